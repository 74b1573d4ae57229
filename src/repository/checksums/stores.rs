//! Asking S3 (through aws-sdk-s3) and GCS (its JSON API) for the checksums they keep of one
//! object, pinned to the ETag the listing gave.
use std::time::Duration;

use aws_sdk_s3::{
    error::{DisplayErrorContext, ProvideErrorMetadata, SdkError},
    types::{ChecksumMode, ChecksumType, ObjectAttributes, ObjectPart},
};
use futures_util::{StreamExt, TryStreamExt, stream};
use object_store::gcp::GcpCredentialProvider;

use super::{Algorithm, Expected, Part, decode};
use crate::names::percent_encode;

/// S3 allows at most this many parts.
const MAX_PARTS: u32 = 10_000;

pub enum Checksums {
    S3 { client: aws_sdk_s3::Client, bucket: String },
    Gcs { http: reqwest::Client, base: String, bucket: String, credentials: Option<GcpCredentialProvider> },
}

/// The cheapest checksum present to compute: CRC32C, CRC32, CRC64NVME, then SHA-256.
fn pick<'a>(
    crc32c: Option<&'a str>,
    crc32: Option<&'a str>,
    crc64: Option<&'a str>,
    sha256: Option<&'a str>,
) -> Option<(Algorithm, &'a str)> {
    [(Algorithm::Crc32c, crc32c), (Algorithm::Crc32, crc32), (Algorithm::Crc64Nvme, crc64), (Algorithm::Sha256, sha256)]
        .into_iter()
        .find_map(|(a, v)| v.filter(|v| !v.is_empty()).map(|v| (a, v)))
}

fn part_checksum(p: &ObjectPart, a: Algorithm) -> Option<&str> {
    match a {
        Algorithm::Crc32c => p.checksum_crc32_c(),
        Algorithm::Crc32 => p.checksum_crc32(),
        Algorithm::Crc64Nvme => p.checksum_crc64_nvme(),
        Algorithm::Sha256 => p.checksum_sha256(),
    }
}

/// An SDK failure in one line: the HTTP status and S3's code where S3 answered.
fn sdk_error<E: ProvideErrorMetadata + std::error::Error + 'static>(e: SdkError<E>) -> String {
    match &e {
        SdkError::ServiceError(s) => {
            let status = s.raw().status().as_u16();
            format!("HTTP {status} {} {}", s.err().code().unwrap_or(""), s.err().message().unwrap_or(""))
                .trim()
                .to_string()
        }
        _ => DisplayErrorContext(&e).to_string(),
    }
}

impl Checksums {
    pub fn s3(
        sdk: &aws_config::SdkConfig,
        bucket: &str,
        region: &str,
        endpoint: Option<&str>,
        anonymous: bool,
    ) -> Self {
        let mut conf =
            aws_sdk_s3::config::Builder::from(sdk).region(aws_sdk_s3::config::Region::new(region.to_string()));
        if let Some(endpoint) = endpoint {
            conf = conf.endpoint_url(endpoint).force_path_style(true);
        }
        if anonymous {
            conf.set_credentials_provider(None);
        }
        Checksums::S3 { client: aws_sdk_s3::Client::from_conf(conf.build()), bucket: bucket.to_string() }
    }

    pub fn gcs(base: Option<&str>, bucket: &str, credentials: Option<GcpCredentialProvider>) -> Self {
        let http = reqwest::Client::builder().timeout(Duration::from_secs(60)).build().unwrap_or_default();
        let base = base.unwrap_or("https://storage.googleapis.com").trim_end_matches('/').to_string();
        Checksums::Gcs { http, base, bucket: bucket.to_string(), credentials }
    }

    /// What the store says of object `key` (listed with `etag` and `size`, downloaded at
    /// `version`: a GCS generation or an S3 version id); None when it keeps no checksum this
    /// server can check.
    pub async fn expected(
        &self,
        key: &str,
        etag: Option<&str>,
        version: Option<&str>,
        size: u64,
    ) -> Result<Option<Expected>, String> {
        match self {
            Checksums::S3 { client, bucket } => s3_expected(client, bucket, key, (etag, version), size).await,
            Checksums::Gcs { http, base, bucket, credentials } => {
                gcs_expected(http, base, bucket, (key, version), credentials.as_ref()).await
            }
        }
    }
}

async fn s3_expected(
    client: &aws_sdk_s3::Client,
    bucket: &str,
    key: &str,
    (etag, version): (Option<&str>, Option<&str>),
    size: u64,
) -> Result<Option<Expected>, String> {
    let what = |e: String| format!("asking S3 for the checksums of '{key}': {e}");
    let head = client
        .head_object()
        .bucket(bucket)
        .key(key)
        .checksum_mode(ChecksumMode::Enabled)
        .set_if_match(etag.map(str::to_string))
        .set_version_id(version.map(str::to_string));
    let out = head.send().await.map_err(|e| what(sdk_error(e)))?;
    let Some((algorithm, value)) =
        pick(out.checksum_crc32_c(), out.checksum_crc32(), out.checksum_crc64_nvme(), out.checksum_sha256())
    else {
        return Ok(None);
    };
    let (value, count) = decode(value)?;
    // Without a type (older stores, S3-compatible servers), a multipart upload's checksum is
    // composite, as S3's was before full-object checksums.
    let multipart = etag.and_then(|t| t.trim_matches('"').rsplit_once('-')).and_then(|(_, n)| n.parse::<u32>().ok());
    let composite = match out.checksum_type() {
        Some(ChecksumType::FullObject) => false,
        Some(ChecksumType::Composite) => true,
        _ => count.is_some() || multipart.is_some(),
    };
    if !composite {
        return Ok(Some(Expected::Whole { algorithm, value }));
    }
    let count = count.or(multipart);
    let parts = match s3_attribute_parts(client, bucket, key, algorithm).await {
        Some(parts) if !parts.is_empty() => parts,
        // GetObjectAttributes may be denied, or answer without parts: ask part by part.
        _ => s3_head_parts(client, bucket, (key, version), algorithm, count).await.map_err(what)?,
    };
    if parts.iter().map(|p| p.size).sum::<u64>() != size {
        return Err(what(format!("its parts do not add up to the {size} bytes listed")));
    }
    Ok(Some(Expected::Composite { algorithm, value, parts }))
}

