//! `backend: "ferry_image"`: encoded images (BYTES: raw, or base64 text; `encoding` auto (the
//! default: raw when the bytes start like an image, else base64), raw or base64;
//! JPEG, PNG, WebP, BMP, GIF's first frame; EXIF orientation applied) to the tensor a vision model
//! takes. Steps, each a parameter, with `preset` (`clip`, `imagenet`, `yolo`) setting them all:
//! `color` rgb|bgr|gray; `resize` none|exact|shortest|longest|letterbox with `size` (`N` or
//! `W,H`), `filter` nearest|bilinear|bicubic|lanczos and `antialias` (PIL's convolution, or a
//! fixed kernel as OpenCV); `crop` (`N` or `W,H`, centred; `crop_offset` floor|round);
//! `pad_value` (letterbox); `scale`, `mean`, `std` (per channel); `layout` nchw|nhwc; the output's
//! datatype (FP32, FP16, or UINT8 for raw pixels). A second FP32 output of `dims: [ 4 ]` gets
//! `[scale_x, scale_y, pad_x, pad_y]` (x' = x * scale + pad), to map boxes back. `max_pixels`
//! (50 million) bounds what one image may decode to, what a resize may make of it (its output,
//! its intermediate rows, and 16 multiply-adds per pixel of the limit), and the configured
//! `size` and `crop`; `max_aspect_ratio` (100) refuses images too long and thin to resize.
//! Each request runs on its own: a corrupt or refused image fails only its request.
use std::path::Path;

use base64::Engine as _;
use half::f16;

use super::{Params, f32_tensor, in_order};
use crate::{
    backend::{Answer, Backend, BackendInput, BackendRequest, InstanceSpec, ModelInstance, ModelIo},
    error::{Error, Result},
    request::Context,
    tensor::{DataType, Tensor, bytes_elements},
};

mod ops;
use ops::{Color, Filter, Pixels, Resample};

pub struct ImageBackend;

