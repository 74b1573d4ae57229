//! Content checks beyond the ETag, for objects whose ETag is not the MD5 of their content
//! (multipart S3 uploads, composite GCS objects): the checksums the stores keep. S3: CRC32,
//! CRC32C, CRC64NVME or SHA-256, of the whole object or composite (a checksum of the parts'
//! checksums, checked part by part); GCS: CRC32C of every object.
use std::{fs::File, os::unix::fs::FileExt, path::Path};

use base64::Engine as _;
use sha2::Digest as _;

mod stores;
pub use stores::Checksums;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Algorithm {
    Crc32,
    Crc32c,
    Crc64Nvme,
    Sha256,
}

impl Algorithm {
    fn name(self) -> &'static str {
        match self {
            Algorithm::Crc32 => "CRC32",
            Algorithm::Crc32c => "CRC32C",
            Algorithm::Crc64Nvme => "CRC64NVME",
            Algorithm::Sha256 => "SHA-256",
        }
    }

    /// The digest of `len` bytes of `file` from `start`, big-endian as the stores encode it.
    fn of_range(self, file: &File, start: u64, len: u64) -> Result<Vec<u8>, String> {
        let mut digest = Running::new(self);
        let mut buf = vec![0u8; (1 << 20).min(len.max(1) as usize)];
        let mut at = 0u64;
        while at < len {
            let n = buf.len().min((len - at) as usize);
            file.read_exact_at(&mut buf[..n], start + at).map_err(|e| format!("cannot read the download: {e}"))?;
            digest.update(&buf[..n]);
            at += n as u64;
        }
        Ok(digest.finish())
    }

    fn of_bytes(self, data: &[u8]) -> Vec<u8> {
        let mut digest = Running::new(self);
        digest.update(data);
        digest.finish()
    }
}

enum Running {
    Crc(Box<crc_fast::Digest>, usize),
    Sha(sha2::Sha256),
}

impl Running {
    fn new(a: Algorithm) -> Running {
        use crc_fast::CrcAlgorithm::{Crc32Iscsi, Crc32IsoHdlc, Crc64Nvme};
        match a {
            Algorithm::Crc32 => Running::Crc(Box::new(crc_fast::Digest::new(Crc32IsoHdlc)), 4),
            Algorithm::Crc32c => Running::Crc(Box::new(crc_fast::Digest::new(Crc32Iscsi)), 4),
            Algorithm::Crc64Nvme => Running::Crc(Box::new(crc_fast::Digest::new(Crc64Nvme)), 8),
            Algorithm::Sha256 => Running::Sha(sha2::Sha256::default()),
        }
    }

    fn update(&mut self, data: &[u8]) {
        match self {
            Running::Crc(d, _) => d.update(data),
            Running::Sha(d) => d.update(data),
        }
    }

    fn finish(self) -> Vec<u8> {
        match self {
            Running::Crc(d, width) => d.finalize().to_be_bytes()[8 - width..].to_vec(),
            Running::Sha(d) => d.finalize().to_vec(),
        }
    }
}

/// One part of a composite object: its length and, where the store gave it, its checksum.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Part {
    pub size: u64,
    pub checksum: Option<Vec<u8>>,
}

/// What the store says about an object's content.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Expected {
    Whole {
        algorithm: Algorithm,
        value: Vec<u8>,
    },
    /// `value` is the checksum of the parts' checksums, concatenated in order.
    Composite {
        algorithm: Algorithm,
        value: Vec<u8>,
        parts: Vec<Part>,
    },
}

