//! What a Python process asks of ferry while it runs: BLS inference on any model (an ordinary
//! engine call, run on the async runtime so that several `async_exec` calls overlap), model
//! control, and log lines into ferry's log.
use std::sync::Arc;

use bytes::Bytes;
use serde_json::{Value, json};

use super::process::Writer;
use crate::{
    backend::Host,
    error::{Error, Result},
    request::{InferRequest, InferResponse, InputTensor, ParamValue, Parameters, RequestedOutput},
    tensor::DataType,
};

pub enum HostCall {
    /// A BLS request, with the context of the batch that made it.
    Infer(Value, Vec<Vec<u8>>, crate::request::Context),
    /// A BLS request whose responses stream back (`exec(decoupled=True)`), until the process
    /// cancels it through `cancel`.
    Stream(Value, Vec<Vec<u8>>, crate::request::Context, Cancel),
    Control(Value),
}

/// The BLS streams a process has open, by the call's sequence number: cancelling one drops
/// its responses, so the model it calls sees the request cancelled.
#[derive(Clone, Default)]
pub struct Cancels(Arc<std::sync::Mutex<std::collections::HashMap<u64, tokio::sync::oneshot::Sender<()>>>>);

/// What a streaming BLS call waits on besides its responses; it leaves `Cancels` when done.
pub struct Cancel {
    seq: u64,
    rx: tokio::sync::oneshot::Receiver<()>,
    all: Cancels,
}

impl Cancels {
    pub fn open(&self, seq: u64) -> Cancel {
        let (tx, rx) = tokio::sync::oneshot::channel();
        self.0.lock().unwrap_or_else(|p| p.into_inner()).insert(seq, tx);
        Cancel { seq, rx, all: self.clone() }
    }

    pub fn cancel(&self, seq: u64) {
        if let Some(tx) = self.0.lock().unwrap_or_else(|p| p.into_inner()).remove(&seq) {
            let _ = tx.send(());
        }
    }
}

impl Drop for Cancel {
    fn drop(&mut self) {
        self.all.0.lock().unwrap_or_else(|p| p.into_inner()).remove(&self.seq);
    }
}

pub fn log(model: &str, msg: &Value) {
    let text = msg["message"].as_str().unwrap_or_default();
    match msg["level"].as_str() {
        Some("ERROR") => tracing::error!(model, "{text}"),
        Some("WARN") => tracing::warn!(model, "{text}"),
        Some("VERBOSE") => tracing::debug!(model, "{text}"),
        _ => tracing::info!(model, "{text}"),
    }
}

pub fn param_json(v: &ParamValue) -> Value {
    match v {
        ParamValue::Bool(b) => json!(b),
        ParamValue::Int(i) => json!(i),
        ParamValue::Uint(u) => json!(u),
        ParamValue::Double(d) => json!(d),
        ParamValue::String(s) => json!(s),
    }
}

pub fn params_of(v: &Value) -> Parameters {
    v.as_object()
        .into_iter()
        .flatten()
        .filter_map(|(k, v)| {
            let p = match v {
                Value::Bool(b) => ParamValue::Bool(*b),
                Value::String(s) => ParamValue::String(s.clone()),
                Value::Number(n) => match (n.as_i64(), n.as_u64(), n.as_f64()) {
                    (Some(i), _, _) => ParamValue::Int(i),
                    (None, Some(u), _) => ParamValue::Uint(u),
                    (_, _, Some(f)) => ParamValue::Double(f),
                    _ => return None,
                },
                _ => return None,
            };
            Some((k.clone(), p))
        })
        .collect()
}

