//! Which OpenAI operation a model serves, and which of its tensors play which part, read from its
//! config: `parameters` name them (`openai_operation`: `embeddings`, `completions` or `none`;
//! `openai_text_input`, `openai_embedding_output`, `openai_text_output`,
//! `openai_token_count_output`), else they are inferred from names, so that a classifier is
//! never taken for a chat model: text in (the BYTES input `text_input`, else the only BYTES
//! input) and a BYTES output `text_output` (Triton's LLM models' names) is a completions model;
//! text in and one floating-point output named like `*embed*` is an embeddings model. An
//! embeddings model may take token ids instead of (or besides) text: see `tokens`.
use bytes::Bytes;

use super::{
    fields::{dtype, is_float, is_int, param},
    tokens::TokenInputs,
};
use crate::{
    error::{Error, Result},
    model::ChatTemplate,
    proto::inference::{ModelConfig, ModelInput},
    request::InputTensor,
    tensor::{DataType, Tensor},
};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Operation {
    Embeddings,
    Completions,
}

impl Operation {
    pub fn name(self) -> &'static str {
        match self {
            Operation::Embeddings => "embeddings",
            Operation::Completions => "completions",
        }
    }
}

/// The generation inputs the front-end fills when a model has them (Triton's OpenAI front-end's
/// names), besides the text.
pub const GENERATION_INPUTS: &[&str] = &[
    "stream",
    "max_tokens",
    "temperature",
    "top_p",
    "frequency_penalty",
    "presence_penalty",
    "seed",
    "stop_words",
    "sampling_parameters",
    "return_num_input_tokens",
    "return_num_output_tokens",
];

/// Outputs read as token counts when a model has them.
const PROMPT_COUNT_OUTPUTS: &[&str] = &["num_input_tokens", "token_count", "attention_mask"];

#[derive(Debug, Clone)]
pub struct Roles {
    pub operation: Operation,
    /// The text input; a completions model always has one.
    pub text_input: Option<ModelInput>,
    /// The token-id inputs, for embeddings of token arrays.
    pub tokens: Option<TokenInputs>,
    /// The embedding (embeddings) or the text (completions).
    pub output: String,
    /// An output whose elements add up to the prompt's tokens.
    pub prompt_tokens: Option<String>,
    /// An output whose elements add up to the completion's tokens.
    pub completion_tokens: Option<String>,
    pub max_batch_size: usize,
    pub decoupled: bool,
    /// `openai_truncatable_dimensions: true`: embeddings may be cut to `dimensions` (Matryoshka
    /// models) and renormalised.
    pub truncatable: bool,
    pub chat_template: Option<String>,
    /// What the chat template sees as `bos_token` and `eos_token` (parameters of those names).
    pub bos_token: String,
    pub eos_token: String,
    /// The model's other inputs the front-end may fill (by name, as the config declares them).
    pub extra_inputs: Vec<ModelInput>,
}

/// The one item `pick` finds among `names`, preferring `preferred`; None when none or several.
fn only<'a>(names: impl Iterator<Item = &'a str> + Clone, preferred: &str) -> Option<&'a str> {
    if let Some(p) = names.clone().find(|n| *n == preferred) {
        return Some(p);
    }
    let mut it = names;
    match (it.next(), it.next()) {
        (Some(one), None) => Some(one),
        _ => None,
    }
}

/// The one output named like an embedding.
fn embedding_output<'a>(names: impl Iterator<Item = &'a str>) -> Option<&'a str> {
    let mut it = names.filter(|n| n.to_ascii_lowercase().contains("embed"));
    match (it.next(), it.next()) {
        (Some(one), None) => Some(one),
        _ => None,
    }
}

