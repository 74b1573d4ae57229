//! The shape of the house, checked: reads the `use` paths of src/ and fails, naming the files, on
//! an import cycle between sibling modules (at any depth), on an import that points from a lower
//! layer to a higher one (data → core → adapters → wiring, as ../shared/design/architecture.md
//! writes it down), on a module laid out both as `foo.rs` and `foo/`, and on a framework named
//! outside its adapter. Test code (`mod tests`) is left out: it may reach wherever it needs.
use std::{
    collections::{BTreeMap, BTreeSet},
    path::{Path, PathBuf},
};

type Module = Vec<String>;

/// Each module's layer, by the longest matching prefix of its path; every top-level module needs
/// one. 0 data, 1 core, 2 adapters, 3 wiring: an import may point only to its own layer or a lower.
const LAYERS: &[(&str, u8)] = &[
    ("admission", 0),
    ("classify", 0),
    ("device", 0),
    ("error", 0),
    ("names", 0),
    ("proto", 0),
    ("request", 0),
    ("schema", 0),
    ("settings", 0),
    ("stats", 0),
    ("tensor", 0),
    ("backend", 1),
    ("cache", 1),
    ("engine", 1),
    ("ensemble", 1),
    ("gpu", 1),
    ("metrics", 1),
    ("model", 1),
    ("repository", 1),
    ("scheduler", 1),
    ("shm", 1),
    ("telemetry", 1),
    ("validate", 1),
    ("backend::accelerators", 2),
    ("backend::identity", 2),
    ("backend::native", 2),
    ("backend::onnx", 2),
    ("backend::ort_library", 2),
    ("backend::python", 2),
    ("frontend", 2),
    ("config", 3),
    ("server", 3),
    ("tune", 3),
];
const LAYER_NAMES: [&str; 4] = ["data", "core", "adapters", "wiring"];

/// The frameworks and the only places (path prefixes under src/) that may name them.
const FRAMEWORKS: &[(&str, &[&str])] = &[
    ("axum", &["frontend/", "server.rs"]),
    ("tonic", &["frontend/", "server.rs"]),
    ("hyper", &["frontend/"]),
    ("ort", &["backend/onnx/"]),
    ("object_store", &["repository/storage.rs", "repository/checksums/"]),
    ("aws_config", &["repository/storage.rs", "repository/checksums/"]),
    ("aws_sdk_s3", &["repository/checksums/"]),
    ("cudarc", &["gpu.rs", "shm/cuda.rs"]),
    ("prometheus", &["metrics/"]),
    ("opentelemetry", &["telemetry/"]),
    ("opentelemetry_sdk", &["telemetry/"]),
    ("opentelemetry_otlp", &["telemetry/"]),
    ("tokenizers", &["backend/native/tokenizer/"]),
    ("image", &["backend/native/image/"]),
];

struct Source {
    module: Module,
    rel: String,
    code: String,
}

fn src_dir() -> PathBuf {
    let root = std::env::var("CARGO_MANIFEST_DIR").unwrap_or_else(|_| env!("CARGO_MANIFEST_DIR").to_string());
    Path::new(&root).join("src")
}

fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            walk(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The library's files with their module paths (src/main.rs, the binary, is not one of them).
fn sources(src: &Path) -> Vec<Source> {
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
        let code = without_tests(&strip(&std::fs::read_to_string(&path).unwrap()));
        out.push(Source { module, rel, code });
    }
    out
}

