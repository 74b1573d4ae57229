//! A model's tensor schema as requests see it, derived once from the effective config: the
//! inputs and outputs with their shapes and labels, and the batch inputs the scheduler makes.
use std::sync::Arc;

use crate::{
    error::{Error, Result},
    proto::inference::{ModelConfig, ModelInput, ModelOutput},
    tensor::DataType,
};

/// One input or output as requests see it.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorSpec {
    pub name: String,
    pub datatype: DataType,
    /// Config dims, without the implicit batch dim; -1 = variable.
    pub dims: Vec<i64>,
    /// The shape the model itself sees (config `reshape`), without the batch dim.
    pub reshape: Option<Vec<i64>>,
    pub optional: bool,
    /// Requests with different shapes of this input may share a batch.
    pub allow_ragged_batch: bool,
    /// Class labels for the classification extension (outputs only), line i = class i.
    pub labels: Arc<Vec<String>>,
}

#[derive(Debug, Clone, PartialEq, Default)]
pub struct Schema {
    /// 0 = the model does not batch; requests' shapes are taken as they are.
    pub max_batch_size: usize,
    pub inputs: Vec<TensorSpec>,
    pub outputs: Vec<TensorSpec>,
    /// BYTES elements must be UTF-8 text (the backend's strings are text, as ONNX's are): checked
    /// per request, so one client's bad string fails only its own request.
    pub utf8_bytes: bool,
    /// Inputs the scheduler makes for each batch it forms (config `batch_input`).
    pub batch_inputs: Vec<BatchInputSpec>,
    /// Outputs split back per request by the shape of an input (config `batch_output`
    /// `BATCH_SCATTER_WITH_INPUT_SHAPE`): (output index, source input index).
    pub scatter_outputs: Vec<(usize, usize)>,
}

/// What a generated batch input holds, per request of the batch (Triton's `BatchInput.Kind`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BatchInputKind {
    ElementCount,
    AccumulatedElementCount,
    AccumulatedElementCountWithZero,
    MaxElementCountAsShape,
    ItemShape,
    ItemShapeFlatten,
}

impl BatchInputKind {
    pub fn from_config(kind: i32) -> Option<BatchInputKind> {
        use BatchInputKind::*;
        Some(match kind {
            0 => ElementCount,
            1 => AccumulatedElementCount,
            2 => AccumulatedElementCountWithZero,
            3 => MaxElementCountAsShape,
            4 => ItemShape,
            5 => ItemShapeFlatten,
            _ => return None,
        })
    }

    pub fn config_name(self) -> &'static str {
        use BatchInputKind::*;
        match self {
            ElementCount => "BATCH_ELEMENT_COUNT",
            AccumulatedElementCount => "BATCH_ACCUMULATED_ELEMENT_COUNT",
            AccumulatedElementCountWithZero => "BATCH_ACCUMULATED_ELEMENT_COUNT_WITH_ZERO",
            MaxElementCountAsShape => "BATCH_MAX_ELEMENT_COUNT_AS_SHAPE",
            ItemShape => "BATCH_ITEM_SHAPE",
            ItemShapeFlatten => "BATCH_ITEM_SHAPE_FLATTEN",
        }
    }
}

/// One generated batch input: the model input `name` of `datatype`, computed from the requests'
/// input `source` (a schema input index).
#[derive(Debug, Clone, PartialEq)]
pub struct BatchInputSpec {
    pub name: String,
    pub kind: BatchInputKind,
    pub datatype: DataType,
    pub source: usize,
}

