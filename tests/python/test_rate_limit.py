"""Triton's rate limiter (`--rate-limit=execution_count`): two models whose instances need the one
unit of resource R never run at once, across models; with two units (`--rate-limit-resource`)
or the limiter off they do; an instance that needs more than the flag gives fails its load."""
import threading

import numpy as np
import pytest
import tritonclient.http as httpclient

import models
from ferry_server import Server

# Marks itself running, then waits (at most 3 s) for the other model's mark: OUT is 1 when the
# two ran at the same time. No timing decides it: a model alone always waits the full bound.
MEETS = '''
import os
import time
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.name = args["model_name"]

    def execute(self, requests):
        folder = os.environ["FERRY_TEST_MARKS"]
        mine = os.path.join(folder, self.name)
        open(mine, "w").close()
        other = os.path.join(folder, "b" if self.name == "a" else "a")
        deadline = time.time() + 3
        while not os.path.exists(other) and time.time() < deadline:
            time.sleep(0.01)
        met = os.path.exists(other)
        time.sleep(0.1)
        os.remove(mine)
        return [pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array([int(met)], np.int32))]) for _ in requests]
'''

CONFIG = """
backend: "python"
max_batch_size: 0
input [ { name: "IN" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "OUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
instance_group [ { count: 1 kind: KIND_CPU rate_limiter { resources [ { name: "R" count: %d } ] priority: 1 } } ]
"""


def repo(tmp_path, need=1):
    root = tmp_path / "repo"
    for name in ("a", "b"):
        models.python_model(str(root), name, MEETS, CONFIG % need)
    marks = tmp_path / "marks"
    marks.mkdir(exist_ok=True)
    return str(root), {"FERRY_TEST_MARKS": str(marks)}


def both_at_once(s):
    met = {}

    def call(name):
        x = httpclient.InferInput("IN", [1], "INT32").set_data_from_numpy(np.array([1], np.int32))
        try:
            met[name] = int(s.client().infer(name, [x]).as_numpy("OUT")[0])
        except Exception as e:  # noqa: BLE001 - shown in the assertion
            met[name] = str(e)

    threads = [threading.Thread(target=call, args=(n,)) for n in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return met


@pytest.mark.parametrize("args, together", [
    (["--rate-limit=execution_count"], False),
    (["--rate-limit=execution_count", "--rate-limit-resource=R:2"], True),
    (["--rate-limit=off"], True),
], ids=["one unit", "two units", "off"])
def test_instances_that_need_the_same_resource_take_turns(tmp_path, args, together):
    root, env = repo(tmp_path)
    with Server(["--model-repository", root, *args], env=env) as s:
        assert both_at_once(s) == {"a": int(together), "b": int(together)}


def test_a_need_over_the_resource_flag_fails_the_load(tmp_path):
    root, env = repo(tmp_path, need=3)
    with Server(["--model-repository", root, "--exit-on-error=false", "--rate-limit=execution_count",
                 "--rate-limit-resource=R:2"], env=env) as s:
        index = {m["name"]: m for m in s.client().get_model_repository_index()}
        assert "needs 3 of rate-limiter resource 'R' on device 0, more than the 2" in index["a"]["reason"], index


def test_a_malformed_resource_flag_is_refused(tmp_path):
    root, env = repo(tmp_path)
    s = Server(["--model-repository", root, "--rate-limit=execution_count", "--rate-limit-resource=R"],
               env=env, expect_exit=True)
    assert s.wait_exit() != 0
    assert "--rate-limit-resource 'R': expected <name>:<count>" in s.log(), s.log()
