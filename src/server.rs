//! Wiring: backends, the repository and its registry, the engine, and the listeners; start-up
//! loading; graceful shutdown (stop taking requests, finish those in flight, release models).
use std::{
    future::Future,
    net::SocketAddr,
    path::{Path, PathBuf},
    sync::Arc,
    time::Duration,
};

use tokio::{net::TcpListener, sync::watch, task::JoinHandle};

use crate::{
    admission::Admission,
    backend::{Backends, Host, HostSlot, identity::IdentityBackend, onnx::OnnxBackend, python::PythonBackend},
    cache::ResponseCache,
    config::{Config, Mode},
    engine::{EXTENSIONS, Engine, ServerInfo, Services},
    frontend::{
        self, grpc,
        guard::AdmitLayer,
        http_common::HttpState,
        net::{self, Network},
        restrict::{self, Category, RestrictLayer, Restrictions},
        sagemaker::SageMakerState,
        vertex::VertexState,
    },
    metrics::{FIRST_RESPONSE_BUCKETS, Metrics},
    repository::{
        control::{ControlMode, ModelRepository},
        embedded,
        loader::{LoadOptions, Loader},
        registry::Registry,
        sources::Sources,
    },
    settings::{LogControl, Logging, Tracing},
    shm::SharedMemory,
};

type Service = (&'static str, JoinHandle<Result<(), String>>);

async fn bind(what: &str, addr: SocketAddr) -> Result<TcpListener, String> {
    let listener = TcpListener::bind(addr).await.map_err(|e| format!("cannot listen for {what} on {addr}: {e}"))?;
    let local = listener.local_addr().map_err(|e| e.to_string())?;
    tracing::info!("{what} service listening on {local}");
    Ok(listener)
}

/// The listeners' shared pieces.
struct Listen {
    limits: Network,
    admission: Arc<Admission>,
    stop: watch::Receiver<bool>,
    http_tls: Option<tokio_rustls::TlsAcceptor>,
    grpc_tls: Option<tonic::transport::ServerTlsConfig>,
}

impl Listen {
    fn http(&self, listener: TcpListener, app: axum::Router) -> JoinHandle<Result<(), String>> {
        let (limits, admission, stop) = (self.limits.clone(), Arc::clone(&self.admission), self.stop.clone());
        tokio::spawn(net::serve_http(listener, app, limits, admission, self.http_tls.clone(), stop))
    }

    fn grpc(
        &self,
        listener: TcpListener,
        engine: Arc<Engine>,
        forward: Option<regex::Regex>,
        rules: Restrictions,
    ) -> JoinHandle<Result<(), String>> {
        let l = &self.limits;
        let (inference, health) = grpc::services(engine, l, forward);
        let incoming = net::grpc_incoming(listener, l, self.stop.clone());
        let mut stop = self.stop.clone();
        let mut builder = tonic::transport::Server::builder();
        if let Some(tls) = &self.grpc_tls {
            builder = match builder.tls_config(tls.clone()) {
                Ok(b) => b,
                Err(e) => return tokio::spawn(std::future::ready(Err(format!("gRPC TLS: {e}")))),
            };
        }
        let server = builder
            .max_concurrent_streams(Some(l.grpc_max_concurrent_streams))
            .http2_keepalive_interval(Some(Duration::from_secs(60)))
            .http2_keepalive_timeout(Some(Duration::from_secs(20)))
            .layer(grpc::deadline::DeadlineLayer)
            .layer(AdmitLayer { admission: Arc::clone(&self.admission) })
            .layer(RestrictLayer(Arc::new(rules)))
            .add_service(inference)
            .add_service(health);
        tokio::spawn(async move {
            server
                .serve_with_incoming_shutdown(incoming, async move { net::stopped(&mut stop).await })
                .await
                .map_err(|e| e.to_string())
        })
    }
}

/// Reads the machine gauges every interval, and prints EMF lines when asked.
fn spawn_metrics_tasks(metrics: &Arc<Metrics>, emf_secs: u64, stop: watch::Receiver<bool>) {
    let (m, mut stop_sampling) = (Arc::clone(metrics), stop.clone());
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(m.settings().interval);
        loop {
            tokio::select! {
                _ = tick.tick() => { let m = Arc::clone(&m); let _ = tokio::task::spawn_blocking(move || m.sample()).await; }
                () = net::stopped(&mut stop_sampling) => break,
            }
        }
    });
    if emf_secs == 0 {
        return;
    }
    let (m, mut stop_emf) = (Arc::clone(metrics), stop);
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_secs(emf_secs));
        loop {
            tokio::select! {
                _ = tick.tick() => {
                    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64);
                    for line in m.emf_lines(now) {
                        println!("{line}");
                    }
                }
                () = net::stopped(&mut stop_emf) => break,
            }
        }
    });
}

