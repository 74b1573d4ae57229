//! A running Python process and the thread that reads everything it sends: replies to ferry's
//! calls go to the instance thread; a decoupled model's responses (sent during or after
//! `execute`) go to their request's stream; BLS and model-control calls, cancellation checks and
//! log lines are answered on the spot. When the process dies, every open stream gets the error.
use std::{
    collections::HashMap,
    sync::{
        Arc, Mutex,
        atomic::{AtomicU64, Ordering},
        mpsc,
    },
    time::{Duration, Instant},
};

use bytes::Bytes;
use serde_json::{Value, json};

use super::{
    Launch,
    bls::{self, HostCall},
    process::{Message, Process, Writer, read_message},
};
use crate::{
    error::{Error, ErrorKind, Result},
    request::{Context, StreamTx, Streamed},
    tensor::{DataType, Tensor},
};

type Streams = Arc<Mutex<HashMap<u64, StreamTx>>>;

pub struct Link {
    pub process: Process,
    replies: mpsc::Receiver<std::io::Result<Message>>,
    streams: Streams,
    /// The context of the batch running: BLS calls made meanwhile are nested in it.
    pub running: Arc<Mutex<Context>>,
}

/// How often a wait for the process looks at the process itself.
const WATCH: Duration = Duration::from_millis(200);

/// Tensors a message describes, with their bytes in its blobs.
pub fn tensors(meta: &Value, blobs: Vec<Vec<u8>>) -> Result<Vec<Tensor>> {
    meta.as_array()
        .into_iter()
        .flatten()
        .zip(blobs)
        .map(|(o, data)| {
            let datatype = DataType::from_wire(o["datatype"].as_str().unwrap_or_default())
                .ok_or_else(|| Error::internal(format!("output '{}' has a datatype ferry does not know", o["name"])))?;
            Ok(Tensor {
                name: o["name"].as_str().unwrap_or_default().to_string(),
                datatype,
                shape: o["shape"].as_array().into_iter().flatten().filter_map(Value::as_i64).collect(),
                data: Bytes::from(data),
            })
        })
        .collect()
}

impl Link {
    /// Starts reading what `process` sends.
    pub fn new(process: Process, launch: Arc<Launch>) -> Result<Link> {
        let reader = process.reader().map_err(|e| Error::internal(format!("cannot read the Python process: {e}")))?;
        let (tx, replies) = mpsc::channel();
        let streams: Streams = Arc::default();
        let running: Arc<Mutex<Context>> = Arc::default();
        let (writer, shared, context) = (process.writer.clone(), Arc::clone(&streams), Arc::clone(&running));
        std::thread::Builder::new()
            .name(format!("{}-py-reader", launch.model))
            .spawn(move || read_loop(reader, (&launch, &context), &writer, &shared, &tx))
            .map_err(|e| Error::internal(format!("cannot start a reader thread: {e}")))?;
        Ok(Link { process, replies, streams, running })
    }

    /// The process's reply to the call just sent, watching the process itself meanwhile (a
    /// helper it forked may hold its socket open after it died: then the socket never closes).
    /// Past `deadline`: an error of kind TimedOut.
    /// A request of the batch that asks whether its client left (`gone(index)`) is answered.
    pub fn wait(&mut self, deadline: Option<Instant>, gone: &dyn Fn(usize) -> bool) -> std::io::Result<Message> {
        loop {
            match self.replies.recv_timeout(WATCH) {
                Ok(Ok((m, _))) if m["op"] == "cancelled" => {
                    let cancelled = gone(m["index"].as_u64().unwrap_or(u64::MAX) as usize);
                    let reply = json!({"op": "cancelled_result", "seq": m["seq"], "cancelled": cancelled});
                    self.process.writer.send(&reply, &[])?;
                }
                Ok(reply) => return reply,
                Err(mpsc::RecvTimeoutError::Disconnected) => {
                    return Err(std::io::Error::other("the Python process is gone"));
                }
                Err(mpsc::RecvTimeoutError::Timeout) => {}
            }
            if self.process.exited() {
                return Err(std::io::Error::other("the Python process exited"));
            }
            if deadline.is_some_and(|d| Instant::now() >= d) {
                return Err(std::io::Error::new(std::io::ErrorKind::TimedOut, "execute() did not return in time"));
            }
        }
    }

    /// A handle for a request whose responses stream.
    pub fn register(&self, tx: &StreamTx) -> u64 {
        static NEXT: AtomicU64 = AtomicU64::new(1);
        let handle = NEXT.fetch_add(1, Ordering::Relaxed);
        let mut open = self.streams.lock().unwrap_or_else(|p| p.into_inner());
        // Streams whose clients left go: a model that keeps their senders holds nothing by it.
        open.retain(|_, tx| !tx.cancelled());
        open.insert(handle, tx.clone());
        handle
    }

    /// Whether the reader already saw the process go (its socket closed) while no call was out;
    /// a stale reply left over is dropped.
    pub fn gone_while_idle(&self) -> bool {
        match self.replies.try_recv() {
            Ok(Err(_)) | Err(mpsc::TryRecvError::Disconnected) => true,
            Ok(Ok(_)) | Err(mpsc::TryRecvError::Empty) => false,
        }
    }

