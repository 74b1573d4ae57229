//! Models run by OpenVINO (`backend: "openvino"`): IR (`model.xml` + `model.bin`), ONNX and the
//! other formats OpenVINO reads, and TensorFlow SavedModels and GraphDefs (`platform:
//! "tensorflow_savedmodel"` / `"tensorflow_graphdef"`, which Triton no longer serves) through
//! OpenVINO's TensorFlow reader. OpenVINO's C library is loaded at run time, found like ONNX
//! Runtime (`backend::library`). Triton's parameters: `PERFORMANCE_HINT`, `NUM_STREAMS`,
//! `INFERENCE_NUM_THREADS`, `COMPILATION_NUM_THREADS`, `HINT_BF16`, `TARGET_DEVICE`,
//! `RESHAPE_IO_LAYERS`, `SKIP_OV_DYNAMIC_BATCHSIZE`, `ENABLE_BATCH_PADDING`. Unlike Triton's
//! backend, a batching model takes any batch up to `max_batch_size`: its batch dimension is made
//! variable at load (unless `SKIP_OV_DYNAMIC_BATCHSIZE`).
use std::{
    collections::HashMap,
    path::{Path, PathBuf},
    sync::{Arc, OnceLock},
};

use bytes::Bytes;

use super::{Backend, BackendInput, Device, InstanceSpec, ModelInstance, ModelIo, TensorInfo, library};
use crate::{
    error::{Error, Result},
    proto::inference::{ModelConfig, ModelInput, ModelOutput},
    tensor::Tensor,
};

mod ffi;
mod params;
mod signature;

use ffi::{Core, Dimension, Port};
use params::Params;

/// OpenVINO's library and core, made once, at the first model needing them.
struct Shared {
    library: Option<PathBuf>,
    core: library::Loaded<Core>,
}

impl Shared {
    fn core(&self) -> Result<Arc<Core>> {
        library::load_once(&self.core, &library::OPENVINO, self.library.as_deref(), |path| {
            let api = ffi::Api::load(path)?;
            tracing::info!(version = %api.version, "OpenVINO loaded");
            Core::new(Arc::new(api))
        })
        .map_err(Error::unavailable)
    }
}

/// The backend, under the name it serves: `openvino`, or `tensorflow` for TensorFlow models.
pub struct OpenVinoBackend {
    name: &'static str,
    shared: Arc<Shared>,
}

/// The OpenVINO backend and the TensorFlow one it also is, sharing one library and core.
pub fn backends(library: Option<PathBuf>) -> [OpenVinoBackend; 2] {
    let shared = Arc::new(Shared { library, core: OnceLock::new() });
    [OpenVinoBackend { name: "openvino", shared: Arc::clone(&shared) }, OpenVinoBackend { name: "tensorflow", shared }]
}

fn info(port: &Port) -> TensorInfo {
    TensorInfo { name: port.name.clone(), datatype: port.datatype, shape: port.dims.iter().map(|d| d.size()).collect() }
}

fn io_of(inputs: &[Port], outputs: &[Port]) -> ModelIo {
    ModelIo { inputs: inputs.iter().map(info).collect(), outputs: outputs.iter().map(info).collect() }
}

impl OpenVinoBackend {
    /// The model's inputs and outputs, named as the config names them: a TensorFlow GraphDef's
    /// tensors (`features:0`) by their node's name (`features`), as Triton's TensorFlow backend.
    fn ports(&self, model: &ffi::Model) -> std::result::Result<(Vec<Port>, Vec<Port>), String> {
        let (mut inputs, mut outputs) = (model.inputs()?, model.outputs()?);
        if self.name == "tensorflow" {
            for p in inputs.iter_mut().chain(outputs.iter_mut()) {
                if let Some(stem) = p.name.strip_suffix(":0") {
                    p.name = stem.to_string();
                }
            }
        }
        Ok((inputs, outputs))
    }
}

