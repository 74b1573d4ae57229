//! Triton's generate extension over HTTP: `POST .../generate` answers one JSON object, and
//! `.../generate_stream` answers each response of the model as a server-sent event, the way LLM
//! clients read token streams. The body's keys (but `id` and `parameters`) are the model's
//! inputs; the replies' keys are its outputs. Both are encodings of the engine's one response
//! stream; a client that disconnects cancels the request.
use std::{convert::Infallible, sync::Arc};

use axum::{
    Router,
    body::{Body, Bytes},
    extract::{Path, State},
    http::{HeaderMap, StatusCode, header},
    response::{IntoResponse, Response},
    routing::post,
};
use serde_json::{Map, Value, json};

use super::{
    http::{HttpState, error_response, read_request},
    instances,
};
use crate::{
    engine::ResponseStream,
    error::{Error, Result},
    request::parse_version,
};

type AppState = State<Arc<HttpState>>;

pub fn routes() -> Router<Arc<HttpState>> {
    Router::new()
        .route("/v2/models/{model}/generate", post(generate))
        .route("/v2/models/{model}/versions/{version}/generate", post(generate))
        .route("/v2/models/{model}/generate_stream", post(generate_stream))
        .route("/v2/models/{model}/versions/{version}/generate_stream", post(generate_stream))
}

fn target(params: &[(String, String)]) -> Result<(String, Option<u64>)> {
    let get = |k: &str| params.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone());
    let model = get("model").unwrap_or_default();
    let version = parse_version(&model, &get("version").unwrap_or_default())?;
    Ok((model, version))
}

/// The engine stream of a generate body read from the request.
async fn start(
    s: &HttpState,
    params: &[(String, String)],
    headers: &HeaderMap,
    body: Body,
) -> Result<(String, ResponseStream)> {
    let (model, version) = target(params)?;
    let body = read_request(s, headers, body).await?;
    Ok((model.clone(), start_with(s, &model, version, &body).await?))
}

/// The engine stream of a generate body: its keys (but `id` and `parameters`) made as one
/// instance of the model's inputs.
pub async fn start_with(s: &HttpState, model: &str, version: Option<u64>, body: &[u8]) -> Result<ResponseStream> {
    let mut doc: Map<String, Value> =
        serde_json::from_slice(body).map_err(|e| Error::invalid(format!("failed to parse the request JSON: {e}")))?;
    let id = match doc.remove("id") {
        Some(Value::String(id)) => id,
        Some(other) => other.to_string(),
        None => String::new(),
    };
    let parameters = doc.remove("parameters").unwrap_or(Value::Null);
    let meta = s.engine.model_metadata(model, version)?;
    let max_batch = s.engine.model_config(model, version)?.max_batch_size.max(0) as usize;
    let instance = json!({"instances": [Value::Object(doc)], "parameters": parameters}).to_string();
    let (mut request, _) = instances::requests(model, instance.as_bytes(), &meta.inputs, max_batch.min(1))?
        .pop()
        .ok_or_else(|| Error::invalid("the generate body holds no inputs"))?;
    request.model_version = version;
    request.id = id;
    s.engine.infer_stream(request).await
}

/// A response as one JSON object of its outputs. Building it takes a JSON value per element
/// (up to 64 bytes each, and each string twice): held against the request's ticket meanwhile.
fn reply_json(r: &crate::engine::StreamItem) -> Result<Value> {
    let cost: u64 = r
        .response
        .outputs
        .iter()
        .map(|t| {
            let elements = crate::tensor::element_count(&t.shape).unwrap_or(0) as u64;
            elements.saturating_mul(64).saturating_add(2 * t.data.len() as u64)
        })
        .sum();
    let _building = r.charge.more(cost)?;
    let mut fields = instances::flat_outputs(&r.response)?;
    fields.insert("model_name".into(), Value::String(r.response.model_name.clone()));
    fields.insert("model_version".into(), Value::String(r.response.model_version.to_string()));
    if !r.response.id.is_empty() {
        fields.insert("id".into(), Value::String(r.response.id.clone()));
    }
    Ok(Value::Object(fields))
}

/// The model's last response that has outputs (a decoupled model's final mark may have none).
async fn generate(
    State(s): AppState,
    Path(params): Path<Vec<(String, String)>>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let outcome = async {
        let (model, stream) = start(&s, &params, &headers, body).await?;
        last_json(&model, stream).await
    }
    .await;
    match outcome {
        Ok(v) => (StatusCode::OK, axum::Json(v)).into_response(),
        Err(e) => error_response(&e),
    }
}

/// The stream's last response with outputs, as `generate` answers it.
pub async fn last_json(model: &str, mut stream: ResponseStream) -> Result<Value> {
    let mut last = None;
    while let Some(item) = stream.recv().await {
        let item = item?;
        if !item.response.outputs.is_empty() {
            last = Some(item);
        }
    }
    let item = last.ok_or_else(|| Error::internal(format!("model '{model}' sent no response with outputs")))?;
    reply_json(&item)
}

/// Each response as a server-sent event (`data: {...}`); an error is an event `{"error": ...}`
/// that ends the stream.
async fn generate_stream(
    State(s): AppState,
    Path(params): Path<Vec<(String, String)>>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    match start(&s, &params, &headers, body).await {
        Ok((_, stream)) => sse(stream),
        Err(e) => error_response(&e),
    }
}

/// A response stream as server-sent events: `data: {...}` per response; an error is an event
/// `{"error": ...}` that ends the stream. A response stays charged to its request's admission
/// ticket, its event's bytes too, until the connection asks for the next event (it has taken
/// this one): what a client that does not read makes the server hold is counted.
pub fn sse(stream: ResponseStream) -> Response {
    let start = (stream, false, crate::request::Charge::default());
    let events = futures_util::stream::unfold(start, |(mut stream, done, held)| async move {
        drop(held);
        if done {
            return None;
        }
        loop {
            let item = stream.recv().await?;
            let (event, end, mut charge) = match item {
                Ok(it) if it.response.outputs.is_empty() => {
                    if it.last {
                        return None;
                    }
                    continue;
                }
                Ok(it) => match reply_json(&it) {
                    Ok(v) => (v, it.last, it.charge),
                    Err(e) => (json!({"error": e.message()}), true, it.charge),
                },
                Err(e) => (json!({"error": e.message()}), true, Default::default()),
            };
            let frame = Bytes::from(format!("data: {event}\n\n"));
            drop(event);
            if let Err(e) = charge.grow(frame.len() as u64) {
                let refused = Bytes::from(format!("data: {}\n\n", json!({"error": e.message()})));
                return Some((Ok::<_, Infallible>(refused), (stream, true, Default::default())));
            }
            return Some((Ok::<_, Infallible>(frame), (stream, end, charge)));
        }
    });
    Response::builder()
        .status(StatusCode::OK)
        .header(header::CONTENT_TYPE, "text/event-stream")
        .header(header::CACHE_CONTROL, "no-cache")
        .body(Body::from_stream(events))
        .unwrap_or_else(|e| error_response(&Error::internal(e.to_string())))
}
