//! Loads a model folder into serving versions: the config pipeline, the versions its policy
//! selects, instances on the backend, then one atomic install into the registry. The versions it
//! replaces finish the requests they admitted, then stop.
use std::{
    collections::BTreeMap,
    path::{Path, PathBuf},
    sync::Arc,
};

use super::{config, registry::Registry, select_versions, version_dirs, warmup::Samples};
use crate::{
    backend::{Backend, Backends, Device, InstanceSpec, ModelInstance},
    ensemble::Ensemble,
    error::{Error, Result},
    model::{ModelVersion, Runner},
    proto::inference::{ModelConfig, model_config::SchedulingChoice},
    scheduler::{BatchPolicy, ModelContext, Policy, QueuePolicy, Scheduler, sequence},
    schema::Schema,
    stats::Stats,
};

#[derive(Debug, Clone)]
pub struct LoadOptions {
    pub auto_complete: bool,
    /// max_batch_size given to batchable models whose config leaves it out.
    pub default_max_batch_size: i32,
    /// `--adaptive-queue-delay`, for dynamically batched models.
    pub adaptive_queue_delay: bool,
    /// Cores shared by a model's instances.
    pub cores: usize,
    /// Keep recent durations per version (for latency summaries).
    pub recent_stats: bool,
    /// Keep a request-duration histogram per version, with these bucket bounds (ms).
    pub histogram: Option<Vec<f64>>,
    /// Digest the content of versions the response cache serves (the server has a cache).
    pub content_digests: bool,
    /// `--rate-limit=execution_count`: the server's rate limiter (None: off).
    pub rate_limiter: Option<Arc<crate::scheduler::rate_limit::RateLimiter>>,
}

pub struct Loader {
    backends: Backends,
    registry: Arc<Registry>,
    options: LoadOptions,
}

/// What the config pipeline hands to version loading.
struct Prepared {
    config: Arc<ModelConfig>,
    /// None: an ensemble (its steps run on other models).
    backend: Option<Arc<dyn Backend>>,
    versions: Vec<u64>,
    labels: Vec<Vec<String>>,
}

impl Loader {
    pub fn new(backends: Backends, registry: Arc<Registry>, options: LoadOptions) -> Self {
        Loader { backends, registry, options }
    }

    pub fn registry(&self) -> &Arc<Registry> {
        &self.registry
    }

    /// Loads or reloads the model in `dir` under its registry key (its name, or with namespacing
    /// its qualified name). `config_override` replaces config.pbtxt (load API).
    pub async fn load(&self, key: &str, dir: &Path, config_override: Option<ModelConfig>) -> Result<()> {
        self.load_as(key, dir, config_override, false).await
    }

    /// `load`, and with `rename` the model serves as its key's name whatever its folder and
    /// config say (SageMaker's multi-model API names models itself).
    pub async fn load_as(
        &self,
        key: &str,
        dir: &Path,
        config_override: Option<ModelConfig>,
        rename: bool,
    ) -> Result<()> {
        let started = std::time::Instant::now();
        let name = self.registry.name_of(key);
        let prepared = {
            let (name, dir, backends, options) =
                (name.to_string(), dir.to_path_buf(), self.backends.clone(), self.options.clone());
            tokio::task::spawn_blocking(move || prepare(&name, &dir, &backends, &options, config_override, rename))
                .await
                .map_err(|e| Error::internal(format!("model load task failed: {e}")))?
        };
        let prepared = match prepared {
            Ok(p) => p,
            Err(reason) => {
                tracing::error!(model = name, error = %reason, "model failed to load");
                let reason = shown(&reason, dir, name);
                self.registry.fail_model(key, &reason);
                return Err(Error::invalid(format!("failed to load '{name}': {reason}")));
            }
        };
        self.registry.mark_loading(key, &prepared.versions);
        let prepared = Arc::new(prepared);
        let mut tasks = Vec::new();
        for &version in &prepared.versions {
            let (prepared, dir, options, key, registry) = (
                Arc::clone(&prepared),
                dir.to_path_buf(),
                self.options.clone(),
                key.to_string(),
                Arc::clone(&self.registry),
            );
            tasks.push((
                version,
                tokio::task::spawn_blocking(move || load_version(&key, &prepared, &dir, version, &registry, &options)),
            ));
        }
        let mut outcomes = BTreeMap::new();
        let mut failures = Vec::new();
        for (version, task) in tasks {
            let mut outcome = task.await.unwrap_or_else(|e| Err(format!("version load task failed: {e}")));
            match &mut outcome {
                Ok(_) => tracing::info!(model = name, version, "model version ready"),
                Err(reason) => {
                    tracing::error!(model = name, version, error = %reason, "model version failed to load");
                    *reason = shown(reason, dir, name);
                    failures.push(format!("version {version}: {reason}"));
                }
            }
            outcomes.insert(version, outcome.map(Arc::new));
        }
        for old in self.registry.install(key, outcomes) {
            tracing::info!(model = name, version = old.version, "retiring replaced model version");
            old.retire();
        }
        tracing::debug!(model = name, seconds = started.elapsed().as_secs_f64(), "load finished");
        if failures.is_empty() {
            Ok(())
        } else {
            Err(Error::invalid(format!("failed to load '{name}': {}", failures.join("; "))))
        }
    }

