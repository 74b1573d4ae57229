//! Measuring one combination of points (one per model): each model whose point changed is
//! loaded with that config (an atomic version swap, as `ferry serve` does it), then the models
//! are driven together at every concurrency under the traffic mix.
use std::{
    sync::Arc,
    time::{Duration, Instant},
};

use crate::{proto::pbtxt, repository::control::LoadRequest, server::Core};

use super::{
    drive::{self, Target},
    progress::Progress,
    search::{self, Measured, Point},
    subject::Subject,
};

/// The time each concurrency is measured for, and when the budget ends.
pub struct Plan {
    pub slice: Duration,
    pub deadline: Instant,
}

impl Plan {
    fn warmup(&self) -> Duration {
        (self.slice / 5).min(Duration::from_secs(2))
    }

    fn left(&self) -> Duration {
        self.deadline.saturating_duration_since(Instant::now())
    }
}

pub struct Sweep<'a> {
    pub core: &'a Core,
    pub subjects: &'a [Subject],
    pub plan: Plan,
    pub concurrency: &'a [usize],
    /// What each model runs now (None: as loaded at the start, not yet by the sweep).
    loaded: Vec<Option<Point>>,
    pub progress: Progress,
    pub measured: Vec<Measured>,
}

impl<'a> Sweep<'a> {
    pub fn new(
        core: &'a Core,
        subjects: &'a [Subject],
        plan: Plan,
        concurrency: &'a [usize],
        progress: Progress,
    ) -> Self {
        Sweep { core, subjects, plan, concurrency, loaded: vec![None; subjects.len()], progress, measured: Vec::new() }
    }

    fn describe(&self, points: &[Point]) -> String {
        if points.len() == 1 {
            return points[0].describe();
        }
        let names: Vec<String> = self.subjects.iter().map(|s| s.name.clone()).collect();
        let changed: Vec<String> = names
            .iter()
            .zip(points)
            .zip(&self.loaded)
            .filter(|((_, p), l)| l.as_ref() != Some(*p))
            .map(|((n, p), _)| format!("{n}: {}", p.describe()))
            .collect();
        if changed.is_empty() { "the same configs again".into() } else { changed.join("; ") }
    }

    /// Measures `points` unless they already were; keeps what loads. The baseline runs whatever
    /// budget is left; other points are skipped when it has no room for them.
    pub async fn add(&mut self, points: Vec<Point>, baseline: bool) {
        if self.measured.iter().any(|m| m.points == points) {
            return;
        }
        let what = self.describe(&points);
        let needed = (self.plan.slice + self.plan.warmup()) * self.concurrency.len() as u32;
        if !baseline && self.plan.left() < needed {
            self.progress.skip(&what);
            return;
        }
        self.progress.start(&what);
        let loading = Instant::now();
        for (k, (subject, point)) in self.subjects.iter().zip(&points).enumerate() {
            if self.loaded[k].as_ref() == Some(point) {
                continue;
            }
            let config = if baseline { subject.base.clone() } else { search::config_for(&subject.base, point) };
            let json = pbtxt::to_json(&config).to_string();
            let request = LoadRequest { config: Some(json), files: Vec::new() };
            if let Err(e) = self.core.repository.load(&subject.name, request).await {
                self.progress.fail(&format!("{}: {e}", subject.name));
                return;
            }
            self.loaded[k] = Some(*point);
        }
        let load_secs = loading.elapsed().as_secs_f64();
        let engine = Arc::clone(&self.core.engine);
        let targets: Vec<Target<'_>> =
            self.subjects.iter().map(|s| Target { model: &s.name, http: &s.http, weight: s.weight }).collect();
        let (mut samples, mut per_model) = (Vec::new(), vec![Vec::new(); self.subjects.len()]);
        for &c in self.concurrency {
            let mix = drive::drive(&engine, &targets, c, self.plan.warmup(), self.plan.slice).await;
            samples.push(mix.combined);
            for (k, s) in mix.models.into_iter().enumerate() {
                per_model[k].push(s);
            }
        }
        let model_bytes = self
            .subjects
            .iter()
            .map(|s| {
                self.core
                    .registry
                    .resolve(&s.name, None)
                    .map(|m| m.stats.snapshot().memory.iter().map(|u| u.bytes).sum())
                    .unwrap_or(0)
            })
            .collect();
        let resident_bytes = crate::stats::resident_bytes("self").unwrap_or(0);
        self.progress.done(samples.iter().map(|s| s.throughput).fold(0.0, f64::max));
        self.measured.push(Measured { points, baseline, samples, per_model, model_bytes, resident_bytes, load_secs });
    }
}
