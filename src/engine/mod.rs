//! The engine: the one place front-ends call. It resolves the model version, validates, hands
//! the request to that version's scheduler, and answers the read-only questions of the protocol
//! (health, metadata, config, statistics).
use std::{
    sync::{
        Arc,
        atomic::{AtomicU8, Ordering},
    },
    time::Instant,
};

use crate::{
    admission::Admission,
    cache::{self, Lookup, ResponseCache},
    device::DeviceBytes,
    ensemble::{self, Ensemble, StepEngine, StepFuture},
    error::{Error, Result},
    model::{ModelVersion, Runner},
    proto::inference::ModelConfig,
    repository::{control::ModelRepository, registry::Registry},
    request::{InferRequest, InferResponse, MAX_NESTING, ShmRef},
    settings::{Logging, TraceSettings, TraceUpdate, Tracing},
    shm::SharedMemory,
    stats::Snapshot,
    telemetry::otel,
    tensor::{DataType, Tensor},
    validate::{ValidatedRequest, validate},
};

pub mod ordering;
mod stream;
pub use stream::{ResponseStream, StreamItem};

/// The extensions this server implements, in Triton's order.
pub const EXTENSIONS: &[&str] = &[
    "classification",
    "model_repository",
    "model_repository(unload_dependents)",
    "schedule_policy",
    "model_configuration",
    "system_shared_memory",
    "binary_tensor_data",
    "parameters",
    "statistics",
    "trace",
    "logging",
];

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServerInfo {
    pub name: String,
    pub version: String,
    pub extensions: Vec<String>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct TensorMetadata {
    pub name: String,
    pub datatype: DataType,
    pub shape: Vec<i64>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct ModelMetadata {
    pub name: String,
    pub versions: Vec<u64>,
    pub platform: String,
    pub inputs: Vec<TensorMetadata>,
    pub outputs: Vec<TensorMetadata>,
}

/// Statistics of one model version.
#[derive(Debug, Clone, PartialEq)]
pub struct VersionStats {
    pub name: String,
    pub version: u64,
    pub stats: Snapshot,
}

const STARTING: u8 = 0;
const SERVING: u8 = 1;
const EXITING: u8 = 2;

/// The services the engine fronts besides inference.
pub struct Services {
    /// None: no `--cache-config`.
    pub cache: Option<Arc<ResponseCache>>,
    pub repository: Arc<ModelRepository>,
    pub logging: Logging,
    pub tracing: Tracing,
    pub shm: SharedMemory,
    /// The server-wide budget for the bytes of requests in flight.
    pub admission: Arc<Admission>,
}

pub struct Engine {
    registry: Arc<Registry>,
    services: Services,
    info: ServerInfo,
    strict_readiness: bool,
    phase: AtomicU8,
    /// Request traces are exported (OpenTelemetry configured).
    traces: bool,
}

impl Engine {
    pub fn new(services: Services, info: ServerInfo, strict_readiness: bool, traces: bool) -> Self {
        let registry = Arc::clone(services.repository.loader().registry());
        Engine { registry, services, info, strict_readiness, phase: AtomicU8::new(STARTING), traces }
    }

    /// The span of a request when it is to be traced: the caller's `traceparent` asked for it,
    /// or the trace settings (level, rate, count) pick it.
    fn trace_span(&self, req: &InferRequest, version: u64) -> tracing::Span {
        let traceparent = req.trace_parent.as_deref();
        if self.traces && (otel::sampled_by_caller(traceparent) || self.services.tracing.sample(&req.model_name)) {
            otel::request_span(&req.model_name, version, &req.id, traceparent)
        } else {
            tracing::Span::none()
        }
    }

    pub fn registry(&self) -> &Arc<Registry> {
        &self.registry
    }

    /// The repository extension: index, load, unload.
    pub fn repository(&self) -> &Arc<ModelRepository> {
        &self.services.repository
    }

    /// The logging extension.
    pub fn logging(&self) -> &Logging {
        &self.services.logging
    }

    /// The system shared memory extension.
    pub fn shm(&self) -> &SharedMemory {
        &self.services.shm
    }

    /// Admission control (front-ends take tickets for what they read).
    pub fn admission(&self) -> &Arc<Admission> {
        &self.services.admission
    }

    /// Trace settings, global or of one model (which must exist and be ready).
    pub fn trace_settings(&self, model: Option<&str>) -> Result<TraceSettings> {
        self.check_trace_model(model)?;
        Ok(self.services.tracing.get(model))
    }

    pub fn update_trace_settings(&self, model: Option<&str>, update: TraceUpdate) -> Result<TraceSettings> {
        self.check_trace_model(model)?;
        self.services.tracing.update(model, update)
    }

    fn check_trace_model(&self, model: Option<&str>) -> Result<()> {
        let Some(m) = model else { return Ok(()) };
        match self.registry.resolve(m, None) {
            Ok(_) => Ok(()),
            Err(e) if e.kind() == crate::error::ErrorKind::NotFound && !self.registry.contains(m) => Err(e),
            Err(_) => Err(Error::invalid(format!("Request for unknown model : {m}"))),
        }
    }

    /// Start-up is over (the initial models were tried).
    pub fn set_serving(&self) {
        self.phase.store(SERVING, Ordering::SeqCst);
    }

    pub fn set_exiting(&self) {
        self.phase.store(EXITING, Ordering::SeqCst);
        self.services.admission.close();
    }

    /// Live from start until shutdown begins.
    pub fn live(&self) -> Result<()> {
        match self.phase.load(Ordering::SeqCst) {
            EXITING => Err(Error::unavailable("Server exiting")),
            _ => Ok(()),
        }
    }

    pub fn ready(&self) -> bool {
        self.phase.load(Ordering::SeqCst) == SERVING && (!self.strict_readiness || self.registry.all_ready())
    }

    pub fn server_info(&self) -> &ServerInfo {
        &self.info
    }

    pub fn model_ready(&self, name: &str, version: Option<u64>) -> Result<()> {
        self.registry.resolve(name, version).map(|_| ())
    }

    pub fn model_config(&self, name: &str, version: Option<u64>) -> Result<Arc<ModelConfig>> {
        Ok(Arc::clone(&self.registry.resolve(name, version)?.config))
    }

    pub fn model_metadata(&self, name: &str, version: Option<u64>) -> Result<ModelMetadata> {
        let model = self.registry.resolve(name, version)?;
        let versions = match version {
            Some(v) => vec![v],
            None => self.registry.serving(Some(name)).iter().map(|m| m.version).collect(),
        };
        let schema = &model.schema;
        let meta = |specs: &[crate::schema::TensorSpec]| {
            specs
                .iter()
                .map(|s| TensorMetadata { name: s.name.clone(), datatype: s.datatype, shape: schema.client_shape(s) })
                .collect()
        };
        Ok(ModelMetadata {
            name: model.name.clone(),
            versions,
            platform: model.platform().to_string(),
            inputs: meta(&schema.inputs),
            outputs: meta(&schema.outputs),
        })
    }

    /// The chat template saved beside a model's highest ready version.
    pub fn chat_template(&self, name: &str) -> Option<Arc<crate::model::ChatTemplate>> {
        self.registry.resolve(name, None).ok()?.chat_template.clone()
    }

    /// Tokens an OpenAI API request to `name` counted (metrics), on its highest ready version.
    pub fn record_tokens(&self, name: &str, prompt: u64, completion: u64) {
        if let Ok(m) = self.registry.resolve(name, None) {
            m.stats.record_tokens(prompt, completion);
        }
    }

    /// Statistics of every serving version, of one model's, or of one version.
    pub fn statistics(&self, name: Option<&str>, version: Option<u64>) -> Result<Vec<VersionStats>> {
        let models: Vec<Arc<ModelVersion>> =
            match (name, version) {
                (Some(n), Some(v)) => vec![self.registry.resolve(n, Some(v)).map_err(|_| {
                    Error::invalid(format!("requested model version is not available for model '{n}'"))
                })?],
                (Some(n), None) => {
                    let all = self.registry.serving(Some(n));
                    if all.is_empty() {
                        return Err(Error::invalid(format!("requested model '{n}' is not available")));
                    }
                    all
                }
                (None, _) => self.registry.serving(None),
            };
        Ok(models
            .iter()
            .map(|m| VersionStats { name: m.name.clone(), version: m.version, stats: m.stats.snapshot() })
            .collect())
    }

    /// Runs one inference request to completion.
    pub async fn infer(&self, mut req: InferRequest) -> Result<InferResponse> {
        // Once a stop began, only requests that arrived before it run.
        if crate::admission::arrived_after_stop() {
            self.live()?;
        }
        if req.context.ticket.is_none() {
            req.context.ticket = crate::admission::current_ticket();
        }
        let start = Instant::now();
        let (name, version) = (req.model_name.clone(), req.model_version);
        // Loads refuse cycles and deep nesting; this holds when a race between two loads, or BLS
        // calls (which no load can see), would make one.
        if req.context.nesting > MAX_NESTING {
            return Err(Error::invalid(format!(
                "model '{name}': the request is nested more than {MAX_NESTING} ensemble steps or BLS calls deep (a \
                 model that calls itself?)"
            )));
        }
        let model = self.registry.resolve_in(req.context.namespace, &name, version)?;
        if model.config.model_transaction_policy.as_ref().is_some_and(|p| p.decoupled) {
            return Err(Error::unsupported(format!(
                "model '{name}' is decoupled (0..n responses per request): send its requests on a stream"
            )));
        }
        // CUDA shared memory stays on the GPU for a model whose instances all run there, unless
        // the response cache (which keys and keeps bytes) or the sequence batcher needs them.
        let direct = model.device_io && self.cache_for(&model).is_none() && model.sequences.is_none();
        host_inputs(&mut req, direct)?;
        let (shm_targets, device_outputs) = self.output_targets(&model, &req, direct)?;
        // Lives until the reply is ready; the scheduler hangs the queue and compute spans on it.
        let span = self.trace_span(&req, model.version);
        let cache = self.cache_for(&model).map(|c| (c, cache::key(&name, model.version, &model.content, &req)));
        let validated = match validate(&name, &model.schema, req) {
            Ok(v) => ValidatedRequest { span: span.clone(), device_outputs, ..v },
            Err(e) => {
                model.stats.record_failure(start.elapsed(), e.origin());
                return Err(e);
            }
        };
        // A caller that goes away before the reply counts as a cancelled failure, as in Triton.
        let mut gone = CountedIfDropped { stats: Some(Arc::clone(&model.stats)), start };
        let (model, mut result) = match cache {
            Some((cache, key)) => self.infer_cached(cache, key, (model, version), validated, start).await,
            None => self.submit(model, version, validated).await,
        };
        gone.stats = None;
        if let Ok(resp) = &mut result
            && let Err(e) = self.write_shm_outputs(&shm_targets, resp)
        {
            result = Err(e);
        }
        match &result {
            Ok(_) => model.stats.record_success(start.elapsed()),
            Err(e) => model.stats.record_failure(start.elapsed(), e.origin()),
        }
        result
    }

    /// The response cache, when the server has one and the model turned it on.
    fn cache_for(&self, model: &ModelVersion) -> Option<&Arc<ResponseCache>> {
        self.services.cache.as_ref().filter(|_| model.config.response_cache.as_ref().is_some_and(|c| c.enable))
    }

    /// A request to a model with the response cache: a hit skips the scheduler; a miss runs and
    /// stores a successful response for the requests that repeat it.
    async fn infer_cached(
        &self,
        cache: &Arc<ResponseCache>,
        key: cache::Key,
        (model, requested): (Arc<ModelVersion>, Option<u64>),
        validated: ValidatedRequest,
        start: Instant,
    ) -> (Arc<ModelVersion>, Result<InferResponse>) {
        let looking = Instant::now();
        match cache.lookup(key).await {
            Lookup::Hit(hit) => {
                let resp = hit.response(&model.name, model.version, &validated.id);
                model.stats.record_cache_hit(looking.elapsed(), looking - start);
                (model, Ok(resp))
            }
            Lookup::Miss(filler) => {
                let looked = looking.elapsed();
                let version = model.version;
                let (model, result) = self.submit(model, requested, validated).await;
                let storing = Instant::now();
                // The key names the version it was made for: a response from the version that
                // replaced it during a swap is not stored under it.
                if let Ok(resp) = &result
                    && model.version == version
                {
                    filler.fill(resp);
                }
                model.stats.record_cache_miss(looked + storing.elapsed());
                (model, result)
            }
        }
    }

    /// Hands the request to the version's scheduler and waits for the reply. A version retired
    /// by a swap between resolve and submit hands the request back, and the version that
    /// replaced it takes it (when its inputs and outputs are the same).
    async fn submit(
        &self,
        mut model: Arc<ModelVersion>,
        requested: Option<u64>,
        mut validated: ValidatedRequest,
    ) -> (Arc<ModelVersion>, Result<InferResponse>) {
        let name = model.name.clone();
        if let Some(ensemble) = model.ensemble() {
            ordering::queued();
            let result = self.run_ensemble(&model, Arc::clone(ensemble), validated).await;
            return (model, result);
        }
        if let (Some(seqs), Runner::Scheduler(scheduler)) = (&model.sequences, &model.runner) {
            // In its sequence's backlog, in order: the stream's next request may go.
            ordering::queued();
            let result = seqs
                .run(validated, |req| async move {
                    match scheduler.submit(req) {
                        Ok(reply) => reply.await.unwrap_or_else(|_| {
                            Err(Error::internal(format!("model '{name}': the instance running this request failed")))
                        }),
                        Err(_) => Err(Error::unavailable(format!("model '{name}' is unloading"))),
                    }
                })
                .await;
            return (model.clone(), result);
        }
        let reply = loop {
            let Runner::Scheduler(scheduler) = &model.runner else {
                return (
                    model,
                    Err(Error::unavailable(format!(
                        "model '{name}' changed its kind while the request was queued; send it again"
                    ))),
                );
            };
            match scheduler.submit(validated) {
                Ok(reply) => {
                    ordering::queued();
                    break reply;
                }
                Err(back) => {
                    let root = model.namespace.as_ref().map(|(root, _)| *root);
                    let next = match self.registry.resolve_in(root, &name, requested) {
                        Ok(next) if Arc::ptr_eq(&next, &model) => {
                            return (model, Err(Error::unavailable(format!("model '{name}' is unloading"))));
                        }
                        Ok(next) => next,
                        Err(_) => {
                            let e = Error::unavailable(format!(
                                "model '{name}' is unloading; its scheduler has stopped accepting new inference requests"
                            ));
                            return (model, Err(e));
                        }
                    };
                    if next.schema != model.schema {
                        let e = Error::unavailable(format!(
                            "model '{name}' changed its inputs or outputs while request '{}' was queued; send it again",
                            back.0.id
                        ));
                        return (model, Err(e));
                    }
                    validated = *back.0;
                    model = next;
                }
            }
        };
        let result = reply.await.unwrap_or_else(|_| {
            Err(Error::internal(format!(
                "model '{name}': the instance running this request failed unexpectedly (see the server log) and was restarted; send the request again"
            )))
        });
        (model, result)
    }

    /// Runs an ensemble version: its steps are engine calls; its outputs are the tensors the
    /// request asked for, in order (classified when asked).
    async fn run_ensemble(
        &self,
        model: &ModelVersion,
        ensemble: Arc<Ensemble>,
        req: ValidatedRequest,
    ) -> Result<InferResponse> {
        let started = Instant::now();
        let schema = &model.schema;
        let inputs: Vec<Tensor> = schema
            .inputs
            .iter()
            .zip(req.inputs)
            .filter_map(|(spec, t)| {
                let t = t?;
                Some(Tensor { name: spec.name.clone(), datatype: spec.datatype, shape: t.shape, data: t.data })
            })
            .collect();
        let call = (&req.id[..], &req.parameters, &req.context);
        let mut pool = ensemble::run(&ensemble, self, call, inputs, &req.span).await?;
        let outputs = req
            .outputs
            .iter()
            .map(|o| {
                let spec = &schema.outputs[o.index];
                let t = pool.remove(&spec.name).ok_or_else(|| {
                    Error::internal(format!("ensemble '{}' produced no output '{}'", model.name, spec.name))
                })?;
                match o.classification {
                    Some(k) => crate::classify::classify(&t, schema.batching(), k as usize, &spec.labels),
                    None => Ok(t),
                }
            })
            .collect::<Result<Vec<_>>>()?;
        let took = started.elapsed();
        let phases = crate::stats::PhaseTimes { input: Default::default(), infer: took, output: Default::default() };
        model.stats.record_execution(req.rows as u64, &[Default::default()], phases);
        Ok(InferResponse {
            model_name: model.name.clone(),
            model_version: model.version,
            id: req.id,
            parameters: Default::default(),
            outputs,
        })
    }

    /// Where the outputs asked for in shared memory go: written by the engine once the reply is
    /// ready, or (`direct`, CUDA regions) handed to the scheduler to write on the GPU, by schema
    /// output index.
    fn output_targets(
        &self,
        model: &ModelVersion,
        req: &InferRequest,
        direct: bool,
    ) -> Result<(HostTargets, Vec<(usize, DeviceBytes)>)> {
        let (mut host, mut device) = (Vec::new(), Vec::new());
        for o in &req.outputs {
            let Some(target) = &o.shm else { continue };
            let on_gpu = match (direct, model.schema.output_index(&o.name)) {
                (true, Some(index)) => {
                    self.shm().device_range(&target.region, target.offset, target.byte_size)?.map(|d| (index, d))
                }
                _ => None,
            };
            match on_gpu {
                Some(d) => device.push(d),
                None => host.push((o.name.clone(), target.clone())),
            }
        }
        Ok((host, device))
    }

    /// Writes the outputs asked for in shared memory there; the reply then carries them empty.
    fn write_shm_outputs(&self, targets: &[(String, ShmRef)], resp: &mut InferResponse) -> Result<()> {
        for (name, target) in targets {
            if let Some(out) = resp.outputs.iter_mut().find(|o| &o.name == name) {
                self.shm().write(&target.region, target.offset, target.byte_size, name, &out.data)?;
                out.data = bytes::Bytes::new();
            }
        }
        Ok(())
    }
}

/// Outputs the engine writes into shared memory once the reply is ready, by name.
type HostTargets = Vec<(String, ShmRef)>;

/// Inputs a front-end left on a GPU (CUDA shared memory) stay there only for a model that takes
/// them so (`keep`), and only fixed-size ones other than BOOL (BYTES are parsed and BOOL values
/// checked on the host); the rest are copied to the host here, once.
pub(crate) fn host_inputs(req: &mut InferRequest, keep: bool) -> Result<()> {
    for t in &mut req.inputs {
        let stays = keep && t.datatype.size().is_some() && t.datatype != DataType::Bool;
        if !stays && let Some(device) = t.device.take() {
            t.data = device.to_host()?;
        }
    }
    Ok(())
}

impl StepEngine for Engine {
    fn infer_step(&self, req: InferRequest) -> StepFuture<'_> {
        Box::pin(self.infer(req))
    }
}

/// What Python models ask of the server (BLS, model control): ordinary engine calls.
impl crate::backend::Host for Engine {
    fn infer(&self, req: InferRequest) -> crate::backend::HostFuture<'_, InferResponse> {
        Box::pin(Engine::infer(self, req))
    }

    fn infer_stream(&self, req: InferRequest) -> crate::backend::HostFuture<'_, crate::request::ResponseStream> {
        Box::pin(Engine::infer_stream(self, req))
    }

    fn load(
        &self,
        name: String,
        config: Option<String>,
        files: Vec<(String, Vec<u8>)>,
    ) -> crate::backend::HostFuture<'_, ()> {
        let req = crate::repository::control::LoadRequest { config, files };
        Box::pin(async move { self.repository().load(&name, req).await })
    }

    fn unload(&self, name: String) -> crate::backend::HostFuture<'_, ()> {
        Box::pin(async move { self.repository().unload(&name, false).await })
    }

    fn ready(&self, name: &str, version: Option<u64>) -> bool {
        self.model_ready(name, version).is_ok()
    }
}

