//! `backend: "ferry_tokenizer"`: Hugging Face tokenizers (`tokenizer.json`, read with the
//! `tokenizers` crate, the code the Python library runs) from the model's version folder.
//!
//! - `direction: encode` (default): text in (BYTES, UTF-8; a second BYTES input makes sentence
//!   pairs; `dims: [ 1 ]` is one text per row and gives `[rows, tokens]`, other dims get the
//!   tokens added as a last dimension), token ids, attention mask and token type ids out (the outputs named by the
//!   `input_ids`, `attention_mask` and `token_type_ids` parameters, those names by default;
//!   INT64 or INT32 as the config declares). The truncation and padding tokenizer.json saved
//!   hold unless parameters override them: `padding`: `longest` (the longest text of the
//!   request) or `max_length`; `max_length` truncates (and pads, with `padding: max_length`);
//!   `add_special_tokens` (true). What a request may cost is bounded: `max_tokens` (2^20) per
//!   request, padding included; a text longer than truncation needs is cut at a word before it
//!   is encoded; and the memory encoding takes is charged to the request's admission ticket.
//! - `direction: decode`: ids in (INT64/INT32 `[..., L]`), text out (BYTES `[...]`),
//!   `skip_special_tokens` (true).
//!
//! Each request is tokenised on its own, so its padding never depends on what it was batched with.
use std::path::Path;

use tokenizers::{
    PaddingStrategy, Tokenizer,
    utils::truncation::{TruncationDirection, TruncationParams},
};

use super::{Params, bytes_tensor, in_order};
use crate::{
    backend::{Answer, Backend, BackendInput, BackendRequest, InstanceSpec, ModelInstance, ModelIo},
    error::{Error, Result},
    proto::inference::ModelConfig,
    request::Context,
    tensor::{DataType, Tensor, bytes_elements},
};

mod encode;
use encode::Encode;

pub struct TokenizerBackend;

/// The largest tokenizer.json read.
const MAX_FILE: u64 = 512 << 20;

const KEYS: &[&str] = &[
    "direction",
    "tokenizer",
    "padding",
    "max_length",
    "add_special_tokens",
    "skip_special_tokens",
    "input_ids",
    "attention_mask",
    "token_type_ids",
    "max_tokens",
];

/// Longest truncation or fixed padding taken from a parameter or a tokenizer.json.
const MAX_LENGTH: usize = 1 << 20;

/// Truncation and fixed padding (`Some(length)`, and the multiple to round up to): the
/// `max_length` and `padding` parameters where given, else what the tokenizer.json saved.
fn sizing(p: &Params<'_>, tok: &Tokenizer, model: &str) -> Result<(Option<TruncationParams>, Fixed)> {
    let multiple = tok.get_padding().and_then(|p| p.pad_to_multiple_of).filter(|&m| m > 0 && m <= MAX_LENGTH);
    let truncation = match p.text("max_length") {
        Some(_) => {
            let n = p.number("max_length", 0usize, 0..=MAX_LENGTH)?;
            (n > 0).then(|| TruncationParams { max_length: n, ..Default::default() })
        }
        None => match tok.get_truncation() {
            Some(t) if t.max_length > MAX_LENGTH => {
                return Err(Error::invalid(format!(
                    "model '{model}': the tokenizer's truncation max_length {} is over {MAX_LENGTH}",
                    t.max_length
                )));
            }
            t => t.cloned(),
        },
    };
    let fixed = match p.choice("padding", None, &[("longest", Some(false)), ("max_length", Some(true))])? {
        Some(true) => match truncation.as_ref() {
            Some(t) => Some(t.max_length),
            None => {
                return Err(Error::invalid(format!(
                    "model '{model}': parameter 'padding' is 'max_length'; it needs 'max_length'"
                )));
            }
        },
        Some(false) => None,
        None => match tok.get_padding().map(|p| &p.strategy) {
            Some(PaddingStrategy::Fixed(n)) if *n > MAX_LENGTH => {
                return Err(Error::invalid(format!(
                    "model '{model}': the tokenizer pads to {n} tokens, over {MAX_LENGTH}"
                )));
            }
            Some(PaddingStrategy::Fixed(n)) => Some(*n),
            _ => None,
        },
    };
    Ok((truncation, Fixed { length: fixed, multiple }))
}

/// How an encoded request is padded: to `length` tokens at least (else to its longest text),
/// rounded up to a `multiple`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Fixed {
    pub length: Option<usize>,
    pub multiple: Option<usize>,
}

enum Direction {
    Encode(Encode),
    /// `longest`: the bytes of the longest token of the vocabulary (what one id may decode to).
    Decode {
        skip_special_tokens: bool,
        output: String,
        longest: usize,
    },
}

