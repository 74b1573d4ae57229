//! Embeddings of token arrays (`input: [[101, 2023, …], …]`): a model that takes token ids (the
//! integer input named by `openai_token_input`, else `input_ids`) gets the arrays as rows padded
//! to its fixed length, or to the longest array of the batch for a variable one; its attention
//! mask (`openai_attention_mask_input`, else `attention_mask`) gets ones for tokens and zeros for
//! padding, and a `token_type_ids` input zeros.
use bytes::Bytes;

use super::fields::{dtype, is_int, param};
use crate::{
    proto::inference::{ModelConfig, ModelInput},
    request::InputTensor,
    tensor::DataType,
};

/// Most tokens in one array of a model whose token input has a variable length.
pub const MAX_TOKENS: usize = 65_536;
/// Most tokens one engine request may hold once padded (a few short arrays beside a long one
/// must not make gigabytes of padding).
pub const MAX_PADDED: usize = 1 << 20;

#[derive(Debug, Clone)]
pub struct TokenInputs {
    pub ids: ModelInput,
    pub mask: Option<ModelInput>,
    pub type_ids: Option<ModelInput>,
}

impl TokenInputs {
    /// The token inputs of a model, if it has them; an error when a named one is unusable.
    pub fn of(c: &ModelConfig) -> Result<Option<TokenInputs>, String> {
        let int_input = |name: &str| c.input.iter().find(|i| i.name == name && is_int(dtype(i.data_type)));
        let named = |key: &str, default: &str| -> Result<Option<ModelInput>, String> {
            match param(c, key) {
                Some(n) => int_input(n).cloned().map(Some).ok_or(format!("{key} '{n}' is not an integer input")),
                None => Ok(int_input(default).cloned()),
            }
        };
        let Some(ids) = named("openai_token_input", "input_ids")? else { return Ok(None) };
        let batching = c.max_batch_size > 0;
        let fits = |i: &ModelInput| match i.dims.len() {
            1 => true,
            2 => !batching && i.dims[0] < 0,
            _ => false,
        };
        let mask = named("openai_attention_mask_input", "attention_mask")?;
        let type_ids = int_input("token_type_ids").cloned();
        for i in std::iter::once(&ids).chain(&mask).chain(&type_ids) {
            if !fits(i) || i.dims != ids.dims {
                return Err(format!(
                    "token input '{}' (dims {:?}) must be one row of tokens per text, as the ids' {:?}",
                    i.name, i.dims, ids.dims
                ));
            }
        }
        Ok(Some(TokenInputs { ids, mask, type_ids }))
    }

    pub fn fills(&self, name: &str) -> bool {
        self.ids.name == name
            || self.mask.as_ref().is_some_and(|m| m.name == name)
            || self.type_ids.as_ref().is_some_and(|t| t.name == name)
    }

    /// The fixed row length, if the model has one.
    pub fn fixed_len(&self) -> Option<usize> {
        self.ids.dims.last().filter(|d| **d > 0).map(|d| *d as usize)
    }

    /// How many arrays one request may carry: a batching model's batch; a model that does not
    /// batch but takes a variable count of rows, all of them; else one.
    pub fn rows_per_request(&self, max_batch_size: usize, total: usize) -> usize {
        if max_batch_size > 0 {
            max_batch_size
        } else if self.ids.dims.len() == 2 {
            total
        } else {
            1
        }
    }

    /// The inputs for `rows`, padded to one length. Errors name the array (by its index in the
    /// request, from `first`) that does not fit.
    pub fn inputs(&self, rows: &[Vec<i64>], first: usize, batching: bool) -> Result<Vec<InputTensor>, String> {
        let longest = rows.iter().map(Vec::len).max().unwrap_or(0);
        let width = self.fixed_len().unwrap_or(longest);
        let limit = self.fixed_len().unwrap_or(MAX_TOKENS);
        for (k, row) in rows.iter().enumerate() {
            if row.is_empty() {
                return Err(format!("input[{}] holds no tokens", first + k));
            }
            if let Some(bad) = row.iter().find(|t| **t < 0) {
                return Err(format!("input[{}] holds the token {bad}; token ids are not negative", first + k));
            }
            if row.len() > limit {
                return Err(format!(
                    "input[{}] holds {} tokens; the model takes at most {limit}",
                    first + k,
                    row.len()
                ));
            }
        }
        if rows.len() * width > MAX_PADDED {
            return Err(format!(
                "input[{first}..{}] pads to {} rows of {width} tokens, more than {MAX_PADDED} tokens in one batch; \
                 send arrays of like lengths, or fewer per request",
                first + rows.len(),
                rows.len()
            ));
        }
        let shape = if batching || self.ids.dims.len() == 2 {
            vec![rows.len() as i64, width as i64]
        } else {
            vec![width as i64]
        };
        let tensor = |i: &ModelInput, value: &dyn Fn(&[i64], usize) -> i64| -> Result<InputTensor, String> {
            let d = dtype(i.data_type).ok_or_else(|| format!("input '{}' has no datatype", i.name))?;
            let size = d.size().unwrap_or(8);
            let mut data = Vec::with_capacity(rows.len() * width * size);
            for (k, row) in rows.iter().enumerate() {
                for j in 0..width {
                    let v = value(row, j);
                    let bytes = int_bytes(d, v).ok_or_else(|| {
                        format!("input[{}] holds {v}, which '{}' ({}) cannot", first + k, i.name, d.wire())
                    })?;
                    data.extend_from_slice(&bytes[..size]);
                }
            }
            Ok(InputTensor::host(i.name.clone(), d, shape.clone(), Bytes::from(data)))
        };
        let mut out = vec![tensor(&self.ids, &|row, j| row.get(j).copied().unwrap_or(0))?];
        if let Some(m) = &self.mask {
            out.push(tensor(m, &|row, j| i64::from(j < row.len()))?);
        }
        if let Some(t) = &self.type_ids {
            out.push(tensor(t, &|_, _| 0)?);
        }
        Ok(out)
    }
}

