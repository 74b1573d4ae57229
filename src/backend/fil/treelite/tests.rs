//! Checkpoints written here byte by byte in Treelite 4's layout (float32 models), predicted, and
//! broken in the ways a hostile file would be.
use super::*;

#[derive(Clone)]
struct Tree {
    kinds: Vec<i8>,
    left: Vec<i32>,
    right: Vec<i32>,
    split: Vec<i32>,
    default_left: Vec<bool>,
    leaf: Vec<f32>,
    threshold: Vec<f32>,
    cmp: Vec<i8>,
    list_right: Vec<bool>,
    vectors: Vec<f32>,
    vector_span: Vec<(u64, u64)>,
    categories: Vec<u32>,
    category_span: Vec<(u64, u64)>,
}

/// A stump on `feature`: `< threshold` (or a category list) goes left to `a`, else right to `b`.
fn stump(feature: i32, threshold: f32, a: f32, b: f32) -> Tree {
    Tree {
        kinds: vec![1, 0, 0],
        left: vec![1, -1, -1],
        right: vec![2, -1, -1],
        split: vec![feature, 0, 0],
        default_left: vec![true, false, false],
        leaf: vec![0.0, a, b],
        threshold: vec![threshold, 0.0, 0.0],
        cmp: vec![2, 0, 0],
        list_right: vec![false; 3],
        vectors: vec![],
        vector_span: vec![(0, 0); 3],
        categories: vec![],
        category_span: vec![(0, 0); 3],
    }
}

struct Model {
    task: u8,
    average: bool,
    classes: Vec<i32>,
    shape: [i32; 2],
    ids: Vec<(i32, i32)>,
    post: &'static str,
    base: Vec<f64>,
    trees: Vec<Tree>,
}

impl Model {
    fn regression(trees: Vec<Tree>, base: f64) -> Model {
        Model {
            task: 1,
            average: false,
            classes: vec![1],
            shape: [1, 1],
            ids: vec![(0, 0); trees.len()],
            post: "identity",
            base: vec![base],
            trees,
        }
    }

    fn bytes(&self) -> Vec<u8> {
        let mut w = Vec::new();
        fn arr<const N: usize>(w: &mut Vec<u8>, items: impl ExactSizeIterator<Item = [u8; N]>) {
            w.extend_from_slice(&(items.len() as u64).to_le_bytes());
            items.for_each(|b| w.extend_from_slice(&b));
        }
        for v in [4i32, 8, 1] {
            w.extend_from_slice(&v.to_le_bytes());
        }
        w.extend_from_slice(&[2, 2]);
        w.extend_from_slice(&(self.trees.len() as u64).to_le_bytes());
        w.extend_from_slice(&2i32.to_le_bytes()); // features
        w.push(self.task);
        w.push(self.average as u8);
        w.extend_from_slice(&(self.classes.len() as i32).to_le_bytes());
        arr(&mut w, self.classes.iter().map(|v| v.to_le_bytes()));
        arr(&mut w, self.shape.iter().map(|v| v.to_le_bytes()));
        arr(&mut w, self.ids.iter().map(|v| v.0.to_le_bytes()));
        arr(&mut w, self.ids.iter().map(|v| v.1.to_le_bytes()));
        arr(&mut w, self.post.bytes().map(|b| [b]));
        w.extend_from_slice(&1f32.to_le_bytes());
        w.extend_from_slice(&1f32.to_le_bytes());
        arr(&mut w, self.base.iter().map(|v| v.to_le_bytes()));
        arr(&mut w, "{}".bytes().map(|b| [b]));
        w.extend_from_slice(&0i32.to_le_bytes());
        for t in &self.trees {
            w.extend_from_slice(&(t.kinds.len() as i32).to_le_bytes());
            w.push(t.kinds.contains(&2) as u8);
            arr(&mut w, t.kinds.iter().map(|v| v.to_le_bytes()));
            arr(&mut w, t.left.iter().map(|v| v.to_le_bytes()));
            arr(&mut w, t.right.iter().map(|v| v.to_le_bytes()));
            arr(&mut w, t.split.iter().map(|v| v.to_le_bytes()));
            arr(&mut w, t.default_left.iter().map(|&v| [v as u8]));
            arr(&mut w, t.leaf.iter().map(|v| v.to_le_bytes()));
            arr(&mut w, t.threshold.iter().map(|v| v.to_le_bytes()));
            arr(&mut w, t.cmp.iter().map(|v| v.to_le_bytes()));
            arr(&mut w, t.list_right.iter().map(|&v| [v as u8]));
            arr(&mut w, t.vectors.iter().map(|v| v.to_le_bytes()));
            arr(&mut w, t.vector_span.iter().map(|v| v.0.to_le_bytes()));
            arr(&mut w, t.vector_span.iter().map(|v| v.1.to_le_bytes()));
            arr(&mut w, t.categories.iter().map(|v| v.to_le_bytes()));
            arr(&mut w, t.category_span.iter().map(|v| v.0.to_le_bytes()));
            arr(&mut w, t.category_span.iter().map(|v| v.1.to_le_bytes()));
            for _ in 0..6 {
                w.extend_from_slice(&0u64.to_le_bytes());
            }
            w.extend_from_slice(&0i32.to_le_bytes());
            w.extend_from_slice(&0i32.to_le_bytes());
        }
        w
    }
}

