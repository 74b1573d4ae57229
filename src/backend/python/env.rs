//! Which Python runs a model: `EXECUTION_ENV_PATH` (`$$TRITON_MODEL_DIRECTORY` expands to the
//! model's folder) naming a folder with `bin/python3` or a conda-pack archive (`.tar.gz`, `.tgz`,
//! `.tar`), unpacked once into the model cache; else `--backend-config python,executable=...`;
//! else `python3` on PATH.
use std::path::{Path, PathBuf};

use super::PythonSettings;
use crate::{
    error::{Error, Result},
    proto::inference::ModelConfig,
};

pub fn python_for(settings: &PythonSettings, config: &ModelConfig, model_dir: &Path) -> Result<PathBuf> {
    let Some(env) = config.parameters.get("EXECUTION_ENV_PATH").map(|p| p.string_value.as_str()) else {
        return Ok(settings.executable.clone().unwrap_or_else(|| PathBuf::from("python3")));
    };
    let path = PathBuf::from(env.replace("$$TRITON_MODEL_DIRECTORY", &model_dir.display().to_string()));
    let fail = |why: String| Error::invalid(format!("model '{}': EXECUTION_ENV_PATH '{env}': {why}", config.name));
    let meta = std::fs::metadata(&path).map_err(|e| fail(format!("{}", e.kind())))?;
    let root = if meta.is_dir() { path } else { unpack(&path, meta.len(), &settings.envs_dir).map_err(fail)? };
    let python = ["bin/python3", "bin/python"].iter().map(|p| root.join(p)).find(|p| p.is_file());
    python.ok_or_else(|| fail(format!("'{}' holds no bin/python3", root.display())))
}

/// Unpacks an environment archive into `<envs>/<digest>` once (later loads reuse it), then runs
/// conda-pack's `bin/conda-unpack` when the archive has one.
fn unpack(archive: &Path, size: u64, envs: &Path) -> std::result::Result<PathBuf, String> {
    let modified = std::fs::metadata(archive)
        .and_then(|m| m.modified())
        .map(|t| t.duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos()))
        .unwrap_or(0);
    let key = format!("{:x}", <md5::Md5 as md5::Digest>::digest(format!("{}:{size}:{modified}", archive.display())));
    let dest = envs.join(&key);
    if dest.join(".ferry-unpacked").is_file() {
        return Ok(dest);
    }
    let name = archive.file_name().and_then(|n| n.to_str()).unwrap_or_default().to_string();
    let staging = envs.join(format!("{key}.partial-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&staging);
    std::fs::create_dir_all(&staging).map_err(|e| format!("cannot create {}: {e}", staging.display()))?;
    let file = std::fs::File::open(archive).map_err(|e| e.to_string())?;
    let reader: Box<dyn std::io::Read> = if name.ends_with(".tar") {
        Box::new(file)
    } else if name.ends_with(".tar.gz") || name.ends_with(".tgz") {
        Box::new(flate2::read::GzDecoder::new(file))
    } else {
        return Err("expected a folder or a .tar.gz / .tgz / .tar archive".into());
    };
    tracing::info!(archive = %archive.display(), into = %dest.display(), "unpacking a Python environment");
    // tar's unpack refuses entries that would land outside the destination.
    tar::Archive::new(reader).unpack(&staging).map_err(|e| format!("cannot unpack: {e}"))?;
    let python = staging.join("bin/python3");
    let fixer = staging.join("bin/conda-unpack");
    if fixer.is_file() && python.is_file() {
        let status = std::process::Command::new(&python).arg(&fixer).status().map_err(|e| e.to_string())?;
        if !status.success() {
            return Err(format!("conda-unpack failed ({status})"));
        }
    }
    std::fs::write(staging.join(".ferry-unpacked"), b"").map_err(|e| e.to_string())?;
    let _ = std::fs::remove_dir_all(&dest);
    std::fs::rename(&staging, &dest).map_err(|e| format!("cannot move the environment into place: {e}"))?;
    Ok(dest)
}
