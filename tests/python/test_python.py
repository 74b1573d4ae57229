"""The Python backend through the real server: Triton's Python models run unchanged in their own
processes (add/sub in several datatypes, BYTES with response parameters, batched execute, per-request errors, exceptions,
a killed process, auto_complete_config, BLS, EXECUTION_ENV_PATH, a failing initialize)."""
import os
import signal
import sys
import time

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

import models
from ferry_server import Server

LIBS = {"http": httpclient, "grpc": grpcclient}

IDENTITY_BYTES = '''
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        out = []
        for r in requests:
            t = pb_utils.get_input_tensor_by_name(r, "TEXT").as_numpy()
            params = {"items": int(t.size), "echo": "yes", "exact": True}
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("ECHO", t)], parameters=params))
        return out
'''

AUTO = '''
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    @staticmethod
    def auto_complete_config(config):
        config.add_input({"name": "X", "data_type": "TYPE_FP32", "dims": [2]})
        config.add_output({"name": "Y", "data_type": "TYPE_FP32", "dims": [2]})
        config.set_max_batch_size(4)
        config.set_dynamic_batching()
        return config

    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor("Y", pb_utils.get_input_tensor_by_name(r, "X").as_numpy() * 10)])
                for r in requests]
'''

BLS = '''
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    async def execute(self, requests):
        responses = []
        for r in requests:
            x = pb_utils.get_input_tensor_by_name(r, "X").as_numpy()
            mode = pb_utils.get_input_tensor_by_name(r, "MODE").as_numpy()[0][0].decode()
            target = {"onnx": "add_mul", "ensemble": "pipeline", "missing": "ghost"}[mode.split("-")[0]]
            names = {"add_mul": (["a", "b"], "y"), "pipeline": (["IN_A", "IN_B"], "OUT_Y"), "ghost": (["a", "b"], "y")}
            ins, out = names[target]
            request = pb_utils.InferenceRequest(model_name=target, requested_output_names=[out],
                                                inputs=[pb_utils.Tensor(ins[0], x), pb_utils.Tensor(ins[1], x)])
            if mode.endswith("async"):
                a, b = await request.async_exec(), await request.async_exec()
                assert not a.has_error() and not b.has_error()
                response = a
            else:
                response = request.exec()
            if response.has_error():
                responses.append(pb_utils.InferenceResponse(error=response.error()))
                continue
            y = pb_utils.get_output_tensor_by_name(response, out).as_numpy()
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("Y", y)]))
        return responses
'''

BLS_CONFIG = """
backend: "python"
max_batch_size: 4
input [ { name: "X" data_type: TYPE_FP32 dims: [ 4 ] }, { name: "MODE" data_type: TYPE_STRING dims: [ 1 ] } ]
output [ { name: "Y" data_type: TYPE_FP32 dims: [ 4 ] } ]
"""

FAILS = '''
class TritonPythonModel:
    def initialize(self, args):
        raise RuntimeError("the weights are missing")

    def execute(self, requests):
        return []
'''


def add_sub_inputs(lib, a, b, dtype):
    return [lib.InferInput("INPUT0", list(a.shape), dtype).set_data_from_numpy(a),
            lib.InferInput("INPUT1", list(b.shape), dtype).set_data_from_numpy(b)]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    repo = str(tmp_path_factory.mktemp("python"))
    models.python_model(repo, "add_sub_fp32", models.ADD_SUB_PY, models.add_sub_config("TYPE_FP32"))
    models.python_model(repo, "add_sub_int32", models.ADD_SUB_PY, models.add_sub_config("TYPE_INT32"))
    models.python_model(repo, "identity_bytes_py", IDENTITY_BYTES, """
backend: "python"
max_batch_size: 8
input [ { name: "TEXT" data_type: TYPE_STRING dims: [ -1 ] } ]
output [ { name: "ECHO" data_type: TYPE_STRING dims: [ -1 ] } ]
""")
    models.python_model(repo, "auto", AUTO)
    from test_ensemble import pipeline_repo
    pipeline_repo(repo)
    models.python_model(repo, "bls", BLS, BLS_CONFIG)
    with Server(["--model-repository", repo]) as s:
        yield s


