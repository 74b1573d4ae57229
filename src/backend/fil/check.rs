//! What ferry checks in a tree model before the framework reads it. XGBoost's and LightGBM's
//! readers trust their files: an index out of range or a cycle in a tree crashes or hangs the
//! process at load or at the first request. So every tree is walked here first: children in
//! range and each node reached once, split features below the feature count, the counts that
//! size the predictions within bounds.
use serde::Deserialize;

use super::{MAX_CLASSES, MAX_FEATURES};

/// Largest model file read (it is read whole, and checked in memory).
pub const MAX_MODEL_BYTES: u64 = 1 << 30;
/// Most 32-bit words of category bitsets XGBoost may make for one model's categorical splits.
const MAX_CATEGORY_WORDS: usize = 1 << 24;

/// A model file's bytes: a regular file (not a pipe or a device), of bounded size, not empty.
pub fn read(path: &std::path::Path) -> Result<Vec<u8>, String> {
    let meta = std::fs::metadata(path).map_err(|e| format!("cannot read '{}': {e}", path.display()))?;
    if !meta.is_file() {
        return Err(format!("'{}' is not a regular file", path.display()));
    }
    if meta.len() > MAX_MODEL_BYTES {
        return Err(format!(
            "'{}' is {} bytes; ferry reads tree models of up to {MAX_MODEL_BYTES}",
            path.display(),
            meta.len()
        ));
    }
    let bytes = std::fs::read(path).map_err(|e| format!("cannot read '{}': {e}", path.display()))?;
    if bytes.is_empty() {
        return Err(format!("'{}' is empty", path.display()));
    }
    Ok(bytes)
}

/// One tree's structure, as both formats give it: `children[i]` is None for a leaf, and a
/// child is another node (`Node`) or, in LightGBM, a leaf of its own numbering (`Leaf`).
#[derive(Debug, Clone, Copy, PartialEq)]
enum Child {
    Node(usize),
    Leaf(usize),
}

/// Walks a tree from node 0: every child in range, every node and leaf reached at most once (no
/// cycle, no shared subtree).
fn walk(internal: usize, leaves: usize, children: impl Fn(usize) -> Option<(Child, Child)>) -> Result<(), String> {
    let (mut seen_node, mut seen_leaf) = (vec![false; internal], vec![false; leaves]);
    let mut stack = vec![Child::Node(0)];
    while let Some(c) = stack.pop() {
        match c {
            Child::Node(i) => {
                if i >= internal {
                    return Err(format!("a child names node {i} of {internal}"));
                }
                if std::mem::replace(&mut seen_node[i], true) {
                    return Err(format!("node {i} is reached twice (a cycle)"));
                }
                if let Some((l, r)) = children(i) {
                    stack.push(l);
                    stack.push(r);
                }
            }
            Child::Leaf(i) => {
                if i >= leaves {
                    return Err(format!("a child names leaf {i} of {leaves}"));
                }
                if std::mem::replace(&mut seen_leaf[i], true) {
                    return Err(format!("leaf {i} is reached twice"));
                }
            }
        }
    }
    Ok(())
}

/// Counts a JSON array's elements without keeping them.
#[derive(Debug, Default)]
struct Counted(usize);

impl<'de> Deserialize<'de> for Counted {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> serde::de::Visitor<'de> for V {
            type Value = Counted;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("an array")
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<Counted, A::Error> {
                let mut n = 0;
                while seq.next_element::<serde::de::IgnoredAny>()?.is_some() {
                    n += 1;
                }
                Ok(Counted(n))
            }
        }
        d.deserialize_seq(V)
    }
}

/// A JSON array of numbers as float32 (a null, UBJSON's NaN, is NaN), and whether any was
/// written so close to halfway between two float32s that reading it through float64 (as here)
/// and straight to float32 (as XGBoost does) could differ.
#[derive(Debug, Default)]
struct Floats(Vec<f32>, bool);

impl<'de> Deserialize<'de> for Floats {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let v: Vec<Option<f64>> = Vec::deserialize(d)?;
        let ambiguous = v.iter().flatten().any(|&x| halfway(x));
        Ok(Floats(v.into_iter().map(|x| x.map_or(f32::NAN, |x| x as f32)).collect(), ambiguous))
    }
}

/// Whether `v` lies within a float64 rounding of the midpoint between two float32s.
fn halfway(v: f64) -> bool {
    let x = v as f32;
    if !x.is_finite() || f64::from(x) == v {
        return false;
    }
    let other = if v > f64::from(x) { x.next_up() } else { x.next_down() };
    let mid = (f64::from(x) + f64::from(other)) / 2.0;
    (v - mid).abs() <= 2.0 * f64::EPSILON * v.abs()
}

