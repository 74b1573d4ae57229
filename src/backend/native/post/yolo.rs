//! `operation: "yolo"`: detections from a YOLO head (Ultralytics' export: `[4 + classes, anchors]`
//! per image, boxes as centre x, centre y, width, height), as Ultralytics' post-processing does
//! them: each anchor's best class, kept at `confidence` or above, greedy non-maximum suppression
//! at `iou` (per class when `class_aware`), at most `max_detections`. An optional second input,
//! the letterbox `[scale_x, scale_y, pad_x, pad_y]` the image step reports, maps boxes back to
//! the original image. Outputs: FP32 boxes `[n, 4]` (x1, y1, x2, y2), FP32 scores `[n]` and
//! INT64/INT32 classes `[n]`, with the request's leading batch dimension when it has one.
use super::super::{Params, f32_tensor, floats, int_tensor};
use crate::{
    backend::BackendInput,
    error::{Error, Result},
    proto::inference::ModelConfig,
    tensor::{DataType, Tensor},
};

/// Candidates kept for suppression, highest scores first (as Ultralytics' `max_nms`).
const MAX_CANDIDATES: usize = 30_000;

#[derive(Debug, Clone)]
pub struct Yolo {
    channels_first: bool,
    confidence: f32,
    iou: f32,
    max: usize,
    class_aware: bool,
    boxes: String,
    scores: String,
}

pub fn check_roles(floats: &[String], ints: &[(String, DataType)], config: &ModelConfig) -> Result<()> {
    let boxes = config.output.iter().filter(|o| o.dims.last() == Some(&4)).count();
    if floats.len() != 2 || ints.len() > 1 || boxes == 0 {
        return Err(Error::invalid(format!(
            "model '{}': yolo expects two TYPE_FP32 outputs, boxes (last dimension 4) and scores, and at most \
             one TYPE_INT64/TYPE_INT32 output for classes",
            config.name
        )));
    }
    Ok(())
}

#[derive(Debug, Clone, Copy)]
struct Detection {
    b: [f32; 4],
    score: f32,
    class: usize,
}

fn iou(a: &[f32; 4], b: &[f32; 4]) -> f32 {
    let w = (a[2].min(b[2]) - a[0].max(b[0])).max(0.0);
    let h = (a[3].min(b[3]) - a[1].max(b[1])).max(0.0);
    let inter = w * h;
    let area = |r: &[f32; 4]| (r[2] - r[0]).max(0.0) * (r[3] - r[1]).max(0.0);
    let union = area(a) + area(b) - inter;
    if union <= 0.0 { 0.0 } else { inter / union }
}

impl Yolo {
    pub fn from_params(p: &Params<'_>) -> Result<Yolo> {
        Ok(Yolo {
            channels_first: p.choice("layout", true, &[("channels_first", true), ("channels_last", false)])?,
            confidence: p.number("confidence", 0.25f32, 0.0..=1.0)?,
            iou: p.number("iou", 0.45f32, 0.0..=1.0)?,
            max: p.number("max_detections", 300usize, 1..=100_000)?,
            class_aware: p.flag("class_aware", true)?,
            boxes: String::new(),
            scores: String::new(),
        })
    }

    /// Names the outputs: boxes are the FP32 output whose last dimension is 4.
    pub fn bind(&mut self, config: &ModelConfig, floats: &[String]) {
        let is_boxes = |n: &String| config.output.iter().any(|o| &o.name == n && o.dims.last() == Some(&4));
        self.boxes = floats.iter().find(|n| is_boxes(n)).cloned().unwrap_or_default();
        self.scores = floats.iter().find(|n| !is_boxes(n)).cloned().unwrap_or_default();
    }

    fn detect(&self, v: &[f32], channels: usize, anchors: usize) -> Vec<Detection> {
        let at = |c: usize, a: usize| if self.channels_first { v[c * anchors + a] } else { v[a * channels + c] };
        let mut found: Vec<Detection> = (0..anchors)
            .filter_map(|a| {
                let (class, score) = (4..channels)
                    .map(|c| (c - 4, at(c, a)))
                    .fold((0, f32::NEG_INFINITY), |best, x| if x.1 > best.1 { x } else { best });
                // NaN scores are dropped too.
                if score.is_nan() || score < self.confidence {
                    return None;
                }
                let (cx, cy, w, h) = (at(0, a), at(1, a), at(2, a), at(3, a));
                Some(Detection { b: [cx - w / 2.0, cy - h / 2.0, cx + w / 2.0, cy + h / 2.0], score, class })
            })
            .collect();
        found.sort_by(|x, y| y.score.total_cmp(&x.score));
        found.truncate(MAX_CANDIDATES);
        let mut kept: Vec<Detection> = Vec::new();
        for d in found {
            if kept.len() == self.max {
                break;
            }
            let overlaps = kept.iter().any(|k| (!self.class_aware || k.class == d.class) && iou(&k.b, &d.b) > self.iou);
            if !overlaps {
                kept.push(d);
            }
        }
        kept
    }

    pub fn run(
        &self,
        inputs: &[BackendInput<'_>],
        _floats: &[String],
        ints: &[(String, DataType)],
    ) -> Result<Vec<Tensor>> {
        let p = &inputs[0];
        let rank = p.shape.len();
        let lead = &p.shape[..rank.saturating_sub(2)];
        if rank < 2 || lead.iter().product::<i64>() != 1 {
            return Err(Error::invalid(format!(
                "input '{}' must hold one image's predictions, [4 + classes, anchors] (or [1, ...]); got {:?}",
                p.name, p.shape
            )));
        }
        let (d0, d1) = (p.shape[rank - 2].max(0) as usize, p.shape[rank - 1].max(0) as usize);
        let (channels, anchors) = if self.channels_first { (d0, d1) } else { (d1, d0) };
        if channels < 5 {
            return Err(Error::invalid(format!(
                "input '{}' has {channels} values per anchor; a YOLO head has 4 box values and at least one class \
                 (is 'layout' right?)",
                p.name
            )));
        }
        let mut kept = self.detect(&floats(p)?, channels, anchors);
        if let Some(letterbox) = inputs.get(1) {
            let l = floats(letterbox)?;
            let [sx, sy, px, py] = l[..] else {
                return Err(Error::invalid(format!(
                    "input '{}' must be the letterbox [scale_x, scale_y, pad_x, pad_y]",
                    letterbox.name
                )));
            };
            for d in &mut kept {
                d.b = [(d.b[0] - px) / sx, (d.b[1] - py) / sy, (d.b[2] - px) / sx, (d.b[3] - py) / sy];
            }
        }
        let n = kept.len() as i64;
        let shape = |tail: &[i64]| lead.iter().chain(tail).copied().collect::<Vec<i64>>();
        let boxes: Vec<f32> = kept.iter().flat_map(|d| d.b).collect();
        let scores: Vec<f32> = kept.iter().map(|d| d.score).collect();
        let mut out =
            vec![f32_tensor(&self.boxes, shape(&[n, 4]), &boxes), f32_tensor(&self.scores, shape(&[n]), &scores)];
        if let Some((name, t)) = ints.first() {
            let classes: Vec<i64> = kept.iter().map(|d| d.class as i64).collect();
            out.push(int_tensor(name, *t, shape(&[n]), &classes));
        }
        Ok(out)
    }
}
