//! The non-inference messages: statistics, repository index and load parameters, trace and log
//! settings, translated to and from the engine's types.
use std::collections::HashMap;

use crate::{
    engine::VersionStats,
    error::{Error, Result},
    proto::inference::{
        InferBatchStatistics, InferResponseStatistics, InferStatistics, LogSettingsRequest, LogSettingsResponse,
        MemoryUsage, ModelRepositoryParameter, ModelStatistics, RepositoryIndexResponse, StatisticDuration,
        TraceSettingRequest, TraceSettingResponse, log_settings_request, log_settings_response,
        model_repository_parameter::ParameterChoice as RepoParam, repository_index_response::ModelIndex,
        trace_setting_response,
    },
    repository::{control::LoadRequest, registry::IndexEntry},
    settings::{LogSettings, LogUpdate, TraceSettings, TraceUpdate},
    stats::Tally,
};

fn duration(t: &Tally) -> Option<StatisticDuration> {
    Some(StatisticDuration { count: t.count, ns: t.ns })
}

pub fn statistics(all: &[VersionStats]) -> Vec<ModelStatistics> {
    all.iter()
        .map(|v| {
            let s = &v.stats;
            ModelStatistics {
                name: v.name.clone(),
                version: v.version.to_string(),
                last_inference: s.last_inference_ms,
                inference_count: s.inference_count,
                execution_count: s.execution_count,
                inference_stats: Some(InferStatistics {
                    success: duration(&s.success),
                    fail: duration(&s.fail),
                    queue: duration(&s.queue),
                    compute_input: duration(&s.compute_input),
                    compute_infer: duration(&s.compute_infer),
                    compute_output: duration(&s.compute_output),
                    cache_hit: duration(&s.cache_hit),
                    cache_miss: duration(&s.cache_miss),
                }),
                batch_stats: s
                    .batches
                    .iter()
                    .map(|(size, b)| InferBatchStatistics {
                        batch_size: *size,
                        compute_input: duration(&b.compute_input),
                        compute_infer: duration(&b.compute_infer),
                        compute_output: duration(&b.compute_output),
                    })
                    .collect(),
                memory_usage: s
                    .memory
                    .iter()
                    .map(|m| MemoryUsage { r#type: m.kind.to_string(), id: m.id, byte_size: m.bytes })
                    .collect(),
                response_stats: s
                    .responses
                    .iter()
                    .map(|(i, r)| {
                        let stats = InferResponseStatistics {
                            compute_infer: duration(&r.compute_infer),
                            compute_output: duration(&r.compute_output),
                            success: duration(&r.success),
                            fail: duration(&r.fail),
                            empty_response: duration(&r.empty_response),
                            cancel: duration(&r.cancel),
                        };
                        (i.to_string(), stats)
                    })
                    .collect(),
            }
        })
        .collect()
}

pub fn index(entries: &[IndexEntry]) -> RepositoryIndexResponse {
    RepositoryIndexResponse {
        models: entries
            .iter()
            .map(|e| ModelIndex {
                name: e.name.clone(),
                version: e.version.map(|v| v.to_string()).unwrap_or_default(),
                state: if e.version.is_some() || !e.reason.is_empty() {
                    e.state.as_str().to_string()
                } else {
                    String::new()
                },
                reason: e.reason.clone(),
            })
            .collect(),
    }
}

/// `config` must be a string_param and `file:<path>` a bytes_param (raw bytes, unlike HTTP).
pub fn load_request(params: HashMap<String, ModelRepositoryParameter>) -> Result<LoadRequest> {
    let mut req = LoadRequest::default();
    for (k, p) in params {
        match (k.as_str(), p.parameter_choice) {
            ("config", Some(RepoParam::StringParam(s))) => req.config = Some(s),
            ("config", _) => {
                return Err(Error::invalid("invalid value type for load parameter 'config', expected string_param."));
            }
            (f, Some(RepoParam::BytesParam(b))) if f.starts_with("file:") => req.files.push((f[5..].to_string(), b)),
            (f, _) if f.starts_with("file:") => {
                return Err(Error::invalid(format!(
                    "invalid value type for load parameter '{f}', expected bytes_param."
                )));
            }
            (other, _) => return Err(Error::invalid(format!("Unrecognized load parameter '{other}'"))),
        }
    }
    Ok(req)
}

pub fn unload_dependents(params: &HashMap<String, ModelRepositoryParameter>) -> Result<bool> {
    match params.get("unload_dependents").map(|p| &p.parameter_choice) {
        None => Ok(false),
        Some(Some(RepoParam::BoolParam(b))) => Ok(*b),
        Some(_) => Err(Error::invalid("invalid value type for 'unload_dependents' parameter, expected bool_param.")),
    }
}

/// An entry with no values clears a per-model setting back to the global one.
pub fn trace_update(req: &TraceSettingRequest) -> Result<TraceUpdate> {
    let mut u = TraceUpdate::default();
    for (k, v) in &req.settings {
        let first = v.value.first().cloned();
        match k.as_str() {
            "trace_level" => u.trace_level = Some((!v.value.is_empty()).then(|| v.value.clone())),
            "trace_rate" => u.trace_rate = Some(first),
            "trace_count" => u.trace_count = Some(first),
            "log_frequency" => u.log_frequency = Some(first),
            "trace_file" => u.trace_file = Some(first),
            other => return Err(Error::invalid(format!("unknown trace setting '{other}'"))),
        }
    }
    Ok(u)
}

pub fn trace_response(t: &TraceSettings) -> TraceSettingResponse {
    let one = |v: &str| trace_setting_response::SettingValue { value: vec![v.to_string()] };
    let mut settings = HashMap::new();
    settings.insert("trace_level".into(), trace_setting_response::SettingValue { value: t.trace_level.clone() });
    settings.insert("trace_rate".into(), one(&t.trace_rate));
    settings.insert("trace_count".into(), one(&t.trace_count));
    settings.insert("log_frequency".into(), one(&t.log_frequency));
    settings.insert("trace_file".into(), one(&t.trace_file));
    settings.insert("trace_mode".into(), one(&t.trace_mode));
    TraceSettingResponse { settings }
}

pub fn log_update(req: &LogSettingsRequest) -> Result<LogUpdate> {
    use log_settings_request::setting_value::ParameterChoice as P;
    let mut u = LogUpdate::default();
    for (k, v) in &req.settings {
        let wrong = |want: &str| Error::invalid(format!("invalid value type for '{k}' log setting, expected {want}."));
        match (k.as_str(), &v.parameter_choice) {
            (_, None) => {}
            ("log_file", Some(P::StringParam(s))) => u.log_file = Some(s.clone()),
            ("log_info", Some(P::BoolParam(b))) => u.log_info = Some(*b),
            ("log_warning", Some(P::BoolParam(b))) => u.log_warning = Some(*b),
            ("log_error", Some(P::BoolParam(b))) => u.log_error = Some(*b),
            ("log_verbose_level", Some(P::Uint32Param(n))) => u.log_verbose_level = Some(*n),
            ("log_format", Some(P::StringParam(s))) => u.log_format = Some(s.clone()),
            ("log_file" | "log_format", _) => return Err(wrong("string_param")),
            ("log_info" | "log_warning" | "log_error", _) => return Err(wrong("bool_param")),
            ("log_verbose_level", _) => return Err(wrong("uint32_param")),
            (other, _) => return Err(Error::invalid(format!("unknown log setting '{other}'"))),
        }
    }
    Ok(u)
}

pub fn log_response(l: &LogSettings) -> LogSettingsResponse {
    use log_settings_response::{SettingValue, setting_value::ParameterChoice as P};
    let v = |p: P| SettingValue { parameter_choice: Some(p) };
    let mut settings = HashMap::new();
    settings.insert("log_file".into(), v(P::StringParam(l.log_file.clone())));
    settings.insert("log_info".into(), v(P::BoolParam(l.log_info)));
    settings.insert("log_warning".into(), v(P::BoolParam(l.log_warning)));
    settings.insert("log_error".into(), v(P::BoolParam(l.log_error)));
    settings.insert("log_verbose_level".into(), v(P::Uint32Param(l.log_verbose_level)));
    settings.insert("log_format".into(), v(P::StringParam(l.log_format.clone())));
    LogSettingsResponse { settings }
}
