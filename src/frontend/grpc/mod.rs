//! KServe v2 over gRPC (tonic): `inference.GRPCInferenceService` with every RPC and the
//! `grpc.health.v1` health check. Each RPC translates into one engine call; errors carry the
//! gRPC code of the one table in `error`.
use std::{pin::Pin, sync::Arc};

use tokio::sync::mpsc;
use tokio_stream::{Stream, StreamExt, wrappers::ReceiverStream};
use tonic::{Code, Request, Response, Status, Streaming, codec::CompressionEncoding};

use prost::Message;

use services::{health::health_server, inference::grpc_inference_service_server as service};

use super::{guard::RequestTicket, net::Network};
use crate::{
    engine::Engine,
    error::Error,
    proto::{
        health::{HealthCheckRequest, HealthCheckResponse, health_check_response::ServingStatus},
        inference as pb,
    },
    request::{Charge, parse_version},
};

mod admin;
pub mod convert;
pub mod deadline;
mod services;

fn status(e: Error) -> Status {
    Status::new(Code::from_i32(e.grpc_code()), e.message())
}

type Reply<T> = Result<Response<T>, Status>;

#[derive(Clone)]
pub struct Grpc {
    engine: Arc<Engine>,
    /// Requests of one ModelStreamInfer stream in flight at once.
    stream_inflight: usize,
    /// --grpc-header-forward-pattern.
    forward: Option<Arc<regex::Regex>>,
}

/// The inference and health services: requests up to --grpc-max-input-size (also once
/// inflated: tonic counts decompressed bytes against the same limit), replies up to Triton's
/// 2 GiB, gzip/deflate requests accepted.
pub fn services(
    engine: Arc<Engine>,
    limits: &Network,
    forward: Option<regex::Regex>,
) -> (service::GrpcInferenceServiceServer<Grpc>, health_server::HealthServer<Grpc>) {
    let grpc = Grpc { engine, stream_inflight: limits.grpc_stream_max_inflight, forward: forward.map(Arc::new) };
    let inference = service::GrpcInferenceServiceServer::new(grpc.clone())
        .max_decoding_message_size(limits.grpc_max_input_size)
        .max_encoding_message_size(i32::MAX as usize)
        .accept_compressed(CompressionEncoding::Gzip)
        .accept_compressed(CompressionEncoding::Deflate);
    (inference, health_server::HealthServer::new(grpc))
}

impl Grpc {
    async fn infer(&self, req: pb::ModelInferRequest, meta: Meta) -> Result<pb::ModelInferResponse, Error> {
        let mut request = convert::request(req, self.engine.shm())?;
        request.trace_parent = meta.trace;
        request.parameters.extend(meta.forwarded?);
        Ok(convert::response(self.engine.infer(request).await?))
    }

    /// One streamed reply: the response marked final; on failure the error with what identifies
    /// the request.
    async fn stream_reply(
        &self,
        req: pb::ModelInferRequest,
        trace: Meta,
    ) -> Result<pb::ModelStreamInferResponse, (Error, pb::ModelInferResponse)> {
        let failed = failed_reply(&req);
        match self.infer(req, trace).await {
            Ok(mut resp) => {
                let (k, v) = convert::final_flag();
                resp.parameters.insert(k, v);
                Ok(pb::ModelStreamInferResponse { error_message: String::new(), infer_response: Some(resp) })
            }
            Err(e) => Err((e, failed)),
        }
    }
}

