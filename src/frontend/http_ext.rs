//! The HTTP routes of Triton's protocol extensions besides inference: model repository, trace
//! and log settings, and shared memory. Each translates into one engine call.
use std::sync::Arc;

use axum::{
    Router,
    body::{Body, Bytes},
    extract::{Path, State},
    http::{HeaderMap, StatusCode},
    response::{IntoResponse, Response},
    routing::{get, post},
};
use base64::Engine as _;
use serde_json::{Map, Value, json};

use super::http_common::{HttpState, error_response, read_request};
use crate::{
    error::{Error, Result},
    repository::{control::LoadRequest, registry::IndexEntry},
    settings::{LogSettings, LogUpdate, TraceSettings, TraceUpdate},
};

type AppState = State<Arc<HttpState>>;

pub fn routes() -> Router<Arc<HttpState>> {
    Router::new()
        .route("/v2/repository/index", post(index))
        .route("/v2/repository/{repo}/index", post(index_in))
        .route("/v2/repository/models/{model}/load", post(load))
        .route("/v2/repository/models/{model}/unload", post(unload))
        .route("/v2/repository/{repo}/models/{model}/load", post(named_repository))
        .route("/v2/repository/{repo}/models/{model}/unload", post(named_repository))
        .route("/v2/trace/setting", get(trace_get).post(trace_post))
        .route("/v2/models/{model}/trace/setting", get(model_trace_get).post(model_trace_post))
        .route("/v2/logging", get(logging_get).post(logging_post))
        .route("/v2/systemsharedmemory/status", get(shm_status_all))
        .route("/v2/systemsharedmemory/region/{region}/status", get(shm_status))
        .route("/v2/systemsharedmemory/region/{region}/register", post(shm_register))
        .route("/v2/systemsharedmemory/unregister", post(shm_unregister_all))
        .route("/v2/systemsharedmemory/region/{region}/unregister", post(shm_unregister))
        .route("/v2/cudasharedmemory/status", get(cuda_status_all))
        .route("/v2/cudasharedmemory/region/{region}/status", get(cuda_status))
        .route("/v2/cudasharedmemory/region/{region}/register", post(cuda_register))
        .route("/v2/cudasharedmemory/unregister", post(cuda_unregister_all))
        .route("/v2/cudasharedmemory/region/{region}/unregister", post(cuda_unregister))
}

fn reply(result: Result<Value>) -> Response {
    match result {
        Ok(Value::Null) => StatusCode::OK.into_response(),
        Ok(v) => (StatusCode::OK, axum::Json(v)).into_response(),
        Err(e) => error_response(&e),
    }
}

/// A JSON object body; an empty body is an empty object.
fn object(body: &[u8]) -> Result<Map<String, Value>> {
    if body.iter().all(u8::is_ascii_whitespace) {
        return Ok(Map::new());
    }
    match serde_json::from_slice(body) {
        Ok(Value::Object(m)) => Ok(m),
        Ok(other) => Err(Error::invalid(format!("expected a JSON object as the request body, got {other}"))),
        Err(e) => Err(Error::invalid(format!("failed to parse the request JSON: {e}"))),
    }
}

fn index_json(entries: &[IndexEntry]) -> Value {
    Value::Array(
        entries
            .iter()
            .map(|e| {
                let mut m = Map::new();
                m.insert("name".into(), e.name.clone().into());
                if let Some(v) = e.version {
                    m.insert("version".into(), v.to_string().into());
                    m.insert("state".into(), e.state.as_str().into());
                    if !e.reason.is_empty() {
                        m.insert("reason".into(), e.reason.clone().into());
                    }
                } else if !e.reason.is_empty() {
                    m.insert("state".into(), e.state.as_str().into());
                    m.insert("reason".into(), e.reason.clone().into());
                }
                Value::Object(m)
            })
            .collect(),
    )
}

async fn index(State(s): AppState, body: Bytes) -> Response {
    let ready = (|| match object(&body)?.get("ready") {
        None => Ok(false),
        Some(Value::Bool(b)) => Ok(*b),
        Some(v) => Err(Error::invalid(format!("'ready' must be a boolean, got {v}"))),
    })();
    match ready {
        Ok(ready) => reply(Ok(index_json(&s.engine.repository().index_fresh(ready).await))),
        Err(e) => reply(Err(e)),
    }
}

async fn index_in(state: AppState, Path(_repo): Path<String>, body: Bytes) -> Response {
    index(state, body).await
}

async fn named_repository() -> Response {
    error_response(&Error::unsupported("'repository_name' specification is not supported"))
}

