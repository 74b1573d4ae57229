//! Triton's OpenVINO parameters, checked, and what they make: the inputs' new shapes and the
//! properties the model is compiled with.
use super::{Dimension, Port, dimensions};
use crate::proto::inference::ModelConfig;

#[derive(Debug, Default)]
pub struct Params {
    pub device: String,
    pub reshape_io: bool,
    pub skip_dynamic_batch: bool,
    pub batch_padding: bool,
    hint: Option<String>,
    streams: Option<String>,
    threads: Option<usize>,
    /// Triton's `COMPILATION_NUM_THREADS`: a core-wide setting in OpenVINO (the CPU plugin
    /// refuses it per model), taken and not applied.
    pub compile_threads: Option<usize>,
    /// `INFERENCE_PRECISION_HINT` (ferry's; f32, bf16 or f16), or bf16 from Triton's `HINT_BF16`.
    precision: Option<String>,
}

impl Params {
    pub fn of(config: &ModelConfig) -> Result<Params, String> {
        let get = |k: &str| config.parameters.get(k).map(|p| p.string_value.trim()).filter(|v| !v.is_empty());
        // Triton's switches are on for YES and off for anything else.
        let yes = |k: &str| get(k).is_some_and(|v| v.eq_ignore_ascii_case("yes"));
        let count = |k: &str| -> Result<Option<usize>, String> {
            get(k)
                .map(|v| {
                    v.parse::<usize>()
                        .ok()
                        .filter(|&n| n <= super::super::MAX_THREADS)
                        .ok_or_else(|| format!("parameter {k} is '{v}'; expected 0 to {}", super::super::MAX_THREADS))
                })
                .transpose()
        };
        if let Some(path) = get("CPU_EXTENSION_PATH") {
            return Err(format!(
                "parameter CPU_EXTENSION_PATH ('{path}'): custom OpenVINO layers are not loaded by ferry"
            ));
        }
        let hint = get("PERFORMANCE_HINT").map(str::to_ascii_uppercase);
        if let Some(h) = &hint
            && !matches!(h.as_str(), "LATENCY" | "THROUGHPUT" | "CUMULATIVE_THROUGHPUT")
        {
            return Err(format!("parameter PERFORMANCE_HINT is '{h}'; expected LATENCY or THROUGHPUT"));
        }
        let streams = get("NUM_STREAMS").map(str::to_ascii_uppercase);
        if let Some(s) = &streams
            && !matches!(s.as_str(), "AUTO" | "NUMA")
            && s.parse::<u32>().ok().filter(|&n| (1..=1024).contains(&n)).is_none()
        {
            return Err(format!("parameter NUM_STREAMS is '{s}'; expected AUTO, NUMA or 1 to 1024"));
        }
        let precision = match get("INFERENCE_PRECISION_HINT").map(str::to_ascii_lowercase) {
            Some(p) if matches!(p.as_str(), "f32" | "bf16" | "f16") => Some(p),
            Some(p) => return Err(format!("parameter INFERENCE_PRECISION_HINT is '{p}'; expected f32, bf16 or f16")),
            None => yes("HINT_BF16").then(|| "bf16".to_string()),
        };
        let device = get("TARGET_DEVICE").map_or_else(|| "CPU".to_string(), str::to_ascii_uppercase);
        Ok(Params {
            device,
            reshape_io: yes("RESHAPE_IO_LAYERS"),
            skip_dynamic_batch: yes("SKIP_OV_DYNAMIC_BATCHSIZE"),
            batch_padding: yes("ENABLE_BATCH_PADDING"),
            hint,
            streams,
            threads: count("INFERENCE_NUM_THREADS")?,
            compile_threads: count("COMPILATION_NUM_THREADS")?,
            precision,
        })
    }

    /// The precision when the config names none (None: OpenVINO's own default).
    pub fn default_precision(&mut self, precision: &str) {
        self.precision.get_or_insert_with(|| precision.to_string());
    }

