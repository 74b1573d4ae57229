//! Tensor bytes that stay in GPU memory: a range of a client's CUDA shared-memory region, read by
//! a GPU instance and written by it without passing through host memory. Plain data and one
//! trait; the driver calls live with the region (`shm`), the binding with the instance (`backend`).
use std::sync::Arc;

use bytes::Bytes;

use crate::error::{Error, Result};

/// Memory on one GPU that tensors are read from and written to.
pub trait DeviceMemory: Send + Sync {
    /// The GPU (ordinal among the visible ones) holding it.
    fn gpu(&self) -> i32;
    /// Copies `out.len()` bytes at `offset` to host memory.
    fn read(&self, offset: u64, out: &mut [u8]) -> Result<()>;
    /// Copies `data` from host memory to `offset`.
    fn write(&self, offset: u64, data: &[u8]) -> Result<()>;
    /// Copies `len` bytes at `offset` to the device address `to`, and waits for the copy.
    ///
    /// # Safety
    /// `to` must address `len` writable bytes of device memory on the same GPU.
    unsafe fn copy_to(&self, offset: u64, to: u64, len: usize) -> Result<()>;
    /// Copies `len` bytes from the device address `from` to `offset`, and waits for the copy.
    ///
    /// # Safety
    /// `from` must address `len` readable bytes of device memory on the same GPU.
    unsafe fn copy_from(&self, offset: u64, from: u64, len: usize) -> Result<()>;
}

/// An output that does not fit the shared memory its request gave it (Triton's words).
pub fn too_small(output: &str, room: impl std::fmt::Display, needed: usize) -> Error {
    Error::internal(format!(
        "shared memory size specified with the request for output '{output}' ({room} bytes) should be at least {needed} bytes to hold the results"
    ))
}

/// `len` bytes at `offset` of some device memory (bounds checked when it was made).
#[derive(Clone)]
pub struct DeviceBytes {
    memory: Arc<dyn DeviceMemory>,
    offset: u64,
    len: usize,
}

impl DeviceBytes {
    /// The caller has checked that `[offset, offset + len)` lies inside `memory`.
    pub fn new(memory: Arc<dyn DeviceMemory>, offset: u64, len: usize) -> Self {
        DeviceBytes { memory, offset, len }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn gpu(&self) -> i32 {
        self.memory.gpu()
    }

    /// A host copy of the bytes.
    pub fn to_host(&self) -> Result<Bytes> {
        let mut data = vec![0u8; self.len];
        self.memory.read(self.offset, &mut data)?;
        Ok(Bytes::from(data))
    }

    /// Copies the bytes into `out`, which holds exactly as many.
    pub fn read_into(&self, out: &mut [u8]) -> Result<()> {
        if out.len() != self.len {
            return Err(Error::internal(format!("{} device bytes read into {} bytes", self.len, out.len())));
        }
        self.memory.read(self.offset, out)
    }

    /// Writes host bytes at the start (no more than the range holds).
    pub fn write(&self, data: &[u8]) -> Result<()> {
        self.check(data.len())?;
        self.memory.write(self.offset, data)
    }

    /// Copies the bytes to the device address `to`.
    ///
    /// # Safety
    /// `to` must address `self.len()` writable bytes on the GPU `self.gpu()`.
    pub unsafe fn copy_to(&self, to: u64) -> Result<()> {
        // SAFETY: passed on from the caller.
        unsafe { self.memory.copy_to(self.offset, to, self.len) }
    }

    /// Copies `len` bytes (no more than the range holds) from the device address `from`.
    ///
    /// # Safety
    /// `from` must address `len` readable bytes on the GPU `self.gpu()`.
    pub unsafe fn copy_from(&self, from: u64, len: usize) -> Result<()> {
        self.check(len)?;
        // SAFETY: passed on from the caller; the range holds `len` bytes.
        unsafe { self.memory.copy_from(self.offset, from, len) }
    }

    fn check(&self, len: usize) -> Result<()> {
        if len > self.len {
            return Err(Error::internal(format!("{len} bytes do not fit a {}-byte device range", self.len)));
        }
        Ok(())
    }
}

impl std::fmt::Debug for DeviceBytes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "DeviceBytes(gpu {}, offset {}, {} bytes)", self.gpu(), self.offset, self.len)
    }
}

