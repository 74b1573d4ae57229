//! Processing steps built into ferry, so pipelines need no Python: image pre-processing, tokenizers and output steps
//! (softmax, top-k with labels, pooling, YOLO boxes with non-maximum suppression), each an ordinary backend
//! configured by the model's `parameters`, batched and composable in ensembles like any model.
use std::{collections::HashMap, fmt::Display, ops::RangeInclusive, str::FromStr};

use bytes::Bytes;

use super::BackendInput;
use crate::{
    error::{Error, Result},
    proto::inference::{ModelConfig, ModelParameter},
    tensor::{DataType, Tensor, push_bytes_element},
};

pub mod image;
pub mod post;
pub mod tokenizer;

/// A model's `parameters`, read with errors that name the model, the key, the value and what is
/// allowed. Keys a backend does not know are refused (a typo is not silently ignored).
pub struct Params<'a> {
    model: &'a str,
    all: &'a HashMap<String, ModelParameter>,
}

impl<'a> Params<'a> {
    pub fn new(config: &'a ModelConfig) -> Self {
        Params { model: &config.name, all: &config.parameters }
    }

    /// A bad value: names the model, the key, the value and what is allowed.
    pub fn fail(&self, key: &str, value: &str, allowed: impl Display) -> Error {
        Error::invalid(format!("model '{}': parameter '{key}' is '{value}'; {allowed}", self.model))
    }

    pub fn model(&self) -> &str {
        self.model
    }

    pub fn text(&self, key: &str) -> Option<&'a str> {
        self.all.get(key).map(|p| p.string_value.trim())
    }

    /// One of `allowed` (by name), else `default`.
    pub fn choice<T: Copy>(&self, key: &str, default: T, allowed: &[(&str, T)]) -> Result<T> {
        let Some(value) = self.text(key) else { return Ok(default) };
        allowed.iter().find(|(name, _)| name.eq_ignore_ascii_case(value)).map(|(_, v)| *v).ok_or_else(|| {
            let names: Vec<&str> = allowed.iter().map(|(n, _)| *n).collect();
            self.fail(key, value, format!("expected one of: {}", names.join(", ")))
        })
    }

    /// A number in `range`, else `default`.
    pub fn number<T>(&self, key: &str, default: T, range: RangeInclusive<T>) -> Result<T>
    where
        T: FromStr + PartialOrd + Display + Copy,
    {
        let Some(value) = self.text(key) else { return Ok(default) };
        let expected = || format!("expected a number from {} to {}", range.start(), range.end());
        let n: T = value.parse().map_err(|_| self.fail(key, value, expected()))?;
        if range.contains(&n) { Ok(n) } else { Err(self.fail(key, value, expected())) }
    }

    pub fn flag(&self, key: &str, default: bool) -> Result<bool> {
        self.choice(key, default, &[("true", true), ("false", false), ("1", true), ("0", false)])
    }

    /// Refuses keys outside `known`.
    pub fn only(&self, known: &[&str]) -> Result<()> {
        let mut unknown: Vec<&String> = self.all.keys().filter(|k| !known.contains(&k.as_str())).collect();
        unknown.sort();
        match unknown.first() {
            None => Ok(()),
            Some(k) => Err(Error::invalid(format!(
                "model '{}': parameter '{k}' is not one this backend reads (it reads: {})",
                self.model,
                known.join(", ")
            ))),
        }
    }
}

/// The values of an FP32 input, whatever the buffer's alignment.
pub fn floats(input: &BackendInput<'_>) -> Result<Vec<f32>> {
    if input.datatype != DataType::Fp32 {
        return Err(Error::invalid(format!("input '{}' must be FP32, got {}", input.name, input.datatype.wire())));
    }
    Ok(input.data.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect())
}

/// The values of a numeric or BOOL input as f32 (attention masks come in any of these).
pub fn as_f32(input: &BackendInput<'_>) -> Result<Vec<f32>> {
    let d = input.data;
    Ok(match input.datatype {
        DataType::Fp32 => return floats(input),
        DataType::Int64 => {
            d.chunks_exact(8).map(|c| i64::from_le_bytes(c.try_into().unwrap_or_default()) as f32).collect()
        }
        DataType::Int32 => {
            d.chunks_exact(4).map(|c| i32::from_le_bytes(c.try_into().unwrap_or_default()) as f32).collect()
        }
        DataType::Bool | DataType::Uint8 | DataType::Int8 => d.iter().map(|&b| f32::from(b)).collect(),
        other => {
            return Err(Error::invalid(format!(
                "input '{}' must be FP32, INT64, INT32, INT8, UINT8 or BOOL, got {}",
                input.name,
                other.wire()
            )));
        }
    })
}

/// The tensors `wanted` names, in that order (what `ModelInstance::execute` returns).
pub fn in_order(mut made: Vec<Tensor>, wanted: &[&str]) -> Result<Vec<Tensor>> {
    wanted
        .iter()
        .map(|name| {
            let at = made.iter().position(|t| t.name == *name).ok_or_else(|| {
                Error::invalid(format!("output '{name}' is not one this step makes from its inputs and parameters"))
            })?;
            Ok(made.swap_remove(at))
        })
        .collect()
}

pub fn f32_tensor(name: &str, shape: Vec<i64>, values: &[f32]) -> Tensor {
    let mut data = Vec::with_capacity(values.len() * 4);
    for v in values {
        data.extend_from_slice(&v.to_le_bytes());
    }
    Tensor { name: name.to_string(), datatype: DataType::Fp32, shape, data: Bytes::from(data) }
}

