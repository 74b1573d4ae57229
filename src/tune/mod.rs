//! `ferry tune`: Model Analyzer's job, built in. Measures one model of a repository on this
//! machine: in-process (the backend alone at each batch size: the ceiling), then through the
//! engine every front-end calls (queue, dynamic batcher, instances) over a sweep of instance
//! counts, intra-op threads, batch sizes and queue delays, within a time budget. Reports every
//! point, and writes the best config within the latency target as a complete config.pbtxt.
use std::{
    net::SocketAddr,
    path::PathBuf,
    sync::Arc,
    time::{Duration, Instant},
};

use tokio::{net::TcpListener, sync::watch};

use crate::{
    backend::Device,
    config::{Config, TuneSettings},
    frontend::{self, http_common::HttpState, net},
    proto::inference::model_config::SchedulingChoice,
    proto::pbtxt,
    repository::control::LoadRequest,
    server::Core,
};

mod ceiling;
mod drive;
mod progress;
mod report;
mod request;
mod search;

use search::{Measured, Point};

/// Splits the budget: a share for the ceiling, the rest evenly over the planned points.
struct Plan {
    slice: Duration,
    deadline: Instant,
}

impl Plan {
    fn warmup(&self) -> Duration {
        (self.slice / 5).min(Duration::from_secs(2))
    }

    fn left(&self) -> Duration {
        self.deadline.saturating_duration_since(Instant::now())
    }
}

/// The real HTTP front-end on a loopback port, for the clients to call; stops when dropped.
async fn listen(config: &Config, core: &Core) -> Result<(SocketAddr, watch::Sender<bool>), String> {
    let listener = TcpListener::bind("127.0.0.1:0").await.map_err(|e| format!("cannot listen on loopback: {e}"))?;
    let addr = listener.local_addr().map_err(|e| e.to_string())?;
    let state = Arc::new(HttpState {
        engine: Arc::clone(&core.engine),
        max_input_size: config.http_max_input_size,
        size_note: String::new(),
        forward_headers: None,
        openai_api_key: None,
    });
    let (stop, stopped) = watch::channel(false);
    let app = frontend::http_router(state);
    tokio::spawn(net::serve_http(listener, app, config.network.clone(), Arc::clone(&core.admission), None, stopped));
    core.engine.set_serving();
    Ok((addr, stop))
}

