//! Triton's generate extension over HTTP: `POST .../generate` answers one JSON object, and
//! `.../generate_stream` answers each response of the model as a server-sent event, the way LLM
//! clients read token streams. The body's keys named like the model's inputs are those inputs,
//! the others request parameters (`convert`); the replies' keys are its outputs. Both are
//! encodings of the engine's one response stream; a client that disconnects cancels the request.
use std::{collections::BTreeMap, convert::Infallible, sync::Arc};

use axum::{
    Router,
    body::{Body, Bytes},
    extract::{Path, State},
    http::{HeaderMap, StatusCode, header},
    response::{IntoResponse, Response},
    routing::post,
};
use serde_json::{Value, json};

use super::{
    http_common::{HttpState, error_response, read_request},
    instances,
};
use crate::{
    engine::ResponseStream,
    error::{Error, Result},
    request::{InferRequest, ParamValue, Parameters, parse_version},
};

mod convert;

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

/// The engine stream of a generate body read from the request. Triton's generate takes the
/// body as it is: a content encoding other than `identity` is refused.
async fn start(s: &HttpState, params: &[(String, String)], headers: &HeaderMap, body: Body) -> Result<ResponseStream> {
    let (model, version) = target(params)?;
    s.engine.model_metadata(&model, version)?;
    let encoding = headers.get(header::CONTENT_ENCODING).map(|v| v.to_str().unwrap_or("?").trim());
    if encoding.is_some_and(|e| !e.is_empty() && !e.eq_ignore_ascii_case("identity")) {
        return Err(Error::invalid("Unsupported content-encoding, only 'identity' is supported."));
    }
    let body = read_request(s, headers, body).await?;
    start_with(s, &model, version, body, Parameters::new()).await
}

/// The engine stream of a generate body (see `convert`), with `extra` request parameters.
pub async fn start_with(
    s: &HttpState,
    model: &str,
    version: Option<u64>,
    body: Bytes,
    extra: Parameters,
) -> Result<ResponseStream> {
    let meta = s.engine.model_metadata(model, version)?;
    // A large body takes a while to read: off the async workers, which serve health checks.
    let mut converted = if body.len() < 64 << 10 {
        convert::convert(&body, &meta.inputs)?
    } else {
        tokio::task::spawn_blocking(move || convert::convert(&body, &meta.inputs))
            .await
            .map_err(|e| Error::internal(format!("reading the generate body failed: {e}")))??
    };
    converted.parameters.extend(extra);
    let request = InferRequest {
        model_name: model.to_string(),
        model_version: version,
        id: converted.id,
        parameters: converted.parameters,
        inputs: converted.inputs,
        ..Default::default()
    };
    s.engine.infer_stream(request).await
}

/// A response as one JSON object: `id` (when set), `model_name`, `model_version`, then each
/// response parameter and each output as a top-level key (the first of a name wins), in key
/// order as Triton writes them. Building it takes a JSON value per element (up to 64 bytes
/// each, and each string twice): held against the request's ticket meanwhile.
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
    let mut fields: BTreeMap<String, Value> = BTreeMap::new();
    if !r.response.id.is_empty() {
        fields.insert("id".into(), Value::String(r.response.id.clone()));
    }
    fields.insert("model_name".into(), Value::String(r.response.model_name.clone()));
    fields.insert("model_version".into(), Value::String(r.response.model_version.to_string()));
    for (k, v) in &r.response.parameters {
        let v = match v {
            ParamValue::Bool(b) => json!(b),
            ParamValue::Int(i) => json!(i),
            ParamValue::Uint(u) => json!(u),
            ParamValue::Double(d) => json!(d),
            ParamValue::String(s) => json!(s),
        };
        fields.entry(k.clone()).or_insert(v);
    }
    for (k, v) in instances::flat_outputs(&r.response)? {
        fields.entry(k).or_insert(v);
    }
    Ok(Value::Object(fields.into_iter().collect()))
}

/// Only the mark that a decoupled model's responses are over: no response of its own.
fn flag_only(item: &crate::engine::StreamItem) -> bool {
    item.last && item.response.outputs.is_empty() && item.response.parameters.is_empty()
}

