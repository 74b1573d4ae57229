"""Processing steps built into ferry (`backend: "ferry_postprocess"`), through the real server with
tritonclient over HTTP and gRPC, against numpy references computed here: top-k with softmax and
labels (batched by the dynamic batcher), mean pooling with an attention mask and L2 normalisation,
YOLO boxes with non-maximum suppression mapped back through a letterbox, an ensemble of an ONNX
model and an output step, and bad parameters as load errors that name them."""
import os

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from onnx import TensorProto, helper, numpy_helper

import models
from ferry_server import Server

LABELS = [f"class_{i}" for i in range(10)]
RNG = np.random.default_rng(3)
W = RNG.standard_normal((4, 10)).astype(np.float32)


def step(repo, name, config):
    models.write(os.path.join(repo, name, "config.pbtxt"), f'name: "{name}"\nbackend: "ferry_postprocess"\n' + config)
    os.makedirs(os.path.join(repo, name, "1"), exist_ok=True)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    repo = str(tmp_path_factory.mktemp("native"))
    step(repo, "top3", """
max_batch_size: 8
dynamic_batching { }
parameters [ { key: "operation" value { string_value: "topk" } }, { key: "k" value { string_value: "3" } },
             { key: "activation" value { string_value: "softmax" } },
             { key: "labels" value { string_value: "labels.txt" } } ]
input [ { name: "LOGITS" data_type: TYPE_FP32 dims: [ 10 ] } ]
output [ { name: "SCORES" data_type: TYPE_FP32 dims: [ 3 ] }, { name: "INDICES" data_type: TYPE_INT64 dims: [ 3 ] },
         { name: "LABELS" data_type: TYPE_STRING dims: [ 3 ] } ]
""")
    models.write(os.path.join(repo, "top3", "labels.txt"), "".join(f"{label}\n" for label in LABELS))
    step(repo, "embed", """
max_batch_size: 0
parameters [ { key: "operation" value { string_value: "pool" } } ]
input [ { name: "HIDDEN" data_type: TYPE_FP32 dims: [ -1, -1, 8 ] }, { name: "MASK" data_type: TYPE_INT64 dims: [ -1, -1 ] } ]
output [ { name: "EMBEDDING" data_type: TYPE_FP32 dims: [ -1, 8 ] } ]
""")
    step(repo, "detect", """
max_batch_size: 0
parameters [ { key: "operation" value { string_value: "yolo" } }, { key: "confidence" value { string_value: "0.3" } },
             { key: "iou" value { string_value: "0.5" } } ]
input [ { name: "PRED" data_type: TYPE_FP32 dims: [ 1, 7, -1 ] },
        { name: "LETTERBOX" data_type: TYPE_FP32 dims: [ 1, 4 ] optional: true } ]
output [ { name: "BOXES" data_type: TYPE_FP32 dims: [ 1, -1, 4 ] }, { name: "SCORES" data_type: TYPE_FP32 dims: [ 1, -1 ] },
         { name: "CLASSES" data_type: TYPE_INT64 dims: [ 1, -1 ] } ]
""")
    # An ONNX model (logits = x @ W) and the top-3 step, wired by an ensemble.
    x = helper.make_tensor_value_info("X", TensorProto.FLOAT, ["b", 4])
    y = helper.make_tensor_value_info("LOGITS", TensorProto.FLOAT, ["b", 10])
    graph = helper.make_graph([helper.make_node("MatMul", ["X", "W"], ["LOGITS"])], "lin", [x], [y],
                              initializer=[numpy_helper.from_array(W, "W")])
    models.save(graph, os.path.join(repo, "linear", "1", "model.onnx"), opset=13)
    models.write(os.path.join(repo, "linear", "config.pbtxt"), 'name: "linear"\nmax_batch_size: 8\n')
    models.write(os.path.join(repo, "classify", "config.pbtxt"), """
name: "classify"
platform: "ensemble"
max_batch_size: 8
input [ { name: "X" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "LABELS" data_type: TYPE_STRING dims: [ 3 ] }, { name: "SCORES" data_type: TYPE_FP32 dims: [ 3 ] } ]
ensemble_scheduling { step [
  { model_name: "linear" model_version: -1 input_map { key: "X" value: "X" } output_map { key: "LOGITS" value: "logits" } },
  { model_name: "top3" model_version: -1 input_map { key: "LOGITS" value: "logits" }
    output_map [ { key: "LABELS" value: "LABELS" }, { key: "SCORES" value: "SCORES" } ] } ] }
""")
    os.makedirs(os.path.join(repo, "classify", "1"), exist_ok=True)
    with Server(["--model-repository", repo]) as s:
        yield s


