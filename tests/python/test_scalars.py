"""Scalar tensors as Triton's ONNX Runtime backend serves them: config `dims: [1]` for a model
tensor of shape `[]` (or `[-1]` per row for a batching model); clients send and receive `[1]`.
Silero VAD, a real model with a scalar input, loads with the config its users write for Triton."""
import numpy as np
import onnxruntime as ort
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

import models
from ferry_server import Server

PROTOCOLS = {"http": httpclient, "grpc": grpcclient}


def client_of(s, protocol):
    return s.client() if protocol == "http" else s.grpc_client()


def vad_chunks(n=6, size=512):
    """Audio-like chunks: silence, then a voiced tone, then noise."""
    rng = np.random.default_rng(3)
    t = np.arange(size * n, dtype=np.float32) / 16000
    audio = np.where(t > 0.05, 0.5 * np.sin(2 * np.pi * 220 * t) * (1 + 0.3 * np.sin(2 * np.pi * 3 * t)), 0)
    audio = (audio + 0.01 * rng.standard_normal(audio.shape)).astype(np.float32)
    return [audio[i * size:(i + 1) * size].reshape(1, size) for i in range(n)]


def reference(chunks):
    session = ort.InferenceSession(models.silero_vad_file())
    state = np.zeros((2, 1, 128), dtype=np.float32)
    probs = []
    for c in chunks:
        out, state = session.run(None, {"input": c, "state": state, "sr": np.array(16000, dtype=np.int64)})
        probs.append(float(out[0, 0]))
    return probs


@pytest.mark.parametrize("protocol", ["http", "grpc"])
@pytest.mark.parametrize("auto_complete", [False, True])
def test_silero_vad_loads_with_tritons_config_and_matches_onnxruntime(fresh_repo, protocol, auto_complete):
    models.silero_vad(fresh_repo, config=None if auto_complete else models.SILERO_CONFIG)
    args = ["--model-repository", fresh_repo]
    if not auto_complete:
        args.append("--disable-auto-complete-config")
    with Server(args) as s:
        client, lib = client_of(s, protocol), PROTOCOLS[protocol]
        meta = client.get_model_metadata("silero_vad")
        inputs = meta["inputs"] if protocol == "http" else [
            {"name": t.name, "shape": list(t.shape)} for t in meta.inputs]
        assert {"name": "sr", "shape": [1]} in [{"name": t["name"], "shape": t["shape"]} for t in inputs]
        chunks = vad_chunks()
        state = np.zeros((2, 1, 128), dtype=np.float32)
        probs = []
        for c in chunks:
            ins = [lib.InferInput("input", list(c.shape), "FP32").set_data_from_numpy(c),
                   lib.InferInput("state", [2, 1, 128], "FP32").set_data_from_numpy(state),
                   lib.InferInput("sr", [1], "INT64").set_data_from_numpy(np.array([16000], dtype=np.int64))]
            r = client.infer("silero_vad", ins)
            assert list(r.as_numpy("output").shape) == [1, 1]
            state = r.as_numpy("stateN")
            probs.append(float(r.as_numpy("output")[0, 0]))
        np.testing.assert_allclose(probs, reference(chunks), rtol=1e-4, atol=1e-5)
        assert len(set(probs)) == len(probs), "the state carried over changes each answer" 


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_scalar_outputs_and_batched_scalar_rows(fresh_repo, protocol):
    models.scalars(fresh_repo)
    models.write(f"{fresh_repo}/total/config.pbtxt", """
max_batch_size: 0
input [ { name: "x" data_type: TYPE_FP32 dims: [ -1 ] }, { name: "k" data_type: TYPE_FP32 dims: [ 1 ] } ]
output [ { name: "s" data_type: TYPE_FP32 dims: [ 1 ] } ]
""")
    models.write(f"{fresh_repo}/per_row/config.pbtxt", """
max_batch_size: 8
dynamic_batching { }
input [ { name: "r" data_type: TYPE_FP32 dims: [ 1 ] } ]
output [ { name: "d" data_type: TYPE_FP32 dims: [ 1 ] } ]
""")
    with Server(["--model-repository", fresh_repo]) as s:
        client, lib = client_of(s, protocol), PROTOCOLS[protocol]
        x = np.arange(5, dtype=np.float32)
        ins = [lib.InferInput("x", [5], "FP32").set_data_from_numpy(x),
               lib.InferInput("k", [1], "FP32").set_data_from_numpy(np.array([0.5], dtype=np.float32))]
        r = client.infer("total", ins)
        assert r.as_numpy("s").shape == (1,) and r.as_numpy("s")[0] == 10.5
        rows = np.array([[1.0], [2.0], [3.0]], dtype=np.float32)
        r = client.infer("per_row", [lib.InferInput("r", [3, 1], "FP32").set_data_from_numpy(rows)])
        np.testing.assert_array_equal(r.as_numpy("d"), rows * 2)
        wrong = [lib.InferInput("k", [2], "FP32").set_data_from_numpy(np.array([1, 2], dtype=np.float32)),
                 ins[0]]
        with pytest.raises(Exception, match="k"):
            client.infer("total", wrong)


def test_auto_completed_scalars(fresh_repo):
    models.scalars(fresh_repo)
    with Server(["--model-repository", fresh_repo]) as s:
        client = s.client()
        cfg = client.get_model_config("total")
        assert [i["dims"] for i in cfg["input"]] == [[-1], [1]]
        assert cfg["output"][0]["dims"] == [1] and cfg["max_batch_size"] == 0
        ins = [httpclient.InferInput("x", [2], "FP32").set_data_from_numpy(np.ones(2, dtype=np.float32)),
               httpclient.InferInput("k", [1], "FP32").set_data_from_numpy(np.ones(1, dtype=np.float32))]
        assert client.infer("total", ins).as_numpy("s").tolist() == [3.0]
        cfg = client.get_model_config("per_row")
        assert cfg["max_batch_size"] == 4 and cfg["input"][0]["dims"] == [1]
        rows = np.array([[4.0], [5.0]], dtype=np.float32)
        r = client.infer("per_row", [httpclient.InferInput("r", [2, 1], "FP32").set_data_from_numpy(rows)])
        np.testing.assert_array_equal(r.as_numpy("d"), rows * 2)
