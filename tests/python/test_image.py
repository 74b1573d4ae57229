"""`backend: "ferry_image"` through the real server against references computed here with PIL and
numpy: the CLIP (Hugging Face) and ImageNet (torchvision) presets, every format (JPEG, PNG, WebP,
BMP, GIF's first frame), every image mode (gray, CMYK, alpha, palettes, 1-bit, 16-bit), EXIF
orientation, each resize filter, gray and BGR, NHWC, FP16 and UINT8
outputs, raw and base64 input, the YOLO letterbox and its box mapping; and corrupt, truncated and
100-megapixel images failing only their own request.

Tolerances (in 8-bit pixel levels, after undoing the normalisation), as measured: on lossless
input the tensors equal PIL's bit for bit (0 levels; ferry reproduces PIL's fixed-point
resampling); JPEG decoding (zune-jpeg against PIL's libjpeg-turbo) differs by 0.4 levels on
average and at most 4 on a 640x480 photo, so JPEG cases bound the mean and the 99th percentile."""
import base64
import io
import os
import struct
import zlib

import numpy as np
import pytest
import tritonclient.http as httpclient
from PIL import Image, ImageOps
from tritonclient.utils import InferenceServerException

import models
from ferry_server import Server

CLIP_MEAN, CLIP_STD = np.array([0.48145466, 0.4578275, 0.40821073]), np.array([0.26862954, 0.26130258, 0.27577711])
NET_MEAN, NET_STD = np.array([0.485, 0.456, 0.406]), np.array([0.229, 0.224, 0.225])


