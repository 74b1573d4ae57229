//! ModelInferRequest → the engine's InferRequest, and InferResponse → ModelInferResponse, with
//! Triton's rules: raw_input_contents consumed in input order, typed contents for generic KServe
//! clients, and exactly one raw_output_contents entry per output.
use std::collections::HashMap;

use bytes::Bytes;

use crate::{
    error::{Error, Result},
    proto::inference::{
        InferParameter, InferTensorContents, ModelInferRequest, ModelInferResponse, infer_parameter::ParameterChoice,
        model_infer_response::InferOutputTensor,
    },
    request::{
        InferRequest, InferResponse, InputTensor, ParamValue, Parameters, RequestedOutput, ShmRef, parse_version,
    },
    shm::SharedMemory,
    tensor::{DataType, push_bytes_element},
};

pub fn request(mut r: ModelInferRequest, shm: &SharedMemory) -> Result<InferRequest> {
    let model = r.model_name.clone();
    let version = parse_version(&model, &r.model_version)?;
    let parameters = parameters(&r.parameters)?;
    let mut raw = std::mem::take(&mut r.raw_input_contents).into_iter();
    let mut inputs = Vec::with_capacity(r.inputs.len());
    for i in r.inputs {
        let datatype = DataType::from_wire(&i.datatype).ok_or_else(|| {
            Error::invalid(format!("input '{}' has an invalid datatype '{}' for model '{model}'", i.name, i.datatype))
        })?;
        let contents = i.contents.filter(|c| !contents_empty(c));
        let (data, device) = if let Some(region) = shm_ref(&i.parameters, "input", &i.name)? {
            if contents.is_some() {
                return Err(Error::invalid(format!(
                    "unexpected 'content' provided when using shared memory for input tensor '{}' for model '{model}'",
                    i.name
                )));
            }
            shm.read_input(&region.region, region.offset, region.byte_size)?
        } else if let Some(c) = contents {
            if raw.len() > 0 {
                return Err(Error::invalid(format!(
                    "contents field must not be specified when using raw_input_contents for '{}' for model '{model}'",
                    i.name
                )));
            }
            (typed(&model, &i.name, datatype, c)?, None)
        } else {
            let data = raw.next().ok_or_else(|| {
                Error::invalid(format!(
                    "unable to find data for input tensor '{}' for model '{model}' in request.",
                    i.name
                ))
            })?;
            (data, None)
        };
        inputs.push(InputTensor { name: i.name, datatype, shape: i.shape, data, device });
    }
    let outputs = r
        .outputs
        .into_iter()
        .map(|o| {
            let classification = match o.parameters.get("classification").and_then(|p| p.parameter_choice.as_ref()) {
                None => None,
                Some(ParameterChoice::Int64Param(k)) if *k > 0 => Some(u32::try_from(*k).unwrap_or(u32::MAX)),
                Some(other) => {
                    return Err(Error::invalid(format!(
                        "output '{}': 'classification' must be an int64_param > 0, got {other:?}",
                        o.name
                    )));
                }
            };
            let shm = shm_ref(&o.parameters, "output", &o.name)?;
            if shm.is_some() && classification.is_some() {
                return Err(Error::invalid(format!(
                    "output '{}': Output can't set both 'shared_memory_region' and 'classification'",
                    o.name
                )));
            }
            Ok(RequestedOutput { name: o.name, classification, shm })
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(InferRequest {
        model_name: model,
        model_version: version,
        id: r.id,
        parameters,
        inputs,
        outputs,
        trace_parent: None,
        context: Default::default(),
    })
}

fn contents_empty(c: &InferTensorContents) -> bool {
    c.bool_contents.is_empty()
        && c.int_contents.is_empty()
        && c.int64_contents.is_empty()
        && c.uint_contents.is_empty()
        && c.uint64_contents.is_empty()
        && c.fp32_contents.is_empty()
        && c.fp64_contents.is_empty()
        && c.bytes_contents.is_empty()
}

/// Typed contents in the wire layout; the field used must be the one of the datatype.
fn typed(model: &str, name: &str, dt: DataType, c: InferTensorContents) -> Result<Bytes> {
    let wrong = || {
        Error::invalid(format!(
            "unexpected explicit tensor data for input tensor '{name}' for model '{model}': expected the contents field of datatype '{}'",
            dt.wire()
        ))
    };
    let fields_set = [
        !c.bool_contents.is_empty(),
        !c.int_contents.is_empty(),
        !c.int64_contents.is_empty(),
        !c.uint_contents.is_empty(),
        !c.uint64_contents.is_empty(),
        !c.fp32_contents.is_empty(),
        !c.fp64_contents.is_empty(),
        !c.bytes_contents.is_empty(),
    ];
    if fields_set.iter().filter(|s| **s).count() > 1 {
        return Err(wrong());
    }
    let mut out: Vec<u8> = Vec::new();
    match dt {
        DataType::Bool if !c.bool_contents.is_empty() => out.extend(c.bool_contents.iter().map(|&b| u8::from(b))),
        DataType::Int8 if !c.int_contents.is_empty() => out.extend(c.int_contents.iter().map(|&v| v as i8 as u8)),
        DataType::Int16 if !c.int_contents.is_empty() => {
            c.int_contents.iter().for_each(|&v| out.extend((v as i16).to_le_bytes()))
        }
        DataType::Int32 if !c.int_contents.is_empty() => {
            c.int_contents.iter().for_each(|&v| out.extend(v.to_le_bytes()))
        }
        DataType::Int64 if !c.int64_contents.is_empty() => {
            c.int64_contents.iter().for_each(|&v| out.extend(v.to_le_bytes()))
        }
        DataType::Uint8 if !c.uint_contents.is_empty() => out.extend(c.uint_contents.iter().map(|&v| v as u8)),
        DataType::Uint16 if !c.uint_contents.is_empty() => {
            c.uint_contents.iter().for_each(|&v| out.extend((v as u16).to_le_bytes()))
        }
        DataType::Uint32 if !c.uint_contents.is_empty() => {
            c.uint_contents.iter().for_each(|&v| out.extend(v.to_le_bytes()))
        }
        DataType::Uint64 if !c.uint64_contents.is_empty() => {
            c.uint64_contents.iter().for_each(|&v| out.extend(v.to_le_bytes()))
        }
        DataType::Fp32 if !c.fp32_contents.is_empty() => {
            c.fp32_contents.iter().for_each(|&v| out.extend(v.to_le_bytes()))
        }
        DataType::Fp64 if !c.fp64_contents.is_empty() => {
            c.fp64_contents.iter().for_each(|&v| out.extend(v.to_le_bytes()))
        }
        DataType::Bytes if !c.bytes_contents.is_empty() => {
            c.bytes_contents.iter().for_each(|v| push_bytes_element(&mut out, v))
        }
        DataType::Fp16 | DataType::Bf16 => {
            return Err(Error::invalid(format!(
                "input '{name}' for model '{model}': {} data must be sent in raw_input_contents",
                dt.wire()
            )));
        }
        _ => return Err(wrong()),
    }
    Ok(Bytes::from(out))
}

fn shm_ref(params: &HashMap<String, InferParameter>, what: &str, name: &str) -> Result<Option<ShmRef>> {
    let int = |key: &str| -> Result<Option<u64>> {
        match params.get(key).and_then(|p| p.parameter_choice.as_ref()) {
            None => Ok(None),
            Some(ParameterChoice::Int64Param(v)) if *v >= 0 => Ok(Some(*v as u64)),
            Some(other) => Err(Error::invalid(format!(
                "{what} '{name}': '{key}' must be a non-negative int64_param, got {other:?}"
            ))),
        }
    };
    let (size, offset) = (int("shared_memory_byte_size")?, int("shared_memory_offset")?);
    match params.get("shared_memory_region").and_then(|p| p.parameter_choice.as_ref()) {
        None if size.is_some() || offset.is_some() => Err(Error::invalid(format!(
            "{what} '{name}': 'shared_memory_byte_size' and 'shared_memory_offset' need 'shared_memory_region'"
        ))),
        None => Ok(None),
        Some(ParameterChoice::StringParam(region)) => Ok(Some(ShmRef {
            region: region.clone(),
            offset: offset.unwrap_or(0),
            byte_size: size.ok_or_else(|| {
                Error::invalid(format!("{what} '{name}': 'shared_memory_region' needs 'shared_memory_byte_size'"))
            })?,
        })),
        Some(other) => Err(Error::invalid(format!(
            "{what} '{name}': 'shared_memory_region' must be a string_param, got {other:?}"
        ))),
    }
}

/// Request parameters; the reserved keys keep their kinds, custom ones may not be uint64.
fn parameters(map: &HashMap<String, InferParameter>) -> Result<Parameters> {
    let mut out = Parameters::new();
    for (k, p) in map {
        let Some(choice) = &p.parameter_choice else { continue };
        let value = match choice {
            ParameterChoice::BoolParam(b) => ParamValue::Bool(*b),
            ParameterChoice::Int64Param(i) => ParamValue::Int(*i),
            ParameterChoice::StringParam(s) => ParamValue::String(s.clone()),
            ParameterChoice::DoubleParam(d) => ParamValue::Double(*d),
            ParameterChoice::Uint64Param(u) if k == "priority" => ParamValue::Uint(*u),
            ParameterChoice::Uint64Param(_) => {
                return Err(Error::invalid(format!(
                    "invalid value type for '{k}' parameter, expected int64_param, bool_param, or string_param."
                )));
            }
        };
        out.insert(k.clone(), value);
    }
    Ok(out)
}

fn parameter(v: &ParamValue) -> InferParameter {
    let choice = match v {
        ParamValue::Bool(b) => ParameterChoice::BoolParam(*b),
        ParamValue::Int(i) => ParameterChoice::Int64Param(*i),
        ParamValue::Uint(u) => ParameterChoice::Uint64Param(*u),
        ParamValue::Double(d) => ParameterChoice::DoubleParam(*d),
        ParamValue::String(s) => ParameterChoice::StringParam(s.clone()),
    };
    InferParameter { parameter_choice: Some(choice) }
}

/// Outputs always travel in raw_output_contents, one entry per output (empty when in shm).
pub fn response(r: InferResponse) -> ModelInferResponse {
    let mut outputs = Vec::with_capacity(r.outputs.len());
    let mut raw = Vec::with_capacity(r.outputs.len());
    for t in r.outputs {
        outputs.push(InferOutputTensor {
            name: t.name,
            datatype: t.datatype.wire().to_string(),
            shape: t.shape,
            parameters: HashMap::new(),
            contents: None,
        });
        raw.push(t.data);
    }
    ModelInferResponse {
        model_name: r.model_name,
        model_version: r.model_version.to_string(),
        id: r.id,
        parameters: r.parameters.iter().map(|(k, v)| (k.clone(), parameter(v))).collect(),
        outputs,
        raw_output_contents: raw,
    }
}

/// A stream reply's `triton_final_response` flag.
pub fn final_flag() -> (String, InferParameter) {
    final_param(true)
}

/// `triton_final_response`: whether this is the request's last response on the stream.
pub fn final_param(last: bool) -> (String, InferParameter) {
    ("triton_final_response".to_string(), InferParameter { parameter_choice: Some(ParameterChoice::BoolParam(last)) })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proto::inference::model_infer_request::InferInputTensor;

    fn input(name: &str, dt: &str, shape: &[i64], contents: Option<InferTensorContents>) -> InferInputTensor {
        InferInputTensor {
            name: name.into(),
            datatype: dt.into(),
            shape: shape.to_vec(),
            parameters: HashMap::new(),
            contents,
        }
    }

    #[test]
    fn raw_entries_follow_the_inputs() {
        let req = ModelInferRequest {
            model_name: "m".into(),
            inputs: vec![input("a", "UINT8", &[2], None), input("b", "UINT8", &[1], None)],
            raw_input_contents: vec![Bytes::from_static(&[1, 2]), Bytes::from_static(&[3])],
            ..Default::default()
        };
        let r = request(req, &SharedMemory::new(false)).unwrap();
        assert_eq!(r.inputs[0].data.as_ref(), &[1, 2]);
        assert_eq!(r.inputs[1].data.as_ref(), &[3]);
        assert_eq!(r.model_version, None);
    }

    #[test]
    fn typed_contents_convert_and_mismatches_are_named() {
        let c = InferTensorContents { int_contents: vec![-1, 2], ..Default::default() };
        let req = ModelInferRequest {
            model_name: "m".into(),
            model_version: "3".into(),
            inputs: vec![input("a", "INT16", &[2], Some(c.clone()))],
            ..Default::default()
        };
        let r = request(req, &SharedMemory::new(false)).unwrap();
        assert_eq!(r.inputs[0].data.as_ref(), &[0xff, 0xff, 2, 0]);
        assert_eq!(r.model_version, Some(3));
        let req = ModelInferRequest {
            model_name: "m".into(),
            inputs: vec![input("a", "FP32", &[2], Some(c))],
            ..Default::default()
        };
        let e = request(req, &SharedMemory::new(false)).unwrap_err();
        assert!(e.message().contains("unexpected explicit tensor data for input tensor 'a'"), "{e}");
        let req = ModelInferRequest {
            model_name: "m".into(),
            inputs: vec![input("a", "FP32", &[2], None)],
            ..Default::default()
        };
        let e = request(req, &SharedMemory::new(false)).unwrap_err();
        assert!(e.message().contains("unable to find data for input tensor 'a'"), "{e}");
    }

    #[test]
    fn custom_uint64_parameters_are_refused() {
        let mut req = ModelInferRequest { model_name: "m".into(), ..Default::default() };
        req.parameters.insert("x".into(), InferParameter { parameter_choice: Some(ParameterChoice::Uint64Param(1)) });
        assert!(
            request(req.clone(), &SharedMemory::new(false))
                .unwrap_err()
                .message()
                .contains("invalid value type for 'x'")
        );
        req.parameters.clear();
        req.parameters
            .insert("priority".into(), InferParameter { parameter_choice: Some(ParameterChoice::Uint64Param(1)) });
        assert_eq!(request(req, &SharedMemory::new(false)).unwrap().parameters["priority"], ParamValue::Uint(1));
    }
}
