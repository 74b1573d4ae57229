//! What `ferry tune` prints: every point as a table, what the recommendation changes, and the
//! sizing for the platforms.
use std::fmt::Write;

use serde::Serialize;

use crate::config::Percentile;

use super::{
    ceiling::BatchPoint,
    drive::Sample,
    search::{Measured, Point},
};

const MIB: f64 = 1024.0 * 1024.0;

pub fn ceiling_table(model: &str, points: &[BatchPoint], threads: usize) -> String {
    let mut out =
        format!("In-process ceiling of '{model}' (the backend alone, one instance, {threads} intra-op threads):\n");
    let _ = writeln!(out, "  {:>6} {:>12} {:>10}", "batch", "rows/s", "p50 ms");
    for p in points {
        let _ = writeln!(out, "  {:>6} {:>12.1} {:>10.3}", p.batch, p.rows_per_sec, p.p50_ms);
    }
    out
}

/// Every measured point at every concurrency; with several models, each model's share under it.
pub fn table(measured: &[Measured], names: &[String]) -> String {
    let label = |m: &Measured| {
        let d = m.describe(names);
        if m.baseline { format!("{d} (current)") } else { d }
    };
    let w = measured.iter().map(|m| label(m).len()).max().unwrap_or(6).clamp(6, 60);
    let mut out = String::new();
    let _ = writeln!(
        out,
        "  {:>3} {:<w$} {:>5} {:>10} {:>9} {:>9} {:>9} {:>7} {:>9} {:>6} {:>7}",
        "#", "config", "conc", "req/s", "p50 ms", "p95 ms", "p99 ms", "batch", "model MiB", "load", "errors"
    );
    let row = |out: &mut String, n: &str, l: &str, s: &Sample, mib: f64| {
        let _ = writeln!(
            out,
            "  {:>3} {:<w$} {:>5} {:>10.1} {:>9.3} {:>9.3} {:>9.3} {:>7.2} {:>9.1} {:>6.1} {:>7}",
            n, l, s.concurrency, s.throughput, s.p50_ms, s.p95_ms, s.p99_ms, s.avg_batch, mib, s.load, s.errors
        );
    };
    for (i, m) in measured.iter().enumerate() {
        let label = label(m);
        let label = if label.chars().count() > w {
            format!("{}...", label.chars().take(w - 3).collect::<String>())
        } else {
            label
        };
        for (j, s) in m.samples.iter().enumerate() {
            let (n, l) = if j == 0 { ((i + 1).to_string(), label.as_str()) } else { (String::new(), "") };
            row(&mut out, &n, l, s, m.memory_bytes() as f64 / MIB);
            if names.len() > 1 {
                for (k, name) in names.iter().enumerate() {
                    if let Some(s) = m.per_model[k].get(j) {
                        row(&mut out, "", &format!("  {name}"), s, m.model_bytes[k] as f64 / MIB);
                    }
                }
            }
        }
    }
    out
}

/// What the recommended point changes relative to the current config.
pub fn changes(current: &Point, best: &Point) -> Vec<String> {
    let mut c = Vec::new();
    let show = |v: Option<u64>| v.map_or("off".to_string(), |d| format!("{d} us"));
    if current.instances != best.instances {
        c.push(format!("instance_group count {} -> {}", current.instances, best.instances));
    }
    if current.threads != best.threads {
        c.push(format!("intra_op_thread_count {} -> {}", current.threads, best.threads));
    }
    if current.max_batch_size != best.max_batch_size {
        c.push(format!("max_batch_size {} -> {}", current.max_batch_size, best.max_batch_size));
    }
    if current.preferred_batch_size != best.preferred_batch_size {
        let p = |v: Option<usize>| v.map_or("none".to_string(), |p| p.to_string());
        c.push(format!("preferred_batch_size {} -> {}", p(current.preferred_batch_size), p(best.preferred_batch_size)));
    }
    if current.queue_delay_us != best.queue_delay_us {
        c.push(format!(
            "dynamic_batching max_queue_delay {} -> {}",
            show(current.queue_delay_us),
            show(best.queue_delay_us)
        ));
    }
    c
}

/// How to deploy the recommended point: replicas for a rate, and the autoscaling targets.
#[derive(Debug, Clone, Serialize)]
pub struct Sizing {
    /// Requests per second one replica answers at the recommended point (all models together).
    pub throughput: f64,
    pub latency_ms: f64,
    pub percentile: &'static str,
    pub concurrency: usize,
    pub cores: usize,
    pub target_rps: Option<f64>,
    pub replicas: Option<u64>,
    /// `ferry_inference_load` (queued + executing, all models) measured at that point.
    pub measured_load: f64,
    /// The per-replica load to scale out above: what the point held (to one decimal, at least 0.1).
    pub inference_load_target: f64,
    /// 80% of the measured rate, per minute: Vertex AI's `request-counts-per-minute` and
    /// SageMaker's `SageMakerVariantInvocationsPerInstance`, which see only request counts.
    pub requests_per_minute_target: u64,
}