/// What serving needs before any listener: backends, the registry, the repository and the engine
/// over them. `ferry serve` puts listeners in front of it; `ferry tune` drives the engine itself.
pub struct Core {
    pub engine: Arc<Engine>,
    pub registry: Arc<Registry>,
    pub repository: Arc<ModelRepository>,
    pub backends: Backends,
    pub cache: Option<Arc<ResponseCache>>,
    pub admission: Arc<Admission>,
    /// The folders served (local paths or storage URLs).
    pub roots: Vec<String>,
    /// Keeps the embedded examples' temporary folder alive.
    _extracted: Option<tempfile::TempDir>,
}

impl Core {
    /// Builds everything but the listeners; errors are start-up failures worded for the operator.
    pub fn new(config: &Config, log_control: Option<Arc<dyn LogControl>>, traces: bool) -> Result<Core, String> {
        let (roots, extracted) = repositories(config)?;
        let onnx = Arc::new(
            OnnxBackend::new(config.onnxruntime_library.clone())
                .with_engine_cache(config.storage.cache_dir.join("tensorrt")),
        );
        // ONNX Runtime is found and loaded once, up front, so a missing library is one clear
        // start-up error rather than one failure per model.
        if let Err(e) = onnx.environment() {
            if config.exit_on_error {
                return Err(e.to_string());
            }
            tracing::error!("{e}; ONNX models will not load");
        }
        // Python processes call back into the engine (BLS, model control) once it exists.
        let host: HostSlot = Arc::default();
        let python =
            Arc::new(PythonBackend::new(config.python.clone(), Arc::clone(&host), tokio::runtime::Handle::current()));
        let based = Arc::clone(&python);
        let pytorch = Arc::new(crate::backend::pytorch::backend(&python, config.pytorch_python.clone()));
        let [openvino, tensorflow] = crate::backend::openvino::backends(config.openvino_library.clone());
        let backends = Backends::new(vec![
            onnx,
            Arc::new(openvino),
            Arc::new(tensorflow),
            python,
            pytorch,
            Arc::new(crate::backend::fil::FilBackend::new(
                config.xgboost_library.clone(),
                config.lightgbm_library.clone(),
            )),
            Arc::new(IdentityBackend),
            Arc::new(crate::backend::native::image::ImageBackend),
            Arc::new(crate::backend::native::post::PostBackend),
            Arc::new(crate::backend::native::tokenizer::TokenizerBackend),
        ])
        .with_found(move |name| based.based_on(name).map(|b| Arc::new(b) as Arc<dyn crate::backend::Backend>));
        let registry = Arc::new(if config.model_namespacing {
            Registry::namespaced(roots.iter().map(|r| r.trim_end_matches('/').to_string()).collect())
        } else {
            Registry::default()
        });
        let options = LoadOptions {
            auto_complete: config.auto_complete,
            default_max_batch_size: config.default_max_batch_size,
            adaptive_queue_delay: config.adaptive_queue_delay,
            cores: config.cores,
            recent_stats: config.metrics.as_ref().is_some_and(|m| m.summary_latencies),
            histogram: config
                .metrics
                .as_ref()
                .filter(|m| m.histogram_latencies)
                .map(|_| FIRST_RESPONSE_BUCKETS.to_vec()),
            content_digests: config.cache.is_some(),
            rate_limiter: config
                .rate_limit
                .clone()
                .map(|given| Arc::new(crate::scheduler::rate_limit::RateLimiter::new(given))),
        };
        let loader = Loader::new(backends.clone(), Arc::clone(&registry), options);
        let sources = Sources::new(&roots, &config.storage.settings, &config.storage.cache_dir)?
            .with_namespacing(config.model_namespacing);
        let listing_max_age = Duration::from_secs(config.storage.poll_secs);
        let repository = Arc::new(ModelRepository::new(sources, loader, config.control, listing_max_age));
        let info = ServerInfo {
            name: config.server_id.clone(),
            version: env!("CARGO_PKG_VERSION").to_string(),
            extensions: EXTENSIONS.iter().map(|s| s.to_string()).collect(),
        };
        let cache = match &config.cache {
            Some(c) => {
                let cache = ResponseCache::new(c)?;
                tracing::info!(tiers = %cache.describe(), "response cache on for models with response_cache {{ enable: true }}");
                Some(cache)
            }
            None => None,
        };
        let admission = Admission::new(config.network.admission_budget);
        let services = Services {
            cache: cache.clone(),
            repository: Arc::clone(&repository),
            logging: Logging::new(config.log_verbose, log_control),
            tracing: Tracing::new(config.trace.clone()),
            shm: SharedMemory::new(config.allow_client_shm),
            admission: Arc::clone(&admission),
        };
        let engine = Arc::new(Engine::new(services, info, config.strict_readiness, traces));
        let as_host: Arc<dyn Host> = engine.clone();
        let _ = host.set(Arc::downgrade(&as_host));
        Ok(Core { engine, registry, repository, backends, cache, admission, roots, _extracted: extracted })
    }
}

