//! Per model version: a queue of validated requests, and one thread per model instance that takes
//! the next batch the batcher allows, runs it, and answers each request.
use std::{
    collections::VecDeque,
    sync::{Arc, Condvar, Mutex, MutexGuard},
    thread::JoinHandle,
    time::Instant,
};

use tokio::sync::oneshot;

use crate::{
    backend::ModelInstance,
    error::{Error, Result},
    model::Schema,
    request::InferResponse,
    stats::Stats,
    validate::ValidatedRequest,
};

mod batch;
pub mod batcher;

pub use batcher::BatchPolicy;

pub type Reply = oneshot::Receiver<Result<InferResponse>>;

/// What a batch needs to know of its model version.
pub struct ModelContext {
    pub name: String,
    pub version: u64,
    pub schema: Arc<Schema>,
    pub stats: Arc<Stats>,
}

struct Job {
    req: ValidatedRequest,
    enqueued: Instant,
    reply: oneshot::Sender<Result<InferResponse>>,
}

#[derive(Default)]
struct Queue {
    jobs: VecDeque<Job>,
    stopping: bool,
}

struct Shared {
    queue: Mutex<Queue>,
    ready: Condvar,
    policy: BatchPolicy,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Queue> {
        self.queue.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Blocks until the batcher allows a batch; None once stopped and drained.
    fn next_batch(&self) -> Option<Vec<Job>> {
        let mut q = self.lock();
        loop {
            // A request whose caller went away costs no compute.
            q.jobs.retain(|j| !j.reply.is_closed());
            let now = Instant::now();
            let pending = q.jobs.iter().map(|j| batcher::Pending {
                rows: j.req.rows,
                enqueued: j.enqueued,
                key: &j.req.batch_key,
            });
            match batcher::decide(&self.policy, pending, now, q.stopping) {
                batcher::Decision::Run(n) => {
                    let jobs: Vec<Job> = q.jobs.drain(..n).collect();
                    if !q.jobs.is_empty() {
                        self.ready.notify_one();
                    }
                    return Some(jobs);
                }
                batcher::Decision::WaitUntil(at) => {
                    q = self
                        .ready
                        .wait_timeout(q, at.saturating_duration_since(now))
                        .unwrap_or_else(|p| p.into_inner())
                        .0;
                }
                batcher::Decision::Idle if q.stopping => return None,
                batcher::Decision::Idle => q = self.ready.wait(q).unwrap_or_else(|p| p.into_inner()),
            }
        }
    }
}

/// A request the scheduler did not take because its version was retired; the caller may resolve
/// the model again and submit it to the version that replaced it.
pub struct Retired(pub Box<ValidatedRequest>);

pub struct Scheduler {
    shared: Arc<Shared>,
    workers: Mutex<Vec<JoinHandle<()>>>,
}

impl Scheduler {
    /// Starts one thread per instance.
    pub fn start(ctx: ModelContext, policy: BatchPolicy, instances: Vec<Box<dyn ModelInstance>>) -> Result<Scheduler> {
        let shared = Arc::new(Shared { queue: Mutex::default(), ready: Condvar::new(), policy });
        let ctx = Arc::new(ctx);
        let mut workers = Vec::with_capacity(instances.len());
        for (i, mut instance) in instances.into_iter().enumerate() {
            let (shared, ctx) = (Arc::clone(&shared), Arc::clone(&ctx));
            let name = format!("{}-v{}-{i}", ctx.name, ctx.version);
            let handle = std::thread::Builder::new()
                .name(name)
                .spawn(move || {
                    while let Some(jobs) = shared.next_batch() {
                        batch::run(instance.as_mut(), &ctx, jobs);
                    }
                })
                .map_err(|e| Error::internal(format!("cannot start an instance thread: {e}")))?;
            workers.push(handle);
        }
        Ok(Scheduler { shared, workers: Mutex::new(workers) })
    }

    /// Queues a request; the receiver gets its one reply.
    pub fn submit(&self, req: ValidatedRequest) -> Result<Reply, Retired> {
        let (tx, rx) = oneshot::channel();
        let mut q = self.shared.lock();
        if q.stopping {
            return Err(Retired(Box::new(req)));
        }
        q.jobs.push_back(Job { req, enqueued: Instant::now(), reply: tx });
        drop(q);
        self.shared.ready.notify_one();
        Ok(rx)
    }

    /// Stops taking requests; queued ones still run, then the instance threads end.
    pub fn stop(&self) {
        self.shared.lock().stopping = true;
        self.shared.ready.notify_all();
    }

    /// Blocks until every instance thread has ended (after `stop`).
    pub fn join(&self) {
        let workers = std::mem::take(&mut *self.workers.lock().unwrap_or_else(|p| p.into_inner()));
        for w in workers {
            let _ = w.join();
        }
    }
}

impl Drop for Scheduler {
    fn drop(&mut self) {
        self.stop();
    }
}

#[cfg(test)]
mod tests;
