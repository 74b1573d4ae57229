//! CUDA shared memory regions (the CUDA shared-memory extension): a client's `cudaIpcMemHandle_t`
//! opened on its device through the CUDA driver (cudarc). A GPU instance reads inputs from it and
//! writes outputs into it device to device; anything else copies to or from the host once. The
//! handle stays open while any request uses the region, so unregistering one in use closes it when
//! the last such request ends.
use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaStream, sys};

use crate::{
    device::DeviceMemory,
    error::{Error, Result},
};

/// A `cudaIpcMemHandle_t`'s size.
pub const HANDLE_BYTES: usize = 64;

pub struct CudaRegion {
    pub device_id: i64,
    pub byte_size: u64,
    context: Arc<CudaContext>,
    /// Copies between device addresses go here (a non-blocking stream: other work on the GPU,
    /// another instance's inference included, is neither waited for nor held up).
    stream: Arc<CudaStream>,
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
        let stream = context
            .new_stream()
            .map_err(|e| Error::internal(format!("CUDA shared memory: GPU {device}: cannot make a stream: {e}")))?;
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
        let region = CudaRegion { device_id, byte_size, context, stream, pointer };
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

    fn bind(&self) -> Result<()> {
        self.context.bind_to_thread().map_err(|e| Error::internal(format!("CUDA shared memory: {e}")))
    }

    /// Copies `len` bytes between device addresses on the region's stream, and waits for it.
    fn device_copy(&self, to: sys::CUdeviceptr, from: sys::CUdeviceptr, len: usize) -> Result<()> {
        self.bind()?;
        // SAFETY: the callers vouch for both ranges (one inside the opened allocation, the other
        // the instance's own device tensor).
        driver("cuMemcpyDtoDAsync", unsafe { sys::cuMemcpyDtoDAsync_v2(to, from, len, self.stream.cu_stream()) })?;
        self.stream.synchronize().map_err(|e| Error::internal(format!("CUDA shared memory: synchronize: {e}")))
    }
}

/// Offsets and lengths are checked by the callers (`SharedMemory` checks every range against the
/// registered size, which fits in the allocation).
impl DeviceMemory for CudaRegion {
    fn gpu(&self) -> i32 {
        self.device_id as i32
    }

    fn read(&self, offset: u64, out: &mut [u8]) -> Result<()> {
        self.bind()?;
        // SAFETY: `out` holds `out.len()` bytes; the range lies inside the opened allocation.
        driver("cuMemcpyDtoH", unsafe {
            sys::cuMemcpyDtoH_v2(out.as_mut_ptr().cast(), self.pointer + offset, out.len())
        })
    }

    fn write(&self, offset: u64, data: &[u8]) -> Result<()> {
        self.bind()?;
        // SAFETY: `data` is readable for its length; the range lies inside the opened allocation.
        driver("cuMemcpyHtoD", unsafe { sys::cuMemcpyHtoD_v2(self.pointer + offset, data.as_ptr().cast(), data.len()) })
    }

    unsafe fn copy_to(&self, offset: u64, to: u64, len: usize) -> Result<()> {
        self.device_copy(to, self.pointer + offset, len)
    }

    unsafe fn copy_from(&self, offset: u64, from: u64, len: usize) -> Result<()> {
        self.device_copy(self.pointer + offset, from, len)
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
