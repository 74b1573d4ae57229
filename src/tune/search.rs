//! What `ferry tune` tries, and how it picks. A point is one config (instances, intra-op threads,
//! batch sizes, queue delay), measured at every concurrency asked for. The sweep goes in stages,
//! each around the best so far: instance count x threads, then the queue delay, then the batch
//! sizes. Several models are searched one after the other, the others held at their best so far.
use serde::Serialize;

use crate::proto::inference::{
    ModelConfig, ModelDynamicBatching, ModelInstanceGroup, ModelParameter, model_config::SchedulingChoice,
};

/// The config's dynamic batching, if it has some.
fn dynamic_batching(config: &ModelConfig) -> Option<&ModelDynamicBatching> {
    match &config.scheduling_choice {
        Some(SchedulingChoice::DynamicBatching(db)) => Some(db),
        _ => None,
    }
}

use super::drive::Sample;
use crate::config::Percentile;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Point {
    pub instances: usize,
    /// Intra-op threads of each instance.
    pub threads: usize,
    /// 0: the model does not batch.
    pub max_batch_size: usize,
    pub preferred_batch_size: Option<usize>,
    /// None: no dynamic batching (each request runs alone).
    pub queue_delay_us: Option<u64>,
}

impl Point {
    pub fn describe(&self) -> String {
        let mut s = format!("{} inst x {} thr", self.instances, self.threads);
        if self.max_batch_size > 0 {
            s += &format!(", batch <= {}", self.max_batch_size);
        }
        if let Some(p) = self.preferred_batch_size {
            s += &format!(", preferred {p}");
        }
        if let Some(d) = self.queue_delay_us {
            s += &format!(", delay {d} us");
        }
        s
    }
}

/// A measured combination: one point per model (in the order the models were given), its
/// samples at each concurrency for all the models together, and each model's.
#[derive(Debug, Clone)]
pub struct Measured {
    pub points: Vec<Point>,
    /// The configs as they are today.
    pub baseline: bool,
    /// All the models together, one per concurrency: requests/s summed, percentiles over every request.
    pub samples: Vec<Sample>,
    /// `[model][concurrency]`.
    pub per_model: Vec<Vec<Sample>>,
    /// What each model's instances hold (ONNX Runtime sessions, Python processes), bytes.
    pub model_bytes: Vec<u64>,
    /// This process's resident memory after the point, bytes.
    pub resident_bytes: u64,
    pub load_secs: f64,
}

impl Measured {
    pub fn memory_bytes(&self) -> u64 {
        self.model_bytes.iter().sum()
    }

    /// The slowest model's latency at concurrency index `i` (every model must meet the budget).
    pub fn worst_latency(&self, i: usize, p: Percentile) -> f64 {
        self.per_model.iter().filter_map(|m| m.get(i)).map(|s| s.latency(p)).fold(0.0, f64::max)
    }

    /// Every model answered every request at concurrency index `i`.
    pub fn clean(&self, i: usize) -> bool {
        self.per_model.iter().all(|m| m.get(i).is_some_and(Sample::clean))
    }

    /// "2 inst x 1 thr, ..." for one model, "a: ...; b: ..." for several.
    pub fn describe(&self, names: &[String]) -> String {
        if self.points.len() == 1 {
            return self.points[0].describe();
        }
        names.iter().zip(&self.points).map(|(n, p)| format!("{n}: {}", p.describe())).collect::<Vec<_>>().join("; ")
    }
}

/// Instance counts 1, 2, 4, ... up to `max`, with the cores shared between them.
pub fn instance_layouts(max_instances: usize, cores: usize) -> Vec<(usize, usize)> {
    let mut counts = Vec::new();
    let mut n = 1;
    while n < max_instances {
        counts.push(n);
        n *= 2;
    }
    counts.push(max_instances.max(1));
    counts.dedup();
    counts.into_iter().map(|n| (n, (cores / n).max(1))).collect()
}

pub const DELAYS_US: [u64; 3] = [100, 500, 2000];

/// The batch-size variations of stage three around `current` (never above `cap`).
pub fn batch_variations(current: usize, knee: usize, cap: usize) -> Vec<(usize, Option<usize>)> {
    if current == 0 {
        return Vec::new();
    }
    let mut v = vec![((current / 4).max(1), None), ((current * 2).min(cap), None), (current, Some(knee.min(current)))];
    v.sort();
    v.dedup();
    v.retain(|p| *p != (current, None));
    v
}

