"""Decoupled Python models (0..n responses per request) through the real server: over the gRPC
stream with tritonclient (final marks, an empty final response when asked, an error mid-stream,
cancellation that the model sees), over HTTP's generate and generate_stream (read as server-sent
events), and refused on plain infer as Triton refuses it."""
import http.client
import json
import queue
import time

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

import models
from ferry_server import Server

REPEAT = '''
import threading
import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            threading.Thread(target=self.respond, args=(request,), daemon=True).start()
        return None

    def respond(self, request):
        value = lambda name: pb_utils.get_input_tensor_by_name(request, name).as_numpy().reshape(-1)[0]
        n, delay, fail = int(value("COUNT")), float(value("DELAY")), int(value("FAIL"))
        sender = request.get_response_sender()
        for i in range(n):
            if request.is_cancelled():
                pb_utils.Logger.log_info(f"request {request.request_id()} cancelled after {i} responses")
                sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                return
            if fail and i == 1:
                sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError("token 1 failed")))
            else:
                sender.send(pb_utils.InferenceResponse([
                    pb_utils.Tensor("OUT", np.array([i], dtype=np.int32)),
                    pb_utils.Tensor("TEXT", np.array([f"token{i}".encode()], dtype=np.object_))],
                    parameters={"index": i}))
            time.sleep(delay)
        sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
'''

CONFIG = """
backend: "python"
max_batch_size: 0
model_transaction_policy { decoupled: true }
input [ { name: "COUNT" data_type: TYPE_INT32 dims: [ 1 ] }, { name: "DELAY" data_type: TYPE_FP32 dims: [ 1 ] },
        { name: "FAIL" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "OUT" data_type: TYPE_INT32 dims: [ 1 ] }, { name: "TEXT" data_type: TYPE_STRING dims: [ 1 ] } ]
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    repo = str(tmp_path_factory.mktemp("decoupled"))
    models.python_model(repo, "repeat", REPEAT, CONFIG)
    with Server(["--model-repository", repo]) as s:
        yield s


def inputs(lib, count, delay=0.0, fail=0):
    return [lib.InferInput("COUNT", [1], "INT32").set_data_from_numpy(np.array([count], dtype=np.int32)),
            lib.InferInput("DELAY", [1], "FP32").set_data_from_numpy(np.array([delay], dtype=np.float32)),
            lib.InferInput("FAIL", [1], "INT32").set_data_from_numpy(np.array([fail], dtype=np.int32))]


def collect(got, until_final=True, timeout=30):
    """(values, errors) of one request's responses, up to its final mark."""
    values, errors = [], []
    while True:
        result, error = got.get(timeout=timeout)
        if error is not None:
            errors.append(str(error))
            continue
        r = result.get_response()
        final = r.parameters["triton_final_response"].bool_param
        if result.as_numpy("OUT") is not None:
            values.append(int(result.as_numpy("OUT")[0]))
            # The parameters the model set on this response travel with it.
            assert r.parameters["index"].int64_param == values[-1], r.parameters
        if final or not until_final:
            return values, errors


def test_many_zero_and_an_error_over_the_grpc_stream(server):
    client = server.grpc_client()
    got = queue.Queue()
    client.start_stream(callback=lambda result, error: got.put((result, error)))
    client.async_stream_infer("repeat", inputs(grpcclient, 4), request_id="a", enable_empty_final_response=True)
    assert collect(got) == ([0, 1, 2, 3], [])
    client.async_stream_infer("repeat", inputs(grpcclient, 0), request_id="b", enable_empty_final_response=True)
    assert collect(got) == ([], []), "zero responses: only the empty final one"
    client.async_stream_infer("repeat", inputs(grpcclient, 3, fail=1), request_id="c", enable_empty_final_response=True)
    values, errors = collect(got)
    assert values == [0, 2] and len(errors) == 1 and "token 1 failed" in errors[0], (values, errors)
    # Without enable_empty_final_response the last message is the last one with outputs.
    client.async_stream_infer("repeat", inputs(grpcclient, 2), request_id="d")
    first, _ = got.get(timeout=30)
    second, _ = got.get(timeout=30)
    assert [int(r.as_numpy("OUT")[0]) for r in (first, second)] == [0, 1]
    time.sleep(0.3)
    assert got.empty(), "no empty final response unless asked for"
    client.stop_stream()


