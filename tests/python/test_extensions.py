"""Triton's protocol extensions over both HTTP and gRPC: model repository control, shared memory,
log and trace settings."""
import json
import os
import threading

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import tritonclient.utils.shared_memory as shm
from tritonclient.utils import InferenceServerException

import models
from conftest import EXAMPLES, copy_example
from ferry_server import Server

PROTOCOLS = ["http", "grpc"]


def clients(s):
    return {"http": (s.client(), httpclient), "grpc": (s.grpc_client(), grpcclient)}


def index_of(client, protocol):
    if protocol == "http":
        return client.get_model_repository_index()
    return [json.loads(json.dumps({k: v for k, v in (("name", m.name), ("version", m.version), ("state", m.state),
                                                          ("reason", m.reason)) if v}))
            for m in client.get_model_repository_index().models]


def is_ready(client, name):
    """Like Triton, gRPC ModelReady answers an error (not False) for a model it cannot serve."""
    try:
        return client.is_model_ready(name)
    except InferenceServerException:
        return False


def add_mul(client, lib, version=""):
    a = np.ones((1, 4), dtype=np.float32)
    inputs = [lib.InferInput(n, [1, 4], "FP32").set_data_from_numpy(a) for n in ("a", "b")]
    return client.infer("add_mul", inputs, model_version=version)


@pytest.fixture
def explicit(fresh_repo):
    copy_example(fresh_repo, "simple")
    models.add_mul(fresh_repo, "add_mul", versions=(1,))
    with Server(["--model-repository", fresh_repo, "--model-control-mode=explicit", "--load-model=simple"]) as s:
        yield s, fresh_repo


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_repository_index_load_unload(explicit, protocol):
    s, repo = explicit
    client, lib = clients(s)[protocol]
    assert index_of(client, protocol) == [{"name": "add_mul"}, {"name": "simple", "version": "1", "state": "READY"}]
    client.load_model("add_mul")
    assert add_mul(client, lib).as_numpy("y")[0, 0] == 2.0
    assert {"name": "add_mul", "version": "1", "state": "READY"} in index_of(client, protocol)
    client.unload_model("add_mul")
    assert {"name": "add_mul", "version": "1", "state": "UNAVAILABLE", "reason": "unloaded"} in index_of(client, protocol)
    assert not is_ready(client, "add_mul")
    ready = client.get_model_repository_index() if protocol == "http" else None
    if ready is not None:
        only = s.client()._post("v2/repository/index", json.dumps({"ready": True}), None, None)
        assert [m["name"] for m in json.loads(only.read())] == ["simple"]
    with pytest.raises(InferenceServerException, match="no model folder named 'ghost'"):
        client.load_model("ghost")


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_load_with_config_override_and_files(explicit, protocol):
    s, repo = explicit
    client, lib = clients(s)[protocol]
    onnx_bytes = open(os.path.join(repo, "add_mul", "1", "model.onnx"), "rb").read()
    config = json.dumps({"name": "add_mul", "backend": "onnxruntime", "max_batch_size": 2})
    client.load_model("add_mul", config=config, files={"file:7/model.onnx": onnx_bytes})
    assert client.get_model_metadata("add_mul", as_json=True)["versions"] == ["7"] if protocol == "grpc" else \
        client.get_model_metadata("add_mul")["versions"] == ["7"]
    cfg = client.get_model_config("add_mul")
    cfg = cfg["config"] if protocol == "grpc" and isinstance(cfg, dict) else cfg
    assert (cfg.config.max_batch_size if protocol == "grpc" else cfg["max_batch_size"]) == 2
    with pytest.raises(InferenceServerException, match="relative path inside the model folder"):
        client.load_model("add_mul", config=config, files={"file:../escape/model.onnx": onnx_bytes})
    with pytest.raises(InferenceServerException, match="Invalid config override"):
        client.load_model("add_mul", config=json.dumps({"inputs": []}))