/// The config that runs `point`: the base config with its instance group, batch sizes, dynamic
/// batching and intra-op threads replaced; everything else (inputs, outputs, parameters, policies)
/// kept as it is.
pub fn config_for(base: &ModelConfig, point: &Point) -> ModelConfig {
    let mut c = base.clone();
    let group = base.instance_group.first().cloned().unwrap_or_default();
    c.instance_group = vec![ModelInstanceGroup {
        name: String::new(),
        count: point.instances as i32,
        kind: group.kind,
        gpus: group.gpus,
        ..Default::default()
    }];
    c.max_batch_size = point.max_batch_size as i32;
    match point.queue_delay_us {
        Some(delay) => {
            let keep = dynamic_batching(base).cloned().unwrap_or_default();
            c.scheduling_choice = Some(SchedulingChoice::DynamicBatching(ModelDynamicBatching {
                preferred_batch_size: point.preferred_batch_size.map(|p| vec![p as i32]).unwrap_or_default(),
                max_queue_delay_microseconds: delay,
                ..keep
            }));
        }
        None if dynamic_batching(base).is_some() => c.scheduling_choice = None,
        None => {}
    }
    c.parameters.insert("intra_op_thread_count".into(), ModelParameter { string_value: point.threads.to_string() });
    c
}

/// The base config as a point (what the model runs today).
pub fn point_of(config: &ModelConfig, cores: usize) -> Point {
    let instances = config.instance_group.iter().map(|g| g.count.max(1) as usize).sum::<usize>().max(1);
    let threads = config
        .parameters
        .get("intra_op_thread_count")
        .and_then(|p| p.string_value.parse().ok())
        .filter(|&n: &usize| n > 0)
        .unwrap_or((cores / instances).max(1));
    let batching = dynamic_batching(config);
    Point {
        instances,
        threads,
        max_batch_size: config.max_batch_size.max(0) as usize,
        preferred_batch_size: batching.and_then(|b| b.preferred_batch_size.first()).map(|&p| p as usize),
        queue_delay_us: batching.map(|b| b.max_queue_delay_microseconds),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layouts_share_the_cores() {
        assert_eq!(instance_layouts(2, 2), vec![(1, 2), (2, 1)]);
        assert_eq!(instance_layouts(6, 8), vec![(1, 8), (2, 4), (4, 2), (6, 1)]);
        assert_eq!(instance_layouts(1, 4), vec![(1, 4)]);
    }

    #[test]
    fn batch_variations_stay_within_the_cap() {
        assert_eq!(batch_variations(16, 8, 32), vec![(4, None), (16, Some(8)), (32, None)]);
        assert_eq!(batch_variations(32, 8, 32), vec![(8, None), (32, Some(8))]);
        assert!(batch_variations(0, 1, 8).is_empty());
    }

    #[test]
    fn config_for_replaces_only_what_is_tuned() {
        let base = crate::proto::pbtxt::parse(
            r#"name: "m" backend: "onnxruntime" max_batch_size: 4
input [ { name: "x" data_type: TYPE_FP32 dims: [ 3 ] } ]
output [ { name: "y" data_type: TYPE_FP32 dims: [ 3 ] } ]
dynamic_batching { default_queue_policy { timeout_action: REJECT default_timeout_microseconds: 1000 } }
parameters { key: "enable_mem_pattern" value: { string_value: "0" } }"#,
        )
        .unwrap();
        let p = Point {
            instances: 2,
            threads: 1,
            max_batch_size: 16,
            preferred_batch_size: Some(8),
            queue_delay_us: Some(500),
        };
        let c = config_for(&base, &p);
        assert_eq!(c.instance_group[0].count, 2);
        assert_eq!(c.max_batch_size, 16);
        let db = dynamic_batching(&c).unwrap();
        assert_eq!((db.preferred_batch_size.clone(), db.max_queue_delay_microseconds), (vec![8], 500));
        assert!(db.default_queue_policy.is_some(), "the queue policy is kept");
        assert_eq!(c.parameters["intra_op_thread_count"].string_value, "1");
        assert_eq!(c.parameters["enable_mem_pattern"].string_value, "0");
        assert_eq!(c.input, base.input);
        assert_eq!(point_of(&c, 2), p);
    }
}
