//! The bytes a cached response is kept as in the shared tier. Versioned by its first four bytes;
//! anything that does not decode whole is treated as absent.
use bytes::Bytes;

use super::Cached;
use crate::{request::ParamValue, tensor::DataType, tensor::Tensor};

const MAGIC: &[u8; 4] = b"FRC1";

fn put_bytes(out: &mut Vec<u8>, b: &[u8]) {
    out.extend_from_slice(&(b.len() as u64).to_le_bytes());
    out.extend_from_slice(b);
}

pub fn encode(c: &Cached) -> Vec<u8> {
    let size = c.outputs.iter().map(|t| t.data.len() + t.name.len() + 64).sum::<usize>() + 64;
    let mut out = Vec::with_capacity(size);
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&(c.parameters.len() as u64).to_le_bytes());
    for (name, value) in &c.parameters {
        put_bytes(&mut out, name.as_bytes());
        match value {
            ParamValue::Bool(b) => out.extend_from_slice(&[0, u8::from(*b)]),
            ParamValue::Int(i) => {
                out.push(1);
                out.extend_from_slice(&i.to_le_bytes());
            }
            ParamValue::Uint(u) => {
                out.push(2);
                out.extend_from_slice(&u.to_le_bytes());
            }
            ParamValue::Double(d) => {
                out.push(3);
                out.extend_from_slice(&d.to_le_bytes());
            }
            ParamValue::String(s) => {
                out.push(4);
                put_bytes(&mut out, s.as_bytes());
            }
        }
    }
    out.extend_from_slice(&(c.outputs.len() as u64).to_le_bytes());
    for t in &c.outputs {
        put_bytes(&mut out, t.name.as_bytes());
        put_bytes(&mut out, t.datatype.wire().as_bytes());
        out.extend_from_slice(&(t.shape.len() as u64).to_le_bytes());
        for d in &t.shape {
            out.extend_from_slice(&d.to_le_bytes());
        }
        put_bytes(&mut out, &t.data);
    }
    out
}

struct Reader {
    buf: Bytes,
    at: usize,
}

impl Reader {
    fn take(&mut self, n: usize) -> Option<Bytes> {
        let end = self.at.checked_add(n).filter(|e| *e <= self.buf.len())?;
        let b = self.buf.slice(self.at..end);
        self.at = end;
        Some(b)
    }
    fn word(&mut self) -> Option<[u8; 8]> {
        self.take(8)?.as_ref().try_into().ok()
    }
    fn u64(&mut self) -> Option<u64> {
        self.word().map(u64::from_le_bytes)
    }
    fn len(&mut self) -> Option<usize> {
        usize::try_from(self.u64()?).ok()
    }
    fn bytes(&mut self) -> Option<Bytes> {
        let n = self.len()?;
        self.take(n)
    }
    fn string(&mut self) -> Option<String> {
        String::from_utf8(self.bytes()?.to_vec()).ok()
    }
}

pub fn decode(buf: Bytes) -> Option<Cached> {
    let mut r = Reader { buf, at: 0 };
    if r.take(4)?.as_ref() != MAGIC {
        return None;
    }
    let mut parameters = crate::request::Parameters::new();
    for _ in 0..r.u64()? {
        let name = r.string()?;
        let value = match r.take(1)?[0] {
            0 => ParamValue::Bool(r.take(1)?[0] != 0),
            1 => ParamValue::Int(i64::from_le_bytes(r.word()?)),
            2 => ParamValue::Uint(u64::from_le_bytes(r.word()?)),
            3 => ParamValue::Double(f64::from_le_bytes(r.word()?)),
            4 => ParamValue::String(r.string()?),
            _ => return None,
        };
        parameters.insert(name, value);
    }
    let count = r.len()?;
    // Capacities follow what the remaining bytes can hold, not what the entry claims.
    let left = |r: &Reader| r.buf.len().saturating_sub(r.at);
    let mut outputs = Vec::with_capacity(count.min(left(&r) / 32));
    for _ in 0..count {
        let name = r.string()?;
        let datatype = DataType::from_wire(&r.string()?)?;
        let rank = r.len()?;
        let mut shape = Vec::with_capacity(rank.min(left(&r) / 8));
        for _ in 0..rank {
            shape.push(i64::from_le_bytes(r.word()?));
        }
        let data = r.bytes()?;
        outputs.push(Tensor { name, datatype, shape, data });
    }
    (r.at == r.buf.len()).then_some(Cached { parameters, outputs })
}
