//! The `ferry` binary: parse the configuration, start logging, run the server until a signal.
use std::process::ExitCode;

use ferry::{
    backend::pytorch::{aoti_trial, torchscript_shim},
    config::{Config, Invocation},
    server, telemetry, tune,
};

fn main() -> ExitCode {
    // AOTInductor packages run in this process check each call's shapes and dtypes against what
    // they were compiled for (else a package reads past a short input), whatever the environment
    // says: PyTorch reads this once, and it is set here, while the process has one thread.
    // SAFETY: no other thread exists yet to read the environment.
    unsafe { std::env::set_var("AOTI_RUNTIME_CHECK_INPUTS", "1") };
    let args: Vec<std::ffi::OsString> = std::env::args_os().collect();
    if args.get(1).is_some_and(|a| a == aoti_trial::COMMAND) {
        return aoti_trial::child(&args[2..]);
    }
    if args.get(1).is_some_and(|a| a == torchscript_shim::BUILD_COMMAND) {
        return torchscript_shim::build_command(&args[2..]);
    }
    let (config, tuning) = match Invocation::from_args(std::env::args_os()) {
        Ok(Invocation::Serve(c)) => (*c, None),
        Ok(Invocation::Tune(c, t)) => (*c, Some(*t)),
        Err(e) => e.exit(),
    };
    let runtime = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("ferry: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    if let Some(settings) = tuning {
        return runtime.block_on(run_tune(config, settings));
    }
    let code = runtime.block_on(async {
        // Signal handlers first: in a container ferry is PID 1, and a SIGTERM that arrives before
        // a handler exists is dropped (a stop during a long start-up would end in SIGKILL).
        let shutdown = shutdown_signal();
        // Inside the runtime: the OTLP exporter runs on it.
        let telemetry =
            telemetry::init(config.log_verbose, config.log_filter.as_deref(), config.log_format, config.otlp.as_ref());
        let result = server::run(config, Some(telemetry.control.clone()), telemetry.tracing(), shutdown).await;
        telemetry.shutdown().await;
        match result {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                tracing::error!("{e}");
                ExitCode::FAILURE
            }
        }
    });
    // Work that cannot be cancelled (a model session being built) does not hold the exit.
    runtime.shutdown_timeout(std::time::Duration::from_secs(1));
    code
}

/// `ferry tune`: warnings and errors only, so the progress bar and the report stay readable.
async fn run_tune(config: Config, settings: ferry::config::TuneSettings) -> ExitCode {
    let filter = config.log_filter.clone().unwrap_or_else(|| "warn".to_string());
    let telemetry = telemetry::init(0, Some(&filter), config.log_format, None);
    let result = match server::Core::new(&config, None, false) {
        Ok(core) => tune::run(&config, core, settings).await,
        Err(e) => Err(e),
    };
    telemetry.shutdown().await;
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("ferry tune: {e}");
            ExitCode::FAILURE
        }
    }
}

/// SIGTERM (what container platforms send before they stop a container) or Ctrl-C. The handlers
/// are installed when this is called, not when the future is first polled; a second signal
/// during the graceful stop exits at once.
fn shutdown_signal() -> impl std::future::Future<Output = ()> + Send + 'static {
    use tokio::signal::unix::{SignalKind, signal};
    let term = signal(SignalKind::terminate());
    let int = signal(SignalKind::interrupt());
    let (mut term, mut int) = match (term, int) {
        (Ok(t), Ok(i)) => (t, i),
        (Err(e), _) | (_, Err(e)) => {
            eprintln!("ferry: cannot install signal handlers: {e}");
            std::process::exit(1);
        }
    };
    async move {
        tokio::select! {
            _ = term.recv() => {},
            _ = int.recv() => {},
        }
        tokio::spawn(async move {
            tokio::select! {
                _ = term.recv() => {},
                _ = int.recv() => {},
            }
            eprintln!("ferry: second stop signal: exiting now");
            std::process::exit(1);
        });
    }
}
