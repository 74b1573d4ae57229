//! Load on the server: `concurrency` clients, each sending the same request again as soon as its
//! last one is answered (perf_analyzer's closed loop), over HTTP on loopback with binary tensors
//! (the KServe binary extension, as `perf_analyzer -i http`), to the real HTTP front-end. What is
//! measured: requests answered per second, latency percentiles, the batch sizes the scheduler
//! formed (from the model's statistics).
use std::{
    sync::Arc,
    time::{Duration, Instant},
};

use serde::Serialize;

use bytes::Bytes;

use crate::{config::Percentile, engine::Engine, request::InferRequest};

/// One inference request, encoded once: the URL, the body (JSON header, then the tensors' bytes)
/// and the header's length.
#[derive(Clone)]
pub struct Http {
    client: reqwest::Client,
    url: String,
    body: Bytes,
    header_len: usize,
}

impl Http {
    pub fn new(addr: std::net::SocketAddr, request: &InferRequest, outputs: &[String]) -> Result<Http, String> {
        let inputs: Vec<serde_json::Value> = request
            .inputs
            .iter()
            .map(|t| {
                serde_json::json!({"name": t.name, "shape": t.shape, "datatype": t.datatype.wire(),
                    "parameters": {"binary_data_size": t.data.len()}})
            })
            .collect();
        let outputs: Vec<serde_json::Value> =
            outputs.iter().map(|o| serde_json::json!({"name": o, "parameters": {"binary_data": true}})).collect();
        let header = serde_json::json!({"inputs": inputs, "outputs": outputs}).to_string();
        let mut body = header.clone().into_bytes();
        for t in &request.inputs {
            body.extend_from_slice(&t.data);
        }
        let client = reqwest::Client::builder().build().map_err(|e| format!("HTTP client: {e}"))?;
        let url = format!("http://{addr}/v2/models/{}/infer", crate::names::percent_encode(&request.model_name));
        Ok(Http { client, url, body: body.into(), header_len: header.len() })
    }

