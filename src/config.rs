//! The command line and the environment, folded once at start-up into one `Config`. The only
//! module that reads environment variables. Flag names follow tritonserver's where they exist;
//! every flag can also come from a `FERRY_*` variable.
use std::{
    net::{IpAddr, SocketAddr},
    path::PathBuf,
};

use clap::{ArgAction, Args, Parser, Subcommand};

use crate::{
    metrics::MetricsSettings,
    settings::TraceSettings,
    telemetry::{LogFormat, otel::OtlpSettings},
};

#[derive(Parser, Debug)]
#[command(
    name = "ferry",
    version,
    about = "A Triton-compatible model server for managed clouds",
    args_conflicts_with_subcommands = true
)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
    #[command(flatten)]
    serve: ServeArgs,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Serve the model repositories (the default command).
    Serve(ServeArgs),
}

/// Boolean flags read `--flag`, `--flag=true` or `--flag=false`, like tritonserver's.
#[derive(Args, Debug, Clone)]
struct ServeArgs {
    /// Model repository path (repeatable). Without one, the embedded example repository is served.
    #[arg(long = "model-repository", env = "FERRY_MODEL_REPOSITORY", value_delimiter = ',')]
    model_repository: Vec<PathBuf>,
    /// HTTP port for KServe v2 (0 = any free port).
    #[arg(long, env = "FERRY_HTTP_PORT", default_value_t = 8000)]
    http_port: u16,
    #[arg(long, env = "FERRY_HTTP_ADDRESS", default_value = "0.0.0.0")]
    http_address: IpAddr,
    /// gRPC port (reserved: the gRPC front-end is not part of this build yet).
    #[arg(long, env = "FERRY_GRPC_PORT", default_value_t = 8001)]
    grpc_port: u16,
    /// Prometheus metrics port.
    #[arg(long, env = "FERRY_METRICS_PORT", default_value_t = 8002)]
    metrics_port: u16,
    /// Metrics bind address (default: --http-address).
    #[arg(long, env = "FERRY_METRICS_ADDRESS")]
    metrics_address: Option<IpAddr>,
    /// Serve Prometheus metrics.
    #[arg(long, env = "FERRY_ALLOW_METRICS", default_value = "true", num_args = 0..=1, default_missing_value = "true", action = ArgAction::Set)]
    allow_metrics: bool,
    /// GPU utilization, memory and power metrics (through NVML, when a GPU is present).
    #[arg(long, env = "FERRY_ALLOW_GPU_METRICS", default_value = "true", num_args = 0..=1, default_missing_value = "true", action = ArgAction::Set)]
    allow_gpu_metrics: bool,
    /// CPU utilization and memory metrics.
    #[arg(long, env = "FERRY_ALLOW_CPU_METRICS", default_value = "true", num_args = 0..=1, default_missing_value = "true", action = ArgAction::Set)]
    allow_cpu_metrics: bool,
    /// How often the CPU and GPU metrics are read, in milliseconds.
    #[arg(long, env = "FERRY_METRICS_INTERVAL_MS", default_value_t = 2000.0)]
    metrics_interval_ms: f64,
    /// `counter_latencies=<bool>`, `histogram_latencies=<bool>`, `summary_latencies=<bool>`,
    /// `summary_quantiles=<q:err,...>` (repeatable), as tritonserver.
    #[arg(long, env = "FERRY_METRICS_CONFIG", value_delimiter = ';')]
    metrics_config: Vec<String>,
    /// Print the autoscaling signal as CloudWatch embedded-metric log lines every N seconds (0 = off).
    #[arg(long, env = "FERRY_EMF_INTERVAL_SECS", default_value_t = 0)]
    emf_interval_secs: u64,
    /// Deprecated alias of --disable-auto-complete-config.
    #[arg(long, env = "FERRY_STRICT_MODEL_CONFIG", default_value = "false", num_args = 0..=1, default_missing_value = "true", action = ArgAction::Set)]
    strict_model_config: bool,
    /// Do not complete configs from the model file; config.pbtxt must be complete.
    #[arg(long, env = "FERRY_DISABLE_AUTO_COMPLETE_CONFIG", default_value = "false", num_args = 0..=1, default_missing_value = "true", action = ArgAction::Set)]
    disable_auto_complete_config: bool,
    /// Exit at start-up when any model fails to load.
    #[arg(long, env = "FERRY_EXIT_ON_ERROR", default_value = "true", num_args = 0..=1, default_missing_value = "true", action = ArgAction::Set)]
    exit_on_error: bool,
    /// Ready only when every model is ready.
    #[arg(long, env = "FERRY_STRICT_READINESS", default_value = "true", num_args = 0..=1, default_missing_value = "true", action = ArgAction::Set)]
    strict_readiness: bool,
    /// `default` or `ISO8601` (Triton's line formats), or `json` (one object per line, with the
    /// fields Cloud Logging and CloudWatch read).
    #[arg(long, env = "FERRY_LOG_FORMAT", default_value = "default", value_parser = ["default", "ISO8601", "json"])]
    log_format: String,
    /// Request tracing as tritonserver's: `mode=opentelemetry`, `rate=N`, `level=TIMESTAMPS`,
    /// `count=N`, `opentelemetry,url=HOST:PORT/v1/traces`, `opentelemetry,protocol=grpc`,
    /// `opentelemetry,resource=key=value` (repeatable). The OTEL_EXPORTER_OTLP_* variables work too.
    #[arg(long, env = "FERRY_TRACE_CONFIG", value_delimiter = ';')]
    trace_config: Vec<String>,
    /// Verbose logging level (0 = off).
    #[arg(long, env = "FERRY_LOG_VERBOSE", default_value_t = 0)]
    log_verbose: u32,
    /// Largest HTTP request body, in bytes (also after decompression).
    #[arg(long, env = "FERRY_HTTP_MAX_INPUT_SIZE", default_value_t = 64 * 1024 * 1024)]
    http_max_input_size: usize,
    /// `none`: load every model at start; `explicit`: load `--load-model` models, then the
    /// repository API loads and unloads.
    #[arg(long, env = "FERRY_MODEL_CONTROL_MODE", default_value = "none", value_parser = ["none", "explicit"])]
    model_control_mode: String,
    /// Model to load at start in explicit mode (repeatable; `*` = all).
    #[arg(long, env = "FERRY_LOAD_MODEL", value_delimiter = ',')]
    load_model: Vec<String>,
    /// Let clients register system shared memory regions for inputs and outputs.
    #[arg(long, env = "FERRY_ALLOW_CLIENT_SHM", default_value = "false", num_args = 0..=1, default_missing_value = "true", action = ArgAction::Set)]
    allow_client_shm: bool,
    /// ONNX Runtime shared library (libonnxruntime.so); also read from ORT_DYLIB_PATH.
    #[arg(long, env = "FERRY_ONNXRUNTIME_LIBRARY")]
    onnxruntime_library: Option<PathBuf>,
    /// Server name reported by the metadata endpoint.
    #[arg(long, env = "FERRY_ID", default_value = "ferry")]
    id: String,
    /// Backend settings, as tritonserver: `onnxruntime,default-max-batch-size=4` (repeatable).
    #[arg(long, env = "FERRY_BACKEND_CONFIG")]
    backend_config: Vec<String>,
}

