//! A generate body → the engine request, as Triton converts it: keys in document order (duplicates
//! kept, so a repeated input is refused), a key named like a model input becomes that input (its
//! shape fitted to the model's), `parameters` is read by the same rules one level down, and any
//! other key becomes a request parameter. Type errors keep Triton's words and its status (500 for
//! what its JSON reader refuses, 400 for the rest).
use std::fmt;

use bytes::Bytes;
use serde::de::{self, Deserialize, DeserializeSeed, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde_json::value::RawValue;

use crate::{
    engine::TensorMetadata,
    error::{Error, Result},
    request::{InputTensor, ParamValue, Parameters},
    tensor::{DataType, push_bytes_element},
};

/// An object's entries in document order, repeated keys kept; each value is still JSON text,
/// read only as far as its use needs (a large input is decoded straight into tensor bytes).
struct Entries(Vec<(String, Box<RawValue>)>);

impl<'de> Deserialize<'de> for Entries {
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Entries, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Entries;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> std::result::Result<Entries, A::Error> {
                let mut entries = Vec::new();
                while let Some((k, v)) = map.next_entry::<String, Box<RawValue>>()? {
                    entries.push((k, v));
                }
                Ok(Entries(entries))
            }
        }
        d.deserialize_map(V)
    }
}

/// The entries of a JSON object text; `not_object` when it is valid JSON of another kind.
fn entries(text: &[u8], not_object: &str) -> Result<Vec<(String, Box<RawValue>)>> {
    match serde_json::from_slice::<Entries>(text) {
        Ok(e) => Ok(e.0),
        Err(_) if serde_json::from_slice::<IgnoredAny>(text).is_ok() => Err(Error::invalid(not_object.to_string())),
        Err(e) => Err(Error::invalid(format!("failed to parse the request JSON buffer: {e}"))),
    }
}

/// A parameter's (or the id's) value: a scalar, or something else (skipped unread).
#[derive(Debug, Clone, PartialEq)]
enum Scalar {
    Bool(bool),
    Int(i64),
    Double(f64),
    Str(String),
    Other,
}