/// Runs the server until `shutdown` completes. Errors are start-up failures, already worded for
/// the operator.
pub async fn run(
    config: Config,
    log_control: Option<Arc<dyn LogControl>>,
    traces: bool,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), String> {
    let core = Core::new(&config, log_control, traces)?;
    crate::backend::python::live::sweep_stale();
    crate::backend::python::live::adopt_orphans();
    log_platform(&config, &core.roots);
    for note in &config.flag_notes {
        tracing::warn!("tritonserver flag {note}");
    }
    crate::gpu::log_visible();
    let Core { engine, registry, repository, cache, admission, .. } = &core;
    let (engine, registry, repository, cache, admission) =
        (Arc::clone(engine), Arc::clone(registry), Arc::clone(repository), cache.clone(), Arc::clone(admission));
    // Listen first, load second: health answers (not ready) while models load.
    let (stop_tx, stop_rx) = watch::channel(false);
    let listen = Listen {
        limits: config.network.clone(),
        admission: Arc::clone(&admission),
        stop: stop_rx.clone(),
        http_tls: config.http_tls.as_ref().map(frontend::tls::http_acceptor).transpose()?,
        grpc_tls: config.grpc_tls.as_ref().map(frontend::tls::grpc_config).transpose()?,
    };
    let metrics = config
        .metrics
        .as_ref()
        .map(|m| Metrics::new(m.clone(), Arc::clone(&registry), cache.clone(), Arc::clone(&admission)));
    let services = listeners(&config, &listen, &engine, metrics.as_ref()).await?;
    let stopping = Stopping {
        engine: Arc::clone(&engine),
        admission,
        stop: stop_tx,
        services,
        limit: config.network.exit_timeout,
    };

    let mut shutdown = Box::pin(shutdown);
    // A stop signal during start-up abandons the loads in progress (downloads included).
    let failures = tokio::select! {
        f = repository.load_startup(&config.load_models) => f,
        () = &mut shutdown => {
            tracing::info!("stop signal during start-up: abandoning the model loads in progress");
            stopping.run().await;
            return Ok(());
        }
    };
    if !failures.is_empty() && config.exit_on_error {
        stopping.run().await;
        return Err(format!("failed to load all models (--exit-on-error=true): {}", failures.join("; ")));
    }
    engine.set_serving();
    warn_cache_unused(&registry, cache.is_some());
    tracing::info!(models = registry.serving(None).len(), "ferry is serving");
    if config.control == ControlMode::Poll {
        let (repository, mut stop) = (Arc::clone(&repository), stop_rx.clone());
        let every = Duration::from_secs(config.storage.poll_secs);
        tokio::spawn(async move {
            loop {
                tokio::select! {
                    () = tokio::time::sleep(every) => repository.poll().await,
                    () = net::stopped(&mut stop) => break,
                }
            }
        });
    }

    shutdown.await;
    stopping.run().await;
    for model in registry.serving(None) {
        repository.loader().unload(&model.name);
    }
    // Python models get a moment to finalize; then no process or region of theirs outlives ferry.
    tokio::task::spawn_blocking(|| crate::backend::python::live::release_all(Duration::from_secs(5))).await.ok();
    Ok(())
}

