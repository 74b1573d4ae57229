//! Which platform ferry runs on, and what that platform's environment decides: Vertex AI
//! (`AIP_*`), SageMaker (`serve`, `SAGEMAKER_*`, `/opt/ml`), or plain KServe v2. Flags override.
use std::net::SocketAddr;

use super::ServeArgs;
use crate::frontend::{
    sagemaker::{InferenceType, SageMakerSettings},
    vertex::VertexSettings,
};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    KServe,
    Vertex,
    SageMaker,
}

impl Mode {
    pub fn name(self) -> &'static str {
        match self {
            Mode::KServe => "kserve",
            Mode::Vertex => "vertex",
            Mode::SageMaker => "sagemaker",
        }
    }
}

/// Everything the platform decides, resolved once.
#[derive(Debug, Clone, PartialEq)]
pub struct Platform {
    pub mode: Mode,
    /// The KServe v2 listeners.
    pub http: bool,
    pub grpc: bool,
    pub grpc_port: u16,
    pub metrics: bool,
    pub metrics_port: u16,
    pub vertex: Option<VertexSettings>,
    pub sagemaker: Option<SageMakerSettings>,
    pub max_input_size: usize,
    /// What the 413 message adds about the platform's own limit.
    pub size_note: String,
    /// The model repository the platform provides, when no --model-repository is given.
    pub repository: Option<String>,
    pub emf_interval_secs: u64,
    pub log_verbose: Option<u32>,
    pub explicit_model_control: bool,
}

type Env<'a> = &'a dyn Fn(&str) -> Option<String>;

fn flag(env: Env<'_>, key: &str) -> Option<bool> {
    env(key).map(|v| matches!(v.to_ascii_lowercase().as_str(), "true" | "1" | "yes"))
}

fn env_port(env: Env<'_>, key: &str) -> Result<Option<u16>, String> {
    env(key).map(|v| v.trim().parse::<u16>().map_err(|_| format!("{key}={v} is not a port number"))).transpose()
}

/// `SAGEMAKER_SAFE_PORT_RANGE` (`LOW-HIGH`): extra listeners must lie inside it.
fn check_safe(range: Option<&str>, what: &str, p: u16) -> Result<(), String> {
    let Some(range) = range else { return Ok(()) };
    let (lo, hi) = range
        .split_once('-')
        .and_then(|(a, b)| Some((a.trim().parse::<u16>().ok()?, b.trim().parse::<u16>().ok()?)))
        .ok_or_else(|| format!("SAGEMAKER_SAFE_PORT_RANGE={range} is not LOW-HIGH"))?;
    if p != 0 && !(lo..=hi).contains(&p) {
        return Err(format!(
            "The server cannot listen to {what} requests at port {p}, allowed port range is [{lo}, {hi}] (SAGEMAKER_SAFE_PORT_RANGE)"
        ));
    }
    Ok(())
}

const MIB: usize = 1 << 20;

pub(super) fn resolve(
    a: &ServeArgs,
    env: Env<'_>,
    sagemaker_env: bool,
    opt_ml_exists: bool,
) -> Result<Platform, String> {
    let mode = match a.mode.as_str() {
        "vertex" => Mode::Vertex,
        "sagemaker" => Mode::SageMaker,
        "kserve" => Mode::KServe,
        _ if env("AIP_MODE").as_deref() == Some("PREDICTION") => Mode::Vertex,
        _ if sagemaker_env || opt_ml_exists => Mode::SageMaker,
        _ => Mode::KServe,
    };
    let mut p = Platform {
        mode,
        http: a.allow_http.unwrap_or(mode == Mode::KServe),
        grpc: a.allow_grpc.unwrap_or(mode == Mode::KServe),
        grpc_port: a.grpc_port,
        metrics: a.allow_metrics,
        metrics_port: a.metrics_port,
        vertex: None,
        sagemaker: None,
        max_input_size: a.http_max_input_size.unwrap_or(64 * MIB),
        size_note: String::new(),
        repository: None,
        emf_interval_secs: a.emf_interval_secs.unwrap_or(0),
        log_verbose: None,
        explicit_model_control: a.model_control_mode == "explicit",
    };
    match mode {
        Mode::KServe => {}
        Mode::Vertex => vertex(a, env, &mut p)?,
        Mode::SageMaker => sagemaker(a, env, &mut p)?,
    }
    Ok(p)
}