/// Everything the server needs to know, resolved once.
#[derive(Debug, Clone)]
pub struct Config {
    /// Empty: serve the embedded example repository.
    pub model_repositories: Vec<PathBuf>,
    pub http_addr: SocketAddr,
    pub grpc_addr: SocketAddr,
    pub metrics_addr: SocketAddr,
    /// None: no metrics endpoint.
    pub metrics: Option<MetricsSettings>,
    pub emf_interval_secs: u64,
    pub auto_complete: bool,
    pub exit_on_error: bool,
    pub strict_readiness: bool,
    pub explicit_model_control: bool,
    /// `--load-model` names (explicit mode).
    pub load_models: Vec<String>,
    pub allow_client_shm: bool,
    pub log_verbose: u32,
    pub log_format: LogFormat,
    /// Where request traces go; None = no tracing.
    pub otlp: Option<OtlpSettings>,
    /// Trace settings at start (the trace extension changes them at run time).
    pub trace: TraceSettings,
    /// RUST_LOG, when set: a tracing filter that overrides --log-verbose.
    pub log_filter: Option<String>,
    pub http_max_input_size: usize,
    pub onnxruntime_library: Option<PathBuf>,
    pub server_id: String,
    pub default_max_batch_size: i32,
    pub cores: usize,
}