impl Schema {
    /// Builds the schema from a validated, effective config. `labels` gives each output's label
    /// lines (same order as `config.output`).
    pub fn from_config(config: &ModelConfig, mut labels: Vec<Vec<String>>) -> Result<Schema> {
        labels.resize(config.output.len(), Vec::new());
        let inputs = config.input.iter().map(input_spec).collect::<Result<Vec<_>>>()?;
        let outputs = config.output.iter().zip(labels).map(|(o, l)| output_spec(o, l)).collect::<Result<Vec<_>>>()?;
        let max_batch_size = usize::try_from(config.max_batch_size).unwrap_or(0);
        let source = |names: &[String]| {
            let name = names.first().map_or("", String::as_str);
            inputs
                .iter()
                .position(|t: &TensorSpec| t.name == name)
                .ok_or_else(|| Error::invalid(format!("unknown source input name '{name}'")))
        };
        let mut batch_inputs = Vec::new();
        for b in &config.batch_input {
            let kind = BatchInputKind::from_config(b.kind)
                .ok_or_else(|| Error::invalid(format!("batch input kind {} is not known", b.kind)))?;
            let source = source(&b.source_input)?;
            for name in &b.target_name {
                let datatype = datatype(b.data_type, "batch input", name)?;
                batch_inputs.push(BatchInputSpec { name: name.clone(), kind, datatype, source });
            }
        }
        let mut scatter_outputs = Vec::new();
        for b in &config.batch_output {
            let source = source(&b.source_input)?;
            for name in &b.target_name {
                let at = outputs
                    .iter()
                    .position(|t| &t.name == name)
                    .ok_or_else(|| Error::invalid(format!("unknown target output name '{name}'")))?;
                scatter_outputs.push((at, source));
            }
        }
        Ok(Schema {
            max_batch_size,
            inputs,
            outputs,
            utf8_bytes: config.backend == "onnxruntime",
            batch_inputs,
            scatter_outputs,
        })
    }

    /// Tensors the model holds as scalars where the config says `dims: [1]`: the model sees
    /// them reshaped to `[]` per item, and clients keep seeing `[1]`.
    pub fn with_scalars(mut self, inputs: &[String], outputs: &[String]) -> Schema {
        for (specs, names) in [(&mut self.inputs, inputs), (&mut self.outputs, outputs)] {
            for spec in specs.iter_mut().filter(|s| names.contains(&s.name)) {
                spec.reshape = Some(Vec::new());
            }
        }
        self
    }

    pub fn batching(&self) -> bool {
        self.max_batch_size > 0
    }

    pub fn input_index(&self, name: &str) -> Option<usize> {
        self.inputs.iter().position(|t| t.name == name)
    }

    pub fn output_index(&self, name: &str) -> Option<usize> {
        self.outputs.iter().position(|t| t.name == name)
    }

    /// The input whose shape splits output `index` back per request (`batch_output`).
    pub fn scatter_source(&self, index: usize) -> Option<usize> {
        self.scatter_outputs.iter().find(|(o, _)| *o == index).map(|(_, s)| *s)
    }

    /// What a model returned for output `index`, against its config: the datatype, and bytes
    /// that hold exactly the elements of its shape. The shape itself is the model's (as Triton
    /// passes a Python model's through); a model's process is not trusted to send a
    /// well-formed tensor.
    pub fn check_output(&self, model: &str, index: usize, t: &crate::tensor::Tensor) -> Result<()> {
        let spec = &self.outputs[index];
        let fail = |why: String| Err(Error::internal(format!("model '{model}' output '{}': {why}", spec.name)));
        // The datatype and shape are the model's own, as Triton passes a Python model's
        // through; only what the bytes must hold for them is checked.
        if t.shape.iter().any(|&d| d < 0) {
            return fail(format!("its shape {} has a negative dimension", crate::tensor::shape_string(&t.shape)));
        }
        let elements = crate::tensor::element_count(&t.shape).unwrap_or(usize::MAX);
        let held = match t.datatype.size() {
            Some(size) => t.data.len().is_multiple_of(size).then_some(t.data.len() / size),
            None => crate::tensor::bytes_elements(&t.data).try_fold(0usize, |n, e| e.map(|_| n + 1)).ok(),
        };
        if held != Some(elements) {
            return fail(format!(
                "its {} bytes do not hold the {elements} elements of shape {}",
                t.data.len(),
                crate::tensor::shape_string(&t.shape)
            ));
        }
        Ok(())
    }

