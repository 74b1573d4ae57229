//! TorchScript models (`pytorch_libtorch`, `model.pt`) run inside the server, through ferry's
//! small C++ shim over libtorch's C++ API (`shim.cpp`, compiled against the PyTorch the server
//! runs: `compile`). A batch is one call of `forward` over copies of the batch's bytes (a model may
//! write its inputs). What this path does not take runs in a PyTorch process, as before: a GPU
//! instance, a model with its own `EXECUTION_ENV_PATH`, the parameters that change libtorch for the
//! whole process (`DISABLE_OPTIMIZED_EXECUTION`, `ENABLE_JIT_EXECUTOR`, `ENABLE_JIT_PROFILING`,
//! `INTER_OP_THREAD_COUNT`), or no shim (no C++ compiler, no PyTorch headers).
use std::{
    collections::HashMap,
    ffi::CString,
    path::Path,
    sync::{Arc, Mutex, OnceLock, Weak},
};

use bytes::Bytes;

use super::{
    super::{BackendInput, Device, InstanceSpec, ModelInstance},
    aoti::{Output, check_shape, file_identity, spec},
    libtorch::{self, LibTorch},
    params::Params,
};
use crate::{
    error::{Error, Result},
    proto::inference::{ModelConfig, model_config::SchedulingChoice},
    tensor::{DataType, Tensor, bytes_elements, push_bytes_element},
};

pub mod compile;
mod ffi;

use ffi::{Argument, Module, RawTensor, Shim};

/// Parameters that change libtorch for the whole process: a model naming one runs in a process.
const PROCESS_WIDE: &[&str] =
    &["DISABLE_OPTIMIZED_EXECUTION", "ENABLE_JIT_EXECUTOR", "ENABLE_JIT_PROFILING", "INTER_OP_THREAD_COUNT"];

pub struct TorchScript {
    torch: Arc<LibTorch>,
    shim: OnceLock<std::result::Result<Arc<Shim>, String>>,
    /// Modules the version's instances share (`ENABLE_WEIGHT_SHARING`), by file.
    shared: Mutex<HashMap<String, Weak<Module>>>,
}

impl TorchScript {
    pub fn new(torch: Arc<LibTorch>) -> Self {
        TorchScript { torch, shim: OnceLock::new(), shared: Mutex::default() }
    }

    fn shim(&self) -> std::result::Result<Arc<Shim>, String> {
        self.shim
            .get_or_init(|| {
                let torch = self.torch.get()?;
                let version = libtorch::version(&torch.path)
                    .ok_or_else(|| format!("no torch/version.py beside '{}'", torch.path.display()))?;
                let mut built = compile::shim(&torch.path, &version)?;
                let shim = match Shim::load(&built.path) {
                    // A cached library that does not load (cut short, say) is built again, once.
                    Err(e) if built.cached => {
                        tracing::warn!(shim = %built.path.display(), "{e}; building it again");
                        let _ = std::fs::remove_file(&built.path);
                        built = compile::shim(&torch.path, &version)?;
                        Shim::load(&built.path)?
                    }
                    loaded => loaded?,
                };
                tracing::info!(torch = %version, shim = %built.path.display(), "TorchScript models run inside the server");
                Ok(Arc::new(shim))
            })
            .clone()
    }

    /// An instance running in the server, or None when this one runs in a PyTorch process.
    pub fn load(&self, spec: &InstanceSpec<'_>) -> Result<Option<Box<dyn ModelInstance>>> {
        let config = spec.config;
        if config.platform != "pytorch_libtorch" {
            return Ok(None);
        }
        let elsewhere = |why: &str| {
            if spec.index == 0 {
                tracing::info!(model = %config.name, "runs in a PyTorch process: {why}");
            }
            Ok(None)
        };
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
        if let Some(key) = PROCESS_WIDE.iter().find(|k| config.parameters.contains_key(**k)) {
            return elsewhere(&format!("parameter {key} changes PyTorch for the whole process it runs in"));
        }
        let shim = match self.shim() {
            Ok(s) => s,
            Err(e) => return elsewhere(&e),
        };
        let named = |e: String| Error::invalid(format!("model '{}': {e}", config.name));
        let params = Params::of(config, spec.index == 0).map_err(named)?;
        let module = match self.module(shim, spec.model_path, params.share_weights).map_err(named)? {
            Ok(m) => m,
            Err(why) => return elsewhere(&why),
        };
        let plan = Plan::new(config, &module.arguments().map_err(named)?).map_err(named)?;
        Ok(Some(Box::new(ScriptInstance {
            module,
            plan,
            threads: params.threads.unwrap_or(spec.intra_op_threads).max(1),
            inference_mode: params.inference_mode,
            batching: config.max_batch_size > 0,
        })))
    }