def photo(w=640, h=480):
    """Smooth gradients, hard edges and noise: what resampling filters disagree on."""
    rng = np.random.default_rng(11)
    y, x = np.mgrid[0:h, 0:w]
    img = np.stack([x * 255 / w, y * 255 / h, (x + y) % 256], -1)
    img[h // 4:h // 2, w // 3:w // 2] = [250, 20, 30]
    img += rng.normal(0, 12, img.shape)
    return Image.fromarray(np.clip(img, 0, 255).astype(np.uint8))


def encoded(img, fmt, **kw):
    buf = io.BytesIO()
    img.save(buf, fmt, **kw)
    return buf.getvalue()


def model(repo, name, params, output, max_batch_size=8, extra_output=""):
    ps = ", ".join(f'{{ key: "{k}" value {{ string_value: "{v}" }} }}' for k, v in params.items())
    models.write(os.path.join(repo, name, "config.pbtxt"), f"""
name: "{name}"
backend: "ferry_image"
max_batch_size: {max_batch_size}
parameters [ {ps} ]
input [ {{ name: "IMAGE" data_type: TYPE_STRING dims: [ 1 ] }} ]
output [ {output}{extra_output} ]
""")
    os.makedirs(os.path.join(repo, name, "1"), exist_ok=True)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    repo = str(tmp_path_factory.mktemp("images"))
    fp32 = lambda *d: f'{{ name: "PIXELS" data_type: TYPE_FP32 dims: [ {", ".join(map(str, d))} ] }}'
    model(repo, "clip", {"preset": "clip"}, fp32(3, 224, 224))
    model(repo, "imagenet", {"preset": "imagenet"}, fp32(3, 224, 224))
    model(repo, "yolo", {"preset": "yolo"}, fp32(3, 640, 640),
          extra_output=', { name: "LETTERBOX" data_type: TYPE_FP32 dims: [ 4 ] }')
    for f in ("nearest", "bilinear", "bicubic", "lanczos"):
        model(repo, f"exact_{f}", {"resize": "exact", "size": "200,150", "filter": f, "scale": "1", "mean": "0", "std": "1"},
              fp32(3, 150, 200))
    model(repo, "gray_nhwc_fp16", {"resize": "exact", "size": "96", "color": "gray", "layout": "nhwc"},
          '{ name: "PIXELS" data_type: TYPE_FP16 dims: [ 96, 96, 1 ] }')
    model(repo, "bgr_u8", {"resize": "exact", "size": "64,48", "color": "bgr", "layout": "nhwc"},
          '{ name: "PIXELS" data_type: TYPE_UINT8 dims: [ 48, 64, 3 ] }')
    model(repo, "raw_u8", {"resize": "none", "layout": "nhwc"}, '{ name: "PIXELS" data_type: TYPE_UINT8 dims: [ 48, 64, 3 ] }')
    with Server(["--model-repository", repo]) as s:
        yield s


def infer(server, name, data, outputs=("PIXELS",)):
    inp = httpclient.InferInput("IMAGE", [1, 1], "BYTES").set_data_from_numpy(np.array([[data]], dtype=np.object_))
    r = server.client().infer(name, [inp])
    return [r.as_numpy(o)[0] for o in outputs]


def levels(got, want, mean=0.0, std=1.0, scale=255.0):
    """Differences in 8-bit levels, CHW float tensors compared after undoing the normalisation."""
    m, s = np.asarray(mean).reshape(-1, 1, 1), np.asarray(std).reshape(-1, 1, 1)
    return np.abs((got * s + m) - (want * s + m)) * scale


def chw(img):
    return np.asarray(img, dtype=np.float32).transpose(2, 0, 1) / 255.0


def clip_reference(img):
    w, h = img.size
    short, long = (w, h) if w <= h else (h, w)
    other = int(224 * long / short)
    size = (224, other) if w <= h else (other, 224)
    img = img.resize(size, Image.BICUBIC)
    left, top = (img.width - 224) // 2, (img.height - 224) // 2
    img = img.crop((left, top, left + 224, top + 224))
    return (chw(img) - CLIP_MEAN.reshape(-1, 1, 1)) / CLIP_STD.reshape(-1, 1, 1)


def imagenet_reference(img):
    w, h = img.size
    short, long = (w, h) if w <= h else (h, w)
    other = int(256 * long / short)
    img = img.resize((256, other) if w <= h else (other, 256), Image.BILINEAR)
    left, top = int(round((img.width - 224) / 2.0)), int(round((img.height - 224) / 2.0))
    img = img.crop((left, top, left + 224, top + 224))
    return (chw(img) - NET_MEAN.reshape(-1, 1, 1)) / NET_STD.reshape(-1, 1, 1)


def test_clip_and_imagenet_presets_match_pil_on_lossless_input(server):
    img = photo()
    png = encoded(img, "PNG")
    [got] = infer(server, "clip", png)
    d = levels(got, clip_reference(img), CLIP_MEAN, CLIP_STD)
    assert d.max() < 1e-3, f"CLIP: max {d.max():.2f} levels"
    [got] = infer(server, "imagenet", png)
    d = levels(got, imagenet_reference(img), NET_MEAN, NET_STD)
    assert d.max() < 1e-3, f"ImageNet: max {d.max():.2f} levels"


@pytest.mark.parametrize("fmt", ["JPEG", "PNG", "WEBP", "BMP", "GIF"])
def test_every_format_decodes_as_pil_does(server, fmt):
    img = photo(320, 240)
    kw = {"quality": 92} if fmt == "JPEG" else {"lossless": True} if fmt == "WEBP" else {}
    data = encoded(img if fmt != "GIF" else img.quantize(64), fmt, **kw)
    want_img = Image.open(io.BytesIO(data)).convert("RGB").resize((200, 150), Image.NEAREST)
    [got] = infer(server, "exact_nearest", data)
    d = np.abs(got - np.asarray(want_img, dtype=np.float32).transpose(2, 0, 1))
    if fmt == "JPEG":
        assert d.mean() < 1.0 and np.percentile(d, 99) <= 4, f"JPEG: mean {d.mean():.2f}, p99 {np.percentile(d, 99)}"
    else:
        assert d.max() == 0, f"{fmt}: max {d.max()} levels"


def png16(samples, color_type):
    """A 16-bit PNG (PIL writes none but gray): samples [h, w, channels] of uint16."""
    h, w = samples.shape[:2]
    chunk = lambda kind, data: struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    raw = b"".join(b"\0" + samples[y].astype(">u2").tobytes() for y in range(h))
    ihdr = struct.pack(">IIBBBBB", w, h, 16, color_type, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b"")


def wide(img, alpha=None):
    """The photo's 8-bit channels spread over 16 bits (low bytes that PIL drops), plus alpha."""
    a = np.asarray(img, dtype=np.uint16).reshape(img.height, img.width, -1)
    a = a * 257 + (np.arange(a.size, dtype=np.uint16).reshape(a.shape) % 200)
    return a if alpha is None else np.concatenate([a, np.full(a.shape[:2] + (1,), alpha, np.uint16)], -1)


MODES = {
    "JPEG gray": lambda p: encoded(p.convert("L"), "JPEG", quality=95),
    "JPEG CMYK": lambda p: encoded(p.convert("CMYK"), "JPEG", quality=95),
    "PNG RGBA": lambda p: encoded(p.convert("RGBA"), "PNG"),
    "PNG gray+alpha": lambda p: encoded(p.convert("LA"), "PNG"),
    "PNG palette": lambda p: encoded(p.quantize(64), "PNG"),
    "PNG palette+transparency": lambda p: encoded(p.quantize(64), "PNG", transparency=0),
    "PNG 1-bit": lambda p: encoded(p.convert("1"), "PNG"),
    "PNG 16-bit RGB": lambda p: png16(wide(p), 2),
    "PNG 16-bit RGBA": lambda p: png16(wide(p, 40000), 6),
    "PNG 16-bit gray+alpha": lambda p: png16(wide(p.convert("L"), 9), 4),
    "BMP palette": lambda p: encoded(p.quantize(64), "BMP"),
    "WebP RGBA": lambda p: encoded(p.convert("RGBA"), "WEBP", lossless=True),
}


@pytest.mark.parametrize("mode", list(MODES))
def test_every_image_mode_converts_as_pil_does(server, mode):
    """Gray, CMYK, alpha, palettes, 1-bit and 16-bit images come out as PIL's convert("RGB")."""
    data = MODES[mode](photo(64, 48))
    want = np.asarray(Image.open(io.BytesIO(data)).convert("RGB"), dtype=np.int16)
    [got] = infer(server, "raw_u8", data)
    d = np.abs(got.astype(np.int16) - want)
    if mode.startswith("JPEG"):
        assert d.mean() < 1.0 and d.max() <= 4, f"{mode}: mean {d.mean():.2f}, max {d.max()}"
    else:
        assert d.max() == 0, f"{mode}: max {d.max()} levels"


def test_16_bit_gray_keeps_its_image_where_pil_clips(server):
    """PIL reads plain 16-bit gray as "I;16" and its convert("RGB") clips every value over 255 to
    white; ferry takes the high byte, as PIL itself does for 16-bit colour."""
    samples = wide(photo(64, 48).convert("L"))
    data = png16(samples, 0)
    [got] = infer(server, "raw_u8", data)
    assert (got == (samples >> 8).astype(np.uint8)).all()
    pil = np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))
    assert (pil[samples[..., 0] > 255] == 255).all(), "what PIL gives: white wherever the value passes 255"


