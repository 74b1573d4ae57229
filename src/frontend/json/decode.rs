//! KServe v2 infer request bodies: the JSON header, and the binary tensor data extension (raw
//! tensor bytes after the JSON, in input order, sized by `binary_data_size`).
use bytes::Bytes;
use serde::Deserialize;
use serde_json::{Map, Value, value::RawValue};

use super::data;
use crate::{
    engine::TensorMetadata,
    error::{Error, Result},
    request::{InferRequest, InputTensor, ParamValue, Parameters, RequestedOutput, ShmRef},
    shm::SharedMemory,
    tensor::{DataType, element_count},
};

#[derive(Deserialize)]
struct Header<'a> {
    #[serde(default)]
    id: Option<String>,
    #[serde(default)]
    parameters: Option<Map<String, Value>>,
    #[serde(borrow)]
    inputs: Vec<InputHeader<'a>>,
    #[serde(default)]
    outputs: Option<Vec<OutputHeader>>,
}

#[derive(Deserialize)]
struct InputHeader<'a> {
    name: String,
    shape: Vec<i64>,
    datatype: String,
    #[serde(default)]
    parameters: Option<Map<String, Value>>,
    #[serde(default, borrow)]
    data: Option<&'a RawValue>,
}

#[derive(Deserialize)]
struct OutputHeader {
    name: String,
    #[serde(default)]
    parameters: Option<Map<String, Value>>,
}

/// An output listed in the request, and how its reply carries it.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Listed {
    pub name: String,
    /// `binary_data`: after the JSON header instead of in it.
    pub binary: bool,
    /// Written into shared memory: the reply carries neither data nor parameters.
    pub in_shm: bool,
}

/// How the reply should carry each output (binary data extension).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct OutputFormat {
    pub listed: Vec<Listed>,
    /// For unlisted outputs: the request's `binary_data_output`.
    pub default_binary: bool,
}

impl OutputFormat {
    fn find(&self, name: &str) -> Option<&Listed> {
        self.listed.iter().find(|l| l.name == name)
    }

    pub fn binary(&self, name: &str) -> bool {
        self.find(name).map_or(self.default_binary, |l| l.binary)
    }

    pub fn in_shm(&self, name: &str) -> bool {
        self.find(name).is_some_and(|l| l.in_shm)
    }
}

/// Decodes an infer body. `header_len`: the Inference-Header-Content-Length value, if any.
pub fn decode(
    model: &str,
    version: Option<u64>,
    body: Bytes,
    header_len: Option<usize>,
    shm: &SharedMemory,
) -> Result<(InferRequest, OutputFormat)> {
    let json_len = header_len.unwrap_or(body.len());
    if json_len > body.len() {
        return Err(Error::invalid(format!(
            "inference header size should be in range (0, {}), got: {json_len}",
            body.len()
        )));
    }
    let header: Header<'_> = serde_json::from_slice(&body[..json_len])
        .map_err(|e| Error::invalid(format!("failed to parse the request JSON buffer: {e}")))?;
    let mut binary = body.slice(json_len..);
    let mut parameters = parameters(header.parameters, "request")?;
    let default_binary = match parameters.remove("binary_data_output") {
        None => false,
        Some(ParamValue::Bool(b)) => b,
        Some(other) => {
            return Err(Error::invalid(format!("parameter 'binary_data_output' must be a boolean, got {other:?}")));
        }
    };
    let inputs = header.inputs.into_iter().map(|i| input(model, i, &mut binary, shm)).collect::<Result<Vec<_>>>()?;
    if !binary.is_empty() {
        return Err(Error::invalid(format!("unexpected additional input data for model '{model}'")));
    }
    let (outputs, listed) = outputs(header.outputs.unwrap_or_default())?;
    let request = InferRequest {
        model_name: model.to_string(),
        model_version: version,
        id: header.id.unwrap_or_default(),
        parameters,
        inputs,
        outputs,
        trace_parent: None,
        context: Default::default(),
    };
    Ok((request, OutputFormat { listed, default_binary }))
}

