"""Python processes that die, hang, fork, print bytes or recurse, against the real binary: the
death is seen, the model keeps serving, nothing is left in /dev/shm or the process table, and
what the process sends is bounded."""
import glob
import os
import signal
import stat
import time

import numpy as np
import pytest
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

import models
from ferry_server import Server

CONFIG = """
backend: "python"
max_batch_size: 0
{extra}
input [ {{ name: "X" data_type: TYPE_INT32 dims: [ 1 ] }} ]
output [ {{ name: "Y" data_type: TYPE_INT32 dims: [ 1 ] }} ]
"""

# X picks what execute does: 0 answers, 1 forks a helper that outlives the process and then the
# process kills itself, 2 prints a byte that is not UTF-8 and a long line without a newline,
# 3 never returns, 4 calls this model through BLS, 5 starts a helper in a session of its own
# and then dies.
MODEL = '''
import os
import signal
import sys
import time
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        out = []
        for r in requests:
            x = int(pb_utils.get_input_tensor_by_name(r, "X").as_numpy()[0])
            if x == 1:
                helper = os.fork()
                if helper == 0:
                    time.sleep(3600)
                    os._exit(0)
                with open(os.environ["FERRY_TEST_DIR"] + "/helper", "w") as f:
                    f.write(str(helper))
                print("fetching https://bucket.example/model?X-Signature=SECRET", file=sys.stderr, flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            if x == 2:
                sys.stdout.buffer.write(b"caf\\xe9 \\xff\\n")
                sys.stdout.buffer.write(b"z" * (1 << 20))
                sys.stdout.flush()
                print("after the bytes")
            if x == 3:
                while True:
                    time.sleep(1)
            if x == 5:
                import subprocess
                helper = subprocess.Popen(["sleep", "600"], start_new_session=True)
                with open(os.environ["FERRY_TEST_DIR"] + "/session", "w") as f:
                    f.write(str(helper.pid))
                os._exit(3)
            if x == 4:
                req = pb_utils.InferenceRequest(model_name="procs",
                    requested_output_names=["Y"], inputs=[pb_utils.Tensor("X", np.array([0], dtype=np.int32))])
                resp = req.exec()
                if resp.has_error():
                    raise RuntimeError(resp.error().message())
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("Y", np.array([x + 100], dtype=np.int32))]))
        return out
'''


def infer(server, x, model="procs"):
    i = httpclient.InferInput("X", [1], "INT32").set_data_from_numpy(np.array([x], dtype=np.int32))
    return int(server.client().infer(model, [i]).as_numpy("Y")[0])


def regions(pid):
    return sorted(glob.glob(f"/dev/shm/ferry-{pid}-*"))


