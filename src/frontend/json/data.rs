//! JSON tensor `data` → wire bytes: walks nested arrays depth-first (Triton flattens them) and
//! writes each element straight into the tensor buffer in the request's datatype.
use std::fmt;

use serde::de::{self, DeserializeSeed, SeqAccess, Visitor};

use crate::tensor::{DataType, push_bytes_element};

/// Decodes one input's `data` into `out`, returning the number of elements.
pub fn decode(raw: &str, datatype: DataType, out: &mut Vec<u8>) -> Result<usize, String> {
    if matches!(datatype, DataType::Fp16 | DataType::Bf16) {
        return Err(format!(
            "receiving {} data via JSON is not supported; send it as binary data (binary_data_size)",
            datatype.wire()
        ));
    }
    let mut count = 0;
    let mut de = serde_json::Deserializer::from_str(raw);
    Element { datatype, out, count: &mut count }.deserialize(&mut de).map_err(|e| e.to_string())?;
    Ok(count)
}

struct Element<'a> {
    datatype: DataType,
    out: &'a mut Vec<u8>,
    count: &'a mut usize,
}

impl<'de> DeserializeSeed<'de> for Element<'_> {
    type Value = ();

    fn deserialize<D: de::Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_any(self)
    }
}

macro_rules! push_int {
    ($self:ident, $v:expr, $($dt:ident => $ty:ty),*) => {
        match $self.datatype {
            $(DataType::$dt => {
                let x = <$ty>::try_from($v).map_err(|_| E::custom(format!("{} does not fit {}", $v, $self.datatype.wire())))?;
                $self.out.extend_from_slice(&x.to_le_bytes());
            })*
            DataType::Fp32 => $self.out.extend_from_slice(&($v as f32).to_le_bytes()),
            DataType::Fp64 => $self.out.extend_from_slice(&($v as f64).to_le_bytes()),
            other => return Err(E::custom(format!("expected {} elements, found the number {}", other.wire(), $v))),
        }
    };
}

impl<'de> Visitor<'de> for Element<'_> {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} elements, or arrays of them", self.datatype.wire())
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        while seq
            .next_element_seed(Element { datatype: self.datatype, out: &mut *self.out, count: &mut *self.count })?
            .is_some()
        {}
        Ok(())
    }

    fn visit_bool<E: de::Error>(self, v: bool) -> Result<(), E> {
        if self.datatype != DataType::Bool {
            return Err(E::custom(format!("expected {} elements, found the boolean {v}", self.datatype.wire())));
        }
        self.out.push(u8::from(v));
        *self.count += 1;
        Ok(())
    }

    fn visit_i64<E: de::Error>(self, v: i64) -> Result<(), E> {
        push_int!(self, v, Int8 => i8, Int16 => i16, Int32 => i32, Int64 => i64, Uint8 => u8, Uint16 => u16, Uint32 => u32, Uint64 => u64);
        *self.count += 1;
        Ok(())
    }

    fn visit_u64<E: de::Error>(self, v: u64) -> Result<(), E> {
        push_int!(self, v, Int8 => i8, Int16 => i16, Int32 => i32, Int64 => i64, Uint8 => u8, Uint16 => u16, Uint32 => u32, Uint64 => u64);
        *self.count += 1;
        Ok(())
    }

    fn visit_f64<E: de::Error>(self, v: f64) -> Result<(), E> {
        match self.datatype {
            DataType::Fp32 => self.out.extend_from_slice(&(v as f32).to_le_bytes()),
            DataType::Fp64 => self.out.extend_from_slice(&v.to_le_bytes()),
            other => {
                return Err(E::custom(format!("expected {} elements, found the number {v}", other.wire())));
            }
        }
        *self.count += 1;
        Ok(())
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<(), E> {
        if self.datatype != DataType::Bytes {
            return Err(E::custom(format!("expected {} elements, found the string {v:?}", self.datatype.wire())));
        }
        push_bytes_element(self.out, v.as_bytes());
        *self.count += 1;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tensor::bytes_elements;

    fn f32s(b: &[u8]) -> Vec<f32> {
        b.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect()
    }

    #[test]
    fn flattens_nested_arrays() {
        let mut out = Vec::new();
        assert_eq!(decode("[[1, 2.5], [3, -4]]", DataType::Fp32, &mut out).unwrap(), 4);
        assert_eq!(f32s(&out), vec![1.0, 2.5, 3.0, -4.0]);
    }

    #[test]
    fn integers_are_range_checked() {
        let mut out = Vec::new();
        assert_eq!(decode("[1, 255]", DataType::Uint8, &mut out).unwrap(), 2);
        assert_eq!(out, vec![1, 255]);
        let err = decode("[256]", DataType::Uint8, &mut Vec::new()).unwrap_err();
        assert!(err.contains("256 does not fit UINT8"), "{err}");
        let err = decode("[1.5]", DataType::Int32, &mut Vec::new()).unwrap_err();
        assert!(err.contains("expected INT32 elements, found the number 1.5"), "{err}");
        let mut out = Vec::new();
        decode("[-2]", DataType::Int64, &mut out).unwrap();
        assert_eq!(out, (-2i64).to_le_bytes());
    }

    #[test]
    fn bools_strings_and_refusals() {
        let mut out = Vec::new();
        decode("[true, false]", DataType::Bool, &mut out).unwrap();
        assert_eq!(out, vec![1, 0]);
        assert!(decode("[1]", DataType::Bool, &mut Vec::new()).is_err());
        let mut out = Vec::new();
        assert_eq!(decode(r#"["héllo", ""]"#, DataType::Bytes, &mut out).unwrap(), 2);
        let elems: Vec<&[u8]> = bytes_elements(&out).map(|e| e.unwrap()).collect();
        assert_eq!(elems, vec!["héllo".as_bytes(), b""]);
        assert!(decode("[1]", DataType::Fp16, &mut Vec::new()).unwrap_err().contains("FP16"));
        assert!(decode(r#"["x"]"#, DataType::Fp32, &mut Vec::new()).is_err());
    }
}
