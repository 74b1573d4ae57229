"""Bad input over raw HTTP: every error names what is wrong, has the right status, and the server
keeps serving afterwards."""
import http.client
import json

import pytest

from ferry_server import Server

SIMPLE_OK = {"inputs": [{"name": n, "shape": [1, 16], "datatype": "INT32", "data": list(range(16))} for n in ("INPUT0", "INPUT1")]}


def request(server, method, path, body=b"", headers=None):
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    if isinstance(body, (dict, list)):
        body = json.dumps(body).encode()
    conn.request(method, path, body=body, headers=headers or {})
    resp = conn.getresponse()
    data = resp.read()
    conn.close()
    return resp.status, resp.headers, data


def error_of(server, method, path, body=b"", headers=None):
    status, _, data = request(server, method, path, body, headers)
    payload = json.loads(data)
    assert list(payload) == ["error"], payload
    return status, payload["error"]


@pytest.fixture(autouse=True)
def still_serving(server):
    yield
    status, _, data = request(server, "POST", "/v2/models/simple/infer", SIMPLE_OK)
    assert status == 200, data
    assert request(server, "GET", "/v2/health/live")[0] == 200


def with_input(**changes):
    body = json.loads(json.dumps(SIMPLE_OK))
    body["inputs"][0].update(changes)
    return body


def test_unknown_model_is_404(server):
    status, msg = error_of(server, "POST", "/v2/models/nope/infer", SIMPLE_OK)
    assert status == 404
    assert msg == "Request for unknown model: 'nope' is not found"
    status, msg = error_of(server, "GET", "/v2/models/simple/versions/9")
    assert status == 404 and "'simple' version 9 is not found" in msg


def test_wrong_input_name(server):
    status, msg = error_of(server, "POST", "/v2/models/simple/infer", with_input(name="INPUTX"))
    assert status == 400
    assert msg == "unexpected inference input 'INPUTX' for model 'simple'"


def test_wrong_datatype_names_both(server):
    body = with_input(datatype="FP32")
    status, msg = error_of(server, "POST", "/v2/models/simple/infer", body)
    assert status == 400
    assert msg == "inference input 'INPUT0' data-type is 'FP32', but model 'simple' expects 'INT32'"


def test_wrong_shape_names_both(server):
    status, msg = error_of(server, "POST", "/v2/models/simple/infer", with_input(shape=[1, 8], data=list(range(8))))
    assert status == 400
    assert "input 'INPUT0' for model 'simple'. Expected [-1,16], got [1,8]" in msg
    status, msg = error_of(server, "POST", "/v2/models/simple/infer", with_input(shape=[1, 1, 16]))
    assert status == 400 and "Expected [-1,16], got [1,1,16]" in msg and "batch dimension" in msg


def test_batch_too_large(server):
    body = {"inputs": [{"name": n, "shape": [9, 16], "datatype": "INT32", "data": [0] * 144} for n in ("INPUT0", "INPUT1")]}
    status, msg = error_of(server, "POST", "/v2/models/simple/infer", body)
    assert status == 400 and "batch-size must be <= 8 for 'simple'" in msg


def test_data_count_mismatch(server):
    status, msg = error_of(server, "POST", "/v2/models/simple/infer", with_input(data=[1, 2, 3]))
    assert (status, msg) == (400, "Failed to parse 'data' field: shape does not match true shape")
    status, msg = error_of(server, "POST", "/v2/models/simple/infer", with_input(data=list(range(17))))
    assert (status, msg) == (400, "Unable to parse 'data': Shape does not match true shape of 'data' field")


