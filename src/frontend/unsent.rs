//! A gRPC connection's replies that HTTP/2 holds and the socket has not taken: charged to
//! admission, and watched.
//!
//! hyper hands a whole response chunk to h2 as soon as the client's window has one byte free,
//! and h2 keeps it until the client's window and socket take it all. A client that never reads
//! (or grants window and never reads the socket) could so make the server hold any number of
//! replies that admission no longer sees. Every data frame a gRPC response hands to hyper is
//! charged to its connection here, and each byte the socket takes gives one back. A connection
//! that holds unsent replies and writes nothing for the stall timeout (longer for more bytes
//! held, at `MIN_READ_RATE`) is closed: its replies are dropped and their charges given back.
use std::{
    io,
    pin::Pin,
    sync::{
        Arc, Weak,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    task::{Context, Poll},
    time::Duration,
};

use bytes::Bytes;
use futures_util::task::AtomicWaker;
use http_body::{Body, Frame, SizeHint};

use crate::admission::{Admission, Ticket};

/// The slowest a client may read what a connection holds for it: the stall timeout is longer by
/// the time the bytes held take at this rate.
const MIN_READ_RATE: u64 = 64 << 10;

/// What one connection holds: bytes handed to HTTP/2 and not yet written.
pub struct Unsent {
    holder: Ticket,
    /// Bytes charged now (handed and not yet matched by bytes written).
    held: AtomicU64,
    /// Bytes the socket took so far (frames, headers and TLS included: a little more than the
    /// replies, so the charge ends a little early rather than late).
    written: AtomicU64,
    /// Whether a task watches this connection for a stall.
    watched: AtomicBool,
    closed: AtomicBool,
    /// The connection's reader, woken to fail when the connection is closed for a stall.
    reader: AtomicWaker,
    stall: Duration,
}

impl Unsent {
    pub fn new(admission: &Arc<Admission>, stall: Duration) -> Arc<Unsent> {
        Arc::new(Unsent {
            holder: admission.holder(),
            held: AtomicU64::new(0),
            written: AtomicU64::new(0),
            watched: AtomicBool::new(false),
            closed: AtomicBool::new(false),
            reader: AtomicWaker::new(),
            stall,
        })
    }

    /// `n` bytes of a reply handed to HTTP/2: charged (past the budget if need be: they exist)
    /// until the socket takes as many; watched if nothing watches yet.
    fn handed(self: &Arc<Self>, n: u64) {
        if n == 0 || self.closed.load(Ordering::Acquire) {
            return;
        }
        self.holder.hold(n);
        self.held.fetch_add(n, Ordering::AcqRel);
        if !self.watched.swap(true, Ordering::AcqRel) {
            tokio::spawn(watch(Arc::downgrade(self)));
        }
    }

    /// The socket took `n` bytes: as many held bytes are given back.
    pub fn wrote(&self, n: usize) {
        self.written.fetch_add(n as u64, Ordering::Relaxed);
        if self.held.load(Ordering::Acquire) > 0 {
            self.give_back(n as u64);
        }
    }

    fn give_back(&self, n: u64) {
        let Ok(before) =
            self.held.fetch_update(Ordering::AcqRel, Ordering::Acquire, |h| (h > 0).then(|| h.saturating_sub(n)))
        else {
            return;
        };
        self.holder.shrink(before.min(n));
    }

    /// Whether the connection was closed for a stall; otherwise its reader is woken should that
    /// happen.
    pub fn closed(&self, cx: &Context<'_>) -> bool {
        if self.closed.load(Ordering::Acquire) {
            return true;
        }
        self.reader.register(cx.waker());
        self.closed.load(Ordering::Acquire)
    }

    fn close(&self) {
        self.closed.store(true, Ordering::Release);
        self.give_back(u64::MAX);
        self.reader.wake();
    }

    pub fn closed_error() -> io::Error {
        io::Error::new(io::ErrorKind::ConnectionAborted, "the client read none of its replies for the stall timeout")
    }
}

impl Drop for Unsent {
    fn drop(&mut self) {
        self.give_back(u64::MAX);
    }
}

/// Looks once per stall timeout while the connection holds bytes; closes it when the socket
/// took nothing since the last look and the bytes held would take longer than that at
/// `MIN_READ_RATE`. Ends when nothing is held (the next reply starts another) or the connection
/// is gone.
async fn watch(unsent: Weak<Unsent>) {
    let Some(stall) = unsent.upgrade().map(|u| u.stall) else { return };
    let mut look = tokio::time::interval_at(tokio::time::Instant::now() + stall, stall);
    let (mut written, mut quiet) = (u64::MAX, Duration::ZERO);
    loop {
        look.tick().await;
        let Some(u) = unsent.upgrade() else { return };
        let held = u.held.load(Ordering::Acquire);
        if held == 0 {
            u.watched.store(false, Ordering::Release);
            // A reply handed meanwhile found this task still watching: look on for it.
            if u.held.load(Ordering::Acquire) == 0 || u.watched.swap(true, Ordering::AcqRel) {
                return;
            }
        }
        let now = u.written.load(Ordering::Relaxed);
        quiet = if now == written { quiet + stall } else { Duration::ZERO };
        written = now;
        if quiet >= stall + Duration::from_secs(held / MIN_READ_RATE) && held > 0 {
            tracing::warn!(
                held,
                stall_secs = stall.as_secs(),
                "closing a gRPC connection whose client read none of its {held} bytes of replies for {} s \
                 (--grpc-stream-stall-timeout-secs)",
                quiet.as_secs()
            );
            u.close();
            return;
        }
    }
}

/// A gRPC response's body: each data frame is charged to the connection as hyper takes it.
pub struct Charged<B> {
    inner: B,
    unsent: Arc<Unsent>,
}

impl<B> Charged<B> {
    pub fn new(inner: B, unsent: Arc<Unsent>) -> Self {
        Charged { inner, unsent }
    }
}

impl<B> Body for Charged<B>
where
    B: Body<Data = Bytes> + Unpin,
{
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, B::Error>>> {
        let polled = Pin::new(&mut self.inner).poll_frame(cx);
        if let Poll::Ready(Some(Ok(frame))) = &polled
            && let Some(data) = frame.data_ref()
        {
            self.unsent.handed(data.len() as u64);
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn held(admission: &Admission) -> u64 {
        admission.counts().used
    }

    #[tokio::test]
    async fn bytes_handed_stay_charged_until_as_many_are_written() {
        let admission = Admission::new(1 << 20);
        let unsent = Unsent::new(&admission, Duration::from_secs(60));
        unsent.handed(3000);
        assert_eq!(held(&admission), 3000);
        unsent.wrote(1000);
        assert_eq!(held(&admission), 2000);
        // Frames and headers are written too: never more is given back than is held.
        unsent.wrote(5000);
        assert_eq!(held(&admission), 0);
        unsent.handed(10);
        drop(unsent);
        assert_eq!(held(&admission), 0, "a connection gone gives its charge back");
    }

    #[tokio::test(start_paused = true)]
    async fn a_connection_that_writes_nothing_of_what_it_holds_is_closed_after_the_stall() {
        let admission = Admission::new(1 << 20);
        let stall = Duration::from_secs(1);
        let (writing, stuck) = (Unsent::new(&admission, stall), Unsent::new(&admission, stall));
        // 128 KiB at 64 KiB/s: two seconds more than the stall.
        writing.handed(128 << 10);
        stuck.handed(128 << 10);
        let cx = Context::from_waker(std::task::Waker::noop());
        for _ in 0..3 {
            tokio::time::sleep(stall).await;
            writing.wrote(1);
            assert!(!stuck.closed(&cx), "the time its bytes take at 64 KiB/s is allowed");
        }
        for _ in 0..3 {
            tokio::time::sleep(stall).await;
            writing.wrote(1);
        }
        assert!(stuck.closed(&cx));
        assert!(!writing.closed(&cx), "a connection that writes is never closed");
        assert_eq!(held(&admission), (128 << 10) - 6, "the stuck one's charge is given back");
    }
}