impl Roles {
    /// How `model` (its config, and the chat template saved beside it) maps to an OpenAI
    /// operation; the error says why it does not.
    pub fn of(model: &str, c: &ModelConfig, saved: Option<&ChatTemplate>) -> Result<Roles> {
        let refuse = |why: String| Error::invalid(format!("model '{model}' does not serve the OpenAI API: {why}"));
        let op_param = param(c, "openai_operation");
        if op_param == Some("none") {
            return Err(refuse("its config says openai_operation: none".into()));
        }
        let bytes_inputs =
            c.input.iter().filter(|i| dtype(i.data_type) == Some(DataType::Bytes)).map(|i| i.name.as_str());
        let text_input = match param(c, "openai_text_input") {
            Some(n) => Some(n),
            None => only(bytes_inputs, "text_input"),
        };
        let text_input = text_input
            .and_then(|n| c.input.iter().find(|i| i.name == n && dtype(i.data_type) == Some(DataType::Bytes)))
            .cloned();
        if let (Some(n), None) = (param(c, "openai_text_input"), &text_input) {
            return Err(refuse(format!("openai_text_input '{n}' is not a BYTES input")));
        }
        let mut tokens = TokenInputs::of(c).map_err(refuse)?;
        if text_input.is_none() && tokens.is_none() {
            return Err(refuse(
                "it has neither a single text (BYTES) input nor a token input 'input_ids'; name one with \
                 openai_text_input or openai_token_input"
                    .into(),
            ));
        }
        let text_outputs =
            c.output.iter().filter(|o| dtype(o.data_type) == Some(DataType::Bytes)).map(|o| o.name.as_str());
        let float_outputs = c.output.iter().filter(|o| is_float(dtype(o.data_type))).map(|o| o.name.as_str());
        let operation = match op_param {
            Some("embeddings") => Operation::Embeddings,
            Some("completions" | "chat") => Operation::Completions,
            Some(other) => {
                return Err(refuse(format!("openai_operation '{other}' is none of embeddings, completions, none")));
            }
            None if param(c, "openai_text_output").is_some() => Operation::Completions,
            None if param(c, "openai_embedding_output").is_some() => Operation::Embeddings,
            None if text_outputs.clone().any(|n| n == "text_output") => Operation::Completions,
            None if embedding_output(float_outputs.clone()).is_some() => Operation::Embeddings,
            None => {
                return Err(refuse(
                    "it has neither a text output 'text_output' nor one floating-point output named like 'embedding' \
                     (set openai_operation in its config)"
                        .into(),
                ));
            }
        };
        let output = match operation {
            Operation::Completions => param(c, "openai_text_output").or_else(|| only(text_outputs, "text_output")),
            Operation::Embeddings => param(c, "openai_embedding_output")
                .or_else(|| only(float_outputs.clone(), "embedding"))
                .or_else(|| embedding_output(float_outputs)),
        };
        let output = output
            .filter(|n| c.output.iter().any(|o| o.name == *n))
            .ok_or_else(|| refuse(format!("no output plays the {} part", operation.name())))?
            .to_string();
        if operation == Operation::Completions {
            tokens = None;
        }
        if operation == Operation::Completions && text_input.is_none() {
            return Err(refuse(
                "a completions model needs a text (BYTES) input; name it with openai_text_input".into(),
            ));
        }
        let int_output = |names: &[&str]| {
            c.output
                .iter()
                .find(|o| names.contains(&o.name.as_str()) && is_int(dtype(o.data_type)))
                .map(|o| o.name.clone())
        };
        let prompt_tokens = match param(c, "openai_token_count_output") {
            Some(n) => Some(n.to_string()),
            None => int_output(PROMPT_COUNT_OUTPUTS),
        };
        let prompt = |i: &ModelInput| {
            text_input.as_ref().is_some_and(|t| t.name == i.name) || tokens.as_ref().is_some_and(|t| t.fills(&i.name))
        };
        let extra_inputs: Vec<ModelInput> = c.input.iter().filter(|i| !prompt(i)).cloned().collect();
        for i in &extra_inputs {
            let filled = operation == Operation::Completions && GENERATION_INPUTS.contains(&i.name.as_str());
            if !i.optional && !filled {
                return Err(refuse(format!("its input '{}' has no OpenAI counterpart and is not optional", i.name)));
            }
        }
        Ok(Roles {
            operation,
            text_input,
            tokens,
            output,
            prompt_tokens,
            completion_tokens: int_output(&["num_output_tokens"]),
            max_batch_size: c.max_batch_size.max(0) as usize,
            decoupled: c.model_transaction_policy.as_ref().is_some_and(|p| p.decoupled),
            truncatable: param(c, "openai_truncatable_dimensions").is_some_and(|v| v.eq_ignore_ascii_case("true")),
            chat_template: c
                .parameters
                .get("chat_template")
                .map(|p| p.string_value.clone())
                .filter(|t| !t.is_empty())
                .or_else(|| saved.map(|t| t.template.clone())),
            bos_token: param(c, "bos_token")
                .map(str::to_string)
                .or_else(|| saved.map(|t| t.bos_token.clone()))
                .unwrap_or_default(),
            eos_token: param(c, "eos_token")
                .map(str::to_string)
                .or_else(|| saved.map(|t| t.eos_token.clone()))
                .unwrap_or_default(),
            extra_inputs,
        })
    }

