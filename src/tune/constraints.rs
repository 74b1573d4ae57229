//! Which measured point `ferry tune` recommends, as Model Analyzer chose: the constraints (a
//! latency budget at p99 or p95 that every model must keep, a least throughput, a most memory)
//! filter the samples, and the objective ranks what is left. Within 3% of the best value the
//! other measure breaks the tie (the lower latency for throughput, the higher throughput for
//! latency). When nothing is feasible, each constraint that no sample met is named with the best
//! value measured, and the closest sample (the smallest summed relative violation) is shown.
use crate::config::{Objective, Percentile, TuneSettings};

use super::search::Measured;

const MIB: f64 = 1024.0 * 1024.0;

/// "512.0 MiB", or bytes below one MiB.
fn size(bytes: u64) -> String {
    if bytes < 1 << 20 { format!("{bytes} bytes") } else { format!("{:.1} MiB", bytes as f64 / MIB) }
}

#[derive(Debug, Clone, Copy)]
pub struct Constraints {
    pub latency_ms: Option<f64>,
    pub percentile: Percentile,
    pub min_throughput: Option<f64>,
    pub max_memory_bytes: Option<u64>,
    pub objective: Objective,
}

/// A sample of a measured combination: `measured[point].samples[sample]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Pick {
    pub point: usize,
    pub sample: usize,
}

/// Why nothing was recommended.
#[derive(Debug, Clone)]
pub struct Infeasible {
    /// One line per constraint that no sample met on its own; empty when each was met by some
    /// sample but none met all of them.
    pub unmet: Vec<String>,
    /// The clean sample nearest to meeting them all.
    pub closest: Option<Pick>,
    /// No sample was answered without errors.
    pub all_failed: bool,
}

impl Constraints {
    pub fn of(settings: &TuneSettings) -> Self {
        Constraints {
            latency_ms: settings.latency_budget_ms,
            percentile: settings.percentile,
            min_throughput: settings.min_throughput,
            max_memory_bytes: settings.max_memory_bytes,
            objective: settings.objective,
        }
    }

    /// "p99 <= 5 ms, >= 100 requests/s, <= 512 MiB" (empty: none).
    pub fn describe(&self) -> String {
        let mut parts = Vec::new();
        if let Some(l) = self.latency_ms {
            parts.push(format!("{} <= {l} ms", self.percentile.label()));
        }
        if let Some(t) = self.min_throughput {
            parts.push(format!(">= {t} requests/s"));
        }
        if let Some(m) = self.max_memory_bytes {
            parts.push(format!("<= {}", size(m)));
        }
        parts.join(", ")
    }

    fn latency_ok(&self, m: &Measured, i: usize) -> bool {
        self.latency_ms.is_none_or(|l| m.worst_latency(i, self.percentile) <= l)
    }

    fn throughput_ok(&self, m: &Measured, i: usize) -> bool {
        self.min_throughput.is_none_or(|t| m.samples[i].throughput >= t)
    }

    fn memory_ok(&self, m: &Measured) -> bool {
        self.max_memory_bytes.is_none_or(|b| m.memory_bytes() <= b)
    }

    pub fn feasible(&self, m: &Measured, i: usize) -> bool {
        m.clean(i) && self.latency_ok(m, i) && self.throughput_ok(m, i) && self.memory_ok(m)
    }

    fn clean(measured: &[Measured]) -> impl Iterator<Item = (Pick, &Measured)> {
        measured.iter().enumerate().flat_map(|(p, m)| {
            (0..m.samples.len()).filter(move |&s| m.clean(s)).map(move |s| (Pick { point: p, sample: s }, m))
        })
    }

