//! Where the TorchScript shim comes from: PyTorch's C++ API has no stable ABI, so the shim is
//! compiled against the headers of the very PyTorch the server runs. Found, in order: beside the
//! ferry binary as `libferry_torchscript-<torch version>.so` (an image builds it there), in the
//! user's cache (`$XDG_CACHE_HOME/ferry`, else `~/.cache/ferry`; only when this user owns it and
//! nobody else may write it) under a key of the shim's source and the PyTorch it was built for,
//! else compiled there with the machine's C++ compiler (`$CXX`, else `c++`), about half a minute
//! once; without such a cache, into a private folder for this process alone.
use std::{
    path::{Path, PathBuf},
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use sha2::{Digest, Sha256};

/// The shim's source, built into the binary.
pub const SOURCE: &str = include_str!("shim.cpp");

/// A shim library ready to load, and the private folder it was built in when it is not cached
/// (removed once the library is loaded).
pub struct Built {
    pub path: PathBuf,
    pub cached: bool,
    pub _private: Option<tempfile::TempDir>,
}

/// How long one compile may take.
const COMPILE_TIMEOUT: Duration = Duration::from_secs(300);

/// The shim built for the PyTorch whose `libtorch_cpu.so` is `torch` (version `version`).
pub fn shim(torch: &Path, version: &str) -> Result<Built, String> {
    let name = format!("libferry_torchscript-{version}.so");
    if let Some(dir) = std::env::current_exe().ok().and_then(|e| e.parent().map(Path::to_path_buf)) {
        for candidate in [dir.join(&name), dir.join("lib").join(&name), dir.join("../lib").join(&name)] {
            if candidate.is_file() {
                return Ok(Built { path: candidate, cached: false, _private: None });
            }
        }
    }
    let key: String = {
        let mut h = Sha256::new();
        h.update(SOURCE.as_bytes());
        h.update(version.as_bytes());
        h.update(torch.as_os_str().as_encoded_bytes());
        h.finalize().iter().take(12).map(|b| format!("{b:02x}")).collect()
    };
    if let Some(root) = cache_root() {
        let dir = root.join("torchscript").join(key);
        let built = dir.join("libferry_torchscript.so");
        if built.is_file() && private(&dir) && private(&built) {
            return Ok(Built { path: built, cached: true, _private: None });
        }
        if std::fs::create_dir_all(&dir).is_ok() && private(&dir) {
            compile(torch, &dir, &built)?;
            return Ok(Built { path: built, cached: true, _private: None });
        }
    }
    // No cache of this user's own: built in a private folder, for this process only.
    let temp = tempfile::Builder::new().prefix("ferry-torchscript-").tempdir().map_err(|e| e.to_string())?;
    let built = temp.path().join("libferry_torchscript.so");
    compile(torch, temp.path(), &built)?;
    Ok(Built { path: built, cached: false, _private: Some(temp) })
}

/// `$XDG_CACHE_HOME/ferry`, else `~/.cache/ferry`, when it exists or can be made.
fn cache_root() -> Option<PathBuf> {
    let home = std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache"));
    let root = std::env::var_os("XDG_CACHE_HOME").map(PathBuf::from).or(home)?.join("ferry");
    std::fs::create_dir_all(&root).ok().map(|_| root)
}

/// Whether a path is this user's and nobody else may write it (a library loaded from there runs
/// in the server).
fn private(path: &Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    // SAFETY: geteuid has no preconditions.
    let me = unsafe { libc::geteuid() };
    std::fs::symlink_metadata(path).is_ok_and(|m| m.uid() == me && m.mode() & 0o022 == 0 && !m.file_type().is_symlink())
}

/// Compiles the shim into `built` (through temporary names, so a half-written library is never
/// found and two servers compiling at once do not share a file).
fn compile(torch: &Path, dir: &Path, built: &Path) -> Result<(), String> {
    let lib = torch.parent().ok_or("PyTorch's library has no folder")?;
    let include = lib.parent().ok_or("PyTorch's library folder has no parent")?.join("include");
    if !include.join("torch/script.h").is_file() {
        return Err(format!("PyTorch's C++ headers are not at '{}'", include.display()));
    }
    let source = dir.join(format!("shim-{}.cpp", std::process::id()));
    std::fs::write(&source, SOURCE).map_err(|e| format!("cannot write '{}': {e}", source.display()))?;
    let partial = dir.join(format!("libferry_torchscript.so.partial-{}", std::process::id()));
    // `CXX` may carry arguments (`ccache g++`).
    let cxx = std::env::var("CXX").ok().filter(|c| !c.trim().is_empty()).unwrap_or_else(|| "c++".into());
    let mut words = cxx.split_whitespace();
    let program = words.next().unwrap_or("c++");
    tracing::info!(compiler = %cxx, into = %built.display(), "compiling ferry's TorchScript shim against this PyTorch (once)");
    let child = Command::new(program)
        .args(words)
        .args(["-O2", "-shared", "-fPIC", "-std=c++20", "-fopenmp", "-D_GLIBCXX_USE_CXX11_ABI=1", "-w"])
        .arg(format!("-I{}", include.display()))
        .arg(format!("-I{}", include.join("torch/csrc/api/include").display()))
        .arg(&source)
        .arg(format!("-L{}", lib.display()))
        .args(["-ltorch_cpu", "-lc10", "-o"])
        .arg(&partial)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("no C++ compiler to build the TorchScript shim ({cxx}: {e}); set CXX"));
    let result = child.and_then(|c| wait(c, &cxx));
    let _ = std::fs::remove_file(&source);
    if let Err(e) = result {
        let _ = std::fs::remove_file(&partial);
        return Err(e);
    }
    std::fs::rename(&partial, built).map_err(|e| format!("cannot put the shim in place: {e}"))
}

