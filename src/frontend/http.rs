//! KServe v2 over HTTP (axum): translates each route into one engine call and back, with
//! Triton's status codes and `{"error": "..."}` bodies.
use std::sync::Arc;

use bytes::Bytes;

use axum::{
    Router,
    body::Body,
    extract::{Path, State},
    http::{HeaderMap, HeaderValue, StatusCode, header},
    response::{IntoResponse, Response},
    routing::{get, post},
};
use serde_json::{Value, json};

use super::{
    encoding,
    http_common::{HttpState, error_response, header_str, read_request},
    json as codec,
};
use crate::{
    engine::{ModelMetadata, VersionStats},
    error::Error,
    proto::pbtxt,
    stats::Tally,
};

type AppState = State<Arc<HttpState>>;
type Params = Path<Vec<(String, String)>>;

/// Triton's answers for an unknown route (404) and a known route with another method (405).
pub fn with_fallbacks(r: Router) -> Router {
    r.fallback(not_found).method_not_allowed_fallback(method_not_allowed)
}

/// The KServe v2 routes alone, to merge with the extensions' (`frontend::http_routes`).
pub fn routes() -> Router<Arc<HttpState>> {
    let model_routes = |r: Router<Arc<HttpState>>, base: &str| {
        r.route(base, get(model_metadata))
            .route(&format!("{base}/ready"), get(model_ready))
            .route(&format!("{base}/config"), get(model_config))
            .route(&format!("{base}/stats"), get(model_stats))
            .route(&format!("{base}/infer"), post(infer))
    };
    let r = Router::new()
        .route("/v2/health/live", get(live))
        .route("/v2/health/ready", get(ready))
        .route("/v2", get(server_metadata))
        .route("/v2/models/stats", get(all_stats));
    let r = model_routes(r, "/v2/models/{model}");
    model_routes(r, "/v2/models/{model}/versions/{version}")
}

fn json_response(status: StatusCode, value: &Value) -> Response {
    (status, axum::Json(value)).into_response()
}

async fn not_found() -> Response {
    json_response(StatusCode::NOT_FOUND, &json!({"error": "Not Found"}))
}

async fn method_not_allowed() -> Response {
    json_response(StatusCode::METHOD_NOT_ALLOWED, &json!({"error": "Method Not Allowed"}))
}

/// The model and version named by the path. A version that is not a number is a route miss.
fn target(Path(params): Params) -> Result<(String, Option<u64>), Error> {
    let get = |k: &str| params.iter().find(|(n, _)| n == k).map(|(_, v)| v.as_str());
    let model = get("model").unwrap_or_default().to_string();
    match get("version") {
        None => Ok((model, None)),
        Some(v) if !v.is_empty() && v.bytes().all(|b| b.is_ascii_digit()) => match v.parse() {
            Ok(n) => Ok((model, Some(n))),
            Err(_) => Err(Error::invalid(format!("invalid model version specified '{v}'"))),
        },
        // A version that is not a number does not match the route.
        Some(_) => Err(Error::not_found("Not Found")),
    }
}

async fn live(State(s): AppState) -> Response {
    match s.engine.live() {
        Ok(()) => StatusCode::OK.into_response(),
        Err(e) => error_response(&e),
    }
}

async fn ready(State(s): AppState) -> Response {
    if s.engine.ready() { StatusCode::OK } else { StatusCode::BAD_REQUEST }.into_response()
}

async fn server_metadata(State(s): AppState) -> Response {
    let info = s.engine.server_info();
    json_response(StatusCode::OK, &json!({"name": info.name, "version": info.version, "extensions": info.extensions}))
}

fn metadata_json(m: &ModelMetadata) -> Value {
    let tensors = |ts: &[crate::engine::TensorMetadata]| -> Vec<Value> {
        ts.iter().map(|t| json!({"name": t.name, "datatype": t.datatype.wire(), "shape": t.shape})).collect()
    };
    json!({
        "name": m.name,
        "versions": m.versions.iter().map(u64::to_string).collect::<Vec<_>>(),
        "platform": m.platform,
        "inputs": tensors(&m.inputs),
        "outputs": tensors(&m.outputs),
    })
}

async fn model_metadata(State(s): AppState, path: Params) -> Response {
    let (model, version) = match target(path) {
        Ok(t) => t,
        Err(e) => return error_response(&e),
    };
    match s.engine.model_metadata(&model, version) {
        Ok(m) => json_response(StatusCode::OK, &metadata_json(&m)),
        Err(e) => error_response(&e),
    }
}

