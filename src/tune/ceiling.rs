//! The ceiling: the backend alone, in-process, one instance with every core, executing batches of
//! each size back to back (no server, no queue). Rows per second at each batch size show where
//! batching stops paying (the knee), which bounds the batch sizes worth sweeping.
use std::{
    path::Path,
    time::{Duration, Instant},
};

use serde::Serialize;

use crate::{
    backend::{Backend, BackendInput, Device, InstanceSpec},
    proto::inference::ModelConfig,
    request::InferRequest,
};

#[derive(Debug, Clone, Serialize)]
pub struct BatchPoint {
    pub batch: usize,
    pub rows_per_sec: f64,
    pub p50_ms: f64,
}

/// One request's inputs repeated `batch` times along a new first dimension.
fn batched(request: &InferRequest, batch: usize) -> Vec<(String, crate::tensor::DataType, Vec<i64>, Vec<u8>)> {
    request
        .inputs
        .iter()
        .map(|t| {
            let mut shape = t.shape.clone();
            if let Some(first) = shape.first_mut() {
                *first *= batch as i64;
            }
            (t.name.clone(), t.datatype, shape, t.data.repeat(batch))
        })
        .collect()
}

/// Measures each batch size for `slice` (after one untimed run) on `device` (the model's own:
/// a GPU model's ceiling is on its GPU). Runs on the calling thread.
#[allow(clippy::too_many_arguments)]
pub fn measure(
    backend: &dyn Backend,
    device: Device,
    model_path: &Path,
    config: &ModelConfig,
    request: &InferRequest,
    batches: &[usize],
    threads: usize,
    slice: Duration,
) -> Result<Vec<BatchPoint>, String> {
    let mut config = config.clone();
    config.max_batch_size = config.max_batch_size.max(batches.iter().copied().max().unwrap_or(1) as i32);
    let spec = InstanceSpec { model_path, config: &config, device, intra_op_threads: threads, index: 0 };
    let mut instance = backend.load(&spec).map_err(|e| e.to_string())?;
    let outputs: Vec<&str> = config.output.iter().map(|o| o.name.as_str()).collect();
    let mut points = Vec::new();
    for &batch in batches {
        let data = batched(request, batch);
        let inputs: Vec<BackendInput<'_>> = data
            .iter()
            .map(|(name, datatype, shape, bytes)| BackendInput {
                name,
                datatype: *datatype,
                shape,
                data: bytes,
                device: &[],
            })
            .collect();
        instance.execute(&inputs, &outputs).map_err(|e| format!("batch {batch}: {e}"))?;
        let (start, mut times) = (Instant::now(), Vec::new());
        while start.elapsed() < slice {
            let t = Instant::now();
            instance.execute(&inputs, &outputs).map_err(|e| format!("batch {batch}: {e}"))?;
            times.push(t.elapsed().as_secs_f64() * 1e3);
        }
        let elapsed = start.elapsed().as_secs_f64();
        times.sort_by(f64::total_cmp);
        points.push(BatchPoint {
            batch,
            rows_per_sec: (batch * times.len()) as f64 / elapsed,
            p50_ms: super::drive::percentile(&times, 0.5),
        });
    }
    Ok(points)
}

/// The smallest batch whose rows per second reach 90% of the best measured.
pub fn knee(points: &[BatchPoint]) -> Option<usize> {
    let best = points.iter().map(|p| p.rows_per_sec).fold(0.0, f64::max);
    points.iter().find(|p| p.rows_per_sec >= 0.9 * best).map(|p| p.batch)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn knee_is_where_throughput_levels_off() {
        let p = |batch, rows_per_sec| BatchPoint { batch, rows_per_sec, p50_ms: 1.0 };
        let points = [p(1, 100.0), p(2, 190.0), p(4, 330.0), p(8, 380.0), p(16, 400.0)];
        assert_eq!(knee(&points), Some(8));
        assert_eq!(knee(&[]), None);
    }
}
