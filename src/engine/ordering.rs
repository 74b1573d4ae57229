//! Requests of one gRPC stream reach their model's queue in the order the client sent them, as
//! Triton's do, while they still run concurrently: each waits until the one before it was
//! queued (or failed before), and says so itself once queued.
use std::{cell::RefCell, future::Future};

use tokio::sync::oneshot;

tokio::task_local! {
    static QUEUED: RefCell<Option<oneshot::Sender<()>>>;
}

/// Where a stream's requests are in line: the signal of the last one given out.
#[derive(Default)]
pub struct Line {
    last: Option<oneshot::Receiver<()>>,
}

/// One request's place in line: it waits for `before`, and tells the next through `after`.
pub struct Place {
    before: Option<oneshot::Receiver<()>>,
    after: oneshot::Sender<()>,
}

impl Line {
    /// The next request's place.
    pub fn place(&mut self) -> Place {
        let (after, next) = oneshot::channel();
        Place { before: self.last.replace(next), after }
    }
}

impl Place {
    /// Runs `f` once the request before it is queued; whatever `f` queues first frees the next.
    pub async fn run<F: Future>(self, f: F) -> F::Output {
        if let Some(before) = self.before {
            // A request that ended before it was queued frees the next all the same.
            let _ = before.await;
        }
        QUEUED.scope(RefCell::new(Some(self.after)), f).await
    }
}

/// The request being served is queued (or running): the next of its stream may go. Does
/// nothing outside a stream.
pub fn queued() {
    let _ = QUEUED.try_with(|q| q.borrow_mut().take().map(|tx| tx.send(())));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn each_waits_for_the_one_before_to_be_queued() {
        let mut line = Line::default();
        let (first, second) = (line.place(), line.place());
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        let tx2 = tx.clone();
        let b = tokio::spawn(second.run(async move { tx2.send(2).unwrap() }));
        tokio::task::yield_now().await;
        assert!(rx.try_recv().is_err(), "the second waits for the first");
        first
            .run(async move {
                tx.send(1).unwrap();
                queued();
                tokio::task::yield_now().await;
            })
            .await;
        b.await.unwrap();
        assert_eq!((rx.recv().await, rx.recv().await), (Some(1), Some(2)));
        // One that ends without being queued frees the next too.
        let (third, fourth) = (line.place(), line.place());
        third.run(async {}).await;
        fourth.run(async {}).await;
    }
}