    pub fn extra(&self, name: &str) -> Option<&ModelInput> {
        self.extra_inputs.iter().find(|i| i.name == name)
    }
}

/// The shape of `count` elements of input `i` in one request: the batch dimension first for a
/// batching model (`rows` rows), the first variable dimension taking the elements of a row.
pub fn shape_for(i: &ModelInput, batching: bool, rows: usize, per_row: usize) -> Result<Vec<i64>> {
    let mut dims: Vec<i64> = i.dims.clone();
    let mut placed = per_row == 1;
    for d in dims.iter_mut() {
        if *d < 0 {
            *d = if placed { 1 } else { per_row as i64 };
            placed = true;
        }
    }
    let fixed: i64 = dims.iter().product();
    if !placed || fixed != per_row as i64 {
        return Err(Error::invalid(format!(
            "input '{}' (dims {:?}) cannot take {per_row} element(s) per request",
            i.name, i.dims
        )));
    }
    if batching {
        dims.insert(0, rows as i64);
    } else if rows != 1 {
        return Err(Error::internal("several rows for a model that does not batch"));
    }
    Ok(dims)
}

/// One input holding a single value, converted to the input's datatype.
pub fn scalar_input(i: &ModelInput, batching: bool, value: Scalar) -> Result<InputTensor> {
    let d = dtype(i.data_type).ok_or_else(|| Error::invalid(format!("input '{}' has no datatype", i.name)))?;
    let shown = match &value {
        Scalar::Bool(b) => b.to_string(),
        Scalar::Number(v) => v.to_string(),
        Scalar::Integer(v) => v.to_string(),
        Scalar::Text(t) => format!("the text {t:?}"),
    };
    let bad = || Error::invalid(format!("input '{}' ({}) cannot take {shown}", i.name, d.wire()));
    let data: Vec<u8> = match (d, value) {
        (DataType::Bool, Scalar::Bool(b)) => vec![u8::from(b)],
        (DataType::Bytes, Scalar::Text(ref s)) => {
            let mut buf = Vec::new();
            crate::tensor::push_bytes_element(&mut buf, s.as_bytes());
            buf
        }
        (DataType::Fp32, Scalar::Number(v)) => (v as f32).to_le_bytes().to_vec(),
        (DataType::Fp64, Scalar::Number(v)) => v.to_le_bytes().to_vec(),
        (DataType::Fp16, Scalar::Number(v)) => half::f16::from_f64(v).to_le_bytes().to_vec(),
        (DataType::Bf16, Scalar::Number(v)) => half::bf16::from_f64(v).to_le_bytes().to_vec(),
        (DataType::Int8 | DataType::Int16 | DataType::Int32 | DataType::Int64, Scalar::Integer(v)) => {
            let size = d.size().unwrap_or(8);
            let (lo, hi) = (-(1i128 << (size * 8 - 1)), (1i128 << (size * 8 - 1)) - 1);
            if !(lo..=hi).contains(&v) {
                return Err(Error::invalid(format!("input '{}' ({}) cannot hold {v}", i.name, d.wire())));
            }
            v.to_le_bytes()[..size].to_vec()
        }
        (DataType::Uint8 | DataType::Uint16 | DataType::Uint32 | DataType::Uint64, Scalar::Integer(v)) => {
            let size = d.size().unwrap_or(8);
            if v < 0 || v > (1i128 << (size * 8)) - 1 {
                return Err(Error::invalid(format!("input '{}' ({}) cannot hold {v}", i.name, d.wire())));
            }
            v.to_le_bytes()[..size].to_vec()
        }
        (DataType::Fp32 | DataType::Fp64 | DataType::Fp16 | DataType::Bf16, Scalar::Integer(v)) => {
            return scalar_input(i, batching, Scalar::Number(v as f64));
        }
        (DataType::Int32, Scalar::Number(v)) if v.fract() == 0.0 && v.abs() <= f64::from(i32::MAX) => {
            (v as i32).to_le_bytes().to_vec()
        }
        (DataType::Int64, Scalar::Number(v)) if v.fract() == 0.0 && v.abs() < 9.0e18 => {
            (v as i64).to_le_bytes().to_vec()
        }
        (DataType::Uint32, Scalar::Number(v)) if v.fract() == 0.0 && (0.0..=f64::from(u32::MAX)).contains(&v) => {
            (v as u32).to_le_bytes().to_vec()
        }
        (DataType::Uint64, Scalar::Number(v)) if v.fract() == 0.0 && (0.0..1.8e19).contains(&v) => {
            (v as u64).to_le_bytes().to_vec()
        }
        _ => return Err(bad()),
    };
    let shape = shape_for(i, batching, 1, 1)?;
    Ok(InputTensor::host(i.name.clone(), d, shape, Bytes::from(data)))
}

