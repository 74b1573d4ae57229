//! LightGBM's text models evaluated by ferry itself: numeric and categorical splits with
//! LightGBM's missing-value rules, one value per leaf, the usual objectives. LightGBM's own call
//! costs tens of microseconds at batch 1 and starts its OpenMP threads for every batch; walking
//! the trees here costs microseconds. The walk and the sums follow LightGBM's `Tree::Predict`
//! and `GBDT::Predict` (in double, tree after tree, each class's trees in order), and the load
//! checks the forest against LightGBM on probe rows before it serves (`agrees`); a model that
//! differs, or an objective not listed here, is LightGBM's to run.
use std::collections::HashMap;

use super::Forest;

/// LightGBM's `kZeroThreshold` (a float literal widened to double).
const ZERO: f64 = 1e-35f32 as f64;

#[derive(Debug, Clone, Copy)]
struct Node {
    threshold: f64,
    feature: u32,
    /// Children: >= 0 a node of the forest, < 0 the forest's leaf `!child`.
    left: i32,
    right: i32,
    /// LightGBM's decision type: bit 0 categorical, bit 1 default left, bits 2-3 the missing type.
    decision: u8,
    /// A categorical split's bitset in `bits`.
    cats: (u32, u32),
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Transform {
    Identity,
    /// `1 / (1 + exp(-k x))` on each class.
    Sigmoid(f64),
    Softmax,
    Exp,
    /// `sign(x) x²`: a regression trained on square roots (`regression sqrt`).
    Square,
    /// `log(1 + exp(x))` (`cross_entropy_lambda`).
    Softplus,
}

impl Transform {
    /// LightGBM's objective line (`binary sigmoid:1`) as the transform its `ConvertOutput` makes;
    /// None for one ferry leaves to LightGBM.
    fn of(line: &str) -> Option<Transform> {
        let mut words = line.split_whitespace();
        let name = words.next().unwrap_or("");
        let params: Vec<&str> = words.collect();
        let sigmoid = || -> Option<f64> {
            match params.iter().find_map(|p| p.strip_prefix("sigmoid:")) {
                None => Some(1.0),
                Some(v) => v.parse::<f64>().ok().filter(|k| k.is_finite() && *k > 0.0),
            }
        };
        Some(match name {
            "binary" | "multiclassova" | "multiclass_ova" | "ova" | "ovr" => Transform::Sigmoid(sigmoid()?),
            "multiclass" | "softmax" => Transform::Softmax,
            "cross_entropy" | "xentropy" => Transform::Sigmoid(1.0),
            "cross_entropy_lambda" | "xentlambda" => Transform::Softplus,
            "poisson" | "gamma" | "tweedie" => Transform::Exp,
            "regression"
            | "regression_l2"
            | "l2"
            | "mean_squared_error"
            | "mse"
            | "l2_root"
            | "root_mean_squared_error"
            | "rmse"
            | "regression_l1"
            | "l1"
            | "mean_absolute_error"
            | "mae"
            | "huber"
            | "fair"
            | "quantile"
            | "mape"
            | "mean_absolute_percentage_error" => {
                if params.contains(&"sqrt") {
                    Transform::Square
                } else {
                    Transform::Identity
                }
            }
            "lambdarank" | "rank_xendcg" | "xendcg" | "xe_ndcg" | "xe_ndcg_mart" | "xendcg_mart" => Transform::Identity,
            _ => return None,
        })
    }
}

#[derive(Debug, Clone)]
pub struct LgbForest {
    nodes: Vec<Node>,
    leaves: Vec<f64>,
    bits: Vec<u32>,
    /// Each tree's root (as a child is written), in the file's order: tree `k` adds to class
    /// `k % classes`.
    roots: Vec<i32>,
    features: usize,
    classes: usize,
    transform: Transform,
    /// Random-forest mode (`average_output`): the sums are divided by the iterations.
    average: bool,
    probabilities: bool,
    threads: usize,
}

fn numbers<T: std::str::FromStr>(tree: &HashMap<&str, &str>, key: &str) -> Option<Vec<T>> {
    tree.get(key)?.split_whitespace().map(|v| v.parse().ok()).collect()
}

impl LgbForest {
    /// The forest of a model `check::lightgbm` has checked: its header's keys, whether the header
    /// says `average_output`, and each tree's keys. None when ferry leaves it to LightGBM.
    pub fn build(
        objective: &str,
        average: bool,
        trees: &[HashMap<&str, &str>],
        features: usize,
        classes: usize,
    ) -> Option<LgbForest> {
        let transform = Transform::of(objective)?;
        if features == 0 || (transform == Transform::Softmax && classes < 2) {
            return None;
        }
        let probabilities = matches!(
            objective.split_whitespace().next().unwrap_or(""),
            "binary" | "multiclass" | "multiclassova" | "cross_entropy" | "xentropy" | "softmax" | "ova"
        );
        let mut forest = LgbForest {
            nodes: Vec::new(),
            leaves: Vec::new(),
            bits: Vec::new(),
            roots: Vec::with_capacity(trees.len()),
            features,
            classes: classes.max(1),
            transform,
            average,
            probabilities,
            threads: 1,
        };
        for t in trees {
            forest.add(t)?;
        }
        Some(forest)
    }

