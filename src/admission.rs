//! Admission control: one server-wide budget for the bytes of the requests being served. Every
//! request holds a ticket from its first body byte until its reply is made; the ticket grows as
//! the body arrives, and a request that would take the total past the budget is refused at once
//! (503 + Retry-After / RESOURCE_EXHAUSTED) instead of growing memory. The count of live tickets
//! is what a graceful stop waits for.
use std::sync::{
    Arc,
    atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering},
};

use crate::error::{Error, ErrorKind, Result};

pub struct Admission {
    budget: u64,
    used: AtomicU64,
    live: AtomicUsize,
    rejected: AtomicU64,
    idle: tokio::sync::Notify,
    /// A stop began: tickets issued from now on are late.
    closed: AtomicBool,
}

tokio::task_local! {
    /// The ticket of the request being served.
    static TICKET: Arc<Ticket>;
}

/// Runs a request's work with its ticket at hand: the engine attaches it to the request, so that
/// the request's bytes stay counted wherever they go (a queue, a batch) for as long as they live.
pub async fn scope<F: Future>(ticket: Arc<Ticket>, f: F) -> F::Output {
    TICKET.scope(ticket, f).await
}

/// The ticket of the request being served (None outside any request, e.g. in a BLS call).
pub fn current_ticket() -> Option<Arc<Ticket>> {
    TICKET.try_with(Arc::clone).ok()
}

/// Whether the request being served arrived after the stop began (false outside any request,
/// e.g. the steps a request already admitted runs).
pub fn arrived_after_stop() -> bool {
    TICKET.try_with(|t| t.late).unwrap_or(false)
}

/// What the metrics report.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AdmissionCounts {
    pub budget: u64,
    pub used: u64,
    pub live: usize,
    pub rejected: u64,
}

impl Admission {
    pub fn new(budget: u64) -> Arc<Self> {
        Arc::new(Admission {
            budget,
            used: AtomicU64::new(0),
            live: AtomicUsize::new(0),
            rejected: AtomicU64::new(0),
            idle: tokio::sync::Notify::new(),
            closed: AtomicBool::new(false),
        })
    }

    /// The stop began: requests that arrive from now on are refused by the engine; those that
    /// arrived before finish.
    pub fn close(&self) {
        self.closed.store(true, Ordering::SeqCst);
    }

    pub fn closed(&self) -> bool {
        self.closed.load(Ordering::SeqCst)
    }

    /// A ticket holding no bytes yet; it counts as a request in flight until dropped.
    pub fn ticket(self: &Arc<Self>) -> Ticket {
        self.live.fetch_add(1, Ordering::SeqCst);
        Ticket { admission: Arc::clone(self), bytes: AtomicU64::new(0), late: self.closed(), counted: true }
    }

    /// A ticket that is no request (not counted in flight, not waited for at a stop) for bytes
    /// held on requests' behalf: a stream's replies waiting for their client.
    pub fn holder(self: &Arc<Self>) -> Ticket {
        Ticket { admission: Arc::clone(self), bytes: AtomicU64::new(0), late: false, counted: false }
    }

    /// A ticket for `bytes` at once, or the overload error.
    pub fn admit(self: &Arc<Self>, bytes: u64) -> Result<Ticket> {
        let t = self.ticket();
        t.grow(bytes)?;
        Ok(t)
    }

    pub fn counts(&self) -> AdmissionCounts {
        AdmissionCounts {
            budget: self.budget,
            used: self.used.load(Ordering::Relaxed),
            live: self.live.load(Ordering::SeqCst),
            rejected: self.rejected.load(Ordering::Relaxed),
        }
    }

    /// Resolves when no ticket is alive.
    pub async fn drained(&self) {
        loop {
            let notified = self.idle.notified();
            if self.live.load(Ordering::SeqCst) == 0 {
                return;
            }
            notified.await;
        }
    }

    fn reserve(&self, n: u64) -> Result<()> {
        let mut used = self.used.load(Ordering::Relaxed);
        loop {
            let next = used.saturating_add(n);
            if next > self.budget {
                self.rejected.fetch_add(1, Ordering::Relaxed);
                return Err(Error::new(
                    ErrorKind::Overloaded,
                    format!(
                        "the server is overloaded: {used} bytes of requests are in flight and this one needs {n} more, over the budget of {} bytes (--max-inflight-request-bytes); retry later",
                        self.budget
                    ),
                ));
            }
            match self.used.compare_exchange_weak(used, next, Ordering::AcqRel, Ordering::Relaxed) {
                Ok(_) => return Ok(()),
                Err(now) => used = now,
            }
        }
    }
}