impl<'de> Deserialize<'de> for Scalar {
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Scalar, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Scalar;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a JSON value")
            }
            fn visit_unit<E: de::Error>(self) -> std::result::Result<Scalar, E> {
                Ok(Scalar::Other)
            }
            fn visit_bool<E: de::Error>(self, v: bool) -> std::result::Result<Scalar, E> {
                Ok(Scalar::Bool(v))
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> std::result::Result<Scalar, E> {
                Ok(Scalar::Int(v))
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> std::result::Result<Scalar, E> {
                Ok(i64::try_from(v).map_or(Scalar::Double(v as f64), Scalar::Int))
            }
            fn visit_f64<E: de::Error>(self, v: f64) -> std::result::Result<Scalar, E> {
                Ok(Scalar::Double(v))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> std::result::Result<Scalar, E> {
                Ok(Scalar::Str(v.to_string()))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> std::result::Result<Scalar, A::Error> {
                while seq.next_element::<IgnoredAny>()?.is_some() {}
                Ok(Scalar::Other)
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> std::result::Result<Scalar, A::Error> {
                while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
                Ok(Scalar::Other)
            }
        }
        d.deserialize_any(V)
    }
}

fn scalar(raw: &RawValue) -> Scalar {
    serde_json::from_str(raw.get()).unwrap_or(Scalar::Other)
}

/// What a generate body asks for.
#[derive(Debug, Default)]
pub struct Converted {
    pub id: String,
    pub parameters: Parameters,
    pub inputs: Vec<InputTensor>,
}

/// Reads a generate body against the model's inputs (`inputs`, with the metadata's shapes:
/// `-1` first for a batching model).
pub fn convert(body: &[u8], inputs: &[TensorMetadata]) -> Result<Converted> {
    let entries = entries(body, "attempt to get members for non-object")?;
    let mut out = Converted::default();
    if let Some((_, id)) = entries.iter().find(|(k, _)| k == "id") {
        match scalar(id) {
            Scalar::Str(s) => out.id = s,
            _ => return Err(Error::invalid("Unable to parse 'id': attempt to access JSON non-string as string")),
        }
    }
    walk(&entries, inputs, &mut out, true)?;
    Ok(out)
}

fn walk(entries: &[(String, Box<RawValue>)], inputs: &[TensorMetadata], out: &mut Converted, top: bool) -> Result<()> {
    for (key, value) in entries {
        if top && key == "parameters" {
            if inputs.iter().any(|i| i.name == "parameters") {
                return Err(Error::invalid("Keyword 'parameters' for nested schema also given as input tensor name"));
            }
            let inner = self::entries(
                value.get().as_bytes(),
                "Expected JSON object for keyword: 'parameters': attempt to access JSON non-object as object",
            )?;
            walk(&inner, inputs, out, false).map_err(|e| e.context("Converting keyword: 'parameters'"))?;
        } else if let Some(spec) = inputs.iter().find(|i| &i.name == key) {
            if out.inputs.iter().any(|t| &t.name == key) {
                let id = if out.id.is_empty() { "<id_unknown>" } else { &out.id };
                return Err(Error::invalid(format!("[request id: {id}] input '{key}' already exists in request")));
            }
            out.inputs.push(tensor(spec, value)?);
        } else {
            out.parameters.insert(key.clone(), parameter(key, value)?);
        }
    }
    Ok(())
}

fn parameter(key: &str, value: &RawValue) -> Result<ParamValue> {
    Ok(match scalar(value) {
        Scalar::Str(s) => ParamValue::String(s),
        Scalar::Int(v) => ParamValue::Int(v),
        Scalar::Bool(b) => ParamValue::Bool(b),
        Scalar::Double(v) => ParamValue::Double(v),
        Scalar::Other => {
            return Err(Error::invalid(format!(
                "parameter '{key}' has invalid type. It should be either 'int', 'bool', or 'string'."
            )));
        }
    })
}

/// One input from its JSON value: every leaf an element of the model's datatype, written
/// straight into the tensor's bytes, the top-level count fitted into the model's shape.
fn tensor(spec: &TensorMetadata, value: &RawValue) -> Result<InputTensor> {
    let key = &spec.name;
    if matches!(spec.datatype, DataType::Fp16 | DataType::Bf16) {
        return Err(Error::invalid(format!(
            "receiving {} data via JSON is not supported. Please use the binary data format for input {key}",
            spec.datatype.wire()
        )));
    }
    let mut data = Vec::new();
    let (mut leaves, mut count, mut failed) = (0usize, None, None);
    let walk = Elements {
        datatype: spec.datatype,
        out: &mut data,
        leaves: &mut leaves,
        top: Some(&mut count),
        failed: &mut failed,
    };
    let mut de = serde_json::Deserializer::from_str(value.get());
    if let Err(e) = walk.deserialize(&mut de) {
        return Err(Error::invalid(failed.unwrap_or_else(|| format!("Unable to parse 'data': {e}"))));
    }
    let count = count.unwrap_or(1);
    if count == 0 {
        return Ok(InputTensor::host(key.clone(), spec.datatype, Vec::new(), Bytes::new()));
    }
    // The shape is fitted to the top-level count; nested leaves must match it.
    if spec.datatype != DataType::Bytes && leaves != count {
        return Err(Error::invalid("Unable to parse 'data': Shape does not match true shape of 'data' field"));
    }
    let shape = fit(&spec.shape, count).ok_or_else(|| {
        Error::invalid(format!("The schema can not convert input '{key}' to tensor with proper shape"))
    })?;
    Ok(InputTensor::host(key.clone(), spec.datatype, shape, Bytes::from(data)))
}

/// Walks an input's value depth-first, each leaf one element; `top` takes the top-level array's
/// length. A leaf of the wrong kind sets `failed` (Triton's words) and stops the walk.
struct Elements<'a> {
    datatype: DataType,
    out: &'a mut Vec<u8>,
    leaves: &'a mut usize,
    top: Option<&'a mut Option<usize>>,
    failed: &'a mut Option<String>,
}

impl Elements<'_> {
    fn leaf<E: de::Error>(self, leaf: Leaf<'_>) -> std::result::Result<(), E> {
        *self.leaves += 1;
        let done = if self.datatype == DataType::Bytes {
            match leaf {
                Leaf::Str(s) => {
                    push_bytes_element(self.out, s.as_bytes());
                    Ok(())
                }
                _ => Err("Unable to parse JSON bytes array: attempt to access JSON non-string as string".to_string()),
            }
        } else {
            push_element(self.datatype, &leaf, self.out).map_err(|why| format!("Unable to parse 'data': {why}"))
        };
        done.map_err(|why| {
            *self.failed = Some(why);
            E::custom("")
        })
    }
}

