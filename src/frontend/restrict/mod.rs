//! Restricted APIs: a request to a category named by `--http-restricted-api` (HTTP, Vertex AI and
//! SageMaker listeners) or `--grpc-restricted-protocol` needs the configured header with its
//! exact value; without it HTTP answers 403 and gRPC UNAVAILABLE, with Triton's words.
use std::{
    pin::Pin,
    sync::Arc,
    task::{Context, Poll},
};

use axum::{Router, http::StatusCode, response::IntoResponse};

mod rules;

pub use rules::{Category, GRPC_HEADER_PREFIX, Restrictions};

/// Which category a KServe v2 HTTP route belongs to (None: not restricted, e.g. metrics),
/// read segment by segment so that a model's name never decides it.
pub fn kserve_category(path: &str) -> Option<Category> {
    let segments: Vec<&str> = path.trim_end_matches('/').split('/').skip(1).collect();
    let model_op = |rest: &[&str]| match rest {
        [] => Category::Metadata,
        ["ready"] => Category::Health,
        ["infer" | "generate" | "generate_stream"] => Category::Inference,
        ["config"] => Category::ModelConfig,
        ["stats"] => Category::Statistics,
        ["trace", "setting"] => Category::Trace,
        _ => Category::Metadata,
    };
    Some(match segments.as_slice() {
        ["v2", "health", ..] => Category::Health,
        ["v2", "repository", ..] => Category::ModelRepository,
        ["v2", "systemsharedmemory" | "cudasharedmemory", ..] => Category::SharedMemory,
        ["v2", "trace", "setting"] => Category::Trace,
        ["v2", "logging", ..] => Category::Logging,
        ["v2", "models", "stats"] => Category::Statistics,
        ["v2", "models", _, "versions", _, rest @ ..] => model_op(rest),
        ["v2", "models", _, rest @ ..] => model_op(rest),
        ["v2", ..] => Category::Metadata,
        // The OpenAI API, as Triton's OpenAI front-end sorts it.
        ["v1", "models", ..] => Category::ModelRepository,
        ["v1", "embeddings" | "completions" | "chat", ..] => Category::Inference,
        _ => return None,
    })
}

/// SageMaker's routes (Triton's mapping): `/ping` health, invocations inference, the
/// multi-model API model-repository.
pub fn sagemaker_category(path: &str) -> Option<Category> {
    Some(match path {
        "/ping" => Category::Health,
        "/invocations" | "/invocations-response-stream" => Category::Inference,
        "/execution-parameters" => Category::Metadata,
        p if p.starts_with("/models/") && p.ends_with("/invoke") => Category::Inference,
        p if p.starts_with("/models") => Category::ModelRepository,
        p => return kserve_category(p),
    })
}

pub type Categorize = Arc<dyn Fn(&str) -> Option<Category> + Send + Sync>;

/// The router, answering 403 to restricted requests without the header.
pub fn http(router: Router, rules: &Restrictions, categorize: Categorize) -> Router {
    if rules.is_empty() {
        return router;
    }
    let rules = Arc::new(rules.clone());
    router.layer(axum::middleware::from_fn(move |req: axum::extract::Request, next: axum::middleware::Next| {
        let (rules, categorize) = (Arc::clone(&rules), Arc::clone(&categorize));
        async move {
            let missing = categorize(req.uri().path()).and_then(|c| {
                rules.check(c, |h| req.headers().get(h).and_then(|v| v.to_str().ok())).map(str::to_string)
            });
            match missing {
                Some(h) => {
                    let body = serde_json::json!({"error": format!("This API is restricted, expecting header '{h}'")});
                    (StatusCode::FORBIDDEN, axum::Json(body)).into_response()
                }
                None => next.run(req).await,
            }
        }
    }))
}

