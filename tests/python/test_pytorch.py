"""PyTorch models through the real server on the official PyTorch from PyPI: TorchScript, run
inside the server through ferry's shim over libtorch's C++ API (and in a PyTorch process where a
model's parameters change libtorch for the whole process)
(`pytorch_libtorch`: an MLP, a CNN with batch norm over images of any size, a model whose inputs
are named by forward's arguments with two INT64 outputs, FP16, BF16, strings, `max_batch_size: 0`), each compared with the same model run in-process by
PyTorch, over HTTP (JSON and binary) and gRPC; batches formed under concurrency; bad inputs
answered 400; a corrupt file and a missing PyTorch failing only their own model. AOTInductor
packages are test_pytorch_aoti.py's.

The models are made by FERRY_TORCH_PYTHON (scripts/torch.sh makes one); without it these tests
skip, unless FERRY_REQUIRE_TORCH=1 (CI sets it)."""
import glob
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from conftest import framework_python
from ferry_server import Server

TORCH_PYTHON = framework_python("FERRY_TORCH_PYTHON", "FERRY_REQUIRE_TORCH", "torch.sh", "PyTorch")

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    root = tmp_path_factory.mktemp("torch")
    repo = root / "repo"
    repo.mkdir()
    subprocess.run([TORCH_PYTHON, os.path.join(HERE, "torch_models.py"), str(repo)], check=True)
    return str(repo), dict(np.load(root / "expected.npz"))


@pytest.fixture(scope="module")
def server(made):
    repo, _ = made
    # Two models fail on purpose; the others serve.
    with Server(["--model-repository", repo, f"--backend-config=pytorch,python={TORCH_PYTHON}",
                 "--exit-on-error=false"], timeout=300) as s:  # a dozen processes import torch at once
        yield s


@pytest.fixture(scope="module")
def expected(made):
    return made[1]


def http_infer(server, model, arrays, binary=True, outputs=None):
    c = httpclient.InferenceServerClient(server.url)
    inputs = []
    for name, a in arrays.items():
        i = httpclient.InferInput(name, list(a.shape), "BYTES" if a.dtype == object else str(np_type(a)))
        i.set_data_from_numpy(a, binary_data=binary)
        inputs.append(i)
    outs = [httpclient.InferRequestedOutput(o, binary_data=binary) for o in outputs or []]
    return c.infer(model, inputs, outputs=outs or None)


def grpc_infer(server, model, arrays):
    c = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
    inputs = []
    for name, a in arrays.items():
        i = grpcclient.InferInput(name, list(a.shape), np_type(a))
        i.set_data_from_numpy(a)
        inputs.append(i)
    return c.infer(model, inputs)


def np_type(a):
    from tritonclient.utils import np_to_triton_dtype
    return np_to_triton_dtype(a.dtype)


def test_torchscript_outputs_equal_pytorch_in_process(server, expected):
    x, want = expected["mlp_in"], expected["mlp_out"]
    for binary in (True, False):
        got = http_infer(server, "mlp", {"INPUT__0": x}, binary=binary, outputs=["OUTPUT__0"]).as_numpy("OUTPUT__0")
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(grpc_infer(server, "mlp", {"INPUT__0": x}).as_numpy("OUTPUT__0"), want, rtol=1e-5,
                               atol=1e-6)
    for k in (0, 1):  # two image sizes: variable dimensions
        got = grpc_infer(server, "cnn", {"INPUT__0": expected[f"cnn_in{k}"]}).as_numpy("OUTPUT__0")
        np.testing.assert_allclose(got, expected[f"cnn_out{k}"], rtol=1e-5, atol=1e-6)
    # Inputs by forward's argument names (config order differs), INT64 beyond 32 bits, two outputs.
    two = http_infer(server, "two", {"scale": expected["two_scale"], "count": expected["two_count"]})
    np.testing.assert_array_equal(two.as_numpy("SUM__0"), expected["two_sum"])
    np.testing.assert_array_equal(two.as_numpy("PRODUCT__1"), expected["two_product"])
    half = grpc_infer(server, "half", {"INPUT__0": expected["half_in"]}).as_numpy("OUTPUT__0")
    assert half.dtype == np.float16
    np.testing.assert_array_equal(half, expected["half_out"])
    words = http_infer(server, "words", {"INPUT__0": np.array([b"red", b"fire"], dtype=object)})
    assert words.as_numpy("OUTPUT__0").tolist() == [b"RED", b"FIRE"]
    meta = httpclient.InferenceServerClient(server.url).get_model_metadata("mlp")
    assert meta["platform"] == "pytorch_libtorch"


