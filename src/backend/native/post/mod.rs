//! `backend: "ferry_postprocess"`: what Python post-processing steps usually do, natively. The
//! `operation` parameter picks one:
//!
//! - `softmax` / `sigmoid` (`axis`, default -1): FP32 in, FP32 of the same shape out;
//! - `argmax`: FP32 `[..., C]` in, INT64 or INT32 `[...]` out;
//! - `topk` (`k`, `activation` none|softmax|sigmoid, `labels`: a file in the model folder, one
//!   label per line): outputs by datatype, FP32 scores, INT64/INT32 indices, BYTES labels, each
//!   `[..., k]`;
//! - `pool` (`pooling` mean|cls, `normalize` true|false): hidden states FP32 `[..., S, D]` and an
//!   optional attention mask `[..., S]` in, FP32 `[..., D]` out (sentence embeddings);
//! - `yolo`: see `yolo.rs`.
use std::{path::Path, sync::Arc};

use super::{Params, as_f32, bytes_tensor, f32_tensor, floats, in_order, int_tensor};
use crate::{
    backend::{Answer, Backend, BackendInput, BackendRequest, InstanceSpec, ModelInstance, ModelIo},
    error::{Error, Result},
    proto::inference::ModelConfig,
    tensor::{DataType, Tensor},
};

mod yolo;

pub struct PostBackend;

#[derive(Debug, Clone, Copy, PartialEq)]
enum Activation {
    None,
    Softmax,
    Sigmoid,
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Pooling {
    Mean,
    Cls,
}

#[derive(Debug, Clone)]
enum Op {
    Activate(Activation, i64),
    Argmax,
    TopK { k: usize, activation: Activation, labels: Option<Arc<Vec<String>>> },
    Pool { pooling: Pooling, normalize: bool },
    Yolo(yolo::Yolo),
}

/// Which config output gets which result.
#[derive(Debug, Clone, Default)]
struct Roles {
    /// FP32 outputs, in config order.
    floats: Vec<String>,
    /// Integer outputs: (name, INT64 or INT32).
    ints: Vec<(String, DataType)>,
    bytes: Vec<String>,
}

struct PostInstance {
    op: Op,
    roles: Roles,
}

const KEYS: &[&str] = &[
    "operation",
    "axis",
    "k",
    "activation",
    "labels",
    "pooling",
    "normalize",
    "layout",
    "confidence",
    "iou",
    "max_detections",
    "class_aware",
];

fn roles(config: &ModelConfig) -> Result<Roles> {
    let mut r = Roles::default();
    for o in &config.output {
        match DataType::from_config(o.data_type) {
            Some(DataType::Fp32) => r.floats.push(o.name.clone()),
            Some(t @ (DataType::Int64 | DataType::Int32)) => r.ints.push((o.name.clone(), t)),
            Some(DataType::Bytes) => r.bytes.push(o.name.clone()),
            _ => {
                return Err(Error::invalid(format!(
                    "model '{}': output '{}' must be TYPE_FP32, TYPE_INT64, TYPE_INT32 or TYPE_STRING",
                    config.name, o.name
                )));
            }
        }
    }
    Ok(r)
}

fn operation(config: &ModelConfig, folder: &Path) -> Result<Op> {
    let p = Params::new(config);
    p.only(KEYS)?;
    let activation = |p: &Params<'_>| {
        p.choice(
            "activation",
            Activation::None,
            &[("none", Activation::None), ("softmax", Activation::Softmax), ("sigmoid", Activation::Sigmoid)],
        )
    };
    let names = ["softmax", "sigmoid", "argmax", "topk", "pool", "yolo"];
    let Some(op) = p.text("operation") else {
        return Err(Error::invalid(format!(
            "model '{}': parameter 'operation' is required (one of: {})",
            config.name,
            names.join(", ")
        )));
    };
    Ok(match op.to_ascii_lowercase().as_str() {
        "softmax" => Op::Activate(Activation::Softmax, p.number("axis", -1i64, -8..=7)?),
        "sigmoid" => Op::Activate(Activation::Sigmoid, 0),
        "argmax" => Op::Argmax,
        "topk" => {
            let labels = match p.text("labels") {
                Some(file) => {
                    let data = crate::names::read_inside(folder, file, 64 << 20)
                        .map_err(|e| Error::invalid(format!("model '{}': parameter 'labels' {e}", config.name)))?;
                    let text = String::from_utf8(data).map_err(|_| {
                        Error::invalid(format!("model '{}': labels file '{file}' is not UTF-8", config.name))
                    })?;
                    Some(Arc::new(text.lines().map(str::to_string).collect()))
                }
                None => None,
            };
            Op::TopK { k: p.number("k", 5usize, 1..=65536)?, activation: activation(&p)?, labels }
        }
        "pool" => Op::Pool {
            pooling: p.choice("pooling", Pooling::Mean, &[("mean", Pooling::Mean), ("cls", Pooling::Cls)])?,
            normalize: p.flag("normalize", true)?,
        },
        "yolo" => Op::Yolo(yolo::Yolo::from_params(&p)?),
        other => {
            return Err(Error::invalid(format!(
                "model '{}': parameter 'operation' is '{other}'; expected one of: {}",
                config.name,
                names.join(", ")
            )));
        }
    })
}