/// XGBoost's `default_left`: 0 and 1 (JSON, UBJSON), or booleans.
#[derive(Debug, Default)]
struct Flags(Vec<i64>);

impl<'de> Deserialize<'de> for Flags {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum F {
            B(bool),
            I(i64),
        }
        let v: Vec<F> = Vec::deserialize(d)?;
        Ok(Flags(
            v.into_iter()
                .map(|f| match f {
                    F::B(b) => i64::from(b),
                    F::I(i) => i,
                })
                .collect(),
        ))
    }
}

/// XGBoost writes its counts as strings ("31") in JSON, as numbers in some versions.
fn count<'de, D: serde::Deserializer<'de>>(d: D) -> Result<u64, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum N {
        S(String),
        U(u64),
    }
    match N::deserialize(d)? {
        N::U(n) => Ok(n),
        N::S(s) => s.trim().parse().map_err(|_| serde::de::Error::custom(format!("'{s}' is not a count"))),
    }
}

#[derive(Deserialize)]
struct XgbModel {
    learner: Learner,
}

#[derive(Deserialize)]
struct Learner {
    learner_model_param: ModelParam,
    gradient_booster: Booster,
    objective: Objective,
}

#[derive(Deserialize)]
struct ModelParam {
    #[serde(deserialize_with = "count")]
    num_feature: u64,
    #[serde(deserialize_with = "count", default)]
    num_class: u64,
    #[serde(deserialize_with = "count", default)]
    num_target: u64,
    /// "5E-1", or "[1E-1,2E-1]" (one per class) in XGBoost 3.
    #[serde(default)]
    base_score: Option<serde_json::Value>,
}

#[derive(Deserialize)]
struct Objective {
    name: String,
}

#[derive(Deserialize)]
struct Booster {
    name: String,
    #[serde(default)]
    model: Option<serde_json::Value>,
    /// DART keeps its trees in an inner gbtree, with a weight per tree.
    #[serde(default)]
    gbtree: Option<Box<Booster>>,
    #[serde(default)]
    weight_drop: Option<Counted>,
}

#[derive(Deserialize)]
struct Forest {
    trees: Vec<Tree>,
    tree_info: Vec<i64>,
    /// Where each boosting round's trees start (XGBoost 2 and later).
    #[serde(default)]
    iteration_indptr: Option<Vec<i64>>,
}

#[derive(Deserialize)]
struct Linear {
    weights: Counted,
}

#[derive(Deserialize)]
struct TreeParam {
    #[serde(deserialize_with = "count")]
    num_nodes: u64,
    #[serde(deserialize_with = "count", default)]
    size_leaf_vector: u64,
}

#[derive(Deserialize)]
struct Tree {
    tree_param: TreeParam,
    left_children: Vec<i64>,
    right_children: Vec<i64>,
    split_indices: Vec<i64>,
    split_conditions: Floats,
    default_left: Flags,
    base_weights: Counted,
    #[serde(default)]
    split_type: Vec<i64>,
    #[serde(default)]
    categories: Vec<i64>,
    #[serde(default)]
    categories_nodes: Vec<i64>,
    #[serde(default)]
    categories_segments: Vec<i64>,
    #[serde(default)]
    categories_sizes: Vec<i64>,
    /// What XGBoost reads besides, unchecked: each must fit the nodes.
    #[serde(default)]
    parents: Option<Vec<i64>>,
    #[serde(default)]
    loss_changes: Option<Counted>,
    #[serde(default)]
    sum_hessian: Option<Counted>,
    #[serde(default)]
    id: Option<i64>,
    /// A multi-target tree's leaf vectors (XGBoost 3): a leaf's right child indexes them.
    #[serde(default)]
    leaf_weights: Option<Counted>,
}

/// What an XGBoost model file says, once checked.
#[derive(Debug)]
pub struct XgbInfo {
    pub objective: String,
    /// Targets of a multi-target model (vector leaves); 1 otherwise.
    pub targets: usize,
    /// The forest as ferry evaluates it, when it is one of the common kinds.
    pub native: Option<super::native::NativeForest>,
}

/// XGBoost's base score: one number, or a bracketed list, as a string or a number.
fn base_score(v: Option<&serde_json::Value>) -> Option<Vec<f32>> {
    match v {
        None => Some(Vec::new()),
        Some(serde_json::Value::Number(n)) => Some(vec![n.as_f64()? as f32]),
        Some(serde_json::Value::String(s)) => s
            .trim()
            .trim_start_matches('[')
            .trim_end_matches(']')
            .split(',')
            .map(|x| x.trim().parse::<f32>().ok())
            .collect(),
        _ => None,
    }
}

