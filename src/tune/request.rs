//! The request `ferry tune` sends: one row of every required input, with `--shape` for dims the
//! config leaves variable (else 1), filled with small deterministic values every datatype accepts
//! (floats in [0, 1), integers 0..9 so index inputs stay in range, the string "ferry"), unless
//! `--input-data` gives the values (perf_analyzer's JSON format; its first entry).
use std::collections::BTreeMap;

use bytes::Bytes;

use crate::{
    request::{InferRequest, InputTensor},
    schema::Schema,
    tensor::{DataType, element_count, shape_string},
};

/// One input's values from perf_analyzer's input-data format: a flat list, or
/// `{"content": [...], "shape": [...]}`; None when the entry does not name the input.
fn given(data: Option<&serde_json::Value>, name: &str) -> Option<(Vec<serde_json::Value>, Option<Vec<i64>>)> {
    let v = data?.get("data")?.as_array()?.first()?.get(name)?;
    let (values, shape) = match v {
        serde_json::Value::Object(o) => (o.get("content")?, o.get("shape")),
        other => (other, None),
    };
    let mut flat = Vec::new();
    fn walk(v: &serde_json::Value, out: &mut Vec<serde_json::Value>) {
        match v {
            serde_json::Value::Array(a) => a.iter().for_each(|x| walk(x, out)),
            x => out.push(x.clone()),
        }
    }
    walk(values, &mut flat);
    let shape = shape.and_then(|s| s.as_array()).map(|a| a.iter().filter_map(serde_json::Value::as_i64).collect());
    Some((flat, shape))
}

/// Values from the input-data file, encoded as the wire carries `datatype`.
fn encode(name: &str, datatype: DataType, values: &[serde_json::Value]) -> Result<Vec<u8>, String> {
    let mut out = Vec::new();
    for (i, v) in values.iter().enumerate() {
        let bad = || format!("--input-data: input '{name}' element {i} ({v}) is not a {}", datatype.wire());
        if datatype == DataType::Bytes {
            let text = match v {
                serde_json::Value::String(s) => s.clone(),
                other => other.to_string(),
            };
            out.extend_from_slice(&(text.len() as u32).to_le_bytes());
            out.extend_from_slice(text.as_bytes());
            continue;
        }
        let f = v.as_f64().or_else(|| v.as_bool().map(f64::from)).ok_or_else(bad)?;
        match datatype {
            DataType::Bool => out.push(u8::from(f != 0.0)),
            DataType::Fp32 => out.extend_from_slice(&(f as f32).to_le_bytes()),
            DataType::Fp64 => out.extend_from_slice(&f.to_le_bytes()),
            DataType::Fp16 => out.extend_from_slice(&half::f16::from_f64(f).to_le_bytes()),
            DataType::Bf16 => out.extend_from_slice(&half::bf16::from_f64(f).to_le_bytes()),
            DataType::Int8 => out.extend_from_slice(&(f as i8).to_le_bytes()),
            DataType::Int16 => out.extend_from_slice(&(f as i16).to_le_bytes()),
            DataType::Int32 => out.extend_from_slice(&(f as i32).to_le_bytes()),
            DataType::Int64 => out.extend_from_slice(&(f as i64).to_le_bytes()),
            DataType::Uint8 => out.push(f as u8),
            DataType::Uint16 => out.extend_from_slice(&(f as u16).to_le_bytes()),
            DataType::Uint32 => out.extend_from_slice(&(f as u32).to_le_bytes()),
            DataType::Uint64 => out.extend_from_slice(&(f as u64).to_le_bytes()),
            DataType::Bytes => unreachable!("handled above"),
        }
    }
    Ok(out)
}