def test_bf16_tensors_pass_both_ways(server, expected):
    import ml_dtypes
    x, want = expected["bf16_in"].astype(ml_dtypes.bfloat16), expected["bf16_out"]
    h = httpclient.InferInput("INPUT__0", list(x.shape), "BF16")
    h.set_data_from_numpy(x, binary_data=True)
    got = httpclient.InferenceServerClient(server.url).infer(
        "mlp_bf16", [h], outputs=[httpclient.InferRequestedOutput("OUTPUT__0", binary_data=True)])
    np.testing.assert_allclose(got.as_numpy("OUTPUT__0").astype(np.float32), want, rtol=2e-2, atol=2e-2)
    g = grpcclient.InferInput("INPUT__0", [1, 16], "BF16")
    g.set_data_from_numpy(x[2:3])
    got = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}").infer("mlp_bf16", [g])
    np.testing.assert_allclose(got.as_numpy("OUTPUT__0").astype(np.float32), want[2:3], rtol=2e-2, atol=2e-2)
    meta = httpclient.InferenceServerClient(server.url).get_model_metadata("mlp_bf16")
    assert meta["inputs"][0]["datatype"] == "BF16" and meta["outputs"][0]["datatype"] == "BF16", meta


def test_ensembles_and_warm_up(server, expected):
    got = grpc_infer(server, "pipeline", {"X": expected["mlp_in"]}).as_numpy("Y")
    np.testing.assert_allclose(got, expected["mlp_out"], rtol=1e-5, atol=1e-6)


def test_sequences_keep_implicit_state(server):
    c = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")

    def step(value, seq, start=False, end=False):
        i = grpcclient.InferInput("INPUT__0", [1, 1], "FP32")
        i.set_data_from_numpy(np.array([[value]], dtype=np.float32))
        r = c.infer("accumulate", [i], sequence_id=seq, sequence_start=start, sequence_end=end)
        return float(r.as_numpy("OUTPUT__0")[0][0])

    assert step(1, 7, start=True) == 1
    assert step(10, 8, start=True) == 10  # another sequence, its own state
    assert step(2, 7) == 3
    assert step(5, 7, end=True) == 8
    assert step(1, 8, end=True) == 11


def test_outputs_are_checked_against_the_config(server):
    x = np.array([[1, 2]], dtype=np.float32)
    keyed = grpc_infer(server, "keyed", {"INPUT__0": x})
    np.testing.assert_array_equal(keyed.as_numpy("plus"), x + 1)
    assert keyed.as_numpy("double").dtype == np.float64
    np.testing.assert_array_equal(keyed.as_numpy("double"), x * 2)
    with pytest.raises(InferenceServerException, match="output 'double': the configuration expects TYPE_FP32, the model returned (float64|TYPE_FP64)"):
        http_infer(server, "mistyped", {"INPUT__0": x})


def test_batches_form_under_concurrency(server, expected):
    x, want = expected["mlp_in"], expected["mlp_out"]
    c = httpclient.InferenceServerClient(server.url, concurrency=16)
    before = c.get_inference_statistics("mlp")["model_stats"][0]

    def one(k):
        return http_infer(server, "mlp", {"INPUT__0": x[k % 5:k % 5 + 1]}).as_numpy("OUTPUT__0")

    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(one, range(64)))
    for k, got in enumerate(results):
        np.testing.assert_allclose(got, want[k % 5:k % 5 + 1], rtol=1e-5, atol=1e-6)
    after = c.get_inference_statistics("mlp")["model_stats"][0]
    inferences = after["inference_count"] - before["inference_count"]
    executions = after["execution_count"] - before["execution_count"]
    assert inferences == 64
    assert executions < inferences, (executions, inferences)


