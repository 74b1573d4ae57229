//! Response streams: what a decoupled model sends for one request (0..n responses, the last
//! marked), as one stream that the gRPC `ModelStreamInfer` and the HTTP `generate_stream`
//! front-ends encode their own way. A model that is not decoupled gives a stream of one. The
//! client leaving (the stream dropped) stops the forwarding, and the model sees the request
//! cancelled.
use std::time::Instant;

use tokio::sync::mpsc;

use super::Engine;
use crate::{
    error::{Error, Result},
    request::{Charge, InferRequest, InferResponse, STREAM_BACKLOG, STREAM_BACKLOG_BYTES, StreamTx, Streamed},
    stats::ResponseOutcome,
    validate::{ValidatedRequest, validate},
};

pub use crate::request::{ResponseStream, StreamItem};

/// Responses handed to the front-end ahead of what it has sent (the rest wait, bounded, in the
/// model's stream: see `StreamTx`).
const AHEAD: usize = 4;

impl Engine {
    /// Whether the model answers through streams only (`model_transaction_policy.decoupled`).
    pub fn decoupled(&self, name: &str, version: Option<u64>) -> bool {
        self.registry().resolve(name, version).is_ok_and(|m| is_decoupled(&m.config))
    }

    /// Runs a request whose responses stream.
    pub async fn infer_stream(&self, req: InferRequest) -> Result<ResponseStream> {
        let (out, rx) = mpsc::channel(AHEAD);
        let model = self.registry().resolve_in(req.context.namespace, &req.model_name, req.model_version)?;
        if !is_decoupled(&model.config) {
            let one =
                self.infer(req).await.map(|response| StreamItem { response, last: true, charge: Charge::default() });
            let _ = out.try_send(one);
            return Ok(rx);
        }
        if crate::admission::arrived_after_stop() {
            self.live()?;
        }
        let started = Instant::now();
        let crate::model::Runner::Scheduler(scheduler) = &model.runner else {
            return Err(Error::unsupported(format!("model '{}' cannot stream", model.name)));
        };
        let mut req = req;
        if req.context.ticket.is_none() {
            req.context.ticket = crate::admission::current_ticket();
        }
        let (tx, mut responses) = StreamTx::channel(req.context.ticket.clone());
        super::host_inputs(&mut req, false)?;
        let validated = match validate(&model.name, &model.schema, req) {
            Ok(v) => ValidatedRequest { stream: Some(tx), ..v },
            Err(e) => {
                model.stats.record_failure(started.elapsed(), e.origin());
                return Err(e);
            }
        };
        let id = validated.id.clone();
        let wanted: Vec<usize> = validated.outputs.iter().map(|o| o.index).collect();
        let Ok(mut taken) = scheduler.submit(validated) else {
            return Err(Error::unavailable(format!("model '{}' is unloading", model.name)));
        };
        super::ordering::queued();
        tokio::spawn(async move {
            let (name, version) = (model.name.clone(), model.version);
            let item = |s: Streamed, charge: Charge| StreamItem {
                response: InferResponse {
                    model_name: name.clone(),
                    model_version: version,
                    id: id.clone(),
                    parameters: s.parameters,
                    outputs: s.outputs,
                },
                last: s.last,
                charge,
            };
            let mut accepted = false;
            // Response statistics: the index of the next response and when the previous one left.
            let (mut index, mut previous) = (0u64, started);
            let mut respond = |outcome: ResponseOutcome, handed: Instant| {
                let now = Instant::now();
                model.stats.record_response(index, outcome, handed - previous, now - handed);
                (index, previous) = (index + 1, now);
            };
            let outcome: Result<()> = loop {
                tokio::select! {
                    reply = &mut taken, if !accepted => match reply {
                        Ok(Ok(_)) => accepted = true,
                        Ok(Err(e)) => break Err(e),
                        Err(_) => break Err(Error::internal(format!("model '{name}': the instance failed"))),
                    },
                    next = responses.recv() => match next.map(|(r, c)| (r.and_then(|s| checked(&model, &wanted, s)), c)) {
                        Some((Ok(s), charge)) => {
                            let (handed, last) = (Instant::now(), s.last);
                            let kind = if s.outputs.is_empty() && last { ResponseOutcome::Empty } else { ResponseOutcome::Success };
                            if out.send(Ok(item(s, charge))).await.is_err() {
                                respond(ResponseOutcome::Cancel, handed);
                                break Err(Error::new(crate::error::ErrorKind::Cancelled, "the client left"));
                            }
                            respond(kind, handed);
                            if last {
                                break Ok(());
                            }
                        }
                        Some((Err(e), _)) => {
                            let handed = Instant::now();
                            let gone = out.send(Err(e)).await.is_err();
                            respond(if gone { ResponseOutcome::Cancel } else { ResponseOutcome::Fail }, handed);
                            if gone {
                                break Ok(());
                            }
                        }
                        None if responses.fell_behind() => break Err(Error::new(
                            crate::error::ErrorKind::Overloaded,
                            format!(
                                "model '{name}': the client fell behind by {STREAM_BACKLOG} responses or \
                                 {STREAM_BACKLOG_BYTES} bytes; the stream was ended and the model told the request is cancelled"
                            ),
                        )),
                        // Every sender gone before the model took the request: its reply
                        // says why (a process that died while it waited).
                        None if !accepted => break match (&mut taken).await {
                            Ok(Err(e)) => Err(e),
                            Ok(Ok(_)) => Err(Error::internal(format!("model '{name}' ended the request without a response"))),
                            Err(_) => Err(Error::internal(format!("model '{name}': the instance failed"))),
                        },
                        None => break Ok(()),
                    },
                    () = out.closed() => {
                        respond(ResponseOutcome::Cancel, Instant::now());
                        break Err(Error::new(crate::error::ErrorKind::Cancelled, "the client left"));
                    }
                }
            };
            match outcome {
                Ok(()) => model.stats.record_success(started.elapsed()),
                Err(e) => {
                    model.stats.record_failure(started.elapsed(), e.origin());
                    let _ = out.send(Err(e)).await;
                }
            }
        });
        Ok(rx)
    }
}

/// A streamed response as the client gets it: the outputs it asked for (all, when it named
/// none), each checked against the config as a batch's outputs are.
fn checked(model: &crate::model::ModelVersion, wanted: &[usize], mut s: Streamed) -> Result<Streamed> {
    let schema = &model.schema;
    let mut kept = Vec::with_capacity(s.outputs.len());
    for t in s.outputs {
        let Some(index) = schema.output_index(&t.name) else {
            return Err(Error::internal(format!(
                "model '{}' sent an output '{}', which its config does not have",
                model.name, t.name
            )));
        };
        if wanted.contains(&index) {
            schema.check_output(&model.name, index, &t)?;
            kept.push(t);
        }
    }
    s.outputs = kept;
    Ok(s)
}

fn is_decoupled(config: &crate::proto::inference::ModelConfig) -> bool {
    config.model_transaction_policy.as_ref().is_some_and(|p| p.decoupled)
}