/// Starts every listener the platform asks for.
async fn listeners(
    config: &Config,
    listen: &Listen,
    engine: &Arc<Engine>,
    metrics: Option<&Arc<Metrics>>,
) -> Result<Vec<Service>, String> {
    let mut services: Vec<Service> = Vec::new();
    let state = Arc::new(HttpState {
        engine: Arc::clone(engine),
        max_input_size: config.http_max_input_size,
        size_note: config.size_note.clone(),
        forward_headers: config.http_header_forward.clone(),
        openai_api_key: config.openai_api_key.as_deref().map(Arc::from),
    });
    let rules = &config.http_restricted;
    let kserve_rules = |r: axum::Router| restrict::http(r, rules, Arc::new(restrict::kserve_category));
    // The KServe v2 routes, also reached through Vertex AI's redirect header.
    let mut kserve = frontend::http_routes(Arc::clone(&state));
    if let Some(m) = metrics {
        kserve = kserve.merge(frontend::metrics::routes(Arc::clone(m)));
    }
    let kserve = kserve_rules(frontend::http::with_fallbacks(kserve));
    if let Some(v) = &config.platform.vertex {
        let vertex = Arc::new(VertexState { http: Arc::clone(&state), settings: v.clone(), kserve: kserve.clone() });
        let listener = bind("Vertex AI", v.addr).await?;
        let (health, predict) = (v.health_route.clone(), v.predict_route.clone());
        let categorize: restrict::Categorize = Arc::new(move |p: &str| match p {
            p if p == health => Some(Category::Health),
            p if p == predict => Some(Category::Inference),
            // Other paths are KServe routes reached through the redirect header, checked there.
            _ => None,
        });
        services.push((
            "Vertex AI",
            listen.http(listener, restrict::http(frontend::vertex::router(vertex), rules, categorize)),
        ));
    }
    if let Some(sm) = &config.platform.sagemaker {
        let sagemaker = Arc::new(SageMakerState::new(Arc::clone(&state), sm.clone()));
        let listener = bind("SageMaker", sm.addr).await?;
        let router =
            restrict::http(frontend::sagemaker::router(sagemaker), rules, Arc::new(restrict::sagemaker_category));
        services.push(("SageMaker", listen.http(listener, router)));
    }
    if config.platform.http {
        let http = bind("HTTP KServe v2", config.http_addr).await?;
        services.push(("HTTP", listen.http(http, kserve_rules(frontend::http_router(Arc::clone(&state))))));
    }
    if config.platform.grpc {
        let grpc = bind("gRPC KServe v2", config.grpc_addr).await?;
        let (forward, rules) = (config.grpc_header_forward.clone(), config.grpc_restricted.clone());
        services.push(("gRPC", listen.grpc(grpc, Arc::clone(engine), forward, rules)));
    }
    if let Some(metrics) = metrics {
        let listener = bind("Prometheus metrics", config.metrics_addr).await?;
        services.push(("metrics", listen.http(listener, frontend::metrics::router(Arc::clone(metrics)))));
        spawn_metrics_tasks(metrics, config.emf_interval_secs, listen.stop.clone());
    }
    Ok(services)
}

/// A model that asks for the response cache on a server without one is said once, at start.
fn warn_cache_unused(registry: &Registry, has_cache: bool) {
    if has_cache {
        return;
    }
    for m in registry.serving(None).iter().filter(|m| m.config.response_cache.as_ref().is_some_and(|c| c.enable)) {
        tracing::warn!(
            model = %m.name,
            version = m.version,
            "response_cache is enabled in the model's config but the server has no cache (--cache-config local,size=<bytes>); every request runs the model"
        );
    }
}

/// The graceful stop, bounded by --exit-timeout-secs: not ready and refusing new requests at
/// once, admitted requests finish, then the listeners close; what is left at the deadline is
/// cancelled.
struct Stopping {
    engine: Arc<Engine>,
    admission: Arc<Admission>,
    stop: watch::Sender<bool>,
    services: Vec<Service>,
    limit: Duration,
}

