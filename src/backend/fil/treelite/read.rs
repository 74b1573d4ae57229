//! Treelite's v4 serialization, read with every length checked against the bytes left before
//! anything is allocated from it, every index checked against what it indexes, and each tree
//! checked to be a tree (no cycles, no shared nodes), so that the walk needs no checks of its own.
//! The layout is Treelite's: little-endian scalars, arrays and strings as a u64 count then the
//! items, the header, then per tree its per-node arrays and two empty extension slots.
use super::{Checkpoint, MAX_CLASSES, MAX_FEATURES, Node, Op, Post, Test};

/// Most trees one checkpoint may hold; each is walked for every row.
const MAX_TREES: usize = 1 << 20;
/// Most targets (outputs) of a multi-target model.
const MAX_TARGETS: usize = 1 << 10;
/// Most categories the forest's categorical splits may list in all.
const MAX_CATEGORIES: usize = 1 << 24;
/// Most leaf-vector values the forest's leaves may hold in all (1 GiB of float64).
const MAX_LEAF_VALUES: usize = 1 << 27;

/// Treelite's TypeInfo numbering of the threshold and leaf types.
const FLOAT32: u8 = 2;
const FLOAT64: u8 = 3;

struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8], String> {
        let left = self.bytes.len() - self.at;
        if n > left {
            return Err(format!("the file ends inside {what} (at byte {}, {n} bytes needed, {left} left)", self.at));
        }
        let s = &self.bytes[self.at..self.at + n];
        self.at += n;
        Ok(s)
    }

    fn fixed<const N: usize>(&mut self, what: &str) -> Result<[u8; N], String> {
        Ok(self.take(N, what)?.try_into().expect("N bytes"))
    }

    fn i32(&mut self, what: &str) -> Result<i32, String> {
        Ok(i32::from_le_bytes(self.fixed(what)?))
    }

    fn u64(&mut self, what: &str) -> Result<u64, String> {
        Ok(u64::from_le_bytes(self.fixed(what)?))
    }

    fn f32(&mut self, what: &str) -> Result<f32, String> {
        Ok(f32::from_le_bytes(self.fixed(what)?))
    }

    fn u8(&mut self, what: &str) -> Result<u8, String> {
        Ok(self.fixed::<1>(what)?[0])
    }

    /// An array's items as raw bytes (`size` bytes each), its count checked against the file.
    fn items(&mut self, size: usize, what: &str) -> Result<(usize, &'a [u8]), String> {
        let count = self.u64(what)?;
        let bytes = usize::try_from(count)
            .ok()
            .and_then(|c| c.checked_mul(size))
            .filter(|&b| b <= self.bytes.len() - self.at)
            .ok_or_else(|| format!("{what} declares {count} items, more than the file holds"))?;
        Ok((bytes / size, self.take(bytes, what)?))
    }

    fn array<T, const N: usize>(&mut self, what: &str, parse: fn([u8; N]) -> T) -> Result<Vec<T>, String> {
        let (_, bytes) = self.items(N, what)?;
        Ok(bytes.chunks_exact(N).map(|c| parse(c.try_into().expect("N bytes"))).collect())
    }

    /// A per-node array: exactly `nodes` items.
    fn per_node<T, const N: usize>(
        &mut self,
        nodes: usize,
        what: &str,
        parse: fn([u8; N]) -> T,
    ) -> Result<Vec<T>, String> {
        let v = self.array(what, parse)?;
        if v.len() != nodes {
            return Err(format!("{what} has {} items for {nodes} nodes", v.len()));
        }
        Ok(v)
    }

    /// A float array in the model's precision, as float64.
    fn reals(&mut self, double: bool, what: &str) -> Result<Vec<f64>, String> {
        if double {
            self.array(what, f64::from_le_bytes)
        } else {
            self.array(what, |b| f64::from(f32::from_le_bytes(b)))
        }
    }

    fn string(&mut self, what: &str) -> Result<&'a [u8], String> {
        Ok(self.items(1, what)?.1)
    }

    /// Treelite's extension slots: a count, then per field its name, item size, count and bytes.
    fn skip_extensions(&mut self, what: &str) -> Result<(), String> {
        let fields = self.i32(what)?;
        if fields < 0 {
            return Err(format!("{what} declares {fields} fields"));
        }
        for _ in 0..fields {
            self.string(what)?;
            let size = self.u64(what)?;
            let count = self.u64(what)?;
            let bytes = size
                .checked_mul(count)
                .and_then(|b| usize::try_from(b).ok())
                .ok_or_else(|| format!("{what} declares a field of {size} × {count} bytes"))?;
            self.take(bytes, what)?;
        }
        Ok(())
    }
}