def test_failures_stay_with_their_model(server):
    c = httpclient.InferenceServerClient(server.url)
    index = {m["name"]: m for m in c.get_model_repository_index()}
    assert index["corrupt"]["state"] == "UNAVAILABLE"
    assert "cannot load" in index["corrupt"]["reason"], index["corrupt"]
    assert index["miscounted"]["state"] == "UNAVAILABLE"
    assert "configuration expects 3 inputs, the model's forward takes 2" in index["miscounted"]["reason"]
    # Warm-up runs the model: a sample it fails on fails the load.
    assert index["cnn_cold"]["state"] == "UNAVAILABLE"
    assert "PyTorch execute failure" in index["cnn_cold"]["reason"], index["cnn_cold"]
    assert c.is_model_ready("mlp") and c.is_model_ready("mlp_warm")


def test_bad_inputs_are_400_and_the_server_keeps_serving(server, expected):
    c = httpclient.InferenceServerClient(server.url)
    with pytest.raises(InferenceServerException, match=r"\[400\].*INPUT__0"):
        http_infer(server, "mlp", {"INPUT__0": np.zeros((1, 15), dtype=np.float32)})
    with pytest.raises(InferenceServerException, match=r"\[400\].*FP64"):
        http_infer(server, "mlp", {"INPUT__0": np.zeros((1, 16), dtype=np.float64)})
    # A shape the model itself cannot take fails that request, with PyTorch's words.
    with pytest.raises(InferenceServerException, match="PyTorch execute failure"):
        http_infer(server, "cnn", {"INPUT__0": np.zeros((1, 3, 0, 4), dtype=np.float32)})
    assert c.is_server_live()
    got = http_infer(server, "mlp", {"INPUT__0": expected["mlp_in"]}).as_numpy("OUTPUT__0")
    np.testing.assert_allclose(got, expected["mlp_out"], rtol=1e-5, atol=1e-6)


def children(pid):
    found = []
    for f in glob.glob(f"/proc/{pid}/task/*/children"):
        with open(f) as fh:
            found += fh.read().split()
    return found


def test_torchscript_runs_inside_the_server(made):
    repo, expected = made
    models = ["mlp", "cnn", "two", "keyed", "words", "mlp_bf16", "half", "accumulate", "stash", "counter", "nowords",
              "views"]
    with Server(["--model-repository", repo, f"--backend-config=pytorch,python={TORCH_PYTHON}",
                 "--model-control-mode=explicit"] + [f"--load-model={m}" for m in models], timeout=300) as s:
        assert children(s.proc.pid) == [], "no PyTorch process: TorchScript runs in the server"
        assert any("TorchScript models run inside the server" in line for line in s.lines)
        got = grpc_infer(s, "mlp", {"INPUT__0": expected["mlp_in"]}).as_numpy("OUTPUT__0")
        np.testing.assert_allclose(got, expected["mlp_out"], rtol=1e-5, atol=1e-6)
        words = np.array([b"ferry", b"caf\xc3\xa9"], dtype=object)
        # TorchScript's upper() changes ASCII letters only; the UTF-8 passes through whole.
        assert list(http_infer(s, "words", {"INPUT__0": words}).as_numpy("OUTPUT__0")) == [b"FERRY", b"CAF\xc3\xa9"]
        assert http_infer(s, "nowords", {"INPUT__0": np.ones(1, np.float32)}).as_numpy("OUTPUT__0").shape == (0,)
        # More strings than a call may hand the model: the request's 400, and the server serves on.
        many = np.array([b""] * ((1 << 20) + 1), dtype=object)
        with pytest.raises(InferenceServerException, match="more than 1048576 strings in one call") as e:
            http_infer(s, "words", {"INPUT__0": many})
        assert e.value.status() == "400"
        assert list(http_infer(s, "words", {"INPUT__0": words}).as_numpy("OUTPUT__0")) == [b"FERRY", b"CAF\xc3\xa9"]
        # Views PyTorch resolves lazily come back as the values they stand for (a negated view,
        # and an "efficient zero" tensor, which has no memory behind it).
        x = np.array([1, -2, 3, 4], np.float32)
        views = grpc_infer(s, "views", {"INPUT__0": x})
        np.testing.assert_array_equal(views.as_numpy("OUTPUT__0"), -x)
        np.testing.assert_array_equal(views.as_numpy("OUTPUT__1"), np.zeros(4, np.float32))
        # A model that keeps its input for the next call keeps what it was given, not ferry's buffer.
        got = [http_infer(s, "stash", {"INPUT__0": np.full(4, k, np.float32)}).as_numpy("OUTPUT__0") for k in (1, 2, 3)]
        np.testing.assert_array_equal(got, [np.zeros(4), np.full(4, 1.0), np.full(4, 2.0)])
        # Four instances sharing weights, each assigning an attribute per call, under concurrency.
        with ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(lambda k: http_infer(s, "counter", {"INPUT__0": np.full((1, 4), k, np.float32)})
                                    .as_numpy("OUTPUT__0"), range(200)))
        for k, a in enumerate(answers):
            np.testing.assert_array_equal(a, np.full((1, 4), k + 1, np.float32))


