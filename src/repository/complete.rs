//! When a version folder in a bucket is complete enough to load. The rule, as the README gives it
//! to users:
//!
//! - a version folder holding `_READY` is complete (upload the marker last);
//! - a version folder holding `_MANIFEST.json` is complete once every file it lists is there with
//!   the listed size; the listed MD5 or SHA-256 digests are checked after download, and a mismatch
//!   fails the load (the versions already serving stay);
//! - once any version of a model uses a marker, its versions without one wait;
//! - a model that uses no marker: a version is complete when its listing (names, sizes, ETags) did
//!   not change between two polls. At start-up, the bucket is taken as it is.
use std::collections::HashMap;

use serde::Deserialize;

use super::storage::Object;

pub const READY: &str = "_READY";
pub const MANIFEST: &str = "_MANIFEST.json";

/// `_MANIFEST.json`: `{"files": [{"path": "model.onnx", "size": 123, "md5": "…"}]}`, paths
/// relative to the version folder; `md5` and `sha256` (hex) are optional.
#[derive(Debug, Clone, Deserialize, PartialEq, Eq)]
pub struct Manifest {
    pub files: Vec<ManifestFile>,
}

#[derive(Debug, Clone, Deserialize, PartialEq, Eq)]
pub struct ManifestFile {
    pub path: String,
    pub size: u64,
    #[serde(default)]
    pub md5: Option<String>,
    #[serde(default)]
    pub sha256: Option<String>,
}

impl Manifest {
    pub fn parse(bytes: &[u8]) -> Result<Manifest, String> {
        serde_json::from_slice(bytes).map_err(|e| format!("{MANIFEST} is not valid: {e}"))
    }
}

/// A digest to check once a file is downloaded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Digest {
    Md5(String),
    Sha256(String),
}

/// What to stage of one model, and what waits.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Selection {
    pub usable: Vec<Object>,
    /// Why versions wait, one line each.
    pub held: Vec<String>,
    /// Digests from manifests: (path relative to the repository, digest).
    pub checks: Vec<(String, Digest)>,
    /// How many version folders are usable.
    pub versions: usize,
}

/// `model/<version>/...` → the version folder's name. Only version folders count (positive
/// integers not starting with 0): `warmup/`, `initial_state/` and `configs/` belong to the model
/// and are staged whatever the markers say.
pub fn version_of(rel: &str) -> Option<&str> {
    let mut parts = rel.splitn(3, '/');
    let (_model, v, rest) = (parts.next()?, parts.next()?, parts.next());
    let numeric = !v.is_empty() && !v.starts_with('0') && v.bytes().all(|b| b.is_ascii_digit());
    (rest.is_some() && numeric).then_some(v)
}

fn is_marker(rel: &str) -> bool {
    rel.rsplit('/').next().is_some_and(|f| f == READY || f == MANIFEST)
}

/// Applies the rule to one model's objects. `previous`: its objects at the last poll (None at
/// start-up); `manifests`: each version's parsed manifest, where it has one.
pub fn select(
    objects: &[Object],
    previous: Option<&[Object]>,
    manifests: &HashMap<String, Result<Manifest, String>>,
) -> Selection {
    let has = |v: &str, name: &str| objects.iter().any(|o| version_of(&o.rel) == Some(v) && o.rel.ends_with(name));
    let marked = objects.iter().any(|o| version_of(&o.rel).is_some() && is_marker(&o.rel));
    let mut versions: Vec<&str> = objects.iter().filter_map(|o| version_of(&o.rel)).collect();
    versions.sort_unstable();
    versions.dedup();
    let mut out = Selection::default();
    let mut ok: Vec<&str> = Vec::new();
    for v in versions {
        let in_v = |list: &[Object]| -> Vec<Object> {
            list.iter().filter(|o| version_of(&o.rel) == Some(v)).cloned().collect()
        };
        let now = in_v(objects);
        let verdict: Result<(), String> = if has(v, &format!("/{READY}")) {
            Ok(())
        } else if has(v, &format!("/{MANIFEST}")) {
            match manifests.get(v) {
                Some(Ok(m)) => check_listed(v, m, &now).map(|checks| out.checks.extend(checks)),
                Some(Err(e)) => Err(format!("version {v}: {e}")),
                None => Err(format!("version {v}: {MANIFEST} was not read")),
            }
        } else if marked {
            Err(format!("version {v} is not complete yet: it has no {READY} or {MANIFEST}"))
        } else {
            match previous {
                Some(prev) if in_v(prev) != now => {
                    Err(format!("version {v} changed since the last poll; waiting for it to settle"))
                }
                _ => Ok(()),
            }
        };
        match verdict {
            Ok(()) => ok.push(v),
            Err(why) => out.held.push(why),
        }
    }
    out.versions = ok.len();
    out.usable = objects
        .iter()
        .filter(|o| !is_marker(&o.rel))
        .filter(|o| version_of(&o.rel).is_none_or(|v| ok.contains(&v)))
        .cloned()
        .collect();
    out
}

