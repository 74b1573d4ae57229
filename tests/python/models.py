"""Fixture model repositories for the integration tests, written with the `onnx` helpers."""
import os
import shutil

import ml_dtypes
import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

# protocol datatype -> (ONNX element type, numpy dtype used by tritonclient)
DATATYPES = {
    "BOOL": (TensorProto.BOOL, np.bool_),
    "UINT8": (TensorProto.UINT8, np.uint8),
    "UINT16": (TensorProto.UINT16, np.uint16),
    "UINT32": (TensorProto.UINT32, np.uint32),
    "UINT64": (TensorProto.UINT64, np.uint64),
    "INT8": (TensorProto.INT8, np.int8),
    "INT16": (TensorProto.INT16, np.int16),
    "INT32": (TensorProto.INT32, np.int32),
    "INT64": (TensorProto.INT64, np.int64),
    "FP16": (TensorProto.FLOAT16, np.float16),
    "FP32": (TensorProto.FLOAT, np.float32),
    "FP64": (TensorProto.DOUBLE, np.float64),
    "BYTES": (TensorProto.STRING, np.object_),
    "BF16": (TensorProto.BFLOAT16, None),  # ml_dtypes.bfloat16 in tritonclient
}
CONFIG_TYPE = {k: ("TYPE_STRING" if k == "BYTES" else f"TYPE_{k}") for k in DATATYPES}


def save(graph, path, opset=17):
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], producer_name="ferry-tests")
    model.ir_version = 8
    onnx.checker.check_model(model)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    onnx.save(model, path)


def write(path, text):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)


def identity(repo, name, datatype, batched=True, config=True):
    """INPUT0 -> OUTPUT0 unchanged; batched models take [-1, -1], others [-1]."""
    elem = DATATYPES[datatype][0]
    shape = ["batch", "n"] if batched else ["n"]
    x = helper.make_tensor_value_info("INPUT0", elem, shape)
    y = helper.make_tensor_value_info("OUTPUT0", elem, shape)
    graph = helper.make_graph([helper.make_node("Identity", ["INPUT0"], ["OUTPUT0"])], name, [x], [y])
    save(graph, os.path.join(repo, name, "1", "model.onnx"))
    if config:
        write(os.path.join(repo, name, "config.pbtxt"), f"""
max_batch_size: {8 if batched else 0}
input [ {{ name: "INPUT0" data_type: {CONFIG_TYPE[datatype]} dims: [ -1 ] }} ]
output [ {{ name: "OUTPUT0" data_type: {CONFIG_TYPE[datatype]} dims: [ -1 ] }} ]
""")


def add_mul(repo, name, versions=(1,), config=None, scale=None):
    """y = a + b and z = a * b on FP32 [-1, 4]; version v adds v-1 to y so versions differ."""
    for v in versions:
        a = helper.make_tensor_value_info("a", TensorProto.FLOAT, ["batch", 4])
        b = helper.make_tensor_value_info("b", TensorProto.FLOAT, ["batch", 4])
        y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])
        z = helper.make_tensor_value_info("z", TensorProto.FLOAT, ["batch", 4])
        offset = numpy_helper.from_array(np.array(float(v - 1), dtype=np.float32), "offset")
        nodes = [
            helper.make_node("Add", ["a", "b"], ["s"]),
            helper.make_node("Add", ["s", "offset"], ["y"]),
            helper.make_node("Mul", ["a", "b"], ["z"]),
        ]
        graph = helper.make_graph(nodes, name, [a, b], [y, z], initializer=[offset])
        save(graph, os.path.join(repo, name, str(v), "model.onnx"))
    if config is not None:
        write(os.path.join(repo, name, "config.pbtxt"), config)


ONNX_DATA = os.path.join(os.path.dirname(onnx.__file__), "backend", "test", "data", "light")


