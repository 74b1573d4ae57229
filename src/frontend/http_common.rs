//! What every HTTP route of the front-ends shares: the listener's state, reading a body under the
//! size limit (and undoing its Content-Encoding), and the JSON error reply with its status code.
use std::sync::Arc;

use axum::{
    body::Body,
    http::{HeaderMap, HeaderValue, StatusCode, header},
    response::{IntoResponse, Response},
};
use bytes::Bytes;
use serde_json::json;

use super::encoding;
use crate::{engine::Engine, error::Error};

pub struct HttpState {
    pub engine: Arc<Engine>,
    /// --http-max-input-size
    pub max_input_size: usize,
    /// The platform's own size limit, said in 413 replies.
    pub size_note: String,
    /// --http-header-forward-pattern: request headers whose names match become request
    /// parameters (case-insensitively, as Triton).
    pub forward_headers: Option<regex::Regex>,
    /// --openai-api-key: what the OpenAI routes ask for.
    pub openai_api_key: Option<Arc<str>>,
}

pub fn error_response(e: &Error) -> Response {
    let status = StatusCode::from_u16(e.http_status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let mut r = (status, axum::Json(json!({ "error": e.message() }))).into_response();
    if e.kind() == crate::error::ErrorKind::Overloaded {
        r.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
    }
    r
}

pub fn header_str<'a>(headers: &'a HeaderMap, name: &str) -> Option<&'a str> {
    headers.get(name).and_then(|v| v.to_str().ok())
}

/// Reads a request body under the size limit (the platform's limit named in the error) and
/// undoes its Content-Encoding.
pub async fn read_request(s: &HttpState, headers: &HeaderMap, body: Body) -> Result<Bytes, Error> {
    let declared = header_str(headers, "content-length").and_then(|v| v.parse().ok());
    let limit = |e: Error| {
        if e.http_status() == 413 && !s.size_note.is_empty() {
            Error::too_large(format!("{} ({})", e.message(), s.size_note))
        } else {
            e
        }
    };
    let raw = encoding::read_body(body, declared, s.max_input_size).await.map_err(limit)?;
    let coding = header_str(headers, "content-encoding").map(str::to_string);
    if coding.is_none() || raw.len() < 64 << 10 {
        return encoding::decompress(raw, coding.as_deref(), s.max_input_size).map_err(limit);
    }
    // Inflating up to the size limit takes long enough to stall the async workers: off them.
    let max = s.max_input_size;
    tokio::task::spawn_blocking(move || encoding::decompress(raw, coding.as_deref(), max))
        .await
        .map_err(|e| Error::internal(format!("decompression failed: {e}")))?
        .map_err(limit)
}
