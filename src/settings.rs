//! Run-time settings of the logging and trace extensions: the values clients read and update,
//! validated here; applying log levels is the telemetry adapter's job (through `LogControl`).
use std::{
    collections::BTreeMap,
    sync::{Arc, Mutex},
};

use crate::error::{Error, Result};

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LogSettings {
    pub log_file: String,
    pub log_info: bool,
    pub log_warning: bool,
    pub log_error: bool,
    pub log_verbose_level: u32,
    /// `default` or `ISO8601`.
    pub log_format: String,
}

/// A partial update; None leaves a setting as it is.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LogUpdate {
    pub log_file: Option<String>,
    pub log_info: Option<bool>,
    pub log_warning: Option<bool>,
    pub log_error: Option<bool>,
    pub log_verbose_level: Option<u32>,
    pub log_format: Option<String>,
}

/// Applies log settings to the process's logger.
pub trait LogControl: Send + Sync {
    fn apply(&self, settings: &LogSettings);
}

pub struct Logging {
    current: Mutex<LogSettings>,
    control: Option<Arc<dyn LogControl>>,
}

impl Logging {
    pub fn new(verbose: u32, control: Option<Arc<dyn LogControl>>) -> Self {
        let current = LogSettings {
            log_file: String::new(),
            log_info: true,
            log_warning: true,
            log_error: true,
            log_verbose_level: verbose,
            log_format: "default".into(),
        };
        Logging { current: Mutex::new(current), control }
    }

    pub fn get(&self) -> LogSettings {
        self.current.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    pub fn update(&self, u: LogUpdate) -> Result<LogSettings> {
        if u.log_file.as_ref().is_some_and(|f| !f.is_empty()) {
            return Err(Error::unsupported("log file location can not be updated through network protocol"));
        }
        if let Some(f) = &u.log_format
            && f != "default"
            && f != "ISO8601"
        {
            return Err(Error::unavailable(format!("invalid argument for --log_format, got: {f}")));
        }
        let mut s = self.current.lock().unwrap_or_else(|p| p.into_inner());
        s.log_info = u.log_info.unwrap_or(s.log_info);
        s.log_warning = u.log_warning.unwrap_or(s.log_warning);
        s.log_error = u.log_error.unwrap_or(s.log_error);
        s.log_verbose_level = u.log_verbose_level.unwrap_or(s.log_verbose_level);
        if let Some(f) = u.log_format {
            s.log_format = f;
        }
        if let Some(c) = &self.control {
            c.apply(&s);
        }
        Ok(s.clone())
    }
}

/// Trace settings: strings as the protocol carries them (`trace_level` is a list).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TraceSettings {
    pub trace_level: Vec<String>,
    pub trace_rate: String,
    pub trace_count: String,
    pub log_frequency: String,
    pub trace_file: String,
    pub trace_mode: String,
}

impl Default for TraceSettings {
    fn default() -> Self {
        TraceSettings {
            trace_level: vec!["OFF".into()],
            trace_rate: "1000".into(),
            trace_count: "-1".into(),
            log_frequency: "0".into(),
            trace_file: String::new(),
            trace_mode: "triton".into(),
        }
    }
}

/// A partial update: `Some(None)` clears a per-model override back to the global value.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TraceUpdate {
    pub trace_level: Option<Option<Vec<String>>>,
    pub trace_rate: Option<Option<String>>,
    pub trace_count: Option<Option<String>>,
    pub log_frequency: Option<Option<String>>,
    pub trace_file: Option<Option<String>>,
}

#[derive(Debug, Clone, Default)]
struct TraceOverride {
    trace_level: Option<Vec<String>>,
    trace_rate: Option<String>,
    trace_count: Option<String>,
    log_frequency: Option<String>,
}

pub struct Tracing {
    global: Mutex<TraceSettings>,
    models: Mutex<BTreeMap<String, TraceOverride>>,
    seen: std::sync::atomic::AtomicU64,
    /// The global level and rate, parsed, so the common case decides without locks or copies.
    global_off: std::sync::atomic::AtomicBool,
    global_rate: std::sync::atomic::AtomicU64,
    overrides: std::sync::atomic::AtomicBool,
}

