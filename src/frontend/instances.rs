//! The `{"instances": [...], "parameters": {...}}` → `{"predictions": [...]}` format of Vertex AI
//! (and TensorFlow Serving, which SageMaker users also send), mapped onto a model's inputs:
//! - one input: each instance is that input's value for one row (a number, string, nested list,
//!   or `{"b64": "..."}` for bytes); with several inputs, each instance is an object keyed by
//!   input name;
//! - a batching model runs the instances as rows of one request (split by max_batch_size);
//!   a model that does not batch runs each instance as its own request;
//! - each prediction is the instance's row of the output, or an object keyed by output name when
//!   the model has several; bytes that are not UTF-8 come back as `{"b64": "..."}`.
use base64::Engine as _;
use bytes::Bytes;
use serde_json::{Map, Value};

use super::json as codec;
use crate::{
    engine::{Engine, TensorMetadata},
    error::{Error, Result},
    request::{InferRequest, InferResponse, InputTensor},
    tensor::{DataType, Tensor, bytes_elements, push_bytes_element},
};

/// Whether a JSON body is in the instances format (its top level holds `instances`).
pub fn is_instances(body: &[u8]) -> bool {
    serde_json::from_slice::<Map<String, Value>>(body).is_ok_and(|m| m.contains_key("instances"))
}

fn json_shape(v: &Value) -> Vec<i64> {
    match v {
        Value::Array(a) => {
            let mut s = vec![a.len() as i64];
            if let Some(first) = a.first() {
                s.extend(json_shape(first));
            }
            s
        }
        _ => Vec::new(),
    }
}

fn push_bytes(v: &Value, out: &mut Vec<u8>, count: &mut usize) -> std::result::Result<(), String> {
    match v {
        Value::Array(items) => items.iter().try_for_each(|i| push_bytes(i, out, count)),
        Value::String(s) => {
            push_bytes_element(out, s.as_bytes());
            *count += 1;
            Ok(())
        }
        Value::Object(o) if o.len() == 1 && o.contains_key("b64") => {
            let text = o["b64"].as_str().ok_or("'b64' must hold a string")?;
            let raw = base64::engine::general_purpose::STANDARD.decode(text).map_err(|e| format!("bad base64: {e}"))?;
            push_bytes_element(out, &raw);
            *count += 1;
            Ok(())
        }
        other => Err(format!("expected strings or {{\"b64\": ...}}, found {other}")),
    }
}

/// One input's data for several instances, and the shape of one instance's value.
fn input_tensor(spec: &TensorMetadata, values: &[&Value], batching: bool) -> Result<(Vec<i64>, Bytes)> {
    let item = json_shape(values[0]);
    if let Some(i) = values.iter().position(|v| json_shape(v) != item) {
        return Err(Error::invalid(format!(
            "instance {i} gives input '{}' the shape {:?}, but instance 0 gives {item:?}",
            spec.name,
            json_shape(values[i])
        )));
    }
    let mut out = Vec::new();
    let mut count = 0;
    for v in values {
        if spec.datatype == DataType::Bytes {
            push_bytes(v, &mut out, &mut count)
        } else {
            codec::decode_data(&v.to_string(), spec.datatype, &mut out).map(|n| count += n)
        }
        .map_err(|e| Error::invalid(format!("input '{}': {e}", spec.name)))?;
    }
    let per_item = count / values.len().max(1);
    let dims = if batching { &spec.shape[1..] } else { &spec.shape[..] };
    // A flat list or a scalar also fills fixed dims of the same element count ([1] for a scalar).
    let fixed = dims.iter().all(|&d| d >= 0) && dims.iter().product::<i64>() as usize == per_item;
    let item = if fixed && item != dims { dims.to_vec() } else { item };
    Ok((item, Bytes::from(out)))
}

/// The value of each input, per instance.
fn split_inputs<'a>(instances: &'a [Value], inputs: &[TensorMetadata]) -> Result<Vec<Vec<&'a Value>>> {
    let mut per_input: Vec<Vec<&Value>> = vec![Vec::with_capacity(instances.len()); inputs.len()];
    for (i, inst) in instances.iter().enumerate() {
        match (inputs, inst) {
            ([only], Value::Object(o)) if o.contains_key(&only.name) => per_input[0].push(&o[&only.name]),
            ([_], v) => per_input[0].push(v),
            (many, Value::Object(o)) => {
                for (k, spec) in many.iter().enumerate() {
                    let v = o.get(&spec.name).ok_or_else(|| {
                        Error::invalid(format!("instance {i} has no value for input '{}'", spec.name))
                    })?;
                    per_input[k].push(v);
                }
            }
            (many, _) => {
                let names: Vec<&str> = many.iter().map(|m| m.name.as_str()).collect();
                return Err(Error::invalid(format!(
                    "instance {i} must be an object keyed by the model's inputs ({})",
                    names.join(", ")
                )));
            }
        }
    }
    Ok(per_input)
}