def densenet(repo, name="densenet_onnx"):
    """The DenseNet-121 of the ONNX model zoo, as shipped inside the `onnx` PyPI package (light
    weights), with the config of Triton's quick-start `densenet_onnx` (reshape and labels)."""
    dest = os.path.join(repo, name, "1", "model.onnx")
    os.makedirs(os.path.dirname(dest), exist_ok=True)
    shutil.copy(os.path.join(ONNX_DATA, "light_densenet121.onnx"), dest)
    write(os.path.join(repo, name, "labels.txt"), "".join(f"class_{i}\n" for i in range(1000)))
    write(os.path.join(repo, name, "config.pbtxt"), """
name: "densenet_onnx"
platform: "onnxruntime_onnx"
max_batch_size : 0
input [
  {
    name: "data_0"
    data_type: TYPE_FP32
    format: FORMAT_NCHW
    dims: [ 3, 224, 224 ]
    reshape { shape: [ 1, 3, 224, 224 ] }
  }
]
output [
  {
    name: "fc6_1"
    data_type: TYPE_FP32
    dims: [ 1000 ]
    reshape { shape: [ 1, 1000, 1, 1 ] }
    label_filename: "labels.txt"
  }
]
""")
    return os.path.join(ONNX_DATA, "light_densenet121.onnx")


RNG = np.random.default_rng(7)


def sample(datatype, shape):
    if datatype == "BYTES":
        return np.array([f"s{i}-é".encode() for i in range(int(np.prod(shape)))], dtype=np.object_).reshape(shape)
    if datatype == "BOOL":
        return RNG.integers(0, 2, size=shape).astype(np.bool_)
    if datatype == "BF16":
        return RNG.standard_normal(shape).astype(ml_dtypes.bfloat16)
    np_type = DATATYPES[datatype][1]
    if np.issubdtype(np_type, np.integer):
        info = np.iinfo(np_type)
        return RNG.integers(info.min, info.max, size=shape, dtype=np_type, endpoint=True)
    return RNG.standard_normal(shape).astype(np_type)


SILERO_VERSION = "6.2.3"
SILERO_CONFIG = """
name: "silero_vad"
backend: "onnxruntime"
max_batch_size: 0
input [
  { name: "input" data_type: TYPE_FP32 dims: [ -1, -1 ] },
  { name: "state" data_type: TYPE_FP32 dims: [ 2, -1, 128 ] },
  { name: "sr" data_type: TYPE_INT64 dims: [ 1 ] }
]
output [
  { name: "output" data_type: TYPE_FP32 dims: [ -1, 1 ] },
  { name: "stateN" data_type: TYPE_FP32 dims: [ 2, -1, 128 ] }
]
"""


def silero_vad_file():
    """The Silero VAD ONNX file (scalar input `sr`, recurrent `state`) from the PyPI `silero-vad`
    wheel, downloaded once (no dependencies) into .venv/test-models."""
    import subprocess
    import sys
    import zipfile

    cache = os.path.join(os.path.dirname(os.path.dirname(sys.executable)), "test-models")
    dest = os.path.join(cache, f"silero_vad-{SILERO_VERSION}.onnx")
    if not os.path.exists(dest):
        os.makedirs(cache, exist_ok=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
                        "-d", cache, f"silero-vad=={SILERO_VERSION}"], check=True)
        wheel = os.path.join(cache, f"silero_vad-{SILERO_VERSION}-py3-none-any.whl")
        with zipfile.ZipFile(wheel) as z, open(dest + ".partial", "wb") as out:
            out.write(z.read("silero_vad/data/silero_vad.onnx"))
        os.replace(dest + ".partial", dest)
    return dest


def silero_vad(repo, name="silero_vad", config=SILERO_CONFIG):
    dest = os.path.join(repo, name, "1", "model.onnx")
    os.makedirs(os.path.dirname(dest), exist_ok=True)
    shutil.copy(silero_vad_file(), dest)
    if config is not None:
        write(os.path.join(repo, name, "config.pbtxt"), config.replace("silero_vad", name))
    return dest