fn index(v: i32, bound: usize, what: &str) -> Result<usize, String> {
    usize::try_from(v)
        .ok()
        .filter(|&i| i < bound)
        .ok_or_else(|| format!("{what} is {v}; expected 0 to {}", bound as i64 - 1))
}

/// A span `[begin, end)` of one of a tree's arrays, of `len` items.
fn span(begin: u64, end: u64, len: usize, what: &str) -> Result<(u32, u32), String> {
    let fits = |v: u64| u32::try_from(v).ok().filter(|&v| v as usize <= len);
    match (fits(begin), fits(end)) {
        (Some(b), Some(e)) if b <= e => Ok((b, e)),
        _ => Err(format!("{what} spans {begin}..{end} of an array of {len}")),
    }
}

/// Reads and checks a checkpoint (Treelite 4's format; 3.x checkpoints are refused with the way
/// to re-save them).
pub fn read(bytes: &[u8]) -> Result<Checkpoint, String> {
    let mut r = Reader { bytes, at: 0 };
    let (major, minor, patch) = (r.i32("the version")?, r.i32("the version")?, r.i32("the version")?);
    if major != 4 {
        return Err(format!(
            "the checkpoint was written by Treelite {major}.{minor}.{patch}; ferry reads Treelite 4's format \
             (load it with Treelite 4 and save it again with Model.serialize)"
        ));
    }
    let double = match (r.u8("the threshold type")?, r.u8("the leaf type")?) {
        (FLOAT32, FLOAT32) => false,
        (FLOAT64, FLOAT64) => true,
        (t, l) => {
            return Err(format!(
                "threshold and leaf types {t} and {l}; Treelite 4 writes float32 or float64 (2 or 3) for both"
            ));
        }
    };
    let trees = r.u64("the tree count")?;
    let trees = usize::try_from(trees)
        .ok()
        .filter(|&n| (1..=MAX_TREES).contains(&n))
        .ok_or_else(|| format!("the checkpoint declares {trees} trees; ferry takes 1 to {MAX_TREES}"))?;
    let features = r.i32("the feature count")?;
    let features = usize::try_from(features)
        .ok()
        .filter(|&n| (1..=MAX_FEATURES).contains(&n))
        .ok_or_else(|| format!("the checkpoint declares {features} features; ferry takes 1 to {MAX_FEATURES}"))?;
    let task = r.u8("the task type")?;
    // Binary and multi-class classifiers (0, 2); regressors, ranking and isolation forests (1, 3, 4).
    let classifier = match task {
        0 | 2 => true,
        1 | 3 | 4 => false,
        other => return Err(format!("task type {other} is not one of Treelite's (0 to 4)")),
    };
    let average = r.u8("average_tree_output")? != 0;
    let targets = r.i32("num_target")?;
    let targets = usize::try_from(targets)
        .ok()
        .filter(|&n| (1..=MAX_TARGETS).contains(&n))
        .ok_or_else(|| format!("the checkpoint declares {targets} targets; ferry takes 1 to {MAX_TARGETS}"))?;
    let classes = r.array("num_class", i32::from_le_bytes)?;
    if classes.len() != targets {
        return Err(format!("num_class has {} items for {targets} targets", classes.len()));
    }
    let classes: Vec<usize> = classes
        .iter()
        .map(|&k| usize::try_from(k).ok().filter(|&k| (1..=MAX_CLASSES).contains(&k)))
        .collect::<Option<_>>()
        .ok_or_else(|| format!("num_class is {classes:?}; each target takes 1 to {MAX_CLASSES} classes"))?;
    let max_class = classes.iter().copied().max().unwrap_or(1);
    let width = targets * max_class;
    if width > MAX_CLASSES {
        return Err(format!(
            "{targets} targets of {max_class} classes give {width} values a row; ferry takes up to {MAX_CLASSES}"
        ));
    }
    let shape = r.array("leaf_vector_shape", i32::from_le_bytes)?;
    let shape: (usize, usize) = match shape[..] {
        [t, k] if usize::try_from(t) == Ok(targets) || t == 1 => {
            if k != 1 && usize::try_from(k) != Ok(max_class) {
                return Err(format!(
                    "leaf_vector_shape is {shape:?}; its second item is 1 or the most classes ({max_class})"
                ));
            }
            (t as usize, k as usize)
        }
        _ => return Err(format!("leaf_vector_shape is {shape:?}; expected [1 or {targets}, 1 or {max_class}]")),
    };
    let target_ids = r.array("target_id", i32::from_le_bytes)?;
    let class_ids = r.array("class_id", i32::from_le_bytes)?;
    if target_ids.len() != trees || class_ids.len() != trees {
        return Err(format!(
            "target_id and class_id have {} and {} items for {trees} trees",
            target_ids.len(),
            class_ids.len()
        ));
    }
    let name = r.string("the postprocessor")?;
    let post = std::str::from_utf8(name).ok().and_then(Post::of).ok_or_else(|| {
        format!("postprocessor '{}' is not one of Treelite's", String::from_utf8_lossy(&name[..name.len().min(64)]))
    })?;
    let sigmoid_alpha = r.f32("sigmoid_alpha")?;
    let ratio_c = r.f32("ratio_c")?;
    let base = r.array("base_scores", f64::from_le_bytes)?;
    if base.len() != width {
        return Err(format!("base_scores has {} items; expected {targets} × {max_class}", base.len()));
    }
    r.string("attributes")?;
    r.skip_extensions("the model's extension slot")?;

    let mut forest = Checkpoint {
        nodes: Vec::new(),
        trees: Vec::with_capacity(trees),
        leaf_values: Vec::new(),
        categories: Vec::new(),
        features,
        classes,
        max_class,
        divisors: None,
        base,
        post,
        sigmoid_alpha,
        ratio_c,
        double,
        classifier,
    };
    for (t, (&target, &class)) in target_ids.iter().zip(&class_ids).enumerate() {
        let what = |s: &str| format!("tree {t}: {s}");
        if target < -1 || target >= targets as i32 {
            return Err(what(&format!("target_id is {target}; expected -1 to {}", targets - 1)));
        }
        // A class of the tree's target; for all targets (-1), any of the widest target's (GTIL
        // adds to the padding of narrower targets, which the output keeps as it is).
        let classes = if target < 0 { max_class } else { forest.classes[target as usize] };
        if class < -1 || class >= classes as i32 {
            return Err(what(&format!("class_id is {class}; expected -1 to {}", classes - 1)));
        }
        // The leaf vector each of the tree's leaves must hold, as GTIL lays them out.
        let expected = match (target, class) {
            (-1, -1) => (targets, max_class),
            (-1, _) => (targets, 1),
            (_, -1) => (1, max_class),
            _ => (1, 1),
        };
        let root = u32::try_from(forest.nodes.len()).map_err(|_| what("the forest is too large"))?;
        read_tree(&mut r, &mut forest, double, (expected, target < 0 || class < 0), shape, &what)?;
        forest.trees.push((root, target, class));
    }
    if r.at != bytes.len() {
        return Err(format!("{} bytes follow the last tree", bytes.len() - r.at));
    }
    if average {
        let c = max_class;
        let mut counts = vec![0.0f64; width];
        for &(_, target, class) in &forest.trees {
            for (t, &k) in forest.classes.iter().enumerate() {
                for j in 0..k {
                    if (target < 0 || target as usize == t) && (class < 0 || class as usize == j) {
                        counts[t * c + j] += 1.0;
                    }
                }
            }
        }
        forest.divisors = Some(counts);
    }
    Ok(forest)
}

