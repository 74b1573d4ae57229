"""The repository shape the project was built from (a CLIP deployment), started the way its
owners start Triton: a Python pre-processing step using PIL, an ONNX model with a REJECT queue
policy, and an ensemble wiring them, in explicit mode with strict readiness and no auto-complete.
The outputs over HTTP and gRPC equal running the same steps in-process."""
import base64
import io
import os

import numpy as np
import onnxruntime as ort
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from onnx import TensorProto, helper
from PIL import Image

import models
from ferry_server import Server

PREPROCESS = '''
import base64
import io

import numpy as np
import triton_python_backend_utils as pb_utils
from PIL import Image

SIZE = 24


def image_nchw(b64):
    image = Image.open(io.BytesIO(base64.b64decode(b64))).convert("RGB").resize((SIZE, SIZE), Image.BILINEAR)
    return (np.asarray(image, dtype=np.float32) / 255.0).transpose(2, 0, 1)


def tokens(text, length=8):
    ids = [sum(w.encode()) % 1000 + 1 for w in text.decode().lower().split()][:length]
    mask = [1] * len(ids) + [0] * (length - len(ids))
    return ids + [0] * (length - len(ids)), mask


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            images = pb_utils.get_input_tensor_by_name(request, "BASE64IMAGE").as_numpy().reshape(-1)
            texts = pb_utils.get_input_tensor_by_name(request, "TEXT").as_numpy().reshape(-1)
            pixels = np.stack([image_nchw(b) for b in images])
            ids, mask = zip(*[tokens(t) for t in texts])
            responses.append(pb_utils.InferenceResponse(output_tensors=[
                pb_utils.Tensor("IMAGE_NCHW", pixels),
                pb_utils.Tensor("SUBWORD_IDS", np.array(ids, dtype=np.int64)),
                pb_utils.Tensor("ATTENTION_MASK", np.array(mask, dtype=np.int64)),
            ]))
        return responses
'''

PREPROCESS_CONFIG = """
name: "clip-preprocess"
backend: "python"
max_batch_size: 128
dynamic_batching { }
input [ { name: "BASE64IMAGE" data_type: TYPE_STRING dims: [ 1 ] }, { name: "TEXT" data_type: TYPE_STRING dims: [ 1 ] } ]
output [
  { name: "IMAGE_NCHW" data_type: TYPE_FP32 dims: [ 3, -1, -1 ] },
  { name: "SUBWORD_IDS" data_type: TYPE_INT64 dims: [ -1 ] },
  { name: "ATTENTION_MASK" data_type: TYPE_INT64 dims: [ -1 ] }
]
"""

CORE_CONFIG = """
name: "clip-core"
platform: "onnxruntime_onnx"
max_batch_size: 128
dynamic_batching {
  default_queue_policy { timeout_action: REJECT default_timeout_microseconds: 10000000 }
}
input [
  { name: "pixel_values" data_type: TYPE_FP32 dims: [ 3, -1, -1 ] },
  { name: "input_ids" data_type: TYPE_INT64 dims: [ -1 ] },
  { name: "attention_mask" data_type: TYPE_INT64 dims: [ -1 ] }
]
output [ { name: "image_embeds" data_type: TYPE_FP32 dims: [ 3 ] }, { name: "text_embeds" data_type: TYPE_FP32 dims: [ 1 ] } ]
"""

ENSEMBLE = """
name: "clip"
platform: "ensemble"
max_batch_size: 128
input [ { name: "BASE64IMAGE" data_type: TYPE_STRING dims: [ 1 ] }, { name: "TEXT" data_type: TYPE_STRING dims: [ 1 ] } ]
output [ { name: "IMAGE_EMBEDS" data_type: TYPE_FP32 dims: [ 3 ] }, { name: "TEXT_EMBEDS" data_type: TYPE_FP32 dims: [ 1 ] } ]
ensemble_scheduling {
  step [
    {
      model_name: "clip-preprocess"
      model_version: -1
      input_map { key: "BASE64IMAGE" value: "BASE64IMAGE" }
      input_map { key: "TEXT" value: "TEXT" }
      output_map { key: "IMAGE_NCHW" value: "pixels" }
      output_map { key: "SUBWORD_IDS" value: "ids" }
      output_map { key: "ATTENTION_MASK" value: "mask" }
    },
    {
      model_name: "clip-core"
      model_version: -1
      input_map { key: "pixel_values" value: "pixels" }
      input_map { key: "input_ids" value: "ids" }
      input_map { key: "attention_mask" value: "mask" }
      output_map { key: "image_embeds" value: "IMAGE_EMBEDS" }
      output_map { key: "text_embeds" value: "TEXT_EMBEDS" }
    }
  ]
}
"""


