"""AOTInductor packages (`torch_aoti`, `model.pt2`) through the real server, run inside it through
PyTorch's C ABI on the official PyTorch from PyPI: an MLP, a CNN with batch norm over images of any
size, a positional and a keyword INT64 input with two outputs (`max_batch_size: 0`), dict outputs
matched by key, FP16 and BF16; each compared with the same model run in-process by PyTorch, over
HTTP (JSON and binary) and gRPC; batches formed under concurrency; two instances sharing one copy of
the weights; a package that writes its input, twice in one ensemble; packages with their own Python
environment, with checks inside parallel kernels or with integer division (a failure of either
would end the server) running in a PyTorch process instead; bad inputs answered 400; broken packages failing only their own load.

The packages are made by FERRY_TORCH_PYTHON (scripts/torch.sh makes one); without it these tests
skip, unless FERRY_REQUIRE_TORCH=1 (CI sets it)."""
import glob
import os
import subprocess
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException, np_to_triton_dtype

from conftest import framework_python
from ferry_server import Server

TORCH_PYTHON = framework_python("FERRY_TORCH_PYTHON", "FERRY_REQUIRE_TORCH", "torch.sh", "PyTorch")

HERE = os.path.dirname(os.path.abspath(__file__))
IN_SERVER = ["mlp_aoti", "mlp_shared", "mlp_from2", "cnn_aoti", "two_aoti", "keyed_aoti", "half_aoti", "bf16_aoti", "inplace_aoti"]


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    root = tmp_path_factory.mktemp("packages")
    repo = root / "repo"
    repo.mkdir()
    subprocess.run([TORCH_PYTHON, os.path.join(HERE, "torch_packages.py"), str(repo)], check=True)
    return str(repo), dict(np.load(root / "expected.npz"))


def serve(repo, *models):
    args = ["--model-repository", repo, f"--backend-config=pytorch,python={TORCH_PYTHON}", "--exit-on-error=false",
            "--model-control-mode=explicit"]
    return Server(args + [f"--load-model={m}" for m in models], timeout=300)


@pytest.fixture(scope="module")
def server(made):
    with serve(made[0], *IN_SERVER, "inplace_twice", "mlp_static", "corrupt", "truncated") as s:
        yield s


@pytest.fixture(scope="module")
def expected(made):
    return made[1]


def children(pid):
    found = []
    for f in glob.glob(f"/proc/{pid}/task/*/children"):
        with open(f) as fh:
            found += fh.read().split()
    return found


def http_infer(server, model, arrays, binary=True):
    inputs = []
    for name, a in arrays.items():
        i = httpclient.InferInput(name, list(a.shape), np_to_triton_dtype(a.dtype) if a.dtype.name != "bfloat16" else "BF16")
        i.set_data_from_numpy(a, binary_data=binary)
        inputs.append(i)
    return httpclient.InferenceServerClient(server.url).infer(model, inputs)


def grpc_infer(server, model, arrays):
    inputs = []
    for name, a in arrays.items():
        i = grpcclient.InferInput(name, list(a.shape), np_to_triton_dtype(a.dtype) if a.dtype.name != "bfloat16" else "BF16")
        i.set_data_from_numpy(a)
        inputs.append(i)
    return grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}").infer(model, inputs)


def test_packages_run_inside_the_server(server):
    c = httpclient.InferenceServerClient(server.url)
    for m in IN_SERVER:
        assert c.is_model_ready(m), m
    # No PyTorch process: every package runs in the server itself.
    assert children(server.proc.pid) == []
    assert c.get_model_metadata("mlp_aoti")["platform"] == "torch_aoti"


def test_outputs_equal_pytorch_in_process_over_each_protocol(server, expected):
    x, want = expected["mlp_in"], expected["mlp_out"]
    for binary in (True, False):
        got = http_infer(server, "mlp_aoti", {"ARGS[0]": x[:3]}, binary).as_numpy("RESULT[0]")
        np.testing.assert_allclose(got, want[:3], rtol=1e-5, atol=1e-6)
    got = grpc_infer(server, "mlp_aoti", {"ARGS[0]": x}).as_numpy("RESULT[0]")
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    for k in range(2):
        got = grpc_infer(server, "cnn_aoti", {"INPUT__0": expected[f"cnn_in{k}"]}).as_numpy("OUTPUT__0")
        np.testing.assert_allclose(got, expected[f"cnn_out{k}"], rtol=1e-4, atol=1e-5)
    r = http_infer(server, "two_aoti", {"ARGS[0]": expected["two_count"], "KWARGS[scale]": expected["two_scale"]}, False)
    np.testing.assert_array_equal(r.as_numpy("SUM__0"), expected["two_sum"])
    np.testing.assert_array_equal(r.as_numpy("PRODUCT__1"), expected["two_product"])
    r = grpc_infer(server, "keyed_aoti", {"INPUT__0": expected["keyed_in"]})
    assert r.as_numpy("double").dtype == np.float64
    np.testing.assert_allclose(r.as_numpy("double"), expected["keyed_double"], rtol=1e-6)
    np.testing.assert_allclose(r.as_numpy("plus"), expected["keyed_plus"], rtol=1e-6)
    got = http_infer(server, "half_aoti", {"INPUT__0": expected["half_in"]}).as_numpy("OUTPUT__0")
    assert got.dtype == np.float16
    np.testing.assert_allclose(got.astype(np.float32), expected["half_out"].astype(np.float32), rtol=1e-3)