@pytest.mark.parametrize("name,flt", [("bilinear", Image.BILINEAR), ("bicubic", Image.BICUBIC), ("lanczos", Image.LANCZOS)])
def test_each_filter_resamples_as_pil(server, name, flt):
    img = photo()
    [got] = infer(server, f"exact_{name}", encoded(img, "PNG"))
    want = np.asarray(img.resize((200, 150), flt), dtype=np.float32).transpose(2, 0, 1)
    assert np.abs(got - want).max() == 0, f"{name}: max {np.abs(got - want).max()} levels"


def test_exif_orientation_is_applied(server):
    img = photo(320, 240)
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90° clockwise to display
    data = encoded(img, "JPEG", quality=95, exif=exif.tobytes())
    upright = ImageOps.exif_transpose(Image.open(io.BytesIO(data))).convert("RGB")
    assert upright.size == (240, 320)
    [got] = infer(server, "exact_nearest", data)
    want = np.asarray(upright.resize((200, 150), Image.NEAREST), dtype=np.float32).transpose(2, 0, 1)
    assert np.abs(got - want).mean() < 1.0


def test_gray_nhwc_fp16_and_bgr_uint8_raw_or_base64(server):
    img = photo()
    [got] = infer(server, "gray_nhwc_fp16", encoded(img, "PNG"))
    want = np.asarray(img.convert("L").resize((96, 96), Image.BILINEAR), dtype=np.float32)[..., None] / 255.0
    assert got.dtype == np.float16 and got.shape == (96, 96, 1)
    assert np.abs(got.astype(np.float32) - want).max() * 255 <= 0.5, "FP16 rounding only"
    want = np.asarray(img.resize((64, 48), Image.BILINEAR))[..., ::-1]
    png = encoded(img, "PNG")
    # Raw, base64, and base64 broken into lines (as MIME and Python's encodebytes write it).
    for data in (png, base64.b64encode(png), base64.encodebytes(png)):
        [got] = infer(server, "bgr_u8", data)
        assert got.dtype == np.uint8 and got.shape == (48, 64, 3)
        assert (got == want).all()


def test_yolo_letterbox_and_its_mapping(server):
    img = photo(640, 480)
    pixels, mapping = infer(server, "yolo", encoded(img, "PNG"), outputs=("PIXELS", "LETTERBOX"))
    assert pixels.shape == (3, 640, 640)
    assert mapping.tolist() == [1.0, 1.0, 0.0, 80.0], "640x480 fits at scale 1, 80 rows of grey above"
    assert np.allclose(pixels[:, :80], 114 / 255) and np.allclose(pixels[:, 560:], 114 / 255)
    assert np.abs(pixels[:, 80:560] - chw(img)).max() < 1e-6, "at scale 1 the image is copied as is"
    small = photo(320, 200)
    pixels, mapping = infer(server, "yolo", encoded(small, "PNG"), outputs=("PIXELS", "LETTERBOX"))
    assert mapping.tolist() == [2.0, 2.0, 0.0, 120.0]


def png_header_only(w, h):
    """A PNG that claims w x h pixels (what a decompression bomb looks like before decoding)."""
    chunk = lambda kind, data: struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    ihdr = struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")


@pytest.mark.parametrize("data,why", [
    (b"not an image at all", "not an image"),
    (None, "cannot decode"),
    (png_header_only(10000, 10000), "10000x10000 pixels, over the limit of 50000000"),
], ids=["junk", "truncated", "100-megapixel bomb"])
def test_bad_images_fail_only_their_request(server, data, why):
    good = encoded(photo(), "JPEG", quality=90)
    data = good[: len(good) // 3] if data is None else data
    client = server.client()
    inputs = [httpclient.InferInput("IMAGE", [1, 1], "BYTES").set_data_from_numpy(np.array([[d]], dtype=np.object_))
              for d in (data, good)]
    pending = [client.async_infer("clip", [i]) for i in inputs]
    with pytest.raises(InferenceServerException, match=why):
        pending[0].get_result()
    assert pending[1].get_result().as_numpy("PIXELS").shape == (1, 3, 224, 224)
    assert client.is_server_live() and client.is_model_ready("clip")
