//! The command line and the environment, folded once at start-up into one `Config`. The only
//! module that reads environment variables. Flag names follow tritonserver's where they exist;
//! every flag can also come from a `FERRY_*` variable.
use std::{
    net::{IpAddr, SocketAddr},
    path::PathBuf,
};

use clap::{ArgAction, Args, Parser, Subcommand};

use crate::{
    backend::python::PythonSettings,
    cache::CacheSettings,
    frontend::{net::Network, restrict::Restrictions, tls::Tls},
    metrics::MetricsSettings,
    repository::control::ControlMode,
    settings::TraceSettings,
    telemetry::{LogFormat, otel::OtlpSettings},
};

mod cache;
mod network;
mod platform;
mod storage;
mod tls;
mod tracing;
mod triton_flags;
mod tune;

pub use platform::{Mode, Platform};
pub use storage::Storage;
pub use tune::{Objective, Percentile, TuneSettings, is_folder};

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
    Serve(Box<ServeArgs>),
    /// Measure models on this machine (one, or several sharing it under a traffic mix) over a sweep
    /// of instance counts, threads, batch sizes and queue delays, within latency, throughput and
    /// memory constraints; recommend a config.pbtxt per model, with an HTML report and the sizing
    /// for the platforms (Model Analyzer's job).
    Tune(Box<tune::TuneArgs>),
}

/// What the command line asks for.
#[derive(Debug)]
pub enum Invocation {
    Serve(Box<Config>),
    /// The engine's config (the repository, explicit model control, no listeners) and the run's.
    Tune(Box<Config>, Box<TuneSettings>),
}

impl Invocation {
    /// Parses the command line (and the environment). `args` includes the program name.
    pub fn from_args<I, T>(args: I) -> Result<Invocation, clap::Error>
    where
        I: IntoIterator<Item = T>,
        T: Into<std::ffi::OsString> + Clone,
    {
        let args: Vec<std::ffi::OsString> = args.into_iter().map(Into::into).collect();
        let translated = triton_flags::translate(args).map_err(invalid)?;
        let cli = Cli::try_parse_from(translated.args)?;
        let serve = |a: ServeArgs| -> Result<Invocation, clap::Error> {
            let mut config = Config::resolve(a)?;
            config.flag_notes = translated.notes.clone();
            Ok(Invocation::Serve(Box::new(config)))
        };
        match cli.command {
            Some(Command::Serve(a)) => serve(*a),
            None => serve(cli.serve),
            Some(Command::Tune(t)) => {
                let mut serve: Vec<String> = [
                    "ferry",
                    "serve",
                    "--model-control-mode=explicit",
                    "--mode=kserve",
                    "--allow-metrics=false",
                    "--exit-on-error=true",
                ]
                .iter()
                .map(|s| s.to_string())
                .collect();
                serve.push(format!("--model-repository={}", t.model_repository));
                if let Some(lib) = &t.onnxruntime_library {
                    serve.push(format!("--onnxruntime-library={}", lib.display()));
                }
                serve.extend(t.backend_config.iter().map(|b| format!("--backend-config={b}")));
                let config = match Cli::try_parse_from(serve)?.command {
                    Some(Command::Serve(a)) => Config::resolve(*a)?,
                    _ => unreachable!("the serve command was given"),
                };
                let settings = t.settings(config.cores)?;
                Ok(Invocation::Tune(Box::new(config), Box::new(settings)))
            }
        }
    }
}

