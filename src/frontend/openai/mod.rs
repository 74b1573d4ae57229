//! The OpenAI API over HTTP, for any model whose config maps to one of its operations
//! (`roles`): `GET /v1/models`, `POST /v1/embeddings`, `POST /v1/completions` and
//! `POST /v1/chat/completions` (streamed as OpenAI's server-sent events). Each translates into
//! engine calls and back; errors are OpenAI's `{"error": {message, type, param, code}}` with its
//! status codes (overload: 429 with Retry-After). With `--openai-api-key` every route asks for
//! `Authorization: Bearer <key>`.
use std::sync::Arc;

use axum::{
    Router,
    body::Body,
    extract::{Path, Request, State},
    http::{HeaderMap, HeaderValue, StatusCode, header},
    middleware::Next,
    response::{IntoResponse, Response},
    routing::{get, post},
};
use serde_json::{Value, json};

use super::http_common::{HttpState, read_request};
use crate::error::{Error, ErrorKind};

mod completions;
mod embeddings;
mod fields;
pub mod roles;
mod template;
mod tokens;

use roles::Roles;

type AppState = State<Arc<HttpState>>;

pub fn routes(api_key: Option<Arc<str>>) -> Router<Arc<HttpState>> {
    let r = Router::new()
        .route("/v1/models", get(list_models).fallback(wrong_method))
        .route("/v1/models/{*model}", get(one_model).fallback(wrong_method))
        .route("/v1/embeddings", post(embeddings::embeddings).fallback(wrong_method))
        .route("/v1/completions", post(completions::completions).fallback(wrong_method))
        .route("/v1/chat/completions", post(completions::chat_completions).fallback(wrong_method))
        .route("/v1/{*rest}", axum::routing::any(no_route));
    match api_key {
        None => r,
        Some(key) => r.layer(axum::middleware::from_fn(move |req: Request, next: Next| {
            let key = Arc::clone(&key);
            async move {
                if authorized(req.headers(), &key) {
                    next.run(req).await
                } else {
                    let e = ApiError {
                        status: StatusCode::UNAUTHORIZED,
                        message: "Incorrect API key provided.".into(),
                        kind: "invalid_request_error",
                        param: None,
                        code: Some("invalid_api_key"),
                    };
                    e.into_response()
                }
            }
        })),
    }
}

/// An OpenAI body that arrived on another route (SageMaker's `/invocations`): `messages` makes it
/// a chat completion, `prompt` a completion, `input` embeddings; `model` defaults to
/// `default_model`; `stream` asks a completion to stream.
pub async fn invoke(s: Arc<HttpState>, body: axum::body::Bytes, default_model: &str, stream: bool) -> Response {
    let mut v: serde_json::Map<String, Value> = match serde_json::from_slice(&body) {
        Ok(v) => v,
        Err(e) => return ApiError::bad(format!("the request body is not a JSON object: {e}"), "body").into_response(),
    };
    drop(body);
    if v.get("model").and_then(Value::as_str).is_none_or(str::is_empty) {
        v.insert("model".into(), Value::String(default_model.to_string()));
    }
    let route = if v.contains_key("messages") {
        "chat"
    } else if v.contains_key("prompt") {
        "completions"
    } else if v.contains_key("input") {
        "embeddings"
    } else {
        return ApiError::bad(
            "an OpenAI body holds 'messages' (chat), 'prompt' (completions) or 'input' (embeddings)",
            "body",
        )
        .into_response();
    };
    if stream && route != "embeddings" {
        v.insert("stream".into(), Value::Bool(true));
    }
    let body = Body::from(Value::Object(v).to_string());
    let headers = HeaderMap::new();
    match route {
        "chat" => completions::chat_completions(State(s), headers, body).await,
        "completions" => completions::completions(State(s), headers, body).await,
        _ => embeddings::embeddings(State(s), headers, body).await,
    }
}

