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
