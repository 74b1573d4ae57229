//! Logging through `tracing`: human-readable lines on stderr; `--log-verbose` turns on debug
//! output, and a RUST_LOG filter (read by `config`) overrides it.
use tracing_subscriber::EnvFilter;

pub fn init(log_verbose: u32, filter: Option<&str>) {
    let default = match log_verbose {
        0 => "info",
        1 => "info,ferry=debug",
        _ => "debug",
    };
    let filter = filter
        .and_then(|f| EnvFilter::try_new(f).ok())
        .unwrap_or_else(|| EnvFilter::new(default));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .try_init();
}
