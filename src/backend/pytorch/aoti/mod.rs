//! AOTInductor packages (`torch_aoti`, `model.pt2`) run inside the server, through PyTorch's
//! stable C ABI: the package's compiled model library and `libtorch_cpu.so` of the PyTorch the
//! backend found, both loaded at run time. A batch is one call into the compiled model over the
//! batch's own bytes (no copy, no process hand-off). What this path does not take (a CUDA package
//! or a GPU instance, weights stored apart from the library, nested inputs or outputs, a model with
//! its own `EXECUTION_ENV_PATH`, no PyTorch found) runs in a PyTorch process instead, as TorchScript
//! does.
use std::{
    collections::HashMap,
    path::{Path, PathBuf},
    sync::{Arc, Mutex, Weak},
};

use bytes::Bytes;

use super::{
    super::{BackendInput, Device, InstanceSpec, ModelInstance},
    ctensor::{self, Torch},
    libtorch::LibTorch,
    params::Params,
};
use crate::{
    error::{Error, Result},
    proto::{
        inference::{ModelConfig, model_config::SchedulingChoice},
        pbtxt,
    },
    tensor::{DataType, Tensor},
};

mod elf;
mod ffi;
mod package;
mod probe;
pub(super) mod spec;
pub mod trial;

use ffi::{Container, ModelLibrary};

/// Largest output one run may give.
const MAX_OUTPUT_BYTES: usize = 1 << 31;
/// Bytes of input copies an instance keeps between batches.
const SCRATCH_KEPT: usize = 16 << 20;

/// The PyTorch library (loaded at the first package that runs here), the packages' model
/// libraries, and the weights that instances share (`ENABLE_WEIGHT_SHARING`).
pub struct Aoti {
    torch: Arc<LibTorch>,
    /// Model libraries by the SHA-256 of their content, and file identities seen (`identity`) by
    /// the library they hold. A model library is never unloaded (its GNU-unique symbols keep it
    /// mapped whatever dlclose is asked), so each content is loaded once and kept.
    libraries: Mutex<Libraries>,
    shared: Mutex<HashMap<String, Weak<Loaded>>>,
    /// The (package content, configuration) pairs whose trial passed.
    tried: Mutex<std::collections::HashSet<String>>,
}

#[derive(Default)]
struct Libraries {
    by_digest: HashMap<String, Arc<Library>>,
    by_file: HashMap<String, String>,
}

/// A package's model library, loaded from its copy in a private folder (kept while it is loaded:
/// PyTorch may read the library's own file for weights appended to it).
struct Library {
    model: Arc<ModelLibrary>,
    path: PathBuf,
    /// The fewest rows its batch dimension takes (its input checks say; PyTorch's compiler often
    /// starts a dynamic dimension at 2).
    least_rows: i64,
    /// SHA-256 of its content.
    digest: String,
    _dir: Option<tempfile::TempDir>,
}

/// A package's model, loaded: its container (weights and compiled models) over its library.
struct Loaded {
    container: Container,
    library: Arc<Library>,
}

impl Aoti {
    pub fn new(torch: Arc<LibTorch>) -> Self {
        Aoti { torch, libraries: Mutex::default(), shared: Mutex::default(), tried: Mutex::default() }
    }

    fn torch(&self) -> std::result::Result<Arc<Torch>, String> {
        self.torch.get()
    }

    /// An instance running in the server, or None when this one runs in a PyTorch process.
    pub fn load(&self, spec: &InstanceSpec<'_>) -> Result<Option<Box<dyn ModelInstance>>> {
        let config = spec.config;
        let elsewhere = |why: &str| {
            if spec.index == 0 {
                tracing::info!(model = %config.name, "runs in a PyTorch process: {why}");
            }
            Ok(None)
        };
        if config.platform != "torch_aoti" {
            return Ok(None);
        }
        if spec.device != Device::Cpu {
            return elsewhere("a GPU instance");
        }
        if config.parameters.contains_key("EXECUTION_ENV_PATH") {
            return elsewhere("it names its own Python environment (EXECUTION_ENV_PATH)");
        }
        if config.parameters.contains_key("EXECUTE_TIMEOUT_SECONDS") {
            return elsewhere(
                "it has an execution deadline (EXECUTE_TIMEOUT_SECONDS), which only a process can enforce",
            );
        }
        let torch = match self.torch() {
            Ok(t) => t,
            Err(e) => return elsewhere(&e),
        };
        let named = |e: String| Error::invalid(format!("model '{}': {e}", config.name));
        let params = Params::of(config, spec.index == 0).map_err(named)?;
        let loaded = match self.model(spec, &params)? {
            Some(l) => l,
            None => return Ok(None),
        };
        let instance =
            AotiInstance::new(torch, loaded, config, params.threads.unwrap_or(spec.intra_op_threads)).map_err(named)?;
        Ok(Some(Box::new(instance)))
    }

