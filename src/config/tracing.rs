//! `--trace-config` and the standard OTEL_* variables: where request traces go, and the trace
//! settings at start.
use crate::{settings::TraceSettings, telemetry::otel::OtlpSettings};

/// Folds `--trace-config` entries and the standard OTEL_* variables into where traces go and the
/// initial trace settings. With an exporter and no level given, requests are traced at
/// TIMESTAMPS level (1 in `rate`, 1000 by default as in Triton).
pub(super) fn settings(
    entries: &[String],
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<(Option<OtlpSettings>, TraceSettings), String> {
    let mut trace = TraceSettings::default();
    let (mut url, mut protocol, mut resource, mut level_given) = (None::<String>, None::<String>, Vec::new(), false);
    let mut opentelemetry = false;
    for e in entries {
        let (scope, kv) = match e.split_once(',') {
            Some((scope, kv)) if !scope.contains('=') => (scope, kv),
            _ => ("", e.as_str()),
        };
        let (key, value) = kv.split_once('=').ok_or_else(|| format!("expected key=value, got '{e}'"))?;
        match (scope, key) {
            ("", "mode") if value == "opentelemetry" => opentelemetry = true,
            ("", "mode") => return Err(format!("mode '{value}' is not supported; use mode=opentelemetry")),
            ("", "rate") => trace.trace_rate = value.to_string(),
            ("", "count") => trace.trace_count = value.to_string(),
            ("", "level") => {
                if !level_given {
                    trace.trace_level.clear();
                    level_given = true;
                }
                trace.trace_level.push(value.to_string());
            }
            ("opentelemetry", "url") => url = Some(value.to_string()),
            ("opentelemetry", "protocol") => protocol = Some(value.to_string()),
            ("opentelemetry", "resource") => {
                let (k, v) = value.split_once('=').ok_or_else(|| format!("resource needs key=value, got '{value}'"))?;
                resource.push((k.to_string(), v.to_string()));
            }
            _ => return Err(format!("unknown trace setting '{e}'")),
        }
    }
    let protocol =
        protocol.or_else(|| env("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")).or_else(|| env("OTEL_EXPORTER_OTLP_PROTOCOL"));
    let http = match protocol.as_deref() {
        None => url.is_some(), // Triton's --trace-config url is an OTLP/HTTP endpoint
        Some("grpc") => false,
        Some("http/protobuf") => true,
        Some(other) => return Err(format!("OTLP protocol '{other}' is not supported (grpc or http/protobuf)")),
    };
    let endpoint = url
        .map(|u| if u.starts_with("http") { u } else { format!("http://{u}") })
        .or_else(|| env("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"))
        .or_else(|| {
            env("OTEL_EXPORTER_OTLP_ENDPOINT")
                .map(|e| if http { format!("{}/v1/traces", e.trim_end_matches('/')) } else { e })
        });
    let Some(endpoint) = endpoint else {
        if opentelemetry {
            return Err("mode=opentelemetry needs opentelemetry,url=... or OTEL_EXPORTER_OTLP_ENDPOINT".into());
        }
        return Ok((None, trace));
    };
    if !level_given {
        trace.trace_level = vec!["TIMESTAMPS".into()];
    }
    trace.trace_mode = "opentelemetry".into();
    if let Some(attrs) = env("OTEL_RESOURCE_ATTRIBUTES") {
        resource.extend(
            attrs.split(',').filter_map(|kv| kv.split_once('=')).map(|(k, v)| (k.trim().into(), v.trim().into())),
        );
    }
    let service_name = env("OTEL_SERVICE_NAME").unwrap_or_else(|| "ferry".into());
    Ok((Some(OtlpSettings { endpoint, http, service_name, resource }), trace))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tracing_from_flags_and_environment() {
        let none = |_: &str| None;
        let (otlp, trace) = settings(&[], &none).unwrap();
        assert!(otlp.is_none());
        assert_eq!(trace.trace_level, vec!["OFF"]);
        let flags: Vec<String> = [
            "mode=opentelemetry",
            "opentelemetry,url=localhost:4318/v1/traces",
            "rate=1",
            "opentelemetry,resource=team=ml",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        let (otlp, trace) = settings(&flags, &none).unwrap();
        let otlp = otlp.unwrap();
        assert_eq!(otlp.endpoint, "http://localhost:4318/v1/traces");
        assert!(otlp.http);
        assert_eq!(otlp.resource, vec![("team".to_string(), "ml".to_string())]);
        assert_eq!((trace.trace_rate.as_str(), trace.trace_level.clone()), ("1", vec!["TIMESTAMPS".to_string()]));
        let env = |k: &str| match k {
            "OTEL_EXPORTER_OTLP_ENDPOINT" => Some("http://collector:4317".to_string()),
            "OTEL_SERVICE_NAME" => Some("svc".to_string()),
            _ => None,
        };
        let (otlp, _) = settings(&[], &env).unwrap();
        let otlp = otlp.unwrap();
        assert_eq!(
            (otlp.endpoint.as_str(), otlp.http, otlp.service_name.as_str()),
            ("http://collector:4317", false, "svc")
        );
        assert!(settings(&["mode=opentelemetry".to_string()], &none).is_err());
        assert!(settings(&["bogus".to_string()], &none).is_err());
    }
}
