"""Inference over HTTP with the official tritonclient.http, checked against onnxruntime."""
import gzip
import json
import os
import urllib.request

import numpy as np
import onnxruntime as ort
import pytest
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

import models
from conftest import EXAMPLES

RNG = models.RNG
sample = models.sample


def infer(client, model, arrays, binary=True, outputs=None, **kw):
    inputs = []
    for name, (datatype, arr) in arrays.items():
        i = httpclient.InferInput(name, list(arr.shape), datatype)
        i.set_data_from_numpy(arr, binary_data=binary)
        inputs.append(i)
    requested = None
    if outputs is not None:
        requested = [httpclient.InferRequestedOutput(o, binary_data=binary) for o in outputs]
    return client.infer(model, inputs, outputs=requested, **kw)


@pytest.mark.parametrize("datatype", list(models.DATATYPES))
@pytest.mark.parametrize("binary", [True, False])
def test_every_datatype_round_trips(server, datatype, binary):
    if not binary and datatype in ("FP16", "BF16"):
        pytest.skip("FP16/BF16 travel only as binary data (tested in test_http_errors)")
    client = server.client()
    arr = sample(datatype, (3, 5))
    result = infer(client, f"identity_{datatype.lower()}", {"INPUT0": (datatype, arr)}, binary=binary, outputs=["OUTPUT0"])
    out = result.as_numpy("OUTPUT0")
    if datatype == "BYTES" and not binary:
        # tritonclient hands JSON strings back as str, binary ones as bytes (as with Triton).
        out = np.array([x.encode() for x in out.flatten()], dtype=np.object_).reshape(out.shape)
    assert out.shape == arr.shape
    assert out.dtype == arr.dtype
    np.testing.assert_array_equal(out, arr)
    response = result.get_response()
    assert response["model_name"] == f"identity_{datatype.lower()}"
    assert response["model_version"] == "1"


def test_unbatched_model_takes_shape_as_is(server):
    arr = sample("FP32", (7,))
    out = infer(server.client(), "identity_fp32_nobatch", {"INPUT0": ("FP32", arr)}).as_numpy("OUTPUT0")
    np.testing.assert_array_equal(out, arr)


@pytest.mark.parametrize("binary", [True, False])
def test_simple_example_matches_onnxruntime(server, binary):
    session = ort.InferenceSession(os.path.join(EXAMPLES, "simple", "1", "model.onnx"))
    a = RNG.integers(-1000, 1000, size=(4, 16), dtype=np.int32)
    b = RNG.integers(-1000, 1000, size=(4, 16), dtype=np.int32)
    want = session.run(None, {"INPUT0": a, "INPUT1": b})
    r = infer(server.client(), "simple", {"INPUT0": ("INT32", a), "INPUT1": ("INT32", b)}, binary=binary)
    np.testing.assert_array_equal(r.as_numpy("OUTPUT0"), want[0])
    np.testing.assert_array_equal(r.as_numpy("OUTPUT1"), want[1])


@pytest.mark.parametrize("binary", [True, False])
def test_simple_string_example_matches_onnxruntime(server, binary):
    session = ort.InferenceSession(os.path.join(EXAMPLES, "simple_string", "1", "model.onnx"))
    a = np.array([[str(i) for i in range(16)]], dtype=np.object_)
    b = np.array([[str(3 * i) for i in range(16)]], dtype=np.object_)
    want = session.run(None, {"INPUT0": a, "INPUT1": b})
    r = infer(server.client(), "simple_string", {"INPUT0": ("BYTES", a), "INPUT1": ("BYTES", b)}, binary=binary)
    assert [x.decode() for x in r.as_numpy("OUTPUT0").flatten()] == list(want[0].flatten())
    assert [x.decode() for x in r.as_numpy("OUTPUT1").flatten()] == list(want[1].flatten())


def test_real_model_from_pypi_with_reshape_and_classification(server, repo):
    """DenseNet-121 from the `onnx` package, configured like Triton's densenet_onnx example."""
    session = ort.InferenceSession(os.path.join(repo, "densenet_onnx", "1", "model.onnx"))
    image = RNG.standard_normal((3, 224, 224)).astype(np.float32)
    want = session.run(None, {"data_0": image.reshape(1, 3, 224, 224)})[0].reshape(1000)
    client = server.client()
    r = infer(client, "densenet_onnx", {"data_0": ("FP32", image)})
    got = r.as_numpy("fc6_1")
    assert got.shape == (1000,)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    i = httpclient.InferInput("data_0", [3, 224, 224], "FP32")
    i.set_data_from_numpy(image)
    top = client.infer("densenet_onnx", [i], outputs=[httpclient.InferRequestedOutput("fc6_1", class_count=3)])
    classes = [x.decode() for x in top.as_numpy("fc6_1")]
    best = np.argsort(-want, kind="stable")[:3]
    assert [c.split(":")[1] for c in classes] == [str(k) for k in best]
    assert classes[0] == f"{want[best[0]]:.6f}:{best[0]}:class_{best[0]}"
    meta = client.get_model_metadata("densenet_onnx")
    assert meta["inputs"][0]["shape"] == [3, 224, 224]
    assert meta["platform"] == "onnxruntime_onnx"