    /// The package's model: shared with the version's other instances under
    /// `ENABLE_WEIGHT_SHARING` (one copy of the weights for all), else its own.
    fn model(&self, spec: &InstanceSpec<'_>, params: &Params) -> Result<Option<Arc<Loaded>>> {
        let config = spec.config;
        let prepared = match self.prepare(spec.model_path)? {
            Ok(p) => p,
            Err(why) => {
                if spec.index == 0 {
                    tracing::info!(model = %config.name, "runs in a PyTorch process: {why}");
                }
                return Ok(None);
            }
        };
        let named =
            |e: String| Error::invalid(format!("model '{}': '{}': {e}", config.name, spec.model_path.display()));
        let torch = self.torch().map_err(Error::unavailable)?;
        // First in a process of its own, once per package content and configuration (a changed
        // configuration is tried again): what would end a process ends that one.
        let tried = format!("{}:{}", prepared.digest(), digest(pbtxt::to_json(config).to_string().as_bytes()));
        if !self.tried.lock().unwrap_or_else(|p| p.into_inner()).contains(&tried) {
            trial::run(prepared.path(), prepared.least_rows(), &torch.path, config).map_err(named)?;
            self.tried.lock().unwrap_or_else(|p| p.into_inner()).insert(tried);
            if config.max_batch_size > 0 && prepared.least_rows() > 1 {
                tracing::warn!(
                    model = %config.name,
                    least_rows = prepared.least_rows(),
                    "this package's input checks start its batch at {} rows, so a smaller batch is padded to that and \
                     computed whole; export it under torch.fx.experimental._config.patch(backed_size_oblivious=True), \
                     and for convolutions with inductor_configs={{\"layout_optimization\": False}}, to take 1",
                    prepared.least_rows()
                );
            }
        }
        let key = params.share_weights.then(|| share_key(spec.model_path, cpu_instances(config))).flatten();
        {
            let mut shared = self.shared.lock().unwrap_or_else(|p| p.into_inner());
            shared.retain(|_, w| w.strong_count() > 0);
            if let Some(found) = key.as_ref().and_then(|k| shared.get(k)).and_then(Weak::upgrade) {
                return Ok(Some(found));
            }
        }
        let library = self.load_library(prepared).map_err(named)?;
        let models = if key.is_some() { cpu_instances(config) } else { 1 };
        let container = Container::new(Arc::clone(&library.model), models, &library.path).map_err(named)?;
        let loaded = Arc::new(Loaded { container, library });
        if let Some(k) = key {
            self.shared.lock().unwrap_or_else(|p| p.into_inner()).insert(k, Arc::downgrade(&loaded));
        }
        Ok(Some(loaded))
    }

    /// The package's model library: loaded already, or taken out of the package to be loaded
    /// (Ok(Err(why)): it runs in a process). The package is read outside the lock (a large one
    /// takes a while, and other models load meanwhile).
    fn prepare(&self, path: &Path) -> Result<std::result::Result<Prepared, String>> {
        let identity = file_identity(path);
        {
            let libraries = self.libraries.lock().unwrap_or_else(|p| p.into_inner());
            let known =
                identity.as_ref().and_then(|i| libraries.by_file.get(i)).and_then(|d| libraries.by_digest.get(d));
            if let Some(found) = known {
                return Ok(Ok(Prepared::Loaded(Arc::clone(found))));
            }
        }
        let opened = match package::open(path) {
            Ok(o) => o,
            Err(package::Refusal::Elsewhere(why)) => return Ok(Err(why)),
            Err(package::Refusal::Broken(e)) => return Err(Error::invalid(e)),
        };
        {
            let mut libraries = self.libraries.lock().unwrap_or_else(|p| p.into_inner());
            if let Some(found) = libraries.by_digest.get(&opened.digest).cloned() {
                if let Some(i) = identity {
                    libraries.by_file.insert(i, opened.digest.clone());
                }
                return Ok(Ok(Prepared::Loaded(found)));
            }
        }
        let device = opened.metadata.get("AOTI_DEVICE_KEY").map(String::as_str).unwrap_or("cpu");
        if device != "cpu" {
            return Ok(Err(format!("a package compiled for {device}")));
        }
        package::runs_here(&opened.metadata).map_err(|e| Error::invalid(format!("'{}': {e}", path.display())))?;
        Ok(Ok(Prepared::Opened(opened, identity)))
    }

