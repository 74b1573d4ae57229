//! What an ONNX model's config asks of ONNX Runtime's execution providers, read as Triton's
//! ONNX Runtime backend reads it: `optimization { execution_accelerators { ... } }` (TensorRT and
//! CUDA on GPU instances, OpenVINO on CPU ones), the CUDA `parameters` keys
//! (`cudnn_conv_algo_search`, `gpu_mem_limit`, `arena_extend_strategy`,
//! `do_copy_in_default_stream`) and `optimization { cuda { graphs: true } }`. The result is
//! ONNX Runtime's own option names and values; whatever cannot be applied becomes a warning that
//! names it, never silence. Applying the plan is the ONNX backend's job.
use std::path::Path;

use crate::proto::inference::ModelConfig;

/// Provider options as ONNX Runtime names them.
pub type Options = Vec<(String, String)>;

#[derive(Debug, Default, Clone, PartialEq)]
pub struct Plan {
    pub cuda: Options,
    /// TensorRT before CUDA, when asked for.
    pub tensorrt: Option<Options>,
    pub openvino: Option<Options>,
    pub warnings: Vec<String>,
}

/// CUDA provider keys passed through from a `cuda` accelerator's parameters.
const CUDA_KEYS: &[&str] = &[
    "cudnn_conv_use_max_workspace",
    "cudnn_conv1d_pad_to_nc1d",
    "enable_cuda_graph",
    "use_tf32",
    "prefer_nhwc",
    "use_ep_level_unified_stream",
    "tunable_op_enable",
    "tunable_op_tuning_enable",
];

/// Triton's model `parameters` for the CUDA provider, with their values in ONNX Runtime's terms.
fn cuda_parameter(key: &str, value: &str) -> Option<Result<(String, String), String>> {
    let mapped = match key {
        "cudnn_conv_algo_search" => match value {
            "0" => Ok("EXHAUSTIVE"),
            "1" => Ok("HEURISTIC"),
            "2" => Ok("DEFAULT"),
            _ => Err("0 (exhaustive), 1 (heuristic) or 2 (default)"),
        }
        .map(str::to_string),
        "arena_extend_strategy" => match value {
            "0" => Ok("kNextPowerOfTwo"),
            "1" => Ok("kSameAsRequested"),
            _ => Err("0 (next power of two) or 1 (same as requested)"),
        }
        .map(str::to_string),
        "gpu_mem_limit" => value.parse::<u64>().map(|v| v.to_string()).map_err(|_| "a number of bytes"),
        "do_copy_in_default_stream" => match value {
            "0" | "1" => Ok(value.to_string()),
            "true" => Ok("1".into()),
            "false" => Ok("0".into()),
            _ => Err("0 or 1"),
        },
        _ => return None,
    };
    Some(
        mapped
            .map(|v| (key.to_string(), v))
            .map_err(|allowed| format!("parameter '{key}' = '{value}' is not valid (allowed: {allowed}); ignored")),
    )
}

/// TensorRT parameters as Triton's ONNX Runtime backend names them.
fn tensorrt_parameter(key: &str, value: &str) -> Result<Vec<(String, String)>, String> {
    let flag = |v: &str| matches!(v, "1" | "true" | "True");
    Ok(match key {
        "precision_mode" => match value {
            "FP32" => vec![],
            "FP16" => vec![("trt_fp16_enable".into(), "1".into())],
            "INT8" => vec![("trt_int8_enable".into(), "1".into()), ("trt_fp16_enable".into(), "1".into())],
            _ => return Err(format!("tensorrt precision_mode '{value}' is not FP32, FP16 or INT8; ignored")),
        },
        "max_workspace_size_bytes" => match value.parse::<u64>() {
            Ok(v) => vec![("trt_max_workspace_size".into(), v.to_string())],
            Err(_) => return Err(format!("tensorrt max_workspace_size_bytes '{value}' is not a number; ignored")),
        },
        "minimum_segment_size" => vec![("trt_min_subgraph_size".into(), value.to_string())],
        "trt_engine_cache_enable" => vec![("trt_engine_cache_enable".into(), (flag(value) as u8).to_string())],
        "trt_engine_cache_path" => vec![("trt_engine_cache_path".into(), value.to_string())],
        "trt_build_heuristics_enable" | "trt_sparsity_enable" | "trt_timing_cache_enable" => {
            vec![(key.to_string(), (flag(value) as u8).to_string())]
        }
        "trt_builder_optimization_level" | "trt_timing_cache_path" => vec![(key.to_string(), value.to_string())],
        _ => return Err(format!("tensorrt parameter '{key}' is not one ferry applies; ignored")),
    })
}

