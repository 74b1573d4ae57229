//! Which config tensor is which of a package's flat inputs and outputs, as Triton's PyTorch
//! backends name them: by ordinal (`<name>__<i>`), by the call spec (`ARGS[i]`, `KWARGS[name]`,
//! `RESULT[i]`), by the keys of a returned dict, else in config order. The call spec is the
//! package's pytree description of `(args, kwargs)` and of the result, as PyTorch writes it:
//! `[version, {"type": ..., "context": ..., "children_spec": [...]}]`.
use serde_json::Value;

/// The package's flat inputs: positional arguments, then keyword arguments by name.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Inputs {
    pub args: usize,
    pub kwargs: Vec<String>,
}

/// The package's flat outputs, and their keys when the model returns a dict.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Outputs {
    pub count: usize,
    pub keys: Vec<String>,
}

/// Why a spec is not one the server maps (nested structures): such packages run in a process.
pub type Nested = String;

fn leaf(node: &Value) -> bool {
    node.get("type").is_none_or(Value::is_null) && children(node).is_empty()
}

fn children(node: &Value) -> &[Value] {
    node.get("children_spec").and_then(Value::as_array).map_or(&[], Vec::as_slice)
}

/// A dict node's keys (its context is the JSON text of the key list).
fn keys(node: &Value) -> Vec<String> {
    let context = node.get("context").and_then(Value::as_str).unwrap_or("[]");
    let parsed: Value = serde_json::from_str(context).unwrap_or(Value::Null);
    parsed
        .as_array()
        .map_or_else(Vec::new, |a| a.iter().map(|k| k.as_str().map_or_else(|| k.to_string(), str::to_string)).collect())
}

fn root(text: &str) -> Result<Value, Nested> {
    let v: Value = serde_json::from_str(text).map_err(|e| format!("its call spec is not JSON ({e})"))?;
    v.get(1).cloned().ok_or_else(|| "its call spec has no tree".to_string())
}

/// The inputs a spec describes; `flat` is what the container says it takes (used when the
/// package has no spec).
pub fn inputs(text: &str, flat: usize) -> Result<Inputs, Nested> {
    if text.trim().is_empty() {
        return Ok(Inputs { args: flat, kwargs: Vec::new() });
    }
    let tree = root(text)?;
    let [args, kwargs] = children(&tree) else {
        return Err("its inputs are not (args, kwargs)".into());
    };
    if !children(args).iter().all(leaf) || !children(kwargs).iter().all(leaf) {
        return Err("an input is a nested structure (a list or dict of tensors)".into());
    }
    let names = keys(kwargs);
    if names.len() != children(kwargs).len() {
        return Err("its keyword inputs and their names disagree".into());
    }
    let found = Inputs { args: children(args).len(), kwargs: names };
    if found.args + found.kwargs.len() != flat {
        return Err(format!(
            "its call spec names {} inputs and the model takes {flat}",
            found.args + found.kwargs.len()
        ));
    }
    Ok(found)
}

pub fn outputs(text: &str, flat: usize) -> Result<Outputs, Nested> {
    if text.trim().is_empty() {
        return Ok(Outputs { count: flat, keys: Vec::new() });
    }
    let tree = root(text)?;
    if leaf(&tree) {
        return Ok(Outputs { count: 1, keys: Vec::new() });
    }
    if !children(&tree).iter().all(leaf) {
        return Err("an output is a nested structure".into());
    }
    let dict =
        tree.get("type").and_then(Value::as_str).is_some_and(|t| t.ends_with("dict") || t.ends_with("OrderedDict"));
    let found = Outputs { count: children(&tree).len(), keys: if dict { keys(&tree) } else { Vec::new() } };
    if found.count != flat {
        return Err(format!("its call spec names {} outputs and the model gives {flat}", found.count));
    }
    Ok(found)
}

/// A position a name carries: `<name>__<i>`, `ARGS[i]` or `RESULT[i]`.
pub fn ordinal(name: &str) -> Option<usize> {
    if let Some(inner) =
        name.strip_prefix("ARGS[").or_else(|| name.strip_prefix("RESULT[")).and_then(|r| r.strip_suffix(']'))
    {
        return inner.parse().ok();
    }
    let (stem, n) = name.rsplit_once("__")?;
    (!stem.is_empty() && !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit())).then(|| n.parse().ok()).flatten()
}