impl OpenVinoBackend {
    /// A SavedModel's `TF_SIGNATURE_DEF` other than `serving_default`, as a copy of the model
    /// serving that signature (`signature`); None: the model as it is.
    fn signature_copy(
        &self,
        path: &Path,
        config: &ModelConfig,
    ) -> std::result::Result<Option<tempfile::TempDir>, String> {
        let name = config.parameters.get("TF_SIGNATURE_DEF").map(|p| p.string_value.trim()).unwrap_or_default();
        if self.name != "tensorflow" || name.is_empty() || name == "serving_default" || !path.is_dir() {
            return Ok(None);
        }
        // The folder's own checks (regular files, at most 10,000 entries) before it is linked.
        readable(path)?;
        signature::resigned(path, name).map(Some)
    }

    /// An error about the copy, naming the model's own folder instead.
    fn original(copy: &tempfile::TempDir, path: &Path) -> impl Fn(String) -> String {
        let (copy, path) = (copy.path().display().to_string(), path.display().to_string());
        move |e: String| e.replace(&copy, &path)
    }
}

impl Backend for OpenVinoBackend {
    fn name(&self) -> &'static str {
        self.name
    }

    fn model_io(&self, model_path: &Path) -> Result<ModelIo> {
        readable(model_path).map_err(Error::invalid)?;
        let model = self.shared.core()?.read(model_path).map_err(Error::invalid)?;
        let (inputs, outputs) = self.ports(&model).map_err(Error::invalid)?;
        // A tensor of dynamic rank has no dims to complete the config with.
        if let Some(p) = inputs.iter().chain(&outputs).find(|p| !p.ranked) {
            return Err(Error::invalid(format!(
                "tensor '{}' of '{}' has a dynamic rank; list the model's inputs and outputs in config.pbtxt with their dims \
                 and RESHAPE_IO_LAYERS: \"YES\"",
                p.name,
                model_path.display()
            )));
        }
        Ok(io_of(&inputs, &outputs))
    }

    /// A config naming a `TF_SIGNATURE_DEF` takes its inputs and outputs from that signature.
    fn auto_complete(&self, model_path: &Path, config: &mut ModelConfig) -> Result<()> {
        if !config.input.is_empty() && !config.output.is_empty() {
            return Ok(());
        }
        let named = |e: String| Error::invalid(format!("model '{}': {e}", config.name));
        let Some(copy) = self.signature_copy(model_path, config).map_err(named)? else {
            return Ok(());
        };
        let io = self
            .model_io(copy.path())
            .map_err(|e| named(Self::original(&copy, model_path)(e.message().to_string())))?;
        let dims = |t: &TensorInfo| {
            if config.max_batch_size > 0 && !t.shape.is_empty() { t.shape[1..].to_vec() } else { t.shape.clone() }
        };
        let data_type = |t: &TensorInfo| t.datatype.map_or(0, |d| d.config());
        if config.input.is_empty() {
            let inputs = io.inputs.iter().map(|t| ModelInput {
                name: t.name.clone(),
                data_type: data_type(t),
                dims: dims(t),
                ..Default::default()
            });
            config.input = inputs.collect();
        }
        if config.output.is_empty() {
            let outputs = io.outputs.iter().map(|t| ModelOutput {
                name: t.name.clone(),
                data_type: data_type(t),
                dims: dims(t),
                ..Default::default()
            });
            config.output = outputs.collect();
        }
        Ok(())
    }

    fn load(&self, spec: &InstanceSpec<'_>) -> Result<Box<dyn ModelInstance>> {
        let config = spec.config;
        let named = |e: String| Error::invalid(format!("model '{}': {e}", config.name));
        if let Device::Gpu(_) = spec.device {
            return Err(Error::unsupported(format!(
                "model '{}': OpenVINO does not run on NVIDIA GPUs; use instance_group kind KIND_CPU (TARGET_DEVICE \
                 chooses an Intel GPU or NPU)",
                config.name
            )));
        }
        let mut params = Params::of(config).map_err(named)?;
        if self.name == "tensorflow" {
            // TensorFlow computes in FP32; so do its models here unless the config says otherwise.
            params.default_precision("f32");
        }
        readable(spec.model_path).map_err(named)?;
        let core = self.shared.core()?;
        let copy = self.signature_copy(spec.model_path, config).map_err(named)?;
        let mut model = match &copy {
            Some(c) => core.read(c.path()).map_err(|e| named(Self::original(c, spec.model_path)(e)))?,
            None => core.read(spec.model_path).map_err(named)?,
        };
        let batching = config.max_batch_size > 0;
        let (inputs, _) = self.ports(&model).map_err(named)?;
        let reshapes = params.reshapes(config, &inputs).map_err(named)?;
        model.reshape(&reshapes).map_err(|e| {
            named(format!(
                "{e}{}",
                if params.reshape_io {
                    ""
                } else {
                    " (set SKIP_OV_DYNAMIC_BATCHSIZE to keep the model's own batch size)"
                }
            ))
        })?;
        let (inputs, outputs) = self.ports(&model).map_err(named)?;
        if inputs.is_empty() || outputs.is_empty() {
            return Err(named(format!(
                "the model has {} inputs and {} outputs; it computes nothing",
                inputs.len(),
                outputs.len()
            )));
        }
        if let Some(p) = inputs.iter().chain(&outputs).find(|p| !p.ranked) {
            return Err(named(format!(
                "tensor '{}' has a dynamic rank; give its dims in the config with RESHAPE_IO_LAYERS: \"YES\"",
                p.name
            )));
        }
        if let Some(p) = inputs.iter().chain(&outputs).find(|p| p.datatype.is_none()) {
            return Err(named(format!(
                "tensor '{}' has OpenVINO element type {}, which has no KServe datatype ferry serves",
                p.name, p.element
            )));
        }
        // A batch dimension the model keeps fixed: batches are padded to it, or must fill it.
        let fixed_batch = batching
            .then(|| inputs.iter().map(|p| p.dims.first().map(|d| d.size())).collect::<Option<Vec<i64>>>())
            .flatten()
            .and_then(|sizes| sizes.first().copied().filter(|&n| n > 0 && sizes.iter().all(|&s| s == n)));
        if let Some(n) = fixed_batch
            && i64::from(config.max_batch_size) > n
        {
            return Err(named(format!(
                "max_batch_size {} is more than the model's fixed batch dimension ({n}) takes",
                config.max_batch_size
            )));
        }
        if let Some(n) = fixed_batch
            && !params.batch_padding
            && i64::from(config.max_batch_size) != n
        {
            return Err(named(format!(
                "the model's batch dimension is fixed at {n} and max_batch_size is {}: no batch could run; set \
                 max_batch_size to {n} or ENABLE_BATCH_PADDING to \"YES\"",
                config.max_batch_size
            )));
        }
        if params.compile_threads.is_some() && spec.index == 0 {
            tracing::warn!(model = %config.name, "COMPILATION_NUM_THREADS is a core-wide OpenVINO setting; it has no effect per model");
        }
        let properties = params.properties(spec.intra_op_threads);
        if spec.index == 0 {
            tracing::info!(model = %config.name, device = %params.device, ?properties, "compiling with OpenVINO");
            if params.bf16_without_amx(cpu_flags()) {
                tracing::info!(
                    model = %config.name,
                    "OpenVINO computes this model in bf16, its default on this CPU, which has AVX-512 BF16 but no AMX; \
                     there bf16 can be slower than f32 (a ResNet-18: 0.6x) or faster (a small MLP at batch 1: 1.6-2.3x), \
                     see bench/RESULTS.md; set the parameter INFERENCE_PRECISION_HINT to \"f32\" to compare"
                );
            }
        }
        let request = model.compile(&params.device, &properties).map_err(named)?.request().map_err(named)?;
        let mut io = io_of(&inputs, &outputs);
        if fixed_batch.is_some() {
            // Batches of any size up to the fixed one reach it (padded, or refused if not full).
            for t in io.inputs.iter_mut().chain(io.outputs.iter_mut()).filter(|t| !t.shape.is_empty()) {
                t.shape[0] = -1;
            }
        }
        Ok(Box::new(OpenVinoInstance {
            io,
            input_index: inputs.iter().enumerate().map(|(i, p)| (p.name.clone(), i)).collect(),
            output_index: outputs.iter().enumerate().map(|(i, p)| (p.name.clone(), i)).collect(),
            request,
            fixed_batch,
            padding: params.batch_padding,
            batching,
            scratch: Vec::new(),
            _signature_copy: copy,
        }))
    }
}

