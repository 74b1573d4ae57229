//! A bounded reader of UBJSON (XGBoost's `.ubj` model format) into JSON values, so that a model
//! file is checked by ferry before XGBoost reads it. Counts are bounded by the bytes left, and
//! nesting by `MAX_DEPTH`, so no file can make it allocate more than its own size allows.
use serde_json::{Map, Number, Value};

const MAX_DEPTH: usize = 64;

pub fn parse(bytes: &[u8]) -> Result<Value, String> {
    let mut r = Reader { bytes, at: 0, budget: bytes.len() };
    let marker = r.byte()?;
    let v = r.value(marker, 0)?;
    if r.at != bytes.len() {
        return Err(format!("UBJSON: {} bytes after the value", bytes.len() - r.at));
    }
    Ok(v)
}

struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
    /// Values still to be made: no more than the file has bytes, whatever its counts say.
    budget: usize,
}

impl Reader<'_> {
    fn byte(&mut self) -> Result<u8, String> {
        let b = *self.bytes.get(self.at).ok_or("UBJSON: the file ends inside a value")?;
        self.at += 1;
        Ok(b)
    }

    fn take(&mut self, n: usize) -> Result<&[u8], String> {
        let end =
            self.at.checked_add(n).filter(|&e| e <= self.bytes.len()).ok_or("UBJSON: the file ends inside a value")?;
        let s = &self.bytes[self.at..end];
        self.at = end;
        Ok(s)
    }

    fn int(&mut self, marker: u8) -> Result<i64, String> {
        Ok(match marker {
            b'i' => i64::from(self.take(1)?[0] as i8),
            b'U' => i64::from(self.take(1)?[0]),
            b'I' => i64::from(i16::from_be_bytes(self.take(2)?.try_into().expect("2"))),
            b'l' => i64::from(i32::from_be_bytes(self.take(4)?.try_into().expect("4"))),
            b'L' => i64::from_be_bytes(self.take(8)?.try_into().expect("8")),
            m => return Err(format!("UBJSON: expected an integer, found marker {:?}", m as char)),
        })
    }

    /// A count or length: an integer marker, then a value no larger than the bytes left (each
    /// element takes at least one byte, or one per its fixed type).
    fn count(&mut self, marker: u8, each: usize) -> Result<usize, String> {
        let n = self.int(marker)?;
        let left = (self.bytes.len() - self.at) / each.max(1);
        usize::try_from(n)
            .ok()
            .filter(|&n| n <= left)
            .ok_or_else(|| format!("UBJSON: a count of {n} is more than the file holds"))
    }

    fn string(&mut self) -> Result<String, String> {
        let m = self.byte()?;
        let n = self.count(m, 1)?;
        String::from_utf8(self.take(n)?.to_vec()).map_err(|_| "UBJSON: a string is not UTF-8".to_string())
    }

    fn number(f: f64) -> Value {
        Number::from_f64(f).map_or(Value::Null, Value::Number)
    }

    fn value(&mut self, marker: u8, depth: usize) -> Result<Value, String> {
        if depth > MAX_DEPTH {
            return Err("UBJSON: nested too deep".into());
        }
        self.budget = self.budget.checked_sub(1).ok_or("UBJSON: more values than the file has bytes")?;
        Ok(match marker {
            b'Z' => Value::Null,
            b'T' => Value::Bool(true),
            b'F' => Value::Bool(false),
            b'i' | b'U' | b'I' | b'l' | b'L' => Value::from(self.int(marker)?),
            b'd' => Self::number(f64::from(f32::from_be_bytes(self.take(4)?.try_into().expect("4")))),
            b'D' => Self::number(f64::from_be_bytes(self.take(8)?.try_into().expect("8"))),
            b'C' => Value::String((self.take(1)?[0] as char).to_string()),
            b'S' | b'H' => {
                let m = self.byte()?;
                let n = self.count(m, 1)?;
                let text = String::from_utf8(self.take(n)?.to_vec()).map_err(|_| "UBJSON: a string is not UTF-8")?;
                if marker == b'H' {
                    text.parse::<f64>().map(Self::number).unwrap_or(Value::String(text))
                } else {
                    Value::String(text)
                }
            }
            b'[' => Value::Array(self.container(depth, false)?.into_iter().map(|(_, v)| v).collect()),
            b'{' => {
                // XGBoost keeps a key's first value, a map its last: a key twice is refused.
                let mut map = Map::new();
                for (k, v) in self.container(depth, true)? {
                    if map.contains_key(&k) {
                        return Err(format!("UBJSON: key '{k}' appears twice"));
                    }
                    map.insert(k, v);
                }
                Value::Object(map)
            }
            m => return Err(format!("UBJSON: unknown marker {:?}", m as char)),
        })
    }

    /// An array or object, in its plain, counted (`#`) or typed (`$`) form.
    fn container(&mut self, depth: usize, object: bool) -> Result<Vec<(String, Value)>, String> {
        let (mut typed, mut count) = (None, None);
        if self.bytes.get(self.at) == Some(&b'$') {
            self.at += 1;
            typed = Some(self.byte()?);
            if self.byte()? != b'#' {
                return Err("UBJSON: a typed container without a count".into());
            }
            count = Some(self.elements(typed)?);
        } else if self.bytes.get(self.at) == Some(&b'#') {
            self.at += 1;
            count = Some(self.elements(None)?);
        }
        let close = if object { b'}' } else { b']' };
        let mut out = Vec::new();
        loop {
            match count {
                Some(n) if out.len() == n => break,
                None if self.bytes.get(self.at) == Some(&close) => {
                    self.at += 1;
                    break;
                }
                _ => {}
            }
            let key = if object { self.string()? } else { String::new() };
            let marker = match typed {
                Some(t) => t,
                None => self.byte()?,
            };
            out.push((key, self.value(marker, depth + 1)?));
        }
        Ok(out)
    }

    /// A container's element count, no more than the bytes left hold (each element becomes a
    /// value in memory, so one of no bytes, a typed null or boolean, counts as one).
    fn elements(&mut self, typed: Option<u8>) -> Result<usize, String> {
        let marker = self.byte()?;
        let each = match typed {
            Some(b'I') => 2,
            Some(b'l' | b'd') => 4,
            Some(b'L' | b'D') => 8,
            _ => 1,
        };
        self.count(marker, each)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_xgboosts_shapes() {
        // {"a": [1, 2] (typed int8, counted), "b": "xy", "c": 1.5 (float32)}
        let mut b = vec![b'{'];
        b.extend([b'i', 1, b'a', b'[', b'$', b'i', b'#', b'i', 2, 1, 2]);
        b.extend([b'i', 1, b'b', b'S', b'i', 2, b'x', b'y']);
        b.extend([b'i', 1, b'c', b'd']);
        b.extend(1.5f32.to_be_bytes());
        b.push(b'}');
        let v = parse(&b).unwrap();
        assert_eq!(v, serde_json::json!({"a": [1, 2], "b": "xy", "c": 1.5}));
    }

    #[test]
    fn counts_beyond_the_file_and_truncation_are_errors() {
        assert!(
            parse(&[b'[', b'$', b'l', b'#', b'L', 0x7f, 0, 0, 0, 0, 0, 0, 0])
                .unwrap_err()
                .contains("more than the file")
        );
        assert!(parse(&[b'[', b'i', 1]).is_err());
        assert!(parse(&[]).is_err());
        assert!(parse(&[b'S', b'i', 100, b'a']).is_err());
        // Typed nulls take no bytes: their count is bounded all the same.
        let mut nulls = vec![b'['];
        nulls.extend([b'[', b'$', b'Z', b'#', b'l', 0, 0, 0, 20]);
        nulls.extend([b'[', b'$', b'Z', b'#', b'l', 0, 0, 0, 11]);
        nulls.extend([b'Z'; 10]);
        nulls.push(b']');
        assert!(parse(&nulls).unwrap_err().contains("more values"), "{:?}", parse(&nulls));
        let deep: Vec<u8> = std::iter::repeat_n(b'[', 200).collect();
        assert!(parse(&deep).unwrap_err().contains("deep"));
    }
}
