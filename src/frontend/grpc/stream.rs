//! `ModelStreamInfer`: many requests in flight on one stream (at most
//! --grpc-stream-max-inflight: the next message is read only when one finishes). One task drives
//! them all; each gets one reply (a decoupled model's request, its responses), in completion
//! order, and the replies of one batch in the batch's order, as Triton sends them.
use std::{panic::AssertUnwindSafe, pin::Pin, sync::Arc};

use futures_util::{FutureExt as _, stream::FuturesUnordered};

use prost::Message;
use tokio_stream::{Stream, StreamExt};
use tonic::{Request, Status, Streaming};

use super::{
    Grpc, Meta, convert,
    outbox::{Outbox, StreamItem, StreamSender},
    status,
};
use crate::{
    error::Error,
    frontend::guard::RequestTicket,
    proto::inference as pb,
    request::{Charge, parse_version},
};

pub(super) type InferStream = Pin<Box<dyn Stream<Item = Result<pb::ModelStreamInferResponse, Status>> + Send>>;

impl Grpc {
    /// The stream's replies, as the requests that `r` brings are answered.
    pub(super) fn open_stream(&self, r: Request<Streaming<pb::ModelInferRequest>>) -> InferStream {
        let meta = self.meta(&r);
        let grpc_errors =
            r.metadata().get("triton_grpc_error").is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"true"));
        let stream_ticket = r.extensions().get::<RequestTicket>().map(|t| Arc::clone(&t.0));
        let mut inbound = r.into_inner();
        let holder = self.engine.admission().holder();
        let (mut outbox, tx, messages) = Outbox::new(holder, self.stream_inflight, self.stream_stall);
        let this = self.clone();
        tokio::spawn(async move {
            // Each request reaches its model's queue after the one sent before it.
            let mut line = crate::engine::ordering::Line::default();
            // Requests with one reply each, and decoupled models' requests (which send their
            // own responses, under tokio's budget: they may stream for long).
            let (mut running, mut streaming) = (FuturesUnordered::new(), FuturesUnordered::new());
            // The requests in flight keep being polled while their replies wait in the outbox,
            // so a client that stops reading holds only its replies: the requests' own work
            // (sequence slots, the cache, their tickets) ends as ever.
            let (mut reading, mut sent) = (true, 0u64);
            let mut look = tokio::time::interval_at(tokio::time::Instant::now() + outbox.stall, outbox.stall);
            while reading || !running.is_empty() || !streaming.is_empty() || !outbox.waiting.is_empty() {
                // Requests in flight and replies waiting here stay within
                // --grpc-stream-max-inflight (the channel to the connection holds as many again).
                let held = running.len() + streaming.len() + outbox.waiting.len();
                let room = reading && held < this.stream_inflight;
                // A client that leaves the stream cancels its requests (dropped with `running`:
                // out of the queue, or seen by the model as cancelled).
                tokio::select! {
                    biased;
                    () = tx.closed() => return,
                    permit = tx.reserve(), if !outbox.waiting.is_empty() => {
                        let (Ok(permit), Some(reply)) = (permit, outbox.waiting.pop_front()) else { return };
                        let ends = reply.0.is_err();
                        permit.send(reply);
                        if ends {
                            // An error status ends the gRPC stream: what is still running is
                            // cancelled.
                            return;
                        }
                    }
                    // The replies ready together (a batch's) go out in the order their requests
                    // came, whichever was polled first.
                    // Polled outside tokio's budget: a reply ready but refused a poll by the
                    // budget would come back after later ones.
                    Some(first) = tokio::task::unconstrained(running.next()), if !running.is_empty() => {
                        for item in ready_together(first, &mut running).await {
                            outbox.push(item);
                        }
                    }
                    Some(done) = streaming.next(), if !streaming.is_empty() => {
                        let done: Option<(u64, StreamItem)> = done;
                        if let Some((_, item)) = done {
                            outbox.push(item);
                        }
                    }
                    _ = look.tick() => if outbox.stalled() {
                        return stalled(&mut outbox);
                    },
                    next = inbound.next(), if room => match next {
                        None => reading = false,
                        Some(Err(status)) => {
                            reading = false;
                            outbox.push(Err(status));
                        }
                        Some(Ok(req)) => {
                            // The message's bytes move from the stream's ticket to a ticket of
                            // its own, given back when its reply is made.
                            if let Some(t) = &stream_ticket {
                                t.release();
                            }
                            let ticket = this.engine.admission().admit(req.encoded_len() as u64).map(Arc::new);
                            let version = parse_version(&req.model_name, &req.model_version).ok().flatten();
                            let decoupled = ticket.is_ok() && this.engine.decoupled(&req.model_name, version);
                            let n = sent;
                            sent += 1;
                            let one = this.clone().stream_one(n, req, (meta.clone(), grpc_errors), ticket, decoupled, tx.clone());
                            let one = line.place().run(one);
                            if decoupled { streaming.push(one) } else { running.push(one) }
                        }
                    },
                }
            }
            // All is answered; the stream ends once tonic has sent what the channel holds. A
            // client that has sent all it had and reads nothing must not hold that for ever. The
            // stream's own ticket goes now: it is no longer a request in flight.
            drop((tx, stream_ticket, inbound, this));
            while outbox.in_channel() {
                look.tick().await;
                if outbox.stalled() {
                    return stalled(&mut outbox);
                }
            }
        });
        Box::pin(messages)
    }

    /// One streamed reply: the response marked final.
    async fn stream_reply(
        &self,
        req: pb::ModelInferRequest,
        trace: Meta,
    ) -> Result<pb::ModelStreamInferResponse, Error> {
        let mut resp = self.infer(req, trace).await?;
        let (k, v) = convert::final_flag();
        resp.parameters.insert(k, v);
        Ok(pb::ModelStreamInferResponse { error_message: String::new(), infer_response: Some(resp) })
    }
}

