//! A call's deadline (`grpc-timeout`), answered as gRPC servers answer it: DEADLINE_EXCEEDED
//! "Deadline Exceeded". tonic's own timer (outside this layer) would answer CANCELLED "Timeout
//! expired"; this one is set first, so it fires first, and the call behind it is dropped (which
//! takes its request out of the queue, or frees its sequence) as it would be.
use std::{
    pin::Pin,
    task::{Context, Poll},
    time::Duration,
};

type GrpcRequest = http::Request<tonic::body::Body>;
type GrpcResponse = http::Response<tonic::body::Body>;

/// The timeout a `grpc-timeout` value names: at most 8 digits and a unit (H M S m u n).
pub fn parse(value: &str) -> Option<Duration> {
    let unit = value.chars().last()?;
    let digits = &value[..value.len() - unit.len_utf8()];
    if digits.is_empty() || digits.len() > 8 || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let n: u64 = digits.parse().ok()?;
    Some(match unit {
        'H' => Duration::from_secs(n * 3600),
        'M' => Duration::from_secs(n * 60),
        'S' => Duration::from_secs(n),
        'm' => Duration::from_millis(n),
        'u' => Duration::from_micros(n),
        'n' => Duration::from_nanos(n),
        _ => return None,
    })
}

#[derive(Clone)]
pub struct DeadlineLayer;

impl<S> tower::Layer<S> for DeadlineLayer {
    type Service = Deadline<S>;

    fn layer(&self, inner: S) -> Deadline<S> {
        Deadline { inner }
    }
}

#[derive(Clone)]
pub struct Deadline<S> {
    inner: S,
}

impl<S> tower::Service<GrpcRequest> for Deadline<S>
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
        let timeout = req.headers().get("grpc-timeout").and_then(|v| v.to_str().ok()).and_then(parse);
        // The timer starts here, before tonic's (which starts once this call returns).
        let Some(sleep) = timeout.map(tokio::time::sleep) else { return Box::pin(self.inner.call(req)) };
        let fut = self.inner.call(req);
        Box::pin(async move {
            tokio::select! {
                biased;
                r = fut => r,
                () = sleep => Ok(tonic::Status::deadline_exceeded("Deadline Exceeded").into_http()),
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timeouts_parse_as_the_grpc_spec_writes_them() {
        assert_eq!(parse("500m"), Some(Duration::from_millis(500)));
        assert_eq!(parse("3H"), Some(Duration::from_secs(10800)));
        assert_eq!(parse("2M"), Some(Duration::from_secs(120)));
        assert_eq!(parse("99999999S"), Some(Duration::from_secs(99_999_999)));
        assert_eq!(parse("7u"), Some(Duration::from_micros(7)));
        assert_eq!(parse("7n"), Some(Duration::from_nanos(7)));
        for bad in ["", "m", "123456789m", "5x", "-5m", "5é", "+5S"] {
            assert_eq!(parse(bad), None, "{bad}");
        }
    }
}
