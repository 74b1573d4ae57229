//! `ferry tune`: Model Analyzer's job, built in. Measures models of a repository on this machine:
//! in-process (the backend alone at each batch size: the ceiling), then through the real HTTP
//! front-end and the engine (queue, dynamic batcher, instances) over a sweep of instance counts,
//! intra-op threads, batch sizes and queue delays, within a time budget. Several models are
//! loaded and driven together under a traffic mix, so they compete for the cores as they will in
//! production. Reports every point (text, JSON, an HTML page of charts) and writes the best config
//! within the constraints as a complete config.pbtxt per model, with the sizing for the platforms.
use std::{net::SocketAddr, sync::Arc, time::Instant};

use tokio::{net::TcpListener, sync::watch};

use crate::{
    config::{Config, TuneSettings},
    frontend::{self, http_common::HttpState, net},
    server::Core,
};

mod ceiling;
mod constraints;
mod drive;
mod html;
mod machine;
mod outcome;
mod output;
mod progress;
mod report;
mod request;
mod search;
mod subject;
mod svg;
mod sweep;

use constraints::Constraints;
use search::Point;
use subject::Subject;
use sweep::{Plan, Sweep};

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
    let mut subjects = Vec::new();
    for (name, &weight) in settings.models.iter().zip(&settings.mix) {
        subjects.push(Subject::prepare(&core, name, weight, &settings, addr).await?);
    }
    let cores = settings.cores;
    let concurrency = &settings.concurrency;

    // The plan: the current configs, then for each model its instance layouts, three queue delays
    // and three batch sizes; the ceiling takes a share first.
    let planned = 1 + subjects.iter().map(Subject::planned).sum::<usize>();
    let with_ceiling = subjects.iter().filter(|s| s.has_ceiling()).count();
    let ceiling_share = if with_ceiling > 0 { settings.budget.mul_f64(0.12) } else { std::time::Duration::ZERO };
    let per_point = (settings.budget.saturating_sub(ceiling_share)).mul_f64(0.85) / planned as u32;
    // Each point also pays a load (sessions created); a fifth of a slice more warms each
    // concurrency up.
    let slice = per_point
        .div_f64(concurrency.len() as f64 * 1.2)
        .clamp(std::time::Duration::from_millis(300), std::time::Duration::from_secs(20));
    let mut progress = progress::Progress::new(planned, deadline);

    let mut ceilings = Vec::new();
    for s in &subjects {
        if s.has_ceiling() {
            progress.note(&format!("in-process ceiling of '{}'", s.name));
            ceilings.push(s.ceiling(&core, ceiling_share / with_ceiling as u32, cores).await);
        } else {
            ceilings.push(Vec::new());
        }
    }
    let batch0: Vec<usize> = subjects.iter().zip(&ceilings).map(|(s, c)| s.first_batch(ceiling::knee(c))).collect();

    let constraints = Constraints::of(&settings);
    let current: Vec<Point> = subjects.iter().map(|s| s.current).collect();
    let mut sweep = Sweep::new(&core, &subjects, Plan { slice, deadline }, concurrency, progress);
    // Stage 0: what runs today.
    sweep.add(current.clone(), true).await;
    // The heaviest model first (the highest latency alone at the lowest concurrency).
    let mut order: Vec<usize> = (0..subjects.len()).collect();
    if let Some(m) = sweep.measured.first() {
        let p50 = |k: usize| m.per_model[k].first().map_or(0.0, |s| s.p50_ms);
        order.sort_by(|&a, &b| p50(b).total_cmp(&p50(a)));
    }
    let anchor = |sweep: &Sweep<'_>| -> Vec<Point> {
        constraints.anchor(&sweep.measured).map(|p| sweep.measured[p.point].points.clone()).unwrap_or(current.clone())
    };
    for k in order {
        let s = &subjects[k];
        // Stage 1: instances x threads, dynamic batching with no delay.
        let base = anchor(&sweep);
        let delay0 = if s.batchable { Some(0) } else { None };
        for &(instances, threads) in &s.layouts {
            let mut points = base.clone();
            points[k] = Point {
                instances,
                threads,
                max_batch_size: batch0[k],
                preferred_batch_size: None,
                queue_delay_us: delay0,
            };
            sweep.add(points, false).await;
        }
        if !s.batchable {
            continue;
        }
        // Stage 2: queue delays around the best layout.
        let base = anchor(&sweep);
        for delay in search::DELAYS_US {
            let mut points = base.clone();
            points[k] = Point { queue_delay_us: Some(delay), max_batch_size: base[k].max_batch_size.max(1), ..base[k] };
            sweep.add(points, false).await;
        }
        // Stage 3: batch sizes around the best so far.
        let base = anchor(&sweep);
        let knee = ceiling::knee(&ceilings[k]).unwrap_or(base[k].max_batch_size);
        for (max_batch_size, preferred_batch_size) in
            search::batch_variations(base[k].max_batch_size, knee, s.batch_cap())
        {
            let mut points = base.clone();
            points[k] = Point {
                max_batch_size,
                preferred_batch_size,
                queue_delay_us: base[k].queue_delay_us.or(Some(0)),
                ..base[k]
            };
            sweep.add(points, false).await;
        }
    }
    sweep.progress.finish();
    let measured = std::mem::take(&mut sweep.measured);
    drop(sweep);
    for s in &subjects {
        let _ = core.repository.unload(&s.name, false).await;
    }
    let run = outcome::Run {
        settings: &settings,
        subjects: &subjects,
        ceilings: &ceilings,
        measured: &measured,
        constraints,
        elapsed_secs: started.elapsed().as_secs_f64(),
    };
    run.finish()
}