/// Every file the manifest lists is listed in the bucket with its size; returns the digests to
/// check after download.
fn check_listed(v: &str, m: &Manifest, now: &[Object]) -> Result<Vec<(String, Digest)>, String> {
    let mut checks = Vec::new();
    for f in &m.files {
        let Some(o) = now.iter().find(|o| o.rel.split_once(&format!("/{v}/")).is_some_and(|(_, r)| r == f.path)) else {
            return Err(format!("version {v} is not complete yet: '{}' in {MANIFEST} is not uploaded", f.path));
        };
        if o.size != f.size {
            return Err(format!(
                "version {v} is not complete yet: '{}' is {} bytes, {MANIFEST} says {}",
                f.path, o.size, f.size
            ));
        }
        if let Some(h) = &f.sha256 {
            checks.push((o.rel.clone(), Digest::Sha256(h.to_ascii_lowercase())));
        } else if let Some(h) = &f.md5 {
            checks.push((o.rel.clone(), Digest::Md5(h.to_ascii_lowercase())));
        }
    }
    Ok(checks)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn o(rel: &str, size: u64) -> Object {
        Object { rel: rel.into(), size, tag: "t".into() }
    }

    fn rels(s: &Selection) -> Vec<&str> {
        s.usable.iter().map(|o| o.rel.as_str()).collect()
    }

    #[test]
    fn versions_with_ready_markers() {
        let objects = vec![o("m/config.pbtxt", 1), o("m/1/model.onnx", 5), o("m/1/_READY", 0), o("m/2/model.onnx", 3)];
        let s = select(&objects, None, &HashMap::new());
        assert_eq!(rels(&s), vec!["m/config.pbtxt", "m/1/model.onnx"]);
        assert_eq!(s.versions, 1);
        assert!(s.held[0].contains("version 2 is not complete"), "{:?}", s.held);
    }

    #[test]
    fn model_folders_that_are_not_versions_are_staged_with_markers() {
        let objects = vec![
            o("m/config.pbtxt", 1),
            o("m/1/model.onnx", 5),
            o("m/1/_READY", 0),
            o("m/warmup/sample.bin", 16),
            o("m/initial_state/state.bin", 8),
        ];
        let s = select(&objects, None, &HashMap::new());
        assert_eq!(
            rels(&s),
            vec!["m/config.pbtxt", "m/1/model.onnx", "m/warmup/sample.bin", "m/initial_state/state.bin"]
        );
        assert!(s.held.is_empty(), "{:?}", s.held);
    }

    #[test]
    fn versions_without_markers_must_settle_between_polls() {
        let before = vec![o("m/1/model.onnx", 5), o("m/2/model.onnx", 3)];
        let now = vec![o("m/1/model.onnx", 5), o("m/2/model.onnx", 9)];
        let s = select(&now, Some(&before), &HashMap::new());
        assert_eq!(rels(&s), vec!["m/1/model.onnx"]);
        assert!(s.held[0].contains("version 2 changed"));
        assert_eq!(select(&now, Some(&now), &HashMap::new()).usable.len(), 2);
        assert_eq!(select(&now, None, &HashMap::new()).usable.len(), 2, "at start-up a bucket is taken as it is");
    }

    #[test]
    fn manifests_list_sizes_and_digests() {
        let m = Manifest::parse(
            br#"{"files": [{"path": "model.onnx", "size": 5, "md5": "ABC"}, {"path": "x/y.bin", "size": 2}]}"#,
        )
        .unwrap();
        let manifests = HashMap::from([("1".to_string(), Ok(m))]);
        let partial = vec![o("m/1/model.onnx", 5), o("m/1/_MANIFEST.json", 9)];
        let s = select(&partial, None, &manifests);
        assert_eq!(s.versions, 0);
        assert!(s.held[0].contains("'x/y.bin' in _MANIFEST.json is not uploaded"), "{:?}", s.held);
        let short = vec![o("m/1/model.onnx", 5), o("m/1/x/y.bin", 1), o("m/1/_MANIFEST.json", 9)];
        assert!(select(&short, None, &manifests).held[0].contains("is 1 bytes, _MANIFEST.json says 2"));
        let full = vec![o("m/1/model.onnx", 5), o("m/1/x/y.bin", 2), o("m/1/_MANIFEST.json", 9)];
        let s = select(&full, None, &manifests);
        assert_eq!(rels(&s), vec!["m/1/model.onnx", "m/1/x/y.bin"]);
        assert_eq!(s.checks, vec![("m/1/model.onnx".to_string(), Digest::Md5("abc".into()))]);
        let bad = HashMap::from([("1".to_string(), Manifest::parse(b"{"))]);
        assert!(select(&full, None, &bad).held[0].contains("_MANIFEST.json is not valid"));
    }
}