fn check_number(key: &str, v: &str, min: i64) -> Result<()> {
    match v.parse::<i64>() {
        Ok(n) if n >= min => Ok(()),
        Ok(_) => Err(Error::invalid(format!("'{key}' must be >= {min}, got: {v}"))),
        Err(_) => Err(Error::invalid(format!("Unable to parse '{key}', got: {v}"))),
    }
}

fn check_levels(levels: &[String]) -> Result<()> {
    if let Some(bad) = levels.iter().find(|l| !matches!(l.as_str(), "OFF" | "TIMESTAMPS" | "TENSORS")) {
        return Err(Error::invalid(format!(
            "invalid 'trace_level' value '{bad}': expected OFF, TIMESTAMPS or TENSORS"
        )));
    }
    if levels.len() > 1 && levels.iter().any(|l| l == "OFF") {
        return Err(Error::invalid("'trace_level' OFF cannot be combined with other levels"));
    }
    Ok(())
}

impl Default for Tracing {
    fn default() -> Self {
        Tracing::new(TraceSettings::default())
    }
}

impl Tracing {
    pub fn new(initial: TraceSettings) -> Self {
        let t = Tracing {
            global: Mutex::new(initial),
            models: Mutex::default(),
            seen: Default::default(),
            global_off: Default::default(),
            global_rate: Default::default(),
            overrides: Default::default(),
        };
        t.refresh();
        t
    }

    fn refresh(&self) {
        use std::sync::atomic::Ordering::Relaxed;
        let g = self.global.lock().unwrap_or_else(|p| p.into_inner());
        self.global_off.store(g.trace_level.is_empty() || g.trace_level.iter().any(|l| l == "OFF"), Relaxed);
        self.global_rate.store(g.trace_rate.parse::<u64>().unwrap_or(1000).max(1), Relaxed);
        drop(g);
        self.overrides.store(!self.models.lock().unwrap_or_else(|p| p.into_inner()).is_empty(), Relaxed);
    }

    /// Whether to trace the next request of `model`: its level is not OFF, it is the `rate`-th
    /// request, and `trace_count` (-1 = unlimited) is not used up (each trace uses one).
    pub fn sample(&self, model: &str) -> bool {
        use std::sync::atomic::Ordering::Relaxed;
        if !self.overrides.load(Relaxed) {
            // No per-model settings: decide from the parsed global ones.
            if self.global_off.load(Relaxed) {
                return false;
            }
            let n = self.seen.fetch_add(1, Relaxed) + 1;
            if !n.is_multiple_of(self.global_rate.load(Relaxed)) {
                return false;
            }
            return self.use_count();
        }
        let s = self.get(Some(model));
        if s.trace_level.iter().any(|l| l == "OFF") || s.trace_level.is_empty() {
            return false;
        }
        let rate = s.trace_rate.parse::<u64>().unwrap_or(1000).max(1);
        let n = self.seen.fetch_add(1, Relaxed) + 1;
        if !n.is_multiple_of(rate) {
            return false;
        }
        self.use_count()
    }

    /// Takes one trace from `trace_count` (-1 = unlimited).
    fn use_count(&self) -> bool {
        let mut g = self.global.lock().unwrap_or_else(|p| p.into_inner());
        match g.trace_count.parse::<i64>() {
            Ok(0) => false,
            Ok(n) if n > 0 => {
                g.trace_count = (n - 1).to_string();
                true
            }
            _ => true,
        }
    }

    /// The settings that apply to `model` (its overrides over the global ones), or the global ones.
    pub fn get(&self, model: Option<&str>) -> TraceSettings {
        let mut s = self.global.lock().unwrap_or_else(|p| p.into_inner()).clone();
        if let Some(o) = model.and_then(|m| self.models.lock().unwrap_or_else(|p| p.into_inner()).get(m).cloned()) {
            s.trace_level = o.trace_level.unwrap_or(s.trace_level);
            s.trace_rate = o.trace_rate.unwrap_or(s.trace_rate);
            s.trace_count = o.trace_count.unwrap_or(s.trace_count);
            s.log_frequency = o.log_frequency.unwrap_or(s.log_frequency);
        }
        s
    }

