use std::sync::Arc;

use bytes::Bytes;

use super::*;
use crate::{
    error::ErrorKind,
    request::{InputTensor, RequestedOutput},
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

fn simple(max_batch_size: usize) -> Schema {
    Schema {
        max_batch_size,
        inputs: vec![spec("INPUT0", DataType::Int32, &[16]), spec("INPUT1", DataType::Int32, &[16])],
        outputs: vec![spec("OUTPUT0", DataType::Int32, &[16]), spec("OUTPUT1", DataType::Int32, &[16])],
        ..Default::default()
    }
}

fn input(name: &str, datatype: DataType, shape: &[i64], bytes: usize) -> InputTensor {
    InputTensor::host(name, datatype, shape.to_vec(), Bytes::from(vec![0u8; bytes]))
}

fn request(inputs: Vec<InputTensor>) -> InferRequest {
    InferRequest { model_name: "simple".into(), inputs, ..Default::default() }
}

fn err(schema: &Schema, req: InferRequest) -> String {
    let e = validate("simple", schema, req).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidArgument);
    e.message().to_string()
}

#[test]
fn accepts_a_good_batch() {
    let schema = simple(8);
    let v = validate(
        "simple",
        &schema,
        request(vec![input("INPUT1", DataType::Int32, &[3, 16], 192), input("INPUT0", DataType::Int32, &[3, 16], 192)]),
    )
    .unwrap();
    assert_eq!(v.rows, 3);
    assert_eq!(v.inputs.len(), 2);
    assert_eq!(v.outputs.len(), 2);
    assert_eq!(v.batch_key, vec![16, -3, 16, -3]);
}

#[test]
fn names_unknown_and_missing_inputs() {
    let schema = simple(8);
    let m = err(&schema, request(vec![input("INPUT9", DataType::Int32, &[1, 16], 64)]));
    assert_eq!(m, "unexpected inference input 'INPUT9' for model 'simple'");
    let m = err(&schema, request(vec![input("INPUT0", DataType::Int32, &[1, 16], 64)]));
    assert!(m.starts_with("expected 2 inputs but got 1 inputs for model 'simple'"), "{m}");
    assert!(m.contains("missing required input(s) ['INPUT1']"), "{m}");
}

#[test]
fn names_datatype_and_shape_mismatches() {
    let schema = simple(8);
    let m = err(
        &schema,
        request(vec![input("INPUT0", DataType::Fp32, &[1, 16], 64), input("INPUT1", DataType::Int32, &[1, 16], 64)]),
    );
    assert_eq!(m, "inference input 'INPUT0' data-type is 'FP32', but model 'simple' expects 'INT32'");
    let m = err(
        &schema,
        request(vec![input("INPUT0", DataType::Int32, &[1, 15], 60), input("INPUT1", DataType::Int32, &[1, 16], 64)]),
    );
    assert!(
        m.starts_with("unexpected shape for input 'INPUT0' for model 'simple'. Expected [-1,16], got [1,15]."),
        "{m}"
    );
    let m = err(
        &schema,
        request(vec![input("INPUT0", DataType::Int32, &[1, 16], 60), input("INPUT1", DataType::Int32, &[1, 16], 64)]),
    );
    assert_eq!(m, "input byte size mismatch for input 'INPUT0' for model 'simple'. Expected 64, got 60");
}

#[test]
fn batch_rules() {
    let schema = simple(8);
    let m = err(
        &schema,
        request(vec![input("INPUT0", DataType::Int32, &[9, 16], 576), input("INPUT1", DataType::Int32, &[9, 16], 576)]),
    );
    assert!(m.starts_with("inference request batch-size must be <= 8 for 'simple'"), "{m}");
    let m = err(
        &schema,
        request(vec![input("INPUT0", DataType::Int32, &[0, 16], 0), input("INPUT1", DataType::Int32, &[0, 16], 0)]),
    );
    assert!(m.starts_with("inference request batch-size must be >= 1 for 'simple' (input 'INPUT0' has 0 rows"), "{m}");
    let m = err(
        &schema,
        request(vec![input("INPUT0", DataType::Int32, &[2, 16], 128), input("INPUT1", DataType::Int32, &[1, 16], 64)]),
    );
    assert_eq!(m, "input 'INPUT1' batch size does not match other inputs for 'simple'");
    let m = err(
        &schema,
        request(vec![input("INPUT0", DataType::Int32, &[], 4), input("INPUT1", DataType::Int32, &[1, 16], 64)]),
    );
    assert!(m.contains("has no shape but model requires batch dimension"), "{m}");
}

