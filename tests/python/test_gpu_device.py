"""On a machine with an NVIDIA GPU and onnxruntime-gpu (FERRY_ORT_GPU: the path of its
libonnxruntime.so.*; bench/gpu_check.sh sets it): KIND_GPU instances serve what the CPU computes,
KIND_AUTO lands on the GPU, a GPU that is not there is a load error naming those seen, and CUDA
shared memory carries inputs and outputs (device to device for GPU instances, batched requests
included; through the host for CPU instances). Elsewhere every test here skips with its
reason."""
import concurrent.futures
import ctypes
import os

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

import models
from conftest import EXAMPLES
from ferry_server import Server


def _driver():
    try:
        ctypes.CDLL("libcuda.so.1")
        return True
    except OSError:
        return False


ORT_GPU = os.environ.get("FERRY_ORT_GPU")
pytestmark = [
    pytest.mark.skipif(not _driver(), reason="no NVIDIA driver (libcuda.so.1) on this machine"),
    pytest.mark.skipif(not ORT_GPU, reason="FERRY_ORT_GPU (onnxruntime-gpu's libonnxruntime.so) is not set"),
]


def simple(repo, name, group):
    os.makedirs(os.path.join(repo, name, "1"))
    with open(os.path.join(EXAMPLES, "simple", "1", "model.onnx"), "rb") as f:
        open(os.path.join(repo, name, "1", "model.onnx"), "wb").write(f.read())
    config = open(os.path.join(EXAMPLES, "simple", "config.pbtxt")).read().replace('name: "simple"', f'name: "{name}"')
    models.write(os.path.join(repo, name, "config.pbtxt"), config + group + "\n")


def inputs(a, b):
    out = []
    for name, arr in (("INPUT0", a), ("INPUT1", b)):
        i = httpclient.InferInput(name, list(arr.shape), "INT32")
        i.set_data_from_numpy(arr)
        out.append(i)
    return out


@pytest.fixture(scope="module")
def gpu_server(tmp_path_factory):
    repo = str(tmp_path_factory.mktemp("gpu"))
    simple(repo, "on_gpu", "instance_group [ { kind: KIND_GPU count: 2 gpus: [ 0 ] } ]")
    simple(repo, "on_auto", "instance_group [ { kind: KIND_AUTO } ]")
    simple(repo, "on_cpu", "instance_group [ { kind: KIND_CPU } ]")
    with Server(["--model-repository", repo, f"--onnxruntime-library={ORT_GPU}", "--allow-client-shm"]) as s:
        yield s


def test_gpu_instances_compute_what_the_cpu_does(gpu_server):
    c = gpu_server.client()
    a = np.arange(32, dtype=np.int32).reshape(2, 16)
    b = np.ones((2, 16), dtype=np.int32)
    gpu = c.infer("on_gpu", inputs(a, b))
    cpu = c.infer("on_cpu", inputs(a, b))
    for o in ("OUTPUT0", "OUTPUT1"):
        np.testing.assert_array_equal(gpu.as_numpy(o), cpu.as_numpy(o))
    assert "GPU visible" in gpu_server.log()


def test_kind_auto_lands_on_the_gpu(gpu_server):
    groups = gpu_server.client().get_model_config("on_auto")["instance_group"]
    assert groups[0]["kind"] == "KIND_GPU" and groups[0]["gpus"]


def test_a_gpu_that_is_not_there_names_those_seen(tmp_path):
    simple(str(tmp_path), "far", "instance_group [ { kind: KIND_GPU gpus: [ 99 ] } ]")
    s = Server(["--model-repository", str(tmp_path), f"--onnxruntime-library={ORT_GPU}"], expect_exit=True)
    assert s.wait_exit() == 1
    assert "GPU 99 is not visible to ferry; GPUs seen: 0 (" in s.log()


