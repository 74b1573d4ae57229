//! `ferry tune`'s command line, resolved into the tuning settings and the serving config its engine
//! runs with (the repository in explicit mode, no listeners).
use std::{collections::BTreeMap, path::PathBuf, time::Duration};

use clap::Args;

use super::invalid;

#[derive(Args, Debug, Clone)]
pub(super) struct TuneArgs {
    /// The model repository folder holding the model.
    #[arg(long = "model-repository")]
    pub model_repository: String,
    /// The model to tune.
    #[arg(long)]
    model: String,
    /// Seconds the whole run may take (measurements and loads).
    #[arg(long, default_value_t = 300)]
    budget_secs: u64,
    /// Where to write the recommended config.pbtxt (complete, loadable as it is); default: printed.
    #[arg(long)]
    output: Option<PathBuf>,
    /// Where to write every measured point as JSON.
    #[arg(long)]
    report: Option<PathBuf>,
    /// The p99 latency, in milliseconds, the recommendation must stay within.
    #[arg(long)]
    latency_target_ms: Option<f64>,
    /// Concurrent clients to measure each config with (comma-separated).
    #[arg(long, value_delimiter = ',', default_values_t = [1usize, 4, 16])]
    concurrency: Vec<usize>,
    /// The shape of an input with variable dims, without the batch dim: `NAME:3,224,224`
    /// (repeatable). Other variable dims are measured at 1.
    #[arg(long)]
    shape: Vec<String>,
    /// Input values in perf_analyzer's JSON format (`{"data": [{"INPUT0": [...]}]}`; the first
    /// entry is sent), for models that need real values (token ids, numbers as strings).
    #[arg(long)]
    input_data: Option<PathBuf>,
    /// Most instances to try (default: the cores).
    #[arg(long)]
    max_instances: Option<usize>,
    /// Requests per second to size the deployment for (the sizing note's replica count).
    #[arg(long)]
    target_rps: Option<f64>,
    /// ONNX Runtime shared library (libonnxruntime.so); also read from ORT_DYLIB_PATH.
    #[arg(long, env = "FERRY_ONNXRUNTIME_LIBRARY")]
    pub onnxruntime_library: Option<PathBuf>,
    /// Backend settings, as `ferry serve`'s (repeatable).
    #[arg(long)]
    pub backend_config: Vec<String>,
}

impl TuneArgs {
    pub(super) fn settings(&self, cores: usize) -> Result<TuneSettings, clap::Error> {
        if self.budget_secs == 0 {
            return Err(invalid("--budget-secs must be at least 1"));
        }
        if self.concurrency.is_empty() || self.concurrency.contains(&0) {
            return Err(invalid("--concurrency: give one or more counts of at least 1, e.g. 1,4,16"));
        }
        if self.latency_target_ms.is_some_and(|t| t.is_nan() || t <= 0.0) {
            return Err(invalid("--latency-target-ms must be above 0"));
        }
        let mut shapes = BTreeMap::new();
        for s in &self.shape {
            let parsed = s.rsplit_once(':').and_then(|(name, dims)| {
                let dims: Option<Vec<i64>> = dims.split(',').map(|d| d.trim().parse().ok()).collect();
                Some((name.to_string(), dims?))
            });
            match parsed {
                Some((name, dims)) if !name.is_empty() && !dims.is_empty() => {
                    shapes.insert(name, dims);
                }
                _ => {
                    return Err(invalid(format!(
                        "--shape {s}: expected NAME:D1,D2,... (for example INPUT0:3,224,224)"
                    )));
                }
            }
        }
        let input_data = match &self.input_data {
            Some(path) => {
                let text = std::fs::read_to_string(path)
                    .map_err(|e| invalid(format!("--input-data {}: {e}", path.display())))?;
                Some(
                    serde_json::from_str::<serde_json::Value>(&text)
                        .map_err(|e| invalid(format!("--input-data {}: not JSON: {e}", path.display())))?,
                )
            }
            None => None,
        };
        let mut concurrency = self.concurrency.clone();
        concurrency.sort_unstable();
        concurrency.dedup();
        Ok(TuneSettings {
            model: self.model.clone(),
            budget: Duration::from_secs(self.budget_secs),
            output: self.output.clone(),
            report: self.report.clone(),
            latency_target_ms: self.latency_target_ms,
            concurrency,
            shapes,
            input_data,
            max_instances: self.max_instances.unwrap_or(cores).max(1),
            target_rps: self.target_rps,
            cores,
        })
    }
}

/// What the command line asks of a tuning run.
#[derive(Debug, Clone)]
pub struct TuneSettings {
    pub model: String,
    pub budget: Duration,
    /// Where the recommended config.pbtxt goes (None: printed).
    pub output: Option<PathBuf>,
    /// Every point as JSON.
    pub report: Option<PathBuf>,
    /// p99 the recommendation must stay within, in milliseconds.
    pub latency_target_ms: Option<f64>,
    pub concurrency: Vec<usize>,
    /// Shapes for inputs with variable dims (without the batch dim).
    pub shapes: BTreeMap<String, Vec<i64>>,
    /// Input values in perf_analyzer's JSON format (`--input-data`).
    pub input_data: Option<serde_json::Value>,
    pub max_instances: usize,
    /// Requests per second the sizing note plans for.
    pub target_rps: Option<f64>,
    pub cores: usize,
}