/// Bytes a request holds against the budget; given back when dropped.
pub struct Ticket {
    admission: Arc<Admission>,
    bytes: AtomicU64,
    late: bool,
    /// A request in flight (`live`); false for a holder.
    counted: bool,
}

impl Ticket {
    /// Issued after the stop began.
    pub fn late(&self) -> bool {
        self.late
    }

    /// Takes `n` more bytes, or refuses (the ticket keeps what it had).
    pub fn grow(&self, n: u64) -> Result<()> {
        self.admission.reserve(n)?;
        self.bytes.fetch_add(n, Ordering::AcqRel);
        Ok(())
    }

    /// Takes `n` more bytes even past the budget: memory already spent that must be kept for a
    /// while (a reply waiting for a slow client). The requests that come after are refused until
    /// it is given back.
    pub fn hold(&self, n: u64) {
        self.admission.used.fetch_add(n, Ordering::AcqRel);
        self.bytes.fetch_add(n, Ordering::AcqRel);
    }

    /// Gives `n` of its bytes back (what it held for a while: a stream's waiting responses).
    pub fn shrink(&self, n: u64) {
        let mut held = self.bytes.load(Ordering::Acquire);
        loop {
            let give = n.min(held);
            match self.bytes.compare_exchange_weak(held, held - give, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => {
                    self.admission.used.fetch_sub(give, Ordering::AcqRel);
                    return;
                }
                Err(now) => held = now,
            }
        }
    }

    /// Gives every byte back (a stream whose messages took their own tickets).
    pub fn release(&self) {
        let n = self.bytes.swap(0, Ordering::AcqRel);
        self.admission.used.fetch_sub(n, Ordering::AcqRel);
    }

    pub fn bytes(&self) -> u64 {
        self.bytes.load(Ordering::Acquire)
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        self.release();
        if self.counted && self.admission.live.fetch_sub(1, Ordering::SeqCst) == 1 {
            self.admission.idle.notify_waiters();
        }
    }
}

/// The default budget: a quarter of the memory the process may use (the cgroup's limit inside a
/// container, else the machine's memory): requests are copied on their way through the server
/// (decoded, batched, answered), so their bytes are a fraction of what they cost.
pub fn default_budget(memory_limit: u64) -> u64 {
    (memory_limit / 4).max(64 << 20)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_budget_bounds_the_bytes_in_flight() {
        let a = Admission::new(100);
        let t1 = a.admit(60).unwrap();
        let t2 = a.ticket();
        t2.grow(40).unwrap();
        let e = t2.grow(1).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Overloaded);
        assert_eq!(e.http_status(), 503);
        assert!(e.message().contains("budget of 100 bytes"), "{e}");
        assert_eq!(a.counts(), AdmissionCounts { budget: 100, used: 100, live: 2, rejected: 1 });
        drop(t1);
        assert_eq!(a.counts().used, 40);
        t2.release();
        assert_eq!(a.counts().used, 0);
        assert!(a.admit(101).is_err());
        drop(t2);
        assert_eq!(a.counts().live, 0);
    }

    #[test]
    fn bytes_held_count_past_the_budget_and_refuse_what_comes_after() {
        let a = Admission::new(100);
        let held = a.holder();
        held.hold(150);
        assert_eq!((a.counts().used, a.counts().live), (150, 0), "a holder is no request in flight");
        assert_eq!(a.admit(1).err().map(|e| e.kind()), Some(ErrorKind::Overloaded));
        drop(held);
        assert_eq!((a.counts().used, a.counts().live), (0, 0));
        assert!(a.admit(100).is_ok());
    }

    #[tokio::test]
    async fn tickets_after_the_stop_are_late() {
        let a = Admission::new(10);
        assert!(!a.ticket().late());
        a.close();
        let t = Arc::new(a.ticket());
        assert!(t.late());
        assert!(scope(Arc::clone(&t), async { arrived_after_stop() }).await);
        assert!(scope(Arc::clone(&t), async { current_ticket().is_some_and(|c| Arc::ptr_eq(&c, &t)) }).await);
        assert!(!scope(Arc::new(Admission::new(10).ticket()), async { arrived_after_stop() }).await);
        assert!(!arrived_after_stop() && current_ticket().is_none());
    }

    #[tokio::test]
    async fn drained_waits_for_the_last_ticket() {
        let a = Admission::new(10);
        let t = a.ticket();
        let waiter = {
            let a = Arc::clone(&a);
            tokio::spawn(async move { a.drained().await })
        };
        tokio::task::yield_now().await;
        assert!(!waiter.is_finished());
        drop(t);
        waiter.await.unwrap();
        a.drained().await;
    }
}