def test_cuda_shared_memory_round_trip(gpu_server):
    cudashm = pytest.importorskip("tritonclient.utils.cuda_shared_memory",
                                  reason="tritonclient's CUDA shared memory helper needs cuda-python")
    c = gpu_server.client()
    a = np.arange(16, dtype=np.int32).reshape(1, 16)
    b = np.full((1, 16), 2, dtype=np.int32)
    size = a.nbytes
    hin = cudashm.create_shared_memory_region("in", size * 2, 0)
    hout = cudashm.create_shared_memory_region("out", size * 2, 0)
    try:
        cudashm.set_shared_memory_region(hin, [a, b])
        from tritonclient.utils import InferenceServerException
        with pytest.raises(InferenceServerException, match="past the"):
            c.register_cuda_shared_memory("big", cudashm.get_raw_handle(hin), 0, 1 << 40)
        c.register_cuda_shared_memory("in", cudashm.get_raw_handle(hin), 0, size * 2)
        c.register_cuda_shared_memory("out", cudashm.get_raw_handle(hout), 0, size * 2)
        ins = inputs(a, b)
        ins[0].set_shared_memory("in", size)
        ins[1].set_shared_memory("in", size, offset=size)
        outs = [httpclient.InferRequestedOutput("OUTPUT0"), httpclient.InferRequestedOutput("OUTPUT1")]
        outs[0].set_shared_memory("out", size)
        outs[1].set_shared_memory("out", size, offset=size)
        c.infer("on_gpu", ins, outputs=outs)
        got0 = cudashm.get_contents_as_numpy(hout, np.int32, [1, 16])
        np.testing.assert_array_equal(got0, a + b)
        assert [r["name"] for r in c.get_cuda_shared_memory_status()] == ["in", "out"]
    finally:
        c.unregister_cuda_shared_memory()
        cudashm.destroy_shared_memory_region(hin)
        cudashm.destroy_shared_memory_region(hout)


def test_batched_cuda_shared_memory_stays_on_the_gpu(gpu_server):
    """Concurrent gRPC requests, each with its own CUDA regions, batched on GPU instances (their
    inputs gathered and outputs scattered device to device) and on a CPU instance (through the
    host): every request gets its own sums and differences. An output some requests take in the
    reply stays correct, and a region too small for its output fails that request alone."""
    cudashm = pytest.importorskip("tritonclient.utils.cuda_shared_memory",
                                  reason="tritonclient's CUDA shared memory helper needs cuda-python")
    from tritonclient.utils import InferenceServerException
    n, rows = 12, 2
    size = rows * 16 * 4
    regions = []
    try:
        for k in range(n):
            a = np.arange(rows * 16, dtype=np.int32).reshape(rows, 16) * (k + 1)
            b = np.full((rows, 16), k, dtype=np.int32)
            hin = cudashm.create_shared_memory_region(f"bin{k}", size * 2, 0)
            hout = cudashm.create_shared_memory_region(f"bout{k}", size * 2, 0)
            cudashm.set_shared_memory_region(hin, [a, b])
            regions.append((hin, hout, a, b))
            c = gpu_server.client()
            c.register_cuda_shared_memory(f"bin{k}", cudashm.get_raw_handle(hin), 0, size * 2)
            c.register_cuda_shared_memory(f"bout{k}", cudashm.get_raw_handle(hout), 0, size * 2)

        def one(model, k, reply_output1=False, room=size):
            client = grpcclient.InferenceServerClient(gpu_server.grpc_url())
            ins = []
            for name, offset in (("INPUT0", 0), ("INPUT1", size)):
                i = grpcclient.InferInput(name, [rows, 16], "INT32")
                i.set_shared_memory(f"bin{k}", size, offset=offset)
                ins.append(i)
            outs = [grpcclient.InferRequestedOutput("OUTPUT0"), grpcclient.InferRequestedOutput("OUTPUT1")]
            outs[0].set_shared_memory(f"bout{k}", room)
            if not reply_output1:
                outs[1].set_shared_memory(f"bout{k}", size, offset=size)
            return client.infer(model, ins, outputs=outs)

        for model in ("on_gpu", "on_cpu"):
            with concurrent.futures.ThreadPoolExecutor(n) as pool:
                replies = list(pool.map(lambda k: one(model, k, reply_output1=k % 3 == 0), range(n)))
            for k, (hin, hout, a, b) in enumerate(regions):
                got = cudashm.get_contents_as_numpy(hout, np.int32, [2 * rows, 16])
                np.testing.assert_array_equal(got[:rows], a + b, err_msg=f"{model} request {k} OUTPUT0")
                if k % 3 == 0:
                    np.testing.assert_array_equal(replies[k].as_numpy("OUTPUT1"), a - b)
                else:
                    np.testing.assert_array_equal(got[rows:], a - b, err_msg=f"{model} request {k} OUTPUT1")
                cudashm.set_shared_memory_region(hout, [np.zeros((2 * rows, 16), dtype=np.int32)])
            with pytest.raises(InferenceServerException, match=f"should be at least {size} bytes"):
                one(model, 0, room=size // 2)
            np.testing.assert_array_equal(one(model, 1, reply_output1=True).as_numpy("OUTPUT1"),
                                          regions[1][2] - regions[1][3])
    finally:
        c = gpu_server.client()
        c.unregister_cuda_shared_memory()
        for hin, hout, _, _ in regions:
            cudashm.destroy_shared_memory_region(hin)
            cudashm.destroy_shared_memory_region(hout)
