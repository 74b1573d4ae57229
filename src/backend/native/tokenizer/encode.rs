//! Encoding with what one request may make the server allocate bounded: a text longer than
//! truncation needs is cut at a word first (when the tokenizer splits words before its model
//! runs, and only once the cut text alone already gives more than `max_length` tokens, so the
//! kept tokens are the same), the work of encoding is charged to the request's admission ticket
//! before it starts, and padding is written straight into the output tensors after the padded
//! size is checked against `max_tokens`.
use bytes::Bytes;
use tokenizers::{EncodeInput, Encoding, Tokenizer, utils::padding::PaddingDirection};

use crate::{
    error::{Error, Result},
    request::Context,
    tensor::{DataType, Tensor},
};

/// What encoding costs in memory per byte of text, at its peak (the library keeps an alignment
/// per byte of normalised text and a token string, offsets and ids per token): measured at 60-80
/// for words, up to 360 where every byte or two is a token of its own (".a.a.a").
pub const WORK_PER_BYTE: u64 = 400;

/// Bytes of text kept, at first, per token `max_length` keeps (doubled while not enough).
const BYTES_PER_TOKEN: usize = 32;

/// An output the config has: its name and datatype.
type Output = Option<(String, DataType)>;
/// What an output holds per token.
type Values = fn(&Encoding) -> &[u32];

/// The padding the tokenizer file asks for.
#[derive(Debug, Clone, Copy)]
pub struct Pad {
    pub id: u32,
    pub type_id: u32,
    pub left: bool,
}

pub struct Encode {
    pub add_special_tokens: bool,
    /// The text input's dims end in 1 (`dims: [ 1 ]`, one text per row): the tokens take that
    /// place in the outputs' shape (`[rows, tokens]`) instead of being added after it.
    pub one_per_row: bool,
    /// (output name, datatype) for ids, mask and type ids, where the config has them.
    pub ids: Output,
    pub mask: Output,
    pub types: Output,
    /// Tokens kept per text (0: all).
    pub max_length: usize,
    /// The length every text is padded to (else to the request's longest).
    pub fixed: super::Fixed,
    pub pad: Pad,
    /// The tokenizer splits words before its model runs: a text may be cut at a word.
    pub cuttable: bool,
    /// Most tokens one request may make, padding included.
    pub max_tokens: usize,
}

/// `text` cut to at most `budget` bytes, at the end of a word when there is one.
fn cut(text: &str, budget: usize) -> &str {
    if text.len() <= budget {
        return text;
    }
    let mut end = budget;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    let head = &text[..end];
    match head.rfind(char::is_whitespace).map(|w| head[..w].trim_end()) {
        Some(words) if !words.is_empty() => words,
        _ => head,
    }
}

