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

/// pid (= process group) -> (shared-memory prefix, killed already), of every Python process
/// started and not yet reaped.
static LIVE: Mutex<BTreeMap<u32, (String, bool)>> = Mutex::new(BTreeMap::new());

fn live() -> std::sync::MutexGuard<'static, BTreeMap<u32, (String, bool)>> {
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

/// Held from a process's spawn to its `started`, and by `reap_orphans` while it looks: a
/// process just spawned is never taken for an orphan.
static SPAWNING: Mutex<()> = Mutex::new(());

pub fn spawning() -> std::sync::MutexGuard<'static, ()> {
    SPAWNING.lock().unwrap_or_else(|p| p.into_inner())
}

pub fn started(pid: u32, prefix: &str) {
    live().insert(pid, (prefix.to_string(), false));
}

/// The process was reaped: its pid is no longer its own.
pub fn forget(pid: u32) {
    live().remove(&pid);
}

/// Kills the process, what it started (its group, and descendants that left it for a session
/// of their own), and removes its regions. Only the first call kills, and only before `forget`:
/// the process is not reaped yet, so its pid (and group id) cannot have been reused.
pub fn release(pid: u32, prefix: &str) {
    let first = live().get_mut(&pid).is_some_and(|(_, killed)| !std::mem::replace(killed, true));
    if first {
        for p in descendants(pid) {
            // SAFETY: kill(2) on a process found in /proc as a descendant of ours.
            unsafe { libc::kill(p, libc::SIGKILL) };
        }
        // SAFETY: kill(2) with a negative pid signals the process group the child leads.
        unsafe { libc::kill(-(pid as i32), libc::SIGKILL) };
        reap_orphans();
    }
    remove_regions(|name| name.starts_with(prefix));
}

/// Makes ferry the reaper of what its children leave behind: a helper a Python process started
/// in a session of its own, whose parent died, becomes ferry's child (not init's), so that
/// `reap_orphans` finds it.
pub fn adopt_orphans() {
    // SAFETY: prctl(2) with PR_SET_CHILD_SUBREAPER and an integer argument.
    unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1) };
}

/// Kills and reaps ferry's children that it did not start: orphans of a dead Python process
/// (ferry starts its other children in its own process group, and Python processes are in the
/// registry of live ones).
fn reap_orphans() {
    let me = std::process::id() as i32;
    // SAFETY: getpgid(2) of ferry itself.
    let group = unsafe { libc::getpgid(0) };
    let _no_spawn = spawning();
    let known: Vec<u32> = live().keys().copied().collect();
    for e in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Some(p) = e.file_name().to_str().and_then(|n| n.parse::<i32>().ok()) else { continue };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{p}/stat")) else { continue };
        let fields: Vec<&str> = stat.rsplit_once(')').map_or(Vec::new(), |(_, r)| r.split_whitespace().collect());
        let (Some(ppid), Some(pgid)) = (fields.get(1), fields.get(2)) else { continue };
        let orphan = ppid.parse() == Ok(me) && pgid.parse() != Ok(group) && !known.contains(&(p as u32));
        if orphan {
            tracing::warn!(pid = p, "a process left behind by a Python process that ended is killed");
            // SAFETY: kill(2) and waitpid(2) on a child of ferry's, found just now (a zombie too
            // long to die is reaped by a later call).
            unsafe {
                libc::kill(p, libc::SIGKILL);
                for _ in 0..50 {
                    if libc::waitpid(p, std::ptr::null_mut(), libc::WNOHANG) != 0 {
                        break;
                    }
                    std::thread::sleep(Duration::from_millis(10));
                }
            }
        }
    }
}

/// Every process below `pid` in the process tree, read from /proc.
fn descendants(pid: u32) -> Vec<i32> {
    let mut children: BTreeMap<i32, Vec<i32>> = BTreeMap::new();
    for e in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Some(p) = e.file_name().to_str().and_then(|n| n.parse::<i32>().ok()) else { continue };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{p}/stat")) else { continue };
        // The command name (in parentheses) may hold spaces: the fields after it are fixed.
        let parent = stat.rsplit_once(')').and_then(|(_, rest)| rest.split_whitespace().nth(1)?.parse().ok());
        if let Some(parent) = parent {
            children.entry(parent).or_default().push(p);
        }
    }
    let mut out = Vec::new();
    let mut todo = vec![pid as i32];
    while let Some(p) = todo.pop() {
        for &c in children.get(&p).into_iter().flatten() {
            if !out.contains(&c) && out.len() < 100_000 {
                out.push(c);
                todo.push(c);
            }
        }
    }
    out
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
    let left: Vec<(u32, String)> = live().iter().map(|(p, (s, _))| (*p, s.clone())).collect();
    for (pid, prefix) in left {
        tracing::warn!(pid, "a Python process still running at exit is killed");
        release(pid, &prefix);
    }
}

/// Removes regions of ferry processes that are gone (a ferry killed before it could clean up).
pub fn sweep_stale() {
    remove_regions(|name| {
        let Some(rest) = name.strip_prefix("ferry-") else { return false };
        // `ferry-<pid>-…`, and the names of earlier versions: `ferry-in-<ferry's pid>-…`,
        // `ferry-py-<the Python process's pid>-…`.
        let rest = rest.strip_prefix("in-").or_else(|| rest.strip_prefix("py-")).unwrap_or(rest);
        let Some(pid) = rest.split('-').next().and_then(|p| p.parse::<u32>().ok()) else { return false };
        pid != std::process::id() && !std::path::Path::new(&format!("/proc/{pid}")).exists()
    });
}

/// Whether child `pid` has ended, without reaping it (WNOWAIT): until it is reaped its pid and
/// group id stay its own.
pub fn exited(pid: u32) -> bool {
    // SAFETY: waitid(2) on a child of ours, writing into a zeroed siginfo_t we own.
    unsafe {
        let mut info: libc::siginfo_t = std::mem::zeroed();
        let flags = libc::WEXITED | libc::WNOHANG | libc::WNOWAIT;
        libc::waitid(libc::P_PID, pid, &mut info, flags) == 0 && info.si_pid() != 0
    }
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
        let gone = ["ferry-999999999-00ff00ff00ff00ff-in-1", "ferry-in-999999999-5-1", "ferry-py-999999999-2"];
        let mine = format!("{}-in-1", prefix());
        for n in gone.iter().copied().chain([mine.as_str()]) {
            std::fs::write(format!("/dev/shm/{n}"), b"x").unwrap();
        }
        sweep_stale();
        for n in gone {
            assert!(!std::path::Path::new(&format!("/dev/shm/{n}")).exists(), "{n}");
        }
        assert!(std::path::Path::new(&format!("/dev/shm/{mine}")).exists());
        let _ = std::fs::remove_file(format!("/dev/shm/{mine}"));
    }
}