def softmax(x):
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def top3(logits):
    p = softmax(logits)
    idx = np.argsort(-p, axis=-1, kind="stable")[:, :3]
    return np.take_along_axis(p, idx, axis=-1), idx


@pytest.mark.parametrize("lib", [httpclient, grpcclient], ids=["http", "grpc"])
def test_topk_with_softmax_and_labels_batched(server, lib):
    client = server.client() if lib is httpclient else server.grpc_client()
    logits = RNG.standard_normal((16, 10)).astype(np.float32)
    pending = []
    for row in logits:
        ins = [lib.InferInput("LOGITS", [1, 10], "FP32").set_data_from_numpy(row[None])]
        if lib is httpclient:
            pending.append(client.async_infer("top3", ins))
        else:
            import queue
            box = queue.Queue()
            client.async_infer("top3", ins, callback=lambda result, error, box=box: box.put((result, error)))
            pending.append(box)
    results = [p.get_result() if lib is httpclient else p.get(timeout=30)[0] for p in pending]
    scores, idx = top3(logits)
    for i, r in enumerate(results):
        np.testing.assert_allclose(r.as_numpy("SCORES")[0], scores[i], rtol=1e-5)
        assert (r.as_numpy("INDICES")[0] == idx[i]).all()
        assert [b.decode() for b in r.as_numpy("LABELS")[0]] == [LABELS[j] for j in idx[i]]


def test_an_ensemble_of_an_onnx_model_and_an_output_step(server):
    x = RNG.standard_normal((3, 4)).astype(np.float32)
    r = server.client().infer("classify", [httpclient.InferInput("X", [3, 4], "FP32").set_data_from_numpy(x)])
    scores, idx = top3(x @ W)
    np.testing.assert_allclose(r.as_numpy("SCORES"), scores, rtol=1e-4)
    assert [[b.decode() for b in row] for row in r.as_numpy("LABELS")] == [[LABELS[j] for j in row] for row in idx]


def test_mean_pooling_with_a_mask_and_normalisation(server):
    hidden = RNG.standard_normal((2, 5, 8)).astype(np.float32)
    mask = np.array([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], dtype=np.int64)
    ins = [grpcclient.InferInput("HIDDEN", [2, 5, 8], "FP32").set_data_from_numpy(hidden),
           grpcclient.InferInput("MASK", [2, 5], "INT64").set_data_from_numpy(mask)]
    got = server.grpc_client().infer("embed", ins).as_numpy("EMBEDDING")
    mean = (hidden * mask[..., None]).sum(1) / np.clip(mask.sum(1, keepdims=True), 1e-9, None)
    np.testing.assert_allclose(got, mean / np.linalg.norm(mean, axis=1, keepdims=True), rtol=1e-5, atol=1e-6)


def nms_reference(pred, conf, iou, letterbox):
    """Ultralytics' rule in numpy: best class per anchor, confidence, greedy per-class NMS."""
    p = pred[0].T  # anchors x (4 + classes)
    cls, score = p[:, 4:].argmax(1), p[:, 4:].max(1)
    keep = score >= conf
    cx, cy, w, h = p[keep, :4].T
    boxes = np.stack([cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2], 1)
    cls, score = cls[keep], score[keep]
    order = np.argsort(-score, kind="stable")
    kept = []
    for i in order:
        ok = True
        for j in kept:
            if cls[i] != cls[j]:
                continue
            tl, br = np.maximum(boxes[i, :2], boxes[j, :2]), np.minimum(boxes[i, 2:], boxes[j, 2:])
            inter = np.prod(np.clip(br - tl, 0, None))
            union = np.prod(boxes[i, 2:] - boxes[i, :2]) + np.prod(boxes[j, 2:] - boxes[j, :2]) - inter
            if inter / union > iou:
                ok = False
                break
        if ok:
            kept.append(i)
    sx, sy, px, py = letterbox
    b = boxes[kept]
    return (b - [px, py, px, py]) / [sx, sy, sx, sy], score[kept], cls[kept]