const KEYS: &[&str] = &[
    "preset",
    "encoding",
    "color",
    "resize",
    "size",
    "filter",
    "antialias",
    "crop",
    "crop_offset",
    "pad_value",
    "scale",
    "mean",
    "std",
    "layout",
    "max_pixels",
    "max_aspect_ratio",
];

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Resize {
    None,
    Exact,
    Shortest,
    Longest,
    Letterbox,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Encoding {
    Auto,
    Raw,
    Base64,
}

#[derive(Debug, Clone)]
struct Steps {
    encoding: Encoding,
    color: Color,
    resize: Resize,
    size: (u32, u32),
    filter: Filter,
    antialias: bool,
    crop: Option<(u32, u32)>,
    crop_round: bool,
    pad: u8,
    scale: f32,
    mean: Vec<f32>,
    std: Vec<f32>,
    nchw: bool,
    max_pixels: u64,
    max_aspect: u32,
}

struct ImageInstance {
    steps: Steps,
    /// The image output and its datatype; the letterbox output, if any.
    output: (String, DataType),
    mapping: Option<String>,
    one_per_row: bool,
    /// Each channel's 256 output elements (scaled and normalised, in the output's datatype and
    /// byte order), computed once: 256 x the element size bytes per channel.
    values: Vec<Vec<u8>>,
    /// Images (or requests) of one batch decoded at once.
    threads: usize,
}

fn preset(name: &str) -> Steps {
    let base = Steps {
        encoding: Encoding::Auto,
        color: Color::Rgb,
        resize: Resize::None,
        size: (0, 0),
        filter: Filter::Bilinear,
        antialias: true,
        crop: None,
        crop_round: false,
        pad: 114,
        scale: 1.0 / 255.0,
        mean: vec![0.0],
        std: vec![1.0],
        nchw: true,
        max_pixels: 50_000_000,
        max_aspect: 100,
    };
    match name {
        // Hugging Face's CLIPImageProcessor.
        "clip" => Steps {
            resize: Resize::Shortest,
            size: (224, 224),
            filter: Filter::Bicubic,
            crop: Some((224, 224)),
            mean: vec![0.481_454_66, 0.457_827_5, 0.408_210_73],
            std: vec![0.268_629_54, 0.261_302_6, 0.275_777_1],
            ..base
        },
        // torchvision's Resize(256), CenterCrop(224), Normalize(ImageNet).
        "imagenet" => Steps {
            resize: Resize::Shortest,
            size: (256, 256),
            crop: Some((224, 224)),
            crop_round: true,
            mean: vec![0.485, 0.456, 0.406],
            std: vec![0.229, 0.224, 0.225],
            ..base
        },
        // Ultralytics' LetterBox(640) with cv2.INTER_LINEAR, then /255.
        "yolo" => Steps { resize: Resize::Letterbox, size: (640, 640), antialias: false, ..base },
        _ => base,
    }
}

/// `N` (a square) or `W,H`.
fn dims2(p: &Params<'_>, key: &str) -> Result<Option<(u32, u32)>> {
    let Some(text) = p.text(key) else { return Ok(None) };
    let parts: Vec<std::result::Result<u32, _>> = text.split(',').map(|s| s.trim().parse::<u32>()).collect();
    match parts[..] {
        [Ok(n)] if (1..=16384).contains(&n) => Ok(Some((n, n))),
        [Ok(w), Ok(h)] if (1..=16384).contains(&w) && (1..=16384).contains(&h) => Ok(Some((w, h))),
        _ => Err(p.fail(key, text, "expected N or W,H (pixels, 1 to 16384)")),
    }
}

fn channels(p: &Params<'_>, key: &str, default: &[f32], n: usize) -> Result<Vec<f32>> {
    let Some(text) = p.text(key) else {
        return Ok(if default.len() == n { default.to_vec() } else { vec![default[0]; n] });
    };
    let values: std::result::Result<Vec<f32>, _> = text.split(',').map(|s| s.trim().parse::<f32>()).collect();
    match values {
        Ok(v) if v.len() == n || v.len() == 1 => Ok(if v.len() == n { v } else { vec![v[0]; n] }),
        _ => Err(p.fail(key, text, format!("expected 1 or {n} numbers, comma-separated"))),
    }
}

fn steps(p: &Params<'_>) -> Result<Steps> {
    p.only(KEYS)?;
    let name =
        p.choice("preset", "none", &[("none", "none"), ("clip", "clip"), ("imagenet", "imagenet"), ("yolo", "yolo")])?;
    let d = preset(name);
    let color = p.choice("color", d.color, &[("rgb", Color::Rgb), ("bgr", Color::Bgr), ("gray", Color::Gray)])?;
    let n = color.channels();
    let resize = p.choice(
        "resize",
        d.resize,
        &[
            ("none", Resize::None),
            ("exact", Resize::Exact),
            ("shortest", Resize::Shortest),
            ("longest", Resize::Longest),
            ("letterbox", Resize::Letterbox),
        ],
    )?;
    let size = dims2(p, "size")?.unwrap_or(d.size);
    if resize != Resize::None && size.0 == 0 {
        return Err(p.fail("resize", p.text("resize").unwrap_or_default(), "it needs 'size'"));
    }
    let std = channels(p, "std", &d.std, n)?;
    if std.contains(&0.0) {
        return Err(p.fail("std", p.text("std").unwrap_or_default(), "a standard deviation cannot be 0"));
    }
    let max_pixels = p.number("max_pixels", d.max_pixels, 1..=1_000_000_000)?;
    let crop = dims2(p, "crop")?.or(d.crop);
    // Every image comes out this size (exact, letterbox, crop): it must fit the pixel limit too.
    let fixed = [("size", (resize == Resize::Exact || resize == Resize::Letterbox).then_some(size)), ("crop", crop)];
    for (key, dims) in fixed {
        if let Some((w, h)) = dims
            && u64::from(w) * u64::from(h) > max_pixels
        {
            return Err(p.fail(
                key,
                &format!("{w},{h}"),
                format!("at most {max_pixels} pixels (parameter 'max_pixels')"),
            ));
        }
    }
    Ok(Steps {
        encoding: p.choice(
            "encoding",
            d.encoding,
            &[("auto", Encoding::Auto), ("raw", Encoding::Raw), ("base64", Encoding::Base64)],
        )?,
        color,
        resize,
        size,
        filter: p.choice(
            "filter",
            d.filter,
            &[
                ("nearest", Filter::Nearest),
                ("bilinear", Filter::Bilinear),
                ("bicubic", Filter::Bicubic),
                ("lanczos", Filter::Lanczos),
            ],
        )?,
        antialias: p.flag("antialias", d.antialias)?,
        crop,
        crop_round: p.choice("crop_offset", d.crop_round, &[("floor", false), ("round", true)])?,
        pad: p.number("pad_value", d.pad, 0..=255)?,
        scale: p.number("scale", d.scale, f32::MIN..=f32::MAX)?,
        mean: channels(p, "mean", &d.mean, n)?,
        std,
        nchw: p.choice("layout", d.nchw, &[("nchw", true), ("nhwc", false)])?,
        max_pixels,
        max_aspect: p.number("max_aspect_ratio", d.max_aspect, 1..=10_000)?,
    })
}

impl Backend for ImageBackend {
    fn name(&self) -> &'static str {
        "ferry_image"
    }

    fn model_io(&self, _model_path: &Path) -> Result<ModelIo> {
        Ok(ModelIo::default())
    }

    fn load(&self, spec: &InstanceSpec<'_>) -> Result<Box<dyn ModelInstance>> {
        let c = spec.config;
        let steps = steps(&Params::new(c))?;
        let kinds: Vec<(String, Option<DataType>, &Vec<i64>)> =
            c.output.iter().map(|o| (o.name.clone(), DataType::from_config(o.data_type), &o.dims)).collect();
        let image = kinds
            .iter()
            .find(|(_, t, d)| matches!(t, Some(DataType::Fp32 | DataType::Fp16 | DataType::Uint8)) && d.len() >= 3);
        let Some((name, Some(t), _)) = image else {
            return Err(Error::invalid(format!(
                "model '{}': needs an image output of TYPE_FP32, TYPE_FP16 or TYPE_UINT8 with 3 dims (CHW or HWC)",
                c.name
            )));
        };
        let mapping = kinds
            .iter()
            .find(|(n, t, d)| n != name && *t == Some(DataType::Fp32) && d.last() == Some(&4))
            .map(|(n, ..)| n.clone());
        let one_per_row = c.input.first().is_some_and(|i| i.dims.last() == Some(&1));
        // The same arithmetic as per pixel, (v * scale - mean) / std, done once per value.
        let values = (0..steps.color.channels())
            .map(|ch| {
                (0..256)
                    .flat_map(|v| {
                        let x = (v as f32 * steps.scale - steps.mean[ch]) / steps.std[ch];
                        match *t {
                            DataType::Uint8 => vec![v as u8],
                            DataType::Fp16 => f16::from_f32(x).to_le_bytes().to_vec(),
                            _ => x.to_le_bytes().to_vec(),
                        }
                    })
                    .collect()
            })
            .collect();
        Ok(Box::new(ImageInstance {
            steps,
            output: (name.clone(), *t),
            mapping,
            one_per_row,
            values,
            threads: spec.intra_op_threads.max(1),
        }))
    }
}