@pytest.mark.parametrize("protocol", ["http", "grpc"])
@pytest.mark.parametrize("dtype", ["FP32", "INT32"])
def test_add_sub(server, protocol, dtype):
    client = server.client() if protocol == "http" else server.grpc_client()
    lib = LIBS[protocol]
    np_type = np.float32 if dtype == "FP32" else np.int32
    a = np.arange(8, dtype=np_type).reshape(2, 4)
    b = np.ones((2, 4), dtype=np_type)
    r = client.infer(f"add_sub_{dtype.lower()}", add_sub_inputs(lib, a, b, dtype))
    np.testing.assert_array_equal(r.as_numpy("OUTPUT0"), a + b)
    np.testing.assert_array_equal(r.as_numpy("OUTPUT1"), a - b)
    assert r.as_numpy("OUTPUT0").dtype == np_type
    assert "initialized add_sub_fp32 version 1" in server.log()


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_bytes_identity(server, protocol):
    client = server.client() if protocol == "http" else server.grpc_client()
    lib = LIBS[protocol]
    text = np.array([["héllo".encode(), b"", b"\x00\xffraw"]], dtype=np.object_)
    r = client.infer("identity_bytes_py", [lib.InferInput("TEXT", [1, 3], "BYTES").set_data_from_numpy(text)])
    assert r.as_numpy("ECHO").tolist() == text.tolist()
    # The response parameters the model set reach the client.
    if protocol == "http":
        assert r.get_response()["parameters"] == {"items": 3, "echo": "yes", "exact": True}
    else:
        p = r.get_response().parameters
        assert (p["items"].int64_param, p["echo"].string_param, p["exact"].bool_param) == (3, "yes", True)


def test_batched_execute_with_an_error_beside_good_requests(server):
    """Concurrent requests reach execute() together; one request's error response fails only it."""
    client = httpclient.InferenceServerClient(server.url, concurrency=8)
    b = np.ones((1, 4), dtype=np.float32)
    values = [np.full((1, 4), k, dtype=np.float32) for k in range(7)] + [np.full((1, 4), -1, dtype=np.float32)]
    pending = [client.async_infer("add_sub_fp32", add_sub_inputs(httpclient, a, b, "FP32")) for a in values]
    results, errors, batches = 0, [], []
    for p in pending:
        try:
            r = p.get_result()
            results += 1
            batches.append(int(r.as_numpy("BATCH")[0, 0]))
        except InferenceServerException as e:
            errors.append(str(e))
    assert results == 7 and len(errors) == 1 and "negative input" in errors[0], (results, errors)
    assert max(batches) > 1, f"execute() saw several requests at once: {batches}"


def test_an_exception_in_execute_fails_the_request_and_the_model_goes_on(server):
    a = np.full((1, 4), 13, dtype=np.float32)
    with pytest.raises(InferenceServerException, match="unlucky 13"):
        server.client().infer("add_sub_fp32", add_sub_inputs(httpclient, a, a, "FP32"))
    ok = np.ones((1, 4), dtype=np.float32)
    assert server.client().infer("add_sub_fp32", add_sub_inputs(httpclient, ok, ok, "FP32")).as_numpy("OUTPUT0")[0, 0] == 2


def test_a_killed_python_process_is_replaced(server):
    client = server.client()
    ok = np.ones((1, 4), dtype=np.int32)
    pid = int(client.infer("add_sub_int32", add_sub_inputs(httpclient, ok, ok, "INT32")).as_numpy("PID")[0, 0])
    os.kill(pid, signal.SIGKILL)
    time.sleep(0.2)
    failed = 0
    for _ in range(3):
        try:
            r = client.infer("add_sub_int32", add_sub_inputs(httpclient, ok, ok, "INT32"))
            break
        except InferenceServerException as e:
            assert "died" in str(e), e
            failed += 1
    assert failed <= 1
    assert int(r.as_numpy("PID")[0, 0]) != pid
    assert client.is_model_ready("add_sub_int32")
    assert "Python process restarted" in server.log()


def test_auto_complete_config(server):
    cfg = server.client().get_model_config("auto")
    assert cfg["backend"] == "python" and cfg["max_batch_size"] == 4
    assert [i["name"] for i in cfg["input"]] == ["X"] and "dynamic_batching" in cfg
    x = np.array([[1, 2]], dtype=np.float32)
    r = server.client().infer("auto", [httpclient.InferInput("X", [1, 2], "FP32").set_data_from_numpy(x)])
    np.testing.assert_array_equal(r.as_numpy("Y"), x * 10)


