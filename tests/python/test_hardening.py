"""What a client, a bucket or a config can name stays inside its folder, and what a config can make
ferry allocate is bounded: the regression tests of the hardening review (each failed before its
fix)."""
import base64
import http.client
import json
import os

import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

import models
from conftest import copy_example
from ferry_server import Server


def raw(s, method, path, body=None, headers=None):
    conn = http.client.HTTPConnection("127.0.0.1", s.port, timeout=30)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        r = conn.getresponse()
        return r.status, r.read().decode(errors="replace")
    finally:
        conn.close()


@pytest.fixture
def explicit(fresh_repo):
    copy_example(fresh_repo, "simple")
    with Server(["--model-repository", fresh_repo, "--model-control-mode=explicit", "--load-model=simple"]) as s:
        yield s


ESCAPES = ["%2Ftmp%2Fferry-pwned-http", "..", "a%2F..%2F..%2Fferry-pwned-rel", ".hidden", "a%5Cb"]


@pytest.mark.parametrize("name", ESCAPES)
def test_load_api_model_name_is_not_a_path_http(explicit, tmp_path, name):
    body = json.dumps({"parameters": {"config": "{}", "file:x": base64.b64encode(b"hello").decode()}})
    status, text = raw(explicit, "POST", f"/v2/repository/models/{name}/load", body)
    assert status == 400, text
    assert "invalid model name" in json.loads(text)["error"], text
    assert not os.path.exists("/tmp/ferry-pwned-http")
    assert not os.path.exists("/tmp/ferry-pwned-rel")
    status, text = raw(explicit, "POST", f"/v2/repository/models/{name}/unload", "{}")
    assert status == 400 and "invalid model name" in text, text
    assert explicit.client().is_server_ready(), "a refused name leaves the server ready"


@pytest.mark.parametrize("name", ["/tmp/ferry-pwned-grpc", "../../ferry-pwned-grpc", "a\\b", ""])
def test_load_api_model_name_is_not_a_path_grpc(explicit, name):
    client = explicit.grpc_client()
    with pytest.raises(InferenceServerException) as err:
        client.load_model(name, config="{}", files={"file:x": b"hello"})
    assert err.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert "invalid model name" in err.value.message()
    assert not os.path.exists("/tmp/ferry-pwned-grpc")
    assert client.is_server_ready()