def test_invalid_reload_keeps_the_old_version_serving(explicit):
    s, repo = explicit
    client = s.client()
    client.load_model("add_mul")
    stop, failures, done = threading.Event(), [], []

    def traffic():
        own = s.client()  # tritonclient clients are not shared between threads
        while not stop.is_set():
            try:
                add_mul(own, httpclient)
                done.append(1)
            except Exception as e:  # noqa: BLE001 - every failure is recorded and asserted on
                failures.append(str(e))

    worker = threading.Thread(target=traffic)
    worker.start()
    with open(os.path.join(repo, "add_mul", "config.pbtxt"), "w") as f:
        f.write("max_batch_size: 4\ninput [ { name: \"a\" data_type: TYPE_FP32 dims: [ 4 ] bogus: 1 } ]\n")
    with pytest.raises(InferenceServerException) as err:
        client.load_model("add_mul")
    assert "config.pbtxt: line 2" in str(err.value) and "bogus" in str(err.value)
    os.remove(os.path.join(repo, "add_mul", "config.pbtxt"))
    models.add_mul(repo, "add_mul", versions=(2,))
    client.load_model("add_mul")  # a good new version swaps in under traffic
    stop.set()
    worker.join()
    assert failures == []
    assert len(done) > 0
    assert add_mul(client, httpclient).get_response()["model_version"] == "2"
    entry = [m for m in client.get_model_repository_index() if m["name"] == "add_mul"]
    assert entry == [{"name": "add_mul", "version": "2", "state": "READY"}]


def test_load_is_refused_outside_explicit_mode(server):
    with pytest.raises(InferenceServerException) as err:
        server.client().load_model("simple")
    assert "[503]" in str(err.value) and "not allowed" in str(err.value)
    with pytest.raises(InferenceServerException) as err:
        server.grpc_client().unload_model("simple")
    assert err.value.status() == "StatusCode.UNAVAILABLE"


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_system_shared_memory_inputs_and_outputs(protocol):
    with Server(["--model-repository", EXAMPLES, "--allow-client-shm"]) as s:
        client, lib = clients(s)[protocol]
        key_in, key_out = f"/ferry_test_in_{protocol}", f"/ferry_test_out_{protocol}"
        a = np.arange(16, dtype=np.int32).reshape(1, 16)
        b = np.full((1, 16), 3, dtype=np.int32)
        hin = shm.create_shared_memory_region("in", key_in, 128)
        hout = shm.create_shared_memory_region("out", key_out, 128)
        try:
            shm.set_shared_memory_region(hin, [a, b])
            client.unregister_system_shared_memory()
            client.register_system_shared_memory("in", key_in, 128)
            client.register_system_shared_memory("out", key_out, 128)
            status = client.get_system_shared_memory_status()
            names = [r["name"] for r in status] if protocol == "http" else sorted(status.regions)
            assert names == ["in", "out"]
            i0 = lib.InferInput("INPUT0", [1, 16], "INT32")
            i0.set_shared_memory("in", 64)
            i1 = lib.InferInput("INPUT1", [1, 16], "INT32")
            i1.set_shared_memory("in", 64, offset=64)
            o0 = lib.InferRequestedOutput("OUTPUT0")
            o0.set_shared_memory("out", 64)
            o1 = lib.InferRequestedOutput("OUTPUT1")
            o1.set_shared_memory("out", 64, offset=64)
            client.infer("simple", [i0, i1], outputs=[o0, o1])
            np.testing.assert_array_equal(shm.get_contents_as_numpy(hout, np.int32, [1, 16]), a + b)
            np.testing.assert_array_equal(shm.get_contents_as_numpy(hout, np.int32, [1, 16], offset=64), a - b)
            small = lib.InferRequestedOutput("OUTPUT0")
            small.set_shared_memory("out", 16)
            with pytest.raises(InferenceServerException, match="should be at least 64 bytes"):
                client.infer("simple", [i0, i1], outputs=[small])
            with pytest.raises(InferenceServerException, match="already in manager"):
                client.register_system_shared_memory("in", key_in, 128)
            client.unregister_system_shared_memory("in")
            with pytest.raises(InferenceServerException, match="Unable to find shared memory region: 'in'"):
                client.infer("simple", [i0, i1])
        finally:
            client.unregister_system_shared_memory()
            shm.destroy_shared_memory_region(hin)
            shm.destroy_shared_memory_region(hout)