impl Backend for PostBackend {
    fn name(&self) -> &'static str {
        "ferry_postprocess"
    }

    fn model_io(&self, _model_path: &Path) -> Result<ModelIo> {
        Ok(ModelIo::default())
    }

    fn load(&self, spec: &InstanceSpec<'_>) -> Result<Box<dyn ModelInstance>> {
        // Files the parameters name (labels) are read from the model's folder.
        let folder = spec.model_path.parent().and_then(Path::parent).unwrap_or(spec.model_path);
        let mut op = operation(spec.config, folder)?;
        let roles = roles(spec.config)?;
        let need = |ok: bool, what: &str| {
            if ok { Ok(()) } else { Err(Error::invalid(format!("model '{}': {what}", spec.config.name))) }
        };
        match &mut op {
            Op::Activate(..) | Op::Pool { .. } => need(roles.floats.len() == 1, "expects one TYPE_FP32 output")?,
            Op::Argmax => need(roles.ints.len() == 1, "argmax expects one TYPE_INT64 or TYPE_INT32 output")?,
            Op::TopK { labels, .. } => need(
                roles.floats.len() <= 1
                    && roles.ints.len() <= 1
                    && roles.bytes.len() <= 1
                    && (labels.is_some() || roles.bytes.is_empty()),
                "topk has at most one output of each kind (FP32 scores, INT64/INT32 indices, TYPE_STRING labels, \
                 which needs the 'labels' parameter)",
            )?,
            Op::Yolo(y) => {
                yolo::check_roles(&roles.floats, &roles.ints, spec.config)?;
                y.bind(spec.config, &roles.floats);
            }
        }
        Ok(Box::new(PostInstance { op, roles }))
    }
}

fn last_dim(input: &BackendInput<'_>) -> Result<usize> {
    match input.shape.last() {
        Some(&d) if d > 0 => Ok(d as usize),
        _ => Err(Error::invalid(format!("input '{}' needs a last dimension of at least 1", input.name))),
    }
}

fn softmax_in_place(row: &mut [f32]) {
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0.0;
    for v in row.iter_mut() {
        *v = (*v - max).exp();
        sum += *v;
    }
    for v in row.iter_mut() {
        *v /= sum;
    }
}

fn sigmoid(v: f32) -> f32 {
    1.0 / (1.0 + (-v).exp())
}

/// Softmax along `axis` of a tensor of `shape`.
fn softmax_axis(values: &mut [f32], shape: &[i64], axis: i64) -> Result<()> {
    let rank = shape.len() as i64;
    let a = if axis < 0 { axis + rank } else { axis };
    if !(0..rank).contains(&a) {
        return Err(Error::invalid(format!("softmax axis {axis} is outside a tensor of rank {rank}")));
    }
    let a = a as usize;
    let (outer, n) = (shape[..a].iter().product::<i64>() as usize, shape[a] as usize);
    let inner = shape[a + 1..].iter().product::<i64>() as usize;
    let mut line = vec![0f32; n];
    for o in 0..outer {
        for i in 0..inner {
            let at = |j: usize| (o * n + j) * inner + i;
            for (j, slot) in line.iter_mut().enumerate() {
                *slot = values[at(j)];
            }
            softmax_in_place(&mut line);
            for (j, v) in line.iter().enumerate() {
                values[at(j)] = *v;
            }
        }
    }
    Ok(())
}

