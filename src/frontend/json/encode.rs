//! KServe v2 infer replies: the JSON header (outputs as JSON `data`, or as binary data after the
//! header when asked), with Triton's rule that an output has `parameters` only when binary.
use super::decode::OutputFormat;
use crate::{
    error::{Error, Result},
    request::{InferResponse, ParamValue},
    tensor::{DataType, Tensor, bytes_elements},
};

/// An encoded reply: the body, and the JSON header's length when binary data follows it.
pub struct Encoded {
    pub body: Vec<u8>,
    pub header_len: Option<usize>,
}

pub fn encode(resp: &InferResponse, format: &OutputFormat) -> Result<Encoded> {
    let binary: Vec<bool> = resp.outputs.iter().map(|o| format.binary(&o.name) && !format.in_shm(&o.name)).collect();
    let tail: usize = resp.outputs.iter().zip(&binary).filter(|(_, b)| **b).map(|(o, _)| o.data.len()).sum();
    let mut out = Vec::with_capacity(256 + tail);
    out.push(b'{');
    if !resp.id.is_empty() {
        out.extend_from_slice(b"\"id\":");
        string(&mut out, &resp.id);
        out.push(b',');
    }
    out.extend_from_slice(b"\"model_name\":");
    string(&mut out, &resp.model_name);
    out.extend_from_slice(b",\"model_version\":\"");
    out.extend_from_slice(itoa::Buffer::new().format(resp.model_version).as_bytes());
    out.push(b'"');
    if !resp.parameters.is_empty() {
        out.extend_from_slice(b",\"parameters\":{");
        for (i, (k, v)) in resp.parameters.iter().enumerate() {
            if i > 0 {
                out.push(b',');
            }
            string(&mut out, k);
            out.push(b':');
            param(&mut out, v);
        }
        out.push(b'}');
    }
    out.extend_from_slice(b",\"outputs\":[");
    for (i, (o, &bin)) in resp.outputs.iter().zip(&binary).enumerate() {
        if i > 0 {
            out.push(b',');
        }
        output(&mut out, o, bin, format.in_shm(&o.name))?;
    }
    out.extend_from_slice(b"]}");
    let header_len = out.len();
    for (o, _) in resp.outputs.iter().zip(&binary).filter(|(_, b)| **b) {
        out.extend_from_slice(&o.data);
    }
    Ok(Encoded { body: out, header_len: (tail > 0).then_some(header_len) })
}

fn output(out: &mut Vec<u8>, t: &Tensor, binary: bool, in_shm: bool) -> Result<()> {
    out.extend_from_slice(b"{\"name\":");
    string(out, &t.name);
    out.extend_from_slice(b",\"datatype\":\"");
    out.extend_from_slice(t.datatype.wire().as_bytes());
    out.extend_from_slice(b"\",\"shape\":[");
    for (i, d) in t.shape.iter().enumerate() {
        if i > 0 {
            out.push(b',');
        }
        out.extend_from_slice(itoa::Buffer::new().format(*d).as_bytes());
    }
    out.push(b']');
    if in_shm {
        out.push(b'}');
    } else if binary {
        out.extend_from_slice(b",\"parameters\":{\"binary_data_size\":");
        out.extend_from_slice(itoa::Buffer::new().format(t.data.len()).as_bytes());
        out.extend_from_slice(b"}}");
    } else {
        out.extend_from_slice(b",\"data\":[");
        data(out, t)?;
        out.extend_from_slice(b"]}");
    }
    Ok(())
}

fn data(out: &mut Vec<u8>, t: &Tensor) -> Result<()> {
    let d = &t.data[..];
    macro_rules! ints {
        ($ty:ty, $n:expr) => {
            for (i, c) in d.chunks_exact($n).enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                out.extend_from_slice(
                    itoa::Buffer::new().format(<$ty>::from_le_bytes(c.try_into().expect("chunk"))).as_bytes(),
                );
            }
        };
    }
    macro_rules! floats {
        ($ty:ty, $n:expr) => {
            for (i, c) in d.chunks_exact($n).enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                float(out, <$ty>::from_le_bytes(c.try_into().expect("chunk")));
            }
        };
    }
    match t.datatype {
        DataType::Bool => {
            for (i, b) in d.iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                out.extend_from_slice(if *b != 0 { b"true" } else { b"false" });
            }
        }
        DataType::Int8 => ints!(i8, 1),
        DataType::Int16 => ints!(i16, 2),
        DataType::Int32 => ints!(i32, 4),
        DataType::Int64 => ints!(i64, 8),
        DataType::Uint8 => ints!(u8, 1),
        DataType::Uint16 => ints!(u16, 2),
        DataType::Uint32 => ints!(u32, 4),
        DataType::Uint64 => ints!(u64, 8),
        DataType::Fp32 => floats!(f32, 4),
        DataType::Fp64 => floats!(f64, 8),
        DataType::Fp16 | DataType::Bf16 => {
            return Err(Error::invalid(format!(
                "sending {} data via JSON is not supported; request output '{}' with binary_data",
                t.datatype.wire(),
                t.name
            )));
        }
        DataType::Bytes => {
            for (i, e) in bytes_elements(d).enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                let text = std::str::from_utf8(e?).map_err(|_| {
                    Error::invalid(format!(
                        "output '{}' element {i} is not valid UTF-8 and cannot be sent as JSON; request it with binary_data",
                        t.name
                    ))
                })?;
                string(out, text);
            }
        }
    }
    Ok(())
}

/// Shortest round-trip form; NaN and infinities as the literals Python's json module reads.
fn float<F: ryu::Float + Into<f64> + Copy>(out: &mut Vec<u8>, v: F) {
    let wide: f64 = v.into();
    if wide.is_finite() {
        out.extend_from_slice(ryu::Buffer::new().format_finite(v).as_bytes());
    } else if wide.is_nan() {
        out.extend_from_slice(b"NaN");
    } else if wide > 0.0 {
        out.extend_from_slice(b"Infinity");
    } else {
        out.extend_from_slice(b"-Infinity");
    }
}

fn string(out: &mut Vec<u8>, s: &str) {
    serde_json::to_writer(&mut *out, s).expect("writing a string to a Vec cannot fail");
}

fn param(out: &mut Vec<u8>, v: &ParamValue) {
    match v {
        ParamValue::Bool(b) => out.extend_from_slice(if *b { b"true" } else { b"false" }),
        ParamValue::Int(i) => out.extend_from_slice(itoa::Buffer::new().format(*i).as_bytes()),
        ParamValue::Uint(u) => out.extend_from_slice(itoa::Buffer::new().format(*u).as_bytes()),
        ParamValue::Double(d) => float(out, *d),
        ParamValue::String(s) => string(out, s),
    }
}
