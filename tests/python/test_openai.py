"""The OpenAI API through the real server, driven by the official `openai` client: embeddings of the
embedded example pipeline (tokenizer, ONNX, pooling; no Python) equal to its KServe v2 result, in
float and base64; chat and text completions over a decoupled Python model that emits one word per
response, streamed chunk by chunk and whole; request fields reaching the model; stop sequences;
OpenAI's error shapes; a client that leaves mid-stream (the model sees the cancellation); the API
key."""
import base64
import http.client
import json
import os

import numpy as np
import openai
import pytest
import tritonclient.http as httpclient

import models
from ferry_server import Server

EXAMPLES = os.path.join(os.path.dirname(__file__), "..", "..", "examples")

WORDS = '''
import json
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
        prompt = pb_utils.get_input_tensor_by_name(request, "text_input").as_numpy().reshape(-1)[0].decode()
        params = json.loads(request.parameters())
        max_tokens = pb_utils.get_input_tensor_by_name(request, "max_tokens")
        limit = int(max_tokens.as_numpy().reshape(-1)[0]) if max_tokens is not None else 1000
        delay = float(params.get("delay", 0.0)) if "delay" in params else 0.0
        words = prompt.split()
        if params.get("temperature") is not None:
            words.append(f"t={params['temperature']}")
        sender = request.get_response_sender()
        if params.get("bytes"):
            # One byte per response: characters split between responses.
            for b in prompt.encode():
                sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("text_output", np.array([bytes([b])], dtype=np.object_))]))
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            return
        for i, w in enumerate(words[:limit]):
            if request.is_cancelled():
                pb_utils.Logger.log_info(f"words: cancelled after {i}")
                sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                return
            sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("text_output", np.array([(w + " ").encode()], dtype=np.object_))]))
            time.sleep(delay)
        sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
'''

WORDS_CONFIG = """
backend: "python"
max_batch_size: 0
model_transaction_policy { decoupled: true }
parameters [ { key: "chat_template" value { string_value: "{% for m in messages %}{{ m.role }}: {{ m.content }} {% endfor %}" } } ]
input [ { name: "text_input" data_type: TYPE_STRING dims: [ 1 ] },
        { name: "max_tokens" data_type: TYPE_INT32 dims: [ 1 ] optional: true } ]
output [ { name: "text_output" data_type: TYPE_STRING dims: [ 1 ] } ]
"""