fn element(t: &Tensor, i: usize, bytes: &[&[u8]]) -> Value {
    let d = &t.data[..];
    let at = |n: usize| &d[i * n..(i + 1) * n];
    match t.datatype {
        DataType::Bool => Value::Bool(d[i] != 0),
        DataType::Int8 => (d[i] as i8).into(),
        DataType::Uint8 => d[i].into(),
        DataType::Int16 => i16::from_le_bytes(at(2).try_into().expect("2 bytes")).into(),
        DataType::Uint16 => u16::from_le_bytes(at(2).try_into().expect("2 bytes")).into(),
        DataType::Int32 => i32::from_le_bytes(at(4).try_into().expect("4 bytes")).into(),
        DataType::Uint32 => u32::from_le_bytes(at(4).try_into().expect("4 bytes")).into(),
        DataType::Int64 => i64::from_le_bytes(at(8).try_into().expect("8 bytes")).into(),
        DataType::Uint64 => u64::from_le_bytes(at(8).try_into().expect("8 bytes")).into(),
        DataType::Fp16 => f64::from(half::f16::from_le_bytes(at(2).try_into().expect("2 bytes")).to_f32()).into(),
        DataType::Bf16 => f64::from(half::bf16::from_le_bytes(at(2).try_into().expect("2 bytes")).to_f32()).into(),
        DataType::Fp32 => f64::from(f32::from_le_bytes(at(4).try_into().expect("4 bytes"))).into(),
        DataType::Fp64 => f64::from_le_bytes(at(8).try_into().expect("8 bytes")).into(),
        DataType::Bytes => match std::str::from_utf8(bytes[i]) {
            Ok(s) => Value::String(s.to_string()),
            Err(_) => serde_json::json!({"b64": base64::engine::general_purpose::STANDARD.encode(bytes[i])}),
        },
    }
}

/// Nests `flat` into arrays by `shape`.
fn nest(flat: &mut impl Iterator<Item = Value>, shape: &[i64]) -> Value {
    match shape.split_first() {
        None => flat.next().unwrap_or(Value::Null),
        Some((&n, rest)) => Value::Array((0..n.max(0)).map(|_| nest(flat, rest)).collect()),
    }
}

/// Each output as the generate extension answers it: one element as a plain value, several as a
/// flat list.
pub fn flat_outputs(resp: &InferResponse) -> Result<Map<String, Value>> {
    let mut fields = Map::new();
    for t in &resp.outputs {
        let strings: Vec<&[u8]> =
            if t.datatype == DataType::Bytes { bytes_elements(&t.data).collect::<Result<_>>()? } else { Vec::new() };
        let total = t.shape.iter().map(|&d| d.max(0) as usize).product::<usize>();
        let mut all: Vec<Value> = (0..total).map(|i| element(t, i, &strings)).collect();
        let v = if all.len() == 1 { all.remove(0) } else { Value::Array(all) };
        fields.insert(t.name.clone(), v);
    }
    Ok(fields)
}

/// Row `row` of each output (the whole output when `rows` is None), as one prediction.
fn prediction(resp: &InferResponse, row: Option<(usize, usize)>) -> Result<Value> {
    let mut fields = Map::new();
    for t in &resp.outputs {
        let strings: Vec<&[u8]> =
            if t.datatype == DataType::Bytes { bytes_elements(&t.data).collect::<Result<_>>()? } else { Vec::new() };
        let total = t.shape.iter().map(|&d| d.max(0) as usize).product::<usize>();
        let (start, count, shape) = match row {
            Some((r, rows)) => {
                let per = total / rows.max(1);
                (r * per, per, &t.shape[1..])
            }
            None => (0, total, &t.shape[..]),
        };
        let mut flat = (start..start + count).map(|i| element(t, i, &strings));
        fields.insert(t.name.clone(), nest(&mut flat, shape));
    }
    Ok(if fields.len() == 1 {
        fields.into_iter().next().map(|(_, v)| v).unwrap_or(Value::Null)
    } else {
        Value::Object(fields)
    })
}

