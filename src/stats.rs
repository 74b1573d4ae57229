//! Per model-version statistics in Triton's shape (the statistics extension reads them, the
//! Prometheus metrics mirror them). Durations in nanoseconds.
use std::{
    collections::BTreeMap,
    sync::Mutex,
    time::{Duration, SystemTime, UNIX_EPOCH},
};

#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Tally {
    pub count: u64,
    pub ns: u64,
}

impl Tally {
    fn add(&mut self, count: u64, d: Duration) {
        self.count += count;
        self.ns += d.as_nanos() as u64 * count;
    }
}

/// Durations of one model execution's three phases.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct PhaseTimes {
    pub input: Duration,
    pub infer: Duration,
    pub output: Duration,
}

#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct BatchTally {
    pub compute_input: Tally,
    pub compute_infer: Tally,
    pub compute_output: Tally,
}

#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Snapshot {
    /// Milliseconds since the epoch of the last execution; 0 = never.
    pub last_inference_ms: u64,
    pub inference_count: u64,
    pub execution_count: u64,
    pub success: Tally,
    pub fail: Tally,
    pub queue: Tally,
    pub compute_input: Tally,
    pub compute_infer: Tally,
    pub compute_output: Tally,
    pub cache_hit: Tally,
    pub cache_miss: Tally,
    /// Keyed by executed batch size (rows).
    pub batches: BTreeMap<u64, BatchTally>,
}

#[derive(Debug, Default)]
pub struct Stats {
    inner: Mutex<Snapshot>,
}

impl Stats {
    pub fn snapshot(&self) -> Snapshot {
        self.lock().clone()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Snapshot> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A request answered successfully, `total` from arrival in the engine to the reply.
    pub fn record_success(&self, total: Duration) {
        self.lock().success.add(1, total);
    }

    pub fn record_failure(&self, total: Duration) {
        self.lock().fail.add(1, total);
    }

    /// One execution of `rows` rows made of requests that waited `queued` each.
    pub fn record_execution(&self, rows: u64, queued: &[Duration], phases: PhaseTimes) {
        let now_ms = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64);
        let mut s = self.lock();
        let n = queued.len() as u64;
        s.last_inference_ms = now_ms;
        s.inference_count += rows;
        s.execution_count += 1;
        for q in queued {
            s.queue.add(1, *q);
        }
        s.compute_input.add(n, phases.input);
        s.compute_infer.add(n, phases.infer);
        s.compute_output.add(n, phases.output);
        let b = s.batches.entry(rows).or_default();
        b.compute_input.add(1, phases.input);
        b.compute_infer.add(1, phases.infer);
        b.compute_output.add(1, phases.output);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn execution_counts_requests_and_batches() {
        let stats = Stats::default();
        let ms = Duration::from_millis(1);
        let phases = PhaseTimes { input: ms, infer: 2 * ms, output: ms };
        stats.record_execution(5, &[ms, 2 * ms], phases);
        stats.record_success(3 * ms);
        stats.record_success(3 * ms);
        let s = stats.snapshot();
        assert_eq!(s.inference_count, 5);
        assert_eq!(s.execution_count, 1);
        assert_eq!(s.queue, Tally { count: 2, ns: 3_000_000 });
        assert_eq!(s.compute_infer, Tally { count: 2, ns: 4_000_000 });
        assert_eq!(s.batches[&5].compute_infer, Tally { count: 1, ns: 2_000_000 });
        assert_eq!(s.success.count, 2);
        assert!(s.last_inference_ms > 0);
    }
}