# The example pipeline without its tokenizer: token ids and their mask in, the embedding out.
TOKEN_EMBEDDING = """
name: "token_embedding"
platform: "ensemble"
max_batch_size: 8
input [ { name: "input_ids" data_type: TYPE_INT64 dims: [ 16 ] }, { name: "attention_mask" data_type: TYPE_INT64 dims: [ 16 ] } ]
output [ { name: "EMBEDDING" data_type: TYPE_FP32 dims: [ 8 ] } ]
ensemble_scheduling {
  step [
    { model_name: "text_embedding_onnx" model_version: -1
      input_map { key: "input_ids" value: "input_ids" } output_map { key: "HIDDEN" value: "hidden" } },
    { model_name: "text_embedding_pool" model_version: -1
      input_map { key: "HIDDEN" value: "hidden" } input_map { key: "MASK" value: "attention_mask" }
      output_map { key: "EMBEDDING" value: "EMBEDDING" } }
  ]
}
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    repo = str(tmp_path_factory.mktemp("openai"))
    models.python_model(repo, "words", WORDS, WORDS_CONFIG)
    # The same model with its chat template saved beside it, as Hugging Face saves it.
    plain = "\n".join(line for line in WORDS_CONFIG.splitlines() if "chat_template" not in line)
    models.python_model(repo, "words_hf", WORDS, plain)
    models.write(os.path.join(repo, "words_hf", "tokenizer_config.json"), json.dumps({
        "chat_template": "{{ bos_token }}{% for m in messages %}<{{ m.role }}>{{ m.content }} {% endfor %}",
        "bos_token": {"content": "<s>"}}))
    models.write(os.path.join(repo, "token_embedding", "config.pbtxt"), TOKEN_EMBEDDING)
    os.makedirs(os.path.join(repo, "token_embedding", "1"))
    with Server(["--model-repository", EXAMPLES, "--model-repository", repo]) as s:
        yield s


def client(server, key="unused"):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key=key, max_retries=0)


def kserve_embeddings(server, texts):
    c = httpclient.InferenceServerClient(server.url)
    out = []
    for at in range(0, len(texts), 8):
        part = texts[at:at + 8]
        i = httpclient.InferInput("TEXT", [len(part), 1], "BYTES")
        i.set_data_from_numpy(np.array([[t.encode()] for t in part], dtype=np.object_))
        out.append(c.infer("text_embedding", [i]).as_numpy("EMBEDDING"))
    return np.concatenate(out)


def test_models_lists_what_maps_to_an_operation(server):
    listed = {m.id for m in client(server).models.list()}
    assert {"text_embedding", "words"} <= listed
    # A classifier or an add/sub model is no OpenAI model.
    assert not listed & {"simple", "text_classifier", "color_match", "color_match_image"}
    assert client(server).models.retrieve("words").id == "words"
    with pytest.raises(openai.NotFoundError):
        client(server).models.retrieve("simple")


def test_embeddings_equal_the_kserve_result(server):
    texts = ["red fire", "the sky and the ocean", "snow", "green leaf grass", "coal at night", "milk",
             "blue", "tomato", "white snow"]  # more than the pipeline's max_batch_size of 8
    got = client(server).embeddings.create(model="text_embedding", input=texts, encoding_format="float")
    want = kserve_embeddings(server, texts)
    assert [d.index for d in got.data] == list(range(len(texts)))
    np.testing.assert_allclose(np.array([d.embedding for d in got.data]), want, rtol=1e-6)
    np.testing.assert_allclose(np.linalg.norm(want, axis=1), 1.0, rtol=1e-5)
    # The attention mask counts the tokens: one per word.
    assert got.usage.prompt_tokens == sum(len(t.split()) for t in texts)
    one = client(server).embeddings.create(model="text_embedding", input="red fire")
    np.testing.assert_allclose(one.data[0].embedding, want[0], rtol=1e-6)


def token_ids(server, texts):
    """The example tokenizer's ids of each text, its padding cut off."""
    c = httpclient.InferenceServerClient(server.url)
    arrays = []
    for text in texts:
        i = httpclient.InferInput("TEXT", [1, 1], "BYTES")
        i.set_data_from_numpy(np.array([[text.encode()]], dtype=np.object_))
        out = c.infer("text_embedding_tokens", [i])
        ids, mask = out.as_numpy("input_ids")[0], out.as_numpy("attention_mask")[0]
        arrays.append(ids[mask == 1].tolist())
    return arrays


def test_embeddings_of_token_arrays(server):
    texts = ["red fire", "the sky and the ocean", "snow", "green leaf grass", "coal at night", "milk",
             "blue", "tomato", "white snow"]
    arrays = token_ids(server, texts)
    assert all(arrays) and len({len(a) for a in arrays}) > 1
    got = client(server).embeddings.create(model="token_embedding", input=arrays, encoding_format="float")
    np.testing.assert_allclose(np.array([d.embedding for d in got.data]), kserve_embeddings(server, texts), rtol=1e-6)
    assert got.usage.prompt_tokens == sum(len(a) for a in arrays)
    one = client(server).embeddings.create(model="token_embedding", input=arrays[1])
    np.testing.assert_allclose(one.data[0].embedding, kserve_embeddings(server, texts[1:2])[0], rtol=1e-6)
    c = client(server)
    with pytest.raises(openai.BadRequestError, match=r"input\[1\] holds 17 tokens; the model takes at most 16"):
        c.embeddings.create(model="token_embedding", input=[[2], [2] * 17])
    with pytest.raises(openai.BadRequestError, match=r"input\[0\] holds no tokens"):
        c.embeddings.create(model="token_embedding", input=[[]])
    with pytest.raises(openai.BadRequestError, match="token -1; token ids are not negative"):
        c.embeddings.create(model="token_embedding", input=[[2], [3, -1]])
    with pytest.raises(openai.BadRequestError, match="takes token arrays, not text"):
        c.embeddings.create(model="token_embedding", input="red")
    with pytest.raises(openai.BadRequestError, match="takes text, not token arrays"):
        c.embeddings.create(model="text_embedding", input=[[2, 3]])
    assert "token_embedding" in {m.id for m in c.models.list()}