def core_model(path):
    """image_embeds = the mean of each colour plane; text_embeds = the sum of the kept ids / 1000."""
    pixels = helper.make_tensor_value_info("pixel_values", TensorProto.FLOAT, ["b", 3, "h", "w"])
    ids = helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["b", "n"])
    mask = helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["b", "n"])
    image = helper.make_tensor_value_info("image_embeds", TensorProto.FLOAT, ["b", 3])
    text = helper.make_tensor_value_info("text_embeds", TensorProto.FLOAT, ["b", 1])
    axes = helper.make_tensor("axes", TensorProto.INT64, [2], [2, 3])
    one = helper.make_tensor("one", TensorProto.INT64, [1], [1])
    scale = helper.make_tensor("scale", TensorProto.FLOAT, [], [0.001])
    nodes = [
        helper.make_node("ReduceMean", ["pixel_values", "axes"], ["image_embeds"], keepdims=0),
        helper.make_node("Mul", ["input_ids", "attention_mask"], ["kept"]),
        helper.make_node("Cast", ["kept"], ["kept_f"], to=TensorProto.FLOAT),
        helper.make_node("ReduceSum", ["kept_f", "one"], ["total"], keepdims=1),
        helper.make_node("Mul", ["total", "scale"], ["text_embeds"]),
    ]
    graph = helper.make_graph(nodes, "clip-core", [pixels, ids, mask], [image, text], initializer=[axes, one, scale])
    models.save(graph, path, opset=18)


@pytest.fixture(scope="module")
def clip(tmp_path_factory):
    repo = str(tmp_path_factory.mktemp("clip"))
    models.python_model(repo, "clip-preprocess", PREPROCESS, PREPROCESS_CONFIG)
    core_model(os.path.join(repo, "clip-core", "1", "model.onnx"))
    models.write(os.path.join(repo, "clip-core", "config.pbtxt"), CORE_CONFIG)
    os.makedirs(os.path.join(repo, "clip", "1"))
    models.write(os.path.join(repo, "clip", "config.pbtxt"), ENSEMBLE)
    args = ["--model-repository", repo, "--model-control-mode=explicit", "--load-model=clip",
            "--load-model=clip-preprocess", "--load-model=clip-core", "--disable-auto-complete-config",
            "--strict-readiness"]
    with Server(args) as s:
        yield s, repo


def picture(seed):
    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 256, size=(40 + seed, 30 + 2 * seed, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return base64.b64encode(buf.getvalue())


def in_process(repo, images, texts):
    """The same steps without a server: the model.py functions, then ONNX Runtime."""
    scope = {}
    exec(PREPROCESS.replace("import triton_python_backend_utils as pb_utils", ""), scope)
    pixels = np.stack([scope["image_nchw"](b) for b in images])
    ids, mask = zip(*[scope["tokens"](t) for t in texts])
    session = ort.InferenceSession(os.path.join(repo, "clip-core", "1", "model.onnx"))
    return session.run(None, {"pixel_values": pixels, "input_ids": np.array(ids, dtype=np.int64),
                              "attention_mask": np.array(mask, dtype=np.int64)})


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_the_clip_shaped_repository_serves_like_the_steps_in_process(clip, protocol):
    s, repo = clip
    lib = httpclient if protocol == "http" else grpcclient
    client = s.client() if protocol == "http" else s.grpc_client()
    assert client.is_server_ready()
    images = [picture(1), picture(2)]
    texts = [b"a photo of a cat", b"A DIAGRAM"]
    ins = [lib.InferInput("BASE64IMAGE", [2, 1], "BYTES").set_data_from_numpy(np.array(images, dtype=np.object_).reshape(2, 1)),
           lib.InferInput("TEXT", [2, 1], "BYTES").set_data_from_numpy(np.array(texts, dtype=np.object_).reshape(2, 1))]
    r = client.infer("clip", ins)
    image, text = in_process(repo, images, texts)
    np.testing.assert_allclose(r.as_numpy("IMAGE_EMBEDS"), image, rtol=1e-6)
    np.testing.assert_allclose(r.as_numpy("TEXT_EMBEDS"), text, rtol=1e-6)
