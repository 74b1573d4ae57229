"""OpenVINO models (`backend: "openvino"`) through the real server, on the OpenVINO of its PyPI
wheel: a small CNN as an IR converted from ONNX (fixed batch 1, served batched), the ONNX file
itself (auto-completed), a fixed batch padded (`SKIP_OV_DYNAMIC_BATCHSIZE`,
`ENABLE_BATCH_PADDING`), images of any size (`RESHAPE_IO_LAYERS`), INT64 and FP16 tensors; each
compared with the same model compiled by OpenVINO in this process, over HTTP (binary and JSON) and
gRPC; batches formed under concurrency; an ensemble and warm-up; bad inputs answered 400; a corrupt
model, bad parameters and a missing library failing only their own model."""
import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from onnx import TensorProto, helper, numpy_helper
from tritonclient.utils import InferenceServerException

import models
from ferry_server import Server

ov = pytest.importorskip("openvino")

RNG = np.random.default_rng(11)
IMAGES = RNG.normal(size=(6, 3, 16, 16)).astype(np.float32)


def cnn(path, batch):
    """Conv 3->8 (3x3), ReLU, global average pool, a 8->5 dense layer; `batch` fixes dim 0."""
    w = numpy_helper.from_array(RNG.normal(size=(8, 3, 3, 3)).astype(np.float32) * 0.3, "w")
    b = numpy_helper.from_array(RNG.normal(size=(8,)).astype(np.float32), "b")
    fc = numpy_helper.from_array(RNG.normal(size=(8, 5)).astype(np.float32), "fc")
    x = helper.make_tensor_value_info("IMAGE", TensorProto.FLOAT, [batch, 3, "h", "w"])
    y = helper.make_tensor_value_info("LOGITS", TensorProto.FLOAT, [batch, 5])
    nodes = [
        helper.make_node("Conv", ["IMAGE", "w", "b"], ["c"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c"], ["r"]),
        helper.make_node("GlobalAveragePool", ["r"], ["p"]),
        helper.make_node("Flatten", ["p"], ["f"]),
        helper.make_node("MatMul", ["f", "fc"], ["LOGITS"]),
    ]
    models.save(helper.make_graph(nodes, "cnn", [x], [y], [w, b, fc]), path)


def two_types(path):
    """SUM = A + A (INT64), HALF = B * 0.5 (FP16)."""
    a = helper.make_tensor_value_info("A", TensorProto.INT64, ["n", 4])
    b = helper.make_tensor_value_info("B", TensorProto.FLOAT16, ["n", 4])
    s = helper.make_tensor_value_info("SUM", TensorProto.INT64, ["n", 4])
    h = helper.make_tensor_value_info("HALF", TensorProto.FLOAT16, ["n", 4])
    half = numpy_helper.from_array(np.array(0.5, dtype=np.float16), "half")
    nodes = [helper.make_node("Add", ["A", "A"], ["SUM"]), helper.make_node("Mul", ["B", "half"], ["HALF"])]
    models.save(helper.make_graph(nodes, "two", [a, b], [s, h], [half]), path)


def scalar_sum(path):
    """S = sum(X), a scalar (rank 0) output."""
    x = helper.make_tensor_value_info("X", TensorProto.FLOAT, [4])
    y = helper.make_tensor_value_info("S", TensorProto.FLOAT, [])
    node = helper.make_node("ReduceSum", ["X"], ["S"], keepdims=0)
    models.save(helper.make_graph([node], "sum", [x], [y]), path, opset=11)


def to_ir(onnx_path, xml_path):
    os.makedirs(os.path.dirname(xml_path), exist_ok=True)
    ov.save_model(ov.convert_model(onnx_path), xml_path)


def config(name, body, params=(), extra="", precision="f32"):
    if precision:
        params = [*params, ("INFERENCE_PRECISION_HINT", precision)]
    ps = "".join(f'parameters {{ key: "{k}" value: {{ string_value: "{v}" }} }}\n' for k, v in params)
    return f'name: "{name}"\nbackend: "openvino"\n{body}\n{ps}{extra}'


CNN_IO = '''input [{ name: "IMAGE" data_type: TYPE_FP32 dims: [ 3, 16, 16 ] }]
output [{ name: "LOGITS" data_type: TYPE_FP32 dims: [ 5 ] }]'''


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    root = tmp_path_factory.mktemp("openvino")
    repo = root / "repo"
    src = str(root / "src")
    cnn(os.path.join(src, "cnn1.onnx"), 1)
    cnn(os.path.join(src, "cnn4.onnx"), 4)
    cnn(os.path.join(src, "cnn_any.onnx"), "batch")

    def put(name, text, files):
        os.makedirs(repo / name / "1", exist_ok=True)
        for dest, source in files.items():
            path = repo / name / "1" / dest
            if source.endswith(".onnx") and dest.endswith(".xml"):
                to_ir(source, str(path))
            else:
                os.makedirs(path.parent, exist_ok=True)
                path.write_bytes(open(source, "rb").read())
        (repo / name / "config.pbtxt").write_text(text)

    put("cnn_ir", config("cnn_ir", f"max_batch_size: 8\ndynamic_batching {{ max_queue_delay_microseconds: 20000 }}\n{CNN_IO}",
                         extra=f'''model_warmup [{{ name: "w" batch_size: 2
  inputs {{ key: "IMAGE" value: {{ data_type: TYPE_FP32 dims: [ 3, 16, 16 ] random_data: true }} }} }}]
instance_group [{{ kind: KIND_CPU count: 2 }}]'''), {"model.xml": os.path.join(src, "cnn1.onnx")})
    # The ONNX file read by OpenVINO, its inputs and outputs from the model.
    put("cnn_onnx", config("cnn_onnx", 'max_batch_size: 8\ndefault_model_filename: "model.onnx"',
                           [("PERFORMANCE_HINT", "THROUGHPUT"), ("NUM_STREAMS", "1"), ("INFERENCE_NUM_THREADS", "1")],
                           precision=None),
        {"model.onnx": os.path.join(src, "cnn_any.onnx")})
    put("cnn_padded", config("cnn_padded", f"max_batch_size: 4\n{CNN_IO}",
                             [("SKIP_OV_DYNAMIC_BATCHSIZE", "YES"), ("ENABLE_BATCH_PADDING", "YES")]),
        {"model.xml": os.path.join(src, "cnn4.onnx")})
    put("cnn_fixed", config("cnn_fixed", f"max_batch_size: 4\n{CNN_IO}", [("SKIP_OV_DYNAMIC_BATCHSIZE", "YES")]),
        {"model.xml": os.path.join(src, "cnn4.onnx")})
    put("cnn_any_size", config("cnn_any_size", '''max_batch_size: 4
input [{ name: "IMAGE" data_type: TYPE_FP32 dims: [ -1, -1, -1 ] }]
output [{ name: "LOGITS" data_type: TYPE_FP32 dims: [ 5 ] }]''', [("RESHAPE_IO_LAYERS", "YES")]),
        {"model.xml": os.path.join(src, "cnn1.onnx")})
    two_types(os.path.join(src, "two.onnx"))
    put("two_types", config("two_types", "max_batch_size: 8"), {"model.xml": os.path.join(src, "two.onnx")})
    scalar_sum(os.path.join(src, "sum.onnx"))
    put("scalar_out", config("scalar_out", 'max_batch_size: 0\ndefault_model_filename: "model.onnx"'),
        {"model.onnx": os.path.join(src, "sum.onnx")})
    # Taken, and without effect (a core-wide setting in OpenVINO).
    put("compile_threads", config("compile_threads", f"max_batch_size: 8\n{CNN_IO}", [("COMPILATION_NUM_THREADS", "1")]),
        {"model.xml": os.path.join(src, "cnn1.onnx")})
    # Failures, each of its own model.
    put("never_full", config("never_full", f"max_batch_size: 2\n{CNN_IO}", [("SKIP_OV_DYNAMIC_BATCHSIZE", "YES")]),
        {"model.xml": os.path.join(src, "cnn4.onnx")})
    (root / "junk.xml").write_text("<net><layers><layer id='0' type='Banana'/></layers></net>")
    put("corrupt", config("corrupt", "max_batch_size: 0"), {"model.xml": str(root / "junk.xml")})
    put("bad_streams", config("bad_streams", f"max_batch_size: 8\n{CNN_IO}", [("NUM_STREAMS", "0")]),
        {"model.xml": os.path.join(src, "cnn1.onnx")})
    put("too_big", config("too_big", f"max_batch_size: 8\n{CNN_IO}", [("SKIP_OV_DYNAMIC_BATCHSIZE", "YES")]),
        {"model.xml": os.path.join(src, "cnn4.onnx")})
    put("no_file", config("no_file", "max_batch_size: 0"), {})
    # A pipe would block OpenVINO's read forever: the model, and an IR's weights.
    put("fifo_xml", config("fifo_xml", "max_batch_size: 0"), {})
    os.mkfifo(repo / "fifo_xml" / "1" / "model.xml")
    put("fifo_bin", config("fifo_bin", f"max_batch_size: 8\n{CNN_IO}"), {"model.xml": os.path.join(src, "cnn1.onnx")})
    os.remove(repo / "fifo_bin" / "1" / "model.bin")
    os.mkfifo(repo / "fifo_bin" / "1" / "model.bin")
    (repo / "both").mkdir()
    (repo / "both" / "1").mkdir()
    (repo / "both" / "config.pbtxt").write_text('''platform: "ensemble"
max_batch_size: 8
input [{ name: "X" data_type: TYPE_FP32 dims: [ 3, 16, 16 ] }]
output [{ name: "FROM_IR" data_type: TYPE_FP32 dims: [ 5 ] }, { name: "FROM_ONNX" data_type: TYPE_FP32 dims: [ 5 ] }]
ensemble_scheduling { step [
  { model_name: "cnn_ir" model_version: -1 input_map { key: "IMAGE" value: "X" } output_map { key: "LOGITS" value: "FROM_IR" } },
  { model_name: "cnn_onnx" model_version: -1 input_map { key: "IMAGE" value: "X" } output_map { key: "LOGITS" value: "FROM_ONNX" } } ] }
''')
    return str(repo), src


@pytest.fixture(scope="module")
def server(made):
    with Server(["--model-repository", made[0], "--exit-on-error=false"], timeout=120) as s:
        yield s


def in_process(path, arrays, reshape=None, precision="f32"):
    """The same model file compiled by OpenVINO here (precision None: OpenVINO's default, bf16
    on CPUs that have it): outputs by name."""
    core = ov.Core()
    model = core.read_model(path)
    if reshape:
        model.reshape(reshape)
    compiled = core.compile_model(model, "CPU", {"INFERENCE_PRECISION_HINT": precision} if precision else {})
    result = compiled(arrays)
    return {o.get_any_name(): result[o] for o in compiled.outputs}


def http_infer(server, model, arrays, binary=True):
    c = httpclient.InferenceServerClient(server.url)
    inputs = []
    for name, a in arrays.items():
        i = httpclient.InferInput(name, list(a.shape), {np.float32: "FP32", np.int64: "INT64", np.float16: "FP16"}[a.dtype.type])
        i.set_data_from_numpy(a, binary_data=binary)
        inputs.append(i)
    return c.infer(model, inputs)


def grpc_infer(server, model, arrays):
    c = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
    inputs = []
    for name, a in arrays.items():
        i = grpcclient.InferInput(name, list(a.shape), {np.float32: "FP32", np.int64: "INT64", np.float16: "FP16"}[a.dtype.type])
        i.set_data_from_numpy(a)
        inputs.append(i)
    return c.infer(model, inputs)


@pytest.mark.parametrize("model", ["cnn_ir", "cnn_onnx", "cnn_padded"])
def test_outputs_equal_openvino_in_process(server, made, model):
    repo = made[0]
    file = "model.onnx" if model == "cnn_onnx" else "model.xml"
    path = os.path.join(repo, model, "1", file)
    batch = 4 if model == "cnn_padded" else 1
    precision = None if model == "cnn_onnx" else "f32"
    want = np.concatenate([in_process(path, {"IMAGE": IMAGES[k:k + batch]}, precision=precision)["LOGITS"]
                           for k in range(0, 4, batch)])
    # OpenVINO's default precision (bf16 here) rounds differently at other batch sizes.
    tol = dict(rtol=1e-4, atol=1e-5) if precision else dict(rtol=3e-2, atol=3e-2)
    for rows in (slice(0, 1), slice(0, 3), slice(0, 4)):
        x = IMAGES[rows]
        np.testing.assert_allclose(http_infer(server, model, {"IMAGE": x}).as_numpy("LOGITS"), want[rows], **tol)
        np.testing.assert_allclose(grpc_infer(server, model, {"IMAGE": x}).as_numpy("LOGITS"), want[rows], **tol)
    got = http_infer(server, model, {"IMAGE": IMAGES[:2]}, binary=False).as_numpy("LOGITS")
    np.testing.assert_allclose(got, want[:2], **tol)


def test_images_of_any_size_with_reshape_io_layers(server, made):
    x = RNG.normal(size=(2, 3, 24, 20)).astype(np.float32)
    want = in_process(os.path.join(made[0], "cnn_any_size", "1", "model.xml"), {"IMAGE": x},
                      reshape={"IMAGE": [-1, -1, -1, -1]})["LOGITS"]
    np.testing.assert_allclose(grpc_infer(server, "cnn_any_size", {"IMAGE": x}).as_numpy("LOGITS"), want, rtol=1e-4, atol=1e-5)
    meta = httpclient.InferenceServerClient(server.url).get_model_metadata("cnn_any_size")
    assert meta["inputs"][0]["shape"] == [-1, -1, -1, -1]


def test_int64_and_fp16_tensors(server, made):
    a = np.arange(8, dtype=np.int64).reshape(2, 4) * 1_000_000_007
    b = RNG.normal(size=(2, 4)).astype(np.float16)
    r = http_infer(server, "two_types", {"A": a, "B": b})
    want = in_process(os.path.join(made[0], "two_types", "1", "model.xml"), {"A": a, "B": b})
    # OpenVINO's CPU plugin adds 64-bit integers in 32 bits (it wraps past 2^31), in-process too.
    np.testing.assert_array_equal(r.as_numpy("SUM"), want["SUM"])
    np.testing.assert_array_equal(r.as_numpy("SUM")[0, :2], (a + a)[0, :2])
    np.testing.assert_array_equal(r.as_numpy("HALF"), want["HALF"])
    np.testing.assert_allclose(r.as_numpy("HALF"), b * np.float16(0.5), rtol=1e-3)
    config = httpclient.InferenceServerClient(server.url).get_model_config("two_types")
    assert {o["name"]: o["data_type"] for o in config["output"]} == {"SUM": "TYPE_INT64", "HALF": "TYPE_FP16"}


def test_a_scalar_output(server):
    x = np.array([1.5, 2.0, -0.5, 4.0], dtype=np.float32)
    r = grpc_infer(server, "scalar_out", {"X": x})
    # As for ONNX models, a scalar is written dims [ 1 ] and answered as [1].
    np.testing.assert_array_equal(r.as_numpy("S"), np.array([7.0], dtype=np.float32))


def test_auto_complete_from_the_model(server):
    config = httpclient.InferenceServerClient(server.url).get_model_config("cnn_onnx")
    assert [(i["name"], i["data_type"], [int(d) for d in i["dims"]]) for i in config["input"]] == \
        [("IMAGE", "TYPE_FP32", [3, -1, -1])], config["input"]
    assert [(o["name"], [int(d) for d in o["dims"]]) for o in config["output"]] == [("LOGITS", [5])]
    assert config["max_batch_size"] == 8 and config["backend"] == "openvino"


def test_batches_form_under_concurrency(server, made):
    ir = os.path.join(made[0], "cnn_ir", "1", "model.xml")
    want = np.concatenate([in_process(ir, {"IMAGE": IMAGES[k:k + 1]})["LOGITS"] for k in range(6)])
    c = httpclient.InferenceServerClient(server.url)
    before = c.get_inference_statistics("cnn_ir")["model_stats"][0]
    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(lambda k: http_infer(server, "cnn_ir", {"IMAGE": IMAGES[k % 6:k % 6 + 1]}).as_numpy("LOGITS"),
                                range(64)))
    for k, got in enumerate(results):
        np.testing.assert_allclose(got, want[k % 6:k % 6 + 1], rtol=1e-4, atol=1e-5)
    after = c.get_inference_statistics("cnn_ir")["model_stats"][0]
    inferences = after["inference_count"] - before["inference_count"]
    executions = after["execution_count"] - before["execution_count"]
    assert inferences == 64 and executions < inferences, (executions, inferences)


def test_an_ensemble_of_ir_and_onnx(server, made):
    x = IMAGES[:3]
    r = grpc_infer(server, "both", {"X": x})
    # The two models hold different random weights; each equals its own in-process result.
    path = os.path.join(made[0], "cnn_ir", "1", "model.xml")
    ir = np.concatenate([in_process(path, {"IMAGE": x[k:k + 1]})["LOGITS"] for k in range(3)])
    np.testing.assert_allclose(r.as_numpy("FROM_IR"), ir, rtol=1e-4, atol=1e-5)
    onnx = in_process(os.path.join(made[0], "cnn_onnx", "1", "model.onnx"), {"IMAGE": x}, precision=None)["LOGITS"]
    np.testing.assert_allclose(r.as_numpy("FROM_ONNX"), onnx, rtol=3e-2, atol=3e-2)


def test_bad_inputs_are_400_and_the_server_keeps_serving(server):
    with pytest.raises(InferenceServerException, match=r"\[400\].*IMAGE"):
        http_infer(server, "cnn_ir", {"IMAGE": np.zeros((1, 3, 8, 8), dtype=np.float32)})
    with pytest.raises(InferenceServerException, match=r"\[400\].*FP64|\[400\].*datatype"):
        c = httpclient.InferenceServerClient(server.url)
        i = httpclient.InferInput("IMAGE", [1, 3, 16, 16], "FP64")
        i.set_data_from_numpy(np.zeros((1, 3, 16, 16)))
        c.infer("cnn_ir", [i])
    # A fixed batch without padding takes only full batches, in Triton's words.
    with pytest.raises(InferenceServerException, match=r"expected requests with batch size '4', got '1'"):
        http_infer(server, "cnn_fixed", {"IMAGE": IMAGES[:1]})
    assert http_infer(server, "cnn_fixed", {"IMAGE": IMAGES[:4]}).as_numpy("LOGITS").shape == (4, 5)
    # A shape the model cannot take (2 channels for a convolution of 3) is the request's error.
    with pytest.raises(InferenceServerException, match=r"\[400\] OpenVINO running the model failed") as e:
        http_infer(server, "cnn_any_size", {"IMAGE": np.zeros((1, 2, 8, 8), dtype=np.float32)})
    assert http_infer(server, "cnn_ir", {"IMAGE": IMAGES[:1]}).as_numpy("LOGITS").shape == (1, 5)


def test_failures_stay_with_their_model(server):
    c = httpclient.InferenceServerClient(server.url)
    index = {m["name"]: m for m in c.get_model_repository_index()}
    assert "fixed at 4 and max_batch_size is 2" in index["never_full"]["reason"], index["never_full"]
    for name in ["fifo_xml", "fifo_bin"]:
        assert index[name]["state"] == "UNAVAILABLE" and "is not a regular file" in index[name]["reason"], index[name]
    for name in ["corrupt", "bad_streams", "too_big", "no_file"]:
        assert index[name]["state"] == "UNAVAILABLE", (name, index[name])
    assert "OpenVINO reading" in index["corrupt"]["reason"], index["corrupt"]
    assert "NUM_STREAMS is '0'" in index["bad_streams"]["reason"]
    assert "max_batch_size 8 is more than the model's fixed batch dimension (4) takes" in index["too_big"]["reason"]
    assert "model.xml" in index["no_file"]["reason"], index["no_file"]
    for name in ["cnn_ir", "cnn_onnx", "cnn_padded", "cnn_fixed", "cnn_any_size", "two_types", "both", "compile_threads"]:
        assert c.is_model_ready(name), (name, index.get(name))


def test_bf16_advice_where_openvino_picks_bf16_without_amx(server):
    """cnn_onnx names no precision: OpenVINO chooses, and on a CPU with AVX-512 BF16 but no AMX
    (bf16 there can be slower than f32) the load says so. Models that name f32 never get it."""
    flags = next((l.split(":", 1)[1].split() for l in open("/proc/cpuinfo") if l.startswith("flags")), [])
    without_amx = "avx512_bf16" in flags and "amx_bf16" not in flags
    advice = [l for l in server.log().splitlines() if "AVX-512 BF16 but no AMX" in l]
    assert any("model=cnn_onnx" in l for l in advice) == without_amx, (flags, advice)
    assert not any("model=cnn_ir" in l for l in advice), advice
    if without_amx:
        assert 'set the parameter INFERENCE_PRECISION_HINT to "f32"' in advice[0], advice


def test_a_missing_library_fails_only_its_models(made):
    with Server(["--model-repository", made[0], "--exit-on-error=false", "--model-control-mode=explicit",
                 "--load-model=cnn_ir", "--backend-config=openvino,library=/nonexistent/libopenvino_c.so"]) as s:
        c = httpclient.InferenceServerClient(s.url)
        reason = {m["name"]: m for m in c.get_model_repository_index()}["cnn_ir"]["reason"]
        assert "no OpenVINO library at '/nonexistent/libopenvino_c.so'" in reason, reason
        assert "openvino,library=<path> or FERRY_OPENVINO_LIBRARY" in reason

