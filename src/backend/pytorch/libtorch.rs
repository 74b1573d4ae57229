//! Where the server finds PyTorch's `libtorch_cpu.so` (the `torch` package of the Python the
//! PyTorch backend runs, found without importing it; else as ONNX Runtime is found), loaded once
//! at the first model that runs inside the server, and what the package says of itself.
use std::{
    path::{Path, PathBuf},
    sync::{Arc, OnceLock},
};

use super::{super::library, ctensor::Torch};

const TORCH: library::Framework = library::Framework {
    name: "PyTorch",
    file: "libtorch_cpu.so",
    configured_by: "--backend-config pytorch,python=<path> or FERRY_PYTORCH_PYTHON",
    package: "torch",
    package_dir: "lib",
};

pub struct LibTorch {
    /// The Python whose `torch` package the library comes from; None: found as for ONNX Runtime.
    python: Option<PathBuf>,
    torch: library::Loaded<Torch>,
}

impl LibTorch {
    pub fn new(python: Option<PathBuf>) -> Self {
        LibTorch { python, torch: OnceLock::new() }
    }

    /// PyTorch, loaded (once).
    pub fn get(&self) -> Result<Arc<Torch>, String> {
        // Asking the Python where its torch is takes a process; once is enough.
        if let Some(done) = self.torch.get() {
            return done.clone();
        }
        let configured = self.python.as_deref().and_then(torch_folder);
        library::load_once(&self.torch, &TORCH, configured.as_deref(), |path| {
            let torch = Torch::load(path)?;
            tracing::info!(path = %path.display(), "PyTorch loaded into the server");
            Ok(torch)
        })
    }
}

/// The `torch` package's `lib` folder of the given Python, found without importing it.
fn torch_folder(python: &Path) -> Option<PathBuf> {
    let script = "import importlib.util; s = importlib.util.find_spec('torch'); print(s.submodule_search_locations[0])";
    let out =
        std::process::Command::new(python).args(["-c", script]).stderr(std::process::Stdio::null()).output().ok()?;
    out.status.success().then(|| PathBuf::from(String::from_utf8_lossy(&out.stdout).trim()).join("lib"))
}

/// The version of the `torch` package whose `lib/libtorch_cpu.so` this is (`torch/version.py`'s
/// `__version__`), read without importing it.
pub fn version(library: &Path) -> Option<String> {
    let file = library.parent()?.parent()?.join("version.py");
    let text = std::fs::read_to_string(file).ok()?;
    let line = text.lines().find(|l| l.trim_start().starts_with("__version__"))?;
    let value = line.split_once('=')?.1.trim().trim_matches(['\'', '"']);
    (!value.is_empty() && value.len() < 64).then(|| value.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_version_is_read_from_the_package() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join("torch/lib")).unwrap();
        std::fs::write(
            dir.path().join("torch/version.py"),
            "from typing import Optional\n__version__ = '2.15.0+cu132'\n",
        )
        .unwrap();
        assert_eq!(version(&dir.path().join("torch/lib/libtorch_cpu.so")).as_deref(), Some("2.15.0+cu132"));
        assert_eq!(version(&dir.path().join("elsewhere/lib/libtorch_cpu.so")), None);
    }
}
