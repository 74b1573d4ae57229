//! The PyTorch backend: TorchScript models (platform `pytorch_libtorch`, backend `pytorch`,
//! `<version>/model.pt`) and AOTInductor packages (platform `torch_aoti`, `<version>/model.pt2`),
//! on the official PyTorch the user chooses, the one they exported with. Each instance is a
//! process of its own, as a Python model's is (the Python backend's processes, supervision and
//! shared memory, with the runner `runner.py`), so a crash or a leak in PyTorch never reaches the
//! server, and the server carries no PyTorch. Batches run as one call on the batch dimension.
//!
//! Which Python runs it: `--backend-config pytorch,python=<path>` or `FERRY_PYTORCH_PYTHON`, else
//! `python3` when it has the `torch` package, else `pytorch/bin/python3` beside the ferry binary,
//! else `python3` (whose load then says PyTorch is missing); a model's `EXECUTION_ENV_PATH` names
//! its own environment, as for Python models.
use std::path::{Path, PathBuf};

use super::python::PythonBackend;

const RUNNER: &str = include_str!("runner.py");

/// The backend, run by the Python `find_python` chose.
pub fn backend(python: &PythonBackend, given: Option<PathBuf>) -> PythonBackend {
    let chosen = find_python(given, std::env::current_exe().ok().as_deref());
    match &chosen {
        Some(p) => tracing::info!(python = %p.display(), "PyTorch models run on this Python"),
        None => tracing::info!("no Python with PyTorch found; PyTorch models will say so when they load"),
    }
    python.builtin("pytorch", "ferry_pytorch.py", RUNNER, chosen)
}

fn find_python(given: Option<PathBuf>, exe: Option<&Path>) -> Option<PathBuf> {
    if given.is_some() {
        return given;
    }
    let has_torch = std::process::Command::new("python3")
        .args(["-c", "import importlib.util, sys; sys.exit(importlib.util.find_spec('torch') is None)"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if has_torch {
        return Some(PathBuf::from("python3"));
    }
    exe.and_then(Path::parent).map(|d| d.join("pytorch/bin/python3")).filter(|p| p.is_file())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_python_given_is_the_one() {
        let given = PathBuf::from("/opt/torch/bin/python3");
        assert_eq!(find_python(Some(given.clone()), None), Some(given));
    }

    #[test]
    fn a_python_beside_the_binary_is_found() {
        let dir = tempfile::tempdir().unwrap();
        let python = dir.path().join("pytorch/bin/python3");
        std::fs::create_dir_all(python.parent().unwrap()).unwrap();
        std::fs::write(&python, "").unwrap();
        let found = find_python(None, Some(&dir.path().join("ferry")));
        // python3 on PATH wins when it has torch.
        assert!(found == Some(python) || found == Some(PathBuf::from("python3")), "{found:?}");
    }
}
