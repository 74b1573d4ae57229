//! The listeners: HTTP/1.1 connections served by hyper with a cap on open connections, a header
//! timeout (a request's headers must arrive once they started), an idle keep-alive timeout, every
//! body guarded by admission and a read deadline; gRPC connections under the same cap. On stop,
//! a listener closes and its connections finish the request they are on.
use std::{
    io,
    pin::Pin,
    sync::{
        Arc, OnceLock,
        atomic::{AtomicU64, AtomicUsize, Ordering},
    },
    task::{Context, Poll},
    time::{Duration, Instant},
};

use axum::{Router, body::Body};
use tokio::{
    io::{AsyncRead, AsyncWrite, ReadBuf},
    net::{TcpListener, TcpStream},
    sync::{OwnedSemaphorePermit, Semaphore, watch},
    task::JoinSet,
};
use tower::ServiceExt;

use super::guard::{GuardedBody, RequestTicket};
use super::wakes::SelfWakesKept;
use crate::admission::Admission;

/// What the network flags resolve to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Network {
    pub max_connections: usize,
    pub header_timeout: Duration,
    pub body_timeout: Duration,
    pub idle_timeout: Duration,
    pub grpc_max_input_size: usize,
    pub grpc_max_concurrent_streams: u32,
    pub grpc_stream_max_inflight: usize,
    /// How long a stream's replies may wait for a client that takes none.
    pub grpc_stream_stall_timeout: Duration,
    pub admission_budget: u64,
    pub exit_timeout: Duration,
}

/// Resolves once the stop signal is set.
pub async fn stopped(stop: &mut watch::Receiver<bool>) {
    let _ = stop.wait_for(|s| *s).await;
}

/// Milliseconds since the first call: a cheap clock the connection watchdogs share.
fn now_ms() -> u64 {
    static START: OnceLock<Instant> = OnceLock::new();
    START.get_or_init(Instant::now).elapsed().as_millis() as u64 + 1
}

/// What a connection is doing, for its watchdog.
#[derive(Default)]
struct Activity {
    /// When bytes of a request's headers began to arrive (0: none pending).
    head_since: AtomicU64,
    /// Last byte read or reply made.
    last: AtomicU64,
    /// Requests being served.
    active: AtomicUsize,
}

impl Activity {
    fn read(&self) {
        let now = now_ms();
        self.last.store(now, Ordering::Relaxed);
        if self.active.load(Ordering::Acquire) == 0 {
            let _ = self.head_since.compare_exchange(0, now, Ordering::AcqRel, Ordering::Relaxed);
        }
    }

    fn started(&self) {
        self.active.fetch_add(1, Ordering::AcqRel);
        self.head_since.store(0, Ordering::Release);
    }

    fn done(&self) {
        self.active.fetch_sub(1, Ordering::AcqRel);
        self.last.store(now_ms(), Ordering::Relaxed);
    }

    /// Why the connection should close now, if it should.
    fn expired(&self, limits: &Network) -> Option<&'static str> {
        let now = now_ms();
        let head = self.head_since.load(Ordering::Acquire);
        if head != 0 && now - head > limits.header_timeout.as_millis() as u64 {
            return Some("request headers did not arrive in time (--http-header-timeout-secs)");
        }
        let idle = self.active.load(Ordering::Acquire) == 0 && head == 0;
        if idle && now - self.last.load(Ordering::Relaxed) > limits.idle_timeout.as_millis() as u64 {
            return Some("idle keep-alive connection (--http-idle-timeout-secs)");
        }
        None
    }
}

/// A connection's socket: reports reads to the watchdog, and holds the connection's slot.
pub struct Watched<T> {
    io: T,
    activity: Arc<Activity>,
    _slot: OwnedSemaphorePermit,
}

