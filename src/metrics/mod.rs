//! Every metric name, in one file: Triton's Prometheus families (read from the per-version
//! statistics at scrape time, so requests pay nothing extra), the machine gauges, ferry's
//! autoscaling gauges, and the same signal as CloudWatch embedded-metric log lines.
use std::{
    collections::{BTreeMap, VecDeque},
    sync::{Arc, Mutex},
    time::Duration,
};

use prometheus::{
    Encoder, TextEncoder,
    proto::{Bucket, Counter, Gauge, LabelPair, Metric, MetricFamily, MetricType, Quantile, Summary},
};

use crate::{
    admission::{Admission, AdmissionCounts},
    cache::{CacheCounts, ResponseCache},
    error::Origin,
    model::ModelVersion,
    repository::registry::Registry,
    stats::{Snapshot, Tally},
};

pub mod host;

/// What `--allow-*-metrics`, `--metrics-interval-ms` and `--metrics-config` turn on.
#[derive(Debug, Clone, PartialEq)]
pub struct MetricsSettings {
    pub cpu: bool,
    pub gpu: bool,
    pub interval: Duration,
    pub counter_latencies: bool,
    pub histogram_latencies: bool,
    pub summary_latencies: bool,
    /// (quantile, allowed error)
    pub quantiles: Vec<(f64, f64)>,
}

impl Default for MetricsSettings {
    fn default() -> Self {
        MetricsSettings {
            cpu: true,
            gpu: true,
            interval: Duration::from_millis(2000),
            counter_latencies: true,
            histogram_latencies: false,
            summary_latencies: false,
            quantiles: vec![(0.5, 0.05), (0.9, 0.01), (0.95, 0.001), (0.99, 0.001), (0.999, 0.001)],
        }
    }
}

impl MetricsSettings {
    /// Applies one `--metrics-config key=value`.
    pub fn apply(&mut self, setting: &str) -> Result<(), String> {
        let (key, value) = setting.split_once('=').ok_or_else(|| format!("expected key=value, got '{setting}'"))?;
        let flag = || match value {
            "true" | "1" => Ok(true),
            "false" | "0" => Ok(false),
            _ => Err(format!("'{key}' takes true or false, got '{value}'")),
        };
        match key {
            "counter_latencies" => self.counter_latencies = flag()?,
            "histogram_latencies" => self.histogram_latencies = flag()?,
            "summary_latencies" => self.summary_latencies = flag()?,
            "summary_quantiles" => {
                // Malformed pairs are skipped, as Triton does.
                self.quantiles = value
                    .split(',')
                    .filter_map(|p| {
                        let (q, e) = p.split_once(':')?;
                        Some((q.trim().parse().ok()?, e.trim().parse().ok()?))
                    })
                    .collect();
            }
            other => return Err(format!("unknown --metrics-config key '{other}'")),
        }
        Ok(())
    }
}

/// Default buckets (ms) of `nv_inference_first_response_histogram_ms`.
pub const FIRST_RESPONSE_BUCKETS: [f64; 4] = [100.0, 500.0, 2000.0, 5000.0];

pub struct Metrics {
    settings: MetricsSettings,
    registry: Arc<Registry>,
    sampler: Mutex<host::Sampler>,
    reading: Mutex<host::HostReading>,
    cache: Option<Arc<ResponseCache>>,
    admission: Arc<Admission>,
}

type Labels = Vec<(String, String)>;

/// Families in the order first added, each with its samples.
#[derive(Default)]
struct Families {
    order: Vec<&'static str>,
    families: BTreeMap<&'static str, MetricFamily>,
}

impl Families {
    fn add(
        &mut self,
        name: &'static str,
        help: &str,
        kind: MetricType,
        labels: &Labels,
        fill: impl FnOnce(&mut Metric),
    ) {
        let family = self.families.entry(name).or_insert_with(|| {
            self.order.push(name);
            let mut f = MetricFamily::default();
            f.set_name(name.to_string());
            f.set_help(help.to_string());
            f.set_field_type(kind);
            f
        });
        let mut sorted = labels.clone();
        sorted.sort();
        let mut m = Metric::default();
        m.set_label(
            sorted
                .into_iter()
                .map(|(k, v)| {
                    let mut p = LabelPair::default();
                    p.set_name(k);
                    p.set_value(v);
                    p
                })
                .collect(),
        );
        fill(&mut m);
        family.mut_metric().push(m);
    }