    fn add(&mut self, t: &HashMap<&str, &str>) -> Option<()> {
        let leaf_values: Vec<f64> = numbers(t, "leaf_value")?;
        let first_leaf = i32::try_from(self.leaves.len()).ok()?;
        let first_node = i32::try_from(self.nodes.len()).ok()?;
        self.leaves.extend_from_slice(&leaf_values);
        if leaf_values.len() == 1 {
            self.roots.push(!first_leaf);
            return Some(());
        }
        let split: Vec<u32> = numbers(t, "split_feature")?;
        let left: Vec<i32> = numbers(t, "left_child")?;
        let right: Vec<i32> = numbers(t, "right_child")?;
        let decision: Vec<u8> = numbers(t, "decision_type")?;
        let threshold: Vec<f64> = numbers(t, "threshold")?;
        let cats: usize = t.get("num_cat").map_or(Some(0), |v| v.trim().parse().ok())?;
        let (bounds, words): (Vec<u32>, Vec<u32>) = if cats > 0 {
            (numbers(t, "cat_boundaries")?, numbers(t, "cat_threshold")?)
        } else {
            (Vec::new(), Vec::new())
        };
        let first_word = u32::try_from(self.bits.len()).ok()?;
        self.bits.extend_from_slice(&words);
        let child = |c: i32| if c >= 0 { first_node.checked_add(c) } else { first_leaf.checked_add(!c).map(|l| !l) };
        for i in 0..split.len() {
            let categorical = decision[i] & 1 == 1;
            let cat_range = if categorical {
                let k = threshold[i] as usize;
                let (lo, hi) = (*bounds.get(k)?, *bounds.get(k + 1)?);
                (first_word.checked_add(lo)?, hi.checked_sub(lo)?)
            } else {
                (0, 0)
            };
            self.nodes.push(Node {
                threshold: threshold[i],
                feature: split[i],
                left: child(*left.get(i)?)?,
                right: child(*right.get(i)?)?,
                decision: decision[i],
                cats: cat_range,
            });
        }
        self.roots.push(first_node);
        Some(())
    }

    /// One tree's leaf value for a row, as LightGBM's `Tree::Predict` walks it.
    fn tree(&self, root: i32, x: &[f32]) -> f64 {
        let mut at = root;
        while at >= 0 {
            let n = &self.nodes[at as usize];
            let mut v = f64::from(x[n.feature as usize]);
            // LightGBM reads a row as its values beyond kZeroThreshold (and NaNs): the rest are 0.
            if v.abs() <= ZERO {
                v = 0.0;
            }
            let left = if n.decision & 1 == 1 {
                // Categorical: NaN and negative values go right; a category goes left when its bit is set.
                !v.is_nan() && {
                    let c = v as i32;
                    let (start, len) = n.cats;
                    c >= 0
                        && (c as u32 / 32) < len
                        && (self.bits[(start + c as u32 / 32) as usize] >> (c as u32 % 32)) & 1 == 1
                }
            } else {
                let missing = (n.decision >> 2) & 3;
                if v.is_nan() && missing != 2 {
                    v = 0.0;
                }
                if (missing == 1 && (-ZERO..=ZERO).contains(&v)) || (missing == 2 && v.is_nan()) {
                    n.decision & 2 != 0
                } else {
                    v <= n.threshold
                }
            };
            at = if left { n.left } else { n.right };
        }
        self.leaves[!at as usize]
    }

    /// The threads a large batch is split over (the instance's `cpu_nthread`).
    pub fn with_threads(mut self, threads: usize) -> Self {
        self.threads = threads.max(1);
        self
    }