/// A floating-point output's values as FP32.
pub fn floats(t: &Tensor) -> Result<Vec<f32>> {
    let d = &t.data;
    Ok(match t.datatype {
        DataType::Fp32 => d.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect(),
        DataType::Fp64 => {
            d.chunks_exact(8).map(|c| f64::from_le_bytes(c.try_into().unwrap_or_default()) as f32).collect()
        }
        DataType::Fp16 => d.chunks_exact(2).map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
        DataType::Bf16 => d.chunks_exact(2).map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
        other => return Err(Error::internal(format!("output '{}' is {}, not floating-point", t.name, other.wire()))),
    })
}

/// The sum of an integer output's elements (negative ones count as zero).
pub fn int_sum(t: &Tensor) -> u64 {
    let Some(size) = t.datatype.size().filter(|_| is_int(Some(t.datatype))) else {
        return 0;
    };
    let signed = matches!(t.datatype, DataType::Int8 | DataType::Int16 | DataType::Int32 | DataType::Int64);
    t.data
        .chunks_exact(size)
        .map(|c| {
            let mut b = [0u8; 8];
            b[..size].copy_from_slice(c);
            if signed && c[size - 1] & 0x80 != 0 {
                return 0;
            }
            u64::from_le_bytes(b)
        })
        .fold(0u64, u64::saturating_add)
}

/// A value for a model input.
#[derive(Debug, Clone, PartialEq)]
pub enum Scalar {
    Bool(bool),
    Number(f64),
    /// An integer, exact (a token count, a seed).
    Integer(i128),
    Text(String),
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proto::inference::{ModelOutput, ModelParameter, ModelTransactionPolicy};