fn predict(bytes: &[u8], rows: &[[f32; 2]]) -> Vec<f32> {
    let mut forest = read(bytes).unwrap();
    let data: Vec<f32> = rows.iter().flatten().copied().collect();
    let mut out = Vec::new();
    forest.predict(&data, rows.len(), &mut out).unwrap();
    out
}

#[test]
fn a_regression_forest_sums_its_trees_and_the_base_and_takes_the_default_branch_for_nan() {
    let m = Model::regression(vec![stump(0, 0.5, 1.0, 2.0), stump(1, 0.0, 10.0, 20.0)], 0.5);
    let out = predict(&m.bytes(), &[[0.0, -1.0], [0.5, 1.0], [f32::NAN, f32::NAN]]);
    assert_eq!(out, vec![11.5, 22.5, 11.5]);
}

#[test]
fn a_categorical_split_goes_left_on_a_listed_category_and_right_otherwise() {
    let mut t = stump(0, 0.0, 1.0, 2.0);
    t.kinds[0] = 2;
    t.categories = vec![7, 3, 1];
    t.category_span[0] = (0, 3);
    let m = Model::regression(vec![t.clone()], 0.0);
    let out = predict(&m.bytes(), &[[1.0, 0.0], [3.9, 0.0], [2.0, 0.0], [-1.0, 0.0], [7.0, 0.0], [5e9, 0.0]]);
    assert_eq!(out, vec![1.0, 1.0, 2.0, 2.0, 1.0, 2.0]);
    t.list_right[0] = true;
    let out = predict(&Model::regression(vec![t], 0.0).bytes(), &[[1.0, 0.0], [2.0, 0.0]]);
    assert_eq!(out, vec![2.0, 1.0]);
}

#[test]
fn a_random_forest_averages_its_leaf_vectors() {
    let vote = |a: [f32; 2], b: [f32; 2]| {
        let mut t = stump(0, 0.0, 0.0, 0.0);
        t.vectors = vec![a[0], a[1], b[0], b[1]];
        t.vector_span = vec![(0, 0), (0, 2), (2, 4)];
        t
    };
    let m = Model {
        task: 2,
        average: true,
        classes: vec![2],
        shape: [1, 2],
        ids: vec![(0, -1); 2],
        post: "identity_multiclass",
        base: vec![0.0, 0.0],
        trees: vec![vote([1.0, 0.0], [0.0, 1.0]), vote([0.5, 0.5], [0.0, 1.0])],
    };
    let forest = read(&m.bytes()).unwrap();
    assert!(forest.gives_probabilities());
    assert_eq!((forest.width(), forest.targets()), (2, 1));
    assert_eq!(predict(&m.bytes(), &[[-1.0, 0.0], [1.0, 0.0]]), vec![0.75, 0.25, 0.0, 1.0]);
}

#[test]
fn a_grove_per_class_model_takes_the_softmax_of_each_classes_trees() {
    let m = Model {
        task: 2,
        average: false,
        classes: vec![2],
        shape: [1, 1],
        ids: vec![(0, 0), (0, 1)],
        post: "softmax",
        base: vec![0.0, 0.0],
        trees: vec![stump(0, 0.0, 1.0, 0.0), stump(0, 0.0, 0.0, 1.0)],
    };
    let out = predict(&m.bytes(), &[[-1.0, 0.0]]);
    let e = 1f32.exp();
    assert!((out[0] - e / (e + 1.0)).abs() < 1e-6 && (out[1] - 1.0 / (e + 1.0)).abs() < 1e-6, "{out:?}");
}

fn refused(m: &[u8]) -> String {
    read(m).expect_err("a broken checkpoint must be refused")
}

#[test]
fn every_truncation_and_trailing_bytes_are_refused() {
    let good = Model::regression(vec![stump(0, 0.5, 1.0, 2.0)], 0.0).bytes();
    for n in 0..good.len() {
        refused(&good[..n]);
    }
    let mut long = good.clone();
    long.push(0);
    assert!(refused(&long).contains("follow the last tree"));
}