pub fn keyword(name: &str) -> Option<&str> {
    name.strip_prefix("KWARGS[").and_then(|r| r.strip_suffix(']'))
}

/// Each config input's flat index. Every flat input must be named once.
pub fn plan_inputs(names: &[&str], spec: &Inputs) -> Result<Vec<usize>, String> {
    let flat = spec.args + spec.kwargs.len();
    let named = names.iter().all(|n| ordinal(n).is_some() || keyword(n).is_some());
    let plan: Vec<usize> = if named {
        names
            .iter()
            .map(|n| match keyword(n) {
                Some(k) => spec.kwargs.iter().position(|x| x == k).map(|p| spec.args + p).ok_or_else(|| {
                    format!("input '{n}': the package has no keyword input '{k}' (it has {:?})", spec.kwargs)
                }),
                None => {
                    let i = ordinal(n).unwrap_or(usize::MAX);
                    let limit = if n.starts_with("ARGS[") { spec.args } else { flat };
                    if i < limit {
                        Ok(i)
                    } else {
                        Err(format!("input '{n}': the package takes {limit} positional inputs"))
                    }
                }
            })
            .collect::<Result<_, _>>()?
    } else {
        (0..names.len()).collect()
    };
    let mut seen = vec![false; flat];
    for (n, &i) in names.iter().zip(&plan) {
        match seen.get_mut(i) {
            Some(s) if !*s => *s = true,
            Some(_) => return Err(format!("input '{n}' names the package's input {i}, which another input names too")),
            None => break,
        }
    }
    if names.len() != flat || seen.iter().any(|s| !s) {
        return Err(format!(
            "the configuration names {} inputs ({names:?}), the package takes {flat} ({} positional{})",
            names.len(),
            spec.args,
            if spec.kwargs.is_empty() { String::new() } else { format!(", keywords {:?}", spec.kwargs) }
        ));
    }
    Ok(plan)
}

/// Each config output's flat index.
pub fn plan_outputs(names: &[&str], spec: &Outputs) -> Result<Vec<usize>, String> {
    let by_key = |n: &str| {
        let key = n
            .strip_prefix("RESULT[")
            .and_then(|r| r.strip_suffix(']'))
            .map(|k| k.trim_matches(['\'', '"']))
            .unwrap_or(n);
        spec.keys.iter().position(|k| k == key)
    };
    let plan: Vec<usize> = if !spec.keys.is_empty() && names.iter().all(|n| by_key(n).is_some()) {
        names.iter().map(|n| by_key(n).unwrap_or_default()).collect()
    } else if names.iter().all(|n| ordinal(n).is_some()) {
        names.iter().map(|n| ordinal(n).unwrap_or_default()).collect()
    } else {
        (0..names.len()).collect()
    };
    if let Some((n, i)) = names.iter().zip(&plan).find(|(_, i)| **i >= spec.count) {
        return Err(format!(
            "output '{n}' names the package's output {i}, and the model gives {}{}",
            spec.count,
            if spec.keys.is_empty() { String::new() } else { format!(" (keys {:?})", spec.keys) }
        ));
    }
    Ok(plan)
}

#[cfg(test)]
mod tests {
    use super::*;

    const LEAF: &str = r#"{"type": null, "context": null, "children_spec": []}"#;

    fn input_spec(args: usize, kwargs: &[&str]) -> String {
        let leaves = |n: usize| vec![LEAF; n].join(", ");
        let keys = serde_json::to_string(&serde_json::to_string(kwargs).unwrap()).unwrap();
        format!(
            r#"[1, {{"type": "builtins.tuple", "context": "null", "children_spec": [{{"type": "builtins.tuple", "context": "null", "children_spec": [{}]}}, {{"type": "builtins.dict", "context": {keys}, "children_spec": [{}]}}]}}]"#,
            leaves(args),
            leaves(kwargs.len())
        )
    }

    #[test]
    fn reads_positional_and_keyword_inputs() {
        // As PyTorch 2.15 writes a one-argument model's spec.
        let one = r#"[1, {"type": "builtins.tuple", "context": "null", "children_spec": [{"type": "builtins.tuple", "context": "null", "children_spec": [{"type": null, "context": null, "children_spec": []}]}, {"type": "builtins.dict", "context": "[]", "children_spec": []}]}]"#;
        assert_eq!(inputs(one, 1).unwrap(), Inputs { args: 1, kwargs: vec![] });
        let both = input_spec(2, &["scale"]);
        assert_eq!(inputs(&both, 3).unwrap(), Inputs { args: 2, kwargs: vec!["scale".into()] });
        assert!(inputs(&both, 2).unwrap_err().contains("names 3 inputs"));
        assert_eq!(inputs("", 4).unwrap(), Inputs { args: 4, kwargs: vec![] });
    }