/// Integers as INT64 or INT32 (whichever the config declares).
pub fn int_tensor(name: &str, datatype: DataType, shape: Vec<i64>, values: &[i64]) -> Tensor {
    let data: Vec<u8> = match datatype {
        DataType::Int32 => values.iter().flat_map(|v| (*v as i32).to_le_bytes()).collect(),
        _ => values.iter().flat_map(|v| v.to_le_bytes()).collect(),
    };
    Tensor { name: name.to_string(), datatype, shape, data: Bytes::from(data) }
}

pub fn bytes_tensor<'b>(name: &str, shape: Vec<i64>, items: impl Iterator<Item = &'b [u8]>) -> Tensor {
    let mut data = Vec::new();
    for item in items {
        push_bytes_element(&mut data, item);
    }
    Tensor { name: name.to_string(), datatype: DataType::Bytes, shape, data: Bytes::from(data) }
}

/// Runs a third-party decoder on untrusted bytes: a panic inside it (a defect of the decoder on
/// input it fails to refuse cleanly) becomes this item's error, so it fails its own request and
/// never the rest of the batch nor the instance.
pub fn contain_panic<T>(
    what: &str,
    f: impl FnOnce() -> std::result::Result<T, String>,
) -> std::result::Result<T, String> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).unwrap_or_else(|panic| {
        Err(format!("cannot decode the {what}: the decoder failed on it ({})", crate::error::panic_message(&*panic)))
    })
}

/// `f` over `items` on up to `threads` threads (scoped: nothing outlives the call), results in
/// order. One thread, or one item, runs on the caller's thread.
pub fn par_map<T: Sync, R: Send>(items: &[T], threads: usize, f: impl Fn(&T) -> R + Sync) -> Vec<R> {
    let threads = threads.min(items.len());
    if threads <= 1 {
        return items.iter().map(f).collect();
    }
    let chunk = items.len().div_ceil(threads);
    let f = &f;
    std::thread::scope(|scope| {
        let mut parts = items.chunks(chunk);
        let first = parts.next().unwrap_or_default();
        let handles: Vec<_> = parts.map(|part| scope.spawn(move || part.iter().map(f).collect::<Vec<R>>())).collect();
        let mut out: Vec<R> = first.iter().map(f).collect();
        for h in handles {
            out.extend(h.join().unwrap_or_else(|p| std::panic::resume_unwind(p)));
        }
        out
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_decoder_panic_is_the_item_s_error() {
        assert_eq!(contain_panic("image", || Ok(3)), Ok(3));
        assert_eq!(contain_panic::<()>("image", || Err("bad".into())), Err("bad".into()));
        let e = contain_panic::<()>("image", || panic!("index out of bounds")).unwrap_err();
        assert_eq!(e, "cannot decode the image: the decoder failed on it (index out of bounds)");
        let n = 7;
        let e = contain_panic::<()>("image", || panic!("row {n} missing")).unwrap_err();
        assert!(e.ends_with("(row 7 missing)"), "{e}");
    }

    fn config(pairs: &[(&str, &str)]) -> ModelConfig {
        let mut c = ModelConfig { name: "post".into(), ..Default::default() };
        for (k, v) in pairs {
            c.parameters.insert(k.to_string(), ModelParameter { string_value: v.to_string() });
        }
        c
    }

    #[test]
    fn parameters_are_read_with_errors_that_name_them() {
        let c = config(&[("k", "7"), ("mode", "Mean"), ("normalize", "no"), ("iou", "1.5")]);
        let p = Params::new(&c);
        assert_eq!(p.number("k", 5usize, 1..=100).unwrap(), 7);
        assert_eq!(p.number("absent", 5usize, 1..=100).unwrap(), 5);
        assert_eq!(p.choice("mode", 0, &[("mean", 1), ("cls", 2)]).unwrap(), 1);
        let e = p.flag("normalize", true).unwrap_err().to_string();
        assert!(e.contains("model 'post': parameter 'normalize' is 'no'; expected one of: true, false"), "{e}");
        let e = p.number("iou", 0.5f32, 0.0..=1.0).unwrap_err().to_string();
        assert!(e.contains("'iou' is '1.5'; expected a number from 0 to 1"), "{e}");
        let e = p.only(&["k", "mode", "normalize"]).unwrap_err().to_string();
        assert!(e.contains("parameter 'iou' is not one this backend reads (it reads: k, mode, normalize)"), "{e}");
    }

    #[test]
    fn inputs_of_any_alignment_and_integer_masks_read_as_floats() {
        let raw: Vec<u8> = [0u8].iter().copied().chain(1.5f32.to_le_bytes()).chain((-2f32).to_le_bytes()).collect();
        let input = BackendInput { name: "x", datatype: DataType::Fp32, shape: &[2], data: &raw[1..], device: &[] };
        assert_eq!(floats(&input).unwrap(), vec![1.5, -2.0]);
        let mask: Vec<u8> = [1i64, 0].iter().flat_map(|v| v.to_le_bytes()).collect();
        let m = BackendInput { name: "mask", datatype: DataType::Int64, shape: &[2], data: &mask, device: &[] };
        assert_eq!(as_f32(&m).unwrap(), vec![1.0, 0.0]);
        let e = floats(&m).unwrap_err().to_string();
        assert!(e.contains("input 'mask' must be FP32, got INT64"), "{e}");
    }

    #[test]
    fn par_map_keeps_order_on_any_thread_count() {
        let items: Vec<u32> = (0..37).collect();
        for threads in [0, 1, 2, 5, 64] {
            assert_eq!(super::par_map(&items, threads, |x| x * 2), items.iter().map(|x| x * 2).collect::<Vec<_>>());
        }
        assert!(super::par_map(&[] as &[u32], 4, |x| *x).is_empty());
    }
}