def test_a_package_whose_batch_starts_at_two_takes_single_rows(server, expected):
    """Exported without backed_size_oblivious, the package's input checks start the batch at 2:
    a single row is padded to two, and only its own answer comes back."""
    x, want = expected["mlp_in"], expected["mlp_out"]
    for k in range(3):
        got = grpc_infer(server, "mlp_from2", {"ARGS[0]": x[k:k + 1]}).as_numpy("RESULT[0]")
        assert got.shape == (1, 4)
        np.testing.assert_allclose(got, want[k:k + 1], rtol=1e-5, atol=1e-6)
    got = http_infer(server, "mlp_from2", {"ARGS[0]": x[:5]}).as_numpy("RESULT[0]")
    np.testing.assert_allclose(got, want[:5], rtol=1e-5, atol=1e-6)
    # The load says so, and how to export a package that takes one row.
    said = [line for line in server.log().splitlines() if "start its batch at 2 rows" in line]
    assert any("mlp_from2" in line and "layout_optimization" in line for line in said), said
    assert not any("mlp_aoti" in line for line in said), said


def test_bf16_tensors_pass_both_ways(server, expected):
    import ml_dtypes
    x = expected["bf16_in"].astype(ml_dtypes.bfloat16)
    for got in (http_infer(server, "bf16_aoti", {"ARGS[0]": x}).as_numpy("RESULT[0]"),
                grpc_infer(server, "bf16_aoti", {"ARGS[0]": x}).as_numpy("RESULT[0]")):
        np.testing.assert_allclose(got.astype(np.float32), expected["bf16_out"], rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("model", ["mlp_aoti", "mlp_shared", "mlp_from2"])
def test_batches_form_under_concurrency(server, expected, model):
    x, want = expected["mlp_in"], expected["mlp_out"]
    c = httpclient.InferenceServerClient(server.url, concurrency=16)
    before = c.get_inference_statistics(model)["model_stats"][0]
    with ThreadPoolExecutor(16) as pool:
        got = list(pool.map(lambda k: http_infer(server, model, {"ARGS[0]": x[k % 6:k % 6 + 1]}).as_numpy("RESULT[0]"),
                            range(64)))
    for k, g in enumerate(got):
        np.testing.assert_allclose(g, want[k % 6:k % 6 + 1], rtol=1e-5, atol=1e-6)
    after = c.get_inference_statistics(model)["model_stats"][0]
    assert after["inference_count"] - before["inference_count"] == 64
    assert after["execution_count"] - before["execution_count"] < 64


def test_bad_inputs_are_400_and_the_server_keeps_serving(server, expected):
    with pytest.raises(InferenceServerException, match=r"\[400\].*ARGS\[0\]"):
        http_infer(server, "mlp_aoti", {"ARGS[0]": np.zeros((1, 15), dtype=np.float32)})
    with pytest.raises(InferenceServerException, match=r"\[400\].*FP64"):
        http_infer(server, "mlp_aoti", {"ARGS[0]": np.zeros((1, 16), dtype=np.float64)})
    # An image smaller than the package was exported for: its own check refuses it.
    with pytest.raises(InferenceServerException, match=r"\[400\].*PyTorch execute failure"):
        http_infer(server, "cnn_aoti", {"INPUT__0": np.zeros((1, 3, 2, 9), dtype=np.float32)})
    with pytest.raises(InferenceServerException, match=r"\[400\].*PyTorch execute failure"):
        http_infer(server, "cnn_aoti", {"INPUT__0": np.zeros((1, 3, 100, 9), dtype=np.float32)})
    assert httpclient.InferenceServerClient(server.url).is_server_live()
    got = http_infer(server, "mlp_aoti", {"ARGS[0]": expected["mlp_in"]}).as_numpy("RESULT[0]")
    np.testing.assert_allclose(got, expected["mlp_out"], rtol=1e-5, atol=1e-6)


def test_broken_packages_fail_only_their_own_load(server):
    index = {m["name"]: m for m in httpclient.InferenceServerClient(server.url).get_model_repository_index()}
    assert index["corrupt"]["state"] == "UNAVAILABLE"
    assert "is not an AOTInductor package" in index["corrupt"]["reason"], index["corrupt"]
    assert index["truncated"]["state"] == "UNAVAILABLE"
    assert "model library" in index["truncated"]["reason"], index["truncated"]
    assert index["mlp_static"]["state"] == "UNAVAILABLE"
    assert "max_batch_size 8 is more than this package's batch dimension takes" in index["mlp_static"]["reason"]


def test_a_package_that_writes_its_input_gets_its_own_copy(server):
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    for binary in (True, False):
        r = http_infer(server, "inplace_twice", {"X": x}, binary)
        np.testing.assert_array_equal(r.as_numpy("Y1"), (x + 100) * 2)
        np.testing.assert_array_equal(r.as_numpy("Y2"), (x + 100) * 2)
    r = grpc_infer(server, "inplace_twice", {"X": x})
    np.testing.assert_array_equal(r.as_numpy("Y2"), (x + 100) * 2)


def test_a_package_with_its_own_environment_runs_in_a_process(made):
    repo, expected = made
    with serve(repo, "mlp_process") as s:
        assert children(s.proc.pid), "expected a PyTorch process"
        got = grpc_infer(s, "mlp_process", {"ARGS[0]": expected["mlp_in"]}).as_numpy("RESULT[0]")
        np.testing.assert_allclose(got, expected["mlp_out"], rtol=1e-5, atol=1e-6)


def test_a_package_whose_kernels_check_inside_parallel_regions_runs_in_a_process(made):
    """An index out of range fails a check; inside an OpenMP region that ends the process it is in
    (std::terminate), which must then be a PyTorch process, never the server. Outside one, the
    check is the request's error."""
    repo, expected = made
    bad = np.full((1, 32), 1000, dtype=np.int64)
    with serve(repo, "embed_parallel") as s:
        assert children(s.proc.pid), "expected a PyTorch process"
        assert any("a kernel checks `AOTI_TORCH_CHECK` inside a parallel region" in line for line in s.lines)
        got = http_infer(s, "embed_parallel", {"INPUT__0": expected["embed_parallel_in"]}).as_numpy("OUTPUT__0")
        np.testing.assert_allclose(got, expected["embed_parallel_out"], rtol=1e-5, atol=1e-5)
        with pytest.raises(InferenceServerException, match="died"):
            http_infer(s, "embed_parallel", {"INPUT__0": bad})
        assert httpclient.InferenceServerClient(s.url).is_server_live()
        got = http_infer(s, "embed_parallel", {"INPUT__0": expected["embed_parallel_in"]}).as_numpy("OUTPUT__0")
        np.testing.assert_allclose(got, expected["embed_parallel_out"], rtol=1e-5, atol=1e-5)
    with serve(repo, "embed_small") as s:
        assert children(s.proc.pid) == []
        with pytest.raises(InferenceServerException, match=r"\[400\].*index out of bounds"):
            http_infer(s, "embed_small", {"INPUT__0": bad[:, :5]})
        got = http_infer(s, "embed_small", {"INPUT__0": expected["embed_small_in"]}).as_numpy("OUTPUT__0")
        np.testing.assert_allclose(got, expected["embed_small_out"], rtol=1e-5, atol=1e-6)


def test_a_package_that_divides_integers_runs_in_a_process(made):
    """A zero divisor is a hardware fault in the compiled kernel: it may end only a PyTorch
    process, never the server."""
    repo, _ = made
    a = np.array([[7, -7, 9, 10]], dtype=np.int64)
    with serve(repo, "divide_aoti") as s:
        assert children(s.proc.pid), "expected a PyTorch process"
        got = http_infer(s, "divide_aoti", {"INPUT__0": a, "INPUT__1": np.full((1, 4), 2, np.int64)}).as_numpy("OUTPUT__0")
        np.testing.assert_array_equal(got, [[3, -3, 4, 5]])
        with pytest.raises(InferenceServerException):
            http_infer(s, "divide_aoti", {"INPUT__0": a, "INPUT__1": np.zeros((1, 4), np.int64)})
        assert httpclient.InferenceServerClient(s.url).is_server_live()
        got = http_infer(s, "divide_aoti", {"INPUT__0": a, "INPUT__1": np.full((1, 4), 2, np.int64)}).as_numpy("OUTPUT__0")
        np.testing.assert_array_equal(got, [[3, -3, 4, 5]])