impl PartialEq for DeviceBytes {
    fn eq(&self, other: &Self) -> bool {
        std::ptr::addr_eq(Arc::as_ptr(&self.memory), Arc::as_ptr(&other.memory))
            && self.offset == other.offset
            && self.len == other.len
    }
}

/// Host memory standing in for a GPU's, for tests of the device paths on machines without one:
/// "device addresses" are host addresses.
#[cfg(test)]
pub struct HostMemory {
    pub gpu: i32,
    pub bytes: std::sync::Mutex<Vec<u8>>,
}

#[cfg(test)]
impl HostMemory {
    pub fn new(gpu: i32, bytes: Vec<u8>) -> Arc<HostMemory> {
        Arc::new(HostMemory { gpu, bytes: std::sync::Mutex::new(bytes) })
    }

    pub fn range(self: &Arc<Self>, offset: u64, len: usize) -> DeviceBytes {
        DeviceBytes::new(Arc::clone(self) as Arc<dyn DeviceMemory>, offset, len)
    }

    pub fn snapshot(&self) -> Vec<u8> {
        self.bytes.lock().unwrap().clone()
    }
}

#[cfg(test)]
impl DeviceMemory for HostMemory {
    fn gpu(&self) -> i32 {
        self.gpu
    }
    fn read(&self, offset: u64, out: &mut [u8]) -> Result<()> {
        let at = offset as usize;
        out.copy_from_slice(&self.bytes.lock().unwrap()[at..at + out.len()]);
        Ok(())
    }
    fn write(&self, offset: u64, data: &[u8]) -> Result<()> {
        let at = offset as usize;
        self.bytes.lock().unwrap()[at..at + data.len()].copy_from_slice(data);
        Ok(())
    }
    unsafe fn copy_to(&self, offset: u64, to: u64, len: usize) -> Result<()> {
        let at = offset as usize;
        let from = &self.bytes.lock().unwrap()[at..at + len];
        // SAFETY: the caller promises `len` writable bytes at `to` (host memory here).
        unsafe { std::ptr::copy_nonoverlapping(from.as_ptr(), to as *mut u8, len) };
        Ok(())
    }
    unsafe fn copy_from(&self, offset: u64, from: u64, len: usize) -> Result<()> {
        let at = offset as usize;
        let to = &mut self.bytes.lock().unwrap()[at..at + len];
        // SAFETY: the caller promises `len` readable bytes at `from` (host memory here).
        unsafe { std::ptr::copy_nonoverlapping(from as *const u8, to.as_mut_ptr(), len) };
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_read_write_and_refuse_what_does_not_fit() {
        let memory = HostMemory::new(0, vec![0u8; 16]);
        let range = memory.range(4, 8);
        range.write(&[1, 2, 3]).unwrap();
        assert_eq!(&range.to_host().unwrap()[..4], &[1, 2, 3, 0]);
        assert!(range.write(&[0; 9]).unwrap_err().message().contains("do not fit"));
        let source = [9u8; 8];
        // SAFETY: `source` holds 8 readable bytes.
        unsafe { range.copy_from(source.as_ptr() as u64, 8) }.unwrap();
        let mut out = [0u8; 8];
        // SAFETY: `out` holds 8 writable bytes.
        unsafe { range.copy_to(out.as_mut_ptr() as u64) }.unwrap();
        assert_eq!(out, [9; 8]);
        assert_eq!(memory.snapshot()[3..13], [0, 9, 9, 9, 9, 9, 9, 9, 9, 0]);
        assert_eq!(range, memory.range(4, 8));
        assert_ne!(range, memory.range(4, 4));
    }
}