def test_negative_dims_in_tritons_words(server):
    status, msg = error_of(server, "POST", "/v2/models/simple/infer", with_input(shape=[2, -5]))
    assert (status, msg) == (400, "Unable to parse 'shape': attempt to access JSON non-unsigned-integer as "
                                  "unsigned-integer")
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException
    client = server.grpc_client()
    for shape, why in [([1, -1], "All input dimensions should be specified for input 'INPUT0' for model "
                                 "'identity_fp32', got [1,-1]"),
                       ([1, -5], "tensor 'INPUT0' contains an invalid dimension [1,-5]"),
                       ([1, 2, 3], "unexpected shape for input 'INPUT0' for model 'identity_fp32'. Expected "
                                   "[-1,-1], got [1,2,3]. NOTE: Setting a non-zero max_batch_size in the model "
                                   "config requires a batch dimension to be prepended to each input shape. If you "
                                   "want to specify the full shape including the batch dim in your input dims "
                                   "config, try setting max_batch_size to zero.")]:
        x = grpcclient.InferInput("INPUT0", shape, "FP32")
        x._get_tensor().contents.fp32_contents[:] = [1.0]
        with pytest.raises(InferenceServerException) as err:
            client.infer("identity_fp32", [x])
        assert why in err.value.message(), err.value.message()


def test_malformed_json(server):
    status, msg = error_of(server, "POST", "/v2/models/simple/infer", b'{"inputs": [')
    assert status == 400 and msg.startswith("failed to parse the request JSON buffer")
    status, msg = error_of(server, "POST", "/v2/models/simple/infer", b'{"outputs": []}')
    assert status == 400 and "missing field `inputs`" in msg


def test_binary_header_past_the_body(server):
    header = json.dumps({"inputs": [{"name": n, "shape": [1, 16], "datatype": "INT32", "parameters": {"binary_data_size": 64}}
                                    for n in ("INPUT0", "INPUT1")]}).encode()
    body = header + bytes(64)
    status, msg = error_of(server, "POST", "/v2/models/simple/infer", body,
                           {"Inference-Header-Content-Length": str(len(body) + 10)})
    assert (status, msg) == (400, f"inference header size should be in range (0, {len(body)}), got: {len(body) + 10}")
    status, msg = error_of(server, "POST", "/v2/models/simple/infer", body, {"Inference-Header-Content-Length": "x"})
    assert (status, msg) == (400, "Unable to parse Inference-Header-Content-Length, got: x")
    status, msg = error_of(server, "POST", "/v2/models/simple/infer", body, {"Inference-Header-Content-Length": str(len(header))})
    assert status == 400 and "unexpected size for input 'INPUT1', expecting 64 additional bytes" in msg


def test_fp16_refused_as_json(server):
    body = {"inputs": [{"name": "INPUT0", "shape": [1, 1], "datatype": "FP16", "data": [1.0]}]}
    status, msg = error_of(server, "POST", "/v2/models/identity_fp16/infer", body)
    assert status == 400 and "FP16" in msg and "binary" in msg


def test_unsupported_content_encoding(server):
    status, headers, data = request(server, "POST", "/v2/models/simple/infer", b"xx", {"Content-Encoding": "br"})
    assert status == 501
    assert "Unsupported compression type" in json.loads(data)["error"]
    assert headers["Accept-Encoding"] == "gzip, deflate"


def test_routes(server):
    assert error_of(server, "GET", "/v2/nothing") == (404, "Not Found")
    assert error_of(server, "GET", "/v2/models/simple/versions/x/ready") == (404, "Not Found")
    assert error_of(server, "DELETE", "/v2/models/simple/infer") == (405, "Method Not Allowed")
    assert request(server, "GET", "/v2/health/live/")[0] == 404


def test_oversize_body_is_413():
    with Server(["--http-max-input-size=1000", "--model-repository", __import__("conftest").EXAMPLES]) as small:
        status, msg = error_of(small, "POST", "/v2/models/simple/infer", b"{" + b" " * 2000 + b"}")
        assert status == 413 and "exceeds the maximum allowed input size of 1000 bytes" in msg and "--http-max-input-size" in msg
        # A small body compressed well past the limit is refused after decompression too.
        import zlib
        status, msg = error_of(small, "POST", "/v2/models/simple/infer", zlib.compress(b" " * 5000), {"Content-Encoding": "deflate"})
        assert status == 413
        assert request(small, "POST", "/v2/models/simple/infer", SIMPLE_OK)[0] == 200
