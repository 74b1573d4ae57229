//! System shared memory regions registered by clients (the shared-memory extension): inputs are
//! read from them without a copy, and outputs are written into them. Behind --allow-client-shm.
use std::{
    collections::BTreeMap,
    fs::OpenOptions,
    path::PathBuf,
    sync::{Arc, Mutex},
};

use bytes::Bytes;
use memmap2::MmapRaw;

use crate::error::{Error, ErrorKind, Result};

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
    map: Arc<MmapRaw>,
}

/// A slice of a mapped region, kept mapped while tensors use it.
struct Slice {
    map: Arc<MmapRaw>,
    start: usize,
    len: usize,
}

impl AsRef<[u8]> for Slice {
    fn as_ref(&self) -> &[u8] {
        // The mapping lives as long as `map`, and start + len was checked against its length.
        unsafe { std::slice::from_raw_parts(self.map.as_ptr().add(self.start), self.len) }
    }
}

pub struct SharedMemory {
    allowed: bool,
    regions: Mutex<BTreeMap<String, Region>>,
}

const DISABLED: &str = "Client shared memory is disabled. Start the server with '--allow-client-shm=true' to enable.";

impl SharedMemory {
    pub fn new(allowed: bool) -> Self {
        SharedMemory { allowed, regions: Mutex::default() }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, Region>> {
        self.regions.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn check_allowed(&self) -> Result<()> {
        if self.allowed { Ok(()) } else { Err(Error::unsupported(DISABLED)) }
    }

    /// Maps `[offset, offset + byte_size)` of the POSIX shared memory object `key`.
    pub fn register(&self, name: &str, key: &str, offset: u64, byte_size: u64) -> Result<()> {
        self.check_allowed()?;
        if key.starts_with("triton_python_backend_shm_region_") {
            return Err(Error::invalid(format!("shared memory key '{key}' uses a reserved prefix")));
        }
        let mut regions = self.lock();
        if regions.contains_key(name) {
            return Err(Error::new(
                ErrorKind::AlreadyExists,
                format!("shared memory region '{name}' already in manager"),
            ));
        }
        let path = PathBuf::from("/dev/shm").join(key.trim_start_matches('/'));
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .open(&path)
            .map_err(|e| Error::internal(format!("Unable to open shared memory region: '{key}': {e}")))?;
        let size = file.metadata().map(|m| m.len()).unwrap_or(0);
        if offset.checked_add(byte_size).is_none_or(|end| end > size) {
            return Err(Error::invalid(format!(
                "failed to register shared memory region '{name}': invalid args (offset {offset} + byte_size {byte_size} is past the {size} bytes of '{key}')"
            )));
        }
        let map =
            MmapRaw::map_raw(&file).map_err(|e| Error::internal(format!("cannot map shared memory '{key}': {e}")))?;
        let status = RegionStatus { name: name.to_string(), key: key.to_string(), offset, byte_size };
        regions.insert(name.to_string(), Region { status, map: Arc::new(map) });
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
            Some(n) => regions
                .get(n)
                .map(|r| vec![r.status.clone()])
                .ok_or_else(|| Error::not_found(format!("Unable to find system shared memory region: '{n}'"))),
            None => Ok(regions.values().map(|r| r.status.clone()).collect()),
        }
    }

    fn locate(&self, name: &str, offset: u64, size: u64) -> Result<(Arc<MmapRaw>, usize)> {
        self.check_allowed()?;
        let regions = self.lock();
        let r = regions
            .get(name)
            .ok_or_else(|| Error::not_found(format!("Unable to find shared memory region: '{name}'")))?;
        if offset >= r.status.byte_size && !(offset == 0 && size == 0) {
            return Err(Error::invalid(format!("Invalid offset for shared memory region: '{name}'")));
        }
        if offset.checked_add(size).is_none_or(|end| end > r.status.byte_size) {
            return Err(Error::invalid(format!("Invalid offset + byte size for shared memory region: '{name}'")));
        }
        Ok((Arc::clone(&r.map), (r.status.offset + offset) as usize))
    }

    /// The bytes of an input held in a region, without a copy.
    pub fn read(&self, name: &str, offset: u64, size: u64) -> Result<Bytes> {
        let (map, start) = self.locate(name, offset, size)?;
        Ok(Bytes::from_owner(Slice { map, start, len: size as usize }))
    }

    /// Writes an output into a region; `size` is the room the client gave it.
    pub fn write(&self, name: &str, offset: u64, size: u64, output: &str, data: &[u8]) -> Result<()> {
        if (data.len() as u64) > size {
            return Err(Error::internal(format!(
                "shared memory size specified with the request for output '{output}' ({size} bytes) should be at least {} bytes to hold the results",
                data.len()
            )));
        }
        let (map, start) = self.locate(name, offset, size)?;
        // The region was checked to hold `size` >= data.len() bytes at `start`.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), map.as_mut_ptr().add(start), data.len()) };
        Ok(())
    }
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
    fn disabled_by_default() {
        let shm = SharedMemory::new(false);
        assert_eq!(shm.register("r", "/x", 0, 1).unwrap_err().http_status(), 501);
        assert!(shm.status(None).unwrap().is_empty());
    }
}
