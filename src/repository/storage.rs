//! Model repositories in object storage (`gs://`, `s3://`, `az://`) through object_store: the only
//! file that names object_store and the AWS SDK. Credentials follow each cloud's default chain
//! (never an anonymous fallback unless asked for); objects are listed once and fetched with
//! bounded parallelism, large ones in ranged parts, each verified (size, and MD5 when the ETag is
//! one) before it is renamed into the cache.
use std::{
    path::{Path, PathBuf},
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
    time::{Duration, SystemTime},
};

use aws_credential_types::provider::ProvideCredentials;
use futures_util::{StreamExt, TryStreamExt, stream};
use md5::{Digest, Md5};
use object_store::{
    ClientOptions, CredentialProvider, ObjectStore, ObjectStoreExt, RetryConfig,
    aws::{AmazonS3Builder, AwsCredential},
    azure::MicrosoftAzureBuilder,
    gcp::GoogleCloudStorageBuilder,
    path::Path as ObjPath,
};

use super::{
    checksums::{self, Checksums},
    cloud_credentials::{AzureKey, CloudCredentials, S3Key},
};

/// How to reach object storage, from the command line and the environment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StorageSettings {
    /// An S3-compatible endpoint (path-style addressing), e.g. MinIO or moto.
    pub s3_endpoint: Option<String>,
    pub s3_region: Option<String>,
    /// A GCS endpoint other than Google's (an emulator).
    pub gcs_endpoint: Option<String>,
    /// GOOGLE_APPLICATION_CREDENTIALS.
    pub gcs_credentials: Option<PathBuf>,
    /// TRITON_CLOUD_CREDENTIAL_PATH: per-prefix credentials for every scheme.
    pub credential_file: Option<PathBuf>,
    /// AZURE_STORAGE_AUTH_TYPE (`managed_identity`, `default`) and AZURE_STORAGE_CLIENT_ID.
    pub azure_auth: Option<String>,
    pub azure_client_id: Option<String>,
    /// Read without credentials (public buckets, emulators). Never a silent fallback.
    pub anonymous: bool,
    /// Objects fetched at once.
    pub parallel: usize,
    /// Objects larger than this are fetched in ranged parts of this size.
    pub part_size: u64,
    pub retries: usize,
}

impl Default for StorageSettings {
    fn default() -> Self {
        StorageSettings {
            s3_endpoint: None,
            s3_region: None,
            gcs_endpoint: None,
            gcs_credentials: None,
            credential_file: None,
            azure_auth: None,
            azure_client_id: None,
            anonymous: false,
            parallel: 16,
            part_size: 16 << 20,
            retries: 5,
        }
    }
}

