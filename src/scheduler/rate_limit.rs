//! Triton's rate limiter (`--rate-limit=execution_count`): an instance runs a batch only while
//! the resources its `instance_group { rate_limiter { resources [...] } }` names are free, across
//! every model of the server; among instances that could run, the one with the fewest executions
//! weighted by its `priority` goes first (priority 2 gets half the turns of priority 1).
//! A resource's count is the `--rate-limit-resource=name:count[:device]` flag's, else the most
//! any one instance needs; a per-device resource is counted on each device apart, a `global`
//! one once for the server.
use std::{
    collections::HashMap,
    sync::{Condvar, Mutex, MutexGuard},
};

/// A resource: its name, and the device it is counted on (None: global).
pub type Key = (String, Option<i32>);

/// What one instance needs to run a batch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Need {
    pub resources: Vec<(Key, u64)>,
    /// At least 1.
    pub priority: u64,
}

/// `--rate-limit-resource` values: counts by name and device (None: every device).
pub type Given = HashMap<(String, Option<i32>), u64>;

#[derive(Default)]
struct State {
    /// Counts the flags fixed, and the defaults (the most one instance needs) for the rest.
    given: Given,
    default: HashMap<Key, u64>,
    used: HashMap<Key, u64>,
    /// Instances waiting: (ticket, weighted executions, need).
    waiting: Vec<(u64, u64, Need)>,
    next: u64,
}

impl State {
    fn capacity(&self, key: &Key) -> u64 {
        let (name, device) = key;
        self.given
            .get(&(name.clone(), *device))
            .or_else(|| self.given.get(&(name.clone(), None)))
            .or_else(|| self.default.get(key))
            .copied()
            .unwrap_or(0)
    }

    fn fits(&self, need: &Need) -> bool {
        need.resources.iter().all(|(k, n)| self.used.get(k).copied().unwrap_or(0) + n <= self.capacity(k))
    }
}

pub struct RateLimiter {
    state: Mutex<State>,
    freed: Condvar,
}

impl std::fmt::Debug for RateLimiter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RateLimiter").field("given", &self.lock().given).finish_non_exhaustive()
    }
}

/// The resources of one running batch; given back when dropped.
pub struct Granted<'a> {
    limiter: &'a RateLimiter,
    need: &'a Need,
}

impl Drop for Granted<'_> {
    fn drop(&mut self) {
        let mut s = self.limiter.lock();
        for (k, n) in &self.need.resources {
            if let Some(used) = s.used.get_mut(k) {
                *used = used.saturating_sub(*n);
            }
        }
        drop(s);
        self.limiter.freed.notify_all();
    }
}

impl RateLimiter {
    pub fn new(given: Given) -> RateLimiter {
        RateLimiter { state: Mutex::new(State { given, ..State::default() }), freed: Condvar::new() }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// An instance that will ask for `need`: resources the flags do not fix grow to what it
    /// needs; one that needs more than a flag gives can never run, and is refused.
    pub fn register(&self, model: &str, need: &Need) -> Result<(), String> {
        let mut s = self.lock();
        for ((name, device), n) in &need.resources {
            let key = (name.clone(), *device);
            let fixed = s.given.get(&key).or_else(|| s.given.get(&(name.clone(), None))).copied();
            match fixed {
                Some(count) if count < *n => {
                    return Err(format!(
                        "model '{model}': an instance needs {n} of rate-limiter resource '{name}'{}, more than the {count} \
                         --rate-limit-resource gives",
                        device.map(|d| format!(" on device {d}")).unwrap_or_default()
                    ));
                }
                Some(_) => {}
                None => {
                    let d = s.default.entry(key).or_insert(0);
                    *d = (*d).max(*n);
                }
            }
        }
        Ok(())
    }

    /// Blocks until the instance may run (its resources free, and no instance that could run
    /// has had fewer weighted turns); `executions` counts this instance's turns.
    pub fn acquire<'a>(&'a self, need: &'a Need, executions: &mut u64) -> Granted<'a> {
        let mut s = self.lock();
        s.next += 1;
        let ticket = s.next;
        let score = executions.saturating_add(1).saturating_mul(need.priority.max(1));
        s.waiting.push((ticket, score, need.clone()));
        loop {
            let best = s.waiting.iter().filter(|(_, _, n)| s.fits(n)).min_by_key(|(t, score, _)| (*score, *t));
            if best.is_some_and(|(t, _, _)| *t == ticket) {
                s.waiting.retain(|(t, _, _)| *t != ticket);
                for (k, n) in &need.resources {
                    *s.used.entry(k.clone()).or_insert(0) += n;
                }
                *executions += 1;
                drop(s);
                // Another waiter may fit in what is left.
                self.freed.notify_all();
                return Granted { limiter: self, need };
            }
            s = self.freed.wait(s).unwrap_or_else(|p| p.into_inner());
        }
    }
}

/// Parses one `--rate-limit-resource` value: `name:count` or `name:count:device`.
pub fn parse_resource(value: &str) -> Result<((String, Option<i32>), u64), String> {
    let bad = || format!("--rate-limit-resource '{value}': expected <name>:<count> or <name>:<count>:<device>");
    let parts: Vec<&str> = value.split(':').collect();
    let (name, count, device) = match parts.as_slice() {
        [name, count] => (*name, *count, None),
        [name, count, device] => (*name, *count, Some(device.parse::<i32>().map_err(|_| bad())?)),
        _ => return Err(bad()),
    };
    if name.is_empty() || device.is_some_and(|d| d < 0) {
        return Err(bad());
    }
    Ok(((name.to_string(), device), count.parse::<u64>().map_err(|_| bad())?))
}

#[cfg(test)]
mod tests {
    use std::{
        sync::{Arc, atomic::AtomicUsize, atomic::Ordering},
        time::Duration,
    };