/// `v` as the little-endian bytes of an integer type (the first `size` of the eight), if it fits.
fn int_bytes(d: DataType, v: i64) -> Option<[u8; 8]> {
    let bits = d.size()? as u32 * 8;
    let signed = matches!(d, DataType::Int8 | DataType::Int16 | DataType::Int32 | DataType::Int64);
    let fits = if signed {
        bits == 64 || (-(1i64 << (bits - 1))..(1i64 << (bits - 1))).contains(&v)
    } else {
        v >= 0 && (bits == 64 || v < (1i64 << bits))
    };
    fits.then(|| v.to_le_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn input(name: &str, d: DataType, dims: &[i64]) -> ModelInput {
        ModelInput { name: name.into(), data_type: d.config(), dims: dims.to_vec(), ..Default::default() }
    }

    #[test]
    fn arrays_are_padded_and_masked() {
        let c = ModelConfig {
            max_batch_size: 4,
            input: vec![
                input("input_ids", DataType::Int64, &[-1]),
                input("attention_mask", DataType::Int32, &[-1]),
                input("token_type_ids", DataType::Int64, &[-1]),
            ],
            ..Default::default()
        };
        let t = TokenInputs::of(&c).unwrap().unwrap();
        let got = t.inputs(&[vec![5, 6, 7], vec![9]], 0, true).unwrap();
        assert_eq!(got[0].shape, vec![2, 3]);
        let ids: Vec<i64> = got[0].data.chunks_exact(8).map(|c| i64::from_le_bytes(c.try_into().unwrap())).collect();
        assert_eq!(ids, vec![5, 6, 7, 9, 0, 0]);
        let mask: Vec<i32> = got[1].data.chunks_exact(4).map(|c| i32::from_le_bytes(c.try_into().unwrap())).collect();
        assert_eq!(mask, vec![1, 1, 1, 1, 0, 0]);
        assert!(got[2].data.iter().all(|b| *b == 0));
        assert!(t.inputs(&[vec![]], 3, true).unwrap_err().contains("input[3] holds no tokens"));
        // Many short arrays beside one long one: the padding is bounded, not allocated.
        let mut padded = vec![vec![1]; 2047];
        padded.push(vec![1; MAX_TOKENS]);
        assert!(t.inputs(&padded, 0, true).unwrap_err().contains("more than 1048576 tokens in one batch"));
    }

    #[test]
    fn fixed_lengths_and_ranges_are_kept() {
        let c = ModelConfig {
            max_batch_size: 2,
            input: vec![input("input_ids", DataType::Int32, &[4])],
            ..Default::default()
        };
        let t = TokenInputs::of(&c).unwrap().unwrap();
        assert_eq!(t.inputs(&[vec![1]], 0, true).unwrap()[0].shape, vec![1, 4]);
        assert!(t.inputs(&[vec![1; 5]], 1, true).unwrap_err().contains("input[1] holds 5 tokens"));
        assert!(t.inputs(&[vec![1 << 40]], 0, true).unwrap_err().contains("cannot"));
        let mut named = c.clone();
        named.parameters.insert("openai_token_input".into(), Default::default());
        named.parameters.get_mut("openai_token_input").unwrap().string_value = "nope".into();
        assert!(TokenInputs::of(&named).unwrap_err().contains("'nope' is not an integer input"));
        let none = ModelConfig { input: vec![input("x", DataType::Fp32, &[4])], ..Default::default() };
        assert!(TokenInputs::of(&none).unwrap().is_none());
    }
}