impl<'de> DeserializeSeed<'de> for Elements<'_> {
    type Value = ();
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> std::result::Result<(), D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Elements<'_> {
    type Value = ();
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("elements, or arrays of them")
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> std::result::Result<(), A::Error> {
        let mut n = 0;
        while seq
            .next_element_seed(Elements {
                datatype: self.datatype,
                out: &mut *self.out,
                leaves: &mut *self.leaves,
                top: None,
                failed: &mut *self.failed,
            })?
            .is_some()
        {
            n += 1;
        }
        if let Some(top) = self.top {
            *top = Some(n);
        }
        Ok(())
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> std::result::Result<(), A::Error> {
        while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
        self.leaf(Leaf::Other)
    }
    fn visit_unit<E: de::Error>(self) -> std::result::Result<(), E> {
        self.leaf(Leaf::Other)
    }
    fn visit_bool<E: de::Error>(self, v: bool) -> std::result::Result<(), E> {
        self.leaf(Leaf::Bool(v))
    }
    fn visit_i64<E: de::Error>(self, v: i64) -> std::result::Result<(), E> {
        self.leaf(Leaf::Int(v))
    }
    fn visit_u64<E: de::Error>(self, v: u64) -> std::result::Result<(), E> {
        self.leaf(i64::try_from(v).map_or(Leaf::Uint(v), Leaf::Int))
    }
    fn visit_f64<E: de::Error>(self, v: f64) -> std::result::Result<(), E> {
        self.leaf(Leaf::Float(v))
    }
    fn visit_str<E: de::Error>(self, v: &str) -> std::result::Result<(), E> {
        self.leaf(Leaf::Str(v))
    }
}

/// One leaf of an input's value.
enum Leaf<'a> {
    Bool(bool),
    Int(i64),
    Uint(u64),
    Float(f64),
    Str(&'a str),
    Other,
}

/// `count` elements in `shape`: fixed dims divide it (innermost first), then the innermost
/// variable dim takes what is left and the others 1. None when it does not fit.
fn fit(shape: &[i64], count: usize) -> Option<Vec<i64>> {
    let mut left = count as i64;
    for &d in shape.iter().rev().filter(|&&d| d != -1) {
        if d <= 0 || left % d != 0 {
            return None;
        }
        left /= d;
    }
    let mut out = shape.to_vec();
    for d in out.iter_mut().rev().filter(|d| **d == -1) {
        *d = left;
        left = 1;
    }
    (left == 1).then_some(out)
}

