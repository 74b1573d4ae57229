//! Checks a request against a model version's schema and produces the only type the scheduler
//! accepts. Messages follow Triton's texts and always name the model, the tensor and both values.
use bytes::Bytes;

use crate::{
    device::DeviceBytes,
    error::{Error, Result},
    request::{InferRequest, InputTensor, ParamValue, Parameters},
    schema::{Schema, TensorSpec},
    tensor::{DataType, count_bytes_elements, element_count, shape_string},
};

/// An input ready for a backend: the shape the model sees (batch dim and `reshape` applied).
#[derive(Debug, Clone, PartialEq)]
pub struct ModelTensor {
    pub shape: Vec<i64>,
    pub data: Bytes,
    /// The bytes left on a GPU (a CUDA shared-memory input; `data` is then empty).
    pub device: Option<DeviceBytes>,
}

impl ModelTensor {
    pub fn host(shape: Vec<i64>, data: Bytes) -> Self {
        ModelTensor { shape, data, device: None }
    }

    /// Its size in bytes, wherever they are.
    pub fn byte_len(&self) -> usize {
        self.device.as_ref().map_or(self.data.len(), DeviceBytes::len)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OutputRequest {
    /// Index into the schema's outputs.
    pub index: usize,
    pub classification: Option<u32>,
}

/// A request that passed validation; only this type reaches the scheduler.
#[derive(Debug, Clone, PartialEq)]
pub struct ValidatedRequest {
    pub id: String,
    pub parameters: Parameters,
    /// Rows this request adds to a batch (1 for models that do not batch).
    pub rows: usize,
    /// One entry per schema input; None = an optional input left out.
    pub inputs: Vec<Option<ModelTensor>>,
    /// Outputs to return, in order.
    pub outputs: Vec<OutputRequest>,
    /// Requests share a batch only when their keys are equal: the non-batch shape of every
    /// non-ragged input, with -2 marking an absent optional input.
    pub batch_key: Vec<i64>,
    /// The `priority` parameter: 1 = highest level, 0 = the model's default.
    pub priority: u64,
    /// The `timeout` parameter, in microseconds.
    pub timeout_us: Option<u64>,
    /// The request's trace span (disabled when the request is not traced).
    pub span: tracing::Span,
    /// A decoupled model's responses go here (None: one reply through the scheduler).
    pub stream: Option<crate::request::StreamTx>,
    /// Outputs to write straight into GPU memory (CUDA shared memory), by schema output index;
    /// the reply carries them empty. Set by the engine for models whose instances run on a GPU.
    pub device_outputs: Vec<(usize, DeviceBytes)>,
    pub context: crate::request::Context,
}

pub fn validate(model: &str, schema: &Schema, req: InferRequest) -> Result<ValidatedRequest> {
    check_parameters(&req.parameters)?;
    let priority = uint_parameter(&req.parameters, "priority")?.unwrap_or(0);
    let timeout_us = uint_parameter(&req.parameters, "timeout")?;
    let slots = place_inputs(model, schema, req.inputs)?;
    let rows = batch_rows(model, schema, &slots)?;
    let mut inputs = Vec::with_capacity(slots.len());
    let mut batch_key = Vec::new();
    for (spec, slot) in schema.inputs.iter().zip(slots) {
        match slot {
            None => {
                batch_key.push(-2);
                inputs.push(None);
            }
            Some(t) => {
                let model_tensor = check_input(model, schema, spec, t)?;
                if !spec.allow_ragged_batch {
                    let skip = usize::from(schema.batching());
                    batch_key.extend_from_slice(&model_tensor.shape[skip..]);
                    batch_key.push(-3);
                }
                inputs.push(Some(model_tensor));
            }
        }
    }
    let outputs = select_outputs(model, schema, &req.outputs)?;
    Ok(ValidatedRequest {
        id: req.id,
        parameters: req.parameters,
        rows,
        inputs,
        outputs,
        batch_key,
        priority,
        timeout_us,
        span: tracing::Span::none(),
        stream: None,
        device_outputs: Vec::new(),
        context: req.context,
    })
}

/// A scheduling parameter that must be a non-negative integer.
fn uint_parameter(params: &Parameters, key: &str) -> Result<Option<u64>> {
    match params.get(key) {
        None => Ok(None),
        Some(v) => v.as_u64().map(Some).ok_or_else(|| {
            Error::invalid(format!(
                "invalid value type for '{key}' parameter, expected a non-negative integer, got {v:?}"
            ))
        }),
    }
}

fn check_parameters(params: &Parameters) -> Result<()> {
    if let Some(k) = params.keys().find(|k| k.starts_with("triton_") && *k != "triton_enable_empty_final_response") {
        return Err(Error::invalid(format!(
            "parameter '{k}': keys starting with 'triton_' are reserved for Triton usage and should not be specified."
        )));
    }
    // The sequence parameters keep their kinds, as Triton checks them.
    let kind = |k: &str, expected: &str| {
        Error::invalid(format!("invalid value type for '{k}' parameter, expected {expected}."))
    };
    for k in ["sequence_start", "sequence_end"] {
        if params.get(k).is_some_and(|v| !matches!(v, ParamValue::Bool(_))) {
            return Err(kind(k, "bool_param"));
        }
    }
    match params.get("sequence_id") {
        Some(ParamValue::Int(n)) if *n < 0 => {
            Err(Error::invalid("invalid value for 'sequence_id', expected value >= 0."))
        }
        Some(ParamValue::Bool(_) | ParamValue::Double(_)) => Err(kind("sequence_id", "int64_param or string_param")),
        _ => Ok(()),
    }
}

fn place_inputs(model: &str, schema: &Schema, given: Vec<InputTensor>) -> Result<Vec<Option<InputTensor>>> {
    let mut slots: Vec<Option<InputTensor>> = vec![None; schema.inputs.len()];
    let given_names: Vec<String> = given.iter().map(|t| format!("'{}'", t.name)).collect();
    for t in given {
        let Some(i) = schema.input_index(&t.name) else {
            return Err(Error::invalid(format!("unexpected inference input '{}' for model '{model}'", t.name)));
        };
        if slots[i].is_some() {
            return Err(Error::invalid(format!(
                "input '{}' appears more than once in the request for model '{model}'",
                t.name
            )));
        }
        slots[i] = Some(t);
    }
    let missing: Vec<String> = schema
        .inputs
        .iter()
        .zip(&slots)
        .filter(|(spec, slot)| slot.is_none() && !spec.optional)
        .map(|(spec, _)| format!("'{}'", spec.name))
        .collect();
    if !missing.is_empty() {
        let required = schema.inputs.iter().filter(|s| !s.optional).count();
        let expected = if required == schema.inputs.len() {
            format!("expected {required} inputs")
        } else {
            format!("expected number of inputs between {required} and {}", schema.inputs.len())
        };
        return Err(Error::invalid(format!(
            "{expected} but got {} inputs for model '{model}'. Got input(s) [{}], but missing required input(s) \
             [{}]. Please provide all required input(s).",
            given_names.len(),
            given_names.join(","),
            missing.join(",")
        )));
    }
    Ok(slots)
}

/// The batch size shared by every input (1 for models that do not batch).
fn batch_rows(model: &str, schema: &Schema, slots: &[Option<InputTensor>]) -> Result<usize> {
    if !schema.batching() {
        return Ok(1);
    }
    let mut rows: Option<(i64, &str)> = None;
    for t in slots.iter().flatten() {
        let Some(&b) = t.shape.first() else {
            return Err(Error::invalid(format!(
                "input '{}' has no shape but model requires batch dimension for '{model}'",
                t.name
            )));
        };
        match rows {
            None => rows = Some((b, &t.name)),
            Some((first, _)) if first != b => {
                return Err(Error::invalid(format!(
                    "input '{}' batch size does not match other inputs for '{model}'",
                    t.name
                )));
            }
            Some(_) => {}
        }
    }
    let (b, first) = rows.unwrap_or((1, ""));
    let max = schema.max_batch_size as i64;
    if b < 1 {
        return Err(Error::invalid(format!(
            "inference request batch-size must be >= 1 for '{model}' (input '{first}' has {b} rows in its batch dimension)"
        )));
    }
    if b > max {
        return Err(Error::invalid(format!("inference request batch-size must be <= {max} for '{model}'")));
    }
    Ok(b as usize)
}

fn check_input(model: &str, schema: &Schema, spec: &TensorSpec, t: InputTensor) -> Result<ModelTensor> {
    if t.datatype != spec.datatype {
        return Err(Error::invalid(format!(
            "inference input '{}' data-type is '{}', but model '{model}' expects '{}'",
            t.name,
            t.datatype.wire(),
            spec.datatype.wire()
        )));
    }
    // Triton's order: dim by dim where the ranks agree (-1 unspecified, else against the config),
    // then any other negative dim is invalid.
    let item = if schema.batching() { &t.shape[1..] } else { &t.shape[..] };
    let same_rank = item.len() == spec.dims.len();
    let first_bad = item.iter().zip(&spec.dims).find(|&(&d, &want)| d == -1 || (want != -1 && d != want));
    if same_rank && first_bad.is_some_and(|(&d, _)| d == -1) {
        return Err(Error::invalid(format!(
            "All input dimensions should be specified for input '{}' for model '{model}', got {}",
            t.name,
            shape_string(&t.shape)
        )));
    }
    let fits = same_rank && first_bad.is_none();
    if !fits {
        let note = if schema.batching() {
            "NOTE: Setting a non-zero max_batch_size in the model config requires a batch dimension to be \
             prepended to each input shape. If you want to specify the full shape including the batch dim in your \
             input dims config, try setting max_batch_size to zero. See the model configuration docs for more info \
             on max_batch_size."
        } else {
            ""
        };
        return Err(Error::invalid(format!(
            "unexpected shape for input '{}' for model '{model}'. Expected {}, got {}. {note}",
            t.name,
            shape_string(&schema.client_shape(spec)),
            shape_string(&t.shape)
        )));
    }
    if t.shape.iter().any(|&d| d < 0) {
        return Err(Error::invalid(format!(
            "tensor '{}' contains an invalid dimension {}",
            t.name,
            shape_string(&t.shape)
        )));
    }
    check_byte_size(model, &t, schema.utf8_bytes)?;
    let shape = match &spec.reshape {
        Some(reshape) => model_shape(schema.batching().then(|| t.shape[0]), item, &spec.dims, reshape),
        None => t.shape,
    };
    Ok(ModelTensor { shape, data: t.data, device: t.device })
}

fn check_byte_size(model: &str, t: &InputTensor, utf8: bool) -> Result<()> {
    let too_large = || Error::invalid(format!("shape {} of input '{}' is too large", shape_string(&t.shape), t.name));
    let count = element_count(&t.shape).ok_or_else(too_large)?;
    match t.datatype.size() {
        Some(size) => {
            let expected = count.checked_mul(size).ok_or_else(too_large)?;
            if expected != t.byte_len() {
                return Err(Error::invalid(format!(
                    "input byte size mismatch for input '{}' for model '{model}'. Expected {expected}, got {}",
                    t.name,
                    t.byte_len()
                )));
            }
        }
        None => {
            let got = count_bytes_elements(&t.data)
                .map_err(|e| e.context(format!("input '{}' for model '{model}'", t.name)))?;
            if got < count {
                return Err(Error::invalid(format!(
                    "expected {count} string elements for inference input '{}' for model '{model}', got {got}",
                    t.name
                )));
            }
            if got > count {
                return Err(Error::invalid(format!(
                    "unexpected number of string elements {got} for inference input '{}' for model '{model}', \
                     expecting {count}",
                    t.name
                )));
            }
            if utf8
                && let Some(n) = crate::tensor::bytes_elements(&t.data)
                    .position(|e| e.is_ok_and(|e| std::str::from_utf8(e).is_err()))
            {
                return Err(Error::invalid(format!(
                    "input '{}' for model '{model}': element {n} is not valid UTF-8; this model's strings are text",
                    t.name
                )));
            }
        }
    }
    if t.datatype == DataType::Bool && t.data.iter().any(|&b| b > 1) {
        return Err(Error::invalid(format!(
            "input '{}' for model '{model}': BOOL elements must be the bytes 0 or 1",
            t.name
        )));
    }
    Ok(())
}

/// Maps a request's item shape onto the config `reshape`: each -1 of the reshape takes the
/// request's value of the next variable dim.
pub fn model_shape(batch: Option<i64>, item: &[i64], dims: &[i64], reshape: &[i64]) -> Vec<i64> {
    let mut variable = item.iter().zip(dims).filter(|(_, d)| **d == -1).map(|(v, _)| *v);
    let mut shape: Vec<i64> = batch.into_iter().collect();
    shape.extend(reshape.iter().map(|&r| if r == -1 { variable.next().unwrap_or(-1) } else { r }));
    shape
}

fn select_outputs(
    model: &str,
    schema: &Schema,
    wanted: &[crate::request::RequestedOutput],
) -> Result<Vec<OutputRequest>> {
    if wanted.is_empty() {
        return Ok((0..schema.outputs.len()).map(|index| OutputRequest { index, classification: None }).collect());
    }
    if let Some((i, o)) = wanted.iter().enumerate().find(|(i, o)| wanted[..*i].iter().any(|p| p.name == o.name)) {
        return Err(Error::invalid(format!(
            "output '{}' is requested more than once (at positions {} and {i}) for model '{model}'",
            o.name,
            wanted.iter().position(|p| p.name == o.name).unwrap_or(0)
        )));
    }
    wanted
        .iter()
        .map(|o| {
            let index = schema.output_index(&o.name).ok_or_else(|| {
                Error::invalid(format!("unexpected inference output '{}' for model '{model}'", o.name))
            })?;
            if let Some(k) = o.classification {
                let dt = schema.outputs[index].datatype;
                if matches!(dt, DataType::Fp16 | DataType::Bf16 | DataType::Bool | DataType::Bytes) {
                    return Err(Error::invalid(format!(
                        "class result not available for output '{}' due to unsupported type '{}'",
                        o.name,
                        dt.wire()
                    )));
                }
                if k == 0 {
                    return Err(Error::invalid(format!("classification count for output '{}' must be > 0", o.name)));
                }
            }
            Ok(OutputRequest { index, classification: o.classification })
        })
        .collect()
}

#[cfg(test)]
mod tests;
