//! HTTP body plumbing shared by the HTTP routes: reading a body under the size limit, and
//! gzip/deflate in both directions (Triton's rules: `deflate` is the zlib wrapper).
use std::io::{Read, Write};

use axum::body::Body;
use bytes::{Bytes, BytesMut};
use flate2::{Compression, read::GzDecoder, read::ZlibDecoder, write::GzEncoder, write::ZlibEncoder};
use http_body_util::BodyExt;

use crate::error::{Error, Result};

/// Oversized bodies up to this size are read and dropped before the 413 is sent.
const DRAIN_LIMIT: usize = 256 << 20;

/// Triton's words; `size` is what is known of the body (at least `limit` + 1 bytes).
fn too_large(size: usize, limit: usize) -> Error {
    Error::too_large(format!(
        "request JSON size of {size} bytes exceeds the maximum allowed input size of {limit} bytes. Use \
         --http-max-input-size to increase the limit."
    ))
}

/// Reads the whole body, refusing anything over `limit` bytes (declared or actual).
pub async fn read_body(body: Body, declared: Option<usize>, limit: usize) -> Result<Bytes> {
    let mut body = body;
    if let Some(n) = declared.filter(|&n| n > limit) {
        // Read (and drop) a moderately oversized body so the client, still sending, gets the
        // 413 instead of a broken connection.
        if n <= DRAIN_LIMIT {
            while let Some(Ok(_)) = body.frame().await {}
        }
        return Err(too_large(n, limit));
    }
    let mut buf = BytesMut::with_capacity(declared.unwrap_or(0));
    let mut first: Option<Bytes> = None;
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|e| {
            super::guard::guard_error(&e)
                .unwrap_or_else(|| Error::invalid(format!("failed to read the request body: {e}")))
        })?;
        let Ok(chunk) = frame.into_data() else {
            continue;
        };
        let have = first.as_ref().map_or(0, Bytes::len) + buf.len();
        if have + chunk.len() > limit {
            return Err(too_large(have + chunk.len(), limit));
        }
        // A body that arrives in one chunk is used as is, without a copy.
        match first.take() {
            None if buf.is_empty() => first = Some(chunk),
            Some(f) => {
                buf.extend_from_slice(&f);
                buf.extend_from_slice(&chunk);
            }
            None => buf.extend_from_slice(&chunk),
        }
    }
    Ok(first.unwrap_or_else(|| buf.freeze()))
}

/// Undoes `Content-Encoding` (gzip, deflate/zlib, identity), bounded by `limit`.
pub fn decompress(body: Bytes, encoding: Option<&str>, limit: usize) -> Result<Bytes> {
    let encoding = encoding.map(|e| e.trim().to_ascii_lowercase()).unwrap_or_default();
    let reader: Box<dyn Read + '_> = match encoding.as_str() {
        "" | "identity" => return Ok(body),
        "gzip" | "x-gzip" => Box::new(GzDecoder::new(&body[..])),
        // Triton's inflater accepts either wrapper under `deflate`.
        "deflate" if body.starts_with(&[0x1f, 0x8b]) => Box::new(GzDecoder::new(&body[..])),
        "deflate" => Box::new(ZlibDecoder::new(&body[..])),
        other => {
            return Err(Error::unsupported(format!("Unsupported compression type '{other}'")));
        }
    };
    let mut out = Vec::new();
    reader
        .take(limit as u64 + 1)
        .read_to_end(&mut out)
        .map_err(|e| Error::invalid(format!("cannot decompress the {encoding} request body: {e}")))?;
    if out.len() > limit {
        return Err(too_large(out.len(), limit));
    }
    Ok(Bytes::from(out))
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Coding {
    Gzip,
    Deflate,
}

impl Coding {
    pub fn name(self) -> &'static str {
        match self {
            Coding::Gzip => "gzip",
            Coding::Deflate => "deflate",
        }
    }
}

/// Picks the reply coding from `Accept-Encoding`: highest q among identity, deflate, gzip; the
/// first listed wins ties.
pub fn choose(accept: Option<&str>) -> Option<Coding> {
    let mut best: Option<(f32, Option<Coding>)> = None;
    for part in accept.unwrap_or("").split(',') {
        let mut pieces = part.split(';');
        let name = pieces.next().unwrap_or("").trim().to_ascii_lowercase();
        let q = pieces
            .filter_map(|p| p.trim().strip_prefix("q=").and_then(|v| v.trim().parse::<f32>().ok()))
            .next()
            .unwrap_or(1.0);
        let coding = match name.as_str() {
            "gzip" => Some(Coding::Gzip),
            "deflate" => Some(Coding::Deflate),
            "identity" => None,
            _ => continue,
        };
        if q > 0.0 && best.is_none_or(|(bq, _)| q > bq) {
            best = Some((q, coding));
        }
    }
    best.and_then(|(_, c)| c)
}

pub fn compress(body: &[u8], coding: Coding) -> std::io::Result<Vec<u8>> {
    match coding {
        Coding::Gzip => {
            let mut e = GzEncoder::new(Vec::with_capacity(body.len() / 2), Compression::fast());
            e.write_all(body)?;
            e.finish()
        }
        Coding::Deflate => {
            let mut e = ZlibEncoder::new(Vec::with_capacity(body.len() / 2), Compression::fast());
            e.write_all(body)?;
            e.finish()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accept_encoding_choice() {
        assert_eq!(choose(None), None);
        assert_eq!(choose(Some("gzip, deflate")), Some(Coding::Gzip));
        assert_eq!(choose(Some("deflate;q=0.9, gzip;q=0.5")), Some(Coding::Deflate));
        assert_eq!(choose(Some("identity, gzip")), None);
        assert_eq!(choose(Some("br, gzip;q=0")), None);
    }

    #[test]
    fn round_trips_and_limits() {
        let text = vec![b'a'; 10_000];
        for coding in [Coding::Gzip, Coding::Deflate] {
            let packed = Bytes::from(compress(&text, coding).unwrap());
            assert_eq!(decompress(packed.clone(), Some(coding.name()), 20_000).unwrap(), &text[..]);
            let err = decompress(packed, Some(coding.name()), 1_000).unwrap_err();
            assert_eq!(err.http_status(), 413);
        }
        assert_eq!(decompress(Bytes::from_static(b"x"), Some("br"), 10).unwrap_err().http_status(), 501);
    }

    #[tokio::test]
    async fn body_limit() {
        let ok = read_body(Body::from("hello"), Some(5), 5).await.unwrap();
        assert_eq!(ok, "hello");
        assert_eq!(read_body(Body::from("hello"), Some(5), 4).await.unwrap_err().http_status(), 413);
        assert_eq!(read_body(Body::from("hello"), None, 4).await.unwrap_err().http_status(), 413);
    }
}
