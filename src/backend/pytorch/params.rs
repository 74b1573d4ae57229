//! Triton's PyTorch parameters, as ferry's in-server paths (packages and TorchScript on a CPU
//! instance) take them.
use crate::{backend::MAX_THREADS, proto::inference::ModelConfig};

/// Triton's PyTorch parameters that mean nothing for a package, or on a CPU.
const JIT_ONLY: &[&str] = &["DISABLE_OPTIMIZED_EXECUTION", "ENABLE_JIT_EXECUTOR", "ENABLE_JIT_PROFILING"];
const GPU_ONLY: &[&str] = &["DISABLE_CUDNN", "ENABLE_CACHE_CLEANING"];

const FLAGS: &[&str] = &[
    "DISABLE_OPTIMIZED_EXECUTION",
    "INFERENCE_MODE",
    "DISABLE_CUDNN",
    "ENABLE_WEIGHT_SHARING",
    "ENABLE_CACHE_CLEANING",
    "ENABLE_JIT_EXECUTOR",
    "ENABLE_JIT_PROFILING",
];

#[derive(Debug, PartialEq)]
pub struct Params {
    /// `INTRA_OP_THREAD_COUNT`.
    pub threads: Option<usize>,
    /// `ENABLE_WEIGHT_SHARING`: the version's instances share one copy of the weights.
    pub share_weights: bool,
    /// `INFERENCE_MODE` (default on): run in inference mode, else only without gradients.
    pub inference_mode: bool,
}

impl Default for Params {
    fn default() -> Self {
        Params { threads: None, share_weights: false, inference_mode: true }
    }
}

fn flag(key: &str, value: &str) -> Result<bool, String> {
    match value.trim().to_ascii_lowercase().as_str() {
        "true" | "1" | "yes" | "on" => Ok(true),
        "false" | "0" | "no" | "off" => Ok(false),
        _ => Err(format!("parameter {key}: '{value}' is not true or false")),
    }
}

fn count(key: &str, value: &str) -> Result<usize, String> {
    let n: i64 = value.trim().parse().map_err(|_| format!("parameter {key}: '{value}' is not an integer"))?;
    if n < 1 || n > MAX_THREADS as i64 {
        return Err(format!("parameter {key}: {n} is not between 1 and {MAX_THREADS}"));
    }
    Ok(n as usize)
}

impl Params {
    /// The parameters of a model on a CPU instance, checked; `warn`: log the ones that do not
    /// apply (once per model).
    pub fn of(config: &ModelConfig, warn: bool) -> Result<Params, String> {
        let package = config.platform == "torch_aoti";
        let mut params = Params::default();
        let mut keys: Vec<&String> = config.parameters.keys().collect();
        keys.sort();
        for key in keys {
            let value = config.parameters[key].string_value.as_str();
            if FLAGS.contains(&key.as_str()) {
                let on = flag(key, value)?;
                match key.as_str() {
                    "ENABLE_WEIGHT_SHARING" => params.share_weights = on,
                    "INFERENCE_MODE" => params.inference_mode = on,
                    _ => {}
                }
            }
            match key.as_str() {
                "INTRA_OP_THREAD_COUNT" => params.threads = Some(count(key, value)?),
                "INTER_OP_THREAD_COUNT" => {
                    count(key, value)?;
                }
                _ => {}
            }
            let what = if package && JIT_ONLY.contains(&key.as_str()) {
                Some("an AOTInductor package")
            } else {
                GPU_ONLY.contains(&key.as_str()).then_some("a CPU instance")
            };
            if let Some(what) = what
                && warn
            {
                tracing::warn!(model = %config.name, "parameter {key} does not apply to this model ({what})");
            }
        }
        Ok(params)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(params: &[(&str, &str)]) -> ModelConfig {
        let mut c = ModelConfig { name: "m".into(), ..Default::default() };
        for (k, v) in params {
            c.parameters.insert(k.to_string(), crate::proto::inference::ModelParameter { string_value: v.to_string() });
        }
        c
    }

    #[test]
    fn parameters_are_checked() {
        assert_eq!(
            Params::of(&config(&[("INTRA_OP_THREAD_COUNT", "3"), ("ENABLE_WEIGHT_SHARING", "YES")]), false).unwrap(),
            Params { threads: Some(3), share_weights: true, inference_mode: true }
        );
        assert!(Params::of(&config(&[("INTRA_OP_THREAD_COUNT", "0")]), false).unwrap_err().contains("between 1 and"));
        assert!(Params::of(&config(&[("INTER_OP_THREAD_COUNT", "x")]), false).unwrap_err().contains("not an integer"));
        assert!(Params::of(&config(&[("INFERENCE_MODE", "maybe")]), false).unwrap_err().contains("not true or false"));
        assert!(!Params::of(&config(&[("INFERENCE_MODE", "false")]), false).unwrap().inference_mode);
        // Parameters that do not apply are accepted (and logged).
        assert_eq!(Params::of(&config(&[("DISABLE_CUDNN", "true")]), true).unwrap(), Params::default());
    }
}
