//! The Vertex AI custom-container contract: health on `AIP_HEALTH_ROUTE` and predictions on
//! `AIP_PREDICT_ROUTE` (both matched literally), on `AIP_HTTP_PORT`. The predict route takes
//! Vertex's `{"instances": [...]}` and KServe v2 bodies (JSON, or binary with the
//! `application/vnd.vertex-ai-triton.binary+json;json-header-size=N` content type), and routes
//! `X-Vertex-Ai-Triton-Redirect: <v2 path>` to the KServe v2 API as Triton does. Every other
//! path is one of Vertex's invoke routes (`…/invoke/{path}` reaches the container as `/{path}`
//! for a model uploaded with `invokeRoutePrefix: "/*"`): ferry's own KServe v2 and generate
//! routes answer it, except loading, unloading and shared-memory registration.
use std::{net::SocketAddr, sync::Arc};

use axum::{
    Router,
    body::Body,
    extract::State,
    http::{HeaderMap, Method, Request, StatusCode, header},
    response::{IntoResponse, Response},
    routing::{get, post},
};
use serde_json::json;
use tower::ServiceExt;

use super::{
    http::{infer_body, reply},
    http_common::{HttpState, error_response, header_str, read_request},
    instances, platform,
};
use crate::error::Error;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VertexSettings {
    pub addr: SocketAddr,
    pub health_route: String,
    pub predict_route: String,
    pub default_model: Option<String>,
}

pub const BINARY_CONTENT_TYPE: &str = "application/vnd.vertex-ai-triton.binary+json";
const REDIRECT: &str = "x-vertex-ai-triton-redirect";

pub struct VertexState {
    pub http: Arc<HttpState>,
    pub settings: VertexSettings,
    /// The KServe v2 routes (and /metrics) that the redirect header reaches.
    pub kserve: Router,
}

pub fn router(state: Arc<VertexState>) -> Router {
    let (health_route, predict_route) = (state.settings.health_route.clone(), state.settings.predict_route.clone());
    Router::new()
        .route(&health_route, get(health))
        .route(&predict_route, post(predict))
        .fallback(invoke)
        .method_not_allowed_fallback(|| async {
            (StatusCode::METHOD_NOT_ALLOWED, axum::Json(json!({"error": "Method Not Allowed"})))
        })
        .with_state(state)
}

fn default_model(s: &VertexState) -> crate::error::Result<String> {
    platform::default_model(&s.http.engine, s.settings.default_model.as_deref(), "--vertex-ai-default-model")
}

async fn health(State(s): State<Arc<VertexState>>) -> Response {
    let (ready, body) = platform::health(&s.http.engine, default_model(&s));
    let status = if ready { StatusCode::OK } else { StatusCode::SERVICE_UNAVAILABLE };
    (status, axum::Json(body)).into_response()
}

async fn predict(State(s): State<Arc<VertexState>>, headers: HeaderMap, body: Body) -> Response {
    if let Some(target) = header_str(&headers, REDIRECT) {
        return redirect(&s, target.to_string(), headers, body).await;
    }
    match predict_inner(&s, &headers, body).await {
        Ok(r) => r,
        Err(e) => error_response(&e),
    }
}

async fn predict_inner(s: &VertexState, headers: &HeaderMap, body: Body) -> Result<Response, Error> {
    let body = read_request(&s.http, headers, body).await?;
    let model = default_model(s)?;
    if s.http.engine.decoupled(&model, None) {
        // streamRawPredict: a decoupled model's responses as server-sent events, its inputs the
        // body's keys (the generate extension's body).
        let stream = super::generate::start_with(&s.http, &model, None, body, Default::default()).await?;
        return Ok(super::generate::sse(stream).await);
    }
    let header_len = match platform::json_header_size(header_str(headers, "content-type"), BINARY_CONTENT_TYPE)? {
        Some(n) => Some(n),
        None => header_str(headers, "inference-header-content-length").and_then(|v| v.trim().parse().ok()),
    };
    if header_len.is_none() && instances::is_instances(&body) {
        let predictions = instances::predict(&s.http.engine, &model, &body).await?;
        return Ok((StatusCode::OK, axum::Json(predictions)).into_response());
    }
    let encoded = infer_body(&s.http, &model, None, body, header_len, headers).await?;
    reply(encoded, None)
}