def test_files_a_config_names_stay_in_the_model_folder(fresh_repo, tmp_path):
    """Warm-up data files and the model file name are confined to the folder, devices are refused,
    and errors do not reveal what lies outside."""
    secret = tmp_path / "outside.bin"
    secret.write_bytes(b"\0" * 64)
    cases = {
        "zero": 'input_data_file: "../../../../../../dev/zero"',
        "absolute": f'input_data_file: "{secret}"',
        "device": None,
    }
    for name, data in cases.items():
        models.add_mul(fresh_repo, name)
        if data is None:  # a warm-up file that is a device node inside the folder
            os.makedirs(os.path.join(fresh_repo, name, "warmup"), exist_ok=True)
            os.symlink("/dev/zero", os.path.join(fresh_repo, name, "warmup", "zero"))
            data = 'input_data_file: "zero"'
        models.write(os.path.join(fresh_repo, name, "config.pbtxt"), f"""
max_batch_size: 4
model_warmup [ {{ name: "w" batch_size: 1
  inputs {{ key: "a" value: {{ data_type: TYPE_FP32 dims: [ 4 ] {data} }} }}
  inputs {{ key: "b" value: {{ data_type: TYPE_FP32 dims: [ 4 ] zero_data: true }} }} }} ]
""")
    models.add_mul(fresh_repo, "escape", config='default_model_filename: "../../escape_target/1/model.onnx"\n')
    models.add_mul(fresh_repo, "many", config='instance_group [ { count: 2147483647 kind: KIND_CPU } ]\n')
    models.add_mul(fresh_repo, "huge", config="""
max_batch_size: 4
model_warmup [ { name: "w" batch_size: 1
  inputs { key: "a" value: { data_type: TYPE_FP32 dims: [ 1048576, 1048576 ] zero_data: true } } } ]
""")
    copy_example(fresh_repo, "simple")
    with Server(["--model-repository", fresh_repo, "--exit-on-error=false"]) as s:
        client = s.client()
        assert client.is_model_ready("simple")
        index = {m["name"]: m.get("reason", "") for m in client.get_model_repository_index()}
        for name in ["zero", "absolute", "device", "escape", "many", "huge"]:
            assert not client.is_model_ready(name), name
        assert "inside the model folder" in index["zero"], index
        assert "inside the model folder" in index["absolute"] and "64 bytes" not in index["absolute"], index
        assert "not a regular file" in index["device"], index
        assert "default_model_filename" in index["escape"], index
        assert "at most 128 are allowed" in index["many"], index
        assert "a warm-up sample may use" in index["huge"], index


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_shared_memory_keys_and_shrunk_regions(protocol):
    """A key names one object under /dev/shm, nothing else; a region the client shrinks after
    registering it fails the requests that use it (it used to kill the server with SIGBUS)."""
    import numpy as np
    import tritonclient.http as httpclient
    import tritonclient.utils.shared_memory as shm
    from conftest import EXAMPLES

    lib = httpclient if protocol == "http" else grpcclient
    with Server(["--model-repository", EXAMPLES, "--allow-client-shm"]) as s:
        client = s.client() if protocol == "http" else s.grpc_client()
        for key in ["../../etc/hostname", "/../../etc/hostname", "/a/b"]:
            with pytest.raises(InferenceServerException, match="shared memory key"):
                client.register_system_shared_memory("evil", key, 4)
        key = f"/ferry_test_shrink_{protocol}"
        handle = shm.create_shared_memory_region("in", key, 1 << 20)
        try:
            a = np.arange(16, dtype=np.int32).reshape(1, 16)
            shm.set_shared_memory_region(handle, [a, a])
            client.register_system_shared_memory("in", key, 1 << 20)
            inputs = []
            for i, name in enumerate(["INPUT0", "INPUT1"]):
                t = lib.InferInput(name, [1, 16], "INT32")
                t.set_shared_memory("in", 64, offset=(1 << 19) + 64 * i)
                inputs.append(t)
            os.truncate(f"/dev/shm{key}", 4096)
            with pytest.raises(InferenceServerException, match="smaller than when it was registered"):
                client.infer("simple", inputs)
            out = lib.InferRequestedOutput("OUTPUT0")
            out.set_shared_memory("in", 64, offset=(1 << 19))
            small = [lib.InferInput(n, [1, 16], "INT32").set_data_from_numpy(a) for n in ("INPUT0", "INPUT1")]
            with pytest.raises(InferenceServerException, match="smaller than when it was registered"):
                client.infer("simple", small, outputs=[out])
            assert s.proc.poll() is None, "the server is still running"
            r = client.infer("simple", small)
            np.testing.assert_array_equal(r.as_numpy("OUTPUT0"), a + a)
        finally:
            client.unregister_system_shared_memory()
            shm.destroy_shared_memory_region(handle)


def test_grpc_message_and_inflated_sizes_are_bounded():
    """A gRPC message over --grpc-max-input-size, or one that inflates past it, is refused with
    RESOURCE_EXHAUSTED before it is held whole; the server goes on serving."""
    import numpy as np
    from conftest import EXAMPLES

    with Server(["--model-repository", EXAMPLES, "--grpc-max-input-size=65536"]) as s:
        client = s.grpc_client()
        big = np.zeros((1, 16), dtype=np.int32)
        ok = [grpcclient.InferInput(n, [1, 16], "INT32").set_data_from_numpy(big) for n in ("INPUT0", "INPUT1")]
        assert client.infer("simple", ok).as_numpy("OUTPUT0").shape == (1, 16)
        huge = np.zeros((1, 40000), dtype=np.int32)  # 160 kB of zeros: a few hundred bytes gzipped
        over = [grpcclient.InferInput(n, [1, 40000], "INT32").set_data_from_numpy(huge) for n in ("INPUT0", "INPUT1")]
        for compression in (None, "gzip", "deflate"):
            with pytest.raises(InferenceServerException) as err:
                client.infer("simple", over, compression_algorithm=compression)
            # tonic says OUT_OF_RANGE for a message declared too long, RESOURCE_EXHAUSTED for one
            # that inflates past the limit.
            assert err.value.status() in ("StatusCode.RESOURCE_EXHAUSTED", "StatusCode.OUT_OF_RANGE"), err.value
            assert "65536" in err.value.message(), err.value.message()
        assert client.infer("simple", ok).as_numpy("OUTPUT0").shape == (1, 16)


