//! A chat template beside a model: `tokenizer_config.json` in its version folder or its model
//! folder, as Hugging Face saves it (`chat_template`: the template, or a list of named ones, of
//! which `default`; `bos_token`/`eos_token`: a string or `{"content": ...}`). Read at load; a
//! file that is too large or not JSON is a warning, never a load failure.
use std::path::Path;

use serde_json::Value;

use crate::model::ChatTemplate;

/// The largest tokenizer_config.json read.
const MAX_FILE: u64 = 8 << 20;

/// The chat template of the model in `dir`, version `version`.
pub fn find(model: &str, dir: &Path, version: u64) -> Option<ChatTemplate> {
    let candidates = [dir.join(version.to_string()).join("tokenizer_config.json"), dir.join("tokenizer_config.json")];
    let path = candidates.iter().find(|p| p.is_file())?;
    let read = || -> Result<Option<ChatTemplate>, String> {
        let size = std::fs::metadata(path).map_err(|e| e.to_string())?.len();
        if size > MAX_FILE {
            return Err(format!("{size} bytes, more than {MAX_FILE}"));
        }
        let v: Value =
            serde_json::from_slice(&std::fs::read(path).map_err(|e| e.to_string())?).map_err(|e| e.to_string())?;
        Ok(parse(&v))
    };
    match read() {
        Ok(t) => t,
        Err(e) => {
            tracing::warn!(model, file = %path.display(), "tokenizer_config.json not read: {e}");
            None
        }
    }
}

fn token(v: Option<&Value>) -> String {
    match v {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Object(o)) => o.get("content").and_then(Value::as_str).unwrap_or_default().to_string(),
        _ => String::new(),
    }
}

fn parse(v: &Value) -> Option<ChatTemplate> {
    let template = match v.get("chat_template")? {
        Value::String(s) => s.clone(),
        Value::Array(named) => {
            let pick = |want: &str| {
                named.iter().find(|t| t.get("name").and_then(Value::as_str) == Some(want))?.get("template")?.as_str()
            };
            pick("default")?.to_string()
        }
        _ => return None,
    };
    Some(ChatTemplate { template, bos_token: token(v.get("bos_token")), eos_token: token(v.get("eos_token")) })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hugging_face_files_are_read() {
        let t = parse(
            &serde_json::json!({"chat_template": "{{ x }}", "bos_token": "<s>", "eos_token": {"content": "</s>"}}),
        )
        .unwrap();
        assert_eq!((t.template.as_str(), t.bos_token.as_str(), t.eos_token.as_str()), ("{{ x }}", "<s>", "</s>"));
        let named = serde_json::json!({"chat_template": [{"name": "tool_use", "template": "a"}, {"name": "default", "template": "b"}]});
        assert_eq!(parse(&named).unwrap().template, "b");
        assert!(parse(&serde_json::json!({"bos_token": "<s>"})).is_none());
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join("1")).unwrap();
        std::fs::write(dir.path().join("tokenizer_config.json"), "not json").unwrap();
        assert!(find("m", dir.path(), 1).is_none());
        std::fs::write(dir.path().join("1/tokenizer_config.json"), r#"{"chat_template": "v1"}"#).unwrap();
        assert_eq!(find("m", dir.path(), 1).unwrap().template, "v1");
    }
}
