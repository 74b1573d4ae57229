"""GPU instances (KIND_GPU) through ONNX Runtime's CUDA execution provider. On a machine without
a GPU, the load fails with a message that says what is missing (never a silent fall back to CPU),
and KIND_AUTO runs on the CPU; the GPU run itself is checked by bench/gpu_check.sh on a GPU
machine."""
import ctypes
import os

import pytest

import models
from conftest import EXAMPLES
from ferry_server import Server


def gpu_model(repo, name="gpu_simple", gpus="[ 0 ]"):
    src = os.path.join(EXAMPLES, "simple")
    os.makedirs(os.path.join(repo, name, "1"))
    with open(os.path.join(src, "1", "model.onnx"), "rb") as f, open(os.path.join(repo, name, "1", "model.onnx"), "wb") as g:
        g.write(f.read())
    config = open(os.path.join(src, "config.pbtxt")).read().replace('name: "simple"', f'name: "{name}"')
    models.write(os.path.join(repo, name, "config.pbtxt"),
                 config + f"instance_group [ {{ kind: KIND_GPU count: 1 gpus: {gpus} }} ]\n")


def driver_present():
    try:
        ctypes.CDLL("libcuda.so.1")
        return True
    except OSError:
        return False


no_gpu = pytest.mark.skipif(driver_present(), reason="this machine has an NVIDIA driver: the GPU path is bench/gpu_check.sh's")


@no_gpu
def test_a_gpu_instance_without_a_gpu_is_a_clear_load_error(fresh_repo):
    gpu_model(fresh_repo)
    s = Server(["--model-repository", fresh_repo], expect_exit=True)
    assert s.wait_exit() == 1
    log = s.log()
    assert "failed to load 'gpu_simple'" in log
    assert "GPU 0 is not visible to ferry; GPUs seen: none (the NVIDIA driver's libcuda.so.1 is not" in log
    assert "no GPU: none (" in log, "the start-up line says why there is no GPU"


@no_gpu
def test_kind_auto_runs_on_the_cpu_without_a_gpu(fresh_repo):
    models.identity(fresh_repo, "auto_model", "FP32")
    with open(os.path.join(fresh_repo, "auto_model", "config.pbtxt"), "a") as f:
        f.write("instance_group [ { kind: KIND_AUTO } ]\n")
    with Server(["--model-repository", fresh_repo]) as s:
        config = s.client().get_model_config("auto_model")
        assert [(g["kind"], g["count"]) for g in config["instance_group"]] == [("KIND_CPU", 2)]
        assert "KIND_AUTO instances run on the CPU" in s.log()


def test_the_other_models_keep_serving(fresh_repo):
    gpu_model(fresh_repo, gpus="[ 1 ]")
    models.identity(fresh_repo, "cpu_model", "FP32")
    with Server(["--model-repository", fresh_repo, "--exit-on-error=false", "--strict-readiness=false"]) as s:
        c = s.client()
        assert c.is_model_ready("cpu_model") and not c.is_model_ready("gpu_simple")
        index = {m["name"]: m for m in c.get_model_repository_index()}
        assert "GPU 1 is not visible to ferry; GPUs seen:" in index["gpu_simple"]["reason"]


def test_accelerator_options_that_cannot_apply_are_named_not_silent(fresh_repo):
    models.identity(fresh_repo, "accel", "FP32")
    with open(os.path.join(fresh_repo, "accel", "config.pbtxt"), "a") as f:
        f.write("""
instance_group [ { kind: KIND_CPU count: 1 } ]
parameters [ { key: "gpu_mem_limit" value { string_value: "1073741824" } } ]
optimization { execution_accelerators {
  gpu_execution_accelerator [ { name: "tensorrt" parameters { key: "precision_mode" value: "FP16" } } ]
  cpu_execution_accelerator [ { name: "openvino" } ] } }
""")
    with Server(["--model-repository", fresh_repo]) as s:
        import numpy as np
        import tritonclient.http as httpclient
        x = np.arange(4, dtype=np.float32).reshape(1, 4)
        inp = httpclient.InferInput("INPUT0", [1, 4], "FP32")
        inp.set_data_from_numpy(x)
        np.testing.assert_array_equal(s.client().infer("accel", [inp]).as_numpy("OUTPUT0"), x)
        log = s.log()
        assert "gpu_execution_accelerator 'tensorrt', parameter 'gpu_mem_limit' apply to KIND_GPU instances only" in log
        # The CPU build of ONNX Runtime has no OpenVINO provider: said, and the CPU provider runs.
        assert "OpenVINO execution provider is not usable here" in log


@no_gpu
def test_cuda_shared_memory_without_a_gpu_is_refused_clearly(fresh_repo):
    import base64
    import json
    import urllib.error
    import urllib.request

    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    models.identity(fresh_repo, "m", "FP32")
    with Server(["--model-repository", fresh_repo, "--allow-client-shm"]) as s:
        def register(body):
            req = urllib.request.Request(f"http://{s.url}/v2/cudasharedmemory/region/r/register",
                                         data=json.dumps(body).encode(), method="POST")
            try:
                urllib.request.urlopen(req, timeout=5)
                return 200, ""
            except urllib.error.HTTPError as e:
                return e.code, json.loads(e.read())["error"]

        handle = {"b64": base64.b64encode(bytes(64)).decode()}
        code, msg = register({"raw_handle": handle, "device_id": 0, "byte_size": 64})
        assert code == 400 and "failed to register CUDA shared memory region: 'r', GPUs not supported: none (" in msg
        code, msg = register({"raw_handle": {"b64": base64.b64encode(bytes(10)).decode()}, "device_id": 0, "byte_size": 64})
        assert code == 400 and "raw_handle must be 64 bytes" in msg and "got 10" in msg
        code, msg = register({"raw_handle": handle, "byte_size": 64})
        assert code == 400 and "no 'device_id' field" in msg
        with pytest.raises(InferenceServerException) as err:
            s.grpc_client().register_cuda_shared_memory("r", base64.b64encode(bytes(64)), 0, 64)
        assert err.value.status() == "StatusCode.INVALID_ARGUMENT" and "GPUs not supported" in err.value.message()
        assert s.client().get_cuda_shared_memory_status() == []
        with pytest.raises(InferenceServerException, match="Unable to find cuda shared memory region: 'r'"):
            s.client().get_cuda_shared_memory_status("r")
        s.client().unregister_cuda_shared_memory()
        s.grpc_client().unregister_cuda_shared_memory()
        assert s.client().is_server_live()
