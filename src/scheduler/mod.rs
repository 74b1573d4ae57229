//! Per model version: a queue of validated requests, and one thread per model instance that takes
//! the next batch the batcher allows, runs it, and answers each request. With request timeouts, a
//! reaper thread answers expired requests on time even while every instance is busy.
use std::{
    collections::BTreeMap,
    sync::{
        Arc, Condvar, Mutex, MutexGuard,
        atomic::{AtomicUsize, Ordering},
    },
    thread::JoinHandle,
    time::{Duration, Instant},
};

use tokio::sync::oneshot;

use crate::{
    backend::ModelInstance,
    error::{Error, Result},
    request::InferResponse,
    schema::Schema,
    stats::Stats,
    validate::ValidatedRequest,
};

mod batch;
pub mod batcher;
mod queue;
mod ragged;
pub mod rate_limit;
mod seats;
pub mod sequence;

pub use batcher::BatchPolicy;
use queue::{Job, Queue};
pub use queue::{LevelPolicy, QueuePolicy};
use seats::{LINGER_MAX, Recent, Seat, Slot, State};

/// A queued request's one reply. Dropped before it arrives (its caller went away), the request
/// leaves the queue at once if it is still there, and its bytes (and admission ticket) with it.
pub struct Reply {
    rx: oneshot::Receiver<Result<InferResponse>>,
    queued: Option<(std::sync::Weak<Shared>, u64)>,
}

impl Reply {
    /// The reply if it has arrived.
    pub fn try_recv(&mut self) -> std::result::Result<Result<InferResponse>, oneshot::error::TryRecvError> {
        let out = self.rx.try_recv();
        if out.is_ok() {
            self.queued = None;
        }
        out
    }
}

impl Future for Reply {
    type Output = std::result::Result<Result<InferResponse>, oneshot::error::RecvError>;

    fn poll(mut self: std::pin::Pin<&mut Self>, cx: &mut std::task::Context<'_>) -> std::task::Poll<Self::Output> {
        let out = std::task::ready!(std::pin::Pin::new(&mut self.rx).poll(cx));
        self.queued = None;
        std::task::Poll::Ready(out)
    }
}

impl Drop for Reply {
    fn drop(&mut self) {
        if let Some((shared, seq)) = self.queued.take()
            && let Some(shared) = shared.upgrade()
        {
            shared.cancel(seq);
        }
    }
}
/// Builds instance `i` again (after it panicked).
pub type Rebuild = Arc<dyn Fn(usize) -> Result<Box<dyn ModelInstance>> + Send + Sync>;
type Sender = oneshot::Sender<Result<InferResponse>>;

/// What a batch needs to know of its model version.
pub struct ModelContext {
    pub name: String,
    pub version: u64,
    pub schema: Arc<Schema>,
    pub stats: Arc<Stats>,
}

/// Replies that arrived before an earlier request's: the next sequence number to answer, and
/// the held ones by sequence number.
type Held = (u64, BTreeMap<u64, (Sender, Result<InferResponse>)>);

/// Answers requests; with preserve_ordering, in arrival order whatever order batches end in.
struct Responder {
    ordered: bool,
    held: Mutex<Held>,
    /// Requests queued and not yet answered (counted down before a reply leaves, so a client
    /// that sends its next request when answered finds its last one counted out). Counted only
    /// with `--adaptive-queue-delay` (`counting`): nothing else reads it.
    open: AtomicUsize,
    counting: bool,
}

impl Responder {
    /// Requests of a batch whose instance panicked: their senders are gone (the callers get an
    /// error); later replies must not wait for them.
    fn abandon(&self, seqs: &[u64]) {
        self.answered(seqs.len());
        if !self.ordered {
            return;
        }
        let mut held = self.held.lock().unwrap_or_else(|p| p.into_inner());
        for &seq in seqs {
            if seq >= held.0 {
                let (tx, _) = oneshot::channel();
                held.1.insert(seq, (tx, Err(Error::internal("abandoned"))));
            }
        }
        loop {
            let next = held.0;
            let Some((reply, result)) = held.1.remove(&next) else { break };
            let _ = reply.send(result);
            held.0 += 1;
        }
    }