    /// The shape as clients see it: `[-1] + dims` for batching models.
    pub fn client_shape(&self, spec: &TensorSpec) -> Vec<i64> {
        let mut shape = Vec::with_capacity(spec.dims.len() + 1);
        if self.batching() {
            shape.push(-1);
        }
        shape.extend_from_slice(&spec.dims);
        shape
    }
}

fn datatype(n: i32, what: &str, name: &str) -> Result<DataType> {
    DataType::from_config(n).ok_or_else(|| Error::invalid(format!("{what} '{name}' has no valid data_type")))
}

fn input_spec(i: &ModelInput) -> Result<TensorSpec> {
    Ok(TensorSpec {
        name: i.name.clone(),
        datatype: datatype(i.data_type, "input", &i.name)?,
        dims: i.dims.clone(),
        reshape: i.reshape.as_ref().map(|r| r.shape.clone()),
        optional: i.optional,
        allow_ragged_batch: i.allow_ragged_batch,
        labels: Arc::default(),
    })
}

fn output_spec(o: &ModelOutput, labels: Vec<String>) -> Result<TensorSpec> {
    Ok(TensorSpec {
        name: o.name.clone(),
        datatype: datatype(o.data_type, "output", &o.name)?,
        dims: o.dims.clone(),
        reshape: o.reshape.as_ref().map(|r| r.shape.clone()),
        optional: false,
        allow_ragged_batch: false,
        labels: Arc::new(labels),
    })
}

#[cfg(test)]
mod tests {
    use bytes::Bytes;

    use super::*;
    use crate::tensor::Tensor;

    fn schema(max_batch_size: usize, datatype: DataType, dims: Vec<i64>) -> Schema {
        let spec = TensorSpec {
            name: "y".into(),
            datatype,
            dims,
            reshape: None,
            optional: false,
            allow_ragged_batch: false,
            labels: Arc::default(),
        };
        Schema { max_batch_size, outputs: vec![spec], ..Default::default() }
    }

    fn tensor(datatype: DataType, shape: Vec<i64>, data: &'static [u8]) -> Tensor {
        Tensor { name: "y".into(), datatype, shape, data: Bytes::from_static(data) }
    }

    #[test]
    fn outputs_a_model_returns_are_checked_against_the_config() {
        let s = schema(4, DataType::Int32, vec![-1, 2]);
        s.check_output("m", 0, &tensor(DataType::Int32, vec![1, 1, 2], &[0; 8])).unwrap();
        // The shape is the model's own, as in Triton.
        s.check_output("m", 0, &tensor(DataType::Int32, vec![3], &[0; 12])).unwrap();
        let e = |t| s.check_output("m", 0, &t).unwrap_err().message().to_string();
        s.check_output("m", 0, &tensor(DataType::Int64, vec![1, 1, 2], &[0; 16])).unwrap();
        assert!(e(tensor(DataType::Int64, vec![1, 1, 2], &[0; 8])).contains("do not hold"));
        assert!(e(tensor(DataType::Int32, vec![1, -1, 2], &[0; 8])).contains("negative dimension"));
        assert!(e(tensor(DataType::Int32, vec![1, 1, 2], &[0; 7])).contains("7 bytes do not hold the 2 elements"));
        let strings = schema(0, DataType::Bytes, vec![2]);
        strings.check_output("m", 0, &tensor(DataType::Bytes, vec![2], b"\x01\0\0\0a\0\0\0\0")).unwrap();
        let bad = strings.check_output("m", 0, &tensor(DataType::Bytes, vec![2], b"\x01\0\0\0a")).unwrap_err();
        assert!(bad.message().contains("do not hold the 2 elements"), "{bad}");
        let cut =
            strings.check_output("m", 0, &tensor(DataType::Bytes, vec![2], b"\x01\0\0\0a\x09\0\0\0")).unwrap_err();
        assert!(cut.message().contains("do not hold"), "{cut}");
    }
}
