//! KServe v2 over gRPC (tonic): `inference.GRPCInferenceService` with every RPC and the
//! `grpc.health.v1` health check. Each RPC translates into one engine call; errors carry the
//! gRPC code of the one table in `error`.
use std::sync::Arc;

use tonic::{Code, Request, Response, Status, Streaming, codec::CompressionEncoding};

use services::{health::health_server, inference::grpc_inference_service_server as service};

use super::net::Network;
use crate::{
    engine::Engine,
    error::Error,
    proto::{
        health::{HealthCheckRequest, HealthCheckResponse, health_check_response::ServingStatus},
        inference as pb,
    },
    request::parse_version,
};

mod admin;
pub mod convert;
pub mod deadline;
mod outbox;
mod services;
mod stream;

fn status(e: Error) -> Status {
    Status::new(Code::from_i32(e.grpc_code()), e.message())
}

type Reply<T> = Result<Response<T>, Status>;

#[derive(Clone)]
pub struct Grpc {
    engine: Arc<Engine>,
    /// Requests of one ModelStreamInfer stream in flight at once.
    stream_inflight: usize,
    /// How long a stream's replies may wait for a client that takes none of them.
    stream_stall: std::time::Duration,
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
    let grpc = Grpc {
        engine,
        stream_inflight: limits.grpc_stream_max_inflight,
        stream_stall: limits.grpc_stream_stall_timeout,
        forward: forward.map(Arc::new),
    };
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

use stream::InferStream;

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

    /// Many requests in flight on one stream; see `stream`.
    async fn model_stream_infer(&self, r: Request<Streaming<pb::ModelInferRequest>>) -> Reply<InferStream> {
        Ok(Response::new(self.open_stream(r)))
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