def test_a_model_with_process_wide_parameters_runs_in_a_process(made):
    repo, expected = made
    with Server(["--model-repository", repo, f"--backend-config=pytorch,python={TORCH_PYTHON}",
                 "--model-control-mode=explicit", "--load-model=mlp_jit"], timeout=300) as s:
        assert children(s.proc.pid), "expected a PyTorch process"
        assert any("parameter ENABLE_JIT_PROFILING changes PyTorch for the whole process" in line for line in s.lines)
        got = grpc_infer(s, "mlp_jit", {"INPUT__0": expected["mlp_in"]}).as_numpy("OUTPUT__0")
        np.testing.assert_allclose(got, expected["mlp_out"], rtol=1e-5, atol=1e-6)


def test_a_model_that_divides_integers_runs_in_a_process(made):
    """INT64_MIN / -1 is a hardware fault in PyTorch itself: it may end a PyTorch process, never
    the server."""
    repo, _ = made
    with Server(["--model-repository", repo, f"--backend-config=pytorch,python={TORCH_PYTHON}",
                 "--model-control-mode=explicit", "--load-model=intdiv", "--load-model=divmod",
                 "--load-model=forked"], timeout=300) as s:
        assert len(children(s.proc.pid)) >= 3, "expected a PyTorch process per model"
        assert any("its forward calls aten::div, which on integers can fault the process" in line for line in s.lines)
        assert any("its forward calls aten::divmod" in line for line in s.lines)
        # Work started by torch.jit.fork is a subgraph the check cannot look into.
        assert any("runs code through prim::fork, which ferry cannot inspect" in line for line in s.lines)
        a, b = np.array([7, -7], np.int64), np.array([2, 2], np.int64)
        for name in ("intdiv", "forked"):
            np.testing.assert_array_equal(grpc_infer(s, name, {"INPUT__0": a, "INPUT__1": b}).as_numpy("OUTPUT__0"), [3, -3])
            with pytest.raises(InferenceServerException):
                grpc_infer(s, name, {"INPUT__0": np.array([-2**63, 1], np.int64), "INPUT__1": np.array([-1, 1], np.int64)})
            assert httpclient.InferenceServerClient(s.url).is_server_live()
            np.testing.assert_array_equal(grpc_infer(s, name, {"INPUT__0": a, "INPUT__1": b}).as_numpy("OUTPUT__0"), [3, -3])
        np.testing.assert_array_equal(grpc_infer(s, "divmod", {"INPUT__0": np.array([7, 2], np.int64)}).as_numpy("OUTPUT__0"), [3, 1])
        with pytest.raises(InferenceServerException):
            grpc_infer(s, "divmod", {"INPUT__0": np.array([-2**63, -1], np.int64)})
        assert httpclient.InferenceServerClient(s.url).is_server_live()
        np.testing.assert_array_equal(grpc_infer(s, "divmod", {"INPUT__0": np.array([7, 2], np.int64)}).as_numpy("OUTPUT__0"), [3, 1])