impl Grpc {
    /// A decoupled model's request on the stream: each of its responses is a stream message,
    /// `triton_final_response` marking the last (an empty last one is sent only when the request
    /// asked with `triton_enable_empty_final_response`).
    async fn stream_decoupled(
        &self,
        req: pb::ModelInferRequest,
        (meta, grpc_errors): (Meta, bool),
        failed: &pb::ModelInferResponse,
        tx: &StreamSender,
    ) {
        let empty_final = matches!(
            req.parameters.get("triton_enable_empty_final_response").and_then(|p| p.parameter_choice.as_ref()),
            Some(pb::infer_parameter::ParameterChoice::BoolParam(true))
        );
        let error = |e: Error| error_item(e, failed.clone(), grpc_errors);
        let request = convert::request(req, self.engine.shm()).and_then(|mut r| {
            r.trace_parent = meta.trace;
            r.parameters.extend(meta.forwarded?);
            Ok(r)
        });
        let mut responses = match request {
            Ok(r) => match self.engine.infer_stream(r).await {
                Ok(rx) => rx,
                Err(e) => return drop(tx.send((error(e), Charge::default())).await),
            },
            Err(e) => return drop(tx.send((error(e), Charge::default())).await),
        };
        loop {
            // A client that left ends the request here (the model sees it cancelled), even while
            // the model sends nothing.
            let item = tokio::select! {
                item = responses.recv() => match item {
                    Some(item) => item,
                    None => return,
                },
                () = tx.closed() => return,
            };
            // The response stays charged until the connection takes its message.
            let (msg, charge) = match item {
                Ok(it) if it.last && it.response.outputs.is_empty() && !empty_final => continue,
                Ok(it) => {
                    let mut resp = convert::response(it.response);
                    let (k, v) = convert::final_param(it.last);
                    resp.parameters.insert(k, v);
                    let msg = pb::ModelStreamInferResponse { error_message: String::new(), infer_response: Some(resp) };
                    (Ok(msg), it.charge)
                }
                Err(e) => (error(e), Charge::default()),
            };
            if tx.send((msg, charge)).await.is_err() {
                return;
            }
        }
    }
}