    /// `n` requests are answered (never below none: a batch that panicked after answering some of
    /// its requests is counted out whole).
    fn answered(&self, n: usize) {
        if !self.counting {
            return;
        }
        let _ = self.open.fetch_update(Ordering::AcqRel, Ordering::Acquire, |open| Some(open.saturating_sub(n)));
    }

    fn send(&self, seq: u64, reply: Sender, result: Result<InferResponse>) {
        self.answered(1);
        if !self.ordered {
            let _ = reply.send(result);
            return;
        }
        let mut held = self.held.lock().unwrap_or_else(|p| p.into_inner());
        held.1.insert(seq, (reply, result));
        loop {
            let next = held.0;
            let Some((reply, result)) = held.1.remove(&next) else { break };
            let _ = reply.send(result);
            held.0 += 1;
        }
    }
}

struct Shared {
    queue: Mutex<State>,
    /// Per instance, wakes its thread: a request arrived, or stop.
    ready: Vec<Condvar>,
    slots: Vec<Mutex<Slot>>,
    ctx: ModelContext,
    /// Builds an instance again after it panicked (without it, the instance goes on).
    rebuild: Option<Rebuild>,
    /// How long batches lately took: light models may run on the caller's thread.
    recent: Recent,
    /// Wakes the reaper: a request with a deadline arrived, or stop.
    reaper: Condvar,
    /// Wakes the caller that waits out a short queue delay (`State::lingering`).
    linger: Condvar,
    /// The longest queue delay a caller waits out itself (`LINGER_MAX`; tests raise it).
    linger_max: Duration,
    /// Whether a reaper thread runs (requests can time out); without one, no wake is sent.
    reaping: bool,
    batching: BatchPolicy,
    responder: Responder,
    /// Pending and executing gauges.
    stats: Arc<Stats>,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.queue.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The instance whose thread to wake for queued work, if one waits free.
    fn to_wake(q: &State) -> Option<usize> {
        if q.is_empty() { None } else { q.free_waiting() }
    }

    fn wake(&self, i: Option<usize>) {
        if let Some(i) = i {
            self.ready[i].notify_one();
        }
    }

    fn wake_all(&self) {
        for c in &self.ready {
            c.notify_all();
        }
    }