impl Config {
    /// Parses the command line (and the environment). `args` includes the program name.
    pub fn from_args<I, T>(args: I) -> Result<Config, clap::Error>
    where
        I: IntoIterator<Item = T>,
        T: Into<std::ffi::OsString> + Clone,
    {
        let cli = Cli::try_parse_from(args)?;
        let a = match cli.command {
            Some(Command::Serve(a)) => a,
            None => cli.serve,
        };
        let mut default_max_batch_size = 4;
        for setting in &a.backend_config {
            match setting.split_once(',').and_then(|(b, kv)| Some((b, kv.split_once('=')?))) {
                Some(("onnxruntime", ("default-max-batch-size", v))) => {
                    default_max_batch_size = v.parse().map_err(|_| {
                        clap::Error::raw(
                            clap::error::ErrorKind::InvalidValue,
                            format!("--backend-config {setting}: '{v}' is not an integer\n"),
                        )
                    })?;
                }
                _ => {
                    return Err(clap::Error::raw(
                        clap::error::ErrorKind::InvalidValue,
                        format!("--backend-config {setting}: expected onnxruntime,default-max-batch-size=<n>\n"),
                    ));
                }
            }
        }
        let (otlp, trace) = tracing_settings(&a.trace_config, &|k| std::env::var(k).ok().filter(|v| !v.is_empty()))
            .map_err(|e| clap::Error::raw(clap::error::ErrorKind::InvalidValue, format!("--trace-config: {e}\n")))?;
        let metrics = if a.allow_metrics {
            let mut m = MetricsSettings {
                cpu: a.allow_cpu_metrics,
                gpu: a.allow_gpu_metrics,
                interval: std::time::Duration::from_secs_f64(a.metrics_interval_ms.max(1.0) / 1000.0),
                ..MetricsSettings::default()
            };
            for setting in &a.metrics_config {
                m.apply(setting).map_err(|e| {
                    clap::Error::raw(clap::error::ErrorKind::InvalidValue, format!("--metrics-config: {e}\n"))
                })?;
            }
            Some(m)
        } else {
            None
        };
        Ok(Config {
            model_repositories: a.model_repository,
            http_addr: SocketAddr::new(a.http_address, a.http_port),
            grpc_addr: SocketAddr::new(a.http_address, a.grpc_port),
            metrics_addr: SocketAddr::new(a.metrics_address.unwrap_or(a.http_address), a.metrics_port),
            metrics,
            emf_interval_secs: a.emf_interval_secs,
            auto_complete: !(a.disable_auto_complete_config || a.strict_model_config),
            exit_on_error: a.exit_on_error,
            strict_readiness: a.strict_readiness,
            explicit_model_control: a.model_control_mode == "explicit",
            load_models: a.load_model,
            allow_client_shm: a.allow_client_shm,
            log_verbose: a.log_verbose,
            log_format: match a.log_format.as_str() {
                "json" => LogFormat::Json,
                "ISO8601" => LogFormat::Iso8601,
                _ => LogFormat::Default,
            },
            otlp,
            trace,
            log_filter: std::env::var("RUST_LOG").ok().filter(|v| !v.is_empty()),
            http_max_input_size: a.http_max_input_size,
            onnxruntime_library: a
                .onnxruntime_library
                .or_else(|| std::env::var_os("ORT_DYLIB_PATH").map(PathBuf::from)),
            server_id: a.id,
            default_max_batch_size,
            cores: std::thread::available_parallelism().map_or(1, |n| n.get()),
        })
    }
}

