use bytes::Bytes;

use super::*;
use crate::{
    error::ErrorKind,
    request::{InferResponse, ParamValue},
    tensor::{DataType, Tensor, push_bytes_element},
};

fn decode_plain(
    model: &str,
    version: Option<u64>,
    body: Bytes,
    header_len: Option<usize>,
) -> crate::error::Result<(crate::request::InferRequest, OutputFormat)> {
    decode(model, version, body, header_len, &crate::shm::SharedMemory::new(false))
}

fn body(json: &str, binary: &[u8]) -> (Bytes, Option<usize>) {
    let mut b = json.as_bytes().to_vec();
    b.extend_from_slice(binary);
    (Bytes::from(b), (!binary.is_empty()).then_some(json.len()))
}

#[test]
fn json_inputs_and_outputs() {
    let (b, h) = body(
        r#"{"id":"7","parameters":{"binary_data_output":true,"custom":3},
            "inputs":[{"name":"x","shape":[1,2],"datatype":"INT32","data":[[1,2]]}],
            "outputs":[{"name":"y","parameters":{"binary_data":false,"classification":2}}]}"#,
        &[],
    );
    let (req, fmt) = decode_plain("m", Some(2), b, h).unwrap();
    assert_eq!(req.id, "7");
    assert_eq!(req.model_version, Some(2));
    assert_eq!(req.inputs[0].data.as_ref(), &[1, 0, 0, 0, 2, 0, 0, 0]);
    assert_eq!(req.parameters.get("custom"), Some(&ParamValue::Int(3)));
    assert!(!req.parameters.contains_key("binary_data_output"));
    assert_eq!(req.outputs[0].classification, Some(2));
    assert!(!fmt.binary("y"));
    assert!(fmt.binary("z"), "unlisted outputs follow binary_data_output");
}

#[test]
fn binary_inputs_are_sliced_in_order() {
    let (b, h) = body(
        r#"{"inputs":[{"name":"a","shape":[2],"datatype":"UINT8","parameters":{"binary_data_size":2}},
                      {"name":"j","shape":[1],"datatype":"UINT8","data":[9]},
                      {"name":"b","shape":[3],"datatype":"UINT8","parameters":{"binary_data_size":3}}]}"#,
        &[1, 2, 3, 4, 5],
    );
    let (req, _) = decode_plain("m", None, b, h).unwrap();
    assert_eq!(req.inputs[0].data.as_ref(), &[1, 2]);
    assert_eq!(req.inputs[1].data.as_ref(), &[9]);
    assert_eq!(req.inputs[2].data.as_ref(), &[3, 4, 5]);
}

#[test]
fn binary_errors_name_the_problem() {
    let json = r#"{"inputs":[{"name":"a","shape":[4],"datatype":"UINT8","parameters":{"binary_data_size":4}}]}"#;
    let (b, h) = body(json, &[1, 2]);
    let e = decode_plain("m", None, b, h).unwrap_err();
    assert!(e.message().contains("unexpected size for input 'a', expecting 2 additional bytes"), "{e}");
    let (b, h) = body(json, &[1, 2, 3, 4, 5]);
    assert!(
        decode_plain("m", None, b, h).unwrap_err().message().contains("unexpected additional input data for model 'm'")
    );
    let e = decode_plain("m", None, Bytes::from_static(b"{}"), Some(99)).unwrap_err();
    assert_eq!(e.message(), "inference header size should be in range (0, 2), got: 99");
    // Without the header the binary part is read as JSON and fails to parse.
    let (b, _) = body(json, &[1, 2, 3, 4]);
    assert_eq!(decode_plain("m", None, b, None).unwrap_err().kind(), ErrorKind::InvalidArgument);
}