/// Checks an XGBoost model (JSON, or UBJSON when `ubj` allows it).
pub fn xgboost(bytes: &[u8], ubj: bool) -> Result<XgbInfo, String> {
    // XGBoost's JSON reader keeps `\u` escapes as they are where serde decodes them: a key one
    // reads differently from the other is refused (XGBoost never writes one).
    if looks_json(bytes) && bytes.windows(2).any(|w| w == b"\\u") {
        return Err("the JSON holds a \\u escape, which XGBoost reads differently; save the model with XGBoost".into());
    }
    let model: XgbModel = match serde_json::from_slice(bytes) {
        Ok(m) => m,
        Err(_) if ubj && !looks_json(bytes) => {
            let value = super::ubjson::parse(bytes).map_err(|e| {
                if bytes.first() == Some(&b'{') {
                    format!("not an XGBoost UBJSON model: {e}")
                } else {
                    format!("the file is neither JSON nor UBJSON ({e}); XGBoost 3 no longer reads its old binary format: load the model in XGBoost and save it as .json or .ubj")
                }
            })?;
            serde_json::from_value(value).map_err(|e| format!("not an XGBoost model: {e}"))?
        }
        Err(e) => return Err(format!("not an XGBoost JSON model: {e}")),
    };
    let learner = model.learner;
    let p = &learner.learner_model_param;
    if p.num_feature > MAX_FEATURES as u64 {
        return Err(format!(
            "the model has {} features; ferry takes tree models of up to {MAX_FEATURES}",
            p.num_feature
        ));
    }
    if p.num_class > MAX_CLASSES as u64 || p.num_target > MAX_CLASSES as u64 {
        return Err(format!(
            "the model has {} classes and {} targets; ferry takes tree models of up to {MAX_CLASSES} of each",
            p.num_class, p.num_target
        ));
    }
    let groups = p.num_class.max(p.num_target).max(1);
    let features = p.num_feature;
    let targets = if p.num_class <= 1 { p.num_target.max(1) as usize } else { 1 };
    let mut booster = &learner.gradient_booster;
    let mut weights = None;
    if booster.name == "dart" {
        weights = Some(booster.weight_drop.as_ref().map_or(0, |w| w.0));
        booster = booster.gbtree.as_deref().ok_or("a DART model without its gbtree")?;
    }
    let model = booster.model.as_ref().ok_or("the booster has no model")?;
    match booster.name.as_str() {
        "gbtree" => {
            let forest = Forest::deserialize(model).map_err(|e| format!("not an XGBoost forest: {e}"))?;
            if forest.tree_info.len() != forest.trees.len() {
                return Err(format!("{} trees but {} tree_info entries", forest.trees.len(), forest.tree_info.len()));
            }
            if let Some(g) = forest.tree_info.iter().find(|&&g| g < 0 || g as u64 >= groups) {
                return Err(format!("tree_info names output {g}; the model has {groups}"));
            }
            if let Some(w) = weights.filter(|&w| w != forest.trees.len()) {
                return Err(format!("a DART model of {} trees with {w} tree weights", forest.trees.len()));
            }
            if let Some(ptr) = &forest.iteration_indptr {
                let n = forest.trees.len() as i64;
                if ptr.first().is_some_and(|&p| p != 0)
                    || ptr.last().is_some_and(|&p| p != n)
                    || ptr.windows(2).any(|w| w[1] < w[0])
                {
                    return Err(format!("iteration_indptr does not divide the {n} trees into rounds"));
                }
            }
            let mut words = 0usize;
            for (k, t) in forest.trees.iter().enumerate() {
                words += xgb_tree(t, features, p.num_target.max(1)).map_err(|e| format!("tree {k}: {e}"))?;
                if words > MAX_CATEGORY_WORDS {
                    return Err(format!(
                        "the categorical splits up to tree {k} need more than {} MiB of category bitsets",
                        (MAX_CATEGORY_WORDS * 4) >> 20
                    ));
                }
                if t.id.is_some_and(|id| id != k as i64) {
                    return Err(format!("tree {k} says it is tree {}", t.id.unwrap_or_default()));
                }
            }
            let plain = weights.is_none()
                && !forest.trees.iter().any(|t| t.split_conditions.1)
                && p.num_target <= 1
                && forest
                    .trees
                    .iter()
                    .all(|t| t.tree_param.size_leaf_vector <= 1 && t.split_type.iter().all(|&s| s == 0));
            let native = plain
                .then(|| base_score(p.base_score.as_ref()))
                .flatten()
                .and_then(|base| {
                    super::native::NativeForest::new(&learner.objective.name, features as usize, groups as usize, &base)
                })
                .map(|mut native| {
                    for (t, &g) in forest.trees.iter().zip(&forest.tree_info) {
                        native.add_tree(
                            g as usize,
                            &t.left_children,
                            &t.right_children,
                            &t.split_indices,
                            &t.split_conditions.0,
                            &t.default_left.0,
                        );
                    }
                    native
                });
            return Ok(XgbInfo { objective: learner.objective.name, targets, native });
        }
        "gblinear" => {
            let linear = Linear::deserialize(model).map_err(|e| format!("not an XGBoost linear model: {e}"))?;
            let want = (features + 1) * groups;
            if linear.weights.0 as u64 != want {
                return Err(format!(
                    "the linear model has {} weights; {features} features need {want}",
                    linear.weights.0
                ));
            }
        }
        other => return Err(format!("booster '{other}' is not one ferry serves (gbtree, dart or gblinear)")),
    }
    Ok(XgbInfo { objective: learner.objective.name, targets, native: None })
}

