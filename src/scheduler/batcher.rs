//! When to cut a batch: a pure function of the queue and the clock, after Triton's dynamic
//! batcher (preferred sizes, a maximum queue delay, never more than max_batch_size, and only
//! requests whose shapes agree in one batch).
use std::time::{Duration, Instant};

use crate::proto::inference::ModelDynamicBatching;

/// The longest a request waits for a batch to fill.
const MAX_DELAY: Duration = Duration::from_secs(24 * 3600);

#[derive(Debug, Clone, PartialEq)]
pub struct BatchPolicy {
    /// Rows one execution may hold; 0 = the model does not batch.
    pub max_batch_size: usize,
    /// false: every request runs alone (Triton's default scheduler).
    pub dynamic: bool,
    /// Preferred batch sizes, ascending; empty = only max_batch_size.
    pub preferred: Vec<usize>,
    pub max_delay: Duration,
    /// A lone request on a model whose requests lately came one at a time runs at once
    /// (`--adaptive-queue-delay`; see `State::hurry`).
    pub adaptive: bool,
}

impl BatchPolicy {
    pub fn new(max_batch_size: usize, dynamic: Option<&ModelDynamicBatching>) -> Self {
        let Some(db) = dynamic.filter(|_| max_batch_size > 0) else {
            return BatchPolicy {
                max_batch_size,
                dynamic: false,
                preferred: Vec::new(),
                max_delay: Duration::ZERO,
                adaptive: false,
            };
        };
        let mut preferred: Vec<usize> =
            db.preferred_batch_size.iter().filter_map(|&p| usize::try_from(p).ok()).collect();
        preferred.sort_unstable();
        preferred.dedup();
        BatchPolicy {
            max_batch_size,
            dynamic: true,
            preferred,
            // Past a day a delay means "until the batch is full"; capped, deadlines stay in range.
            max_delay: Duration::from_micros(db.max_queue_delay_microseconds).min(MAX_DELAY),
            adaptive: false,
        }
    }

    pub fn adaptive(self, adaptive: bool) -> Self {
        BatchPolicy { adaptive, ..self }
    }

    fn largest_preferred(&self) -> usize {
        self.preferred.last().copied().unwrap_or(self.max_batch_size)
    }
}

/// What the batcher needs to know of one queued request.
#[derive(Debug, Clone, Copy)]
pub struct Pending<'a> {
    pub rows: usize,
    pub enqueued: Instant,
    /// Requests may share a batch only when these are equal.
    pub key: &'a [i64],
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decision {
    /// Take this many requests from the front of the queue and run them now.
    Run(usize),
    /// Nothing to run yet; decide again at this instant (or when a request arrives).
    WaitUntil(Instant),
    Idle,
}