#[test]
fn malformed_json_and_sources() {
    let e = decode_plain("m", None, Bytes::from_static(b"{\"inputs\": [}"), None).unwrap_err();
    assert!(e.message().starts_with("failed to parse the request JSON buffer"), "{e}");
    let e = decode_plain(
        "m",
        None,
        Bytes::from_static(b"{\"inputs\":[{\"name\":\"a\",\"shape\":[1],\"datatype\":\"FP32\"}]}"),
        None,
    )
    .unwrap_err();
    assert!(e.message().contains("But no field is set"), "{e}");
    let e = decode_plain(
        "m",
        None,
        Bytes::from_static(b"{\"inputs\":[{\"name\":\"a\",\"shape\":[1],\"datatype\":\"FP99\",\"data\":[1]}]}"),
        None,
    )
    .unwrap_err();
    assert!(e.message().contains("invalid datatype 'FP99'"), "{e}");
    let e = decode_plain(
        "m",
        None,
        Bytes::from_static(b"{\"inputs\":[{\"name\":\"a\",\"shape\":[3],\"datatype\":\"FP32\",\"data\":[1,2]}]}"),
        None,
    )
    .unwrap_err();
    assert_eq!(e.message(), "Failed to parse 'data' field: shape does not match true shape");
    let e =
        decode_plain("m", None, Bytes::from_static(b"{\"parameters\":{\"p\":[1]},\"inputs\":[]}"), None).unwrap_err();
    assert!(e.message().contains("parameter 'p' has invalid type"), "{e}");
}

fn tensor(name: &str, datatype: DataType, shape: &[i64], data: Vec<u8>) -> Tensor {
    Tensor { name: name.into(), datatype, shape: shape.to_vec(), data: Bytes::from(data) }
}

#[test]
fn encodes_json_and_binary_outputs() {
    let mut s = Vec::new();
    push_bytes_element(&mut s, b"hi \"you\"");
    let resp = InferResponse {
        model_name: "m".into(),
        model_version: 3,
        id: String::new(),
        parameters: Default::default(),
        outputs: vec![
            tensor("f", DataType::Fp32, &[2], [0.5f32, f32::NAN].iter().flat_map(|f| f.to_le_bytes()).collect()),
            tensor("s", DataType::Bytes, &[1], s),
            tensor("b", DataType::Uint8, &[3], vec![7, 8, 9]),
        ],
    };
    let fmt =
        OutputFormat { listed: vec![Listed { name: "b".into(), binary: true, in_shm: false }], default_binary: false };
    let enc = encode(&resp, &fmt).unwrap();
    let len = enc.header_len.unwrap();
    let json = std::str::from_utf8(&enc.body[..len]).unwrap();
    assert_eq!(
        json,
        r#"{"model_name":"m","model_version":"3","outputs":[{"name":"f","datatype":"FP32","shape":[2],"data":[0.5,NaN]},{"name":"s","datatype":"BYTES","shape":[1],"data":["hi \"you\""]},{"name":"b","datatype":"UINT8","shape":[3],"parameters":{"binary_data_size":3}}]}"#
    );
    assert_eq!(&enc.body[len..], &[7, 8, 9]);
}

#[test]
fn json_only_reply_has_no_header_length_and_fp16_needs_binary() {
    let resp = InferResponse {
        model_name: "m".into(),
        model_version: 1,
        id: "x".into(),
        parameters: Default::default(),
        outputs: vec![tensor("h", DataType::Fp16, &[1], vec![0, 0])],
    };
    let e = encode(&resp, &OutputFormat::default()).err().unwrap();
    assert!(e.message().contains("sending FP16 data via JSON is not supported"), "{e}");
    let enc = encode(&resp, &OutputFormat { listed: vec![], default_binary: true }).unwrap();
    assert!(enc.header_len.is_some());
    let resp = InferResponse {
        outputs: vec![tensor("i", DataType::Int64, &[2], [-1i64, 5].iter().flat_map(|v| v.to_le_bytes()).collect())],
        ..resp
    };
    let enc = encode(&resp, &OutputFormat::default()).unwrap();
    assert!(enc.header_len.is_none());
    let v: serde_json::Value = serde_json::from_slice(&enc.body).unwrap();
    assert_eq!(v["id"], "x");
    assert_eq!(v["outputs"][0]["data"], serde_json::json!([-1, 5]));
}
