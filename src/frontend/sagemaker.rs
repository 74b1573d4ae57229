//! The SageMaker custom-container contract: `GET /ping`, `POST /invocations` (KServe v2 JSON, the
//! `application/vnd.sagemaker-triton.binary+json;json-header-size=N` binary type, or
//! `{"instances": [...]}`), `GET /execution-parameters` for batch transform, and the
//! multi-model endpoint API (`/models` load, list, get, unload, invoke).
use std::{
    collections::BTreeMap,
    net::SocketAddr,
    path::{Component, Path, PathBuf},
    sync::{Arc, Mutex},
};

use axum::{
    Router,
    body::Body,
    extract::{Path as UrlPath, Query, State},
    http::{HeaderMap, StatusCode, header},
    response::{IntoResponse, Response},
    routing::{get, post},
};
use serde_json::{Value, json};

use super::{
    generate,
    http::infer_body_with,
    http_common::{HttpState, error_response, header_str, read_request},
    instances, platform,
};
use crate::{
    error::Error,
    repository::config::CONFIG_FILE,
    request::{ParamValue, Parameters},
};

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SageMakerSettings {
    pub addr: SocketAddr,
    pub default_model: Option<String>,
    /// `/ping` answers liveness (MME default) rather than readiness.
    pub ping_live: bool,
    pub multi_model: bool,
    /// Where SageMaker extracts multi-model endpoint models (`/opt/ml/models`).
    pub models_root: PathBuf,
    pub max_concurrent_transforms: u32,
    pub batch_strategy: String,
    pub max_payload_mb: u32,
    /// What `/invocations` does (SAGEMAKER_TRITON_INFERENCE_TYPE).
    pub inference_type: InferenceType,
}

/// `SAGEMAKER_TRITON_INFERENCE_TYPE`: KServe v2 `infer` (the default), or the generate
/// extension's `generate` (one JSON object) or `generate_stream` (server-sent events), or
/// ferry's `openai` (the OpenAI API's bodies: chat, completions or embeddings).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum InferenceType {
    Infer,
    Generate,
    GenerateStream,
    OpenAi,
}

pub const BINARY_CONTENT_TYPE: &str = "application/vnd.sagemaker-triton.binary+json";
const TARGET_MODEL: &str = "x-amzn-sagemaker-target-model";
/// The header SageMaker forwards verbatim, and the request parameter the model reads it as (and
/// sets on its response for SageMaker to return to the client).
const CUSTOM_ATTRIBUTES: &str = "x-amzn-sagemaker-custom-attributes";
const ATTRIBUTES_PARAMETER: &str = CUSTOM_ATTRIBUTES;
/// Stateful sessions: the client's session id (or `NEW_SESSION`), and what the reply says.
const SESSION_ID: &str = "x-amzn-sagemaker-session-id";
const NEW_SESSION_ID: &str = "x-amzn-sagemaker-new-session-id";
const CLOSED_SESSION_ID: &str = "x-amzn-sagemaker-closed-session-id";

/// A model loaded through the multi-model API.
#[derive(Debug, Clone)]
struct Loaded {
    /// The name it serves under (the client's TargetModel when SageMaker sent it).
    name: String,
    url: String,
    /// The composing models an ensemble archive brought (unloaded with it).
    parts: Vec<String>,
}

pub struct SageMakerState {
    pub http: Arc<HttpState>,
    pub settings: SageMakerSettings,
    /// By SageMaker's model_name.
    models: Mutex<BTreeMap<String, Loaded>>,
    /// Names (SageMaker's and the one served) of loads in progress: a second load of the same
    /// name is refused at once instead of racing the first.
    loading: Mutex<std::collections::BTreeSet<String>>,
}

/// A load's hold on its names until it is over.
struct Reservation<'a> {
    state: &'a SageMakerState,
    names: [String; 2],
}

impl Drop for Reservation<'_> {
    fn drop(&mut self) {
        let mut loading = self.state.loading.lock().unwrap_or_else(|p| p.into_inner());
        for n in &self.names {
            loading.remove(n);
        }
    }
}