/// Folds `--trace-config` entries and the standard OTEL_* variables into where traces go and the
/// initial trace settings. With an exporter and no level given, requests are traced at
/// TIMESTAMPS level (1 in `rate`, 1000 by default as in Triton).
fn tracing_settings(
    entries: &[String],
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<(Option<OtlpSettings>, TraceSettings), String> {
    let mut trace = TraceSettings::default();
    let (mut url, mut protocol, mut resource, mut level_given) = (None::<String>, None::<String>, Vec::new(), false);
    let mut opentelemetry = false;
    for e in entries {
        let (scope, kv) = match e.split_once(',') {
            Some((scope, kv)) if !scope.contains('=') => (scope, kv),
            _ => ("", e.as_str()),
        };
        let (key, value) = kv.split_once('=').ok_or_else(|| format!("expected key=value, got '{e}'"))?;
        match (scope, key) {
            ("", "mode") if value == "opentelemetry" => opentelemetry = true,
            ("", "mode") => return Err(format!("mode '{value}' is not supported; use mode=opentelemetry")),
            ("", "rate") => trace.trace_rate = value.to_string(),
            ("", "count") => trace.trace_count = value.to_string(),
            ("", "level") => {
                if !level_given {
                    trace.trace_level.clear();
                    level_given = true;
                }
                trace.trace_level.push(value.to_string());
            }
            ("opentelemetry", "url") => url = Some(value.to_string()),
            ("opentelemetry", "protocol") => protocol = Some(value.to_string()),
            ("opentelemetry", "resource") => {
                let (k, v) = value.split_once('=').ok_or_else(|| format!("resource needs key=value, got '{value}'"))?;
                resource.push((k.to_string(), v.to_string()));
            }
            _ => return Err(format!("unknown trace setting '{e}'")),
        }
    }
    let protocol =
        protocol.or_else(|| env("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")).or_else(|| env("OTEL_EXPORTER_OTLP_PROTOCOL"));
    let http = match protocol.as_deref() {
        None => url.is_some(), // Triton's --trace-config url is an OTLP/HTTP endpoint
        Some("grpc") => false,
        Some("http/protobuf") => true,
        Some(other) => return Err(format!("OTLP protocol '{other}' is not supported (grpc or http/protobuf)")),
    };
    let endpoint = url
        .map(|u| if u.starts_with("http") { u } else { format!("http://{u}") })
        .or_else(|| env("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"))
        .or_else(|| {
            env("OTEL_EXPORTER_OTLP_ENDPOINT")
                .map(|e| if http { format!("{}/v1/traces", e.trim_end_matches('/')) } else { e })
        });
    let Some(endpoint) = endpoint else {
        if opentelemetry {
            return Err("mode=opentelemetry needs opentelemetry,url=... or OTEL_EXPORTER_OTLP_ENDPOINT".into());
        }
        return Ok((None, trace));
    };
    if !level_given {
        trace.trace_level = vec!["TIMESTAMPS".into()];
    }
    trace.trace_mode = "opentelemetry".into();
    if let Some(attrs) = env("OTEL_RESOURCE_ATTRIBUTES") {
        resource.extend(
            attrs.split(',').filter_map(|kv| kv.split_once('=')).map(|(k, v)| (k.trim().into(), v.trim().into())),
        );
    }
    let service_name = env("OTEL_SERVICE_NAME").unwrap_or_else(|| "ferry".into());
    Ok((Some(OtlpSettings { endpoint, http, service_name, resource }), trace))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tracing_from_flags_and_environment() {
        let none = |_: &str| None;
        let (otlp, trace) = tracing_settings(&[], &none).unwrap();
        assert!(otlp.is_none());
        assert_eq!(trace.trace_level, vec!["OFF"]);
        let flags: Vec<String> = [
            "mode=opentelemetry",
            "opentelemetry,url=localhost:4318/v1/traces",
            "rate=1",
            "opentelemetry,resource=team=ml",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        let (otlp, trace) = tracing_settings(&flags, &none).unwrap();
        let otlp = otlp.unwrap();
        assert_eq!(otlp.endpoint, "http://localhost:4318/v1/traces");
        assert!(otlp.http);
        assert_eq!(otlp.resource, vec![("team".to_string(), "ml".to_string())]);
        assert_eq!((trace.trace_rate.as_str(), trace.trace_level.clone()), ("1", vec!["TIMESTAMPS".to_string()]));
        let env = |k: &str| match k {
            "OTEL_EXPORTER_OTLP_ENDPOINT" => Some("http://collector:4317".to_string()),
            "OTEL_SERVICE_NAME" => Some("svc".to_string()),
            _ => None,
        };
        let (otlp, _) = tracing_settings(&[], &env).unwrap();
        let otlp = otlp.unwrap();
        assert_eq!(
            (otlp.endpoint.as_str(), otlp.http, otlp.service_name.as_str()),
            ("http://collector:4317", false, "svc")
        );
        assert!(tracing_settings(&["mode=opentelemetry".to_string()], &none).is_err());
        assert!(tracing_settings(&["bogus".to_string()], &none).is_err());
    }

    #[test]
    fn defaults_match_tritonserver() {
        let c = Config::from_args(["ferry"]).unwrap();
        assert_eq!(c.http_addr.port(), 8000);
        assert_eq!(c.grpc_addr.port(), 8001);
        assert_eq!(c.metrics_addr.port(), 8002);
        assert!(c.auto_complete && c.exit_on_error && c.strict_readiness);
        assert_eq!(c.http_max_input_size, 64 << 20);
        assert!(c.model_repositories.is_empty());
        assert_eq!(c.default_max_batch_size, 4);
    }

    #[test]
    fn serve_subcommand_and_triton_style_booleans() {
        let c = Config::from_args([
            "ferry",
            "serve",
            "--model-repository",
            "/a",
            "--model-repository=/b",
            "--http-port=0",
            "--strict-model-config",
            "--exit-on-error=false",
            "--backend-config=onnxruntime,default-max-batch-size=0",
        ])
        .unwrap();
        assert_eq!(c.model_repositories, vec![PathBuf::from("/a"), PathBuf::from("/b")]);
        assert_eq!(c.http_addr.port(), 0);
        assert!(!c.auto_complete);
        assert!(!c.exit_on_error);
        assert_eq!(c.default_max_batch_size, 0);
        assert!(Config::from_args(["ferry", "--backend-config=tensorflow,x=1"]).is_err());
        assert!(Config::from_args(["ferry", "--http-port=notaport"]).is_err());
    }
}