def test_a_stream_has_a_bounded_number_of_requests_in_flight():
    """With --grpc-stream-max-inflight=1 the stream reads one message at a time: replies come
    back in the order sent, each one complete."""
    import queue

    import numpy as np
    from conftest import EXAMPLES

    with Server(["--model-repository", EXAMPLES, "--grpc-stream-max-inflight=1"]) as s:
        client = s.grpc_client()
        got = queue.Queue()
        client.start_stream(callback=lambda result, error: got.put((result, error)))
        for k in range(20):
            a = np.full((1, 16), k, dtype=np.int32)
            ins = [grpcclient.InferInput(n, [1, 16], "INT32").set_data_from_numpy(a) for n in ("INPUT0", "INPUT1")]
            client.async_stream_infer("simple", ins, request_id=str(k))
        ids = []
        for _ in range(20):
            result, error = got.get(timeout=30)
            assert error is None, error
            ids.append(result.get_response().id)
            k = int(ids[-1])
            assert (result.as_numpy("OUTPUT0") == 2 * k).all()
        client.stop_stream()
        assert ids == [str(k) for k in range(20)]


def test_admission_budget_refuses_with_retry_after(fresh_repo):
    """Past --max-inflight-request-bytes a request is refused with 503 and Retry-After (HTTP) or
    RESOURCE_EXHAUSTED (gRPC), counted in a metric; smaller ones are served."""
    import numpy as np
    from conftest import EXAMPLES
    from test_metrics import parse, value

    with Server(["--model-repository", EXAMPLES, "--max-inflight-request-bytes=4096"]) as s:
        small = json.dumps({"inputs": [
            {"name": "INPUT0", "shape": [1, 16], "datatype": "INT32", "data": list(range(16))},
            {"name": "INPUT1", "shape": [1, 16], "datatype": "INT32", "data": list(range(16))}]})
        assert raw(s, "POST", "/v2/models/simple/infer", small)[0] == 200
        big = small + " " * 8192
        conn = http.client.HTTPConnection("127.0.0.1", s.port, timeout=30)
        conn.request("POST", "/v2/models/simple/infer", body=big)
        r = conn.getresponse()
        text = r.read().decode()
        assert r.status == 503 and r.getheader("Retry-After") == "1", (r.status, text)
        assert "--max-inflight-request-bytes" in json.loads(text)["error"]
        conn.close()
        a = np.zeros((1, 16), dtype=np.int32)
        client = s.grpc_client()
        ok = [grpcclient.InferInput(n, [1, 16], "INT32").set_data_from_numpy(a) for n in ("INPUT0", "INPUT1")]
        client.infer("simple", ok)
        bigger = np.zeros((1, 2048), dtype=np.int32)
        over = [grpcclient.InferInput(n, [1, 2048], "INT32").set_data_from_numpy(bigger) for n in ("INPUT0", "INPUT1")]
        with pytest.raises(InferenceServerException) as err:
            client.infer("simple", over)
        assert err.value.status() == "StatusCode.RESOURCE_EXHAUSTED"
        m, _ = parse(s.metrics())
        assert value(m, "ferry_admission_rejected_total") == 2
        assert value(m, "ferry_inflight_request_budget_bytes") == 4096
        assert raw(s, "POST", "/v2/models/simple/infer", small)[0] == 200, "the budget is given back"