    fn row(&self, x: &[f32], scores: &mut Vec<f64>, out: &mut Vec<f32>) {
        let classes = self.classes;
        scores.clear();
        scores.resize(classes, 0.0);
        for (k, &root) in self.roots.iter().enumerate() {
            scores[k % classes] += self.tree(root, x);
        }
        if self.average {
            let iterations = (self.roots.len() / classes).max(1) as f64;
            for s in scores.iter_mut() {
                *s /= iterations;
            }
        }
        match self.transform {
            Transform::Identity => out.extend(scores.iter().map(|&s| s as f32)),
            Transform::Sigmoid(k) => out.extend(scores.iter().map(|&s| (1.0 / (1.0 + (-k * s).exp())) as f32)),
            Transform::Exp => out.extend(scores.iter().map(|&s| s.exp() as f32)),
            Transform::Square => out.extend(scores.iter().map(|&s| (s.signum() * s * s) as f32)),
            Transform::Softplus => out.extend(scores.iter().map(|&s| s.exp().ln_1p() as f32)),
            Transform::Softmax => {
                let top = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let mut sum = 0.0;
                for s in scores.iter_mut() {
                    *s = (*s - top).exp();
                    sum += *s;
                }
                out.extend(scores.iter().map(|&s| (s / sum) as f32));
            }
        }
    }

    /// Probe rows from the forest's own splits: each feature at, just below and just above a
    /// threshold it is split on, zero, missing, and for categorical splits categories in and out
    /// of their sets and a negative one, so that every rule of the walk is taken.
    pub fn probe_rows(&self, rows: usize) -> Vec<f32> {
        let f = self.features.max(1);
        let mut values: Vec<Vec<f32>> = vec![Vec::new(); f];
        for n in &self.nodes {
            let list = &mut values[n.feature as usize];
            if list.len() >= 64 {
                continue;
            }
            if n.decision & 1 == 1 {
                let (start, len) = n.cats;
                let words = &self.bits[start as usize..(start + len) as usize];
                let set = (0..len * 32).find(|&c| (words[(c / 32) as usize] >> (c % 32)) & 1 == 1);
                let unset =
                    (0..len * 32 + 1).find(|&c| c / 32 >= len || (words[(c / 32) as usize] >> (c % 32)) & 1 == 0);
                list.extend(set.into_iter().chain(unset).map(|c| c as f32));
            } else {
                let t = n.threshold as f32;
                list.extend([t, t - t.abs().max(1.0) * 1e-3, t + t.abs().max(1.0) * 1e-3]);
            }
        }
        let mut data = Vec::with_capacity(rows * f);
        for r in 0..rows {
            for (j, list) in values.iter().enumerate() {
                let k = r.wrapping_mul(31).wrapping_add(j.wrapping_mul(17));
                data.push(match (list.get(k % list.len().max(1)), k % 7) {
                    (_, 5) => f32::NAN,
                    (_, 6) => 0.0,
                    (Some(&v), 4) => -v - 1.0,
                    (Some(&v), _) => v,
                    (None, _) => (k % 5) as f32 - 2.0,
                });
            }
        }
        data
    }
}

impl Forest for LgbForest {
    fn features(&self) -> usize {
        self.features
    }

    fn width(&self) -> usize {
        self.classes
    }

    fn gives_classes(&self) -> bool {
        false
    }

    fn gives_probabilities(&self) -> bool {
        self.probabilities
    }

