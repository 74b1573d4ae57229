//! Shared memory regions registered by clients (the system and CUDA shared-memory extensions,
//! one name space): inputs are read from them and outputs written into them. Behind
//! --allow-client-shm.
//!
//! A client owns the object and may shrink it at any moment, which turns any access to a mapping
//! past the new end into SIGBUS. So nothing is mapped: inputs are copied out with `pread` and
//! outputs copied in with `pwrite` on the descriptor opened at registration. A shrunk object is a
//! request error (short read, or a size check before writing), never a signal; and the copy is
//! what the request (and the response cache's key) sees, whatever the client writes afterwards.
use std::{
    collections::BTreeMap,
    fs::{File, OpenOptions},
    os::unix::fs::{FileExt, OpenOptionsExt},
    path::PathBuf,
    sync::{Arc, Mutex},
};

use bytes::Bytes;

use crate::{
    device::{DeviceBytes, DeviceMemory},
    error::{Error, ErrorKind, Result},
};

mod cuda;
use cuda::CudaRegion;
pub use cuda::HANDLE_BYTES;

/// What a status query reports of a CUDA region.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CudaStatus {
    pub name: String,
    pub device_id: i64,
    pub byte_size: u64,
}

/// Where a region's bytes are.
enum Located {
    File(Arc<File>, u64),
    Cuda(Arc<CudaRegion>, u64),
}

/// What a status query reports of a region.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RegionStatus {
    pub name: String,
    pub key: String,
    pub offset: u64,
    pub byte_size: u64,
}

struct Region {
    status: RegionStatus,
    file: Arc<File>,
}

/// Most regions registered at once (each holds a descriptor open).
pub const MAX_REGIONS: usize = 1024;

pub struct SharedMemory {
    allowed: bool,
    regions: Mutex<BTreeMap<String, Region>>,
    cuda: Mutex<BTreeMap<String, Arc<CudaRegion>>>,
}

const DISABLED: &str = "Client shared memory is disabled. Start the server with '--allow-client-shm=true' to enable.";