struct TokenizerInstance {
    tokenizer: Tokenizer,
    direction: Direction,
    model: String,
}

fn output(config: &ModelConfig, name: &str) -> Result<Option<(String, DataType)>> {
    let Some(o) = config.output.iter().find(|o| o.name == name) else { return Ok(None) };
    match DataType::from_config(o.data_type) {
        Some(t @ (DataType::Int64 | DataType::Int32)) => Ok(Some((o.name.clone(), t))),
        _ => Err(Error::invalid(format!("model '{}': output '{name}' must be TYPE_INT64 or TYPE_INT32", config.name))),
    }
}

impl Backend for TokenizerBackend {
    fn name(&self) -> &'static str {
        "ferry_tokenizer"
    }

    fn model_io(&self, _model_path: &Path) -> Result<ModelIo> {
        Ok(ModelIo::default())
    }

    fn load(&self, spec: &InstanceSpec<'_>) -> Result<Box<dyn ModelInstance>> {
        let config = spec.config;
        let p = Params::new(config);
        p.only(KEYS)?;
        // Instances give the parallelism; the library's own thread pool would take every core.
        tokenizers::utils::parallelism::set_parallelism(false);
        let version = spec.model_path.parent().unwrap_or(spec.model_path);
        let file = p.text("tokenizer").unwrap_or("tokenizer.json");
        let fail = |why: String| Error::invalid(format!("model '{}': tokenizer '{file}': {why}", config.name));
        let data = crate::names::read_inside(version, file, MAX_FILE).map_err(|e| fail(e.to_string()))?;
        let mut tokenizer = Tokenizer::from_bytes(&data).map_err(|e| fail(e.to_string()))?;
        let decode = p.choice("direction", false, &[("encode", false), ("decode", true)])?;
        let direction = if decode {
            let [o] = &config.output[..] else {
                return Err(Error::invalid(format!("model '{}': decode has one TYPE_STRING output", config.name)));
            };
            if DataType::from_config(o.data_type) != Some(DataType::Bytes) {
                return Err(Error::invalid(format!(
                    "model '{}': output '{}' must be TYPE_STRING",
                    config.name, o.name
                )));
            }
            let longest = tokenizer.get_vocab(true).keys().map(String::len).max().unwrap_or(1);
            Direction::Decode {
                skip_special_tokens: p.flag("skip_special_tokens", true)?,
                output: o.name.clone(),
                longest,
            }
        } else {
            // The file's own truncation and padding hold unless a parameter overrides them, as
            // the Python library keeps what tokenizer.json saved.
            let (truncation, fixed) = sizing(&p, &tokenizer, &config.name)?;
            let max_length = truncation.as_ref().map_or(0, |t| t.max_length);
            let cut_from_end = truncation.as_ref().is_none_or(|t| matches!(t.direction, TruncationDirection::Right));
            tokenizer.with_truncation(truncation).map_err(|e| fail(e.to_string()))?;
            // The file's own pad id and side, written into the outputs once their size is checked.
            let pad = encode::pad_of(&tokenizer);
            tokenizer.with_padding(None);
            let named = |key: &str| output(config, p.text(key).unwrap_or(key));
            let e = Encode {
                add_special_tokens: p.flag("add_special_tokens", true)?,
                one_per_row: config.input.first().is_some_and(|i| i.dims.last() == Some(&1)),
                ids: named("input_ids")?,
                mask: named("attention_mask")?,
                types: named("token_type_ids")?,
                max_length,
                fixed,
                pad,
                cuttable: tokenizer.get_pre_tokenizer().is_some() && cut_from_end,
                max_tokens: p.number("max_tokens", 1usize << 20, 1..=1 << 28)?,
            };
            if e.ids.is_none() && e.mask.is_none() && e.types.is_none() {
                return Err(Error::invalid(format!(
                    "model '{}': no output is named 'input_ids', 'attention_mask' or 'token_type_ids' (or what the \
                     parameters of those names say)",
                    config.name
                )));
            }
            Direction::Encode(e)
        };
        Ok(Box::new(TokenizerInstance { tokenizer, direction, model: config.name.clone() }))
    }
}

fn texts<'a>(input: &'a BackendInput<'a>) -> Result<Vec<&'a str>> {
    if input.datatype != DataType::Bytes {
        return Err(Error::invalid(format!("input '{}' must be BYTES, got {}", input.name, input.datatype.wire())));
    }
    bytes_elements(input.data)
        .map(|e| {
            std::str::from_utf8(e?)
                .map_err(|_| Error::invalid(format!("input '{}' holds text that is not UTF-8", input.name)))
        })
        .collect()
}

