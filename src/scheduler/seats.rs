//! Who runs a version's instances. Each instance has a thread that waits for batches, and a seat
//! under the queue's lock saying whether the instance is busy. A light model's batch that the
//! batcher would run at once, arriving while an instance that may run anywhere is free, runs on
//! the caller's own thread instead: the request then costs no wake-up of the instance thread and
//! no wake-up of the caller when the reply is ready, which on light models is most of what a
//! request costs the server.
use std::{
    ops::{Deref, DerefMut},
    sync::atomic::{AtomicU64, Ordering},
    time::Duration,
};

use super::{Limit, queue::Queue};
use crate::backend::ModelInstance;

/// A batch may run on the caller's thread while batches have lately taken no longer than this
/// (it holds an async worker thread meanwhile).
pub(super) const ANYWHERE_MAX: Duration = Duration::from_micros(250);

/// A lone request's caller waits out the queue delay itself, holding the instance, when the delay
/// is no longer than this; a longer delay is waited out by the instance's thread.
pub(super) const LINGER_MAX: Duration = ANYWHERE_MAX;

/// Requests in a row that must have found the version idle before a lone one skips the queue
/// delay (`--adaptive-queue-delay`).
pub(super) const ALONE_RUNS: u32 = 8;

/// One instance, locked by whoever runs its batch (never two at once: the seat says who).
pub(super) struct Slot {
    pub instance: Box<dyn ModelInstance>,
    pub limit: Option<Limit>,
    /// Batches run, for the rate limiter's turn.
    pub executions: u64,
}

/// An instance's state under the queue's lock.
#[derive(Debug, Default, Clone, Copy)]
pub(super) struct Seat {
    /// A batch is running on it (on its thread, or on a caller's).
    pub busy: bool,
    /// Its thread waits on its condition variable.
    pub waiting: bool,
    /// Its batches may run on any thread: the backend allows it and no rate limiter gates it.
    pub anywhere: bool,
}

/// What the queue's lock guards: the queue and the instances' seats.
pub(super) struct State {
    pub queue: Queue,
    pub seats: Vec<Seat>,
    /// A caller holds a free instance while the batcher waits out a short queue delay for
    /// company (woken by `Shared::linger` when a request arrives or the version stops).
    pub lingering: bool,
    /// Requests in a row that arrived with every earlier one answered.
    pub alone: u32,
}

impl State {
    /// Counts a request about to be queued (`answered`: every earlier request of the version has
    /// its reply, so none is queued or running): in a row of lone arrivals, or the end of one.
    pub fn arriving(&mut self, answered: bool) {
        let idle = answered && self.queue.is_empty();
        self.alone = if idle { self.alone.saturating_add(1) } else { 0 };
    }

    /// The batcher should not wait for company now: the version is stopping, or (with
    /// `adaptive`) one request is queued and the last `ALONE_RUNS` each found the version idle:
    /// requests come one at a time (a client that sends its next when answered), and waiting
    /// would only delay them.
    pub fn hurry(&self, adaptive: bool) -> bool {
        self.queue.stopping || (adaptive && self.alone >= ALONE_RUNS && self.queue.len() == 1)
    }

    /// A free instance that may run on the caller's thread.
    pub fn free_anywhere(&self) -> Option<usize> {
        self.seats.iter().position(|s| s.anywhere && !s.busy)
    }

    /// A free instance whose thread waits, to wake for queued work.
    pub fn free_waiting(&self) -> Option<usize> {
        self.seats.iter().position(|s| s.waiting && !s.busy)
    }
}

impl Deref for State {
    type Target = Queue;
    fn deref(&self) -> &Queue {
        &self.queue
    }
}

impl DerefMut for State {
    fn deref_mut(&mut self) -> &mut Queue {
        &mut self.queue
    }
}

/// Moving averages of how long the version's batches take to run and how many input bytes they
/// carry (unknown until one ran).
#[derive(Debug)]
pub(super) struct Recent {
    ns: AtomicU64,
    bytes: AtomicU64,
}

impl Default for Recent {
    fn default() -> Self {
        Recent { ns: AtomicU64::new(u64::MAX), bytes: AtomicU64::new(0) }
    }
}

/// A request may run on the caller's thread when it carries no more than twice the bytes of the
/// batches the time average was built on, plus this slack (tiny requests vary in size).
const BYTES_SLACK: u64 = 4096;

fn average(cell: &AtomicU64, sample: u64, unknown: bool) {
    let old = cell.load(Ordering::Relaxed);
    let new = if unknown { sample } else { old - old / 8 + sample / 8 };
    cell.store(new, Ordering::Relaxed);
}

impl Recent {
    pub fn record(&self, took: Duration, bytes: usize) {
        let ns = u64::try_from(took.as_nanos()).unwrap_or(u64::MAX).min(u64::MAX - 1);
        let unknown = self.ns.load(Ordering::Relaxed) == u64::MAX;
        average(&self.bytes, bytes as u64, unknown);
        average(&self.ns, ns, unknown);
    }

    /// Batches lately ran within `ANYWHERE_MAX`, and a request of `bytes` is no bigger than they
    /// were: its cost is known not to be larger (a big image or text to a model that is
    /// usually fed small ones runs on the instance thread).
    pub fn light_for(&self, bytes: usize) -> bool {
        self.ns.load(Ordering::Relaxed) <= ANYWHERE_MAX.as_nanos() as u64
            && bytes as u64 <= self.bytes.load(Ordering::Relaxed).saturating_mul(2).saturating_add(BYTES_SLACK)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_average_follows_the_batches() {
        let r = Recent::default();
        assert!(!r.light_for(16), "unknown until a batch ran");
        r.record(Duration::from_micros(50), 64);
        assert!(r.light_for(64));
        for _ in 0..40 {
            r.record(Duration::from_millis(5), 64);
        }
        assert!(!r.light_for(64), "slow batches stop it");
        for _ in 0..60 {
            r.record(Duration::from_micros(20), 64);
        }
        assert!(r.light_for(64), "and fast ones bring it back");
    }

    #[test]
    fn a_request_bigger_than_the_recent_ones_is_not_light() {
        let r = Recent::default();
        for _ in 0..10 {
            r.record(Duration::from_micros(30), 100_000);
        }
        assert!(r.light_for(150_000), "within twice the usual size");
        assert!(!r.light_for(1 << 20), "a megabyte to a model fed 100 kB ones");
        let tiny = Recent::default();
        tiny.record(Duration::from_micros(10), 69);
        assert!(tiny.light_for(2000), "small requests vary");
        assert!(!tiny.light_for(1_000_000));
    }

    #[test]
    fn seats_pick_free_instances() {
        let q = Queue::new(crate::scheduler::QueuePolicy::new(None));
        let mut s = State {
            queue: q,
            seats: vec![
                Seat { busy: true, waiting: false, anywhere: true },
                Seat { busy: false, waiting: true, anywhere: false },
                Seat { busy: false, waiting: true, anywhere: true },
            ],
            lingering: false,
            alone: 0,
        };
        assert_eq!(s.free_anywhere(), Some(2));
        assert_eq!(s.free_waiting(), Some(1));
        s.seats[2].busy = true;
        s.seats[1].busy = true;
        assert_eq!((s.free_anywhere(), s.free_waiting()), (None, None));
    }
}
