"""Ensembles through the real server: parallel steps, BYTES through steps, batching inside a step
under load, errors in a step, load-time errors, explicit-mode load/unload of an ensemble and its
parts, over HTTP and gRPC."""
import json
import os
import threading

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

import models
from ferry_server import Server

LIBS = {"http": httpclient, "grpc": grpcclient}

ADD_MUL = """
max_batch_size: 8
dynamic_batching { max_queue_delay_microseconds: 20000 }
input [ { name: "a" data_type: TYPE_FP32 dims: [ 4 ] }, { name: "b" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "y" data_type: TYPE_FP32 dims: [ 4 ] }, { name: "z" data_type: TYPE_FP32 dims: [ 4 ] } ]
"""

# OUT_Y = (a + b) + a*b and OUT_Z = (a + b) * b: steps 1 and 2 both wait for step 0 only, so they
# run at the same time.
PIPELINE = """
name: "pipeline"
platform: "ensemble"
max_batch_size: 4
input [ { name: "IN_A" data_type: TYPE_FP32 dims: [ 4 ] }, { name: "IN_B" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "OUT_Y" data_type: TYPE_FP32 dims: [ 4 ] }, { name: "OUT_Z" data_type: TYPE_FP32 dims: [ 4 ] } ]
ensemble_scheduling {
  step [
    { model_name: "add_mul" model_version: -1
      input_map { key: "a" value: "IN_A" } input_map { key: "b" value: "IN_B" }
      output_map { key: "y" value: "sum" } output_map { key: "z" value: "prod" } },
    { model_name: "add_mul" model_version: 1
      input_map { key: "a" value: "sum" } input_map { key: "b" value: "prod" }
      output_map { key: "y" value: "OUT_Y" } },
    { model_name: "add_mul" model_version: -1
      input_map { key: "a" value: "sum" } input_map { key: "b" value: "IN_B" }
      output_map { key: "z" value: "OUT_Z" } }
  ]
}
"""

STRINGS = """
name: "strings"
platform: "ensemble"
max_batch_size: 8
input [ { name: "TEXT" data_type: TYPE_STRING dims: [ -1 ] } ]
output [ { name: "ECHO" data_type: TYPE_STRING dims: [ -1 ] } ]
ensemble_scheduling { step [
  { model_name: "identity_bytes" model_version: -1 input_map { key: "INPUT0" value: "TEXT" } output_map { key: "OUTPUT0" value: "mid" } },
  { model_name: "identity_bytes" model_version: -1 input_map { key: "INPUT0" value: "mid" } output_map { key: "OUTPUT0" value: "ECHO" } }
] }
"""


def ensemble_folder(repo, name, config):
    os.makedirs(os.path.join(repo, name, "1"), exist_ok=True)
    models.write(os.path.join(repo, name, "config.pbtxt"), config)


def pipeline_repo(repo):
    models.add_mul(repo, "add_mul", config=ADD_MUL)
    models.identity(repo, "identity_bytes", "BYTES")
    ensemble_folder(repo, "pipeline", PIPELINE)
    ensemble_folder(repo, "strings", STRINGS)
    return repo


def pipeline_inputs(lib, a, b):
    return [lib.InferInput("IN_A", list(a.shape), "FP32").set_data_from_numpy(a),
            lib.InferInput("IN_B", list(b.shape), "FP32").set_data_from_numpy(b)]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    repo = pipeline_repo(str(tmp_path_factory.mktemp("ensembles")))
    with Server(["--model-repository", repo]) as s:
        yield s


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_parallel_steps_compute_the_pipeline(server, protocol):
    client = server.client() if protocol == "http" else server.grpc_client()
    lib = LIBS[protocol]
    a = np.arange(8, dtype=np.float32).reshape(2, 4)
    b = np.full((2, 4), 3.0, dtype=np.float32)
    r = client.infer("pipeline", pipeline_inputs(lib, a, b), request_id="req-7")
    np.testing.assert_allclose(r.as_numpy("OUT_Y"), (a + b) + a * b)
    np.testing.assert_allclose(r.as_numpy("OUT_Z"), (a + b) * b)
    assert r.get_response(as_json=True)["id"] == "req-7" if protocol == "grpc" else r.get_response()["id"] == "req-7"
    only = lib.InferRequestedOutput("OUT_Z")
    r = client.infer("pipeline", pipeline_inputs(lib, a, b), outputs=[only])
    assert r.as_numpy("OUT_Y") is None
    meta = client.get_model_metadata("pipeline")
    platform = meta["platform"] if protocol == "http" else meta.platform
    assert platform == "ensemble"
    assert client.is_model_ready("pipeline")


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_bytes_pass_through_steps(server, protocol):
    client = server.client() if protocol == "http" else server.grpc_client()
    lib = LIBS[protocol]
    text = np.array([["héllo".encode(), b"", b"world"]], dtype=np.object_)
    t = lib.InferInput("TEXT", [1, 3], "BYTES").set_data_from_numpy(text)
    r = client.infer("strings", [t])
    assert r.as_numpy("ECHO").tolist() == text.tolist()