    fn load_library(&self, prepared: Prepared) -> std::result::Result<Arc<Library>, String> {
        let (opened, identity) = match prepared {
            Prepared::Loaded(l) => return Ok(l),
            Prepared::Opened(o, i) => (o, i),
        };
        let mut libraries = self.libraries.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(found) = libraries.by_digest.get(&opened.digest) {
            return Ok(Arc::clone(found));
        }
        let model = Arc::new(ModelLibrary::load(&opened.library)?);
        let library = Arc::new(Library {
            model,
            path: opened.library,
            least_rows: opened.least_rows,
            digest: opened.digest.clone(),
            _dir: Some(opened.dir),
        });
        if let Some(i) = identity {
            libraries.by_file.insert(i, opened.digest.clone());
        }
        libraries.by_digest.insert(opened.digest, Arc::clone(&library));
        Ok(library)
    }
}

/// A package's library, loaded or ready to load (with the identity of the file it came from).
enum Prepared {
    Loaded(Arc<Library>),
    Opened(package::Opened, Option<String>),
}

impl Prepared {
    fn path(&self) -> &Path {
        match self {
            Prepared::Loaded(l) => &l.path,
            Prepared::Opened(o, _) => &o.library,
        }
    }

    fn digest(&self) -> &str {
        match self {
            Prepared::Loaded(l) => &l.digest,
            Prepared::Opened(o, _) => &o.digest,
        }
    }

    fn least_rows(&self) -> i64 {
        match self {
            Prepared::Loaded(l) => l.least_rows,
            Prepared::Opened(o, _) => o.least_rows,
        }
    }
}

fn digest(bytes: &[u8]) -> String {
    use sha2::Digest;
    sha2::Sha256::digest(bytes).iter().map(|b| format!("{b:02x}")).collect()
}

/// A file's path and what changes when it is written (the change time too, which no tool sets
/// back).
pub(super) fn file_identity(path: &Path) -> Option<String> {
    use std::os::unix::fs::MetadataExt;
    let m = std::fs::metadata(path).ok()?;
    let (modified, changed) = ((m.mtime(), m.mtime_nsec()), (m.ctime(), m.ctime_nsec()));
    Some(format!("{}:{}:{}:{}:{modified:?}:{changed:?}", path.display(), m.dev(), m.ino(), m.len()))
}

/// Which file a shared model is of, and for how many instances.
fn share_key(path: &Path, models: usize) -> Option<String> {
    file_identity(path).map(|i| format!("{i}:{models}"))
}

fn cpu_instances(config: &ModelConfig) -> usize {
    let gpu = crate::proto::inference::model_instance_group::Kind::Gpu as i32;
    let n: i64 = config.instance_group.iter().filter(|g| g.kind != gpu).map(|g| i64::from(g.count.max(0))).sum();
    n.clamp(1, 1024) as usize
}

/// An output: its flat index, and the datatype and dims the config declares for it (dims None:
/// not checked, a reshape).
#[derive(Debug, Clone)]
pub(super) struct Output {
    pub at: usize,
    pub datatype: Option<DataType>,
    pub dims: Option<Vec<i64>>,
}

/// One instance: the config's names mapped to the package's flat inputs and outputs.
pub struct AotiInstance {
    torch: Arc<Torch>,
    loaded: Arc<Loaded>,
    /// Config input name → flat input index.
    inputs: HashMap<String, usize>,
    /// Config output name → what the package gives for it.
    outputs: HashMap<String, Output>,
    threads: usize,
    batching: bool,
    /// The fewest rows the package's batch dimension takes (a batch of fewer is padded to it).
    least_rows: i64,
    /// The inputs' copies the package computes on (aligned for any type).
    scratch: Vec<Vec<u64>>,
}

