//! The contract between the core and whatever runs a model: a backend loads instances from a
//! model file, and an instance executes one batch at a time on its own thread.
use std::{
    future::Future,
    path::Path,
    pin::Pin,
    sync::{Arc, OnceLock, Weak},
};

use crate::{
    device::DeviceBytes,
    error::{Error, Result},
    proto::inference::ModelConfig,
    request::{InferRequest, InferResponse, Parameters},
    tensor::{DataType, Tensor},
};

/// Most threads a runtime parameter (`intra_op_thread_count`, ...) may ask an instance for.
pub const MAX_THREADS: usize = 1024;

pub mod accelerators;
pub mod fil;
pub mod fil_model_type;
pub mod identity;
pub mod native;
pub mod onnx;
pub mod openvino;
pub mod python;
pub mod pytorch;

/// One input of a batch, in the shape the model sees.
#[derive(Debug, Clone, Copy)]
pub struct BackendInput<'a> {
    pub name: &'a str,
    pub datatype: DataType,
    pub shape: &'a [i64],
    pub data: &'a [u8],
    /// For an instance with device I/O (`device_io`): the input's pieces in the GPU's memory,
    /// in row order (`data` is then empty). Empty: the bytes are `data`.
    pub device: &'a [DeviceBytes],
}

/// Rows of a batch output that one request wants written into GPU memory.
#[derive(Debug, Clone, Copy)]
pub struct DeviceTarget<'a> {
    /// Index into the batch's outputs (as named to `execute_device`).
    pub output: usize,
    pub first_row: usize,
    pub rows: usize,
    pub to: &'a DeviceBytes,
}

/// A batch's outputs from `execute_device`: `written[i]` says output `i` went to its targets
/// (each target its rows, where they fit) and comes back with its shape but no bytes.
#[derive(Debug, Default)]
pub struct Executed {
    pub outputs: Vec<Tensor>,
    pub written: Vec<bool>,
}

impl Executed {
    /// Outputs all in host memory, none written to a target.
    pub fn on_host(outputs: Vec<Tensor>) -> Self {
        Executed { written: vec![false; outputs.len()], outputs }
    }
}

/// An input or output as the model file declares it. `datatype` is None for types that have no
/// protocol equivalent (sequences, maps, complex numbers); `shape` uses -1 for unknown dims.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorInfo {
    pub name: String,
    pub datatype: Option<DataType>,
    pub shape: Vec<i64>,
}

#[derive(Debug, Clone, PartialEq, Default)]
pub struct ModelIo {
    pub inputs: Vec<TensorInfo>,
    pub outputs: Vec<TensorInfo>,
}

/// Where an instance runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Device {
    Cpu,
    Gpu(i32),
}

/// Everything a backend needs to create one instance.
#[derive(Debug, Clone)]
pub struct InstanceSpec<'a> {
    pub model_path: &'a Path,
    pub config: &'a ModelConfig,
    pub device: Device,
    /// Threads this instance may use for one operator (its share of the machine's cores).
    pub intra_op_threads: usize,
    /// Which instance of the version this is (0, 1, ...).
    pub index: usize,
}

/// One request of a batch, for instances that take requests apart (a Python model's
/// `execute(requests)` answers each request on its own).
pub struct BackendRequest<'a> {
    pub id: &'a str,
    pub parameters: &'a Parameters,
    pub inputs: Vec<BackendInput<'a>>,
    pub outputs: Vec<&'a str>,
    /// A decoupled model's responses for this request go here, during or after the batch.
    pub stream: Option<&'a crate::request::StreamTx>,
    /// Its nesting and admission ticket: what the request makes the backend allocate is charged
    /// to it (`Context::charge`).
    pub context: &'a crate::request::Context,
    /// Whether its client is gone (nobody waits for the answer), for a model that asks
    /// (`request.is_cancelled()`); None: never.
    pub cancelled: Option<&'a (dyn Fn() -> bool + Sync)>,
}

/// One request's answer from `execute_each`: its outputs and the response parameters the model
/// set (a Python model's `InferenceResponse(parameters=...)`).
#[derive(Debug, Default)]
pub struct Answer {
    pub outputs: Vec<Tensor>,
    pub parameters: crate::request::Parameters,
}

impl From<Vec<Tensor>> for Answer {
    fn from(outputs: Vec<Tensor>) -> Self {
        Answer { outputs, parameters: Default::default() }
    }
}