    /// Takes a model (by registry key) out of service; its versions finish what they admitted.
    pub fn unload(&self, key: &str) {
        for old in self.registry.unload(key) {
            tracing::info!(model = key, version = old.version, "unloading model version");
            old.retire();
        }
    }
}

/// A load failure as clients see it (the load API, the repository index): the server's local
/// folders (the model cache, staging) named by the model's own folder name; the log has it whole.
fn shown(reason: &str, dir: &Path, name: &str) -> String {
    let local = dir.display().to_string();
    if local.is_empty() { reason.to_string() } else { reason.replace(&local, name) }
}

fn prepare(
    name: &str,
    dir: &Path,
    backends: &Backends,
    options: &LoadOptions,
    config_override: Option<ModelConfig>,
    rename: bool,
) -> std::result::Result<Prepared, String> {
    let mut cfg = match config_override {
        Some(cfg) => cfg,
        None => config::read(dir, options.auto_complete)?,
    };
    if rename {
        cfg.name = name.to_string();
    }
    config::fill_with(&mut cfg, dir, name, &|b| backends.get(b).is_ok())?;
    let available = version_dirs(dir);
    let versions = select_versions(cfg.version_policy.as_ref(), &available);
    let Some(&newest) = versions.last() else {
        return Err(format!(
            "no version folder of '{}' is selected by its version policy (found: {available:?})",
            dir.display()
        ));
    };
    let backend = if cfg.platform == "ensemble" {
        None
    } else {
        let backend = backends.get(&cfg.backend).map_err(|e| e.to_string())?;
        if options.auto_complete {
            backend.auto_complete(&model_path(dir, newest, &cfg), &mut cfg).map_err(|e| e.to_string())?;
        }
        if options.auto_complete && (cfg.input.is_empty() || cfg.output.is_empty()) {
            let io = backend.model_io(&model_path(dir, newest, &cfg)).map_err(|e| e.to_string())?;
            if !io.inputs.is_empty() || !io.outputs.is_empty() {
                config::complete(&mut cfg, &io, options.default_max_batch_size)?;
            }
        }
        Some(backend)
    };
    config::normalize(&mut cfg);
    config::validate(&cfg)?;
    for warning in super::agents::run(&cfg, dir)? {
        tracing::warn!(model = name, "{warning}");
    }
    let labels =
        cfg.output.iter().map(|o| read_labels(dir, &o.label_filename)).collect::<std::result::Result<_, _>>()?;
    Ok(Prepared { config: Arc::new(cfg), backend, versions, labels })
}

fn model_path(dir: &Path, version: u64, cfg: &ModelConfig) -> PathBuf {
    dir.join(version.to_string()).join(&cfg.default_model_filename)
}

/// The largest label file read (a million classes of 64 characters).
const MAX_LABEL_BYTES: u64 = 64 << 20;

/// Label lines of an output's `label_filename`, which must stay inside the model folder.
fn read_labels(dir: &Path, file: &str) -> std::result::Result<Vec<String>, String> {
    if file.is_empty() {
        return Ok(Vec::new());
    }
    let data = crate::names::read_inside(dir, file, MAX_LABEL_BYTES).map_err(|e| format!("label_filename {e}"))?;
    let text = String::from_utf8(data).map_err(|_| format!("label_filename '{file}' is not UTF-8 text"))?;
    Ok(text.lines().map(str::to_string).collect())
}