    /// The instance's module: its own, or under `ENABLE_WEIGHT_SHARING` a copy sharing the
    /// parameters of the version's first (each instance keeps attribute slots of its own, so a
    /// forward that assigns `self.x` never races another instance's). Ok(Err(why)): it runs in a
    /// process.
    fn module(
        &self,
        shim: Arc<Shim>,
        path: &Path,
        share: bool,
    ) -> std::result::Result<std::result::Result<Module, String>, String> {
        let meta = std::fs::metadata(path).map_err(|_| format!("model file '{}' not found", path.display()))?;
        if !meta.is_file() {
            return Err(format!("model file '{}' is not a regular file", path.display()));
        }
        let key = share.then(|| file_identity(path)).flatten();
        let found = key
            .as_ref()
            .and_then(|k| self.shared.lock().unwrap_or_else(|p| p.into_inner()).get(k).and_then(Weak::upgrade));
        if let Some(base) = found {
            return base.share().map(Ok);
        }
        let module = load_deep(shim, path).map_err(|e| format!("cannot load '{}': {e}", path.display()))?;
        if let Some(why) = faults(&module.faulting_ops()?) {
            return Ok(Err(why));
        }
        let Some(k) = key else { return Ok(Ok(module)) };
        let base = Arc::new(module);
        let mut shared = self.shared.lock().unwrap_or_else(|p| p.into_inner());
        shared.retain(|_, w| w.strong_count() > 0);
        shared.insert(k, Arc::downgrade(&base));
        drop(shared);
        let instance = base.share()?;
        // The base lives as long as an instance shares it (its weights are theirs).
        Ok(Ok(instance.keeping(base)))
    }
}

/// Loads a module on a thread with a large stack: TorchScript compiles the model's code as it
/// loads, recursively, and deeply nested code (a long generated expression) needs more than a
/// worker thread's 2 MiB.
fn load_deep(shim: Arc<Shim>, path: &Path) -> std::result::Result<Module, String> {
    let path = path.to_path_buf();
    std::thread::Builder::new()
        .name("torchscript-load".into())
        .stack_size(LOAD_STACK)
        .spawn(move || Module::load(shim, &path))
        .map_err(|e| format!("cannot start a thread to load it: {e}"))?
        .join()
        .map_err(|_| "loading it failed".to_string())?
}

/// The stack a module is loaded on.
const LOAD_STACK: usize = 256 << 20;

/// Where a config input goes: forward's argument at a position, or a keyword argument.
#[derive(Debug, Clone, PartialEq)]
enum Slot {
    Arg(usize),
    Keyword(CString),
}

/// The config's names mapped to forward's arguments and to what forward returns, as Triton's
/// PyTorch backend maps them.
#[derive(Debug)]
struct Plan {
    inputs: HashMap<String, (Slot, Option<DataType>)>,
    /// Output name → its position in what forward returns, its datatype and its dims.
    outputs: HashMap<String, Output>,
}

