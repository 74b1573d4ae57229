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

use crate::{engine::Engine, request::InferRequest};

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
        let url = format!("http://{addr}/v2/models/{}/infer", request.model_name);
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
    pub p99_ms: f64,
    pub requests: u64,
    pub errors: u64,
    /// The first error's message, when some request failed.
    pub error: Option<String>,
    /// Average rows per execution while measured.
    pub avg_batch: f64,
}

/// The value below which a fraction `q` of the sorted `v` lies (nearest rank).
pub fn percentile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let rank = ((q * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len());
    sorted[rank - 1]
}

struct Tally {
    latencies_ms: Vec<f64>,
    errors: u64,
    error: Option<String>,
}

/// Warms up for `warmup`, then measures for `measure`.
pub async fn drive(
    engine: &Arc<Engine>,
    model: &str,
    http: &Http,
    concurrency: usize,
    warmup: Duration,
    measure: Duration,
) -> Sample {
    let start = Instant::now() + warmup;
    let end = start + measure;
    let model = engine.registry().resolve(model, None).ok();
    let before = model.as_ref().map(|m| m.stats.snapshot());
    let mut tasks = Vec::with_capacity(concurrency);
    for _ in 0..concurrency {
        let http = http.clone();
        tasks.push(tokio::spawn(async move {
            let mut t = Tally { latencies_ms: Vec::new(), errors: 0, error: None };
            loop {
                let sent = Instant::now();
                if sent >= end {
                    break;
                }
                let result = http.send().await;
                let answered = Instant::now();
                if sent < start || answered > end {
                    continue;
                }
                match result {
                    Ok(_) => t.latencies_ms.push((answered - sent).as_secs_f64() * 1e3),
                    Err(e) => {
                        t.errors += 1;
                        t.error.get_or_insert(e);
                    }
                }
            }
            t
        }));
    }
    let mut all = Tally { latencies_ms: Vec::new(), errors: 0, error: None };
    for task in tasks {
        match task.await {
            Ok(t) => {
                all.latencies_ms.extend(t.latencies_ms);
                all.errors += t.errors;
                if all.error.is_none() {
                    all.error = t.error;
                }
            }
            Err(e) => {
                all.errors += 1;
                all.error.get_or_insert_with(|| format!("load task failed: {e}"));
            }
        }
    }
    let after = model.as_ref().map(|m| m.stats.snapshot());
    let avg_batch = match (before, after) {
        (Some(b), Some(a)) if a.execution_count > b.execution_count => {
            (a.inference_count - b.inference_count) as f64 / (a.execution_count - b.execution_count) as f64
        }
        _ => 0.0,
    };
    all.latencies_ms.sort_by(f64::total_cmp);
    let n = all.latencies_ms.len() as u64;
    Sample {
        concurrency,
        throughput: n as f64 / measure.as_secs_f64(),
        p50_ms: percentile(&all.latencies_ms, 0.50),
        p99_ms: percentile(&all.latencies_ms, 0.99),
        requests: n,
        errors: all.errors,
        error: all.error,
        avg_batch,
    }
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
