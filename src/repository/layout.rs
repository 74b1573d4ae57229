//! Where the models are in a folder a platform hands over (SageMaker's read-only `/opt/ml/model`):
//! a repository root (`<m>/config.pbtxt`, `<m>/<version>/`), a single model folder
//! (`config.pbtxt` and versions at the top), or one wrapper folder around a repository root
//! (archives made from the parent folder). Nothing is ever written into the folder.
use std::path::{Path, PathBuf};

use super::{config::CONFIG_FILE, version_dirs};

fn is_model(dir: &Path) -> bool {
    dir.join(CONFIG_FILE).is_file() || !version_dirs(dir).is_empty()
}

fn subdirs(dir: &Path) -> Vec<PathBuf> {
    let mut d: Vec<PathBuf> = std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.is_dir())
        .collect();
    d.sort();
    d
}

/// The top two levels of a folder, for the error that says what was found.
fn tree(dir: &Path) -> String {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let p = entry.path();
        let name = entry.file_name().to_string_lossy().to_string();
        if p.is_dir() {
            let inner: Vec<String> = std::fs::read_dir(&p)
                .into_iter()
                .flatten()
                .flatten()
                .map(|e| e.file_name().to_string_lossy().to_string())
                .collect();
            out.push(format!("{name}/ [{}]", inner.join(", ")));
        } else {
            out.push(name);
        }
    }
    out.sort();
    if out.is_empty() { "(empty)".into() } else { out.join("; ") }
}

/// The repository roots to serve from `base`; a single model folder is served under `name`
/// through a link in a temporary folder (kept alive by the returned guard).
pub fn detect(base: &Path, name: &str) -> Result<(Vec<PathBuf>, Option<tempfile::TempDir>), String> {
    if is_model(base) {
        let temp = tempfile::Builder::new().prefix("ferry-model-").tempdir().map_err(|e| e.to_string())?;
        std::os::unix::fs::symlink(base, temp.path().join(name)).map_err(|e| e.to_string())?;
        tracing::info!(folder = %base.display(), model = name, "the folder is a single model");
        return Ok((vec![temp.path().to_path_buf()], Some(temp)));
    }
    let children = subdirs(base);
    if children.iter().any(|c| is_model(c)) {
        return Ok((vec![base.to_path_buf()], None));
    }
    if let [wrapper] = children.as_slice()
        && subdirs(wrapper).iter().any(|c| is_model(c))
    {
        tracing::info!(folder = %wrapper.display(), "the models are inside one wrapper folder");
        return Ok((vec![wrapper.clone()], None));
    }
    Err(format!(
        "no model found in '{}'. Found: {}. Expected one of: <model>/config.pbtxt with <model>/<version>/model.onnx \
         (a repository root); config.pbtxt with <version>/model.onnx at the top (one model); or one folder holding a \
         repository root",
        base.display(),
        tree(base)
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn model(dir: &Path) {
        std::fs::create_dir_all(dir.join("1")).unwrap();
        std::fs::write(dir.join(CONFIG_FILE), "").unwrap();
    }

    #[test]
    fn the_three_layouts() {
        let root = tempfile::tempdir().unwrap();
        model(&root.path().join("m"));
        assert_eq!(detect(root.path(), "x").unwrap().0, vec![root.path().to_path_buf()]);

        let single = tempfile::tempdir().unwrap();
        model(single.path());
        let (roots, guard) = detect(single.path(), "mine").unwrap();
        assert!(roots[0].join("mine").join(CONFIG_FILE).is_file());
        drop(guard);

        let wrapped = tempfile::tempdir().unwrap();
        model(&wrapped.path().join("repo").join("m"));
        assert_eq!(detect(wrapped.path(), "x").unwrap().0, vec![wrapped.path().join("repo")]);

        let empty = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(empty.path().join("stuff")).unwrap();
        std::fs::write(empty.path().join("stuff/readme"), "").unwrap();
        let e = detect(empty.path(), "x").unwrap_err();
        assert!(e.contains("stuff/ [readme]") && e.contains("Expected one of"), "{e}");
    }
}
