//! Ragged batching's helpers (config `batch_input` / `batch_output`): the inputs the scheduler
//! makes for each batch it forms, describing where each request's elements are in the flat
//! ragged tensors, and outputs split back per request by the shape of one of its inputs.
use crate::{
    error::{Error, Result},
    schema::{BatchInputKind, BatchInputSpec, Schema},
    tensor::{DataType, Tensor, bytes_element_offsets, element_count},
    validate::ModelTensor,
};

/// A generated input: its shape and its bytes, 8-byte aligned.
pub struct Generated {
    pub shape: Vec<i64>,
    pub words: Vec<u64>,
    pub len: usize,
}

/// The batch input `spec` for a batch whose requests sent `sources` (the source input of each,
/// None where an optional one was left out).
pub fn generate(spec: &BatchInputSpec, batching: bool, sources: &[Option<&ModelTensor>]) -> Result<Generated> {
    let counts: Vec<i64> =
        sources.iter().map(|t| t.map_or(0, |t| element_count(&t.shape).unwrap_or(0) as i64)).collect();
    let accumulated = || {
        counts.iter().scan(0i64, |sum, c| {
            *sum += c;
            Some(*sum)
        })
    };
    let items = || {
        sources.iter().flatten().flat_map(move |t| {
            let (rows, item) = match (batching, t.shape.split_first()) {
                (true, Some((rows, item))) => (*rows, item),
                _ => (1, &t.shape[..]),
            };
            (0..rows.max(0)).map(move |_| item)
        })
    };
    let (shape, values): (Vec<i64>, Vec<i64>) = match spec.kind {
        BatchInputKind::ElementCount => (vec![counts.len() as i64], counts.clone()),
        BatchInputKind::AccumulatedElementCount => (vec![counts.len() as i64], accumulated().collect()),
        BatchInputKind::AccumulatedElementCountWithZero => {
            (vec![counts.len() as i64 + 1], std::iter::once(0).chain(accumulated()).collect())
        }
        BatchInputKind::MaxElementCountAsShape => {
            let max = counts.iter().copied().max().unwrap_or(0);
            (vec![max], vec![0; max.max(0) as usize])
        }
        BatchInputKind::ItemShape | BatchInputKind::ItemShapeFlatten => {
            let rank = items().map(<[i64]>::len).max().unwrap_or(0);
            if let Some(odd) = items().find(|i| i.len() != rank) {
                return Err(Error::invalid(format!(
                    "batch input '{}' ({}) needs every request's input to have the same rank, got {} and {}",
                    spec.name,
                    spec.kind.config_name(),
                    rank,
                    odd.len()
                )));
            }
            let values: Vec<i64> = items().flatten().copied().collect();
            let count = items().count() as i64;
            let shape = if spec.kind == BatchInputKind::ItemShape {
                vec![count, rank as i64]
            } else {
                vec![values.len() as i64]
            };
            (shape, values)
        }
    };
    let size = spec.datatype.size().unwrap_or(4);
    let len = values.len() * size;
    let mut words = vec![0u64; len.div_ceil(8)];
    let bytes: &mut [u8] = bytemuck::cast_slice_mut(&mut words);
    for (v, out) in values.iter().zip(bytes.chunks_exact_mut(size)) {
        match spec.datatype {
            DataType::Int64 => out.copy_from_slice(&v.to_le_bytes()),
            DataType::Fp32 => out.copy_from_slice(&(*v as f32).to_le_bytes()),
            _ => out.copy_from_slice(&(*v as i32).to_le_bytes()),
        }
    }
    Ok(Generated { shape, words, len })
}

impl Generated {
    pub fn bytes(&self) -> &[u8] {
        &bytemuck::cast_slice(&self.words)[..self.len]
    }
}

/// Each request's element count of `source`, in batch order.
pub fn element_counts<'a>(sources: impl Iterator<Item = Option<&'a ModelTensor>>) -> Vec<usize> {
    sources.map(|t| t.map_or(0, |t| element_count(&t.shape).unwrap_or(0))).collect()
}

