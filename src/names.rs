//! Untrusted names and paths: model names, paths a config or a bucket names inside a model
//! folder, and shared-memory keys. Every name a client, a bucket or a config gives passes one of
//! these checks before it touches the disk; none of them can reach outside its folder.
use std::path::{Component, Path, PathBuf};

/// The longest name of one path component on Linux (NAME_MAX).
const NAME_MAX: usize = 255;

/// A model name is one path component: not empty, at most 255 bytes, not `.`/`..` nor hidden
/// (ferry's own working folders start with a dot), without `/`, `\`, NUL or other control
/// characters. Triton's check refuses `..` and `/`; this one also refuses what a folder name
/// cannot portably be.
pub fn check_model_name(name: &str) -> Result<(), String> {
    let bad = |why: &str| Err(format!("invalid model name '{}': {why}", name.escape_debug()));
    if name.is_empty() {
        return bad("it is empty");
    }
    if name.len() > NAME_MAX {
        return bad(&format!("it is {} bytes long, at most {NAME_MAX} are allowed", name.len()));
    }
    if name.starts_with('.') {
        return bad("it starts with '.'");
    }
    if let Some(c) = name.chars().find(|c| matches!(c, '/' | '\\') || c.is_control()) {
        return bad(&format!("it holds {c:?}; a model name is one folder name"));
    }
    Ok(())
}

/// A relative path that stays inside the folder it is joined to: `/`-separated normal
/// components only (no root, no `..`, no `.`, nothing empty, no NUL or backslash).
pub fn relative_path(rel: &str) -> Result<PathBuf, String> {
    let bad = |why: &str| Err(format!("'{}' {why}", rel.escape_debug()));
    if rel.is_empty() {
        return bad("is empty");
    }
    if rel.contains('\0') || rel.contains('\\') {
        return bad("holds a NUL or a backslash");
    }
    let path = Path::new(rel);
    let odd = |c: &str| c.is_empty() || c == "." || c == "..";
    if path.components().any(|c| !matches!(c, Component::Normal(_))) || rel.split('/').any(odd) {
        return bad("must be a relative path inside the model folder (no '/' at the start, no '..', no '.')");
    }
    if rel.split('/').any(|c| c.len() > NAME_MAX) {
        return bad("has a component longer than 255 bytes");
    }
    Ok(path.to_path_buf())
}

/// Reads a file a config names inside `dir`: confined to the folder, a regular file (not a
/// device, a FIFO or a folder), and at most `max` bytes. Errors name the path as the config
/// gave it, not where it resolved.
pub fn read_inside(dir: &Path, rel: &str, max: u64) -> Result<Vec<u8>, String> {
    let path = dir.join(relative_path(rel)?);
    let meta = std::fs::metadata(&path).map_err(|e| format!("cannot read '{rel}': {}", io_reason(&e)))?;
    if !meta.is_file() {
        return Err(format!("'{rel}' is not a regular file"));
    }
    if meta.len() > max {
        return Err(format!("'{rel}' is larger than the {max} bytes allowed"));
    }
    use std::io::Read;
    let file = std::fs::File::open(&path).map_err(|e| format!("cannot read '{rel}': {}", io_reason(&e)))?;
    let mut data = Vec::with_capacity(meta.len() as usize);
    // The file may grow between the size check and the read: read at most max + 1 bytes.
    file.take(max + 1).read_to_end(&mut data).map_err(|e| format!("cannot read '{rel}': {}", io_reason(&e)))?;
    if data.len() as u64 > max {
        return Err(format!("'{rel}' is larger than the {max} bytes allowed"));
    }
    Ok(data)
}

/// The kind of an I/O failure, without the OS's wording of the path.
fn io_reason(e: &std::io::Error) -> String {
    match e.kind() {
        std::io::ErrorKind::NotFound => "no such file".to_string(),
        std::io::ErrorKind::PermissionDenied => "permission denied".to_string(),
        _ => e.to_string(),
    }
}

/// A POSIX shared-memory object name: an optional leading `/`, then one component of at most
/// 255 bytes, not `.` or `..`, without `/` or NUL. Returns the name without its slash.
pub fn shm_object(key: &str) -> Result<&str, String> {
    let name = key.strip_prefix('/').unwrap_or(key);
    let bad = |why: &str| Err(format!("shared memory key '{}' {why}", key.escape_debug()));
    if name.is_empty() || name == "." || name == ".." {
        return bad("does not name a shared memory object");
    }
    if name.contains('/') || name.contains('\0') {
        return bad("must be one name under /dev/shm (no '/' after the first character)");
    }
    if name.len() > NAME_MAX {
        return bad("is longer than 255 bytes");
    }
    Ok(name)
}

/// Every byte outside `A-Za-z0-9-._~` percent-encoded: a name put into a URL (a GCS object in
/// a path, a Redis user or password in the userinfo) as one opaque component.
pub fn percent_encode(name: &str) -> String {
    name.bytes()
        .map(|b| {
            if b.is_ascii_alphanumeric() || b"-._~".contains(&b) {
                (b as char).to_string()
            } else {
                format!("%{b:02X}")
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn model_names() {
        for ok in ["simple", "clip-preprocess", "resnet.tar.gz", "a_b.c-1", "модель", "x y"] {
            check_model_name(ok).unwrap();
        }
        for bad in ["", ".", "..", ".hidden", "/tmp/pwned", "a/b", "..\\x", "a\\b", "a\0b", "a\nb", &"x".repeat(256)] {
            assert!(check_model_name(bad).unwrap_err().starts_with("invalid model name"), "{bad:?}");
        }
    }

    #[test]
    fn names_are_percent_encoded_as_one_url_component() {
        assert_eq!(percent_encode("repo/m 1/model.onnx"), "repo%2Fm%201%2Fmodel.onnx");
        assert_eq!(percent_encode("a-b_c.d~e"), "a-b_c.d~e");
        assert_eq!(percent_encode("p@ss:w/rd"), "p%40ss%3Aw%2Frd");
    }

    #[test]
    fn relative_paths() {
        assert_eq!(relative_path("1/model.onnx").unwrap(), PathBuf::from("1/model.onnx"));
        for bad in ["", "/etc/passwd", "../x", "1/../../x", "./x", "a//b", "a/", "a\\b", "a\0b", "a/./b"] {
            assert!(relative_path(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn reads_stay_inside_and_bounded() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("f"), b"12345").unwrap();
        std::fs::create_dir(dir.path().join("d")).unwrap();
        assert_eq!(read_inside(dir.path(), "f", 5).unwrap(), b"12345");
        assert!(read_inside(dir.path(), "f", 4).unwrap_err().contains("larger than the 4 bytes"));
        assert!(read_inside(dir.path(), "d", 5).unwrap_err().contains("not a regular file"));
        assert!(read_inside(dir.path(), "../f", 5).unwrap_err().contains("inside the model folder"));
        assert!(read_inside(Path::new("/"), "dev/zero", 5).unwrap_err().contains("not a regular file"));
        let missing = read_inside(dir.path(), "nope", 5).unwrap_err();
        assert!(missing.contains("'nope'") && !missing.contains(&dir.path().display().to_string()), "{missing}");
    }

    #[test]
    fn shm_keys() {
        assert_eq!(shm_object("/input").unwrap(), "input");
        assert_eq!(shm_object("input").unwrap(), "input");
        for bad in ["", "/", "/..", "..", "../../etc/passwd", "/a/b", "a\0"] {
            assert!(shm_object(bad).is_err(), "{bad:?}");
        }
    }
}