def test_a_failed_load_of_an_invented_name_keeps_the_server_ready(explicit):
    for name in ("junk", "other"):
        body = json.dumps({"parameters": {"config": "{}", "file:1/model.onnx": base64.b64encode(b"nope").decode()}})
        status, text = raw(explicit, "POST", f"/v2/repository/models/{name}/load", body)
        assert status == 400, text
    status, text = raw(explicit, "POST", "/v2/repository/models/ghost/load", "{}")
    assert status == 400, text
    assert explicit.status("/v2/health/ready") == 200
    index = {m["name"]: m for m in explicit.client().get_model_repository_index()}
    assert index["junk"]["state"] == "UNAVAILABLE", "the failure is still reported"


def test_an_overwritten_version_is_not_served_from_the_cache(fresh_repo, tmp_path):
    """Poll mode reloads a version whose file changed in place; the cache must not answer with
    the old version's outputs (the key carries the version's content digest)."""
    import numpy as np
    import test_cache

    test_cache.add_mul(fresh_repo, "cached")
    other = str(tmp_path / "other")
    models.add_mul(other, "cached", versions=(5,))  # y = a + b + 4
    args = ["--model-repository", fresh_repo, "--model-control-mode=poll", "--repository-poll-secs=1",
            *test_cache.LOCAL]
    with Server(args) as s:
        client = s.client()
        one = test_cache.inputs(httpclient_lib(), [1, 1, 1, 1])
        assert client.infer("cached", one).as_numpy("y")[0, 0] == 2.0
        assert client.infer("cached", one).as_numpy("y")[0, 0] == 2.0  # a hit
        os.replace(os.path.join(other, "cached", "5", "model.onnx"), os.path.join(fresh_repo, "cached", "1", "model.onnx"))
        assert s.wait_log("poll: loading the model's new or changed files", timeout=30)
        import time
        deadline = time.time() + 30
        while time.time() < deadline:
            y = client.infer("cached", one).as_numpy("y")[0, 0]
            if y == 6.0:
                break
            time.sleep(0.2)
        assert y == 6.0, "the reloaded version's outputs, not the cached ones"


def httpclient_lib():
    import tritonclient.http as httpclient
    return httpclient


def test_sigterm_during_start_up_is_honoured(fresh_repo):
    """The stop signal is handled from the first instant: a SIGTERM while models load ends the
    process cleanly (exit 0) instead of being dropped."""
    import signal
    import time

    from platforms import slow_model

    slow_model(fresh_repo, seconds_of_warmup=100000)
    s = Server(["--model-repository", fresh_repo, "--exit-timeout-secs=5"], wait_ready=False)
    try:
        assert s.wait_log("loading", timeout=10) or True
        time.sleep(0.5)
        assert "ferry is serving" not in s.log(), "still loading when the signal comes"
        s.proc.send_signal(signal.SIGTERM)
        assert s.wait_exit(timeout=20) == 0, s.log()
        assert "stop signal during start-up" in s.log()
    finally:
        s.stop()


