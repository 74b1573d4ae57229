//! The Prometheus listener (`--metrics-port`, 8002): `GET /metrics` as Triton serves it. Other
//! paths answer 200 with an empty body (Triton's quirk), other methods 405.
use std::sync::Arc;

use axum::{
    Router,
    extract::State,
    http::{StatusCode, header},
    response::{IntoResponse, Response},
    routing::get,
};

use crate::metrics::Metrics;

pub fn router(metrics: Arc<Metrics>) -> Router {
    routes(metrics).fallback(get(|| async { StatusCode::OK })).method_not_allowed_fallback(|| async {
        (StatusCode::METHOD_NOT_ALLOWED, axum::Json(serde_json::json!({"error": "Method Not Allowed"})))
    })
}

/// `/metrics` alone, to merge with other routes.
pub fn routes(metrics: Arc<Metrics>) -> Router {
    Router::new().route("/metrics", get(scrape)).route("/metrics/", get(scrape)).with_state(metrics)
}

async fn scrape(State(metrics): State<Arc<Metrics>>) -> Response {
    ([(header::CONTENT_TYPE, "text/plain; charset=utf-8")], metrics.render()).into_response()
}