def test_yolo_boxes_match_the_reference(server):
    anchors = 300
    centres = RNG.uniform(50, 590, (2, anchors)).astype(np.float32)
    sizes = RNG.uniform(20, 120, (2, anchors)).astype(np.float32)
    classes = RNG.uniform(0, 1, (3, anchors)).astype(np.float32) ** 3
    pred = np.concatenate([centres, sizes, classes])[None].astype(np.float32)
    letterbox = np.array([[0.5, 0.5, 0.0, 80.0]], dtype=np.float32)
    ins = [httpclient.InferInput("PRED", list(pred.shape), "FP32").set_data_from_numpy(pred),
           httpclient.InferInput("LETTERBOX", [1, 4], "FP32").set_data_from_numpy(letterbox)]
    r = server.client().infer("detect", ins)
    boxes, scores, cls = nms_reference(pred, 0.3, 0.5, letterbox[0])
    assert len(scores) > 5, "the random heads leave several detections"
    assert (r.as_numpy("CLASSES")[0] == cls).all()
    np.testing.assert_allclose(r.as_numpy("SCORES")[0], scores, rtol=1e-6)
    np.testing.assert_allclose(r.as_numpy("BOXES")[0], boxes, rtol=1e-5, atol=1e-3)


def test_bad_parameters_fail_the_load_naming_them(tmp_path):
    repo = str(tmp_path)
    step(repo, "typo", """
max_batch_size: 0
parameters [ { key: "operation" value { string_value: "topk" } }, { key: "k" value { string_value: "three" } } ]
input [ { name: "L" data_type: TYPE_FP32 dims: [ 10 ] } ]
output [ { name: "S" data_type: TYPE_FP32 dims: [ 3 ] } ]
""")
    with Server(["--model-repository", repo, "--exit-on-error=false"]) as s:
        [entry] = s.client().get_model_repository_index()
        assert entry["state"] == "UNAVAILABLE"
        assert "parameter 'k' is 'three'; expected a number from 1 to 65536" in entry["reason"], entry


PY_IMAGE = '''
import io
import numpy as np
import triton_python_backend_utils as pb_utils
from PIL import Image


class TritonPythonModel:
    def execute(self, requests):
        out = []
        for r in requests:
            images = pb_utils.get_input_tensor_by_name(r, "IMAGE").as_numpy().reshape(-1)
            pixels = [np.asarray(Image.open(io.BytesIO(b)).convert("RGB").resize((32, 32), Image.BILINEAR),
                                 dtype=np.float32).transpose(2, 0, 1) / 255.0 for b in images]
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("PIXELS", np.stack(pixels))]))
        return out
'''

PY_TEXT = '''
import os
import numpy as np
import triton_python_backend_utils as pb_utils
from tokenizers import Tokenizer


class TritonPythonModel:
    def initialize(self, args):
        self.tok = Tokenizer.from_file(os.path.join(args["model_repository"], args["model_version"], "tokenizer.json"))
        self.tok.enable_truncation(8)
        self.tok.enable_padding(length=8)

    def execute(self, requests):
        out = []
        for r in requests:
            texts = [t.decode() for t in pb_utils.get_input_tensor_by_name(r, "TEXT").as_numpy().reshape(-1)]
            enc = self.tok.encode_batch(texts)
            out.append(pb_utils.InferenceResponse([
                pb_utils.Tensor("input_ids", np.array([e.ids for e in enc], dtype=np.int64)),
                pb_utils.Tensor("attention_mask", np.array([e.attention_mask for e in enc], dtype=np.int64))]))
        return out
'''