/// A storage failure as clients may see it: bucket names, object paths under them, and the
/// server's cloud identity (ARNs, service-account e-mails, key ids) are replaced, the rest kept.
/// The log keeps the full text.
pub fn public_reason(reason: &str) -> String {
    static PATTERNS: std::sync::OnceLock<Vec<(regex::Regex, &'static str)>> = std::sync::OnceLock::new();
    let patterns = PATTERNS.get_or_init(|| {
        [
            (r#"\b(s3|gs|az)://[^\s'"]+"#, "<bucket>"),
            (r#"bucket '[^']*'"#, "bucket <bucket>"),
            (r#"object '[^']*'"#, "object <path>"),
            (r#"arn:aws[^\s'"]*"#, "<principal>"),
            (r#"[A-Za-z0-9._%+-]+@[A-Za-z0-9.-]+\.[A-Za-z]{2,}"#, "<principal>"),
            (r#"access key \S+"#, "access key <hidden>"),
            (r#"https?://[^\s'"]+"#, "<endpoint>"),
        ]
        .into_iter()
        .map(|(p, r)| (regex::Regex::new(p).expect("a valid pattern"), r))
        .collect()
    });
    patterns.iter().fold(reason.to_string(), |text, (re, with)| re.replace_all(&text, *with).into_owned())
}

/// Tags that are not ETags: a generation (pinned with `version`) or a time (not pinned).
const GENERATION: &str = "generation:";
const MTIME: &str = "mtime:";

/// One object under a repository prefix.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Object {
    /// Path relative to the repository prefix, `/`-separated.
    pub rel: String,
    pub size: u64,
    /// What changes when the content does: ETag, else generation/version, else the mtime.
    pub tag: String,
}

/// Bytes fetched and to fetch, shared with whoever reports progress.
#[derive(Debug, Default)]
pub struct Progress {
    pub done: AtomicU64,
    pub total: AtomicU64,
}

pub struct Remote {
    url: String,
    bucket: String,
    prefix: String,
    store: Arc<dyn ObjectStore>,
    /// Who we are to the store, for the log and for access errors.
    principal: String,
    settings: StorageSettings,
    /// Requests in flight, across every object: at most `settings.parallel`.
    requests: Arc<tokio::sync::Semaphore>,
    /// Where the store's own checksums are asked for (S3 and GCS).
    checksums: Option<Checksums>,
}

/// The ETag and version every part of one download asks for.
#[derive(Debug, Clone, Default)]
struct Pin {
    etag: Option<String>,
    version: Option<String>,
}

/// A store, who we are to it, and where to ask for its checksums.
type Opened = (Arc<dyn ObjectStore>, String, Option<Checksums>);

fn client_options(allow_http: bool) -> ClientOptions {
    ClientOptions::new().with_allow_http(allow_http).with_connect_timeout(Duration::from_secs(10))
}

fn retry(n: usize) -> RetryConfig {
    RetryConfig { max_retries: n, ..RetryConfig::default() }
}

/// AWS's default credential chain (environment, profiles and SSO, web identity, ECS, IMDSv2),
/// cached until five minutes before expiry.
#[derive(Debug)]
struct AwsChain {
    provider: aws_credential_types::provider::SharedCredentialsProvider,
    cached: tokio::sync::Mutex<Option<(Arc<AwsCredential>, Option<SystemTime>)>>,
}

#[async_trait::async_trait]
impl CredentialProvider for AwsChain {
    type Credential = AwsCredential;

    async fn get_credential(&self) -> object_store::Result<Arc<AwsCredential>> {
        let mut cached = self.cached.lock().await;
        let fresh = |exp: &Option<SystemTime>| exp.is_none_or(|e| e > SystemTime::now() + Duration::from_secs(300));
        if let Some((c, exp)) = cached.as_ref()
            && fresh(exp)
        {
            return Ok(Arc::clone(c));
        }
        let creds = self.provider.provide_credentials().await.map_err(|e| object_store::Error::Generic {
            store: "S3",
            source: format!("AWS credentials: {e}").into(),
        })?;
        let c = Arc::new(AwsCredential {
            key_id: creds.access_key_id().to_string(),
            secret_key: creds.secret_access_key().to_string(),
            token: creds.session_token().map(str::to_string),
        });
        *cached = Some((Arc::clone(&c), creds.expiry()));
        Ok(c)
    }
}

/// Where a repository URL points, in the forms Triton reads: `s3://bucket/path`,
/// `s3://host:port/bucket/path` and `s3://https://host[:port]/bucket/path` (S3-compatible
/// stores: http unless the URL says https), `gs://bucket/path`, `as://account/container/path`
/// (Azure, Triton's) and `az://container/path` (the account from the environment).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Location {
    pub scheme: &'static str,
    /// An S3-compatible endpoint the URL names, or the Azure account.
    pub host: Option<String>,
    pub bucket: String,
    pub prefix: String,
}

impl Location {
    pub fn parse(url: &str) -> Result<Location, String> {
        let (scheme, rest) = url.split_once("://").ok_or_else(|| format!("'{url}' is not a storage URL"))?;
        let scheme = match scheme {
            "s3" => "s3",
            "gs" => "gs",
            "az" => "az",
            "as" => "as",
            other => return Err(format!("'{other}://' repositories are not supported (gs://, s3://, as://, az://)")),
        };
        let (mut host, mut rest) = (None, rest);
        if scheme == "s3" {
            let explicit = ["https://", "http://"].into_iter().find(|p| rest.starts_with(p));
            let first = rest[explicit.map_or(0, str::len)..].split('/').next().unwrap_or_default();
            if explicit.is_some() || first.contains(':') {
                if first.is_empty() {
                    return Err(format!("'{url}' names no S3 host"));
                }
                host = Some(format!("{}{first}", explicit.unwrap_or("http://")));
                rest = rest[explicit.map_or(0, str::len) + first.len()..].trim_start_matches('/');
            }
        } else if scheme == "as" {
            let (account, after) = rest.split_once('/').unwrap_or((rest, ""));
            if account.is_empty() {
                return Err(format!("'{url}' names no Azure storage account"));
            }
            host = Some(account.to_string());
            rest = after;
        }
        let (bucket, prefix) = rest.split_once('/').unwrap_or((rest, ""));
        if bucket.is_empty() || bucket.contains(':') {
            return Err(format!("'{url}' names no bucket"));
        }
        Ok(Location { scheme, host, bucket: bucket.to_string(), prefix: prefix.trim_matches('/').to_string() })
    }
}

async fn s3(bucket: &str, endpoint: Option<&str>, key: Option<&S3Key>, s: &StorageSettings) -> Result<Opened, String> {
    // An endpoint the URL names wins over --s3-endpoint; a credential file's region over the flag.
    let region = key.map(|k| k.region.clone()).filter(|r| !r.is_empty()).or_else(|| s.s3_region.clone());
    let s = &StorageSettings {
        s3_endpoint: endpoint.map(str::to_string).or_else(|| s.s3_endpoint.clone()),
        s3_region: region,
        ..s.clone()
    };
    let mut b = AmazonS3Builder::new().with_bucket_name(bucket).with_retry(retry(s.retries));
    let mut loader = aws_config::defaults(aws_config::BehaviorVersion::latest());
    if let Some(k) = key.filter(|k| !k.profile.is_empty()) {
        loader = loader.profile_name(&k.profile);
    }
    if let Some(k) = key.filter(|k| !k.key_id.is_empty()) {
        let token = Some(k.session_token.clone()).filter(|t| !t.is_empty());
        let creds = aws_credential_types::Credentials::new(&k.key_id, &k.secret_key, token, None, "credential file");
        loader = loader.credentials_provider(creds);
    }
    let sdk = loader.load().await;
    let region = match (&s.s3_region, sdk.region(), &s.s3_endpoint) {
        (Some(r), _, _) => r.clone(),
        (None, Some(r), _) => r.to_string(),
        (None, None, Some(_)) => "us-east-1".to_string(),
        (None, None, None) => object_store::aws::resolve_bucket_region(bucket, &client_options(false))
            .await
            .map_err(|e| format!("cannot find the region of bucket '{bucket}' (set AWS_REGION): {e}"))?,
    };
    b = b.with_region(&region);
    if let Some(endpoint) = &s.s3_endpoint {
        b = b
            .with_endpoint(endpoint)
            .with_virtual_hosted_style_request(false)
            .with_client_options(client_options(endpoint.starts_with("http://")));
    }
    let principal = if s.anonymous {
        b = b.with_skip_signature(true);
        "anonymous (--storage-anonymous)".to_string()
    } else {
        let provider = sdk.credentials_provider().ok_or_else(|| {
            format!("no AWS credentials for s3://{bucket}: the default chain (environment, profile, web identity, ECS, instance metadata) found none; pass --storage-anonymous for a public bucket")
        })?;
        let creds =
            provider.provide_credentials().await.map_err(|e| format!("no AWS credentials for s3://{bucket}: {e}"))?;
        let principal = caller_identity(&sdk, s).await.unwrap_or_else(|| {
            let k = creds.access_key_id();
            format!("access key {}…{}", &k[..k.len().min(4)], &k[k.len().saturating_sub(4)..])
        });
        b = b.with_credentials(Arc::new(AwsChain { provider, cached: Default::default() }));
        principal
    };
    let store = b.build().map_err(|e| format!("cannot open s3://{bucket}: {e}"))?;
    tracing::info!(bucket, region = %region, principal = %principal, "using AWS credentials");
    let checksums = Checksums::s3(&sdk, bucket, &region, s.s3_endpoint.as_deref(), s.anonymous);
    Ok((Arc::new(store), principal, Some(checksums)))
}

/// The ARN STS reports for the credentials, when STS answers.
async fn caller_identity(sdk: &aws_config::SdkConfig, s: &StorageSettings) -> Option<String> {
    let mut conf = aws_sdk_sts::config::Builder::from(sdk);
    if let Some(endpoint) = &s.s3_endpoint {
        conf = conf.endpoint_url(endpoint);
    }
    let client = aws_sdk_sts::Client::from_conf(conf.build());
    let who = tokio::time::timeout(Duration::from_secs(5), client.get_caller_identity().send()).await.ok()?.ok()?;
    who.arn().map(str::to_string)
}

fn gcs(bucket: &str, s: &StorageSettings) -> Result<Opened, String> {
    let mut b = GoogleCloudStorageBuilder::new().with_bucket_name(bucket).with_retry(retry(s.retries));
    if let Some(endpoint) = &s.gcs_endpoint {
        b = b.with_base_url(endpoint).with_client_options(client_options(endpoint.starts_with("http://")));
    }
    let principal = if s.anonymous {
        b = b.with_skip_signature(true);
        "anonymous (--storage-anonymous)".to_string()
    } else if let Some(path) = &s.gcs_credentials {
        b = b.with_application_credentials(path.display().to_string());
        let email = std::fs::read_to_string(path)
            .ok()
            .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok())
            .and_then(|v| v["client_email"].as_str().map(str::to_string));
        email.unwrap_or_else(|| format!("application default credentials from {}", path.display()))
    } else {
        "the metadata server's service account (workload identity)".to_string()
    };
    let store = b.build().map_err(|e| format!("cannot open gs://{bucket}: {e}"))?;
    tracing::info!(bucket, principal = %principal, "using Google credentials");
    let credentials = (!s.anonymous).then(|| Arc::clone(store.credentials()));
    let checksums = Checksums::gcs(s.gcs_endpoint.as_deref(), bucket, credentials);
    Ok((Arc::new(store), principal, Some(checksums)))
}

/// Azure Blob Storage: the account from the URL (`as://`) or AZURE_STORAGE_ACCOUNT, the key from
/// AZURE_STORAGE_KEY (Triton's variables) or object_store's own, else the default credential
/// chain (managed identity, workload identity, the Azure CLI).
fn azure(
    account: Option<&str>,
    container: &str,
    file: Option<&AzureKey>,
    s: &StorageSettings,
) -> Result<Opened, String> {
    let env = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
    let given = |v: &str| Some(v.to_string()).filter(|v| !v.is_empty());
    let mut b = MicrosoftAzureBuilder::from_env().with_container_name(container).with_retry(retry(s.retries));
    let account = account
        .map(str::to_string)
        .or_else(|| file.and_then(|f| given(&f.account_str)))
        .or_else(|| env("AZURE_STORAGE_ACCOUNT"));
    if let Some(a) = &account {
        b = b.with_account(a);
    }
    // A credential file entry decides alone; else Triton's variables.
    let (key, auth, client) = match file {
        Some(f) => (given(&f.account_key), given(&f.auth_type), given(&f.client_id)),
        None => (env("AZURE_STORAGE_KEY"), s.azure_auth.clone(), s.azure_client_id.clone()),
    };
    let principal = match (s.anonymous, auth.as_deref(), key) {
        (true, _, _) => {
            b = b.with_skip_signature(true);
            "anonymous (--storage-anonymous)".to_string()
        }
        (false, Some(kind), _) => {
            let (credential, principal) = azure_auth(kind, client.as_deref())?;
            b = b.with_credential_type(credential);
            if let Some(id) = client {
                b = b.with_client_id(id);
            }
            principal
        }
        (false, None, Some(key)) => {
            b = b.with_access_key(key);
            format!("the account key of '{}'", account.as_deref().unwrap_or("?"))
        }
        (false, None, None) => "Azure default credentials".to_string(),
    };
    let store = b.build().map_err(|e| format!("cannot open Azure container '{container}': {e}"))?;
    Ok((Arc::new(store), principal, None))
}

/// What AZURE_STORAGE_AUTH_TYPE (or a credential file's `auth_type`) asks of object_store, and
/// who that makes us.
fn azure_auth(kind: &str, client: Option<&str>) -> Result<(&'static str, String), String> {
    match kind {
        "managed_identity" => Ok((
            "managed_identity",
            match client {
                Some(id) => format!("the user-assigned managed identity {id}"),
                None => "the system-assigned managed identity".to_string(),
            },
        )),
        "default" => Ok(("auto", "Azure's default credential chain".to_string())),
        other => Err(format!(
            "AZURE_STORAGE_AUTH_TYPE '{other}' is not one ferry knows: use managed_identity or default (or leave it \
             unset for AZURE_STORAGE_KEY)"
        )),
    }
}

impl Remote {
    /// Whether a repository location is in object storage.
    pub fn is_remote(url: &str) -> bool {
        ["gs://", "s3://", "az://", "as://"].iter().any(|p| url.starts_with(p))
    }

    pub async fn open(url: &str, s: &StorageSettings) -> Result<Remote, String> {
        let at = Location::parse(url)?;
        let file = s.credential_file.as_deref().map(CloudCredentials::read).transpose()?;
        let (store, principal, checksums) = match at.scheme {
            "s3" => s3(&at.bucket, at.host.as_deref(), file.as_ref().and_then(|f| f.s3(url)), s).await?,
            "gs" => match file.as_ref().and_then(|f| f.gcs(url)) {
                Some(key) => {
                    gcs(&at.bucket, &StorageSettings { gcs_credentials: Some(key.to_path_buf()), ..s.clone() })?
                }
                None => gcs(&at.bucket, s)?,
            },
            _ => azure(at.host.as_deref(), &at.bucket, file.as_ref().and_then(|f| f.azure(url)), s)?,
        };
        Ok(Remote {
            url: url.trim_end_matches('/').to_string(),
            bucket: at.bucket,
            prefix: at.prefix,
            store,
            principal,
            settings: s.clone(),
            requests: Arc::new(tokio::sync::Semaphore::new(s.parallel.max(1))),
            checksums,
        })
    }

    pub fn url(&self) -> &str {
        &self.url
    }

    fn object_path(&self, rel: &str) -> ObjPath {
        ObjPath::from(if self.prefix.is_empty() { rel.to_string() } else { format!("{}/{rel}", self.prefix) })
    }

    fn access_error(&self, what: &str, e: object_store::Error) -> String {
        let denied =
            matches!(e, object_store::Error::PermissionDenied { .. } | object_store::Error::Unauthenticated { .. });
        let reason = if denied { "access denied" } else { "failed" };
        format!("{what} in bucket '{}' {reason} for {}: {e}", self.bucket, self.principal)
    }

    /// A small object's content (a manifest).
    pub async fn read(&self, rel: &str) -> Result<Vec<u8>, String> {
        let what = format!("reading object '{}'", self.object_path(rel));
        let got = self.store.get(&self.object_path(rel)).await.map_err(|e| self.access_error(&what, e))?;
        Ok(got.bytes().await.map_err(|e| self.access_error(&what, e))?.to_vec())
    }

    /// Every object under the prefix, listed once.
    pub async fn list(&self) -> Result<Vec<Object>, String> {
        let prefix = (!self.prefix.is_empty()).then(|| ObjPath::from(self.prefix.as_str()));
        let metas: Vec<_> = self
            .store
            .list(prefix.as_ref())
            .try_collect()
            .await
            .map_err(|e| self.access_error(&format!("listing '{}'", self.url), e))?;
        let skip = if self.prefix.is_empty() { 0 } else { self.prefix.len() + 1 };
        let mut objects: Vec<Object> = metas
            .into_iter()
            .filter_map(|m| {
                let rel = m.location.as_ref().get(skip..)?.to_string();
                let tag = match (m.e_tag, m.version) {
                    (Some(etag), _) => etag,
                    (None, Some(generation)) => format!("{GENERATION}{generation}"),
                    (None, None) => format!("{MTIME}{}", m.last_modified.timestamp_millis()),
                };
                (!rel.is_empty() && !rel.ends_with('/')).then_some(Object { rel, size: m.size, tag })
            })
            .collect();
        objects.sort();
        Ok(objects)
    }

    /// What pins every part of one download to the listed content: the ETag (If-Match) and the
    /// version that holds it now (GCS generation, S3 version id), read with a HEAD; an object
    /// replaced since the listing fails here.
    async fn pin(&self, path: &ObjPath, obj: &Object) -> Result<Pin, String> {
        if let Some(generation) = obj.tag.strip_prefix(GENERATION) {
            return Ok(Pin { etag: None, version: Some(generation.to_string()) });
        }
        if obj.tag.starts_with(MTIME) {
            return Ok(Pin::default());
        }
        let what = format!("reading object '{path}'");
        let meta = {
            let _slot = self.requests.acquire().await.map_err(|e| e.to_string())?;
            self.store.head(path).await.map_err(|e| self.access_error(&what, e))?
        };
        if meta.e_tag.as_deref().map(|t| t.trim_matches('"')) != Some(obj.tag.trim_matches('"')) {
            return Err(format!(
                "{what}: the object changed since it was listed; it is fetched again at the next attempt"
            ));
        }
        Ok(Pin { etag: Some(obj.tag.clone()), version: meta.version })
    }

    /// One ranged part (or the whole object), written at its offset; returns its length.
    async fn fetch_part(
        &self,
        path: &ObjPath,
        pin: &Pin,
        r: std::ops::Range<u64>,
        file: Arc<std::fs::File>,
        whole: bool,
    ) -> Result<u64, String> {
        let what = format!("reading object '{path}'");
        let _slot = self.requests.acquire().await.map_err(|e| e.to_string())?;
        // Every part is pinned: an object replaced during the download fails it instead of
        // stitching two uploads together.
        let mut options =
            object_store::GetOptions { if_match: pin.etag.clone(), version: pin.version.clone(), ..Default::default() };
        if !whole {
            options.range = Some(object_store::GetRange::Bounded(r.clone()));
        }
        let changed = |e: object_store::Error| match e {
            object_store::Error::Precondition { .. } | object_store::Error::NotFound { .. } => {
                format!("{what}: the object changed while it was downloaded; it is fetched again at the next attempt")
            }
            e => self.access_error(&what, e),
        };
        let got = self.store.get_opts(path, options).await.map_err(changed)?;
        let bytes = got.bytes().await.map_err(|e| self.access_error(&what, e))?;
        if bytes.len() as u64 != r.end - r.start {
            return Err(format!("{what}: got {} bytes for bytes {r:?}", bytes.len()));
        }
        let len = bytes.len() as u64;
        tokio::task::spawn_blocking(move || std::os::unix::fs::FileExt::write_all_at(&*file, &bytes, r.start))
            .await
            .map_err(|e| e.to_string())?
            .map_err(|e| format!("cannot write {what}: {e}"))?;
        Ok(len)
    }

    /// Size and MD5 (a plain MD5 ETag), else the checksums the store keeps.
    async fn check(&self, path: &ObjPath, obj: &Object, pin: &Pin, file: &Path) -> Result<(), String> {
        let expected = match &self.checksums {
            Some(c) if md5_of(&obj.tag).is_none() => {
                c.expected(path.as_ref(), pin.etag.as_deref(), pin.version.as_deref(), obj.size).await?
            }
            _ => None,
        };
        let (file, obj) = (file.to_path_buf(), obj.clone());
        tokio::task::spawn_blocking(move || {
            verify(&file, &obj)?;
            expected.map_or(Ok(()), |e| checksums::verify(&file, &obj.rel, &e))
        })
        .await
        .map_err(|e| e.to_string())?
    }

    /// Fetches one object to `dest` (through `dest.partial`, renamed only when complete and
    /// verified).
    pub async fn fetch(&self, obj: &Object, dest: &Path, progress: &Progress) -> Result<(), String> {
        let path = self.object_path(&obj.rel);
        let pin = self.pin(&path, obj).await?;
        let partial = dest.with_extension("partial");
        let file = std::fs::File::create(&partial).map_err(|e| format!("cannot write {}: {e}", partial.display()))?;
        file.set_len(obj.size).map_err(|e| e.to_string())?;
        let file = Arc::new(file);
        let part = self.settings.part_size.max(1);
        let ranges: Vec<std::ops::Range<u64>> =
            (0..obj.size.div_ceil(part).max(1)).map(|i| i * part..((i + 1) * part).min(obj.size)).collect();
        let whole = ranges.len() == 1;
        let parts: Vec<_> =
            ranges.into_iter().map(|r| self.fetch_part(&path, &pin, r, Arc::clone(&file), whole)).collect();
        // The parts of one large object fill every free request slot (the semaphore in
        // fetch_part bounds the requests of all objects together).
        let mut parts = stream::iter(parts).buffer_unordered(self.settings.parallel.max(1));
        let result = async {
            while let Some(n) = parts.try_next().await? {
                progress.done.fetch_add(n, Ordering::Relaxed);
            }
            Ok::<(), String>(())
        }
        .await;
        drop(file);
        let checked = match result {
            Ok(()) => self.check(&path, obj, &pin, &partial).await,
            Err(e) => Err(e),
        };
        if let Err(e) = checked {
            let _ = std::fs::remove_file(&partial);
            return Err(e);
        }
        std::fs::rename(&partial, dest).map_err(|e| format!("cannot move {} into place: {e}", dest.display()))
    }
}

/// The MD5 an ETag is, when it is a plain MD5 (single-part S3 uploads, GCS objects).
fn md5_of(tag: &str) -> Option<String> {
    let tag = tag.trim_matches('"').to_ascii_lowercase();
    (tag.len() == 32 && tag.bytes().all(|b| b.is_ascii_hexdigit())).then_some(tag)
}

/// Size, and MD5 when the tag is a plain MD5 ETag.
fn verify(file: &Path, obj: &Object) -> Result<(), String> {
    let len = std::fs::metadata(file).map_err(|e| e.to_string())?.len();
    if len != obj.size {
        return Err(format!("'{}' is {len} bytes, the store says {}", obj.rel, obj.size));
    }
    if let Some(tag) = md5_of(&obj.tag) {
        let got = md5_file(file)?;
        if got != tag {
            return Err(format!("'{}' has MD5 {got}, the store's ETag says {tag}", obj.rel));
        }
    }
    Ok(())
}

/// The hex digest of a file's content.
pub fn hash_file<D: Digest>(file: &Path) -> Result<String, String> {
    use std::io::Read;
    let mut f = std::fs::File::open(file).map_err(|e| format!("cannot read {}: {e}", file.display()))?;
    let mut h = D::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf).map_err(|e| format!("cannot read {}: {e}", file.display()))?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    Ok(h.finalize().iter().map(|b| format!("{b:02x}")).collect())
}

pub fn md5_file(file: &Path) -> Result<String, String> {
    hash_file::<Md5>(file)
}

pub fn sha256_file(file: &Path) -> Result<String, String> {
    hash_file::<sha2::Sha256>(file)
}

pub fn md5_hex(text: &str) -> String {
    format!("{:x}", Md5::digest(text.as_bytes()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn azure_auth_types_are_tritons() {
        assert_eq!(azure_auth("managed_identity", None).unwrap().0, "managed_identity");
        assert!(azure_auth("managed_identity", Some("cid")).unwrap().1.contains("cid"));
        assert_eq!(azure_auth("default", None).unwrap().0, "auto");
        assert!(azure_auth("password", None).unwrap_err().contains("'password'"));
    }

    #[test]
    fn urls_in_tritons_forms() {
        let at = |url: &str| Location::parse(url).map(|l| (l.scheme, l.host, l.bucket, l.prefix));
        let some = |s: &str| Some(s.to_string());
        assert_eq!(at("s3://bucket/a/b/"), Ok(("s3", None, "bucket".into(), "a/b".into())));
        assert_eq!(at("s3://bucket"), Ok(("s3", None, "bucket".into(), "".into())));
        assert_eq!(
            at("s3://minio:9000/models/repo"),
            Ok(("s3", some("http://minio:9000"), "models".into(), "repo".into()))
        );
        assert_eq!(
            at("s3://https://minio.local:443/models/"),
            Ok(("s3", some("https://minio.local:443"), "models".into(), "".into()))
        );
        assert_eq!(at("s3://http://10.0.0.1:80/b/p"), Ok(("s3", some("http://10.0.0.1:80"), "b".into(), "p".into())));
        assert_eq!(at("as://acct/container/path"), Ok(("as", some("acct"), "container".into(), "path".into())));
        assert_eq!(at("az://container/path"), Ok(("az", None, "container".into(), "path".into())));
        assert_eq!(at("gs://b/p"), Ok(("gs", None, "b".into(), "p".into())));
        for bad in ["s3://", "s3://host:9000", "s3://https://", "as://", "as://acct", "ftp://x/y", "gs:///p", "nothing"]
        {
            assert!(Location::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn public_reasons_hide_buckets_and_identities() {
        let full = "download of model 'm' failed: reading object 'repo/m/1/model.onnx' in bucket 'secret-models' \
                    access denied for arn:aws:sts::123456789012:assumed-role/ferry/i-0abc: s3://secret-models/repo \
                    (ferry@proj.iam.gserviceaccount.com at https://storage.googleapis.com/x)";
        let shown = super::public_reason(full);
        for secret in ["secret-models", "123456789012", "iam.gserviceaccount", "repo/m/1", "googleapis"] {
            assert!(!shown.contains(secret), "{secret} in {shown}");
        }
        assert!(shown.contains("download of model 'm' failed") && shown.contains("access denied"), "{shown}");
        let digest = "'model.onnx' has MD5 abc, its _MANIFEST.json says def";
        assert_eq!(super::public_reason(digest), digest);
    }
}