    async fn send(&self) -> Result<(), String> {
        let resp = self
            .client
            .post(&self.url)
            .header("Inference-Header-Content-Length", self.header_len)
            .header("Content-Type", "application/octet-stream")
            .body(self.body.clone())
            .send()
            .await
            .map_err(|e| e.to_string())?;
        let status = resp.status();
        let body = resp.bytes().await.map_err(|e| e.to_string())?;
        if status.is_success() {
            Ok(())
        } else {
            Err(format!("HTTP {status}: {}", String::from_utf8_lossy(&body[..body.len().min(300)])))
        }
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct Sample {
    pub concurrency: usize,
    /// Requests answered per second in the measured window.
    pub throughput: f64,
    pub p50_ms: f64,
    pub p95_ms: f64,
    pub p99_ms: f64,
    pub requests: u64,
    pub errors: u64,
    /// The first error's message, when some request failed.
    pub error: Option<String>,
    /// Average rows per execution while measured.
    pub avg_batch: f64,
    /// Average requests queued or executing in the server (`ferry_inference_load`) while measured.
    pub load: f64,
}

impl Sample {
    /// The latency at `p`.
    pub fn latency(&self, p: Percentile) -> f64 {
        match p {
            Percentile::P95 => self.p95_ms,
            Percentile::P99 => self.p99_ms,
        }
    }

    /// Answered every request it sent, and sent some.
    pub fn clean(&self) -> bool {
        self.errors == 0 && self.requests > 0
    }
}

/// The value below which a fraction `q` of the sorted `v` lies (nearest rank).
pub fn percentile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let rank = ((q * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len());
    sorted[rank - 1]
}

#[derive(Default)]
struct Tally {
    latencies_ms: Vec<f64>,
    errors: u64,
    error: Option<String>,
}

impl Tally {
    fn absorb(&mut self, other: Tally) {
        self.latencies_ms.extend(other.latencies_ms);
        self.errors += other.errors;
        if self.error.is_none() {
            self.error = other.error;
        }
    }

    fn sample(mut self, concurrency: usize, measure: Duration, avg_batch: f64, load: f64) -> Sample {
        self.latencies_ms.sort_by(f64::total_cmp);
        let n = self.latencies_ms.len() as u64;
        Sample {
            concurrency,
            throughput: n as f64 / measure.as_secs_f64(),
            p50_ms: percentile(&self.latencies_ms, 0.50),
            p95_ms: percentile(&self.latencies_ms, 0.95),
            p99_ms: percentile(&self.latencies_ms, 0.99),
            requests: n,
            errors: self.errors,
            error: self.error,
            avg_batch,
            load,
        }
    }
}

/// One model under load: its request and its share of the traffic.
pub struct Target<'a> {
    pub model: &'a str,
    pub http: &'a Http,
    pub weight: f64,
}

/// What one concurrency measured: all the models together, and each model.
pub struct MixSample {
    pub combined: Sample,
    pub models: Vec<Sample>,
}

/// A small deterministic generator (xorshift64*): each client picks its next model by weight.
struct Pick(u64);

impl Pick {
    fn next(&mut self, cumulative: &[f64]) -> usize {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        let r = (self.0.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 11) as f64 / (1u64 << 53) as f64;
        let total = cumulative.last().copied().unwrap_or(1.0);
        cumulative.iter().position(|&c| r * total < c).unwrap_or(cumulative.len() - 1)
    }
}

/// `concurrency` closed-loop clients, each sending its next request to a model drawn by the
/// weights. Warms up for `warmup`, then measures for `measure`; the models' load (queued and
/// executing) is sampled every 10 ms meanwhile.
pub async fn drive(
    engine: &Arc<Engine>,
    targets: &[Target<'_>],
    concurrency: usize,
    warmup: Duration,
    measure: Duration,
) -> MixSample {
    let start = Instant::now() + warmup;
    let end = start + measure;
    let give_up = end + measure.max(Duration::from_secs(1));
    let models: Vec<_> = targets.iter().map(|t| engine.registry().resolve(t.model, None).ok()).collect();
    let before: Vec<_> = models.iter().map(|m| m.as_ref().map(|m| m.stats.snapshot())).collect();
    let cumulative: Arc<Vec<f64>> = Arc::new(
        targets
            .iter()
            .scan(0.0, |sum, t| {
                *sum += t.weight;
                Some(*sum)
            })
            .collect(),
    );
    let https: Arc<Vec<Http>> = Arc::new(targets.iter().map(|t| t.http.clone()).collect());
    let sampler = {
        let stats: Vec<_> = models.iter().map(|m| m.as_ref().map(|m| Arc::clone(&m.stats))).collect();
        tokio::spawn(async move {
            let (mut sums, mut n) = (vec![0i64; stats.len()], 0u64);
            tokio::time::sleep_until(start.into()).await;
            let mut tick = tokio::time::interval(Duration::from_millis(10));
            while Instant::now() < end {
                tick.tick().await;
                for (sum, s) in sums.iter_mut().zip(&stats) {
                    *sum += s.as_ref().map_or(0, |s| s.load().max(0));
                }
                n += 1;
            }
            sums.into_iter().map(|s| s as f64 / n.max(1) as f64).collect::<Vec<f64>>()
        })
    };
    let mut tasks = Vec::with_capacity(concurrency);
    for client in 0..concurrency {
        let (https, cumulative) = (Arc::clone(&https), Arc::clone(&cumulative));
        tasks.push(tokio::spawn(async move {
            let mut tallies: Vec<Tally> = https.iter().map(|_| Tally::default()).collect();
            let mut pick = Pick(0x9e37_79b9_7f4a_7c15 ^ (client as u64 + 1).wrapping_mul(0xbf58_476d_1ce4_e5b9));
            loop {
                let sent = Instant::now();
                if sent >= end {
                    break;
                }
                let i = if https.len() == 1 { 0 } else { pick.next(&cumulative) };
                // A request still unanswered well after the window is a failure, not a wait.
                let Ok(result) = tokio::time::timeout_at(give_up.into(), https[i].send()).await else {
                    if sent >= start {
                        tallies[i].errors += 1;
                        tallies[i].error.get_or_insert_with(|| {
                            "no answer by the end of the measured window (the model is slower than the budget allows)"
                                .to_string()
                        });
                    }
                    break;
                };
                let answered = Instant::now();
                if sent < start || answered > end {
                    continue;
                }
                let t = &mut tallies[i];
                match result {
                    Ok(_) => t.latencies_ms.push((answered - sent).as_secs_f64() * 1e3),
                    Err(e) => {
                        t.errors += 1;
                        t.error.get_or_insert(e);
                    }
                }
            }
            tallies
        }));
    }
    let mut all: Vec<Tally> = targets.iter().map(|_| Tally::default()).collect();
    for task in tasks {
        match task.await {
            Ok(tallies) => all.iter_mut().zip(tallies).for_each(|(a, t)| a.absorb(t)),
            Err(e) => {
                all[0].errors += 1;
                all[0].error.get_or_insert_with(|| format!("load task failed: {e}"));
            }
        }
    }
    let loads = sampler.await.unwrap_or_else(|_| vec![0.0; targets.len()]);
    let mut combined = Tally::default();
    let mut samples = Vec::with_capacity(targets.len());
    let (mut rows, mut executions) = (0u64, 0u64);
    for (i, tally) in all.into_iter().enumerate() {
        let after = models[i].as_ref().map(|m| m.stats.snapshot());
        let (r, e) = match (&before[i], after) {
            (Some(b), Some(a)) if a.execution_count > b.execution_count => {
                (a.inference_count - b.inference_count, a.execution_count - b.execution_count)
            }
            _ => (0, 0),
        };
        rows += r;
        executions += e;
        let avg_batch = if e > 0 { r as f64 / e as f64 } else { 0.0 };
        let part = Tally { latencies_ms: tally.latencies_ms.clone(), errors: tally.errors, error: tally.error.clone() };
        combined.absorb(part);
        samples.push(tally.sample(concurrency, measure, avg_batch, loads[i]));
    }
    let avg_batch = if executions > 0 { rows as f64 / executions as f64 } else { 0.0 };
    let combined = combined.sample(concurrency, measure, avg_batch, loads.iter().sum());
    MixSample { combined, models: samples }
}

#[cfg(test)]
mod tests {
    use super::percentile;

    #[test]
    fn nearest_rank_percentiles() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(percentile(&v, 0.5), 50.0);
        assert_eq!(percentile(&v, 0.99), 99.0);
        assert_eq!(percentile(&v[..1], 0.99), 1.0);
        assert_eq!(percentile(&[], 0.5), 0.0);
    }
}
