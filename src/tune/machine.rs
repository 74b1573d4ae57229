//! The machine a tuning run measured, for the report: numbers hold only on the machine they
//! were measured on.
use serde::Serialize;

#[derive(Debug, Clone, Serialize)]
pub struct Machine {
    pub cores: usize,
    pub cpu: String,
    pub memory_mib: u64,
    pub os: String,
    pub ferry: String,
    /// When the run finished, UTC (`2026-12-03 23:59:59Z`).
    pub finished: String,
}

fn first_value(text: &str, key: &str) -> Option<String> {
    text.lines()
        .find(|l| l.split(':').next().is_some_and(|k| k.trim() == key))
        .and_then(|l| l.split_once(':'))
        .map(|(_, v)| v.trim().to_string())
}

impl Machine {
    pub fn read(cores: usize) -> Machine {
        let read = |p: &str| std::fs::read_to_string(p).unwrap_or_default();
        let cpu = first_value(&read("/proc/cpuinfo"), "model name").unwrap_or_else(|| std::env::consts::ARCH.into());
        let memory_mib = first_value(&read("/proc/meminfo"), "MemTotal")
            .and_then(|v| v.split_whitespace().next().and_then(|n| n.parse::<u64>().ok()))
            .map_or(0, |kib| kib / 1024);
        let release = read("/etc/os-release");
        let name = release
            .lines()
            .find_map(|l| l.strip_prefix("PRETTY_NAME="))
            .map(|v| v.trim_matches('"').to_string())
            .unwrap_or_else(|| std::env::consts::OS.to_string());
        let kernel = read("/proc/sys/kernel/osrelease").trim().to_string();
        let os = if kernel.is_empty() { name } else { format!("{name}, kernel {kernel}") };
        let finished = crate::clock::Utc::now().to_string();
        Machine { cores, cpu, memory_mib, os, ferry: env!("CARGO_PKG_VERSION").to_string(), finished }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_keys_from_proc_files() {
        let text = "processor\t: 0\nmodel name\t: Some CPU @ 2.0GHz\nflags\t: a b\n";
        assert_eq!(first_value(text, "model name").as_deref(), Some("Some CPU @ 2.0GHz"));
        assert_eq!(first_value(text, "nope"), None);
        let m = Machine::read(2);
        assert_eq!(m.cores, 2);
        assert!(!m.cpu.is_empty() && !m.os.is_empty());
    }
}
