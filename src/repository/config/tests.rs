use super::*;
use crate::backend::TensorInfo;

fn info(name: &str, dt: DataType, shape: &[i64]) -> TensorInfo {
    TensorInfo { name: name.into(), datatype: Some(dt), shape: shape.to_vec() }
}

fn onnx_io() -> ModelIo {
    ModelIo {
        inputs: vec![info("x", DataType::Fp32, &[-1, 16]), info("ids", DataType::Int64, &[-1])],
        outputs: vec![info("y", DataType::Fp32, &[-1, 16])],
    }
}

fn dir_with_version(name: &str) -> tempfile::TempDir {
    let root = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(root.path().join(name).join("1")).unwrap();
    std::fs::write(root.path().join(name).join("1/model.onnx"), b"").unwrap();
    root
}

#[test]
fn fills_onnx_backend_from_the_file_name() {
    let root = dir_with_version("m");
    let mut cfg = ModelConfig::default();
    fill(&mut cfg, &root.path().join("m"), "m").unwrap();
    assert_eq!(
        (cfg.name.as_str(), cfg.backend.as_str(), cfg.platform.as_str()),
        ("m", "onnxruntime", "onnxruntime_onnx")
    );
    assert_eq!(cfg.default_model_filename, "model.onnx");
}

#[test]
fn unsupported_platforms_and_backends_are_named_with_a_way_forward() {
    let root = dir_with_version("m");
    for (platform, backend, want) in [
        (
            "tensorrt_plan",
            "",
            "platform 'tensorrt_plan' is not served by ferry (run the ONNX model with ONNX Runtime's TensorRT",
        ),
        ("caffe2_netdef", "", "platform 'caffe2_netdef' is not served by ferry"),
        ("", "dali", "backend 'dali' is not served by ferry"),
    ] {
        let mut cfg = ModelConfig { platform: platform.into(), backend: backend.into(), ..Default::default() };
        let e = fill(&mut cfg, &root.path().join("m"), "m").unwrap_err();
        assert!(e.contains(want), "{platform}/{backend}: {e}");
    }
}

#[test]
fn a_fil_models_file_follows_its_model_type() {
    let root = dir_with_version("m");
    for (model_type, file) in [
        (None, "xgboost.model"),
        (Some("xgboost_json"), "xgboost.json"),
        (Some("xgboost_ubj"), "xgboost.ubj"),
        (Some("lightgbm"), "model.txt"),
    ] {
        let mut cfg = ModelConfig { backend: "fil".into(), ..Default::default() };
        if let Some(t) = model_type {
            cfg.parameters
                .insert("model_type".into(), crate::proto::inference::ModelParameter { string_value: t.into() });
        }
        fill(&mut cfg, &root.path().join("m"), "m").unwrap();
        assert_eq!(cfg.default_model_filename, file, "{model_type:?}");
    }
    let mut cfg =
        ModelConfig { backend: "fil".into(), default_model_filename: "forest.json".into(), ..Default::default() };
    cfg.parameters
        .insert("model_type".into(), crate::proto::inference::ModelParameter { string_value: "xgboost_json".into() });
    fill(&mut cfg, &root.path().join("m"), "m").unwrap();
    assert_eq!(cfg.default_model_filename, "forest.json");
    cfg.parameters
        .insert("model_type".into(), crate::proto::inference::ModelParameter { string_value: "sklearn".into() });
    let e = fill(&mut cfg, &root.path().join("m"), "m").unwrap_err();
    assert!(e.contains("model_type is 'sklearn'"), "{e}");
}

#[test]
fn name_must_match_directory() {
    let root = dir_with_version("m");
    let mut cfg = ModelConfig { name: "other".into(), ..Default::default() };
    let err = fill(&mut cfg, &root.path().join("m"), "m").unwrap_err();
    assert!(err.contains("directory name must equal model name"), "{err}");
}

#[test]
fn platform_backend_pair_and_missing_backend() {
    let root = tempfile::tempdir().unwrap();
    let mut cfg = ModelConfig { backend: "onnxruntime".into(), platform: "tensorrt_plan".into(), ..Default::default() };
    assert!(fill(&mut cfg, root.path(), "").unwrap_err().contains("unexpected 'platform' and 'backend' pair"));
    let mut cfg = ModelConfig::default();
    assert!(fill(&mut cfg, root.path(), "").unwrap_err().contains("must specify 'platform' or 'backend'"));
}

