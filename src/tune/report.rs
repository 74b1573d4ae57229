//! What `ferry tune` prints and writes: every point as a table, the recommendation with what it
//! changes, and the sizing note.
use std::fmt::Write;

use super::{
    ceiling::BatchPoint,
    drive::Sample,
    search::{Measured, Point},
};

const MIB: f64 = 1024.0 * 1024.0;

pub fn ceiling_table(points: &[BatchPoint], threads: usize) -> String {
    let mut out = format!("In-process ceiling (the backend alone, one instance, {threads} intra-op threads):\n");
    let _ = writeln!(out, "  {:>6} {:>12} {:>10}", "batch", "rows/s", "p50 ms");
    for p in points {
        let _ = writeln!(out, "  {:>6} {:>12.1} {:>10.3}", p.batch, p.rows_per_sec, p.p50_ms);
    }
    out
}

pub fn table(measured: &[Measured]) -> String {
    let label =
        |m: &Measured| if m.baseline { format!("{} (current)", m.point.describe()) } else { m.point.describe() };
    let w = measured.iter().map(|m| label(m).len()).max().unwrap_or(6).max(6);
    let mut out = String::new();
    let _ = writeln!(
        out,
        "  {:>3} {:<w$} {:>5} {:>10} {:>9} {:>9} {:>7} {:>9} {:>7}",
        "#", "config", "conc", "req/s", "p50 ms", "p99 ms", "batch", "model MiB", "errors"
    );
    for (i, m) in measured.iter().enumerate() {
        let label = label(m);
        for (j, s) in m.samples.iter().enumerate() {
            let (n, l) = if j == 0 { ((i + 1).to_string(), label.as_str()) } else { (String::new(), "") };
            let _ = writeln!(
                out,
                "  {:>3} {:<w$} {:>5} {:>10.1} {:>9.3} {:>9.3} {:>7.2} {:>9.1} {:>7}",
                n,
                l,
                s.concurrency,
                s.throughput,
                s.p50_ms,
                s.p99_ms,
                s.avg_batch,
                m.model_bytes as f64 / MIB,
                s.errors
            );
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

/// "N replicas of this machine for X requests/s at p99 <= Y ms".
pub fn sizing(best: &Sample, target_rps: Option<f64>, cores: usize) -> String {
    let machine = format!("{cores}-core machine");
    match target_rps {
        Some(rps) if best.throughput > 0.0 => {
            let replicas = (rps / best.throughput).ceil().max(1.0) as u64;
            format!(
                "{replicas} replica{} of this {machine} for {rps:.0} requests/s at p99 <= {:.1} ms \
                 ({:.0} requests/s each at concurrency {})",
                if replicas == 1 { "" } else { "s" },
                best.p99_ms,
                best.throughput,
                best.concurrency
            )
        }
        _ => format!(
            "1 replica of this {machine} for {:.0} requests/s at p99 <= {:.1} ms (concurrency {}); \
             size with --target-rps",
            best.throughput, best.p99_ms, best.concurrency
        ),
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
            p99_ms: 20.0,
            requests: 4000,
            errors: 0,
            error: None,
            avg_batch: 4.0,
        };
        assert!(
            sizing(&s, Some(1000.0), 2)
                .starts_with("3 replicas of this 2-core machine for 1000 requests/s at p99 <= 20.0 ms")
        );
        assert!(sizing(&s, None, 2).starts_with("1 replica of this 2-core machine for 400 requests/s"));
    }
}