impl Grpc {
    /// A decoupled model's request on the stream: each of its responses is a stream message,
    /// `triton_final_response` marking the last (an empty last one is sent only when the request
    /// asked with `triton_enable_empty_final_response`).
    async fn stream_decoupled(&self, req: pb::ModelInferRequest, meta: Meta, grpc_errors: bool, tx: &StreamSender) {
        let failed = failed_reply(&req);
        let empty_final = matches!(
            req.parameters.get("triton_enable_empty_final_response").and_then(|p| p.parameter_choice.as_ref()),
            Some(pb::infer_parameter::ParameterChoice::BoolParam(true))
        );
        let error = |e: Error| {
            if grpc_errors {
                Err(status(e))
            } else {
                Ok(pb::ModelStreamInferResponse {
                    error_message: e.message().to_string(),
                    infer_response: Some(failed.clone()),
                })
            }
        };
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
    /// One request of a stream: its reply, to go out (a decoupled model's responses are sent
    /// as they come, and it gives none).
    async fn stream_request(
        self,
        req: pb::ModelInferRequest,
        meta: Meta,
        ticket: Result<Arc<crate::admission::Ticket>, Error>,
        grpc_errors: bool,
        tx: StreamSender,
    ) -> Option<StreamItem> {
        let outcome = match ticket {
            Err(e) => Err((e, failed_reply(&req))),
            Ok(ticket) => {
                let version = parse_version(&req.model_name, &req.model_version).ok().flatten();
                if self.engine.decoupled(&req.model_name, version) {
                    let run = self.stream_decoupled(req, meta, grpc_errors, &tx);
                    crate::admission::scope(ticket, run).await;
                    return None;
                }
                crate::admission::scope(ticket, self.stream_reply(req, meta)).await
            }
        };
        // Errors travel in-band and the stream goes on, unless the client asked
        // (triton_grpc_error) for the first one to end the stream with its status.
        Some(match outcome {
            Ok(resp) => Ok(resp),
            Err((e, _)) if grpc_errors => Err(status(e)),
            Err((e, failed)) => Ok(pb::ModelStreamInferResponse {
                error_message: e.message().to_string(),
                infer_response: Some(failed),
            }),
        })
    }
}

/// `first`, and every other reply of `running` ready now, in the order their requests came
/// (numbered as read): the replies of one batch are all ready once it ran, and whichever of
/// them was polled first, they go out in the batch's order, as Triton sends them.
async fn ready_together<F>(
    first: Option<(u64, StreamItem)>,
    running: &mut futures_util::stream::FuturesUnordered<F>,
) -> Vec<StreamItem>
where
    F: std::future::Future<Output = Option<(u64, StreamItem)>>,
{
    use futures_util::StreamExt as _;
    let mut ready: Vec<(u64, StreamItem)> = first.into_iter().collect();
    // Polled with this task's own waker, so that one not ready yet still wakes it.
    while let std::task::Poll::Ready(Some(done)) =
        std::future::poll_fn(|cx| std::task::Poll::Ready(running.poll_next_unpin(cx))).await
    {
        ready.extend(done);
    }
    ready.sort_unstable_by_key(|(n, _)| *n);
    ready.into_iter().map(|(_, item)| item).collect()
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

/// What a request's metadata gives the engine: the caller's W3C trace context and the
/// forwarded headers.
#[derive(Clone)]
struct Meta {
    trace: Option<String>,
    /// The forwarded headers, or the error of one whose name is reserved.
    forwarded: Result<Vec<(String, crate::request::ParamValue)>, Error>,
}

impl Default for Meta {
    fn default() -> Self {
        Meta { trace: None, forwarded: Ok(Vec::new()) }
    }
}

impl Grpc {
    fn meta<T>(&self, r: &Request<T>) -> Meta {
        let trace = r.metadata().get("traceparent").and_then(|v| v.to_str().ok()).map(str::to_string);
        let forwarded = match &self.forward {
            None => Ok(Vec::new()),
            // Byte for byte (a value need not be visible ASCII to be forwarded).
            Some(pattern) => r
                .metadata()
                .iter()
                .filter_map(|kv| match kv {
                    tonic::metadata::KeyAndValueRef::Ascii(k, v) if pattern.is_match(k.as_str()) => {
                        Some(crate::request::forwarded_header(k.as_str(), v.as_encoded_bytes()))
                    }
                    _ => None,
                })
                .collect(),
        };
        Meta { trace, forwarded }
    }
}

type InferStream = Pin<Box<dyn Stream<Item = Result<pb::ModelStreamInferResponse, Status>> + Send>>;
/// One message of a `ModelStreamInfer` stream.
type StreamItem = Result<pb::ModelStreamInferResponse, Status>;
/// A `ModelStreamInfer` stream's messages on their way out, each with what it holds charged.
type StreamSender = mpsc::Sender<(StreamItem, Charge)>;

#[tonic::async_trait]
impl service::GrpcInferenceService for Grpc {
    async fn server_live(&self, _: Request<pb::ServerLiveRequest>) -> Reply<pb::ServerLiveResponse> {
        self.engine.live().map_err(status)?;
        Ok(Response::new(pb::ServerLiveResponse { live: true }))
    }

    async fn server_ready(&self, _: Request<pb::ServerReadyRequest>) -> Reply<pb::ServerReadyResponse> {
        Ok(Response::new(pb::ServerReadyResponse { ready: self.engine.ready() }))
    }

    async fn model_ready(&self, r: Request<pb::ModelReadyRequest>) -> Reply<pb::ModelReadyResponse> {
        let r = r.into_inner();
        let version = parse_version(&r.name, &r.version).map_err(status)?;
        self.engine.model_ready(&r.name, version).map_err(status)?;
        Ok(Response::new(pb::ModelReadyResponse { ready: true }))
    }

    async fn server_metadata(&self, _: Request<pb::ServerMetadataRequest>) -> Reply<pb::ServerMetadataResponse> {
        let info = self.engine.server_info();
        Ok(Response::new(pb::ServerMetadataResponse {
            name: info.name.clone(),
            version: info.version.clone(),
            extensions: info.extensions.clone(),
        }))
    }

    async fn model_metadata(&self, r: Request<pb::ModelMetadataRequest>) -> Reply<pb::ModelMetadataResponse> {
        use pb::model_metadata_response::TensorMetadata;
        let r = r.into_inner();
        let version = parse_version(&r.name, &r.version).map_err(status)?;
        let m = self.engine.model_metadata(&r.name, version).map_err(status)?;
        let tensors = |ts: &[crate::engine::TensorMetadata]| {
            ts.iter()
                .map(|t| TensorMetadata {
                    name: t.name.clone(),
                    datatype: t.datatype.wire().into(),
                    shape: t.shape.clone(),
                })
                .collect()
        };
        Ok(Response::new(pb::ModelMetadataResponse {
            name: m.name.clone(),
            versions: m.versions.iter().map(u64::to_string).collect(),
            platform: m.platform.clone(),
            inputs: tensors(&m.inputs),
            outputs: tensors(&m.outputs),
        }))
    }

    async fn model_infer(&self, r: Request<pb::ModelInferRequest>) -> Reply<pb::ModelInferResponse> {
        let meta = self.meta(&r);
        let req = r.into_inner();
        if self.engine.decoupled(&req.model_name, parse_version(&req.model_name, &req.model_version).ok().flatten()) {
            return Err(Status::unimplemented(
                "ModelInfer RPC doesn't support models with decoupled transaction policy",
            ));
        }
        self.infer(req, meta).await.map(Response::new).map_err(status)
    }

    type ModelStreamInferStream = InferStream;

    /// Many requests in flight on one stream (at most --grpc-stream-max-inflight: the next
    /// message is read only when one finishes); each gets one reply, in completion order. One
    /// task drives them all, so the replies of one batch go out in the batch's order, as
    /// Triton's do.
    async fn model_stream_infer(&self, r: Request<Streaming<pb::ModelInferRequest>>) -> Reply<InferStream> {
        let meta = self.meta(&r);
        let grpc_errors =
            r.metadata().get("triton_grpc_error").is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"true"));
        let stream_ticket = r.extensions().get::<RequestTicket>().map(|t| Arc::clone(&t.0));
        let mut inbound = r.into_inner();
        let (tx, rx) = mpsc::channel(self.stream_inflight);
        let this = self.clone();
        tokio::spawn(async move {
            // Each request reaches its model's queue after the one sent before it.
            let mut line = crate::engine::ordering::Line::default();
            let mut running = futures_util::stream::FuturesUnordered::new();
            let (mut reading, mut sent) = (true, 0u64);
            while reading || !running.is_empty() {
                let room = reading && running.len() < this.stream_inflight;
                // A client that leaves the stream cancels its requests (dropped with `running`:
                // out of the queue, or seen by the model as cancelled).
                tokio::select! {
                    biased;
                    () = tx.closed() => return,
                    Some(first) = running.next(), if !running.is_empty() => {
                        // The replies ready together (a batch's) go out in the order their
                        // requests came, whichever was polled first.
                        for item in ready_together(first, &mut running).await {
                            if tx.send((item, Charge::default())).await.is_err() {
                                return;
                            }
                        }
                    }
                    next = inbound.next(), if room => match next {
                        None => reading = false,
                        Some(Err(status)) => return drop(tx.send((Err(status), Charge::default())).await),
                        Some(Ok(req)) => {
                            // The message's bytes move from the stream's ticket to a ticket of
                            // its own, given back when its reply is made.
                            if let Some(t) = &stream_ticket {
                                t.release();
                            }
                            let ticket = this.engine.admission().admit(req.encoded_len() as u64).map(Arc::new);
                            let (n, one) = (sent, this.clone().stream_request(req, meta.clone(), ticket, grpc_errors, tx.clone()));
                            sent += 1;
                            running.push(line.place().run(async move { one.await.map(|item| (n, item)) }));
                        }
                    },
                }
            }
        });
        // A message's charge ends when tonic takes it to encode and send.
        let messages = ReceiverStream::new(rx).map(|(msg, _charge): (_, Charge)| msg);
        Ok(Response::new(Box::pin(messages) as InferStream))
    }

