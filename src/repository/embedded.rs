//! The example model repository compiled into the binary (examples/), served when no
//! --model-repository is given.
use std::path::Path;

mod files {
    include!(concat!(env!("OUT_DIR"), "/embedded_examples.rs"));
}

/// Writes the example repository under `dir` and returns how many files it wrote.
pub fn extract(dir: &Path) -> std::io::Result<usize> {
    for (rel, bytes) in files::FILES {
        let path = dir.join(rel);
        if let Some(parent) = path.parent() {
            std::fs::create_dir_all(parent)?;
        }
        std::fs::write(path, bytes)?;
    }
    Ok(files::FILES.len())
}

/// Removes the example models that need Python (Python models, and the ensembles that run
/// them) from an extracted repository; returns their names.
pub fn drop_python_examples(dir: &Path) -> Vec<String> {
    let mut dropped = Vec::new();
    for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let config = std::fs::read_to_string(entry.path().join("config.pbtxt")).unwrap_or_default();
        if config.contains("backend: \"python\"") || config.contains("platform: \"ensemble\"") {
            let _ = std::fs::remove_dir_all(entry.path());
            dropped.push(entry.file_name().to_string_lossy().to_string());
        }
    }
    dropped.sort();
    dropped
}

#[cfg(test)]
mod tests {
    #[test]
    fn extracts_every_embedded_file() {
        let dir = tempfile::tempdir().unwrap();
        let n = super::extract(dir.path()).unwrap();
        assert_eq!(n, super::files::FILES.len());
        for (rel, bytes) in super::files::FILES {
            assert_eq!(std::fs::read(dir.path().join(rel)).unwrap(), *bytes);
        }
    }
}