/// Decides for the queue as it stands at `now`. With `flush` (shutting down, or a lone request
/// that need not wait: `State::hurry`), never waits.
pub fn decide<'a>(
    policy: &BatchPolicy,
    pending: impl IntoIterator<Item = Pending<'a>>,
    now: Instant,
    flush: bool,
) -> Decision {
    let mut pending = pending.into_iter();
    let Some(first) = pending.next() else {
        return Decision::Idle;
    };
    if !policy.dynamic {
        return Decision::Run(1);
    }
    // Like Triton, a batch never grows past the largest preferred size (default: the maximum).
    let limit = policy.largest_preferred();
    let (mut count, mut rows) = (1, first.rows);
    let mut preferred_prefix = policy.preferred.contains(&rows).then_some(1);
    let mut closed = rows >= limit;
    for p in pending {
        if closed || rows + p.rows > limit || p.key != first.key {
            closed = true;
            break;
        }
        count += 1;
        rows += p.rows;
        if policy.preferred.contains(&rows) {
            preferred_prefix = Some(count);
        }
        closed = rows >= limit;
    }
    let deadline = first.enqueued + policy.max_delay;
    if closed || policy.max_delay.is_zero() || now >= deadline || flush {
        return Decision::Run(count);
    }
    match preferred_prefix {
        Some(n) => Decision::Run(n),
        None => Decision::WaitUntil(deadline),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy(max: usize, preferred: &[usize], delay_us: u64) -> BatchPolicy {
        BatchPolicy {
            max_batch_size: max,
            dynamic: true,
            preferred: preferred.to_vec(),
            max_delay: Duration::from_micros(delay_us),
            adaptive: false,
        }
    }

    fn queue(t0: Instant, rows: &[usize]) -> Vec<(usize, Instant)> {
        rows.iter().enumerate().map(|(i, &r)| (r, t0 + Duration::from_micros(i as u64))).collect()
    }

    fn run(p: &BatchPolicy, q: &[(usize, Instant)], now: Instant) -> Decision {
        decide(p, q.iter().map(|&(rows, enqueued)| Pending { rows, enqueued, key: &[] }), now, false)
    }

    #[test]
    fn empty_queue_is_idle() {
        assert_eq!(run(&policy(8, &[], 100), &[], Instant::now()), Decision::Idle);
    }

    #[test]
    fn without_dynamic_batching_one_at_a_time() {
        let t0 = Instant::now();
        let p = BatchPolicy::new(8, None);
        assert_eq!(run(&p, &queue(t0, &[1, 1, 1]), t0), Decision::Run(1));
    }

    #[test]
    fn zero_delay_takes_all_up_to_max() {
        let t0 = Instant::now();
        let p = policy(4, &[], 0);
        assert_eq!(run(&p, &queue(t0, &[1, 1]), t0), Decision::Run(2));
        assert_eq!(run(&p, &queue(t0, &[1, 2, 1, 1]), t0), Decision::Run(3));
    }

    #[test]
    fn waits_for_the_delay_then_cuts_what_is_there() {
        let t0 = Instant::now();
        let p = policy(8, &[], 100);
        let q = queue(t0, &[1, 1, 1]);
        assert_eq!(run(&p, &q, t0), Decision::WaitUntil(t0 + Duration::from_micros(100)));
        assert_eq!(run(&p, &q, t0 + Duration::from_micros(100)), Decision::Run(3));
    }

    #[test]
    fn full_batch_runs_at_once() {
        let t0 = Instant::now();
        let p = policy(4, &[], 1_000_000);
        assert_eq!(run(&p, &queue(t0, &[2, 2, 1]), t0), Decision::Run(2));
    }

    #[test]
    fn largest_preferred_prefix_runs_before_the_delay() {
        let t0 = Instant::now();
        let p = policy(16, &[2, 4], 1_000_000);
        assert_eq!(run(&p, &queue(t0, &[1, 1, 1]), t0), Decision::Run(2));
        assert_eq!(run(&p, &queue(t0, &[1, 1, 1, 1, 1]), t0), Decision::Run(4));
        assert_eq!(run(&p, &queue(t0, &[3]), t0), Decision::WaitUntil(t0 + Duration::from_secs(1)));
        // A batch at the largest preferred size runs at once and grows no further.
        assert_eq!(run(&p, &queue(t0, &[4, 1]), t0), Decision::Run(1));
        // A request larger than the largest preferred size runs alone.
        assert_eq!(run(&p, &queue(t0, &[6, 1]), t0), Decision::Run(1));
    }

    #[test]
    fn requests_with_other_shapes_close_the_batch() {
        let t0 = Instant::now();
        let p = policy(8, &[], 1_000_000);
        let keys: [&[i64]; 3] = [&[3], &[3], &[5]];
        let d = decide(&p, keys.iter().map(|k| Pending { rows: 1, enqueued: t0, key: k }), t0, false);
        assert_eq!(d, Decision::Run(2));
    }

    #[test]
    fn flush_never_waits() {
        let t0 = Instant::now();
        let p = policy(8, &[], 1_000_000);
        let q = queue(t0, &[1]);
        let d = decide(&p, q.iter().map(|&(rows, enqueued)| Pending { rows, enqueued, key: &[] }), t0, true);
        assert_eq!(d, Decision::Run(1));
    }

    #[test]
    fn policy_from_config_sorts_preferred_sizes() {
        let db = ModelDynamicBatching {
            preferred_batch_size: vec![8, 4],
            max_queue_delay_microseconds: 50,
            ..Default::default()
        };
        let p = BatchPolicy::new(8, Some(&db));
        assert!(p.dynamic);
        assert_eq!(p.preferred, vec![4, 8]);
        assert_eq!(p.max_delay, Duration::from_micros(50));
        assert!(!BatchPolicy::new(0, Some(&db)).dynamic);
        // A delay past the end of time waits a day, and the deadline is computed without overflow.
        let forever = ModelDynamicBatching { max_queue_delay_microseconds: u64::MAX, ..Default::default() };
        let p = BatchPolicy::new(8, Some(&forever));
        assert_eq!(p.max_delay, MAX_DELAY);
        let t0 = Instant::now();
        assert_eq!(run(&p, &queue(t0, &[1]), t0), Decision::WaitUntil(t0 + MAX_DELAY));
    }
}