pub async fn run(config: &Config, core: Core, settings: TuneSettings) -> Result<(), String> {
    let started = Instant::now();
    let (addr, _stop) = listen(config, &core).await?;
    let deadline = started + settings.budget;
    let name = settings.model.clone();
    core.repository.load(&name, LoadRequest::default()).await.map_err(|e| format!("model '{name}': {e}"))?;
    let model = core.registry.resolve(&name, None).map_err(|e| e.to_string())?;
    let base = (*model.config).clone();
    if model.ensemble().is_some() || matches!(base.scheduling_choice, Some(SchedulingChoice::SequenceBatching(_))) {
        return Err(format!(
            "model '{name}' is an ensemble or a sequence model: tune the models it is made of, one at a time"
        ));
    }
    if base.model_transaction_policy.as_ref().is_some_and(|p| p.decoupled) {
        return Err(format!("model '{name}' is decoupled: ferry tune measures request/response models"));
    }
    let (req, notes) = request::build(&name, &model.schema, &settings.shapes, settings.input_data.as_ref())?;
    for note in &notes {
        eprintln!("ferry tune: {note}");
    }
    let outputs: Vec<String> = base.output.iter().map(|o| o.name.clone()).collect();
    let http = drive::Http::new(addr, &req, &outputs)?;
    let cores = settings.cores;
    let current = search::point_of(&base, cores);
    let batchable = base.max_batch_size > 0;
    let concurrency = &settings.concurrency;

    // The plan: the current config, the instance layouts, three queue delays, three batch sizes.
    // A GPU model is measured on its first GPU, with up to 4 instances there (each its own stream).
    let group = base.instance_group.first();
    let device = match group {
        Some(g) if g.kind == crate::proto::inference::model_instance_group::Kind::Gpu as i32 => {
            Device::Gpu(g.gpus.first().copied().unwrap_or(0))
        }
        _ => Device::Cpu,
    };
    let most = if device == Device::Cpu { settings.max_instances } else { settings.max_instances.min(4) };
    let layouts = search::instance_layouts(most.clamp(1, 64), cores);
    let planned = 1 + layouts.len() + if batchable { search::DELAYS_US.len() + 3 } else { 0 };
    let ceiling_share =
        if batchable && base.backend == "onnxruntime" { settings.budget.mul_f64(0.12) } else { Duration::ZERO };
    let per_point = (settings.budget.saturating_sub(ceiling_share)).mul_f64(0.85) / planned as u32;
    // Each point also pays a load (sessions created); measured on the first, counted after.
    // A fifth of a slice more warms each concurrency up.
    let slice =
        per_point.div_f64(concurrency.len() as f64 * 1.2).clamp(Duration::from_millis(300), Duration::from_secs(20));
    let plan = Plan { slice, deadline };
    let mut progress = progress::Progress::new(planned, deadline);

    // The ceiling, in-process, on a blocking thread.
    let mut knee = None;
    let mut ceiling_points = Vec::new();
    if !ceiling_share.is_zero() {
        let batches: Vec<usize> = [1usize, 2, 4, 8, 16, 32, 64].into_iter().collect();
        let slice = ceiling_share / batches.len() as u32;
        progress.note("in-process ceiling");
        let backend = core.backends.get(&base.backend).map_err(|e| e.to_string())?;
        let path = core
            .roots
            .first()
            .map(|r| PathBuf::from(r).join(&name).join(model.version.to_string()).join(&base.default_model_filename));
        match path.filter(|p| p.is_file()) {
            Some(path) => {
                let (cfg, req) = (base.clone(), req.clone());
                let points = tokio::task::spawn_blocking(move || {
                    ceiling::measure(&*backend, device, &path, &cfg, &req, &batches, cores, slice)
                })
                .await
                .map_err(|e| e.to_string())?;
                match points {
                    Ok(points) => {
                        knee = ceiling::knee(&points);
                        ceiling_points = points;
                    }
                    Err(e) => eprintln!("ferry tune: in-process ceiling skipped: {e}"),
                }
            }
            None => eprintln!("ferry tune: in-process ceiling skipped: the model file is not in a local folder"),
        }
    }
    let cap = 128usize.max(current.max_batch_size);
    let batch0 = if batchable {
        let from_knee = knee.unwrap_or(32).max(1) * 2;
        current.max_batch_size.max(from_knee).min(cap)
    } else {
        0
    };

    let mut measured: Vec<Measured> = Vec::new();
    let mut sweep = Sweep { core: &core, name: &name, base: &base, http: &http, plan: &plan, concurrency };
    // Stage 0: what runs today.
    sweep.add(&mut measured, current, true, &mut progress).await?;
    // Stage 1: instances x threads, dynamic batching with no delay.
    let delay0 = if batchable { Some(0) } else { None };
    for (instances, threads) in layouts {
        let p =
            Point { instances, threads, max_batch_size: batch0, preferred_batch_size: None, queue_delay_us: delay0 };
        if p != current {
            sweep.add(&mut measured, p, false, &mut progress).await?;
        }
    }
    if batchable {
        // Stage 2: queue delays around the best layout.
        let anchor = search::best(&measured, settings.latency_target_ms).map(|(m, _)| m.point).unwrap_or(current);
        for delay in search::DELAYS_US {
            let p = Point { queue_delay_us: Some(delay), max_batch_size: batch0.max(1), ..anchor };
            sweep.add(&mut measured, p, false, &mut progress).await?;
        }
        // Stage 3: batch sizes around the best so far.
        let anchor = search::best(&measured, settings.latency_target_ms).map(|(m, _)| m.point).unwrap_or(current);
        for (max_batch_size, preferred_batch_size) in
            search::batch_variations(anchor.max_batch_size, knee.unwrap_or(anchor.max_batch_size), cap)
        {
            let p = Point {
                max_batch_size,
                preferred_batch_size,
                queue_delay_us: anchor.queue_delay_us.or(Some(0)),
                ..anchor
            };
            sweep.add(&mut measured, p, false, &mut progress).await?;
        }
    }
    progress.finish();
    let _ = core.repository.unload(&name, false).await;

    let mut out = String::new();
    out += &format!(
        "ferry tune: model '{name}' on {cores} cores, {:.0} s of {:.0} s budget, request {}\n\n",
        started.elapsed().as_secs_f64(),
        settings.budget.as_secs_f64(),
        request::describe(&req)
    );
    if !ceiling_points.is_empty() {
        out += &report::ceiling_table(&ceiling_points, cores);
        out.push('\n');
    }
    out += "Through the server (HTTP on loopback, binary tensors; queue, dynamic batcher, instances):\n";
    out += &report::table(&measured);
    out.push('\n');
    let target = settings.latency_target_ms;
    let Some((winner, sample)) = search::best(&measured, target) else {
        let why = match target {
            Some(t) => format!("no measured point kept p99 within {t} ms without errors"),
            None => "no point was measured without errors".to_string(),
        };
        let first = measured.iter().flat_map(|m| &m.samples).find_map(|s| s.error.clone());
        let why = match first {
            Some(e) => format!("{why}; the first error: {e} (give real values with --input-data)"),
            None => why,
        };
        write_report(&settings, started, &measured, &ceiling_points, None)?;
        print!("{out}");
        return Err(format!("model '{name}': {why}"));
    };
    let tuned = search::config_for(&base, &winner.point);
    let within = target.map_or(String::new(), |t| format!(" within p99 <= {t} ms"));
    out += &format!(
        "Best{within}: {} at concurrency {}: {:.1} requests/s, p50 {:.3} ms, p99 {:.3} ms\n",
        winner.point.describe(),
        sample.concurrency,
        sample.throughput,
        sample.p50_ms,
        sample.p99_ms
    );
    let changes = report::changes(&current, &winner.point);
    if changes.is_empty() {
        out += "The current config is the best measured.\n";
    } else {
        out += &format!("Changes from the current config: {}\n", changes.join("; "));
    }
    out += &format!("Sizing: {}\n", report::sizing(sample, settings.target_rps, cores));
    let text = pbtxt::to_text(&tuned);
    match &settings.output {
        Some(path) => {
            std::fs::write(path, &text).map_err(|e| format!("cannot write {}: {e}", path.display()))?;
            out += &format!("Recommended config written to {}\n", path.display());
        }
        None => out += &format!("\nRecommended config.pbtxt:\n{text}"),
    }
    write_report(&settings, started, &measured, &ceiling_points, Some((winner, sample, &text)))?;
    print!("{out}");
    Ok(())
}