/// The engine request a BLS call describes.
fn bls_request(msg: &Value, blobs: Vec<Vec<u8>>) -> Result<InferRequest> {
    let r = &msg["request"];
    let inputs = r["inputs"]
        .as_array()
        .into_iter()
        .flatten()
        .zip(blobs)
        .map(|(t, data)| {
            let datatype = DataType::from_wire(t["datatype"].as_str().unwrap_or_default())
                .ok_or_else(|| Error::invalid(format!("BLS input '{}' has an unknown datatype", t["name"])))?;
            Ok(InputTensor::host(
                t["name"].as_str().unwrap_or_default().to_string(),
                datatype,
                t["shape"].as_array().into_iter().flatten().filter_map(Value::as_i64).collect(),
                Bytes::from(data),
            ))
        })
        .collect::<Result<Vec<_>>>()?;
    let mut parameters = params_of(&r["parameters"]);
    if let Some(t) = r["timeout"].as_u64().filter(|&t| t > 0) {
        parameters.insert("timeout".into(), ParamValue::Uint(t));
    }
    Ok(InferRequest {
        model_name: r["model_name"].as_str().unwrap_or_default().to_string(),
        model_version: r["model_version"].as_i64().filter(|&v| v >= 0).map(|v| v as u64),
        id: r["id"].as_str().unwrap_or_default().to_string(),
        parameters,
        inputs,
        outputs: r["requested_output_names"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(Value::as_str)
            .map(|n| RequestedOutput { name: n.to_string(), ..Default::default() })
            .collect(),
        trace_parent: None,
        context: Default::default(),
    })
}

fn error_json(e: &Error) -> Value {
    let code = match e.kind() {
        crate::error::ErrorKind::NotFound => 2,
        crate::error::ErrorKind::InvalidArgument => 3,
        crate::error::ErrorKind::Unavailable | crate::error::ErrorKind::Overloaded => 4,
        crate::error::ErrorKind::Unsupported => 5,
        crate::error::ErrorKind::AlreadyExists => 6,
        crate::error::ErrorKind::Cancelled => 7,
        crate::error::ErrorKind::Unknown => 0,
        _ => 1,
    };
    json!({"message": e.message(), "code": code})
}

/// Writes to the process off the runtime's workers: a process that does not read its socket
/// for a while (busy in `execute`) blocks a thread of the blocking pool, never the server.
async fn send_off_runtime(writer: &Writer, msg: Value, blobs: Vec<Bytes>) -> bool {
    let writer = writer.clone();
    let sent = tokio::task::spawn_blocking(move || {
        let blobs: Vec<&[u8]> = blobs.iter().map(|b| &b[..]).collect();
        writer.send(&msg, &blobs)
    })
    .await;
    match sent {
        Ok(Ok(())) => true,
        Ok(Err(e)) => {
            tracing::debug!(error = %e, "cannot answer a BLS call (the process is gone)");
            false
        }
        Err(_) => false,
    }
}

/// Answers a BLS call; `more`: further responses of the same call follow.
async fn infer_reply(seq: &Value, outcome: Result<InferResponse>, writer: &Writer, more: bool) -> bool {
    let (msg, blobs) = match outcome {
        Ok(resp) => {
            let meta: Vec<Value> = resp
                .outputs
                .iter()
                .map(|t| json!({"name": t.name, "datatype": t.datatype.wire(), "shape": t.shape}))
                .collect();
            let parameters: serde_json::Map<String, Value> =
                resp.parameters.iter().map(|(k, v)| (k.clone(), param_json(v))).collect();
            let blobs = resp.outputs.into_iter().map(|t| t.data).collect();
            (json!({"op": "infer_result", "seq": seq, "outputs": meta, "parameters": parameters, "more": more}), blobs)
        }
        Err(e) => (json!({"op": "infer_result", "seq": seq, "error": error_json(&e)}), Vec::new()),
    };
    send_off_runtime(writer, msg, blobs).await
}

/// Forwards a streaming BLS call's responses, each as it comes, the last marked; a cancel from
/// the process drops the stream (the called model sees its request cancelled) and ends the
/// call with a CANCELLED error.
async fn forward_stream(seq: &Value, mut stream: crate::request::ResponseStream, mut cancel: Cancel, writer: &Writer) {
    loop {
        tokio::select! {
            _ = &mut cancel.rx => {
                drop(stream);
                let e = Error::new(crate::error::ErrorKind::Cancelled, "the BLS request was cancelled");
                infer_reply(seq, Err(e), writer, false).await;
                return;
            }
            item = stream.recv() => {
                let (outcome, more) = match item {
                    Some(Ok(item)) => (Ok(item.response), !item.last),
                    Some(Err(e)) => (Err(e), false),
                    None => (Err(Error::internal("the BLS stream ended before its final response")), false),
                };
                if !infer_reply(seq, outcome, writer, more).await || !more {
                    return;
                }
            }
        }
    }
}

/// A BLS request, unless it calls the one busy instance of the model making it.
fn checked(req: Result<InferRequest>, alone: Option<&str>) -> Result<InferRequest> {
    match req {
        Ok(req) if alone == Some(req.model_name.as_str()) => Err(Error::invalid(format!(
            "model '{}' runs one instance, which is busy with the request that makes this BLS call: a call to \
             itself would wait for itself for ever (give it more instances)",
            req.model_name
        ))),
        other => other,
    }
}

/// Runs a call on the runtime and answers the process when it is done.
/// `alone`: the calling model, when it runs a single instance (a BLS call to itself would wait
/// for the very instance that makes it).
pub fn serve(
    call: HostCall,
    (host, alone): (Option<Arc<dyn Host>>, Option<&str>),
    runtime: &tokio::runtime::Handle,
    writer: Writer,
) {
    let alone = alone.map(str::to_string);
    runtime.spawn(async move {
        let Some(host) = host else {
            let e = Error::unavailable("the server is not running");
            let msg = json!({"op": "infer_result", "seq": Value::Null, "error": error_json(&e)});
            send_off_runtime(&writer, msg, Vec::new()).await;
            return;
        };
        match call {
            HostCall::Infer(msg, blobs, context) => {
                let outcome = match checked(bls_request(&msg, blobs), alone.as_deref()) {
                    Ok(req) => host.infer(crate::request::InferRequest { context, ..req }).await,
                    Err(e) => Err(e),
                };
                infer_reply(&msg["seq"], outcome, &writer, false).await;
            }
            HostCall::Stream(msg, blobs, context, cancel) => {
                let stream = match checked(bls_request(&msg, blobs), alone.as_deref()) {
                    Ok(req) => host.infer_stream(crate::request::InferRequest { context, ..req }).await,
                    Err(e) => Err(e),
                };
                match stream {
                    Ok(stream) => forward_stream(&msg["seq"], stream, cancel, &writer).await,
                    Err(e) => _ = infer_reply(&msg["seq"], Err(e), &writer, false).await,
                }
            }
            HostCall::Control(msg) => {
                let name = msg["model_name"].as_str().unwrap_or_default().to_string();
                let outcome: Result<Value> = match msg["call"].as_str() {
                    Some("load_model") => {
                        let config = msg["config"].as_str().filter(|c| !c.is_empty()).map(str::to_string);
                        let files = msg["files"]
                            .as_object()
                            .into_iter()
                            .flatten()
                            .map(|(k, v)| {
                                let bytes =
                                    v.as_array().into_iter().flatten().filter_map(|b| b.as_u64()).map(|b| b as u8);
                                (k.trim_start_matches("file:").to_string(), bytes.collect())
                            })
                            .collect();
                        host.load(name, config, files).await.map(|()| json!({}))
                    }
                    Some("unload_model") => host.unload(name).await.map(|()| json!({})),
                    Some("is_model_ready") => {
                        let version = msg["model_version"].as_str().and_then(|v| v.parse().ok());
                        Ok(json!({"ready": host.ready(&name, version)}))
                    }
                    other => Err(Error::invalid(format!("unknown model control call {other:?}"))),
                };
                let mut reply = match outcome {
                    Ok(v) => v,
                    Err(e) => json!({"error": e.message()}),
                };
                reply["op"] = json!("control_result");
                reply["seq"] = msg["seq"].clone();
                send_off_runtime(&writer, reply, Vec::new()).await;
            }
        }
    });
}