@pytest.mark.parametrize("mode", ["onnx", "onnx-async", "ensemble", "ensemble-async"])
def test_bls_to_onnx_and_to_an_ensemble(server, mode):
    x = np.arange(4, dtype=np.float32).reshape(1, 4)
    ins = [httpclient.InferInput("X", [1, 4], "FP32").set_data_from_numpy(x),
           httpclient.InferInput("MODE", [1, 1], "BYTES").set_data_from_numpy(np.array([[mode.encode()]], dtype=np.object_))]
    y = server.client().infer("bls", ins).as_numpy("Y")
    expected = x + x if mode.startswith("onnx") else (x + x) + x * x
    np.testing.assert_allclose(y, expected)


def test_bls_errors_reach_the_model(server):
    x = np.zeros((1, 4), dtype=np.float32)
    ins = [httpclient.InferInput("X", [1, 4], "FP32").set_data_from_numpy(x),
           httpclient.InferInput("MODE", [1, 1], "BYTES").set_data_from_numpy(np.array([[b"missing"]], dtype=np.object_))]
    with pytest.raises(InferenceServerException, match="ghost"):
        server.client().infer("bls", ins)


def test_execution_env_path_and_a_failing_initialize(fresh_repo):
    env = os.path.dirname(os.path.dirname(sys.executable))  # this test run's venv: a folder with bin/python3
    extra = 'parameters { key: "EXECUTION_ENV_PATH" value: { string_value: "%s" } }' % env
    models.python_model(fresh_repo, "in_env", models.ADD_SUB_PY, models.add_sub_config(extra=extra))
    models.python_model(fresh_repo, "broken", FAILS, 'backend: "python"\nmax_batch_size: 0\n'
                        'input [ { name: "X" data_type: TYPE_FP32 dims: [ 1 ] } ]\noutput [ { name: "Y" data_type: TYPE_FP32 dims: [ 1 ] } ]\n')
    missing = 'parameters { key: "EXECUTION_ENV_PATH" value: { string_value: "$$TRITON_MODEL_DIRECTORY/env.tar.gz" } }'
    models.python_model(fresh_repo, "no_env", models.ADD_SUB_PY, models.add_sub_config(extra=missing))
    with Server(["--model-repository", fresh_repo, "--exit-on-error=false"]) as s:
        ok = np.ones((1, 4), dtype=np.float32)
        assert s.client().infer("in_env", add_sub_inputs(httpclient, ok, ok, "FP32")).as_numpy("OUTPUT0")[0, 0] == 2
        index = {m["name"]: m for m in s.client().get_model_repository_index()}
        assert index["broken"]["state"] == "UNAVAILABLE"
        assert "RuntimeError: the weights are missing" in index["broken"]["reason"], index["broken"]
        assert "EXECUTION_ENV_PATH" in index["no_env"]["reason"], index["no_env"]


def test_the_embedded_pipeline_example_serves_or_is_skipped_with_one_line():
    from conftest import EXAMPLES

    text = np.array([[b"I love this"], [b"terrible, awful"]], dtype=np.object_)
    with Server([]) as s:
        r = s.client().infer("text_classifier", [httpclient.InferInput("TEXT", [2, 1], "BYTES").set_data_from_numpy(text)])
        scope = {}
        code = open(os.path.join(EXAMPLES, "text_classifier_pre", "1", "model.py")).read()
        exec(code.replace("import triton_python_backend_utils as pb_utils", ""), scope)
        import onnxruntime as ort
        session = ort.InferenceSession(os.path.join(EXAMPLES, "text_classifier_onnx", "1", "model.onnx"))
        logits = session.run(None, {"FEATURES": np.stack([scope["features"](t[0]) for t in text])})[0]
        probs = np.exp(logits) / np.exp(logits).sum(axis=1, keepdims=True)
        np.testing.assert_allclose(r.as_numpy("SCORE").reshape(-1), probs.max(axis=1), rtol=1e-5)
        labels = np.array([b"negative", b"neutral", b"positive"])[probs.argmax(axis=1)]
        assert r.as_numpy("LABEL").reshape(-1).tolist() == labels.tolist()
    with Server(["--backend-config", "python,executable=/nonexistent/python3"]) as s:
        assert s.client().is_model_ready("simple")
        lines = [line for line in s.log().splitlines() if "Python examples are not served" in line]
        assert len(lines) == 1 and "text_classifier" in lines[0], s.log()
        index = [m["name"] for m in s.client().get_model_repository_index()]
        assert "text_classifier" not in index and "simple" in index
        # The pipeline with no Python step stays.
        assert "color_match" not in lines[0] and s.client().is_model_ready("color_match")
