"""Model repositories on disk: configs, versions, auto-complete, and failures that stay local to
one model."""
import os

import numpy as np
import pytest
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

import models
from conftest import EXAMPLES, copy_example
from ferry_server import Server


def add_mul_infer(client, version=""):
    a = np.ones((1, 4), dtype=np.float32)
    inputs = []
    for name in ("a", "b"):
        i = httpclient.InferInput(name, [1, 4], "FP32")
        i.set_data_from_numpy(a)
        inputs.append(i)
    return client.infer("add_mul", inputs, model_version=version)


BROKEN = """name: "broken"
max_batch_size: 4
input [ { name: "a" data_type: TYPE_FP32 dimz: [ 4 ] } ]
"""


def test_broken_config_fails_only_that_model(fresh_repo):
    copy_example(fresh_repo, "simple")
    models.add_mul(fresh_repo, "broken", config=BROKEN)
    with Server(["--model-repository", fresh_repo, "--exit-on-error=false"]) as s:
        client = s.client()
        assert client.is_model_ready("simple")
        assert not client.is_model_ready("broken")
        assert not client.is_server_ready(), "strict readiness: a model failed"
        with pytest.raises(InferenceServerException) as err:
            client.get_model_metadata("broken")
        msg = str(err.value)
        assert "config.pbtxt" in msg and "line 3, column 42" in msg and "dimz" in msg, msg
        assert "broken" in s.log() and "dimz" in s.log()


def test_broken_config_with_exit_on_error_stops_start_up(fresh_repo):
    copy_example(fresh_repo, "simple")
    models.add_mul(fresh_repo, "broken", config=BROKEN)
    s = Server(["--model-repository", fresh_repo], expect_exit=True)
    assert s.wait_exit() != 0
    assert "failed to load all models" in s.log() and "dimz" in s.log()


def test_non_strict_readiness(fresh_repo):
    copy_example(fresh_repo, "simple")
    models.add_mul(fresh_repo, "broken", config=BROKEN)
    with Server(["--model-repository", fresh_repo, "--exit-on-error=false", "--strict-readiness=false"]) as s:
        assert s.client().is_server_ready()


def test_version_policy_and_version_routing(fresh_repo):
    models.add_mul(fresh_repo, "add_mul", versions=(1, 2, 3), config="version_policy: { latest { num_versions: 2 } }\n")
    with Server(["--model-repository", fresh_repo]) as s:
        client = s.client()
        assert client.get_model_metadata("add_mul")["versions"] == ["2", "3"]
        assert not client.is_model_ready("add_mul", "1")
        assert add_mul_infer(client, "2").as_numpy("y")[0, 0] == 3.0
        latest = add_mul_infer(client)
        assert latest.as_numpy("y")[0, 0] == 4.0
        assert latest.get_response()["model_version"] == "3"


def test_specific_and_all_policies(fresh_repo):
    models.add_mul(fresh_repo, "add_mul", versions=(1, 2, 3), config="version_policy: { specific { versions: [1, 3] } }\n")
    models.add_mul(fresh_repo, "every", versions=(1, 2), config="name: \"every\"\nversion_policy: { all { } }\n")
    with Server(["--model-repository", fresh_repo]) as s:
        client = s.client()
        assert client.get_model_metadata("add_mul")["versions"] == ["1", "3"]
        assert client.get_model_metadata("every")["versions"] == ["1", "2"]


