//! Treelite checkpoints (`model_type: treelite_checkpoint`, `checkpoint.tl`), the format FIL keeps
//! scikit-learn, cuML and converted forests in. ferry reads Treelite's v4 serialization itself
//! (`read`: every count, index and offset checked against the file before anything is sized
//! from it) and evaluates the forest as Treelite's reference predictor (GTIL) does: the same
//! tests, sums in the model's own precision, tree averaging, base scores, then the model's
//! postprocessor. No Treelite library is needed at run time.
use std::ops::{Add, AddAssign, Div, DivAssign, Mul, Neg};

use super::{Forest, MAX_CLASSES, MAX_FEATURES};

mod read;

pub use read::read;

/// A comparison of a numeric split: the row goes left when `value <op> threshold` holds.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Op {
    Eq,
    Lt,
    Le,
    Gt,
    Ge,
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Test {
    Leaf,
    Numeric(Op),
    /// Left when the value is one of the node's categories (right when `right` is set).
    Categorical {
        right: bool,
    },
}

/// A node of the flattened forest; `left`/`right` index the forest's nodes.
#[derive(Debug, Clone, Copy)]
struct Node {
    test: Test,
    default_left: bool,
    feature: u32,
    left: u32,
    right: u32,
    /// The split's threshold, or the leaf's value.
    value: f64,
    /// A leaf's vector in `leaf_values`, or a categorical split's list in `categories`.
    span: (u32, u32),
}

/// The model's postprocessor, applied to each target's class values.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Post {
    Identity,
    SignedSquare,
    Hinge,
    Sigmoid,
    Exponential,
    ExponentialStandardRatio,
    LogarithmOnePlusExp,
    Softmax,
    MulticlassOva,
}

impl Post {
    fn of(name: &str) -> Option<Post> {
        Some(match name {
            "identity" | "identity_multiclass" => Post::Identity,
            "signed_square" => Post::SignedSquare,
            "hinge" => Post::Hinge,
            "sigmoid" => Post::Sigmoid,
            "exponential" => Post::Exponential,
            "exponential_standard_ratio" => Post::ExponentialStandardRatio,
            "logarithm_one_plus_exp" => Post::LogarithmOnePlusExp,
            "softmax" => Post::Softmax,
            "multiclass_ova" => Post::MulticlassOva,
            _ => return None,
        })
    }
}

/// A checked Treelite forest, ready to predict.
#[derive(Debug, Clone)]
pub struct Checkpoint {
    nodes: Vec<Node>,
    /// Each tree's root in `nodes`, and the target and class it adds to (-1: all of them).
    trees: Vec<(u32, i32, i32)>,
    leaf_values: Vec<f64>,
    categories: Vec<u32>,
    features: usize,
    /// Classes of each target; the output holds `max_class` values per target, padded with 0.
    classes: Vec<usize>,
    max_class: usize,
    /// What each output value is divided by when the model averages its trees.
    divisors: Option<Vec<f64>>,
    base: Vec<f64>,
    post: Post,
    sigmoid_alpha: f32,
    ratio_c: f32,
    /// Thresholds and leaves in float64 (sums then run in float64, as Treelite's).
    double: bool,
    classifier: bool,
}

/// The arithmetic of the model's precision (float32 or float64), as Treelite runs it.
trait Real:
    Copy
    + Default
    + PartialOrd
    + Add<Output = Self>
    + Mul<Output = Self>
    + Div<Output = Self>
    + Neg<Output = Self>
    + AddAssign
    + DivAssign
{
    fn of(v: f64) -> Self;
    fn get(self) -> f64;
    fn exp(self) -> Self;
    fn exp2(self) -> Self;
    fn ln_1p(self) -> Self;
    fn copysign(self, sign: Self) -> Self;
    /// The largest value a categorical split reads as a category.
    const MAX_CATEGORY: f64;
}

macro_rules! real {
    ($t:ty, $max:expr) => {
        impl Real for $t {
            fn of(v: f64) -> Self {
                v as $t
            }
            fn get(self) -> f64 {
                self as f64
            }
            fn exp(self) -> Self {
                <$t>::exp(self)
            }
            fn exp2(self) -> Self {
                <$t>::exp2(self)
            }
            fn ln_1p(self) -> Self {
                <$t>::ln_1p(self)
            }
            fn copysign(self, sign: Self) -> Self {
                <$t>::copysign(self, sign)
            }
            const MAX_CATEGORY: f64 = $max;
        }
    };
}
// Exactly representable in the type, and within u32.
real!(f32, (1u64 << 24) as f64);
real!(f64, u32::MAX as f64);

impl Checkpoint {
    fn walk<T: Real>(&self, root: u32, row: &[f32]) -> &Node {
        let mut node = &self.nodes[root as usize];
        loop {
            let next = match node.test {
                Test::Leaf => return node,
                _ if row[node.feature as usize].is_nan() => {
                    if node.default_left {
                        node.left
                    } else {
                        node.right
                    }
                }
                Test::Numeric(op) => {
                    // Both sides in the model's precision: a float32 input is exact in either.
                    let (x, t) = (f64::from(row[node.feature as usize]), node.value);
                    let holds = match op {
                        Op::Eq => x == t,
                        Op::Lt => x < t,
                        Op::Le => x <= t,
                        Op::Gt => x > t,
                        Op::Ge => x >= t,
                    };
                    if holds { node.left } else { node.right }
                }
                Test::Categorical { right } => {
                    let x = f64::from(row[node.feature as usize]);
                    let listed = x >= 0.0
                        && x <= T::MAX_CATEGORY
                        && self.categories[node.span.0 as usize..node.span.1 as usize]
                            .binary_search(&(x as u32))
                            .is_ok();
                    if listed != right { node.left } else { node.right }
                }
            };
            node = &self.nodes[next as usize];
        }
    }

