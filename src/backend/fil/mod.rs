//! Tree models as Triton's FIL backend takes them (`backend: "fil"`): XGBoost (JSON, UBJSON) and
//! LightGBM (text) forests, checked by ferry (`check`), then loaded by the framework's own
//! predictor through its C API, loaded at run time like ONNX Runtime (`backend::library`). A common
//! XGBoost forest is then walked by ferry itself (`native`) once its answers on probe rows equal
//! XGBoost's, else XGBoost runs it; Treelite checkpoints, read and evaluated by ferry as Treelite's
//! reference predictor does (`treelite`). One input `input__0` (FP32, `[batch, features]`), one output
//! `output__0`: class scores, class probabilities (`predict_proba`), or class ids
//! (`output_class`, with `threshold` for binary models), as FIL gives them.
use std::{
    path::{Path, PathBuf},
    sync::{Arc, OnceLock},
};

use bytes::Bytes;

use super::{Backend, BackendInput, Device, InstanceSpec, ModelInstance, ModelIo, TensorInfo, library};
use crate::{
    backend::fil_model_type::ModelType,
    error::{Error, Result},
    proto::inference::{ModelConfig, ModelInput, ModelOutput},
    tensor::{DataType, Tensor},
};

mod check;
mod lightgbm;
mod native;
mod output;
mod treelite;
mod ubjson;
mod xgboost;

use output::Output;

pub const INPUT: &str = "input__0";
pub const OUTPUT: &str = "output__0";
/// Bounds on what a model file may declare (it sizes the buffers of every prediction).
const MAX_FEATURES: usize = 1 << 20;
const MAX_CLASSES: usize = 1 << 14;
/// Most values one batch's output may hold (64 MiB of FP32): rows × classes is the client's to
/// choose, the classes the model's.
const MAX_OUTPUT_VALUES: usize = 1 << 24;

/// A loaded forest: dense FP32 rows in, `width()` values per row out.
trait Forest: Send {
    fn features(&self) -> usize;
    /// Values per row that `predict` writes (1 for regression and binary models).
    fn width(&self) -> usize;
    /// Whether the values are class ids already (XGBoost's `multi:softmax`).
    fn gives_classes(&self) -> bool;
    /// Whether the values are class probabilities (a classifier's objective).
    fn gives_probabilities(&self) -> bool;
    /// Outputs the model predicts, each of `width() / targets()` values (a multi-target model).
    fn targets(&self) -> usize {
        1
    }
    fn predict(&mut self, data: &[f32], rows: usize, out: &mut Vec<f32>) -> std::result::Result<(), String>;
}

/// FIL's parameters that choose how its own engine runs (on the GPU mostly): ferry runs the
/// framework's predictor, so they are taken and have no effect.
const NO_EFFECT: &[&str] = &[
    "algo",
    "storage_type",
    "threads_per_tree",
    "blocks_per_sm",
    "transfer_threshold",
    "use_experimental_optimizations",
    "layout",
    "chunk_size",
    "xgboost_allow_unknown_field",
];

/// The backend; each framework's library is found and loaded once, at the first model needing it.
pub struct FilBackend {
    xgboost_library: Option<PathBuf>,
    lightgbm_library: Option<PathBuf>,
    xgboost: library::Loaded<xgboost::Api>,
    lightgbm: library::Loaded<lightgbm::Api>,
}

impl FilBackend {
    /// The configured library paths (None: found by `library::locate`).
    pub fn new(xgboost_library: Option<PathBuf>, lightgbm_library: Option<PathBuf>) -> Self {
        FilBackend { xgboost_library, lightgbm_library, xgboost: OnceLock::new(), lightgbm: OnceLock::new() }
    }

    fn xgboost(&self) -> Result<Arc<xgboost::Api>> {
        library::load_once(&self.xgboost, &library::XGBOOST, self.xgboost_library.as_deref(), xgboost::Api::load)
            .map_err(Error::unavailable)
    }

    fn lightgbm(&self) -> Result<Arc<lightgbm::Api>> {
        library::load_once(&self.lightgbm, &library::LIGHTGBM, self.lightgbm_library.as_deref(), lightgbm::Api::load)
            .map_err(Error::unavailable)
    }