/// The engine requests an instances body makes: one per chunk of at most `max_batch` instances
/// (one instance per request for a model that does not batch), with how many instances each
/// holds.
pub fn requests(
    model: &str,
    body: &[u8],
    inputs: &[TensorMetadata],
    max_batch: usize,
) -> Result<Vec<(InferRequest, usize)>> {
    let mut doc: Map<String, Value> =
        serde_json::from_slice(body).map_err(|e| Error::invalid(format!("failed to parse the request JSON: {e}")))?;
    let instances = match doc.remove("instances") {
        Some(Value::Array(a)) if !a.is_empty() => a,
        Some(Value::Array(_)) => return Err(Error::invalid("'instances' is empty")),
        _ => return Err(Error::invalid("'instances' must be an array")),
    };
    let parameters = match doc.remove("parameters") {
        None | Some(Value::Null) => Default::default(),
        Some(Value::Object(p)) => codec::parameters(Some(p), "request")?,
        Some(other) => return Err(Error::invalid(format!("'parameters' must be an object, got {other}"))),
    };
    let batching = max_batch > 0;
    let chunk = if batching { max_batch } else { 1 };
    let mut out = Vec::new();
    for part in instances.chunks(chunk) {
        let per_input = split_inputs(part, inputs)?;
        let mut tensors = Vec::with_capacity(inputs.len());
        for (spec, values) in inputs.iter().zip(&per_input) {
            let (item, data) = input_tensor(spec, values, batching)?;
            let mut shape = if batching { vec![part.len() as i64] } else { Vec::new() };
            shape.extend(item);
            tensors.push(InputTensor::host(spec.name.clone(), spec.datatype, shape, data));
        }
        let request = InferRequest {
            model_name: model.to_string(),
            parameters: parameters.clone(),
            inputs: tensors,
            ..Default::default()
        };
        out.push((request, part.len()));
    }
    Ok(out)
}

/// Runs an instances body on `model` and answers `{"predictions": [...]}`.
pub async fn predict(engine: &Engine, model: &str, body: &[u8]) -> Result<Value> {
    let meta = engine.model_metadata(model, None)?;
    let max_batch = engine.model_config(model, None)?.max_batch_size.max(0) as usize;
    let mut predictions = Vec::new();
    for (request, rows) in requests(model, body, &meta.inputs, max_batch)? {
        let resp = engine.infer(request).await?;
        if max_batch > 0 {
            for r in 0..rows {
                predictions.push(prediction(&resp, Some((r, rows)))?);
            }
        } else {
            predictions.push(prediction(&resp, None)?);
        }
    }
    Ok(serde_json::json!({ "predictions": predictions }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shapes_and_nesting() {
        let v: Value = serde_json::json!([[1, 2, 3], [4, 5, 6]]);
        assert_eq!(json_shape(&v), vec![2, 3]);
        let mut flat = (1..=6).map(Value::from);
        assert_eq!(nest(&mut flat, &[2, 3]), v);
        assert!(is_instances(br#"{"instances": [1], "parameters": {}}"#));
        assert!(!is_instances(br#"{"inputs": []}"#));
    }

    #[test]
    fn instance_values_fill_fixed_dims() {
        let spec = TensorMetadata { name: "x".into(), datatype: DataType::Fp32, shape: vec![-1, 4] };
        let a = serde_json::json!([1, 2, 3, 4]);
        let b = serde_json::json!([5, 6, 7, 8]);
        let (item, data) = input_tensor(&spec, &[&a, &b], true).unwrap();
        assert_eq!(item, vec![4]);
        assert_eq!(data.len(), 32);
        let scalar = TensorMetadata { name: "s".into(), datatype: DataType::Int64, shape: vec![-1, 1] };
        let (item, _) = input_tensor(&scalar, &[&Value::from(3)], true).unwrap();
        assert_eq!(item, vec![1]);
        let bad = serde_json::json!([1, 2]);
        assert!(input_tensor(&spec, &[&a, &bad], true).unwrap_err().message().contains("instance 1"));
    }

    #[test]
    fn bytes_take_strings_and_b64() {
        let spec = TensorMetadata { name: "t".into(), datatype: DataType::Bytes, shape: vec![-1, 1] };
        let a = Value::from("hi");
        let b = serde_json::json!({"b64": "AAE="});
        let (_, data) = input_tensor(&spec, &[&a, &b], true).unwrap();
        let elems: Vec<&[u8]> = bytes_elements(&data).map(|e| e.unwrap()).collect();
        assert_eq!(elems, vec![&b"hi"[..], &[0u8, 1][..]]);
    }
}