    /// Adds one tree's leaf to the row's sums (`targets × max_class`), as GTIL places it.
    fn add<T: Real>(&self, leaf: &Node, target: i32, class: i32, sums: &mut [T]) {
        let c = self.max_class;
        let vector = &self.leaf_values[leaf.span.0 as usize..leaf.span.1 as usize];
        if vector.is_empty() {
            sums[target as usize * c + class as usize] += T::of(leaf.value);
            return;
        }
        match (target, class) {
            (-1, -1) => {
                for (t, &k) in self.classes.iter().enumerate() {
                    for j in 0..k {
                        sums[t * c + j] += T::of(vector[t * c + j]);
                    }
                }
            }
            (-1, class) => {
                for t in 0..self.classes.len() {
                    sums[t * c + class as usize] += T::of(vector[t]);
                }
            }
            (target, -1) => {
                let t = target as usize;
                for j in 0..self.classes[t] {
                    sums[t * c + j] += T::of(vector[j]);
                }
            }
            (target, class) => sums[target as usize * c + class as usize] += T::of(vector[0]),
        }
    }

    /// One target's class values, postprocessed. As in Treelite, the element-wise
    /// postprocessors (all but softmax and multiclass_ova) change only the first value.
    fn postprocess<T: Real>(&self, values: &mut [T]) {
        let one = T::of(1.0);
        let alpha = T::of(f64::from(self.sigmoid_alpha));
        let first = &mut values[..1];
        match self.post {
            Post::Identity => {}
            Post::SignedSquare => first.iter_mut().for_each(|v| *v = (*v * *v).copysign(*v)),
            Post::Hinge => first.iter_mut().for_each(|v| *v = if *v > T::default() { one } else { T::default() }),
            Post::Sigmoid => first.iter_mut().for_each(|v| *v = one / (one + (-alpha * *v).exp())),
            Post::MulticlassOva => values.iter_mut().for_each(|v| *v = one / (one + (-alpha * *v).exp())),
            Post::Exponential => first.iter_mut().for_each(|v| *v = v.exp()),
            Post::ExponentialStandardRatio => {
                let ratio = T::of(f64::from(self.ratio_c));
                first.iter_mut().for_each(|v| *v = (-*v / ratio).exp2())
            }
            Post::LogarithmOnePlusExp => first.iter_mut().for_each(|v| *v = v.exp().ln_1p()),
            Post::Softmax => {
                // Treelite's softmax: float32 terms, summed in float64.
                let max = values.iter().fold(f32::NEG_INFINITY, |m, v| m.max(v.get() as f32));
                let mut norm = 0.0f64;
                for v in values.iter_mut() {
                    let t = ((v.get() - f64::from(max)) as f32).exp();
                    norm += f64::from(t);
                    *v = T::of(f64::from(t));
                }
                values.iter_mut().for_each(|v| *v = T::of(f64::from((v.get() as f32) / norm as f32)));
            }
        }
    }

    fn predict_as<T: Real>(&self, data: &[f32], rows: usize, out: &mut Vec<f32>) {
        let (features, c) = (self.features, self.max_class);
        let width = self.classes.len() * c;
        let mut sums = vec![T::default(); width];
        out.clear();
        out.reserve(rows * width);
        for row in data.chunks_exact(features).take(rows) {
            sums.iter_mut().for_each(|s| *s = T::default());
            for &(root, target, class) in &self.trees {
                let leaf = self.walk::<T>(root, row);
                self.add(leaf, target, class, &mut sums);
            }
            for (t, &k) in self.classes.iter().enumerate() {
                let values = &mut sums[t * c..t * c + k];
                if let Some(divisors) = &self.divisors {
                    values.iter_mut().zip(&divisors[t * c..]).for_each(|(v, &d)| *v /= T::of(d));
                }
                values.iter_mut().zip(&self.base[t * c..]).for_each(|(v, &b)| *v = T::of(v.get() + b));
                self.postprocess(values);
            }
            out.extend(sums.iter().map(|v| v.get() as f32));
        }
    }
}

impl Forest for Checkpoint {
    fn features(&self) -> usize {
        self.features
    }

    fn width(&self) -> usize {
        self.classes.len() * self.max_class
    }

    fn targets(&self) -> usize {
        self.classes.len()
    }

    fn gives_classes(&self) -> bool {
        false
    }

    fn gives_probabilities(&self) -> bool {
        self.classifier
    }

    fn predict(&mut self, data: &[f32], rows: usize, out: &mut Vec<f32>) -> Result<(), String> {
        if self.double {
            self.predict_as::<f64>(data, rows, out);
        } else {
            self.predict_as::<f32>(data, rows, out);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests;