    /// With the request just queued: when the version is otherwise quiet (no batch running, no
    /// other request queued), the model is light and an instance may run anywhere, that instance
    /// is taken for a batch on the caller's thread: at once when the batcher would run the
    /// request now, else after the caller itself waited out a queue delay of at most
    /// `LINGER_MAX` for company (what the instance's thread would have done, without the two
    /// wake-ups). Under load the instance threads run every batch, and the callers' threads
    /// stay free for the network.
    /// `seq`: the caller's own request; once it has left the queue (answered as expired, or
    /// taken by another instance) the caller stops waiting and its reply goes out.
    fn claim_here<'a>(
        &'a self,
        mut q: MutexGuard<'a, State>,
        seq: u64,
    ) -> (MutexGuard<'a, State>, Option<(usize, Vec<Job>)>) {
        if q.len() != 1 || q.seats.iter().any(|s| s.busy) {
            return (q, None);
        }
        let bytes = q.iter().map(Job::input_bytes).sum();
        if !self.recent.light_for(bytes) {
            return (q, None);
        }
        let Some(i) = q.free_anywhere() else { return (q, None) };
        let linger = self.batching.max_delay <= self.linger_max;
        q.seats[i].busy = true;
        loop {
            let now = Instant::now();
            self.answer_swept(&mut q, now);
            if !q.iter().any(|j| j.seq == seq) {
                // The rest is the instance threads' (the caller wakes one).
                q.lingering = false;
                q.seats[i].busy = false;
                return (q, None);
            }
            let hurry = q.hurry(self.batching.adaptive);
            let pending =
                q.iter().map(|j| batcher::Pending { rows: j.req.rows, enqueued: j.enqueued, key: &j.req.batch_key });
            match batcher::decide(&self.batching, pending, now, hurry) {
                batcher::Decision::Run(n) => {
                    q.lingering = false;
                    let jobs = q.take(n);
                    self.stats.running(jobs.len() as i64);
                    return (q, Some((i, jobs)));
                }
                batcher::Decision::WaitUntil(at) if linger => {
                    q.lingering = true;
                    let at = q.next_deadline().map_or(at, |d| d.min(at));
                    q = self
                        .linger
                        .wait_timeout(q, at.saturating_duration_since(now))
                        .unwrap_or_else(|p| p.into_inner())
                        .0;
                }
                // Nothing left (swept), or a delay for the instance's thread to wait out.
                _ => {
                    q.lingering = false;
                    q.seats[i].busy = false;
                    return (q, None);
                }
            }
        }
    }

    /// Runs a batch on instance `i` (whose seat is taken). A panic fails that batch only (its
    /// callers get an error), and the instance is built again, so the version keeps serving.
    fn execute(&self, i: usize, jobs: Vec<Job>) {
        let mut slot = self.slots[i].lock().unwrap_or_else(|p| p.into_inner());
        let Slot { instance, limit, executions } = &mut *slot;
        // Held for the batch: the rate limiter's resources this instance needs.
        let _granted = limit.as_ref().map(|(limiter, need)| limiter.acquire(need, executions));
        let (n, seqs): (i64, Vec<u64>) = (jobs.len() as i64, jobs.iter().map(|j| j.seq).collect());
        let bytes = jobs.iter().map(Job::input_bytes).sum();
        let started = Instant::now();
        let ran = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            batch::run(instance.as_mut(), &self.ctx, &self.responder, jobs)
        }));
        self.recent.record(started.elapsed(), bytes);
        self.stats.running(-n);
        let Err(panic) = ran else { return };
        let ctx = &self.ctx;
        let what = crate::error::panic_message(&*panic);
        tracing::error!(model = %ctx.name, version = ctx.version, instance = i, panic = %what, "a model instance panicked; its batch failed");
        self.responder.abandon(&seqs);
        if let Some(rebuild) = &self.rebuild {
            match rebuild(i) {
                Ok(fresh) => {
                    *instance = fresh;
                    tracing::info!(model = %ctx.name, version = ctx.version, instance = i, "model instance restarted");
                }
                Err(e) => {
                    tracing::error!(model = %ctx.name, error = %e, "cannot restart the model instance; keeping it")
                }
            }
        }
    }

    /// Runs a claimed batch on the caller's thread, then frees the instance for what queued
    /// meanwhile.
    fn run_here(&self, i: usize, jobs: Vec<Job>) {
        self.execute(i, jobs);
        let mut q = self.lock();
        q.seats[i].busy = false;
        let wake = Self::to_wake(&q);
        // Stopping, this instance's thread must see it is free, whoever takes the rest.
        let own = (q.stopping && q.seats[i].waiting && wake != Some(i)).then_some(i);
        drop(q);
        self.wake(wake);
        self.wake(own);
    }

    /// A request whose caller went away, taken out of the queue if it is still there.
    fn cancel(&self, seq: u64) {
        let mut q = self.lock();
        if let Some(job) = q.remove(seq) {
            self.stats.queued(-1);
            tracing::debug!(request = %job.req.id, "request left the queue unrun: its caller went away");
            self.responder.send(job.seq, job.reply, Err(queue::cancelled()));
        }
    }

    fn answer_swept(&self, q: &mut Queue, now: Instant) {
        for (job, error) in q.sweep(now) {
            self.stats.queued(-1);
            tracing::debug!(request = %job.req.id, reason = %error, "request left the queue unrun");
            self.responder.send(job.seq, job.reply, Err(error));
        }
    }

    /// Instance `i`'s thread: blocks until the batcher allows it a batch (`finished`: it ran
    /// one since it last asked); None once stopped and drained.
    fn next_batch(&self, i: usize, finished: bool) -> Option<Vec<Job>> {
        let mut q = self.lock();
        if finished {
            q.seats[i].busy = false;
        }
        loop {
            let now = Instant::now();
            self.answer_swept(&mut q, now);
            if q.seats[i].busy {
                // A caller runs a batch on this instance; it wakes this thread when done.
                q.seats[i].waiting = true;
                q = self.ready[i].wait(q).unwrap_or_else(|p| p.into_inner());
                q.seats[i].waiting = false;
                continue;
            }
            let hurry = q.hurry(self.batching.adaptive);
            let pending =
                q.iter().map(|j| batcher::Pending { rows: j.req.rows, enqueued: j.enqueued, key: &j.req.batch_key });
            let wake = match batcher::decide(&self.batching, pending, now, hurry) {
                batcher::Decision::Run(n) => {
                    let jobs = q.take(n);
                    self.stats.running(jobs.len() as i64);
                    q.seats[i].busy = true;
                    let wake = Self::to_wake(&q);
                    drop(q);
                    self.wake(wake);
                    return Some(jobs);
                }
                batcher::Decision::Idle if q.stopping => return None,
                batcher::Decision::Idle => q.next_deadline(),
                batcher::Decision::WaitUntil(at) => Some(q.next_deadline().map_or(at, |d| d.min(at))),
            };
            q.seats[i].waiting = true;
            q = match wake {
                Some(at) => {
                    let wait = at.saturating_duration_since(now);
                    self.ready[i].wait_timeout(q, wait).unwrap_or_else(|p| p.into_inner()).0
                }
                None => self.ready[i].wait(q).unwrap_or_else(|p| p.into_inner()),
            };
            q.seats[i].waiting = false;
        }
    }

    /// Answers expired requests when they expire. Once the version stops, the reaper ends as
    /// soon as no queued request has a deadline (the instances answer the rest).
    fn reap(&self) {
        let mut q = self.lock();
        while !(q.stopping && q.next_deadline().is_none()) {
            let now = Instant::now();
            self.answer_swept(&mut q, now);
            q = match q.next_deadline() {
                Some(at) => {
                    // Once stopping, the instances take the queued requests without waking the
                    // reaper: it looks again soon rather than sleeping out the last deadline.
                    let mut wait = at.saturating_duration_since(now);
                    if q.stopping {
                        wait = wait.min(STOPPING_RECHECK);
                    }
                    self.reaper.wait_timeout(q, wait).unwrap_or_else(|p| p.into_inner()).0
                }
                None => self.reaper.wait(q).unwrap_or_else(|p| p.into_inner()),
            };
        }
    }
}