    #[test]
    fn nested_inputs_are_not_mapped() {
        let nested = format!(
            r#"[1, {{"type": "builtins.tuple", "children_spec": [{{"type": "builtins.tuple", "children_spec": [{{"type": "builtins.list", "context": "null", "children_spec": [{LEAF}, {LEAF}]}}]}}, {{"type": "builtins.dict", "context": "[]", "children_spec": []}}]}}]"#
        );
        assert!(inputs(&nested, 2).unwrap_err().contains("nested"));
        assert!(inputs("not json", 1).is_err());
    }

    #[test]
    fn reads_outputs_of_each_form() {
        assert_eq!(outputs(&format!("[1, {LEAF}]"), 1).unwrap(), Outputs { count: 1, keys: vec![] });
        let tuple =
            format!(r#"[1, {{"type": "builtins.tuple", "context": "null", "children_spec": [{LEAF}, {LEAF}]}}]"#);
        assert_eq!(outputs(&tuple, 2).unwrap(), Outputs { count: 2, keys: vec![] });
        let dict = format!(
            r#"[1, {{"type": "builtins.dict", "context": "[\"plus\", \"double\"]", "children_spec": [{LEAF}, {LEAF}]}}]"#
        );
        assert_eq!(outputs(&dict, 2).unwrap(), Outputs { count: 2, keys: vec!["plus".into(), "double".into()] });
    }

    #[test]
    fn names_map_to_flat_positions() {
        let spec = Inputs { args: 2, kwargs: vec!["scale".into()] };
        assert_eq!(plan_inputs(&["KWARGS[scale]", "ARGS[1]", "ARGS[0]"], &spec).unwrap(), [2, 1, 0]);
        assert_eq!(plan_inputs(&["INPUT__2", "INPUT__0", "INPUT__1"], &spec).unwrap(), [2, 0, 1]);
        // Plain names: config order.
        assert_eq!(plan_inputs(&["x", "y", "z"], &spec).unwrap(), [0, 1, 2]);
        assert!(
            plan_inputs(&["KWARGS[nope]", "ARGS[0]", "ARGS[1]"], &spec)
                .unwrap_err()
                .contains("no keyword input 'nope'")
        );
        assert!(plan_inputs(&["ARGS[2]", "ARGS[0]", "ARGS[1]"], &spec).unwrap_err().contains("2 positional"));
        assert!(
            plan_inputs(&["INPUT__0", "INPUT__0", "INPUT__1"], &spec).unwrap_err().contains("another input names too")
        );
        assert!(plan_inputs(&["x", "y"], &spec).unwrap_err().contains("names 2 inputs"));
    }

    #[test]
    fn outputs_map_by_position_key_or_order() {
        let keyed = Outputs { count: 2, keys: vec!["plus".into(), "double".into()] };
        assert_eq!(plan_outputs(&["double", "plus"], &keyed).unwrap(), [1, 0]);
        assert_eq!(plan_outputs(&["RESULT['double']"], &keyed).unwrap(), [1]);
        let two = Outputs { count: 2, keys: vec![] };
        assert_eq!(plan_outputs(&["SUM__1", "PRODUCT__0"], &two).unwrap(), [1, 0]);
        assert_eq!(plan_outputs(&["RESULT[1]"], &two).unwrap(), [1]);
        assert_eq!(plan_outputs(&["a", "b"], &two).unwrap(), [0, 1]);
        assert!(plan_outputs(&["OUTPUT__2"], &two).unwrap_err().contains("gives 2"));
        assert!(plan_outputs(&["a", "b", "c"], &two).is_err());
    }

    #[test]
    fn ordinals_are_read_strictly() {
        assert_eq!(ordinal("INPUT__12"), Some(12));
        assert_eq!(ordinal("ARGS[3]"), Some(3));
        assert_eq!(ordinal("__3"), None);
        assert_eq!(ordinal("x__"), None);
        assert_eq!(ordinal("x__-1"), None);
        assert_eq!(ordinal("ARGS[99999999999999999999999]"), None);
    }
}