impl Plan {
    fn new(config: &ModelConfig, args: &[Argument]) -> std::result::Result<Plan, String> {
        let mut ins: Vec<(&str, i32)> = config.input.iter().map(|i| (i.name.as_str(), i.data_type)).collect();
        let mut outs: Vec<(&str, i32, Option<Vec<i64>>)> = config
            .output
            .iter()
            .map(|o| (o.name.as_str(), o.data_type, o.reshape.is_none().then(|| o.dims.clone())))
            .collect();
        // The sequence batcher's control inputs and implicit state reach the model as tensors too.
        if let Some(SchedulingChoice::SequenceBatching(sb)) = &config.scheduling_choice {
            for c in &sb.control_input {
                let t = c.control.first().map_or(0, |k| k.data_type);
                ins.push((c.name.as_str(), t));
            }
            for st in &sb.state {
                ins.push((st.input_name.as_str(), st.data_type));
                outs.push((st.output_name.as_str(), st.data_type, None));
            }
        }
        let names: Vec<&str> = ins.iter().map(|(n, _)| *n).collect();
        let slots = plan_inputs(&names, args)?;
        let outputs_at = positions(&outs.iter().map(|(n, _, _)| *n).collect::<Vec<_>>(), "outputs")?
            .unwrap_or_else(|| (0..outs.len()).collect());
        Ok(Plan {
            inputs: ins.iter().zip(slots).map(|((n, t), s)| (n.to_string(), (s, DataType::from_config(*t)))).collect(),
            outputs: outs
                .into_iter()
                .zip(outputs_at)
                .map(|((n, t, dims), at)| (n.to_string(), Output { at, datatype: DataType::from_config(t), dims }))
                .collect(),
        })
    }
}

/// Each name's position by the `<name>__<i>` / `ARGS[i]` convention, or None when not every name
/// follows it; the positions must be 0..n-1, each once.
fn positions(names: &[&str], what: &str) -> std::result::Result<Option<Vec<usize>>, String> {
    let Some(found) = names.iter().map(|n| spec::ordinal(n)).collect::<Option<Vec<usize>>>() else { return Ok(None) };
    let mut sorted = found.clone();
    sorted.sort_unstable();
    if sorted.iter().enumerate().any(|(i, p)| i != *p) {
        return Err(format!(
            "{what} {names:?} are numbered {sorted:?}: the positions must be 0..{}, each once",
            names.len().saturating_sub(1)
        ));
    }
    Ok(Some(found))
}

fn plan_inputs(names: &[&str], args: &[Argument]) -> std::result::Result<Vec<Slot>, String> {
    let arg_names: Vec<&str> = args.iter().map(|a| a.name.as_str()).collect();
    let slots: Vec<Slot> = if let Some(at) = positions(names, "inputs")? {
        at.into_iter().map(Slot::Arg).collect()
    } else if names.iter().all(|n| spec::keyword(n).is_some()) {
        names
            .iter()
            .map(|n| CString::new(spec::keyword(n).unwrap_or_default()).map(Slot::Keyword))
            .collect::<std::result::Result<_, _>>()
            .map_err(|_| "an input name holds a NUL byte".to_string())?
    } else if !arg_names.is_empty() && names.iter().all(|n| arg_names.contains(n)) {
        names.iter().map(|n| Slot::Arg(arg_names.iter().position(|a| a == n).unwrap_or_default())).collect()
    } else if !arg_names.is_empty() && arg_names.len() < names.len() {
        return Err(format!(
            "the model's forward takes {} inputs ({arg_names:?}), the config names {} ({names:?})",
            arg_names.len(),
            names.len()
        ));
    } else {
        (0..names.len()).map(Slot::Arg).collect()
    };
    if let Some(k) = slots.iter().find_map(|s| match s {
        Slot::Keyword(k) if !arg_names.contains(&k.to_string_lossy().as_ref()) => Some(k.to_string_lossy()),
        _ => None,
    }) {
        return Err(format!("the model's forward has no argument '{k}' (it takes {arg_names:?})"));
    }
    let top = slots.iter().filter_map(|s| if let Slot::Arg(p) = s { Some(p + 1) } else { None }).max().unwrap_or(0);
    let required = args.iter().filter(|a| a.required).count();
    // Every required argument must be named, by position or by keyword.
    let covered = |i: usize| {
        slots.iter().any(|s| match s {
            Slot::Arg(p) => *p == i,
            Slot::Keyword(k) => k.to_bytes() == args[i].name.as_bytes(),
        })
    };
    if top > args.len() || (0..args.len()).any(|i| args[i].required && !covered(i)) {
        return Err(format!(
            "configuration expects {} inputs, the model's forward takes {} ({required} required: {arg_names:?})",
            slots.len(),
            args.len()
        ));
    }
    Ok(slots)
}

