//! The PyTorch backend: TorchScript models (platform `pytorch_libtorch`, backend `pytorch`,
//! `<version>/model.pt`) and AOTInductor packages (platform `torch_aoti`, `<version>/model.pt2`),
//! on the official PyTorch the user chooses, the one they exported with. On a CPU instance a
//! package runs inside the server through PyTorch's stable C ABI (`aoti`), and TorchScript through
//! ferry's C++ shim compiled against that PyTorch (`torchscript`). What those paths do not take
//! runs in a process of its own per instance, as a Python model does (the Python backend's
//! processes, supervision and shared memory, with the runner `runner.py`). Batches run as one
//! call on the batch dimension.
//!
//! Which Python runs it: `--backend-config pytorch,python=<path>` or `FERRY_PYTORCH_PYTHON`, else
//! `python3` when it has the `torch` package, else `pytorch/bin/python3` beside the ferry binary,
//! else `python3` (whose load then says PyTorch is missing); a model's `EXECUTION_ENV_PATH` names
//! its own environment, as for Python models.
use std::path::{Path, PathBuf};

use super::{Backend, InstanceSpec, ModelInstance, ModelIo, python::PythonBackend};
use crate::{error::Result, proto::inference::ModelConfig};

mod aoti;
mod ctensor;
mod libtorch;
mod params;
mod torchscript;

pub use aoti::trial as aoti_trial;
pub use torchscript::compile as torchscript_shim;

const RUNNER: &str = include_str!("runner.py");

/// The backend: packages in the server where they can run there, everything else in processes
/// of the Python `find_python` chose (whose PyTorch the server's packages use too).
pub struct PyTorchBackend {
    processes: PythonBackend,
    aoti: aoti::Aoti,
    torchscript: torchscript::TorchScript,
}

pub fn backend(python: &PythonBackend, given: Option<PathBuf>) -> PyTorchBackend {
    let chosen = find_python(given, std::env::current_exe().ok().as_deref());
    match &chosen {
        Some(p) => tracing::info!(python = %p.display(), "PyTorch models run on this Python"),
        None => tracing::info!("no Python with PyTorch found; PyTorch models will say so when they load"),
    }
    let torch = std::sync::Arc::new(libtorch::LibTorch::new(chosen.clone()));
    PyTorchBackend {
        aoti: aoti::Aoti::new(std::sync::Arc::clone(&torch)),
        torchscript: torchscript::TorchScript::new(torch),
        processes: python.builtin("pytorch", "ferry_pytorch.py", RUNNER, chosen),
    }
}

impl Backend for PyTorchBackend {
    fn name(&self) -> &'static str {
        "pytorch"
    }

    fn model_io(&self, model_path: &Path) -> Result<ModelIo> {
        self.processes.model_io(model_path)
    }

    fn load(&self, spec: &InstanceSpec<'_>) -> Result<Box<dyn ModelInstance>> {
        if let Some(instance) = self.aoti.load(spec)? {
            return Ok(instance);
        }
        match self.torchscript.load(spec)? {
            Some(instance) => Ok(instance),
            None => self.processes.load(spec),
        }
    }

    fn auto_complete(&self, model_path: &Path, config: &mut ModelConfig) -> Result<()> {
        self.processes.auto_complete(model_path, config)
    }
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