/// A UBJSON object opens with '{' then a length marker; a JSON one with '{' then '"', a space or '}'.
fn looks_json(bytes: &[u8]) -> bool {
    let mut rest = bytes.iter().skip_while(|b| b.is_ascii_whitespace());
    rest.next() == Some(&b'{') && rest.next().is_some_and(|b| *b == b'"' || b.is_ascii_whitespace() || *b == b'}')
}

/// Checks one tree; returns the words of its categorical bitsets.
fn xgb_tree(t: &Tree, features: u64, targets: u64) -> Result<usize, String> {
    let n = usize::try_from(t.tree_param.num_nodes).map_err(|_| "too many nodes")?;
    if n == 0 {
        return Err("no nodes".into());
    }
    if let Some(s) = t.split_type.iter().find(|&&s| s != 0 && s != 1) {
        return Err(format!("split type {s}; XGBoost's are 0 (numeric) and 1 (categorical)"));
    }
    let vector = t.tree_param.size_leaf_vector;
    if vector > 1 && vector != targets {
        return Err(format!("leaf vectors of {vector} values in a model of {targets} targets"));
    }
    // XGBoost 3's multi-target trees: a leaf's right child is its row of leaf_weights. XGBoost's
    // reader of them takes leaf_weights, loss_changes and sum_hessian as given (a missing one
    // crashes it), and XGBoost 2's layout (no leaf_weights) is read the same way.
    let leaf_rows = match (&t.leaf_weights, vector > 1) {
        (_, true) if t.loss_changes.is_none() || t.sum_hessian.is_none() => {
            return Err("a multi-target tree without loss_changes or sum_hessian".into());
        }
        (Some(w), true) if w.0 % vector as usize == 0 => Some(w.0 / vector as usize),
        (Some(w), true) => return Err(format!("{} leaf weights for leaf vectors of {vector}", w.0)),
        (None, true) => {
            return Err("a multi-target tree without leaf_weights (XGBoost 2's layout, which XGBoost 3 cannot read \
                        safely): train the model again with XGBoost 3"
                .into());
        }
        _ => None,
    };
    for (key, len) in [
        ("loss_changes", t.loss_changes.as_ref().map(|c| c.0)),
        ("sum_hessian", t.sum_hessian.as_ref().map(|c| c.0)),
        // A multi-target tree's base weights are a vector per node (checked below).
        ("base_weights", Some(t.base_weights.0).filter(|_| t.tree_param.size_leaf_vector <= 1)),
    ] {
        if len.is_some_and(|l| l != n) {
            return Err(format!("{key} has {} entries for {n} nodes", len.unwrap_or_default()));
        }
    }
    if let Some(parents) = &t.parents {
        if parents.len() != n {
            return Err(format!("parents has {} entries for {n} nodes", parents.len()));
        }
        // The root's parent is XGBoost's invalid id; every other node's is the node naming it.
        for (i, &p) in parents.iter().enumerate().skip(1) {
            let named =
                usize::try_from(p).ok().filter(|&p| p < n && t.left_children.get(p) != Some(&-1)).is_some_and(|p| {
                    t.left_children.get(p) == Some(&(i as i64)) || t.right_children.get(p) == Some(&(i as i64))
                });
            if !named {
                return Err(format!("node {i}'s parent is {p}, which does not name it"));
            }
        }
        if !matches!(parents[0], -1 | 2147483647) {
            return Err(format!("the root's parent is {}", parents[0]));
        }
    }
    let leaf_vector = t.tree_param.size_leaf_vector.max(1) as usize;
    let sizes = [
        t.left_children.len(),
        t.right_children.len(),
        t.split_indices.len(),
        t.split_conditions.0.len(),
        t.default_left.0.len(),
    ];
    if sizes.iter().any(|&s| s != n) || (!t.split_type.is_empty() && t.split_type.len() != n) {
        return Err(format!("{n} nodes, but arrays of {sizes:?} entries"));
    }
    if leaf_vector > 1 && t.base_weights.0 != n * leaf_vector {
        return Err(format!("{} base weights for {n} nodes of {leaf_vector}", t.base_weights.0));
    }
    let mut leaf_used = vec![false; leaf_rows.unwrap_or(0)];
    for i in 0..n {
        let (l, r) = (t.left_children[i], t.right_children[i]);
        if let (Some(rows), -1) = (leaf_rows, l) {
            // Each leaf names its own row of leaf_weights.
            let row = usize::try_from(r).ok().filter(|&r| r < rows);
            match row {
                Some(row) if !std::mem::replace(&mut leaf_used[row], true) => continue,
                _ => return Err(format!("leaf {i} names leaf weights row {r} of {rows} (or one another leaf has)")),
            }
        }
        let leaf = l == -1 && r == -1;
        if !leaf {
            if l < 1 || r < 1 || l as usize >= n || r as usize >= n || l as usize == i || r as usize == i {
                return Err(format!("node {i} has children {l} and {r}, of {n} nodes"));
            }
            let f = t.split_indices[i];
            if f < 0 || f as u64 >= features.max(1) {
                return Err(format!("node {i} splits on feature {f}; the model has {features}"));
            }
        }
    }
    // Leaves are nodes here: every node is a `Node`, and a leaf has no children.
    walk(n, 0, |i| {
        let (l, r) = (t.left_children[i], t.right_children[i]);
        (l >= 0).then_some((Child::Node(l as usize), Child::Node(r as usize)))
    })?;
    categorical(t)
}

