//! The GPUs this process can use, found once through the CUDA driver (cudarc, loaded at run time):
//! count, names, UUIDs, compute capability and memory, as the driver numbers them after
//! `CUDA_VISIBLE_DEVICES`. Without libcuda (CPU machines, containers started without the NVIDIA
//! runtime) the answer is "none" with the reason; the driver is never touched when its library is
//! absent, and a driver that misbehaves is caught rather than taking the server down.
use std::sync::OnceLock;

use cudarc::driver::{result, sys};

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Gpu {
    /// The ordinal CUDA uses (after CUDA_VISIBLE_DEVICES), as config `gpus: [...]` names it.
    pub index: i32,
    pub name: String,
    /// `GPU-xxxxxxxx-xxxx-...`, as nvidia-smi prints it.
    pub uuid: String,
    pub compute_capability: (i32, i32),
    pub memory_bytes: u64,
}

/// The GPUs visible to this process, or why there are none.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Gpus {
    Found(Vec<Gpu>),
    None(String),
}

impl Gpus {
    pub fn list(&self) -> &[Gpu] {
        match self {
            Gpus::Found(g) => g,
            Gpus::None(_) => &[],
        }
    }

    /// `0 (NVIDIA H200), 1 (...)` or `none: <reason>`, for errors and the start-up line.
    pub fn describe(&self) -> String {
        match self {
            Gpus::Found(g) if !g.is_empty() => {
                g.iter().map(|g| format!("{} ({})", g.index, g.name)).collect::<Vec<_>>().join(", ")
            }
            Gpus::Found(_) => "none (the driver reports no device)".to_string(),
            Gpus::None(why) => format!("none ({why})"),
        }
    }

    /// Checks a config's `gpus: [...]` against what is visible.
    pub fn check(&self, wanted: &[i32]) -> Result<(), String> {
        let seen = self.list();
        match wanted.iter().find(|&&g| !seen.iter().any(|s| s.index == g)) {
            Some(g) => Err(format!("GPU {g} is not visible to ferry; GPUs seen: {}", self.describe())),
            None => Ok(()),
        }
    }
}

fn uuid_string(bytes: &[std::ffi::c_char; 16]) -> String {
    let b: Vec<u8> = bytes.iter().map(|&c| c as u8).collect();
    let hex = |r: std::ops::Range<usize>| b[r].iter().map(|x| format!("{x:02x}")).collect::<String>();
    format!("GPU-{}-{}-{}-{}-{}", hex(0..4), hex(4..6), hex(6..8), hex(8..10), hex(10..16))
}

fn query() -> Result<Vec<Gpu>, String> {
    // SAFETY: only tries to open the library; nothing in it is called.
    if !unsafe { sys::is_culib_present() } {
        return Err("the NVIDIA driver's libcuda.so.1 is not on this machine or not in the container".into());
    }
    let err = |what: &str, e: result::DriverError| format!("CUDA driver: {what}: {e}");
    result::init().map_err(|e| err("cuInit", e))?;
    let count = result::device::get_count().map_err(|e| err("cuDeviceGetCount", e))?;
    (0..count)
        .map(|index| {
            let dev = result::device::get(index).map_err(|e| err("cuDeviceGet", e))?;
            let name = result::device::get_name(dev).map_err(|e| err("cuDeviceGetName", e))?;
            // SAFETY: `dev` came from cuDeviceGet; the out-pointers are valid for the calls.
            let (memory, major, minor, uuid) = unsafe {
                let memory = result::device::total_mem(dev).map_err(|e| err("cuDeviceTotalMem", e))?;
                let attr = |a| result::device::get_attribute(dev, a).map_err(|e| err("cuDeviceGetAttribute", e));
                let major = attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?;
                let minor = attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?;
                let mut uuid = std::mem::MaybeUninit::<sys::CUuuid>::uninit();
                sys::cuDeviceGetUuid_v2(uuid.as_mut_ptr(), dev).result().map_err(|e| err("cuDeviceGetUuid", e))?;
                (memory, major, minor, uuid.assume_init())
            };
            Ok(Gpu {
                index,
                name,
                uuid: uuid_string(&uuid.bytes),
                compute_capability: (major, minor),
                memory_bytes: memory as u64,
            })
        })
        .collect()
}

/// Asks the driver once per process (a driver too old for a symbol panics inside cudarc; that is
/// caught and said).
pub fn visible() -> &'static Gpus {
    static GPUS: OnceLock<Gpus> = OnceLock::new();
    GPUS.get_or_init(|| match std::panic::catch_unwind(query) {
        Ok(Ok(list)) => Gpus::Found(list),
        Ok(Err(why)) => Gpus::None(why),
        Err(_) => Gpus::None("the CUDA driver could not be queried (a symbol ferry needs is missing)".into()),
    })
}

/// Says once, at start, which GPUs ferry sees.
pub fn log_visible() {
    match visible() {
        Gpus::Found(list) if !list.is_empty() => {
            for g in list {
                tracing::info!(
                    gpu = g.index,
                    name = %g.name,
                    uuid = %g.uuid,
                    compute_capability = %format!("{}.{}", g.compute_capability.0, g.compute_capability.1),
                    memory_mib = g.memory_bytes >> 20,
                    "GPU visible"
                );
            }
        }
        other => tracing::info!("no GPU: {}; KIND_AUTO instances run on the CPU", other.describe()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gpu(index: i32) -> Gpu {
        Gpu {
            index,
            name: "NVIDIA H200".into(),
            uuid: String::new(),
            compute_capability: (9, 0),
            memory_bytes: 140 << 30,
        }
    }

    #[test]
    fn out_of_range_gpus_name_what_is_seen() {
        let two = Gpus::Found(vec![gpu(0), gpu(1)]);
        assert!(two.check(&[0, 1]).is_ok());
        assert_eq!(
            two.check(&[2]).unwrap_err(),
            "GPU 2 is not visible to ferry; GPUs seen: 0 (NVIDIA H200), 1 (NVIDIA H200)"
        );
        let none = Gpus::None("no driver".into());
        assert_eq!(none.check(&[0]).unwrap_err(), "GPU 0 is not visible to ferry; GPUs seen: none (no driver)");
        assert!(none.check(&[]).is_ok());
    }

    #[test]
    fn uuids_print_as_nvidia_smi() {
        let b: [std::ffi::c_char; 16] = std::array::from_fn(|i| i as std::ffi::c_char);
        assert_eq!(uuid_string(&b), "GPU-00010203-0405-0607-0809-0a0b0c0d0e0f");
    }

    #[test]
    fn without_a_driver_there_are_no_gpus_and_no_panic() {
        // On machines with a GPU this finds it; elsewhere it says why, either way without panicking.
        match visible() {
            Gpus::Found(list) => assert!(list.iter().enumerate().all(|(i, g)| g.index == i as i32)),
            Gpus::None(why) => assert!(!why.is_empty()),
        }
    }
}