/// The plan for one instance of `config` (`gpu`: a KIND_GPU instance). `engine_cache`: where
/// TensorRT engines are kept unless the config says otherwise.
pub fn plan(config: &ModelConfig, gpu: bool, engine_cache: &Path) -> Plan {
    let mut plan = Plan::default();
    let accelerators = config.optimization.as_ref().and_then(|o| o.execution_accelerators.as_ref());
    let gpu_accelerators = accelerators.map(|a| a.gpu_execution_accelerator.as_slice()).unwrap_or_default();
    let cpu_accelerators = accelerators.map(|a| a.cpu_execution_accelerator.as_slice()).unwrap_or_default();
    let mut cuda_params: Vec<&str> = Vec::new();
    for (key, value) in &config.parameters {
        match cuda_parameter(key, &value.string_value) {
            Some(Ok(option)) => {
                cuda_params.push(key);
                plan.cuda.push(option);
            }
            Some(Err(warning)) => plan.warnings.push(warning),
            None => {}
        }
    }
    let graphs = config.optimization.as_ref().and_then(|o| o.cuda.as_ref()).is_some_and(|c| c.graphs);
    if !gpu {
        if !gpu_accelerators.is_empty() || !cuda_params.is_empty() || graphs {
            let mut named: Vec<String> =
                gpu_accelerators.iter().map(|a| format!("gpu_execution_accelerator '{}'", a.name)).collect();
            named.extend(cuda_params.iter().map(|k| format!("parameter '{k}'")));
            if graphs {
                named.push("optimization.cuda.graphs".into());
            }
            plan.warnings.push(format!("{} apply to KIND_GPU instances only; ignored on the CPU", named.join(", ")));
            plan.cuda.clear();
        }
        for a in cpu_accelerators {
            match a.name.as_str() {
                "openvino" => plan.openvino = Some(a.parameters.iter().map(|(k, v)| (k.clone(), v.clone())).collect()),
                other => plan.warnings.push(format!(
                    "cpu_execution_accelerator '{other}' is not one ferry runs (openvino is); running on ONNX Runtime's CPU provider"
                )),
            }
        }
        return plan;
    }
    for a in cpu_accelerators {
        plan.warnings.push(format!(
            "cpu_execution_accelerator '{}' applies to KIND_CPU instances only; ignored on the GPU",
            a.name
        ));
    }
    for a in gpu_accelerators {
        match a.name.as_str() {
            "tensorrt" => {
                let mut options: Options = vec![
                    ("trt_engine_cache_enable".into(), "1".into()),
                    ("trt_engine_cache_path".into(), engine_cache.join(&config.name).display().to_string()),
                ];
                let mut keys: Vec<&String> = a.parameters.keys().collect();
                keys.sort();
                for key in keys {
                    match tensorrt_parameter(key, &a.parameters[key]) {
                        Ok(set) => {
                            for (k, v) in set {
                                options.retain(|(have, _)| *have != k);
                                options.push((k, v));
                            }
                        }
                        Err(warning) => plan.warnings.push(warning),
                    }
                }
                plan.tensorrt = Some(options);
            }
            "cuda" => {
                let mut keys: Vec<&String> = a.parameters.keys().collect();
                keys.sort();
                for key in keys {
                    if CUDA_KEYS.contains(&key.as_str()) {
                        plan.cuda.push((key.clone(), a.parameters[key].clone()));
                    } else {
                        plan.warnings
                            .push(format!("cuda accelerator parameter '{key}' is not one ferry applies; ignored"));
                    }
                }
            }
            other => plan.warnings.push(format!(
                "gpu_execution_accelerator '{other}' is not one ferry runs (tensorrt and cuda are); running on CUDA"
            )),
        }
    }
    if graphs {
        let fixed = config.max_batch_size == 0 && config.input.iter().all(|i| i.dims.iter().all(|&d| d > 0));
        if fixed {
            plan.cuda.push(("enable_cuda_graph".into(), "1".into()));
        } else {
            plan.warnings.push(
                "optimization.cuda.graphs needs fixed input shapes (max_batch_size 0, no -1 dims); not applied".into(),
            );
        }
    }
    plan
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proto::pbtxt::parse;

    fn config(extra: &str) -> ModelConfig {
        parse(&format!(
            r#"name: "m" backend: "onnxruntime" max_batch_size: 0
input [ {{ name: "x" data_type: TYPE_FP32 dims: [ 3, 224, 224 ] }} ]
output [ {{ name: "y" data_type: TYPE_FP32 dims: [ 1000 ] }} ]
{extra}"#
        ))
        .unwrap()
    }

    fn has(options: &Options, key: &str, value: &str) -> bool {
        options.iter().any(|(k, v)| k == key && v == value)
    }

    #[test]
    fn tensorrt_with_precision_workspace_and_an_engine_cache() {
        let c = config(
            r#"optimization { execution_accelerators { gpu_execution_accelerator [ { name: "tensorrt"
  parameters { key: "precision_mode" value: "FP16" }
  parameters { key: "max_workspace_size_bytes" value: "1073741824" }
  parameters { key: "bogus" value: "1" } } ] } }"#,
        );
        let p = plan(&c, true, Path::new("/cache/tensorrt"));
        let trt = p.tensorrt.unwrap();
        assert!(has(&trt, "trt_fp16_enable", "1"));
        assert!(has(&trt, "trt_max_workspace_size", "1073741824"));
        assert!(has(&trt, "trt_engine_cache_enable", "1"));
        assert!(has(&trt, "trt_engine_cache_path", "/cache/tensorrt/m"));
        assert_eq!(p.warnings, vec!["tensorrt parameter 'bogus' is not one ferry applies; ignored"]);
    }

    #[test]
    fn cuda_parameters_in_onnx_runtime_terms() {
        let c = config(
            r#"parameters [ { key: "cudnn_conv_algo_search" value { string_value: "1" } },
  { key: "gpu_mem_limit" value { string_value: "4294967296" } },
  { key: "arena_extend_strategy" value { string_value: "1" } },
  { key: "do_copy_in_default_stream" value { string_value: "0" } },
  { key: "intra_op_thread_count" value { string_value: "2" } } ]
optimization { cuda { graphs: true } }"#,
        );
        let p = plan(&c, true, Path::new("/c"));
        for (k, v) in [
            ("cudnn_conv_algo_search", "HEURISTIC"),
            ("gpu_mem_limit", "4294967296"),
            ("arena_extend_strategy", "kSameAsRequested"),
            ("do_copy_in_default_stream", "0"),
            ("enable_cuda_graph", "1"),
        ] {
            assert!(has(&p.cuda, k, v), "{k}={v} in {:?}", p.cuda);
        }
        assert!(p.warnings.is_empty(), "{:?}", p.warnings);
        let bad = config(r#"parameters [ { key: "cudnn_conv_algo_search" value { string_value: "fast" } } ]"#);
        assert!(
            plan(&bad, true, Path::new("/c")).warnings[0].contains("'cudnn_conv_algo_search' = 'fast' is not valid")
        );
    }

    #[test]
    fn gpu_options_on_a_cpu_instance_are_named_and_ignored() {
        let c = config(
            r#"parameters [ { key: "gpu_mem_limit" value { string_value: "1000" } } ]
optimization { execution_accelerators { gpu_execution_accelerator [ { name: "tensorrt" } ]
  cpu_execution_accelerator [ { name: "openvino" }, { name: "dnnl" } ] } }"#,
        );
        let p = plan(&c, false, Path::new("/c"));
        assert!(p.cuda.is_empty() && p.tensorrt.is_none());
        assert_eq!(p.openvino, Some(vec![]));
        assert_eq!(p.warnings.len(), 2, "{:?}", p.warnings);
        assert!(
            p.warnings[0].contains("gpu_execution_accelerator 'tensorrt', parameter 'gpu_mem_limit' apply to KIND_GPU")
        );
        assert!(p.warnings[1].contains("cpu_execution_accelerator 'dnnl'"));
    }

    #[test]
    fn cuda_graphs_need_fixed_shapes() {
        let mut c = config("optimization { cuda { graphs: true } }");
        c.max_batch_size = 8;
        let p = plan(&c, true, Path::new("/c"));
        assert!(p.cuda.is_empty());
        assert!(p.warnings[0].contains("needs fixed input shapes"));
    }
}