/// An invoke route: the KServe v2 route of the same path and method (its own errors for
/// unknown paths and methods), unless it changes what is loaded or registered.
async fn invoke(State(s): State<Arc<VertexState>>, req: Request<Body>) -> Response {
    if redirect_method(req.uri().path()) == Err(StatusCode::FORBIDDEN) {
        let path = req.uri().path().to_string();
        let text = format!("This API is restricted: '{path}' cannot be reached through Vertex AI's invoke routes");
        return (StatusCode::FORBIDDEN, axum::Json(json!({ "error": text }))).into_response();
    }
    s.kserve.clone().oneshot(req).await.unwrap_or_else(|never| match never {})
}

/// The method a redirected path is served with, or the status that refuses it.
fn redirect_method(path: &str) -> Result<Method, StatusCode> {
    let parts: Vec<&str> = path.trim_matches('/').split('/').collect();
    let refused = StatusCode::FORBIDDEN;
    match parts.as_slice() {
        ["v2"] | ["metrics"] | ["v2", "health", "live" | "ready"] | ["v2", "models", "stats"] => Ok(Method::GET),
        ["v2", "models", _] | ["v2", "models", _, "ready" | "config" | "stats"] => Ok(Method::GET),
        ["v2", "models", _, "versions", _] | ["v2", "models", _, "versions", _, "ready" | "config" | "stats"] => {
            Ok(Method::GET)
        }
        ["v2", "models", _, "infer"] | ["v2", "models", _, "versions", _, "infer"] => Ok(Method::POST),
        ["v2", "systemsharedmemory" | "cudasharedmemory", "status"] => Ok(Method::GET),
        ["v2", "systemsharedmemory" | "cudasharedmemory", "region", _, "status"] => Ok(Method::GET),
        ["v2", "systemsharedmemory" | "cudasharedmemory", ..] => Err(refused),
        ["v2", "repository", "index"] | ["v2", "repository", _, "index"] => Ok(Method::POST),
        ["v2", "repository", ..] => Err(refused),
        _ => Err(StatusCode::BAD_REQUEST),
    }
}

/// `X-Vertex-Ai-Triton-Redirect: <path>` (with or without a leading `/`): the KServe v2 route,
/// answered as on the KServe port. Load, unload and shared-memory registration are refused.
async fn redirect(s: &VertexState, target: String, headers: HeaderMap, body: Body) -> Response {
    let path = format!("/{}", target.trim_start_matches('/'));
    let method = match redirect_method(&path) {
        Ok(m) => m,
        Err(StatusCode::FORBIDDEN) => {
            return (
                StatusCode::FORBIDDEN,
                axum::Json(json!({"error": format!("This API is restricted: '{target}' cannot be reached through {REDIRECT}")})),
            )
                .into_response();
        }
        Err(status) => {
            return (status, axum::Json(json!({"error": format!("'{target}' is not a route {REDIRECT} can reach")})))
                .into_response();
        }
    };
    let mut inner = Request::builder().method(method).uri(&path);
    for (name, value) in headers.iter().filter(|(n, _)| *n != header::HOST && n.as_str() != REDIRECT) {
        inner = inner.header(name, value);
    }
    match inner.body(body) {
        Ok(req) => s.kserve.clone().oneshot(req).await.unwrap_or_else(|never| match never {}),
        Err(e) => error_response(&Error::invalid(format!("{REDIRECT}: '{target}' is not a usable path: {e}"))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn redirect_targets() {
        assert_eq!(redirect_method("/v2/models/m/infer"), Ok(Method::POST));
        assert_eq!(redirect_method("/v2/models/m/versions/2/config"), Ok(Method::GET));
        assert_eq!(redirect_method("/v2/repository/index"), Ok(Method::POST));
        assert_eq!(redirect_method("/v2/repository/models/m/load"), Err(StatusCode::FORBIDDEN));
        assert_eq!(redirect_method("/v2/systemsharedmemory/region/r/register"), Err(StatusCode::FORBIDDEN));
        assert_eq!(redirect_method("/metrics"), Ok(Method::GET));
        assert_eq!(redirect_method("/v2/trace/setting"), Err(StatusCode::BAD_REQUEST));
    }
}