def test_auto_completed_model(server):
    client = server.client()
    config = client.get_model_config("add_mul")
    assert config["max_batch_size"] == 4
    assert config["backend"] == "onnxruntime" and config["platform"] == "onnxruntime_onnx"
    assert config["dynamic_batching"]["preferred_batch_size"] == [4]
    assert sorted(i["name"] for i in config["input"]) == ["a", "b"]
    assert all(i["dims"] == [4] for i in config["input"])
    meta = client.get_model_metadata("add_mul")
    assert {i["name"]: i["shape"] for i in meta["inputs"]} == {"a": [-1, 4], "b": [-1, 4]}
    a, b = sample("FP32", (2, 4)), sample("FP32", (2, 4))
    r = infer(client, "add_mul", {"a": ("FP32", a), "b": ("FP32", b)}, outputs=["z"])
    np.testing.assert_allclose(r.as_numpy("z"), a * b, rtol=1e-6)
    assert r.as_numpy("y") is None


def test_compressed_requests_and_replies(server):
    client = server.client()
    a = RNG.integers(0, 100, size=(1, 16), dtype=np.int32)
    for request, reply in [("gzip", "deflate"), ("deflate", "gzip")]:
        r = infer(client, "simple", {"INPUT0": ("INT32", a), "INPUT1": ("INT32", a)},
                  request_compression_algorithm=request, response_compression_algorithm=reply)
        np.testing.assert_array_equal(r.as_numpy("OUTPUT0"), 2 * a)
    body = json.dumps({"inputs": [{"name": n, "shape": [1, 16], "datatype": "INT32", "data": a.flatten().tolist()}
                                  for n in ("INPUT0", "INPUT1")]}).encode()
    req = urllib.request.Request(f"http://{server.url}/v2/models/simple/infer", data=gzip.compress(body),
                                 headers={"Content-Encoding": "gzip", "Accept-Encoding": "gzip"})
    with urllib.request.urlopen(req) as resp:
        assert resp.headers["Content-Encoding"] == "gzip"
        reply = json.loads(gzip.decompress(resp.read()))
    assert reply["outputs"][0]["data"] == (2 * a).flatten().tolist()


def test_request_id_parameters_and_statistics(server):
    client = server.client()
    before = client.get_inference_statistics("identity_int32")["model_stats"][0]
    arr = sample("INT32", (2, 3))
    r = infer(client, "identity_int32", {"INPUT0": ("INT32", arr)}, request_id="req-42", parameters={"custom": "x"})
    assert r.get_response()["id"] == "req-42"
    after = client.get_inference_statistics("identity_int32")["model_stats"][0]
    assert after["version"] == "1"
    assert after["inference_count"] == before["inference_count"] + 2
    assert after["execution_count"] == before["execution_count"] + 1
    assert after["inference_stats"]["success"]["count"] == before["inference_stats"]["success"]["count"] + 1
    assert after["inference_stats"]["compute_infer"]["ns"] > before["inference_stats"]["compute_infer"]["ns"]
    all_stats = client.get_inference_statistics()
    assert "identity_int32" in {m["name"] for m in all_stats["model_stats"]}


def test_server_metadata_and_health(server):
    client = server.client()
    assert client.is_server_live() and client.is_server_ready()
    meta = client.get_server_metadata()
    assert "binary_tensor_data" in meta["extensions"] and "statistics" in meta["extensions"]
    assert client.is_model_ready("simple") and client.is_model_ready("simple", "1")
    assert not client.is_model_ready("simple", "2")
    with pytest.raises(InferenceServerException, match="unknown model"):
        client.get_model_metadata("nope")


def test_raw_binary_request(server):
    """Inference-Header-Content-Length: 0 — the body is the only input's data, outputs binary."""
    import http.client
    arr = np.arange(6, dtype=np.float32)
    conn = http.client.HTTPConnection("127.0.0.1", server.port)
    conn.request("POST", "/v2/models/identity_fp32/infer", body=arr.tobytes(), headers={"Inference-Header-Content-Length": "0"})
    resp = conn.getresponse()
    body = resp.read()
    assert resp.status == 200, body
    n = int(resp.headers["Inference-Header-Content-Length"])
    header = json.loads(body[:n])
    assert header["outputs"][0]["shape"] == [1, 6]
    np.testing.assert_array_equal(np.frombuffer(body[n:], dtype=np.float32), arr)
    conn.request("POST", "/v2/models/simple/infer", body=bytes(64), headers={"Inference-Header-Content-Length": "0"})
    resp = conn.getresponse()
    assert resp.status == 400 and ("Raw request must only have 1 input (found 1) to be deduced but got 2 inputs in "
                                   "'simple' model configuration") in json.loads(resp.read())["error"]
    conn.request("POST", "/v2/models/identity_bytes/infer", body=b"abc", headers={"Inference-Header-Content-Length": "0"})
    resp = conn.getresponse()
    assert resp.status == 400 and ("For BYTE datatype raw input 'INPUT0', the model must have input shape [1]"
                                   in json.loads(resp.read())["error"])
    # A body that is not whole elements fails the byte-size check, as Triton's.
    conn.request("POST", "/v2/models/identity_fp32/infer", body=bytes(6), headers={"Inference-Header-Content-Length": "0"})
    resp = conn.getresponse()
    assert resp.status == 400 and "input byte size mismatch for input 'INPUT0'" in json.loads(resp.read())["error"]


def test_default_model_filename(fresh_repo):
    from ferry_server import Server
    models.add_mul(fresh_repo, "add_mul", config='default_model_filename: "net.onnx"\n')
    os.rename(os.path.join(fresh_repo, "add_mul", "1", "model.onnx"), os.path.join(fresh_repo, "add_mul", "1", "net.onnx"))
    with Server(["--model-repository", fresh_repo]) as s:
        assert s.client().get_model_config("add_mul")["default_model_filename"] == "net.onnx"
        assert s.client().is_model_ready("add_mul")
