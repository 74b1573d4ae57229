//! A connection's future polled again at once when it wakes itself while being polled.
//!
//! hyper's HTTP/1 dispatcher wakes its own task on every request that carries a body: it reads the
//! body into the request's channel, whose reader is the handler it polls in the same task. tokio
//! sees a task woken during its poll as one that yielded: it goes to the back of the run queue and
//! another worker is woken to steal it, which on a lightly loaded server is a futex wake and a
//! context switch per request for nothing (bench/RESULTS.md, "Server CPU per request"). Here such
//! a wake is kept: the future is polled again in the same poll, a few times at most, and only a
//! wake from elsewhere (a socket, another task) reaches tokio.

use std::{
    future::Future,
    pin::Pin,
    sync::{
        Arc,
        atomic::{AtomicU8, Ordering},
    },
    task::{Context, Poll, Wake, Waker},
};

use futures_util::task::AtomicWaker;

/// How many times one poll polls the future again for its own wakes before yielding as usual.
const REPOLLS: usize = 8;

/// Set while the future is being polled.
const POLLING: u8 = 1;
/// Set by a wake; a poll that ends with it set polls again.
const WOKEN: u8 = 2;

struct Proxy {
    state: AtomicU8,
    task: AtomicWaker,
}

impl Wake for Proxy {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        // A read-modify-write, so that the poll that sees the mark also sees what the waker did
        // before it. While the future is being polled, that poll polls again; otherwise the
        // task is woken.
        if self.state.fetch_or(WOKEN, Ordering::AcqRel) & POLLING == 0 {
            self.task.wake();
        }
    }
}

/// `future`, with the wakes it makes while being polled answered by polling it again.
pub struct SelfWakesKept<F> {
    future: Pin<Box<F>>,
    proxy: Arc<Proxy>,
    waker: Waker,
}

impl<F: Future> SelfWakesKept<F> {
    pub fn new(future: F) -> Self {
        let proxy = Arc::new(Proxy { state: AtomicU8::new(0), task: AtomicWaker::new() });
        let waker = Waker::from(Arc::clone(&proxy));
        SelfWakesKept { future: Box::pin(future), proxy, waker }
    }
}

impl<F: Future> Future for SelfWakesKept<F> {
    type Output = F::Output;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        let this = self.get_mut();
        this.proxy.task.register(cx.waker());
        for _ in 0..REPOLLS {
            this.proxy.state.swap(POLLING, Ordering::AcqRel);
            let mut inner = Context::from_waker(&this.waker);
            if let Poll::Ready(out) = this.future.as_mut().poll(&mut inner) {
                this.proxy.state.store(0, Ordering::Release);
                return Poll::Ready(out);
            }
            // Not woken meanwhile: from now on a wake goes to the task.
            if this.proxy.state.compare_exchange(POLLING, 0, Ordering::AcqRel, Ordering::Acquire).is_ok() {
                return Poll::Pending;
            }
        }
        // Still waking itself: yield to the other tasks as tokio would.
        this.proxy.state.store(0, Ordering::Release);
        cx.waker().wake_by_ref();
        Poll::Pending
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;

    /// Wakes itself `n` times before it is ready, counting its polls.
    struct SelfWaking {
        left: usize,
        polls: Arc<AtomicUsize>,
    }

    impl Future for SelfWaking {
        type Output = ();
        fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
            self.polls.fetch_add(1, Ordering::Relaxed);
            if self.left == 0 {
                return Poll::Ready(());
            }
            self.left -= 1;
            cx.waker().wake_by_ref();
            Poll::Pending
        }
    }

    struct Counter(AtomicUsize);
    impl Wake for Counter {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, Ordering::Relaxed);
        }
    }

    #[test]
    fn own_wakes_poll_again_without_waking_the_task() {
        let polls = Arc::new(AtomicUsize::new(0));
        let task = Arc::new(Counter(AtomicUsize::new(0)));
        let waker = Waker::from(Arc::clone(&task));
        let mut f = SelfWakesKept::new(SelfWaking { left: 3, polls: Arc::clone(&polls) });
        let ready = Pin::new(&mut f).poll(&mut Context::from_waker(&waker));
        assert!(ready.is_ready());
        assert_eq!(polls.load(Ordering::Relaxed), 4);
        assert_eq!(task.0.load(Ordering::Relaxed), 0);
    }

    #[test]
    fn two_wakes_in_one_poll_poll_once_more_and_wake_nothing() {
        let task = Arc::new(Counter(AtomicUsize::new(0)));
        let waker = Waker::from(Arc::clone(&task));
        let mut polls = 0;
        let mut f = SelfWakesKept::new(std::future::poll_fn(move |cx: &mut Context<'_>| {
            polls += 1;
            if polls == 1 {
                cx.waker().wake_by_ref();
                cx.waker().wake_by_ref();
                return Poll::Pending;
            }
            Poll::Ready(polls)
        }));
        assert_eq!(Pin::new(&mut f).poll(&mut Context::from_waker(&waker)), Poll::Ready(2));
        assert_eq!(task.0.load(Ordering::Relaxed), 0);
    }

    #[test]
    fn a_future_that_keeps_waking_itself_yields_to_the_task() {
        let polls = Arc::new(AtomicUsize::new(0));
        let task = Arc::new(Counter(AtomicUsize::new(0)));
        let waker = Waker::from(Arc::clone(&task));
        let mut f = SelfWakesKept::new(SelfWaking { left: 100, polls: Arc::clone(&polls) });
        assert!(Pin::new(&mut f).poll(&mut Context::from_waker(&waker)).is_pending());
        assert_eq!(polls.load(Ordering::Relaxed), REPOLLS);
        assert_eq!(task.0.load(Ordering::Relaxed), 1, "it yields: the task is woken once to poll again");
    }

    /// Wakes from another thread racing the polls are never lost: every message arrives.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn wakes_racing_the_polls_are_not_lost() {
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<usize>();
        let sender = std::thread::spawn(move || {
            for k in 0..200_000 {
                tx.send(k).unwrap();
                if k % 64 == 0 {
                    std::thread::yield_now();
                }
            }
        });
        let all = SelfWakesKept::new(async move {
            let mut n = 0;
            while let Some(k) = rx.recv().await {
                assert_eq!(k, n);
                n += 1;
                // Some of the polls wake themselves too.
                if n % 3 == 0 {
                    tokio::task::yield_now().await;
                }
            }
            n
        });
        let got = tokio::time::timeout(std::time::Duration::from_secs(120), tokio::spawn(all)).await;
        sender.join().unwrap();
        assert_eq!(got.expect("a wake was lost: the receiver hung").unwrap(), 200_000);
    }

    #[test]
    fn a_wake_from_elsewhere_reaches_the_task() {
        let task = Arc::new(Counter(AtomicUsize::new(0)));
        let waker = Waker::from(Arc::clone(&task));
        let (tx, rx) = std::sync::mpsc::channel::<Waker>();
        let pending = std::future::poll_fn(move |cx: &mut Context<'_>| {
            let _ = tx.send(cx.waker().clone());
            Poll::<()>::Pending
        });
        let mut f = SelfWakesKept::new(pending);
        assert!(Pin::new(&mut f).poll(&mut Context::from_waker(&waker)).is_pending());
        let inner = rx.recv().unwrap();
        std::thread::spawn(move || inner.wake()).join().unwrap();
        assert_eq!(task.0.load(Ordering::Relaxed), 1);
    }
}
