//! config.pbtxt and Triton's JSON form of ModelConfig: protobuf text format parsed through
//! prost-reflect (after a pass that accepts the colon-less list form `input [ {..} ]` that nearly
//! every Triton config uses), JSON printed and read with proto field names.
use miette::Diagnostic;
use prost_reflect::{DeserializeOptions, DynamicMessage, MessageDescriptor, SerializeOptions};

use super::{DESCRIPTORS, inference::ModelConfig};

fn descriptor() -> MessageDescriptor {
    DESCRIPTORS.get_message_by_name("inference.ModelConfig").expect("ModelConfig is in proto/")
}

/// Parses config.pbtxt text. Errors read `line L, column C: <what>`.
pub fn parse(text: &str) -> Result<ModelConfig, String> {
    let (fixed, inserted) = insert_list_colons(text);
    let msg = DynamicMessage::parse_text_format(descriptor(), &fixed).map_err(|e| {
        let at = e
            .labels()
            .and_then(|mut labels| labels.next())
            .map(|label| original_offset(label.offset(), &inserted))
            .unwrap_or(text.len());
        let (line, col) = line_col(text, at);
        match field_before(text, at) {
            Some(field) => format!("line {line}, column {col}: field '{field}': {e}"),
            None => format!("line {line}, column {col}: {e}"),
        }
    })?;
    msg.transcode_to::<ModelConfig>().map_err(|e| format!("config does not fit ModelConfig: {e}"))
}

/// Parses Triton's JSON form (the load API's `config` override): proto field names or their
/// lowerCamelCase forms, enums by name, 64-bit integers as numbers or strings, unknown fields
/// rejected.
pub fn from_json(text: &str) -> Result<ModelConfig, String> {
    let mut de = serde_json::Deserializer::from_str(text);
    let options = DeserializeOptions::new().deny_unknown_fields(true);
    let msg = DynamicMessage::deserialize_with_options(descriptor(), &mut de, &options).map_err(|e| e.to_string())?;
    de.end().map_err(|e| e.to_string())?;
    msg.transcode_to::<ModelConfig>().map_err(|e| e.to_string())
}

/// Triton's JSON form of a config: proto field names, default scalars and lists printed, unset
/// sub-messages left out, enums by name, 64-bit integers as numbers.
pub fn to_json(config: &ModelConfig) -> serde_json::Value {
    let mut msg = DynamicMessage::new(descriptor());
    msg.transcode_from(config).expect("ModelConfig transcodes to its own descriptor");
    let options =
        SerializeOptions::new().use_proto_field_name(true).skip_default_fields(false).stringify_64_bit_integers(false);
    let mut out = Vec::new();
    msg.serialize_with_options(&mut serde_json::Serializer::new(&mut out), &options)
        .expect("a DynamicMessage serializes to JSON");
    // Parsed back into a Value whose maps keep insertion (= proto field) order.
    serde_json::from_slice(&out).expect("JSON written by serde_json parses")
}

/// config.pbtxt text for a config: one field per line, indented, default values left out, fields in
/// the proto's order; `parse` reads it back to the same config.
pub fn to_text(config: &ModelConfig) -> String {
    let mut msg = DynamicMessage::new(descriptor());
    msg.transcode_from(config).expect("ModelConfig transcodes to its own descriptor");
    let options = prost_reflect::text_format::FormatOptions::new()
        .pretty(true)
        .skip_default_fields(true)
        .print_message_fields_in_index_order(true);
    let mut text = msg.to_text_format_with_options(&options);
    text.push('\n');
    text
}

