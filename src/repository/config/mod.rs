//! The model-config pipeline of Triton (model-config.md §5): read config.pbtxt, fill what the
//! server derives, complete inputs/outputs from the model file, normalize defaults, validate.
//! Errors name the field and the values involved.
use std::path::Path;

use crate::{
    backend::{ModelIo, TensorInfo},
    proto::{
        inference::{
            ModelConfig, ModelDynamicBatching, ModelInput, ModelInstanceGroup, ModelOutput, ModelSequenceBatching,
            ModelTensorReshape, ModelVersionPolicy, model_config::SchedulingChoice, model_instance_group::Kind,
            model_version_policy,
        },
        pbtxt,
    },
    tensor::{DataType, shape_string},
};

pub const CONFIG_FILE: &str = "config.pbtxt";

/// Reads `<dir>/config.pbtxt`; when it is missing, an empty config if auto-complete may fill it.
pub fn read(dir: &Path, auto_complete: bool) -> Result<ModelConfig, String> {
    let path = dir.join(CONFIG_FILE);
    match std::fs::read_to_string(&path) {
        Ok(text) => pbtxt::parse(&text).map_err(|e| format!("{}: {e}", path.display())),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound && auto_complete => Ok(ModelConfig::default()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Err(format!(
            "{} is missing and auto-complete is disabled (--disable-auto-complete-config / --strict-model-config)",
            path.display()
        )),
        Err(e) => Err(format!("cannot read {}: {e}", path.display())),
    }
}

/// What the server fills in even without auto-complete: the name, and backend / platform /
/// default_model_filename for ONNX models (§5.1).
pub fn fill(cfg: &mut ModelConfig, dir: &Path, dir_name: &str) -> Result<(), String> {
    fill_with(cfg, dir, dir_name, &|_| false)
}

/// `fill`, where `python_based(name)` says whether backend `name` is a Python-based one.
pub fn fill_with(
    cfg: &mut ModelConfig,
    dir: &Path,
    dir_name: &str,
    python_based: &dyn Fn(&str) -> bool,
) -> Result<(), String> {
    if cfg.name.is_empty() {
        cfg.name = dir_name.to_string();
    }
    if cfg.name != dir_name {
        return Err(format!(
            "unexpected directory name '{dir_name}' for model '{}', directory name must equal model name",
            cfg.name
        ));
    }
    if !cfg.default_model_filename.is_empty() {
        crate::names::relative_path(&cfg.default_model_filename).map_err(|e| format!("default_model_filename {e}"))?;
    }
    if cfg.platform == "ensemble" {
        return Ok(());
    }
    if let Some(hint) = unsupported(&cfg.platform, &cfg.backend).filter(|_| !python_based(&cfg.backend)) {
        return Err(format!("model '{}': {hint}; {SERVED}, and Python-based backends (--backend-directory)", cfg.name));
    }
    let onnx = cfg.backend == "onnxruntime"
        || (cfg.backend.is_empty() && cfg.platform == "onnxruntime_onnx")
        || (cfg.backend.is_empty() && cfg.platform.is_empty() && looks_onnx(cfg, dir));
    if onnx {
        if cfg.backend.is_empty() {
            cfg.backend = "onnxruntime".into();
        }
        if cfg.platform.is_empty() {
            cfg.platform = "onnxruntime_onnx".into();
        }
        if cfg.platform != "onnxruntime_onnx" {
            return Err(format!("unexpected 'platform' and 'backend' pair, got:{}, {}", cfg.platform, cfg.backend));
        }
        if cfg.default_model_filename.is_empty() {
            cfg.default_model_filename = "model.onnx".into();
        }
    } else if matches!(cfg.platform.as_str(), "pytorch_libtorch" | "torch_aoti") || cfg.backend == "pytorch" {
        fill_pytorch(cfg)?;
    } else if cfg.backend == "openvino" {
        if cfg.default_model_filename.is_empty() {
            cfg.default_model_filename = "model.xml".into();
        }
    } else if matches!(cfg.platform.as_str(), "tensorflow_savedmodel" | "tensorflow_graphdef")
        || cfg.backend == "tensorflow"
    {
        fill_tensorflow(cfg)?;
    } else if cfg.backend == "fil" {
        // FIL's file name follows its model_type (xgboost.json, model.txt, ...).
        let model_type = crate::backend::fil_model_type::ModelType::of(cfg)?;
        if cfg.default_model_filename.is_empty() {
            cfg.default_model_filename = model_type.default_file().into();
        }
    } else if cfg.backend.is_empty() && cfg.platform.is_empty() && first_version_holds(dir, "model.py") {
        // As Triton's auto-complete: a folder with model.py is a Python model.
        cfg.backend = "python".into();
        cfg.default_model_filename = "model.py".into();
    } else if cfg.backend.is_empty() && cfg.platform.is_empty() {
        return Err(format!("must specify 'platform' or 'backend' for '{}' ({SERVED})", cfg.name));
    } else if cfg.backend == "python" && cfg.default_model_filename.is_empty() {
        cfg.default_model_filename = "model.py".into();
    } else if cfg.default_model_filename.is_empty() && !cfg.backend.is_empty() {
        cfg.default_model_filename = format!("model.{}", cfg.backend);
    }
    Ok(())
}

/// Whether the first version folder (in byte order, as Triton looks) holds `file`.
fn first_version_holds(dir: &Path, file: &str) -> bool {
    let mut subdirs: Vec<_> = std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .filter_map(|e| e.ok())
        .filter(|e| e.path().is_dir())
        .map(|e| e.path())
        .collect();
    subdirs.sort();
    subdirs.first().is_some_and(|d| d.join(file).exists())
}

/// What ferry serves, for errors about what it does not.
const SERVED: &str = "ferry serves backend \"onnxruntime\" (platform \"onnxruntime_onnx\"), backend \"python\", backend \
                      \"pytorch\" (platforms \"pytorch_libtorch\" and \"torch_aoti\"), backend \"fil\" (XGBoost and LightGBM), backend \"openvino\", backend \"tensorflow\" (platforms \"tensorflow_savedmodel\" and \"tensorflow_graphdef\", run by OpenVINO), its built-in processing backends \"ferry_image\", \"ferry_tokenizer\" and \"ferry_postprocess\", and \
                      platform \"ensemble\"";

/// What to say of a platform or backend ferry does not serve (None: one it serves, or none named).
fn unsupported(platform: &str, backend: &str) -> Option<String> {
    let served = |b: &str| {
        matches!(
            b,
            "" | "onnxruntime"
                | "python"
                | "pytorch"
                | "fil"
                | "openvino"
                | "tensorflow"
                | "identity"
                | "ferry_image"
                | "ferry_tokenizer"
                | "ferry_postprocess"
        )
    };
    let named = |what: &str, name: &str| format!("{what} '{name}' is not served by ferry");
    let hint = |p: &str| match p {
        "tensorrt_plan" | "tensorrt" => " (run the ONNX model with ONNX Runtime's TensorRT execution provider instead)",
        _ => "",
    };
    let torch = matches!(platform, "pytorch_libtorch" | "torch_aoti");
    let tensorflow = matches!(platform, "tensorflow_savedmodel" | "tensorflow_graphdef");
    if !platform.is_empty() && platform != "onnxruntime_onnx" && !torch && !tensorflow && backend.is_empty() {
        return Some(format!("{}{}", named("platform", platform), hint(platform)));
    }
    if !served(backend) {
        return Some(format!("{}{}", named("backend", backend), hint(backend)));
    }
    None
}

/// TensorFlow's pairs, as Triton's: platform `tensorflow_savedmodel` (a SavedModel folder,
/// `model.savedmodel`) or `tensorflow_graphdef` (a frozen graph, `model.graphdef`), with backend
/// `tensorflow` (run by OpenVINO's TensorFlow reader).
fn fill_tensorflow(cfg: &mut ModelConfig) -> Result<(), String> {
    if cfg.backend.is_empty() {
        cfg.backend = "tensorflow".into();
    }
    if cfg.platform.is_empty() {
        cfg.platform =
            if cfg.default_model_filename.ends_with(".graphdef") || cfg.default_model_filename.ends_with(".pb") {
                "tensorflow_graphdef"
            } else {
                "tensorflow_savedmodel"
            }
            .into();
    }
    if cfg.backend != "tensorflow" || !matches!(cfg.platform.as_str(), "tensorflow_savedmodel" | "tensorflow_graphdef")
    {
        return Err(format!("unexpected 'platform' and 'backend' pair, got:{}, {}", cfg.platform, cfg.backend));
    }
    if cfg.default_model_filename.is_empty() {
        cfg.default_model_filename =
            if cfg.platform == "tensorflow_graphdef" { "model.graphdef" } else { "model.savedmodel" }.into();
    }
    Ok(())
}

/// PyTorch's pairs, as Triton's: platform `pytorch_libtorch` (TorchScript, `model.pt`) or
/// `torch_aoti` (an AOTInductor package, `model.pt2`), with backend `pytorch`.
fn fill_pytorch(cfg: &mut ModelConfig) -> Result<(), String> {
    if cfg.backend.is_empty() {
        cfg.backend = "pytorch".into();
    }
    if cfg.platform.is_empty() {
        cfg.platform = "pytorch_libtorch".into();
    }
    if cfg.backend != "pytorch" || !matches!(cfg.platform.as_str(), "pytorch_libtorch" | "torch_aoti") {
        return Err(format!("unexpected 'platform' and 'backend' pair, got:{}, {}", cfg.platform, cfg.backend));
    }
    if cfg.default_model_filename.is_empty() {
        cfg.default_model_filename = if cfg.platform == "torch_aoti" { "model.pt2" } else { "model.pt" }.into();
    }
    Ok(())
}

/// No backend named: an ONNX file name, or `model.onnx` in the first version directory.
fn looks_onnx(cfg: &ModelConfig, dir: &Path) -> bool {
    if cfg.default_model_filename.ends_with(".onnx") {
        return true;
    }
    first_version_holds(dir, "model.onnx")
}

/// Completes missing inputs/outputs, and the batch size, from what the model file declares
/// (§5.3). Parts the user wrote are never overwritten.
pub fn complete(cfg: &mut ModelConfig, io: &ModelIo, default_max_batch_size: i32) -> Result<(), String> {
    let has_inputs = !cfg.input.is_empty() || !cfg.batch_input.is_empty();
    if has_inputs && !cfg.output.is_empty() {
        return Ok(());
    }
    let batchable = io.inputs.iter().chain(&io.outputs).all(|t| t.shape.first() == Some(&-1));
    if batchable && cfg.max_batch_size == 0 && default_max_batch_size > 0 {
        tracing::warn!(model = %cfg.name, max_batch_size = default_max_batch_size, "auto-complete set max_batch_size");
        cfg.max_batch_size = default_max_batch_size;
    }
    if batchable && cfg.max_batch_size > 1 && cfg.scheduling_choice.is_none() {
        cfg.scheduling_choice = Some(SchedulingChoice::DynamicBatching(ModelDynamicBatching::default()));
    }
    if !batchable && cfg.max_batch_size != 0 {
        return Err(format!(
            "autofill failed for model '{}': model does not support batching while non-zero max_batch_size is specified",
            cfg.name
        ));
    }
    let batching = cfg.max_batch_size > 0;
    if !has_inputs {
        cfg.input = io
            .inputs
            .iter()
            .map(|t| {
                let (data_type, dims, reshape) = completed(t, batching, &cfg.name)?;
                Ok(ModelInput { name: t.name.clone(), data_type, dims, reshape, ..Default::default() })
            })
            .collect::<Result<_, String>>()?;
    }
    if cfg.output.is_empty() {
        cfg.output = io
            .outputs
            .iter()
            .map(|t| {
                let (data_type, dims, reshape) = completed(t, batching, &cfg.name)?;
                Ok(ModelOutput { name: t.name.clone(), data_type, dims, reshape, ..Default::default() })
            })
            .collect::<Result<_, String>>()?;
    }
    Ok(())
}

type Completed = (i32, Vec<i64>, Option<ModelTensorReshape>);

fn completed(t: &TensorInfo, batching: bool, model: &str) -> Result<Completed, String> {
    let dt = t.datatype.ok_or_else(|| {
        format!("model '{model}': tensor '{}' is not a tensor of a supported datatype; list the model's inputs and outputs in config.pbtxt", t.name)
    })?;
    let dims: Vec<i64> = if batching { t.shape[1..].to_vec() } else { t.shape.clone() };
    if dims.is_empty() {
        let reshape = batching.then(ModelTensorReshape::default);
        return Ok((dt.config(), vec![1], reshape));
    }
    Ok((dt.config(), dims, None))
}

/// Fills the defaults Triton writes into the effective config (§5.2, §6.5).
pub fn normalize(cfg: &mut ModelConfig) {
    let gpus: Vec<i32> = crate::gpu::visible().list().iter().map(|g| g.index).collect();
    normalize_with(cfg, &gpus);
}

/// `normalize` on a machine whose visible GPUs are `gpus`: KIND_AUTO runs ONNX models on every
/// visible GPU (as Triton), anything else, or any model without a GPU, on the CPU.
pub fn normalize_with(cfg: &mut ModelConfig, gpus: &[i32]) {
    if cfg.version_policy.as_ref().and_then(|p| p.policy_choice.as_ref()).is_none() {
        cfg.version_policy = Some(ModelVersionPolicy {
            policy_choice: Some(model_version_policy::PolicyChoice::Latest(model_version_policy::Latest {
                num_versions: 1,
            })),
        });
    }
    let max = cfg.max_batch_size;
    if let Some(SchedulingChoice::DynamicBatching(db)) = &mut cfg.scheduling_choice
        && db.preferred_batch_size.is_empty()
        && max > 0
    {
        db.preferred_batch_size = vec![max];
    }
    if cfg.platform == "ensemble" {
        return;
    }
    let opt = cfg.optimization.get_or_insert_with(Default::default);
    opt.input_pinned_memory
        .get_or_insert(crate::proto::inference::model_optimization_policy::PinnedMemoryBuffer { enable: true });
    opt.output_pinned_memory
        .get_or_insert(crate::proto::inference::model_optimization_policy::PinnedMemoryBuffer { enable: true });
    if cfg.instance_group.is_empty() {
        cfg.instance_group.push(ModelInstanceGroup { name: cfg.name.clone(), ..Default::default() });
    }
    let default_count = if cfg.backend == "onnxruntime" { 2 } else { 1 };
    for (i, group) in cfg.instance_group.iter_mut().enumerate() {
        if group.name.is_empty() {
            group.name = format!("{}_{i}", cfg.name);
        }
        if group.kind == Kind::Auto as i32 {
            if cfg.backend == "onnxruntime" && !gpus.is_empty() {
                group.kind = Kind::Gpu as i32;
                if group.gpus.is_empty() {
                    group.gpus = gpus.to_vec();
                }
                tracing::info!(model = %cfg.name, group = %group.name, gpus = ?group.gpus, "KIND_AUTO: on the GPU");
            } else {
                group.kind = Kind::Cpu as i32;
                // Said once at start ("no GPU: ...; KIND_AUTO instances run on the CPU").
                tracing::debug!(model = %cfg.name, group = %group.name, "KIND_AUTO: on the CPU");
            }
        }
        if group.count < 1 {
            group.count = if group.kind == Kind::Cpu as i32 { default_count } else { 1 };
        }
    }
}

mod checks;

pub use checks::{
    MAX_INSTANCES, MAX_PRIORITY_LEVELS, MAX_WARMUP_BYTES, MAX_WARMUP_RUNS, Scalars, check_against_model, validate,
};

/// The composing models of the ensemble whose folder is `dir` (or whose config is `config`);
/// empty for any other model, or a config that does not read.
pub fn ensemble_steps(dir: &Path, config: Option<&ModelConfig>) -> Vec<String> {
    let parsed;
    let cfg = match config {
        Some(c) => c,
        None => match read(dir, true) {
            Ok(c) => {
                parsed = c;
                &parsed
            }
            Err(_) => return Vec::new(),
        },
    };
    match &cfg.scheduling_choice {
        Some(SchedulingChoice::EnsembleScheduling(es)) if cfg.platform == "ensemble" => {
            let mut m: Vec<String> = es.step.iter().map(|s| s.model_name.clone()).collect();
            m.sort();
            m.dedup();
            m
        }
        _ => Vec::new(),
    }
}

#[cfg(test)]
mod tests;