fn write_report(
    settings: &TuneSettings,
    started: Instant,
    measured: &[Measured],
    ceiling: &[ceiling::BatchPoint],
    best: Option<(&Measured, &drive::Sample, &String)>,
) -> Result<(), String> {
    let Some(path) = &settings.report else { return Ok(()) };
    let json = serde_json::json!({
        "model": settings.model,
        "cores": settings.cores,
        "budget_secs": settings.budget.as_secs_f64(),
        "elapsed_secs": started.elapsed().as_secs_f64(),
        "latency_target_ms": settings.latency_target_ms,
        "ceiling": ceiling,
        "points": measured,
        "best": best.map(|(m, s, config)| serde_json::json!({"point": m.point, "sample": s, "config": config})),
    });
    let text = serde_json::to_string_pretty(&json).map_err(|e| e.to_string())?;
    std::fs::write(path, text).map_err(|e| format!("cannot write {}: {e}", path.display()))
}

/// Loads each point's config and measures it at every concurrency.
struct Sweep<'a> {
    core: &'a Core,
    name: &'a str,
    base: &'a crate::proto::inference::ModelConfig,
    http: &'a drive::Http,
    plan: &'a Plan,
    concurrency: &'a [usize],
}

impl Sweep<'_> {
    /// Measures `point` unless it already was, keeping what loads.
    async fn add(
        &mut self,
        measured: &mut Vec<Measured>,
        point: Point,
        baseline: bool,
        progress: &mut progress::Progress,
    ) -> Result<(), String> {
        if !measured.iter().any(|m| m.point == point)
            && let Some(m) = self.point(point, baseline, progress).await?
        {
            measured.push(m);
        }
        Ok(())
    }

    /// None when the budget has no room left for the point.
    async fn point(
        &mut self,
        point: Point,
        baseline: bool,
        progress: &mut progress::Progress,
    ) -> Result<Option<Measured>, String> {
        let needed = (self.plan.slice + self.plan.warmup()) * self.concurrency.len() as u32;
        if !baseline && self.plan.left() < needed {
            progress.skip(&point.describe());
            return Ok(None);
        }
        progress.start(&point.describe());
        let config = if baseline { self.base.clone() } else { search::config_for(self.base, &point) };
        let json = pbtxt::to_json(&config).to_string();
        let loading = Instant::now();
        if let Err(e) =
            self.core.repository.load(self.name, LoadRequest { config: Some(json), files: Vec::new() }).await
        {
            progress.fail(&format!("{}: {e}", point.describe()));
            return Ok(None);
        }
        let load_secs = loading.elapsed().as_secs_f64();
        let engine = Arc::clone(&self.core.engine);
        let mut samples = Vec::new();
        let warmup = self.plan.warmup();
        for &c in self.concurrency {
            samples.push(drive::drive(&engine, self.name, self.http, c, warmup, self.plan.slice).await);
        }
        let model_bytes = self
            .core
            .registry
            .resolve(self.name, None)
            .map(|m| m.stats.snapshot().memory.iter().map(|u| u.bytes).sum())
            .unwrap_or(0);
        let resident_bytes = crate::stats::resident_bytes("self").unwrap_or(0);
        progress.done(samples.iter().map(|s| s.throughput).fold(0.0, f64::max));
        Ok(Some(Measured { point, baseline, samples, model_bytes, resident_bytes, load_secs }))
    }
}
