//! XGBoost's common forests evaluated by ferry itself: numeric splits, one value per leaf, the
//! usual objectives. XGBoost's prediction call costs about 0.1 ms at batch 1 whatever the
//! forest (bench/RESULTS.md); walking the trees here costs microseconds. The sums follow
//! XGBoost's own (float32, the base margin first, then each tree in order) and the load checks
//! this forest against XGBoost on probe rows before it serves (`agrees`); any other forest is
//! XGBoost's to run.
use super::Forest;

/// A node of the flattened forest; `left == LEAF` marks a leaf holding `value`.
#[derive(Debug, Clone, Copy)]
struct Node {
    feature: u32,
    left: u32,
    right: u32,
    default_left: bool,
    /// The split's threshold, or the leaf's value.
    value: f32,
}

const LEAF: u32 = u32::MAX;

#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Transform {
    Identity,
    Sigmoid,
    Softmax,
    /// The likeliest class's index (`multi:softmax`).
    Argmax,
}

impl Transform {
    /// How XGBoost's objective turns margins into predictions, and whether its base score is a
    /// probability (turned into a margin by the logit). None: an objective left to XGBoost.
    pub fn of(objective: &str) -> Option<(Transform, bool)> {
        Some(match objective {
            "binary:logistic" | "reg:logistic" => (Transform::Sigmoid, true),
            "binary:logitraw" => (Transform::Identity, true),
            "reg:squarederror" | "reg:squaredlogerror" | "reg:absoluteerror" | "reg:pseudohubererror" => {
                (Transform::Identity, false)
            }
            "multi:softprob" => (Transform::Softmax, false),
            "multi:softmax" => (Transform::Argmax, false),
            _ => return None,
        })
    }
}

#[derive(Debug, Clone)]
pub struct NativeForest {
    nodes: Vec<Node>,
    /// Each tree's root in `nodes`, and the output group it adds to.
    trees: Vec<(u32, u32)>,
    features: usize,
    groups: usize,
    /// The base margin of each group.
    base: Vec<f32>,
    transform: Transform,
    objective: String,
    threads: usize,
}

impl NativeForest {
    /// An empty forest; `base_score` as XGBoost stores it (a probability for the logistic
    /// objectives, else a margin), one value or one per group.
    pub fn new(objective: &str, features: usize, groups: usize, base_score: &[f32]) -> Option<NativeForest> {
        let (transform, probability) = Transform::of(objective)?;
        let groups = groups.max(1);
        let base: Vec<f32> = match base_score.len() {
            0 => vec![if probability { 0.5 } else { 0.0 }; groups],
            1 => vec![base_score[0]; groups],
            n if n == groups => base_score.to_vec(),
            _ => return None,
        };
        // XGBoost's ProbToMargin of the logistic objectives, in float32.
        let base = if probability { base.iter().map(|&p| -(1.0f32 / p - 1.0).ln()).collect() } else { base };
        if base.iter().any(|b| !b.is_finite()) || (matches!(transform, Transform::Sigmoid) && groups != 1) {
            return None;
        }
        Some(NativeForest {
            nodes: Vec::new(),
            trees: Vec::new(),
            features,
            groups,
            base,
            transform,
            objective: objective.to_string(),
            threads: 1,
        })
    }

    /// Adds one checked tree (children -1 at leaves, every index in range).
    pub fn add_tree(
        &mut self,
        group: usize,
        left: &[i64],
        right: &[i64],
        feature: &[i64],
        value: &[f32],
        default_left: &[i64],
    ) {
        let first = self.nodes.len() as u32;
        for i in 0..left.len() {
            let leaf = left[i] < 0;
            self.nodes.push(Node {
                feature: if leaf { 0 } else { feature[i] as u32 },
                left: if leaf { LEAF } else { first + left[i] as u32 },
                right: if leaf { LEAF } else { first + right[i] as u32 },
                // XGBoost reads the flag as true only when it is 1.
                default_left: default_left[i] == 1,
                value: value[i],
            });
        }
        self.trees.push((first, group as u32));
    }

    fn row(&self, x: &[f32], margins: &mut [f32]) {
        margins.copy_from_slice(&self.base);
        for &(root, group) in &self.trees {
            let mut n = self.nodes[root as usize];
            while n.left != LEAF {
                let v = x[n.feature as usize];
                let next = if v.is_nan() {
                    if n.default_left { n.left } else { n.right }
                } else if v < n.value {
                    n.left
                } else {
                    n.right
                };
                n = self.nodes[next as usize];
            }
            margins[group as usize] += n.value;
        }
    }
}