pub fn sizing(best: &Sample, latency_ms: f64, percentile: Percentile, target_rps: Option<f64>, cores: usize) -> Sizing {
    Sizing {
        throughput: best.throughput,
        latency_ms,
        percentile: percentile.label(),
        concurrency: best.concurrency,
        cores,
        target_rps,
        replicas: target_rps
            .filter(|_| best.throughput > 0.0)
            .map(|rps| (rps / best.throughput).ceil().max(1.0) as u64),
        measured_load: best.load,
        inference_load_target: ((best.load * 10.0).round() / 10.0).max(0.1),
        requests_per_minute_target: (best.throughput * 60.0 * 0.8).floor().max(1.0) as u64,
    }
}

impl Sizing {
    /// "N replicas of this machine for X requests/s at p99 <= Y ms".
    pub fn headline(&self) -> String {
        let machine = format!("{}-core machine", self.cores);
        let at = format!("{} <= {:.1} ms", self.percentile, self.latency_ms);
        match (self.target_rps, self.replicas) {
            (Some(rps), Some(n)) => format!(
                "{n} replica{} of this {machine} for {rps:.0} requests/s at {at} ({:.0} requests/s each at concurrency {})",
                if n == 1 { "" } else { "s" },
                self.throughput,
                self.concurrency
            ),
            _ => format!(
                "1 replica of this {machine} for {:.0} requests/s at {at} (concurrency {}); size with --target-rps",
                self.throughput, self.concurrency
            ),
        }
    }

    /// The settings to paste, one per platform.
    pub fn autoscaling(&self) -> Vec<(&'static str, String)> {
        let (load, rpm) = (self.inference_load_target, self.requests_per_minute_target);
        vec![
            ("Kubernetes (Helm)", format!("--set autoscaling.inferenceLoad.averageValue={load}")),
            ("GCE (Terraform)", format!("target_inference_load = {load}")),
            ("Vertex AI", format!("--autoscaling-metric-specs=request-counts-per-minute={rpm}")),
            (
                "SageMaker",
                format!(
                    "target tracking on the metric InferenceLoad (namespace ferry, from --emf-interval-secs=60), \
                     TargetValue {load}; or SageMakerVariantInvocationsPerInstance, TargetValue {rpm}"
                ),
            ),
        ]
    }

    pub fn text(&self) -> String {
        let mut out = format!("Sizing: {}\n", self.headline());
        let _ = writeln!(
            out,
            "Autoscaling: this point held {:.1} requests queued or executing (ferry_inference_load); scale out above {}:",
            self.measured_load, self.inference_load_target
        );
        for (platform, setting) in self.autoscaling() {
            let _ = writeln!(out, "  {platform:<18} {setting}");
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn point(instances: usize, delay: Option<u64>) -> Point {
        Point {
            instances,
            threads: 2 / instances,
            max_batch_size: 8,
            preferred_batch_size: None,
            queue_delay_us: delay,
        }
    }

    #[test]
    fn changes_name_each_field() {
        let c = changes(&point(1, None), &point(2, Some(500)));
        assert_eq!(
            c,
            vec![
                "instance_group count 1 -> 2",
                "intra_op_thread_count 2 -> 1",
                "dynamic_batching max_queue_delay off -> 500 us"
            ]
        );
        assert!(changes(&point(1, None), &point(1, None)).is_empty());
    }

    #[test]
    fn sizing_rounds_replicas_up() {
        let s = Sample {
            concurrency: 16,
            throughput: 400.0,
            p50_ms: 10.0,
            p95_ms: 18.0,
            p99_ms: 20.0,
            requests: 4000,
            errors: 0,
            error: None,
            avg_batch: 4.0,
            load: 9.6,
        };
        let z = sizing(&s, 20.0, Percentile::P99, Some(1000.0), 2);
        assert!(z.headline().starts_with("3 replicas of this 2-core machine for 1000 requests/s at p99 <= 20.0 ms"));
        assert_eq!((z.inference_load_target, z.requests_per_minute_target), (9.6, 19200));
        let text = z.text();
        assert!(text.contains("autoscaling.inferenceLoad.averageValue=9.6"), "{text}");
        assert!(text.contains("request-counts-per-minute=19200"), "{text}");
        let z = sizing(&s, 18.0, Percentile::P95, None, 2);
        assert!(z.headline().starts_with("1 replica of this 2-core machine for 400 requests/s at p95 <= 18.0 ms"));
    }
}
