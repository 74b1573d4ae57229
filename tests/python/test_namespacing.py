"""`--model-namespacing=true` through the real server, as Triton's qa/L0_model_namespacing tests
it: a model name in two repositories loads twice; each ensemble runs its own repository's model
of a step's name, and another repository's when its own has none (poll mode follows folders
that come and go); a name alone in two repositories is refused with Triton's "ambiguity" error;
`<i>::<name>` addresses one; explicit load and unload by name act on every repository; metrics
carry the repository as a `namespace` label."""
import os
import shutil

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

import models
from ferry_server import Server, wait_for

STEP = """
max_batch_size: 8
input [ { name: "a" data_type: TYPE_FP32 dims: [ 4 ] }, { name: "b" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "y" data_type: TYPE_FP32 dims: [ 4 ] }, { name: "z" data_type: TYPE_FP32 dims: [ 4 ] } ]
"""

ENSEMBLE = """
platform: "ensemble" max_batch_size: 8
input [ { name: "X" data_type: TYPE_FP32 dims: [ 4 ] } ] output [ { name: "Y" data_type: TYPE_FP32 dims: [ 4 ] } ]
ensemble_scheduling { step [ { model_name: "step" model_version: -1 input_map { key: "a" value: "X" }
  input_map { key: "b" value: "X" } output_map { key: "y" value: "Y" } } ] }
"""

X = np.arange(4, dtype=np.float32).reshape(1, 4)


def repos(root):
    """Two repositories, each with a model `step` (y = a + b in the first, a + b + 1 in the
    second: add_mul's version 2), an ensemble `pipe` of the same name in both, and one ensemble
    of its own (`pipe_a`, `pipe_b`). All use `step`."""
    paths = []
    for i, own in enumerate(["pipe_a", "pipe_b"]):
        repo = os.path.join(root, f"repo{i}")
        models.add_mul(repo, "step", versions=(i + 1,), config=STEP)
        for name in ["pipe", own]:
            models.write(os.path.join(repo, name, "config.pbtxt"), ENSEMBLE)
            os.makedirs(os.path.join(repo, name, "1"))
        paths.append(repo)
    return paths


def infer(client, lib, model, name="X"):
    inp = lib.InferInput(name, [1, 4], "FP32")
    inp.set_data_from_numpy(X)
    return client.infer(model, [inp])


def offset(client, lib, model, out="Y", inp="X"):
    """What the model adds to 2x: 0 from the first repository's `step`, 1 from the second's."""
    if inp == "a":
        a, b = lib.InferInput("a", [1, 4], "FP32"), lib.InferInput("b", [1, 4], "FP32")
        a.set_data_from_numpy(X)
        b.set_data_from_numpy(X)
        result = client.infer(model, [a, b]).as_numpy(out)
    else:
        result = infer(client, lib, model).as_numpy(out)
    d = result - 2 * X
    assert np.all(d == d.flat[0]), result
    return int(d.flat[0])


def ambiguous(client, lib, model, inp="X"):
    with pytest.raises(InferenceServerException) as e:
        offset(client, lib, model, inp=inp, out="y" if inp == "a" else "Y")
    assert "ambiguity" in e.value.message(), e.value.message()
    assert f"identifiers of model '{model}'" in e.value.message()
    return e.value


def args(paths, mode):
    a = ["--model-namespacing=true", f"--model-control-mode={mode}"]
    for p in paths:
        a += ["--model-repository", p]
    return a + (["--repository-poll-secs=1"] if mode == "poll" else [])


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_each_ensemble_runs_its_own_repositorys_model(tmp_path, protocol):
    paths = repos(str(tmp_path))
    lib = httpclient if protocol == "http" else grpcclient
    with Server(args(paths, "none")) as s:
        c = s.client() if protocol == "http" else s.grpc_client()
        assert c.is_server_ready()
        assert offset(c, lib, "pipe_a") == 0
        assert offset(c, lib, "pipe_b") == 1
        assert offset(c, lib, "0::pipe") == 0 and offset(c, lib, "1::pipe") == 1
        assert offset(c, lib, "0::step", out="y", inp="a") == 0
        assert offset(c, lib, "1::step", out="y", inp="a") == 1
        ambiguous(c, lib, "pipe")
        ambiguous(c, lib, "step", inp="a")
        # The index lists both copies, by their own names.
        index = s.client().get_model_repository_index()
        assert sorted(m["name"] for m in index) == ["pipe", "pipe", "pipe_a", "pipe_b", "step", "step"], index
        assert all(m["state"] == "READY" for m in index), index
        # Responses and metadata carry the model's name.
        assert s.client().get_model_metadata("1::step")["name"] == "step"
        metrics = s.metrics()
        for p in paths:
            line = f'nv_inference_count{{model="step",namespace="{p}",version="{1 + paths.index(p)}"}} 3'
            assert line in metrics, metrics