def test_embeddings_in_base64(server):
    # The client asks for base64 by default and decodes it; check the raw body too.
    conn = http.client.HTTPConnection("127.0.0.1", server.port)
    conn.request("POST", "/v1/embeddings", json.dumps({"model": "text_embedding", "input": ["sky"], "encoding_format": "base64"}),
                 {"Content-Type": "application/json"})
    body = json.loads(conn.getresponse().read())
    raw = np.frombuffer(base64.b64decode(body["data"][0]["embedding"]), dtype="<f4")
    np.testing.assert_allclose(raw, kserve_embeddings(server, ["sky"])[0], rtol=1e-6)
    default = client(server).embeddings.create(model="text_embedding", input="sky")
    np.testing.assert_allclose(default.data[0].embedding, raw, rtol=1e-6)


def test_embedding_errors(server):
    c = client(server)
    with pytest.raises(openai.NotFoundError) as e:
        c.embeddings.create(model="no_such_model", input="x")
    assert e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as e:
        c.embeddings.create(model="text_embedding", input="x", dimensions=4)
    assert "openai_truncatable_dimensions" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        c.embeddings.create(model="words", input="x")
    assert "serves completions" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        c.embeddings.create(model="text_embedding", input=[[1, 2, 3]])
    assert e.value.body["param"] == "input"
    with pytest.raises(openai.BadRequestError):
        c.embeddings.create(model="text_embedding", input=[])