impl Forest for NativeForest {
    fn features(&self) -> usize {
        self.features
    }

    fn width(&self) -> usize {
        if self.transform == Transform::Argmax { 1 } else { self.groups }
    }

    fn gives_classes(&self) -> bool {
        self.transform == Transform::Argmax
    }

    fn gives_probabilities(&self) -> bool {
        matches!(self.objective.split(':').next(), Some("binary" | "multi")) || self.objective == "reg:logistic"
    }

    fn predict(&mut self, data: &[f32], rows: usize, out: &mut Vec<f32>) -> Result<(), String> {
        out.clear();
        let this = &*self;
        over_threads(data, self.features, rows, self.threads, out, |part, out| {
            let mut margins = vec![0.0; this.groups];
            for x in part.chunks_exact(this.features.max(1)) {
                this.row(x, &mut margins);
                this.finish(&margins, out);
            }
        });
        Ok(())
    }
}

impl NativeForest {
    /// The threads a large batch is split over (the instance's `cpu_nthread`).
    pub fn with_threads(mut self, threads: usize) -> Self {
        self.threads = threads.max(1);
        self
    }

    /// A row's predictions from its margins.
    fn finish(&self, margins: &[f32], out: &mut Vec<f32>) {
        match self.transform {
            Transform::Identity => out.extend_from_slice(margins),
            Transform::Sigmoid => out.extend(margins.iter().map(|&m| 1.0f32 / (1.0 + (-m).exp()))),
            Transform::Softmax => {
                let top = margins.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let mut sum = 0.0f32;
                for m in margins {
                    sum += (m - top).exp();
                }
                out.extend(margins.iter().map(|&m| (m - top).exp() / sum));
            }
            Transform::Argmax => {
                let best = margins.iter().enumerate().fold(0, |b, (i, &m)| if m > margins[b] { i } else { b });
                out.push(best as f32);
            }
        }
    }
}

/// Batches of at least this many rows are split over the instance's threads: a thread started
/// for a batch costs tens of microseconds, and such a batch of a forest takes milliseconds.
const PARALLEL_ROWS: usize = 512;

/// The first `rows` rows of `data` (of `features` values each) predicted by `part`, which appends
/// the values of each row it is given to its output; on up to `threads` threads when the batch
/// is large enough to pay for them. The values come back in row order.
pub fn over_threads(
    data: &[f32],
    features: usize,
    rows: usize,
    threads: usize,
    out: &mut Vec<f32>,
    part: impl Fn(&[f32], &mut Vec<f32>) + Sync,
) {
    let f = features.max(1);
    let data = &data[..rows.saturating_mul(f).min(data.len())];
    if threads < 2 || rows < PARALLEL_ROWS {
        return part(data, out);
    }
    let per = rows.div_ceil(threads) * f;
    let mut chunks = data.chunks(per);
    let first = chunks.next().unwrap_or_default();
    let rest: Vec<Vec<f32>> = std::thread::scope(|s| {
        let part = &part;
        // A thread the system will not start leaves its rows to this one.
        let started: Vec<_> = chunks
            .map(|chunk| {
                std::thread::Builder::new()
                    .name("ferry-forest".into())
                    .spawn_scoped(s, move || {
                        let mut o = Vec::new();
                        part(chunk, &mut o);
                        o
                    })
                    .map_err(|_| chunk)
            })
            .collect();
        part(first, out);
        started
            .into_iter()
            .map(|t| match t {
                Ok(handle) => handle.join().unwrap_or_default(),
                Err(chunk) => {
                    let mut o = Vec::new();
                    part(chunk, &mut o);
                    o
                }
            })
            .collect()
    });
    for r in rest {
        out.extend(r);
    }
}