def test_an_error_in_a_step_names_the_step_and_its_model(server):
    bad = np.array([[b"\xff\xfe"]], dtype=np.object_)
    t = httpclient.InferInput("TEXT", [1, 1], "BYTES").set_data_from_numpy(bad)
    with pytest.raises(InferenceServerException) as err:
        server.client().infer("strings", [t])
    msg = str(err.value)
    assert "in ensemble 'strings', step 0 (model 'identity_bytes')" in msg and "UTF-8" in msg, msg
    assert err.value.status() == "400"


def test_steps_batch_with_other_traffic(server):
    """Concurrent ensemble requests meet in the composing model's dynamic batcher."""
    before = server.client().get_inference_statistics("add_mul")["model_stats"][0]
    client = httpclient.InferenceServerClient(server.url, concurrency=16)
    a = np.ones((1, 4), dtype=np.float32)
    pending = [client.async_infer("pipeline", pipeline_inputs(httpclient, a * k, a)) for k in range(32)]
    for k, p in enumerate(pending):
        np.testing.assert_allclose(p.get_result().as_numpy("OUT_Z"), (a * k + a) * a)
    after = server.client().get_inference_statistics("add_mul")["model_stats"][0]
    inferences = after["inference_count"] - before["inference_count"]
    executions = after["execution_count"] - before["execution_count"]
    assert inferences == 3 * 32, "every step counts in the composing model's own statistics"
    assert executions < inferences, (executions, inferences)
    ens = server.client().get_inference_statistics("pipeline")["model_stats"][0]
    assert ens["inference_stats"]["success"]["count"] >= 32


BROKEN = {
    "unknown_model": ("""
platform: "ensemble" max_batch_size: 4
input [ { name: "X" data_type: TYPE_FP32 dims: [ 4 ] } ] output [ { name: "Y" data_type: TYPE_FP32 dims: [ 4 ] } ]
ensemble_scheduling { step [ { model_name: "ghost" model_version: -1 input_map { key: "a" value: "X" } output_map { key: "y" value: "Y" } } ] }
""", "step 0 (model 'ghost')"),
    "never_produced": ("""
platform: "ensemble" max_batch_size: 4
input [ { name: "X" data_type: TYPE_FP32 dims: [ 4 ] } ] output [ { name: "Y" data_type: TYPE_FP32 dims: [ 4 ] } ]
ensemble_scheduling { step [ { model_name: "add_mul" model_version: -1 input_map { key: "a" value: "X" } input_map { key: "b" value: "X" } output_map { key: "y" value: "other" } } ] }
""", "output 'Y' is never produced"),
    "wrong_type": ("""
platform: "ensemble" max_batch_size: 4
input [ { name: "X" data_type: TYPE_INT32 dims: [ 4 ] } ] output [ { name: "Y" data_type: TYPE_FP32 dims: [ 4 ] } ]
ensemble_scheduling { step [ { model_name: "add_mul" model_version: -1 input_map { key: "a" value: "X" } input_map { key: "b" value: "X" } output_map { key: "y" value: "Y" } } ] }
""", "input 'a' (tensor 'X') is FP32 but the tensor mapped to it is INT32"),
    "too_big": ("""
platform: "ensemble" max_batch_size: 64
input [ { name: "X" data_type: TYPE_FP32 dims: [ 4 ] } ] output [ { name: "Y" data_type: TYPE_FP32 dims: [ 4 ] } ]
ensemble_scheduling { step [ { model_name: "add_mul" model_version: -1 input_map { key: "a" value: "X" } input_map { key: "b" value: "X" } output_map { key: "y" value: "Y" } } ] }
""", "max_batch_size is 64 but the model allows 8"),
}