/// Records a cancelled failure when dropped armed (the request's caller went away mid-way).
struct CountedIfDropped {
    stats: Option<Arc<crate::stats::Stats>>,
    start: Instant,
}

impl Drop for CountedIfDropped {
    fn drop(&mut self) {
        if let Some(stats) = self.stats.take() {
            stats.record_failure(self.start.elapsed(), crate::error::Origin::Cancelled);
        }
    }
}

#[cfg(test)]
mod tests {
    use bytes::Bytes;

    use super::*;
    use crate::{device::HostMemory, request::InputTensor};

    #[test]
    fn gpu_inputs_stay_only_where_the_model_takes_them() {
        let memory = HostMemory::new(0, (0u8..16).collect());
        let on_gpu = |datatype, len| InputTensor {
            device: Some(memory.range(0, len)),
            ..InputTensor::host("x", datatype, vec![1], Bytes::new())
        };
        let mut req = InferRequest {
            inputs: vec![on_gpu(DataType::Fp32, 4), on_gpu(DataType::Bool, 1), on_gpu(DataType::Bytes, 8)],
            ..Default::default()
        };
        host_inputs(&mut req, true).unwrap();
        assert!(req.inputs[0].device.is_some() && req.inputs[0].data.is_empty(), "FP32 stays on the GPU");
        for t in &req.inputs[1..] {
            assert!(t.device.is_none() && t.data.len() == t.byte_len(), "{:?} is copied to the host", t.datatype);
        }
        host_inputs(&mut req, false).unwrap();
        assert_eq!(req.inputs[0].data, Bytes::from_static(&[0, 1, 2, 3]));
        assert!(req.inputs[0].device.is_none());
    }
}
