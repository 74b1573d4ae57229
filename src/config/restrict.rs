//! `--http-restricted-api` / `--grpc-restricted-protocol` (tritonserver's flags): which API
//! categories need a header with an exact value, `<category,...>:<header>=<value>`.
use std::collections::BTreeMap;

/// Triton's API categories.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Category {
    Health,
    Metadata,
    Inference,
    SharedMemory,
    ModelConfig,
    ModelRepository,
    Statistics,
    Trace,
    Logging,
}

impl Category {
    pub const ALL: [Category; 9] = [
        Category::Health,
        Category::Metadata,
        Category::Inference,
        Category::SharedMemory,
        Category::ModelConfig,
        Category::ModelRepository,
        Category::Statistics,
        Category::Trace,
        Category::Logging,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Category::Health => "health",
            Category::Metadata => "metadata",
            Category::Inference => "inference",
            Category::SharedMemory => "shared-memory",
            Category::ModelConfig => "model-config",
            Category::ModelRepository => "model-repository",
            Category::Statistics => "statistics",
            Category::Trace => "trace",
            Category::Logging => "logging",
        }
    }
}

/// The header (lowercase name) and value each restricted category needs.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Restrictions(BTreeMap<Category, (String, String)>);

impl Restrictions {
    /// Parses every occurrence of the flag; a category named twice is an error.
    pub fn parse(flag: &str, specs: &[String]) -> Result<Restrictions, String> {
        let mut out = BTreeMap::new();
        for spec in specs {
            let bad = |why: &str| format!("{flag} '{spec}': {why} (expected <category,...>:<header>=<value>)");
            let (cats, kv) = spec.split_once(':').ok_or_else(|| bad("no ':'"))?;
            let (header, value) = kv.split_once('=').ok_or_else(|| bad("no '=' after the header name"))?;
            let header = header.trim().to_ascii_lowercase();
            if header.is_empty() || http::HeaderName::from_bytes(header.as_bytes()).is_err() {
                return Err(bad("the header name is not valid"));
            }
            for c in cats.split(',').map(str::trim) {
                let cat = Category::ALL.iter().find(|k| k.name() == c).ok_or_else(|| {
                    let known: Vec<&str> = Category::ALL.iter().map(|k| k.name()).collect();
                    bad(&format!("unknown category '{c}' (categories: {})", known.join(", ")))
                })?;
                if out.insert(*cat, (header.clone(), value.to_string())).is_some() {
                    return Err(bad(&format!("category '{c}' is restricted twice")));
                }
            }
        }
        Ok(Restrictions(out))
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// None: allowed; Some(header): the header the request lacks (or has with another value).
    pub fn check<'a>(&self, category: Category, header: impl Fn(&str) -> Option<&'a str>) -> Option<&str> {
        let (name, value) = self.0.get(&category)?;
        if header(name) == Some(value.as_str()) { None } else { Some(name) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_checks() {
        let r = Restrictions::parse(
            "--http-restricted-api",
            &["model-repository,shared-memory:Admin-Key=s3cret".into(), "trace:t=1".into()],
        )
        .unwrap();
        assert_eq!(r.check(Category::Inference, |_| None), None);
        assert_eq!(r.check(Category::ModelRepository, |_| None), Some("admin-key"));
        assert_eq!(r.check(Category::ModelRepository, |h| (h == "admin-key").then_some("wrong")), Some("admin-key"));
        assert_eq!(r.check(Category::SharedMemory, |h| (h == "admin-key").then_some("s3cret")), None);
        for bad in ["model-repository", "nope:k=v", "health:=v", "health:k", "health,health:k=v"] {
            assert!(Restrictions::parse("--x", &[bad.into()]).is_err(), "{bad}");
        }
    }
}
