//! `model_repository_agents`, as far as ferry runs them. Triton's `checksum` agent is run here:
//! each `MD5:<path>` parameter names a file of the model folder and its MD5 digest (hex), and a
//! file that does not match fails the load. Other agents (relocation, decryption) are not run:
//! the load says so in a warning instead of ignoring them silently.
use std::{io::Read, path::Path};

use md5::{Digest, Md5};

use crate::proto::inference::ModelConfig;

/// Checks what the config's agents ask that ferry can; returns the warnings for the rest.
pub fn run(cfg: &ModelConfig, dir: &Path) -> Result<Vec<String>, String> {
    let mut warnings = Vec::new();
    let Some(agents) = &cfg.model_repository_agents else { return Ok(warnings) };
    for agent in &agents.agents {
        if agent.name != "checksum" {
            warnings.push(format!(
                "model_repository_agents: agent '{}' is not run by ferry (only 'checksum' is); the model loads as \
                 its files are",
                agent.name.escape_debug()
            ));
            continue;
        }
        for (key, expected) in &agent.parameters {
            let at = |why: String| format!("model_repository_agents checksum '{}': {why}", key.escape_debug());
            let (algorithm, rel) = key.split_once(':').ok_or_else(|| at("expected '<algorithm>:<path>'".into()))?;
            if algorithm != "MD5" {
                return Err(at(format!("algorithm '{}' is not supported (MD5 is)", algorithm.escape_debug())));
            }
            let got = md5_of(dir, rel).map_err(at)?;
            if !got.eq_ignore_ascii_case(expected.trim()) {
                return Err(at(format!("the file's MD5 is {got}, the config expects '{}'", expected.escape_debug())));
            }
        }
    }
    Ok(warnings)
}

/// The MD5 (hex) of a regular file inside the model folder, read in pieces.
fn md5_of(dir: &Path, rel: &str) -> Result<String, String> {
    let path = dir.join(crate::names::relative_path(rel)?);
    let meta = std::fs::metadata(&path).map_err(|_| format!("cannot read '{}'", rel.escape_debug()))?;
    if !meta.is_file() {
        return Err(format!("'{}' is not a regular file", rel.escape_debug()));
    }
    let mut file =
        std::fs::File::open(&path).map_err(|e| format!("cannot read '{}': {}", rel.escape_debug(), e.kind()))?;
    let (mut hash, mut buf) = (Md5::new(), vec![0u8; 1 << 20]);
    loop {
        let n = file.read(&mut buf).map_err(|e| format!("cannot read '{}': {e}", rel.escape_debug()))?;
        if n == 0 {
            break;
        }
        hash.update(&buf[..n]);
    }
    Ok(hash.finalize().iter().map(|b| format!("{b:02x}")).collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proto::inference::{ModelRepositoryAgents, model_repository_agents::Agent};

    fn with(agents: Vec<(&str, Vec<(&str, &str)>)>) -> ModelConfig {
        let agents = agents
            .into_iter()
            .map(|(name, params)| Agent {
                name: name.into(),
                parameters: params.into_iter().map(|(k, v)| (k.to_string(), v.to_string())).collect(),
            })
            .collect();
        ModelConfig { model_repository_agents: Some(ModelRepositoryAgents { agents }), ..Default::default() }
    }

    #[test]
    fn checksums_are_checked_and_other_agents_warned_about() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir(dir.path().join("1")).unwrap();
        std::fs::write(dir.path().join("1/model.bin"), b"hello").unwrap();
        let md5 = "5d41402abc4b2a76b9719d911017c592";
        assert!(run(&with(vec![("checksum", vec![("MD5:1/model.bin", md5)])]), dir.path()).unwrap().is_empty());
        let e = run(&with(vec![("checksum", vec![("MD5:1/model.bin", "0000")])]), dir.path()).unwrap_err();
        assert!(e.contains(md5) && e.contains("'0000'"), "{e}");
        for (key, what) in [
            ("SHA1:1/model.bin", "not supported"),
            ("1/model.bin", "expected"),
            ("MD5:../etc/passwd", "inside the model folder"),
            ("MD5:1", "not a regular file"),
            ("MD5:2/none", "cannot read"),
        ] {
            let e = run(&with(vec![("checksum", vec![(key, md5)])]), dir.path()).unwrap_err();
            assert!(e.contains(what), "{key}: {e}");
        }
        let w = run(&with(vec![("relocation", vec![])]), dir.path()).unwrap();
        assert!(w[0].contains("'relocation' is not run"), "{w:?}");
    }
}
