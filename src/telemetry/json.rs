//! One JSON object per log line, with the field names Cloud Logging and CloudWatch Logs read:
//! `timestamp`, `severity`, `message`, the event's fields, and the OpenTelemetry `trace_id` /
//! `span_id` of the current request when it is traced.
use std::fmt;

use opentelemetry::trace::TraceContextExt;
use serde_json::{Map, Value};
use tracing::{Event, Subscriber, field::Field};
use tracing_opentelemetry::OpenTelemetrySpanExt;
use tracing_subscriber::{
    fmt::{FmtContext, FormatEvent, FormatFields, format::Writer, time::FormatTime},
    registry::LookupSpan,
};

use super::Clock;

pub struct JsonFormat {
    pub clock: Clock,
}

struct Fields(Map<String, Value>);

impl tracing::field::Visit for Fields {
    fn record_debug(&mut self, field: &Field, value: &dyn fmt::Debug) {
        self.0.insert(field.name().to_string(), Value::String(format!("{value:?}")));
    }
    fn record_str(&mut self, field: &Field, value: &str) {
        self.0.insert(field.name().to_string(), Value::String(value.to_string()));
    }
    fn record_i64(&mut self, field: &Field, value: i64) {
        self.0.insert(field.name().to_string(), value.into());
    }
    fn record_u64(&mut self, field: &Field, value: u64) {
        self.0.insert(field.name().to_string(), value.into());
    }
    fn record_f64(&mut self, field: &Field, value: f64) {
        self.0.insert(field.name().to_string(), value.into());
    }
    fn record_bool(&mut self, field: &Field, value: bool) {
        self.0.insert(field.name().to_string(), value.into());
    }
}

/// Cloud Logging's severity names.
fn severity(level: &tracing::Level) -> &'static str {
    match *level {
        tracing::Level::ERROR => "ERROR",
        tracing::Level::WARN => "WARNING",
        tracing::Level::INFO => "INFO",
        _ => "DEBUG",
    }
}

impl<S, N> FormatEvent<S, N> for JsonFormat
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    N: for<'a> FormatFields<'a> + 'static,
{
    fn format_event(&self, _ctx: &FmtContext<'_, S, N>, mut writer: Writer<'_>, event: &Event<'_>) -> fmt::Result {
        let mut time = String::new();
        self.clock.format_time(&mut Writer::new(&mut time))?;
        let mut fields = Fields(Map::new());
        event.record(&mut fields);
        let mut line = Map::new();
        line.insert("timestamp".into(), time.into());
        line.insert("severity".into(), severity(event.metadata().level()).into());
        line.insert("message".into(), fields.0.remove("message").unwrap_or(Value::String(String::new())));
        line.insert("target".into(), event.metadata().target().into());
        line.extend(fields.0);
        let context = tracing::Span::current().context();
        let span = context.span();
        let span_context = span.span_context();
        if span_context.is_valid() {
            line.insert("trace_id".into(), span_context.trace_id().to_string().into());
            line.insert("span_id".into(), span_context.span_id().to_string().into());
        }
        writeln!(writer, "{}", Value::Object(line))
    }
}