def python_children(pid):
    """Pids of the stub processes ferry runs."""
    out = []
    for d in glob.glob("/proc/[0-9]*"):
        try:
            with open(f"{d}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"{d}/cmdline", "rb") as f:
                cmd = f.read()
        except OSError:
            continue
        if int(fields[1]) == pid and b"ferry_stub.py" in cmd:
            out.append(int(d.rsplit("/", 1)[1]))
    return out


def alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


@pytest.fixture
def procs(tmp_path):
    repo = str(tmp_path / "repo")
    models.python_model(repo, "procs", MODEL, CONFIG.format(extra='parameters [ { key: "EXECUTE_TIMEOUT_SECONDS" value { string_value: "2" } } ]'))
    with Server(["--model-repository", repo], env={"FERRY_TEST_DIR": str(tmp_path)}) as s:
        yield s, tmp_path


def test_a_death_behind_a_forked_helper_is_seen_and_the_helper_goes_with_it(procs):
    s, tmp = procs
    assert infer(s, 0) == 100
    with pytest.raises(InferenceServerException, match="the Python process running this request died") as e:
        infer(s, 1)
    # What it printed stays in the log; the client is told what happened, not what it said.
    assert "SECRET" not in str(e.value) and "signal: 9" in str(e.value), str(e.value)
    assert s.wait_log("X-Signature=SECRET")
    helper = int((tmp / "helper").read_text())
    # Killed with its process group; a new process serves.
    deadline = time.time() + 10
    while alive(helper) and time.time() < deadline:
        time.sleep(0.05)
    assert not alive(helper)
    assert infer(s, 0) == 100
    # The dead process's regions went with it: what is left belongs to the new one.
    prefixes = {r.rsplit("-", 2)[0] for r in regions(s.proc.pid)}
    assert len(prefixes) == 1, regions(s.proc.pid)


def test_a_helper_in_a_session_of_its_own_dies_with_its_process(procs):
    s, tmp = procs
    threads = lambda: len(os.listdir(f"/proc/{s.proc.pid}/task"))
    assert infer(s, 0) == 100
    before = threads()
    for _ in range(3):
        with pytest.raises(InferenceServerException, match="died"):
            infer(s, 5)
        helper = int((tmp / "session").read_text())
        # It left the process group, so it was found as an orphan ferry adopted, and killed.
        deadline = time.time() + 10
        while alive(helper) and time.time() < deadline:
            time.sleep(0.05)
        assert not alive(helper)
    assert infer(s, 0) == 100
    # The threads that forwarded the dead processes' output ended (the helper held the pipes).
    deadline = time.time() + 10
    while threads() > before and time.time() < deadline:
        time.sleep(0.1)
    assert threads() <= before


def test_bytes_that_are_not_text_and_endless_lines_do_not_stop_the_log(procs):
    s, _ = procs
    assert infer(s, 2) == 102
    assert infer(s, 2) == 102, "a later print still works"
    assert s.wait_log("after the bytes")
    assert "caf\ufffd \ufffd" in s.log()
    longest = max(len(line) for line in s.log().splitlines())
    assert longest < 20_000, longest


def test_an_execute_that_never_returns_is_stopped_at_its_deadline(procs):
    s, _ = procs
    before = python_children(s.proc.pid)
    with pytest.raises(InferenceServerException, match=r"execute\(\) did not return within 2 s"):
        infer(s, 3)
    assert infer(s, 0) == 100
    after = python_children(s.proc.pid)
    assert len(after) == 1 and after != before


def test_a_model_calling_itself_with_one_instance_fails_clearly(procs):
    s, _ = procs
    with pytest.raises(InferenceServerException, match="a call to itself would wait for itself"):
        infer(s, 4)
    assert infer(s, 0) == 100


def test_regions_are_private_and_nothing_outlives_a_sigterm(procs):
    s, _ = procs
    assert infer(s, 0) == 100
    mine = regions(s.proc.pid)
    assert mine, "the instance's regions carry ferry's pid"
    for r in mine:
        assert stat.S_IMODE(os.stat(r).st_mode) == 0o600, r
    stubs = python_children(s.proc.pid)
    assert stubs
    s.proc.send_signal(signal.SIGTERM)
    assert s.wait_exit(30) == 0
    assert regions(s.proc.pid) == []
    assert not any(alive(p) for p in stubs)


def test_the_stub_timeout_bounds_initialize_however_much_it_logs(tmp_path):
    chatty = '''
import time
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        while True:
            pb_utils.Logger.log_info("still initializing")
            time.sleep(0.1)

    def execute(self, requests):
        return []
'''
    repo = str(tmp_path)
    models.python_model(repo, "chatty", chatty, CONFIG.format(extra=""))
    models.python_model(repo, "procs", MODEL, CONFIG.format(extra=""))
    with Server(["--model-repository", repo, "--exit-on-error=false", "--backend-config=python,stub-timeout-seconds=2"],
                env={"FERRY_TEST_DIR": str(tmp_path)}) as s:
        index = {m["name"]: m for m in s.client().get_model_repository_index()}
        assert "no answer within 2 s" in index["chatty"]["reason"], index["chatty"]
        assert infer(s, 0) == 100


def test_load_errors_name_the_model_folder_not_the_servers_paths(tmp_path):
    repo = str(tmp_path / "models")
    models.write(os.path.join(repo, "broken", "config.pbtxt"), 'backend: "onnxruntime"\nmax_batch_size: 0\n'
                 'input [ { name: "x" data_type: TYPE_FP32 dims: [ 1 ] } ]\n'
                 'output [ { name: "y" data_type: TYPE_FP32 dims: [ 1 ] } ]\n')
    models.write(os.path.join(repo, "broken", "1", "model.onnx"), "not an onnx file")
    with Server(["--model-repository", repo, "--exit-on-error=false"]) as s:
        reason = {m["name"]: m for m in s.client().get_model_repository_index()}["broken"]["reason"]
        assert "broken/1/model.onnx" in reason and repo not in reason, reason
        assert repo in s.log()