/// A store's base64 checksum; composite S3 values end in `-<parts>`.
pub fn decode(value: &str) -> Result<(Vec<u8>, Option<u32>), String> {
    let (b64, parts) = match value.rsplit_once('-') {
        Some((b, n)) if n.bytes().all(|c| c.is_ascii_digit()) => (b, n.parse().ok()),
        _ => (value, None),
    };
    let raw = base64::engine::general_purpose::STANDARD
        .decode(b64.trim())
        .map_err(|e| format!("the store's checksum '{value}' is not base64: {e}"))?;
    Ok((raw, parts))
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// Checks the downloaded `file` (object `rel`) against what the store says.
pub fn verify(file: &Path, rel: &str, expected: &Expected) -> Result<(), String> {
    let f = File::open(file).map_err(|e| format!("cannot read {}: {e}", file.display()))?;
    let size = f.metadata().map_err(|e| e.to_string())?.len();
    match expected {
        Expected::Whole { algorithm, value } => {
            let got = algorithm.of_range(&f, 0, size)?;
            if &got != value {
                return Err(format!("'{rel}' has {} {}, the store says {}", algorithm.name(), hex(&got), hex(value)));
            }
        }
        Expected::Composite { algorithm, value, parts } => {
            let total: u64 = parts.iter().map(|p| p.size).sum();
            if total != size {
                return Err(format!("'{rel}' is {size} bytes, its {} parts add up to {total}", parts.len()));
            }
            let mut all = Vec::with_capacity(parts.len() * 32);
            let mut start = 0;
            for (i, part) in parts.iter().enumerate() {
                let got = algorithm.of_range(&f, start, part.size)?;
                if let Some(want) = &part.checksum
                    && want != &got
                {
                    return Err(format!(
                        "'{rel}' part {} (bytes {start}..{}) has {} {}, the store says {}",
                        i + 1,
                        start + part.size,
                        algorithm.name(),
                        hex(&got),
                        hex(want)
                    ));
                }
                all.extend_from_slice(&got);
                start += part.size;
            }
            let got = algorithm.of_bytes(&all);
            if &got != value {
                return Err(format!(
                    "'{rel}' has composite {} {}, the store says {}",
                    algorithm.name(),
                    hex(&got),
                    hex(value)
                ));
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file_of(data: &[u8]) -> tempfile::NamedTempFile {
        let f = tempfile::NamedTempFile::new().unwrap();
        std::fs::write(f.path(), data).unwrap();
        f
    }

    #[test]
    fn known_values() {
        // "hello": CRC32 as S3 reports it (NhCmhg==), CRC32C's check value for "123456789".
        assert_eq!(Algorithm::Crc32.of_bytes(b"hello"), decode("NhCmhg==").unwrap().0);
        assert_eq!(Algorithm::Crc32c.of_bytes(b"123456789"), 0xe306_9283u32.to_be_bytes());
        assert_eq!(Algorithm::Crc64Nvme.of_bytes(b"123456789"), 0xae8b_1486_0a79_9888u64.to_be_bytes());
        assert_eq!(hex(&Algorithm::Sha256.of_bytes(b"")[..4]), "e3b0c442");
        assert_eq!(decode("ufYEXw==-2").unwrap(), (decode("ufYEXw==").unwrap().0, Some(2)));
        assert!(decode("not base64!").is_err());
    }

    #[test]
    fn whole_objects_are_checked() {
        let f = file_of(b"hello");
        let value = Algorithm::Crc32c.of_bytes(b"hello");
        assert!(verify(f.path(), "m", &Expected::Whole { algorithm: Algorithm::Crc32c, value }).is_ok());
        let wrong = Expected::Whole { algorithm: Algorithm::Sha256, value: vec![0; 32] };
        let e = verify(f.path(), "m/1/model.onnx", &wrong).unwrap_err();
        assert!(e.contains("'m/1/model.onnx' has SHA-256"), "{e}");
    }

    #[test]
    fn composite_objects_are_checked_part_by_part() {
        // Two 5-byte parts, as S3 computes a composite CRC32 (the moto figures: parts yTuzdQ==
        // and 67XDxA== of 5 MiB each give ufYEXw==; here small parts, same rule).
        let data = b"aaaaabbbbb";
        let f = file_of(data);
        let a = Algorithm::Crc32;
        let (p1, p2) = (a.of_bytes(&data[..5]), a.of_bytes(&data[5..]));
        let value = a.of_bytes(&[p1.clone(), p2.clone()].concat());
        let parts = vec![Part { size: 5, checksum: Some(p1) }, Part { size: 5, checksum: None }];
        let good = Expected::Composite { algorithm: a, value: value.clone(), parts: parts.clone() };
        assert!(verify(f.path(), "m", &good).is_ok());
        let mut swapped = parts.clone();
        swapped[0].checksum = Some(p2);
        let e = verify(f.path(), "m", &Expected::Composite { algorithm: a, value: value.clone(), parts: swapped })
            .unwrap_err();
        assert!(e.contains("part 1 (bytes 0..5)"), "{e}");
        let short = vec![Part { size: 4, checksum: None }, Part { size: 5, checksum: None }];
        let e = verify(f.path(), "m", &Expected::Composite { algorithm: a, value, parts: short }).unwrap_err();
        assert!(e.contains("add up to 9"), "{e}");
        let stitched = file_of(b"aaaaabbbbc");
        assert!(verify(stitched.path(), "m", &good).unwrap_err().contains("composite CRC32"));
    }

    #[test]
    fn composite_matches_the_figures_moto_gives() {
        let p1 = decode("yTuzdQ==").unwrap().0;
        let p2 = decode("67XDxA==").unwrap().0;
        assert_eq!(Algorithm::Crc32.of_bytes(&[p1, p2].concat()), decode("ufYEXw==").unwrap().0);
        assert_eq!(Algorithm::Crc32.of_bytes(&vec![0u8; 5 << 20]), decode("yTuzdQ==").unwrap().0);
    }
}
