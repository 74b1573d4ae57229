//! The request `ferry tune` sends: one row of every required input, with `--shape` for dims the
//! config leaves variable (else 1), filled with small deterministic values every datatype accepts
//! (floats in [0, 1), integers 0..9 so index inputs stay in range, the string "ferry").
use std::collections::BTreeMap;

use bytes::Bytes;

use crate::{
    model::Schema,
    request::{InferRequest, InputTensor},
    tensor::{DataType, element_count, shape_string},
};

/// The request, and notes on shapes chosen for the user.
pub fn build(
    model: &str,
    schema: &Schema,
    shapes: &BTreeMap<String, Vec<i64>>,
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
        let dims = match shapes.get(&spec.name) {
            Some(s) => {
                let fits =
                    s.len() == spec.dims.len() && s.iter().zip(&spec.dims).all(|(&g, &d)| g > 0 && (d < 0 || d == g));
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
        inputs.push(InputTensor {
            name: spec.name.clone(),
            datatype: spec.datatype,
            shape,
            data: Bytes::from(fill(spec.datatype, count)),
        });
    }
    let request = InferRequest {
        model_name: model.to_string(),
        model_version: None,
        id: String::new(),
        parameters: Default::default(),
        inputs,
        outputs: Vec::new(),
        trace_parent: None,
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
    fn fills_every_datatype_with_the_right_size() {
        for (dt, n) in [(DataType::Fp32, 4), (DataType::Fp16, 2), (DataType::Int64, 8), (DataType::Bool, 1)] {
            assert_eq!(fill(dt, 6).len(), 6 * n, "{dt:?}");
        }
        assert_eq!(fill(DataType::Bytes, 2), b"\x05\0\0\0ferry\x05\0\0\0ferry");
        assert!(fill(DataType::Int64, 100).chunks(8).all(|c| c[0] < 10 && c[1..].iter().all(|&b| b == 0)));
    }
}