struct ScriptInstance {
    module: Module,
    plan: Plan,
    threads: usize,
    inference_mode: bool,
    batching: bool,
}

/// The most strings one call hands a model, over all its inputs: each becomes a C++ string in a
/// TorchScript list, about 200 bytes of the server's memory with the copies around it, however
/// short it is (bounding what a request of empty strings can make the server allocate).
const MAX_STRINGS: usize = 1 << 20;

/// A BYTES input's elements as the shim takes them (text, pointers and lengths).
struct Strings {
    pointers: Vec<*const std::ffi::c_char>,
    lengths: Vec<i64>,
}

impl ScriptInstance {
    fn run(&mut self, inputs: &[BackendInput<'_>], outputs: &[&str]) -> std::result::Result<Vec<Tensor>, String> {
        let rows = if self.batching { inputs.first().and_then(|i| i.shape.first().copied()) } else { None };
        // The shim copies each tensor into one of PyTorch's own (the model may write it, or keep it).
        let mut strings: Vec<Option<Strings>> = Vec::with_capacity(inputs.len());
        let mut count = 0usize;
        for input in inputs {
            if input.datatype == DataType::Bytes {
                let mut s = Strings { pointers: Vec::new(), lengths: Vec::new() };
                for e in bytes_elements(input.data) {
                    count += 1;
                    if count > MAX_STRINGS {
                        return Err(format!(
                            "more than {MAX_STRINGS} strings in one call (input '{}'); a TorchScript model run in \
                             the server takes at most that many",
                            input.name
                        ));
                    }
                    let e = e.map_err(|e| e.message().to_string())?;
                    std::str::from_utf8(e).map_err(|e| {
                        format!("a string input holds bytes that are not UTF-8 ({e}); TorchScript strings are text")
                    })?;
                    s.pointers.push(e.as_ptr().cast());
                    s.lengths.push(e.len() as i64);
                }
                strings.push(Some(s));
            } else {
                strings.push(None);
            }
        }
        let mut positional: Vec<Option<RawTensor>> = Vec::new();
        let mut keywords: Vec<(CString, RawTensor)> = Vec::new();
        for (input, text) in inputs.iter().zip(&strings) {
            let (slot, _) = self
                .plan
                .inputs
                .get(input.name)
                .ok_or_else(|| format!("unexpected input '{}' for the model", input.name))?;
            let raw = match text {
                Some(s) => RawTensor {
                    is_strings: 1,
                    count: s.pointers.len() as i64,
                    strings: s.pointers.as_ptr(),
                    lengths: s.lengths.as_ptr(),
                    ..RawTensor::default()
                },
                None => RawTensor {
                    dtype: input.datatype.config(),
                    ndim: input.shape.len() as i32,
                    shape: input.shape.as_ptr(),
                    data: input.data.as_ptr() as *mut std::ffi::c_void,
                    nbytes: input.data.len() as i64,
                    ..RawTensor::default()
                },
            };
            match slot {
                Slot::Arg(p) => {
                    if positional.len() <= *p {
                        positional.resize(p + 1, None);
                    }
                    positional[*p] = Some(raw);
                }
                Slot::Keyword(k) => keywords.push((k.clone(), raw)),
            }
        }
        let positional: Vec<RawTensor> = positional
            .into_iter()
            .enumerate()
            .map(|(p, t)| {
                t.ok_or_else(|| format!("no value for the model's input at position {p} (a missing optional input)"))
            })
            .collect::<std::result::Result<_, _>>()?;
        let result = self.module.run(&positional, &keywords, self.inference_mode, self.threads)?;
        self.answer(&result, outputs, rows)
    }

    /// The named outputs from what forward returned: by key from a dict, else by position.
    fn answer(
        &self,
        result: &ffi::Outputs<'_>,
        outputs: &[&str],
        rows: Option<i64>,
    ) -> std::result::Result<Vec<Tensor>, String> {
        let all: Vec<(String, RawTensor)> = (0..result.len()).filter_map(|i| result.get(i)).collect();
        let keyed = result.keyed();
        outputs
            .iter()
            .map(|name| {
                let Output { at, datatype: want, dims } =
                    self.plan.outputs.get(*name).ok_or_else(|| format!("the model has no output '{name}'"))?;
                let raw = if keyed {
                    let keys: Vec<&str> = all.iter().map(|(k, _)| k.as_str()).collect();
                    all.iter().find(|(k, _)| k == name).map(|(_, t)| *t).ok_or_else(|| {
                        format!("the model returns a dict with keys {keys:?}; the config's output '{name}' must be among them")
                    })?
                } else {
                    all.get(*at).map(|(_, t)| *t).ok_or_else(|| {
                        format!("the model returned {} outputs; the config names output '{name}' at position {at}", all.len())
                    })?
                };
                let tensor = to_tensor(name, &raw, rows, dims.as_deref())?;
                if let Some(w) = want.filter(|w| *w != tensor.datatype) {
                    return Err(format!(
                        "output '{name}': the configuration expects {}, the model returned {}",
                        w.config_name(),
                        tensor.datatype.config_name()
                    ));
                }
                if tensor.datatype != DataType::Bytes {
                    check_shape(name, &tensor.shape, dims.as_deref(), rows)?;
                }
                Ok(tensor)
            })
            .collect()
    }
}

/// An output as a protocol tensor: its bytes copied out of what the shim holds.
fn to_tensor(
    name: &str,
    raw: &RawTensor,
    rows: Option<i64>,
    dims: Option<&[i64]>,
) -> std::result::Result<Tensor, String> {
    if raw.is_strings != 0 {
        let n = raw.count.max(0) as usize;
        let mut data = Vec::new();
        if n > 0 && (raw.strings.is_null() || raw.lengths.is_null()) {
            return Err(format!("output '{name}' is not a list of strings ferry can read"));
        }
        for i in 0..n {
            // SAFETY: the shim's arrays hold `count` strings, valid while the result lives.
            let s =
                unsafe { std::slice::from_raw_parts(*raw.strings.add(i) as *const u8, *raw.lengths.add(i) as usize) };
            push_bytes_element(&mut data, s);
        }
        let shape = if rows.is_some() && dims == Some(&[1]) { vec![n as i64, 1] } else { vec![n as i64] };
        return Ok(Tensor { name: name.to_string(), datatype: DataType::Bytes, shape, data: Bytes::from(data) });
    }
    let datatype = DataType::from_config(raw.dtype)
        .ok_or_else(|| format!("output '{name}' is a tensor of a dtype that has no KServe datatype"))?;
    if !(0..=64).contains(&raw.ndim) || raw.nbytes < 0 || (raw.nbytes > 0 && raw.data.is_null()) {
        return Err(format!("output '{name}' is not a tensor ferry can read"));
    }
    // SAFETY: the shim's shape has ndim entries, and its data nbytes bytes, while the result lives.
    let shape = unsafe { std::slice::from_raw_parts(raw.shape, raw.ndim as usize) }.to_vec();
    let data = if raw.nbytes == 0 {
        Vec::new()
    } else {
        // SAFETY: as above.
        unsafe { std::slice::from_raw_parts(raw.data as *const u8, raw.nbytes as usize) }.to_vec()
    };
    // A scalar is what a config declares as dims [ 1 ].
    let shape = if shape.is_empty() && rows.is_none() { vec![1] } else { shape };
    Ok(Tensor { name: name.to_string(), datatype, shape, data: Bytes::from(data) })
}

/// Why a model whose forward calls `kinds` (the shim's list: dividing operators, and the calls it
/// cannot look into) must run in a process, if it must.
fn faults(kinds: &str) -> Option<String> {
    let (opaque, rest): (Vec<&str>, Vec<&str>) =
        kinds.split(", ").filter(|k| !k.is_empty()).partition(|k| k.starts_with("prim::"));
    let (unchecked, dividing): (Vec<&str>, Vec<&str>) = rest.into_iter().partition(|k| k.contains("_unsafe_"));
    if !unchecked.is_empty() {
        return Some(format!(
            "its forward calls {}, which indexes without bounds checks (an index out of range can end the process)",
            unchecked.join(", ")
        ));
    }
    if !dividing.is_empty() {
        return Some(format!(
            "its forward calls {}, which on integers can fault the process (INT64_MIN divided by -1)",
            dividing.join(", ")
        ));
    }
    (!opaque.is_empty()).then(|| {
        format!(
            "its forward runs code through {}, which ferry cannot inspect for integer divisions (INT64_MIN divided \
             by -1 faults the process)",
            opaque.join(", ")
        )
    })
}

impl ModelInstance for ScriptInstance {
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