/// Most categories one categorical split may name (XGBoost sizes a bitset from the largest).
const MAX_CATEGORY: i64 = 1 << 24;

/// Checks a tree's categorical splits as XGBoost's reader takes them: `categories_nodes` lists the
/// categorical nodes in order, each with a non-empty run of `categories` (segment, size) of
/// categories from 0 to `MAX_CATEGORY`. Returns the 32-bit words of the bitsets XGBoost makes.
fn categorical(t: &Tree) -> Result<usize, String> {
    let cat = (&t.categories_nodes, &t.categories_segments, &t.categories_sizes);
    if cat.0.len() != cat.1.len() || cat.0.len() != cat.2.len() {
        return Err("categorical arrays of different lengths".into());
    }
    let splits: Vec<i64> = t.split_type.iter().enumerate().filter(|(_, s)| **s == 1).map(|(i, _)| i as i64).collect();
    if splits != *cat.0 {
        return Err(format!(
            "categories_nodes is {:?}, but the categorical splits are nodes {:?}",
            &cat.0[..cat.0.len().min(8)],
            &splits[..splits.len().min(8)]
        ));
    }
    let mut words = 0usize;
    for ((&node, &seg), &size) in cat.0.iter().zip(cat.1).zip(cat.2) {
        if t.left_children[node as usize] == -1 {
            return Err(format!("node {node} is a leaf with a categorical split"));
        }
        let end = seg.checked_add(size);
        if seg < 0 || size < 1 || end.is_none_or(|e| e as usize > t.categories.len()) {
            return Err(format!("categorical split of node {node} outside the categories ({seg} + {size})"));
        }
        let run = &t.categories[seg as usize..(seg + size) as usize];
        if let Some(c) = run.iter().find(|&&c| !(0..MAX_CATEGORY).contains(&c)) {
            return Err(format!(
                "node {node} splits on category {c}; ferry takes categories 0 to {}",
                MAX_CATEGORY - 1
            ));
        }
        words += run.iter().max().map_or(0, |&m| m as usize / 32 + 1);
    }
    Ok(words)
}

/// What a LightGBM model says, once checked, and its text ready for LightGBM.
#[derive(Debug)]
pub struct LgbInfo {
    pub objective: String,
    /// The model's text without `tree_sizes` (LightGBM then reads the trees one after another,
    /// where a bad tree is an error rather than an abort in its parallel reader).
    pub text: String,
}

fn numbers<T: std::str::FromStr>(line: &str, key: &str) -> Result<Vec<T>, String> {
    line.split_whitespace().map(|v| v.parse::<T>().map_err(|_| format!("{key} holds '{v}', not a number"))).collect()
}

