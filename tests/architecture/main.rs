//! The shape of the house, checked: reads the `use` paths of src/ and fails, naming the files, on
//! an import cycle between sibling modules (at any depth), on an import that points from a lower
//! layer to a higher one (data → core → adapters → wiring, as ../shared/design/architecture.md
//! writes it down), on a module laid out both as `foo.rs` and `foo/`, and on a framework named
//! outside its adapter. Test code (`mod tests`) is left out: it may reach wherever it needs.
use std::{
    collections::{BTreeMap, BTreeSet},
    path::{Path, PathBuf},
};

use scan::{Module, Unit};

mod scan;

/// Each module's layer, by the longest matching prefix of its path; every top-level module needs
/// one. 0 data, 1 core, 2 adapters, 3 wiring: an import may point only to its own layer or a lower.
const LAYERS: &[(&str, u8)] = &[
    ("admission", 0),
    ("classify", 0),
    ("clock", 0),
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
    ("backend::openvino", 2),
    ("backend::fil", 2),
    ("backend::library", 2),
    ("backend::python", 2),
    ("backend::pytorch", 2),
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
    ("libloading", &["backend/fil/", "backend/openvino/", "backend/pytorch/"]),
    ("zip", &["backend/pytorch/aoti/package.rs"]),
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

fn src_dir() -> PathBuf {
    let root = std::env::var("CARGO_MANIFEST_DIR").unwrap_or_else(|_| env!("CARGO_MANIFEST_DIR").to_string());
    Path::new(&root).join("src")
}

/// Every (importer, imported module) edge, with the file it comes from.
fn edges(units: &[Unit]) -> Vec<(Module, Module, String)> {
    let modules: BTreeSet<Module> = units.iter().map(|u| u.module.clone()).collect();
    let mut out = BTreeSet::new();
    for u in units {
        let named = scan::named(&u.code);
        let bound = scan::bindings(u, &named.uses, &modules);
        let paths = named.uses.iter().map(|(p, _)| p).chain(&named.paths);
        for p in paths.filter(|p| !p.is_empty()) {
            if let Some(target) = scan::resolve(&u.module, p, &bound, &modules)
                && target != u.module
            {
                out.insert((u.module.clone(), target, u.rel.clone()));
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

fn layer_breaks(units: &[Unit], edges: &[(Module, Module, String)]) -> Vec<String> {
    let mut found = Vec::new();
    for s in units.iter().filter(|s| s.module.len() == 1) {
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

fn framework_breaks(units: &[Unit]) -> Vec<String> {
    let modules: BTreeSet<Module> = units.iter().map(|u| u.module.clone()).collect();
    let mut found = BTreeSet::new();
    for u in units {
        let named = scan::named(&u.code);
        // A name the file binds to one of the crate's modules is that module, not the framework.
        let bound = scan::bindings(u, &named.uses, &modules);
        let starts = named.uses.iter().map(|(p, _)| p).chain(&named.paths).filter_map(|p| p.first());
        for first in starts.filter(|f| !bound.contains_key(*f)) {
            let Some((name, homes)) = FRAMEWORKS.iter().find(|(n, _)| n == first) else { continue };
            if !homes.iter().any(|h| u.rel.starts_with(h)) {
                found.insert(format!("src/{}: names {name}, whose home is {}", u.rel, homes.join(" or ")));
            }
        }
    }
    found.into_iter().collect()
}

fn layout_breaks(src: &Path) -> Vec<String> {
    let mut files = Vec::new();
    scan::walk(src, &mut files);
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
    let units = scan::units(&src_dir());
    report("import cycles (move what both sides use to the lowest module that needs it)", cycles(&edges(&units)));
}

#[test]
fn imports_point_inward_through_the_layers() {
    let units = scan::units(&src_dir());
    report("imports against the layer order data → core → adapters → wiring", layer_breaks(&units, &edges(&units)));
}

#[test]
fn only_adapters_name_their_framework() {
    report("frameworks named outside their adapters", framework_breaks(&scan::units(&src_dir())));
}

#[test]
fn one_layout_for_modules() {
    report("modules laid out both as foo.rs and foo/", layout_breaks(&src_dir()));
}

/// A small tree written as the review that tried to slip past the scanner wrote it.
#[test]
fn the_scanner_follows_paths_as_rust_resolves_them() {
    let root = std::env::temp_dir().join(format!("ferry-architecture-{}", std::process::id()));
    let files: &[(&str, &str)] = &[
        ("lib.rs", "pub mod a; pub mod b; pub mod d; pub mod e; pub mod f; pub mod g;"),
        ("a/mod.rs", "use crate::b;\nfn f() { b::c::g(); }\nlet s = r#\"crate::d // \"#; let q = '\"';"),
        ("b/mod.rs", "pub mod c;\nfn f() { c::x(); }"),
        ("b/c.rs", "use super::super::a as top;\nfn g() { top::h(); }"),
        (
            "d.rs",
            "#[cfg(test)]\n#[allow(unused)]\nmod tests { use crate::f; }\npub fn after() { crate::e::k(); }\n\
             mod inner { use super::super::g::Q; }",
        ),
        ("e.rs", "#[serde(with = \"crate::g::ser\")]\nstruct S;"),
        ("f.rs", "struct A { s: Vec<::ort::Session> }"),
        ("g/mod.rs", "mod image;\nfn f() { image::decode(); }"),
        ("g/image.rs", ""),
    ];
    for (rel, code) in files {
        let path = root.join(rel);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, code).unwrap();
    }
    let units = scan::units(&root);
    let found: BTreeSet<(String, String)> =
        edges(&units).into_iter().map(|(from, to, _)| (show(&from), show(&to))).collect();
    let want = [("a", "b::c"), ("b::c", "a"), ("d", "e"), ("d::inner", "g"), ("e", "g"), ("g", "g::image")];
    for (from, to) in want {
        assert!(found.contains(&(from.to_string(), to.to_string())), "{from} -> {to} not in {found:?}");
    }
    assert!(!found.iter().any(|(from, to)| (from == "a" && to == "d") || to == "f"), "{found:?}");
    let cycles = cycles(&edges(&units));
    assert!(cycles.iter().any(|c| c.contains("a -> b")) && cycles.iter().any(|c| c.contains("b -> a")), "{cycles:?}");
    let frameworks = framework_breaks(&units);
    assert_eq!(frameworks, vec!["src/f.rs: names ort, whose home is backend/onnx/".to_string()]);
    std::fs::remove_dir_all(&root).unwrap();
}

#[test]
fn the_scanner_reads_what_rust_writes() {
    let code = scan::strip(
        "use crate::{a::{b, c as d}, e};\n// use crate::x;\nlet s = \"crate::y z\"; let c = '\"'; fn f<'a>() {}\nsuper::z::w();",
    );
    let named = scan::named(&code);
    let mut got: Vec<Vec<String>> = named.uses.iter().map(|(p, _)| p.clone()).chain(named.paths).collect();
    got.sort();
    got.dedup();
    let want: Vec<Vec<String>> =
        [&["crate", "a", "b"][..], &["crate", "a", "c"], &["crate", "e"], &["super", "z", "w"]]
            .iter()
            .map(|p| p.iter().map(|s| s.to_string()).collect())
            .collect();
    assert_eq!(got, want);
    assert!(named.uses.iter().any(|(p, name)| p.last().is_some_and(|l| l == "c") && name == "d"));
}
