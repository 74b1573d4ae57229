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
        let secs = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
        Machine { cores, cpu, memory_mib, os, ferry: env!("CARGO_PKG_VERSION").to_string(), finished: utc(secs) }
    }
}

/// Seconds since 1970 as `YYYY-MM-DD HH:MM:SSZ` (the proleptic Gregorian calendar, from days).
fn utc(secs: u64) -> String {
    let (days, rest) = ((secs / 86_400) as i64, secs % 86_400);
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!("{year:04}-{month:02}-{day:02} {:02}:{:02}:{:02}Z", rest / 3600, rest % 3600 / 60, rest % 60)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dates_are_calendar_dates() {
        assert_eq!(utc(0), "1970-01-01 00:00:00Z");
        assert_eq!(utc(951_782_400), "2000-02-29 00:00:00Z");
        assert_eq!(utc(1_796_342_399), "2026-12-03 23:59:59Z");
    }

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