#[test]
fn completes_a_batchable_model() {
    let mut cfg = ModelConfig { name: "m".into(), ..Default::default() };
    complete(&mut cfg, &onnx_io(), 4).unwrap();
    assert_eq!(cfg.max_batch_size, 4);
    assert!(matches!(cfg.scheduling_choice, Some(SchedulingChoice::DynamicBatching(_))));
    assert_eq!(cfg.input[0].dims, vec![16]);
    // A rank-1 input becomes a [1] item with an empty reshape.
    assert_eq!(cfg.input[1].dims, vec![1]);
    assert_eq!(cfg.input[1].reshape, Some(ModelTensorReshape { shape: vec![] }));
    normalize(&mut cfg);
    validate(&cfg).unwrap();
    check_against_model(&cfg, &onnx_io()).unwrap();
    match &cfg.scheduling_choice {
        Some(SchedulingChoice::DynamicBatching(db)) => assert_eq!(db.preferred_batch_size, vec![4]),
        other => panic!("{other:?}"),
    }
}

#[test]
fn fixed_batch_model_with_max_batch_size_fails() {
    let io =
        ModelIo { inputs: vec![info("x", DataType::Fp32, &[3, 2])], outputs: vec![info("y", DataType::Fp32, &[3, 2])] };
    let mut cfg = ModelConfig { name: "m".into(), ..Default::default() };
    complete(&mut cfg, &io, 4).unwrap();
    assert_eq!(cfg.max_batch_size, 0);
    assert_eq!(cfg.input[0].dims, vec![3, 2]);
    let mut cfg = ModelConfig { name: "m".into(), max_batch_size: 8, ..Default::default() };
    assert!(complete(&mut cfg, &io, 4).unwrap_err().contains("does not support batching"));
}

#[test]
fn user_parts_are_kept() {
    let mut cfg = ModelConfig {
        name: "m".into(),
        max_batch_size: 2,
        input: vec![ModelInput { name: "x".into(), data_type: 11, dims: vec![16], ..Default::default() }],
        ..Default::default()
    };
    complete(&mut cfg, &onnx_io(), 4).unwrap();
    assert_eq!(cfg.max_batch_size, 2);
    assert_eq!(cfg.input.len(), 1);
    assert_eq!(cfg.output.len(), 1);
}

#[test]
fn normalize_fills_defaults() {
    let mut cfg = ModelConfig { name: "m".into(), backend: "onnxruntime".into(), ..Default::default() };
    normalize_with(&mut cfg, &[]);
    assert_eq!(cfg.instance_group.len(), 1);
    assert_eq!(cfg.instance_group[0].name, "m");
    assert_eq!(cfg.instance_group[0].count, 2);
    assert_eq!(cfg.instance_group[0].kind, Kind::Cpu as i32);
    assert!(matches!(
        cfg.version_policy.unwrap().policy_choice,
        Some(model_version_policy::PolicyChoice::Latest(model_version_policy::Latest { num_versions: 1 }))
    ));
}

#[test]
fn kind_auto_runs_onnx_models_on_every_visible_gpu() {
    let auto = |backend: &str| ModelConfig { name: "m".into(), backend: backend.into(), ..Default::default() };
    let mut cfg = auto("onnxruntime");
    normalize_with(&mut cfg, &[0, 1]);
    let g = &cfg.instance_group[0];
    assert_eq!((g.kind, g.gpus.clone(), g.count), (Kind::Gpu as i32, vec![0, 1], 1));
    // Other backends, and any backend without a GPU, stay on the CPU.
    let mut cfg = auto("python");
    normalize_with(&mut cfg, &[0]);
    assert_eq!(cfg.instance_group[0].kind, Kind::Cpu as i32);
    let mut cfg = auto("onnxruntime");
    normalize_with(&mut cfg, &[]);
    assert_eq!((cfg.instance_group[0].kind, cfg.instance_group[0].count), (Kind::Cpu as i32, 2));
}