    fn counter(&mut self, name: &'static str, help: &str, labels: &Labels, value: f64) {
        self.add(name, help, MetricType::COUNTER, labels, |m| {
            let mut c = Counter::default();
            c.set_value(value);
            m.set_counter(c);
        });
    }

    fn gauge(&mut self, name: &'static str, help: &str, labels: &Labels, value: f64) {
        self.add(name, help, MetricType::GAUGE, labels, |m| {
            let mut g = Gauge::default();
            g.set_value(value);
            m.set_gauge(g);
        });
    }

    fn summary(
        &mut self,
        name: &'static str,
        help: &str,
        labels: &Labels,
        total: &Tally,
        recent: &VecDeque<f64>,
        quantiles: &[(f64, f64)],
    ) {
        let mut sorted: Vec<f64> = recent.iter().copied().collect();
        sorted.sort_by(f64::total_cmp);
        self.add(name, help, MetricType::SUMMARY, labels, |m| {
            let mut s = Summary::default();
            s.set_sample_count(total.count);
            s.set_sample_sum(us(total));
            s.set_quantile(
                quantiles
                    .iter()
                    .map(|(q, _)| {
                        let mut x = Quantile::default();
                        x.set_quantile(*q);
                        let i = ((sorted.len() as f64 * q).ceil() as usize).clamp(1, sorted.len().max(1)) - 1;
                        x.set_value(sorted.get(i).copied().unwrap_or(0.0));
                        x
                    })
                    .collect(),
            );
            m.set_summary(s);
        });
    }

    fn into_text(self) -> String {
        let mut families: Vec<MetricFamily> = Vec::with_capacity(self.order.len());
        let mut map = self.families;
        for name in self.order {
            families.extend(map.remove(name));
        }
        let mut out = Vec::new();
        if let Err(e) = TextEncoder::new().encode(&families, &mut out) {
            tracing::warn!(error = %e, "cannot encode metrics");
        }
        String::from_utf8(out).unwrap_or_default()
    }
}

/// ferry's own response-cache families (Triton's per-model ones come from the statistics).
fn cache_families(f: &mut Families, c: &CacheCounts) {
    let none = Labels::new();
    f.gauge(
        "ferry_cache_local_entries",
        "Responses held by the in-process response cache",
        &none,
        c.local_entries as f64,
    );
    f.gauge("ferry_cache_local_bytes", "Bytes charged to the in-process response cache", &none, c.local_bytes as f64);
    f.gauge(
        "ferry_cache_local_capacity_bytes",
        "Byte bound of the in-process response cache",
        &none,
        c.local_capacity as f64,
    );
    f.counter(
        "ferry_cache_shared_hits_total",
        "Responses found in the shared (Redis) tier",
        &none,
        c.shared_hits as f64,
    );
    f.counter(
        "ferry_cache_shared_errors_total",
        "Shared (Redis) tier lookups, stores and connections that failed or timed out; each costs a miss only",
        &none,
        c.shared_errors as f64,
    );
    f.counter(
        "ferry_cache_joined_total",
        "Requests answered by an identical request's computation that was already running (single flight)",
        &none,
        c.joined as f64,
    );
}

/// The admission budget: what is held, the bound, and what was refused.
fn admission_families(f: &mut Families, a: &AdmissionCounts) {
    let none = Labels::new();
    f.gauge("ferry_inflight_request_bytes", "Bytes of requests being served (admission control)", &none, a.used as f64);
    f.gauge(
        "ferry_inflight_request_budget_bytes",
        "Most bytes of requests served at once (--max-inflight-request-bytes)",
        &none,
        a.budget as f64,
    );
    f.gauge("ferry_inflight_requests", "Requests being served, streams included", &none, a.live as f64);
    f.counter(
        "ferry_admission_rejected_total",
        "Requests refused because the in-flight byte budget was spent (503 / RESOURCE_EXHAUSTED)",
        &none,
        a.rejected as f64,
    );
}

