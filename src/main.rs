//! The `ferry` binary: parse the configuration, start logging, run the server until a signal.
use std::process::ExitCode;

use ferry::{config::Config, server, telemetry};

fn main() -> ExitCode {
    let config = match Config::from_args(std::env::args_os()) {
        Ok(c) => c,
        Err(e) => e.exit(),
    };
    let runtime = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("ferry: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    runtime.block_on(async {
        // Inside the runtime: the OTLP exporter runs on it.
        let telemetry =
            telemetry::init(config.log_verbose, config.log_filter.as_deref(), config.log_format, config.otlp.as_ref());
        let result = server::run(config, Some(telemetry.control.clone()), telemetry.tracing(), shutdown_signal()).await;
        telemetry.shutdown().await;
        match result {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                tracing::error!("{e}");
                ExitCode::FAILURE
            }
        }
    })
}

/// Ctrl-C or SIGTERM (what container platforms send before they stop a container).
async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => {},
        () = term => {},
    }
}