async fn model_ready(State(s): AppState, path: Params) -> Response {
    let (model, version) = match target(path) {
        Ok(t) => t,
        Err(e) => return error_response(&e),
    };
    match s.engine.model_ready(&model, version) {
        Ok(()) => StatusCode::OK.into_response(),
        Err(e) => error_response(&e),
    }
}

async fn model_config(State(s): AppState, path: Params) -> Response {
    let (model, version) = match target(path) {
        Ok(t) => t,
        Err(e) => return error_response(&e),
    };
    match s.engine.model_config(&model, version) {
        Ok(cfg) => json_response(StatusCode::OK, &pbtxt::to_json(&cfg)),
        Err(e) => error_response(&e),
    }
}

fn tally(t: &Tally) -> Value {
    json!({"count": t.count, "ns": t.ns})
}

fn stats_json(all: &[VersionStats]) -> Value {
    let entries: Vec<Value> = all
        .iter()
        .map(|v| {
            let s = &v.stats;
            let batches: Vec<Value> = s
                .batches
                .iter()
                .map(|(size, b)| {
                    json!({"batch_size": size, "compute_input": tally(&b.compute_input),
                           "compute_infer": tally(&b.compute_infer), "compute_output": tally(&b.compute_output)})
                })
                .collect();
            let responses: serde_json::Map<String, Value> = s
                .responses
                .iter()
                .map(|(i, r)| {
                    let entry = json!({"compute_infer": tally(&r.compute_infer), "compute_output": tally(&r.compute_output),
                        "success": tally(&r.success), "fail": tally(&r.fail),
                        "empty_response": tally(&r.empty_response), "cancel": tally(&r.cancel)});
                    (i.to_string(), entry)
                })
                .collect();
            let memory: Vec<Value> =
                s.memory.iter().map(|m| json!({"type": m.kind, "id": m.id, "byte_size": m.bytes})).collect();
            json!({
                "name": v.name,
                "version": v.version.to_string(),
                "last_inference": s.last_inference_ms,
                "inference_count": s.inference_count,
                "execution_count": s.execution_count,
                "inference_stats": {
                    "success": tally(&s.success), "fail": tally(&s.fail), "queue": tally(&s.queue),
                    "compute_input": tally(&s.compute_input), "compute_infer": tally(&s.compute_infer),
                    "compute_output": tally(&s.compute_output), "cache_hit": tally(&s.cache_hit),
                    "cache_miss": tally(&s.cache_miss),
                },
                "response_stats": responses,
                "batch_stats": batches,
                "memory_usage": memory,
            })
        })
        .collect();
    json!({ "model_stats": entries })
}

async fn all_stats(State(s): AppState) -> Response {
    match s.engine.statistics(None, None) {
        Ok(all) => json_response(StatusCode::OK, &stats_json(&all)),
        Err(e) => error_response(&e),
    }
}

async fn model_stats(State(s): AppState, path: Params) -> Response {
    let (model, version) = match target(path) {
        Ok(t) => t,
        Err(e) => return error_response(&e),
    };
    match s.engine.statistics(Some(&model), version) {
        Ok(all) => json_response(StatusCode::OK, &stats_json(&all)),
        Err(e) => error_response(&e),
    }
}

async fn infer(State(s): AppState, path: Params, headers: HeaderMap, body: Body) -> Response {
    let (model, version) = match target(path) {
        Ok(t) => t,
        Err(e) => return error_response(&e),
    };
    if s.engine.decoupled(&model, version) {
        let e = Error::unsupported("HTTP end point doesn't support models with decoupled transaction policy");
        return error_response(&e);
    }
    match infer_inner(&s, model, version, &headers, body).await {
        Ok(r) => r,
        Err(e) => {
            let mut r = error_response(&e);
            if e.http_status() == 501 && e.message().starts_with("Unsupported compression") {
                r.headers_mut().insert(header::ACCEPT_ENCODING, HeaderValue::from_static("gzip, deflate"));
            }
            r
        }
    }
}

/// Decodes a KServe v2 infer body (JSON, binary extension, or raw binary when `header_len` is
/// 0), runs it, and encodes the reply.
pub async fn infer_body(
    s: &HttpState,
    model: &str,
    version: Option<u64>,
    body: Bytes,
    header_len: Option<usize>,
    headers: &HeaderMap,
) -> Result<codec::Encoded, Error> {
    Ok(infer_body_with(s, (model, version), body, header_len, headers, crate::request::Parameters::new()).await?.0)
}