PY_LABEL = '''
import os
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.labels = open(os.path.join(args["model_repository"], "labels.txt")).read().split()

    def execute(self, requests):
        out = []
        for r in requests:
            x = pb_utils.get_input_tensor_by_name(r, "LOGITS").as_numpy()
            p = np.exp(x - x.max(-1, keepdims=True))
            p /= p.sum(-1, keepdims=True)
            best = p.argmax(-1)
            out.append(pb_utils.InferenceResponse([
                pb_utils.Tensor("LABEL", np.array([[self.labels[i].encode()] for i in best], dtype=np.object_)),
                pb_utils.Tensor("SCORE", p.max(-1, keepdims=True).astype(np.float32))]))
        return out
'''


def test_the_no_python_example_agrees_with_the_same_pipeline_in_python_steps(tmp_path):
    """examples/color_match (ferry_image, ferry_tokenizer, ONNX, ferry_postprocess) against its
    twin whose three processing steps are Python models doing the same with PIL, the tokenizers
    library and numpy, around the same ONNX model."""
    import io
    import shutil

    from PIL import Image

    from conftest import EXAMPLES, copy_example
    repo = str(tmp_path)
    for m in ("color_match", "color_match_image", "color_match_text", "color_match_onnx", "color_match_label"):
        copy_example(repo, m)
    twin = {"color_match_image": ("color_match_image_py", PY_IMAGE), "color_match_text": ("color_match_text_py", PY_TEXT),
            "color_match_label": ("color_match_label_py", PY_LABEL)}
    for native, (name, code) in twin.items():
        config = open(os.path.join(EXAMPLES, native, "config.pbtxt")).read()
        config = config.replace(f'name: "{native}"', f'name: "{name}"')
        config = "\n".join(line for line in config.splitlines()
                           if not line.startswith(("backend:", "parameters", "             {")))
        models.python_model(repo, name, code, 'backend: "python"\n' + config)
    shutil.copy(os.path.join(EXAMPLES, "color_match_text", "1", "tokenizer.json"),
                os.path.join(repo, "color_match_text_py", "1", "tokenizer.json"))
    shutil.copy(os.path.join(EXAMPLES, "color_match_label", "labels.txt"), os.path.join(repo, "color_match_label_py"))
    ensemble = open(os.path.join(EXAMPLES, "color_match", "config.pbtxt")).read().replace('name: "color_match"',
                                                                                         'name: "color_match_py"')
    for native, (name, _) in twin.items():
        ensemble = ensemble.replace(f'"{native}"', f'"{name}"')
    models.write(os.path.join(repo, "color_match_py", "config.pbtxt"), ensemble)
    os.makedirs(os.path.join(repo, "color_match_py", "1"), exist_ok=True)

    rng = np.random.default_rng(2)
    cases = []
    for k in range(6):
        arr = np.clip(rng.normal(rng.uniform(0, 255, 3), 30, (48 + 8 * k, 64, 3)), 0, 255).astype(np.uint8)
        buf = io.BytesIO()
        Image.fromarray(arr).save(buf, "PNG")
        words = " ".join(rng.choice(["the", "red", "fire", "sky", "ocean", "snow", "milk", "coal", "a", "leaf"], 4))
        cases.append((buf.getvalue(), words.encode()))
    with Server(["--model-repository", repo]) as s:
        for lib, client in ((httpclient, s.client()), (grpcclient, s.grpc_client())):
            for image, text in cases:
                ins = [lib.InferInput("IMAGE", [1, 1], "BYTES").set_data_from_numpy(np.array([[image]], dtype=np.object_)),
                       lib.InferInput("TEXT", [1, 1], "BYTES").set_data_from_numpy(np.array([[text]], dtype=np.object_))]
                native, python = (client.infer(m, ins) for m in ("color_match", "color_match_py"))
                for out in ("IMAGE_COLOR", "TEXT_COLOR"):
                    assert native.as_numpy(out).tolist() == python.as_numpy(out).tolist(), (out, text)
                for out in ("IMAGE_SCORE", "TEXT_SCORE"):
                    np.testing.assert_allclose(native.as_numpy(out), python.as_numpy(out), rtol=1e-6)
        stats = {m["name"]: m for m in s.client().get_inference_statistics()["model_stats"]}
    assert stats["color_match_image"]["inference_stats"]["success"]["count"] == 2 * len(cases)
