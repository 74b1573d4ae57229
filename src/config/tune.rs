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
    /// The model to tune; repeat it to tune models that share this machine together.
    #[arg(long, required = true)]
    model: Vec<String>,
    /// The traffic mix between the models, as weights: `A=70,B=30` (default: equal shares).
    #[arg(long)]
    mix: Option<String>,
    /// Seconds the whole run may take (measurements and loads).
    #[arg(long, default_value_t = 300)]
    budget_secs: u64,
    /// Where to write the recommended config.pbtxt (complete, loadable as it is); a folder gets
    /// FOLDER/<model>/config.pbtxt for each model (required form for several models). Default: printed.
    #[arg(long)]
    output: Option<PathBuf>,
    /// Where to write every measured point as JSON.
    #[arg(long)]
    report: Option<PathBuf>,
    /// Where to write the HTML report (charts, one self-contained file). Default: beside --output
    /// (`config.report.html`, or FOLDER/tune-report.html), else beside --report.
    #[arg(long)]
    report_html: Option<PathBuf>,
    /// The latency, in milliseconds, every model must stay within (at --latency-percentile).
    #[arg(long, alias = "latency-target-ms")]
    latency_budget_ms: Option<f64>,
    /// Which latency the budget applies to: p99 or p95.
    #[arg(long, default_value = "p99")]
    latency_percentile: String,
    /// Requests per second (all models together) the recommendation must reach.
    #[arg(long)]
    min_throughput: Option<f64>,
    /// Memory, in MiB, the models' instances may hold together.
    #[arg(long)]
    max_memory_mib: Option<f64>,
    /// What to optimise within the constraints: throughput (most requests/s) or latency (lowest).
    #[arg(long, default_value = "throughput")]
    objective: String,
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
        if self.budget_secs == 0 || self.budget_secs > MAX_BUDGET_SECS {
            return Err(invalid(format!("--budget-secs must be from 1 to {MAX_BUDGET_SECS} (a day)")));
        }
        if self.concurrency.is_empty() || self.concurrency.iter().any(|&c| c == 0 || c > MAX_CONCURRENCY) {
            return Err(invalid(format!(
                "--concurrency: give one or more counts from 1 to {MAX_CONCURRENCY}, e.g. 1,4,16"
            )));
        }
        if self.concurrency.len() > MAX_LEVELS {
            return Err(invalid(format!("--concurrency: at most {MAX_LEVELS} levels")));
        }
        // Bounded, so that every sum, axis and replica count the report draws from them is finite.
        let positive = |v: Option<f64>, flag: &str, most: f64| match v {
            Some(v) if !(v.is_finite() && v > 0.0 && v <= most) => {
                Err(invalid(format!("{flag} must be a number above 0 and at most {most}")))
            }
            _ => Ok(()),
        };
        positive(self.latency_budget_ms, "--latency-budget-ms", 1e7)?;
        positive(self.min_throughput, "--min-throughput", 1e12)?;
        positive(self.max_memory_mib, "--max-memory-mib", 1e9)?;
        positive(self.target_rps, "--target-rps", 1e12)?;
        for (flag, path) in
            [("--output", &self.output), ("--report", &self.report), ("--report-html", &self.report_html)]
        {
            match path {
                Some(p) if p.as_os_str().is_empty() => return Err(invalid(format!("{flag}: give a path"))),
                Some(p) if flag != "--output" && p.is_dir() => {
                    return Err(invalid(format!("{flag} {}: is a folder; give a file", p.display())));
                }
                Some(p) => {
                    if let Some(parent) = p.parent().filter(|d| d.exists() && !d.is_dir()) {
                        return Err(invalid(format!("{flag} {}: {} is not a folder", p.display(), parent.display())));
                    }
                }
                None => {}
            }
        }
        let percentile = match self.latency_percentile.to_ascii_lowercase().as_str() {
            "p99" | "99" => Percentile::P99,
            "p95" | "95" => Percentile::P95,
            other => return Err(invalid(format!("--latency-percentile {other}: expected p99 or p95"))),
        };
        let objective = match self.objective.to_ascii_lowercase().as_str() {
            "throughput" => Objective::Throughput,
            "latency" => Objective::Latency,
            other => return Err(invalid(format!("--objective {other}: expected throughput or latency"))),
        };
        let models = self.model.clone();
        for (i, m) in models.iter().enumerate() {
            if m.is_empty() || models[..i].contains(m) {
                return Err(invalid(format!("--model '{m}': give each model once, by name")));
            }
        }
        let mix = match &self.mix {
            Some(text) => parse_mix(text, &models)?,
            None => vec![1.0; models.len()],
        };
        if models.len() > 1 && self.output.as_ref().is_some_and(|o| o.is_file()) {
            return Err(invalid(format!(
                "--output {}: with several models, give a folder (each model's config goes to FOLDER/<model>/config.pbtxt)",
                self.output.as_ref().map(|o| o.display().to_string()).unwrap_or_default()
            )));
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
        let report_html = self.report_html.clone().or_else(|| match (&self.output, &self.report) {
            (None, Some(report)) if report.extension().is_some_and(|e| e == "html") => {
                Some(report.with_extension("report.html"))
            }
            (Some(out), _) if models.len() > 1 || is_folder(out) => Some(out.join("tune-report.html")),
            (Some(out), _) => Some(out.with_extension("report.html")),
            (None, Some(report)) => Some(report.with_extension("html")),
            (None, None) => None,
        });
        let same = [&self.output, &self.report, &report_html].into_iter().flatten().collect::<Vec<_>>();
        if (1..same.len()).any(|i| same[..i].contains(&same[i])) {
            return Err(invalid("--output, --report and --report-html must be different files"));
        }
        Ok(TuneSettings {
            models,
            mix,
            budget: Duration::from_secs(self.budget_secs),
            output: self.output.clone(),
            report: self.report.clone(),
            report_html,
            latency_budget_ms: self.latency_budget_ms,
            percentile,
            min_throughput: self.min_throughput,
            max_memory_bytes: self.max_memory_mib.map(|m| (m * 1024.0 * 1024.0) as u64),
            objective,
            concurrency,
            shapes,
            input_data,
            max_instances: self.max_instances.unwrap_or(cores).max(1),
            target_rps: self.target_rps,
            cores,
        })
    }
}

