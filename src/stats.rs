//! Per model-version statistics in Triton's shape: the statistics extension reports them and the
//! Prometheus metrics are read from them at scrape time, so requests update one place. Durations
//! in nanoseconds.
use std::{
    collections::{BTreeMap, VecDeque},
    sync::{
        Mutex,
        atomic::{AtomicI64, Ordering},
    },
    time::{Duration, Instant, SystemTime, UNIX_EPOCH},
};

use crate::error::Origin;

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

/// One response index of a decoupled model's streams (`"0"`, `"1"`, ... in the statistics):
/// `compute_infer` runs from the previous response (or the request's start) until the model
/// hands this one over, `compute_output` from then until it is passed to the front-end.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct ResponseTally {
    pub compute_infer: Tally,
    pub compute_output: Tally,
    pub success: Tally,
    pub fail: Tally,
    /// Responses that only mark the end of a stream (no outputs).
    pub empty_response: Tally,
    /// Streams the client left before this response.
    pub cancel: Tally,
}

/// How one response of a stream ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ResponseOutcome {
    Success,
    Empty,
    Fail,
    Cancel,
}

/// Memory a loaded version holds, by device (`kind`: "CPU", "CPU_PINNED" or "GPU").
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MemoryUse {
    pub kind: &'static str,
    pub id: i64,
    pub bytes: u64,
}

/// The resident memory of process `pid` ("self" for this one), from /proc; None where there
/// is no /proc.
pub fn resident_bytes(pid: &str) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let kib = status.lines().find_map(|l| l.strip_prefix("VmRSS:")?.trim().strip_suffix("kB")?.trim().parse().ok());
    kib.map(|k: u64| k * 1024)
}

/// Adds `uses` together by device.
pub fn sum_memory(uses: impl IntoIterator<Item = MemoryUse>) -> Vec<MemoryUse> {
    let mut by: BTreeMap<(&'static str, i64), u64> = BTreeMap::new();
    for m in uses {
        *by.entry((m.kind, m.id)).or_default() += m.bytes;
    }
    by.into_iter().map(|((kind, id), bytes)| MemoryUse { kind, id, bytes }).collect()
}

/// Recent per-request durations (µs) kept for latency summaries, newest last.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct Recent {
    pub request: VecDeque<f64>,
    pub queue: VecDeque<f64>,
    pub compute_input: VecDeque<f64>,
    pub compute_infer: VecDeque<f64>,
    pub compute_output: VecDeque<f64>,
}

const RECENT: usize = 1024;

fn keep(q: &mut VecDeque<f64>, d: Duration, n: usize) {
    for _ in 0..n {
        if q.len() == RECENT {
            q.pop_front();
        }
        q.push_back(d.as_secs_f64() * 1e6);
    }
}

#[derive(Debug, Default, Clone, PartialEq)]
pub struct Snapshot {
    /// Milliseconds since the epoch of the last execution; 0 = never.
    pub last_inference_ms: u64,
    pub inference_count: u64,
    pub execution_count: u64,
    pub success: Tally,
    pub fail: Tally,
    /// Failures by where they failed, in `Origin::ALL` order.
    pub fail_by_origin: [u64; 4],
    pub queue: Tally,
    pub compute_input: Tally,
    pub compute_infer: Tally,
    pub compute_output: Tally,
    pub cache_hit: Tally,
    pub cache_miss: Tally,
    /// Keyed by executed batch size (rows).
    pub batches: BTreeMap<u64, BatchTally>,
    /// Keyed by response index, for decoupled models.
    pub responses: BTreeMap<u64, ResponseTally>,
    /// What the version's instances hold, measured when they were loaded.
    pub memory: Vec<MemoryUse>,
    /// Requests queued and not yet running.
    pub pending: i64,
    /// Requests running on an instance.
    pub executing: i64,
    /// Average queue time of the requests that started running in the last minute (µs).
    pub recent_queue_us: f64,
    /// Only when summaries are kept.
    pub recent: Option<Recent>,
    /// Only when the first-response histogram is kept.
    pub first_response: Option<Histogram>,
    /// Tokens of the prompts and of the completions the OpenAI API counted for this version.
    pub prompt_tokens: u64,
    pub completion_tokens: u64,
}