/// Inserts `:` between a field name and a `[` that opens its list, skipping strings and comments.
/// Returns the new text and the (new-text) offsets where colons were inserted.
fn insert_list_colons(text: &str) -> (String, Vec<usize>) {
    #[derive(Clone, Copy, PartialEq)]
    enum Tok {
        None,
        Ident,
        Colon,
        Other,
    }
    let mut out = String::with_capacity(text.len() + 16);
    let mut inserted = Vec::new();
    let (mut last, mut before_last) = (Tok::None, Tok::None);
    let mut chars = text.char_indices().peekable();
    let push_tok = |t: Tok, last: &mut Tok, before: &mut Tok| {
        *before = *last;
        *last = t;
    };
    while let Some((_, c)) = chars.next() {
        match c {
            '#' => {
                out.push(c);
                while let Some(&(_, c)) = chars.peek() {
                    if c == '\n' {
                        break;
                    }
                    out.push(c);
                    chars.next();
                }
            }
            '"' | '\'' => {
                out.push(c);
                while let Some((_, s)) = chars.next() {
                    out.push(s);
                    if s == '\\' {
                        if let Some((_, esc)) = chars.next() {
                            out.push(esc);
                        }
                    } else if s == c || s == '\n' {
                        break;
                    }
                }
                push_tok(Tok::Other, &mut last, &mut before_last);
            }
            '[' => {
                if last == Tok::Ident && before_last != Tok::Colon {
                    inserted.push(out.len());
                    out.push(':');
                }
                out.push(c);
                push_tok(Tok::Other, &mut last, &mut before_last);
            }
            ':' => {
                out.push(c);
                push_tok(Tok::Colon, &mut last, &mut before_last);
            }
            c if c.is_alphabetic() || c == '_' => {
                out.push(c);
                while let Some(&(_, n)) = chars.peek() {
                    if !(n.is_alphanumeric() || n == '_' || n == '.') {
                        break;
                    }
                    out.push(n);
                    chars.next();
                }
                push_tok(Tok::Ident, &mut last, &mut before_last);
            }
            c if c.is_whitespace() => out.push(c),
            c if c.is_ascii_digit() || c == '-' || c == '.' => {
                out.push(c);
                while let Some(&(_, n)) = chars.peek() {
                    if !(n.is_alphanumeric() || n == '.') {
                        break;
                    }
                    out.push(n);
                    chars.next();
                }
                push_tok(Tok::Other, &mut last, &mut before_last);
            }
            c => {
                out.push(c);
                push_tok(Tok::Other, &mut last, &mut before_last);
            }
        }
    }
    (out, inserted)
}

fn original_offset(offset: usize, inserted: &[usize]) -> usize {
    offset - inserted.iter().filter(|&&at| at < offset).count()
}

/// 1-based line and column of a byte offset.
/// The field whose value starts at `at` (`name: <at>`), when the error is about a value.
fn field_before(text: &str, at: usize) -> Option<&str> {
    let before = text.get(..at)?.trim_end().strip_suffix(':')?.trim_end();
    let start = before.rfind(|c: char| !(c.is_ascii_alphanumeric() || c == '_')).map_or(0, |i| i + 1);
    let field = &before[start..];
    (!field.is_empty()).then_some(field)
}

fn line_col(text: &str, offset: usize) -> (usize, usize) {
    let before = &text[..offset.min(text.len())];
    let line = before.matches('\n').count() + 1;
    let col = before.rfind('\n').map_or(before.chars().count(), |nl| before[nl + 1..].chars().count()) + 1;
    (line, col)
}

#[cfg(test)]
mod tests {
    use super::*;

    const TRITON_STYLE: &str = r#"
name: "densenet_onnx"
platform: "onnxruntime_onnx"
max_batch_size : 0
input [
  {
    name: "data_0"
    data_type: TYPE_FP32
    format: FORMAT_NCHW
    dims: [ 3, 224, 224 ]
    reshape { shape: [ 1, 3, 224, 224 ] }
  }
]
output [
  {
    name: "fc6_1"   # a comment with [ brackets ] and "quotes"
    data_type: TYPE_FP32
    dims: [ 1000 ]
    reshape { shape: [ 1, 1000, 1, 1 ] }
    label_filename: "densenet_labels.txt"
  }
]
instance_group [ { count: 2 kind: KIND_CPU } ]
dynamic_batching { preferred_batch_size: [ 4, 8 ] max_queue_delay_microseconds: 100 }
parameters { key: "intra_op_thread_count" value: { string_value: "2" } }
"#;

    #[test]
    fn parses_colon_less_lists() {
        let cfg = parse(TRITON_STYLE).unwrap();
        assert_eq!(cfg.name, "densenet_onnx");
        assert_eq!(cfg.input.len(), 1);
        assert_eq!(cfg.input[0].dims, vec![3, 224, 224]);
        assert_eq!(cfg.input[0].reshape.as_ref().unwrap().shape, vec![1, 3, 224, 224]);
        assert_eq!(cfg.output[0].label_filename, "densenet_labels.txt");
        assert_eq!(cfg.instance_group[0].count, 2);
        assert_eq!(cfg.instance_group[0].kind, 2);
        assert_eq!(cfg.parameters["intra_op_thread_count"].string_value, "2");
        match cfg.scheduling_choice {
            Some(crate::proto::inference::model_config::SchedulingChoice::DynamicBatching(db)) => {
                assert_eq!(db.preferred_batch_size, vec![4, 8]);
                assert_eq!(db.max_queue_delay_microseconds, 100);
            }
            other => panic!("expected dynamic batching, got {other:?}"),
        }
    }