/// A gRPC method's category.
fn grpc_category(path: &str) -> Option<Category> {
    let method = path.rsplit('/').next()?;
    Some(match method {
        "ServerLive" | "ServerReady" | "ModelReady" | "Check" | "Watch" => Category::Health,
        "ServerMetadata" | "ModelMetadata" => Category::Metadata,
        "ModelInfer" | "ModelStreamInfer" => Category::Inference,
        "ModelConfig" => Category::ModelConfig,
        "ModelStatistics" => Category::Statistics,
        "RepositoryIndex" | "RepositoryModelLoad" | "RepositoryModelUnload" => Category::ModelRepository,
        m if m.contains("SharedMemory") => Category::SharedMemory,
        "TraceSetting" => Category::Trace,
        "LogSettings" => Category::Logging,
        _ => return None,
    })
}

/// The tonic layer.
#[derive(Clone)]
pub struct RestrictLayer(pub Arc<Restrictions>);

impl<S> tower::Layer<S> for RestrictLayer {
    type Service = Restrict<S>;
    fn layer(&self, inner: S) -> Restrict<S> {
        Restrict { inner, rules: Arc::clone(&self.0) }
    }
}

#[derive(Clone)]
pub struct Restrict<S> {
    inner: S,
    rules: Arc<Restrictions>,
}

type GrpcRequest = http::Request<tonic::body::Body>;
type GrpcResponse = http::Response<tonic::body::Body>;

impl<S> tower::Service<GrpcRequest> for Restrict<S>
where
    S: tower::Service<GrpcRequest, Response = GrpcResponse> + Clone + Send + 'static,
    S::Future: Send + 'static,
{
    type Response = GrpcResponse;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<GrpcResponse, S::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: GrpcRequest) -> Self::Future {
        let missing = grpc_category(req.uri().path()).and_then(|c| {
            self.rules.check(c, |h| req.headers().get(h).and_then(|v| v.to_str().ok())).map(str::to_string)
        });
        if let Some(h) = missing {
            let status = tonic::Status::unavailable(format!("This protocol is restricted, expecting header '{h}'"));
            return Box::pin(async move { Ok(status.into_http()) });
        }
        Box::pin(self.inner.call(req))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn routes_fall_in_tritons_categories() {
        assert_eq!(kserve_category("/v2/health/ready"), Some(Category::Health));
        assert_eq!(kserve_category("/v2/models/m/versions/1/ready"), Some(Category::Health));
        assert_eq!(kserve_category("/v2/models/m/infer"), Some(Category::Inference));
        assert_eq!(kserve_category("/v2/models/m"), Some(Category::Metadata));
        assert_eq!(kserve_category("/v2/repository/models/m/load"), Some(Category::ModelRepository));
        assert_eq!(kserve_category("/v2/systemsharedmemory/region/r/register"), Some(Category::SharedMemory));
        assert_eq!(kserve_category("/v2/models/m/stats"), Some(Category::Statistics));
        assert_eq!(kserve_category("/metrics"), None);
        assert_eq!(kserve_category("/v1/chat/completions"), Some(Category::Inference));
        assert_eq!(kserve_category("/v1/embeddings"), Some(Category::Inference));
        assert_eq!(kserve_category("/v1/models/m"), Some(Category::ModelRepository));
        // A model's name never picks the category.
        assert_eq!(kserve_category("/v2/models/ready"), Some(Category::Metadata));
        assert_eq!(kserve_category("/v2/models/infer"), Some(Category::Metadata));
        assert_eq!(kserve_category("/v2/models/config/versions/2"), Some(Category::Metadata));
        assert_eq!(kserve_category("/v2/models/infer/ready"), Some(Category::Health));
        assert_eq!(kserve_category("/v2/models/ready/versions/1/infer"), Some(Category::Inference));
        assert_eq!(kserve_category("/v2/models/stats"), Some(Category::Statistics));
        assert_eq!(kserve_category("/v2/models/m/trace/setting"), Some(Category::Trace));
        assert_eq!(sagemaker_category("/invocations-response-stream"), Some(Category::Inference));
        assert_eq!(sagemaker_category("/models/a/invoke"), Some(Category::Inference));
        assert_eq!(sagemaker_category("/models"), Some(Category::ModelRepository));
        assert_eq!(
            grpc_category("/inference.GRPCInferenceService/RepositoryModelLoad"),
            Some(Category::ModelRepository)
        );
        assert_eq!(grpc_category("/grpc.health.v1.Health/Check"), Some(Category::Health));
    }
}