/// Waits for the compiler, within COMPILE_TIMEOUT.
fn wait(mut child: std::process::Child, cxx: &str) -> Result<(), String> {
    let stderr = child.stderr.take();
    let said = std::thread::spawn(move || {
        let mut text = String::new();
        if let Some(e) = stderr {
            let _ = std::io::Read::read_to_string(&mut std::io::Read::take(e, 1 << 20), &mut text);
        }
        text
    });
    let started = Instant::now();
    let status = loop {
        match child.try_wait() {
            Ok(Some(status)) => break status,
            Ok(None) if started.elapsed() > COMPILE_TIMEOUT => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(format!(
                    "{cxx} did not finish the TorchScript shim within {} s",
                    COMPILE_TIMEOUT.as_secs()
                ));
            }
            Ok(None) => std::thread::sleep(Duration::from_millis(50)),
            Err(e) => return Err(e.to_string()),
        }
    };
    if status.success() {
        return Ok(());
    }
    let text = said.join().unwrap_or_default();
    let errors: Vec<&str> = text.lines().filter(|l| l.contains("error")).take(3).collect();
    Err(format!("the TorchScript shim did not compile ({status}): {}", errors.join(" | ")))
}

/// `ferry __torchscript-shim <libtorch_cpu.so> <out.so>`: builds the shim for that PyTorch into
/// `out` (an image build ships it beside the binary).
pub fn build_command(args: &[std::ffi::OsString]) -> std::process::ExitCode {
    let [torch, out] = args else {
        eprintln!("usage: ferry {BUILD_COMMAND} <libtorch_cpu.so> <out.so>");
        return std::process::ExitCode::FAILURE;
    };
    let out = PathBuf::from(out);
    let dir = match tempfile::tempdir() {
        Ok(d) => d,
        Err(e) => {
            eprintln!("ferry: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    let built = dir.path().join("libferry_torchscript.so");
    match compile(Path::new(torch), dir.path(), &built).and_then(|()| {
        std::fs::copy(&built, &out).map(|_| ()).map_err(|e| format!("cannot write '{}': {e}", out.display()))
    }) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("ferry: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}

/// The hidden command that builds the shim.
pub const BUILD_COMMAND: &str = "__torchscript-shim";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_pytorch_is_a_clear_error() {
        let dir = tempfile::tempdir().unwrap();
        let err = compile(&dir.path().join("lib/libtorch_cpu.so"), &dir.path().join("out"), &dir.path().join("x.so"))
            .unwrap_err();
        assert!(err.contains("C++ headers are not at"), "{err}");
    }
}