    #[test]
    fn repeated_blocks_and_single_quotes() {
        let cfg = parse("input { name: 'a' data_type: TYPE_INT32 dims: 4 dims: 5 }\ninput { name: \"b\" }").unwrap();
        assert_eq!(cfg.input.len(), 2);
        assert_eq!(cfg.input[0].dims, vec![4, 5]);
        assert_eq!(cfg.input[1].name, "b");
    }

    #[test]
    fn errors_name_line_column_and_field() {
        let err = parse("name: \"m\"\ninput [\n  { name: \"x\" dimz: [1] }\n]\n").unwrap_err();
        assert!(err.starts_with("line 3, column 15:"), "{err}");
        assert!(err.contains("dimz"), "{err}");
        let err = parse("max_batch_size: 8\ninput [ { data_type: TYPE_FP33 } ]").unwrap_err();
        assert!(err.starts_with("line 2, column 22:"), "{err}");
        assert!(err.contains("TYPE_FP33") && err.contains("field 'data_type'"), "{err}");
        let err = parse("name: \"m\"\nmax_batch_size: \"eight\"\n").unwrap_err();
        assert!(err.contains("field 'max_batch_size'") && err.contains("integer"), "{err}");
    }

    #[test]
    fn oneof_conflict_is_an_error() {
        let err = parse("dynamic_batching { }\nsequence_batching { }").unwrap_err();
        assert!(err.contains("line 2"), "{err}");
    }

    #[test]
    fn colon_pass_leaves_strings_and_values_alone() {
        let (out, ins) = insert_list_colons("a: \"x [\" b [1] kind: KIND_CPU c [2] d: [3]");
        assert_eq!(out, "a: \"x [\" b :[1] kind: KIND_CPU c :[2] d: [3]");
        assert_eq!(ins.len(), 2);
    }

    #[test]
    fn json_has_triton_shape() {
        let cfg = parse(TRITON_STYLE).unwrap();
        let json = to_json(&cfg);
        assert_eq!(json["max_batch_size"], 0);
        assert_eq!(json["input"][0]["data_type"], "TYPE_FP32");
        assert_eq!(json["input"][0]["dims"], serde_json::json!([3, 224, 224]));
        assert_eq!(json["dynamic_batching"]["max_queue_delay_microseconds"], 100);
        assert_eq!(json["input"][0]["is_shape_tensor"], false);
        assert!(json.get("sequence_batching").is_none(), "{json}");
        assert!(json.get("response_cache").is_none(), "{json}");
        let back = from_json(&json.to_string()).unwrap();
        assert_eq!(back, cfg);
    }

    #[test]
    fn json_override_rejects_unknown_fields() {
        assert!(from_json(r#"{"name":"m","inputs":[]}"#).is_err());
        let cfg =
            from_json(r#"{"name":"m","maxBatchSize":4,"input":[{"name":"x","data_type":"TYPE_FP32","dims":["3"]}]}"#)
                .unwrap();
        assert_eq!(cfg.max_batch_size, 4);
        assert_eq!(cfg.input[0].dims, vec![3]);
    }

    #[test]
    fn text_written_parses_back_to_the_same_config() {
        let cfg = parse(
            r#"name: "m" backend: "onnxruntime" max_batch_size: 8
input [ { name: "x" data_type: TYPE_FP32 dims: [ 3, -1 ] } ]
output [ { name: "y" data_type: TYPE_FP32 dims: [ 3 ] } ]
instance_group [ { count: 2 kind: KIND_CPU } ]
dynamic_batching { preferred_batch_size: [ 4, 8 ] max_queue_delay_microseconds: 500 }
parameters { key: "intra_op_thread_count" value: { string_value: "1" } }"#,
        )
        .unwrap();
        let text = to_text(&cfg);
        assert!(text.contains("max_queue_delay_microseconds: 500"), "{text}");
        assert_eq!(parse(&text).unwrap(), cfg);
    }
}