def test_config_pipeline_errors_name_the_problem(fresh_repo):
    models.add_mul(fresh_repo, "renamed", config='name: "other"\n')
    models.add_mul(fresh_repo, "wrongtype", config='name: "wrongtype"\nmax_batch_size: 4\n'
                   'input [ { name: "a" data_type: TYPE_INT32 dims: [4] }, { name: "b" data_type: TYPE_FP32 dims: [4] } ]\n'
                   'output [ { name: "y" data_type: TYPE_FP32 dims: [4] } ]\n')
    models.add_mul(fresh_repo, "tensorflowy", config='backend: "dali"\n')
    os.makedirs(os.path.join(fresh_repo, "notes"))
    with open(os.path.join(fresh_repo, "notes", "README"), "w") as f:
        f.write("not a model")
    with Server(["--model-repository", fresh_repo, "--exit-on-error=false"]) as s:
        log = s.log()
        assert "unexpected directory name 'renamed' for model 'other'" in log
        assert "input 'a': the configuration says TYPE_INT32 but the model has TYPE_FP32" in log
        assert "backend 'dali' is not served by ferry" in log
        assert "skipping a folder that is not a model" in log and "notes" in log
        for name in ("renamed", "wrongtype", "tensorflowy"):
            assert not s.client().is_model_ready(name)


def test_auto_complete_can_be_disabled(fresh_repo):
    models.add_mul(fresh_repo, "add_mul")
    s = Server(["--model-repository", fresh_repo, "--disable-auto-complete-config"], expect_exit=True)
    assert s.wait_exit() != 0
    assert "config.pbtxt is missing and auto-complete is disabled" in s.log()


def test_partial_config_is_completed(fresh_repo):
    models.add_mul(fresh_repo, "add_mul", config="max_batch_size: 2\ninstance_group [ { count: 3 kind: KIND_CPU } ]\n")
    with Server(["--model-repository", fresh_repo]) as s:
        cfg = s.client().get_model_config("add_mul")
        assert cfg["max_batch_size"] == 2
        assert cfg["instance_group"][0]["count"] == 3
        assert len(cfg["input"]) == 2 and len(cfg["output"]) == 2
        np.testing.assert_array_equal(add_mul_infer(s.client()).as_numpy("z"), np.ones((1, 4), dtype=np.float32))


def test_same_model_in_two_repositories(fresh_repo, tmp_path_factory):
    other = str(tmp_path_factory.mktemp("other"))
    copy_example(fresh_repo, "simple")
    copy_example(other, "simple")
    copy_example(other, "simple_string")
    with Server(["--model-repository", fresh_repo, "--model-repository", other, "--exit-on-error=false"]) as s:
        assert "two repositories" in s.log()
        assert not s.client().is_model_ready("simple")
        assert s.client().is_model_ready("simple_string")


CHECKED = """backend: "identity"
max_batch_size: 0
input [ { name: "INPUT0" data_type: TYPE_INT32 dims: [ 4 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_INT32 dims: [ 4 ] } ]
model_repository_agents { agents [ { name: "checksum", parameters [
  { key: "MD5:1/weights.bin", value: "%s" }, { key: "MD5:data_file", value: "%s" } ] } ] }
"""


def test_the_checksum_repository_agent_checks_the_files(tmp_path):
    import hashlib
    repo = tmp_path / "repo"
    for name, good in (("intact", True), ("tampered", False)):
        (repo / name / "1").mkdir(parents=True)
        (repo / name / "1" / "weights.bin").write_bytes(b"weights")
        (repo / name / "data_file").write_bytes(b"data")
        weights = hashlib.md5(b"weights" if good else b"other").hexdigest()
        (repo / name / "config.pbtxt").write_text(CHECKED % (weights, hashlib.md5(b"data").hexdigest()))
    models.write(str(repo / "relocated" / "1" / ".keep"), "")
    models.write(str(repo / "relocated" / "config.pbtxt"), CHECKED.split("model_repository_agents")[0] +
                 'model_repository_agents { agents [ { name: "relocation" } ] }\n')
    with Server(["--model-repository", str(repo), "--exit-on-error=false"]) as s:
        client = s.client()
        assert client.is_model_ready("intact")
        assert not client.is_model_ready("tampered")
        index = {m["name"]: m for m in client.get_model_repository_index()}
        reason = index["tampered"]["reason"]
        assert "checksum 'MD5:1/weights.bin'" in reason and hashlib.md5(b"weights").hexdigest() in reason, reason
        # An agent ferry does not run is said in the log, not silently ignored.
        assert client.is_model_ready("relocated")
        assert "agent 'relocation' is not run by ferry" in s.log()