    fn predict(&mut self, data: &[f32], rows: usize, out: &mut Vec<f32>) -> Result<(), String> {
        out.clear();
        let this = &*self;
        super::native::over_threads(data, self.features, rows, self.threads, out, |part, out| {
            let mut scores = Vec::with_capacity(this.classes);
            out.reserve(part.len() / this.features.max(1) * this.classes);
            for x in part.chunks_exact(this.features.max(1)) {
                this.row(x, &mut scores, out);
            }
        });
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tree(pairs: &[(&'static str, &'static str)]) -> HashMap<&'static str, &'static str> {
        pairs.iter().copied().collect()
    }

    /// x0 <= 0.5 ? (x2 in {1, 3} ? 0.1 : 0.2) : 0.3; x0 missing (NaN type) goes left, x2 is categorical.
    fn forest(objective: &str) -> LgbForest {
        let t = tree(&[
            ("num_leaves", "3"),
            ("num_cat", "1"),
            ("split_feature", "0 2"),
            ("threshold", "0.5 0"),
            ("decision_type", "10 1"),
            ("left_child", "1 -1"),
            ("right_child", "-3 -2"),
            ("leaf_value", "0.1 0.2 0.3"),
            ("cat_boundaries", "0 1"),
            ("cat_threshold", "10"),
        ]);
        LgbForest::build(objective, false, &[t], 3, 1).unwrap()
    }

    #[test]
    fn walks_numeric_categorical_and_missing_values_as_lightgbm() {
        let mut f = forest("regression");
        let mut out = Vec::new();
        let rows = [
            0.0,
            0.0,
            1.0, // left, category 1 in the set
            0.0,
            0.0,
            2.0, // left, category 2 not in it
            1.0,
            0.0,
            1.0, // right
            f32::NAN,
            0.0,
            3.0, // missing goes left (default left, NaN type), category 3 in the set
            0.0,
            0.0,
            f32::NAN, // a missing category goes right
            0.0,
            0.0,
            -1.0, // a negative category goes right
            0.0,
            0.0,
            1e9, // a category past the set goes right
        ];
        f.predict(&rows, 7, &mut out).unwrap();
        let want = [0.1f32, 0.2, 0.3, 0.1, 0.2, 0.2, 0.2];
        assert_eq!(out, want);
    }

    #[test]
    fn missing_values_of_a_split_without_a_missing_type_count_as_zero() {
        // decision_type 0: numeric, default right, no missing type: NaN is 0.0 <= 0.5, left.
        let t = tree(&[
            ("num_leaves", "2"),
            ("split_feature", "0"),
            ("threshold", "0.5"),
            ("decision_type", "0"),
            ("left_child", "-1"),
            ("right_child", "-2"),
            ("leaf_value", "1 2"),
        ]);
        let mut f = LgbForest::build("regression", false, &[t], 1, 1).unwrap();
        let mut out = Vec::new();
        f.predict(&[f32::NAN, 0.7], 2, &mut out).unwrap();
        assert_eq!(out, [1.0, 2.0]);
    }

    #[test]
    fn values_within_the_zero_threshold_are_zero() {
        // LightGBM splits at -kZeroThreshold; -kZeroThreshold itself reads as 0.0, which goes right.
        let t = tree(&[
            ("num_leaves", "2"),
            ("split_feature", "0"),
            ("threshold", "-1.0000000180025095e-35"),
            ("decision_type", "2"),
            ("left_child", "-1"),
            ("right_child", "-2"),
            ("leaf_value", "1 2"),
        ]);
        let mut f = LgbForest::build("regression", false, &[t], 1, 1).unwrap();
        let mut out = Vec::new();
        f.predict(&[-1e-35, -1e-30], 2, &mut out).unwrap();
        assert_eq!(out, [2.0, 1.0]);
    }

    #[test]
    fn objectives_transform_the_sums() {
        let mut out = Vec::new();
        forest("binary sigmoid:2").predict(&[1.0, 0.0, 0.0], 1, &mut out).unwrap();
        assert!((out[0] - 1.0 / (1.0 + (-0.6f32).exp())).abs() < 1e-7, "{out:?}");
        forest("poisson").predict(&[1.0, 0.0, 0.0], 1, &mut out).unwrap();
        assert!((out[0] - 0.3f32.exp()).abs() < 1e-6);
        forest("regression sqrt").predict(&[1.0, 0.0, 0.0], 1, &mut out).unwrap();
        assert!((out[0] - 0.09).abs() < 1e-7);
        assert!(LgbForest::build("custom", false, &[], 3, 1).is_none());
        assert!(LgbForest::build("binary sigmoid:-1", false, &[], 3, 1).is_none());
    }

    #[test]
    fn classes_take_every_classes_th_tree_and_softmax_sums_to_one() {
        let leaf = |v: &'static str| tree(&[("num_leaves", "1"), ("leaf_value", v)]);
        let trees = [leaf("1"), leaf("2"), leaf("3"), leaf("1"), leaf("0"), leaf("0")];
        let mut f = LgbForest::build("multiclass num_class:3", false, &trees, 1, 3).unwrap();
        let mut out = Vec::new();
        f.predict(&[0.0], 1, &mut out).unwrap();
        let e = [2f64.exp(), 2f64.exp(), 3f64.exp()];
        let s: f64 = e.iter().sum();
        assert_eq!(out, e.iter().map(|v| (v / s) as f32).collect::<Vec<_>>());
        let mut averaged = LgbForest::build("regression", true, &[leaf("1"), leaf("2")], 1, 1).unwrap();
        averaged.predict(&[0.0], 1, &mut out).unwrap();
        assert_eq!(out, [1.5]);
    }

    #[test]
    fn probes_reach_both_sides_of_each_split() {
        let f = forest("regression");
        let rows = f.probe_rows(40);
        assert_eq!(rows.len(), 120);
        let x0: Vec<f32> = rows.iter().step_by(3).copied().collect();
        assert!(x0.iter().any(|&v| v <= 0.5) && x0.iter().any(|&v| v > 0.5) && x0.iter().any(|v| v.is_nan()));
        let x2: Vec<f32> = rows.iter().skip(2).step_by(3).copied().collect();
        assert!(x2.contains(&1.0) && x2.contains(&0.0) && x2.iter().any(|&v| v < 0.0));
    }
}