struct OpenVinoInstance {
    request: ffi::Request,
    io: ModelIo,
    input_index: HashMap<String, usize>,
    output_index: HashMap<String, usize>,
    fixed_batch: Option<i64>,
    padding: bool,
    batching: bool,
    /// Copies of inputs whose bytes are not aligned for their type, or padded to the batch.
    scratch: Vec<Vec<u64>>,
    /// The SavedModel copy serving a `TF_SIGNATURE_DEF`, kept while OpenVINO may read it.
    _signature_copy: Option<tempfile::TempDir>,
}

impl ModelInstance for OpenVinoInstance {
    fn model_io(&self) -> Option<ModelIo> {
        Some(self.io.clone())
    }

    fn runs_anywhere(&self) -> bool {
        true
    }

    fn execute(&mut self, inputs: &[BackendInput<'_>], outputs: &[&str]) -> Result<Vec<Tensor>> {
        let rows = if self.batching { inputs.first().and_then(|i| i.shape.first().copied()).unwrap_or(0) } else { 0 };
        let pad_to = match self.fixed_batch {
            Some(n) if rows != n && self.padding && rows < n => Some(n),
            Some(n) if rows != n => {
                return Err(Error::invalid(format!(
                    "expected requests with batch size '{n}', got '{rows}'... this error can be avoided by setting \
                     'ENABLE_BATCH_PADDING' parameter in model configuration to 'YES' at a performance cost."
                )));
            }
            _ => None,
        };
        let mut set = vec![false; self.input_index.len()];
        self.scratch.resize_with(inputs.len(), Vec::new);
        // The bytes OpenVINO reads: the request's own, or a copy (aligned, or padded).
        let mut shapes: Vec<Vec<i64>> = Vec::with_capacity(inputs.len());
        for (k, input) in inputs.iter().enumerate() {
            let index = *self.input_index.get(input.name).ok_or_else(|| {
                Error::invalid(format!("unexpected inference input '{}' for the OpenVINO model", input.name))
            })?;
            set[index] = true;
            let mut shape = input.shape.to_vec();
            let element = input.datatype.size().unwrap_or(1);
            if let Some(n) = pad_to {
                shape[0] = n;
            }
            let copied = pad_to.is_some() || input.data.as_ptr().align_offset(element) != 0;
            if copied {
                let want: usize = shape.iter().map(|&d| d.max(0) as usize).product::<usize>() * element;
                let buffer = &mut self.scratch[k];
                buffer.clear();
                buffer.resize(want.div_ceil(8), 0);
                let bytes: &mut [u8] = bytemuck::cast_slice_mut(buffer.as_mut_slice());
                bytes[..input.data.len()].copy_from_slice(input.data);
            }
            let data: &[u8] = if copied { bytemuck::cast_slice(self.scratch[k].as_slice()) } else { input.data };
            self.request.set_input(index, input.datatype, &shape, data).map_err(Error::invalid)?;
            shapes.push(shape);
        }
        if let Some(missing) = self.io.inputs.iter().zip(&set).find(|(_, s)| !**s).map(|(t, _)| &t.name) {
            return Err(Error::invalid(format!("the OpenVINO model needs input '{missing}', which the batch lacks")));
        }
        // A shape the model cannot take is the request's error (OpenVINO checks it).
        self.request.infer().map_err(|e| {
            let given: Vec<String> = inputs.iter().zip(&shapes).map(|(i, s)| format!("'{}' {s:?}", i.name)).collect();
            let takes: Vec<String> = self.io.inputs.iter().map(|t| format!("'{}' {:?}", t.name, t.shape)).collect();
            Error::invalid(format!(
                "{e}: the model could not run on inputs {} (it takes {})",
                given.join(", "),
                takes.join(", ")
            ))
        })?;
        // A large padded or realigned copy is not kept for the model's lifetime.
        for buffer in self.scratch.iter_mut().filter(|b| b.capacity() > SCRATCH_KEPT / 8) {
            *buffer = Vec::new();
        }
        outputs
            .iter()
            .map(|name| {
                let index = *self
                    .output_index
                    .get(*name)
                    .ok_or_else(|| Error::invalid(format!("the OpenVINO model has no output '{name}'")))?;
                let out = self.request.output(index).map_err(Error::internal)?;
                let datatype = out.datatype.ok_or_else(|| {
                    Error::internal(format!("OpenVINO output '{name}' has a type the protocol lacks"))
                })?;
                let (mut shape, mut data) = (out.shape, out.data);
                if pad_to.is_some() && !shape.is_empty() && shape[0] > rows {
                    // The padding rows are dropped.
                    let per_row = data.len() / shape[0].max(1) as usize;
                    data.truncate(per_row * rows as usize);
                    shape[0] = rows;
                }
                Ok(Tensor { name: (*name).to_string(), datatype, shape, data: Bytes::from(data) })
            })
            .collect()
    }
}

/// Bytes of input copies an instance keeps between batches.
const SCRATCH_KEPT: usize = 16 << 20;

/// A model's files are regular files (a SavedModel: a folder of them), never a pipe or a device
/// that would block or never end OpenVINO's read; an IR's weights beside it too.
fn readable(path: &Path) -> std::result::Result<(), String> {
    fn check(path: &Path, depth: usize, budget: &mut usize) -> std::result::Result<(), String> {
        let meta = std::fs::metadata(path).map_err(|e| format!("cannot read '{}': {e}", path.display()))?;
        if meta.is_file() {
            return Ok(());
        }
        if !meta.is_dir() || depth == 0 {
            return Err(format!("'{}' is not a regular file", path.display()));
        }
        for entry in std::fs::read_dir(path).map_err(|e| format!("cannot read '{}': {e}", path.display()))? {
            *budget = budget.checked_sub(1).ok_or_else(|| format!("'{}' holds too many files", path.display()))?;
            let entry = entry.map_err(|e| format!("cannot read '{}': {e}", path.display()))?;
            check(&entry.path(), depth - 1, budget)?;
        }
        Ok(())
    }
    let mut budget = 10_000;
    check(path, 4, &mut budget)?;
    let weights = path.with_extension("bin");
    if path.extension().is_some_and(|e| e == "xml") && weights.exists() {
        check(&weights, 0, &mut budget)?;
    }
    Ok(())
}

/// Row-major dims of a config tensor as OpenVINO dimensions (-1: variable).
fn dimensions(dims: &[i64]) -> Vec<Dimension> {
    dims.iter().map(|&d| if d < 0 { Dimension::DYNAMIC } else { Dimension::fixed(d) }).collect()
}

/// The CPU's feature flags (/proc/cpuinfo's first `flags` line, read once; empty where there is none).
fn cpu_flags() -> &'static str {
    static FLAGS: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    FLAGS.get_or_init(|| {
        let info = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
        let line = info.lines().find_map(|l| l.strip_prefix("flags")).and_then(|l| l.split_once(':'));
        line.map_or_else(String::new, |(_, f)| f.to_string())
    })
}