#[test]
fn validation_names_the_field() {
    let good = || ModelConfig {
        name: "m".into(),
        max_batch_size: 8,
        input: vec![ModelInput { name: "x".into(), data_type: 11, dims: vec![4], ..Default::default() }],
        output: vec![ModelOutput { name: "y".into(), data_type: 11, dims: vec![4], ..Default::default() }],
        ..Default::default()
    };
    validate(&good()).unwrap();
    let mut cfg = good();
    cfg.input[0].dims = vec![0];
    assert!(validate(&cfg).unwrap_err().contains("input 'x' dims [0]"));
    let mut cfg = good();
    cfg.output[0].data_type = 0;
    assert!(validate(&cfg).unwrap_err().contains("output 'y' must specify a valid 'data_type'"));
    let mut cfg = good();
    cfg.scheduling_choice = Some(SchedulingChoice::DynamicBatching(ModelDynamicBatching {
        preferred_batch_size: vec![16],
        ..Default::default()
    }));
    assert!(validate(&cfg).unwrap_err().contains("preferred_batch_size 16"));
    let mut cfg = good();
    cfg.input[0].reshape = Some(ModelTensorReshape { shape: vec![2, 3] });
    assert!(validate(&cfg).unwrap_err().contains("different size for dims [4] and reshape [2,3]"));
}

#[test]
fn config_must_agree_with_the_model() {
    let mut cfg = ModelConfig { name: "m".into(), ..Default::default() };
    complete(&mut cfg, &onnx_io(), 4).unwrap();
    cfg.input[0].data_type = DataType::Int32.config();
    let err = check_against_model(&cfg, &onnx_io()).unwrap_err();
    assert!(err.contains("input 'x': the configuration says TYPE_INT32 but the model has TYPE_FP32"), "{err}");
    cfg.input[0].data_type = DataType::Fp32.config();
    cfg.input[0].dims = vec![8];
    let err = check_against_model(&cfg, &onnx_io()).unwrap_err();
    assert!(err.contains("the model's shape is [-1,16] but the configuration gives [-1,8]"), "{err}");
    cfg.input[0].name = "z".into();
    let err = check_against_model(&cfg, &onnx_io()).unwrap_err();
    assert!(err.contains("configuration input 'z' is not an input of the model"), "{err}");
}

#[test]
fn config_dims_1_match_a_model_scalar() {
    let io = ModelIo {
        inputs: vec![info("x", DataType::Fp32, &[-1]), info("sr", DataType::Int64, &[])],
        outputs: vec![info("p", DataType::Fp32, &[])],
    };
    let t = |name: &str, dt: DataType, dims: Vec<i64>| (name.to_string(), dt.config(), dims);
    let cfg = |inputs: Vec<(String, i32, Vec<i64>)>, outputs: Vec<(String, i32, Vec<i64>)>| ModelConfig {
        name: "vad".into(),
        input: inputs
            .into_iter()
            .map(|(name, data_type, dims)| ModelInput { name, data_type, dims, ..Default::default() })
            .collect(),
        output: outputs
            .into_iter()
            .map(|(name, data_type, dims)| ModelOutput { name, data_type, dims, ..Default::default() })
            .collect(),
        ..Default::default()
    };
    let good = cfg(
        vec![t("x", DataType::Fp32, vec![-1]), t("sr", DataType::Int64, vec![1])],
        vec![t("p", DataType::Fp32, vec![1])],
    );
    let scalars = check_against_model(&good, &io).unwrap();
    assert_eq!(scalars, Scalars { inputs: vec!["sr".into()], outputs: vec!["p".into()] });
    let two = cfg(
        vec![t("x", DataType::Fp32, vec![-1]), t("sr", DataType::Int64, vec![2])],
        vec![t("p", DataType::Fp32, vec![1])],
    );
    let err = check_against_model(&two, &io).unwrap_err();
    assert!(err.contains("the model's shape is [] but the configuration gives [2]"), "{err}");
    // Per-row scalars of a batching model.
    let io =
        ModelIo { inputs: vec![info("r", DataType::Fp32, &[-1])], outputs: vec![info("d", DataType::Fp32, &[-1])] };
    let mut rows = cfg(vec![t("r", DataType::Fp32, vec![1])], vec![t("d", DataType::Fp32, vec![1])]);
    rows.max_batch_size = 8;
    let scalars = check_against_model(&rows, &io).unwrap();
    assert_eq!(scalars.inputs, vec!["r".to_string()]);
}