    /// The recommended sample, if any is feasible.
    pub fn choose(&self, measured: &[Measured]) -> Option<Pick> {
        let feasible: Vec<(Pick, f64, f64)> = Self::clean(measured)
            .filter(|(k, m)| self.feasible(m, k.sample))
            .map(|(k, m)| (k, m.samples[k.sample].throughput, m.worst_latency(k.sample, self.percentile)))
            .collect();
        match self.objective {
            Objective::Throughput => {
                let top = feasible.iter().map(|f| f.1).fold(0.0, f64::max);
                feasible.iter().filter(|f| f.1 >= 0.97 * top).min_by(|a, b| a.2.total_cmp(&b.2)).map(|f| f.0)
            }
            Objective::Latency => {
                let low = feasible.iter().map(|f| f.2).fold(f64::INFINITY, f64::min);
                feasible.iter().filter(|f| f.2 <= 1.03 * low).max_by(|a, b| a.1.total_cmp(&b.1)).map(|f| f.0)
            }
        }
    }

    /// The recommendation, or the closest sample when nothing is feasible (what the next stage of
    /// the search starts from).
    pub fn anchor(&self, measured: &[Measured]) -> Option<Pick> {
        self.choose(measured).or_else(|| self.explain(measured).closest)
    }

    /// How far a sample is from meeting every constraint (0: it meets them).
    fn violation(&self, m: &Measured, i: usize) -> f64 {
        let over = |v: f64, limit: f64| (v / limit - 1.0).max(0.0);
        let lat = self.latency_ms.map_or(0.0, |l| over(m.worst_latency(i, self.percentile), l));
        let thr = self.min_throughput.map_or(0.0, |t| (1.0 - m.samples[i].throughput / t).max(0.0));
        let mem = self.max_memory_bytes.map_or(0.0, |b| over(m.memory_bytes() as f64, b.max(1) as f64));
        lat + thr + mem
    }