/// The load body, parsed without copying its (large, base64) file contents: each file is decoded
/// once, straight from the request body.
fn load_request(body: &[u8]) -> Result<LoadRequest> {
    #[derive(serde::Deserialize)]
    struct LoadBody<'a> {
        #[serde(borrow, default)]
        parameters: Option<std::collections::BTreeMap<std::borrow::Cow<'a, str>, &'a serde_json::value::RawValue>>,
    }
    let mut req = LoadRequest::default();
    if body.iter().all(u8::is_ascii_whitespace) {
        return Ok(req);
    }
    let parsed: LoadBody<'_> =
        serde_json::from_slice(body).map_err(|e| Error::invalid(format!("failed to parse the request JSON: {e}")))?;
    for (k, raw) in parsed.parameters.unwrap_or_default() {
        let text: std::borrow::Cow<'_, str> = serde_json::from_str(raw.get()).map_err(|_| {
            Error::invalid(format!("Unrecognized load parameter '{k}' with type '{}': expected a string", raw.get()))
        })?;
        if k == "config" {
            req.config = Some(text.into_owned());
        } else if let Some(path) = k.strip_prefix("file:") {
            let bytes = base64::engine::general_purpose::STANDARD
                .decode(text.as_bytes())
                .map_err(|e| Error::invalid(format!("load parameter '{k}' is not valid base64: {e}")))?;
            req.files.push((path.to_string(), bytes));
        } else {
            return Err(Error::invalid(format!("Unrecognized load parameter '{k}' with type 'string'")));
        }
    }
    Ok(req)
}

/// Takes bodies up to --http-max-input-size (model files travel in them), as Triton.
async fn load(State(s): AppState, Path(model): Path<String>, headers: HeaderMap, body: Body) -> Response {
    let result = match read_request(&s, &headers, body).await {
        Ok(body) => match load_request(&body) {
            Ok(req) => s.engine.repository().load(&model, req).await.map(|()| Value::Null),
            Err(e) => Err(e),
        },
        Err(e) => Err(e),
    };
    reply(result)
}

async fn unload(State(s): AppState, Path(model): Path<String>, body: Bytes) -> Response {
    let dependents = match object(&body) {
        Ok(mut o) => match o.remove("parameters").and_then(|p| p.get("unload_dependents").cloned()) {
            None => Ok(false),
            Some(Value::Bool(b)) => Ok(b),
            Some(v) => Err(Error::invalid(format!("'unload_dependents' must be a boolean, got {v}"))),
        },
        Err(e) => Err(e),
    };
    let result = match dependents {
        Ok(d) => s.engine.repository().unload(&model, d).await.map(|()| Value::Null),
        Err(e) => Err(e),
    };
    reply(result)
}

fn trace_json(t: &TraceSettings) -> Value {
    json!({"trace_level": t.trace_level, "trace_rate": t.trace_rate, "trace_count": t.trace_count,
           "log_frequency": t.log_frequency, "trace_file": t.trace_file, "trace_mode": t.trace_mode})
}

fn trace_update(body: &[u8]) -> Result<TraceUpdate> {
    let mut u = TraceUpdate::default();
    for (k, v) in object(body)? {
        let text = |v: &Value| match v {
            Value::Null => Ok(None),
            Value::String(s) => Ok(Some(s.clone())),
            other => Err(Error::invalid(format!("trace setting '{k}' must be a string, got {other}"))),
        };
        match k.as_str() {
            "trace_level" => {
                u.trace_level = Some(match v {
                    Value::Null => None,
                    Value::Array(items) => Some(
                        items
                            .iter()
                            .map(|i| i.as_str().map(str::to_string))
                            .collect::<Option<Vec<_>>>()
                            .ok_or_else(|| Error::invalid("'trace_level' must be an array of strings"))?,
                    ),
                    other => return Err(Error::invalid(format!("'trace_level' must be an array, got {other}"))),
                })
            }
            "trace_rate" => u.trace_rate = Some(text(&v)?),
            "trace_count" => u.trace_count = Some(text(&v)?),
            "log_frequency" => u.log_frequency = Some(text(&v)?),
            "trace_file" => u.trace_file = Some(text(&v)?),
            _ => return Err(Error::invalid(format!("unknown trace setting '{k}'"))),
        }
    }
    Ok(u)
}

async fn trace_get(State(s): AppState) -> Response {
    reply(s.engine.trace_settings(None).map(|t| trace_json(&t)))
}

async fn trace_post(State(s): AppState, body: Bytes) -> Response {
    reply(trace_update(&body).and_then(|u| s.engine.update_trace_settings(None, u)).map(|t| trace_json(&t)))
}

async fn model_trace_get(State(s): AppState, Path(model): Path<String>) -> Response {
    reply(s.engine.trace_settings(Some(&model)).map(|t| trace_json(&t)))
}

async fn model_trace_post(State(s): AppState, Path(model): Path<String>, body: Bytes) -> Response {
    reply(trace_update(&body).and_then(|u| s.engine.update_trace_settings(Some(&model), u)).map(|t| trace_json(&t)))
}

fn log_json(l: &LogSettings) -> Value {
    json!({"log_file": l.log_file, "log_info": l.log_info, "log_warning": l.log_warning, "log_error": l.log_error,
           "log_verbose_level": l.log_verbose_level, "log_format": l.log_format})
}