fn vertex(a: &ServeArgs, env: Env<'_>, p: &mut Platform) -> Result<(), String> {
    let port = a.vertex_ai_port.or(env_port(env, "AIP_HTTP_PORT")?).unwrap_or(8080);
    let route = |key: &str, fallback: &str| {
        env(key).unwrap_or_else(|| {
            tracing::warn!("{key} is not set (not on Vertex AI?): using {fallback}");
            fallback.to_string()
        })
    };
    p.vertex = Some(VertexSettings {
        addr: SocketAddr::new(a.http_address, port),
        health_route: route("AIP_HEALTH_ROUTE", "/health"),
        predict_route: route("AIP_PREDICT_ROUTE", "/predict"),
        default_model: a.vertex_ai_default_model.clone(),
    });
    if a.http_max_input_size.is_none() {
        p.max_input_size = 1_500_000;
        p.size_note = "Vertex AI shared public endpoints accept 1.5 MB; dedicated endpoints 10 MB".into();
    }
    p.repository = env("AIP_STORAGE_URI").filter(|u| !u.trim().is_empty());
    // gRPC through Vertex (dedicated endpoints): the container's gRPC port is its `grpcPorts`.
    if let Some(port) = a.vertex_ai_grpc_port.or(env_port(env, "AIP_GRPC_PORT")?) {
        p.grpc = a.allow_grpc.unwrap_or(true);
        p.grpc_port = port;
    }
    Ok(())
}

fn sagemaker(a: &ServeArgs, env: Env<'_>, p: &mut Platform) -> Result<(), String> {
    let port = env_port(env, "SAGEMAKER_BIND_TO_PORT")?.or(a.sagemaker_port).unwrap_or(8080);
    let safe = env("SAGEMAKER_SAFE_PORT_RANGE").or_else(|| a.sagemaker_safe_port_range.clone());
    if let Some(on) = flag(env, "SAGEMAKER_TRITON_ALLOW_GRPC").or(a.allow_grpc) {
        p.grpc = on;
    }
    if let Some(gp) = env_port(env, "SAGEMAKER_TRITON_GRPC_PORT")? {
        p.grpc_port = gp;
    }
    p.metrics = flag(env, "SAGEMAKER_TRITON_ALLOW_METRICS").unwrap_or(false) && a.allow_metrics;
    if let Some(mp) = env_port(env, "SAGEMAKER_TRITON_METRICS_PORT")? {
        p.metrics_port = mp;
    }
    if p.grpc {
        check_safe(safe.as_deref(), "GRPC", p.grpc_port)?;
    }
    if p.metrics {
        check_safe(safe.as_deref(), "metrics", p.metrics_port)?;
    }
    if p.http {
        check_safe(safe.as_deref(), "HTTP", a.http_port)?;
    }
    let multi_model = flag(env, "SAGEMAKER_MULTI_MODEL").unwrap_or(false);
    let ping_live = match env("SAGEMAKER_TRITON_OVERRIDE_PING_MODE").as_deref() {
        Some("live") => true,
        Some("ready") => false,
        Some(other) => return Err(format!("SAGEMAKER_TRITON_OVERRIDE_PING_MODE={other}: expected ready or live")),
        None => multi_model,
    };
    let inference_type = match env("SAGEMAKER_TRITON_INFERENCE_TYPE").as_deref() {
        None | Some("infer") => InferenceType::Infer,
        Some("generate") => InferenceType::Generate,
        Some("generate_stream") => InferenceType::GenerateStream,
        Some("openai") => InferenceType::OpenAi,
        Some(other) => {
            return Err(format!(
                "SAGEMAKER_TRITON_INFERENCE_TYPE={other}: expected infer, generate, generate_stream or openai"
            ));
        }
    };
    let batch = flag(env, "SAGEMAKER_BATCH").unwrap_or(false);
    let max_payload_mb = env("SAGEMAKER_MAX_PAYLOAD_IN_MB").and_then(|v| v.parse().ok()).unwrap_or(6);
    p.sagemaker = Some(SageMakerSettings {
        addr: SocketAddr::new(a.http_address, port),
        default_model: env("SAGEMAKER_TRITON_DEFAULT_MODEL_NAME"),
        ping_live,
        multi_model,
        models_root: a.sagemaker_models_root.clone(),
        max_concurrent_transforms: env("SAGEMAKER_MAX_CONCURRENT_TRANSFORMS").and_then(|v| v.parse().ok()).unwrap_or(1),
        batch_strategy: env("SAGEMAKER_BATCH_STRATEGY").unwrap_or_else(|| "SINGLE_RECORD".into()),
        max_payload_mb,
        inference_type,
    });
    if a.http_max_input_size.is_none() {
        p.max_input_size = max_payload_mb as usize * MIB;
        p.size_note = if batch {
            format!("this batch transform job sends at most {max_payload_mb} MB (SAGEMAKER_MAX_PAYLOAD_IN_MB)")
        } else {
            "SageMaker real-time endpoints accept 6 MiB".into()
        };
    }
    if multi_model {
        p.explicit_model_control = true;
    } else {
        p.repository = Some(a.sagemaker_model_dir.display().to_string());
    }
    p.emf_interval_secs = a.emf_interval_secs.unwrap_or(60);
    p.log_verbose = env("SAGEMAKER_TRITON_LOG_VERBOSE").and_then(|v| match v.to_ascii_lowercase().as_str() {
        "true" => Some(1),
        "false" => Some(0),
        n => n.parse().ok(),
    });
    Ok(())
}

#[cfg(test)]
mod tests;