def test_shared_memory_needs_the_flag(server):
    with pytest.raises(InferenceServerException, match="allow-client-shm"):
        server.client().register_system_shared_memory("r", "/whatever", 8)
    with pytest.raises(InferenceServerException) as err:
        server.grpc_client().register_system_shared_memory("r", "/whatever", 8)
    assert err.value.status() == "StatusCode.UNIMPLEMENTED"
    assert server.client().get_system_shared_memory_status() == []
    assert server.client().get_cuda_shared_memory_status() == []
    server.client().unregister_cuda_shared_memory()


def test_log_settings_change_at_run_time():
    with Server(["--model-repository", EXAMPLES, "--allow-client-shm"]) as s:
        http, grpc_c = s.client(), s.grpc_client()
        assert http.get_log_settings()["log_verbose_level"] == 0
        key = "/ferry_test_log"
        h = shm.create_shared_memory_region("r", key, 8)
        try:
            http.register_system_shared_memory("r", key, 8)
            assert "registered system shared memory" not in s.log()
            settings = grpc_c.update_log_settings({"log_verbose_level": 1}, as_json=True)["settings"]
            assert settings["log_verbose_level"]["uint32_param"] == 1
            http.unregister_system_shared_memory()
            http.register_system_shared_memory("r", key, 8)
            assert s.wait_log("registered system shared memory")
            http.unregister_system_shared_memory()
        finally:
            shm.destroy_shared_memory_region(h)
        assert http.update_log_settings({"log_format": "ISO8601"})["log_format"] == "ISO8601"
        with pytest.raises(InferenceServerException, match="log file location can not be updated"):
            http.update_log_settings({"log_file": "/tmp/x"})


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_trace_settings(server, protocol):
    client, _ = clients(server)[protocol]
    def get(model=None):
        t = client.get_trace_settings(model_name=model) if protocol == "http" else \
            client.get_trace_settings(model_name=model, as_json=True)["settings"]
        return t if protocol == "http" else {k: v["value"] for k, v in t.items()}
    assert get()["trace_level"] == ["OFF"]
    client.update_trace_settings(model_name="simple", settings={"trace_rate": "42", "trace_level": ["TIMESTAMPS"]})
    per_model = get("simple")
    assert per_model["trace_rate"] in ("42", ["42"]) and per_model["trace_level"] == ["TIMESTAMPS"]
    assert get()["trace_rate"] in ("1000", ["1000"])
    client.update_trace_settings(model_name="simple", settings={"trace_rate": None, "trace_level": None})
    assert get("simple")["trace_rate"] in ("1000", ["1000"])
    with pytest.raises(InferenceServerException):
        client.update_trace_settings(settings={"trace_rate": "fast"})
    with pytest.raises(InferenceServerException):
        client.get_trace_settings(model_name="nope")


def test_explicit_mode_loads_every_model_with_star(fresh_repo):
    copy_example(fresh_repo, "simple")
    copy_example(fresh_repo, "simple_string")
    with Server(["--model-repository", fresh_repo, "--model-control-mode=explicit", "--load-model=*"]) as s:
        assert s.client().is_model_ready("simple") and s.client().is_model_ready("simple_string")
    with Server(["--model-repository", fresh_repo, "--model-control-mode=explicit"]) as s:
        assert [m["name"] for m in s.client().get_model_repository_index()] == ["simple", "simple_string"]
        assert not s.client().is_model_ready("simple")
        assert s.client().is_server_ready(), "models never loaded do not hold readiness back"