def scalars(repo):
    """Two small models with scalar tensors: `total` (no batching) sums a vector into a scalar
    output and adds a scalar input; `per_row` (batching) doubles a per-row scalar."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n"])
    k = helper.make_tensor_value_info("k", TensorProto.FLOAT, [])
    s = helper.make_tensor_value_info("s", TensorProto.FLOAT, [])
    nodes = [helper.make_node("ReduceSum", ["x"], ["sum"], keepdims=0), helper.make_node("Add", ["sum", "k"], ["s"])]
    save(helper.make_graph(nodes, "total", [x, k], [s]), os.path.join(repo, "total", "1", "model.onnx"))
    r = helper.make_tensor_value_info("r", TensorProto.FLOAT, ["batch"])
    d = helper.make_tensor_value_info("d", TensorProto.FLOAT, ["batch"])
    two = numpy_helper.from_array(np.array(2.0, dtype=np.float32), "two")
    graph = helper.make_graph([helper.make_node("Mul", ["r", "two"], ["d"])], "per_row", [r], [d], initializer=[two])
    save(graph, os.path.join(repo, "per_row", "1", "model.onnx"))


def python_model(repo, name, code, config=None, version=1):
    """A Python-backend model: `code` is its model.py; `config` its config.pbtxt (None: none)."""
    write(os.path.join(repo, name, str(version), "model.py"), code)
    if config is not None:
        write(os.path.join(repo, name, "config.pbtxt"), config)


ADD_SUB_PY = '''
import json
import os
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.config = json.loads(args["model_config"])
        out = pb_utils.get_output_config_by_name(self.config, "OUTPUT0")
        self.dtype = pb_utils.triton_string_to_numpy(out["data_type"])
        self.args = args
        pb_utils.Logger.log_info(f"initialized {args['model_name']} version {args['model_version']}")

    def execute(self, requests):
        responses = []
        for request in requests:
            a = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            b = pb_utils.get_input_tensor_by_name(request, "INPUT1").as_numpy()
            if (a < 0).any():
                responses.append(pb_utils.InferenceResponse(error=pb_utils.TritonError("negative input", pb_utils.TritonError.INVALID_ARG)))
                continue
            if (a == 13).any():
                raise ValueError("unlucky 13")
            outs = [pb_utils.Tensor("OUTPUT0", (a + b).astype(self.dtype)),
                    pb_utils.Tensor("OUTPUT1", (a - b).astype(self.dtype)),
                    pb_utils.Tensor("BATCH", np.full((a.shape[0], 1), len(requests), dtype=np.int32)),
                    pb_utils.Tensor("PID", np.full((a.shape[0], 1), os.getpid(), dtype=np.int64))]
            responses.append(pb_utils.InferenceResponse(output_tensors=outs))
        return responses
'''


def add_sub_config(dtype="TYPE_FP32", max_batch_size=8, extra=""):
    return f"""
backend: "python"
max_batch_size: {max_batch_size}
dynamic_batching {{ max_queue_delay_microseconds: 20000 }}
input [ {{ name: "INPUT0" data_type: {dtype} dims: [ 4 ] }}, {{ name: "INPUT1" data_type: {dtype} dims: [ 4 ] }} ]
output [ {{ name: "OUTPUT0" data_type: {dtype} dims: [ 4 ] }}, {{ name: "OUTPUT1" data_type: {dtype} dims: [ 4 ] }},
         {{ name: "BATCH" data_type: TYPE_INT32 dims: [ 1 ] }}, {{ name: "PID" data_type: TYPE_INT64 dims: [ 1 ] }} ]
{extra}
"""


def accumulator(repo, name="accumulator", max_batch_size=8, strategy="direct { }", idle_us=1000000, instances=1):
    """A stateful model for the sequence batcher: OUTPUT = ACC_IN + INPUT (ACC_IN/ACC_OUT the
    implicit state); CORR and START_OUT echo the CORRID and START control inputs."""
    f = TensorProto.FLOAT
    ins = [helper.make_tensor_value_info("INPUT", f, ["b", 1]), helper.make_tensor_value_info("ACC_IN", f, ["b", 1]),
           helper.make_tensor_value_info("START", TensorProto.INT32, ["b", 1]),
           helper.make_tensor_value_info("CORRID", TensorProto.UINT64, ["b", 1])]
    outs = [helper.make_tensor_value_info(n, f, ["b", 1]) for n in ("OUTPUT", "ACC_OUT", "CORR", "START_OUT")]
    nodes = [helper.make_node("Add", ["ACC_IN", "INPUT"], ["OUTPUT"]), helper.make_node("Identity", ["OUTPUT"], ["ACC_OUT"]),
             helper.make_node("Cast", ["CORRID"], ["CORR"], to=f), helper.make_node("Cast", ["START"], ["START_OUT"], to=f)]
    save(helper.make_graph(nodes, name, ins, outs), os.path.join(repo, name, "1", "model.onnx"))
    write(os.path.join(repo, name, "config.pbtxt"), f"""