/// `Authorization: Bearer <key>`, compared in constant time.
fn authorized(headers: &HeaderMap, key: &str) -> bool {
    let Some(given) = headers.get(header::AUTHORIZATION).and_then(|v| v.to_str().ok()) else {
        return false;
    };
    // The scheme's name is case-insensitive (RFC 7235), then whitespace, then the token.
    let Some((scheme, token)) = given.trim().split_once(char::is_whitespace) else {
        return false;
    };
    if !scheme.eq_ignore_ascii_case("bearer") {
        return false;
    }
    let token = token.trim();
    let (a, b) = (token.as_bytes(), key.as_bytes());
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// An error in OpenAI's shape.
#[derive(Debug)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    pub kind: &'static str,
    pub param: Option<&'static str>,
    pub code: Option<&'static str>,
}

impl ApiError {
    pub fn bad(message: impl Into<String>, param: &'static str) -> ApiError {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            kind: "invalid_request_error",
            param: Some(param),
            code: None,
        }
    }

    pub fn body(&self) -> Value {
        json!({"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}})
    }
}

impl From<Error> for ApiError {
    fn from(e: Error) -> ApiError {
        let (status, kind, code) = match e.kind() {
            ErrorKind::NotFound => (StatusCode::NOT_FOUND, "invalid_request_error", Some("model_not_found")),
            ErrorKind::Overloaded => (StatusCode::TOO_MANY_REQUESTS, "rate_limit_error", Some("rate_limit_exceeded")),
            ErrorKind::PayloadTooLarge => (StatusCode::PAYLOAD_TOO_LARGE, "invalid_request_error", None),
            ErrorKind::InvalidArgument | ErrorKind::AlreadyExists | ErrorKind::Unknown => {
                (StatusCode::BAD_REQUEST, "invalid_request_error", None)
            }
            ErrorKind::Cancelled => (StatusCode::BAD_REQUEST, "invalid_request_error", Some("cancelled")),
            ErrorKind::Unavailable => (StatusCode::SERVICE_UNAVAILABLE, "server_error", None),
            ErrorKind::Timeout => (StatusCode::REQUEST_TIMEOUT, "timeout_error", None),
            ErrorKind::Unsupported => (StatusCode::NOT_IMPLEMENTED, "invalid_request_error", None),
            ErrorKind::Internal => (StatusCode::INTERNAL_SERVER_ERROR, "server_error", None),
        };
        ApiError { status, message: e.message().to_string(), kind, param: None, code }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut r = (self.status, axum::Json(self.body())).into_response();
        if self.status == StatusCode::TOO_MANY_REQUESTS {
            r.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
        }
        r
    }
}

pub type ApiResult<T> = std::result::Result<T, ApiError>;

async fn wrong_method() -> Response {
    let message = "Method Not Allowed".to_string();
    ApiError { status: StatusCode::METHOD_NOT_ALLOWED, message, kind: "invalid_request_error", param: None, code: None }
        .into_response()
}

async fn no_route() -> Response {
    let message = "Not Found".to_string();
    ApiError { status: StatusCode::NOT_FOUND, message, kind: "invalid_request_error", param: None, code: None }
        .into_response()
}

/// A JSON reader's complaint in the API's words rather than the server's types.
fn plain_words(e: &serde_json::Error) -> String {
    let text = e.to_string();
    let words = [
        ("expected u64", "expected a non-negative integer"),
        ("expected i64", "expected an integer"),
        ("expected f64", "expected a number"),
        ("data did not match any variant of untagged enum OneOrMany", "expected a string or a list of strings"),
        ("data did not match any variant of untagged enum Input", "expected a string or a list of strings"),
        ("expected struct ChatMessage", "expected a message object"),
        ("expected a sequence", "expected a list"),
    ];
    words.iter().fold(text, |t, (from, to)| t.replace(from, to))
}

/// The body as JSON of type `T` (after the size limit and content encoding of every route).
async fn body_json<T: serde::de::DeserializeOwned>(s: &HttpState, headers: &HeaderMap, body: Body) -> ApiResult<T> {
    let bytes = read_request(s, headers, body).await?;
    serde_json::from_slice(&bytes).map_err(|e| ApiError {
        status: StatusCode::BAD_REQUEST,
        message: format!("the request body is not a valid request: {}", plain_words(&e)),
        kind: "invalid_request_error",
        param: None,
        code: None,
    })
}

/// The model a request names, and how it maps to the API; `want` is the operation the route needs.
fn model_roles(s: &HttpState, model: &str, want: roles::Operation) -> ApiResult<Roles> {
    if model.is_empty() {
        return Err(ApiError::bad("you must provide a model parameter", "model"));
    }
    let config = s.engine.model_config(model, None).map_err(|e| {
        let mut e = ApiError::from(e);
        if e.status == StatusCode::NOT_FOUND {
            e.message = format!("The model '{model}' does not exist");
        }
        e.param = Some("model");
        e
    })?;
    let saved = s.engine.chat_template(model);
    let r = Roles::of(model, &config, saved.as_deref()).map_err(|e| ApiError::bad(e.message(), "model"))?;
    if r.operation != want {
        return Err(ApiError::bad(
            format!("model '{model}' serves {}, not {}", r.operation.name(), want.name()),
            "model",
        ));
    }
    Ok(r)
}

/// Seconds since the epoch.
pub fn now() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

fn model_object(name: &str, operation: roles::Operation) -> Value {
    json!({"id": name, "object": "model", "created": 0, "owned_by": "ferry", "operation": operation.name()})
}

/// The served models that map to an OpenAI operation, by name.
fn openai_models(s: &HttpState) -> Vec<(String, roles::Operation)> {
    let mut out: Vec<(String, roles::Operation)> = Vec::new();
    for m in s.engine.registry().serving(None) {
        if out.last().is_some_and(|(n, _)| *n == m.name) {
            continue;
        }
        if let Ok(r) = Roles::of(&m.name, &m.config, None) {
            out.push((m.name.clone(), r.operation));
        }
    }
    out
}

async fn list_models(State(s): AppState) -> Response {
    let data: Vec<Value> = openai_models(&s).iter().map(|(n, op)| model_object(n, *op)).collect();
    axum::Json(json!({"object": "list", "data": data})).into_response()
}

async fn one_model(State(s): AppState, Path(model): Path<String>) -> Response {
    match openai_models(&s).into_iter().find(|(n, _)| *n == model) {
        Some((n, op)) => axum::Json(model_object(&n, op)).into_response(),
        None => ApiError {
            status: StatusCode::NOT_FOUND,
            message: format!("The model '{model}' does not exist"),
            kind: "invalid_request_error",
            param: Some("model"),
            code: Some("model_not_found"),
        }
        .into_response(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bearer_keys_compare_whole() {
        let mut h = HeaderMap::new();
        assert!(!authorized(&h, "sk-1"));
        h.insert(header::AUTHORIZATION, HeaderValue::from_static("Bearer sk-1"));
        assert!(authorized(&h, "sk-1"));
        assert!(!authorized(&h, "sk-12"));
        assert!(!authorized(&h, "sk-2"));
        h.insert(header::AUTHORIZATION, HeaderValue::from_static("bearer\tsk-1"));
        assert!(authorized(&h, "sk-1"));
        h.insert(header::AUTHORIZATION, HeaderValue::from_static("Bearer"));
        assert!(!authorized(&h, "sk-1"));
        h.insert(header::AUTHORIZATION, HeaderValue::from_static("Basic sk-1"));
        assert!(!authorized(&h, "sk-1"));
    }

    #[test]
    fn engine_errors_take_openais_codes() {
        let e = ApiError::from(Error::new(ErrorKind::Overloaded, "busy"));
        assert_eq!(e.status, StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(e.into_response().headers()[header::RETRY_AFTER], "1");
        let e = ApiError::from(Error::not_found("no"));
        assert_eq!((e.status, e.code), (StatusCode::NOT_FOUND, Some("model_not_found")));
        assert_eq!(e.body()["error"]["type"], "invalid_request_error");
    }
}
