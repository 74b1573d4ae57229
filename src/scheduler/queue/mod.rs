//! The queue of one model version: a FIFO per priority level, Triton's queue policy per level
//! (maximum size, default timeout, per-request timeout override, REJECT or DELAY on expiry), and
//! the order in which requests are offered to the batcher. The lock is shared with the async
//! side that submits, so no operation under it scans the whole queue: deadlines sit in an
//! ordered index, and cancelled requests are looked for near the front only.
use std::{
    collections::{BTreeSet, VecDeque},
    time::{Duration, Instant},
};

use tokio::sync::oneshot;

use crate::{
    error::{Error, ErrorKind, Origin, Result},
    proto::inference::{ModelDynamicBatching, ModelQueuePolicy, model_queue_policy::TimeoutAction},
    request::InferResponse,
    telemetry::otel,
    validate::ValidatedRequest,
};

pub(super) struct Job {
    pub req: ValidatedRequest,
    pub enqueued: Instant,
    /// Arrival order, for preserve_ordering.
    pub seq: u64,
    pub deadline: Option<Instant>,
    pub reply: oneshot::Sender<Result<InferResponse>>,
    /// Open while the request waits (traced requests only).
    pub queue_span: tracing::Span,
}

impl Job {
    /// The request's input bytes, wherever they are.
    pub fn input_bytes(&self) -> usize {
        self.req.inputs.iter().flatten().map(|t| t.byte_len()).sum()
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct LevelPolicy {
    /// On expiry: reject the request (true), or keep it behind the fresh ones of its level.
    pub reject: bool,
    pub default_timeout: Duration,
    pub allow_override: bool,
    /// 0 = unbounded.
    pub max_size: usize,
}

impl LevelPolicy {
    fn from(p: Option<&ModelQueuePolicy>) -> Self {
        let p = p.cloned().unwrap_or_default();
        LevelPolicy {
            reject: p.timeout_action != TimeoutAction::Delay as i32,
            default_timeout: Duration::from_micros(p.default_timeout_microseconds),
            allow_override: p.allow_timeout_override,
            max_size: p.max_queue_size as usize,
        }
    }

    /// A request's own timeout applies when overrides are allowed and it is shorter than the
    /// default (or there is no default: unlike Triton, which then ignores it).
    fn timeout(&self, requested_us: Option<u64>) -> Option<Duration> {
        let requested = requested_us.filter(|&t| t > 0).map(Duration::from_micros);
        match (self.allow_override, requested) {
            (true, Some(r)) if self.default_timeout.is_zero() || r < self.default_timeout => Some(r),
            _ => (!self.default_timeout.is_zero()).then_some(self.default_timeout),
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct QueuePolicy {
    /// Index 0 = priority level 1 (the highest).
    pub levels: Vec<LevelPolicy>,
    pub default_level: usize,
}

impl QueuePolicy {
    pub fn new(db: Option<&ModelDynamicBatching>) -> Self {
        let Some(db) = db else {
            return QueuePolicy { levels: vec![LevelPolicy::from(None)], default_level: 0 };
        };
        let count = db.priority_levels.max(1) as usize;
        let levels = (1..=count as u64)
            .map(|l| LevelPolicy::from(db.priority_queue_policy.get(&l).or(db.default_queue_policy.as_ref())))
            .collect();
        let default_level = (db.default_priority_level as usize).clamp(1, count) - 1;
        QueuePolicy { levels, default_level }
    }

    /// 1 = highest; 0 or past the last level = the default level.
    fn level_of(&self, priority: u64) -> usize {
        match priority as usize {
            0 => self.default_level,
            p if p > self.levels.len() => self.default_level,
            p => p - 1,
        }
    }

    /// Whether any request can ever time out (then a reaper answers them on time).
    pub fn has_timeouts(&self) -> bool {
        self.levels.iter().any(|l| !l.default_timeout.is_zero() || l.allow_override)
    }
}

pub(super) fn cancelled() -> Error {
    Error::new(ErrorKind::Cancelled, "request cancelled").with_origin(Origin::Cancelled)
}

#[derive(Default)]
struct Level {
    fresh: VecDeque<Job>,
    /// Expired under DELAY: served after every fresh request of the level.
    delayed: VecDeque<Job>,
}

impl Level {
    fn len(&self) -> usize {
        self.fresh.len() + self.delayed.len()
    }
}

/// How many requests from the front are checked for a caller that went away, per sweep.
const CANCEL_WINDOW: usize = 1024;

pub(super) struct Queue {
    policy: QueuePolicy,
    levels: Vec<Level>,
    next_seq: u64,
    /// (deadline, seq, level) of every fresh request that has one.
    deadlines: BTreeSet<(Instant, u64, usize)>,
    pub stopping: bool,
}

impl Queue {
    pub fn new(policy: QueuePolicy) -> Self {
        let levels = policy.levels.iter().map(|_| Level::default()).collect();
        Queue { policy, levels, next_seq: 0, deadlines: BTreeSet::new(), stopping: false }
    }

    pub fn is_empty(&self) -> bool {
        self.levels.iter().all(|l| l.len() == 0)
    }

    /// Requests waiting, at every level.
    pub fn len(&self) -> usize {
        self.levels.iter().map(Level::len).sum()
    }

    /// Enqueues a request at its priority level (returning its arrival number), or hands it
    /// back with the reason it was refused.
    #[allow(clippy::result_large_err)]
    pub fn push(
        &mut self,
        req: ValidatedRequest,
        reply: oneshot::Sender<Result<InferResponse>>,
        now: Instant,
    ) -> std::result::Result<u64, (Error, oneshot::Sender<Result<InferResponse>>)> {
        let level = self.policy.level_of(req.priority);
        let policy = &self.policy.levels[level];
        if policy.max_size > 0 && self.levels[level].len() >= policy.max_size {
            let id = if req.id.is_empty() { "<id_unknown>" } else { &req.id };
            return Err((
                Error::unavailable(format!(
                    "[request id: {id}] Exceeds maximum queue size (max_queue_size {} of priority level {})",
                    policy.max_size,
                    level + 1
                )),
                reply,
            ));
        }
        // A timeout past the end of time is no timeout.
        let deadline = policy.timeout(req.timeout_us).and_then(|t| now.checked_add(t));
        let seq = self.next_seq;
        self.next_seq += 1;
        let queue_span = otel::queue_span(&req.span);
        if let Some(d) = deadline {
            self.deadlines.insert((d, seq, level));
        }
        self.levels[level].fresh.push_back(Job { req, enqueued: now, seq, deadline, reply, queue_span });
        Ok(seq)
    }

    /// Takes request `seq` out of the queue, if it is still there (its caller went away).
    /// O(levels x log n): fresh requests are in arrival order; delayed ones are few.
    pub fn remove(&mut self, seq: u64) -> Option<Job> {
        for (li, level) in self.levels.iter_mut().enumerate() {
            let found = match level.fresh.binary_search_by_key(&seq, |j| j.seq) {
                Ok(i) => level.fresh.remove(i),
                Err(_) => level.delayed.iter().position(|j| j.seq == seq).and_then(|i| level.delayed.remove(i)),
            };
            if let Some(job) = found {
                if let Some(d) = job.deadline {
                    self.deadlines.remove(&(d, job.seq, li));
                }
                return Some(job);
            }
        }
        None
    }

    /// Removes what must not run: expired requests under REJECT (those under DELAY move behind
    /// their level's fresh requests), and requests near the front whose caller went away (deeper
    /// ones are found when they get there). Returns the removed ones with the error to answer
    /// them with. Costs O(expired · log n + CANCEL_WINDOW), whatever the queue's length.
    pub fn sweep(&mut self, now: Instant) -> Vec<(Job, Error)> {
        let mut out = Vec::new();
        while let Some(&(at, seq, level)) = self.deadlines.first()
            && at <= now
        {
            self.deadlines.pop_first();
            let fresh = &mut self.levels[level].fresh;
            // Fresh requests stay in arrival (seq) order.
            let Ok(i) = fresh.binary_search_by_key(&seq, |j| j.seq) else { continue };
            let Some(mut job) = fresh.remove(i) else { continue };
            if self.policy.levels[level].reject {
                out.push((job, Error::unavailable("Request timeout expired").with_origin(Origin::Rejected)));
            } else {
                job.deadline = None;
                self.levels[level].delayed.push_back(job);
            }
        }
        let mut budget = CANCEL_WINDOW;
        for (li, level) in self.levels.iter_mut().enumerate() {
            for q in [&mut level.fresh, &mut level.delayed] {
                let mut end = budget.min(q.len());
                budget -= end;
                let mut i = 0;
                while i < end {
                    if !q[i].reply.is_closed() {
                        i += 1;
                        continue;
                    }
                    let Some(job) = q.remove(i) else { break };
                    if let Some(d) = job.deadline {
                        self.deadlines.remove(&(d, job.seq, li));
                    }
                    out.push((job, cancelled()));
                    end -= 1;
                }
            }
        }
        out
    }

    /// Requests in the order the batcher takes them: by level, fresh before delayed.
    pub fn iter(&self) -> impl Iterator<Item = &Job> {
        self.levels.iter().flat_map(|l| l.fresh.iter().chain(l.delayed.iter()))
    }

    /// Takes the first `n` requests in `iter` order.
    pub fn take(&mut self, mut n: usize) -> Vec<Job> {
        let mut out = Vec::with_capacity(n);
        for (li, level) in self.levels.iter_mut().enumerate() {
            for q in [&mut level.fresh, &mut level.delayed] {
                let k = n.min(q.len());
                for job in q.drain(..k) {
                    if let Some(d) = job.deadline {
                        self.deadlines.remove(&(d, job.seq, li));
                    }
                    out.push(job);
                }
                n -= k;
            }
        }
        out
    }

    /// The earliest instant a queued request expires.
    pub fn next_deadline(&self) -> Option<Instant> {
        self.deadlines.first().map(|&(at, _, _)| at)
    }
}

#[cfg(test)]
mod tests;
