//! CUDA shared memory regions (the CUDA shared-memory extension): a client's `cudaIpcMemHandle_t`
//! opened on its device through the CUDA driver (cudarc). An input held in a region is copied from
//! the device once, an output copied into it once; the handle stays open while any request uses
//! the region, so unregistering one in use closes it when the last such request ends.
use std::sync::Arc;

use bytes::Bytes;
use cudarc::driver::{CudaContext, sys};

use crate::error::{Error, Result};

/// A `cudaIpcMemHandle_t`'s size.
pub const HANDLE_BYTES: usize = 64;

pub struct CudaRegion {
    pub device_id: i64,
    pub byte_size: u64,
    context: Arc<CudaContext>,
    pointer: sys::CUdeviceptr,
}

fn driver(what: &str, r: sys::CUresult) -> Result<()> {
    r.result().map_err(|e| Error::internal(format!("CUDA shared memory: {what}: {e}")))
}

impl CudaRegion {
    /// Opens `handle` (64 bytes, from the client's `cudaIpcGetMemHandle`) on `device_id`.
    pub fn open(name: &str, handle: &[u8], device_id: i64, byte_size: u64) -> Result<CudaRegion> {
        if handle.len() != HANDLE_BYTES {
            return Err(Error::invalid(format!(
                "failed to register CUDA shared memory region: '{name}': raw_handle must be {HANDLE_BYTES} bytes (a cudaIpcMemHandle_t), got {}",
                handle.len()
            )));
        }
        let gpus = crate::gpu::visible();
        if gpus.list().is_empty() {
            return Err(Error::invalid(format!(
                "failed to register CUDA shared memory region: '{name}', GPUs not supported: {}",
                gpus.describe()
            )));
        }
        let device =
            i32::try_from(device_id).map_err(|_| Error::invalid(format!("device_id {device_id} is out of range")))?;
        gpus.check(&[device])
            .map_err(|e| Error::invalid(format!("failed to register CUDA shared memory region: '{name}': {e}")))?;
        let context = CudaContext::new(device as usize)
            .map_err(|e| Error::internal(format!("CUDA shared memory: cannot use GPU {device}: {e}")))?;
        context.bind_to_thread().map_err(|e| Error::internal(format!("CUDA shared memory: GPU {device}: {e}")))?;
        let mut raw = sys::CUipcMemHandle { reserved: [0; HANDLE_BYTES] };
        for (to, from) in raw.reserved.iter_mut().zip(handle) {
            *to = *from as std::ffi::c_char;
        }
        let mut pointer: sys::CUdeviceptr = 0;
        // SAFETY: `pointer` is a valid out-pointer; the handle is plain bytes the driver checks.
        driver("cuIpcOpenMemHandle", unsafe {
            sys::cuIpcOpenMemHandle_v2(
                &mut pointer,
                raw,
                sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32,
            )
        })
        .map_err(|e| {
            Error::invalid(format!("failed to register CUDA shared memory region: '{name}': {}", e.message()))
        })?;
        // Closed on drop from here on, whatever fails next.
        let region = CudaRegion { device_id, byte_size, context, pointer };
        // The size is the client's word: it must fit in the allocation the handle opened, so no
        // later copy reaches past it.
        let (mut base, mut size): (sys::CUdeviceptr, usize) = (0, 0);
        // SAFETY: valid out-pointers; `pointer` was just opened in this context.
        driver("cuMemGetAddressRange", unsafe { sys::cuMemGetAddressRange_v2(&mut base, &mut size, pointer) })?;
        let room = (base + size as u64).saturating_sub(pointer);
        if byte_size > room {
            return Err(Error::invalid(format!(
                "failed to register CUDA shared memory region '{name}': invalid args (byte_size {byte_size} is past the {room} bytes of the allocation the handle names)"
            )));
        }
        Ok(region)
    }

    /// A host copy of `[offset, offset + size)` (bounds checked by the caller).
    pub fn read(&self, offset: u64, size: u64) -> Result<Bytes> {
        self.context.bind_to_thread().map_err(|e| Error::internal(e.to_string()))?;
        let mut data = vec![0u8; size as usize];
        // SAFETY: `data` holds `size` bytes; the range lies inside the opened allocation.
        driver("cuMemcpyDtoH", unsafe {
            sys::cuMemcpyDtoH_v2(data.as_mut_ptr().cast(), self.pointer + offset, data.len())
        })?;
        Ok(Bytes::from(data))
    }

    /// Copies `data` to `offset` (bounds checked by the caller).
    pub fn write(&self, offset: u64, data: &[u8]) -> Result<()> {
        self.context.bind_to_thread().map_err(|e| Error::internal(e.to_string()))?;
        // SAFETY: `data` is readable for its length; the range lies inside the opened allocation.
        driver("cuMemcpyHtoD", unsafe { sys::cuMemcpyHtoD_v2(self.pointer + offset, data.as_ptr().cast(), data.len()) })
    }
}

impl Drop for CudaRegion {
    fn drop(&mut self) {
        if self.context.bind_to_thread().is_ok() {
            // SAFETY: the pointer came from cuIpcOpenMemHandle and is closed once, here.
            let _ = unsafe { sys::cuIpcCloseMemHandle(self.pointer) };
        }
    }
}
