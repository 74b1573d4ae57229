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

/// The header and value each restricted category needs.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Restrictions(BTreeMap<Category, (String, String)>);

/// What gRPC puts before the header name a `--grpc-restricted-protocol` gives, as Triton does.
pub const GRPC_HEADER_PREFIX: &str = "triton-grpc-protocol-";

impl Restrictions {
    /// `--http-restricted-api` (`kind` "api") or `--grpc-restricted-protocol` ("protocol", the
    /// header named with [`GRPC_HEADER_PREFIX`]), every occurrence, in Triton's words when one
    /// is wrong: `<category,...>:<header>=<value>`, none of them empty, each category once.
    pub fn parse(option: &str, kind: &str, specs: &[String]) -> Result<Restrictions, String> {
        let prefix = if kind == "protocol" { GRPC_HEADER_PREFIX } else { "" };
        let mut out = BTreeMap::new();
        for spec in specs {
            let format = || format!("--{option} option format is '<config name>:<setting>=<value>'. Got {spec}");
            let (cats, kv) = spec.split_once(':').ok_or_else(format)?;
            let (header, value) = kv.split_once('=').ok_or_else(format)?;
            if cats.is_empty() || header.is_empty() || value.is_empty() {
                return Err(format());
            }
            for c in cats.split(',') {
                let cat = Category::ALL
                    .iter()
                    .find(|k| k.name() == c)
                    .ok_or_else(|| format!("unknown restricted {kind} '{c}' "))?;
                if out.insert(*cat, (format!("{prefix}{header}"), value.to_string())).is_some() {
                    return Err(format!("restricted {kind} '{c}' can not be specified in multiple config groups"));
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
            "http-restricted-api",
            "api",
            &["model-repository,shared-memory:admin-key=s3cret".into(), "trace:t=1".into()],
        )
        .unwrap();
        assert_eq!(r.check(Category::Inference, |_| None), None);
        assert_eq!(r.check(Category::ModelRepository, |_| None), Some("admin-key"));
        assert_eq!(r.check(Category::ModelRepository, |h| (h == "admin-key").then_some("wrong")), Some("admin-key"));
        assert_eq!(r.check(Category::SharedMemory, |h| (h == "admin-key").then_some("s3cret")), None);
        let grpc = Restrictions::parse("grpc-restricted-protocol", "protocol", &["inference:infer-key=v".into()]);
        assert_eq!(grpc.unwrap().check(Category::Inference, |_| None), Some("triton-grpc-protocol-infer-key"));
    }

    #[test]
    fn parse_errors_in_tritons_words() {
        let err = |spec: &str| Restrictions::parse("http-restricted-api", "api", &[spec.into()]).unwrap_err();
        for bad in ["model-repository", "health:=v", "health:k", "health:k=", ":k=v"] {
            assert_eq!(
                err(bad),
                format!("--http-restricted-api option format is '<config name>:<setting>=<value>'. Got {bad}")
            );
        }
        assert_eq!(err("model-reposit:k=v"), "unknown restricted api 'model-reposit' ");
        assert_eq!(err("health, metadata:k=v"), "unknown restricted api ' metadata' ");
        assert_eq!(err("health,health:k=v"), "restricted api 'health' can not be specified in multiple config groups");
        let twice = Restrictions::parse(
            "grpc-restricted-protocol",
            "protocol",
            &["metadata,health:a=1".into(), "health:b=2".into()],
        );
        assert_eq!(twice.unwrap_err(), "restricted protocol 'health' can not be specified in multiple config groups");
    }
}
