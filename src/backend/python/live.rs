//! The Python processes alive and what they hold: each leads its own process group (a helper it
//! forks dies with it) and names its shared memory with a prefix of its own, unguessable, that
//! carries ferry's pid. Whatever ends a process (death, restart, unload, the server's stop)
//! kills its group and removes every region with its prefix; at start, regions left by a ferry
//! that no longer runs (killed, out of memory) are removed.
use std::{
    collections::BTreeMap,
    io::Read,
    sync::Mutex,
    time::{Duration, Instant},
};

/// pid (= process group) -> shared-memory prefix, of every Python process started and not yet
/// released.
static LIVE: Mutex<BTreeMap<u32, String>> = Mutex::new(BTreeMap::new());

fn live() -> std::sync::MutexGuard<'static, BTreeMap<u32, String>> {
    LIVE.lock().unwrap_or_else(|p| p.into_inner())
}

/// A new prefix for one process's regions: `ferry-<ferry's pid>-<64 random bits>`, so another
/// user can neither guess nor pre-create them.
pub fn prefix() -> String {
    let mut random = [0u8; 8];
    if std::fs::File::open("/dev/urandom").and_then(|mut f| f.read_exact(&mut random)).is_err() {
        // No /dev/urandom (never on Linux): the clock still differs between processes.
        let now = std::time::SystemTime::UNIX_EPOCH.elapsed().unwrap_or_default();
        random = (now.as_nanos() as u64).to_le_bytes();
    }
    let hex: String = random.iter().map(|b| format!("{b:02x}")).collect();
    format!("ferry-{}-{hex}", std::process::id())
}

pub fn started(pid: u32, prefix: &str) {
    live().insert(pid, prefix.to_string());
}

/// Kills the process's group and removes its regions (idempotent).
pub fn release(pid: u32, prefix: &str) {
    // SAFETY: kill(2) with a negative pid signals the process group the child leads.
    unsafe {
        libc::kill(-(pid as i32), libc::SIGKILL);
    }
    remove_regions(|name| name.starts_with(prefix));
    live().remove(&pid);
}

fn remove_regions(matches: impl Fn(&str) -> bool) {
    let Ok(entries) = std::fs::read_dir("/dev/shm") else { return };
    for e in entries.flatten() {
        if let Some(name) = e.file_name().to_str()
            && matches(name)
        {
            let _ = std::fs::remove_file(e.path());
        }
    }
}

/// The server stops: waits up to `grace` for instances to finish with their processes
/// (`finalize`), then kills what is left and removes its regions.
pub fn release_all(grace: Duration) {
    let deadline = Instant::now() + grace;
    while !live().is_empty() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    let left: Vec<(u32, String)> = live().iter().map(|(p, s)| (*p, s.clone())).collect();
    for (pid, prefix) in left {
        tracing::warn!(pid, "a Python process still running at exit is killed");
        release(pid, &prefix);
    }
}

/// Removes regions of ferry processes that are gone (a ferry killed before it could clean up).
pub fn sweep_stale() {
    remove_regions(|name| {
        let Some(rest) = name.strip_prefix("ferry-") else { return false };
        let Some(pid) = rest.split('-').next().and_then(|p| p.parse::<u32>().ok()) else { return false };
        pid != std::process::id() && !std::path::Path::new(&format!("/proc/{pid}")).exists()
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefixes_carry_the_pid_and_differ() {
        let (a, b) = (prefix(), prefix());
        assert_ne!(a, b);
        assert!(a.starts_with(&format!("ferry-{}-", std::process::id())));
        assert_eq!(a.len(), format!("ferry-{}-", std::process::id()).len() + 16);
    }

    #[test]
    fn stale_regions_of_a_gone_ferry_are_swept_and_live_ones_kept() {
        let gone = "ferry-999999999-00ff00ff00ff00ff-in-1";
        let mine = format!("{}-in-1", prefix());
        for n in [gone, &mine] {
            std::fs::write(format!("/dev/shm/{n}"), b"x").unwrap();
        }
        sweep_stale();
        assert!(!std::path::Path::new(&format!("/dev/shm/{gone}")).exists());
        assert!(std::path::Path::new(&format!("/dev/shm/{mine}")).exists());
        let _ = std::fs::remove_file(format!("/dev/shm/{mine}"));
    }
}