/// The code with comments, strings and character literals blanked out (lifetimes kept).
fn strip(text: &str) -> String {
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
        } else if (at(0) == 'r' || (at(0) == 'b' && at(1) == 'r')) && !ident_char(prev(&c, i)) && raw_start(&c, i) {
            i += if at(0) == 'b' { 2 } else { 1 };
            let hashes = c[i..].iter().take_while(|&&h| h == '#').count();
            i += hashes + 1;
            let close: Vec<char> = std::iter::once('"').chain(std::iter::repeat_n('#', hashes)).collect();
            while i < c.len() && !c[i..].starts_with(&close) {
                i += 1;
            }
            i += close.len();
            out.push_str("\"\"");
        } else if at(0) == '"' {
            i += 1;
            while i < c.len() && c[i] != '"' {
                i += if c[i] == '\\' { 2 } else { 1 };
            }
            i += 1;
            out.push_str("\"\"");
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

fn prev(c: &[char], i: usize) -> char {
    if i == 0 { ' ' } else { c[i - 1] }
}

fn raw_start(c: &[char], i: usize) -> bool {
    let j = i + if c[i] == 'b' { 2 } else { 1 };
    let hashes = c[j.min(c.len())..].iter().take_while(|&&h| h == '#').count();
    c.get(j + hashes) == Some(&'"')
}

fn ident_char(ch: char) -> bool {
    ch.is_alphanumeric() || ch == '_'
}

/// The code before its `#[cfg(test)] mod tests { … }`.
fn without_tests(code: &str) -> String {
    let squeezed = |s: &str| s.split_whitespace().collect::<String>();
    let mut at = 0;
    while let Some(k) = code[at..].find("#[cfg(test)]") {
        let start = at + k;
        let after = &code[start + "#[cfg(test)]".len()..];
        let head: String = squeezed(&after[..after.len().min(40)]);
        if head.starts_with("modtests{") {
            return code[..start].to_string();
        }
        at = start + 1;
    }
    code.to_string()
}

/// Every path a file names: the leaves of its `use` trees, and `crate::`, `super::`, `self::`
/// paths written inline.
fn paths(code: &str) -> Vec<Vec<String>> {
    let mut out = Vec::new();
    let words: Vec<(usize, &str)> = code
        .match_indices(|ch: char| !ident_char(ch))
        .scan(0, |start, (k, sep)| {
            let word = (*start, &code[*start..k]);
            *start = k + sep.len();
            Some(word)
        })
        .collect();
    for (k, word) in &words {
        if *word == "use" && k.checked_sub(1).is_none_or(|p| code.as_bytes()[p] != b':') {
            let rest = &code[k + 3..];
            if let Some(end) = rest.find(';') {
                use_tree(&rest[..end], &[], &mut out);
            }
        }
    }
    let bytes = code.as_bytes();
    for (k, word) in &words {
        let starts = k.checked_sub(1).is_none_or(|p| !(bytes[p] == b':' || ident_char(bytes[p] as char)));
        if matches!(*word, "crate" | "super" | "self") && starts && code[k + word.len()..].starts_with("::") {
            let tail: String = code[*k..].chars().take_while(|&ch| ident_char(ch) || ch == ':').collect();
            let path: Vec<String> = tail.split("::").map(str::to_string).filter(|s| !s.is_empty()).collect();
            if path.len() > 1 {
                out.push(path);
            }
        }
    }
    out
}

fn use_tree(tree: &str, prefix: &[String], out: &mut Vec<Vec<String>>) {
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
            prefix
                .iter()
                .cloned()
                .chain(s.split("::").map(|p| p.trim().to_string()).filter(|p| !p.is_empty()))
                .collect()
        };
        match item.find('{') {
            Some(open) => {
                let head = segments(item[..open].trim_end_matches(|c: char| c == ':' || c.is_whitespace()));
                use_tree(&item[open + 1..item.rfind('}').unwrap()], &head, out);
            }
            None => out.push(segments(item.split(" as ").next().unwrap())),
        }
    }
}

/// The module a path lands in, from the module `from` that names it; None outside the crate.
fn resolve(from: &Module, path: &[String], modules: &BTreeSet<Module>) -> Option<Module> {
    let (mut base, mut rest): (Module, &[String]) = match path.first()?.as_str() {
        "crate" => (Vec::new(), &path[1..]),
        "self" => (from.clone(), &path[1..]),
        "super" => (from.clone(), path),
        _ => (from.clone(), path),
    };
    while rest.first().is_some_and(|s| s == "super") {
        base.pop()?;
        rest = &rest[1..];
    }
    let bare = !matches!(path[0].as_str(), "crate" | "self" | "super");
    let mut at = base;
    for seg in rest {
        at.push(seg.clone());
        if !modules.contains(&at) {
            at.pop();
            break;
        }
    }
    // A bare path resolves only through a child module of the file (anything else is a crate).
    if bare && at.len() == from.len() {
        return None;
    }
    Some(at)
}

/// Every (importer, imported module) edge, with the file it comes from.
fn edges(sources: &[Source]) -> Vec<(Module, Module, String)> {
    let modules: BTreeSet<Module> = sources.iter().map(|s| s.module.clone()).collect();
    let mut out = BTreeSet::new();
    for s in sources {
        for p in paths(&s.code) {
            if let Some(target) = resolve(&s.module, &p, &modules)
                && target != s.module
            {
                out.insert((s.module.clone(), target, s.rel.clone()));
            }
        }
    }
    out.into_iter().collect()
}

fn show(m: &[String]) -> String {
    if m.is_empty() { "crate".into() } else { m.join("::") }
}

/// Import cycles among the children of each module: an edge a → b between siblings stands for
/// any import from a's subtree into b's.
fn cycles(edges: &[(Module, Module, String)]) -> Vec<String> {
    let mut levels: BTreeMap<Module, BTreeMap<(String, String), BTreeSet<String>>> = BTreeMap::new();
    for (from, to, file) in edges {
        let common = from.iter().zip(to).take_while(|(a, b)| a == b).count();
        if common == from.len() || common == to.len() {
            continue;
        }
        let key = (from[common].clone(), to[common].clone());
        levels.entry(from[..common].to_vec()).or_default().entry(key).or_default().insert(file.clone());
    }
    let mut found = Vec::new();
    for (parent, level) in &levels {
        let mut adj: BTreeMap<&str, BTreeSet<&str>> = BTreeMap::new();
        for (a, b) in level.keys() {
            adj.entry(a).or_default().insert(b);
        }
        let reach = |start: &str| {
            let (mut seen, mut todo) = (BTreeSet::new(), vec![start.to_string()]);
            while let Some(n) = todo.pop() {
                for &next in adj.get(n.as_str()).into_iter().flatten() {
                    if seen.insert(next.to_string()) {
                        todo.push(next.to_string());
                    }
                }
            }
            seen
        };
        for ((a, b), files) in level {
            if reach(b).contains(a) {
                let files: Vec<&str> = files.iter().map(String::as_str).collect();
                found.push(format!("in {}: {a} -> {b} ({}) is part of a cycle", show(parent), files.join(", ")));
            }
        }
    }
    found
}