/// One tree's fields, checked and appended to the forest's nodes (children made absolute).
fn read_tree(
    r: &mut Reader<'_>,
    forest: &mut Checkpoint,
    double: bool,
    // The leaf vector the tree's target and class take, and whether either is -1 (all).
    (expected, all): ((usize, usize), bool),
    shape: (usize, usize),
    what: &dyn Fn(&str) -> String,
) -> Result<(), String> {
    let n = r.i32(&what("the node count"))?;
    let n = usize::try_from(n).ok().filter(|&n| n >= 1).ok_or_else(|| what(&format!("{n} nodes")))?;
    r.u8(&what("has_categorical_split"))?;
    let kinds = r.per_node(n, &what("node_type"), i8::from_le_bytes)?;
    let left = r.per_node(n, &what("cleft"), i32::from_le_bytes)?;
    let right = r.per_node(n, &what("cright"), i32::from_le_bytes)?;
    let split = r.per_node(n, &what("split_index"), i32::from_le_bytes)?;
    let default_left = r.per_node(n, &what("default_left"), |b: [u8; 1]| b[0] != 0)?;
    let leaf = r.reals(double, &what("leaf_value"))?;
    let threshold = r.reals(double, &what("threshold"))?;
    if leaf.len() != n || threshold.len() != n {
        return Err(what(&format!(
            "leaf_value and threshold have {} and {} items for {n} nodes",
            leaf.len(),
            threshold.len()
        )));
    }
    let ops = r.per_node(n, &what("cmp"), i8::from_le_bytes)?;
    let list_right = r.per_node(n, &what("category_list_right_child"), |b: [u8; 1]| b[0] != 0)?;
    let vectors = r.reals(double, &what("leaf_vector"))?;
    let vector_begin = r.per_node(n, &what("leaf_vector_begin"), u64::from_le_bytes)?;
    let vector_end = r.per_node(n, &what("leaf_vector_end"), u64::from_le_bytes)?;
    let categories = r.array(&what("category_list"), u32::from_le_bytes)?;
    let category_begin = r.per_node(n, &what("category_list_begin"), u64::from_le_bytes)?;
    let category_end = r.per_node(n, &what("category_list_end"), u64::from_le_bytes)?;
    // Node statistics (counts, hessians, gains, each with its present flags): not used to predict.
    for (size, field) in [
        (8, "data_count"),
        (1, "data_count_present"),
        (8, "sum_hess"),
        (1, "sum_hess_present"),
        (8, "gain"),
        (1, "gain_present"),
    ] {
        r.items(size, &what(field))?;
    }
    r.skip_extensions(&what("the tree's extension slot"))?;
    r.skip_extensions(&what("the nodes' extension slot"))?;

    let offset = forest.nodes.len();
    let absolute = |i: usize| u32::try_from(offset + i).map_err(|_| what("the forest is too large"));
    let mut nodes = Vec::with_capacity(n);
    for i in 0..n {
        let node = |s: &str| what(&format!("node {i}: {s}"));
        let (mut l, mut rt, mut feature) = (0u32, 0u32, 0u32);
        let mut vector = (0u32, 0u32);
        let test = if left[i] == -1 {
            let s = span(vector_begin[i], vector_end[i], vectors.len(), &node("its leaf vector"))?;
            let len = (s.1 - s.0) as usize;
            if len > 0 && (len != expected.0 * expected.1 || shape != expected) {
                return Err(node(&format!(
                    "a leaf vector of {len} values where the tree's target and class take {} × {} (the model's leaf_vector_shape is {} × {})",
                    expected.0, expected.1, shape.0, shape.1
                )));
            }
            if len == 0 && (all || shape != (1, 1)) {
                return Err(node(
                    "a single leaf value, where the tree's target_id or class_id (-1: all) or the model's leaf_vector_shape take a vector",
                ));
            }
            vector = s;
            Test::Leaf
        } else {
            l = absolute(index(left[i], n, &node("the left child"))?)?;
            rt = absolute(index(right[i], n, &node("the right child"))?)?;
            feature = index(split[i], forest.features, &node("the split feature"))? as u32;
            if kinds[i] == 2 {
                vector = span(category_begin[i], category_end[i], categories.len(), &node("its categories"))?;
                Test::Categorical { right: list_right[i] }
            } else {
                Test::Numeric(match ops[i] {
                    1 => Op::Eq,
                    2 => Op::Lt,
                    3 => Op::Le,
                    4 => Op::Gt,
                    5 => Op::Ge,
                    other => {
                        return Err(node(&format!("comparison operator {other}; expected 1 to 5 (==, <, <=, >, >=)")));
                    }
                })
            }
        };
        let value = if test == Test::Leaf { leaf[i] } else { threshold[i] };
        nodes.push(Node { test, default_left: default_left[i], feature, left: l, right: rt, value, span: vector });
    }
    // A tree: every node reached from the root at most once (no cycles, no shared children).
    let mut seen = vec![false; n];
    let mut stack = vec![0usize];
    while let Some(i) = stack.pop() {
        if std::mem::replace(&mut seen[i], true) {
            return Err(what(&format!("node {i} is reached twice (the nodes do not form a tree)")));
        }
        if nodes[i].test != Test::Leaf {
            stack.push(nodes[i].left as usize - offset);
            stack.push(nodes[i].right as usize - offset);
        }
    }
    // Each categorical split gets its own sorted copy of its list, for the walk's binary search
    // (the file's lists may overlap); the copies are bounded, since nodes may share one list.
    for node in &mut nodes {
        if let Test::Categorical { .. } = node.test {
            let list = &categories[node.span.0 as usize..node.span.1 as usize];
            if forest.categories.len() + list.len() > MAX_CATEGORIES {
                return Err(what(&format!("its categorical splits list more than {MAX_CATEGORIES} categories in all")));
            }
            let begin = forest.categories.len();
            forest.categories.extend_from_slice(list);
            forest.categories[begin..].sort_unstable();
            node.span = (begin as u32, forest.categories.len() as u32);
        }
    }
    // Only the leaf vectors leaves use are kept (a file may hold more), each once.
    let mut copied = std::collections::HashMap::new();
    for node in nodes.iter_mut().filter(|n| n.test == Test::Leaf && n.span.0 != n.span.1) {
        let (b, e) = (node.span.0 as usize, node.span.1 as usize);
        let begin = *copied.entry((b, e)).or_insert_with(|| {
            forest.leaf_values.extend_from_slice(&vectors[b..e]);
            forest.leaf_values.len() - (e - b)
        });
        if forest.leaf_values.len() > MAX_LEAF_VALUES {
            return Err(what(&format!("its leaves hold more than {MAX_LEAF_VALUES} leaf-vector values in all")));
        }
        node.span = (begin as u32, (begin + e - b) as u32);
    }
    forest.nodes.extend(nodes);
    Ok(())
}
