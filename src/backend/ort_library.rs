//! Finds the ONNX Runtime shared library at start-up: the configured path (flag or
//! ORT_DYLIB_PATH), next to the binary, then an installed Python `onnxruntime` package.
use std::{
    path::{Path, PathBuf},
    process::Command,
};

/// Where the library came from, for the log line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Located {
    pub path: PathBuf,
    pub source: &'static str,
}

pub fn locate(configured: Option<&Path>) -> Result<Located, String> {
    if let Some(path) = configured {
        return in_place(path)
            .map(|path| Located { path, source: "--onnxruntime-library / ORT_DYLIB_PATH" })
            .ok_or_else(|| {
                format!(
                    "no ONNX Runtime library at '{}' (set by --onnxruntime-library or ORT_DYLIB_PATH)",
                    path.display()
                )
            });
    }
    if let Some(dir) = std::env::current_exe().ok().and_then(|e| e.parent().map(Path::to_path_buf)) {
        for candidate in [dir.clone(), dir.join("lib"), dir.join("../lib")] {
            if let Some(path) = find_in_dir(&candidate) {
                return Ok(Located { path, source: "next to the ferry binary" });
            }
        }
    }
    if let Some(path) = python_package() {
        return Ok(Located { path, source: "the Python onnxruntime package" });
    }
    Err("ONNX Runtime library not found. Pass --onnxruntime-library=/path/to/libonnxruntime.so (or set \
         ORT_DYLIB_PATH), place libonnxruntime.so next to the ferry binary, or `pip install onnxruntime`"
        .to_string())
}

/// A file is taken as is; a directory is searched for the library.
fn in_place(path: &Path) -> Option<PathBuf> {
    if path.is_file() { Some(path.to_path_buf()) } else { find_in_dir(path) }
}

/// `libonnxruntime.so` or the newest `libonnxruntime.so.X.Y.Z` in `dir`.
fn find_in_dir(dir: &Path) -> Option<PathBuf> {
    let mut found: Vec<PathBuf> = std::fs::read_dir(dir)
        .ok()?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n == "libonnxruntime.so" || n.starts_with("libonnxruntime.so."))
        })
        .collect();
    found.sort();
    found.pop()
}

fn python_package() -> Option<PathBuf> {
    let out = Command::new("python3")
        .args(["-c", "import os, onnxruntime; print(os.path.dirname(onnxruntime.__file__))"])
        .output()
        .ok()?;
    if !out.status.success() {
        return None;
    }
    let dir = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
    find_in_dir(&dir.join("capi"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn picks_versioned_library_in_a_directory() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("libonnxruntime.so.1.20.0"), b"").unwrap();
        std::fs::write(dir.path().join("libonnxruntime_providers_shared.so"), b"").unwrap();
        let found = locate(Some(dir.path())).unwrap();
        assert!(found.path.ends_with("libonnxruntime.so.1.20.0"));
    }

    #[test]
    fn configured_path_that_does_not_exist_is_a_clear_error() {
        let err = locate(Some(Path::new("/nonexistent/libonnxruntime.so"))).unwrap_err();
        assert!(err.contains("/nonexistent/libonnxruntime.so"), "{err}");
    }
}