    fn forest(&self, path: &Path, config: &ModelConfig, device: Device, threads: usize) -> Result<Box<dyn Forest>> {
        let named = |e: String| Error::invalid(format!("model '{}': {e}", config.name));
        let model_type = ModelType::of(config).map_err(Error::invalid)?;
        match model_type {
            ModelType::Xgboost | ModelType::XgboostJson | ModelType::XgboostUbj => {
                let gpu = match device {
                    Device::Gpu(g) => Some(g),
                    Device::Cpu => None,
                };
                let ubj = model_type != ModelType::XgboostJson;
                let bytes = check::read(path).map_err(named)?;
                let mut info = check::xgboost(&bytes, ubj).map_err(named)?;
                let booster =
                    xgboost::Booster::load(self.xgboost()?, &bytes, path, &info, threads, gpu).map_err(named)?;
                // On the CPU, ferry's own walk of a common forest, once it agrees with XGBoost.
                let native = info.native.take().filter(|_| gpu.is_none()).map(|n| n.with_threads(threads));
                own_walk(native, booster, "XGBoost", &config.name).map_err(named)
            }
            ModelType::Lightgbm => {
                if let Device::Gpu(_) = device {
                    return Err(Error::unsupported(format!(
                        "model '{}': LightGBM models run on the CPU in ferry; use instance_group kind KIND_CPU",
                        config.name
                    )));
                }
                let info = check::lightgbm(check::read(path).map_err(named)?).map_err(named)?;
                Ok(Box::new(lightgbm::Booster::load(self.lightgbm()?, &info, path, threads).map_err(named)?))
            }
            ModelType::TreeliteCheckpoint => {
                if let Device::Gpu(_) = device {
                    return Err(Error::unsupported(format!(
                        "model '{}': treelite_checkpoint models run on the CPU in ferry; use instance_group kind KIND_CPU",
                        config.name
                    )));
                }
                Ok(Box::new(treelite::read(&check::read(path).map_err(named)?).map_err(named)?))
            }
        }
    }
}

/// ferry's own walk of a forest (`native`) in place of the framework's predictor, once the two
/// agree on probe rows made from the forest's splits; else the framework's.
fn own_walk<F: Forest + 'static>(
    native: Option<native::NativeForest>,
    mut framework: F,
    name: &str,
    model: &str,
) -> std::result::Result<Box<dyn Forest>, String> {
    let Some(mut native) = native else { return Ok(Box::new(framework)) };
    // 64 rows, fewer for a very wide model (the probe's values stay within 16 MiB).
    let rows = ((4usize << 20) / native.features().max(1)).clamp(4, 64);
    let data = native::probe_rows(&native, rows);
    let (mut ours, mut theirs) = (Vec::new(), Vec::new());
    native.predict(&data, rows, &mut ours)?;
    framework.predict(&data, rows, &mut theirs)?;
    if native.width() == framework.width() && native::agrees(&ours, &theirs) {
        tracing::info!(model, "the forest is evaluated by ferry (it agrees with {name} on probe rows)");
        return Ok(Box::new(native));
    }
    tracing::warn!(model, "ferry's evaluation of this forest differs from {name}'s; {name} runs it");
    Ok(Box::new(framework))
}

/// The model's input and output as the config should declare them.
fn io_of(forest: &dyn Forest, output: Output) -> ModelIo {
    let tensor = |name: &str, width: usize| TensorInfo {
        name: name.into(),
        datatype: Some(DataType::Fp32),
        shape: vec![-1, i64::try_from(width).unwrap_or(i64::MAX)],
    };
    ModelIo {
        inputs: vec![tensor(INPUT, forest.features())],
        outputs: vec![tensor(OUTPUT, output.width(forest.width()))],
    }
}