/// `infer_body` with request parameters added (`extra`); also gives the response's parameters.
pub async fn infer_body_with(
    s: &HttpState,
    (model, version): (&str, Option<u64>),
    body: Bytes,
    header_len: Option<usize>,
    headers: &HeaderMap,
    extra: crate::request::Parameters,
) -> Result<(codec::Encoded, crate::request::Parameters), Error> {
    let (mut request, format) = if header_len == Some(0) {
        let meta = s.engine.model_metadata(model, version)?;
        let batching = s.engine.model_config(model, version)?.max_batch_size > 0;
        codec::decode_raw(model, version, &meta.inputs, batching, body)?
    } else {
        codec::decode(model, version, body, header_len, s.engine.shm())?
    };
    request.trace_parent = header_str(headers, "traceparent").map(str::to_string);
    if let Some(pattern) = &s.forward_headers {
        for (name, value) in headers.iter().filter(|(n, _)| pattern.is_match(n.as_str())) {
            let (name, value) = crate::request::forwarded_header(name.as_str(), value.as_bytes())?;
            request.parameters.insert(name, value);
        }
    }
    request.parameters.extend(extra);
    let response = s.engine.infer(request).await?;
    Ok((codec::encode(&response, &format)?, response.parameters.clone()))
}

async fn infer_inner(
    s: &HttpState,
    model: String,
    version: Option<u64>,
    headers: &HeaderMap,
    body: Body,
) -> Result<Response, Error> {
    let body = read_request(s, headers, body).await?;
    let header_len = match headers.get("inference-header-content-length") {
        None => None,
        Some(v) => Some(header_length(&String::from_utf8_lossy(v.as_bytes()), body.len())?),
    };
    let encoded = infer_body(s, &model, version, body, header_len, headers).await?;
    reply(encoded, header_str(headers, "accept-encoding"))
}

/// `Inference-Header-Content-Length` as Triton reads it: a 32-bit integer (leading spaces, a
/// sign and trailing text allowed), from 0 (a raw binary body) up to the body's size.
fn header_length(v: &str, body_len: usize) -> Result<usize, Error> {
    let t = v.trim_start();
    let sign = usize::from(t.starts_with(['+', '-']));
    let digits = t[sign..].bytes().take_while(u8::is_ascii_digit).count();
    if digits == 0 {
        return Err(Error::invalid(format!("Unable to parse Inference-Header-Content-Length, got: {v}")));
    }
    let n: i32 = t[..sign + digits].parse().map_err(|_| {
        Error::invalid(format!(
            "Unable to parse Inference-Header-Content-Length, value is out of range [ -2147483648, 2147483647 ], \
             got: {v}"
        ))
    })?;
    match usize::try_from(n) {
        Ok(n) if n <= body_len => Ok(n),
        _ => Err(Error::invalid(format!("inference header size should be in range (0, {body_len}), got: {n}"))),
    }
}

/// The KServe v2 HTTP reply: binary outputs after the JSON header, named by
/// Inference-Header-Content-Length; compressed when the client accepts it.
pub fn reply(encoded: codec::Encoded, accept_encoding: Option<&str>) -> Result<Response, Error> {
    let mut builder = Response::builder().status(StatusCode::OK);
    builder = match encoded.header_len {
        Some(n) => builder
            .header(header::CONTENT_TYPE, "application/octet-stream")
            .header("inference-header-content-length", n),
        None => builder.header(header::CONTENT_TYPE, "application/json"),
    };
    let mut body = encoded.body;
    if let Some(coding) = encoding::choose(accept_encoding)
        && let Ok(packed) = encoding::compress(&body, coding)
    {
        body = packed;
        builder = builder.header(header::CONTENT_ENCODING, coding.name());
    }
    builder.body(Body::from(body)).map_err(|e| Error::internal(format!("cannot build the reply: {e}")))
}

#[cfg(test)]
mod tests {
    use super::header_length;

    #[test]
    fn the_header_length_is_read_as_tritons() {
        assert_eq!(header_length("12", 20).unwrap(), 12);
        assert_eq!(header_length(" +12abc", 20).unwrap(), 12);
        assert_eq!(header_length("0", 20).unwrap(), 0);
        let err = |v: &str| header_length(v, 20).unwrap_err().message().to_string();
        assert_eq!(err("x"), "Unable to parse Inference-Header-Content-Length, got: x");
        assert!(err("99999999999").contains("value is out of range [ -2147483648, 2147483647 ], got: 99999999999"));
        assert_eq!(err("-3"), "inference header size should be in range (0, 20), got: -3");
        assert_eq!(err("21"), "inference header size should be in range (0, 20), got: 21");
    }
}
