//! Plain tensor data shared by every layer: datatypes, shapes, and tensors held as little-endian
//! bytes in the wire layout (BYTES elements as a u32 length followed by the bytes).
use bytes::Bytes;

use crate::error::{Error, Result};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DataType {
    Bool,
    Uint8,
    Uint16,
    Uint32,
    Uint64,
    Int8,
    Int16,
    Int32,
    Int64,
    Fp16,
    Fp32,
    Fp64,
    Bytes,
    Bf16,
}

/// (datatype, protocol string, config enum number, config enum name, element size; 0 = variable)
const TABLE: [(DataType, &str, i32, &str, usize); 14] = [
    (DataType::Bool, "BOOL", 1, "TYPE_BOOL", 1),
    (DataType::Uint8, "UINT8", 2, "TYPE_UINT8", 1),
    (DataType::Uint16, "UINT16", 3, "TYPE_UINT16", 2),
    (DataType::Uint32, "UINT32", 4, "TYPE_UINT32", 4),
    (DataType::Uint64, "UINT64", 5, "TYPE_UINT64", 8),
    (DataType::Int8, "INT8", 6, "TYPE_INT8", 1),
    (DataType::Int16, "INT16", 7, "TYPE_INT16", 2),
    (DataType::Int32, "INT32", 8, "TYPE_INT32", 4),
    (DataType::Int64, "INT64", 9, "TYPE_INT64", 8),
    (DataType::Fp16, "FP16", 10, "TYPE_FP16", 2),
    (DataType::Fp32, "FP32", 11, "TYPE_FP32", 4),
    (DataType::Fp64, "FP64", 12, "TYPE_FP64", 8),
    (DataType::Bytes, "BYTES", 13, "TYPE_STRING", 0),
    (DataType::Bf16, "BF16", 14, "TYPE_BF16", 2),
];

impl DataType {
    fn row(self) -> &'static (DataType, &'static str, i32, &'static str, usize) {
        TABLE.iter().find(|r| r.0 == self).expect("every datatype has a row")
    }
    /// Parses a protocol datatype string (`FP32`, `BYTES`, ...), exact and case-sensitive.
    pub fn from_wire(s: &str) -> Option<Self> {
        TABLE.iter().find(|r| r.1 == s).map(|r| r.0)
    }
    pub fn wire(self) -> &'static str {
        self.row().1
    }
    /// From the config `DataType` enum number (`TYPE_INVALID` and unknown numbers give None).
    pub fn from_config(n: i32) -> Option<Self> {
        TABLE.iter().find(|r| r.2 == n).map(|r| r.0)
    }
    pub fn config(self) -> i32 {
        self.row().2
    }
    pub fn config_name(self) -> &'static str {
        self.row().3
    }
    /// Bytes per element, or None for BYTES (variable length).
    pub fn size(self) -> Option<usize> {
        match self.row().4 {
            0 => None,
            n => Some(n),
        }
    }
}

/// Number of elements of a shape, or None when a dim is negative or the product overflows.
pub fn element_count(shape: &[i64]) -> Option<usize> {
    shape.iter().try_fold(1usize, |acc, &d| usize::try_from(d).ok().and_then(|d| acc.checked_mul(d)))
}

/// Formats a shape as Triton prints it: `[-1,16]`.
pub fn shape_string(shape: &[i64]) -> String {
    let inner: Vec<String> = shape.iter().map(|d| d.to_string()).collect();
    format!("[{}]", inner.join(","))
}

/// A named tensor whose data is in the wire layout.
#[derive(Debug, Clone, PartialEq)]
pub struct Tensor {
    pub name: String,
    pub datatype: DataType,
    pub shape: Vec<i64>,
    pub data: Bytes,
}

/// Iterates the elements of a BYTES tensor buffer (u32 little-endian length, then the bytes).
pub struct BytesElements<'a> {
    rest: &'a [u8],
}

impl<'a> Iterator for BytesElements<'a> {
    type Item = Result<&'a [u8]>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.rest.is_empty() {
            return None;
        }
        if self.rest.len() < 4 {
            self.rest = &[];
            return Some(Err(Error::invalid("BYTES element is cut short: fewer than 4 length bytes remain")));
        }
        let len = u32::from_le_bytes(self.rest[..4].try_into().expect("4 bytes")) as usize;
        if self.rest.len() - 4 < len {
            let have = self.rest.len() - 4;
            self.rest = &[];
            return Some(Err(Error::invalid(format!("BYTES element declares {len} bytes but only {have} remain"))));
        }
        let (elem, rest) = self.rest[4..].split_at(len);
        self.rest = rest;
        Some(Ok(elem))
    }
}

pub fn bytes_elements(data: &[u8]) -> BytesElements<'_> {
    BytesElements { rest: data }
}

/// Counts the elements of a BYTES buffer, failing when it is not well formed.
pub fn count_bytes_elements(data: &[u8]) -> Result<usize> {
    bytes_elements(data).try_fold(0usize, |n, e| e.map(|_| n + 1))
}

/// Byte offsets where each BYTES element starts, plus the end offset.
pub fn bytes_element_offsets(data: &[u8]) -> Result<Vec<usize>> {
    let mut offsets = vec![0];
    let mut at = 0;
    for elem in bytes_elements(data) {
        at += 4 + elem?.len();
        offsets.push(at);
    }
    Ok(offsets)
}

pub fn push_bytes_element(buf: &mut Vec<u8>, elem: &[u8]) {
    buf.extend_from_slice(&(elem.len() as u32).to_le_bytes());
    buf.extend_from_slice(elem);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn datatype_round_trips() {
        for row in TABLE {
            let dt = row.0;
            assert_eq!(DataType::from_wire(dt.wire()), Some(dt));
            assert_eq!(DataType::from_config(dt.config()), Some(dt));
        }
        assert_eq!(DataType::from_wire("fp32"), None);
        assert_eq!(DataType::from_config(0), None);
        assert_eq!(DataType::Bytes.config_name(), "TYPE_STRING");
        assert_eq!(DataType::Bytes.size(), None);
        assert_eq!(DataType::Bf16.size(), Some(2));
    }

    #[test]
    fn element_counts() {
        assert_eq!(element_count(&[2, 3]), Some(6));
        assert_eq!(element_count(&[]), Some(1));
        assert_eq!(element_count(&[0, 5]), Some(0));
        assert_eq!(element_count(&[-1, 5]), None);
        assert_eq!(element_count(&[i64::MAX, i64::MAX]), None);
        assert_eq!(shape_string(&[-1, 16]), "[-1,16]");
    }

    #[test]
    fn bytes_layout() {
        let mut buf = Vec::new();
        push_bytes_element(&mut buf, b"ab");
        push_bytes_element(&mut buf, b"");
        push_bytes_element(&mut buf, b"xyz");
        assert_eq!(count_bytes_elements(&buf).unwrap(), 3);
        assert_eq!(bytes_element_offsets(&buf).unwrap(), vec![0, 6, 10, 17]);
        let elems: Vec<&[u8]> = bytes_elements(&buf).map(|e| e.unwrap()).collect();
        assert_eq!(elems, vec![&b"ab"[..], b"", b"xyz"]);
        assert!(count_bytes_elements(&buf[..buf.len() - 1]).is_err());
        assert!(count_bytes_elements(&[1, 0]).is_err());
    }
}