/// The request, and notes on shapes chosen for the user.
pub fn build(
    model: &str,
    schema: &Schema,
    shapes: &BTreeMap<String, Vec<i64>>,
    data: Option<&serde_json::Value>,
) -> Result<(InferRequest, Vec<String>), String> {
    if let Some(unknown) = shapes.keys().find(|k| !schema.inputs.iter().any(|i| &i.name == *k)) {
        let names: Vec<&str> = schema.inputs.iter().map(|i| i.name.as_str()).collect();
        return Err(format!(
            "--shape {unknown}: model '{model}' has no input '{unknown}' (inputs: {})",
            names.join(", ")
        ));
    }
    let mut notes = Vec::new();
    let mut inputs = Vec::new();
    for spec in schema.inputs.iter().filter(|i| !i.optional) {
        let given = given(data, &spec.name);
        let dims =
            match given.as_ref().and_then(|(_, s)| s.clone()).or_else(|| shapes.get(&spec.name).cloned()).as_ref() {
                Some(s) => {
                    let fits = s.len() == spec.dims.len()
                        && s.iter().zip(&spec.dims).all(|(&g, &d)| g > 0 && (d < 0 || d == g));
                    if !fits {
                        return Err(format!(
                            "--shape {}: {} does not fit the input's dims {} (no batch dim; -1 may be any size)",
                            spec.name,
                            shape_string(s),
                            shape_string(&spec.dims)
                        ));
                    }
                    s.clone()
                }
                None if given.is_some() && spec.dims.iter().filter(|&&d| d < 0).count() == 1 => {
                    // One variable dim: whatever the given values leave for it.
                    let n = given.as_ref().map_or(0, |(v, _)| v.len()) as i64;
                    let fixed: i64 = spec.dims.iter().filter(|&&d| d > 0).product();
                    spec.dims.iter().map(|&d| if d < 0 { (n / fixed.max(1)).max(1) } else { d }).collect()
                }
                None => {
                    let dims: Vec<i64> = spec.dims.iter().map(|&d| if d < 0 { 1 } else { d }).collect();
                    if spec.dims.iter().any(|&d| d < 0) {
                        notes.push(format!(
                            "input '{}' has variable dims {}: measuring {} (give --shape {}:<dims> for real sizes)",
                            spec.name,
                            shape_string(&spec.dims),
                            shape_string(&dims),
                            spec.name
                        ));
                    }
                    dims
                }
            };
        let mut shape = dims;
        if schema.max_batch_size > 0 {
            shape.insert(0, 1);
        }
        let count = element_count(&shape).ok_or_else(|| format!("input '{}': shape too large", spec.name))?;
        let bytes = match &given {
            Some((values, _)) if values.len() == count => encode(&spec.name, spec.datatype, values)?,
            Some((values, _)) => {
                return Err(format!(
                    "--input-data: input '{}' has {} values, its shape {} holds {count}",
                    spec.name,
                    values.len(),
                    shape_string(&shape)
                ));
            }
            None => fill(spec.datatype, count),
        };
        inputs.push(InputTensor::host(spec.name.clone(), spec.datatype, shape, Bytes::from(bytes)));
    }
    let request = InferRequest {
        model_name: model.to_string(),
        model_version: None,
        id: String::new(),
        parameters: Default::default(),
        inputs,
        outputs: Vec::new(),
        trace_parent: None,
        context: Default::default(),
    };
    Ok((request, notes))
}

fn fill(datatype: DataType, count: usize) -> Vec<u8> {
    let unit = |i: usize| ((i * 7919) % 1000) as f64 / 1000.0;
    let small = |i: usize| ((i * 7) % 10) as u8;
    let mut out = Vec::new();
    for i in 0..count {
        match datatype {
            DataType::Bytes => {
                out.extend_from_slice(&5u32.to_le_bytes());
                out.extend_from_slice(b"ferry");
            }
            DataType::Bool => out.push(u8::from(i % 2 == 1)),
            DataType::Fp32 => out.extend_from_slice(&(unit(i) as f32).to_le_bytes()),
            DataType::Fp64 => out.extend_from_slice(&unit(i).to_le_bytes()),
            DataType::Fp16 => out.extend_from_slice(&half::f16::from_f64(unit(i)).to_le_bytes()),
            DataType::Bf16 => out.extend_from_slice(&half::bf16::from_f64(unit(i)).to_le_bytes()),
            other => {
                let size = other.size().unwrap_or(1);
                let mut v = vec![0u8; size];
                v[0] = small(i);
                out.extend_from_slice(&v);
            }
        }
    }
    out
}

/// `INPUT0 FP32 [1,16], ...` for the report.
pub fn describe(request: &InferRequest) -> String {
    request
        .inputs
        .iter()
        .map(|t| format!("{} {} {}", t.name, t.datatype.wire(), shape_string(&t.shape)))
        .collect::<Vec<_>>()
        .join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn input_data_in_perf_analyzers_format() {
        let data = serde_json::json!({"data": [{"A": [1, 2, 3, 4], "B": {"content": ["x", "yz"], "shape": [2]}}]});
        let (values, shape) = given(Some(&data), "A").unwrap();
        assert_eq!((values.len(), shape), (4, None));
        assert_eq!(encode("A", DataType::Int32, &values).unwrap(), [1, 0, 0, 0, 2, 0, 0, 0, 3, 0, 0, 0, 4, 0, 0, 0]);
        let (values, shape) = given(Some(&data), "B").unwrap();
        assert_eq!(shape, Some(vec![2]));
        assert_eq!(encode("B", DataType::Bytes, &values).unwrap(), b"\x01\0\0\0x\x02\0\0\0yz");
        assert!(encode("A", DataType::Fp32, &[serde_json::json!("nope")]).unwrap_err().contains("element 0"));
        assert!(given(Some(&data), "C").is_none());
    }

    #[test]
    fn fills_every_datatype_with_the_right_size() {
        for (dt, n) in [(DataType::Fp32, 4), (DataType::Fp16, 2), (DataType::Int64, 8), (DataType::Bool, 1)] {
            assert_eq!(fill(dt, 6).len(), 6 * n, "{dt:?}");
        }
        assert_eq!(fill(DataType::Bytes, 2), b"\x05\0\0\0ferry\x05\0\0\0ferry");
        assert!(fill(DataType::Int64, 100).chunks(8).all(|c| c[0] < 10 && c[1..].iter().all(|&b| b == 0)));
    }
}