async fn generate(
    State(s): AppState,
    Path(params): Path<Vec<(String, String)>>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    answer(&s, &params, &headers, body, false).await
}

/// Each response as a server-sent event (`data: {...}`); an error is an event `{"error": ...}`.
async fn generate_stream(
    State(s): AppState,
    Path(params): Path<Vec<(String, String)>>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    answer(&s, &params, &headers, body, true).await
}

/// A generate request's answer: one reply, or (`stream`) server-sent events.
async fn answer(s: &HttpState, params: &[(String, String)], headers: &HeaderMap, body: Body, stream: bool) -> Response {
    match start(s, params, headers, body).await {
        Ok(responses) if stream => sse(responses).await,
        Ok(responses) => one_reply(responses).await,
        Err(e) => error_response(&e),
    }
}

/// `generate`'s answer, as Triton's: the status is the first response's (200 for a mark
/// alone), and a model that made other than exactly one response gets an error body.
pub async fn one_reply(mut stream: ResponseStream) -> Response {
    let mut status = None;
    let mut replies = Vec::new();
    while let Some(item) = stream.recv().await {
        let first = status.is_none();
        if !replies.is_empty() && !matches!(&item, Ok(it) if flag_only(it)) {
            // A second response: the answer is the error whatever follows; nothing more is
            // built or held (dropping the stream cancels the request).
            replies.push(Err(String::new()));
            break;
        }
        let reply = match item {
            Ok(it) if flag_only(&it) => {
                status.get_or_insert(StatusCode::OK);
                continue;
            }
            Ok(it) => reply_json(&it).map_err(|e| e.message().to_string()),
            Err(e) => {
                if first {
                    status = StatusCode::from_u16(e.http_status()).ok();
                }
                Err(e.message().to_string())
            }
        };
        status.get_or_insert(StatusCode::OK);
        replies.push(reply);
    }
    let body = match replies.len() {
        1 => match replies.remove(0) {
            Ok(v) => v,
            Err(message) => json!({ "error": message }),
        },
        _ => json!({
            "error": "generate expects model to produce exactly 1 response, use generate stream for model that \
                      generates various number of responses"
        }),
    };
    (status.unwrap_or(StatusCode::OK), axum::Json(body)).into_response()
}

/// A response stream as server-sent events: `data: {...}` per response, `data: {"error": ...}`
/// for an error; the status is the first response's, as Triton's. A response stays charged to
/// its request's admission ticket, its event's bytes too, until the connection asks for the
/// next event (it has taken this one): what a client that does not read makes the server hold
/// is counted.
pub async fn sse(mut stream: ResponseStream) -> Response {
    let first = match stream.recv().await {
        Some(Ok(it)) if flag_only(&it) => None,
        other => other,
    };
    let status = match &first {
        Some(Err(e)) => StatusCode::from_u16(e.http_status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR),
        _ => StatusCode::OK,
    };
    let start = (Some(stream), first, crate::request::Charge::default());
    let events = futures_util::stream::unfold(start, |(stream, mut pending, held)| async move {
        drop(held);
        let mut stream = stream?;
        let item = match pending.take() {
            Some(item) => item,
            None => stream.recv().await?,
        };
        let (event, mut charge) = match item {
            Ok(it) if flag_only(&it) => return None,
            Ok(it) => match reply_json(&it) {
                Ok(v) => (v, it.charge),
                Err(e) => (json!({"error": e.message()}), it.charge),
            },
            Err(e) => (json!({"error": e.message()}), Default::default()),
        };
        let frame = Bytes::from(format!("data: {event}\n\n"));
        drop(event);
        if let Err(e) = charge.grow(frame.len() as u64) {
            // Past the request's budget: the stream ends here, the request with it.
            let refused = Bytes::from(format!("data: {}\n\n", json!({"error": e.message()})));
            return Some((Ok::<_, Infallible>(refused), (None, None, Default::default())));
        }
        Some((Ok::<_, Infallible>(frame), (Some(stream), None, charge)))
    });
    Response::builder()
        .status(status)
        .header(header::CONTENT_TYPE, "text/event-stream; charset=utf-8")
        .header(header::CACHE_CONTROL, "no-cache")
        .body(Body::from_stream(events))
        .unwrap_or_else(|e| error_response(&Error::internal(e.to_string())))
}