    async fn model_config(&self, r: Request<pb::ModelConfigRequest>) -> Reply<pb::ModelConfigResponse> {
        let r = r.into_inner();
        let version = parse_version(&r.name, &r.version).map_err(status)?;
        let config = self.engine.model_config(&r.name, version).map_err(status)?;
        Ok(Response::new(pb::ModelConfigResponse { config: Some((*config).clone()) }))
    }

    async fn model_statistics(&self, r: Request<pb::ModelStatisticsRequest>) -> Reply<pb::ModelStatisticsResponse> {
        let r = r.into_inner();
        let name = (!r.name.is_empty()).then_some(r.name.as_str());
        let version = parse_version(&r.name, &r.version).map_err(status)?;
        let all = self.engine.statistics(name, version).map_err(status)?;
        Ok(Response::new(pb::ModelStatisticsResponse { model_stats: admin::statistics(&all) }))
    }

    async fn repository_index(&self, r: Request<pb::RepositoryIndexRequest>) -> Reply<pb::RepositoryIndexResponse> {
        let r = r.into_inner();
        if !r.repository_name.is_empty() {
            return Err(status(Error::unsupported("'repository_name' specification is not supported")));
        }
        Ok(Response::new(admin::index(&self.engine.repository().index_fresh(r.ready).await)))
    }