def test_a_python_without_pytorch_fails_the_load_clearly(made, tmp_path):
    repo, _ = made
    with Server(["--model-repository", repo, f"--backend-config=pytorch,python={sys.executable}",
                 "--model-control-mode=explicit", "--load-model=mlp", "--exit-on-error=false"], timeout=300) as s:
        c = httpclient.InferenceServerClient(s.url)
        assert not c.is_model_ready("mlp")
        reason = {m["name"]: m for m in c.get_model_repository_index()}["mlp"]["reason"]
        assert f"PyTorch is not importable by {sys.executable}" in reason, reason
        assert "--backend-config pytorch,python=<path> or FERRY_PYTORCH_PYTHON" in reason


BF16_PY = '''
import torch
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "INPUT0")
            try:
                x.as_numpy()
                raise pb_utils.TritonModelException("as_numpy() gave a BF16 tensor to numpy")
            except pb_utils.TritonModelException as e:
                if "tensor dtype is bf16 and cannot be converted to numpy" not in str(e).lower():
                    raise
            assert x.triton_dtype() == 14 and x.data_type() == "BF16" and x.shape() == [2, 3]
            t = torch.utils.dlpack.from_dlpack(x.to_dlpack())
            assert t.dtype == torch.bfloat16
            # A DLPack capsule back, and a torch tensor made here (its __dlpack__).
            same = pb_utils.Tensor.from_dlpack("OUTPUT0", torch.utils.dlpack.to_dlpack(t))
            doubled = pb_utils.Tensor.from_dlpack("OUTPUT1", (t * 2).contiguous())
            responses.append(pb_utils.InferenceResponse([same, doubled]))
        return responses
'''


def test_a_python_model_passes_bf16_through_dlpack(tmp_path):
    """Triton's BF16 contract for Python models: as_numpy() refuses, DLPack carries them to
    PyTorch and back, over both protocols."""
    import ml_dtypes
    import models
    repo = str(tmp_path / "repo")
    models.python_model(repo, "bf16", BF16_PY, '''backend: "python"
max_batch_size: 0
input [ { name: "INPUT0" data_type: TYPE_BF16 dims: [ 2, 3 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_BF16 dims: [ 2, 3 ] }, { name: "OUTPUT1" data_type: TYPE_BF16 dims: [ 2, 3 ] } ]
''')
    x = np.array([[1.5, -2.25, 0.0], [3.0, 1e30, -7.5]], dtype=ml_dtypes.bfloat16)
    with Server(["--model-repository", repo, f"--backend-config=python,executable={TORCH_PYTHON}"], timeout=120) as s:
        h = httpclient.InferInput("INPUT0", [2, 3], "BF16")
        h.set_data_from_numpy(x, binary_data=True)
        r = httpclient.InferenceServerClient(s.url).infer("bf16", [h], outputs=[
            httpclient.InferRequestedOutput("OUTPUT0", binary_data=True),
            httpclient.InferRequestedOutput("OUTPUT1", binary_data=True)])
        np.testing.assert_array_equal(r.as_numpy("OUTPUT0").astype(np.float32), x.astype(np.float32))
        np.testing.assert_array_equal(r.as_numpy("OUTPUT1").astype(np.float32), 2 * x.astype(np.float32))
        g = grpcclient.InferInput("INPUT0", [2, 3], "BF16")
        g.set_data_from_numpy(x)
        r = grpcclient.InferenceServerClient(f"127.0.0.1:{s.grpc_port}").infer("bf16", [g])
        np.testing.assert_array_equal(r.as_numpy("OUTPUT1").astype(np.float32), 2 * x.astype(np.float32))
