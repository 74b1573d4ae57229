//! A GPU instance's batch path through ONNX Runtime's I/O binding: each input is gathered into a
//! page-locked host tensor kept across batches (made again only when its shape or type changes),
//! bound to the session (one host-to-device copy per batch, which page-locked memory makes a
//! direct DMA), and each output is bound to host memory (one device-to-host copy per batch).
use std::collections::HashMap;

use ort::{
    memory::{AllocationDevice, Allocator, AllocatorType, MemoryInfo, MemoryType},
    session::{IoBinding, Session},
    value::{DynTensor, TensorElementType},
};

use super::take_outputs;
use crate::{
    backend::BackendInput,
    error::{Error, Result},
    tensor::{DataType, Tensor},
};

pub struct Staging {
    allocator: Allocator,
    binding: IoBinding,
    host: MemoryInfo<'static>,
    tensors: HashMap<String, DynTensor>,
    /// How long the last batch's inputs took to reach the device.
    pub copy_in: std::time::Duration,
}

fn element(datatype: DataType) -> Option<TensorElementType> {
    Some(match datatype {
        DataType::Bool => TensorElementType::Bool,
        DataType::Uint8 => TensorElementType::Uint8,
        DataType::Uint16 => TensorElementType::Uint16,
        DataType::Uint32 => TensorElementType::Uint32,
        DataType::Uint64 => TensorElementType::Uint64,
        DataType::Int8 => TensorElementType::Int8,
        DataType::Int16 => TensorElementType::Int16,
        DataType::Int32 => TensorElementType::Int32,
        DataType::Int64 => TensorElementType::Int64,
        DataType::Fp16 => TensorElementType::Float16,
        DataType::Fp32 => TensorElementType::Float32,
        DataType::Fp64 => TensorElementType::Float64,
        DataType::Bf16 => TensorElementType::Bfloat16,
        DataType::Bytes => return None,
    })
}

fn ort(e: impl std::fmt::Display) -> Error {
    Error::internal(format!("ONNX Runtime I/O binding: {e}"))
}

impl Staging {
    /// Staging in page-locked memory for a CUDA session.
    pub fn pinned(session: &Session) -> ort::Result<Staging> {
        Self::on(session, AllocationDevice::CUDA_PINNED, MemoryType::CPUInput)
    }

    /// Staging in ordinary host memory: the same path on a CPU session (for tests).
    #[cfg(test)]
    pub fn host(session: &Session) -> ort::Result<Staging> {
        Self::on(session, AllocationDevice::CPU, MemoryType::Default)
    }

    fn on(session: &Session, device: AllocationDevice<'static>, kind: MemoryType) -> ort::Result<Staging> {
        let allocator = Allocator::new(session, MemoryInfo::new(device, 0, AllocatorType::Device, kind)?)?;
        let host = MemoryInfo::new(AllocationDevice::CPU, 0, AllocatorType::Device, MemoryType::Default)?;
        Ok(Staging {
            allocator,
            binding: session.create_binding()?,
            host,
            tensors: HashMap::new(),
            copy_in: std::time::Duration::ZERO,
        })
    }

    /// Whether this batch can go this way (string tensors cannot be staged as bytes).
    pub fn fits(inputs: &[BackendInput<'_>]) -> bool {
        inputs.iter().all(|i| element(i.datatype).is_some())
    }

    /// Runs one batch: stage and bind the inputs, bind the outputs to host memory, run.
    pub fn run(&mut self, session: &mut Session, inputs: &[BackendInput<'_>], outputs: &[&str]) -> Result<Vec<Tensor>> {
        let started = std::time::Instant::now();
        for input in inputs {
            let ty = element(input.datatype).ok_or_else(|| ort("string inputs are not staged"))?;
            let fits = self
                .tensors
                .get(input.name)
                .is_some_and(|t| *t.data_type() == ty && t.shape().iter().eq(input.shape.iter()));
            if !fits {
                let tensor = DynTensor::new(&self.allocator, ty, input.shape.to_vec()).map_err(ort)?;
                self.tensors.insert(input.name.to_string(), tensor);
            }
            let tensor = self.tensors.get_mut(input.name).expect("inserted above");
            let expected = ty.byte_size(input.shape.iter().map(|&d| d.max(0) as usize).product()).unwrap_or(0);
            if expected != input.data.len() {
                return Err(Error::internal(format!(
                    "input '{}': {} bytes for a {expected}-byte tensor",
                    input.name,
                    input.data.len()
                )));
            }
            if expected > 0 {
                // SAFETY: the tensor was allocated for exactly `expected` bytes of host memory
                // (page-locked or ordinary), and the source holds as many.
                unsafe {
                    std::ptr::copy_nonoverlapping(input.data.as_ptr(), tensor.data_ptr_mut().cast::<u8>(), expected);
                }
            }
            self.binding.bind_input(input.name, tensor).map_err(ort)?;
        }
        // Binding queues the copies; waiting for them here times the copy apart from the run.
        self.binding.synchronize_inputs().map_err(ort)?;
        self.copy_in = started.elapsed();
        self.binding.clear_outputs();
        for name in outputs {
            self.binding.bind_output_to_device(*name, &self.host).map_err(ort)?;
        }
        let mut results = session
            .run_binding(&self.binding)
            .map_err(|e| Error::internal(format!("ONNX Runtime failed to run the model: {e}")))?;
        take_outputs(&mut results, outputs)
    }
}