    pub fn update(&self, model: Option<&str>, u: TraceUpdate) -> Result<TraceSettings> {
        if u.trace_file.as_ref().is_some_and(|f| f.is_some()) {
            return Err(Error::unsupported("trace file location can not be updated through network protocol"));
        }
        if let Some(Some(l)) = &u.trace_level {
            check_levels(l)?;
        }
        if let Some(Some(v)) = &u.trace_rate {
            check_number("trace_rate", v, 0)?;
        }
        if let Some(Some(v)) = &u.trace_count {
            check_number("trace_count", v, -1)?;
        }
        if let Some(Some(v)) = &u.log_frequency {
            check_number("log_frequency", v, 0)?;
        }
        match model {
            None => {
                let mut g = self.global.lock().unwrap_or_else(|p| p.into_inner());
                if let Some(Some(v)) = u.trace_level {
                    g.trace_level = v;
                }
                if let Some(Some(v)) = u.trace_rate {
                    g.trace_rate = v;
                }
                if let Some(Some(v)) = u.trace_count {
                    g.trace_count = v;
                }
                if let Some(Some(v)) = u.log_frequency {
                    g.log_frequency = v;
                }
            }
            Some(m) => {
                let mut models = self.models.lock().unwrap_or_else(|p| p.into_inner());
                let o = models.entry(m.to_string()).or_default();
                if let Some(v) = u.trace_level {
                    o.trace_level = v;
                }
                if let Some(v) = u.trace_rate {
                    o.trace_rate = v;
                }
                if let Some(v) = u.trace_count {
                    o.trace_count = v;
                }
                if let Some(v) = u.log_frequency {
                    o.log_frequency = v;
                }
            }
        }
        self.refresh();
        Ok(self.get(model))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn log_updates_validate_and_merge() {
        let l = Logging::new(0, None);
        let s =
            l.update(LogUpdate { log_verbose_level: Some(2), log_info: Some(false), ..Default::default() }).unwrap();
        assert_eq!((s.log_verbose_level, s.log_info, s.log_warning), (2, false, true));
        let e = l.update(LogUpdate { log_file: Some("/tmp/x".into()), ..Default::default() }).unwrap_err();
        assert_eq!(e.http_status(), 501);
        let e = l.update(LogUpdate { log_format: Some("json".into()), ..Default::default() }).unwrap_err();
        assert_eq!(e.message(), "invalid argument for --log_format, got: json");
        assert_eq!(l.get().log_verbose_level, 2);
    }

    #[test]
    fn sampling_follows_level_rate_and_count() {
        let t = Tracing::new(TraceSettings {
            trace_level: vec!["TIMESTAMPS".into()],
            trace_rate: "2".into(),
            trace_count: "2".into(),
            ..Default::default()
        });
        let picked: Vec<bool> = (0..8).map(|_| t.sample("m")).collect();
        assert_eq!(picked, vec![false, true, false, true, false, false, false, false]);
        assert_eq!(t.get(None).trace_count, "0");
        assert!(!Tracing::default().sample("m"), "OFF by default");
    }

    #[test]
    fn trace_overrides_fall_back_to_global() {
        let t = Tracing::default();
        let u = TraceUpdate { trace_rate: Some(Some("10".into())), ..Default::default() };
        assert_eq!(t.update(Some("m"), u).unwrap().trace_rate, "10");
        assert_eq!(t.get(None).trace_rate, "1000");
        let u = TraceUpdate { trace_level: Some(Some(vec!["TIMESTAMPS".into()])), ..Default::default() };
        t.update(None, u).unwrap();
        assert_eq!(t.get(Some("m")).trace_level, vec!["TIMESTAMPS"]);
        t.update(Some("m"), TraceUpdate { trace_rate: Some(None), ..Default::default() }).unwrap();
        assert_eq!(t.get(Some("m")).trace_rate, "1000");
        let bad = TraceUpdate { trace_level: Some(Some(vec!["OFF".into(), "TENSORS".into()])), ..Default::default() };
        assert!(t.update(None, bad).is_err());
        let bad = TraceUpdate { trace_rate: Some(Some("x".into())), ..Default::default() };
        assert_eq!(t.update(None, bad).unwrap_err().message(), "Unable to parse 'trace_rate', got: x");
        let bad = TraceUpdate { trace_count: Some(Some("-2".into())), ..Default::default() };
        assert!(t.update(None, bad).is_err());
    }
}