fn labels(m: &ModelVersion) -> Labels {
    let mut l = vec![("model".to_string(), m.name.clone()), ("version".to_string(), m.version.to_string())];
    if let Some((_, ns)) = &m.namespace {
        l.push(("namespace".to_string(), ns.to_string()));
    }
    l.extend(m.config.metric_tags.iter().map(|(k, v)| (format!("_{k}"), v.clone())));
    l
}

fn us(t: &Tally) -> f64 {
    (t.ns / 1000) as f64
}

impl Metrics {
    pub fn new(
        settings: MetricsSettings,
        registry: Arc<Registry>,
        cache: Option<Arc<ResponseCache>>,
        admission: Arc<Admission>,
    ) -> Arc<Self> {
        let sampler = host::Sampler::new(settings.cpu, settings.gpu);
        let reading = Mutex::default();
        Arc::new(Metrics { settings, registry, sampler: Mutex::new(sampler), reading, cache, admission })
    }

    pub fn settings(&self) -> &MetricsSettings {
        &self.settings
    }

    /// Takes the per-interval machine readings (run every `--metrics-interval-ms`).
    pub fn sample(&self) {
        let reading = self.sampler.lock().unwrap_or_else(|p| p.into_inner()).sample();
        *self.reading.lock().unwrap_or_else(|p| p.into_inner()) = reading;
    }

    /// The Prometheus text exposition.
    pub fn render(&self) -> String {
        let mut f = Families::default();
        for m in self.registry.serving(None) {
            self.model_families(&mut f, &m, &m.stats.snapshot());
        }
        let r = self.reading.lock().unwrap_or_else(|p| p.into_inner()).clone();
        for g in &r.gpus {
            let l = vec![("gpu_uuid".to_string(), g.uuid.clone())];
            f.gauge("nv_gpu_utilization", "GPU utilization rate [0.0 - 1.0)", &l, g.utilization);
            f.gauge("nv_gpu_memory_total_bytes", "GPU total memory, in bytes", &l, g.memory_total);
            f.gauge("nv_gpu_memory_used_bytes", "GPU used memory, in bytes", &l, g.memory_used);
            f.gauge("nv_gpu_power_usage", "GPU power usage in watts", &l, g.power_usage);
            f.gauge("nv_gpu_power_limit", "GPU power management limit in watts", &l, g.power_limit);
            f.counter(
                "nv_energy_consumption",
                "GPU energy consumption in joules since the server started",
                &l,
                g.energy,
            );
        }
        if self.settings.cpu {
            let none = Labels::new();
            f.gauge("nv_cpu_utilization", "CPU utilization rate [0.0 - 1.0]", &none, r.cpu_utilization);
            f.gauge("nv_cpu_memory_total_bytes", "CPU total memory (RAM), in bytes", &none, r.memory_total);
            f.gauge("nv_cpu_memory_used_bytes", "CPU used memory (RAM), in bytes", &none, r.memory_used);
        }
        if let Some(c) = &self.cache {
            cache_families(&mut f, &c.counts());
        }
        admission_families(&mut f, &self.admission.counts());
        f.into_text()
    }

    /// The response cache serves this model: the server has one and the model turned it on.
    fn caches(&self, m: &ModelVersion) -> bool {
        self.cache.is_some() && m.config.response_cache.as_ref().is_some_and(|c| c.enable)
    }