impl AotiInstance {
    fn new(
        torch: Arc<Torch>,
        loaded: Arc<Loaded>,
        config: &ModelConfig,
        threads: usize,
    ) -> std::result::Result<Self, String> {
        let c = &loaded.container;
        let flat_in = spec::inputs(&c.in_spec, c.inputs)?;
        let flat_out = spec::outputs(&c.out_spec, c.outputs)?;
        let (mut in_names, mut out_names): (Vec<&str>, Vec<&str>) = (
            config.input.iter().map(|i| i.name.as_str()).collect(),
            config.output.iter().map(|o| o.name.as_str()).collect(),
        );
        let mut types: HashMap<&str, i32> = config.input.iter().map(|i| (i.name.as_str(), i.data_type)).collect();
        types.extend(config.output.iter().map(|o| (o.name.as_str(), o.data_type)));
        // The sequence batcher's control inputs and implicit state reach the model as tensors too.
        if let Some(SchedulingChoice::SequenceBatching(sb)) = &config.scheduling_choice {
            for c in &sb.control_input {
                in_names.push(&c.name);
            }
            for st in &sb.state {
                in_names.push(&st.input_name);
                out_names.push(&st.output_name);
                types.insert(&st.input_name, st.data_type);
                types.insert(&st.output_name, st.data_type);
            }
        }
        for (name, t) in &types {
            match DataType::from_config(*t) {
                Some(DataType::Bytes) => {
                    return Err(format!("tensor '{name}' is TYPE_STRING; an AOTInductor package takes no strings"));
                }
                Some(d) if torch.code(d).is_none() => {
                    return Err(format!("tensor '{name}' is {}, which this PyTorch has no dtype for", d.config_name()));
                }
                _ => {}
            }
        }
        let in_plan = spec::plan_inputs(&in_names, &flat_in)?;
        let out_plan = spec::plan_outputs(&out_names, &flat_out)?;
        let dims: HashMap<&str, Vec<i64>> =
            config.output.iter().filter(|o| o.reshape.is_none()).map(|o| (o.name.as_str(), o.dims.clone())).collect();
        let outputs = out_names
            .iter()
            .zip(out_plan)
            .map(|(n, i)| {
                let datatype = types.get(n).and_then(|t| DataType::from_config(*t));
                (n.to_string(), Output { at: i, datatype, dims: dims.get(n).cloned() })
            })
            .collect();
        let library_least = loaded.library.least_rows;
        Ok(AotiInstance {
            torch,
            loaded,
            inputs: in_names.iter().map(|n| n.to_string()).zip(in_plan).collect(),
            outputs,
            threads: threads.max(1),
            batching: config.max_batch_size > 0,
            least_rows: library_least,
            scratch: Vec::new(),
        })
    }