/// Checks a LightGBM text model.
pub fn lightgbm(bytes: Vec<u8>) -> Result<LgbInfo, String> {
    let text =
        String::from_utf8(bytes).map_err(|_| "the model is not text (LightGBM saves text models)".to_string())?;
    if text.contains('\0') {
        return Err("the model holds a NUL byte".into());
    }
    // LightGBM's reader and this one must see the same model, so the text LightGBM gets is
    // written here from what was checked: lines broken at '\n' and '\r' (as LightGBM breaks
    // them), no key twice, a tree ending at its blank line, nothing after `end of trees`.
    let mut header: std::collections::HashMap<&str, &str> = Default::default();
    let mut header_lines: Vec<&str> = Vec::new();
    let mut trees: Vec<std::collections::HashMap<&str, &str>> = Vec::new();
    let mut tree_lines: Vec<Vec<&str>> = Vec::new();
    let mut open = false;
    for line in text.split(['\n', '\r']) {
        if line.starts_with("end of trees") {
            break;
        }
        if line.trim().is_empty() {
            open = false;
            continue;
        }
        if let Some(k) = line.strip_prefix("Tree=") {
            if k.trim() != trees.len().to_string() {
                return Err(format!("tree {} is numbered '{}'", trees.len(), k.trim()));
            }
            trees.push(Default::default());
            tree_lines.push(Vec::new());
            open = true;
            continue;
        }
        if !trees.is_empty() && !open {
            return Err(format!("a line between trees: '{}'", line.chars().take(40).collect::<String>()));
        }
        if line.starts_with("tree_sizes=") && trees.is_empty() {
            continue;
        }
        let (map, lines) = match (trees.last_mut(), tree_lines.last_mut()) {
            (Some(t), Some(l)) => (t, l),
            _ => (&mut header, &mut header_lines),
        };
        if let Some((k, _)) = line.split_once('=').filter(|(k, v)| map.insert(k, v).is_some()) {
            return Err(format!("'{k}' appears twice"));
        }
        if open && !line.contains('=') {
            return Err(format!("a tree holds the line '{}'", line.chars().take(40).collect::<String>()));
        }
        lines.push(line);
        // LightGBM reads a tree's first 22 lines and no more.
        if open && lines.len() > 22 {
            return Err(format!("tree {} has more than 22 lines", trees.len() - 1));
        }
    }
    let mut kept = String::with_capacity(text.len());
    for line in &header_lines {
        kept.push_str(line);
        kept.push('\n');
    }
    kept.push('\n');
    for (k, lines) in tree_lines.iter().enumerate() {
        kept.push_str(&format!("Tree={k}\n"));
        for line in lines {
            kept.push_str(line);
            kept.push('\n');
        }
        kept.push('\n');
    }
    kept.push_str("end of trees\n");
    let get = |k: &str| header.get(k).map(|v| v.trim()).ok_or_else(|| format!("the model has no {k}"));
    let int = |k: &str| get(k)?.parse::<i64>().map_err(|_| format!("{k} is not an integer"));
    let classes = int("num_class")?;
    let per_iteration = int("num_tree_per_iteration")?;
    let features = int("max_feature_idx")? + 1;
    if !(1..=MAX_CLASSES as i64).contains(&classes) || per_iteration != classes {
        return Err(format!(
            "num_class is {classes} and num_tree_per_iteration {per_iteration}; ferry takes models of 1 to {MAX_CLASSES} classes, one tree per class and iteration"
        ));
    }
    if !(0..=MAX_FEATURES as i64).contains(&features) {
        return Err(format!("the model has {features} features; ferry takes tree models of up to {MAX_FEATURES}"));
    }
    for key in ["feature_names", "feature_infos"] {
        if let Some(n) = header.get(key).map(|v| v.split_whitespace().count())
            && n as i64 != features
        {
            return Err(format!("{key} has {n} entries for {features} features"));
        }
    }
    if trees.is_empty() || !trees.len().is_multiple_of(classes as usize) {
        return Err(format!("{} trees for {classes} per iteration", trees.len()));
    }
    for (k, t) in trees.iter().enumerate() {
        lgb_tree(t, features as usize).map_err(|e| format!("tree {k}: {e}"))?;
    }
    let objective = get("objective").unwrap_or("").split_whitespace().next().unwrap_or("").to_string();
    Ok(LgbInfo { objective, text: kept })
}