/// The parts as GetObjectAttributes lists them (None when it cannot).
async fn s3_attribute_parts(client: &aws_sdk_s3::Client, bucket: &str, key: &str, a: Algorithm) -> Option<Vec<Part>> {
    let mut parts = Vec::new();
    let mut marker: Option<String> = None;
    loop {
        let out = client
            .get_object_attributes()
            .bucket(bucket)
            .key(key)
            .object_attributes(ObjectAttributes::ObjectParts)
            .max_parts(1000)
            .set_part_number_marker(marker.clone())
            .send()
            .await
            .ok()?;
        let listed = out.object_parts()?;
        for p in listed.parts() {
            let checksum = part_checksum(p, a).map(decode).transpose().ok()?.map(|(raw, _)| raw);
            parts.push(Part { size: u64::try_from(p.size()?).ok()?, checksum });
        }
        if listed.is_truncated() != Some(true) || parts.len() >= MAX_PARTS as usize {
            return Some(parts);
        }
        marker = listed.next_part_number_marker().map(str::to_string);
        marker.as_ref()?;
    }
}

/// The parts, one HEAD each (`partNumber`), eight at a time. Not pinned with If-Match (some
/// S3-compatible servers compare it with the part's ETag); the object's HEAD before was.
async fn s3_head_parts(
    client: &aws_sdk_s3::Client,
    bucket: &str,
    (key, version): (&str, Option<&str>),
    a: Algorithm,
    count: Option<u32>,
) -> Result<Vec<Part>, String> {
    let head = |n: u32| {
        client
            .head_object()
            .bucket(bucket)
            .key(key)
            .part_number(n as i32)
            .checksum_mode(ChecksumMode::Enabled)
            .set_version_id(version.map(str::to_string))
            .send()
    };
    let first = head(1).await.map_err(sdk_error)?;
    let count = count.or(first.parts_count().and_then(|n| u32::try_from(n).ok())).unwrap_or(1);
    if count == 0 || count > MAX_PARTS {
        return Err(format!("S3 reports {count} parts"));
    }
    let part = |out: &aws_sdk_s3::operation::head_object::HeadObjectOutput| -> Result<Part, String> {
        let size = out.content_length().and_then(|n| u64::try_from(n).ok()).ok_or("a part without a length")?;
        let checksum =
            pick(out.checksum_crc32_c(), out.checksum_crc32(), out.checksum_crc64_nvme(), out.checksum_sha256())
                .filter(|(got, _)| *got == a)
                .map(|(_, v)| decode(v).map(|(raw, _)| raw))
                .transpose()?;
        Ok(Part { size, checksum })
    };
    let mut parts = vec![part(&first)?];
    let rest: Vec<Part> = stream::iter(2..=count)
        .map(|n| async move {
            let out = head(n).await.map_err(sdk_error)?;
            part(&out)
        })
        .buffered(8)
        .try_collect()
        .await?;
    parts.extend(rest);
    Ok(parts)
}

async fn gcs_expected(
    http: &reqwest::Client,
    base: &str,
    bucket: &str,
    (key, generation): (&str, Option<&str>),
    credentials: Option<&GcpCredentialProvider>,
) -> Result<Option<Expected>, String> {
    let what = |e: String| format!("asking GCS for the checksum of '{key}': {e}");
    let mut url = format!("{base}/storage/v1/b/{}/o/{}?fields=crc32c", percent_encode(bucket), percent_encode(key));
    if let Some(g) = generation {
        url.push_str(&format!("&generation={}", percent_encode(g)));
    }
    let mut req = http.get(url);
    if let Some(c) = credentials {
        let token = c.get_credential().await.map_err(|e| what(e.to_string()))?;
        req = req.bearer_auth(&token.bearer);
    }
    let resp = req.send().await.map_err(|e| what(e.to_string()))?;
    let status = resp.status();
    let body = resp.bytes().await.map_err(|e| what(e.to_string()))?;
    if !status.is_success() {
        return Err(what(format!("HTTP {status}")));
    }
    let meta: serde_json::Value = serde_json::from_slice(&body).map_err(|e| what(e.to_string()))?;
    let Some(crc) = meta["crc32c"].as_str() else { return Ok(None) };
    let (value, _) = decode(crc)?;
    Ok(Some(Expected::Whole { algorithm: Algorithm::Crc32c, value }))
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_cheapest_checksum_present_is_used() {
        use super::{Algorithm, pick};
        assert_eq!(pick(None, Some("x"), None, Some("y")), Some((Algorithm::Crc32, "x")));
        assert_eq!(pick(Some(""), None, None, Some("y")), Some((Algorithm::Sha256, "y")));
        assert_eq!(pick(None, None, None, None), None);
    }
}
