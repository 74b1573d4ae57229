//! One model `ferry tune` measures: loaded as it is, checked (request/response, not an ensemble
//! or a sequence model), its request built, and what the sweep may vary worked out.
use std::{net::SocketAddr, path::PathBuf, time::Duration};

use crate::{
    backend::Device,
    config::TuneSettings,
    proto::inference::{ModelConfig, model_config::SchedulingChoice, model_instance_group::Kind},
    repository::control::LoadRequest,
    request::InferRequest,
    server::Core,
};

use super::{ceiling, drive::Http, request, search};

pub struct Subject {
    pub name: String,
    /// Its share of the traffic.
    pub weight: f64,
    pub base: ModelConfig,
    pub current: search::Point,
    pub batchable: bool,
    pub device: Device,
    /// Instance counts x threads to try.
    pub layouts: Vec<(usize, usize)>,
    pub request: InferRequest,
    pub http: Http,
    /// The model file, when it is in a local folder (the ceiling loads it directly).
    pub file: Option<PathBuf>,
}

impl Subject {
    pub async fn prepare(
        core: &Core,
        name: &str,
        weight: f64,
        settings: &TuneSettings,
        addr: SocketAddr,
    ) -> Result<Subject, String> {
        core.repository.load(name, LoadRequest::default()).await.map_err(|e| format!("model '{name}': {e}"))?;
        let model = core.registry.resolve(name, None).map_err(|e| e.to_string())?;
        let base = (*model.config).clone();
        if model.ensemble().is_some() || matches!(base.scheduling_choice, Some(SchedulingChoice::SequenceBatching(_))) {
            return Err(format!(
                "model '{name}' is an ensemble or a sequence model: tune the models it is made of instead"
            ));
        }
        if base.model_transaction_policy.as_ref().is_some_and(|p| p.decoupled) {
            return Err(format!("model '{name}' is decoupled: ferry tune measures request/response models"));
        }
        let (request, notes) = request::build(name, &model.schema, &settings.shapes, settings.input_data.as_ref())
            .map_err(|e| if settings.models.len() > 1 { format!("model '{name}': {e}") } else { e })?;
        for note in &notes {
            eprintln!("ferry tune: {note}");
        }
        let outputs: Vec<String> = base.output.iter().map(|o| o.name.clone()).collect();
        let http = Http::new(addr, &request, &outputs)?;
        // A GPU model is measured on its first GPU, with up to 4 instances there (each its own stream).
        let device = match base.instance_group.first() {
            Some(g) if g.kind == Kind::Gpu as i32 => Device::Gpu(g.gpus.first().copied().unwrap_or(0)),
            _ => Device::Cpu,
        };
        let most = if device == Device::Cpu { settings.max_instances } else { settings.max_instances.min(4) };
        let file = core
            .roots
            .first()
            .map(|r| PathBuf::from(r).join(name).join(model.version.to_string()).join(&base.default_model_filename))
            .filter(|p| p.is_file());
        Ok(Subject {
            name: name.to_string(),
            weight,
            current: search::point_of(&base, settings.cores),
            batchable: base.max_batch_size > 0,
            device,
            layouts: search::instance_layouts(most.clamp(1, 64), settings.cores),
            request,
            http,
            file,
            base,
        })
    }

    /// Points the sweep plans for this model: its layouts, then three delays and three batch sizes.
    pub fn planned(&self) -> usize {
        self.layouts.len() + if self.batchable { search::DELAYS_US.len() + 3 } else { 0 }
    }

    /// Whether the in-process ceiling applies (a batching ONNX model).
    pub fn has_ceiling(&self) -> bool {
        self.batchable && self.base.backend == "onnxruntime"
    }

    /// The backend alone at each batch size, on a blocking thread, within `share`.
    pub async fn ceiling(&self, core: &Core, share: Duration, cores: usize) -> Vec<ceiling::BatchPoint> {
        let name = &self.name;
        let Some(path) = self.file.clone() else {
            eprintln!("ferry tune: '{name}': in-process ceiling skipped: the model file is not in a local folder");
            return Vec::new();
        };
        let backend = match core.backends.get(&self.base.backend) {
            Ok(b) => b,
            Err(e) => {
                eprintln!("ferry tune: '{name}': in-process ceiling skipped: {e}");
                return Vec::new();
            }
        };
        let batches = vec![1usize, 2, 4, 8, 16, 32, 64];
        let slice = share / batches.len() as u32;
        let (cfg, req, device) = (self.base.clone(), self.request.clone(), self.device);
        let run = tokio::task::spawn_blocking(move || {
            ceiling::measure(&*backend, device, &path, &cfg, &req, &batches, cores, slice)
        })
        .await;
        match run {
            Ok(Ok(points)) => points,
            Ok(Err(e)) => {
                eprintln!("ferry tune: '{name}': in-process ceiling skipped: {e}");
                Vec::new()
            }
            Err(e) => {
                eprintln!("ferry tune: '{name}': in-process ceiling skipped: {e}");
                Vec::new()
            }
        }
    }

    /// The batch size the layouts are measured at: twice the ceiling's knee (at least what the
    /// config has), capped.
    pub fn first_batch(&self, knee: Option<usize>) -> usize {
        if !self.batchable {
            return 0;
        }
        let from_knee = knee.unwrap_or(32).max(1) * 2;
        self.current.max_batch_size.max(from_knee).min(self.batch_cap())
    }

    pub fn batch_cap(&self) -> usize {
        128usize.max(self.current.max_batch_size)
    }
}