    async fn repository_model_load(
        &self,
        r: Request<pb::RepositoryModelLoadRequest>,
    ) -> Reply<pb::RepositoryModelLoadResponse> {
        let r = r.into_inner();
        if !r.repository_name.is_empty() {
            return Err(status(Error::unsupported("'repository_name' specification is not supported")));
        }
        let req = admin::load_request(r.parameters).map_err(status)?;
        self.engine.repository().load(&r.model_name, req).await.map_err(status)?;
        Ok(Response::new(pb::RepositoryModelLoadResponse {}))
    }

    async fn repository_model_unload(
        &self,
        r: Request<pb::RepositoryModelUnloadRequest>,
    ) -> Reply<pb::RepositoryModelUnloadResponse> {
        let r = r.into_inner();
        if !r.repository_name.is_empty() {
            return Err(status(Error::unsupported("'repository_name' specification is not supported")));
        }
        let dependents = admin::unload_dependents(&r.parameters).map_err(status)?;
        self.engine.repository().unload(&r.model_name, dependents).await.map_err(status)?;
        Ok(Response::new(pb::RepositoryModelUnloadResponse {}))
    }

    async fn system_shared_memory_status(
        &self,
        r: Request<pb::SystemSharedMemoryStatusRequest>,
    ) -> Reply<pb::SystemSharedMemoryStatusResponse> {
        use pb::system_shared_memory_status_response::RegionStatus;
        let name = r.into_inner().name;
        let regions = self.engine.shm().status((!name.is_empty()).then_some(name.as_str())).map_err(status)?;
        let regions = regions
            .into_iter()
            .map(|s| {
                (s.name.clone(), RegionStatus { name: s.name, key: s.key, offset: s.offset, byte_size: s.byte_size })
            })
            .collect();
        Ok(Response::new(pb::SystemSharedMemoryStatusResponse { regions }))
    }