impl<T: AsyncRead + Unpin> AsyncRead for Watched<T> {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let r = Pin::new(&mut self.io).poll_read(cx, buf);
        if buf.filled().len() > before {
            self.activity.read();
        }
        r
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for Watched<T> {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.io).poll_write(cx, buf)
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.io).poll_write_vectored(cx, bufs)
    }
    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }
}

impl tonic::transport::server::Connected for Watched<TcpStream> {
    type ConnectInfo = <TcpStream as tonic::transport::server::Connected>::ConnectInfo;
    fn connect_info(&self) -> Self::ConnectInfo {
        self.io.connect_info()
    }
}

/// Accepts connections while there is a free slot; past the cap, new connections are closed at
/// once (a load balancer retries elsewhere) and counted in the log.
struct Acceptor {
    listener: TcpListener,
    slots: Arc<Semaphore>,
    what: &'static str,
    refused: u64,
}

impl Acceptor {
    fn new(listener: TcpListener, limits: &Network, what: &'static str) -> Self {
        Acceptor { listener, slots: Arc::new(Semaphore::new(limits.max_connections)), what, refused: 0 }
    }

    async fn next(&mut self) -> (TcpStream, OwnedSemaphorePermit) {
        loop {
            let tcp = match self.listener.accept().await {
                Ok((tcp, _)) => tcp,
                Err(e) => {
                    // Out of descriptors or memory: wait rather than spin.
                    tracing::warn!(listener = self.what, error = %e, "cannot accept a connection");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            };
            match Arc::clone(&self.slots).try_acquire_owned() {
                Ok(slot) => {
                    let _ = tcp.set_nodelay(true);
                    return (tcp, slot);
                }
                Err(_) => {
                    self.refused += 1;
                    if self.refused.is_power_of_two() {
                        tracing::warn!(
                            listener = self.what,
                            refused = self.refused,
                            "connection limit reached (--max-connections): closing new connections"
                        );
                    }
                }
            }
        }
    }
}

/// Serves an axum router over HTTP/1.1 (over TLS when given an acceptor) until `stop`; then
/// stops accepting and lets each connection finish its request (the caller bounds that by the
/// exit deadline).
pub async fn serve_http(
    listener: TcpListener,
    app: Router,
    limits: Network,
    admission: Arc<Admission>,
    tls: Option<tokio_rustls::TlsAcceptor>,
    mut stop: watch::Receiver<bool>,
) -> Result<(), String> {
    let mut acceptor = Acceptor::new(listener, &limits, "HTTP");
    let mut conns = JoinSet::new();
    loop {
        let (tcp, slot) = tokio::select! {
            c = acceptor.next() => c,
            () = stopped(&mut stop) => break,
        };
        let conn =
            Conn { app: app.clone(), limits: limits.clone(), admission: Arc::clone(&admission), stop: stop.clone() };
        let tls = tls.clone();
        conns.spawn(SelfWakesKept::new(async move {
            let activity = Arc::new(Activity::default());
            activity.last.store(now_ms(), Ordering::Relaxed);
            let io = Watched { io: tcp, activity: Arc::clone(&activity), _slot: slot };
            match tls {
                None => conn.serve(io, activity).await,
                Some(tls) => match tokio::time::timeout(conn.limits.header_timeout, tls.accept(io)).await {
                    Ok(Ok(stream)) => conn.serve(stream, activity).await,
                    Ok(Err(e)) => tracing::debug!(error = %e, "TLS handshake failed"),
                    Err(_) => tracing::debug!("TLS handshake did not finish in time"),
                },
            }
        }));
        while conns.try_join_next().is_some() {}
    }
    drop(acceptor);
    while conns.join_next().await.is_some() {}
    Ok(())
}

/// What serving one connection needs.
struct Conn {
    app: Router,
    limits: Network,
    admission: Arc<Admission>,
    stop: watch::Receiver<bool>,
}

impl Conn {
    async fn serve<I>(mut self, io: I, activity: Arc<Activity>)
    where
        I: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    {
        let io = hyper_util::rt::TokioIo::new(io);
        let body_timeout = self.limits.body_timeout;
        let on_request = Arc::clone(&activity);
        let (app, admission) = (self.app.clone(), Arc::clone(&self.admission));
        let service = hyper::service::service_fn(move |req: http::Request<hyper::body::Incoming>| {
            let (app, activity, admission) = (app.clone(), Arc::clone(&on_request), Arc::clone(&admission));
            activity.started();
            async move {
                let ticket = Arc::new(admission.ticket());
                let (mut parts, body) = req.into_parts();
                parts.extensions.insert(RequestTicket(Arc::clone(&ticket)));
                let body = Body::new(GuardedBody::new(body, Arc::clone(&ticket), Some(body_timeout), |e| Box::new(e)));
                let request = http::Request::from_parts(parts, body);
                let resp = crate::admission::scope(Arc::clone(&ticket), app.oneshot(request)).await;
                drop(ticket);
                activity.done();
                resp
            }
        });
        // No half-close: a client that shuts its side is taken as gone, as nginx does, so that its
        // queued requests leave the queue with their bytes (the peer of a FIN cannot be told apart
        // from one that closed its socket until a reply is written to it).
        let conn = hyper::server::conn::http1::Builder::new().keep_alive(true).serve_connection(io, service);
        tokio::pin!(conn);
        let mut watchdog = tokio::time::interval(Duration::from_secs(1));
        let mut draining = false;
        loop {
            tokio::select! {
                r = conn.as_mut() => {
                    if let Err(e) = r {
                        tracing::debug!(error = %e, "HTTP connection ended with an error");
                    }
                    return;
                }
                _ = watchdog.tick() => {
                    if let Some(why) = activity.expired(&self.limits) {
                        tracing::debug!(reason = why, "closing an HTTP connection");
                        return;
                    }
                }
                () = stopped(&mut self.stop), if !draining => {
                    draining = true;
                    conn.as_mut().graceful_shutdown();
                }
            }
        }
    }
}

/// gRPC connections under the connection cap, until `stop`.
pub fn grpc_incoming(
    listener: TcpListener,
    limits: &Network,
    stop: watch::Receiver<bool>,
) -> impl futures_util::Stream<Item = io::Result<Watched<TcpStream>>> + Send + 'static {
    let acceptor = Acceptor::new(listener, limits, "gRPC");
    futures_util::stream::unfold((acceptor, stop), |(mut acceptor, mut stop)| async move {
        tokio::select! {
            (tcp, slot) = acceptor.next() => {
                let io = Watched { io: tcp, activity: Arc::default(), _slot: slot };
                Some((Ok(io), (acceptor, stop)))
            }
            () = stopped(&mut stop) => None,
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits() -> Network {
        Network {
            max_connections: 1,
            header_timeout: Duration::from_millis(10),
            body_timeout: Duration::from_secs(1),
            idle_timeout: Duration::from_millis(50),
            grpc_max_input_size: 1,
            grpc_max_concurrent_streams: 1,
            grpc_stream_max_inflight: 1,
            grpc_stream_stall_timeout: Duration::from_secs(60),
            admission_budget: 1,
            exit_timeout: Duration::from_secs(1),
        }
    }

    #[test]
    fn the_watchdog_closes_slow_heads_and_idle_connections_but_not_busy_ones() {
        let a = Activity::default();
        a.last.store(now_ms(), Ordering::Relaxed);
        assert_eq!(a.expired(&limits()), None);
        a.read();
        std::thread::sleep(Duration::from_millis(20));
        assert!(a.expired(&limits()).unwrap().contains("headers"));
        a.started();
        std::thread::sleep(Duration::from_millis(60));
        assert_eq!(a.expired(&limits()), None, "a request being served is not idle");
        a.done();
        assert_eq!(a.expired(&limits()), None);
        std::thread::sleep(Duration::from_millis(60));
        assert!(a.expired(&limits()).unwrap().contains("idle"));
    }
}