impl Grpc {
    /// Request `n` of a stream (numbered as read), to its reply. One that panics is answered
    /// with an error; the stream and its other requests go on.
    async fn stream_one(
        self,
        n: u64,
        req: pb::ModelInferRequest,
        (meta, grpc_errors): (Meta, bool),
        ticket: Result<Arc<crate::admission::Ticket>, Error>,
        decoupled: bool,
        tx: StreamSender,
    ) -> Option<(u64, StreamItem)> {
        let failed = failed_reply(&req);
        let run = self.stream_request(req, (meta, grpc_errors), ticket, decoupled, &failed, tx);
        let outcome = AssertUnwindSafe(run).catch_unwind().await.unwrap_or_else(|_| {
            Some(Err(Error::internal("the request failed unexpectedly (a panic; see the server log)")))
        });
        Some((n, outcome?.unwrap_or_else(|e| error_item(e, failed, grpc_errors))))
    }

    /// One request of a stream: its reply, to go out (a decoupled model's responses are sent
    /// as they come, and it gives none).
    async fn stream_request(
        self,
        req: pb::ModelInferRequest,
        (meta, grpc_errors): (Meta, bool),
        ticket: Result<Arc<crate::admission::Ticket>, Error>,
        decoupled: bool,
        failed: &pb::ModelInferResponse,
        tx: StreamSender,
    ) -> Option<Result<StreamItem, Error>> {
        let ticket = match ticket {
            Ok(t) => t,
            Err(e) => return Some(Err(e)),
        };
        if decoupled {
            crate::admission::scope(ticket, self.stream_decoupled(req, (meta, grpc_errors), failed, &tx)).await;
            return None;
        }
        Some(crate::admission::scope(ticket, self.stream_reply(req, meta)).await.map(Ok))
    }
}

/// Ends a stream whose client takes no reply (see `Outbox::stalled`).
fn stalled(outbox: &mut Outbox) {
    let dropped = outbox.end_stalled();
    tracing::warn!(dropped, "a gRPC stream's client took none of its replies for the stall timeout: stream ended");
}

/// `first`, and every other reply of `running` ready now, in the order their requests came
/// (numbered as read): the replies of one batch are all ready once it ran, and whichever of
/// them was polled first, they go out in the batch's order, as Triton sends them.
async fn ready_together<F>(first: Option<(u64, StreamItem)>, running: &mut FuturesUnordered<F>) -> Vec<StreamItem>
where
    F: std::future::Future<Output = Option<(u64, StreamItem)>>,
{
    use futures_util::StreamExt as _;
    let mut ready: Vec<(u64, StreamItem)> = first.into_iter().collect();
    // Polled with this task's own waker, so that one not ready yet still wakes it.
    while let std::task::Poll::Ready(Some(done)) =
        tokio::task::unconstrained(std::future::poll_fn(|cx| std::task::Poll::Ready(running.poll_next_unpin(cx)))).await
    {
        ready.extend(done);
    }
    ready.sort_unstable_by_key(|(n, _)| *n);
    ready.into_iter().map(|(_, item)| item).collect()
}

/// A request's error on the stream: in-band and the stream goes on, unless the client asked
/// (triton_grpc_error) for the first one to end the stream with its status.
fn error_item(e: Error, failed: pb::ModelInferResponse, grpc_errors: bool) -> StreamItem {
    if grpc_errors {
        Err(status(e))
    } else {
        Ok(pb::ModelStreamInferResponse { error_message: e.message().to_string(), infer_response: Some(failed) })
    }
}

/// What identifies a request in its error reply on a stream.
fn failed_reply(req: &pb::ModelInferRequest) -> pb::ModelInferResponse {
    pb::ModelInferResponse {
        id: req.id.clone(),
        model_name: req.model_name.clone(),
        model_version: req.model_version.clone(),
        ..Default::default()
    }
}