/// One image made ready: its tensor bytes, box mapping, and size (width, height, channels).
struct Prepared {
    bytes: Vec<u8>,
    map: [f32; 4],
    size: (u32, u32, usize),
}

impl ImageInstance {
    /// One image, to its pixels after every step, and the box mapping. `before` is told what
    /// decoding it will take, from its header.
    fn pixels(&self, encoded: &[u8], before: ops::Before<'_>) -> std::result::Result<(Pixels, [f32; 4]), String> {
        let s = &self.steps;
        let decoded;
        let base64 = match s.encoding {
            Encoding::Base64 => true,
            Encoding::Raw => false,
            // JSON clients can only send text: an image that does not start like one is base64.
            Encoding::Auto => !matches!(
                image::guess_format(encoded),
                Ok(image::ImageFormat::Jpeg
                    | image::ImageFormat::Png
                    | image::ImageFormat::WebP
                    | image::ImageFormat::Bmp
                    | image::ImageFormat::Gif)
            ),
        };
        let bytes = if base64 {
            // Line breaks are allowed in base64 text; most clients send none, and then nothing is copied.
            let text: std::borrow::Cow<'_, [u8]> = if encoded.iter().any(u8::is_ascii_whitespace) {
                encoded.iter().copied().filter(|b| !b.is_ascii_whitespace()).collect::<Vec<u8>>().into()
            } else {
                encoded.into()
            };
            decoded = base64::engine::general_purpose::STANDARD.decode(text).map_err(|e| match s.encoding {
                Encoding::Auto => {
                    "not an image in a format ferry decodes (JPEG, PNG, WebP, BMP, GIF), raw or base64".into()
                }
                _ => format!("not base64: {e}"),
            })?;
            &decoded[..]
        } else {
            encoded
        };
        let p = ops::decode(bytes, s.color, s.max_pixels, before)?;
        let (w, h) = (p.width, p.height);
        let how = Resample { filter: s.filter, antialias: s.antialias, max_pixels: s.max_pixels };
        if s.resize != Resize::None && u64::from(w.max(h)) > u64::from(w.min(h)) * u64::from(s.max_aspect) {
            return Err(format!(
                "the image is {w}x{h} pixels, too long and thin to resize: its sides may differ by a factor of at \
                 most {} (parameter 'max_aspect_ratio')",
                s.max_aspect
            ));
        }
        let (mut p, mut map) = match s.resize {
            Resize::None => (p, [1.0, 1.0, 0.0, 0.0]),
            Resize::Letterbox => ops::letterbox(&p, s.size, s.pad, how)?,
            r => {
                let (nw, nh) = match r {
                    Resize::Exact => s.size,
                    _ => ops::side_size(w, h, s.size.0, r == Resize::Longest),
                };
                if u64::from(nw) * u64::from(nh) > s.max_pixels {
                    return Err(format!(
                        "the image is {w}x{h} pixels, which resizes to {nw}x{nh}, over the limit of {} pixels \
                         (parameter 'max_pixels')",
                        s.max_pixels
                    ));
                }
                let map = [nw as f32 / w as f32, nh as f32 / h as f32, 0.0, 0.0];
                match s.crop {
                    // A crop inside the resized image: only its pixels are resampled.
                    Some((cw, ch)) if cw <= nw && ch <= nh && s.filter != ops::Filter::Nearest => {
                        let left = ops::crop_offset(nw, cw, s.crop_round);
                        let top = ops::crop_offset(nh, ch, s.crop_round);
                        let (x0, y0) = (left as usize, top as usize);
                        let window = (x0..x0 + cw as usize, y0..y0 + ch as usize);
                        let p = ops::resize_window(&p, (nw, nh), how, window)?;
                        return Ok((p, [map[0], map[1], -(left as f32), -(top as f32)]));
                    }
                    _ => (ops::resize(&p, (nw, nh), how)?, map),
                }
            }
        };
        if let Some((cw, ch)) = s.crop {
            let (cropped, (left, top)) = ops::center_crop(&p, cw, ch, s.crop_round);
            p = cropped;
            map[2] -= left as f32;
            map[3] -= top as f32;
        }
        Ok((p, map))
    }

    /// Pixels to the output tensor's bytes: CHW or HWC; scaled and normalised unless UINT8.
    fn tensor_bytes(&self, p: &Pixels, out: &mut Vec<u8>) {
        let size = self.values[0].len() / 256;
        let start = out.len();
        out.resize(start + p.data.len() * size, 0);
        let dst = &mut out[start..];
        match size {
            1 => elements::<1>(&self.values, p, self.steps.nchw, dst),
            2 => elements::<2>(&self.values, p, self.steps.nchw, dst),
            _ => elements::<4>(&self.values, p, self.steps.nchw, dst),
        }
    }

    /// One image, to its tensor bytes (charged to the request first), box mapping and size.
    fn one(&self, encoded: &[u8], ctx: &Context) -> Result<Prepared> {
        // What decoding takes is held against the request's ticket while the image is worked on;
        // a refusal is the admission error (503), not a bad image.
        let (mut working, mut refused) = (ctx.hold(0)?, None);
        let outcome = self.pixels(encoded, &mut |n| {
            working.grow(n).map_err(|e| {
                let why = e.message().to_string();
                refused = Some(e);
                why
            })
        });
        let (p, map) = outcome.map_err(|e| refused.take().unwrap_or_else(|| Error::invalid(e)))?;
        ctx.charge((p.data.len() * (self.values[0].len() / 256)) as u64)?;
        let mut bytes = Vec::new();
        self.tensor_bytes(&p, &mut bytes);
        Ok(Prepared { bytes, map, size: (p.width, p.height, p.channels) })
    }

    fn run(
        &self,
        inputs: &[BackendInput<'_>],
        wanted: &[&str],
        (threads, ctx): (usize, &Context),
    ) -> Result<Vec<Tensor>> {
        let input = inputs.first().ok_or_else(|| Error::invalid("no image input"))?;
        if input.datatype != DataType::Bytes {
            return Err(Error::invalid(format!("input '{}' must be BYTES, got {}", input.name, input.datatype.wire())));
        }
        let items = bytes_elements(input.data).collect::<Result<Vec<&[u8]>>>()?;
        let done = super::par_map(&items, threads, |item| self.one(item, ctx));
        let (mut data, mut maps, mut size) = (Vec::new(), Vec::new(), None);
        for (k, result) in done.into_iter().enumerate() {
            let Prepared { bytes, map, size: got } =
                result.map_err(|e| e.context(format!("input '{}', image {k}", input.name)))?;
            match size {
                None => size = Some(got),
                Some(first) if first != got => {
                    return Err(Error::invalid(format!(
                        "input '{}': image {k} comes out {}x{} and image 0 {}x{}; images of one request must come out \
                         the same size (resize exactly, crop or letterbox)",
                        input.name, got.0, got.1, first.0, first.1
                    )));
                }
                _ => {}
            }
            // One image (the common request) hands its bytes over without a copy.
            if data.is_empty() {
                data = bytes;
            } else {
                data.extend_from_slice(&bytes);
            }
            maps.extend_from_slice(&map);
        }
        let (w, h, c) = size.unwrap_or((0, 0, self.steps.color.channels()));
        let mut lead = input.shape.to_vec();
        if self.one_per_row && lead.last() == Some(&1) {
            lead.pop();
        }
        let tail = if self.steps.nchw { [c as i64, h as i64, w as i64] } else { [h as i64, w as i64, c as i64] };
        let (name, t) = &self.output;
        let mut out = vec![Tensor {
            name: name.clone(),
            datatype: *t,
            shape: lead.iter().chain(&tail).copied().collect(),
            data: data.into(),
        }];
        if let Some(m) = &self.mapping {
            out.push(f32_tensor(m, lead.iter().copied().chain([4]).collect(), &maps));
        }
        in_order(out, wanted)
    }
}

