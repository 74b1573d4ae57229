"""ferry started the way SageMaker starts a custom container (`serve`, SAGEMAKER_* variables, a
read-only model folder), walking the checklist of ../shared/spec/sagemaker.md §13."""
import json
import os
import shutil
import time

import numpy as np
import pytest
import tritonclient.http as httpclient

import models
from conftest import EXAMPLES, copy_example
from ferry_server import Server
from platforms import binary_simple, connect_quickly, kserve_simple, request, slow_model, snapshot

BINARY = "application/vnd.sagemaker-triton.binary+json"


def sagemaker(model_dir, env=None, args=(), **kw):
    full = {"SAGEMAKER_BIND_TO_PORT": "0", "FERRY_SAGEMAKER_MODEL_DIR": str(model_dir)}
    full.update(env or {})
    return Server(list(args), env=full, services=("SageMaker",), **kw)


def port(s):
    return s.ports["SageMaker"]


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    """/opt/ml/model holding one model folder (a repository root), served SageMaker's way."""
    folder = tmp_path_factory.mktemp("opt_ml_model")
    copy_example(str(folder), "simple")
    before = snapshot(folder)
    with sagemaker(folder) as s:
        yield s
    assert snapshot(folder) == before, "nothing was written into the model folder"


def test_ping_and_invocations(single):
    p = port(single)
    assert "mode=\"sagemaker\"" in single.log()
    assert "HTTP KServe v2 service" not in single.log()
    assert request(p, "GET", "/ping")[0] == 200
    assert request(p, "POST", "/ping")[0] == 405
    assert request(p, "GET", "/invocations")[0] == 405
    status, headers, body = request(p, "POST", "/invocations", kserve_simple(list(range(16)), [1] * 16))
    assert status == 200 and headers["Content-Type"] == "application/json"
    doc = json.loads(body)
    assert list(doc) == ["model_name", "model_version", "outputs"] and doc["model_name"] == "simple"
    assert request(p, "GET", "/v2/health/ready")[0] == 404


def test_binary_content_type_both_ways(single):
    p = port(single)
    body, n = binary_simple(list(range(16)), [2] * 16)
    status, headers, data = request(p, "POST", "/invocations", body, {"Content-Type": f"{BINARY};json-header-size={n}"})
    assert status == 200, data
    ct = headers["Content-Type"]
    assert ct.startswith(f"{BINARY};json-header-size=")
    length = int(ct.split("json-header-size=")[1])
    assert json.loads(data[:length])["model_name"] == "simple"
    result = httpclient.InferenceServerClient.parse_response_body(data, header_length=length)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0").flatten(), np.arange(16) + 2)
    for bad in [f"junk{BINARY};json-header-size={n}", f"{BINARY};json-header-size=x", f"{BINARY};json-header-size=-5",
                f"{BINARY};json-header-size={len(body) + 9}", f"{BINARY};json-header-size=4294967296"]:
        assert request(p, "POST", "/invocations", body, {"Content-Type": bad})[0] == 400, bad
    assert request(p, "GET", "/ping")[0] == 200


def test_instances_and_execution_parameters(single):
    p = port(single)
    status, _, body = request(p, "POST", "/invocations", {"instances": [{"INPUT0": [1] * 16, "INPUT1": [1] * 16}]})
    assert status == 200 and json.loads(body)["predictions"][0]["OUTPUT0"] == [2] * 16
    status, _, body = request(p, "GET", "/execution-parameters")
    assert status == 200 and json.loads(body) == {"MaxConcurrentTransforms": 1, "BatchStrategy": "SINGLE_RECORD", "MaxPayloadInMB": 6}


def test_oversize_names_sagemakers_limit(single):
    status, _, body = request(port(single), "POST", "/invocations", b"{" + b" " * (6 * 1024 * 1024 + 10) + b"}")
    msg = json.loads(body)["error"]
    assert status == 413 and "6 MiB" in msg and "--http-max-input-size" in msg


def test_a_larger_payload_limit_is_reachable_by_configuration(tmp_path):
    # Asynchronous inference takes up to 1 GB: the limit is the flag's (here 8 MiB).
    folder = tmp_path / "model"
    copy_example(str(folder), "simple")
    with sagemaker(folder, {"FERRY_HTTP_MAX_INPUT_SIZE": str(8 << 20)}) as s:
        a = list(range(16))
        body = json.dumps(kserve_simple(a, [1] * 16)).encode()
        padded = body[:-1] + b" " * (7 << 20) + b"}"
        status, _, reply = request(port(s), "POST", "/invocations", padded, {"Content-Type": "application/json"})
        assert status == 200 and json.loads(reply)["outputs"][0]["data"] == [i + 1 for i in a], reply[:200]
        status, _, reply = request(port(s), "POST", "/invocations", b" " * (9 << 20))
        assert status == 413 and b"maximum allowed input size of 8388608 bytes" in reply, reply[:300]


