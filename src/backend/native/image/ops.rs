//! The image steps, each on 8-bit pixels as PIL works: decode (EXIF orientation applied, a pixel
//! limit checked before any pixel is decoded), colour, resize, centre crop, letterbox, then the
//! tensor (rescale, normalise, layout, datatype).
use std::{io::Cursor, ops::Range};

use image::{DynamicImage, ImageDecoder, ImageReader, Limits};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Color {
    Rgb,
    Bgr,
    Gray,
}

impl Color {
    pub fn channels(self) -> usize {
        if self == Color::Gray { 1 } else { 3 }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Filter {
    Nearest,
    Bilinear,
    Bicubic,
    Lanczos,
}

/// 8-bit pixels, `channels` per pixel, row by row.
#[derive(Debug, Clone, PartialEq)]
pub struct Pixels {
    pub width: u32,
    pub height: u32,
    pub channels: usize,
    pub data: Vec<u8>,
}

/// Whether a JPEG's last scan is followed by its end-of-image marker (FF D9 cannot occur inside
/// entropy-coded data), so a cut-off upload is refused rather than decoded half grey. Searched
/// from where the markers usually are (the last end of image at the very end, a scan near the
/// start), not across the whole entropy-coded data: no start of scan after the last end of image,
/// and one before it.
fn jpeg_complete(bytes: &[u8]) -> bool {
    let marker = |m: u8| move |w: &[u8]| w == [0xFF, m];
    let Some(end) = bytes.windows(2).rposition(marker(0xD9)) else { return false };
    !bytes[end..].windows(2).any(marker(0xDA)) && bytes[..end].windows(2).any(marker(0xDA))
}

/// What decoding may cost, told to the caller from the header before any pixel is decoded (the
/// bytes the decoder and the conversions to 8-bit RGB will hold); an error stops the decode.
pub type Before<'a> = &'a mut dyn FnMut(u64) -> Result<(), String>;

/// Decodes an encoded image into RGB or gray pixels. `max_pixels` is checked on the header.
pub fn decode(bytes: &[u8], color: Color, max_pixels: u64, before: Before<'_>) -> Result<Pixels, String> {
    let rgb = super::super::contain_panic("image", || decode_rgb(bytes, max_pixels, before))?;
    let (width, height) = rgb.dimensions();
    let mut data = rgb.into_raw();
    match color {
        Color::Rgb => {}
        Color::Bgr => data.chunks_exact_mut(3).for_each(|p| p.swap(0, 2)),
        // PIL's "L": ITU-R 601-2 luma, in 16-bit fixed point.
        Color::Gray => {
            data = data
                .chunks_exact(3)
                .map(|p| {
                    ((u32::from(p[0]) * 19595 + u32::from(p[1]) * 38470 + u32::from(p[2]) * 7471 + 0x8000) >> 16) as u8
                })
                .collect();
        }
    }
    Ok(Pixels { width, height, channels: color.channels(), data })
}

/// The image crate's part (third-party code on untrusted bytes): the format, the pixel limit
/// read from the header, the EXIF orientation, RGB pixels.
fn decode_rgb(bytes: &[u8], max_pixels: u64, before: Before<'_>) -> Result<image::RgbImage, String> {
    let reader = ImageReader::new(Cursor::new(bytes))
        .with_guessed_format()
        .map_err(|e| format!("cannot read the image: {e}"))?;
    match reader.format() {
        None => return Err("not an image in a format ferry decodes (JPEG, PNG, WebP, BMP, GIF)".into()),
        Some(image::ImageFormat::Jpeg) if !jpeg_complete(bytes) => {
            return Err("cannot decode the image: the JPEG is truncated (no end of image after its scan)".into());
        }
        _ => {}
    }
    let mut reader = reader;
    let mut limits = Limits::default();
    limits.max_alloc = Some((max_pixels.saturating_mul(8)).max(64 << 20));
    reader.limits(limits);
    let mut decoder = reader.into_decoder().map_err(|e| format!("cannot decode the image: {e}"))?;
    let (w, h) = decoder.dimensions();
    if u64::from(w) * u64::from(h) > max_pixels {
        return Err(format!("the image is {w}x{h} pixels, over the limit of {max_pixels} (parameter 'max_pixels')"));
    }
    // The decoded samples, the 8-bit RGB copy, and what one more copy (a rotation, a colour
    // conversion) takes.
    let pixels = u64::from(w) * u64::from(h);
    before(pixels * (decoder.color_type().bytes_per_pixel() as u64 + 6))?;
    let orientation = decoder.orientation().map_err(|e| format!("cannot read the image's orientation: {e}"))?;
    let mut img = DynamicImage::from_decoder(decoder).map_err(|e| format!("cannot decode the image: {e}"))?;
    img.apply_orientation(orientation);
    Ok(rgb8(img))
}

/// 8-bit RGB as PIL's `convert("RGB")` gives it. 16-bit samples keep their high byte, as PIL reads
/// 16-bit colour and gray-with-alpha PNGs (the image crate would round v/257, one level off at
/// times). Plain 16-bit gray too, where PIL (its "I;16" mode) clips every value over 255 to white
/// instead: ferry keeps the image.
fn rgb8(img: DynamicImage) -> image::RgbImage {
    let (w, h) = (img.width(), img.height());
    let (samples, channels): (&[u16], usize) = match &img {
        DynamicImage::ImageLuma16(i) => (i.as_raw(), 1),
        DynamicImage::ImageLumaA16(i) => (i.as_raw(), 2),
        DynamicImage::ImageRgb16(i) => (i.as_raw(), 3),
        DynamicImage::ImageRgba16(i) => (i.as_raw(), 4),
        _ => return img.into_rgb8(),
    };
    let high = |v: u16| (v >> 8) as u8;
    let mut data = Vec::with_capacity(samples.len() / channels * 3);
    for p in samples.chunks_exact(channels) {
        data.extend_from_slice(&if channels < 3 { [high(p[0]); 3] } else { [high(p[0]), high(p[1]), high(p[2])] });
    }
    image::RgbImage::from_raw(w, h, data).expect("three samples per pixel")
}

/// The filter's weight at `x` and how far it reaches (PIL's definitions).
fn kernel(filter: Filter) -> (fn(f64) -> f64, f64) {
    fn triangle(x: f64) -> f64 {
        let x = x.abs();
        if x < 1.0 { 1.0 - x } else { 0.0 }
    }
    fn cubic(x: f64) -> f64 {
        // a = -0.5, as PIL.
        let (a, x) = (-0.5, x.abs());
        if x < 1.0 {
            ((a + 2.0) * x - (a + 3.0)) * x * x + 1.0
        } else if x < 2.0 {
            (((x - 5.0) * x + 8.0) * x - 4.0) * a
        } else {
            0.0
        }
    }
    fn sinc(x: f64) -> f64 {
        if x == 0.0 {
            1.0
        } else {
            let x = x * std::f64::consts::PI;
            x.sin() / x
        }
    }
    fn lanczos(x: f64) -> f64 {
        if (-3.0..3.0).contains(&x) { sinc(x) * sinc(x / 3.0) } else { 0.0 }
    }
    match filter {
        Filter::Bicubic => (cubic, 2.0),
        Filter::Lanczos => (lanczos, 3.0),
        _ => (triangle, 1.0),
    }
}

/// Fixed-point bits of the weights, as PIL's 8-bit resampling.
const PRECISION: u32 = 22;

/// For each output position in `window` (of `output`; a crop needs no others): the first input
/// position, and the integer weights. With `antialias` the filter widens with the downscale
/// factor (PIL); without, it keeps its size (plain interpolation, as OpenCV's `resize`).
fn coefficients(input: u32, output: u32, filter: Filter, antialias: bool, window: Range<usize>) -> Coefficients {
    let (f, support) = kernel(filter);
    let scale = f64::from(input) / f64::from(output);
    let filterscale = if antialias { scale.max(1.0) } else { 1.0 };
    let support = support * filterscale;
    window
        .map(|xx| {
            let center = (xx as f64 + 0.5) * scale;
            let xmin = ((center - support + 0.5) as i64).max(0) as usize;
            let xmax = ((center + support + 0.5) as i64).min(i64::from(input)) as usize;
            let weights: Vec<f64> =
                (xmin..xmax.max(xmin)).map(|x| f((x as f64 - center + 0.5) / filterscale)).collect();
            let total: f64 = weights.iter().sum();
            let fixed = weights
                .iter()
                .map(|w| {
                    let w = if total != 0.0 { w / total } else { *w } * f64::from(1u32 << PRECISION);
                    if w < 0.0 { (w - 0.5) as i32 } else { (w + 0.5) as i32 }
                })
                .collect();
            (xmin, fixed)
        })
        .collect()
}

fn clip8(v: i32) -> u8 {
    (v >> PRECISION).clamp(0, 255) as u8
}

/// PIL's rounding term, added before the weighted sum.
const HALF: i32 = 1 << (PRECISION - 1);

type Coefficients = Vec<(usize, Vec<i32>)>;

/// How an image is resampled, and what one image may cost: `max_pixels` bounds every buffer a
/// resize makes (its output and the horizontal pass's rows) and, times [`WORK_PER_PIXEL`], the
/// multiply-adds per channel.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Resample {
    pub filter: Filter,
    pub antialias: bool,
    pub max_pixels: u64,
}

/// Multiply-adds per channel a resize may take, per pixel of `max_pixels`: 12 covers the
/// costliest legitimate case (Lanczos, antialiased, reaching 3 input pixels each side per
/// downscale step) of an image at the limit; anything past 16 is an image built to be slow.
pub const WORK_PER_PIXEL: u64 = 16;

/// Refuses, with the reason, a resize past the bounds of `how` before anything is allocated.
fn check_cost(what: &str, pixels: u64, work: u64, how: Resample) -> Result<(), String> {
    if pixels > how.max_pixels {
        return Err(format!(
            "resizing it needs {what} of {pixels} pixels, over the limit of {} (parameter 'max_pixels')",
            how.max_pixels
        ));
    }
    let most = how.max_pixels.saturating_mul(WORK_PER_PIXEL);
    if work > most {
        return Err(format!(
            "resizing it takes {work} multiply-adds per channel, over the limit of {most} ({WORK_PER_PIXEL} x \
             parameter 'max_pixels')"
        ));
    }
    Ok(())
}

fn taps(coeffs: &Coefficients) -> u64 {
    coeffs.iter().map(|(_, k)| k.len() as u64).sum()
}

// Both passes round to 8 bits as PIL does between passes, with 32-bit sums as PIL's (weights in
// 22-bit fixed point: 255 x the largest sum of |weights| stays below 2^31).

/// Along rows, for the input rows in `rows` only (those the vertical pass will read).
fn horizontal(p: &Pixels, coeffs: &[(usize, Vec<i32>)], rows: Range<usize>) -> Pixels {
    horizontal_padded(p, coeffs, rows.clone()).unwrap_or_else(|| horizontal_any(p, coeffs, rows))
}

/// The unrolled pass where it applies: RGB, at most 8 taps, a row at least as wide as the padding.
fn horizontal_padded(p: &Pixels, coeffs: &[(usize, Vec<i32>)], rows: Range<usize>) -> Option<Pixels> {
    if p.channels != 3 {
        return None;
    }
    match coeffs.iter().map(|(_, k)| k.len()).max().unwrap_or(0) {
        0..=4 => horizontal_rgb::<4>(p, coeffs, rows),
        5..=6 => horizontal_rgb::<6>(p, coeffs, rows),
        7..=8 => horizontal_rgb::<8>(p, coeffs, rows),
        _ => None,
    }
}

/// The horizontal pass for any number of channels and taps.
fn horizontal_any(p: &Pixels, coeffs: &[(usize, Vec<i32>)], rows: Range<usize>) -> Pixels {
    let c = p.channels;
    let w = p.width as usize;
    let (ow, oh) = (coeffs.len(), rows.len());
    let mut data = vec![0u8; ow * oh * c];
    let src_rows = p.data.chunks_exact(w * c).skip(rows.start).take(oh);
    for (row, out) in src_rows.zip(data.chunks_exact_mut(ow * c)) {
        for ((start, k), px) in coeffs.iter().zip(out.chunks_exact_mut(c)) {
            let src = &row[start * c..(start + k.len()) * c];
            if c == 3 {
                let (mut r, mut g, mut b) = (HALF, HALF, HALF);
                for (s, &weight) in src.chunks_exact(3).zip(k) {
                    r += i32::from(s[0]) * weight;
                    g += i32::from(s[1]) * weight;
                    b += i32::from(s[2]) * weight;
                }
                px.copy_from_slice(&[clip8(r), clip8(g), clip8(b)]);
            } else {
                for (ch, o) in px.iter_mut().enumerate() {
                    let acc = src.chunks_exact(c).zip(k).fold(HALF, |a, (s, &weight)| a + i32::from(s[ch]) * weight);
                    *o = clip8(acc);
                }
            }
        }
    }
    Pixels { width: ow as u32, height: oh as u32, channels: c, data }
}

/// The horizontal pass on RGB pixels with every output's taps padded to `T` (zero weights around
/// its own, its window moved inside the row where it would cross the end), so the loop over taps
/// has a fixed length the compiler unrolls. The zeros add nothing: the same sums, bit for bit.
/// None when the row is narrower than `T`.
fn horizontal_rgb<const T: usize>(p: &Pixels, coeffs: &[(usize, Vec<i32>)], rows: Range<usize>) -> Option<Pixels> {
    let w = p.width as usize;
    let last = w.checked_sub(T)?;
    let plan: Vec<(usize, [i32; T])> = coeffs
        .iter()
        .map(|(start, k)| {
            let at = (*start).min(last);
            let mut weights = [0i32; T];
            weights[start - at..start - at + k.len()].copy_from_slice(k);
            (at * 3, weights)
        })
        .collect();
    let (ow, oh) = (coeffs.len(), rows.len());
    let mut data = vec![0u8; ow * oh * 3];
    let src_rows = p.data.chunks_exact(w * 3).skip(rows.start).take(oh);
    for (row, out) in src_rows.zip(data.chunks_exact_mut(ow * 3)) {
        for ((at, weights), px) in plan.iter().zip(out.chunks_exact_mut(3)) {
            let window = &row[*at..*at + 3 * T];
            let (mut r, mut g, mut b) = (HALF, HALF, HALF);
            for t in 0..T {
                r += i32::from(window[3 * t]) * weights[t];
                g += i32::from(window[3 * t + 1]) * weights[t];
                b += i32::from(window[3 * t + 2]) * weights[t];
            }
            px.copy_from_slice(&[clip8(r), clip8(g), clip8(b)]);
        }
    }
    Some(Pixels { width: ow as u32, height: oh as u32, channels: 3, data })
}

/// Along columns; `p` starts at input row `offset`. Sums whole rows, which the compiler vectorises.
fn vertical(p: &Pixels, coeffs: &[(usize, Vec<i32>)], offset: usize) -> Pixels {
    let c = p.channels;
    let stride = p.width as usize * c;
    let mut data = vec![0u8; stride * coeffs.len()];
    let mut acc = vec![0i32; stride];
    for ((start, k), out) in coeffs.iter().zip(data.chunks_exact_mut(stride)) {
        acc.fill(HALF);
        for (i, &weight) in k.iter().enumerate() {
            let at = start + i - offset;
            for (a, &v) in acc.iter_mut().zip(&p.data[at * stride..(at + 1) * stride]) {
                *a += i32::from(v) * weight;
            }
        }
        for (o, &a) in out.iter_mut().zip(&acc) {
            *o = clip8(a);
        }
    }
    Pixels { width: p.width, height: coeffs.len() as u32, channels: c, data }
}

/// Resizes to `width` x `height` as PIL's `Image.resize` does (bit for bit): nearest, or a
/// separable convolution widened by the downscale factor (antialiasing); without `antialias`
/// the kernel keeps its size, as OpenCV's `resize` (what YOLO pre-processing uses).
pub fn resize(p: &Pixels, (width, height): (u32, u32), how: Resample) -> Result<Pixels, String> {
    let (width, height) = (width.max(1), height.max(1));
    if (width, height) == (p.width, p.height) {
        return Ok(p.clone());
    }
    if how.filter == Filter::Nearest {
        let out = u64::from(width) * u64::from(height);
        check_cost("an image", out, out, how)?;
        // PIL steps the source position by repeated addition; the same sums pick the same pixels.
        let positions = |size: u32, have: u32| {
            let step = f64::from(have) / f64::from(size);
            let mut at = step * 0.5;
            (0..size)
                .map(|_| {
                    let i = (at as usize).min(have as usize - 1);
                    at += step;
                    i
                })
                .collect::<Vec<usize>>()
        };
        let (xs, ys) = (positions(width, p.width), positions(height, p.height));
        let c = p.channels;
        let mut data = Vec::with_capacity(width as usize * height as usize * c);
        for sy in &ys {
            for sx in &xs {
                let at = (sy * p.width as usize + sx) * c;
                data.extend_from_slice(&p.data[at..at + c]);
            }
        }
        return Ok(Pixels { width, height, channels: c, data });
    }
    resize_window(p, (width, height), how, (0..width as usize, 0..height as usize))
}

/// The part `xs` x `ys` of the image `resize` would make (a crop fused with the resize: each
/// output pixel is computed as `resize` computes it, the others are skipped).
pub fn resize_window(
    p: &Pixels,
    (width, height): (u32, u32),
    how: Resample,
    (xs, ys): (Range<usize>, Range<usize>),
) -> Result<Pixels, String> {
    let (ow, oh) = (xs.len() as u64, ys.len() as u64);
    check_cost("an image", ow * oh, 0, how)?;
    let (filter, antialias) = (how.filter, how.antialias);
    let across =
        (width != p.width || xs.len() != p.width as usize).then(|| coefficients(p.width, width, filter, antialias, xs));
    let down = (height != p.height || ys.len() != p.height as usize)
        .then(|| coefficients(p.height, height, filter, antialias, ys));
    // Only the input rows the vertical pass reads go through the horizontal one.
    let rows = match &down {
        Some(v) => {
            let first = v.iter().map(|(s, _)| *s).min().unwrap_or(0);
            first..v.iter().map(|(s, k)| s + k.len()).max().unwrap_or(first)
        }
        None => 0..p.height as usize,
    };
    let (h_work, across_w) = match &across {
        Some(h) => (taps(h) * rows.len() as u64, ow),
        None => (0, u64::from(p.width)),
    };
    let v_work = down.as_ref().map_or(0, |v| taps(v) * across_w);
    let between = if across.is_some() && down.is_some() { ow * rows.len() as u64 } else { 0 };
    check_cost("rows", between, h_work + v_work, how)?;
    Ok(match (across, down) {
        (None, None) => p.clone(),
        (Some(h), None) => horizontal(p, &h, rows),
        (None, Some(v)) => vertical(p, &v, 0),
        (Some(h), Some(v)) => vertical(&horizontal(p, &h, rows.clone()), &v, rows.start),
    })
}

/// The size that makes the shortest (or longest) side `size`, the other in proportion,
/// truncated as torchvision and Hugging Face compute it.
pub fn side_size(w: u32, h: u32, size: u32, longest: bool) -> (u32, u32) {
    let (short, long) = if w <= h { (w, h) } else { (h, w) };
    let (pick, other) = if longest { (long, short) } else { (short, long) };
    let scaled = ((f64::from(size) * f64::from(other) / f64::from(pick.max(1))) as u32).max(1);
    match (w <= h, longest) {
        (true, false) | (false, true) => (size, scaled),
        _ => (scaled, size),
    }
}

/// The centre `width` x `height` (padded with zeros where the image is smaller, as
/// torchvision), and where it starts. `round`: offsets rounded (torchvision) rather than floored
/// (Hugging Face).
/// Where a centre crop of `want` starts in `have` (torchvision floors, Hugging Face rounds).
pub fn crop_offset(have: u32, want: u32, round: bool) -> i64 {
    let d = f64::from(have) - f64::from(want);
    if round { (d / 2.0).round_ties_even() as i64 } else { (d / 2.0).floor() as i64 }
}

pub fn center_crop(p: &Pixels, width: u32, height: u32, round: bool) -> (Pixels, (i64, i64)) {
    let (left, top) = (crop_offset(p.width, width, round), crop_offset(p.height, height, round));
    let c = p.channels;
    let mut data = vec![0u8; width as usize * height as usize * c];
    for y in 0..height as i64 {
        let sy = y + top;
        if sy < 0 || sy >= i64::from(p.height) {
            continue;
        }
        for x in 0..width as i64 {
            let sx = x + left;
            if sx < 0 || sx >= i64::from(p.width) {
                continue;
            }
            let from = (sy as usize * p.width as usize + sx as usize) * c;
            let to = (y as usize * width as usize + x as usize) * c;
            data[to..to + c].copy_from_slice(&p.data[from..from + c]);
        }
    }
    (Pixels { width, height, channels: c, data }, (left, top))
}

/// Ultralytics' letterbox: scaled to fit `width` x `height` keeping the aspect ratio, centred on
/// `pad` grey. Returns the pixels and `[scale_x, scale_y, pad_x, pad_y]` (x' = x * scale + pad).
pub fn letterbox(
    p: &Pixels,
    (width, height): (u32, u32),
    pad: u8,
    how: Resample,
) -> Result<(Pixels, [f32; 4]), String> {
    let r = (f64::from(width) / f64::from(p.width)).min(f64::from(height) / f64::from(p.height));
    let nw = (f64::from(p.width) * r).round_ties_even().max(1.0) as u32;
    let nh = (f64::from(p.height) * r).round_ties_even().max(1.0) as u32;
    let scaled = resize(p, (nw, nh), how)?;
    let (dw, dh) = (f64::from(width - nw.min(width)) / 2.0, f64::from(height - nh.min(height)) / 2.0);
    let (left, top) = ((dw - 0.1).round_ties_even() as u32, (dh - 0.1).round_ties_even() as u32);
    let c = p.channels;
    let mut data = vec![pad; width as usize * height as usize * c];
    for y in 0..nh.min(height - top) {
        let from = (y as usize * nw as usize) * c;
        let to = ((y + top) as usize * width as usize + left as usize) * c;
        let n = nw.min(width - left) as usize * c;
        data[to..to + n].copy_from_slice(&scaled.data[from..from + n]);
    }
    let out = Pixels { width, height, channels: c, data };
    Ok((out, [nw as f32 / p.width as f32, nh as f32 / p.height as f32, left as f32, top as f32]))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pixels(w: u32, h: u32) -> Pixels {
        Pixels { width: w, height: h, channels: 3, data: (0..w * h * 3).map(|i| (i % 251) as u8).collect() }
    }

    #[test]
    fn a_jpeg_is_complete_when_an_end_of_image_follows_its_last_scan() {
        // Markers only: SOI, an EXIF thumbnail (its own SOI, scan, EOI) inside APP1, the main scan.
        let thumb = [0xFF, 0xE1, 0, 8, 0xFF, 0xD8, 0xFF, 0xDA, 1, 2, 0xFF, 0xD9];
        let main = [0xFF, 0xDA, 0, 4, 9, 0xFF, 0x00, 7];
        let jpeg = |parts: &[&[u8]]| {
            [&[0xFF, 0xD8][..]].iter().chain(parts).flat_map(|p| p.iter().copied()).collect::<Vec<u8>>()
        };
        assert!(jpeg_complete(&jpeg(&[&main, &[0xFF, 0xD9]])));
        assert!(jpeg_complete(&jpeg(&[&thumb, &main, &[0xFF, 0xD9]])));
        assert!(jpeg_complete(&jpeg(&[&main, &[0xFF, 0xD9, 0, 0, 0x12]])), "bytes after the end of image");
        assert!(!jpeg_complete(&jpeg(&[&main])), "cut off in the scan");
        assert!(!jpeg_complete(&jpeg(&[&thumb, &main])), "only the thumbnail ends");
        assert!(!jpeg_complete(&jpeg(&[&[0xFF, 0xD9]])), "no scan at all");
        assert!(!jpeg_complete(&[]));
    }

    #[test]
    fn side_sizes_truncate_as_torchvision() {
        assert_eq!(side_size(640, 480, 256, false), (341, 256));
        assert_eq!(side_size(480, 640, 224, false), (224, 298));
        assert_eq!(side_size(640, 480, 320, true), (320, 240));
    }

    #[test]
    fn center_crop_offsets_floor_or_round_and_pad_with_zeros() {
        let p = pixels(5, 4);
        let at = |x: usize, y: usize| p.data[(y * 5 + x) * 3..(y * 5 + x) * 3 + 3].to_vec();
        // (5 - 2) / 2 = 1.5: floored to 1 (Hugging Face), rounded half to even to 2 (torchvision).
        let (floored, at_floor) = center_crop(&p, 2, 2, false);
        assert_eq!((floored.data[..3].to_vec(), at_floor), (at(1, 1), (1, 1)));
        let (rounded, at_round) = center_crop(&p, 2, 2, true);
        assert_eq!((rounded.data[..3].to_vec(), at_round), (at(2, 1), (2, 1)));
        let (big, _) = center_crop(&p, 7, 4, false);
        assert_eq!(&big.data[..3], &[0, 0, 0], "padding where the image is narrower");
    }

    #[test]
    fn letterbox_centres_and_reports_the_mapping() {
        let p = pixels(640, 480);
        let how = Resample { filter: Filter::Bilinear, antialias: false, max_pixels: 1 << 20 };
        let (out, map) = letterbox(&p, (320, 320), 114, how).unwrap();
        assert_eq!((out.width, out.height), (320, 320));
        assert_eq!(map, [0.5, 0.5, 0.0, 40.0]);
        assert_eq!(&out.data[..3], &[114, 114, 114], "the band above the image is grey");
        assert_ne!(&out.data[(40 * 320) * 3..(40 * 320) * 3 + 3], &[114, 114, 114]);
    }

    #[test]
    fn decoding_refuses_junk_and_bombs_before_decoding() {
        let free = &mut |_| Ok(());
        assert!(decode(b"definitely not an image", Color::Rgb, 1 << 20, free).unwrap_err().contains("not an image"));
        let mut png = Vec::new();
        image::RgbImage::new(300, 200).write_to(&mut Cursor::new(&mut png), image::ImageFormat::Png).unwrap();
        let e = decode(&png, Color::Rgb, 50_000, free).unwrap_err();
        assert!(e.contains("300x200 pixels, over the limit of 50000"), "{e}");
        let gray = decode(&png, Color::Gray, 1 << 20, free).unwrap();
        assert_eq!((gray.width, gray.height, gray.channels, gray.data.len()), (300, 200, 1, 60_000));
        assert!(decode(&png[..png.len() / 2], Color::Rgb, 1 << 20, free).is_err(), "a truncated image");
        let mut told = 0;
        decode(&png, Color::Rgb, 1 << 20, &mut |n| {
            told = n;
            Ok(())
        })
        .unwrap();
        assert_eq!(told, 300 * 200 * (3 + 6), "the cost is told from the header");
        let refused = decode(&png, Color::Rgb, 1 << 20, &mut |_| Err("over the budget".into())).unwrap_err();
        assert_eq!(refused, "over the budget");
    }

    #[test]
    fn a_window_of_the_resize_is_the_crop_of_it() {
        let mut p = pixels(97, 61);
        p.data.iter_mut().enumerate().for_each(|(i, v)| *v = (i * 7919 % 251) as u8);
        for filter in [Filter::Bilinear, Filter::Bicubic, Filter::Lanczos] {
            let how = Resample { filter, antialias: true, max_pixels: 1 << 20 };
            let full = resize(&p, (50, 32), how).unwrap();
            let (crop, (left, top)) = center_crop(&full, 24, 20, false);
            let (x0, y0) = (left as usize, top as usize);
            let window = resize_window(&p, (50, 32), how, (x0..x0 + 24, y0..y0 + 20)).unwrap();
            assert_eq!(window, crop, "{filter:?}");
        }
    }

    #[test]
    fn a_resize_past_its_bounds_is_refused_before_it_allocates() {
        let tall = Pixels { width: 1, height: 10_000, channels: 3, data: vec![7; 30_000] };
        let how = |max_pixels| Resample { filter: Filter::Bilinear, antialias: true, max_pixels };
        // 256 x 2,560,000 asked for, a 224 x 224 window kept: only the window's coefficients.
        let window = resize_window(&tall, (256, 2_560_000), how(1 << 20), (16..240, 1_279_888..1_280_112)).unwrap();
        assert_eq!((window.width, window.height), (224, 224));
        let e = resize(&tall, (256, 2_560_000), how(50_000_000)).unwrap_err();
        assert!(e.contains("655360000 pixels, over the limit of 50000000"), "{e}");
        let e = resize(&tall, (256, 2_560_000), Resample { filter: Filter::Nearest, ..how(50_000_000) }).unwrap_err();
        assert!(e.contains("over the limit of 50000000"), "{e}");
        // Wider and one row high: a small output, but the horizontal pass widens every input row.
        let wide = Pixels { width: 4000, height: 2000, channels: 1, data: vec![1; 8_000_000] };
        let e = resize(&wide, (8000, 1), how(8_000_000)).unwrap_err();
        assert!(e.contains("needs rows of 16000000 pixels"), "{e}");
        let e = resize(&wide, (1, 1), Resample { filter: Filter::Lanczos, ..how(100_000) }).unwrap_err();
        assert!(e.contains("multiply-adds per channel, over the limit of 1600000"), "{e}");
        assert_eq!(
            resize(&wide, (1, 1), Resample { filter: Filter::Lanczos, ..how(8_000_000) }).unwrap().data.len(),
            1
        );
    }

    #[test]
    fn the_padded_rgb_pass_sums_what_the_general_one_does() {
        let mut p = pixels(37, 5);
        let mut covered = Vec::new();
        for (i, v) in p.data.iter_mut().enumerate() {
            *v = (i * 7919 % 251) as u8;
        }
        for (out, filter, antialias) in [
            (20, Filter::Bilinear, true),
            (25, Filter::Bicubic, true),
            (19, Filter::Lanczos, false),
            (30, Filter::Lanczos, true),
            (36, Filter::Bilinear, true),
            (60, Filter::Bicubic, true),
        ] {
            let coeffs = coefficients(37, out, filter, antialias, 0..out as usize);
            let taps = coeffs.iter().map(|(_, k)| k.len()).max().unwrap();
            covered.push(taps);
            let want = horizontal_any(&p, &coeffs, 1..4);
            let got = horizontal_padded(&p, &coeffs, 1..4).expect("at most 8 taps");
            assert_eq!(got.data, want.data, "{out} columns, {filter:?}, {taps} taps");
        }
        for (lo, hi) in [(1, 4), (5, 6), (7, 8)] {
            assert!(covered.iter().any(|t| (lo..=hi).contains(t)), "{lo}-{hi} taps covered: {covered:?}");
        }
        assert!(horizontal_rgb::<8>(&pixels(5, 2), &coefficients(5, 3, Filter::Bilinear, true, 0..3), 0..2).is_none());
    }
}
