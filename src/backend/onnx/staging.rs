//! A GPU instance's batch path through ONNX Runtime's I/O binding: each input is gathered into a
//! page-locked host tensor kept across batches (made again only when its shape or type changes),
//! bound to the session (one host-to-device copy per batch, which page-locked memory makes a
//! direct DMA), and each output is bound to host memory (one device-to-host copy per batch).
//! Tensors in CUDA shared memory skip the host: an input's pieces are copied device to device
//! into a GPU tensor kept the same way, and an output every request wants in GPU memory is
//! bound there and copied device to device into each request's region.
use std::collections::HashMap;

use bytes::Bytes;
use ort::{
    memory::{AllocationDevice, Allocator, AllocatorType, MemoryInfo, MemoryType},
    session::{IoBinding, Session},
    value::{DynTensor, DynTensorValueType, TensorElementType, ValueType},
};

use super::take_outputs;
use crate::{
    backend::{BackendInput, DeviceTarget, Executed},
    device::DeviceBytes,
    error::{Error, Result},
    tensor::{DataType, Tensor, element_count},
};

pub struct Staging {
    allocator: Allocator,
    binding: IoBinding,
    host: MemoryInfo<'static>,
    tensors: HashMap<String, DynTensor>,
    /// The GPU's own memory, for inputs that arrive there (CUDA shared memory) and outputs that
    /// go back there; None when ONNX Runtime gave no allocator for it.
    device: Option<DeviceMemory>,
    /// How long the last batch's inputs took to reach the device.
    pub copy_in: std::time::Duration,
}

/// Tensors in a GPU's memory, kept across batches like the page-locked ones.
struct DeviceMemory {
    gpu: i32,
    allocator: Allocator,
    info: MemoryInfo<'static>,
    tensors: HashMap<String, DynTensor>,
}