fn load_version(
    key: &str,
    p: &Prepared,
    dir: &Path,
    version: u64,
    registry: &Registry,
    options: &LoadOptions,
) -> std::result::Result<ModelVersion, String> {
    let Some(backend) = &p.backend else {
        return load_ensemble(key, p, dir, version, registry, options);
    };
    let name = registry.name_of(key);
    let cores = options.cores;
    let path = model_path(dir, version, &p.config);
    if backend.name() == "onnxruntime" && !path.exists() {
        return Err(format!("model file '{}' does not exist", path.display()));
    }
    let outputs: Vec<&str> = p.config.output.iter().map(|o| o.name.as_str()).collect();
    let devices = devices(&p.config);
    let gpus: Vec<i32> = devices.iter().filter_map(|d| if let Device::Gpu(g) = d { Some(*g) } else { None }).collect();
    crate::gpu::visible().check(&gpus)?;
    let threads = (cores / devices.len().max(1)).max(1);
    let mut instances: Vec<Box<dyn ModelInstance>> = Vec::with_capacity(devices.len());
    let mut scalars = config::Scalars::default();
    let mut warmup: Option<Samples> = None;
    // A sequence model also takes its implicit states and control inputs.
    let facing = sequence::model_facing(&p.config);
    for (index, &device) in devices.iter().enumerate() {
        let mut instance =
            load_instance(&**backend, &path, &p.config, (device, index), threads).map_err(|e| e.to_string())?;
        if instances.is_empty()
            && let Some(io) = instance.model_io()
        {
            scalars = config::check_against_model(&facing, &io)?;
        }
        let samples = match &mut warmup {
            Some(w) => w,
            None => warmup.insert(Samples::build(&p.config, dir, &scalars.inputs)?),
        };
        samples.run(instance.as_mut(), &outputs)?;
        instances.push(instance);
    }
    let schema = Schema::from_config(&p.config, p.labels.clone()).map_err(|e| e.to_string())?;
    let schema = Arc::new(schema.with_scalars(&scalars.inputs, &scalars.outputs));
    let internal = Schema::from_config(&facing, p.labels.clone()).map_err(|e| e.to_string())?;
    let internal = Arc::new(internal.with_scalars(&scalars.inputs, &scalars.outputs));
    let read = |rel: &str, max: u64| crate::names::read_inside(dir, rel, max);
    let plan = sequence::plan(&p.config, &internal, schema.outputs.len(), devices.len(), &read)?;
    let stats = Arc::new(Stats::new(options.recent_stats, options.histogram.clone()));
    stats.set_memory(crate::stats::sum_memory(instances.iter().flat_map(|i| i.memory())));
    let sequence_batcher = sequence::batching(&p.config);
    let dynamic = match &p.config.scheduling_choice {
        Some(SchedulingChoice::DynamicBatching(db)) => Some(db),
        _ => sequence_batcher.as_ref(),
    };
    let policy = Policy {
        // Sequence batchers keep their delays: a sequence's requests are its own company.
        batching: BatchPolicy::new(schema.max_batch_size, dynamic).adaptive(
            options.adaptive_queue_delay
                && matches!(p.config.scheduling_choice, Some(SchedulingChoice::DynamicBatching(_))),
        ),
        queue: QueuePolicy::new(dynamic),
        preserve_ordering: dynamic.is_some_and(|d| d.preserve_ordering),
    };
    let ctx =
        ModelContext { name: name.to_string(), version, schema: Arc::clone(&internal), stats: Arc::clone(&stats) };
    let rebuild: crate::scheduler::Rebuild = {
        let (backend, path, config, devices) = (Arc::clone(backend), path.clone(), Arc::clone(&p.config), devices);
        Arc::new(move |i: usize| {
            let device = devices.get(i).copied().unwrap_or(Device::Cpu);
            load_instance(&*backend, &path, &config, (device, i), threads)
        })
    };
    let device_io = instances.iter().all(|i| i.device_io().is_some());
    let limits = rate_limits(name, &p.config, options.rate_limiter.as_ref())?;
    let scheduler = Scheduler::start(ctx, policy, instances, Some(rebuild), limits).map_err(|e| e.to_string())?;
    let content = cache_content(p, dir, version, options)?;
    Ok(ModelVersion {
        name: name.to_string(),
        namespace: registry.namespace_of(key),
        version,
        config: Arc::clone(&p.config),
        schema,
        runner: Runner::Scheduler(scheduler),
        sequences: plan.map(sequence::Sequences::new),
        stats,
        device_io,
        chat_template: super::chat_template::find(name, dir, version).map(Arc::new),
        content,
    })
}

/// An ensemble version: its steps checked against the composing models loaded now.
fn load_ensemble(
    key: &str,
    p: &Prepared,
    dir: &Path,
    version: u64,
    registry: &Registry,
    options: &LoadOptions,
) -> std::result::Result<ModelVersion, String> {
    let schema = Arc::new(Schema::from_config(&p.config, p.labels.clone()).map_err(|e| e.to_string())?);
    let ensemble = Ensemble::plan_in(&p.config, &schema, registry, registry.root_of(key))?;
    crate::ensemble::graph::check(&ensemble, &registry.ensembles())?;
    let content = cache_content(p, dir, version, options)?;
    Ok(ModelVersion {
        name: registry.name_of(key).to_string(),
        namespace: registry.namespace_of(key),
        version,
        config: Arc::clone(&p.config),
        schema,
        runner: Runner::Ensemble(Arc::new(ensemble)),
        sequences: None,
        stats: Arc::new(Stats::new(options.recent_stats, options.histogram.clone())),
        device_io: false,
        chat_template: super::chat_template::find(registry.name_of(key), dir, version).map(Arc::new),
        content,
    })
}