    fn model_families(&self, f: &mut Families, m: &ModelVersion, s: &Snapshot) {
        let l = labels(m);
        f.counter(
            "nv_inference_request_success",
            "Number of successful inference requests, all batch sizes",
            &l,
            s.success.count as f64,
        );
        for (origin, count) in Origin::ALL.iter().zip(s.fail_by_origin) {
            let mut with_reason = l.clone();
            with_reason.push(("reason".into(), origin.label().into()));
            f.counter(
                "nv_inference_request_failure",
                "Number of failed inference requests, all batch sizes",
                &with_reason,
                count as f64,
            );
        }
        f.counter(
            "nv_inference_count",
            "Number of inferences performed (does not include cached requests)",
            &l,
            s.inference_count as f64,
        );
        f.counter(
            "nv_inference_exec_count",
            "Number of model executions performed (does not include cached requests)",
            &l,
            s.execution_count as f64,
        );
        if s.prompt_tokens > 0 || s.completion_tokens > 0 {
            let tokens = [("prompt", s.prompt_tokens), ("completion", s.completion_tokens)];
            for (kind, n) in tokens {
                let mut with_kind = l.clone();
                with_kind.push(("kind".into(), kind.into()));
                f.counter(
                    "ferry_openai_tokens_total",
                    "Tokens counted by the OpenAI API (prompt, completion)",
                    &with_kind,
                    n as f64,
                );
            }
        }
        f.gauge(
            "nv_inference_pending_request_count",
            "Instantaneous number of pending requests awaiting execution per-model.",
            &l,
            s.pending as f64,
        );
        if let Some(seqs) = &m.sequences {
            let c = seqs.counts();
            f.gauge("ferry_sequences_active", "Sequences holding a slot (and their state)", &l, c.active as f64);
            f.gauge("ferry_sequences_waiting", "New sequences waiting for a free slot", &l, c.waiting as f64);
            f.gauge("ferry_sequence_slots", "Sequences the model serves at once", &l, c.slots as f64);
        }
        if self.settings.counter_latencies {
            let total = Tally { count: s.success.count, ns: s.success.ns };
            f.counter(
                "nv_inference_request_duration_us",
                "Cumulative inference request duration in microseconds (includes cached requests)",
                &l,
                us(&total),
            );
            f.counter(
                "nv_inference_queue_duration_us",
                "Cumulative inference queuing duration in microseconds (includes cached requests)",
                &l,
                us(&s.queue),
            );
            f.counter(
                "nv_inference_compute_input_duration_us",
                "Cumulative compute input duration in microseconds (does not include cached requests)",
                &l,
                us(&s.compute_input),
            );
            f.counter(
                "nv_inference_compute_infer_duration_us",
                "Cumulative compute inference duration in microseconds (does not include cached requests)",
                &l,
                us(&s.compute_infer),
            );
            f.counter(
                "nv_inference_compute_output_duration_us",
                "Cumulative inference compute output duration in microseconds (does not include cached requests)",
                &l,
                us(&s.compute_output),
            );
        }
        if self.caches(m) {
            f.counter("nv_cache_num_hits_per_model", "Number of cache hits per model", &l, s.cache_hit.count as f64);
            f.counter(
                "nv_cache_num_misses_per_model",
                "Number of cache misses per model",
                &l,
                s.cache_miss.count as f64,
            );
            if self.settings.counter_latencies {
                f.counter(
                    "nv_cache_hit_duration_per_model",
                    "Total cache hit duration per model, in microseconds",
                    &l,
                    us(&s.cache_hit),
                );
                f.counter(
                    "nv_cache_miss_duration_per_model",
                    "Total cache miss (insert+lookup) duration per model, in microseconds",
                    &l,
                    us(&s.cache_miss),
                );
            }
        }
        if let Some(h) = &s.first_response {
            f.add(
                "nv_inference_first_response_histogram_ms",
                "Duration from request to first response in milliseconds",
                MetricType::HISTOGRAM,
                &l,
                |metric| {
                    let mut hist = prometheus::proto::Histogram::default();
                    let mut cumulative = 0;
                    let mut buckets = Vec::new();
                    for (bound, count) in h.bounds.iter().zip(&h.counts) {
                        cumulative += count;
                        let mut b = Bucket::default();
                        b.set_upper_bound(*bound);
                        b.set_cumulative_count(cumulative);
                        buckets.push(b);
                    }
                    hist.set_bucket(buckets);
                    hist.set_sample_count(h.counts.iter().sum());
                    hist.set_sample_sum(h.sum_ms);
                    metric.set_histogram(hist);
                },
            );
        }
        if let Some(r) = &s.recent
            && !self.caches(m)
        {
            let q = &self.settings.quantiles;
            let total = Tally { count: s.success.count, ns: s.success.ns };
            f.summary(
                "nv_inference_request_summary_us",
                "Summary of inference request duration in microseconds (includes cached requests)",
                &l,
                &total,
                &r.request,
                q,
            );
            f.summary(
                "nv_inference_queue_summary_us",
                "Summary of inference queuing duration in microseconds (includes cached requests)",
                &l,
                &s.queue,
                &r.queue,
                q,
            );
            f.summary(
                "nv_inference_compute_input_summary_us",
                "Summary of compute input duration in microseconds (does not include cached requests)",
                &l,
                &s.compute_input,
                &r.compute_input,
                q,
            );
            f.summary(
                "nv_inference_compute_infer_summary_us",
                "Summary of compute inference duration in microseconds (does not include cached requests)",
                &l,
                &s.compute_infer,
                &r.compute_infer,
                q,
            );
            f.summary(
                "nv_inference_compute_output_summary_us",
                "Summary of inference compute output duration in microseconds (does not include cached requests)",
                &l,
                &s.compute_output,
                &r.compute_output,
                q,
            );
        }
        // ferry's autoscaling signal (see the README): work in the server now, and how long
        // requests have recently waited for an instance.
        f.gauge(
            "ferry_inference_load",
            "Requests queued or executing now, per model version: the signal to autoscale on",
            &l,
            (s.pending + s.executing) as f64,
        );
        f.gauge(
            "ferry_queue_duration_recent_us",
            "Average time requests waited for an instance over the last minute, in microseconds",
            &l,
            s.recent_queue_us,
        );
    }

