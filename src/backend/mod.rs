//! The contract between the core and whatever runs a model: a backend loads instances from a
//! model file, and an instance executes one batch at a time on its own thread.
use std::{path::Path, sync::Arc};

use crate::{
    error::{Error, Result},
    proto::inference::ModelConfig,
    tensor::{DataType, Tensor},
};

pub mod identity;
pub mod onnx;

/// One input of a batch, in the shape the model sees.
#[derive(Debug, Clone, Copy)]
pub struct BackendInput<'a> {
    pub name: &'a str,
    pub datatype: DataType,
    pub shape: &'a [i64],
    pub data: &'a [u8],
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
}

/// A loaded copy of a model that executes one batch at a time.
pub trait ModelInstance: Send {
    /// Runs one batch and returns the named outputs, in the order asked.
    fn execute(&mut self, inputs: &[BackendInput<'_>], outputs: &[&str]) -> Result<Vec<Tensor>>;

    /// What the loaded model declares, when the backend can tell (checked against the config).
    fn model_io(&self) -> Option<ModelIo> {
        None
    }
}

pub trait Backend: Send + Sync {
    /// The name config.pbtxt uses in `backend:`.
    fn name(&self) -> &'static str;
    /// The inputs and outputs the model file declares (for config auto-complete and checks).
    fn model_io(&self, model_path: &Path) -> Result<ModelIo>;
    /// Loads one instance.
    fn load(&self, spec: &InstanceSpec<'_>) -> Result<Box<dyn ModelInstance>>;
}

/// The backends this server has, found by the config's `backend` name.
#[derive(Clone)]
pub struct Backends {
    all: Vec<Arc<dyn Backend>>,
}

impl Backends {
    pub fn new(all: Vec<Arc<dyn Backend>>) -> Self {
        Backends { all }
    }

    pub fn get(&self, name: &str) -> Result<Arc<dyn Backend>> {
        self.all.iter().find(|b| b.name() == name).cloned().ok_or_else(|| {
            let known: Vec<&str> = self.all.iter().map(|b| b.name()).collect();
            Error::unsupported(format!("backend '{name}' is not available in ferry (available: {})", known.join(", ")))
        })
    }
}
pub mod ort_library;