    pub fn explain(&self, measured: &[Measured]) -> Infeasible {
        let clean: Vec<(Pick, &Measured)> = Self::clean(measured).collect();
        let mut unmet = Vec::new();
        if let Some(l) = self.latency_ms
            && !clean.iter().any(|(k, m)| self.latency_ok(m, k.sample))
        {
            let least =
                clean.iter().map(|(k, m)| m.worst_latency(k.sample, self.percentile)).fold(f64::INFINITY, f64::min);
            unmet.push(format!(
                "--latency-budget-ms {l}: no config kept {} within {l} ms (the lowest measured: {least:.3} ms)",
                self.percentile.label()
            ));
        }
        if let Some(t) = self.min_throughput
            && !clean.iter().any(|(k, m)| self.throughput_ok(m, k.sample))
        {
            let most = clean.iter().map(|(k, m)| m.samples[k.sample].throughput).fold(0.0, f64::max);
            unmet.push(format!(
                "--min-throughput {t}: no config reached {t} requests/s (the most measured: {most:.1} requests/s)"
            ));
        }
        if let Some(b) = self.max_memory_bytes
            && !clean.iter().any(|(_, m)| self.memory_ok(m))
        {
            let least = clean.iter().map(|(_, m)| m.memory_bytes()).min().unwrap_or(0);
            unmet.push(format!(
                "--max-memory-mib {}: every config holds more than {} (the least measured: {})",
                b as f64 / MIB,
                size(b),
                size(least)
            ));
        }
        let closest = clean
            .iter()
            .min_by(|a, b| self.violation(a.1, a.0.sample).total_cmp(&self.violation(b.1, b.0.sample)))
            .map(|(k, _)| *k);
        Infeasible { unmet, closest, all_failed: clean.is_empty() }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tune::{drive::Sample, search::Point};

    fn sample(concurrency: usize, throughput: f64, p99_ms: f64) -> Sample {
        Sample {
            concurrency,
            throughput,
            p50_ms: p99_ms / 2.0,
            p95_ms: p99_ms * 0.8,
            p99_ms,
            requests: 100,
            errors: 0,
            error: None,
            avg_batch: 1.0,
            load: 1.0,
        }
    }

    fn measured(instances: usize, samples: Vec<Sample>, bytes: u64) -> Measured {
        let point =
            Point { instances, threads: 1, max_batch_size: 8, preferred_batch_size: None, queue_delay_us: Some(0) };
        Measured {
            points: vec![point],
            baseline: false,
            per_model: vec![samples.clone()],
            samples,
            model_bytes: vec![bytes],
            resident_bytes: 0,
            load_secs: 0.0,
        }
    }

    fn none() -> Constraints {
        Constraints {
            latency_ms: None,
            percentile: Percentile::P99,
            min_throughput: None,
            max_memory_bytes: None,
            objective: Objective::Throughput,
        }
    }

    fn two() -> [Measured; 2] {
        [
            measured(1, vec![sample(1, 100.0, 2.0), sample(16, 900.0, 30.0)], 100 << 20),
            measured(2, vec![sample(1, 120.0, 1.5), sample(16, 700.0, 9.0)], 200 << 20),
        ]
    }

    #[test]
    fn the_latency_budget_filters() {
        let all = two();
        assert_eq!(none().choose(&all), Some(Pick { point: 0, sample: 1 }));
        let c = Constraints { latency_ms: Some(10.0), ..none() };
        assert_eq!(c.choose(&all), Some(Pick { point: 1, sample: 1 }));
        // p95 of the first at c16 is 24 ms: still over; at 25 ms p95 passes where p99 would not.
        let c = Constraints { latency_ms: Some(25.0), percentile: Percentile::P95, ..none() };
        assert_eq!(c.choose(&all), Some(Pick { point: 0, sample: 1 }));
        let c = Constraints { latency_ms: Some(25.0), ..none() };
        assert_eq!(c.choose(&all), Some(Pick { point: 1, sample: 1 }));
    }

    #[test]
    fn memory_and_throughput_filter_and_latency_can_be_the_objective() {
        let all = two();
        let c = Constraints { max_memory_bytes: Some(150 << 20), latency_ms: Some(10.0), ..none() };
        assert_eq!(c.choose(&all), Some(Pick { point: 0, sample: 0 }));
        let c = Constraints { objective: Objective::Latency, ..none() };
        assert_eq!(c.choose(&all), Some(Pick { point: 1, sample: 0 }));
        let c = Constraints { objective: Objective::Latency, min_throughput: Some(800.0), ..none() };
        assert_eq!(c.choose(&all), Some(Pick { point: 0, sample: 1 }));
    }

    #[test]
    fn infeasible_names_each_unmet_constraint_and_the_closest() {
        let all = two();
        let c =
            Constraints { latency_ms: Some(1.0), min_throughput: Some(5000.0), max_memory_bytes: Some(1), ..none() };
        assert_eq!(c.choose(&all), None);
        let why = c.explain(&all);
        assert_eq!(why.unmet.len(), 3, "{:?}", why.unmet);
        assert!(why.unmet[0].contains("p99 within 1 ms") && why.unmet[0].contains("1.500 ms"), "{}", why.unmet[0]);
        assert!(why.unmet[1].contains("900.0 requests/s"), "{}", why.unmet[1]);
        assert!(why.unmet[2].contains("100.0 MiB"), "{}", why.unmet[2]);
        assert!(why.closest.is_some() && !why.all_failed);
        // Each met by some sample, none by all: nothing unmet alone, the closest still found.
        let c = Constraints { latency_ms: Some(2.0), min_throughput: Some(800.0), ..none() };
        let why = c.explain(&all);
        assert!(c.choose(&all).is_none() && why.unmet.is_empty());
        // (1 inst, c1): within 2 ms at 120 of 800 requests/s, the smallest shortfall.
        assert_eq!(why.closest, Some(Pick { point: 1, sample: 0 }));
    }

    #[test]
    fn a_sample_with_failures_never_wins() {
        let mut bad = sample(16, 5000.0, 1.0);
        bad.errors = 3;
        let all = [measured(1, vec![bad], 0), measured(2, vec![sample(16, 100.0, 5.0)], 0)];
        assert_eq!(none().choose(&all), Some(Pick { point: 1, sample: 0 }));
        let failed = [measured(1, vec![sample(1, 0.0, 0.0)], 0)];
        let mut failed = failed;
        failed[0].per_model[0][0].errors = 1;
        assert!(none().choose(&failed).is_none() && none().explain(&failed).all_failed);
    }
}
