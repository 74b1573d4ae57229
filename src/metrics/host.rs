//! Machine readings for the per-interval metrics: CPU utilisation and memory from Linux procfs,
//! and GPU utilisation, memory and power through NVML, loaded at run time when a GPU is present.
use nvml_wrapper::Nvml;

/// One GPU's readings; memory in bytes, power in watts, energy in joules.
#[derive(Debug, Clone, PartialEq)]
pub struct GpuReading {
    pub uuid: String,
    pub utilization: f64,
    pub memory_total: f64,
    pub memory_used: f64,
    pub power_usage: f64,
    pub power_limit: f64,
    pub energy: f64,
}

#[derive(Debug, Clone, Default, PartialEq)]
pub struct HostReading {
    /// 0..=1 over the last interval.
    pub cpu_utilization: f64,
    pub memory_total: f64,
    pub memory_used: f64,
    pub gpus: Vec<GpuReading>,
}

/// Busy and idle jiffies of the aggregate `cpu` line of /proc/stat.
fn cpu_times(stat: &str) -> Option<(u64, u64)> {
    let fields: Vec<u64> = stat
        .lines()
        .find(|l| l.starts_with("cpu "))?
        .split_whitespace()
        .skip(1)
        .filter_map(|v| v.parse().ok())
        .collect();
    let get = |i: usize| fields.get(i).copied().unwrap_or(0);
    // user nice system idle iowait irq softirq steal
    let busy = get(0) + get(1) + get(2) + get(5) + get(6) + get(7);
    let idle = get(3) + get(4);
    Some((busy, idle))
}

/// (total, used) bytes from /proc/meminfo: MemTotal and MemTotal - MemAvailable.
fn memory(meminfo: &str) -> Option<(f64, f64)> {
    let kb = |key: &str| -> Option<f64> {
        meminfo.lines().find(|l| l.starts_with(key))?.split_whitespace().nth(1)?.parse::<f64>().ok().map(|v| v * 1024.0)
    };
    let total = kb("MemTotal:")?;
    Some((total, total - kb("MemAvailable:").unwrap_or(total)))
}

pub struct Sampler {
    cpu: bool,
    last_cpu: Option<(u64, u64)>,
    nvml: Option<Nvml>,
    /// Energy counter at start, per GPU, so the metric counts from server start.
    energy_base: Vec<u64>,
}

impl Sampler {
    pub fn new(cpu: bool, gpu: bool) -> Self {
        let nvml = if gpu {
            match Nvml::init() {
                Ok(n) => Some(n),
                Err(e) => {
                    tracing::info!(reason = %e, "no GPU metrics: NVML is not available");
                    None
                }
            }
        } else {
            None
        };
        Sampler { cpu, last_cpu: None, nvml, energy_base: Vec::new() }
    }

    pub fn sample(&mut self) -> HostReading {
        let mut r = HostReading::default();
        if self.cpu {
            if let Some(now) = std::fs::read_to_string("/proc/stat").ok().as_deref().and_then(cpu_times) {
                if let Some((busy0, idle0)) = self.last_cpu {
                    let (busy, idle) = (now.0.saturating_sub(busy0), now.1.saturating_sub(idle0));
                    r.cpu_utilization = if busy + idle == 0 { 0.0 } else { busy as f64 / (busy + idle) as f64 };
                }
                self.last_cpu = Some(now);
            }
            if let Some((total, used)) = std::fs::read_to_string("/proc/meminfo").ok().as_deref().and_then(memory) {
                r.memory_total = total;
                r.memory_used = used;
            }
        }
        r.gpus = self.gpus();
        r
    }

    fn gpus(&mut self) -> Vec<GpuReading> {
        let Some(nvml) = &self.nvml else { return Vec::new() };
        let count = nvml.device_count().unwrap_or(0);
        let mut out = Vec::new();
        for i in 0..count {
            let Ok(d) = nvml.device_by_index(i) else { continue };
            let Ok(uuid) = d.uuid() else { continue };
            let memory = d.memory_info().ok();
            let energy = d.total_energy_consumption().unwrap_or(0);
            if self.energy_base.len() <= i as usize {
                self.energy_base.push(energy);
            }
            out.push(GpuReading {
                uuid,
                utilization: d.utilization_rates().map_or(0.0, |u| f64::from(u.gpu) / 100.0),
                memory_total: memory.as_ref().map_or(0.0, |m| m.total as f64),
                memory_used: memory.as_ref().map_or(0.0, |m| m.used as f64),
                power_usage: d.power_usage().map_or(0.0, |mw| f64::from(mw) / 1000.0),
                power_limit: d.enforced_power_limit().map_or(0.0, |mw| f64::from(mw) / 1000.0),
                energy: energy.saturating_sub(self.energy_base[i as usize]) as f64 / 1000.0,
            });
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn procfs_parsing() {
        let stat = "cpu  100 5 50 800 20 3 2 1 0 0\ncpu0 1 1 1 1\n";
        assert_eq!(cpu_times(stat), Some((161, 820)));
        let meminfo = "MemTotal:       1000 kB\nMemFree:  10 kB\nMemAvailable:    250 kB\n";
        assert_eq!(memory(meminfo), Some((1_024_000.0, 768_000.0)));
    }

    #[test]
    fn sampling_this_machine() {
        let mut s = Sampler::new(true, true);
        let first = s.sample();
        assert!(first.memory_total > 0.0 && first.memory_used > 0.0);
        let second = s.sample();
        assert!((0.0..=1.0).contains(&second.cpu_utilization));
    }
}
