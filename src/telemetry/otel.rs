//! OpenTelemetry traces exported over OTLP (gRPC or HTTP/protobuf), and the spans of one request:
//! `infer` (continuing the caller's W3C `traceparent` when there is one), with `queue`, `compute`
//! (one per batch, linked to every request in it) and `response` below it.
use std::time::Duration;

use opentelemetry::{
    KeyValue,
    trace::{SpanContext, SpanId, TraceContextExt, TraceFlags, TraceId, TraceState, TracerProvider as _},
};
use opentelemetry_otlp::{SpanExporter, WithExportConfig};
use opentelemetry_sdk::{
    Resource, runtime,
    trace::{BatchConfigBuilder, SdkTracerProvider, span_processor_with_async_runtime::BatchSpanProcessor},
};
use tracing::Span;
use tracing_opentelemetry::OpenTelemetrySpanExt;

/// Where spans go (from `--trace-config opentelemetry,url=...` or the `OTEL_*` variables).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OtlpSettings {
    pub endpoint: String,
    /// HTTP/protobuf instead of gRPC.
    pub http: bool,
    pub service_name: String,
    pub resource: Vec<(String, String)>,
}

/// The span target the OpenTelemetry layer listens to (log filters do not apply to it).
pub const TARGET: &str = "ferry::trace";

/// Builds the exporting provider; needs the async runtime (exports run on it, so a dead
/// collector blocks nothing but its own task).
pub fn provider(s: &OtlpSettings) -> Result<SdkTracerProvider, String> {
    let timeout = Duration::from_secs(5);
    let exporter = if s.http {
        SpanExporter::builder().with_http().with_endpoint(&s.endpoint).with_timeout(timeout).build()
    } else {
        SpanExporter::builder().with_tonic().with_endpoint(&s.endpoint).with_timeout(timeout).build()
    }
    .map_err(|e| format!("cannot set up the OTLP exporter for '{}': {e}", s.endpoint))?;
    let config = BatchConfigBuilder::default().with_scheduled_delay(Duration::from_millis(500)).build();
    let processor = BatchSpanProcessor::builder(exporter, runtime::Tokio).with_batch_config(config).build();
    let resource = Resource::builder()
        .with_service_name(s.service_name.clone())
        .with_attributes(s.resource.iter().map(|(k, v)| KeyValue::new(k.clone(), v.clone())))
        .build();
    Ok(SdkTracerProvider::builder().with_span_processor(processor).with_resource(resource).build())
}

pub fn tracer(provider: &SdkTracerProvider) -> opentelemetry_sdk::trace::Tracer {
    provider.tracer("ferry")
}

/// Parses a W3C `traceparent` (`00-<trace id>-<parent span id>-<flags>`).
pub fn parse_traceparent(value: &str) -> Option<SpanContext> {
    let mut parts = value.trim().split('-');
    let (version, trace, span, flags) = (parts.next()?, parts.next()?, parts.next()?, parts.next()?);
    if version.len() != 2 || trace.len() != 32 || span.len() != 16 || flags.len() != 2 || version == "ff" {
        return None;
    }
    let trace_id = TraceId::from_hex(trace).ok().filter(|t| *t != TraceId::INVALID)?;
    let span_id = SpanId::from_hex(span).ok().filter(|s| *s != SpanId::INVALID)?;
    let flags = TraceFlags::new(u8::from_str_radix(flags, 16).ok()?);
    Some(SpanContext::new(trace_id, span_id, flags, true, TraceState::default()))
}

/// Whether a caller's `traceparent` asks for this request to be recorded.
pub fn sampled_by_caller(traceparent: Option<&str>) -> bool {
    traceparent.and_then(parse_traceparent).is_some_and(|c| c.is_sampled())
}

/// The span of one traced request, child of the caller's span when a `traceparent` came with it.
pub fn request_span(model: &str, version: u64, id: &str, traceparent: Option<&str>) -> Span {
    let span = tracing::info_span!(target: TARGET, "infer", model = %model, version = version, request_id = %id);
    if let Some(remote) = traceparent.and_then(parse_traceparent) {
        let _ = span.set_parent(opentelemetry::Context::new().with_remote_span_context(remote));
    }
    span
}

pub fn queue_span(parent: &Span) -> Span {
    if parent.is_none() { Span::none() } else { tracing::info_span!(target: TARGET, parent: parent, "queue") }
}

/// One step of an ensemble, under the ensemble request's span.
pub fn step_span(parent: &Span, step: usize, model: &str) -> Span {
    if parent.is_none() {
        Span::none()
    } else {
        tracing::info_span!(target: TARGET, parent: parent, "step", step = step, model = %model)
    }
}

pub fn response_span(parent: &Span) -> Span {
    if parent.is_none() { Span::none() } else { tracing::info_span!(target: TARGET, parent: parent, "response") }
}

/// One batch execution: a child of the first traced request, linked to every traced request.
pub fn compute_span<'a>(requests: impl Iterator<Item = &'a Span>, rows: usize) -> Span {
    let traced: Vec<&Span> = requests.filter(|s| !s.is_none()).collect();
    let Some(first) = traced.first() else { return Span::none() };
    let span =
        tracing::info_span!(target: TARGET, parent: *first, "compute", batch_rows = rows, requests = traced.len());
    for r in &traced {
        span.add_link(r.context().span().span_context().clone());
    }
    span
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn traceparent_parsing() {
        let c = parse_traceparent("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01").unwrap();
        assert_eq!(c.trace_id().to_string(), "4bf92f3577b34da6a3ce929d0e0e4736");
        assert_eq!(c.span_id().to_string(), "00f067aa0ba902b7");
        assert!(c.is_sampled() && c.is_remote());
        assert!(!sampled_by_caller(Some("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00")));
        for bad in [
            "",
            "00-0000-00f067aa0ba902b7-01",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
        ] {
            assert!(parse_traceparent(bad).is_none(), "{bad}");
        }
    }
}