#[test]
fn files_a_config_names_stay_in_the_folder() {
    let root = dir_with_version("m");
    for bad in ["../../other/1/model.onnx", "/etc/passwd", "a/../../b"] {
        let mut cfg = ModelConfig { default_model_filename: bad.into(), ..Default::default() };
        let e = fill(&mut cfg, &root.path().join("m"), "m").unwrap_err();
        assert!(e.starts_with("default_model_filename"), "{bad}: {e}");
    }
}

#[test]
fn what_a_config_can_allocate_is_bounded() {
    use crate::proto::inference::{ModelWarmup, model_warmup::Input as WarmupInput};
    let good = || ModelConfig {
        name: "m".into(),
        max_batch_size: 8,
        input: vec![ModelInput { name: "x".into(), data_type: 11, dims: vec![4], ..Default::default() }],
        output: vec![ModelOutput { name: "y".into(), data_type: 11, dims: vec![4], ..Default::default() }],
        ..Default::default()
    };
    let mut cfg = good();
    cfg.instance_group = vec![ModelInstanceGroup { name: "g".into(), count: i32::MAX, ..Default::default() }];
    assert!(validate(&cfg).unwrap_err().contains("at most 128 are allowed"));
    let warm = |dims: Vec<i64>, batch_size: u32, count: u32| ModelWarmup {
        name: "w".into(),
        batch_size,
        count,
        inputs: [("x".to_string(), WarmupInput { data_type: 11, dims, input_data_type: None })].into(),
    };
    let mut cfg = good();
    cfg.model_warmup = vec![warm(vec![4], 8, 1)];
    validate(&cfg).unwrap();
    cfg.model_warmup = vec![warm(vec![1 << 20, 1 << 20], 1, 1)];
    assert!(validate(&cfg).unwrap_err().contains("a warm-up sample may use"));
    cfg.model_warmup = vec![warm(vec![i64::MAX, i64::MAX], 1, 1)];
    assert!(validate(&cfg).unwrap_err().contains("a warm-up sample may use"));
    cfg.model_warmup = vec![warm(vec![4], 9, 1)];
    assert!(validate(&cfg).unwrap_err().contains("larger than max_batch_size"));
    cfg.model_warmup = vec![warm(vec![4], 1, u32::MAX)];
    assert!(validate(&cfg).unwrap_err().contains("count 4294967295"));
    let mut cfg = good();
    let levels = |n| {
        SchedulingChoice::DynamicBatching(ModelDynamicBatching {
            priority_levels: n,
            default_priority_level: 1,
            ..Default::default()
        })
    };
    cfg.scheduling_choice = Some(levels(1024));
    validate(&cfg).unwrap();
    cfg.scheduling_choice = Some(levels(4_000_000_000));
    assert!(validate(&cfg).unwrap_err().contains("priority_levels 4000000000 is over the 1024 allowed"));
}

#[test]
fn pytorch_platforms_pair_with_the_pytorch_backend() {
    let root = dir_with_version("m");
    let dir = root.path().join("m");
    for (platform, backend, want_platform, want_file) in [
        ("pytorch_libtorch", "", "pytorch_libtorch", "model.pt"),
        ("", "pytorch", "pytorch_libtorch", "model.pt"),
        ("torch_aoti", "", "torch_aoti", "model.pt2"),
        ("torch_aoti", "pytorch", "torch_aoti", "model.pt2"),
    ] {
        let mut cfg = ModelConfig { platform: platform.into(), backend: backend.into(), ..Default::default() };
        fill(&mut cfg, &dir, "m").unwrap();
        assert_eq!((cfg.platform.as_str(), cfg.backend.as_str()), (want_platform, "pytorch"));
        assert_eq!(cfg.default_model_filename, want_file);
    }
    let mut odd = ModelConfig { platform: "pytorch_libtorch".into(), backend: "python".into(), ..Default::default() };
    assert!(fill(&mut odd, &dir, "m").unwrap_err().contains("unexpected 'platform' and 'backend' pair"));
}