@pytest.mark.parametrize("layout", ["root", "model_at_top", "wrapper"])
def test_model_folder_layouts(tmp_path, layout):
    folder = tmp_path / "model"
    folder.mkdir()
    if layout == "root":
        copy_example(str(folder), "simple")
    elif layout == "model_at_top":
        shutil.copytree(os.path.join(EXAMPLES, "simple"), folder, dirs_exist_ok=True)
    else:
        copy_example(str(folder / "export"), "simple")
    env = {"SAGEMAKER_TRITON_DEFAULT_MODEL_NAME": "simple"}
    with sagemaker(folder, env=env) as s:
        assert request(port(s), "POST", "/invocations", kserve_simple([1] * 16, [1] * 16))[0] == 200


def test_unusable_folder_says_what_it_found(tmp_path):
    folder = tmp_path / "model"
    (folder / "stuff").mkdir(parents=True)
    (folder / "stuff" / "notes.txt").write_text("x")
    s = sagemaker(folder, expect_exit=True)
    assert s.wait_exit() != 0
    assert "stuff/ [notes.txt]" in s.log() and "Expected one of" in s.log()


def test_default_model_rules(tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    copy_example(str(folder), "simple")
    copy_example(str(folder), "simple_string")
    with sagemaker(folder) as s:
        status, _, body = request(port(s), "POST", "/invocations", kserve_simple([1] * 16, [1] * 16))
        msg = json.loads(body)["error"]
        assert status == 400 and "simple, simple_string" in msg and "SAGEMAKER_TRITON_DEFAULT_MODEL_NAME" in msg
    with sagemaker(folder, env={"SAGEMAKER_TRITON_DEFAULT_MODEL_NAME": "nope"}) as s:
        status, _, body = request(port(s), "POST", "/invocations", kserve_simple([1] * 16, [1] * 16))
        assert status == 404 and "Request for unknown model: 'nope'" in json.loads(body)["error"]
        assert request(port(s), "GET", "/ping")[0] == 503


def test_ping_is_503_while_loading(tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    slow_model(str(folder))
    s = sagemaker(folder, wait_ready=False)
    try:
        assert connect_quickly(port(s), within=5)
        # Until the listing is read the detail says no model is known yet; then it names the
        # model loading. Not ready (503) throughout.
        deadline = time.time() + 20
        while True:
            status, _, body = request(port(s), "GET", "/ping", timeout=2)
            assert status == 503, body
            if "slow" in json.loads(body)["detail"] or time.time() > deadline:
                break
            time.sleep(0.05)
        assert "slow" in json.loads(body)["detail"], body
        s.wait_ready(120)
        assert request(port(s), "GET", "/ping")[0] == 200
    finally:
        s.stop()
    assert s.proc.returncode == 0


def test_extra_listeners_must_use_the_safe_port_range(tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    copy_example(str(folder), "simple")
    env = {"SAGEMAKER_SAFE_PORT_RANGE": "23000-23999", "SAGEMAKER_TRITON_ALLOW_GRPC": "true", "SAGEMAKER_TRITON_GRPC_PORT": "8001"}
    s = sagemaker(folder, env=env, expect_exit=True)
    assert s.wait_exit() != 0
    assert "cannot listen to GRPC requests at port 8001, allowed port range is [23000, 23999]" in s.log()


@pytest.fixture
def mme(tmp_path):
    root = tmp_path / "models"
    for mid, example in [("h1", "simple"), ("h2", "simple_string")]:
        (root / mid).mkdir(parents=True)
        shutil.copytree(os.path.join(EXAMPLES, example), root / mid / "model")
    env = {"SAGEMAKER_MULTI_MODEL": "true", "FERRY_SAGEMAKER_MODELS_ROOT": str(root)}
    with sagemaker(tmp_path / "unused", env=env) as s:
        yield s, root


def test_multi_model_endpoint(mme):
    s, root = mme
    p = port(s)
    assert request(p, "GET", "/ping")[0] == 200
    url = str(root / "h1" / "model")
    assert request(p, "POST", "/models", {"model_name": "h1", "url": url}, {"X-Amzn-SageMaker-Target-Model": "simple.tar.gz"})[0] == 200
    assert request(p, "POST", "/models", {"model_name": "h1", "url": url})[0] == 409
    status, _, body = request(p, "GET", "/models")
    assert status == 200 and json.loads(body) == {"models": [{"modelName": "h1", "modelUrl": url}]}
    assert json.loads(request(p, "GET", "/models/h1")[2]) == {"modelName": "h1", "modelUrl": url}
    status, _, body = request(p, "POST", "/models/h1/invoke", kserve_simple([1] * 16, [2] * 16))
    assert status == 200 and json.loads(body)["model_name"] == "simple.tar.gz"
    b, n = binary_simple([1] * 16, [2] * 16)
    status, headers, _ = request(p, "POST", "/models/h1/invoke", b, {"Content-Type": f"{BINARY};json-header-size={n}"})
    assert status == 200 and headers["Content-Type"].startswith(BINARY)
    assert request(p, "DELETE", "/models/h1")[0] == 200
    for method, path in [("GET", "/models/h1"), ("DELETE", "/models/h1"), ("POST", "/models/h1/invoke")]:
        assert request(p, method, path, b"{}")[0] == 404, (method, path)
    for bad in ["/proc/self", str(root / ".." / "x" / "model"), str(root / "h2" / "other")]:
        assert request(p, "POST", "/models", {"model_name": "bad", "url": bad})[0] == 400, bad


def test_multi_model_ping_survives_a_broken_model(mme):
    s, root = mme
    broken = root / "h3" / "model"
    broken.mkdir(parents=True)
    (broken / "config.pbtxt").write_text("max_batch_size: oops")
    (broken / "1").mkdir()
    status, _, body = request(port(s), "POST", "/models", {"model_name": "h3", "url": str(broken)})
    assert status == 400 and "config.pbtxt" in json.loads(body)["error"]
    assert request(port(s), "GET", "/ping")[0] == 200
    assert request(port(s), "POST", "/models", {"model_name": "h2", "url": str(root / "h2" / "model")})[0] == 200


# Reads the custom attributes SageMaker forwards; sets its own for SageMaker to return.
ATTRIBUTES_PY = '''
import json
import numpy as np
import triton_python_backend_utils as pb_utils

KEY = "x-amzn-sagemaker-custom-attributes"


class TritonPythonModel:
    def execute(self, requests):
        out = []
        for r in requests:
            text = pb_utils.get_input_tensor_by_name(r, "TEXT").as_numpy().reshape(-1)[0].decode()
            seen = json.loads(r.parameters()).get(KEY, "")
            tensor = pb_utils.Tensor("OUT", np.array([f"{text}/{seen}".encode()], np.object_))
            out.append(pb_utils.InferenceResponse([tensor], parameters={KEY: f"seen={seen}"}))
        return out
'''

# Decoupled: three responses per request.
THREE_PY = '''
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        for r in requests:
            text = pb_utils.get_input_tensor_by_name(r, "TEXT").as_numpy().reshape(-1)[0].decode()
            sender = r.get_response_sender()
            for i in range(3):
                tensor = pb_utils.Tensor("OUT", np.array([f"{text}{i}".encode()], np.object_))
                sender.send(pb_utils.InferenceResponse([tensor]))
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
'''

TEXT_IO = """
backend: "python"
max_batch_size: 0
input [ { name: "TEXT" data_type: TYPE_STRING dims: [ 1 ] } ]
output [ { name: "OUT" data_type: TYPE_STRING dims: [ 1 ] } ]
"""


def text_models(tmp_path, name):
    folder = tmp_path / "model"
    models.python_model(str(folder), "attributes", ATTRIBUTES_PY, TEXT_IO)
    models.python_model(str(folder), "three", THREE_PY, TEXT_IO + "model_transaction_policy { decoupled: true }\n")
    return folder, {"SAGEMAKER_TRITON_DEFAULT_MODEL_NAME": name}


def events(body):
    return [json.loads(line[len(b"data: "):]) for line in body.split(b"\n") if line.startswith(b"data: ")]


def test_custom_attributes_reach_the_model_and_come_back(tmp_path):
    folder, env = text_models(tmp_path, "attributes")
    with sagemaker(folder, env) as s:
        body = {"inputs": [{"name": "TEXT", "shape": [1], "datatype": "BYTES", "data": ["hi"]}]}
        status, headers, reply = request(port(s), "POST", "/invocations", body,
                                         {"X-Amzn-SageMaker-Custom-Attributes": "trace_id=7"})
        assert status == 200, reply
        assert json.loads(reply)["outputs"][0]["data"] == ["hi/trace_id=7"]
        assert headers["X-Amzn-SageMaker-Custom-Attributes"] == "seen=trace_id=7"
        # Without the header the model sees none; its own attributes still come back.
        status, headers, reply = request(port(s), "POST", "/invocations", body)
        assert json.loads(reply)["outputs"][0]["data"] == ["hi/"] and headers["X-Amzn-SageMaker-Custom-Attributes"] == "seen="


def test_inference_type_generate(tmp_path):
    folder, env = text_models(tmp_path, "attributes")
    with sagemaker(folder, {**env, "SAGEMAKER_TRITON_INFERENCE_TYPE": "generate"}) as s:
        status, headers, reply = request(port(s), "POST", "/invocations", {"TEXT": "hi"},
                                         {"X-Amzn-SageMaker-Custom-Attributes": "a=b"})
        assert status == 200 and headers["Content-Type"] == "application/json", reply
        doc = json.loads(reply)
        assert doc["OUT"] == "hi/a=b" and doc["model_name"] == "attributes", doc
        # A key that is not an input is a parameter, as in Triton's generate: TEXT is missing.
        status, _, reply = request(port(s), "POST", "/invocations", {"NOPE": "hi"})
        assert status == 400 and b"missing required input(s) ['TEXT']" in reply, reply


@pytest.mark.parametrize("how", ["generate_stream", "response stream route"])
def test_streamed_invocations_send_one_event_per_response(tmp_path, how):
    folder, env = text_models(tmp_path, "three")
    if how == "generate_stream":
        env["SAGEMAKER_TRITON_INFERENCE_TYPE"] = "generate_stream"
    path = "/invocations" if how == "generate_stream" else "/invocations-response-stream"
    with sagemaker(folder, env) as s:
        status, headers, reply = request(port(s), "POST", path, {"TEXT": "t"})
        assert status == 200 and headers["Content-Type"].startswith("text/event-stream"), reply
        assert [e["OUT"] for e in events(reply)] == ["t0", "t1", "t2"]


def test_an_unknown_inference_type_stops_the_start(tmp_path):
    folder, env = text_models(tmp_path, "three")
    s = sagemaker(folder, {**env, "SAGEMAKER_TRITON_INFERENCE_TYPE": "predict"}, expect_exit=True)
    assert s.wait_exit() != 0
    assert "SAGEMAKER_TRITON_INFERENCE_TYPE=predict: expected infer, generate, generate_stream or openai" in s.log()


def add(value, end=False):
    body = {"inputs": [{"name": "INPUT", "shape": [1, 1], "datatype": "FP32", "data": [value]}]}
    if end:
        body["parameters"] = {"sequence_end": True}
    return body


def test_stateful_sessions_map_onto_the_sequence_batcher(tmp_path):
    folder = tmp_path / "model"
    models.accumulator(str(folder), idle_us=60_000_000)
    copy_example(str(folder), "simple")
    with sagemaker(folder, {"SAGEMAKER_TRITON_DEFAULT_MODEL_NAME": "accumulator"}) as s:
        p = port(s)
        call = lambda body, session: request(p, "POST", "/invocations", body, {"X-Amzn-SageMaker-Session-Id": session})
        out = lambda reply: json.loads(reply)["outputs"][0]["data"][0]
        status, headers, reply = call(add(2.0), "NEW_SESSION")
        assert status == 200, reply
        first, expires = headers["X-Amzn-SageMaker-New-Session-Id"].split("; Expires=")
        assert out(reply) == 2.0 and expires.endswith("Z") and len(expires) == 20, headers
        _, headers, reply = call(add(1.0), "NEW_SESSION")
        second = headers["X-Amzn-SageMaker-New-Session-Id"].split(";")[0]
        assert second != first and out(reply) == 1.0
        # Each session keeps its own state.
        assert out(call(add(3.0), first)[2]) == 5.0
        assert out(call(add(10.0), second)[2]) == 11.0
        status, headers, reply = call(add(1.0, end=True), first)
        assert status == 200 and out(reply) == 6.0 and headers["X-Amzn-SageMaker-Closed-Session-Id"] == first
        # A closed session is gone; an unknown one was never started.
        for gone in (first, "12345"):
            status, _, reply = call(add(1.0), gone)
            assert status == 400 and b"START flag" in reply, reply
        assert out(call(add(1.0), second)[2]) == 12.0
        status, _, reply = call(add(1.0), "bad id")
        assert status == 400 and b"NEW_SESSION" in reply
    with sagemaker(folder, {"SAGEMAKER_TRITON_DEFAULT_MODEL_NAME": "simple"}) as s:
        status, _, reply = request(port(s), "POST", "/invocations", kserve_simple([1] * 16, [1] * 16),
                                   {"X-Amzn-SageMaker-Session-Id": "NEW_SESSION"})
        assert status == 400 and b"no sequence_batching" in reply, reply