/// How often a stopping version's reaper looks whether the queue still holds a deadline.
const STOPPING_RECHECK: Duration = Duration::from_millis(5);

/// An instance thread: runs batches until the scheduler stops.
fn serve_instance(shared: &Shared, i: usize) {
    let mut finished = false;
    while let Some(jobs) = shared.next_batch(i, finished) {
        shared.execute(i, jobs);
        finished = true;
    }
}

/// An instance's share of the rate limiter: the limiter, and what it needs to run a batch.
pub type Limit = (Arc<rate_limit::RateLimiter>, rate_limit::Need);
/// Each instance's (None: not rate limited).
pub type Limits = Vec<Option<Limit>>;

/// A request the scheduler did not take because its version was retired; the caller may resolve
/// the model again and submit it to the version that replaced it.
pub struct Retired(pub Box<ValidatedRequest>);

/// How a version schedules: batching, the queue policy, and whether replies keep arrival order.
#[derive(Debug, Clone, PartialEq)]
pub struct Policy {
    pub batching: BatchPolicy,
    pub queue: QueuePolicy,
    pub preserve_ordering: bool,
}

pub struct Scheduler {
    shared: Arc<Shared>,
    workers: Mutex<Vec<JoinHandle<()>>>,
}

impl Scheduler {
    /// Starts one thread per instance (and a reaper when requests can time out).
    /// `rebuild` makes a fresh instance when one panics (without it, the instance goes on);
    /// `limits[i]`: what instance i must hold of the rate limiter's resources to run a batch.
    pub fn start(
        ctx: ModelContext,
        policy: Policy,
        instances: Vec<Box<dyn ModelInstance>>,
        rebuild: Option<Rebuild>,
        limits: Limits,
    ) -> Result<Scheduler> {
        Self::start_with(ctx, policy, instances, rebuild, limits, LINGER_MAX)
    }