/// One element in the datatype, as Triton's JSON reader takes it (a narrower type is cast).
fn push_element(datatype: DataType, leaf: &Leaf<'_>, out: &mut Vec<u8>) -> std::result::Result<(), &'static str> {
    let signed = || match leaf {
        Leaf::Int(v) => Ok(*v),
        _ => Err("attempt to access JSON non-signed-integer as signed-integer"),
    };
    let unsigned = || match leaf {
        Leaf::Int(v) if *v >= 0 => Ok(*v as u64),
        Leaf::Uint(v) => Ok(*v),
        _ => Err("attempt to access JSON non-unsigned-integer as unsigned-integer"),
    };
    let double = || match leaf {
        Leaf::Int(v) => Ok(*v as f64),
        Leaf::Uint(v) => Ok(*v as f64),
        Leaf::Float(v) => Ok(*v),
        _ => Err("attempt to access JSON non-number as double"),
    };
    match datatype {
        DataType::Bool => match leaf {
            Leaf::Bool(b) => out.push(u8::from(*b)),
            _ => return Err("attempt to access JSON non-boolean as boolean"),
        },
        DataType::Int8 => out.extend_from_slice(&(signed()? as i8).to_le_bytes()),
        DataType::Int16 => out.extend_from_slice(&(signed()? as i16).to_le_bytes()),
        DataType::Int32 => out.extend_from_slice(&(signed()? as i32).to_le_bytes()),
        DataType::Int64 => out.extend_from_slice(&signed()?.to_le_bytes()),
        DataType::Uint8 => out.extend_from_slice(&(unsigned()? as u8).to_le_bytes()),
        DataType::Uint16 => out.extend_from_slice(&(unsigned()? as u16).to_le_bytes()),
        DataType::Uint32 => out.extend_from_slice(&(unsigned()? as u32).to_le_bytes()),
        DataType::Uint64 => out.extend_from_slice(&unsigned()?.to_le_bytes()),
        DataType::Fp32 => out.extend_from_slice(&(double()? as f32).to_le_bytes()),
        DataType::Fp64 => out.extend_from_slice(&double()?.to_le_bytes()),
        DataType::Fp16 | DataType::Bf16 | DataType::Bytes => return Err("attempt to access JSON as a number"),
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn meta(name: &str, datatype: DataType, shape: &[i64]) -> TensorMetadata {
        TensorMetadata { name: name.into(), datatype, shape: shape.to_vec() }
    }

    fn llm() -> Vec<TensorMetadata> {
        vec![
            meta("PROMPT", DataType::Bytes, &[1, 1]),
            meta("STREAM", DataType::Bool, &[1, 1]),
            meta("input_ids", DataType::Int32, &[1, -1]),
        ]
    }

    fn err(body: &str) -> Error {
        convert(body.as_bytes(), &llm()).unwrap_err()
    }

    #[test]
    fn keys_become_inputs_or_parameters_in_document_order() {
        let c = convert(
            br#"{"id":"42","PROMPT":"hi","STREAM":true,"input_ids":[100,200],"REPETITION":3,"x":1.5,
                 "parameters":{"DELAY":"2","STREAM2":false}}"#,
            &llm(),
        )
        .unwrap();
        assert_eq!(c.id, "42");
        let shapes: Vec<_> = c.inputs.iter().map(|t| (t.name.as_str(), t.shape.clone())).collect();
        assert_eq!(shapes, vec![("PROMPT", vec![1, 1]), ("STREAM", vec![1, 1]), ("input_ids", vec![1, 2])]);
        assert_eq!(c.parameters["REPETITION"], ParamValue::Int(3));
        assert_eq!(c.parameters["x"], ParamValue::Double(1.5));
        assert_eq!(c.parameters["id"], ParamValue::String("42".into()));
        assert_eq!(c.parameters["DELAY"], ParamValue::String("2".into()));
        assert_eq!(c.parameters["STREAM2"], ParamValue::Bool(false));
    }

    #[test]
    fn tritons_errors_and_statuses() {
        let e = err(r#"{"PROMPT":"hello","STREAM":false,"PROMPT":"again"}"#);
        assert_eq!(
            (e.http_status(), e.message()),
            (400, "[request id: <id_unknown>] input 'PROMPT' already exists in request")
        );
        assert!(err(r#"{"PROMPT":"a","STREAM":false,"STREAM":false,"PROMPT":"b"}"#).message().contains("'STREAM'"));
        let e = err(r#"{"PROMPT":123,"STREAM":false}"#);
        assert_eq!(e.http_status(), 400);
        assert!(e.message().contains("attempt to access JSON non-string as string"), "{}", e.message());
        assert!(err(r#"{"STREAM":123,"PROMPT":true}"#).message().contains("non-boolean as boolean"));
        assert!(err(r#"{"PROMPT":"a","PARAMS":{"P":0}}"#).message().contains("parameter 'PARAMS' has invalid type"));
        let e = err(r#"{"PROMPT":"a","parameters":1}"#);
        assert!(e.message().starts_with("Expected JSON object for keyword: 'parameters'"), "{}", e.message());
        let e = err(r#"{"PROMPT":"a","parameters":{"nested":{"twice":1}}}"#);
        assert!(e.message().starts_with("Converting keyword: 'parameters': parameter 'nested' has invalid type."));
        assert_eq!(err("[1]").message(), "attempt to get members for non-object");
        assert_eq!(err("{").http_status(), 400);
        assert!(err(r#"{"input_ids":[1.5]}"#).message().contains("non-signed-integer"));
        let e = err(r#"{"PROMPT":["a","b"]}"#);
        assert_eq!(e.message(), "The schema can not convert input 'PROMPT' to tensor with proper shape");
    }

    #[test]
    fn shapes_fit_as_tritons() {
        assert_eq!(fit(&[1, 1], 1), Some(vec![1, 1]));
        assert_eq!(fit(&[1, -1], 2), Some(vec![1, 2]));
        assert_eq!(fit(&[-1, -1], 5), Some(vec![1, 5]));
        assert_eq!(fit(&[-1, 1], 3), Some(vec![3, 1]));
        assert_eq!(fit(&[1, 1], 2), None);
        assert_eq!(fit(&[0], 2), None);
    }
}