def test_streamed_chat_arrives_chunk_by_chunk(server):
    stream = client(server).chat.completions.create(
        model="words", messages=[{"role": "user", "content": "one two three"}], stream=True,
        stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    pieces = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    # The template made "user: one two three "; one word per response, one chunk per word.
    assert pieces == ["user: ", "one ", "two ", "three "]
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["stop"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 4
    assert len({c.id for c in chunks}) == 1 and chunks[0].id.startswith("chatcmpl-")


def test_whole_chat_and_completion(server):
    chat = client(server).chat.completions.create(model="words", messages=[
        {"role": "system", "content": "s"}, {"role": "user", "content": [{"type": "text", "text": "a b"}]}])
    assert chat.choices[0].message.content == "system: s user: a b "
    assert chat.choices[0].message.role == "assistant" and chat.choices[0].finish_reason == "stop"
    done = client(server).completions.create(model="words", prompt="alpha beta gamma delta", max_tokens=2)
    # max_tokens reached the model as its input.
    assert done.choices[0].text == "alpha beta "
    assert done.choices[0].finish_reason == "length"
    assert done.object == "text_completion"
    # A field the model has no input for is a request parameter.
    hot = client(server).completions.create(model="words", prompt="x", temperature=0.5)
    assert hot.choices[0].text == "x t=0.5 "
    several = client(server).completions.create(model="words", prompt="p q", n=3)
    assert [c.index for c in several.choices] == [0, 1, 2]
    assert {c.text for c in several.choices} == {"p q "}


def test_the_chat_template_saved_beside_the_model(server):
    chat = client(server).chat.completions.create(model="words_hf", messages=[{"role": "user", "content": "hi there"}])
    assert chat.choices[0].message.content == "<s><user>hi there "


def test_stop_sequences_cut_the_text(server):
    done = client(server).completions.create(model="words", prompt="keep this END not that", stop=["END"])
    assert done.choices[0].text == "keep this "
    assert done.choices[0].finish_reason == "stop"
    streamed = client(server).completions.create(model="words", prompt="a b STOP c", stop="STOP", stream=True)
    text = "".join(c.choices[0].text for c in streamed if c.choices)
    assert text == "a b "


def test_bad_parameters_are_openai_errors(server):
    c = client(server)
    for kwargs, param in [({"temperature": 5}, "temperature"), ({"n": 0}, "n"), ({"top_p": 2}, "top_p"),
                          ({"max_tokens": 0}, "max_tokens"), ({"stop": ["a", "b", "c", "d", "e"]}, "stop")]:
        with pytest.raises(openai.BadRequestError) as e:
            c.completions.create(model="words", prompt="x", **kwargs)
        assert e.value.body["param"] == param, kwargs
        assert e.value.body["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError):
        c.chat.completions.create(model="words", messages=[])
    with pytest.raises(openai.BadRequestError):
        c.chat.completions.create(model="text_embedding", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.NotFoundError):
        c.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    conn = http.client.HTTPConnection("127.0.0.1", server.port)
    conn.request("POST", "/v1/chat/completions", b"{not json", {"Content-Type": "application/json"})
    r = conn.getresponse()
    assert r.status == 400 and "error" in json.loads(r.read())
    # The server keeps serving.
    assert server.client().is_server_live()


def test_a_client_that_leaves_cancels_the_stream(server):
    conn = http.client.HTTPConnection("127.0.0.1", server.port)
    body = {"model": "words", "prompt": " ".join(f"w{i}" for i in range(200)), "stream": True, "delay": 0.05,
            "max_tokens": 500}
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    r = conn.getresponse()
    assert r.status == 200 and r.getheader("Content-Type").startswith("text/event-stream")
    first = r.readline()
    assert first.startswith(b"data: ")
    conn.close()
    server.wait_log("words: cancelled after", timeout=30)


def test_api_key(tmp_path):
    with Server(["--model-repository", EXAMPLES, "--openai-api-key", "sk-test-123"]) as s:
        with pytest.raises(openai.AuthenticationError) as e:
            client(s, "sk-wrong").embeddings.create(model="text_embedding", input="red")
        assert e.value.body["code"] == "invalid_api_key"
        ok = client(s, "sk-test-123").embeddings.create(model="text_embedding", input="red")
        assert len(ok.data[0].embedding) == 8
        # KServe v2 is not behind the OpenAI key.
        assert s.client().is_server_ready()


def test_vertex_invoke_routes_reach_the_openai_api():
    # A model uploaded with invokeRoutePrefix "/*": Vertex forwards `.../invoke/v1/embeddings` as
    # `/v1/embeddings` to the container's port.
    env = {"AIP_MODE": "PREDICTION", "AIP_HTTP_PORT": "0", "AIP_HEALTH_ROUTE": "/health", "AIP_PREDICT_ROUTE": "/predict",
           "AIP_STORAGE_URI": ""}
    with Server(["--model-repository", EXAMPLES], env=env, services=("Vertex AI",)) as s:
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{s.ports['Vertex AI']}/v1", api_key="x", max_retries=0)
        got = c.embeddings.create(model="text_embedding", input="red fire")
        assert len(got.data[0].embedding) == 8 and got.usage.prompt_tokens == 2


def test_token_counts_are_metrics(server):
    client(server).embeddings.create(model="text_embedding", input=["red fire grass"])
    client(server).completions.create(model="words", prompt="one two")

    def count(model, kind):
        for line in server.metrics().splitlines():
            if line.startswith("ferry_openai_tokens_total{") and f'model="{model}"' in line and f'kind="{kind}"' in line:
                return float(line.rsplit(" ", 1)[1])
        return 0.0
    assert count("text_embedding", "prompt") >= 3
    assert count("words", "completion") >= 2


def test_sagemaker_invocations_take_openai_bodies(tmp_path):
    # SAGEMAKER_TRITON_INFERENCE_TYPE=openai: /invocations tells chat, completions and embeddings
    # apart by their fields; /invocations-response-stream streams (InvokeEndpointWithResponseStream).
    import shutil
    repo = tmp_path / "model"
    shutil.copytree(EXAMPLES, repo, ignore=shutil.ignore_patterns("make_examples.py"))
    models.python_model(str(repo), "words", WORDS, WORDS_CONFIG)
    env = {"SAGEMAKER_BIND_TO_PORT": "0", "FERRY_SAGEMAKER_MODEL_DIR": str(repo), "SAGEMAKER_TRITON_INFERENCE_TYPE": "openai"}
    with Server([], env=env, services=("SageMaker",)) as s:
        def post(path, body):
            conn = http.client.HTTPConnection("127.0.0.1", s.ports["SageMaker"])
            conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
            r = conn.getresponse()
            return r.status, r.getheader("Content-Type"), r.read()
        status, _, body = post("/invocations", {"model": "text_embedding", "input": ["red fire"]})
        assert status == 200, body
        np.testing.assert_allclose(json.loads(body)["data"][0]["embedding"], kserve_embeddings_on(s, ["red fire"])[0], rtol=1e-6)
        status, _, body = post("/invocations", {"model": "words", "messages": [{"role": "user", "content": "a b"}]})
        assert status == 200 and json.loads(body)["choices"][0]["message"]["content"] == "user: a b ", body
        status, kind, body = post("/invocations-response-stream", {"model": "words", "prompt": "x y"})
        assert status == 200 and kind.startswith("text/event-stream"), body
        events = [line[6:] for line in body.decode().splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        assert "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1] if json.loads(e)["choices"]) == "x y "
        status, _, body = post("/invocations", {"model": "words"})
        assert status == 400 and "messages" in json.loads(body)["error"]["message"]


def kserve_embeddings_on(s, texts):
    # The SageMaker listener serves no KServe v2 port of its own here: compute the reference
    # through the same pipeline on a plain server.
    with Server(["--model-repository", EXAMPLES]) as plain:
        return kserve_embeddings(plain, texts)


def test_one_finish_per_choice_and_split_characters(server):
    chunks = list(client(server).completions.create(model="words", prompt=["a STOP b c d e", "x y z w"], stop="STOP",
                                                    stream=True))
    finishes = [(c.choices[0].index, c.choices[0].finish_reason) for c in chunks if c.choices and c.choices[0].finish_reason]
    assert sorted(finishes) == [(0, "stop"), (1, "stop")]
    texts = {i: "".join(c.choices[0].text for c in chunks if c.choices and c.choices[0].index == i) for i in (0, 1)}
    assert texts == {0: "a ", 1: "x y z w "}
    # A character whose bytes come in two responses arrives whole.
    whole = client(server).completions.create(model="words", prompt="café ñ", extra_body={"bytes": True})
    assert whole.choices[0].text == "café ñ"
    streamed = client(server).completions.create(model="words", prompt="é€", extra_body={"bytes": True}, stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == "é€"


def test_unserved_fields_are_refused_and_reserved_names_kept_back(server):
    c = client(server)
    for kwargs in [{"echo": True}, {"logprobs": 2}, {"best_of": 3}, {"suffix": "x"}]:
        with pytest.raises(openai.BadRequestError) as e:
            c.completions.create(model="words", prompt="x", **kwargs)
        assert "not supported" in e.value.body["message"], kwargs
    with pytest.raises(openai.BadRequestError):
        c.chat.completions.create(model="words", messages=[{"role": "user", "content": "x"}],
                                  tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}])
    # Asking for nothing of them is fine; the engine's own parameter names never come from the body.
    ok = c.completions.create(model="words", prompt="x", echo=False, extra_body={"priority": -1, "triton_x": 1})
    assert ok.choices[0].text == "x "
    conn = http.client.HTTPConnection("127.0.0.1", server.port)
    conn.request("GET", "/v1/completions")
    r = conn.getresponse()
    assert r.status == 405 and json.loads(r.read())["error"]["type"] == "invalid_request_error"
    conn.request("GET", "/v1/no/such/route")
    r = conn.getresponse()
    assert r.status == 404 and json.loads(r.read())["error"]["message"] == "Not Found"