/// Boolean flags read `--flag`, `--flag=true` or `--flag=false`, like tritonserver's.
#[derive(Args, Debug, Clone)]
struct ServeArgs {
    /// Model repository (repeatable): a folder, or `gs://bucket/prefix`, `s3://bucket/prefix`,
    /// `az://container/prefix`. Without one, the embedded example repository is served.
    #[arg(long = "model-repository", env = "FERRY_MODEL_REPOSITORY", value_delimiter = ',')]
    model_repository: Vec<String>,
    #[command(flatten)]
    storage: storage::StorageArgs,
    #[command(flatten)]
    cache: cache::CacheArgs,
    #[command(flatten)]
    network: network::NetworkArgs,
    #[command(flatten)]
    tls: tls::TlsArgs,
    /// HTTP port for KServe v2 (0 = any free port).
    #[arg(long, env = "FERRY_HTTP_PORT", default_value_t = 8000)]
    http_port: u16,
    #[arg(long, env = "FERRY_HTTP_ADDRESS", default_value = "0.0.0.0")]
    http_address: IpAddr,
    /// gRPC port for KServe v2 (0 = any free port).
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
    /// Print the autoscaling signal as CloudWatch embedded-metric log lines every N seconds
    /// (0 = off; 60 on SageMaker).
    #[arg(long, env = "FERRY_EMF_INTERVAL_SECS")]
    emf_interval_secs: Option<u64>,
    /// `auto` (from the environment: AIP_MODE=PREDICTION → vertex; SAGEMAKER_* or /opt/ml → sagemaker;
    /// else kserve), `kserve`, `vertex` or `sagemaker`.
    #[arg(long, env = "FERRY_MODE", default_value = "auto", value_parser = ["auto", "kserve", "vertex", "sagemaker"])]
    mode: String,
    /// Serve KServe v2 over HTTP on --http-port (default: on in kserve mode only).
    #[arg(long, env = "FERRY_ALLOW_HTTP", num_args = 0..=1, default_missing_value = "true", action = ArgAction::Set)]
    allow_http: Option<bool>,
    /// Serve KServe v2 over gRPC on --grpc-port (default: on in kserve mode only).
    #[arg(long, env = "FERRY_ALLOW_GRPC", num_args = 0..=1, default_missing_value = "true", action = ArgAction::Set)]
    allow_grpc: Option<bool>,
    /// Vertex AI listener port (default AIP_HTTP_PORT, else 8080).
    #[arg(long, env = "FERRY_VERTEX_AI_PORT")]
    vertex_ai_port: Option<u16>,
    /// The model Vertex AI predict requests go to (default: the only model).
    #[arg(long, env = "FERRY_VERTEX_AI_DEFAULT_MODEL")]
    vertex_ai_default_model: Option<String>,
    /// Vertex AI dedicated endpoints forward gRPC to the first of the model's `grpcPorts`: give
    /// that port here (also AIP_GRPC_PORT) and ferry serves KServe v2 gRPC on it in Vertex mode.
    #[arg(long, env = "FERRY_VERTEX_AI_GRPC_PORT")]
    vertex_ai_grpc_port: Option<u16>,
    /// SageMaker listener port (SAGEMAKER_BIND_TO_PORT wins; default 8080).
    #[arg(long, env = "FERRY_SAGEMAKER_PORT")]
    sagemaker_port: Option<u16>,
    /// Ports other listeners may use on SageMaker, LOW-HIGH (SAGEMAKER_SAFE_PORT_RANGE wins).
    #[arg(long, env = "FERRY_SAGEMAKER_SAFE_PORT_RANGE")]
    sagemaker_safe_port_range: Option<String>,
    /// Where SageMaker extracts the model (read only; never written to).
    #[arg(long, env = "FERRY_SAGEMAKER_MODEL_DIR", default_value = "/opt/ml/model")]
    sagemaker_model_dir: PathBuf,
    /// Where SageMaker puts multi-model endpoint models.
    #[arg(long, env = "FERRY_SAGEMAKER_MODELS_ROOT", default_value = "/opt/ml/models")]
    sagemaker_models_root: PathBuf,
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
    /// `execution_count`: instances run only while the resources their `rate_limiter` names are
    /// free, priorities sharing the turns (Triton's rate limiter); `off` (default): not limited.
    #[arg(long, env = "FERRY_RATE_LIMIT", default_value = "off", value_parser = ["off", "execution_count"])]
    rate_limit: String,
    /// A rate-limiter resource's count, `<name>:<count>[:<device>]` (repeatable; default: the most
    /// any one instance needs).
    #[arg(long = "rate-limit-resource", env = "FERRY_RATE_LIMIT_RESOURCE", value_delimiter = ',')]
    rate_limit_resource: Vec<String>,
    /// Largest HTTP request body, in bytes, also after decompression (default 64 MiB; on Vertex AI
    /// 1.5 MB, on SageMaker 6 MiB: the platforms' own limits).
    #[arg(long, env = "FERRY_HTTP_MAX_INPUT_SIZE")]
    http_max_input_size: Option<usize>,
    /// `none`: load every model at start; `explicit`: load `--load-model` models, then the
    /// repository API loads and unloads; `poll`: load every model, then follow the repositories'
    /// changes every `--repository-poll-secs`.
    #[arg(long, env = "FERRY_MODEL_CONTROL_MODE", default_value = "none", value_parser = ["none", "explicit", "poll"], ignore_case = true)]
    model_control_mode: String,
    /// Model to load at start in explicit mode (repeatable; `*` = all).
    #[arg(long, env = "FERRY_LOAD_MODEL", value_delimiter = ',')]
    load_model: Vec<String>,
    /// Each model repository is a namespace (Triton's flag): models of one name in several
    /// repositories all load; an ensemble's steps prefer its own repository's models; a name
    /// alone addresses a model while only one repository has it (`<i>::<name>` addresses the
    /// one of the i-th repository, counting from 0).
    #[arg(long, env = "FERRY_MODEL_NAMESPACING", default_value = "false", num_args = 0..=1, default_missing_value = "true", action = ArgAction::Set)]
    model_namespacing: bool,
    /// A request that finds its model idle runs at once instead of waiting out the model's
    /// max_queue_delay_microseconds for company, while the model's requests lately came one at a
    /// time (each of its last 8 found it idle). The first request that arrives while another
    /// is queued or running brings the wait back. Off: every lone request waits, as Triton's.
    #[arg(long, env = "FERRY_ADAPTIVE_QUEUE_DELAY", default_value = "false", num_args = 0..=1, default_missing_value = "true", action = ArgAction::Set)]
    adaptive_queue_delay: bool,
    /// Let clients register system shared memory regions for inputs and outputs.
    #[arg(long, env = "FERRY_ALLOW_CLIENT_SHM", default_value = "false", num_args = 0..=1, default_missing_value = "true", action = ArgAction::Set)]
    allow_client_shm: bool,
    /// ONNX Runtime shared library (libonnxruntime.so); also read from ORT_DYLIB_PATH.
    #[arg(long, env = "FERRY_ONNXRUNTIME_LIBRARY")]
    onnxruntime_library: Option<PathBuf>,
    /// API categories that need a header: `<category,...>:<header>=<value>` (repeatable;
    /// categories health, metadata, inference, shared-memory, model-config, model-repository,
    /// statistics, trace, logging). Applies to the HTTP, Vertex AI and SageMaker listeners.
    #[arg(long, env = "FERRY_HTTP_RESTRICTED_API")]
    http_restricted_api: Vec<String>,
    /// The same for gRPC.
    #[arg(long, env = "FERRY_GRPC_RESTRICTED_PROTOCOL")]
    grpc_restricted_protocol: Vec<String>,
    /// Request headers whose names match this regular expression (case-insensitively) become
    /// request parameters that models see (tritonserver's flag).
    #[arg(long, env = "FERRY_HTTP_HEADER_FORWARD_PATTERN")]
    http_header_forward_pattern: Option<String>,
    /// The key the OpenAI API routes (`/v1/...`) ask for as `Authorization: Bearer <key>`
    /// (unset: they are open, or restricted as the `inference` and `model-repository`
    /// categories of `--http-restricted-api`).
    #[arg(long, env = "FERRY_OPENAI_API_KEY", hide_env_values = true)]
    openai_api_key: Option<String>,
    /// The same for gRPC request metadata.
    #[arg(long, env = "FERRY_GRPC_HEADER_FORWARD_PATTERN")]
    grpc_header_forward_pattern: Option<String>,
    /// Server name reported by the metadata endpoint.
    #[arg(long, env = "FERRY_ID", default_value = "ferry")]
    id: String,
    /// Backend settings, as tritonserver (repeatable): `onnxruntime,default-max-batch-size=4`,
    /// `python,executable=<path>`, `python,stub-timeout-seconds=30`, `python,execute-timeout-seconds=0`.
    #[arg(long, env = "FERRY_BACKEND_CONFIG")]
    backend_config: Vec<String>,
    /// Where Python-based backends are: `backend: "<name>"` that ferry does not build in runs
    /// `<dir>/<name>/model.py` as a Python model (Triton's vLLM and TensorRT-LLM backends ship
    /// so). Default: `backends/` beside the binary.
    #[arg(long, env = "FERRY_BACKEND_DIRECTORY")]
    backend_directory: Option<PathBuf>,
}