max_batch_size: {max_batch_size}
input [ {{ name: "INPUT" data_type: TYPE_FP32 dims: [ 1 ] }} ]
output [ {{ name: "OUTPUT" data_type: TYPE_FP32 dims: [ 1 ] }}, {{ name: "CORR" data_type: TYPE_FP32 dims: [ 1 ] }},
         {{ name: "START_OUT" data_type: TYPE_FP32 dims: [ 1 ] }} ]
instance_group [ {{ count: {instances} kind: KIND_CPU }} ]
sequence_batching {{
  max_sequence_idle_microseconds: {idle_us}
  {strategy}
  control_input [
    {{ name: "START" control [ {{ kind: CONTROL_SEQUENCE_START int32_false_true: [ 0, 1 ] }} ] }},
    {{ name: "CORRID" control [ {{ kind: CONTROL_SEQUENCE_CORRID data_type: TYPE_UINT64 }} ] }}
  ]
  state [ {{ input_name: "ACC_IN" output_name: "ACC_OUT" data_type: TYPE_FP32 dims: [ 1 ]
            initial_state: {{ data_type: TYPE_FP32 dims: [ 1 ] zero_data: true name: "zero" }} }} ]
}}
""")


SILERO_STATEFUL = """
name: "silero_vad"
backend: "onnxruntime"
max_batch_size: 0
input [
  { name: "input" data_type: TYPE_FP32 dims: [ -1, -1 ] },
  { name: "sr" data_type: TYPE_INT64 dims: [ 1 ] }
]
output [ { name: "output" data_type: TYPE_FP32 dims: [ -1, 1 ] } ]
sequence_batching {
  max_sequence_idle_microseconds: 10000000
  state [ { input_name: "state" output_name: "stateN" data_type: TYPE_FP32 dims: [ 2, 1, 128 ]
            initial_state: { data_type: TYPE_FP32 dims: [ 2, 1, 128 ] zero_data: true name: "zeros" } } ]
}
"""


FLOOD = '''
import os
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            n = int(pb_utils.get_input_tensor_by_name(request, "COUNT").as_numpy().reshape(-1)[0])
            sent = 0
            for i in range(n):
                if request.is_cancelled():
                    break
                sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.full(1 << 18, i, dtype=np.int32))]))
                sent += 1
            with open(os.environ["FERRY_TEST_SENT"], "a") as f:
                f.write(f"{sent}\\n")
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
'''


def flood(repo, name="flood", instances=1):
    """A decoupled model that sends COUNT responses of 1 MB as fast as it can, until the request
    is cancelled; it appends how many it sent to the file $FERRY_TEST_SENT."""
    python_model(repo, name, FLOOD, f"""
backend: "python"
max_batch_size: 0
model_transaction_policy {{ decoupled: true }}
instance_group [ {{ count: {instances} kind: KIND_CPU }} ]
input [ {{ name: "COUNT" data_type: TYPE_INT32 dims: [ 1 ] }} ]
output [ {{ name: "OUT" data_type: TYPE_INT32 dims: [ -1 ] }} ]
""")