#[test]
fn unbatched_model_takes_shape_as_is() {
    let schema = simple(0);
    let v = validate(
        "simple",
        &schema,
        request(vec![input("INPUT0", DataType::Int32, &[16], 64), input("INPUT1", DataType::Int32, &[16], 64)]),
    )
    .unwrap();
    assert_eq!(v.rows, 1);
    assert_eq!(v.inputs[0].as_ref().unwrap().shape, vec![16]);
}

#[test]
fn bytes_inputs_count_elements() {
    let schema = Schema { max_batch_size: 0, inputs: vec![spec("s", DataType::Bytes, &[2])], ..Default::default() };
    let mut data = Vec::new();
    crate::tensor::push_bytes_element(&mut data, b"hello");
    let one = InputTensor::host("s", DataType::Bytes, vec![2], Bytes::from(data.clone()));
    let m = err(&schema, request(vec![one]));
    assert_eq!(m, "expected 2 string elements for inference input 's' for model 'simple', got 1");
    crate::tensor::push_bytes_element(&mut data, b"");
    let two = InputTensor::host("s", DataType::Bytes, vec![2], Bytes::from(data));
    assert!(validate("simple", &schema, request(vec![two])).is_ok());
    let mut bad = Vec::new();
    crate::tensor::push_bytes_element(&mut bad, b"ok");
    crate::tensor::push_bytes_element(&mut bad, &[0xff, 0xfe]);
    let bad = InputTensor::host("s", DataType::Bytes, vec![2], Bytes::from(bad));
    assert!(
        validate("simple", &schema, request(vec![bad.clone()])).is_ok(),
        "any bytes, unless the backend wants text"
    );
    let text = Schema { utf8_bytes: true, ..schema };
    let m = err(&text, request(vec![bad]));
    assert!(m.contains("input 's' for model 'simple': element 1 is not valid UTF-8"), "{m}");
}

#[test]
fn outputs_and_parameters() {
    let schema = simple(8);
    let mut req =
        request(vec![input("INPUT0", DataType::Int32, &[1, 16], 64), input("INPUT1", DataType::Int32, &[1, 16], 64)]);
    req.outputs = vec![RequestedOutput { name: "OUTPUT1".into(), ..Default::default() }];
    let v = validate("simple", &schema, req.clone()).unwrap();
    assert_eq!(v.outputs, vec![OutputRequest { index: 1, classification: None }]);
    req.outputs[0].name = "NOPE".into();
    assert_eq!(err(&schema, req.clone()), "unexpected inference output 'NOPE' for model 'simple'");
    req.outputs.clear();
    req.parameters.insert("triton_x".into(), crate::request::ParamValue::Bool(true));
    assert!(err(&schema, req).contains("reserved"));
}

#[test]
fn reshape_fills_variable_dims() {
    assert_eq!(model_shape(Some(4), &[1], &[1], &[]), vec![4]);
    assert_eq!(model_shape(Some(2), &[7], &[-1], &[1, -1]), vec![2, 1, 7]);
    assert_eq!(model_shape(None, &[3, 5], &[3, -1], &[-1, 3]), vec![5, 3]);
}

#[test]
fn an_output_asked_for_twice_is_refused() {
    let mut req =
        request(vec![input("INPUT0", DataType::Int32, &[1, 16], 64), input("INPUT1", DataType::Int32, &[1, 16], 64)]);
    req.outputs = vec![
        crate::request::RequestedOutput { name: "OUTPUT0".into(), ..Default::default() },
        crate::request::RequestedOutput { name: "OUTPUT0".into(), ..Default::default() },
    ];
    let m = err(&simple(8), req);
    assert!(m.contains("output 'OUTPUT0' is requested more than once"), "{m}");
}

#[test]
fn a_shape_whose_byte_size_overflows_is_too_large() {
    let t = input("X", DataType::Fp32, &[1, 3, 3074457345618258603, 1], 16);
    let e = check_byte_size("m", &t, false).unwrap_err();
    assert_eq!(e.message(), "shape [1,3,3074457345618258603,1] of input 'X' is too large");
}