/// A flag's value that cannot be used, worded for the operator.
fn invalid(message: impl std::fmt::Display) -> clap::Error {
    clap::Error::raw(clap::error::ErrorKind::InvalidValue, format!("{message}\n"))
}

fn forward_pattern(flag: &str, pattern: Option<String>) -> Result<Option<regex::Regex>, clap::Error> {
    pattern
        .map(|p| {
            regex::RegexBuilder::new(&p)
                .case_insensitive(true)
                .build()
                .map_err(|e| invalid(format!("{flag} '{p}' is not a regular expression: {e}")))
        })
        .transpose()
}

/// Everything the server needs to know, resolved once.
#[derive(Debug, Clone)]
pub struct Config {
    /// Folders or storage URLs; empty: serve the embedded example repository.
    pub model_repositories: Vec<String>,
    pub storage: Storage,
    /// The response cache's tiers; None = no cache.
    pub cache: Option<CacheSettings>,
    pub http_addr: SocketAddr,
    pub grpc_addr: SocketAddr,
    pub metrics_addr: SocketAddr,
    /// None: no metrics endpoint.
    pub metrics: Option<MetricsSettings>,
    pub emf_interval_secs: u64,
    /// The platform, and what its environment decided.
    pub platform: Platform,
    pub auto_complete: bool,
    pub exit_on_error: bool,
    pub strict_readiness: bool,
    pub control: ControlMode,
    /// `--load-model` names (explicit mode).
    pub load_models: Vec<String>,
    /// `--model-namespacing`: each repository is a namespace.
    pub model_namespacing: bool,
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
    /// `--rate-limit=execution_count`: the resource counts the flags give (None: off).
    pub rate_limit: Option<crate::scheduler::rate_limit::Given>,
    /// Connections, timeouts, gRPC limits, the admission budget, the drain deadline.
    pub network: Network,
    /// Said in 413 replies: the platform's own limit.
    pub size_note: String,
    pub onnxruntime_library: Option<PathBuf>,
    pub server_id: String,
    pub default_max_batch_size: i32,
    /// `--adaptive-queue-delay`: lone requests skip the queue delay while requests come one at a time.
    pub adaptive_queue_delay: bool,
    /// How Python models run (`--backend-config python,...`).
    pub python: PythonSettings,
    /// The Python that runs PyTorch models (`--backend-config pytorch,python=<path>`, else
    /// `FERRY_PYTORCH_PYTHON`; None: found as `backend::pytorch` says).
    pub pytorch_python: Option<PathBuf>,
    /// The XGBoost and LightGBM libraries of FIL models (`--backend-config fil,xgboost-library=`,
    /// `fil,lightgbm-library=`, else `FERRY_XGBOOST_LIBRARY` / `FERRY_LIGHTGBM_LIBRARY`; None:
    /// found as `backend::library` says).
    pub xgboost_library: Option<PathBuf>,
    pub lightgbm_library: Option<PathBuf>,
    /// OpenVINO's C library (`--backend-config openvino,library=`, else `FERRY_OPENVINO_LIBRARY`;
    /// None: found as `backend::library` says).
    pub openvino_library: Option<PathBuf>,
    /// TLS of the HTTP listeners and of gRPC (None: plain TCP).
    pub http_tls: Option<Tls>,
    pub grpc_tls: Option<Tls>,
    /// Restricted API categories of the HTTP listeners and of gRPC.
    pub http_restricted: Restrictions,
    pub grpc_restricted: Restrictions,
    /// Header names forwarded as request parameters (HTTP, gRPC), compiled case-insensitively.
    pub http_header_forward: Option<regex::Regex>,
    pub grpc_header_forward: Option<regex::Regex>,
    /// --openai-api-key
    pub openai_api_key: Option<String>,
    pub cores: usize,
    /// tritonserver flags taken but without effect, said once at start-up.
    pub flag_notes: Vec<String>,
}