    fn input(name: &str, dt: DataType, dims: &[i64]) -> ModelInput {
        ModelInput { name: name.into(), data_type: dt.config(), dims: dims.to_vec(), ..Default::default() }
    }
    fn output(name: &str, dt: DataType, dims: &[i64]) -> ModelOutput {
        ModelOutput { name: name.into(), data_type: dt.config(), dims: dims.to_vec(), ..Default::default() }
    }

    #[test]
    fn roles_are_inferred_or_named() {
        let mut c = ModelConfig {
            max_batch_size: 8,
            input: vec![input("TEXT", DataType::Bytes, &[1])],
            output: vec![output("EMBEDDING", DataType::Fp32, &[4]), output("attention_mask", DataType::Int64, &[-1])],
            ..Default::default()
        };
        let r = Roles::of("e", &c, None).unwrap();
        assert_eq!(r.operation, Operation::Embeddings);
        assert_eq!((r.text_input.as_ref().unwrap().name.as_str(), r.output.as_str()), ("TEXT", "EMBEDDING"));
        assert_eq!(r.prompt_tokens.as_deref(), Some("attention_mask"));
        // A float output not named so is no embedding, unless the config says it is.
        c.output.push(output("OTHER", DataType::Fp32, &[4]));
        assert_eq!(Roles::of("e", &c, None).unwrap().output, "EMBEDDING");
        c.output.remove(0);
        assert!(Roles::of("e", &c, None).unwrap_err().message().contains("neither"));
        c.parameters.insert("openai_embedding_output".into(), ModelParameter { string_value: "OTHER".into() });
        assert_eq!(Roles::of("e", &c, None).unwrap().output, "OTHER");
        c.parameters.insert("openai_operation".into(), ModelParameter { string_value: "none".into() });
        assert!(Roles::of("e", &c, None).is_err());

        let llm = ModelConfig {
            input: vec![
                input("text_input", DataType::Bytes, &[1, 1]),
                input("stream", DataType::Bool, &[1, 1]),
                input("other", DataType::Bytes, &[1]),
            ],
            output: vec![output("text_output", DataType::Bytes, &[1, -1])],
            model_transaction_policy: Some(ModelTransactionPolicy { decoupled: true }),
            ..Default::default()
        };
        // A required input the front-end cannot fill.
        assert!(Roles::of("m", &llm, None).unwrap_err().message().contains("'other'"));
        let mut llm = llm;
        llm.input[2].optional = true;
        let r = Roles::of("m", &llm, None).unwrap();
        assert_eq!(r.operation, Operation::Completions);
        assert!(r.decoupled && r.extra("stream").is_some());
        assert_eq!(r.text_input.as_ref().unwrap().name, "text_input");
    }

    #[test]
    fn shapes_and_scalars_fit_the_config() {
        let i = input("x", DataType::Bytes, &[1]);
        assert_eq!(shape_for(&i, true, 3, 1).unwrap(), vec![3, 1]);
        let v = input("x", DataType::Bytes, &[-1]);
        assert_eq!(shape_for(&v, false, 1, 5).unwrap(), vec![5]);
        assert!(shape_for(&i, false, 1, 5).is_err());
        let t = input("max_tokens", DataType::Int32, &[1, 1]);
        let x = scalar_input(&t, false, Scalar::Number(7.0)).unwrap();
        assert_eq!((x.shape.clone(), x.data.to_vec()), (vec![1, 1], 7i32.to_le_bytes().to_vec()));
        assert!(scalar_input(&t, false, Scalar::Number(1.5)).is_err());
        let seed = input("seed", DataType::Uint64, &[1]);
        let x = scalar_input(&seed, true, Scalar::Integer(9007199254740993)).unwrap();
        assert_eq!(x.data.to_vec(), 9007199254740993u64.to_le_bytes().to_vec());
        assert!(scalar_input(&seed, true, Scalar::Integer(-5)).unwrap_err().message().contains("cannot hold -5"));
        assert!(scalar_input(&t, false, Scalar::Integer(1 << 40)).is_err());
        assert!(scalar_input(&t, false, Scalar::Text("a".into())).is_err());
    }
}
