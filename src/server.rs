//! Wiring: backends, the repository and its registry, the engine, and the listeners; start-up
//! loading; graceful shutdown (stop taking requests, finish those in flight, release models).
use std::{future::Future, path::PathBuf, sync::Arc};

use tokio::net::TcpListener;

use crate::{
    backend::{Backends, identity::IdentityBackend, onnx::OnnxBackend},
    config::Config,
    engine::{EXTENSIONS, Engine, ServerInfo, Services},
    frontend::{
        grpc,
        http::{HttpState, router},
    },
    repository::{
        control::{ControlMode, ModelRepository},
        embedded,
        loader::{LoadOptions, Loader},
        registry::Registry,
    },
    settings::{LogControl, Logging, Tracing},
    shm::SharedMemory,
};

/// Runs the server until `shutdown` completes. Errors are start-up failures, already worded for
/// the operator.
pub async fn run(
    config: Config,
    log_control: Option<Arc<dyn LogControl>>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), String> {
    let (roots, _extracted) = repositories(&config)?;
    let onnx = Arc::new(OnnxBackend::new(config.onnxruntime_library.clone()));
    // ONNX Runtime is found and loaded once, up front, so a missing library is one clear
    // start-up error rather than one failure per model.
    if let Err(e) = onnx.environment() {
        if config.exit_on_error {
            return Err(e.to_string());
        }
        tracing::error!("{e}; ONNX models will not load");
    }
    let backends = Backends::new(vec![onnx, Arc::new(IdentityBackend)]);
    let registry = Arc::new(Registry::default());
    let options = LoadOptions {
        auto_complete: config.auto_complete,
        default_max_batch_size: config.default_max_batch_size,
        cores: config.cores,
    };
    let loader = Loader::new(backends, Arc::clone(&registry), options);
    let mode = if config.explicit_model_control { ControlMode::Explicit } else { ControlMode::None };
    let repository = Arc::new(ModelRepository::new(roots, loader, mode));
    let info = ServerInfo {
        name: config.server_id.clone(),
        version: env!("CARGO_PKG_VERSION").to_string(),
        extensions: EXTENSIONS.iter().map(|s| s.to_string()).collect(),
    };
    let services = Services {
        repository: Arc::clone(&repository),
        logging: Logging::new(config.log_verbose, log_control),
        tracing: Tracing::default(),
        shm: SharedMemory::new(config.allow_client_shm),
    };
    let engine = Arc::new(Engine::new(services, info, config.strict_readiness));

    let listener = TcpListener::bind(config.http_addr)
        .await
        .map_err(|e| format!("cannot listen for HTTP on {}: {e}", config.http_addr))?;
    let http_addr = listener.local_addr().map_err(|e| e.to_string())?;
    tracing::info!("HTTP KServe v2 service listening on {http_addr}");
    let state = Arc::new(HttpState { engine: Arc::clone(&engine), max_input_size: config.http_max_input_size });
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let mut stop_http = stop_rx.clone();
    let http = tokio::spawn(async move {
        // Replies are small and written at once: Nagle's algorithm would hold them back ~40 ms.
        let listener = axum::serve::ListenerExt::tap_io(listener, |tcp| {
            let _ = tcp.set_nodelay(true);
        });
        axum::serve(listener, router(state))
            .with_graceful_shutdown(async move {
                let _ = stop_http.wait_for(|s| *s).await;
            })
            .await
    });

    let grpc_listener = TcpListener::bind(config.grpc_addr)
        .await
        .map_err(|e| format!("cannot listen for gRPC on {}: {e}", config.grpc_addr))?;
    let grpc_addr = grpc_listener.local_addr().map_err(|e| e.to_string())?;
    tracing::info!("gRPC KServe v2 service listening on {grpc_addr}");
    let (inference, health) = grpc::services(Arc::clone(&engine));
    let mut stop_grpc = stop_rx.clone();
    let grpc = tokio::spawn(
        tonic::transport::Server::builder().add_service(inference).add_service(health).serve_with_incoming_shutdown(
            tokio_stream::StreamExt::map(tokio_stream::wrappers::TcpListenerStream::new(grpc_listener), |tcp| {
                tcp.inspect(|s| {
                    let _ = s.set_nodelay(true);
                })
            }),
            async move {
                let _ = stop_grpc.wait_for(|s| *s).await;
            },
        ),
    );

    let failures = repository.load_startup(&config.load_models).await;
    if !failures.is_empty() && config.exit_on_error {
        let _ = stop_tx.send(true);
        return Err(format!("failed to load all models (--exit-on-error=true): {}", failures.join("; ")));
    }
    engine.set_serving();
    tracing::info!(models = registry.serving(None).len(), "ferry is serving");

    shutdown.await;
    tracing::info!("shutting down: finishing requests in flight");
    engine.set_exiting();
    let _ = stop_tx.send(true);
    match http.await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => tracing::error!(error = %e, "HTTP service stopped with an error"),
        Err(e) => tracing::error!(error = %e, "HTTP service task failed"),
    }
    match grpc.await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => tracing::error!(error = %e, "gRPC service stopped with an error"),
        Err(e) => tracing::error!(error = %e, "gRPC service task failed"),
    }
    for model in registry.serving(None) {
        repository.loader().unload(&model.name);
    }
    Ok(())
}

/// The repository roots to serve; with none configured, the embedded examples extracted to a
/// temporary folder (kept alive by the returned guard).
fn repositories(config: &Config) -> Result<(Vec<PathBuf>, Option<tempfile::TempDir>), String> {
    if !config.model_repositories.is_empty() {
        for root in &config.model_repositories {
            if !root.is_dir() {
                return Err(format!("model repository '{}' is not a readable folder", root.display()));
            }
        }
        return Ok((config.model_repositories.clone(), None));
    }
    let dir = tempfile::Builder::new()
        .prefix("ferry-examples-")
        .tempdir()
        .map_err(|e| format!("cannot create a folder for the example repository: {e}"))?;
    let files = embedded::extract(dir.path()).map_err(|e| format!("cannot write the example repository: {e}"))?;
    tracing::info!(folder = %dir.path().display(), files, "no --model-repository given: serving the embedded example repository");
    Ok((vec![dir.path().to_path_buf()], Some(dir)))
}
