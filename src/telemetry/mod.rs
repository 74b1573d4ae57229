//! Logs and traces through `tracing`: human-readable lines (or JSON with `--log-format json`) on
//! stderr, `--log-verbose` for debug output, a RUST_LOG filter (read by `config`) over it, and the
//! logging extension changing levels and the timestamp format at run time through `LogControl`.
//! Request traces go to OpenTelemetry (see `otel`), unaffected by log filters.
use std::{
    fmt,
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::{SystemTime, UNIX_EPOCH},
};

use opentelemetry_sdk::trace::SdkTracerProvider;
use tracing_subscriber::{
    EnvFilter, Layer, Registry,
    filter::Targets,
    fmt::{format::Writer, time::FormatTime},
    layer::SubscriberExt,
    reload,
    util::SubscriberInitExt,
};

use crate::settings::{LogControl, LogSettings};

mod json;
pub mod otel;

/// `--log-format`: Triton's `default` and `ISO8601` timestamps, or one JSON object per line.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogFormat {
    Default,
    Iso8601,
    Json,
}

fn filter_for(s: &LogSettings) -> EnvFilter {
    let level = match (s.log_verbose_level, s.log_info, s.log_warning, s.log_error) {
        (v, _, _, _) if v >= 2 => "debug",
        (1, _, _, _) => "info,ferry=debug",
        (_, true, _, _) => "info",
        (_, _, true, _) => "warn",
        (_, _, _, true) => "error",
        _ => "off",
    };
    EnvFilter::new(level)
}

/// Timestamps as Triton's formats: `default` (glog-like `MMDD HH:MM:SS.micros`) or ISO 8601.
pub(crate) struct Clock {
    iso8601: Arc<AtomicBool>,
}

impl FormatTime for Clock {
    fn format_time(&self, w: &mut Writer<'_>) -> fmt::Result {
        let now = SystemTime::now().duration_since(UNIX_EPOCH).unwrap_or_default();
        if self.iso8601.load(Ordering::Relaxed) {
            return write!(w, "{}", iso8601(SystemTime::now()));
        }
        let secs = now.as_secs();
        let (_, mo, d) = civil_from_days((secs / 86_400) as i64);
        let (h, mi, s) = ((secs / 3600) % 24, (secs / 60) % 60, secs % 60);
        write!(w, "{mo:02}{d:02} {h:02}:{mi:02}:{s:02}.{:06}", now.subsec_micros())
    }
}

/// A time as `YYYY-MM-DDTHH:MM:SSZ` (UTC).
pub(crate) fn iso8601(t: SystemTime) -> String {
    let secs = t.duration_since(UNIX_EPOCH).unwrap_or_default().as_secs();
    let (y, mo, d) = civil_from_days((secs / 86_400) as i64);
    let (h, mi, s) = ((secs / 3600) % 24, (secs / 60) % 60, secs % 60);
    format!("{y:04}-{mo:02}-{d:02}T{h:02}:{mi:02}:{s:02}Z")
}

/// Year, month, day of a count of days since 1970-01-01 (Howard Hinnant's algorithm).
fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    (yoe + era * 400 + i64::from(m <= 2), m, d)
}

struct Control {
    filter: reload::Handle<EnvFilter, Registry>,
    iso8601: Arc<AtomicBool>,
}

impl LogControl for Control {
    fn apply(&self, s: &LogSettings) {
        self.iso8601.store(s.log_format == "ISO8601", Ordering::Relaxed);
        if let Err(e) = self.filter.reload(filter_for(s)) {
            tracing::warn!(error = %e, "cannot change the log level");
        }
    }
}

/// Logging and tracing as set up at start.
pub struct Telemetry {
    pub control: Arc<dyn LogControl>,
    provider: Option<SdkTracerProvider>,
}

impl Telemetry {
    /// Whether request traces are exported.
    pub fn tracing(&self) -> bool {
        self.provider.is_some()
    }

    /// Sends the spans still buffered, giving a dead collector at most two seconds.
    pub async fn shutdown(self) {
        if let Some(provider) = self.provider {
            let flush =
                tokio::task::spawn_blocking(move || provider.shutdown_with_timeout(std::time::Duration::from_secs(2)));
            let _ = tokio::time::timeout(std::time::Duration::from_secs(3), flush).await;
        }
    }
}

/// Starts logging (and OTLP export when `otlp` is given; call from inside the async runtime).
pub fn init(log_verbose: u32, filter: Option<&str>, format: LogFormat, otlp: Option<&otel::OtlpSettings>) -> Telemetry {
    let initial = LogSettings {
        log_file: String::new(),
        log_info: true,
        log_warning: true,
        log_error: true,
        log_verbose_level: log_verbose,
        log_format: if format == LogFormat::Iso8601 { "ISO8601" } else { "default" }.into(),
    };
    let env_filter = filter.and_then(|f| EnvFilter::try_new(f).ok()).unwrap_or_else(|| filter_for(&initial));
    let (filter_layer, handle) = reload::Layer::new(env_filter);
    let iso8601 = Arc::new(AtomicBool::new(format == LogFormat::Iso8601));
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let clock = Clock { iso8601: Arc::clone(&iso8601) };
    let logs = match format {
        LogFormat::Json => tracing_subscriber::fmt::layer()
            .with_writer(std::io::stderr)
            .event_format(json::JsonFormat { clock: Clock { iso8601: Arc::new(AtomicBool::new(true)) } })
            .boxed(),
        _ => tracing_subscriber::fmt::layer().with_ansi(ansi).with_writer(std::io::stderr).with_timer(clock).boxed(),
    };
    let mut provider = None;
    let traces = match otlp.map(otel::provider) {
        Some(Ok(p)) => {
            let layer = tracing_opentelemetry::layer()
                .with_tracer(otel::tracer(&p))
                .with_filter(Targets::new().with_target(otel::TARGET, tracing::Level::INFO));
            provider = Some(p);
            Some(layer)
        }
        Some(Err(e)) => {
            eprintln!("ferry: {e}; request traces are off");
            None
        }
        None => None,
    };
    let _ = tracing_subscriber::registry().with(logs.with_filter(filter_layer)).with(traces).try_init();
    if let Some(o) = otlp.filter(|_| provider.is_some()) {
        tracing::info!(endpoint = %o.endpoint, protocol = if o.http { "http/protobuf" } else { "grpc" }, "exporting request traces over OTLP");
    }
    Telemetry { control: Arc::new(Control { filter: handle, iso8601 }), provider }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dates() {
        assert_eq!(civil_from_days(0), (1970, 1, 1));
        assert_eq!(civil_from_days(20_786), (2026, 11, 29));
        assert_eq!(civil_from_days(11_016), (2000, 2, 29));
    }
}