/// Request durations in milliseconds, by bucket upper bound (the last bucket is +Inf).
#[derive(Debug, Clone, PartialEq)]
pub struct Histogram {
    pub bounds: Vec<f64>,
    /// Per bucket (not cumulative), one more entry than `bounds`.
    pub counts: Vec<u64>,
    pub sum_ms: f64,
}

impl Histogram {
    pub fn new(bounds: Vec<f64>) -> Self {
        let counts = vec![0; bounds.len() + 1];
        Histogram { bounds, counts, sum_ms: 0.0 }
    }

    fn observe(&mut self, ms: f64) {
        let i = self.bounds.iter().position(|b| ms <= *b).unwrap_or(self.bounds.len());
        self.counts[i] += 1;
        self.sum_ms += ms;
    }
}

/// Queue time per 10-second slot, for the last minute.
#[derive(Debug, Default)]
struct Window {
    slots: VecDeque<(u64, Duration, u64)>,
}

impl Window {
    const SLOT_SECS: u64 = 10;
    const SLOTS: u64 = 6;

    fn add(&mut self, now: u64, d: Duration, n: u64) {
        let slot = now / Self::SLOT_SECS;
        match self.slots.back_mut() {
            Some((s, sum, count)) if *s == slot => {
                *sum += d * n as u32;
                *count += n;
            }
            _ => self.slots.push_back((slot, d * n as u32, n)),
        }
        while self.slots.front().is_some_and(|(s, _, _)| *s + Self::SLOTS <= slot) {
            self.slots.pop_front();
        }
    }

    fn average_us(&self, now: u64) -> f64 {
        let slot = now / Self::SLOT_SECS;
        let (sum, count) = self
            .slots
            .iter()
            .filter(|(s, _, _)| *s + Self::SLOTS > slot)
            .fold((Duration::ZERO, 0), |(a, b), (_, d, n)| (a + *d, b + n));
        if count == 0 { 0.0 } else { sum.as_secs_f64() * 1e6 / count as f64 }
    }
}

#[derive(Debug, Default)]
struct Inner {
    snap: Snapshot,
    window: Window,
}

#[derive(Debug)]
pub struct Stats {
    inner: Mutex<Inner>,
    pending: AtomicI64,
    executing: AtomicI64,
    epoch: Instant,
}

impl Default for Stats {
    fn default() -> Self {
        Stats::new(false, None)
    }
}

