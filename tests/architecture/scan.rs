//! Reading src/ the way the compiler resolves paths, closely enough to see every module a file
//! reaches: comments and strings blanked (a string holding a `crate::` path, as serde's `with`
//! takes, kept), inline modules read as modules of their own, test modules left out, and a path
//! followed through the names its file's `use` items bind (`use crate::backend;` then
//! `backend::onnx::…` reaches `backend::onnx`).
use std::{
    collections::{BTreeMap, BTreeSet},
    path::{Path, PathBuf},
};

pub type Module = Vec<String>;

/// The code of one module: a file, or an inline `mod x { … }` inside one.
pub struct Unit {
    pub module: Module,
    /// The file, relative to src/.
    pub rel: String,
    pub code: String,
}

pub fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            walk(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The library's modules (src/main.rs, the binary, is none of them; nor are test files).
pub fn units(src: &Path) -> Vec<Unit> {
    let mut files = Vec::new();
    walk(src, &mut files);
    files.sort();
    let mut out = Vec::new();
    for path in files {
        let rel = path.strip_prefix(src).unwrap().to_string_lossy().replace('\\', "/");
        let mut module: Module = rel.trim_end_matches(".rs").split('/').map(str::to_string).collect();
        if module.last().is_some_and(|m| m == "mod" || m == "lib") {
            module.pop();
        }
        if rel == "main.rs" || module.last().is_some_and(|m| m == "tests") {
            continue;
        }
        let code = squeeze_paths(&strip(&std::fs::read_to_string(&path).unwrap()));
        split(module, &rel, &code, &mut out);
    }
    out
}

/// The code with comments, strings and character literals blanked out (lifetimes kept). A string
/// that is a whole `crate::`/`super::`/`self::` path stays, unquoted.
pub fn strip(text: &str) -> String {
    let c: Vec<char> = text.chars().collect();
    let (mut out, mut i) = (String::with_capacity(text.len()), 0);
    while i < c.len() {
        let at = |k: usize| c.get(i + k).copied().unwrap_or('\0');
        if at(0) == '/' && at(1) == '/' {
            while i < c.len() && c[i] != '\n' {
                i += 1;
            }
        } else if at(0) == '/' && at(1) == '*' {
            let mut depth = 0;
            while i < c.len() {
                if c[i] == '/' && c.get(i + 1) == Some(&'*') {
                    depth += 1;
                    i += 2;
                } else if c[i] == '*' && c.get(i + 1) == Some(&'/') {
                    depth -= 1;
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    i += 1;
                }
            }
        } else if let Some(skip) = raw_start(&c, i) {
            let hashes = c[i + skip..].iter().take_while(|&&h| h == '#').count();
            i += skip + hashes + 1;
            let close: Vec<char> = std::iter::once('"').chain(std::iter::repeat_n('#', hashes)).collect();
            while i < c.len() && !c[i..].starts_with(&close) {
                i += 1;
            }
            i += close.len();
            out.push_str("\"\"");
        } else if at(0) == '"' {
            let start = i + 1;
            i += 1;
            while i < c.len() && c[i] != '"' {
                i += if c[i] == '\\' { 2 } else { 1 };
            }
            let content: String = c[start..i.min(c.len())].iter().collect();
            i += 1;
            let is_path = ["crate::", "super::", "self::"].iter().any(|p| content.starts_with(p))
                && content.chars().all(|ch| ident_char(ch) || ch == ':');
            if is_path {
                out.push_str(&format!(" {content} "));
            } else {
                out.push_str("\"\"");
            }
        } else if at(0) == '\'' && (at(1) == '\\' || at(2) == '\'') {
            i += 1;
            while i < c.len() && c[i] != '\'' {
                i += if c[i] == '\\' { 2 } else { 1 };
            }
            i += 1;
            out.push_str("' '");
        } else {
            out.push(c[i]);
            i += 1;
        }
    }
    out
}

/// Where a raw string (`r"`, `r#"`, `br"`, `cr"`) starts at `i`: the length of its prefix letters.
fn raw_start(c: &[char], i: usize) -> Option<usize> {
    if i > 0 && ident_char(c[i - 1]) {
        return None;
    }
    let letters = match (c.get(i), c.get(i + 1)) {
        (Some('r'), _) => 1,
        (Some('b' | 'c'), Some('r')) => 2,
        _ => return None,
    };
    let hashes = c[(i + letters).min(c.len())..].iter().take_while(|&&h| h == '#').count();
    (c.get(i + letters + hashes) == Some(&'"')).then_some(letters)
}

pub fn ident_char(ch: char) -> bool {
    ch.is_alphanumeric() || ch == '_'
}

/// `a :: b` and `a::\n b` written as `a::b`.
fn squeeze_paths(code: &str) -> String {
    let mut out = String::with_capacity(code.len());
    let mut rest = code;
    while let Some(k) = rest.find("::") {
        out.push_str(rest[..k].trim_end());
        out.push_str("::");
        rest = rest[k + 2..].trim_start();
    }
    out.push_str(rest);
    out
}

/// Splits a file's code into its module and its inline modules (each a unit of its own path);
/// a module under a `#[cfg(…test…)]` attribute is left out.
fn split(module: Module, rel: &str, code: &str, out: &mut Vec<Unit>) {
    let mut own = String::with_capacity(code.len());
    let mut at = 0;
    while let Some((start, name, open)) = next_inline_mod(code, at) {
        let close = matching_brace(code, open);
        own.push_str(&code[at..start]);
        if !test_only(&code[..start]) {
            let mut inner = module.clone();
            inner.push(name);
            split(inner, rel, &code[open + 1..close], out);
        } else if let Some(attr) = own.rfind("#[cfg(") {
            own.truncate(attr);
        }
        at = (close + 1).min(code.len());
    }
    own.push_str(&code[at..]);
    out.push(Unit { module, rel: rel.to_string(), code: own });
}

/// The next `mod name {` from `from`: where its `mod` starts, its name, and its brace.
fn next_inline_mod(code: &str, from: usize) -> Option<(usize, String, usize)> {
    let mut at = from;
    while let Some(k) = code[at..].find("mod ") {
        let start = at + k;
        at = start + 4;
        if code[..start].chars().next_back().is_some_and(ident_char) {
            continue;
        }
        let name: String = code[at..].chars().take_while(|&ch| ident_char(ch)).collect();
        let after = code[at + name.len()..].trim_start();
        if !name.is_empty() && after.starts_with('{') {
            let open = code.len() - after.len();
            return Some((start, name, open));
        }
    }
    None
}

fn matching_brace(code: &str, open: usize) -> usize {
    let mut depth = 0usize;
    for (k, ch) in code[open..].char_indices() {
        match ch {
            '{' => depth += 1,
            '}' => {
                depth -= 1;
                if depth == 0 {
                    return open + k;
                }
            }
            _ => {}
        }
    }
    code.len()
}

/// Whether the item that follows `before` (its attributes and visibility) is compiled only
/// for tests.
fn test_only(before: &str) -> bool {
    let mut head = before.trim_end();
    for vis in ["pub(crate)", "pub(super)", "pub"] {
        head = head.strip_suffix(vis).unwrap_or(head).trim_end();
    }
    while head.ends_with(']') {
        let Some(open) = head.rfind("#[") else { break };
        let attr = &head[open..];
        let words: Vec<&str> = attr.split(|ch: char| !ident_char(ch)).collect();
        if attr.starts_with("#[cfg(") && words.contains(&"test") && !words.contains(&"not") {
            return true;
        }
        head = head[..open].trim_end();
    }
    false
}

/// Every path a unit names: the leaves of its `use` trees (with the name each binds), and the
/// paths written in its code.
pub struct Named {
    pub uses: Vec<(Vec<String>, String)>,
    pub paths: Vec<Vec<String>>,
}

pub fn named(code: &str) -> Named {
    let mut uses = Vec::new();
    for (k, word) in words(code) {
        if word == "use" && !code[..k].ends_with(':') {
            let rest = &code[k + 3..];
            if let Some(end) = rest.find(';') {
                use_tree(&rest[..end], &[], &mut uses);
            }
        }
    }
    let mut paths = Vec::new();
    for (k, word) in words(code) {
        let before = code[..k].chars().next_back().unwrap_or(' ');
        if before == ':' && !code[..k].trim_end_matches(':').ends_with(|ch: char| !ident_char(ch)) {
            continue;
        }
        if code[k + word.len()..].starts_with("::") {
            let tail: String = code[k..].chars().take_while(|&ch| ident_char(ch) || ch == ':').collect();
            let path: Vec<String> = tail.split("::").map(str::to_string).filter(|s| !s.is_empty()).collect();
            if path.len() > 1 {
                paths.push(path);
            }
        }
    }
    Named { uses, paths }
}

fn words(code: &str) -> Vec<(usize, &str)> {
    let mut out = Vec::new();
    let mut start = None;
    for (k, ch) in code.char_indices().chain(std::iter::once((code.len(), ' '))) {
        match (ident_char(ch), start) {
            (true, None) => start = Some(k),
            (false, Some(s)) => {
                out.push((s, &code[s..k]));
                start = None;
            }
            _ => {}
        }
    }
    out
}

fn use_tree(tree: &str, prefix: &[String], out: &mut Vec<(Vec<String>, String)>) {
    let mut depth = 0;
    let mut items = vec![String::new()];
    for ch in tree.chars() {
        match ch {
            '{' => depth += 1,
            '}' => depth -= 1,
            ',' if depth == 0 => {
                items.push(String::new());
                continue;
            }
            _ => {}
        }
        items.last_mut().unwrap().push(ch);
    }
    for item in items.iter().map(|i| i.trim()).filter(|i| !i.is_empty()) {
        let segments = |s: &str| -> Vec<String> {
            let own = s.split("::").map(|p| p.trim().to_string()).filter(|p| !p.is_empty());
            prefix.iter().cloned().chain(own).collect()
        };
        match item.find('{') {
            Some(open) => {
                let head = segments(item[..open].trim_end_matches(|c: char| c == ':' || c.is_whitespace()));
                use_tree(&item[open + 1..item.rfind('}').unwrap()], &head, out);
            }
            None => {
                let mut parts = item.split(" as ");
                let mut path = segments(parts.next().unwrap());
                if path.last().is_some_and(|s| s == "self") {
                    path.pop();
                }
                let name = parts.next().map(|a| a.trim().to_string()).or_else(|| path.last().cloned());
                out.push((path, name.unwrap_or_default()));
            }
        }
    }
}

/// The module a path lands in, from the module `from` that names it; None outside the crate.
/// `bound` maps the names `from` has bound (its `use` items, its child modules) to modules.
pub fn resolve(
    from: &Module,
    path: &[String],
    bound: &BTreeMap<String, Module>,
    modules: &BTreeSet<Module>,
) -> Option<Module> {
    let (mut base, mut rest): (Module, &[String]) = match path.first()?.as_str() {
        "crate" => (Vec::new(), &path[1..]),
        "self" => (from.clone(), &path[1..]),
        "super" => (from.clone(), path),
        first => (bound.get(first)?.clone(), &path[1..]),
    };
    while rest.first().is_some_and(|s| s == "super") {
        base.pop()?;
        rest = &rest[1..];
    }
    for seg in rest {
        base.push(seg.clone());
        if !modules.contains(&base) {
            base.pop();
            break;
        }
    }
    Some(base)
}

/// The names a unit has bound to modules: its children, and what its `use` items name (a glob
/// binds the children of the module it opens).
pub fn bindings(unit: &Unit, uses: &[(Vec<String>, String)], modules: &BTreeSet<Module>) -> BTreeMap<String, Module> {
    let children = |m: &Module| {
        modules.iter().filter(move |c| c.len() == m.len() + 1 && c.starts_with(m)).cloned().collect::<Vec<_>>()
    };
    let mut bound: BTreeMap<String, Module> =
        children(&unit.module).into_iter().map(|c| (c.last().unwrap().clone(), c)).collect();
    // Twice: a `use` may name a module through a name another `use` binds.
    for _ in 0..2 {
        for (path, name) in uses {
            let glob = path.last().is_some_and(|s| s == "*");
            let path = if glob { &path[..path.len() - 1] } else { &path[..] };
            if path.is_empty() {
                continue;
            }
            let Some(target) = resolve(&unit.module, path, &bound, modules) else { continue };
            let whole = target.len() == module_len(&unit.module, path, &bound);
            if glob && whole {
                for c in children(&target) {
                    bound.insert(c.last().unwrap().clone(), c);
                }
            } else if whole && !name.is_empty() && name != "_" {
                bound.insert(name.clone(), target);
            }
        }
    }
    bound
}

/// How long the module path of `path` would be if every segment were a module.
fn module_len(from: &Module, path: &[String], bound: &BTreeMap<String, Module>) -> usize {
    let mut len = match path[0].as_str() {
        "crate" => 0,
        "self" | "super" => from.len(),
        first => bound.get(first).map_or(usize::MAX, Vec::len),
    };
    for seg in &path[1..] {
        if seg == "super" {
            len = len.saturating_sub(1);
        } else {
            len += 1;
        }
    }
    if path[0] == "super" { len.saturating_sub(1) } else { len }
}