const MAX_BUDGET_SECS: u64 = 86_400;
/// Clients a level may run (each one connection to the loopback front-end).
const MAX_CONCURRENCY: usize = 1024;
const MAX_LEVELS: usize = 16;

/// A folder that exists, or a path written as one (`tuned/`): where a config per model goes.
pub fn is_folder(path: &std::path::Path) -> bool {
    path.is_dir() || path.as_os_str().to_string_lossy().ends_with('/')
}

/// `A=70,B=30`: a positive weight for every model, each named once.
fn parse_mix(text: &str, models: &[String]) -> Result<Vec<f64>, clap::Error> {
    let mut weights = vec![None; models.len()];
    for part in text.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let Some((name, weight)) = part.split_once('=') else {
            return Err(invalid(format!("--mix {part}: expected MODEL=WEIGHT, for example a=70,b=30")));
        };
        let Some(i) = models.iter().position(|m| m == name.trim()) else {
            return Err(invalid(format!(
                "--mix: '{}' is not one of the --model names ({})",
                name.trim(),
                models.join(", ")
            )));
        };
        match weight.trim().parse::<f64>() {
            Ok(w) if w.is_finite() && w > 0.0 && w <= 1e6 && weights[i].is_none() => weights[i] = Some(w),
            Ok(_) if weights[i].is_some() => return Err(invalid(format!("--mix: '{name}' is given twice"))),
            _ => return Err(invalid(format!("--mix {part}: the weight must be a number above 0 and at most 1000000"))),
        }
    }
    models
        .iter()
        .zip(weights)
        .map(|(m, w)| w.ok_or_else(|| invalid(format!("--mix: give '{m}' a weight too (every --model needs traffic)"))))
        .collect()
}

/// The latency a budget applies to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Percentile {
    P95,
    P99,
}

impl Percentile {
    pub fn label(self) -> &'static str {
        match self {
            Percentile::P95 => "p95",
            Percentile::P99 => "p99",
        }
    }
}

/// What the recommendation optimises within the constraints.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Objective {
    Throughput,
    Latency,
}

/// What the command line asks of a tuning run.
#[derive(Debug, Clone)]
pub struct TuneSettings {
    /// The models tuned together, in the order given.
    pub models: Vec<String>,
    /// Each model's share of the traffic (weights, same order).
    pub mix: Vec<f64>,
    pub budget: Duration,
    /// Where the recommended config.pbtxt goes (None: printed); a folder for several models.
    pub output: Option<PathBuf>,
    /// Every point as JSON.
    pub report: Option<PathBuf>,
    /// The HTML report.
    pub report_html: Option<PathBuf>,
    /// The latency every model must stay within, in milliseconds, at `percentile`.
    pub latency_budget_ms: Option<f64>,
    pub percentile: Percentile,
    /// Requests per second, all models together.
    pub min_throughput: Option<f64>,
    /// What the models' instances may hold together.
    pub max_memory_bytes: Option<u64>,
    pub objective: Objective,
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