impl SharedMemory {
    pub fn new(allowed: bool) -> Self {
        SharedMemory { allowed, regions: Mutex::default(), cuda: Mutex::default() }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, Region>> {
        self.regions.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn lock_cuda(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, Arc<CudaRegion>>> {
        self.cuda.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn taken(name: &str) -> Error {
        Error::new(ErrorKind::AlreadyExists, format!("shared memory region '{name}' already in manager"))
    }

    /// Registers a CUDA region: the client's IPC handle of `byte_size` bytes on GPU `device_id`.
    pub fn register_cuda(&self, name: &str, handle: &[u8], device_id: i64, byte_size: u64) -> Result<()> {
        self.check_allowed()?;
        if self.lock().contains_key(name) || self.lock_cuda().contains_key(name) {
            return Err(Self::taken(name));
        }
        let region = CudaRegion::open(name, handle, device_id, byte_size)?;
        let mut cuda = self.lock_cuda();
        if cuda.contains_key(name) {
            return Err(Self::taken(name));
        }
        if cuda.len() >= MAX_REGIONS {
            return Err(Error::invalid(format!(
                "failed to register CUDA shared memory region '{name}': {MAX_REGIONS} regions are registered, the most allowed"
            )));
        }
        cuda.insert(name.to_string(), Arc::new(region));
        tracing::debug!(region = name, device_id, byte_size, "registered CUDA shared memory");
        Ok(())
    }

    /// Unregisters one CUDA region (unknown names are fine), or every one; a region in use is
    /// closed when its last request ends. Works without --allow-client-shm (nothing can be
    /// registered then): tools unregister everything when they start.
    pub fn unregister_cuda(&self, name: Option<&str>) -> Result<()> {
        let mut cuda = self.lock_cuda();
        match name {
            Some(n) => {
                cuda.remove(n);
            }
            None => cuda.clear(),
        }
        Ok(())
    }

    pub fn status_cuda(&self, name: Option<&str>) -> Result<Vec<CudaStatus>> {
        // Locks are taken system first, then CUDA, everywhere; here one at a time.
        let found: Vec<CudaStatus> = self
            .lock_cuda()
            .iter()
            .filter(|(k, _)| name.is_none_or(|n| n == k.as_str()))
            .map(|(k, r)| CudaStatus { name: k.clone(), device_id: r.device_id, byte_size: r.byte_size })
            .collect();
        match name {
            Some(n) if found.is_empty() => Err(if self.lock().contains_key(n) {
                Error::not_found(format!(
                    "The region named '{n}' is registered as system shared memory, not CUDA shared memory"
                ))
            } else {
                Error::not_found(format!("Unable to find cuda shared memory region: '{n}'"))
            }),
            _ => Ok(found),
        }
    }

    fn check_allowed(&self) -> Result<()> {
        if self.allowed { Ok(()) } else { Err(Error::unsupported(DISABLED)) }
    }

    /// Registers `[offset, offset + byte_size)` of the POSIX shared memory object `key` (one name
    /// under /dev/shm; a symbolic link or anything but a regular file is refused).
    pub fn register(&self, name: &str, key: &str, offset: u64, byte_size: u64) -> Result<()> {
        self.check_allowed()?;
        let object = crate::names::shm_object(key).map_err(Error::invalid)?;
        if object.starts_with("triton_python_backend_shm_region_") {
            return Err(Error::invalid(format!("shared memory key '{key}' uses a reserved prefix")));
        }
        let mut regions = self.lock();
        if regions.contains_key(name) || self.lock_cuda().contains_key(name) {
            return Err(Self::taken(name));
        }
        if regions.len() >= MAX_REGIONS {
            return Err(Error::invalid(format!(
                "failed to register shared memory region '{name}': {MAX_REGIONS} regions are registered, the most allowed"
            )));
        }
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
            .open(PathBuf::from("/dev/shm").join(object))
            .map_err(|e| Error::invalid(format!("Unable to open shared memory region: '{key}': {}", e.kind())))?;
        let meta = file.metadata().map_err(|e| Error::internal(format!("shared memory '{key}': {e}")))?;
        if !meta.is_file() {
            return Err(Error::invalid(format!("shared memory key '{key}' is not a shared memory object")));
        }
        let size = meta.len();
        if offset.checked_add(byte_size).is_none_or(|end| end > size) {
            return Err(Error::invalid(format!(
                "failed to register shared memory region '{name}': invalid args (offset {offset} + byte_size {byte_size} is past the {size} bytes of '{key}')"
            )));
        }
        let status = RegionStatus { name: name.to_string(), key: key.to_string(), offset, byte_size };
        regions.insert(name.to_string(), Region { status, file: Arc::new(file) });
        tracing::debug!(region = name, key, offset, byte_size, "registered system shared memory");
        Ok(())
    }

    /// Unregisters one region (unknown names are fine), or every region.
    pub fn unregister(&self, name: Option<&str>) -> Result<()> {
        self.check_allowed()?;
        let mut regions = self.lock();
        match name {
            Some(n) => {
                regions.remove(n);
            }
            None => regions.clear(),
        }
        Ok(())
    }

    pub fn status(&self, name: Option<&str>) -> Result<Vec<RegionStatus>> {
        let regions = self.lock();
        match name {
            Some(n) => regions.get(n).map(|r| vec![r.status.clone()]).ok_or_else(|| {
                if self.lock_cuda().contains_key(n) {
                    Error::not_found(format!(
                        "The region named '{n}' is registered as CUDA shared memory, not system shared memory"
                    ))
                } else {
                    Error::not_found(format!("Unable to find system shared memory region: '{n}'"))
                }
            }),
            None => Ok(regions.values().map(|r| r.status.clone()).collect()),
        }
    }

    /// The region holding `[offset, offset + size)`, and where that range starts in it.
    fn locate(&self, name: &str, offset: u64, size: u64) -> Result<Located> {
        self.check_allowed()?;
        let checked = |byte_size: u64| -> Result<()> {
            if offset >= byte_size && !(offset == 0 && size == 0) {
                return Err(Error::invalid(format!("Invalid offset for shared memory region: '{name}'")));
            }
            if offset.checked_add(size).is_none_or(|end| end > byte_size) {
                return Err(Error::invalid(format!("Invalid offset + byte size for shared memory region: '{name}'")));
            }
            Ok(())
        };
        if let Some(r) = self.lock().get(name) {
            checked(r.status.byte_size)?;
            return Ok(Located::File(Arc::clone(&r.file), r.status.offset + offset));
        }
        let cuda = self.lock_cuda();
        let r =
            cuda.get(name).ok_or_else(|| Error::not_found(format!("Unable to find shared memory region: '{name}'")))?;
        checked(r.byte_size)?;
        Ok(Located::Cuda(Arc::clone(r), offset))
    }

    /// An input held in a region: a system region's bytes are copied out (empty device part); a
    /// CUDA region's stay on the GPU (empty host bytes), for the engine to hand to a GPU instance
    /// or copy to the host. The region is looked up once.
    /// The copy is charged to the request's admission ticket before it is made: a request
    /// naming more bytes than the budget has room for is refused without reading them.
    pub fn read_input(&self, name: &str, offset: u64, size: u64) -> Result<(Bytes, Option<DeviceBytes>)> {
        Ok(match self.locate(name, offset, size)? {
            Located::File(file, start) => {
                if let Some(ticket) = crate::admission::current_ticket() {
                    ticket.grow(size)?;
                }
                (read_file(name, &file, start, size)?, None)
            }
            Located::Cuda(region, start) => (Bytes::new(), Some(DeviceBytes::new(region, start, byte_len(size)?))),
        })
    }

    /// The range of a CUDA region (None: the region is system shared memory).
    pub fn device_range(&self, name: &str, offset: u64, size: u64) -> Result<Option<DeviceBytes>> {
        Ok(match self.locate(name, offset, size)? {
            Located::File(..) => None,
            Located::Cuda(region, start) => Some(DeviceBytes::new(region, start, byte_len(size)?)),
        })
    }

    /// A host copy of the bytes of an input held in a region, wherever the region is.
    pub fn read(&self, name: &str, offset: u64, size: u64) -> Result<Bytes> {
        match self.read_input(name, offset, size)? {
            (_, Some(device)) => device.to_host(),
            (data, None) => Ok(data),
        }
    }

    /// Writes an output into a region; `size` is the room the client gave it.
    pub fn write(&self, name: &str, offset: u64, size: u64, output: &str, data: &[u8]) -> Result<()> {
        if (data.len() as u64) > size {
            return Err(crate::device::too_small(output, size, data.len()));
        }
        let (file, start) = match self.locate(name, offset, size)? {
            Located::File(file, start) => (file, start),
            Located::Cuda(region, start) => return DeviceMemory::write(&*region, start, data),
        };
        // Writing past a shrunk end would grow the client's object again: refuse instead.
        let now = file.metadata().map(|m| m.len()).unwrap_or(0);
        if now < start + data.len() as u64 {
            return Err(shrunk(name, start + data.len() as u64));
        }
        file.write_all_at(data, start).map_err(|e| {
            Error::internal(format!("cannot write output '{output}' to shared memory region '{name}': {e}"))
        })
    }
}

fn byte_len(size: u64) -> Result<usize> {
    usize::try_from(size).map_err(|_| Error::invalid(format!("byte size {size} is too large")))
}

/// `size` bytes at `start` of a system region's object (a short read means the client shrank it).
/// Read into memory not zeroed first: the copy is the read's only pass over a large input.
fn read_file(name: &str, file: &File, start: u64, size: u64) -> Result<Bytes> {
    use std::os::fd::AsRawFd;
    let len = byte_len(size)?;
    let mut data: Vec<u8> = Vec::new();
    data.try_reserve_exact(len).map_err(|_| {
        Error::new(
            ErrorKind::Overloaded,
            format!("cannot allocate {len} bytes for an input in shared memory region '{name}'"),
        )
    })?;
    while data.len() < len {
        let (done, spare) = (data.len(), data.spare_capacity_mut());
        let at = libc::off_t::try_from(start + done as u64).map_err(|_| shrunk(name, start + size))?;
        // SAFETY: `spare` is this vector's unused capacity, at least `len - done` bytes; pread
        // writes at most that many into it and says how many it wrote.
        let n = unsafe { libc::pread(file.as_raw_fd(), spare.as_mut_ptr().cast(), len - done, at) };
        match n {
            0 => return Err(shrunk(name, start + size)),
            // SAFETY: pread initialised the `n` bytes after `done`.
            n if n > 0 => unsafe { data.set_len(done + n as usize) },
            _ => {
                let e = std::io::Error::last_os_error();
                if e.kind() != std::io::ErrorKind::Interrupted {
                    return Err(Error::internal(format!("cannot read shared memory region '{name}': {e}")));
                }
            }
        }
    }
    Ok(Bytes::from(data))
}

fn shrunk(name: &str, needed: u64) -> Error {
    Error::invalid(format!(
        "shared memory region '{name}' is smaller than when it was registered (it must hold {needed} bytes); register it again"
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn object(key: &str, size: usize) -> PathBuf {
        let path = PathBuf::from("/dev/shm").join(key);
        std::fs::write(&path, vec![0u8; size]).unwrap();
        path
    }

    #[test]
    fn register_read_write_unregister() {
        let key = format!("ferry-test-{}", std::process::id());
        let path = object(&key, 64);
        let shm = SharedMemory::new(true);
        shm.register("r", &format!("/{key}"), 16, 32).unwrap();
        assert_eq!(shm.register("r", &key, 0, 8).unwrap_err().kind(), ErrorKind::AlreadyExists);
        shm.write("r", 4, 8, "out", &[1, 2, 3, 4]).unwrap();
        assert_eq!(&std::fs::read(&path).unwrap()[20..24], &[1, 2, 3, 4]);
        assert_eq!(shm.read("r", 4, 4).unwrap(), Bytes::from_static(&[1, 2, 3, 4]));
        assert!(shm.read("r", 30, 4).unwrap_err().message().contains("Invalid offset + byte size"));
        assert!(shm.write("r", 0, 2, "out", &[1, 2, 3]).unwrap_err().message().contains("should be at least 3 bytes"));
        assert_eq!(shm.status(None).unwrap()[0].byte_size, 32);
        shm.unregister(Some("r")).unwrap();
        assert_eq!(shm.status(Some("r")).unwrap_err().kind(), ErrorKind::NotFound);
        assert!(shm.register("big", &key, 60, 8).unwrap_err().message().contains("invalid args"));
        std::fs::remove_file(path).unwrap();
    }

    #[test]
    fn keys_name_only_shm_objects() {
        let shm = SharedMemory::new(true);
        for bad in ["../../etc/passwd", "/../../etc/passwd", "/a/b", "..", "/"] {
            let e = shm.register("r", bad, 0, 1).unwrap_err();
            assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{bad}: {e}");
        }
        let key = format!("ferry-test-link-{}", std::process::id());
        let link = PathBuf::from("/dev/shm").join(&key);
        let _ = std::fs::remove_file(&link);
        std::os::unix::fs::symlink("/etc/hostname", &link).unwrap();
        assert!(shm.register("r", &key, 0, 1).is_err(), "a symbolic link is not followed");
        std::fs::remove_file(link).unwrap();
        assert!(shm.status(None).unwrap().is_empty());
    }

    #[test]
    fn a_shrunk_object_is_a_request_error() {
        let key = format!("ferry-test-shrink-{}", std::process::id());
        let path = object(&key, 4096);
        let shm = SharedMemory::new(true);
        shm.register("r", &key, 0, 4096).unwrap();
        std::fs::OpenOptions::new().write(true).open(&path).unwrap().set_len(16).unwrap();
        assert!(shm.read("r", 0, 4096).unwrap_err().message().contains("smaller than when it was registered"));
        assert!(shm.write("r", 1024, 8, "out", &[1; 8]).unwrap_err().message().contains("smaller"));
        assert_eq!(std::fs::metadata(&path).unwrap().len(), 16, "the object is not grown back");
        assert_eq!(shm.read("r", 0, 16).unwrap().len(), 16);
        std::fs::remove_file(path).unwrap();
    }

    #[test]
    fn disabled_by_default() {
        let shm = SharedMemory::new(false);
        assert_eq!(shm.register("r", "/x", 0, 1).unwrap_err().http_status(), 501);
        assert!(shm.status(None).unwrap().is_empty());
    }
}