    fn run(&mut self, inputs: &[BackendInput<'_>], outputs: &[&str]) -> std::result::Result<Vec<Tensor>, String> {
        let torch = &*self.torch;
        let container = &self.loaded.container;
        let rows = if self.batching { inputs.first().and_then(|i| i.shape.first().copied()) } else { None };
        // Fewer rows than the package's batch dimension starts at: the last row is repeated up to
        // it, and the answers of the repeats dropped.
        let padded = rows.filter(|&r| r > 0 && r < self.least_rows).map(|_| self.least_rows);
        // The package gets copies: a model may write its inputs in place (`x.add_(1)`), and the
        // request's bytes are shared (an ensemble hands one tensor to several steps).
        self.scratch.resize_with(inputs.len(), Vec::new);
        let mut shapes = Vec::with_capacity(inputs.len());
        for (input, buffer) in inputs.iter().zip(self.scratch.iter_mut()) {
            let (len, mut shape) = (input.data.len(), input.shape.to_vec());
            let total = match (padded, rows) {
                (Some(p), Some(r)) => {
                    shape[0] = p;
                    len / r as usize * p as usize
                }
                _ => len,
            };
            buffer.clear();
            buffer.resize(total.div_ceil(8), 0);
            let bytes = &mut bytemuck::cast_slice_mut::<u64, u8>(buffer)[..total];
            bytes[..len].copy_from_slice(input.data);
            if let (Some(_), Some(r)) = (padded, rows) {
                let row = len / r as usize;
                let last = len - row..len;
                for at in (len..total).step_by(row.max(1)) {
                    bytes.copy_within(last.clone(), at);
                }
            }
            shapes.push((shape, total));
        }
        let mut flat: Vec<Option<ctensor::Tensor<'_>>> = (0..container.inputs).map(|_| None).collect();
        for ((input, buffer), (shape, total)) in inputs.iter().zip(self.scratch.iter_mut()).zip(&shapes) {
            let &at = self
                .inputs
                .get(input.name)
                .ok_or_else(|| format!("unexpected input '{}' for the package", input.name))?;
            let data = &mut bytemuck::cast_slice_mut::<u64, u8>(buffer)[..*total];
            flat[at] = Some(torch.lend(data, shape, input.datatype)?);
        }
        let given: Vec<ctensor::Tensor<'_>> = flat
            .into_iter()
            .enumerate()
            .map(|(k, t)| {
                t.ok_or_else(|| {
                    let name = self.inputs.iter().find(|(_, i)| **i == k).map_or("?", |(n, _)| n.as_str());
                    format!("the package needs input '{name}', which the batch lacks")
                })
            })
            .collect::<std::result::Result<_, _>>()?;
        torch.set_threads(self.threads);
        let produced = container.run(torch, given)?;
        let answer = outputs
            .iter()
            .map(|name| {
                let Output { at, datatype: want, dims } =
                    self.outputs.get(*name).ok_or_else(|| format!("the package has no output '{name}'"))?;
                let (datatype, shape, data) = produced[*at].read(MAX_OUTPUT_BYTES)?;
                if let Some(want) = want.filter(|w| *w != datatype) {
                    return Err(format!(
                        "output '{name}': the configuration expects {}, the model returned {}",
                        want.config_name(),
                        datatype.config_name()
                    ));
                }
                // A scalar is what a config declares as dims [ 1 ] (there is no 0-d config).
                let (mut shape, mut data) = (if shape.is_empty() && rows.is_none() { vec![1] } else { shape }, data);
                check_shape(name, &shape, dims.as_deref(), padded.or(rows))?;
                if let (Some(p), Some(r)) = (padded, rows) {
                    // Only per-row outputs can drop the padding's rows.
                    if shape.first() != Some(&p) {
                        return Err(format!(
                            "output '{name}' has shape {shape:?}, not one row per batch row: a batch of {r} padded to \
                             the {p} rows this package's batch dimension starts at cannot be split back"
                        ));
                    }
                    data.truncate(data.len() / p as usize * r as usize);
                    shape[0] = r;
                }
                Ok(Tensor { name: (*name).to_string(), datatype, shape, data: Bytes::from(data) })
            })
            .collect();
        // Outputs may be views of the input copies: they are read (and deleted) before a large
        // copy is let go (it is not kept for the model's lifetime).
        drop(produced);
        for buffer in self.scratch.iter_mut().filter(|b| b.capacity() > SCRATCH_KEPT / 8) {
            *buffer = Vec::new();
        }
        answer
    }
}

/// An output's shape against the config: the batch's rows first for a batching model, then the
/// dims where they are fixed.
pub(super) fn check_shape(
    name: &str,
    shape: &[i64],
    dims: Option<&[i64]>,
    rows: Option<i64>,
) -> std::result::Result<(), String> {
    let Some(dims) = dims else { return Ok(()) };
    let rest = match rows {
        Some(r) => match shape.split_first() {
            Some((&first, rest)) if first == r => rest,
            _ => return Err(format!("output '{name}' has shape {shape:?}: a batch of {r} needs {r} rows")),
        },
        None => shape,
    };
    if rest.len() != dims.len() || rest.iter().zip(dims).any(|(&s, &d)| d >= 0 && s != d) {
        return Err(format!(
            "output '{name}' has shape {shape:?}, which the configuration's dims {dims:?} do not take"
        ));
    }
    Ok(())
}

impl ModelInstance for AotiInstance {
    fn execute(&mut self, inputs: &[BackendInput<'_>], outputs: &[&str]) -> Result<Vec<Tensor>> {
        self.run(inputs, outputs).map_err(|e| Error::invalid(format!("PyTorch execute failure: {e}")))
    }

    fn runs_anywhere(&self) -> bool {
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn output_shapes_are_checked_against_rows_and_dims() {
        assert!(check_shape("y", &[3, 4], Some(&[4]), Some(3)).is_ok());
        assert!(check_shape("y", &[3, 4], Some(&[-1]), Some(3)).is_ok());
        assert!(check_shape("y", &[2, 4], Some(&[4]), Some(3)).unwrap_err().contains("a batch of 3 needs 3 rows"));
        assert!(check_shape("y", &[3, 5], Some(&[4]), Some(3)).unwrap_err().contains("dims [4]"));
        assert!(check_shape("y", &[], Some(&[4]), Some(3)).is_err());
        assert!(check_shape("y", &[4], Some(&[4]), None).is_ok());
        assert!(check_shape("y", &[7, 7], None, Some(3)).is_ok());
    }

    #[test]
    fn instances_counted_for_sharing_are_the_cpu_ones() {
        let mut config = ModelConfig::default();
        assert_eq!(cpu_instances(&config), 1);
        config.instance_group = vec![
            crate::proto::inference::ModelInstanceGroup { count: 3, kind: 2, ..Default::default() },
            crate::proto::inference::ModelInstanceGroup { count: 2, kind: 1, ..Default::default() },
        ];
        assert_eq!(cpu_instances(&config), 3);
    }
}