    use super::*;

    fn need(name: &str, n: u64, priority: u64) -> Need {
        Need { resources: vec![((name.to_string(), Some(0)), n)], priority }
    }

    #[test]
    fn resource_flags_parse_as_tritons() {
        assert_eq!(parse_resource("R1:5").unwrap(), (("R1".into(), None), 5));
        assert_eq!(parse_resource("R1:5:1").unwrap(), (("R1".into(), Some(1)), 5));
        for bad in ["R1", ":5", "R1:x", "R1:5:-1", "R1:5:0:1", "R1:5:gpu"] {
            assert!(parse_resource(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn instances_run_only_while_their_resources_are_free() {
        let limiter = Arc::new(RateLimiter::new(Given::new()));
        let big = need("R", 2, 1);
        limiter.register("m", &big).unwrap();
        let (running, most) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
        let threads: Vec<_> = (0..4)
            .map(|_| {
                let (limiter, need, running, most) =
                    (Arc::clone(&limiter), big.clone(), Arc::clone(&running), Arc::clone(&most));
                std::thread::spawn(move || {
                    let mut executions = 0;
                    for _ in 0..5 {
                        let _granted = limiter.acquire(&need, &mut executions);
                        let now = running.fetch_add(1, Ordering::SeqCst) + 1;
                        most.fetch_max(now, Ordering::SeqCst);
                        std::thread::sleep(Duration::from_millis(2));
                        running.fetch_sub(1, Ordering::SeqCst);
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        // The default count is what one instance needs: one at a time.
        assert_eq!(most.load(Ordering::SeqCst), 1);
    }

    #[test]
    fn a_need_over_the_flag_is_refused_and_priorities_share_the_turns() {
        let mut given = Given::new();
        given.insert(("R".into(), None), 1);
        let limiter = RateLimiter::new(given);
        assert!(limiter.register("m", &need("R", 2, 1)).unwrap_err().contains("more than the 1"));
        let (fast, slow) = (need("R", 1, 1), need("R", 1, 2));
        limiter.register("a", &fast).unwrap();
        limiter.register("b", &slow).unwrap();
        // With both waiting, the lower weighted count goes first: priority 1 after 2 turns
        // scores 3, priority 2 after 1 turn scores 4.
        let mut s = limiter.lock();
        s.waiting.push((1, 3, fast.clone()));
        s.waiting.push((2, 4, slow.clone()));
        let best = s.waiting.iter().filter(|(_, _, n)| s.fits(n)).min_by_key(|(t, sc, _)| (*sc, *t)).unwrap().0;
        assert_eq!(best, 1);
        s.used.insert(("R".into(), Some(0)), 1);
        assert!(!s.fits(&fast), "the only R is in use");
    }
}