impl PostInstance {
    fn run(&self, inputs: &[BackendInput<'_>], wanted: &[&str]) -> Result<Vec<Tensor>> {
        let Some(first) = inputs.first() else { return Err(Error::invalid("no input")) };
        let out: Vec<Tensor> = match &self.op {
            Op::Activate(kind, axis) => {
                let mut v = floats(first)?;
                match kind {
                    Activation::Sigmoid => v.iter_mut().for_each(|x| *x = sigmoid(*x)),
                    _ => softmax_axis(&mut v, first.shape, *axis)?,
                }
                vec![f32_tensor(&self.roles.floats[0], first.shape.to_vec(), &v)]
            }
            Op::Argmax => {
                let (v, c) = (floats(first)?, last_dim(first)?);
                let best: Vec<i64> = v.chunks_exact(c).map(|row| argmax(row) as i64).collect();
                let (name, t) = &self.roles.ints[0];
                vec![int_tensor(name, *t, first.shape[..first.shape.len() - 1].to_vec(), &best)]
            }
            Op::TopK { k, activation, labels } => self.topk(first, *k, *activation, labels.as_deref())?,
            Op::Pool { pooling, normalize } => {
                vec![pool(first, inputs.get(1), *pooling, *normalize, &self.roles.floats[0])?]
            }
            Op::Yolo(y) => y.run(inputs, &self.roles.floats, &self.roles.ints)?,
        };
        in_order(out, wanted)
    }

    fn topk(
        &self,
        input: &BackendInput<'_>,
        k: usize,
        a: Activation,
        labels: Option<&Vec<String>>,
    ) -> Result<Vec<Tensor>> {
        let (mut v, c) = (floats(input)?, last_dim(input)?);
        let k = k.min(c);
        let (mut scores, mut indices) = (Vec::new(), Vec::new());
        for row in v.chunks_exact_mut(c) {
            match a {
                Activation::Softmax => softmax_in_place(row),
                Activation::Sigmoid => row.iter_mut().for_each(|x| *x = sigmoid(*x)),
                Activation::None => {}
            }
            let mut order: Vec<usize> = (0..c).collect();
            // Highest first; ties keep the lower index first (as numpy's stable argsort of -x).
            order.sort_by(|&i, &j| row[j].total_cmp(&row[i]).then(i.cmp(&j)));
            for &i in &order[..k] {
                scores.push(row[i]);
                indices.push(i as i64);
            }
        }
        let mut shape = input.shape.to_vec();
        *shape.last_mut().unwrap_or(&mut 0) = k as i64;
        let mut out = Vec::new();
        if let Some(name) = self.roles.floats.first() {
            out.push(f32_tensor(name, shape.clone(), &scores));
        }
        if let Some((name, t)) = self.roles.ints.first() {
            out.push(int_tensor(name, *t, shape.clone(), &indices));
        }
        if let (Some(name), Some(labels)) = (self.roles.bytes.first(), labels) {
            let text = indices.iter().map(|&i| labels.get(i as usize).map_or(&b""[..], |l| l.as_bytes()));
            out.push(bytes_tensor(name, shape, text));
        }
        Ok(out)
    }
}

fn argmax(row: &[f32]) -> usize {
    row.iter().enumerate().fold(0, |best, (i, v)| if *v > row[best] { i } else { best })
}

/// Mean (over the positions the mask keeps) or first-token pooling, then L2 normalisation.
fn pool(
    hidden: &BackendInput<'_>,
    mask: Option<&BackendInput<'_>>,
    pooling: Pooling,
    normalize: bool,
    name: &str,
) -> Result<Tensor> {
    let rank = hidden.shape.len();
    if rank < 2 {
        return Err(Error::invalid(format!("input '{}' must be [..., tokens, dim]", hidden.name)));
    }
    let (s, d) = (hidden.shape[rank - 2].max(0) as usize, last_dim(hidden)?);
    let v = floats(hidden)?;
    let m = match mask {
        Some(m) => {
            let m_values = as_f32(m)?;
            if m.shape != &hidden.shape[..rank - 1] {
                return Err(Error::invalid(format!(
                    "mask '{}' has shape {:?}; pooling '{}' of shape {:?} needs {:?}",
                    m.name,
                    m.shape,
                    hidden.name,
                    hidden.shape,
                    &hidden.shape[..rank - 1]
                )));
            }
            Some(m_values)
        }
        None => None,
    };
    let rows = v.len().checked_div(s * d).unwrap_or(0);
    let mut out = vec![0f32; rows * d];
    for r in 0..rows {
        let acc = &mut out[r * d..(r + 1) * d];
        match pooling {
            Pooling::Cls => acc.copy_from_slice(&v[r * s * d..r * s * d + d]),
            Pooling::Mean => {
                let mut weight = 0.0;
                for t in 0..s {
                    let w = m.as_ref().map_or(1.0, |m| m[r * s + t]);
                    if w == 0.0 {
                        continue;
                    }
                    weight += w;
                    for (a, x) in acc.iter_mut().zip(&v[(r * s + t) * d..(r * s + t + 1) * d]) {
                        *a += w * x;
                    }
                }
                // As sentence-transformers: the mask's sum, at least 1e-9.
                acc.iter_mut().for_each(|a| *a /= weight.max(1e-9));
            }
        }
        if normalize {
            let norm = acc.iter().map(|a| a * a).sum::<f32>().sqrt().max(1e-12);
            acc.iter_mut().for_each(|a| *a /= norm);
        }
    }
    let mut shape = hidden.shape[..rank - 2].to_vec();
    shape.push(d as i64);
    Ok(f32_tensor(name, shape, &out))
}

impl ModelInstance for PostInstance {
    fn runs_anywhere(&self) -> bool {
        true
    }

    fn execute(&mut self, inputs: &[BackendInput<'_>], outputs: &[&str]) -> Result<Vec<Tensor>> {
        self.run(inputs, outputs)
    }

    /// YOLO's detections differ in number per request, so its requests run one by one.
    fn separate_requests(&self) -> bool {
        matches!(self.op, Op::Yolo(_))
    }

    fn execute_each(&mut self, requests: &[BackendRequest<'_>]) -> Vec<Result<Answer>> {
        requests.iter().map(|r| self.run(&r.inputs, &r.outputs).map(Answer::from)).collect()
    }
}

#[cfg(test)]
mod tests;