fn input(model: &str, i: InputHeader<'_>, binary: &mut Bytes, shm: &SharedMemory) -> Result<InputTensor> {
    let datatype = DataType::from_wire(&i.datatype).ok_or_else(|| {
        Error::invalid(format!("input '{}' has an invalid datatype '{}' for model '{model}'", i.name, i.datatype))
    })?;
    if i.shape.iter().any(|&d| d < 0) {
        return Err(Error::invalid(
            "Unable to parse 'shape': attempt to access JSON non-unsigned-integer as unsigned-integer",
        ));
    }
    let params = i.parameters.unwrap_or_default();
    let binary_size = match params.get("binary_data_size") {
        None => None,
        Some(v) => Some(v.as_u64().ok_or_else(|| {
            Error::invalid(format!(
                "input '{}': parameter 'binary_data_size' must be an unsigned integer, got {v}",
                i.name
            ))
        })? as usize),
    };
    let shm_ref = shm_ref(&params, "input", &i.name)?;
    let set: Vec<&str> = [
        (i.data.is_some(), "'data'"),
        (binary_size.is_some(), "'binary_data_size'"),
        (shm_ref.is_some(), "'shared_memory_region'"),
    ]
    .iter()
    .filter(|(on, _)| *on)
    .map(|(_, n)| *n)
    .collect();
    if set.len() != 1 {
        let got = if set.is_empty() { "no field is set".to_string() } else { format!("set {}", set.join(" ")) };
        return Err(Error::invalid(format!(
            "Input '{}' must set only one of the following fields: 'data', 'binary_data_size' in 'parameters', \
             'shared_memory_region' in 'parameters'. But {got}",
            i.name
        )));
    }
    if let Some(r) = shm_ref {
        let (data, device) = shm.read_input(&r.region, r.offset, r.byte_size)?;
        return Ok(InputTensor { name: i.name, datatype, shape: i.shape, data, device });
    }
    let data = match (binary_size, i.data) {
        (Some(n), _) => {
            if n > binary.len() {
                return Err(Error::invalid(format!(
                    "unexpected size for input '{}', expecting {} additional bytes for model '{model}'",
                    i.name,
                    n - binary.len()
                )));
            }
            binary.split_to(n)
        }
        (None, Some(raw)) => json_data(model, &i.name, &i.shape, datatype, raw.get())?,
        (None, None) => unreachable!("exactly one data source was checked above"),
    };
    Ok(InputTensor::host(i.name, datatype, i.shape, data))
}

fn json_data(model: &str, name: &str, shape: &[i64], datatype: DataType, raw: &str) -> Result<Bytes> {
    let expected = element_count(shape);
    // Room for the elements the shape declares, but never more than the text can hold (each
    // element takes at least one character): a tiny body cannot make the server reserve megabytes.
    let mut out = Vec::with_capacity(expected.unwrap_or(0).min(raw.len()) * datatype.size().unwrap_or(8));
    let count = data::decode(raw, datatype, &mut out)
        .map_err(|e| Error::invalid(format!("unable to parse 'data' of input '{name}' for model '{model}': {e}")))?;
    // Triton's two texts: too few elements, too many.
    match expected {
        Some(expected) if count < expected => {
            return Err(Error::invalid("Failed to parse 'data' field: shape does not match true shape"));
        }
        Some(expected) if count > expected => {
            return Err(Error::invalid("Unable to parse 'data': Shape does not match true shape of 'data' field"));
        }
        _ => {}
    }
    Ok(Bytes::from(out))
}

/// The requested outputs, and how the reply carries each.
type Outputs = (Vec<RequestedOutput>, Vec<Listed>);

/// `shared_memory_region` / `_byte_size` / `_offset` parameters of an input or output.
fn shm_ref(p: &Map<String, Value>, what: &str, name: &str) -> Result<Option<ShmRef>> {
    let uint = |key: &str| -> Result<Option<u64>> {
        match p.get(key) {
            None => Ok(None),
            Some(v) => v.as_u64().map(Some).ok_or_else(|| {
                Error::invalid(format!("{what} '{name}': parameter '{key}' must be an unsigned integer, got {v}"))
            }),
        }
    };
    let (size, offset) = (uint("shared_memory_byte_size")?, uint("shared_memory_offset")?);
    match p.get("shared_memory_region") {
        None if size.is_some() || offset.is_some() => Err(Error::invalid(format!(
            "{what} '{name}': 'shared_memory_byte_size' and 'shared_memory_offset' need 'shared_memory_region'"
        ))),
        None => Ok(None),
        Some(Value::String(region)) => {
            let byte_size = size.ok_or_else(|| {
                Error::invalid(format!("{what} '{name}': 'shared_memory_region' needs 'shared_memory_byte_size'"))
            })?;
            Ok(Some(ShmRef { region: region.clone(), offset: offset.unwrap_or(0), byte_size }))
        }
        Some(v) => Err(Error::invalid(format!("{what} '{name}': 'shared_memory_region' must be a string, got {v}"))),
    }
}

