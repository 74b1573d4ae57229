//! A SavedModel's `TF_SIGNATURE_DEF` other than `serving_default`: OpenVINO's TensorFlow reader
//! serves the `serving_default` signature, so ferry gives it a copy of the SavedModel whose
//! `saved_model.pb` names the chosen signature `serving_default` (every other file linked, not
//! copied). The protobuf is rewritten at the wire level: `SavedModel.meta_graphs` (field 2), each
//! `MetaGraphDef.signature_def` map entry (field 5: key 1, value 2); every other byte is kept.
use std::path::Path;

/// The largest `saved_model.pb` read (protobuf's own limit).
const MAX_PB_BYTES: u64 = 2 << 30;
const SERVING_DEFAULT: &str = "serving_default";

/// One field of a message: its number and wire type, its bytes as written, and the payload of a
/// length-delimited one.
struct Field<'a> {
    number: u64,
    raw: &'a [u8],
    payload: Option<&'a [u8]>,
}

fn varint(b: &[u8], at: &mut usize) -> Result<u64, String> {
    let mut v = 0u64;
    for shift in (0..64).step_by(7) {
        let byte = *b.get(*at).ok_or("a varint runs past the end")?;
        *at += 1;
        v |= u64::from(byte & 0x7f) << shift;
        if byte & 0x80 == 0 {
            return Ok(v);
        }
    }
    Err("a varint longer than ten bytes".into())
}

/// A message's fields, one at a time (a file may hold millions: none is collected).
fn fields(b: &[u8]) -> impl Iterator<Item = Result<Field<'_>, String>> {
    let mut at = 0;
    std::iter::from_fn(move || {
        if at >= b.len() {
            return None;
        }
        let field = field_at(b, &mut at);
        if field.is_err() {
            at = b.len();
        }
        Some(field)
    })
}

fn field_at<'a>(b: &'a [u8], at: &mut usize) -> Result<Field<'a>, String> {
    let start = *at;
    let key = varint(b, at)?;
    let payload = match key & 7 {
        0 => {
            varint(b, at)?;
            None
        }
        1 | 5 => {
            let n = if key & 7 == 1 { 8 } else { 4 };
            if b.len() - *at < n {
                return Err("a fixed-width field runs past the end".into());
            }
            *at += n;
            None
        }
        2 => {
            let len = varint(b, at)?;
            let len = usize::try_from(len).ok().filter(|&l| l <= b.len() - *at).ok_or("a field runs past the end")?;
            *at += len;
            Some(&b[*at - len..*at])
        }
        w => return Err(format!("wire type {w}, which a SavedModel does not use")),
    };
    Ok(Field { number: key >> 3, raw: &b[start..*at], payload })
}

fn put_varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

fn put_bytes(out: &mut Vec<u8>, number: u64, payload: &[u8]) {
    put_varint(out, number << 3 | 2);
    put_varint(out, payload.len() as u64);
    out.extend_from_slice(payload);
}

/// A signature_def map entry's key, and its bytes with the key renamed.
fn entry_key(entry: &[u8]) -> Result<String, String> {
    let mut key: &[u8] = &[];
    for f in fields(entry) {
        let f = f?;
        if f.number == 1 {
            key = f.payload.unwrap_or_default();
        }
    }
    String::from_utf8(key.to_vec()).map_err(|_| "a signature name that is not UTF-8".into())
}

/// `saved_model.pb` with signature `name` as `serving_default` (the old `serving_default`
/// dropped); an error naming the signatures there are when `name` is not one.
pub fn rename(pb: &[u8], name: &str) -> Result<Vec<u8>, String> {
    let mut out = Vec::with_capacity(pb.len() + 16);
    let mut found = Vec::new();
    let mut renamed = false;
    for f in fields(pb) {
        let f = f?;
        let (2, Some(meta)) = (f.number, f.payload) else {
            out.extend_from_slice(f.raw);
            continue;
        };
        let mut graph = Vec::with_capacity(meta.len() + 16);
        for g in fields(meta) {
            let g = g?;
            let (5, Some(entry)) = (g.number, g.payload) else {
                graph.extend_from_slice(g.raw);
                continue;
            };
            let key = entry_key(entry)?;
            if key == name {
                let mut e = Vec::with_capacity(entry.len());
                put_bytes(&mut e, 1, SERVING_DEFAULT.as_bytes());
                for part in fields(entry) {
                    let part = part?;
                    if part.number != 1 {
                        e.extend_from_slice(part.raw);
                    }
                }
                put_bytes(&mut graph, 5, &e);
                renamed = true;
            } else if key != SERVING_DEFAULT {
                graph.extend_from_slice(g.raw);
            }
            if !key.starts_with("__") {
                found.push(key);
            }
        }
        put_bytes(&mut out, 2, &graph);
    }
    if !renamed {
        found.sort();
        found.dedup();
        return Err(format!("the SavedModel has no signature '{name}' (it has: {})", found.join(", ")));
    }
    Ok(out)
}

