//! Triton's credential file (`TRITON_CLOUD_CREDENTIAL_PATH`): per-prefix credentials for `gs`,
//! `s3` and `as` URLs in one JSON file; the longest name that starts a repository URL wins (""
//! matches every URL of its scheme). A URL no entry matches uses the environment's credentials.
use std::path::{Path, PathBuf};

use serde::Deserialize;

/// Longest credential file read (it holds a few keys).
const MAX_BYTES: u64 = 1 << 20;

#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct S3Key {
    #[serde(default)]
    pub key_id: String,
    #[serde(default)]
    pub secret_key: String,
    #[serde(default)]
    pub session_token: String,
    #[serde(default)]
    pub region: String,
    #[serde(default)]
    pub profile: String,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AzureKey {
    #[serde(default)]
    pub account_str: String,
    #[serde(default)]
    pub account_key: String,
    /// `managed_identity` or `default` (AZURE_STORAGE_AUTH_TYPE's values).
    #[serde(default)]
    pub auth_type: String,
    #[serde(default)]
    pub client_id: String,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CloudCredentials {
    #[serde(default)]
    gs: std::collections::BTreeMap<String, PathBuf>,
    #[serde(default)]
    s3: std::collections::BTreeMap<String, S3Key>,
    #[serde(default, rename = "as")]
    azure: std::collections::BTreeMap<String, AzureKey>,
}

/// The entry whose name is the longest start of `url`.
fn longest<'a, T>(entries: &'a std::collections::BTreeMap<String, T>, url: &str) -> Option<&'a T> {
    entries.iter().filter(|(name, _)| url.starts_with(name.as_str())).max_by_key(|(name, _)| name.len()).map(|(_, v)| v)
}

impl CloudCredentials {
    pub fn parse(text: &str) -> Result<CloudCredentials, String> {
        // serde's words may quote a value, which may be a secret: only where, and what kind.
        serde_json::from_str(text).map_err(|e| {
            format!(
                "not a credential file as Triton reads it ({:?} error at line {}, column {})",
                e.classify(),
                e.line(),
                e.column()
            )
        })
    }

    /// Reads the file (at most 1 MiB); errors name the file, never a key.
    pub fn read(path: &Path) -> Result<CloudCredentials, String> {
        let at = |e: String| format!("TRITON_CLOUD_CREDENTIAL_PATH '{}': {e}", path.display());
        let file = std::fs::File::open(path).map_err(|e| at(e.to_string()))?;
        let mut text = String::new();
        std::io::Read::read_to_string(&mut std::io::Read::take(file, MAX_BYTES + 1), &mut text)
            .map_err(|e| at(e.to_string()))?;
        if text.len() as u64 > MAX_BYTES {
            return Err(at(format!("larger than {MAX_BYTES} bytes")));
        }
        Self::parse(&text).map_err(at)
    }

    pub fn gcs(&self, url: &str) -> Option<&Path> {
        longest(&self.gs, url).map(PathBuf::as_path)
    }

    pub fn s3(&self, url: &str) -> Option<&S3Key> {
        longest(&self.s3, url)
    }

    pub fn azure(&self, url: &str) -> Option<&AzureKey> {
        longest(&self.azure, url)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const FILE: &str = r#"{
      "gs": {"": "/keys/default.json", "gs://gcs-bucket-002": "/keys/two.json"},
      "s3": {
        "": {"secret_key": "S1", "key_id": "K1", "region": "us-east-1", "session_token": "", "profile": ""},
        "s3://s3-bucket-002": {"secret_key": "S2", "key_id": "K2", "region": "eu-west-1", "session_token": "T2", "profile": "p2"}
      },
      "as": {
        "": {"account_str": "acct", "account_key": "key"},
        "as://Account-MI/Container": {"account_str": "Account-MI", "auth_type": "managed_identity", "client_id": "cid"}
      }
    }"#;

    #[test]
    fn a_malformed_file_is_refused_without_quoting_it() {
        let e = CloudCredentials::parse(r#"{"s3": {"": "AKIASECRETVALUE"}}"#).err().unwrap();
        assert!(!e.contains("AKIASECRETVALUE") && e.contains("line 1"), "{e}");
    }

    #[test]
    fn the_longest_matching_name_wins() {
        let c = CloudCredentials::parse(FILE).unwrap();
        assert_eq!(c.gcs("gs://gcs-bucket-002/model_repository"), Some(Path::new("/keys/two.json")));
        assert_eq!(c.gcs("gs://any-other-gcs-bucket"), Some(Path::new("/keys/default.json")));
        assert_eq!(c.s3("s3://s3-bucket-002/repo").unwrap().key_id, "K2");
        assert_eq!(c.s3("s3://s3-bucket-002/repo").unwrap().session_token, "T2");
        assert_eq!(c.s3("s3://elsewhere/repo").unwrap().key_id, "K1");
        assert_eq!(c.azure("as://Account-MI/Container/models").unwrap().auth_type, "managed_identity");
        assert_eq!(c.azure("as://other/c").unwrap().account_key, "key");
    }

    #[test]
    fn a_scheme_with_no_default_falls_back_to_the_environment() {
        let c = CloudCredentials::parse(r#"{"s3": {"s3://only-this": {"key_id": "K", "secret_key": "S"}}}"#).unwrap();
        assert!(c.s3("s3://another/repo").is_none());
        assert!(c.gcs("gs://b").is_none());
        assert_eq!(c.s3("s3://only-this/r").unwrap().key_id, "K");
    }

    #[test]
    fn malformed_files_are_refused_without_echoing_keys() {
        for bad in [r#"{"s3": {"": {"key": "SECRET"}}}"#, "42", r#"{"gcs": {}}"#, "{"] {
            let e = CloudCredentials::parse(bad).unwrap_err();
            assert!(!e.contains("SECRET"), "{e}");
        }
        let dir = std::env::temp_dir().join(format!("ferry-cred-{}", std::process::id()));
        std::fs::write(&dir, vec![b' '; (MAX_BYTES + 10) as usize]).unwrap();
        assert!(CloudCredentials::read(&dir).unwrap_err().contains("larger than"));
        std::fs::remove_file(&dir).unwrap();
        assert!(CloudCredentials::read(Path::new("/no/such/file")).unwrap_err().contains("/no/such/file"));
    }
}
