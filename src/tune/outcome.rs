//! What a tuning run found: the measurements, and the verdict drawn from them (the recommended
//! point and its reasons, or why nothing met the constraints), for the text, JSON and HTML alike.
use crate::{config::TuneSettings, proto::pbtxt};

use super::{
    ceiling::BatchPoint,
    constraints::{Constraints, Infeasible, Pick},
    report::{self, Sizing},
    search::{self, Measured},
    subject::Subject,
};

pub struct Run<'a> {
    pub settings: &'a TuneSettings,
    pub subjects: &'a [Subject],
    pub ceilings: &'a [Vec<BatchPoint>],
    pub measured: &'a [Measured],
    pub constraints: Constraints,
    pub elapsed_secs: f64,
}

/// What was recommended, and why, for the text, JSON and HTML alike.
pub struct Verdict {
    pub pick: Option<Pick>,
    pub infeasible: Option<Infeasible>,
    /// One sentence per reason, the first the headline.
    pub reasons: Vec<String>,
    pub sizing: Option<Sizing>,
    /// The recommended config.pbtxt of each model.
    pub configs: Vec<String>,
}

impl Run<'_> {
    pub fn names(&self) -> Vec<String> {
        self.subjects.iter().map(|s| s.name.clone()).collect()
    }

    pub fn verdict(&self) -> Verdict {
        let (c, measured) = (&self.constraints, self.measured);
        let label = c.percentile.label();
        let Some(pick) = c.choose(measured) else {
            return Verdict {
                pick: None,
                infeasible: Some(c.explain(measured)),
                reasons: Vec::new(),
                sizing: None,
                configs: Vec::new(),
            };
        };
        let m = &measured[pick.point];
        let s = &m.samples[pick.sample];
        let lat = m.worst_latency(pick.sample, c.percentile);
        let mut reasons = Vec::new();
        let baseline = measured.iter().find(|b| b.baseline && b.clean(pick.sample));
        match baseline {
            Some(b) if b.points == m.points => reasons.push("The current config is the best measured.".to_string()),
            Some(b) => {
                let (bs, blat) = (&b.samples[pick.sample], b.worst_latency(pick.sample, c.percentile));
                let gain = (s.throughput / bs.throughput.max(f64::EPSILON) - 1.0) * 100.0;
                reasons.push(format!(
                    "{}: {gain:+.0}% throughput against the current config at concurrency {} \
                     ({:.1} against {:.1} requests/s), {label} {lat:.3} ms against {blat:.3} ms.",
                    m.describe(&self.names()),
                    s.concurrency,
                    s.throughput,
                    bs.throughput
                ));
            }
            None => {
                reasons.push(format!("{}: the current config did not run cleanly here.", m.describe(&self.names())))
            }
        }
        let within = c.describe();
        reasons.push(match c.objective {
            crate::config::Objective::Throughput => format!(
                "Chosen for throughput{}: the most requests/s measured; within 3% of it, the lowest {label}.",
                if within.is_empty() { String::new() } else { format!(" within {within}") }
            ),
            crate::config::Objective::Latency => format!(
                "Chosen for latency{}: the lowest {label} measured; within 3% of it, the most requests/s.",
                if within.is_empty() { String::new() } else { format!(" within {within}") }
            ),
        });
        if s.avg_batch > 1.05 {
            reasons.push(format!("The dynamic batcher formed batches of {:.1} rows on average there.", s.avg_batch));
        }
        let sizing = report::sizing(s, lat, c.percentile, self.settings.target_rps, self.settings.cores);
        let configs = self
            .subjects
            .iter()
            .zip(&m.points)
            .map(|(sub, p)| pbtxt::to_text(&search::config_for(&sub.base, p)))
            .collect();
        Verdict { pick: Some(pick), infeasible: None, reasons, sizing: Some(sizing), configs }
    }

    pub fn mix(&self) -> String {
        let total: f64 = self.subjects.iter().map(|s| s.weight).sum();
        self.subjects
            .iter()
            .map(|s| format!("{}={:.0}%", s.name, s.weight / total * 100.0))
            .collect::<Vec<_>>()
            .join(",")
    }

    /// The error when nothing is recommended: each constraint nothing met, and the closest point.
    pub fn why_not(&self, why: &Infeasible) -> String {
        let who = if self.subjects.len() == 1 {
            format!("model '{}'", self.subjects[0].name)
        } else {
            format!("models {}", self.names().join(", "))
        };
        if why.all_failed {
            let first = self.measured.iter().flat_map(|m| m.per_model.iter().flatten()).find_map(|s| s.error.clone());
            let errors: u64 = self.measured.iter().flat_map(|m| m.per_model.iter().flatten()).map(|s| s.errors).sum();
            if errors == 0 && !self.measured.is_empty() {
                let idle: Vec<&str> = self
                    .subjects
                    .iter()
                    .enumerate()
                    .filter(|(k, _)| self.measured.iter().all(|m| m.per_model[*k].iter().all(|s| s.requests == 0)))
                    .map(|(_, s)| s.name.as_str())
                    .collect();
                let hint = if self.subjects.len() == 1 {
                    "its requests take longer than a measured window: raise --budget-secs"
                } else {
                    "raise its --mix weight or --budget-secs"
                };
                return format!(
                    "{who}: no point was measured: {} got no answered request within the measured windows ({hint})",
                    if idle.is_empty() { "a model".to_string() } else { idle.join(", ") }
                );
            }
            if self.measured.is_empty() {
                return format!("{who}: no config loaded, so nothing was measured (the load errors are above)");
            }
            let mut text = format!("{who}: no point was measured without errors");
            if let Some(e) = first {
                text += &format!("; the first error: {e} (give real values with --input-data)");
            }
            return text;
        }
        let mut text = format!("{who}: no config met {}", self.constraints.describe());
        if why.unmet.is_empty() {
            text += " together (each was met by some config, none met them all)";
        }
        for line in &why.unmet {
            text += &format!("\n  {line}");
        }
        if let Some(k) = why.closest {
            let m = &self.measured[k.point];
            let s = &m.samples[k.sample];
            text += &format!(
                "\n  the closest: {} at concurrency {}: {:.1} requests/s, {} {:.3} ms, {:.1} MiB",
                m.describe(&self.names()),
                s.concurrency,
                s.throughput,
                self.constraints.percentile.label(),
                m.worst_latency(k.sample, self.constraints.percentile),
                m.memory_bytes() as f64 / (1024.0 * 1024.0)
            );
        }
        text
    }
}