impl SageMakerState {
    pub fn new(http: Arc<HttpState>, settings: SageMakerSettings) -> Self {
        SageMakerState { http, settings, models: Mutex::default(), loading: Mutex::default() }
    }

    /// Reserves both names for a load, or None when either is loaded, serving or being loaded:
    /// checked and taken under one lock, with no await between.
    fn reserve(&self, model_name: &str, name: &str) -> Option<Reservation<'_>> {
        let models = self.models();
        let mut loading = self.loading.lock().unwrap_or_else(|p| p.into_inner());
        let busy = models.contains_key(model_name)
            || loading.contains(model_name)
            || loading.contains(name)
            || self.http.engine.registry().resolve(name, None).is_ok();
        if busy {
            return None;
        }
        loading.insert(model_name.to_string());
        loading.insert(name.to_string());
        Some(Reservation { state: self, names: [model_name.to_string(), name.to_string()] })
    }

    fn models(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, Loaded>> {
        self.models.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// The routes; the multi-model API (`/models`) only on a multi-model endpoint
/// (SAGEMAKER_MULTI_MODEL=true): on a single-model endpoint it would let any caller load models.
pub fn router(state: Arc<SageMakerState>) -> Router {
    let mut r = Router::new()
        .route("/ping", get(ping))
        .route("/invocations", post(invocations))
        .route("/invocations-response-stream", post(invocations_stream))
        .route("/execution-parameters", get(execution_parameters));
    if state.settings.multi_model {
        r = r
            .route("/models", post(load).get(list))
            .route("/models/{name}", get(describe).delete(unload))
            .route("/models/{name}/invoke", post(invoke));
    }
    r.fallback(|| async { (StatusCode::NOT_FOUND, axum::Json(json!({"error": "Not Found"}))) })
        .method_not_allowed_fallback(|| async {
            (StatusCode::METHOD_NOT_ALLOWED, axum::Json(json!({"error": "Method Not Allowed"})))
        })
        .with_state(state)
}

fn default_model(s: &SageMakerState) -> crate::error::Result<String> {
    platform::default_model(&s.http.engine, s.settings.default_model.as_deref(), "SAGEMAKER_TRITON_DEFAULT_MODEL_NAME")
}

/// 200 once the default model serves (or, in ping mode `live` and on multi-model endpoints,
/// while the process is up); 503 with what is happening before. Answers at once: no lock is
/// held across a load.
async fn ping(State(s): State<Arc<SageMakerState>>) -> Response {
    let engine = &s.http.engine;
    let (ready, body) = if s.settings.ping_live {
        (engine.live().is_ok(), json!({"ready": engine.live().is_ok(), "detail": "ping mode: live"}))
    } else {
        platform::health(engine, default_model(&s))
    };
    (if ready { StatusCode::OK } else { StatusCode::SERVICE_UNAVAILABLE }, axum::Json(body)).into_response()
}

/// Runs a request body on `model` and answers in SageMaker's binary content type when outputs
/// are binary.
async fn run(s: &SageMakerState, model: &str, headers: &HeaderMap, body: Body) -> Result<Response, Error> {
    let body = read_request(&s.http, headers, body).await?;
    let header_len = platform::json_header_size(header_str(headers, "content-type"), BINARY_CONTENT_TYPE)?;
    if header_len.is_none() && instances::is_instances(&body) {
        let predictions = instances::predict(&s.http.engine, model, &body).await?;
        return Ok((StatusCode::OK, axum::Json(predictions)).into_response());
    }
    let mut extra = Parameters::new();
    if let Some(v) = header_str(headers, CUSTOM_ATTRIBUTES) {
        extra.insert(ATTRIBUTES_PARAMETER.into(), ParamValue::String(v.to_string()));
    }
    let session = session(s, model, headers, &body, header_len, &mut extra)?;
    let (encoded, answered) = infer_body_with(&s.http, (model, None), body, header_len, headers, extra).await?;
    let content_type = match encoded.header_len {
        Some(n) => format!("{BINARY_CONTENT_TYPE};json-header-size={n}"),
        None => "application/json".to_string(),
    };
    let mut response = ([(header::CONTENT_TYPE, content_type)], encoded.body).into_response();
    if let Some((name, value)) = session
        && let Ok(value) = header::HeaderValue::from_str(&value)
    {
        response.headers_mut().insert(name, value);
    }
    // The model's own custom attributes, when it set them, go back in SageMaker's header.
    if let Some(ParamValue::String(v)) = answered.get(ATTRIBUTES_PARAMETER)
        && let Ok(value) = header::HeaderValue::from_str(v)
    {
        response.headers_mut().insert(CUSTOM_ATTRIBUTES, value);
    }
    Ok(response)
}

/// A stateful session (`X-Amzn-SageMaker-Session-Id`) as a sequence of the sequence batcher:
/// `NEW_SESSION` starts a sequence under a new id (answered in `X-Amzn-SageMaker-New-Session-Id`
/// with when it expires: the model's idle limit), an id continues its sequence, and a request
/// whose parameters say `sequence_end: true` ends it (answered in
/// `X-Amzn-SageMaker-Closed-Session-Id`). The header the reply carries, if any.
fn session(
    s: &SageMakerState,
    model: &str,
    headers: &HeaderMap,
    body: &[u8],
    header_len: Option<usize>,
    extra: &mut Parameters,
) -> Result<Option<(&'static str, String)>, Error> {
    let Some(id) = header_str(headers, SESSION_ID).map(str::trim) else { return Ok(None) };
    let config = s.http.engine.model_config(model, None)?;
    let Some(crate::proto::inference::model_config::SchedulingChoice::SequenceBatching(sb)) = &config.scheduling_choice
    else {
        return Err(Error::invalid(format!(
            "model '{model}' keeps no state between requests (it has no sequence_batching): {SESSION_ID} cannot be \
             used with it"
        )));
    };
    if id == "NEW_SESSION" {
        let n = new_session_id(corrid_bits(sb));
        extra.insert("sequence_id".into(), ParamValue::Uint(n));
        extra.insert("sequence_start".into(), ParamValue::Bool(true));
        let idle = match sb.max_sequence_idle_microseconds {
            0 => std::time::Duration::from_secs(1),
            us => std::time::Duration::from_micros(us),
        };
        let expires = crate::telemetry::iso8601(std::time::SystemTime::now() + idle);
        return Ok(Some((NEW_SESSION_ID, format!("{n}; Expires={expires}"))));
    }
    if id.is_empty() || id.len() > 256 || !id.bytes().all(|b| b.is_ascii_graphic()) {
        return Err(Error::invalid(format!("{SESSION_ID} must be NEW_SESSION or a session id ferry gave")));
    }
    let value = id.parse::<u64>().map_or_else(|_| ParamValue::String(id.to_string()), ParamValue::Uint);
    extra.insert("sequence_id".into(), value);
    let json = &body[..header_len.unwrap_or(body.len()).min(body.len())];
    let ends = serde_json::from_slice::<Value>(json)
        .ok()
        .is_some_and(|v| v["parameters"]["sequence_end"].as_bool() == Some(true));
    Ok(ends.then(|| (CLOSED_SESSION_ID, id.to_string())))
}

/// How many bits a session id may have: what the model's CORRID control holds (31 for a
/// 32-bit one), else 63 (the id never reaches the model).
fn corrid_bits(sb: &crate::proto::inference::ModelSequenceBatching) -> u32 {
    use crate::proto::inference::model_sequence_batching::control::Kind;
    let corrid =
        sb.control_input.iter().flat_map(|c| &c.control).find(|c| c.kind == Kind::ControlSequenceCorrid as i32);
    match corrid.and_then(|c| crate::tensor::DataType::from_config(c.data_type)) {
        Some(crate::tensor::DataType::Int32 | crate::tensor::DataType::Uint32) => 31,
        _ => 63,
    }
}

/// A new session id: random, of at most `bits` bits, never 0.
fn new_session_id(bits: u32) -> u64 {
    (super::platform::random_u64() & ((1u64 << bits) - 1)).max(1)
}

/// `/invocations`, as SAGEMAKER_TRITON_INFERENCE_TYPE says: KServe v2 infer (and Vertex-style
/// instances), or the generate extension's body answered as one object or as an event stream.
async fn invocations(State(s): State<Arc<SageMakerState>>, headers: HeaderMap, body: Body) -> Response {
    let kind = s.settings.inference_type;
    if kind == InferenceType::OpenAi {
        // The body may name the model; without a default it must.
        let model = default_model(&s).unwrap_or_default();
        return openai(&s, &model, &headers, body, false).await.unwrap_or_else(|e| error_response(&e));
    }
    let result = match default_model(&s) {
        Ok(model) => match kind {
            InferenceType::Infer => run(&s, &model, &headers, body).await,
            InferenceType::Generate => generated(&s, &model, &headers, body).await,
            InferenceType::GenerateStream => streamed(&s, &model, &headers, body).await,
            InferenceType::OpenAi => openai(&s, &model, &headers, body, false).await,
        },
        Err(e) => Err(e),
    };
    result.unwrap_or_else(|e| error_response(&e))
}

/// InvokeEndpointWithResponseStream: the generate extension's body, each response of the model
/// one server-sent event (a decoupled model streams them as it makes them).
async fn invocations_stream(State(s): State<Arc<SageMakerState>>, headers: HeaderMap, body: Body) -> Response {
    if s.settings.inference_type == InferenceType::OpenAi {
        let model = default_model(&s).unwrap_or_default();
        return openai(&s, &model, &headers, body, true).await.unwrap_or_else(|e| error_response(&e));
    }
    let result = match default_model(&s) {
        Ok(model) => streamed(&s, &model, &headers, body).await,
        Err(e) => Err(e),
    };
    result.unwrap_or_else(|e| error_response(&e))
}

/// An OpenAI API body (chat, completions or embeddings, told by its fields), for the default
/// model unless it names one; `stream`: streamed (InvokeEndpointWithResponseStream).
async fn openai(
    s: &SageMakerState,
    model: &str,
    headers: &HeaderMap,
    body: Body,
    stream: bool,
) -> Result<Response, Error> {
    let body = read_request(&s.http, headers, body).await?;
    Ok(super::openai::invoke(Arc::clone(&s.http), body, model, stream).await)
}

async fn generated(s: &SageMakerState, model: &str, headers: &HeaderMap, body: Body) -> Result<Response, Error> {
    let body = read_request(&s.http, headers, body).await?;
    let stream = generate::start_with(&s.http, model, None, body, custom_attributes(headers)).await?;
    Ok(generate::one_reply(stream).await)
}

async fn streamed(s: &SageMakerState, model: &str, headers: &HeaderMap, body: Body) -> Result<Response, Error> {
    let body = read_request(&s.http, headers, body).await?;
    let stream = generate::start_with(&s.http, model, None, body, custom_attributes(headers)).await?;
    Ok(generate::sse(stream).await)
}

/// The request's custom attributes as the request parameter the model reads them from.
fn custom_attributes(headers: &HeaderMap) -> crate::request::Parameters {
    let mut params = crate::request::Parameters::new();
    if let Some(attributes) = header_str(headers, CUSTOM_ATTRIBUTES) {
        params.insert(ATTRIBUTES_PARAMETER.into(), crate::request::ParamValue::String(attributes.to_string()));
    }
    params
}

async fn execution_parameters(State(s): State<Arc<SageMakerState>>) -> Response {
    let p = &s.settings;
    axum::Json(json!({
        "MaxConcurrentTransforms": p.max_concurrent_transforms,
        "BatchStrategy": p.batch_strategy,
        "MaxPayloadInMB": p.max_payload_mb,
    }))
    .into_response()
}

/// `<root>/<id>/model[/<subdir>]` with `id` of letters, digits, `.`, `_`, `-`.
fn check_url(root: &Path, url: &str) -> Result<PathBuf, Error> {
    let path = Path::new(url);
    let bad = || {
        Error::invalid(format!(
            "Invalid \"url\" '{url}': expected a path of the form {}/<model id>/model[/<subdir>]",
            root.display()
        ))
    };
    let rel = path.strip_prefix(root).map_err(|_| bad())?;
    let parts: Vec<&str> = rel
        .components()
        .map(|c| match c {
            Component::Normal(p) => p.to_str().ok_or_else(bad),
            _ => Err(bad()),
        })
        .collect::<Result<_, _>>()?;
    let id_ok = |id: &str| !id.is_empty() && id.chars().all(|c| c.is_ascii_alphanumeric() || "._-".contains(c));
    match parts.as_slice() {
        [id, "model"] | [id, "model", _] if id_ok(id) => Ok(path.to_path_buf()),
        _ => Err(bad()),
    }
}

/// What an extracted archive holds: the model to serve, and (for an ensemble archive) the
/// composing models beside it, by folder name.
struct Archive {
    model: PathBuf,
    parts: Vec<(String, PathBuf)>,
}

/// The model folder inside an extracted archive: the url itself when it holds config.pbtxt,
/// else its only sub-folder; of several sub-folders, the one that is an ensemble (as Triton),
/// the others being its composing models.
fn model_dir(url: &Path) -> Result<Archive, Error> {
    if url.join(CONFIG_FILE).is_file() || !crate::repository::version_dirs(url).is_empty() {
        return Ok(Archive { model: url.to_path_buf(), parts: Vec::new() });
    }
    let mut subdirs: Vec<PathBuf> = std::fs::read_dir(url)
        .map_err(|e| Error::invalid(format!("cannot read '{}': {e}", url.display())))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.is_dir())
        .collect();
    subdirs.sort();
    let is_ensemble = |d: &Path| !crate::repository::config::ensemble_steps(d, None).is_empty();
    match subdirs.as_slice() {
        [one] => Ok(Archive { model: one.clone(), parts: Vec::new() }),
        [] => Err(Error::invalid(format!("'{}' holds no model (no config.pbtxt, no version folder)", url.display()))),
        many => {
            let ensembles: Vec<&PathBuf> = many.iter().filter(|d| is_ensemble(d)).collect();
            let [ensemble] = ensembles.as_slice() else {
                return Err(Error::invalid(format!(
                    "'{}' holds {} folders and {} ensembles; expected one model folder, or one ensemble with its composing models",
                    url.display(),
                    many.len(),
                    ensembles.len()
                )));
            };
            if many.len() > 5 {
                tracing::warn!(url = %url.display(), folders = many.len(), "a large ensemble archive");
            }
            let parts = many
                .iter()
                .filter(|d| d != ensemble)
                .filter_map(|d| Some((d.file_name()?.to_str()?.to_string(), d.clone())))
                .collect();
            Ok(Archive { model: (*ensemble).clone(), parts })
        }
    }
}

/// Failures SageMaker should answer by unloading other models: out of memory or disk.
fn out_of_memory(message: &str) -> bool {
    [
        "out of memory",
        "Out of memory",
        "OutOfMemory",
        "MemoryError",
        "Failed to allocate memory",
        "No space left on device",
        "OOM",
    ]
    .iter()
    .any(|m| message.contains(m))
}

async fn load(State(s): State<Arc<SageMakerState>>, headers: HeaderMap, body: axum::body::Bytes) -> Response {
    let doc: Value = match serde_json::from_slice(&body) {
        Ok(v) => v,
        Err(e) => return error_response(&Error::invalid(format!("failed to parse the load request JSON: {e}"))),
    };
    let (Some(model_name), Some(url)) = (doc["model_name"].as_str(), doc["url"].as_str()) else {
        return error_response(&Error::invalid("the load request needs \"model_name\" and \"url\""));
    };
    let name = header_str(&headers, TARGET_MODEL).unwrap_or(model_name).to_string();
    // A load never replaces a model that serves (another endpoint model under the same name),
    // nor races another load of it.
    let Some(_reserved) = s.reserve(model_name, &name) else {
        return (StatusCode::CONFLICT, axum::Json(json!({"error": format!("model '{model_name}' is already loaded")})))
            .into_response();
    };
    let archive = match check_url(&s.settings.models_root, url).and_then(|u| model_dir(&u)) {
        Ok(d) => d,
        Err(e) => return error_response(&e),
    };
    let repository = s.http.engine.repository();
    let mut parts = Vec::new();
    let mut outcome = Ok(());
    for (part, dir) in &archive.parts {
        outcome = repository.load_dir(part, dir).await;
        if outcome.is_err() {
            break;
        }
        parts.push(part.clone());
    }
    if outcome.is_ok() {
        outcome = repository.load_dir(&name, &archive.model).await;
    }
    if outcome.is_err() {
        for part in &parts {
            let _ = repository.unload_any(part, false).await;
        }
    }
    match outcome {
        Ok(()) => {
            s.models().insert(model_name.to_string(), Loaded { name, url: url.to_string(), parts });
            StatusCode::OK.into_response()
        }
        Err(e) if out_of_memory(e.message()) => {
            (StatusCode::INSUFFICIENT_STORAGE, axum::Json(json!({"error": e.message()}))).into_response()
        }
        Err(e) => error_response(&e),
    }
}

#[derive(serde::Deserialize)]
struct Page {
    next_page_token: Option<String>,
}

const PAGE: usize = 1000;

async fn list(State(s): State<Arc<SageMakerState>>, Query(page): Query<Page>) -> Response {
    let start: usize = page.next_page_token.and_then(|t| t.parse().ok()).unwrap_or(0);
    let models = s.models();
    let entries: Vec<Value> =
        models.iter().skip(start).take(PAGE).map(|(k, m)| json!({"modelName": k, "modelUrl": m.url})).collect();
    let mut body = json!({ "models": entries });
    if start + PAGE < models.len() {
        body["nextPageToken"] = Value::String((start + PAGE).to_string());
    }
    axum::Json(body).into_response()
}

fn not_loaded(name: &str) -> Response {
    (StatusCode::NOT_FOUND, axum::Json(json!({"error": format!("model '{name}' is not loaded")}))).into_response()
}

async fn describe(State(s): State<Arc<SageMakerState>>, UrlPath(name): UrlPath<String>) -> Response {
    match s.models().get(&name) {
        Some(m) => axum::Json(json!({"modelName": name, "modelUrl": m.url})).into_response(),
        None => not_loaded(&name),
    }
}

async fn unload(State(s): State<Arc<SageMakerState>>, UrlPath(name): UrlPath<String>) -> Response {
    let Some(loaded) = s.models().remove(&name) else { return not_loaded(&name) };
    let repository = s.http.engine.repository();
    let mut outcome = repository.unload_any(&loaded.name, true).await;
    // An ensemble archive's composing models leave with it.
    for part in &loaded.parts {
        outcome = outcome.and(repository.unload_any(part, false).await);
    }
    match outcome {
        Ok(()) => StatusCode::OK.into_response(),
        Err(e) => error_response(&e),
    }
}

async fn invoke(
    State(s): State<Arc<SageMakerState>>,
    UrlPath(name): UrlPath<String>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let Some(loaded) = s.models().get(&name).cloned() else { return not_loaded(&name) };
    match run(&s, &loaded.name, &headers, body).await {
        Ok(r) => r,
        Err(e) if out_of_memory(e.message()) => {
            (StatusCode::INSUFFICIENT_STORAGE, axum::Json(json!({"error": e.message()}))).into_response()
        }
        Err(e) => error_response(&e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn model_urls_stay_under_the_root() {
        let root = Path::new("/opt/ml/models");
        assert!(check_url(root, "/opt/ml/models/abc123/model").is_ok());
        assert!(check_url(root, "/opt/ml/models/abc.1_2/model/sub").is_ok());
        for bad in [
            "/proc/self",
            "/opt/ml/models/../etc/model",
            "/opt/ml/models/x/other",
            "/opt/ml/models/x/model/a/b",
            "relative",
        ] {
            assert!(check_url(root, bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn memory_failures_are_recognised() {
        assert!(out_of_memory("CUDA out of memory. Tried to allocate"));
        assert!(!out_of_memory("model file not found"));
    }
}