impl Config {
    /// Parses the command line (and the environment). `args` includes the program name.
    pub fn from_args<I, T>(args: I) -> Result<Config, clap::Error>
    where
        I: IntoIterator<Item = T>,
        T: Into<std::ffi::OsString> + Clone,
    {
        match Invocation::from_args(args)? {
            Invocation::Serve(c) => Ok(*c),
            Invocation::Tune(..) => Err(invalid("expected the serve command")),
        }
    }

    fn resolve(mut a: ServeArgs) -> Result<Config, clap::Error> {
        // Triton takes the mode in any case (`--model-control-mode=POLL`).
        a.model_control_mode.make_ascii_lowercase();
        let mut default_max_batch_size = 4;
        let mut python = PythonSettings::default();
        let mut pytorch_python = None;
        let (mut xgboost_library, mut lightgbm_library, mut openvino_library) = (None, None, None);
        for setting in &a.backend_config {
            let number = |v: &str| {
                v.parse::<u64>().map_err(|_| invalid(format!("--backend-config {setting}: '{v}' is not an integer")))
            };
            match setting.split_once(',').and_then(|(b, kv)| Some((b, kv.split_once('=')?))) {
                Some(("onnxruntime", ("default-max-batch-size", v))) => {
                    default_max_batch_size = number(v)?.min(i32::MAX as u64) as i32;
                }
                Some(("python", ("executable", v))) => python.executable = Some(PathBuf::from(v)),
                Some(("pytorch", ("python", v))) => pytorch_python = Some(PathBuf::from(v)),
                Some(("fil", ("xgboost-library", v))) => xgboost_library = Some(PathBuf::from(v)),
                Some(("fil", ("lightgbm-library", v))) => lightgbm_library = Some(PathBuf::from(v)),
                Some(("openvino", ("library", v))) => openvino_library = Some(PathBuf::from(v)),
                Some(("python", ("execute-timeout-seconds", v))) => {
                    python.execute_timeout = Some(std::time::Duration::from_secs(number(v)?)).filter(|d| !d.is_zero());
                }
                Some(("python", ("stub-timeout-seconds", v))) => {
                    python.stub_timeout = std::time::Duration::from_secs(number(v)?.max(1));
                }
                // Triton's shared-memory sizing: ferry sizes each region to what a batch needs,
                // so these are checked and accepted, not needed.
                Some((
                    "python",
                    (
                        "shm-default-byte-size"
                        | "shm-growth-byte-size"
                        | "shm-message-queue-size"
                        | "grpc-timeout-milliseconds",
                        v,
                    ),
                )) => {
                    number(v)?;
                }
                Some(("python", ("shm-region-prefix-name", _))) => {}
                _ => {
                    return Err(invalid(format!(
                        "--backend-config {setting}: expected onnxruntime,default-max-batch-size=<n>, python,executable=<path>, python,stub-timeout-seconds=<n>, python,execute-timeout-seconds=<n>, python,shm-default-byte-size=<n>, pytorch,python=<path>, fil,xgboost-library=<path>, fil,lightgbm-library=<path> or openvino,library=<path>"
                    )));
                }
            }
        }
        let env = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
        let (otlp, trace) =
            tracing::settings(&a.trace_config, &env).map_err(|e| invalid(format!("--trace-config: {e}")))?;
        let sagemaker_env = std::env::vars().any(|(k, _)| k.starts_with("SAGEMAKER_"));
        let opt_ml = std::path::Path::new("/opt/ml/model").is_dir() || std::path::Path::new("/opt/ml/models").is_dir();
        let platform = platform::resolve(&a, &env, sagemaker_env, opt_ml).map_err(invalid)?;
        if platform.max_input_size == 0 {
            return Err(invalid("--http-max-input-size must be at least 1 byte, got 0"));
        }
        let metrics = if platform.metrics {
            let mut m = MetricsSettings {
                cpu: a.allow_cpu_metrics,
                gpu: a.allow_gpu_metrics,
                interval: std::time::Duration::from_secs_f64(a.metrics_interval_ms.max(1.0) / 1000.0),
                ..MetricsSettings::default()
            };
            for setting in &a.metrics_config {
                m.apply(setting).map_err(|e| invalid(format!("--metrics-config: {e}")))?;
            }
            Some(m)
        } else {
            None
        };
        let (http_tls, grpc_tls) = a.tls.resolve().map_err(invalid)?;
        let storage = a.storage.resolve(&env);
        python.envs_dir = storage.cache_dir.join("python-envs");
        python.backend_directory = a.backend_directory.clone().unwrap_or_else(|| {
            let exe = std::env::current_exe().ok();
            exe.and_then(|e| e.parent().map(|d| d.join("backends"))).unwrap_or_else(|| PathBuf::from("backends"))
        });
        let mut model_repositories: Vec<String> = Vec::new();
        let given = if a.model_repository.is_empty() {
            platform.repository.iter().cloned().collect()
        } else {
            a.model_repository
        };
        // A repository given twice is one repository (Triton keeps them as a set).
        for r in given {
            let same = |known: &String| {
                known.trim_end_matches('/') == r.trim_end_matches('/') && !r.trim_end_matches('/').is_empty()
            };
            if !model_repositories.iter().any(same) {
                model_repositories.push(r);
            }
        }
        Ok(Config {
            model_repositories,
            http_addr: SocketAddr::new(a.http_address, a.http_port),
            grpc_addr: SocketAddr::new(a.http_address, platform.grpc_port),
            metrics_addr: SocketAddr::new(a.metrics_address.unwrap_or(a.http_address), platform.metrics_port),
            metrics,
            emf_interval_secs: platform.emf_interval_secs,
            auto_complete: !(a.disable_auto_complete_config || a.strict_model_config),
            exit_on_error: a.exit_on_error,
            strict_readiness: a.strict_readiness,
            control: match a.model_control_mode.as_str() {
                _ if platform.explicit_model_control => ControlMode::Explicit,
                "poll" => ControlMode::Poll,
                _ => ControlMode::None,
            },
            storage,
            cache: a.cache.resolve(&env).map_err(invalid)?,
            load_models: a.load_model,
            model_namespacing: a.model_namespacing,
            allow_client_shm: a.allow_client_shm,
            log_verbose: platform.log_verbose.unwrap_or(a.log_verbose),
            log_format: match a.log_format.as_str() {
                "json" => LogFormat::Json,
                "ISO8601" => LogFormat::Iso8601,
                _ => LogFormat::Default,
            },
            otlp,
            trace,
            log_filter: std::env::var("RUST_LOG").ok().filter(|v| !v.is_empty()),
            http_max_input_size: platform.max_input_size,
            rate_limit: match a.rate_limit.as_str() {
                "execution_count" => Some(
                    a.rate_limit_resource
                        .iter()
                        .map(|r| crate::scheduler::rate_limit::parse_resource(r))
                        .collect::<Result<_, _>>()
                        .map_err(invalid)?,
                ),
                _ => None,
            },
            network: a.network.resolve(platform.max_input_size).map_err(invalid)?,
            size_note: platform.size_note.clone(),
            onnxruntime_library: a
                .onnxruntime_library
                .or_else(|| std::env::var_os("ORT_DYLIB_PATH").map(PathBuf::from)),
            server_id: a.id,
            default_max_batch_size,
            adaptive_queue_delay: a.adaptive_queue_delay,
            python,
            pytorch_python: pytorch_python.or_else(|| env("FERRY_PYTORCH_PYTHON").map(PathBuf::from)),
            xgboost_library: xgboost_library.or_else(|| env("FERRY_XGBOOST_LIBRARY").map(PathBuf::from)),
            lightgbm_library: lightgbm_library.or_else(|| env("FERRY_LIGHTGBM_LIBRARY").map(PathBuf::from)),
            openvino_library: openvino_library.or_else(|| env("FERRY_OPENVINO_LIBRARY").map(PathBuf::from)),
            http_tls,
            grpc_tls,
            http_restricted: Restrictions::parse("http-restricted-api", "api", &a.http_restricted_api)
                .map_err(invalid)?,
            grpc_restricted: Restrictions::parse("grpc-restricted-protocol", "protocol", &a.grpc_restricted_protocol)
                .map_err(invalid)?,
            openai_api_key: a.openai_api_key.filter(|k| !k.is_empty()),
            http_header_forward: forward_pattern("--http-header-forward-pattern", a.http_header_forward_pattern)?,
            grpc_header_forward: forward_pattern("--grpc-header-forward-pattern", a.grpc_header_forward_pattern)?,
            cores: std::thread::available_parallelism().map_or(1, |n| n.get()),
            flag_notes: Vec::new(),
            platform,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
        assert_eq!(c.model_repositories, vec!["/a".to_string(), "/b".to_string()]);
        let twice =
            Config::from_args(["ferry", "--model-repository=/a", "--model-repository=/a/", "--model-repository=/b"])
                .unwrap();
        assert_eq!(twice.model_repositories, vec!["/a".to_string(), "/b".to_string()]);
        assert_eq!(c.http_addr.port(), 0);
        assert!(!c.auto_complete);
        assert!(!c.exit_on_error);
        assert_eq!(c.default_max_batch_size, 0);
        assert!(Config::from_args(["ferry", "--backend-config=tensorflow,x=1"]).is_err());
        assert!(Config::from_args(["ferry", "--http-port=notaport"]).is_err());
        for bad in ["--http-max-input-size=0", "--http-max-input-size=-5", "--max-inflight-request-bytes=0"] {
            assert!(Config::from_args(["ferry", bad]).is_err(), "{bad}");
        }
    }

    #[test]
    fn model_control_mode_in_any_case_as_triton() {
        let c = Config::from_args(["ferry", "--model-control-mode=POLL", "--model-namespacing=true"]).unwrap();
        assert!(matches!(c.control, ControlMode::Poll));
        assert!(c.model_namespacing);
        let c = Config::from_args(["ferry", "--model-control-mode", "Explicit"]).unwrap();
        assert!(matches!(c.control, ControlMode::Explicit));
        assert!(Config::from_args(["ferry", "--model-control-mode=sometimes"]).is_err());
    }
}
