//! The classification extension: an output's top-K classes per batch item, as BYTES strings
//! `"value:index[:label]"` (values printed like C++ std::to_string: floats with 6 decimals).
use bytes::Bytes;

use crate::{
    error::{Error, Result},
    tensor::{DataType, Tensor, element_count, push_bytes_element},
};

/// Numbers of one output, widened for sorting, remembering how to print them.
enum Values {
    Ints(Vec<i128>),
    Floats(Vec<f64>),
}

fn values(t: &Tensor) -> Result<Values> {
    let d = &t.data[..];
    macro_rules! read {
        ($ty:ty, $n:expr, $variant:ident, $wide:ty) => {
            Values::$variant(
                d.chunks_exact($n).map(|c| <$ty>::from_le_bytes(c.try_into().expect("chunk")) as $wide).collect(),
            )
        };
    }
    Ok(match t.datatype {
        DataType::Int8 => read!(i8, 1, Ints, i128),
        DataType::Int16 => read!(i16, 2, Ints, i128),
        DataType::Int32 => read!(i32, 4, Ints, i128),
        DataType::Int64 => read!(i64, 8, Ints, i128),
        DataType::Uint8 => read!(u8, 1, Ints, i128),
        DataType::Uint16 => read!(u16, 2, Ints, i128),
        DataType::Uint32 => read!(u32, 4, Ints, i128),
        DataType::Uint64 => read!(u64, 8, Ints, i128),
        DataType::Fp32 => read!(f32, 4, Floats, f64),
        DataType::Fp64 => read!(f64, 8, Floats, f64),
        other => {
            return Err(Error::invalid(format!(
                "class result not available for output '{}' due to unsupported type '{}'",
                t.name,
                other.wire()
            )));
        }
    })
}

/// Top `k` classes of each item (`batching`: the first dim indexes items).
pub fn classify(t: &Tensor, batching: bool, k: usize, labels: &[String]) -> Result<Tensor> {
    let count = element_count(&t.shape).unwrap_or(0);
    if count > 1_000_000 {
        return Err(Error::invalid(format!(
            "output '{}' has {count} elements; classification supports at most 1000000",
            t.name
        )));
    }
    let items = if batching { t.shape.first().map_or(1, |&b| b.max(0) as usize) } else { 1 };
    let per_item = count.checked_div(items).unwrap_or(0);
    let keep = k.min(per_item);
    let vals = values(t)?;
    let mut data = Vec::new();
    for item in 0..items {
        let range = item * per_item..(item + 1) * per_item;
        let mut order: Vec<usize> = (0..per_item).collect();
        let label = |i: usize| labels.get(i).map(|l| format!(":{l}")).unwrap_or_default();
        let entries: Vec<String> = match &vals {
            Values::Ints(v) => {
                let v = &v[range];
                order.sort_by(|&a, &b| v[b].cmp(&v[a]));
                order[..keep].iter().map(|&i| format!("{}:{i}{}", v[i], label(i))).collect()
            }
            Values::Floats(v) => {
                let v = &v[range];
                order.sort_by(|&a, &b| v[b].total_cmp(&v[a]));
                order[..keep].iter().map(|&i| format!("{:.6}:{i}{}", v[i], label(i))).collect()
            }
        };
        for e in entries {
            push_bytes_element(&mut data, e.as_bytes());
        }
    }
    let shape = if batching { vec![items as i64, keep as i64] } else { vec![keep as i64] };
    Ok(Tensor { name: t.name.clone(), datatype: DataType::Bytes, shape, data: Bytes::from(data) })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tensor::bytes_elements;

    fn strings(t: &Tensor) -> Vec<String> {
        bytes_elements(&t.data).map(|e| String::from_utf8(e.unwrap().to_vec()).unwrap()).collect()
    }

    #[test]
    fn top_k_per_item_with_labels() {
        let v: Vec<u8> = [0.1f32, 3.3, 2.0, 5.0, 1.0, 0.5].iter().flat_map(|f| f.to_le_bytes()).collect();
        let t = Tensor { name: "p".into(), datatype: DataType::Fp32, shape: vec![2, 3], data: Bytes::from(v) };
        let labels = vec!["cat".to_string(), "dog".to_string()];
        let out = classify(&t, true, 2, &labels).unwrap();
        assert_eq!(out.shape, vec![2, 2]);
        assert_eq!(strings(&out), vec!["3.300000:1:dog", "2.000000:2", "5.000000:0:cat", "1.000000:1:dog"]);
    }

    #[test]
    fn ints_print_plain_and_k_is_capped() {
        let v: Vec<u8> = [4i32, 9, 1].iter().flat_map(|f| f.to_le_bytes()).collect();
        let t = Tensor { name: "p".into(), datatype: DataType::Int32, shape: vec![3], data: Bytes::from(v) };
        let out = classify(&t, false, 5, &[]).unwrap();
        assert_eq!(out.shape, vec![3]);
        assert_eq!(strings(&out), vec!["9:1", "4:0", "1:2"]);
    }

    #[test]
    fn fp16_is_refused() {
        let t = Tensor { name: "p".into(), datatype: DataType::Fp16, shape: vec![1], data: Bytes::from(vec![0, 0]) };
        assert!(classify(&t, false, 1, &[]).unwrap_err().message().contains("unsupported type 'FP16'"));
    }
}