#[test]
fn a_tree_that_is_not_a_tree_or_points_outside_is_refused() {
    let broken = |f: fn(&mut Tree)| {
        let mut t = stump(0, 0.5, 1.0, 2.0);
        f(&mut t);
        refused(&Model::regression(vec![t], 0.0).bytes())
    };
    assert!(broken(|t| t.left[0] = 0).contains("reached twice"));
    assert!(broken(|t| t.right[0] = 1).contains("reached twice"));
    assert!(broken(|t| t.left[0] = 3).contains("left child"));
    assert!(broken(|t| t.right[0] = -2).contains("right child"));
    assert!(broken(|t| t.split[0] = 2).contains("split feature"));
    assert!(broken(|t| t.cmp[0] = 9).contains("comparison operator"));
    assert!(
        broken(|t| {
            t.leaf.pop();
        })
        .contains("leaf_value")
    );
    assert!(broken(|t| t.vector_span[1] = (0, 5)).contains("leaf vector"));
    assert!(
        broken(|t| {
            t.vectors = vec![1.0, 2.0];
            t.vector_span[1] = (0, 2);
        })
        .contains("leaf vector of 2")
    );
    assert!(
        broken(|t| {
            t.kinds[0] = 2;
            t.category_span[0] = (1, 0);
        })
        .contains("categories")
    );
}

#[test]
fn a_header_out_of_bounds_is_refused() {
    let m = Model::regression(vec![stump(0, 0.5, 1.0, 2.0)], 0.0);
    let mut b = m.bytes();
    b[0] = 3;
    assert!(refused(&b).contains("Treelite 3"));
    let mut b = m.bytes();
    b[14..22].copy_from_slice(&u64::MAX.to_le_bytes()); // the tree count
    assert!(refused(&b).contains("trees"));
    let mut b = m.bytes();
    b[22..26].copy_from_slice(&0i32.to_le_bytes()); // the features
    assert!(refused(&b).contains("features"));
    let mut b = m.bytes();
    b[32..40].copy_from_slice(&(1u64 << 60).to_le_bytes()); // num_class's count
    assert!(refused(&b).contains("more than the file holds"));
    let unknown = Model { post: "cube", ..Model::regression(vec![stump(0, 0.5, 1.0, 2.0)], 0.0) };
    assert!(refused(&unknown.bytes()).contains("postprocessor 'cube'"));
    let wrong = Model { ids: vec![(0, 1)], ..Model::regression(vec![stump(0, 0.5, 1.0, 2.0)], 0.0) };
    assert!(refused(&wrong.bytes()).contains("class_id"));
    let vector = Model { ids: vec![(0, -1)], ..Model::regression(vec![stump(0, 0.5, 1.0, 2.0)], 0.0) };
    assert!(refused(&vector.bytes()).contains("single leaf value"));
}

#[test]
fn element_wise_postprocessors_change_only_each_targets_first_value_as_treelites() {
    let mut t = stump(0, 0.0, 0.0, 0.0);
    t.vectors = vec![-1.5, 0.7, 2.0];
    t.vector_span = vec![(0, 0), (0, 3), (0, 3)];
    let model = |post| Model {
        task: 2,
        average: false,
        classes: vec![3],
        shape: [1, 3],
        ids: vec![(0, -1)],
        post,
        base: vec![0.0; 3],
        trees: vec![t.clone()],
    };
    let sigmoid = predict(&model("sigmoid").bytes(), &[[0.0, 0.0]]);
    assert!((sigmoid[0] - 1.0 / (1.0 + 1.5f32.exp())).abs() < 1e-6 && sigmoid[1..] == [0.7, 2.0], "{sigmoid:?}");
    assert_eq!(predict(&model("hinge").bytes(), &[[0.0, 0.0]]), vec![0.0, 0.7, 2.0]);
    let ova = predict(&model("multiclass_ova").bytes(), &[[0.0, 0.0]]);
    assert!((ova[2] - 1.0 / (1.0 + (-2.0f32).exp())).abs() < 1e-6, "{ova:?}");
}

#[test]
fn a_tree_for_all_targets_may_add_to_a_narrower_targets_padding_and_unused_vectors_are_dropped() {
    // Two targets of 3 and 2 classes; a tree for every target adds to class 2 (padding of the second).
    let mut t = stump(0, 0.0, 0.0, 0.0);
    t.vectors = vec![1.0, 2.0, 99.0, 99.0, 99.0];
    t.vector_span = vec![(0, 0), (0, 2), (0, 2)];
    let m = Model {
        task: 1,
        average: false,
        classes: vec![3, 2],
        shape: [2, 1],
        ids: vec![(-1, 2)],
        post: "identity",
        base: vec![0.0; 6],
        trees: vec![t],
    };
    let forest = read(&m.bytes()).unwrap();
    assert_eq!(forest.leaf_values, vec![1.0, 2.0]);
    assert_eq!(predict(&m.bytes(), &[[0.0, 0.0]]), vec![0.0, 0.0, 1.0, 0.0, 0.0, 2.0]);
}