fn ids_of(input: &BackendInput<'_>) -> Result<Vec<u32>> {
    let d = input.data;
    let wide: Vec<i64> = match input.datatype {
        DataType::Int64 => d.chunks_exact(8).map(|c| i64::from_le_bytes(c.try_into().unwrap_or_default())).collect(),
        DataType::Int32 => {
            d.chunks_exact(4).map(|c| i64::from(i32::from_le_bytes(c.try_into().unwrap_or_default()))).collect()
        }
        t => return Err(Error::invalid(format!("input '{}' must be INT64 or INT32, got {}", input.name, t.wire()))),
    };
    wide.into_iter()
        .map(|v| u32::try_from(v).map_err(|_| Error::invalid(format!("input '{}' holds the token id {v}", input.name))))
        .collect()
}

/// One request's texts to their token outputs, in the order `wanted`.
fn encode(
    (tok, model): (&mut Tokenizer, &str),
    e: &Encode,
    inputs: &[BackendInput<'_>],
    wanted: &[&str],
    ctx: &Context,
) -> Result<Vec<Tensor>> {
    let first = inputs.first().ok_or_else(|| Error::invalid("no text input"))?;
    let a = texts(first)?;
    let b = inputs.get(1).map(texts).transpose()?;
    if let (Some(second), Some(b)) = (inputs.get(1), &b)
        && b.len() != a.len()
    {
        return Err(Error::invalid(format!(
            "inputs '{}' and '{}' hold {} and {} texts; sentence pairs need as many of each",
            first.name,
            second.name,
            a.len(),
            b.len()
        )));
    }
    let mut shape = first.shape.to_vec();
    if e.one_per_row && shape.last() == Some(&1) {
        shape.pop();
    }
    let out =
        e.run(tok, (&a, b.as_deref()), (shape, wanted), ctx).map_err(|err| err.context(format!("model '{model}'")))?;
    in_order(out, wanted)
}

impl TokenizerInstance {
    fn decode(
        &self,
        (skip, longest): (bool, usize),
        output: &str,
        inputs: &[BackendInput<'_>],
        ctx: &Context,
    ) -> Result<Vec<Tensor>> {
        let input = inputs.first().ok_or_else(|| Error::invalid("no ids input"))?;
        let ids = ids_of(input)?;
        // One text per row: the shape without its last dim (ids of length 0 make empty texts).
        let lead = &input.shape[..input.shape.len().saturating_sub(1)];
        let texts = crate::tensor::element_count(lead).unwrap_or(usize::MAX);
        // Each id decodes to at most the vocabulary's longest token (and a space); each text
        // costs its row, its string and its length prefix (64 bytes at most).
        let most =
            (ids.len() as u64).saturating_mul(longest as u64 + 1).saturating_add((texts as u64).saturating_mul(64));
        ctx.charge(most)?;
        let len = match input.shape.last() {
            Some(&l) if l > 0 => l as usize,
            Some(_) => 0,
            None => ids.len(),
        };
        let rows: Vec<&[u32]> = if len == 0 { vec![&[][..]; texts] } else { ids.chunks(len).collect() };
        let text = self
            .tokenizer
            .decode_batch(&rows, skip)
            .map_err(|err| Error::invalid(format!("model '{}': decoding failed: {err}", self.model)))?;
        let shape = input.shape[..input.shape.len().saturating_sub(1)].to_vec();
        Ok(vec![bytes_tensor(output, shape, text.iter().map(|s| s.as_bytes()))])
    }

    fn run(&mut self, inputs: &[BackendInput<'_>], wanted: &[&str], ctx: &Context) -> Result<Vec<Tensor>> {
        match &self.direction {
            Direction::Encode(e) => encode((&mut self.tokenizer, &self.model), e, inputs, wanted, ctx),
            Direction::Decode { skip_special_tokens, output, longest } => {
                self.decode((*skip_special_tokens, *longest), output, inputs, ctx)
            }
        }
    }
}

impl ModelInstance for TokenizerInstance {
    fn runs_anywhere(&self) -> bool {
        true
    }

    fn execute(&mut self, inputs: &[BackendInput<'_>], outputs: &[&str]) -> Result<Vec<Tensor>> {
        self.run(inputs, outputs, &Context::default())
    }

    /// Each request padded to its own longest text, and a bad text fails only its request.
    fn separate_requests(&self) -> bool {
        true
    }

    fn execute_each(&mut self, requests: &[BackendRequest<'_>]) -> Vec<Result<Answer>> {
        requests.iter().map(|r| self.run(&r.inputs, &r.outputs, r.context).map(Answer::from)).collect()
    }
}