def test_a_client_that_cancels_stops_the_work(server):
    client = server.grpc_client()
    got = queue.Queue()
    client.start_stream(callback=lambda result, error: got.put((result, error)))
    client.async_stream_infer("repeat", inputs(grpcclient, 1000, delay=0.02), request_id="long")
    for _ in range(3):
        result, error = got.get(timeout=30)
        assert error is None
    client.stop_stream(cancel_requests=True)
    assert server.wait_log("request long cancelled after", timeout=30), server.log()


def test_plain_infer_is_refused_as_triton_refuses_it(server):
    with pytest.raises(InferenceServerException, match="HTTP end point doesn't support models with decoupled"):
        server.client().infer("repeat", inputs(httpclient, 1))
    with pytest.raises(InferenceServerException) as err:
        server.grpc_client().infer("repeat", inputs(grpcclient, 1))
    assert err.value.status() == "StatusCode.UNIMPLEMENTED"
    assert "ModelInfer RPC doesn't support models with decoupled" in err.value.message()


def test_generate_and_generate_stream_as_server_sent_events(server):
    body = json.dumps({"COUNT": 3, "DELAY": 0.0, "FAIL": 0, "id": "g1"})
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    conn.request("POST", "/v2/models/repeat/generate_stream", body=body)
    r = conn.getresponse()
    assert r.status == 200 and r.getheader("Content-Type") == "text/event-stream; charset=utf-8"
    events = [json.loads(line[len("data: "):]) for line in r.read().decode().splitlines() if line.startswith("data: ")]
    assert [e["OUT"] for e in events] == [0, 1, 2] and events[0]["TEXT"] == "token0" and events[0]["id"] == "g1", events
    conn.request("POST", "/v2/models/repeat/generate", body=json.dumps({"COUNT": 1, "DELAY": 0.0, "FAIL": 0}))
    r = conn.getresponse()
    doc = json.loads(r.read())
    assert r.status == 200 and doc["OUT"] == 0 and doc["model_name"] == "repeat", doc
    # generate wants exactly one response, as Triton's: the status is the first response's.
    conn.request("POST", "/v2/models/repeat/generate", body=body)
    r = conn.getresponse()
    doc = json.loads(r.read())
    assert r.status == 200 and doc["error"].startswith("generate expects model to produce exactly 1 response"), doc
    conn.request("POST", "/v2/models/repeat/generate_stream", body=json.dumps({"COUNT": 3, "DELAY": 0.0, "FAIL": 1}))
    text = conn.getresponse().read().decode()
    assert '"error"' in text and "token 1 failed" in text, text
    conn.close()


def test_statistics_count_each_response_by_index(tmp_path):
    repo = str(tmp_path)
    models.python_model(repo, "repeat", REPEAT, CONFIG)
    with Server(["--model-repository", repo]) as s:
        client = s.grpc_client()
        got = queue.Queue()
        client.start_stream(callback=lambda result, error: got.put((result, error)))
        for i in range(2):
            client.async_stream_infer("repeat", inputs(grpcclient, 3), request_id=f"ok{i}",
                                      enable_empty_final_response=True)
            assert collect(got) == ([0, 1, 2], [])
        client.async_stream_infer("repeat", inputs(grpcclient, 3, fail=1), request_id="bad",
                                  enable_empty_final_response=True)
        assert collect(got)[0] == [0, 2]
        client.stop_stream()
        http = s.client().get_inference_statistics("repeat")["model_stats"][0]["response_stats"]
        grpc = client.get_inference_statistics("repeat").model_stats[0].response_stats
    counts = {i: {k: v["count"] for k, v in r.items()} for i, r in http.items()}
    assert set(counts) == {"0", "1", "2", "3"}, counts
    assert counts["0"] == {"compute_infer": 3, "compute_output": 3, "success": 3, "fail": 0,
                           "empty_response": 0, "cancel": 0}
    assert (counts["1"]["success"], counts["1"]["fail"]) == (2, 1), "the failed token is response 1"
    assert counts["2"]["success"] == 3
    assert (counts["3"]["empty_response"], counts["3"]["success"]) == (3, 0), "the final mark is empty"
    assert http["0"]["success"]["ns"] > 0 and http["0"]["compute_infer"]["ns"] <= http["0"]["success"]["ns"]
    for i, r in http.items():
        for k, v in r.items():
            assert (getattr(grpc[i], k).count, getattr(grpc[i], k).ns) == (v["count"], v["ns"]), (i, k)