def test_ambiguity_is_a_400_over_http(tmp_path):
    import json
    import urllib.request
    paths = repos(str(tmp_path))
    with Server(args(paths, "none")) as s:
        body = json.dumps({"inputs": [{"name": "X", "shape": [1, 4], "datatype": "FP32", "data": [0, 1, 2, 3]}]})
        req = urllib.request.Request(f"http://{s.url}/v2/models/pipe/infer", data=body.encode(), method="POST")
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=10)
        assert e.value.code == 400
        assert "ambiguity" in json.loads(e.value.read())["error"]
        assert s.status("/v2/models/pipe/ready") == 400
        assert s.status("/v2/models/pipe_a/ready") == 200


def test_poll_follows_a_step_model_that_leaves_and_returns(tmp_path):
    paths = repos(str(tmp_path))
    own = os.path.join(paths[0], "step")
    away = os.path.join(str(tmp_path), "step_away")
    with Server(args(paths, "poll")) as s:
        c = s.client()
        assert offset(c, httpclient, "pipe_a") == 0
        ambiguous(c, httpclient, "step", inp="a")
        shutil.move(own, away)
        wait_for(lambda: sum(m["name"] == "step" and m.get("state") == "READY"
                             for m in c.get_model_repository_index()) == 1, "the first repository's step to unload")
        # pipe_a was not reloaded: its step now finds the other repository's model.
        assert offset(c, httpclient, "pipe_a") == 1
        assert offset(c, httpclient, "step", out="y", inp="a") == 1
        shutil.move(away, own)
        wait_for(lambda: sum(m["name"] == "step" and m.get("state") == "READY"
                             for m in c.get_model_repository_index()) == 2, "the first repository's step to return")
        assert offset(c, httpclient, "pipe_a") == 0
        assert offset(c, httpclient, "pipe_b") == 1
        ambiguous(c, httpclient, "step", inp="a")


def test_explicit_load_and_unload_act_in_every_repository(tmp_path):
    paths = repos(str(tmp_path))
    with Server(args(paths, "explicit")) as s:
        c = s.client()
        assert c.get_model_repository_index() and not any(m.get("state") == "READY" for m in c.get_model_repository_index())
        # One name, two ensembles: both load, each with its own repository's step.
        c.load_model("pipe")
        assert offset(c, httpclient, "0::pipe") == 0 and offset(c, httpclient, "1::pipe") == 1
        ambiguous(c, httpclient, "pipe")
        # pipe_a's own step serves already; a repository's own model is preferred.
        c.load_model("pipe_a")
        assert offset(c, httpclient, "pipe_a") == 0
        c.unload_model("step")
        assert not c.is_model_ready("0::step") and not c.is_model_ready("1::step")
        with pytest.raises(InferenceServerException) as e:
            offset(c, httpclient, "pipe_a")
        assert "not ready" in e.value.message(), e.value.message()
        # A qualified name loads that repository's model only.
        c.load_model("1::step")
        assert c.is_model_ready("1::step") and not c.is_model_ready("0::step")
        assert offset(c, httpclient, "pipe_a") == 1
        assert offset(c, httpclient, "step", out="y", inp="a") == 1


def test_without_namespacing_a_name_in_two_repositories_loads_nowhere(tmp_path):
    paths = repos(str(tmp_path))
    with Server(["--model-repository", paths[0], "--model-repository", paths[1], "--exit-on-error=false"]) as s:
        assert "two repositories" in s.log()
        assert not s.client().is_model_ready("step")


def test_qualified_steps_shadowing_folders_and_a_repository_given_twice(tmp_path):
    paths = repos(str(tmp_path))
    # An ensemble step may name another repository's model; a folder named like a qualified key
    # is no model (it would shadow repository 0's).
    third = os.path.join(str(tmp_path), "repo2")
    models.write(os.path.join(third, "pipe_q", "config.pbtxt"), ENSEMBLE.replace('"step"', '"1::step"'))
    os.makedirs(os.path.join(third, "pipe_q", "1"))
    models.add_mul(third, "0::step", versions=(2,), config=STEP)
    with Server(args(paths + [third, paths[0] + "/"], "none")) as s:
        c = s.client()
        assert c.is_server_ready()
        assert offset(c, httpclient, "pipe_q") == 1
        assert offset(c, httpclient, "0::step", out="y", inp="a") == 0
        assert "skipping a folder whose name holds '::'" in s.log()
        # The first repository given twice is one repository: each model once in the index.
        names = sorted(m["name"] for m in c.get_model_repository_index())
        assert names == ["pipe", "pipe", "pipe_a", "pipe_b", "pipe_q", "step", "step"], names