def test_load_errors_name_the_ensemble_step_and_tensor(fresh_repo):
    models.add_mul(fresh_repo, "add_mul", config=ADD_MUL)
    for name, (config, _) in BROKEN.items():
        ensemble_folder(fresh_repo, name, config)
    with Server(["--model-repository", fresh_repo, "--exit-on-error=false"]) as s:
        index = {m["name"]: m for m in s.client().get_model_repository_index()}
        for name, (_, want) in BROKEN.items():
            assert index[name]["state"] == "UNAVAILABLE", index[name]
            assert want in index[name]["reason"] and f"ensemble '{name}'" in index[name]["reason"], index[name]
        assert index["add_mul"]["state"] == "READY"


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_explicit_mode_loads_the_parts_and_unloading_a_part_makes_the_ensemble_unavailable(fresh_repo, protocol):
    pipeline_repo(fresh_repo)
    args = ["--model-repository", fresh_repo, "--model-control-mode=explicit", "--load-model=pipeline"]
    with Server(args) as s:
        client = s.client() if protocol == "http" else s.grpc_client()
        lib = LIBS[protocol]
        assert client.is_model_ready("add_mul"), "loading the ensemble loaded its composing model"
        assert client.is_server_ready()
        a = np.ones((1, 4), dtype=np.float32)
        client.infer("pipeline", pipeline_inputs(lib, a, a))
        client.unload_model("add_mul")
        with pytest.raises(InferenceServerException, match="composing model 'add_mul' is not ready"):
            client.infer("pipeline", pipeline_inputs(lib, a, a))
        index = s.client().get_model_repository_index()
        entry = next(m for m in index if m["name"] == "pipeline")
        assert entry["state"] == "UNAVAILABLE" and "add_mul" in entry["reason"], entry
        client.unload_model("pipeline")
        client.load_model("strings")
        assert client.is_model_ready("identity_bytes")
        client.load_model("pipeline")
        np.testing.assert_allclose(client.infer("pipeline", pipeline_inputs(lib, a, a)).as_numpy("OUT_Y"), 3 * a)


def test_ensemble_with_a_config_override_over_the_load_api(fresh_repo):
    models.add_mul(fresh_repo, "add_mul", config=ADD_MUL)
    with Server(["--model-repository", fresh_repo, "--model-control-mode=explicit"]) as s:
        config = {"name": "wrapped", "platform": "ensemble", "max_batch_size": 4,
                  "input": [{"name": "X", "data_type": "TYPE_FP32", "dims": [4]}],
                  "output": [{"name": "Y", "data_type": "TYPE_FP32", "dims": [4]}],
                  "ensemble_scheduling": {"step": [{"model_name": "add_mul", "model_version": -1,
                                                    "input_map": {"a": "X", "b": "X"}, "output_map": {"y": "Y"}}]}}
        s.client().load_model("wrapped", config=json.dumps(config), files={"file:1/.keep": b""})
        x = np.full((1, 4), 2.0, dtype=np.float32)
        r = s.client().infer("wrapped", [httpclient.InferInput("X", [1, 4], "FP32").set_data_from_numpy(x)])
        np.testing.assert_allclose(r.as_numpy("Y"), x + x)


def test_vertex_instances_and_sagemaker_invocations_reach_an_ensemble(fresh_repo, tmp_path):
    from platforms import request
    from test_sagemaker import port as sm_port
    from test_sagemaker import sagemaker
    from test_vertex import PREDICT, vertex
    from test_vertex import port as vx_port

    pipeline_repo(fresh_repo)
    instances = [{"IN_A": [1, 2, 3, 4], "IN_B": [2, 2, 2, 2]}]
    with vertex(["--model-repository", fresh_repo, "--vertex-ai-default-model=pipeline"]) as s:
        status, _, body = request(vx_port(s), "POST", PREDICT, {"instances": instances})
        assert status == 200, body
        pred = json.loads(body)["predictions"][0]
        assert pred["OUT_Y"] == [5.0, 8.0, 11.0, 14.0] and pred["OUT_Z"] == [6.0, 8.0, 10.0, 12.0]
    env = {"SAGEMAKER_TRITON_DEFAULT_MODEL_NAME": "pipeline"}
    with sagemaker(fresh_repo, env=env) as s:
        status, _, body = request(sm_port(s), "POST", "/invocations", {"instances": instances})
        assert status == 200, body
        assert json.loads(body)["predictions"][0]["OUT_Z"] == [6.0, 8.0, 10.0, 12.0]
    # A multi-model endpoint archive: the ensemble beside its composing models.
    root = tmp_path / "models"
    archive = root / "e1" / "model"
    pipeline_repo(str(archive))
    env = {"SAGEMAKER_MULTI_MODEL": "true", "FERRY_SAGEMAKER_MODELS_ROOT": str(root)}
    with sagemaker(tmp_path / "unused", env=env) as s:
        p = sm_port(s)
        status, _, body = request(p, "POST", "/models", {"model_name": "e1", "url": str(archive)})
        assert status == 400 and "2 ensembles" in json.loads(body)["error"], body
        import shutil
        shutil.rmtree(archive / "strings")
        status, _, body = request(p, "POST", "/models", {"model_name": "e1", "url": str(archive)})
        assert status == 200, body
        status, _, body = request(p, "POST", "/models/e1/invoke", {"instances": instances})
        assert status == 200 and json.loads(body)["predictions"][0]["OUT_Y"] == [5.0, 8.0, 11.0, 14.0], body
        assert request(p, "DELETE", "/models/e1")[0] == 200
        status, _, body = request(p, "POST", "/models", {"model_name": "e1", "url": str(archive)})
        assert status == 200, "the composing models left with the ensemble, so they load again"