/// Probe rows from the forest's own thresholds: each feature at, just below and just above a
/// threshold it is split on, and missing, so that both sides of the splits are taken.
pub fn probe_rows(forest: &NativeForest, rows: usize) -> Vec<f32> {
    let f = forest.features.max(1);
    let mut thresholds: Vec<Vec<f32>> = vec![Vec::new(); f];
    for n in forest.nodes.iter().filter(|n| n.left != LEAF) {
        let list = &mut thresholds[n.feature as usize];
        if list.len() < 64 {
            list.push(n.value);
        }
    }
    let mut data = Vec::with_capacity(rows * f);
    for r in 0..rows {
        for (j, list) in thresholds.iter().enumerate() {
            let k = r.wrapping_mul(31).wrapping_add(j.wrapping_mul(17));
            let v = match (list.get(k % list.len().max(1)), k % 5) {
                (_, 4) => f32::NAN,
                (Some(&t), 0) => t,
                (Some(&t), 1) => t - t.abs().max(1.0) * 1e-3,
                (Some(&t), 2) => t + t.abs().max(1.0) * 1e-3,
                _ => (k % 7) as f32 - 3.0,
            };
            data.push(v);
        }
    }
    data
}

/// Whether two predictions agree within float32 rounding of the transforms: relative to the
/// values, so that a forest whose outputs are all small is checked as closely as any other.
pub fn agrees(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len()
        && a.iter()
            .zip(b)
            .all(|(x, y)| x == y || (x - y).abs() <= 1e-5 * x.abs().max(y.abs()) || (x.is_nan() && y.is_nan()))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// x0 < 0.5 ? (x1 < 2 ? 1 : 2) : 3, missing x0 goes right.
    fn stump() -> NativeForest {
        let mut f = NativeForest::new("reg:squarederror", 2, 1, &[0.5]).unwrap();
        f.add_tree(
            0,
            &[1, 3, -1, -1, -1],
            &[2, 4, -1, -1, -1],
            &[0, 1, 0, 0, 0],
            &[0.5, 2.0, 3.0, 1.0, 2.0],
            &[0, 1, 0, 0, 0],
        );
        f
    }

    #[test]
    fn walks_splits_and_missing_values_as_xgboost() {
        let mut f = stump();
        let mut out = Vec::new();
        f.predict(&[0.0, 0.0, 0.0, 5.0, 1.0, 0.0, f32::NAN, 0.0, 0.0, f32::NAN], 5, &mut out).unwrap();
        assert_eq!(out, vec![1.5, 2.5, 3.5, 3.5, 1.5]);
    }

    #[test]
    fn logistic_base_scores_are_probabilities() {
        let f = NativeForest::new("binary:logistic", 1, 1, &[0.5]).unwrap();
        assert_eq!(f.base, vec![0.0]);
        assert!(NativeForest::new("rank:pairwise", 1, 1, &[0.5]).is_none());
        assert!(NativeForest::new("multi:softprob", 1, 3, &[0.1, 0.2]).is_none());
    }

    #[test]
    fn agreement_is_relative_to_the_values() {
        assert!(agrees(&[1.0, 1e-7, f32::INFINITY, f32::NAN], &[1.000001, 1.000001e-7, f32::INFINITY, f32::NAN]));
        assert!(!agrees(&[3e-7], &[5e-7]));
        assert!(!agrees(&[1.0], &[1.001]));
        assert!(!agrees(&[1.0], &[1.0, 2.0]));
    }

    #[test]
    fn a_large_batch_over_threads_keeps_its_rows_in_order() {
        let rows = PARALLEL_ROWS * 2 + 7;
        let data: Vec<f32> = (0..rows * 2).map(|k| k as f32).collect();
        for threads in [1, 2, 3, 64] {
            let mut out = Vec::new();
            over_threads(&data, 2, rows, threads, &mut out, |part, out| {
                out.extend(part.iter().step_by(2).map(|v| v / 2.0))
            });
            assert_eq!(out, (0..rows).map(|r| r as f32).collect::<Vec<_>>(), "{threads} threads");
        }
        let (mut one, mut two) = (Vec::new(), Vec::new());
        let x: Vec<f32> = (0..rows * 2).map(|k| (k % 11) as f32 / 5.0 - 1.0).collect();
        stump().predict(&x, rows, &mut one).unwrap();
        stump().with_threads(2).predict(&x, rows, &mut two).unwrap();
        assert_eq!(one.len(), rows);
        assert_eq!(one, two);
    }

    #[test]
    fn probes_take_both_sides_of_a_split() {
        let f = stump();
        let rows = probe_rows(&f, 20);
        assert_eq!(rows.len(), 40);
        assert!(rows.iter().step_by(2).any(|&v| v < 0.5) && rows.iter().step_by(2).any(|&v| v >= 0.5));
        assert!(rows.iter().any(|v| v.is_nan()));
    }
}