    /// CloudWatch embedded-metric-format lines (one per serving model version) carrying the
    /// autoscaling signal; CloudWatch Logs turns them into metrics of namespace `ferry`.
    pub fn emf_lines(&self, timestamp_ms: u64) -> Vec<String> {
        self.registry
            .serving(None)
            .iter()
            .map(|m| {
                let s = m.stats.snapshot();
                serde_json::json!({
                    "_aws": {
                        "Timestamp": timestamp_ms,
                        "CloudWatchMetrics": [{
                            "Namespace": "ferry",
                            "Dimensions": [["model"]],
                            "Metrics": [
                                {"Name": "InferenceLoad", "Unit": "Count"},
                                {"Name": "QueueDurationRecent", "Unit": "Microseconds"},
                                {"Name": "RequestSuccess", "Unit": "Count"}
                            ]
                        }]
                    },
                    "model": m.name,
                    "version": m.version.to_string(),
                    "InferenceLoad": s.pending + s.executing,
                    "QueueDurationRecent": s.recent_queue_us,
                    "RequestSuccess": s.success.count,
                })
                .to_string()
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metrics_config_settings() {
        let mut s = MetricsSettings::default();
        s.apply("summary_latencies=true").unwrap();
        s.apply("summary_quantiles=0.5:0.05,bad,0.99:0.001").unwrap();
        assert!(s.summary_latencies);
        assert_eq!(s.quantiles, vec![(0.5, 0.05), (0.99, 0.001)]);
        assert!(s.apply("histogram_latencies=maybe").is_err());
        assert!(s.apply("nonsense=1").is_err());
    }

    #[test]
    fn families_encode_as_prometheus_text() {
        let mut f = Families::default();
        let l = vec![("version".to_string(), "1".to_string()), ("model".to_string(), "m".to_string())];
        f.counter("nv_inference_count", "n", &l, 3.0);
        f.gauge("nv_cpu_utilization", "u", &Labels::new(), 0.25);
        f.summary(
            "nv_inference_queue_summary_us",
            "q",
            &l,
            &Tally { count: 2, ns: 3000 },
            &VecDeque::from(vec![1.0, 2.0]),
            &[(0.5, 0.05)],
        );
        let text = f.into_text();
        assert!(
            text.contains("# TYPE nv_inference_count counter\nnv_inference_count{model=\"m\",version=\"1\"} 3\n"),
            "{text}"
        );
        assert!(text.contains("nv_cpu_utilization 0.25"), "{text}");
        assert!(text.contains("nv_inference_queue_summary_us{model=\"m\",version=\"1\",quantile=\"0.5\"} 1"), "{text}");
        assert!(text.contains("nv_inference_queue_summary_us_count{model=\"m\",version=\"1\"} 2"), "{text}");
    }
}