/// A loaded copy of a model that executes one batch at a time.
pub trait ModelInstance: Send {
    /// Runs one batch and returns the named outputs, in the order asked.
    fn execute(&mut self, inputs: &[BackendInput<'_>], outputs: &[&str]) -> Result<Vec<Tensor>>;

    /// What the loaded model declares, when the backend can tell (checked against the config).
    fn model_io(&self) -> Option<ModelIo> {
        None
    }

    /// The memory the instance holds, by device (for the statistics' `memory_usage`).
    fn memory(&self) -> Vec<crate::stats::MemoryUse> {
        Vec::new()
    }

    /// The time the last `execute` spent copying its inputs to the device (GPU instances), which
    /// the statistics count as compute_input rather than compute_infer.
    fn copy_in_time(&self) -> Option<std::time::Duration> {
        None
    }

    /// The GPU whose memory this instance reads inputs from and writes outputs to directly
    /// (CUDA shared memory without a pass through the host); None: host memory only.
    fn device_io(&self) -> Option<i32> {
        None
    }

    /// As `execute`, for an instance with device I/O: inputs may be in GPU memory, and outputs
    /// whose `targets` it can write on the device come back `written`. A target whose rows do
    /// not fit it is left alone (the scheduler fails that request).
    fn execute_device(
        &mut self,
        inputs: &[BackendInput<'_>],
        outputs: &[&str],
        _targets: &[DeviceTarget<'_>],
    ) -> Result<Executed> {
        self.execute(inputs, outputs).map(Executed::on_host)
    }

    /// Whether a batch may run on whichever thread asks for it (the scheduler then runs a light
    /// model's batch on the caller's thread when an instance is free, saving two thread
    /// hand-offs): true only for an instance that computes on the host and never waits on the
    /// server or another process.
    fn runs_anywhere(&self) -> bool {
        false
    }

    /// Whether batches reach this instance as separate requests (`execute_each`).
    fn separate_requests(&self) -> bool {
        false
    }

    /// Runs the requests of one batch, each answered (or failed) on its own.
    fn execute_each(&mut self, requests: &[BackendRequest<'_>]) -> Vec<Result<Answer>> {
        requests.iter().map(|r| self.execute(&r.inputs, &r.outputs).map(Answer::from)).collect()
    }
}

pub type HostFuture<'a, T> = Pin<Box<dyn Future<Output = Result<T>> + Send + 'a>>;

/// What a backend's own processes may ask of the server: inference on any model (BLS) and
/// model control, as engine calls.
pub trait Host: Send + Sync {
    fn infer(&self, req: InferRequest) -> HostFuture<'_, InferResponse>;
    /// A request whose responses stream (a decoupled model's 0..n, any other model's one).
    fn infer_stream(&self, req: InferRequest) -> HostFuture<'_, crate::request::ResponseStream>;
    fn load(&self, name: String, config: Option<String>, files: Vec<(String, Vec<u8>)>) -> HostFuture<'_, ()>;
    fn unload(&self, name: String) -> HostFuture<'_, ()>;
    fn ready(&self, name: &str, version: Option<u64>) -> bool;
}

/// The server, once it exists (backends are built before the engine).
pub type HostSlot = Arc<OnceLock<Weak<dyn Host>>>;

pub trait Backend: Send + Sync {
    /// The name config.pbtxt uses in `backend:`.
    fn name(&self) -> &'static str;
    /// The inputs and outputs the model file declares (for config auto-complete and checks).
    fn model_io(&self, model_path: &Path) -> Result<ModelIo>;
    /// Loads one instance.
    fn load(&self, spec: &InstanceSpec<'_>) -> Result<Box<dyn ModelInstance>>;
    /// Completes the config from the model itself when the model can say (a Python model's
    /// `auto_complete_config`); `model_path` is the newest version's file.
    fn auto_complete(&self, _model_path: &Path, _config: &mut ModelConfig) -> Result<()> {
        Ok(())
    }
}

/// Makes a backend ferry does not build in, from its name.
type FindBackend = dyn Fn(&str) -> Option<Arc<dyn Backend>> + Send + Sync;

/// The backends this server has, found by the config's `backend` name.
#[derive(Clone)]
pub struct Backends {
    all: Vec<Arc<dyn Backend>>,
    /// Makes a backend ferry does not build in, by name (Python-based backends), once.
    found: Option<Arc<FindBackend>>,
    made: Arc<std::sync::Mutex<Vec<Arc<dyn Backend>>>>,
}

impl Backends {
    pub fn new(all: Vec<Arc<dyn Backend>>) -> Self {
        Backends { all, found: None, made: Default::default() }
    }

    /// Backends found by name when none built in has it.
    pub fn with_found(mut self, found: impl Fn(&str) -> Option<Arc<dyn Backend>> + Send + Sync + 'static) -> Self {
        self.found = Some(Arc::new(found));
        self
    }

    pub fn get(&self, name: &str) -> Result<Arc<dyn Backend>> {
        if let Some(b) = self.all.iter().find(|b| b.name() == name) {
            return Ok(Arc::clone(b));
        }
        let mut made = self.made.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(b) = made.iter().find(|b| b.name() == name) {
            return Ok(Arc::clone(b));
        }
        if let Some(b) = self.found.as_ref().and_then(|f| f(name)) {
            made.push(Arc::clone(&b));
            return Ok(b);
        }
        let known: Vec<&str> = self.all.iter().map(|b| b.name()).collect();
        Err(Error::unsupported(format!("backend '{name}' is not available in ferry (available: {})", known.join(", "))))
    }
}
pub mod library;