fn outputs(list: Vec<OutputHeader>) -> Result<Outputs> {
    let mut requested = Vec::with_capacity(list.len());
    let mut listed = Vec::with_capacity(list.len());
    for o in list {
        let p = o.parameters.unwrap_or_default();
        let binary = match p.get("binary_data") {
            None => false,
            Some(Value::Bool(b)) => *b,
            Some(v) => {
                return Err(Error::invalid(format!("output '{}': 'binary_data' must be a boolean, got {v}", o.name)));
            }
        };
        let classification = match p.get("classification") {
            None => None,
            Some(v) => Some(v.as_u64().and_then(|k| u32::try_from(k).ok()).ok_or_else(|| {
                Error::invalid(format!("output '{}': 'classification' must be an unsigned integer, got {v}", o.name))
            })?),
        };
        let shm = shm_ref(&p, "output", &o.name)?;
        if shm.is_some() && classification.is_some() {
            return Err(Error::invalid(format!(
                "output '{}': Output can't set both 'shared_memory_region' and 'classification'",
                o.name
            )));
        }
        if shm.is_some() && binary {
            return Err(Error::invalid(format!(
                "output '{}': Output can't set both 'shared_memory_region' and 'binary_data'",
                o.name
            )));
        }
        listed.push(Listed { name: o.name.clone(), binary, in_shm: shm.is_some() });
        requested.push(RequestedOutput { name: o.name, classification, shm });
    }
    Ok((requested, listed))
}

/// Request parameters as the engine sees them; objects and arrays are refused.
pub fn parameters(map: Option<Map<String, Value>>, what: &str) -> Result<Parameters> {
    let mut out = Parameters::new();
    for (k, v) in map.unwrap_or_default() {
        let value = match v {
            Value::Bool(b) => ParamValue::Bool(b),
            Value::String(s) => ParamValue::String(s),
            Value::Number(n) => match (n.as_i64(), n.as_u64(), n.as_f64()) {
                (Some(i), _, _) => ParamValue::Int(i),
                (None, Some(u), _) => ParamValue::Uint(u),
                (_, _, Some(f)) => ParamValue::Double(f),
                _ => {
                    return Err(Error::invalid(format!("{what} parameter '{k}' is not a usable number")));
                }
            },
            other => {
                return Err(Error::invalid(format!(
                    "{what} parameter '{k}' has invalid type: expected a string, number or boolean, got {other}"
                )));
            }
        };
        out.insert(k, value);
    }
    Ok(out)
}

/// A raw binary request (`Inference-Header-Content-Length: 0`): the whole body is the data of
/// the model's only input. Its shape comes from the model (batch 1; one variable dim is inferred
/// from the size), and every output comes back binary.
pub fn decode_raw(
    model: &str,
    version: Option<u64>,
    inputs: &[TensorMetadata],
    batching: bool,
    body: Bytes,
) -> Result<(InferRequest, OutputFormat)> {
    // Triton's words and order: one input, at most one variable dim, BYTES of one element.
    let [input] = inputs else {
        return Err(Error::invalid(format!(
            "[request id: <id_unknown>] Raw request must only have 1 input (found 1) to be deduced but got {} inputs \
             in '{model}' model configuration",
            inputs.len()
        )));
    };
    let mut shape = input.shape.clone();
    if batching {
        shape[0] = 1;
    }
    if shape.iter().filter(|&&d| d < 0).count() > 1 {
        return Err(Error::invalid(format!(
            "[request id: <id_unknown>] The shape of the raw input '{}' can not be deduced because there are more \
             than one variable-sized dimension",
            input.name
        )));
    }
    let data = if input.datatype == DataType::Bytes {
        if element_count(&shape) != Some(1) {
            return Err(Error::invalid(format!(
                "[request id: <id_unknown>] For BYTE datatype raw input '{}', the model must have input shape [1]",
                input.name
            )));
        }
        let mut data = Vec::with_capacity(body.len() + 4);
        crate::tensor::push_bytes_element(&mut data, &body);
        Bytes::from(data)
    } else {
        // The variable dim takes what the body holds, rounded down: a body of another size then
        // fails the byte-size check, as in Triton.
        let size = input.datatype.size().unwrap_or(1);
        let known: usize = shape.iter().filter(|&&d| d >= 0).map(|&d| d as usize).product::<usize>() * size;
        let fill = body.len().checked_div(known).unwrap_or(0) as i64;
        shape.iter_mut().filter(|d| **d < 0).for_each(|d| *d = fill);
        body
    };
    let request = InferRequest {
        model_name: model.to_string(),
        model_version: version,
        inputs: vec![InputTensor::host(input.name.clone(), input.datatype, shape, data)],
        ..Default::default()
    };
    Ok((request, OutputFormat { listed: Vec::new(), default_binary: true }))
}