    /// The process's reply to the call just sent.
    pub fn reply(&self, timeout: Option<Duration>) -> std::io::Result<Message> {
        let got = match timeout {
            None => self.replies.recv().map_err(|_| std::io::Error::other("the Python process is gone")),
            Some(t) => self.replies.recv_timeout(t).map_err(|_| std::io::Error::other("no reply in time")),
        };
        got?
    }
}

fn read_loop(
    reader: std::os::unix::net::UnixStream,
    (launch, running): (&Launch, &Mutex<Context>),
    writer: &Writer,
    streams: &Streams,
    replies: &mpsc::Sender<std::io::Result<Message>>,
) {
    let model = &launch.model;
    let mut reader = std::io::BufReader::with_capacity(1 << 16, reader);
    let cancels = bls::Cancels::default();
    loop {
        let (msg, blobs) = match read_message(&mut reader) {
            Ok(m) => m,
            Err(e) => {
                let open: Vec<StreamTx> =
                    streams.lock().unwrap_or_else(|p| p.into_inner()).drain().map(|(_, tx)| tx).collect();
                for tx in open {
                    let why = format!("model '{model}': the Python process stopped before its final response");
                    let _ = tx.send(Err(Error::unavailable(why)));
                }
                let _ = replies.send(Err(e));
                return;
            }
        };
        match msg["op"].as_str() {
            Some("done") => {
                let _ = replies.send(Ok((msg, blobs)));
            }
            Some("log") => bls::log(model, &msg),
            Some("infer") => {
                let context = running.lock().unwrap_or_else(|p| p.into_inner()).nested();
                let call = if msg["decoupled"].as_bool() == Some(true) {
                    let cancel = cancels.open(msg["seq"].as_u64().unwrap_or(0));
                    HostCall::Stream(msg, blobs, context, cancel)
                } else {
                    HostCall::Infer(msg, blobs, context)
                };
                launch.host_call(call, writer.clone());
            }
            Some("cancel_infer") => cancels.cancel(msg["seq"].as_u64().unwrap_or(0)),
            Some("control") => launch.host_call(HostCall::Control(msg), writer.clone()),
            Some("response") => stream_response(model, streams, &msg, blobs),
            // A request of the running batch that has no stream: its instance thread knows.
            Some("cancelled") if msg.get("index").is_some() => _ = replies.send(Ok((msg, blobs))),
            Some("cancelled") => {
                let handle = msg["handle"].as_u64().unwrap_or(0);
                let gone =
                    streams.lock().unwrap_or_else(|p| p.into_inner()).get(&handle).is_none_or(StreamTx::cancelled);
                let _ = writer.send(&json!({"op": "cancelled_result", "seq": msg["seq"], "cancelled": gone}), &[]);
            }
            other => tracing::warn!(model = %model, op = ?other, "unexpected message from the Python process"),
        }
    }
}

/// A response's error as the model set it (`TritonError` and its code, INTERNAL by default).
pub fn error_of(e: &Value) -> Error {
    let message = e["message"].as_str().unwrap_or("the model reported an error").to_string();
    let kind = match e["code"].as_u64() {
        Some(0) => ErrorKind::Unknown,
        Some(2) => ErrorKind::NotFound,
        Some(3) => ErrorKind::InvalidArgument,
        Some(4) => ErrorKind::Unavailable,
        Some(5) => ErrorKind::Unsupported,
        Some(6) => ErrorKind::AlreadyExists,
        Some(7) => ErrorKind::Cancelled,
        _ => ErrorKind::Internal,
    };
    Error::new(kind, message)
}

/// A decoupled model's response: to its request's stream; the final one closes it.
fn stream_response(model: &str, streams: &Streams, msg: &Value, blobs: Vec<Vec<u8>>) {
    let handle = msg["handle"].as_u64().unwrap_or(0);
    let last = msg["final"].as_bool().unwrap_or(false);
    let tx = {
        let mut open = streams.lock().unwrap_or_else(|p| p.into_inner());
        if last { open.remove(&handle) } else { open.get(&handle).cloned() }
    };
    let Some(tx) = tx else {
        tracing::debug!(model, handle, "a response for a request that is over (the client left)");
        return;
    };
    let item = match &msg["error"] {
        Value::Null => tensors(&msg["outputs"], blobs).map(|outputs| Streamed {
            outputs,
            parameters: bls::params_of(&msg["parameters"]),
            last,
        }),
        e => Err(error_of(e)),
    };
    // A client that left (or fell too far behind) cannot be told; the model sees it through
    // is_cancelled(), and what it sends after is dropped here.
    let failed = msg["error"] != Value::Null;
    let sent = tx.send(item) && (!last || !failed || tx.send(Ok(Streamed::end())));
    if !sent {
        streams.lock().unwrap_or_else(|p| p.into_inner()).remove(&handle);
    }
}