impl Stopping {
    async fn run(self) {
        let deadline = tokio::time::Instant::now() + self.limit;
        self.engine.set_exiting();
        let in_flight = self.admission.counts().live;
        tracing::info!(in_flight, deadline_secs = self.limit.as_secs(), "shutting down: finishing admitted requests");
        if tokio::time::timeout_at(deadline, self.admission.drained()).await.is_err() {
            let left = self.admission.counts().live;
            tracing::warn!(in_flight = left, "exit deadline reached (--exit-timeout-secs): cancelling what is left");
        }
        let _ = self.stop.send(true);
        for (name, task) in self.services {
            let abort = task.abort_handle();
            match tokio::time::timeout_at(deadline, task).await {
                Ok(Ok(Ok(()))) => {}
                Ok(Ok(Err(e))) => tracing::error!(error = %e, "{name} service stopped with an error"),
                Ok(Err(e)) if e.is_cancelled() => {}
                Ok(Err(e)) => tracing::error!(error = %e, "{name} service task failed"),
                Err(_) => {
                    tracing::warn!("{name}: connections still open at the exit deadline are closed");
                    abort.abort();
                }
            }
        }
    }
}

/// Says once, at start, where ferry runs and what it serves.
fn log_platform(config: &Config, roots: &[String]) {
    let p = &config.platform;
    let mut listeners = Vec::new();
    if let Some(v) = &p.vertex {
        listeners.push(format!("Vertex AI {} (health {}, predict {})", v.addr, v.health_route, v.predict_route));
    }
    if let Some(s) = &p.sagemaker {
        listeners.push(format!(
            "SageMaker {} (/ping, /invocations{})",
            s.addr,
            if s.multi_model { ", /models" } else { "" }
        ));
    }
    if p.http {
        listeners.push(format!("KServe HTTP {}", config.http_addr));
    }
    if p.grpc {
        listeners.push(format!("KServe gRPC {}", config.grpc_addr));
    }
    if config.metrics.is_some() {
        listeners.push(format!("metrics {}", config.metrics_addr));
    }
    let models = if roots.is_empty() { "none until loaded".to_string() } else { roots.join(", ") };
    tracing::info!(mode = p.mode.name(), listeners = %listeners.join("; "), models = %models, "starting");
}

/// The repositories to serve (folders or storage URLs); with none configured, the embedded
/// examples extracted to a temporary folder (kept alive by the returned guard). SageMaker's model
/// folder may be a repository root, one model, or a wrapper around a root.
fn repositories(config: &Config) -> Result<(Vec<String>, Option<tempfile::TempDir>), String> {
    let as_strings = |dirs: Vec<PathBuf>| dirs.iter().map(|d| d.display().to_string()).collect::<Vec<_>>();
    if let Some(sm) = &config.platform.sagemaker
        && config.model_repositories.len() == 1
        && config.platform.repository.as_ref() == config.model_repositories.first()
    {
        let name = sm.default_model.clone().unwrap_or_else(|| "model".to_string());
        let (dirs, guard) = crate::repository::layout::detect(Path::new(&config.model_repositories[0]), &name)?;
        return Ok((as_strings(dirs), guard));
    }
    if config.platform.mode == Mode::SageMaker && config.model_repositories.is_empty() {
        return Ok((Vec::new(), None));
    }
    if !config.model_repositories.is_empty() {
        return Ok((config.model_repositories.clone(), None));
    }
    let dir = tempfile::Builder::new()
        .prefix("ferry-examples-")
        .tempdir()
        .map_err(|e| format!("cannot create a folder for the example repository: {e}"))?;
    let files = embedded::extract(dir.path()).map_err(|e| format!("cannot write the example repository: {e}"))?;
    tracing::info!(folder = %dir.path().display(), files, "no --model-repository given: serving the embedded example repository");
    if let Err(why) = crate::backend::python::default_python_usable(&config.python) {
        let skipped = embedded::drop_python_examples(dir.path());
        tracing::info!(skipped = %skipped.join(", "), "the Python examples are not served: {why}");
    }
    Ok((as_strings(vec![dir.path().to_path_buf()]), Some(dir)))
}