    fn args(names: &[(&str, bool)]) -> Vec<Argument> {
        names.iter().map(|(n, r)| Argument { name: n.to_string(), required: *r }).collect()
    }

    #[test]
    fn a_model_that_must_run_in_a_process_says_why() {
        assert_eq!(faults(""), None);
        assert!(faults("aten::divmod").unwrap().starts_with("its forward calls aten::divmod, which on integers"));
        assert!(faults("prim::fork").unwrap().starts_with("its forward runs code through prim::fork, which ferry"));
        // A division found is the reason, whatever else there is.
        assert!(faults("prim::fork, aten::fmod").unwrap().starts_with("its forward calls aten::fmod, which"));
        assert!(faults("aten::_unsafe_index").unwrap().contains("indexes without bounds checks"));
    }

    #[test]
    fn inputs_map_as_tritons_pytorch_backend_maps_them() {
        let two = args(&[("count", true), ("scale", true)]);
        // By position.
        assert_eq!(plan_inputs(&["INPUT__1", "INPUT__0"], &two).unwrap(), [Slot::Arg(1), Slot::Arg(0)]);
        // By forward's argument names, in any order.
        assert_eq!(plan_inputs(&["scale", "count"], &two).unwrap(), [Slot::Arg(1), Slot::Arg(0)]);
        // By keyword.
        let kw = plan_inputs(&["KWARGS[scale]", "KWARGS[count]"], &two).unwrap();
        assert_eq!(kw, [Slot::Keyword(CString::new("scale").unwrap()), Slot::Keyword(CString::new("count").unwrap())]);
        // Else in config order.
        assert_eq!(plan_inputs(&["a", "b"], &two).unwrap(), [Slot::Arg(0), Slot::Arg(1)]);
    }

    #[test]
    fn inputs_the_model_cannot_take_are_refused() {
        let two = args(&[("x", true), ("y", true)]);
        let err = plan_inputs(&["INPUT__0", "INPUT__1", "INPUT__2"], &two).unwrap_err();
        assert!(err.starts_with("configuration expects 3 inputs, the model's forward takes 2"), "{err}");
        assert!(plan_inputs(&["a", "b", "c"], &two).unwrap_err().contains("forward takes 2 inputs"));
        assert!(plan_inputs(&["INPUT__0"], &two).unwrap_err().contains("2 required"));
        assert!(plan_inputs(&["INPUT__0", "INPUT__2"], &two).unwrap_err().contains("must be 0..1"));
        assert!(plan_inputs(&["KWARGS[x]", "KWARGS[z]"], &two).unwrap_err().contains("no argument 'z'"));
        // An optional argument may be left out, a required one not.
        let optional = args(&[("x", true), ("y", false)]);
        assert_eq!(plan_inputs(&["x"], &optional).unwrap(), [Slot::Arg(0)]);
        assert!(plan_inputs(&["y"], &optional).unwrap_err().contains("1 required"));
        assert!(plan_inputs(&["KWARGS[y]"], &optional).unwrap_err().contains("1 required"));
    }
}