impl Encode {
    /// The texts to encode: each cut where the tokenizer allows to a prefix that alone gives more
    /// than `max_length` tokens (so truncation keeps the same ones), or kept whole.
    fn shortened<'t>(&self, tok: &mut Tokenizer, text: &'t str, ctx: &Context) -> Result<&'t str> {
        if !self.cuttable || self.max_length == 0 {
            return Ok(text);
        }
        let mut budget = (self.max_length * BYTES_PER_TOKEN).max(4096);
        loop {
            let head = cut(text, budget);
            if head.len() == text.len() {
                return Ok(text);
            }
            let _work = ctx.hold(head.len() as u64 * WORK_PER_BYTE)?;
            // Counted whole: the library's truncation drops what it cuts off.
            let truncation = tok.get_truncation().cloned();
            tok.with_truncation(None).map_err(|e| Error::internal(e.to_string()))?;
            let probe = tok.encode_fast(head, false);
            tok.with_truncation(truncation).map_err(|e| Error::internal(e.to_string()))?;
            let probe = probe.map_err(|e| Error::invalid(format!("tokenizing failed: {e}")))?;
            if probe.get_ids().len() > self.max_length {
                return Ok(head);
            }
            budget = budget.saturating_mul(2);
        }
    }

    /// Encodes one request's texts (with their pairs) into the outputs `wanted`, shaped `shape`
    /// with the tokens added last.
    pub fn run(
        &self,
        tok: &mut Tokenizer,
        texts: (&[&str], Option<&[&str]>),
        (mut shape, wanted): (Vec<i64>, &[&str]),
        ctx: &Context,
    ) -> Result<Vec<Tensor>> {
        let (a, b) = texts;
        let mut batch: Vec<EncodeInput<'_>> = Vec::with_capacity(a.len());
        let mut bytes = 0u64;
        for (i, t) in a.iter().enumerate() {
            let first = self.shortened(tok, t, ctx)?;
            let second = b.map(|b| self.shortened(tok, b[i], ctx)).transpose()?;
            bytes += (first.len() + second.map_or(0, str::len)) as u64;
            batch.push(match second {
                Some(s) => (first, s).into(),
                None => first.into(),
            });
        }
        let work = ctx.hold(bytes.saturating_mul(WORK_PER_BYTE))?;
        let encodings = tok
            .encode_batch_fast(batch, self.add_special_tokens)
            .map_err(|e| Error::invalid(format!("tokenizing failed: {e}")))?;
        let longest = encodings.iter().map(|e| e.get_ids().len()).max().unwrap_or(0);
        let len = self.fixed.length.map_or(longest, |n| n.max(longest));
        let len = self.fixed.multiple.map_or(len, |m| len.div_ceil(m) * m);
        let total = encodings.len().saturating_mul(len);
        if total > self.max_tokens {
            return Err(Error::invalid(format!(
                "the request's {} texts padded to {len} tokens make {total} tokens, over the limit of {} (parameter \
                 'max_tokens')",
                encodings.len(),
                self.max_tokens
            )));
        }
        shape.push(len as i64);
        let mut out = Vec::new();
        let roles: [(&Output, Values, u32); 3] = [
            (&self.ids, Encoding::get_ids, self.pad.id),
            (&self.mask, Encoding::get_attention_mask, 0),
            (&self.types, Encoding::get_type_ids, self.pad.type_id),
        ];
        for (role, get, pad) in roles {
            let Some((name, t)) = role else { continue };
            if !wanted.contains(&name.as_str()) {
                continue;
            }
            let size = t.size().unwrap_or(8);
            ctx.charge((total * size) as u64)?;
            let data = padded(&encodings, len, (pad, self.pad.left), get, size);
            out.push(Tensor { name: name.clone(), datatype: *t, shape: shape.clone(), data });
        }
        drop((encodings, work));
        Ok(out)
    }
}

/// One value per token of each encoding, padded to `len` with `pad` (on the left or the right),
/// as little-endian integers of `size` bytes.
fn padded(
    encodings: &[Encoding],
    len: usize,
    (pad, left): (u32, bool),
    get: fn(&Encoding) -> &[u32],
    size: usize,
) -> Bytes {
    let mut data = Vec::with_capacity(encodings.len() * len * size);
    let mut put = |v: u32| match size {
        4 => data.extend_from_slice(&(v as i32).to_le_bytes()),
        _ => data.extend_from_slice(&i64::from(v).to_le_bytes()),
    };
    for e in encodings {
        let values = get(e);
        let values = &values[..values.len().min(len)];
        let fill = len - values.len();
        if left {
            (0..fill).for_each(|_| put(pad));
        }
        values.iter().for_each(|&v| put(v));
        if !left {
            (0..fill).for_each(|_| put(pad));
        }
    }
    Bytes::from(data)
}

/// The pad values and side of a tokenizer file (its `padding` section, else id 0 on the right).
pub fn pad_of(tok: &Tokenizer) -> Pad {
    tok.get_padding().map_or(Pad { id: 0, type_id: 0, left: false }, |p| Pad {
        id: p.pad_id,
        type_id: p.pad_type_id,
        left: matches!(p.direction, PaddingDirection::Left),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn texts_are_cut_at_the_end_of_a_word_within_the_budget() {
        assert_eq!(cut("short", 10), "short");
        assert_eq!(cut("one two three", 9), "one two");
        assert_eq!(cut("one two   three", 11), "one two");
        assert_eq!(cut("abcdefghij", 4), "abcd", "no word end: at the budget");
        assert_eq!(cut("ééééé", 3), "é", "never inside a character");
        assert_eq!(cut("   abc", 2), "  ");
    }
}
