//! The example model repository compiled into the binary (examples/), served when no
//! --model-repository is given.
use std::path::Path;

use crate::proto::inference::model_config::SchedulingChoice;

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

/// Removes the example models that need Python (Python models, and the ensembles that run one,
/// directly or through another ensemble) from an extracted repository; returns their names.
/// Pipelines without a Python step stay.
pub fn drop_python_examples(dir: &Path) -> Vec<String> {
    let configs: Vec<(String, crate::proto::inference::ModelConfig)> = std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|entry| {
            let text = std::fs::read_to_string(entry.path().join("config.pbtxt")).ok()?;
            Some((entry.file_name().to_string_lossy().to_string(), crate::proto::pbtxt::parse(&text).ok()?))
        })
        .collect();
    let mut dropped: Vec<String> =
        configs.iter().filter(|(_, c)| c.backend == "python").map(|(name, _)| name.clone()).collect();
    loop {
        let runs_dropped = |c: &crate::proto::inference::ModelConfig| {
            matches!(&c.scheduling_choice, Some(SchedulingChoice::EnsembleScheduling(e))
                if e.step.iter().any(|s| dropped.contains(&s.model_name)))
        };
        let more: Vec<String> = configs
            .iter()
            .filter(|(name, c)| !dropped.contains(name) && runs_dropped(c))
            .map(|(name, _)| name.clone())
            .collect();
        if more.is_empty() {
            break;
        }
        dropped.extend(more);
    }
    for name in &dropped {
        let _ = std::fs::remove_dir_all(dir.join(name));
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

    #[test]
    fn only_pipelines_with_a_python_step_are_dropped() {
        let dir = tempfile::tempdir().unwrap();
        super::extract(dir.path()).unwrap();
        let dropped = super::drop_python_examples(dir.path());
        assert!(dropped.contains(&"text_classifier".to_string()), "{dropped:?}");
        assert!(dropped.contains(&"text_classifier_pre".to_string()), "{dropped:?}");
        assert!(!dropped.iter().any(|d| d.starts_with("color_match")), "{dropped:?}");
        assert!(dir.path().join("color_match").is_dir() && !dir.path().join("text_classifier").exists());
    }
}
