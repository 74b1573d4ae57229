//! The load-time check that a package's batch dimension takes `max_batch_size` rows: a package
//! exported for a fixed batch misreads any other, silently.
use half::{bf16, f16};

use super::AotiInstance;
use crate::{
    backend::{BackendInput, ModelInstance},
    proto::inference::{ModelConfig, model_config::SchedulingChoice},
    tensor::{DataType, element_count},
};

/// Bytes of inputs the batch check makes at most.
const PROBE_BYTES: usize = 16 << 20;

/// One row of each input alone and `max_batch_size` copies of it must give the same answer
/// (tried when every dimension but the batch's is fixed, so that inputs can be made).
pub fn check_batch(instance: &AotiInstance, config: &ModelConfig) -> Result<(), String> {
    let rows = i64::from(config.max_batch_size);
    if instance.least_rows > rows {
        return Err(format!(
            "this package's batch dimension starts at {} rows, more than max_batch_size {rows}",
            instance.least_rows
        ));
    }
    let sequences = matches!(config.scheduling_choice, Some(SchedulingChoice::SequenceBatching(_)));
    if sequences || config.input.iter().any(|i| i.dims.iter().any(|&d| d < 0)) {
        return Ok(());
    }
    let mut one = Vec::new();
    for i in &config.input {
        let Some(datatype) = DataType::from_config(i.data_type) else { return Ok(()) };
        let n = element_count(&i.dims)
            .filter(|&n| n <= 1 << 20)
            .ok_or_else(|| format!("input '{}' is too large to try", i.name))?;
        one.push((i.name.as_str(), datatype, i.dims.clone(), sample(datatype, n)));
    }
    let outputs: Vec<&str> = config.output.iter().map(|o| o.name.as_str()).collect();
    let run = |copies: i64| -> Result<Vec<crate::tensor::Tensor>, String> {
        let data: Vec<Vec<u8>> = one.iter().map(|(_, _, _, d)| d.repeat(copies as usize)).collect();
        let shapes: Vec<Vec<i64>> = one.iter().map(|(_, _, dims, _)| [&[copies][..], dims].concat()).collect();
        let inputs: Vec<BackendInput<'_>> = one
            .iter()
            .zip(&data)
            .zip(&shapes)
            .map(|(((name, datatype, _, _), data), shape)| BackendInput {
                name,
                datatype: *datatype,
                shape,
                data,
                device: &[],
            })
            .collect();
        // A probe on a copy of the instance's plan: execute needs `&mut`, the instance is shared.
        let mut probe = AotiInstance {
            torch: instance.torch.clone(),
            loaded: instance.loaded.clone(),
            inputs: instance.inputs.clone(),
            outputs: instance.outputs.clone(),
            threads: instance.threads,
            batching: true,
            least_rows: instance.least_rows,
            scratch: Vec::new(),
        };
        probe.execute(&inputs, &outputs).map_err(|e| e.message().to_string())
    };
    let single = run(1).map_err(|why| {
        format!(
            "the package cannot run one row of the inputs the configuration declares (their dims and datatypes): {why}"
        )
    })?;
    // The copies tried stay within PROBE_BYTES (a huge max_batch_size is tried as far as that).
    let row_bytes: usize = one.iter().map(|(_, _, _, d)| d.len()).sum::<usize>().max(1);
    let rows = rows.min((PROBE_BYTES / row_bytes).max(1) as i64);
    let fail = |why: String| {
        format!(
            "max_batch_size {} is more than this package's batch dimension takes (export it with a dynamic batch \
             Dim of max >= {0}, or lower max_batch_size): {why}",
            config.max_batch_size
        )
    };
    let many = run(rows).map_err(fail)?;
    for (s, m) in single.iter().zip(&many) {
        let (a, b) = (values(s.datatype, &s.data), values(m.datatype, &m.data));
        let same = m.shape.first() == Some(&rows)
            && b.len() == a.len() * rows as usize
            && b.chunks(a.len().max(1)).all(|row| row.iter().zip(&a).all(|(x, y)| close(*x, *y)));
        if !same {
            return Err(fail(format!("{rows} copies of one row do not give {rows} copies of its answer")));
        }
    }
    Ok(())
}

fn close(x: f64, y: f64) -> bool {
    (x.is_nan() && y.is_nan()) || (x - y).abs() <= 1e-4 + 1e-3 * y.abs()
}

/// `n` values of a datatype: small varied numbers for floats, ones otherwise (a zero would be a
/// divisor's fault, not the package's).
pub fn sample(datatype: DataType, n: usize) -> Vec<u8> {
    let v = |k: usize| ((k * 7919 % 1000) as f64 / 500.0) - 1.0;
    match datatype {
        DataType::Fp32 => (0..n).flat_map(|k| (v(k) as f32).to_le_bytes()).collect(),
        DataType::Fp64 => (0..n).flat_map(|k| v(k).to_le_bytes()).collect(),
        DataType::Fp16 => (0..n).flat_map(|k| f16::from_f64(v(k)).to_le_bytes()).collect(),
        DataType::Bf16 => (0..n).flat_map(|k| bf16::from_f64(v(k)).to_le_bytes()).collect(),
        DataType::Bool | DataType::Uint8 | DataType::Int8 => vec![1; n],
        DataType::Int16 | DataType::Uint16 => (0..n).flat_map(|_| 1u16.to_le_bytes()).collect(),
        DataType::Int32 | DataType::Uint32 => (0..n).flat_map(|_| 1u32.to_le_bytes()).collect(),
        other => (0..n).flat_map(|_| 1u64.to_le_bytes()).take(n * other.size().unwrap_or(8)).collect(),
    }
}

/// A tensor's values as f64s, for comparing.
fn values(datatype: DataType, data: &[u8]) -> Vec<f64> {
    let size = datatype.size().unwrap_or(1);
    data.chunks_exact(size)
        .map(|c| match datatype {
            DataType::Fp32 => f32::from_le_bytes(c.try_into().unwrap_or_default()) as f64,
            DataType::Fp64 => f64::from_le_bytes(c.try_into().unwrap_or_default()),
            DataType::Fp16 => f16::from_le_bytes(c.try_into().unwrap_or_default()).to_f64(),
            DataType::Bf16 => bf16::from_le_bytes(c.try_into().unwrap_or_default()).to_f64(),
            _ => c.iter().rev().fold(0u64, |acc, &b| (acc << 8) | u64::from(b)) as f64,
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn samples_read_back_as_their_values() {
        for t in [DataType::Fp32, DataType::Fp64, DataType::Fp16, DataType::Bf16] {
            let v = values(t, &sample(t, 5));
            assert_eq!(v.len(), 5);
            assert!(v.iter().all(|x| (-1.0..=1.0).contains(x)), "{t:?} {v:?}");
            assert!(v.iter().any(|x| *x != 0.0));
        }
        assert_eq!(values(DataType::Int64, &sample(DataType::Int64, 3)), [1.0; 3]);
        assert_eq!(values(DataType::Int32, &sample(DataType::Int32, 2)), [1.0; 2]);
        assert_eq!(values(DataType::Int16, &[1, 1]), [257.0]);
    }

    #[test]
    fn closeness_allows_float_noise_only() {
        assert!(close(1.0, 1.0 + 1e-6));
        assert!(close(f64::NAN, f64::NAN));
        assert!(!close(1.0, 1.1));
    }
}
