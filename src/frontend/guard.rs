//! What every request body passes through on its way in: the admission ticket grows with each
//! frame (so a request is refused before its bytes pile up, not after), and an HTTP body must
//! arrive before its deadline. The same guard serves HTTP (axum) and gRPC (tonic, as a layer).
use std::{
    pin::Pin,
    sync::Arc,
    task::{Context, Poll},
    time::Duration,
};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};

use crate::{
    admission::{Admission, Ticket},
    error::{Error, ErrorKind},
};

pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// A request body counted against the admission budget, with an optional read deadline.
pub struct GuardedBody<B> {
    inner: B,
    ticket: Arc<Ticket>,
    deadline: Option<(Pin<Box<tokio::time::Sleep>>, Duration)>,
    /// How a refusal travels as a body error (tonic looks for a `Status` inside).
    wrap: fn(Error) -> BoxError,
}

impl<B> GuardedBody<B> {
    pub fn new(inner: B, ticket: Arc<Ticket>, timeout: Option<Duration>, wrap: fn(Error) -> BoxError) -> Self {
        let deadline = timeout.map(|t| (Box::pin(tokio::time::sleep(t)), t));
        GuardedBody { inner, ticket, deadline, wrap }
    }
}

impl<B> Body for GuardedBody<B>
where
    B: Body<Data = Bytes> + Unpin,
    B::Error: Into<BoxError>,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        match Pin::new(&mut self.inner).poll_frame(cx) {
            Poll::Ready(Some(Ok(frame))) => {
                if let Some(data) = frame.data_ref()
                    && let Err(e) = self.ticket.grow(data.len() as u64)
                {
                    return Poll::Ready(Some(Err((self.wrap)(e))));
                }
                Poll::Ready(Some(Ok(frame)))
            }
            Poll::Ready(Some(Err(e))) => Poll::Ready(Some(Err(e.into()))),
            Poll::Ready(None) => {
                self.deadline = None;
                Poll::Ready(None)
            }
            Poll::Pending => {
                if let Some((sleep, limit)) = &mut self.deadline
                    && sleep.as_mut().poll(cx).is_ready()
                {
                    let e = Error::new(
                        ErrorKind::Timeout,
                        format!(
                            "the request body did not arrive within {} s (--http-body-timeout-secs)",
                            limit.as_secs()
                        ),
                    );
                    return Poll::Ready(Some(Err((self.wrap)(e))));
                }
                Poll::Pending
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// The engine's error as it was, when a body read failed because of the guard.
pub fn guard_error(e: &(dyn std::error::Error + 'static)) -> Option<Error> {
    let mut cur: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(err) = cur {
        if let Some(found) = err.downcast_ref::<Error>() {
            return Some(found.clone());
        }
        cur = err.source();
    }
    None
}

/// The request's admission ticket, in its extensions (a gRPC stream gives its bytes back per
/// message, once each message has its own ticket).
#[derive(Clone)]
pub struct RequestTicket(pub Arc<Ticket>);

/// The tonic layer: every gRPC request body is guarded (no deadline: streams live long).
#[derive(Clone)]
pub struct AdmitLayer {
    pub admission: Arc<Admission>,
}

impl<S> tower::Layer<S> for AdmitLayer {
    type Service = Admit<S>;

    fn layer(&self, inner: S) -> Admit<S> {
        Admit { inner, admission: Arc::clone(&self.admission) }
    }
}

#[derive(Clone)]
pub struct Admit<S> {
    inner: S,
    admission: Arc<Admission>,
}

fn grpc_error(e: Error) -> BoxError {
    Box::new(tonic::Status::new(tonic::Code::from_i32(e.grpc_code()), e.message()))
}

type GrpcRequest = http::Request<tonic::body::Body>;

impl<S> tower::Service<GrpcRequest> for Admit<S>
where
    S: tower::Service<GrpcRequest> + Clone + Send + 'static,
    S::Future: Send + 'static,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<S::Response, S::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: GrpcRequest) -> Self::Future {
        let ticket = Arc::new(self.admission.ticket());
        let (mut parts, body) = req.into_parts();
        parts.extensions.insert(RequestTicket(Arc::clone(&ticket)));
        let body = tonic::body::Body::new(GuardedBody::new(body, Arc::clone(&ticket), None, grpc_error));
        // The service that was polled ready takes the request; a fresh clone waits for the next.
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        let fut = crate::admission::scope(Arc::clone(&ticket), inner.call(http::Request::from_parts(parts, body)));
        Box::pin(async move {
            let r = fut.await;
            drop(ticket);
            r
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::BodyExt;

    #[tokio::test]
    async fn a_body_over_the_budget_is_refused_as_it_arrives() {
        let admission = Admission::new(10);
        let ticket = Arc::new(admission.ticket());
        let body =
            GuardedBody::new(http_body_util::Full::new(Bytes::from_static(&[0; 16])), Arc::clone(&ticket), None, |e| {
                Box::new(e)
            });
        let e = body.collect().await.err().unwrap();
        assert_eq!(guard_error(e.as_ref()).unwrap().kind(), ErrorKind::Overloaded);
        assert_eq!(admission.counts().used, 0);
    }

    #[tokio::test(start_paused = true)]
    async fn a_slow_body_times_out() {
        let admission = Admission::new(1 << 20);
        let body = http_body_util::StreamBody::new(futures_util::stream::pending::<Result<Frame<Bytes>, BoxError>>());
        let guarded =
            GuardedBody::new(body, Arc::new(admission.ticket()), Some(Duration::from_secs(5)), |e| Box::new(e));
        let e = guarded.collect().await.err().unwrap();
        let e = guard_error(e.as_ref()).unwrap();
        assert_eq!((e.kind(), e.http_status()), (ErrorKind::Timeout, 408));
        assert!(e.message().contains("within 5 s"));
    }
}