impl Backend for FilBackend {
    fn name(&self) -> &'static str {
        "fil"
    }

    fn model_io(&self, _model_path: &Path) -> Result<ModelIo> {
        Ok(ModelIo::default())
    }

    /// Declares `input__0` and `output__0` from the model when the config leaves them out.
    fn auto_complete(&self, model_path: &Path, config: &mut ModelConfig) -> Result<()> {
        if !config.input.is_empty() && !config.output.is_empty() {
            return Ok(());
        }
        let forest = self.forest(model_path, config, Device::Cpu, 1)?;
        let output = Output::of(config, forest.as_ref()).map_err(Error::invalid)?;
        let io = io_of(forest.as_ref(), output);
        let dims = |t: &TensorInfo| if config.max_batch_size > 0 { t.shape[1..].to_vec() } else { t.shape.clone() };
        if config.input.is_empty() {
            let dims = dims(&io.inputs[0]);
            config.input.push(ModelInput {
                name: INPUT.into(),
                data_type: DataType::Fp32.config(),
                dims,
                ..Default::default()
            });
        }
        if config.output.is_empty() {
            let dims = dims(&io.outputs[0]);
            config.output.push(ModelOutput {
                name: OUTPUT.into(),
                data_type: DataType::Fp32.config(),
                dims,
                ..Default::default()
            });
        }
        Ok(())
    }

    fn load(&self, spec: &InstanceSpec<'_>) -> Result<Box<dyn ModelInstance>> {
        let config = spec.config;
        let ignored: Vec<&str> = NO_EFFECT.iter().copied().filter(|k| config.parameters.contains_key(*k)).collect();
        if !ignored.is_empty() && spec.index == 0 {
            tracing::warn!(
                model = %config.name,
                "FIL parameters {} tune FIL's own engine; ferry runs the framework's predictor, so they have no effect",
                ignored.join(", ")
            );
        }
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        let threads = match config.parameters.get("cpu_nthread").map(|p| p.string_value.trim()) {
            // One thread by default: a forest's work per row is small, and an OpenMP team's wake-up
            // costs more than it saves on the batches a server forms (bench/RESULTS.md); add
            // instances for concurrency, or set cpu_nthread for large batches.
            None | Some("") => 1,
            Some("-1") => spec.intra_op_threads,
            Some(v) => v.parse::<usize>().ok().filter(|&n| (1..=super::MAX_THREADS).contains(&n)).ok_or_else(|| {
                Error::invalid(format!(
                    "model '{}': parameter cpu_nthread is '{v}'; expected 1 to {} (or -1: the instance's share of the cores)",
                    config.name,
                    super::MAX_THREADS
                ))
            })?,
        };
        // More threads than cores only costs (and a framework's OpenMP may exit the process when
        // it cannot make them).
        if threads > cores && spec.index == 0 {
            tracing::warn!(model = %config.name, cpu_nthread = threads, cores, "cpu_nthread is more than the machine's cores; using {cores}");
        }
        let threads = threads.min(cores);
        if let Some(o) = config.output.iter().find(|o| o.name != OUTPUT) {
            return Err(Error::unsupported(format!(
                "model '{}': output '{}' is not served; ferry's FIL backend gives one output, {OUTPUT} (no treeshap_output)",
                config.name, o.name
            )));
        }
        let forest = self.forest(spec.model_path, config, spec.device, threads)?;
        let output = Output::of(config, forest.as_ref()).map_err(Error::invalid)?;
        Ok(Box::new(FilInstance {
            io: io_of(forest.as_ref(), output),
            forest,
            output,
            on_host: spec.device == Device::Cpu,
            rows: Vec::new(),
            scores: Vec::new(),
        }))
    }
}

struct FilInstance {
    forest: Box<dyn Forest>,
    output: Output,
    io: ModelIo,
    on_host: bool,
    /// The batch's rows, when its bytes are not aligned for f32.
    rows: Vec<f32>,
    scores: Vec<f32>,
}

impl ModelInstance for FilInstance {
    fn model_io(&self) -> Option<ModelIo> {
        Some(self.io.clone())
    }

    fn runs_anywhere(&self) -> bool {
        self.on_host
    }

    fn execute(&mut self, inputs: &[BackendInput<'_>], outputs: &[&str]) -> Result<Vec<Tensor>> {
        let input = inputs
            .iter()
            .find(|i| i.name == INPUT)
            .ok_or_else(|| Error::invalid(format!("FIL model: missing input '{INPUT}'")))?;
        if input.datatype != DataType::Fp32 {
            return Err(Error::invalid(format!(
                "FIL model: input '{INPUT}' must be FP32, got {}",
                input.datatype.wire()
            )));
        }
        let features = self.forest.features();
        let given = input.shape.last().copied().unwrap_or(0);
        if usize::try_from(given).ok() != Some(features) || input.data.len() % (4 * features.max(1)) != 0 {
            return Err(Error::invalid(format!(
                "FIL model: input '{INPUT}' has rows of {given} features; the model takes {features}"
            )));
        }
        let rows = input.data.len() / (4 * features.max(1));
        let width = self.output.width(self.forest.width());
        if rows.saturating_mul(self.forest.width().max(width)) > MAX_OUTPUT_VALUES {
            return Err(Error::invalid(format!(
                "FIL model: a batch of {rows} rows would give {} output values; ferry answers up to {MAX_OUTPUT_VALUES} per batch (send fewer rows)",
                rows.saturating_mul(self.forest.width().max(width))
            )));
        }
        let data: &[f32] = match bytemuck::try_cast_slice(input.data) {
            Ok(d) => d,
            Err(_) => {
                self.rows.clear();
                self.rows.extend(input.data.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])));
                &self.rows
            }
        };
        if rows == 0 {
            self.scores.clear();
        } else {
            self.forest.predict(data, rows, &mut self.scores).map_err(Error::internal)?;
            if self.scores.len() != rows * self.forest.width() {
                return Err(Error::internal(format!(
                    "FIL model: the forest gave {} values for {rows} rows of {}",
                    self.scores.len(),
                    self.forest.width()
                )));
            }
        }
        let values = Bytes::from(self.output.finish(&self.scores, rows, self.forest.width()));
        outputs
            .iter()
            .map(|name| {
                if *name != OUTPUT {
                    return Err(Error::invalid(format!("FIL model has no output '{name}' (it gives {OUTPUT})")));
                }
                Ok(Tensor {
                    name: OUTPUT.into(),
                    datatype: DataType::Fp32,
                    shape: vec![rows as i64, width as i64],
                    data: values.clone(),
                })
            })
            .collect()
    }
}