    /// The inputs to reshape (by index): to the config's dims with `RESHAPE_IO_LAYERS`, else (batching) the
    /// batch dimension made variable, unless `SKIP_OV_DYNAMIC_BATCHSIZE`.
    pub fn reshapes(&self, config: &ModelConfig, inputs: &[Port]) -> Result<Vec<(usize, Vec<Dimension>)>, String> {
        let batching = config.max_batch_size > 0;
        let mut out = Vec::new();
        if self.reshape_io {
            for i in &config.input {
                let (index, port) = inputs.iter().enumerate().find(|(_, p)| p.name == i.name).ok_or_else(|| {
                    let have: Vec<&str> = inputs.iter().map(|p| p.name.as_str()).collect();
                    format!(
                        "configuration input '{}' is not an input of the model (its inputs: {})",
                        i.name,
                        have.join(", ")
                    )
                })?;
                let dims = i.reshape.as_ref().map_or(&i.dims, |r| &r.shape);
                if let Some(d) = dims.iter().find(|&&d| d < -1 || d == 0) {
                    return Err(format!("input '{}': RESHAPE_IO_LAYERS takes dims of -1 or above 0, not {d}", i.name));
                }
                let mut shape = dimensions(dims);
                if batching {
                    let batch = if self.skip_dynamic_batch {
                        port.dims.first().copied().unwrap_or(Dimension::DYNAMIC)
                    } else {
                        Dimension::DYNAMIC
                    };
                    shape.insert(0, batch);
                }
                out.push((index, shape));
            }
        } else if batching && !self.skip_dynamic_batch {
            for (index, p) in inputs.iter().enumerate().filter(|(_, p)| p.dims.first().is_some_and(|d| d.size() != -1))
            {
                let mut shape = p.dims.clone();
                shape[0] = Dimension::DYNAMIC;
                out.push((index, shape));
            }
        }
        Ok(out)
    }

    /// The properties to compile with; the threads default to the instance's share of the
    /// cores, and one stream (an instance runs one batch at a time).
    pub fn properties(&self, share: usize) -> Vec<(String, String)> {
        let mut p = vec![
            ("PERFORMANCE_HINT".to_string(), self.hint.clone().unwrap_or_else(|| "LATENCY".into())),
            ("NUM_STREAMS".to_string(), self.streams.clone().unwrap_or_else(|| "1".into())),
        ];
        if self.device == "CPU" {
            let threads = self.threads.filter(|&n| n > 0).unwrap_or(share.max(1));
            p.push(("INFERENCE_NUM_THREADS".into(), threads.to_string()));
        }
        if let Some(precision) = &self.precision {
            p.push(("INFERENCE_PRECISION_HINT".into(), precision.clone()));
        }
        p
    }

