//! What the Vertex AI and SageMaker front-ends share: the default model rule, the health answer
//! (503 with what is happening until the model can serve, then 200), and the binary content
//! type that carries the JSON header length in its `json-header-size` parameter.
use serde_json::{Value, json};

use crate::{
    engine::Engine,
    error::{Error, Result},
    repository::registry::State,
};

/// 64 random bits (from the system's random source; the clock where it cannot be read), for ids.
pub fn random_u64() -> u64 {
    use std::io::Read;
    let mut random = [0u8; 8];
    if std::fs::File::open("/dev/urandom").and_then(|mut f| f.read_exact(&mut random)).is_err() {
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
        random = (now.as_nanos() as u64).to_le_bytes();
    }
    u64::from_le_bytes(random)
}

/// The model platform predict calls go to: the configured one, else the only model.
pub fn default_model(engine: &Engine, configured: Option<&str>, knob: &str) -> Result<String> {
    if let Some(m) = configured {
        return Ok(m.to_string());
    }
    // What the registry knows (every model start-up tried, and every load since): no listing of
    // folders or buckets on each request.
    let mut names: Vec<String> = engine.registry().names();
    names.dedup();
    match names.as_slice() {
        [one] => Ok(one.clone()),
        [] => Err(Error::unavailable("no model is in the model repository yet")),
        many => Err(Error::invalid(format!(
            "several models are served ({}); choose the default with {knob}, or address one model with the KServe v2 routes",
            many.join(", ")
        ))),
    }
}

/// Ready for the platform: the default model serves (or, without one, every model is ready).
/// The body says what is happening while not ready.
pub fn health(engine: &Engine, default: Result<String>) -> (bool, Value) {
    let index = engine.repository().index(false);
    let models: Vec<Value> = index
        .iter()
        .map(|e| {
            json!({"name": e.name, "version": e.version.map(|v| v.to_string()), "state": e.state.as_str(), "reason": e.reason})
        })
        .collect();
    let (ready, detail) = match (&default, engine.live()) {
        (_, Err(e)) => (false, e.message().to_string()),
        (Ok(m), Ok(())) => match engine.model_ready(m, None) {
            Ok(()) => (true, format!("model '{m}' is ready")),
            Err(e) => (false, loading_detail(&index, m).unwrap_or_else(|| e.message().to_string())),
        },
        (Err(e), Ok(())) if e.http_status() == 400 => (engine.ready(), e.message().to_string()),
        (Err(e), Ok(())) => (false, e.message().to_string()),
    };
    let mut body = json!({"ready": ready, "detail": detail, "models": models});
    if let Some(progress) = engine.repository().progress() {
        body["download"] = progress;
    }
    (ready, body)
}

fn loading_detail(index: &[crate::repository::registry::IndexEntry], model: &str) -> Option<String> {
    index.iter().find(|e| e.name == model).map(|e| match e.state {
        State::Loading => format!("loading model '{model}'"),
        State::Unavailable => format!("model '{model}' failed to load: {}", e.reason),
        _ => format!("model '{model}' is {}", e.state.as_str()),
    })
}

/// `<media type>;json-header-size=N` → N. The media type must start the value (Triton's rule).
pub fn json_header_size(content_type: Option<&str>, media: &str) -> Result<Option<usize>> {
    let Some(ct) = content_type else { return Ok(None) };
    let ct = ct.trim_start();
    if !ct.to_ascii_lowercase().contains(media) {
        return Ok(None);
    }
    if !ct.to_ascii_lowercase().starts_with(media) {
        return Err(Error::invalid(format!("Content-Type must start with '{media}', got '{ct}'")));
    }
    let size = ct[media.len()..]
        .split(';')
        .filter_map(|p| p.trim().strip_prefix("json-header-size="))
        .next()
        .ok_or_else(|| Error::invalid(format!("Content-Type '{ct}' has no json-header-size parameter")))?;
    let n: i64 = size
        .trim()
        .parse()
        .map_err(|_| Error::invalid(format!("json-header-size must be an integer, got '{size}'")))?;
    if n < 0 || n > i64::from(i32::MAX) {
        return Err(Error::invalid(format!("json-header-size must be between 0 and {}, got {n}", i32::MAX)));
    }
    Ok(Some(n as usize))
}

#[cfg(test)]
mod tests {
    use super::*;

    const M: &str = "application/vnd.sagemaker-triton.binary+json";

    #[test]
    fn header_size_from_the_content_type() {
        assert_eq!(json_header_size(Some("application/json"), M).unwrap(), None);
        assert_eq!(json_header_size(Some(&format!("{M};json-header-size=42")), M).unwrap(), Some(42));
        assert_eq!(json_header_size(Some(&format!("{M}; json-header-size=0")), M).unwrap(), Some(0));
        for bad in [
            format!("x{M};json-header-size=1"),
            format!("{M};json-header-size=abc"),
            format!("{M};json-header-size=-1"),
            format!("{M};json-header-size=99999999999"),
            M.to_string(),
        ] {
            assert_eq!(json_header_size(Some(&bad), M).unwrap_err().http_status(), 400, "{bad}");
        }
    }
}