def test_sigterm_before_anything_else_is_not_lost(fresh_repo):
    """A signal sent the moment the process starts (ferry as PID 1 in a container) stops it."""
    import signal
    import subprocess

    from ferry_server import BINARY

    models.add_mul(fresh_repo, "m")
    p = subprocess.Popen([BINARY, "serve", "--model-repository", fresh_repo, "--http-port=0", "--grpc-port=0",
                          "--metrics-port=0"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    p.send_signal(signal.SIGTERM)
    # Before the handler is installed the default action ends the process by the signal; after,
    # ferry stops itself with 0. Either way it is gone: nothing waits for a SIGKILL.
    assert p.wait(timeout=20) in (0, -signal.SIGTERM)


def test_slow_clients_are_cut_off():
    """A client that stops half-way through its headers or its body does not hold a connection
    (or the server's exit) forever; past --max-connections new connections are closed."""
    import socket
    import time

    from conftest import EXAMPLES

    args = ["--model-repository", EXAMPLES, "--http-header-timeout-secs=1", "--http-body-timeout-secs=1",
            "--max-connections=4"]
    with Server(args) as s:
        body = json.dumps({"inputs": []}).encode()
        half = socket.create_connection(("127.0.0.1", s.port))
        half.sendall(b"POST /v2/models/simple/infer HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % 10000 + body)
        half.settimeout(10)
        reply = half.recv(4096).decode()
        assert reply.startswith("HTTP/1.1 408"), reply
        assert "--http-body-timeout-secs" in reply
        half.close()
        slow = socket.create_connection(("127.0.0.1", s.port))
        slow.sendall(b"GET /v2/health/ready HTTP/1.1\r\nHo")
        slow.settimeout(10)
        started = time.time()
        assert slow.recv(4096) == b"", "the connection is closed"
        assert time.time() - started < 9
        slow.close()
        held = [socket.create_connection(("127.0.0.1", s.port)) for _ in range(4)]
        for c in held:
            c.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\n")
            assert c.recv(4096).startswith(b"HTTP/1.1 200")
        extra = socket.create_connection(("127.0.0.1", s.port))
        extra.settimeout(10)
        extra.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\n")
        try:
            assert extra.recv(4096) == b"", "over the cap: closed without a reply"
        except ConnectionResetError:
            pass
        for c in held:
            c.close()
        time.sleep(0.3)
        assert s.status("/v2/health/live") == 200, "slots free again once clients leave"
        assert "connection limit reached" in s.log()


def test_sigterm_drains_admitted_requests_and_refuses_new_ones():
    """On SIGTERM: not ready at once, a request already admitted completes, new requests get 503,
    and the process exits 0 before the deadline even with a client stuck mid-body."""
    import signal
    import socket
    import time

    from conftest import EXAMPLES

    with Server(["--model-repository", EXAMPLES, "--exit-timeout-secs=10", "--http-body-timeout-secs=60"]) as s:
        body = json.dumps({"inputs": [
            {"name": "INPUT0", "shape": [1, 16], "datatype": "INT32", "data": list(range(16))},
            {"name": "INPUT1", "shape": [1, 16], "datatype": "INT32", "data": [1] * 16}]}).encode()
        admitted = socket.create_connection(("127.0.0.1", s.port))
        admitted.sendall(b"POST /v2/models/simple/infer HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(body)
                         + body[:10])
        stuck = socket.create_connection(("127.0.0.1", s.port))
        stuck.sendall(b"POST /v2/models/simple/infer HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
        time.sleep(0.3)
        s.proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        assert s.status("/v2/health/ready") != 200
        status, text = raw(s, "POST", "/v2/models/simple/infer", body)
        assert status == 503 and "exiting" in text.lower(), (status, text)
        admitted.sendall(body[10:])
        admitted.settimeout(10)
        reply = admitted.recv(65536).decode()
        assert reply.startswith("HTTP/1.1 200"), reply
        assert s.wait_exit(timeout=30) == 0
        assert "exit deadline reached" in s.log(), "the stuck client was cut at the deadline"
        admitted.close()
        stuck.close()


def test_one_clients_bad_string_fails_only_its_request(fresh_repo):
    """BYTES of an ONNX model must be UTF-8: checked per request, so a bad string batched with
    others fails only its own request."""
    import threading

    import numpy as np
    import tritonclient.http as httpclient

    models.identity(fresh_repo, "strings", "BYTES")
    models.write(os.path.join(fresh_repo, "strings", "config.pbtxt"), """
max_batch_size: 8
dynamic_batching { max_queue_delay_microseconds: 200000 }
input [ { name: "INPUT0" data_type: TYPE_STRING dims: [ -1 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_STRING dims: [ -1 ] } ]
""")
    with Server(["--model-repository", fresh_repo]) as s:
        results = {}

        def send(key, value):
            client = httpclient.InferenceServerClient(s.url)
            t = httpclient.InferInput("INPUT0", [1, 1], "BYTES")
            t.set_data_from_numpy(np.array([[value]], dtype=np.object_))
            try:
                results[key] = client.infer("strings", [t]).as_numpy("OUTPUT0")[0, 0]
            except Exception as e:  # noqa: BLE001 - the error is the result
                results[key] = e

        threads = [threading.Thread(target=send, args=(k, v)) for k, v in
                   [("good1", b"hello"), ("bad", b"\xff\xfe"), ("good2", "é".encode())]]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert results["good1"] == b"hello" and results["good2"] == "é".encode(), results
        assert "not valid UTF-8" in str(results["bad"]), results


def test_a_symlink_cycle_in_a_model_folder_does_not_hang(fresh_repo):
    models.add_mul(fresh_repo, "m")
    os.symlink("..", os.path.join(fresh_repo, "m", "1", "loop"))
    os.symlink(fresh_repo, os.path.join(fresh_repo, "m", "up"))
    with Server(["--model-repository", fresh_repo, "--model-control-mode=poll", "--repository-poll-secs=1"]) as s:
        assert s.client().is_model_ready("m")
        assert s.wait_log("poll", timeout=5) or True
        assert s.client().is_server_ready()


def test_restricted_apis_need_their_header_over_http_and_grpc(fresh_repo):
    """Admin calls need a key clients do not have; inference stays open."""
    import numpy as np
    import tritonclient.http as httpclient

    copy_example(fresh_repo, "simple")
    args = ["--model-repository", fresh_repo, "--model-control-mode=explicit", "--load-model=simple",
            "--http-restricted-api", "model-repository,shared-memory,logging:admin-key=s3cret",
            "--grpc-restricted-protocol", "model-repository,trace:admin-key=s3cret"]
    with Server(args) as s:
        status, text = raw(s, "POST", "/v2/repository/index", "{}")
        assert status == 403 and json.loads(text)["error"] == "This API is restricted, expecting header 'admin-key'"
        assert raw(s, "POST", "/v2/repository/index", "{}", {"admin-key": "wrong"})[0] == 403
        assert raw(s, "POST", "/v2/repository/index", "{}", {"Admin-Key": "s3cret"})[0] == 200
        assert raw(s, "GET", "/v2/logging")[0] == 403
        assert raw(s, "GET", "/v2/health/ready")[0] == 200
        client = httpclient.InferenceServerClient(s.url)
        with pytest.raises(InferenceServerException, match="restricted"):
            client.unload_model("simple")
        client.unload_model("simple", headers={"admin-key": "s3cret"})
        client.load_model("simple", headers={"admin-key": "s3cret"})
        a = np.ones((1, 16), dtype=np.int32)
        ins = [httpclient.InferInput(n, [1, 16], "INT32").set_data_from_numpy(a) for n in ("INPUT0", "INPUT1")]
        assert client.infer("simple", ins).as_numpy("OUTPUT0")[0, 0] == 2
        g = s.grpc_client()
        with pytest.raises(InferenceServerException) as err:
            g.get_model_repository_index()
        assert err.value.status() == "StatusCode.UNAVAILABLE"
        # Triton names the gRPC header with its prefix, and clients send it so.
        assert ("This protocol is restricted, expecting header 'triton-grpc-protocol-admin-key'"
                in err.value.message())
        with pytest.raises(InferenceServerException, match="restricted"):
            g.get_model_repository_index(headers={"admin-key": "s3cret"})
        assert g.get_model_repository_index(headers={"triton-grpc-protocol-admin-key": "s3cret"}) is not None
        with pytest.raises(InferenceServerException, match="restricted"):
            g.get_trace_settings()
        assert g.is_server_ready() and g.get_model_metadata("simple").name == "simple"
        gins = [grpcclient.InferInput(n, [1, 16], "INT32").set_data_from_numpy(a) for n in ("INPUT0", "INPUT1")]
        assert g.infer("simple", gins).as_numpy("OUTPUT0")[0, 0] == 2


@pytest.mark.parametrize("flags,why", [
    (["--http-restricted-api", "metadata,health:k=v", "--http-restricted-api", "health:k2=v2"],
     "restricted api 'health' can not be specified in multiple config groups"),
    (["--http-restricted-api", "model-reposit,health:k=v"], "unknown restricted api 'model-reposit'"),
    (["--grpc-restricted-protocol", "model-reposit,health:k=v"], "unknown restricted protocol 'model-reposit'"),
    (["--grpc-restricted-protocol", "health:k="],
     "--grpc-restricted-protocol option format is '<config name>:<setting>=<value>'. Got health:k="),
])
def test_restricted_flags_that_do_not_parse_stop_the_server_in_tritons_words(fresh_repo, flags, why):
    s = Server(["--model-repository", fresh_repo, *flags], expect_exit=True)
    assert s.wait_exit() != 0
    assert why in s.log(), s.log()


def test_sagemaker_model_api_only_on_multi_model_endpoints_and_never_replacing(tmp_path):
    import shutil

    from conftest import EXAMPLES
    from platforms import request
    from test_sagemaker import port, sagemaker

    single = tmp_path / "single"
    shutil.copytree(os.path.join(EXAMPLES, "simple"), single / "simple")
    with sagemaker(single) as s:
        status, _, _ = request(port(s), "POST", "/models", {"model_name": "x", "url": "/opt/ml/models/a/model"})
        assert status == 404, "no model API on a single-model endpoint"
        assert request(port(s), "GET", "/ping")[0] == 200
    root = tmp_path / "models"
    for mid in ("h1", "h2"):
        shutil.copytree(os.path.join(EXAMPLES, "simple"), root / mid / "model")
    env = {"SAGEMAKER_MULTI_MODEL": "true", "FERRY_SAGEMAKER_MODELS_ROOT": str(root)}
    with sagemaker(tmp_path / "unused", env=env) as s:
        target = {"X-Amzn-SageMaker-Target-Model": "shared.tar.gz"}
        assert request(port(s), "POST", "/models", {"model_name": "h1", "url": str(root / "h1" / "model")}, target)[0] == 200
        status, _, body = request(port(s), "POST", "/models", {"model_name": "h2", "url": str(root / "h2" / "model")}, target)
        assert status == 409, body
        assert request(port(s), "POST", "/models/h1/invoke", kserve_body())[0] == 200


def kserve_body():
    from platforms import kserve_simple
    return kserve_simple([1] * 16, [1] * 16)


def test_sigterm_with_an_open_stream_finishes_its_request_and_exits_by_the_deadline(tmp_path):
    """A decoupled request admitted on a gRPC stream before SIGTERM sends all its responses; the
    stream the client keeps open is closed at --exit-timeout-secs and the process exits 0."""
    import queue
    import signal
    import time

    import models
    from test_decoupled import CONFIG, REPEAT, collect, inputs

    models.python_model(str(tmp_path), "repeat", REPEAT, CONFIG)
    with Server(["--model-repository", str(tmp_path), "--exit-timeout-secs=4"]) as s:
        client = s.grpc_client()
        got = queue.Queue()
        client.start_stream(callback=lambda result, error: got.put((result, error)))
        client.async_stream_infer("repeat", inputs(grpcclient, 8, delay=0.15), request_id="admitted",
                                  enable_empty_final_response=True)
        first, error = got.get(timeout=30)
        assert error is None, error
        signalled = time.monotonic()
        s.proc.send_signal(signal.SIGTERM)
        values, errors = collect(got, timeout=10)
        assert (values, errors) == ([1, 2, 3, 4, 5, 6, 7], []), "every response of the admitted request"
        assert s.wait_exit(timeout=30) == 0
        took = time.monotonic() - signalled
        assert took < 4 + 2, f"exit {took:.1f} s after SIGTERM, deadline 4 s"
        assert "exit deadline reached" in s.log(), "the stream the client kept open was closed at the deadline"
        client.stop_stream()
