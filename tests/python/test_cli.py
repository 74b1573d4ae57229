"""The command line, the environment, and start-up."""
import http.client

import numpy as np
import tritonclient.http as httpclient

from conftest import EXAMPLES
from ferry_server import Server


def test_no_repository_serves_the_embedded_examples():
    with Server([]) as s:
        client = s.client()
        assert "embedded example repository" in s.log()
        assert client.is_model_ready("simple") and client.is_model_ready("simple_string")
        a = np.arange(16, dtype=np.int32).reshape(1, 16)
        inputs = [httpclient.InferInput(n, [1, 16], "INT32").set_data_from_numpy(a) for n in ("INPUT0", "INPUT1")]
        np.testing.assert_array_equal(client.infer("simple", inputs).as_numpy("OUTPUT0"), 2 * a)


def test_flags_come_from_the_environment():
    with Server([], env={"FERRY_MODEL_REPOSITORY": EXAMPLES, "FERRY_HTTP_MAX_INPUT_SIZE": "100"}) as s:
        assert "embedded example repository" not in s.log()
        assert s.status("/v2/models/simple/ready") == 200
        conn = http.client.HTTPConnection("127.0.0.1", s.port)
        conn.request("POST", "/v2/models/simple/infer", body=b"{" + b" " * 200 + b"}")
        assert conn.getresponse().status == 413


def test_missing_onnxruntime_is_a_clear_start_up_error():
    s = Server(["--onnxruntime-library=/nonexistent/libonnxruntime.so"], expect_exit=True)
    assert s.wait_exit() != 0
    assert "no ONNX Runtime library at '/nonexistent/libonnxruntime.so'" in s.log()


def test_sigterm_stops_cleanly():
    s = Server(["--model-repository", EXAMPLES])
    s.stop()
    assert s.proc.returncode == 0
    assert "shutting down" in s.log()


def test_bad_flag_is_refused():
    s = Server(["--log-verbose=loud"], expect_exit=True)
    assert s.wait_exit() != 0
    assert "loud" in s.log() and "--log-verbose" in s.log()


def test_repository_that_does_not_exist():
    s = Server(["--model-repository=/nonexistent/repo"], expect_exit=True)
    assert s.wait_exit() != 0
    assert "model repository '/nonexistent/repo' is not a readable folder" in s.log()


def test_a_tritonserver_command_line_runs_unchanged():
    """Triton's aliases and tuning flags are taken (the ones without effect named at start-up);
    what ferry cannot mean stops start-up with the reason."""
    flags = ["--model-store", EXAMPLES, "--pinned-memory-pool-byte-size=268435456", "--log-file", "/tmp/t.log",
             "--model-load-thread-count=4", "--model-namespacing=false", "--reuse-http-port=true"]
    with Server(flags) as s:
        assert s.client().is_model_ready("simple")
        log = s.log()
        assert "--pinned-memory-pool-byte-size=268435456: no effect in ferry" in log, log
        assert "--log-file=/tmp/t.log: no effect in ferry" in log
    # --model-namespacing=true is served (test_namespacing.py); --model-config-name is not.
    for flag, why in [("--model-config-name=h100", "reads each model's config.pbtxt")]:
        s = Server(["--model-repository", EXAMPLES, flag], expect_exit=True)
        assert s.wait_exit() != 0 and why in s.log(), s.log()
