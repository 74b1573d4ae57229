use std::collections::HashMap;

use super::*;
use crate::{
    proto::inference::{ModelEnsembling, model_ensembling::Step as StepConfig},
    schema::TensorSpec,
};

fn spec(name: &str, datatype: DataType, dims: &[i64]) -> TensorSpec {
    TensorSpec {
        name: name.into(),
        datatype,
        dims: dims.to_vec(),
        reshape: None,
        optional: false,
        allow_ragged_batch: false,
        labels: Arc::default(),
    }
}

fn schema(max: usize, inputs: Vec<TensorSpec>, outputs: Vec<TensorSpec>) -> Arc<Schema> {
    Arc::new(Schema { max_batch_size: max, inputs, outputs, ..Default::default() })
}

/// `pre`: TEXT (BYTES [1]) -> IDS (INT64 [-1]); `core`: IDS -> EMB (FP32 [4]).
struct Two;

impl Models for Two {
    fn schema(&self, _: Option<usize>, name: &str, _: Option<u64>) -> Result<Arc<Schema>, String> {
        match name {
            "pre" => {
                Ok(schema(8, vec![spec("TEXT", DataType::Bytes, &[1])], vec![spec("IDS", DataType::Int64, &[-1])]))
            }
            "core" => Ok(schema(4, vec![spec("IDS", DataType::Int64, &[-1])], vec![spec("EMB", DataType::Fp32, &[4])])),
            "loop" => Ok(schema(8, vec![spec("X", DataType::Int64, &[-1])], vec![spec("Y", DataType::Int64, &[-1])])),
            other => Err(format!("model '{other}' is not loaded")),
        }
    }
}

fn step(model: &str, inputs: &[(&str, &str)], outputs: &[(&str, &str)]) -> StepConfig {
    let map = |m: &[(&str, &str)]| m.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect::<HashMap<_, _>>();
    StepConfig {
        model_name: model.into(),
        model_version: -1,
        input_map: map(inputs),
        output_map: map(outputs),
        ..Default::default()
    }
}

fn ensemble(steps: Vec<StepConfig>) -> ModelConfig {
    ModelConfig {
        name: "e".into(),
        platform: "ensemble".into(),
        max_batch_size: 4,
        scheduling_choice: Some(SchedulingChoice::EnsembleScheduling(ModelEnsembling {
            step: steps,
            ..Default::default()
        })),
        ..Default::default()
    }
}

fn e_schema() -> Arc<Schema> {
    schema(4, vec![spec("text", DataType::Bytes, &[1])], vec![spec("embedding", DataType::Fp32, &[4])])
}

fn good_steps() -> Vec<StepConfig> {
    vec![step("pre", &[("TEXT", "text")], &[("IDS", "ids")]), step("core", &[("IDS", "ids")], &[("EMB", "embedding")])]
}

#[test]
fn a_good_pipeline_plans() {
    let e = Ensemble::plan(&ensemble(good_steps()), &e_schema(), &Two).unwrap();
    assert_eq!(e.models(), vec!["core", "pre"]);
    assert_eq!(e.steps[0].inputs, vec![("TEXT".to_string(), "text".to_string())]);
}

#[test]
fn load_errors_name_the_ensemble_the_step_and_the_tensor() {
    let cases: Vec<(Vec<StepConfig>, &str)> = vec![
        (
            vec![step("nope", &[("TEXT", "text")], &[("IDS", "ids")])],
            "step 0 (model 'nope'): model 'nope' is not loaded",
        ),
        (
            vec![
                step("pre", &[("TEXT", "text")], &[("IDS", "ids")]),
                step("pre", &[("TEXT", "text")], &[("IDS", "ids")]),
            ],
            "step 1 (model 'pre'): tensor 'ids' is produced twice (also by step 0)",
        ),
        (
            vec![step("core", &[("IDS", "ghost")], &[("EMB", "embedding")])],
            "reads tensor 'ghost', which no step produces",
        ),
        (vec![step("pre", &[("TEXT", "text")], &[("IDS", "ids")])], "output 'embedding' is never produced"),
        (
            vec![
                step("pre", &[("TEXT", "text")], &[("IDS", "ids")]),
                step("core", &[("IDS", "text")], &[("EMB", "embedding")]),
            ],
            "step 1 (model 'core'): input 'IDS' (tensor 'text') is INT64 but the tensor mapped to it is BYTES",
        ),
        (vec![step("pre", &[("TEXT", "text")], &[("NOPE", "x")])], "output_map names 'NOPE'"),
        (vec![step("e", &[("TEXT", "text")], &[("IDS", "x")])], "an ensemble cannot run itself"),
    ];
    for (steps, want) in cases {
        let err = Ensemble::plan(&ensemble(steps), &e_schema(), &Two).unwrap_err();
        assert!(err.contains(want), "want '{want}' in: {err}");
        assert!(err.starts_with("ensemble 'e'"), "{err}");
    }
}

#[test]
fn batch_sizes_and_cycles() {
    let mut big = ensemble(good_steps());
    big.max_batch_size = 8;
    let s8 = schema(8, vec![spec("text", DataType::Bytes, &[1])], vec![spec("embedding", DataType::Fp32, &[4])]);
    let err = Ensemble::plan(&big, &s8, &Two).unwrap_err();
    assert!(err.contains("step 1 (model 'core'): the ensemble's max_batch_size is 8 but the model allows 4"), "{err}");
    // Two steps that each read what the other writes.
    let steps = vec![
        step("pre", &[("TEXT", "text")], &[("IDS", "ids")]),
        step("loop", &[("X", "q")], &[("Y", "p")]),
        step("loop", &[("X", "p")], &[("Y", "q")]),
        step("core", &[("IDS", "ids")], &[("EMB", "embedding")]),
    ];
    let err = Ensemble::plan(&ensemble(steps), &e_schema(), &Two).unwrap_err();
    assert!(err.contains("steps [1, 2] form a cycle"), "{err}");
}
