//! Finds a framework's shared library, by one rule for every framework loaded at run time: the
//! configured path (a flag or an environment variable), next to the ferry binary, then the
//! framework's package in `python3`'s site-packages.
use std::{
    ffi::{CStr, c_char},
    path::{Path, PathBuf},
    process::Command,
    sync::{Arc, OnceLock},
};

/// A framework's library and where to look for it.
#[derive(Debug, Clone, Copy)]
pub struct Framework {
    /// For messages: "ONNX Runtime", "XGBoost".
    pub name: &'static str,
    /// The library's file name; a versioned `<file>.X.Y.Z` is taken too (the newest).
    pub file: &'static str,
    /// How the path is configured, for messages: "--onnxruntime-library or ORT_DYLIB_PATH".
    pub configured_by: &'static str,
    /// The Python package that ships it, and the library's folder inside the package.
    pub package: &'static str,
    pub package_dir: &'static str,
}

pub const ONNX_RUNTIME: Framework = Framework {
    name: "ONNX Runtime",
    file: "libonnxruntime.so",
    configured_by: "--onnxruntime-library or ORT_DYLIB_PATH",
    package: "onnxruntime",
    package_dir: "capi",
};

pub const XGBOOST: Framework = Framework {
    name: "XGBoost",
    file: "libxgboost.so",
    configured_by: "--backend-config fil,xgboost-library=<path> or FERRY_XGBOOST_LIBRARY",
    package: "xgboost",
    package_dir: "lib",
};

pub const LIGHTGBM: Framework = Framework {
    name: "LightGBM",
    file: "lib_lightgbm.so",
    configured_by: "--backend-config fil,lightgbm-library=<path> or FERRY_LIGHTGBM_LIBRARY",
    package: "lightgbm",
    package_dir: "lib",
};

pub const OPENVINO: Framework = Framework {
    name: "OpenVINO",
    file: "libopenvino_c.so",
    configured_by: "--backend-config openvino,library=<path> or FERRY_OPENVINO_LIBRARY",
    package: "openvino",
    package_dir: "libs",
};

/// Where the library came from, for the log line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Located {
    pub path: PathBuf,
    pub source: &'static str,
}

pub fn locate(framework: &Framework, configured: Option<&Path>) -> Result<Located, String> {
    if let Some(path) = configured {
        return in_place(framework, path).map(|path| Located { path, source: framework.configured_by }).ok_or_else(
            || format!("no {} library at '{}' (set by {})", framework.name, path.display(), framework.configured_by),
        );
    }
    if let Some(dir) = std::env::current_exe().ok().and_then(|e| e.parent().map(Path::to_path_buf)) {
        for candidate in [dir.clone(), dir.join("lib"), dir.join("../lib")] {
            if let Some(path) = find_in_dir(framework, &candidate) {
                return Ok(Located { path, source: "next to the ferry binary" });
            }
        }
    }
    if let Some(path) = python_package(framework) {
        return Ok(Located { path, source: "the Python package" });
    }
    Err(format!(
        "{name} library not found. Set {by} to the path of {file}, place {file} next to the ferry binary, or \
         `pip install {package}`",
        name = framework.name,
        by = framework.configured_by,
        file = framework.file,
        package = framework.package,
    ))
}

/// A framework loaded once, at the first model needing it; a failure is kept and given to every
/// later model too (the library does not appear while the server runs).
pub type Loaded<T> = OnceLock<Result<Arc<T>, String>>;

/// What `cell` holds, or the framework found (`locate`) and made by `load` from its path.
pub fn load_once<T>(
    cell: &Loaded<T>,
    framework: &Framework,
    configured: Option<&Path>,
    load: impl FnOnce(&Path) -> Result<T, String>,
) -> Result<Arc<T>, String> {
    cell.get_or_init(|| {
        let located = locate(framework, configured)?;
        tracing::info!(path = %located.path.display(), source = located.source, "loading {}", framework.name);
        load(&located.path).map(Arc::new)
    })
    .clone()
}

/// One entry point of a library loaded at run time, as the field's function type (`$lib` a
/// `libloading::Library`), or an error naming the library and the symbol; used inside a function
/// returning `Result<_, String>`.
macro_rules! symbol {
    ($lib:expr, $framework:literal, $name:literal) => {
        // SAFETY: each field's type is the function's C signature in the framework's C header.
        *unsafe { $lib.get(concat!($name, "\0").as_bytes()) }
            .map_err(|e| format!("the {} library has no {}: {e}", $framework, $name))?
    };
}
pub(crate) use symbol;

/// A file is taken as is; a directory is searched for the library.
fn in_place(framework: &Framework, path: &Path) -> Option<PathBuf> {
    if path.is_file() { Some(path.to_path_buf()) } else { find_in_dir(framework, path) }
}

/// `<file>` or the newest `<file>.X.Y.Z` in `dir`.
fn find_in_dir(framework: &Framework, dir: &Path) -> Option<PathBuf> {
    let versioned = format!("{}.", framework.file);
    let mut found: Vec<PathBuf> = std::fs::read_dir(dir)
        .ok()?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            p.file_name().and_then(|n| n.to_str()).is_some_and(|n| n == framework.file || n.starts_with(&versioned))
        })
        .collect();
    found.sort();
    found.pop()
}

/// The package's folder, found without importing it (importing can take seconds).
fn python_package(framework: &Framework) -> Option<PathBuf> {
    let script = format!(
        "import importlib.util; s = importlib.util.find_spec('{}'); print(s.submodule_search_locations[0])",
        framework.package
    );
    let out = Command::new("python3").args(["-c", &script]).stderr(std::process::Stdio::null()).output().ok()?;
    if !out.status.success() {
        return None;
    }
    let dir = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
    find_in_dir(framework, &dir.join(framework.package_dir))
}

/// A framework's C string (its last error message, mostly) as text; null is empty.
///
/// # Safety
/// `p` is null or points to a NUL-terminated string that stays valid during the call.
pub unsafe fn text(p: *const c_char) -> String {
    if p.is_null() {
        return String::new();
    }
    // SAFETY: as the caller promises.
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn picks_versioned_library_in_a_directory() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("libonnxruntime.so.1.20.0"), b"").unwrap();
        std::fs::write(dir.path().join("libonnxruntime_providers_shared.so"), b"").unwrap();
        let found = locate(&ONNX_RUNTIME, Some(dir.path())).unwrap();
        assert!(found.path.ends_with("libonnxruntime.so.1.20.0"));
    }

    #[test]
    fn configured_path_that_does_not_exist_is_a_clear_error() {
        let err = locate(&XGBOOST, Some(Path::new("/nonexistent/libxgboost.so"))).unwrap_err();
        assert!(err.contains("/nonexistent/libxgboost.so") && err.contains("XGBoost"), "{err}");
        assert!(err.contains("FERRY_XGBOOST_LIBRARY"), "{err}");
    }

    #[test]
    fn a_library_in_a_configured_folder_is_found_by_its_own_name() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("lib_lightgbm.so"), b"").unwrap();
        std::fs::write(dir.path().join("libxgboost.so"), b"").unwrap();
        assert!(locate(&LIGHTGBM, Some(dir.path())).unwrap().path.ends_with("lib_lightgbm.so"));
        assert!(locate(&XGBOOST, Some(dir.path())).unwrap().path.ends_with("libxgboost.so"));
    }
}