fn layer(module: &[String]) -> Option<u8> {
    let name = module.join("::");
    LAYERS
        .iter()
        .filter(|(p, _)| name == *p || name.starts_with(&format!("{p}::")))
        .max_by_key(|(p, _)| p.len())
        .map(|(_, l)| *l)
}

fn layer_breaks(sources: &[Source], edges: &[(Module, Module, String)]) -> Vec<String> {
    let mut found = Vec::new();
    for s in sources.iter().filter(|s| s.module.len() == 1) {
        if layer(&s.module).is_none() {
            found.push(format!("src/{}: module {} has no layer in LAYERS", s.rel, show(&s.module)));
        }
    }
    for (from, to, file) in edges {
        let (Some(a), Some(b)) = (layer(from), layer(to)) else { continue };
        if b > a {
            let (la, lb) = (LAYER_NAMES[a as usize], LAYER_NAMES[b as usize]);
            found.push(format!("src/{file}: {} ({la}) imports {} ({lb})", show(from), show(to)));
        }
    }
    found
}

fn framework_breaks(sources: &[Source]) -> Vec<String> {
    let mut found = Vec::new();
    for s in sources {
        for (name, homes) in FRAMEWORKS {
            if homes.iter().any(|h| s.rel.starts_with(h)) {
                continue;
            }
            let named = s.code.match_indices(&format!("{name}::")).any(|(k, _)| {
                let before = s.code[..k].chars().next_back().unwrap_or(' ');
                !(ident_char(before) || before == ':')
            });
            let used = paths(&s.code).iter().any(|p| p.first().is_some_and(|f| f == name));
            if named || used {
                found.push(format!("src/{}: names {name}, whose home is {}", s.rel, homes.join(" or ")));
            }
        }
    }
    found
}

fn layout_breaks(src: &Path) -> Vec<String> {
    let mut files = Vec::new();
    walk(src, &mut files);
    let mut found: Vec<String> = files
        .iter()
        .filter(|f| f.with_extension("").is_dir())
        .map(|f| format!("{}: use {}/mod.rs", f.display(), f.with_extension("").display()))
        .collect();
    found.sort();
    found
}

fn report(what: &str, found: Vec<String>) {
    assert!(found.is_empty(), "{what}:\n  {}", found.join("\n  "));
}

#[test]
fn no_import_cycles_between_modules() {
    let sources = sources(&src_dir());
    report("import cycles (move what both sides use to the lowest module that needs it)", cycles(&edges(&sources)));
}

#[test]
fn imports_point_inward_through_the_layers() {
    let sources = sources(&src_dir());
    report("imports against the layer order data → core → adapters → wiring", layer_breaks(&sources, &edges(&sources)));
}

#[test]
fn only_adapters_name_their_framework() {
    report("frameworks named outside their adapters", framework_breaks(&sources(&src_dir())));
}

#[test]
fn one_layout_for_modules() {
    report("modules laid out both as foo.rs and foo/", layout_breaks(&src_dir()));
}

#[test]
fn the_scanner_reads_what_rust_writes() {
    let code = strip(
        "use crate::{a::{b, c as d}, e};\n// use crate::x;\nlet s = \"crate::y\"; let c = '\"'; fn f<'a>() {}\nsuper::z::w();",
    );
    let mut got = paths(&code);
    got.sort();
    let want: Vec<Vec<String>> =
        [&["crate", "a", "b"][..], &["crate", "a", "c"], &["crate", "e"], &["super", "z", "w"]]
            .iter()
            .map(|p| p.iter().map(|s| s.to_string()).collect())
            .collect();
    assert_eq!(got, want);
    assert_eq!(without_tests("fn a() {}\n#[cfg(test)]\nmod tests {\n use crate::b; }"), "fn a() {}\n");
    let modules: BTreeSet<Module> =
        [&[][..], &["a"], &["a", "b"], &["c"]].iter().map(|m| m.iter().map(|s| s.to_string()).collect()).collect();
    let from: Module = vec!["a".into()];
    let path = |p: &[&str]| p.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    assert_eq!(resolve(&from, &path(&["super", "c", "X"]), &modules), Some(vec!["c".into()]));
    assert_eq!(resolve(&from, &path(&["b", "Y"]), &modules), Some(vec!["a".into(), "b".into()]));
    assert_eq!(resolve(&from, &path(&["std", "sync"]), &modules), None);
}
