//! Flags for model repositories in object storage, the local model cache and poll mode.
use std::path::PathBuf;

use clap::{ArgAction, Args};

use crate::repository::storage::StorageSettings;

#[derive(Args, Debug, Clone)]
pub(super) struct StorageArgs {
    /// Seconds between repository polls in `--model-control-mode=poll`.
    #[arg(long, env = "FERRY_REPOSITORY_POLL_SECS", default_value_t = 15)]
    repository_poll_secs: u64,
    /// Where bucket objects are cached and model folders staged (reused across restarts).
    #[arg(long, env = "FERRY_MODEL_CACHE_DIR")]
    model_cache_dir: Option<PathBuf>,
    /// Read buckets without credentials (public buckets, emulators). Never a silent fallback.
    #[arg(long, env = "FERRY_STORAGE_ANONYMOUS", default_value = "false", num_args = 0..=1, default_missing_value = "true", action = ArgAction::Set)]
    storage_anonymous: bool,
    /// An S3-compatible endpoint, addressed path-style (MinIO, moto); also AWS_ENDPOINT_URL_S3.
    #[arg(long, env = "FERRY_S3_ENDPOINT")]
    s3_endpoint: Option<String>,
    /// The bucket's region (default: the AWS configuration's, else asked of S3).
    #[arg(long, env = "FERRY_S3_REGION")]
    s3_region: Option<String>,
    /// A Cloud Storage endpoint other than Google's (an emulator); also STORAGE_EMULATOR_HOST.
    #[arg(long, env = "FERRY_GCS_ENDPOINT")]
    gcs_endpoint: Option<String>,
    /// Objects downloaded at once.
    #[arg(long, env = "FERRY_STORAGE_PARALLELISM", default_value_t = 16)]
    storage_parallelism: usize,
    /// Objects larger than this many MiB are read in ranged parts of this size.
    #[arg(long, env = "FERRY_STORAGE_PART_MIB", default_value_t = 16)]
    storage_part_mib: u64,
    /// Retries of a failed storage request (with backoff).
    #[arg(long, env = "FERRY_STORAGE_RETRIES", default_value_t = 5)]
    storage_retries: usize,
}

/// What the storage flags resolve to.
#[derive(Debug, Clone)]
pub struct Storage {
    pub settings: StorageSettings,
    pub cache_dir: PathBuf,
    pub poll_secs: u64,
}

impl StorageArgs {
    pub(super) fn resolve(&self, env: &dyn Fn(&str) -> Option<String>) -> Storage {
        let with_scheme = |h: String| if h.contains("://") { h } else { format!("http://{h}") };
        let settings = StorageSettings {
            s3_endpoint: self
                .s3_endpoint
                .clone()
                .or_else(|| env("AWS_ENDPOINT_URL_S3"))
                .or_else(|| env("AWS_ENDPOINT_URL")),
            s3_region: self.s3_region.clone(),
            gcs_endpoint: self.gcs_endpoint.clone().or_else(|| env("STORAGE_EMULATOR_HOST")).map(with_scheme),
            gcs_credentials: env("GOOGLE_APPLICATION_CREDENTIALS").map(PathBuf::from),
            credential_file: env("TRITON_CLOUD_CREDENTIAL_PATH").map(PathBuf::from),
            azure_auth: env("AZURE_STORAGE_AUTH_TYPE"),
            azure_client_id: env("AZURE_STORAGE_CLIENT_ID"),
            anonymous: self.storage_anonymous,
            parallel: self.storage_parallelism.max(1),
            part_size: self.storage_part_mib.max(1) << 20,
            retries: self.storage_retries,
        };
        Storage {
            settings,
            cache_dir: self.model_cache_dir.clone().unwrap_or_else(|| std::env::temp_dir().join("ferry-model-cache")),
            poll_secs: self.repository_poll_secs.max(1),
        }
    }
}