/// A scattered output holds exactly the elements of every request's source input.
pub fn check_scatter(model: &str, schema: &Schema, index: usize, t: &Tensor, counts: &[usize]) -> Result<()> {
    let held = element_count(&t.shape).unwrap_or(usize::MAX);
    let want: usize = counts.iter().sum();
    if held == want {
        return Ok(());
    }
    let source = schema.scatter_source(index).map_or("", |s| schema.inputs[s].name.as_str());
    Err(Error::internal(format!(
        "model '{model}' output '{}' has {held} elements, but its batch_output scatters it by input '{source}', \
         whose requests hold {want}",
        schema.outputs[index].name
    )))
}

/// Elements `[first, first + count)` of an output, shaped as the request's source input.
pub fn scatter(t: &Tensor, first: usize, count: usize, shape: &[i64]) -> Result<Tensor> {
    let range = if t.datatype == DataType::Bytes {
        let offsets = bytes_element_offsets(&t.data)?;
        offsets[first]..offsets[first + count]
    } else {
        let size = t.datatype.size().unwrap_or(1);
        first * size..(first + count) * size
    };
    Ok(Tensor { name: t.name.clone(), datatype: t.datatype, shape: shape.to_vec(), data: t.data.slice(range) })
}

#[cfg(test)]
mod tests {
    use bytes::Bytes;

    use super::*;

    fn t(shape: &[i64]) -> ModelTensor {
        let n = element_count(shape).unwrap();
        ModelTensor::host(shape.to_vec(), Bytes::from(vec![0u8; n * 4]))
    }

    fn values(kind: BatchInputKind, sources: &[ModelTensor]) -> (Vec<i64>, Vec<f32>) {
        let spec = BatchInputSpec { name: "B".into(), kind, datatype: DataType::Fp32, source: 0 };
        let refs: Vec<_> = sources.iter().map(Some).collect();
        let g = generate(&spec, true, &refs).unwrap();
        let v = g.bytes().chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect();
        (g.shape, v)
    }

    #[test]
    fn batch_inputs_describe_the_requests_as_triton_makes_them() {
        let ragged = [t(&[1, 2]), t(&[1, 4]), t(&[1, 1]), t(&[1, 3])];
        assert_eq!(values(BatchInputKind::ElementCount, &ragged), (vec![4], vec![2., 4., 1., 3.]));
        assert_eq!(values(BatchInputKind::AccumulatedElementCount, &ragged), (vec![4], vec![2., 6., 7., 10.]));
        assert_eq!(
            values(BatchInputKind::AccumulatedElementCountWithZero, &ragged),
            (vec![5], vec![0., 2., 6., 7., 10.])
        );
        assert_eq!(values(BatchInputKind::MaxElementCountAsShape, &ragged).0, vec![4]);
        let items = [t(&[2, 1, 2]), t(&[1, 1, 2]), t(&[1, 2, 2])];
        assert_eq!(values(BatchInputKind::ItemShape, &items), (vec![4, 2], vec![1., 2., 1., 2., 1., 2., 2., 2.]));
        let flat = [t(&[1, 4, 1]), t(&[1, 1, 2]), t(&[1, 1, 2]), t(&[1, 2, 2])];
        assert_eq!(values(BatchInputKind::ItemShapeFlatten, &flat), (vec![8], vec![4., 1., 1., 2., 1., 2., 2., 2.]));
    }

    #[test]
    fn item_shapes_of_different_ranks_are_refused() {
        let spec =
            BatchInputSpec { name: "B".into(), kind: BatchInputKind::ItemShape, datatype: DataType::Int32, source: 0 };
        let (a, b) = (t(&[1, 2]), t(&[1, 2, 2]));
        let e = generate(&spec, true, &[Some(&a), Some(&b)]).err().unwrap();
        assert!(e.message().contains("same rank"), "{}", e.message());
    }

    #[test]
    fn scatter_splits_by_elements_and_takes_the_inputs_shape() {
        let data: Vec<u8> = (0..10).flat_map(|v| (v as f32).to_le_bytes()).collect();
        let out = Tensor { name: "O".into(), datatype: DataType::Fp32, shape: vec![10], data: Bytes::from(data) };
        let part = scatter(&out, 2, 4, &[1, 4]).unwrap();
        assert_eq!(part.shape, vec![1, 4]);
        let got: Vec<f32> = part.data.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect();
        assert_eq!(got, vec![2., 3., 4., 5.]);
    }
}
