//! Protocol front-ends: each translates its wire format into one engine call and back.
pub mod encoding;
pub mod generate;
pub mod grpc;
pub mod guard;
pub mod http;
pub mod http_common;
pub mod http_ext;
pub mod instances;
pub mod json;
pub mod metrics;
pub mod net;
pub mod openai;
pub mod platform;
pub mod restrict;
pub mod sagemaker;
pub mod tls;
pub mod vertex;
pub mod wakes;

use std::sync::Arc;

use axum::Router;

use http_common::HttpState;

/// The HTTP listener's routes: KServe v2 with its extensions, generate and the OpenAI API, to
/// merge with the platforms' (see [`http_router`] for them alone).
pub fn http_routes(state: Arc<HttpState>) -> Router {
    let openai = openai::routes(state.openai_api_key.clone());
    http::routes().merge(http_ext::routes()).merge(generate::routes()).merge(openai).with_state(state)
}

/// [`http_routes`] with Triton's answers for an unknown route (404) and another method (405).
pub fn http_router(state: Arc<HttpState>) -> Router {
    http::with_fallbacks(http_routes(state))
}