/// A copy of the SavedModel directory `dir` serving signature `name`: the rewritten
/// `saved_model.pb`, and links to everything else. Removed when dropped.
pub fn resigned(dir: &Path, name: &str) -> Result<tempfile::TempDir, String> {
    let pb_path = dir.join("saved_model.pb");
    let meta = std::fs::metadata(&pb_path).map_err(|e| format!("cannot read '{}': {e}", pb_path.display()))?;
    if !meta.is_file() || meta.len() > MAX_PB_BYTES {
        return Err(format!("'{}' is not a regular file of at most 2 GiB", pb_path.display()));
    }
    let pb = std::fs::read(&pb_path).map_err(|e| format!("cannot read '{}': {e}", pb_path.display()))?;
    let pb = rename(&pb, name).map_err(|e| format!("TF_SIGNATURE_DEF '{name}': {e}"))?;
    let temp = tempfile::Builder::new()
        .prefix("ferry-signature-")
        .tempdir()
        .map_err(|e| format!("cannot make a directory for signature '{name}': {e}"))?;
    std::fs::write(temp.path().join("saved_model.pb"), pb)
        .map_err(|e| format!("cannot write the SavedModel copy: {e}"))?;
    let entries = std::fs::read_dir(dir).map_err(|e| format!("cannot list '{}': {e}", dir.display()))?;
    for entry in entries.flatten() {
        if entry.file_name() == "saved_model.pb" {
            continue;
        }
        let target = std::fs::canonicalize(entry.path())
            .map_err(|e| format!("cannot read '{}': {e}", entry.path().display()))?;
        std::os::unix::fs::symlink(&target, temp.path().join(entry.file_name()))
            .map_err(|e| format!("cannot link '{}': {e}", target.display()))?;
    }
    Ok(temp)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(key: &str, value: &[u8]) -> Vec<u8> {
        let mut e = Vec::new();
        put_bytes(&mut e, 1, key.as_bytes());
        put_bytes(&mut e, 2, value);
        e
    }

    fn saved_model(keys: &[(&str, &[u8])]) -> Vec<u8> {
        let mut graph = Vec::new();
        put_bytes(&mut graph, 2, b"graph bytes");
        for (k, v) in keys {
            put_bytes(&mut graph, 5, &entry(k, v));
        }
        put_varint(&mut graph, 7 << 3);
        put_varint(&mut graph, 300);
        let mut pb = vec![8, 1]; // saved_model_schema_version: 1
        put_bytes(&mut pb, 2, &graph);
        pb
    }

    fn signatures(pb: &[u8]) -> Vec<(String, Vec<u8>)> {
        let meta = fields(pb).map(Result::unwrap).find(|f| f.number == 2).unwrap().payload.unwrap();
        fields(meta)
            .map(Result::unwrap)
            .filter(|f| f.number == 5)
            .map(|f| {
                let parts: Vec<_> = fields(f.payload.unwrap()).map(Result::unwrap).collect();
                let value = parts.iter().find(|p| p.number == 2).unwrap().payload.unwrap().to_vec();
                (entry_key(f.payload.unwrap()).unwrap(), value)
            })
            .collect()
    }

    #[test]
    fn the_chosen_signature_becomes_serving_default_and_the_rest_is_kept() {
        let pb = saved_model(&[("serving_default", b"one"), ("predict", b"two"), ("__saved_model_init_op", b"init")]);
        let out = rename(&pb, "predict").unwrap();
        assert_eq!(
            signatures(&out),
            vec![
                ("serving_default".to_string(), b"two".to_vec()),
                ("__saved_model_init_op".to_string(), b"init".to_vec())
            ]
        );
        // Everything else as it was: the version, the graph and the varint field.
        assert_eq!(&out[..2], &[8, 1]);
        assert!(out.windows(11).any(|w| w == b"graph bytes"));
    }

    #[test]
    fn a_missing_signature_names_those_there_are_and_broken_bytes_are_refused() {
        let pb = saved_model(&[("serving_default", b"one"), ("predict", b"two")]);
        let e = rename(&pb, "classify").unwrap_err();
        assert!(e.contains("no signature 'classify' (it has: predict, serving_default)"), "{e}");
        for n in 1..pb.len() {
            // Every cut either fails to parse or lacks the signature; none panics.
            let _ = rename(&pb[..n], "predict");
        }
        assert!(rename(&[0x12, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x01], "p").is_err());
        assert!(rename(&[0x13], "p").unwrap_err().contains("wire type 3"));
    }
}