    /// Whether OpenVINO will choose bf16 by itself on a CPU whose bfloat16 is AVX-512's alone
    /// (`cpu_flags`: /proc/cpuinfo's flags, such as AMD Zen 4's): OpenVINO's default there, and
    /// measured both much slower than f32 (a CNN) and much faster (a small MLP) on one such CPU.
    pub fn bf16_without_amx(&self, cpu_flags: &str) -> bool {
        let has = |flag: &str| cpu_flags.split_ascii_whitespace().any(|f| f == flag);
        self.precision.is_none() && self.device == "CPU" && has("avx512_bf16") && !has("amx_bf16")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proto::inference::{ModelInput, ModelParameter};

    fn config(params: &[(&str, &str)], max_batch_size: i32) -> ModelConfig {
        let mut c = ModelConfig { name: "m".into(), max_batch_size, ..Default::default() };
        for (k, v) in params {
            c.parameters.insert((*k).into(), ModelParameter { string_value: (*v).into() });
        }
        c.input.push(ModelInput { name: "x".into(), dims: vec![3, -1], ..Default::default() });
        c
    }

    fn port(dims: &[i64]) -> Port {
        Port { name: "x".into(), datatype: None, element: 0, dims: dimensions(dims), ranked: true }
    }

    #[test]
    fn a_batching_models_batch_dimension_becomes_variable() {
        let c = config(&[], 8);
        let p = Params::of(&c).unwrap();
        let r = p.reshapes(&c, &[port(&[1, 3, 5]), port(&[-1, 3, 5])]).unwrap();
        assert_eq!(r.len(), 1);
        assert_eq!(r[0].0, 0);
        assert_eq!(r[0].1, vec![Dimension::DYNAMIC, Dimension::fixed(3), Dimension::fixed(5)]);
        let skip = config(&[("SKIP_OV_DYNAMIC_BATCHSIZE", "yes")], 8);
        assert!(Params::of(&skip).unwrap().reshapes(&skip, &[port(&[1, 3, 5])]).unwrap().is_empty());
        assert!(Params::of(&config(&[], 0)).unwrap().reshapes(&config(&[], 0), &[port(&[1, 3])]).unwrap().is_empty());
    }

    #[test]
    fn reshape_io_layers_takes_the_configs_dims() {
        let c = config(&[("RESHAPE_IO_LAYERS", "YES")], 4);
        let r = Params::of(&c).unwrap().reshapes(&c, &[port(&[1, 3, 224])]).unwrap();
        assert_eq!(r[0].1, vec![Dimension::DYNAMIC, Dimension::fixed(3), Dimension::DYNAMIC]);
    }

    #[test]
    fn bad_values_name_the_parameter() {
        for (k, v, want) in [
            ("PERFORMANCE_HINT", "FAST", "PERFORMANCE_HINT is 'FAST'"),
            ("NUM_STREAMS", "0", "NUM_STREAMS is '0'"),
            ("INFERENCE_NUM_THREADS", "-2", "INFERENCE_NUM_THREADS is '-2'"),
            ("CPU_EXTENSION_PATH", "/x.so", "CPU_EXTENSION_PATH"),
            ("INFERENCE_PRECISION_HINT", "int4", "INFERENCE_PRECISION_HINT is 'int4'"),
        ] {
            let e = Params::of(&config(&[(k, v)], 0)).unwrap_err();
            assert!(e.contains(want), "{e}");
        }
    }

    #[test]
    fn properties_default_to_one_stream_and_the_instances_share() {
        let p = Params::of(&config(&[("HINT_BF16", "YES")], 0)).unwrap().properties(3);
        assert!(p.contains(&("NUM_STREAMS".into(), "1".into())));
        assert!(p.contains(&("INFERENCE_NUM_THREADS".into(), "3".into())));
        assert!(p.contains(&("INFERENCE_PRECISION_HINT".into(), "bf16".into())));
        let c =
            config(&[("NUM_STREAMS", "auto"), ("INFERENCE_NUM_THREADS", "2"), ("INFERENCE_PRECISION_HINT", "F32")], 0);
        let p = Params::of(&c).unwrap().properties(3);
        assert!(p.contains(&("INFERENCE_PRECISION_HINT".into(), "f32".into())));
        assert!(p.contains(&("NUM_STREAMS".into(), "AUTO".into())));
        assert!(p.contains(&("INFERENCE_NUM_THREADS".into(), "2".into())));
    }

    #[test]
    fn bf16_without_amx_only_where_openvino_chooses_the_precision() {
        let (zen4, spr, old) = ("fpu avx512f avx512_bf16 avx512_vnni", "avx512_bf16 amx_bf16 amx_tile", "avx2 avx512f");
        let default = Params::of(&config(&[], 0)).unwrap();
        assert!(default.bf16_without_amx(zen4));
        assert!(!default.bf16_without_amx(spr));
        assert!(!default.bf16_without_amx(old));
        assert!(!default.bf16_without_amx("avx512_bf16x"));
        for named in [("INFERENCE_PRECISION_HINT", "f32"), ("HINT_BF16", "YES"), ("TARGET_DEVICE", "GPU")] {
            assert!(!Params::of(&config(&[named], 0)).unwrap().bf16_without_amx(zen4), "{named:?}");
        }
    }
}
