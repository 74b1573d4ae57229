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
    margins: Vec<f32>,
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
            margins: Vec::new(),
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
        let mut margins = std::mem::take(&mut self.margins);
        margins.resize(self.groups, 0.0);
        for x in data.chunks_exact(self.features.max(1)).take(rows) {
            self.row(x, &mut margins);
            match self.transform {
                Transform::Identity => out.extend_from_slice(&margins),
                Transform::Sigmoid => out.extend(margins.iter().map(|&m| 1.0f32 / (1.0 + (-m).exp()))),
                Transform::Softmax => {
                    let top = margins.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                    let mut sum = 0.0f32;
                    for m in &margins {
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
        self.margins = margins;
        Ok(())
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

/// Whether two predictions agree within float32 rounding of the transforms.
pub fn agrees(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len()
        && a.iter().zip(b).all(|(x, y)| (x - y).abs() <= 1e-6 + 1e-5 * y.abs() || (x.is_nan() && y.is_nan()))
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
    fn probes_take_both_sides_of_a_split() {
        let f = stump();
        let rows = probe_rows(&f, 20);
        assert_eq!(rows.len(), 40);
        assert!(rows.iter().step_by(2).any(|&v| v < 0.5) && rows.iter().step_by(2).any(|&v| v >= 0.5));
        assert!(rows.iter().any(|v| v.is_nan()));
    }
}