    async fn system_shared_memory_register(
        &self,
        r: Request<pb::SystemSharedMemoryRegisterRequest>,
    ) -> Reply<pb::SystemSharedMemoryRegisterResponse> {
        let r = r.into_inner();
        self.engine.shm().register(&r.name, &r.key, r.offset, r.byte_size).map_err(status)?;
        Ok(Response::new(pb::SystemSharedMemoryRegisterResponse {}))
    }

    async fn system_shared_memory_unregister(
        &self,
        r: Request<pb::SystemSharedMemoryUnregisterRequest>,
    ) -> Reply<pb::SystemSharedMemoryUnregisterResponse> {
        let name = r.into_inner().name;
        self.engine.shm().unregister((!name.is_empty()).then_some(name.as_str())).map_err(status)?;
        Ok(Response::new(pb::SystemSharedMemoryUnregisterResponse {}))
    }

    async fn cuda_shared_memory_status(
        &self,
        r: Request<pb::CudaSharedMemoryStatusRequest>,
    ) -> Reply<pb::CudaSharedMemoryStatusResponse> {
        use pb::cuda_shared_memory_status_response::RegionStatus;
        let name = r.into_inner().name;
        let regions = self.engine.shm().status_cuda((!name.is_empty()).then_some(name.as_str())).map_err(status)?;
        let regions = regions
            .into_iter()
            .map(|s| {
                let byte_size = s.byte_size;
                (s.name.clone(), RegionStatus { name: s.name, device_id: s.device_id.max(0) as u64, byte_size })
            })
            .collect();
        Ok(Response::new(pb::CudaSharedMemoryStatusResponse { regions }))
    }

    async fn cuda_shared_memory_register(
        &self,
        r: Request<pb::CudaSharedMemoryRegisterRequest>,
    ) -> Reply<pb::CudaSharedMemoryRegisterResponse> {
        let r = r.into_inner();
        self.engine.shm().register_cuda(&r.name, &r.raw_handle, r.device_id, r.byte_size).map_err(status)?;
        Ok(Response::new(pb::CudaSharedMemoryRegisterResponse {}))
    }

    async fn cuda_shared_memory_unregister(
        &self,
        r: Request<pb::CudaSharedMemoryUnregisterRequest>,
    ) -> Reply<pb::CudaSharedMemoryUnregisterResponse> {
        let name = r.into_inner().name;
        self.engine.shm().unregister_cuda((!name.is_empty()).then_some(name.as_str())).map_err(status)?;
        Ok(Response::new(pb::CudaSharedMemoryUnregisterResponse {}))
    }

    async fn trace_setting(&self, r: Request<pb::TraceSettingRequest>) -> Reply<pb::TraceSettingResponse> {
        let r = r.into_inner();
        let model = (!r.model_name.is_empty()).then_some(r.model_name.as_str());
        let settings = if r.settings.is_empty() {
            self.engine.trace_settings(model)
        } else {
            admin::trace_update(&r).and_then(|u| self.engine.update_trace_settings(model, u))
        };
        Ok(Response::new(admin::trace_response(&settings.map_err(status)?)))
    }

    async fn log_settings(&self, r: Request<pb::LogSettingsRequest>) -> Reply<pb::LogSettingsResponse> {
        let r = r.into_inner();
        let settings = if r.settings.is_empty() {
            Ok(self.engine.logging().get())
        } else {
            admin::log_update(&r).and_then(|u| self.engine.logging().update(u))
        };
        Ok(Response::new(admin::log_response(&settings.map_err(status)?)))
    }
}

#[tonic::async_trait]
impl health_server::Health for Grpc {
    /// Answers from server readiness, whatever service is named (as Triton).
    async fn check(&self, _: Request<HealthCheckRequest>) -> Reply<HealthCheckResponse> {
        self.engine.live().map_err(status)?;
        let serving = if self.engine.ready() { ServingStatus::Serving } else { ServingStatus::NotServing };
        Ok(Response::new(HealthCheckResponse { status: serving as i32 }))
    }
}