fn lgb_tree(t: &std::collections::HashMap<&str, &str>, features: usize) -> Result<(), String> {
    let get = |k: &str| t.get(k).copied().ok_or_else(|| format!("no {k}"));
    if t.get("is_linear").is_some_and(|v| v.trim() != "0") {
        return Err("linear trees are not served by ferry".into());
    }
    let leaves: usize = get("num_leaves")?.trim().parse().map_err(|_| "num_leaves is not a count")?;
    let leaf_values = numbers::<f64>(get("leaf_value")?, "leaf_value")?;
    if leaves == 0 || leaf_values.len() != leaves {
        return Err(format!("num_leaves {leaves} with {} leaf values", leaf_values.len()));
    }
    if leaves == 1 {
        return Ok(());
    }
    let internal = leaves - 1;
    let split = numbers::<i64>(get("split_feature")?, "split_feature")?;
    let left = numbers::<i64>(get("left_child")?, "left_child")?;
    let right = numbers::<i64>(get("right_child")?, "right_child")?;
    let decision = numbers::<i64>(get("decision_type")?, "decision_type")?;
    let threshold = numbers::<f64>(get("threshold")?, "threshold")?;
    if [split.len(), left.len(), right.len(), decision.len(), threshold.len()].iter().any(|&n| n != internal) {
        return Err(format!("{leaves} leaves, but the node arrays are not all {internal} long"));
    }
    // LightGBM reads these without checking their lengths: a short one is read past its end.
    for (key, want) in [
        ("split_gain", internal),
        ("internal_value", internal),
        ("internal_weight", internal),
        ("internal_count", internal),
        ("leaf_weight", leaves),
        ("leaf_count", leaves),
    ] {
        if let Some(v) = t.get(key) {
            let n = v.split_whitespace().count();
            if n != want {
                return Err(format!("{key} has {n} entries; {leaves} leaves need {want}"));
            }
        }
    }
    if let Some(f) = split.iter().find(|&&f| f < 0 || f as usize >= features) {
        return Err(format!("a node splits on feature {f}; the model has {features}"));
    }
    let cats: usize = t.get("num_cat").map_or(Ok(0), |v| v.trim().parse()).map_err(|_| "num_cat is not a count")?;
    if cats > 0 {
        let bounds = numbers::<i64>(get("cat_boundaries")?, "cat_boundaries")?;
        let words = numbers::<u64>(get("cat_threshold")?, "cat_threshold")?.len() as i64;
        if bounds.len() != cats + 1 || bounds[0] != 0 || bounds.windows(2).any(|w| w[1] < w[0]) || bounds[cats] > words
        {
            return Err("categorical boundaries outside the categories".into());
        }
    }
    for i in 0..internal {
        if decision[i] & 1 == 1 {
            let c = threshold[i];
            if !(c >= 0.0 && (c as usize) < cats && c.fract() == 0.0) {
                return Err(format!("node {i} names categorical split {c} of {cats}"));
            }
        }
    }
    let child = |c: i64| if c >= 0 { Child::Node(c as usize) } else { Child::Leaf((!c) as usize) };
    walk(internal, leaves, |i| Some((child(left[i]), child(right[i]))))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_walk_finds_cycles_shared_nodes_and_children_out_of_range() {
        let tree = |l: Vec<i64>, r: Vec<i64>| {
            walk(l.len(), l.len() + 1, |i| {
                let c = |c: i64| if c >= 0 { Child::Node(c as usize) } else { Child::Leaf((!c) as usize) };
                Some((c(l[i]), c(r[i])))
            })
        };
        assert!(tree(vec![1, -1], vec![-2, -3]).is_ok());
        assert!(tree(vec![0, -1], vec![-2, -3]).unwrap_err().contains("twice"));
        assert!(tree(vec![1, -1], vec![1, -3]).unwrap_err().contains("twice"));
        assert!(tree(vec![5, -1], vec![-2, -3]).unwrap_err().contains("node 5"));
        assert!(tree(vec![1, -100], vec![-2, -3]).unwrap_err().contains("leaf 99"));
    }

    fn lgb(tree: &str) -> String {
        format!(
            "tree\nversion=v4\nnum_class=1\nnum_tree_per_iteration=1\nmax_feature_idx=2\nobjective=binary sigmoid:1\ntree_sizes=99\n\nTree=0\n{tree}\nend of trees\n\nparameters:\nend of parameters\n"
        )
    }

    const GOOD: &str = "num_leaves=3\nnum_cat=0\nsplit_feature=0 2\nthreshold=0.5 1\ndecision_type=2 2\nleft_child=1 -1\nright_child=-3 -2\nleaf_value=0.1 0.2 0.3\n";

    #[test]
    fn a_lightgbm_model_is_checked_and_loses_its_tree_sizes() {
        let info = lightgbm(lgb(GOOD).into_bytes()).unwrap();
        assert_eq!(info.objective, "binary");
        assert!(!info.text.contains("tree_sizes") && info.text.ends_with("end of trees\n"));
        assert!(
            lightgbm(
                lgb(GOOD)
                    .replace("shrinkage", "x")
                    .replace("leaf_value=0.1 0.2 0.3\n", "leaf_value=0.1 0.2 0.3\rleft_child=0 -1\n")
                    .into_bytes()
            )
            .unwrap_err()
            .contains("twice")
        );
        assert!(
            lightgbm(
                lgb(GOOD)
                    .replace("leaf_value=0.1 0.2 0.3\n", "leaf_value=0.1 0.2 0.3\n\nleft_child=0 -1\n")
                    .into_bytes()
            )
            .unwrap_err()
            .contains("between trees")
        );
        for (bad, want) in [
            (GOOD.replace("split_feature=0 2", "split_feature=0 2000000000"), "feature 2000000000"),
            (GOOD.replace("left_child=1 -1", "left_child=0 -1"), "twice"),
            (GOOD.replace("left_child=1 -1", "left_child=100000000 -1"), "node 100000000"),
            (GOOD.replace("leaf_value=0.1 0.2 0.3", "leaf_value=0.1"), "leaf values"),
            (GOOD.replace("num_leaves=3", "num_leaves=1000000000"), "leaf values"),
            (format!("{GOOD}internal_value=0.5\n"), "internal_value has 1 entries; 3 leaves need 2"),
        ] {
            let e = lightgbm(lgb(&bad).into_bytes()).unwrap_err();
            assert!(e.contains(want), "{want}: {e}");
        }
        let e = lightgbm(lgb(GOOD).replace("num_tree_per_iteration=1", "num_tree_per_iteration=0").into_bytes())
            .unwrap_err();
        assert!(e.contains("num_tree_per_iteration 0"), "{e}");
    }

    fn xgb(tree: serde_json::Value, tree_info: serde_json::Value) -> Vec<u8> {
        serde_json::to_vec(&serde_json::json!({"learner": {
            "learner_model_param": {"num_feature": "3", "num_class": "0", "num_target": "1"},
            "objective": {"name": "binary:logistic"},
            "gradient_booster": {"name": "gbtree", "model": {"trees": [tree], "tree_info": tree_info}}}}))
        .unwrap()
    }

    fn tree(left: Vec<i64>, right: Vec<i64>, split: Vec<i64>) -> serde_json::Value {
        let n = left.len();
        serde_json::json!({"tree_param": {"num_nodes": n.to_string(), "size_leaf_vector": "1"},
            "left_children": left, "right_children": right, "split_indices": split,
            "split_conditions": vec![0.0; n], "default_left": vec![0; n], "base_weights": vec![0.0; n]})
    }

    #[test]
    fn a_number_written_halfway_between_two_float32s_is_found() {
        assert!(!halfway(0.75) && !halfway(0.1) && !halfway(-2.5e-3));
        // 0.75 + 2^-25 is halfway between 0.75 and the next float32 up; a hair above it, too.
        assert!(halfway(0.75 + 2f64.powi(-25)) && halfway(0.75 + 2f64.powi(-25) + 2f64.powi(-52)));
    }

    #[test]
    fn an_xgboost_model_is_checked() {
        let ok = tree(vec![1, -1, -1], vec![2, -1, -1], vec![2, 0, 0]);
        let info = xgboost(&xgb(ok.clone(), serde_json::json!([0])), false).unwrap();
        assert_eq!(info.objective, "binary:logistic");
        assert!(info.native.is_some());
        for (t, info, want) in [
            (tree(vec![0, -1, -1], vec![2, -1, -1], vec![0, 0, 0]), serde_json::json!([0]), "children 0"),
            (tree(vec![1, -1, -1], vec![2, -1, -1], vec![900000, 0, 0]), serde_json::json!([0]), "feature 900000"),
            (
                tree(vec![100000000, -1, -1], vec![2, -1, -1], vec![0, 0, 0]),
                serde_json::json!([0]),
                "children 100000000",
            ),
            (tree(vec![2, -1, 1], vec![2, -1, -1], vec![0, 0, 0]), serde_json::json!([0]), "children"),
            (ok.clone(), serde_json::json!([7]), "tree_info names output 7"),
            (ok, serde_json::json!([]), "tree_info"),
        ] {
            let e = xgboost(&xgb(t, info), false).unwrap_err();
            assert!(e.contains(want), "{want}: {e}");
        }
        assert!(xgboost(b"\x00\x01binary", true).unwrap_err().contains("old binary format"));
    }
}