impl Stats {
    /// `keep_recent`: also keep recent durations for latency summaries; `histogram`: bucket
    /// bounds (ms) of a request-duration histogram to keep.
    pub fn new(keep_recent: bool, histogram: Option<Vec<f64>>) -> Self {
        let snap = Snapshot {
            recent: keep_recent.then(Recent::default),
            first_response: histogram.map(Histogram::new),
            ..Default::default()
        };
        let inner = Inner { snap, ..Default::default() };
        Stats {
            inner: Mutex::new(inner),
            pending: AtomicI64::new(0),
            executing: AtomicI64::new(0),
            epoch: Instant::now(),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn now_secs(&self) -> u64 {
        self.epoch.elapsed().as_secs()
    }

    /// Requests queued or running now (what `ferry_inference_load` reports), without a snapshot.
    pub fn load(&self) -> i64 {
        self.pending.load(Ordering::Relaxed) + self.executing.load(Ordering::Relaxed)
    }

    pub fn snapshot(&self) -> Snapshot {
        let now = self.now_secs();
        let inner = self.lock();
        let mut s = inner.snap.clone();
        s.pending = self.pending.load(Ordering::Relaxed);
        s.executing = self.executing.load(Ordering::Relaxed);
        s.recent_queue_us = inner.window.average_us(now);
        s
    }

    /// A request entered (+1) or left (-1) the queue without running.
    pub fn queued(&self, delta: i64) {
        self.pending.fetch_add(delta, Ordering::Relaxed);
    }

    /// `n` queued requests started (+) or finished (-) running.
    pub fn running(&self, n: i64) {
        if n > 0 {
            self.pending.fetch_sub(n, Ordering::Relaxed);
        }
        self.executing.fetch_add(n, Ordering::Relaxed);
    }

    /// A request answered successfully, `total` from arrival in the engine to the reply.
    pub fn record_success(&self, total: Duration) {
        let mut inner = self.lock();
        inner.snap.success.add(1, total);
        if let Some(r) = &mut inner.snap.recent {
            keep(&mut r.request, total, 1);
        }
        if let Some(h) = &mut inner.snap.first_response {
            h.observe(total.as_secs_f64() * 1e3);
        }
    }

    pub fn record_failure(&self, total: Duration, origin: Origin) {
        let mut inner = self.lock();
        inner.snap.fail.add(1, total);
        let i = Origin::ALL.iter().position(|o| *o == origin).unwrap_or(2);
        inner.snap.fail_by_origin[i] += 1;
    }

    /// Response `index` of a stream: `infer` until the model handed it over, `output` until it
    /// reached the front-end.
    pub fn record_response(&self, index: u64, outcome: ResponseOutcome, infer: Duration, output: Duration) {
        let mut inner = self.lock();
        let r = inner.snap.responses.entry(index).or_default();
        let total = infer + output;
        match outcome {
            ResponseOutcome::Success => {
                r.compute_infer.add(1, infer);
                r.compute_output.add(1, output);
                r.success.add(1, total);
            }
            ResponseOutcome::Fail => {
                r.compute_infer.add(1, infer);
                r.compute_output.add(1, output);
                r.fail.add(1, total);
            }
            ResponseOutcome::Empty => r.empty_response.add(1, total),
            ResponseOutcome::Cancel => r.cancel.add(1, total),
        }
    }

    /// The memory the version's instances hold.
    pub fn set_memory(&self, memory: Vec<MemoryUse>) {
        self.lock().snap.memory = memory;
    }

    /// A request answered from the response cache: `lookup` to find and copy the response,
    /// `queued` from arrival to the lookup (the queue figure Triton reports for hits).
    pub fn record_cache_hit(&self, lookup: Duration, queued: Duration) {
        let mut inner = self.lock();
        inner.snap.cache_hit.add(1, lookup);
        inner.snap.queue.add(1, queued);
    }

    /// A request the cache did not hold: `spent` in the lookup and the insertion.
    /// Tokens an OpenAI API request counted.
    pub fn record_tokens(&self, prompt: u64, completion: u64) {
        let mut inner = self.lock();
        inner.snap.prompt_tokens = inner.snap.prompt_tokens.saturating_add(prompt);
        inner.snap.completion_tokens = inner.snap.completion_tokens.saturating_add(completion);
    }

    pub fn record_cache_miss(&self, spent: Duration) {
        self.lock().snap.cache_miss.add(1, spent);
    }

    /// One execution of `rows` rows made of requests that waited `queued` each.
    pub fn record_execution(&self, rows: u64, queued: &[Duration], phases: PhaseTimes) {
        let now_ms = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64);
        let now = self.now_secs();
        let mut inner = self.lock();
        let n = queued.len() as u64;
        for q in queued {
            inner.window.add(now, *q, 1);
        }
        let s = &mut inner.snap;
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
        if let Some(r) = &mut s.recent {
            for q in queued {
                keep(&mut r.queue, *q, 1);
            }
            keep(&mut r.compute_input, phases.input, n as usize);
            keep(&mut r.compute_infer, phases.infer, n as usize);
            keep(&mut r.compute_output, phases.output, n as usize);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn execution_counts_requests_and_batches() {
        let stats = Stats::new(true, Some(vec![1.0, 10.0]));
        let ms = Duration::from_millis(1);
        let phases = PhaseTimes { input: ms, infer: 2 * ms, output: ms };
        stats.queued(2);
        stats.running(2);
        stats.record_execution(5, &[ms, 2 * ms], phases);
        stats.running(-2);
        stats.record_success(3 * ms);
        stats.record_success(3 * ms);
        stats.record_failure(ms, Origin::Rejected);
        let s = stats.snapshot();
        assert_eq!(s.inference_count, 5);
        assert_eq!(s.execution_count, 1);
        assert_eq!(s.queue, Tally { count: 2, ns: 3_000_000 });
        assert_eq!(s.compute_infer, Tally { count: 2, ns: 4_000_000 });
        assert_eq!(s.batches[&5].compute_infer, Tally { count: 1, ns: 2_000_000 });
        assert_eq!(s.success.count, 2);
        assert_eq!(s.fail_by_origin, [0, 0, 0, 1]);
        assert_eq!((s.pending, s.executing), (0, 0));
        assert!((s.recent_queue_us - 1500.0).abs() < 1e-6);
        assert_eq!(s.recent.unwrap().compute_infer.len(), 2);
        assert_eq!(s.first_response.unwrap().counts, vec![0, 2, 0]);
        assert!(s.last_inference_ms > 0);
    }

    #[test]
    fn responses_are_kept_by_index() {
        let stats = Stats::default();
        let ms = Duration::from_millis(1);
        stats.record_response(0, ResponseOutcome::Success, 2 * ms, ms);
        stats.record_response(1, ResponseOutcome::Success, ms, ms);
        stats.record_response(1, ResponseOutcome::Empty, ms, Duration::ZERO);
        stats.record_response(0, ResponseOutcome::Fail, ms, Duration::ZERO);
        stats.record_response(2, ResponseOutcome::Cancel, ms, Duration::ZERO);
        let s = stats.snapshot();
        let first = s.responses[&0];
        assert_eq!(first.success, Tally { count: 1, ns: 3_000_000 });
        assert_eq!(first.fail, Tally { count: 1, ns: 1_000_000 });
        assert_eq!(first.compute_infer, Tally { count: 2, ns: 3_000_000 });
        assert_eq!(s.responses[&1].empty_response, Tally { count: 1, ns: 1_000_000 });
        assert_eq!(s.responses[&1].success.count, 1);
        assert_eq!(s.responses[&2].cancel.count, 1);
        assert_eq!(s.responses[&2].success.count, 0);
    }

    #[test]
    fn resident_memory_is_read_from_proc() {
        let Some(bytes) = resident_bytes("self") else { return };
        assert!(bytes > 1 << 20, "a test process holds more than 1 MiB: {bytes}");
        assert_eq!(resident_bytes("0"), None);
    }

    #[test]
    fn memory_adds_up_by_device() {
        let m = |kind, id, bytes| MemoryUse { kind, id, bytes };
        let summed = sum_memory([m("GPU", 1, 5), m("CPU", 0, 3), m("GPU", 1, 7), m("GPU", 0, 1)]);
        assert_eq!(summed, vec![m("CPU", 0, 3), m("GPU", 0, 1), m("GPU", 1, 12)]);
        let stats = Stats::default();
        stats.set_memory(summed.clone());
        assert_eq!(stats.snapshot().memory, summed);
    }

    #[test]
    fn the_queue_window_forgets_after_a_minute() {
        let mut w = Window::default();
        w.add(0, Duration::from_micros(100), 1);
        w.add(15, Duration::from_micros(300), 1);
        assert!((w.average_us(15) - 200.0).abs() < 1e-6);
        assert!((w.average_us(65) - 300.0).abs() < 1e-6);
        assert_eq!(w.average_us(200), 0.0);
    }
}