fn log_update(body: &[u8]) -> Result<LogUpdate> {
    let mut u = LogUpdate::default();
    for (k, v) in object(body)? {
        if v.is_null() {
            continue;
        }
        let flag =
            || v.as_bool().ok_or_else(|| Error::invalid(format!("log setting '{k}' must be a boolean, got {v}")));
        match k.as_str() {
            "log_file" => u.log_file = Some(v.as_str().unwrap_or("?").to_string()),
            "log_info" => u.log_info = Some(flag()?),
            "log_warning" => u.log_warning = Some(flag()?),
            "log_error" => u.log_error = Some(flag()?),
            "log_verbose_level" => {
                let n = v.as_u64().and_then(|n| u32::try_from(n).ok());
                u.log_verbose_level = Some(n.ok_or_else(|| {
                    Error::invalid(format!("'log_verbose_level' must be an unsigned integer, got {v}"))
                })?);
            }
            "log_format" => {
                u.log_format = Some(
                    v.as_str()
                        .ok_or_else(|| Error::invalid(format!("'log_format' must be a string, got {v}")))?
                        .to_string(),
                )
            }
            _ => return Err(Error::invalid(format!("unknown log setting '{k}'"))),
        }
    }
    Ok(u)
}

async fn logging_get(State(s): AppState) -> Response {
    reply(Ok(log_json(&s.engine.logging().get())))
}

async fn logging_post(State(s): AppState, body: Bytes) -> Response {
    reply(log_update(&body).and_then(|u| s.engine.logging().update(u)).map(|l| log_json(&l)))
}

fn shm_json(name: Option<&str>, s: &HttpState) -> Result<Value> {
    let regions = s.engine.shm().status(name)?;
    Ok(Value::Array(
        regions
            .iter()
            .map(|r| json!({"name": r.name, "key": r.key, "offset": r.offset, "byte_size": r.byte_size}))
            .collect(),
    ))
}

async fn shm_status_all(State(s): AppState) -> Response {
    reply(shm_json(None, &s))
}

async fn shm_status(State(s): AppState, Path(region): Path<String>) -> Response {
    reply(shm_json(Some(&region), &s))
}

async fn shm_register(State(s): AppState, Path(region): Path<String>, body: Bytes) -> Response {
    reply((|| {
        let o = object(&body)?;
        let key = o
            .get("key")
            .and_then(Value::as_str)
            .ok_or_else(|| Error::invalid("Shared memory register request has no 'key' field"))?;
        let byte_size = o
            .get("byte_size")
            .and_then(Value::as_u64)
            .ok_or_else(|| Error::invalid("Shared memory register request has no 'byte_size' field"))?;
        let offset = o.get("offset").and_then(Value::as_u64).unwrap_or(0);
        s.engine.shm().register(&region, key, offset, byte_size)?;
        Ok(Value::Null)
    })())
}

async fn shm_unregister_all(State(s): AppState) -> Response {
    reply(s.engine.shm().unregister(None).map(|()| Value::Null))
}

async fn shm_unregister(State(s): AppState, Path(region): Path<String>) -> Response {
    reply(s.engine.shm().unregister(Some(&region)).map(|()| Value::Null))
}

fn cuda_json(name: Option<&str>, s: &HttpState) -> Result<Value> {
    let regions = s.engine.shm().status_cuda(name)?;
    Ok(Value::Array(
        regions.iter().map(|r| json!({"name": r.name, "device_id": r.device_id, "byte_size": r.byte_size})).collect(),
    ))
}

async fn cuda_status_all(State(s): AppState) -> Response {
    reply(cuda_json(None, &s))
}

async fn cuda_status(State(s): AppState, Path(region): Path<String>) -> Response {
    reply(cuda_json(Some(&region), &s))
}

async fn cuda_register(State(s): AppState, Path(region): Path<String>, body: Bytes) -> Response {
    reply((|| {
        let o = object(&body)?;
        let missing = |f: &str| Error::invalid(format!("Shared memory register request has no '{f}' field"));
        let b64 = o
            .get("raw_handle")
            .and_then(|h| h.get("b64"))
            .and_then(Value::as_str)
            .ok_or_else(|| missing("raw_handle"))?;
        let handle = base64::engine::general_purpose::STANDARD
            .decode(b64)
            .map_err(|e| Error::invalid(format!("raw_handle is not valid base64: {e}")))?;
        let device_id = o.get("device_id").and_then(Value::as_i64).ok_or_else(|| missing("device_id"))?;
        let byte_size = o.get("byte_size").and_then(Value::as_u64).ok_or_else(|| missing("byte_size"))?;
        s.engine.shm().register_cuda(&region, &handle, device_id, byte_size)?;
        Ok(Value::Null)
    })())
}

async fn cuda_unregister_all(State(s): AppState) -> Response {
    reply(s.engine.shm().unregister_cuda(None).map(|()| Value::Null))
}

async fn cuda_unregister(State(s): AppState, Path(region): Path<String>) -> Response {
    reply(s.engine.shm().unregister_cuda(Some(&region)).map(|()| Value::Null))
}
