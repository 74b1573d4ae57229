use std::collections::HashMap;

use clap::Parser;

use super::*;
use crate::config::Cli;

fn args(extra: &[&str]) -> ServeArgs {
    let mut argv = vec!["ferry"];
    argv.extend_from_slice(extra);
    Cli::try_parse_from(argv).unwrap().serve
}

fn resolve_with(extra: &[&str], vars: &[(&str, &str)], opt_ml: bool) -> Result<Platform, String> {
    let map: HashMap<String, String> = vars.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
    let env = |k: &str| map.get(k).cloned();
    let sagemaker_env = map.keys().any(|k| k.starts_with("SAGEMAKER_"));
    resolve(&args(extra), &env, sagemaker_env, opt_ml)
}

#[test]
fn plain_kserve_by_default() {
    let p = resolve_with(&[], &[], false).unwrap();
    assert_eq!(p.mode, Mode::KServe);
    assert!(p.http && p.grpc && p.metrics);
    assert_eq!(p.max_input_size, 64 << 20);
}

#[test]
fn vertex_from_aip_variables() {
    let vars = [
        ("AIP_MODE", "PREDICTION"),
        ("AIP_HTTP_PORT", "7080"),
        ("AIP_HEALTH_ROUTE", "/v1/endpoints/1/deployedModels/2"),
        ("AIP_PREDICT_ROUTE", "/v1/endpoints/1/deployedModels/2:predict"),
        ("AIP_STORAGE_URI", "gs://bucket/repo"),
    ];
    let p = resolve_with(&[], &vars, false).unwrap();
    assert_eq!(p.mode, Mode::Vertex);
    assert!(!p.http && !p.grpc, "KServe listeners are off on Vertex unless asked for");
    let v = p.vertex.unwrap();
    assert_eq!(v.addr.port(), 7080);
    assert_eq!(v.predict_route, "/v1/endpoints/1/deployedModels/2:predict");
    assert_eq!(p.repository.as_deref(), Some("gs://bucket/repo"));
    assert_eq!(p.max_input_size, 1_500_000);
    let p = resolve_with(&["--allow-grpc", "--http-max-input-size=10", "--vertex-ai-port=9"], &vars, false).unwrap();
    assert!(p.grpc && p.max_input_size == 10 && p.vertex.unwrap().addr.port() == 9);
}

#[test]
fn sagemaker_from_its_environment() {
    let p = resolve_with(
        &["serve"][..0],
        &[("SAGEMAKER_BIND_TO_PORT", "9090"), ("SAGEMAKER_TRITON_DEFAULT_MODEL_NAME", "m")],
        false,
    )
    .unwrap();
    assert_eq!(p.mode, Mode::SageMaker);
    let s = p.sagemaker.unwrap();
    assert_eq!((s.addr.port(), s.default_model.as_deref(), s.ping_live), (9090, Some("m"), false));
    assert_eq!(p.repository.as_deref(), Some("/opt/ml/model"));
    assert_eq!(p.max_input_size, 6 << 20);
    assert_eq!(p.emf_interval_secs, 60);
    assert!(!p.metrics && !p.grpc && !p.http);
    let mme = resolve_with(&[], &[("SAGEMAKER_MULTI_MODEL", "true")], true).unwrap();
    assert!(mme.explicit_model_control && mme.sagemaker.unwrap().ping_live && mme.repository.is_none());
    assert_eq!(resolve_with(&[], &[], true).unwrap().mode, Mode::SageMaker, "/opt/ml alone means SageMaker");
}

#[test]
fn sagemaker_extra_listeners_stay_in_the_safe_range() {
    let vars = [("SAGEMAKER_SAFE_PORT_RANGE", "23000-23999"), ("SAGEMAKER_TRITON_ALLOW_GRPC", "true")];
    let e = resolve_with(&[], &vars, false).unwrap_err();
    assert!(e.contains("cannot listen to GRPC requests at port 8001, allowed port range is [23000, 23999]"), "{e}");
    let vars = [
        ("SAGEMAKER_SAFE_PORT_RANGE", "23000-23999"),
        ("SAGEMAKER_TRITON_ALLOW_GRPC", "true"),
        ("SAGEMAKER_TRITON_GRPC_PORT", "23001"),
    ];
    let p = resolve_with(&[], &vars, false).unwrap();
    assert!(p.grpc && p.grpc_port == 23001);
}