/// The version's content digest when the response cache serves it (empty otherwise).
fn cache_content(p: &Prepared, dir: &Path, version: u64, options: &LoadOptions) -> std::result::Result<String, String> {
    let caches = options.content_digests && p.config.response_cache.as_ref().is_some_and(|c| c.enable);
    if !caches {
        return Ok(String::new());
    }
    content_digest(&p.config, &p.labels, &dir.join(version.to_string()))
}

fn load_instance(
    backend: &dyn Backend,
    path: &Path,
    config: &ModelConfig,
    (device, index): (Device, usize),
    threads: usize,
) -> Result<Box<dyn ModelInstance>> {
    backend.load(&InstanceSpec { model_path: path, config, device, intra_op_threads: threads, index })
}

/// As Triton: a KIND_GPU group puts `count` instances on each GPU it lists (GPU 0 when it lists
/// none); every other kind runs on the CPU.
/// What each instance (in `devices` order) needs of the rate limiter, when it is on: its group's
/// `rate_limiter` resources (a per-device one on the instance's GPU, device 0 for the CPU) and
/// priority; an instance of a group without one takes its turn at priority 1.
fn rate_limits(
    name: &str,
    config: &ModelConfig,
    limiter: Option<&Arc<crate::scheduler::rate_limit::RateLimiter>>,
) -> std::result::Result<crate::scheduler::Limits, String> {
    use crate::scheduler::rate_limit::Need;
    let Some(limiter) = limiter else { return Ok(Vec::new()) };
    let mut limits = Vec::new();
    for group in &config.instance_group {
        for device in group_devices(group) {
            let on = match device {
                Device::Gpu(g) => g,
                _ => 0,
            };
            let rl = group.rate_limiter.clone().unwrap_or_default();
            let resources = rl
                .resources
                .iter()
                .map(|r| ((r.name.clone(), (!r.global).then_some(on)), u64::from(r.count)))
                .collect();
            let need = Need { resources, priority: u64::from(rl.priority.max(1)) };
            limiter.register(name, &need)?;
            limits.push(Some((Arc::clone(limiter), need)));
        }
    }
    Ok(limits)
}

fn devices(config: &ModelConfig) -> Vec<Device> {
    config.instance_group.iter().flat_map(group_devices).collect()
}

/// The device of each instance of one group, in load order.
fn group_devices(group: &crate::proto::inference::ModelInstanceGroup) -> Vec<Device> {
    let devices = if group.kind == crate::proto::inference::model_instance_group::Kind::Gpu as i32 {
        let gpus = if group.gpus.is_empty() { vec![0] } else { group.gpus.clone() };
        gpus.into_iter().map(Device::Gpu).collect()
    } else {
        vec![Device::Cpu]
    };
    devices.into_iter().flat_map(|d| std::iter::repeat_n(d, group.count.max(0) as usize)).collect()
}

/// SHA-256 over the effective config, the label files, and every file of the version folder
/// (relative path, size, content): what the version's outputs depend on. Symbolic links to
/// folders are not followed, so a cycle cannot hang the load.
fn content_digest(config: &ModelConfig, labels: &[Vec<String>], version_dir: &Path) -> Result<String, String> {
    use sha2::{Digest, Sha256};
    fn walk(base: &Path, dir: &Path, depth: usize, out: &mut Vec<PathBuf>) -> Result<(), String> {
        if depth > 32 {
            return Err(format!("'{}' is nested more than 32 folders deep", dir.display()));
        }
        let entries = std::fs::read_dir(dir).map_err(|e| format!("cannot list '{}': {e}", dir.display()))?;
        for e in entries.flatten() {
            let kind = e.file_type().map_err(|e| e.to_string())?;
            if kind.is_dir() {
                walk(base, &e.path(), depth + 1, out)?;
            } else if e.path().is_file() {
                out.push(e.path().strip_prefix(base).map_err(|e| e.to_string())?.to_path_buf());
            }
        }
        Ok(())
    }
    let mut h = Sha256::new();
    h.update(prost::Message::encode_to_vec(config));
    for l in labels {
        h.update(l.join("\n").as_bytes());
        h.update([0]);
    }
    let mut files = Vec::new();
    walk(version_dir, version_dir, 0, &mut files)?;
    files.sort();
    for rel in files {
        let sum = crate::repository::storage::sha256_file(&version_dir.join(&rel))?;
        h.update(rel.to_string_lossy().as_bytes());
        h.update([0]);
        h.update(sum.as_bytes());
    }
    Ok(h.finalize().iter().map(|b| format!("{b:02x}")).collect())
}