    /// `start`, with callers waiting out queue delays up to `linger_max` themselves.
    fn start_with(
        ctx: ModelContext,
        policy: Policy,
        instances: Vec<Box<dyn ModelInstance>>,
        rebuild: Option<Rebuild>,
        mut limits: Limits,
        linger_max: Duration,
    ) -> Result<Scheduler> {
        let (reaper_needed, adaptive) = (policy.queue.has_timeouts(), policy.batching.adaptive);
        limits.resize_with(instances.len(), || None);
        let seats = instances
            .iter()
            .zip(&limits)
            .map(|(instance, limit)| Seat { anywhere: instance.runs_anywhere() && limit.is_none(), ..Seat::default() })
            .collect();
        let count = instances.len();
        let slots = instances
            .into_iter()
            .zip(limits)
            .map(|(instance, limit)| Mutex::new(Slot { instance, limit, executions: 0 }))
            .collect();
        let (name, version) = (ctx.name.clone(), ctx.version);
        let shared = Arc::new(Shared {
            queue: Mutex::new(State { queue: Queue::new(policy.queue), seats, lingering: false, alone: 0 }),
            ready: (0..count).map(|_| Condvar::new()).collect(),
            slots,
            stats: Arc::clone(&ctx.stats),
            ctx,
            rebuild,
            recent: Recent::default(),
            reaper: Condvar::new(),
            linger: Condvar::new(),
            linger_max,
            reaping: reaper_needed,
            batching: policy.batching,
            responder: Responder {
                ordered: policy.preserve_ordering,
                held: Mutex::default(),
                open: AtomicUsize::new(0),
                counting: adaptive,
            },
        });
        let mut workers = Vec::with_capacity(count + 1);
        let spawn = |name: String, f: Box<dyn FnOnce() + Send>| {
            std::thread::Builder::new()
                .name(name)
                .spawn(f)
                .map_err(|e| Error::internal(format!("cannot start a scheduler thread: {e}")))
        };
        for i in 0..count {
            let shared = Arc::clone(&shared);
            workers.push(spawn(format!("{name}-v{version}-{i}"), Box::new(move || serve_instance(&shared, i)))?);
        }
        if reaper_needed {
            let shared = Arc::clone(&shared);
            workers.push(spawn(format!("{name}-v{version}-reaper"), Box::new(move || shared.reap()))?);
        }
        Ok(Scheduler { shared, workers: Mutex::new(workers) })
    }

    /// Queues a request; the receiver gets its one reply. A full queue answers at once.
    pub fn submit(&self, req: ValidatedRequest) -> Result<Reply, Retired> {
        let (tx, rx) = oneshot::channel();
        let mut q = self.shared.lock();
        if q.stopping {
            return Err(Retired(Box::new(req)));
        }
        let responder = &self.shared.responder;
        if responder.counting {
            q.arriving(responder.open.load(Ordering::Acquire) == 0);
        }
        let seq = match q.push(req, tx, Instant::now()) {
            Ok(seq) => {
                if responder.counting {
                    responder.open.fetch_add(1, Ordering::AcqRel);
                }
                seq
            }
            Err((error, tx)) => {
                let _ = tx.send(Err(error));
                return Ok(Reply { rx, queued: None });
            }
        };
        self.shared.stats.queued(1);
        if q.lingering {
            // The caller waiting for company has it.
            self.shared.linger.notify_one();
        }
        let (q, claimed) = self.shared.claim_here(q, seq);
        if let Some((i, jobs)) = claimed {
            drop(q);
            self.shared.run_here(i, jobs);
            // Its own request ran in that batch unless older ones filled it.
            return Ok(Reply { rx, queued: Some((Arc::downgrade(&self.shared), seq)) });
        }
        let wake = Shared::to_wake(&q);
        drop(q);
        self.shared.wake(wake);
        if self.shared.reaping {
            // A syscall whether or not anyone waits: only where a reaper does.
            self.shared.reaper.notify_one();
        }
        Ok(Reply { rx, queued: Some((Arc::downgrade(&self.shared), seq)) })
    }

    /// Stops taking requests; queued ones still run, then the threads end.
    pub fn stop(&self) {
        self.shared.lock().stopping = true;
        self.shared.wake_all();
        self.shared.linger.notify_all();
        self.shared.reaper.notify_all();
    }

    /// Blocks until every thread has ended (after `stop`).
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