/// A tensor of `ty` and `shape` made with `allocator`, reused from `kept` when it still fits.
fn kept_tensor<'a>(
    kept: &'a mut HashMap<String, DynTensor>,
    allocator: &Allocator,
    name: &str,
    ty: TensorElementType,
    shape: &[i64],
) -> Result<&'a mut DynTensor> {
    let fits = kept.get(name).is_some_and(|t| *t.data_type() == ty && t.shape().iter().eq(shape.iter()));
    if !fits {
        let tensor = DynTensor::new(allocator, ty, shape.to_vec()).map_err(ort)?;
        kept.insert(name.to_string(), tensor);
    }
    Ok(kept.get_mut(name).expect("inserted above"))
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
    /// Staging in page-locked memory for a CUDA session on `gpu`, and device memory there for
    /// CUDA shared-memory tensors (without it, they pass through the staging).
    pub fn pinned(session: &Session, gpu: i32) -> ort::Result<Staging> {
        let mut staging = Self::on(session, AllocationDevice::CUDA_PINNED, MemoryType::CPUInput)?;
        match MemoryInfo::new(AllocationDevice::CUDA, gpu, AllocatorType::Device, MemoryType::Default)
            .and_then(|info| Ok((Allocator::new(session, info.clone())?, info)))
        {
            Ok((allocator, info)) => {
                staging.device = Some(DeviceMemory { gpu, allocator, info, tensors: HashMap::new() })
            }
            Err(e) => tracing::warn!(
                gpu,
                "no ONNX Runtime allocator for GPU memory ({e}); CUDA shared-memory tensors pass through the host"
            ),
        }
        Ok(staging)
    }

    /// Staging in ordinary host memory: the same path on a CPU session (for tests), host memory
    /// standing in for GPU `gpu`'s too.
    #[cfg(test)]
    pub fn host(session: &Session, gpu: i32) -> ort::Result<Staging> {
        let mut staging = Self::on(session, AllocationDevice::CPU, MemoryType::Default)?;
        let info = MemoryInfo::new(AllocationDevice::CPU, 0, AllocatorType::Device, MemoryType::Default)?;
        let allocator = Allocator::new(session, info.clone())?;
        staging.device = Some(DeviceMemory { gpu, allocator, info, tensors: HashMap::new() });
        Ok(staging)
    }

    fn on(session: &Session, device: AllocationDevice<'static>, kind: MemoryType) -> ort::Result<Staging> {
        let allocator = Allocator::new(session, MemoryInfo::new(device, 0, AllocatorType::Device, kind)?)?;
        let host = MemoryInfo::new(AllocationDevice::CPU, 0, AllocatorType::Device, MemoryType::Default)?;
        Ok(Staging {
            allocator,
            binding: session.create_binding()?,
            host,
            tensors: HashMap::new(),
            device: None,
            copy_in: std::time::Duration::ZERO,
        })
    }

    /// The GPU whose memory inputs may come from and outputs go to.
    pub fn gpu(&self) -> Option<i32> {
        self.device.as_ref().map(|d| d.gpu)
    }

    /// Whether this batch can go this way (string tensors cannot be staged as bytes).
    pub fn fits(inputs: &[BackendInput<'_>]) -> bool {
        inputs.iter().all(|i| element(i.datatype).is_some())
    }

    /// Runs one batch: stage and bind the inputs (those in GPU memory copied device to device),
    /// bind the outputs (to GPU memory when every request wants one there, else to host
    /// memory), run, and write the outputs kept on the GPU to their targets.
    pub fn run(
        &mut self,
        session: &mut Session,
        inputs: &[BackendInput<'_>],
        outputs: &[&str],
        targets: &[DeviceTarget<'_>],
    ) -> Result<Executed> {
        let started = std::time::Instant::now();
        for input in inputs {
            let ty = element(input.datatype).ok_or_else(|| ort("string inputs are not staged"))?;
            let expected = ty.byte_size(input.shape.iter().map(|&d| d.max(0) as usize).product()).unwrap_or(0);
            let given = if input.device.is_empty() {
                input.data.len()
            } else {
                input.device.iter().map(DeviceBytes::len).sum()
            };
            if expected != given {
                return Err(Error::internal(format!(
                    "input '{}': {given} bytes for a {expected}-byte tensor",
                    input.name
                )));
            }
            let tensor = if input.device.is_empty() {
                let tensor = kept_tensor(&mut self.tensors, &self.allocator, input.name, ty, input.shape)?;
                if expected > 0 {
                    // SAFETY: the tensor was allocated for exactly `expected` bytes of host
                    // memory (page-locked or ordinary), and the source holds as many.
                    unsafe {
                        std::ptr::copy_nonoverlapping(
                            input.data.as_ptr(),
                            tensor.data_ptr_mut().cast::<u8>(),
                            expected,
                        );
                    }
                }
                tensor
            } else {
                let device =
                    self.device.as_mut().ok_or_else(|| ort("an input in GPU memory reached a host-only instance"))?;
                if let Some(other) = input.device.iter().find(|p| p.gpu() != device.gpu) {
                    return Err(ort(format!(
                        "input '{}' is on GPU {}, this instance on GPU {}",
                        input.name,
                        other.gpu(),
                        device.gpu
                    )));
                }
                let tensor = kept_tensor(&mut device.tensors, &device.allocator, input.name, ty, input.shape)?;
                let base = tensor.data_ptr_mut() as u64;
                let mut at = 0;
                for piece in input.device {
                    // SAFETY: the tensor holds `expected` bytes on this GPU, the pieces' lengths
                    // add up to it, and each lands at its own offset.
                    unsafe { piece.copy_to(base + at as u64)? };
                    at += piece.len();
                }
                tensor
            };
            self.binding.bind_input(input.name, tensor).map_err(ort)?;
        }
        // Binding queues the copies; waiting for them here times the copy apart from the run.
        self.binding.synchronize_inputs().map_err(ort)?;
        self.copy_in = started.elapsed();
        self.binding.clear_outputs();
        let on_device: Vec<bool> =
            (0..outputs.len()).map(|k| self.keeps_on_device(session, outputs[k], k, targets)).collect();
        for (name, &kept) in outputs.iter().zip(&on_device) {
            let info = match (&self.device, kept) {
                (Some(device), true) => &device.info,
                _ => &self.host,
            };
            self.binding.bind_output_to_device(*name, info).map_err(ort)?;
        }
        let mut results = session
            .run_binding(&self.binding)
            .map_err(|e| Error::internal(format!("ONNX Runtime failed to run the model: {e}")))?;
        if !on_device.iter().any(|&d| d) {
            return take_outputs(&mut results, outputs).map(Executed::on_host);
        }
        self.binding.synchronize_outputs().map_err(ort)?;
        let mut done = Executed::default();
        for (k, name) in outputs.iter().enumerate() {
            if !on_device[k] {
                done.outputs.push(take_outputs(&mut results, &[name])?.remove(0));
                done.written.push(false);
                continue;
            }
            let value = results
                .remove(*name)
                .ok_or_else(|| Error::internal(format!("ONNX Runtime returned no output '{name}'")))?;
            let tensor = value.downcast::<DynTensorValueType>().map_err(|e| ort(format!("output '{name}': {e}")))?;
            let shape = tensor.shape().to_vec();
            let datatype = super::datatype(*tensor.data_type())
                .filter(|d| d.size().is_some())
                .ok_or_else(|| ort(format!("output '{name}' cannot stay on the GPU ({:?})", tensor.data_type())))?;
            let len = element_count(&shape).unwrap_or(0).saturating_mul(datatype.size().unwrap_or(0));
            write_rows(name, tensor.data_ptr() as u64, len, targets.iter().filter(|t| t.output == k))?;
            done.outputs.push(Tensor { name: name.to_string(), datatype, shape, data: Bytes::new() });
            done.written.push(true);
        }
        Ok(done)
    }

    /// Whether output `k` is bound to GPU memory: every request of the batch wants it in a
    /// region on this instance's GPU (the scheduler only passes targets that cover the batch),
    /// and it is not a string tensor.
    fn keeps_on_device(&self, session: &Session, name: &str, k: usize, targets: &[DeviceTarget<'_>]) -> bool {
        let Some(device) = &self.device else { return false };
        let mut mine = targets.iter().filter(|t| t.output == k).peekable();
        // Most batches have no targets: nothing more is looked at for them.
        if mine.peek().is_none() || !mine.all(|t| t.to.gpu() == device.gpu) {
            return false;
        }
        session.outputs().iter().any(|o| {
            o.name() == name && matches!(o.dtype(), ValueType::Tensor { ty, .. } if *ty != TensorElementType::String)
        })
    }
}

/// Writes each target's rows of an output of `len` bytes at the device address `from`; a target
/// its rows do not fit is left alone (the scheduler fails that request).
fn write_rows<'a>(
    name: &str,
    from: u64,
    len: usize,
    targets: impl Iterator<Item = &'a DeviceTarget<'a>> + Clone,
) -> Result<()> {
    let rows: usize = targets.clone().map(|t| t.rows).sum();
    let per_row = len / rows.max(1);
    for t in targets {
        let bytes = t.rows * per_row;
        if bytes <= t.to.len() && bytes > 0 && t.first_row + t.rows <= rows {
            // SAFETY: the output holds `len` >= `rows * per_row` bytes at `from` on the target's
            // GPU, and this target's rows lie inside them (checked just above).
            unsafe { t.to.copy_from(from + (t.first_row * per_row) as u64, bytes) }
                .map_err(|e| e.context(format!("output '{name}'")))?;
        }
    }
    Ok(())
}
