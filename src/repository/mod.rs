//! Model repositories: finding model folders and their versions on storage, reading configs,
//! loading versions, and the registry of what serves.
use std::path::{Path, PathBuf};

use crate::proto::inference::{ModelVersionPolicy, model_version_policy::PolicyChoice};

pub mod agents;
pub mod chat_template;
pub mod checksums;
pub mod cloud_credentials;
pub mod complete;
pub mod config;
pub mod control;
pub mod embedded;
pub mod layout;
pub mod loader;
pub mod registry;
pub mod sources;
pub mod startup;
pub mod storage;
pub mod warmup;

/// A model folder found in a repository.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Found {
    pub name: String,
    pub dir: PathBuf,
    /// The index of its repository root.
    pub root: usize,
}

/// The model folders of the repository roots given (with their indexes). A name in two roots
/// is an error for that name (neither copy loads), unless `namespacing`: then each root is its
/// own namespace. Folders that hold neither config.pbtxt nor a version are skipped.
pub fn scan(roots: &[(usize, PathBuf)], namespacing: bool) -> (Vec<Found>, Vec<(String, String)>) {
    let mut found: Vec<Found> = Vec::new();
    let mut duplicates: Vec<(String, String)> = Vec::new();
    for (index, root) in roots {
        let entries = match std::fs::read_dir(root) {
            Ok(e) => e,
            Err(e) => {
                tracing::error!(repository = %root.display(), error = %e, "cannot read model repository");
                continue;
            }
        };
        let mut dirs: Vec<PathBuf> = entries.filter_map(|e| e.ok()).map(|e| e.path()).filter(|p| p.is_dir()).collect();
        dirs.sort();
        for dir in dirs {
            let Some(name) = dir.file_name().and_then(|n| n.to_str()).map(str::to_string) else {
                continue;
            };
            if let Err(e) = crate::names::check_model_name(&name) {
                tracing::warn!(folder = %dir.display(), error = %e, "skipping a folder that cannot be a model");
                continue;
            }
            if namespacing && name.contains("::") {
                // `<repository>::<name>` addresses a model under namespacing: a folder of such a
                // name would shadow another repository's model.
                tracing::warn!(folder = %dir.display(), "skipping a folder whose name holds '::' (with --model-namespacing it would read as another repository's model)");
                continue;
            }
            if !dir.join(config::CONFIG_FILE).is_file() && version_dirs(&dir).is_empty() {
                tracing::warn!(folder = %dir.display(), "skipping a folder that is not a model (no config.pbtxt, no version folder)");
                continue;
            }
            if namespacing {
                found.push(Found { name, dir, root: *index });
            } else if let Some(first) = found.iter().position(|f| f.name == name) {
                let other = found.remove(first);
                duplicates.push((
                    name.clone(),
                    format!("model '{name}' is in two repositories: '{}' and '{}'", other.dir.display(), dir.display()),
                ));
            } else if !duplicates.iter().any(|(n, _)| *n == name) {
                found.push(Found { name, dir, root: *index });
            }
        }
    }
    found.sort_by(|a, b| (&a.name, a.root).cmp(&(&b.name, b.root)));
    (found, duplicates)
}

/// Version folders of a model: integer names, not starting with `0`.
pub fn version_dirs(dir: &Path) -> Vec<u64> {
    let mut versions: Vec<u64> = std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .filter_map(|e| e.ok())
        .filter(|e| e.path().is_dir())
        .filter_map(|e| e.file_name().to_str().and_then(|n| if n.starts_with('0') { None } else { n.parse().ok() }))
        .collect();
    versions.sort_unstable();
    versions
}

/// The versions a policy serves out of those available (ascending).
pub fn select_versions(policy: Option<&ModelVersionPolicy>, available: &[u64]) -> Vec<u64> {
    match policy.and_then(|p| p.policy_choice.as_ref()) {
        Some(PolicyChoice::All(_)) => available.to_vec(),
        Some(PolicyChoice::Specific(s)) => {
            available.iter().copied().filter(|v| s.versions.iter().any(|&w| w >= 0 && w as u64 == *v)).collect()
        }
        Some(PolicyChoice::Latest(l)) => {
            let n = (l.num_versions.max(1) as usize).min(available.len());
            available[available.len() - n..].to_vec()
        }
        None => available.last().copied().into_iter().collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proto::inference::model_version_policy::{All, Latest, Specific};

    fn policy(p: PolicyChoice) -> ModelVersionPolicy {
        ModelVersionPolicy { policy_choice: Some(p) }
    }

    #[test]
    fn version_policies() {
        let have = [1, 2, 5];
        assert_eq!(select_versions(None, &have), vec![5]);
        assert_eq!(select_versions(Some(&policy(PolicyChoice::Latest(Latest { num_versions: 2 }))), &have), vec![2, 5]);
        assert_eq!(select_versions(Some(&policy(PolicyChoice::All(All {}))), &have), vec![1, 2, 5]);
        let specific = policy(PolicyChoice::Specific(Specific { versions: vec![1, 3] }));
        assert_eq!(select_versions(Some(&specific), &have), vec![1]);
        assert!(select_versions(None, &[]).is_empty());
    }

    #[test]
    fn scan_finds_models_skips_others_and_flags_duplicates() {
        let a = tempfile::tempdir().unwrap();
        let b = tempfile::tempdir().unwrap();
        for (root, name) in [(&a, "m1"), (&a, "dup"), (&b, "dup"), (&b, "m2")] {
            std::fs::create_dir_all(root.path().join(name).join("1")).unwrap();
        }
        std::fs::create_dir_all(a.path().join("notes")).unwrap();
        std::fs::create_dir_all(a.path().join("m1").join("01")).unwrap();
        std::fs::create_dir_all(a.path().join("m1").join("x")).unwrap();
        let roots = [(0, a.path().to_path_buf()), (1, b.path().to_path_buf())];
        let (found, dups) = scan(&roots, false);
        let names: Vec<&str> = found.iter().map(|f| f.name.as_str()).collect();
        assert_eq!(names, vec!["m1", "m2"]);
        assert_eq!(dups.len(), 1);
        assert!(dups[0].1.contains("two repositories"));
        // With namespacing, both copies are found, each with its root.
        let (found, dups) = scan(&roots, true);
        let named: Vec<(&str, usize)> = found.iter().map(|f| (f.name.as_str(), f.root)).collect();
        assert_eq!(named, vec![("dup", 0), ("dup", 1), ("m1", 0), ("m2", 1)]);
        assert!(dups.is_empty());
        assert_eq!(version_dirs(&a.path().join("m1")), vec![1]);
    }
}