impl ModelInstance for ImageInstance {
    fn runs_anywhere(&self) -> bool {
        true
    }

    fn execute(&mut self, inputs: &[BackendInput<'_>], outputs: &[&str]) -> Result<Vec<Tensor>> {
        self.run(inputs, outputs, (self.threads, &Context::default()))
    }

    fn separate_requests(&self) -> bool {
        true
    }

    fn execute_each(&mut self, requests: &[BackendRequest<'_>]) -> Vec<Result<Answer>> {
        // The requests of a batch on the instance's threads; one request spreads its own images.
        match requests {
            [one] => vec![self.run(&one.inputs, &one.outputs, (self.threads, one.context)).map(Answer::from)],
            _ => super::par_map(requests, self.threads, |r| {
                self.run(&r.inputs, &r.outputs, (1, r.context)).map(Answer::from)
            }),
        }
    }
}

/// Each pixel's channels to their `S`-byte elements (looked up in `values`, one table of 256 per
/// channel), planar (NCHW: one channel after the other, written in order) or interleaved.
fn elements<const S: usize>(values: &[Vec<u8>], p: &Pixels, nchw: bool, dst: &mut [u8]) {
    let c = p.channels.max(1);
    let element = |ch: usize, v: u8| -> [u8; S] {
        let at = usize::from(v) * S;
        values[ch][at..at + S].try_into().expect("S bytes")
    };
    if nchw {
        let plane = p.data.len() / c * S;
        for (ch, out) in dst.chunks_exact_mut(plane.max(1)).enumerate().take(c) {
            for (d, px) in out.chunks_exact_mut(S).zip(p.data.chunks_exact(c)) {
                d.copy_from_slice(&element(ch, px[ch]));
            }
        }
    } else {
        for (i, (d, &v)) in dst.chunks_exact_mut(S).zip(&p.data).enumerate() {
            d.copy_from_slice(&element(i % c, v));
        }
    }
}
