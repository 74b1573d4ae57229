//! `model_warmup`: the declared samples run on every instance before the version is ready, so the
//! first real requests do not pay for lazy initialisation. Any failure fails the load.
use std::path::Path;

use crate::{
    backend::{BackendInput, ModelInstance},
    proto::inference::{ModelConfig, model_warmup::input::InputDataType},
    tensor::{DataType, element_count},
    validate::model_shape,
};

/// One warmup input, built once and run on every instance.
struct Input {
    name: String,
    datatype: DataType,
    shape: Vec<i64>,
    data: Vec<u8>,
}

/// The inputs of every sample, with how many times each runs.
pub struct Samples(Vec<(String, u32, Vec<Input>)>);

impl Samples {
    /// `scalars`: inputs the model takes as scalars (config `[1]`, model `[]`).
    pub fn build(config: &ModelConfig, dir: &Path, scalars: &[String]) -> Result<Samples, String> {
        let batching = config.max_batch_size > 0;
        let mut samples = Vec::new();
        for w in config.model_warmup.iter().filter(|w| w.batch_size > 0) {
            let fail = |e: String| format!("failed to run warmup sample '{}': {e}", w.name);
            let mut inputs = Vec::new();
            for (name, input) in &w.inputs {
                let spec = config
                    .input
                    .iter()
                    .find(|i| &i.name == name)
                    .ok_or_else(|| fail(format!("unknown input '{name}'")))?;
                let datatype = DataType::from_config(input.data_type)
                    .ok_or_else(|| fail(format!("input '{name}' has no valid data_type")))?;
                let item = match &spec.reshape {
                    Some(r) => model_shape(None, &input.dims, &spec.dims, &r.shape),
                    None if scalars.contains(name) => Vec::new(),
                    None => input.dims.clone(),
                };
                let count =
                    element_count(&input.dims).ok_or_else(|| fail(format!("input '{name}' has invalid dims")))?;
                let one = sample_data(datatype, count, input.input_data_type.as_ref(), dir).map_err(fail)?;
                let rows = if batching { w.batch_size as usize } else { 1 };
                let mut shape = if batching { vec![rows as i64] } else { Vec::new() };
                shape.extend(item);
                inputs.push(Input { name: name.clone(), datatype, shape, data: one.repeat(rows) });
            }
            samples.push((w.name.clone(), w.count.max(1), inputs));
        }
        Ok(Samples(samples))
    }

    pub fn run(&self, instance: &mut dyn ModelInstance, outputs: &[&str]) -> Result<(), String> {
        for (name, count, inputs) in &self.0 {
            let batch: Vec<BackendInput<'_>> = inputs
                .iter()
                .map(|i| BackendInput {
                    name: &i.name,
                    datatype: i.datatype,
                    shape: &i.shape,
                    data: &i.data,
                    device: &[],
                })
                .collect();
            for _ in 0..*count {
                instance.execute(&batch, outputs).map_err(|e| format!("failed to run warmup sample '{name}': {e}"))?;
            }
            tracing::debug!(sample = %name, runs = count, "warmup sample ran");
        }
        Ok(())
    }
}

/// One item's data: zeros, random values, or the bytes of `warmup/<file>`.
fn sample_data(dt: DataType, count: usize, kind: Option<&InputDataType>, dir: &Path) -> Result<Vec<u8>, String> {
    match kind {
        Some(InputDataType::InputDataFile(file)) => {
            // Confined to the model's warmup/ folder, a regular file, and no larger than the
            // input (BYTES inputs: the sample bound).
            let rel = format!("warmup/{file}");
            let expected = dt.size().map(|s| s * count);
            let max = expected.map_or(crate::repository::config::MAX_WARMUP_BYTES, |n| n as u64);
            let data = crate::names::read_inside(dir, &rel, max)?;
            match expected {
                Some(n) if n != data.len() => Err(format!("'{rel}' holds {} bytes, the input needs {n}", data.len())),
                _ => Ok(data),
            }
        }
        Some(InputDataType::RandomData(true)) if dt != DataType::Bytes => Ok(random(dt, count)),
        // Zero data; for BYTES each element is an empty string (a zero length).
        _ => Ok(vec![0u8; dt.size().unwrap_or(4) * count]),
    }
}

/// Values in [0, 1) for floats, small integers otherwise, from a fixed xorshift sequence.
fn random(dt: DataType, count: usize) -> Vec<u8> {
    let mut state = 0x9E37_79B9_7F4A_7C15u64;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    let mut out = Vec::with_capacity(count * dt.size().unwrap_or(1));
    for _ in 0..count {
        let r = next();
        let unit = (r >> 11) as f64 / (1u64 << 53) as f64;
        match dt {
            DataType::Bool => out.push((r & 1) as u8),
            DataType::Fp32 => out.extend((unit as f32).to_le_bytes()),
            DataType::Fp64 => out.extend(unit.to_le_bytes()),
            DataType::Fp16 => out.extend(half::f16::from_f64(unit).to_le_bytes()),
            DataType::Bf16 => out.extend(half::bf16::from_f64(unit).to_le_bytes()),
            other => out.extend(&(r % 100).to_le_bytes()[..other.size().unwrap_or(1)]),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn random_values_fit_their_type() {
        let b = random(DataType::Bool, 64);
        assert!(b.iter().all(|&x| x <= 1));
        let f: Vec<f32> =
            random(DataType::Fp32, 16).chunks(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect();
        assert!(f.iter().all(|v| (0.0..1.0).contains(v)));
        assert_eq!(random(DataType::Int16, 5).len(), 10);
    }
}
