"""The generate extension as Triton's (qa/L0_http/generate_endpoint_test.py is the target): body keys
named like inputs are inputs with their shapes fitted to the model's, other keys and `parameters`
are request parameters; Triton's error texts and statuses for missing, mistyped and repeated
inputs; one JSON object per response with sorted keys; generate wants exactly one response;
generate_stream's status is its first response's."""
import http.client
import json

import pytest

import models
from ferry_server import Server

# A decoupled echo: PROMPT back as TEXT, REPEAT times when STREAM, then the final mark, or
# an error response when FAIL_LAST; EMPTY answers a zero-element TEXT.
ECHO = '''
import json

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            params = json.loads(request.parameters())
            prompt = pb_utils.get_input_tensor_by_name(request, "PROMPT").as_numpy()
            stream = bool(pb_utils.get_input_tensor_by_name(request, "STREAM").as_numpy().flatten()[0])
            text = np.array([], dtype=np.object_) if params.get("EMPTY") else prompt
            times = int(params.get("REPEAT", 1)) if stream else 1
            for _ in range(times):
                sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("TEXT", text)]))
            if params.get("FAIL_LAST"):
                sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError("the last one failed")),
                            flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            else:
                sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
'''

CONFIG = """
backend: "python"
max_batch_size: 0
model_transaction_policy { decoupled: true }
input [ { name: "PROMPT" data_type: TYPE_STRING dims: [ 1, 1 ] },
        { name: "STREAM" data_type: TYPE_BOOL dims: [ 1, 1 ] },
        { name: "input_ids" data_type: TYPE_INT32 dims: [ 1, -1 ] optional: true } ]
output [ { name: "TEXT" data_type: TYPE_STRING dims: [ 1, -1 ] } ]
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    repo = str(tmp_path_factory.mktemp("generate"))
    models.python_model(repo, "echo_llm", ECHO, CONFIG)
    with Server(["--model-repository", repo]) as s:
        yield s


def post(s, path, body, headers=None):
    conn = http.client.HTTPConnection("127.0.0.1", s.port, timeout=60)
    conn.request("POST", f"/v2/models/echo_llm/{path}", body=body if isinstance(body, str) else json.dumps(body),
                 headers=headers or {})
    r = conn.getresponse()
    out = r.status, r.getheader("Content-Type"), r.read().decode()
    conn.close()
    return out


def events(text):
    return [json.loads(line[len("data: "):]) for line in text.split("\n\n") if line.startswith("data: ")]


def test_one_object_of_sorted_keys_and_the_id_echoed(server):
    status, ctype, text = post(server, "generate", {"PROMPT": "hello world", "STREAM": False, "id": "42",
                                                    "input_ids": [100, 200]})
    assert (status, ctype) == (200, "application/json"), text
    assert text == '{"TEXT":"hello world","id":"42","model_name":"echo_llm","model_version":"1"}'
    for body in ({"PROMPT": "a", "STREAM": False}, {"PROMPT": "a", "STREAM": False, "id": ""}):
        assert "id" not in json.loads(post(server, "generate", body)[2])


def test_stream_events_and_parameters_one_level_down(server):
    status, ctype, text = post(server, "generate_stream",
                               {"PROMPT": ["hi"], "STREAM": True, "parameters": {"REPEAT": 3}})
    assert (status, ctype) == (200, "text/event-stream; charset=utf-8")
    assert [e["TEXT"] for e in events(text)] == ["hi"] * 3
    assert all(chunk.startswith("data: ") for chunk in text.split("\n\n") if chunk)


def test_missing_and_mistyped_inputs_in_tritons_words(server):
    for path in ("generate", "generate_stream"):
        for body, got in [({}, 0), ({"abc": 123}, 0), ({"PROMPT": "a"}, 1), ({"STREAM": False, "other": "p"}, 1)]:
            status, ctype, text = post(server, path, body)
            assert (status, ctype) == (400, "application/json"), text
            assert f"expected number of inputs between 2 and 3 but got {got}" in json.loads(text)["error"]
        for body, why in [({"PROMPT": 123, "STREAM": False}, "attempt to access JSON non-string as string"),
                          ({"PROMPT": "a", "STREAM": "false"}, "attempt to access JSON non-boolean as boolean"),
                          ('{"STREAM":123,"PROMPT":true}', "non-boolean as boolean")]:
            # Triton answers 500 (its JSON reader's errors are internal); a client's mistake is 400 here.
            status, ctype, text = post(server, path, body)
            assert (status, ctype) == (400, "application/json") and why in json.loads(text)["error"], text


def test_a_repeated_input_is_refused_at_its_first_repeat(server):
    for body, name in [('{"PROMPT":"a","STREAM":false,"PROMPT":"b"}', "PROMPT"),
                       ('{"PROMPT":"a","STREAM":false,"STREAM":false,"PROMPT":"b"}', "STREAM")]:
        for path in ("generate", "generate_stream"):
            status, _, text = post(server, path, body)
            assert status == 400 and f"input '{name}' already exists in request" in json.loads(text)["error"]


def test_generate_wants_exactly_one_response(server):
    for repeat in (0, 2):
        status, _, text = post(server, "generate", {"PROMPT": "a", "STREAM": True, "REPEAT": repeat})
        assert status == 200 and json.loads(text)["error"].startswith(
            "generate expects model to produce exactly 1 response"), text
    status, _, text = post(server, "generate_stream", {"PROMPT": "a", "STREAM": True, "REPEAT": 0})
    assert (status, text) == (200, "")


def test_stream_errors_are_events_and_the_status_is_the_first_responses(server):
    status, ctype, text = post(server, "generate_stream", {"PROMPT": "a", "STREAM": True, "REPEAT": 0,
                                                           "FAIL_LAST": True})
    assert (status, ctype) == (500, "text/event-stream; charset=utf-8")
    assert events(text) == [{"error": "the last one failed"}]
    status, _, text = post(server, "generate_stream", {"PROMPT": "a", "STREAM": True, "REPEAT": 1,
                                                       "FAIL_LAST": True})
    assert status == 200
    assert [e.get("TEXT", e.get("error")) for e in events(text)] == ["a", "the last one failed"]


def test_nested_values_and_parameters_errors(server):
    cases = [({"PROMPT": "a", "STREAM": True, "PARAMS": {"P": 0}}, 400, "parameter 'PARAMS' has invalid type"),
             ({"PROMPT": "a", "STREAM": True, "parameters": 1}, 400, "Expected JSON object for keyword: 'parameters'"),
             ({"PROMPT": "a", "STREAM": True, "parameters": {"nested": {"twice": 1}}}, 400,
              "Converting keyword: 'parameters': parameter 'nested' has invalid type."),
             ({"PROMPT": {"USER": "x"}, "STREAM": True}, 400, "attempt to access JSON non-string as string"),
             ({"PROMPT": ["a", "b"], "STREAM": True}, 400, "can not convert input 'PROMPT' to tensor")]
    for body, code, why in cases:
        status, _, text = post(server, "generate", body)
        assert status == code and why in json.loads(text)["error"], (body, text)


def test_zero_element_output_and_refused_encodings(server):
    status, _, text = post(server, "generate", {"PROMPT": "a", "STREAM": False, "EMPTY": True})
    assert status == 200 and json.loads(text)["TEXT"] == [], text
    status, _, text = post(server, "generate", {"PROMPT": "a", "STREAM": False}, {"Content-Encoding": "gzip"})
    assert status == 400 and "only 'identity' is supported" in json.loads(text)["error"]
    assert post(server, "generate", "{")[0] == 400
    assert server.client().is_server_live()


def test_a_python_model_loads_from_a_relative_repository_path(tmp_path, monkeypatch):
    models.python_model(str(tmp_path / "repo"), "echo_llm", ECHO, CONFIG)
    monkeypatch.chdir(tmp_path)
    with Server(["--model-repository", "repo"]) as s:
        status, _, text = post(s, "generate", {"PROMPT": "here", "STREAM": False})
        assert status == 200 and json.loads(text)["TEXT"] == "here", text
