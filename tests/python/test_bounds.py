"""The second hardening pass: each attack of the review reproduced against the real binary, and the
server alive, answering, and within its memory bound afterwards (peak RSS read from /proc)."""
import json
import os
import re
import struct
import zlib

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.grpc import service_pb2
from tritonclient.utils import InferenceServerException

import models
import raw_grpc
from ferry_server import Server


def peak_rss(server):
    """The server's peak resident memory so far, in bytes (VmHWM)."""
    with open(f"/proc/{server.proc.pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


def gray_png(w, h):
    """A real w x h 8-bit gray PNG, every row zero: a few kilobytes for millions of rows."""
    chunk = lambda kind, data: struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    rows = zlib.compress(b"\0" * ((w + 1) * h), 9)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 0, 0, 0, 0))
            + chunk(b"IDAT", rows) + chunk(b"IEND", b""))


def image_model(repo, name, params, dims):
    ps = ", ".join(f'{{ key: "{k}" value {{ string_value: "{v}" }} }}' for k, v in params.items())
    models.write(os.path.join(repo, name, "config.pbtxt"), f"""
name: "{name}"
backend: "ferry_image"
max_batch_size: 8
parameters [ {ps} ]
input [ {{ name: "IMAGE" data_type: TYPE_STRING dims: [ 1 ] }} ]
output [ {{ name: "PIXELS" data_type: TYPE_FP32 dims: [ {", ".join(map(str, dims))} ] }} ]
""")
    os.makedirs(os.path.join(repo, name, "1"), exist_ok=True)


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    repo = str(tmp_path_factory.mktemp("bounds"))
    image_model(repo, "imagenet", {"preset": "imagenet"}, (3, 224, 224))
    image_model(repo, "clip", {"preset": "clip"}, (3, 224, 224))
    image_model(repo, "nearest", {"resize": "shortest", "size": "256", "filter": "nearest"}, (3, -1, -1))
    image_model(repo, "letterbox", {"preset": "yolo"}, (3, 640, 640))
    with Server(["--model-repository", repo]) as s:
        yield s


def infer_image(client, model, data):
    i = httpclient.InferInput("IMAGE", [1, 1], "BYTES").set_data_from_numpy(np.array([[data]], dtype=np.object_))
    return client.infer(model, [i])


@pytest.mark.parametrize("model", ["imagenet", "clip", "nearest", "letterbox"])
@pytest.mark.parametrize("w,h", [(1, 10_000_000), (200_000, 1), (1, 200_000)])
def test_a_tiny_tall_image_is_refused_without_allocating(images, model, w, h):
    data = gray_png(w, h)
    assert len(data) < 64 << 10
    before = peak_rss(images)
    client = images.client()
    with pytest.raises(InferenceServerException, match=r"too long and thin to resize.*'max_aspect_ratio'") as e:
        infer_image(client, model, data)
    assert f"{w}x{h} pixels" in str(e.value)
    assert peak_rss(images) - before < 200 << 20
    # Still serving: an ordinary image goes through the same model.
    out = infer_image(client, model, gray_png(64, 48)).as_numpy("PIXELS")
    assert out.shape[:2] == (1, 3)
    assert client.is_server_live() and client.is_model_ready(model)


def test_the_embedded_examples_refuse_it_too():
    with Server([]) as s:
        client = s.client()
        with pytest.raises(InferenceServerException, match="too long and thin"):
            infer_image(client, "color_match_image", gray_png(1, 10_000_000))
        assert infer_image(client, "color_match_image", gray_png(40, 30)).as_numpy("PIXELS").shape == (1, 3, 32, 32)


def test_long_but_reasonable_images_still_resize(images):
    # 80:1, under the default ratio of 100: resized and cropped as before.
    out = infer_image(images.client(), "imagenet", gray_png(20, 1600)).as_numpy("PIXELS")
    assert out.shape == (1, 3, 224, 224)


def test_configured_sizes_past_max_pixels_are_refused_at_load(tmp_path):
    repo = str(tmp_path)
    image_model(repo, "huge_crop", {"resize": "shortest", "size": "256", "crop": "16384", "max_pixels": "1000000"},
                (3, 16384, 16384))
    image_model(repo, "huge_exact", {"resize": "exact", "size": "16384,16384"}, (3, 16384, 16384))
    image_model(repo, "fine", {"resize": "exact", "size": "32"}, (3, 32, 32))
    with Server(["--model-repository", repo, "--exit-on-error=false"]) as s:
        client = s.client()
        assert client.is_model_ready("fine")
        index = {m["name"]: m for m in client.get_model_repository_index()}
        assert "parameter 'crop'" in index["huge_crop"]["reason"] and "at most 1000000 pixels" in index["huge_crop"]["reason"]
        assert "parameter 'size'" in index["huge_exact"]["reason"] and "at most 50000000" in index["huge_exact"]["reason"]


def wrapper(name, calls):
    """An ensemble over one model that takes and gives INPUT0 / OUTPUT0 (FP32, [-1])."""
    return json.dumps({
        "name": name, "platform": "ensemble", "max_batch_size": 8,
        "input": [{"name": "INPUT0", "data_type": "TYPE_FP32", "dims": [-1]}],
        "output": [{"name": "OUTPUT0", "data_type": "TYPE_FP32", "dims": [-1]}],
        "ensemble_scheduling": {"step": [{"model_name": calls, "model_version": -1,
                                          "input_map": {"INPUT0": "INPUT0"}, "output_map": {"OUTPUT0": "OUTPUT0"}}]}})


def identity_infer(client, name):
    x = np.arange(3, dtype=np.float32).reshape(1, 3)
    out = client.infer(name, [httpclient.InferInput("INPUT0", [1, 3], "FP32").set_data_from_numpy(x)])
    np.testing.assert_array_equal(out.as_numpy("OUTPUT0"), x)


def test_an_ensemble_cycle_is_refused_at_load_with_its_path(tmp_path):
    repo = str(tmp_path)
    models.identity(repo, "b", "FP32")
    with Server(["--model-repository", repo, "--model-control-mode=explicit", "--load-model=*"]) as s:
        client = s.client()
        client.load_model("a", config=wrapper("a", "b"), files={"file:1/.keep": b""})
        identity_infer(client, "a")
        # b, which a calls, reloaded as an ensemble calling a: the first request would recurse.
        with pytest.raises(InferenceServerException, match="cycle: b -> a -> b"):
            client.load_model("b", config=wrapper("b", "a"), files={"file:1/.keep": b""})
        with pytest.raises(InferenceServerException, match="cycle: c -> c"):
            client.load_model("c", config=wrapper("c", "c"), files={"file:1/.keep": b""})
        identity_infer(client, "a")
        identity_infer(client, "b")
        assert client.is_server_live()


def test_ensembles_nest_at_most_16_deep(tmp_path):
    repo = str(tmp_path)
    models.identity(repo, "m", "FP32")
    with Server(["--model-repository", repo, "--model-control-mode=explicit", "--load-model=*"]) as s:
        client = s.client()
        below = "m"
        for depth in range(1, 17):
            client.load_model(f"e{depth}", config=wrapper(f"e{depth}", below), files={"file:1/.keep": b""})
            below = f"e{depth}"
        # 16 deep runs (no stack runs out), a 17th is refused with the chain in the error.
        identity_infer(client, "e16")
        with pytest.raises(InferenceServerException, match=r"would nest 17 ensembles deep \(e17 -> e16 -> .* -> e1 -> m\), over the limit of 16"):
            client.load_model("e17", config=wrapper("e17", "e16"), files={"file:1/.keep": b""})
        # Nor from below: m (under all 16) reloaded as an ensemble itself.
        models.identity(repo, "n", "FP32")
        client.load_model("n")
        with pytest.raises(InferenceServerException, match="would nest 17 ensembles deep"):
            client.load_model("m", config=wrapper("m", "n"), files={"file:1/.keep": b""})
        identity_infer(client, "e16")


@pytest.mark.parametrize("change,error", [
    (lambda c: c.update(dynamic_batching={"priority_levels": 4000000000, "default_priority_level": 1}),
     "priority_levels 4000000000 is over the 1024 allowed"),
    (lambda c: c["sequence_batching"]["state"][0].update(dims=[100000, 100000]),
     "state 'ACC_IN': dims [100000, 100000] hold more than the 1073741824 bytes a state may"),
    (lambda c: [c["sequence_batching"].pop("direct"),
                c["sequence_batching"].update(oldest={"max_candidate_sequences": 2000000000})],
     "2000000000 sequence slots"),
    (lambda c: c.update(max_batch_size=1000000, instance_group=[{"count": 100, "kind": "KIND_CPU"}]),
     "100000000 sequence slots"),
    (lambda c: [c["sequence_batching"]["state"][0].update(dims=[1000, 1000]), c.update(max_batch_size=2000)],
     "2000 sequence slots x 4000000 bytes of state each"),
    (lambda c: c.update(parameters={"intra_op_thread_count": {"string_value": "1000000"}}),
     "parameter 'intra_op_thread_count' is '1000000'"),
    (lambda c: c.update(instance_group=[{"count": 1000000, "kind": "KIND_CPU"}]), "at most 128 are allowed"),
], ids=["priority levels", "state size", "candidate sequences", "direct slots", "all states", "threads", "instances"])
def test_hostile_config_values_are_refused_at_load(tmp_path, change, error):
    repo = str(tmp_path)
    models.accumulator(repo, "acc")
    # A state of any size: the model passes it through.
    f, i32, u64 = models.TensorProto.FLOAT, models.TensorProto.INT32, models.TensorProto.UINT64
    info = models.helper.make_tensor_value_info
    ins = [info("INPUT", f, ["b", 1]), info("ACC_IN", f, ["b", "n", "m"]), info("START", i32, ["b", 1]),
           info("CORRID", u64, ["b", 1])]
    outs = [info(n, f, shape) for n, shape in
            (("OUTPUT", ["b", 1]), ("ACC_OUT", ["b", "n", "m"]), ("CORR", ["b", 1]), ("START_OUT", ["b", 1]))]
    nodes = [models.helper.make_node("Identity", ["INPUT"], ["OUTPUT"]),
             models.helper.make_node("Identity", ["ACC_IN"], ["ACC_OUT"]),
             models.helper.make_node("Cast", ["CORRID"], ["CORR"], to=f),
             models.helper.make_node("Cast", ["START"], ["START_OUT"], to=f)]
    models.save(models.helper.make_graph(nodes, "acc", ins, outs), os.path.join(repo, "acc", "1", "model.onnx"))
    config_path = os.path.join(repo, "acc", "config.pbtxt")
    with open(config_path) as cf:
        text = cf.read().replace("dims: [ 1 ]\n            initial_state", "dims: [ 1, 1 ]\n            initial_state")
    models.write(config_path, text)
    with Server(["--model-repository", repo, "--model-control-mode=explicit", "--load-model=*"]) as s:
        client = s.client()
        config = client.get_model_config("acc")
        change(config)
        if "dynamic_batching" in config:
            config.pop("sequence_batching")
        before = peak_rss(s)
        with pytest.raises(InferenceServerException, match=re.escape(error)):
            client.load_model("acc", config=json.dumps(config))
        assert peak_rss(s) - before < 200 << 20
        # What served before still serves.
        assert client.is_server_live() and client.is_model_ready("acc")


SLOW_SEQUENCE = """
max_batch_size: 1
backend: "python"
input [ { name: "INPUT" data_type: TYPE_FP32 dims: [ 1 ] } ]
output [ { name: "OUTPUT" data_type: TYPE_FP32 dims: [ 1 ] } ]
sequence_batching {
  max_sequence_idle_microseconds: 60000000
  control_input [
    { name: "START" control [ { kind: CONTROL_SEQUENCE_START int32_false_true: [ 0, 1 ] } ] },
    { name: "CORRID" control [ { kind: CONTROL_SEQUENCE_CORRID data_type: TYPE_UINT32 } ] }
  ]
}
"""

# Sleeps on a negative input; echoes INPUT + the correlation id.
SLOW_SEQUENCE_PY = '''
import time
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        out = []
        for r in requests:
            x = pb_utils.get_input_tensor_by_name(r, "INPUT").as_numpy()
            corr = pb_utils.get_input_tensor_by_name(r, "CORRID").as_numpy().astype(np.float32)
            if (x < 0).any():
                time.sleep(2)
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT", x + corr.reshape(x.shape))]))
        return out
'''


@pytest.fixture(scope="module")
def sequences(tmp_path_factory):
    repo = str(tmp_path_factory.mktemp("sequences"))
    models.accumulator(repo, "one_slot", max_batch_size=1, idle_us=60000000)
    models.python_model(repo, "slow_sequence", SLOW_SEQUENCE_PY, SLOW_SEQUENCE)
    with Server(["--model-repository", repo]) as s:
        yield s


def sequence_step(client, model, seq, value, start=False, end=False, timeout=None):
    x = grpcclient.InferInput("INPUT", [1, 1], "FP32").set_data_from_numpy(np.array([[value]], dtype=np.float32))
    r = client.infer(model, [x], sequence_id=seq, sequence_start=start, sequence_end=end, client_timeout=timeout)
    return float(r.as_numpy("OUTPUT")[0, 0])


def test_a_start_that_gives_up_waiting_for_a_slot_leaves_the_line(sequences):
    client = sequences.grpc_client()
    assert sequence_step(client, "one_slot", 1, 1.0, start=True) == 1.0
    # The only slot is taken: this START waits, and its client gives up.
    with pytest.raises(InferenceServerException, match="Deadline"):
        sequence_step(client, "one_slot", 2, 1.0, start=True, timeout=0.5)
    assert sequence_step(client, "one_slot", 1, 1.0, end=True) == 2.0
    # Before, the abandoned START stayed first in line and no sequence could start again.
    assert sequence_step(client, "one_slot", 3, 5.0, start=True, end=True, timeout=20) == 5.0


def test_a_request_dropped_while_it_runs_frees_its_sequence(sequences):
    client = sequences.grpc_client()
    with pytest.raises(InferenceServerException, match="Deadline"):
        sequence_step(client, "slow_sequence", 7, -1.0, start=True, timeout=0.5)
    # The sequence is free again (before, busy for ever: this request hung).
    assert sequence_step(client, "slow_sequence", 7, 1.0, end=True, timeout=20) == 8.0


def test_a_server_side_deadline_answers_deadline_exceeded_and_frees_the_sequence(sequences):
    # Only the server keeps this deadline (the raw client waits 30 s): it answers as gRPC
    # servers do (before, tonic's "CANCELLED: Timeout expired" raced the client's own timer).
    req = service_pb2.ModelInferRequest(model_name="slow_sequence")
    req.parameters["sequence_id"].int64_param = 11
    req.parameters["sequence_start"].bool_param = True
    req.inputs.add(name="INPUT", datatype="FP32", shape=[1, 1])
    req.raw_input_contents.append(np.array([[-1.0]], dtype=np.float32).tobytes())
    status, message, _ = raw_grpc.call(sequences.grpc_port, "/inference.GRPCInferenceService/ModelInfer",
                                       req.SerializeToString(), [("grpc-timeout", "300m")])
    assert (status, message) == (4, "Deadline Exceeded")
    client = sequences.grpc_client()
    assert sequence_step(client, "slow_sequence", 11, 1.0, end=True, timeout=20) == 12.0


def test_sequence_ids_that_do_not_fit_the_corrid_input_are_refused(sequences):
    client = sequences.grpc_client()
    with pytest.raises(InferenceServerException, match=r"sequence ID 4294967301 .* does not fit its CORRID control input \(UINT32, at most 4294967295\)"):
        sequence_step(client, "slow_sequence", 2**32 + 5, 1.0, start=True, end=True)
    assert sequence_step(client, "slow_sequence", 5, 1.0, start=True, end=True, timeout=20) == 6.0


STUCK = """
max_batch_size: 8
backend: "python"
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ -1 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ -1 ] } ]
"""

# A negative first value holds the instance until the file named by the environment is gone.
STUCK_PY = '''
import os
import time
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        out = []
        for r in requests:
            x = pb_utils.get_input_tensor_by_name(r, "INPUT0").as_numpy()
            if x.flat[0] < 0:
                open(os.environ["FERRY_TEST_HOLD"] + ".running", "w").close()
            while x.flat[0] < 0 and os.path.exists(os.environ["FERRY_TEST_HOLD"]):
                time.sleep(0.02)
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", x)]))
        return out
'''


def metric(server, name, **labels):
    from test_metrics import parse, value
    return value(parse(server.metrics())[0], name, **labels)


def wait_for(condition, what, seconds=30):
    """Waits for a condition the server reaches on its own (not a timing check: the bound only
    keeps a broken server from hanging the suite)."""
    import time
    deadline = time.time() + seconds
    while not condition():
        assert time.time() < deadline, what
        time.sleep(0.05)


def binary_request(n_floats, first):
    import struct as st
    header = json.dumps({"inputs": [{"name": "INPUT0", "shape": [1, n_floats], "datatype": "FP32",
                                     "parameters": {"binary_data_size": 4 * n_floats}}]}).encode()
    data = st.pack("<f", first) + bytes(4 * (n_floats - 1))
    return header + data, {"Inference-Header-Content-Length": str(len(header)), "Content-Type": "application/octet-stream"}


def test_abandoned_queued_requests_leave_the_queue_with_their_bytes(tmp_path):
    import http.client
    import socket
    import threading
    repo = str(tmp_path / "repo")
    models.python_model(repo, "stuck", STUCK_PY, STUCK)
    hold = tmp_path / "hold"
    hold.write_text("")
    with Server(["--model-repository", repo], env={"FERRY_TEST_HOLD": str(hold)}) as s:
        held = threading.Thread(target=lambda: s.client().infer(
            "stuck", [httpclient.InferInput("INPUT0", [1, 16], "FP32").set_data_from_numpy(-np.ones((1, 16), np.float32))]))
        held.start()
        wait_for(lambda: os.path.exists(str(hold) + ".running"), "the model holds its instance")
        # Eight 4 MB requests queue behind the stuck one; their clients go away.
        conns = []
        for _ in range(8):
            body, headers = binary_request(1 << 20, 1.0)
            c = http.client.HTTPConnection("127.0.0.1", s.port, timeout=30)
            c.request("POST", "/v2/models/stuck/infer", body=body, headers=headers)
            conns.append(c)
        pending = lambda: metric(s, "nv_inference_pending_request_count", model="stuck", version="1")
        wait_for(lambda: pending() == 8, "the requests queue")
        assert metric(s, "ferry_inflight_request_bytes") >= 8 * 4 << 20
        # Seven clients close their sockets; the eighth only shuts its write side (a half-close),
        # which is taken as gone too (as nginx takes it): the server closes that connection unanswered.
        for c in conns[:7]:
            c.sock.shutdown(socket.SHUT_RDWR)
            c.close()
        half = conns[7].sock
        half.shutdown(socket.SHUT_WR)
        # The model is still stuck; the abandoned requests leave the queue, and their bytes with
        # them (before, they stayed queued with the counter at 0).
        wait_for(lambda: pending() == 0, "the abandoned requests leave the queue")
        half.settimeout(30)
        assert half.recv(65536) == b"", "a half-closed connection is closed without a reply"
        half.close()
        assert metric(s, "ferry_inflight_request_bytes") < 1 << 20
        hold.unlink()
        held.join(30)
        assert not held.is_alive()
        x = np.arange(4, dtype=np.float32).reshape(1, 4)
        out = s.client().infer("stuck", [httpclient.InferInput("INPUT0", [1, 4], "FP32").set_data_from_numpy(x)])
        np.testing.assert_array_equal(out.as_numpy("OUTPUT0"), x)


def texts_input(texts, shape):
    arr = np.array(texts, dtype=np.object_).reshape(shape)
    return httpclient.InferInput("TEXT", list(shape), "BYTES").set_data_from_numpy(arr)


def test_a_huge_text_is_cut_before_it_is_encoded():
    from conftest import EXAMPLES
    words = ["red", "green", "blue", "white", "black", "fire", "tomato", "grass", "leaf", "sky"]
    huge = " ".join(words[i % 10] for i in range(6_000_000))
    assert len(huge) > 30 << 20
    with Server(["--model-repository", EXAMPLES]) as s:
        client = s.client()
        short = client.infer("color_match_text", [texts_input([" ".join(words[:9])], (1, 1))]).as_numpy("input_ids")
        before = peak_rss(s)
        ids = client.infer("color_match_text", [texts_input([huge], (1, 1))]).as_numpy("input_ids")
        # The same 8 tokens as the text's first words give; before, encoding the whole text
        # first took 2 GB.
        np.testing.assert_array_equal(ids, short)
        assert peak_rss(s) - before < 300 << 20, (before, peak_rss(s))


TEXTS = """
backend: "ferry_tokenizer"
max_batch_size: 0
input [ { name: "TEXT" data_type: TYPE_STRING dims: [ -1 ] } ]
output [ { name: "input_ids" data_type: TYPE_INT64 dims: [ -1, -1 ] }, { name: "attention_mask" data_type: TYPE_INT64 dims: [ -1, -1 ] } ]
"""


@pytest.fixture(scope="module")
def tokenizer_repo(tmp_path_factory):
    import shutil
    from conftest import EXAMPLES
    repo = str(tmp_path_factory.mktemp("tokenizers"))
    os.makedirs(os.path.join(repo, "texts", "1"))
    shutil.copy(os.path.join(EXAMPLES, "color_match_text", "1", "tokenizer.json"), os.path.join(repo, "texts", "1"))
    models.write(os.path.join(repo, "texts", "config.pbtxt"), TEXTS)
    return repo


def test_padding_to_the_longest_is_bounded_per_request(tokenizer_repo):
    with Server(["--model-repository", tokenizer_repo]) as s:
        client = s.client()
        texts = [""] * 99_999 + [" ".join(["red"] * 2000)]
        before = peak_rss(s)
        with pytest.raises(InferenceServerException, match=r"100000 texts padded to 2000 tokens make 200000000 tokens, over the limit of 1048576 \(parameter 'max_tokens'\)"):
            client.infer("texts", [texts_input(texts, (100_000,))])
        assert peak_rss(s) - before < 300 << 20
        out = client.infer("texts", [texts_input(["red green", "blue"], (2,))])
        np.testing.assert_array_equal(out.as_numpy("input_ids"), [[2, 3], [4, 0]])
        np.testing.assert_array_equal(out.as_numpy("attention_mask"), [[1, 1], [1, 0]])


def test_what_encoding_costs_counts_against_the_admission_budget(tokenizer_repo):
    with Server(["--model-repository", tokenizer_repo, "--max-inflight-request-bytes=67108864"]) as s:
        client = s.client()
        # 1 MB of text on the wire, about 80 MB to encode: over a 64 MB budget.
        text = " ".join(["red"] * 262_144)
        with pytest.raises(InferenceServerException, match="--max-inflight-request-bytes") as e:
            client.infer("texts", [texts_input([text], (1,))])
        assert "503" in str(e.value) or "overloaded" in str(e.value)
        assert client.infer("texts", [texts_input(["red"], (1,))]).as_numpy("input_ids").tolist() == [[2]]
        # The charge is given back once the reply has gone out, which may be just after the
        # client has read it.
        wait_for(lambda: metric(s, "ferry_inflight_request_bytes") == 0, "the budget to be given back")


def test_an_image_step_charges_its_output_to_the_request(tmp_path):
    repo = str(tmp_path)
    image_model(repo, "raw", {"resize": "none"}, (3, -1, -1))
    with Server(["--model-repository", repo, "--max-inflight-request-bytes=16777216"]) as s:
        client = s.client()
        # A 7 KB PNG that decodes to 4 megapixels: 48 MB of FP32, over a 16 MB budget.
        with pytest.raises(InferenceServerException, match="--max-inflight-request-bytes"):
            infer_image(client, "raw", gray_png(2000, 2000))
        assert infer_image(client, "raw", gray_png(64, 48)).as_numpy("PIXELS").shape == (1, 3, 48, 64)
        assert metric(s, "ferry_inflight_request_bytes") == 0


def test_a_stream_whose_client_does_not_read_is_bounded(tmp_path):
    import http.client
    repo = str(tmp_path / "repo")
    models.flood(repo)
    sent = tmp_path / "sent"
    with Server(["--model-repository", repo], env={"FERRY_TEST_SENT": str(sent)}) as s:
        before = peak_rss(s)
        # 2,000 responses of 1 MB each asked for; the client reads nothing for now.
        conn = http.client.HTTPConnection("127.0.0.1", s.port, timeout=60)
        conn.request("POST", "/v2/models/flood/generate_stream", body=json.dumps({"COUNT": 2000}))
        wait_for(lambda: sent.exists() and sent.read_text() != "", "the model stops sending", seconds=120)
        # The model saw the request cancelled long before 2,000 (the server holds a bounded backlog).
        assert int(sent.read_text().split()[0]) < 1000
        assert peak_rss(s) - before < 400 << 20, (before, peak_rss(s))
        # Read now: what was held, then an error event that says why the stream ended.
        r = conn.getresponse()
        body = r.read().decode()
        events = [json.loads(line[5:]) for line in body.splitlines() if line.startswith("data:")]
        assert "error" in events[-1] and "fell behind" in events[-1]["error"], events[-1]
        assert 0 < len(events) - 1 < 1000
        conn.close()
        wait_for(lambda: metric(s, "ferry_inflight_request_bytes") == 0, "the backlog is given back")
        assert s.client().is_server_live()


def test_grpc_stream_replies_a_client_does_not_read_count_against_the_budget(tmp_path):
    """Replies made for a gRPC stream and waiting for its client are charged to admission until
    the connection takes them: a client that reads nothing makes the server refuse work it has
    no memory for, and its replies are given back when it leaves."""
    import tritonclient.utils.shared_memory as shm
    models.identity(str(tmp_path), "fast", "FP32", config=False)
    (tmp_path / "fast" / "config.pbtxt").write_text("""max_batch_size: 8
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ -1 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ -1 ] } ]
""")
    size = 256 << 10  # each reply: 256 KiB, from a request of a few dozen bytes (its input in shared memory)

    def request(i):
        req = service_pb2.ModelInferRequest(model_name="fast", id=str(i))
        t = req.inputs.add(name="INPUT0", datatype="FP32")
        t.shape.extend([1, size // 4])
        t.parameters["shared_memory_region"].string_param = "in"
        t.parameters["shared_memory_byte_size"].int64_param = size
        return req.SerializeToString()

    key = f"/ferry_held_{os.getpid()}"
    region = shm.create_shared_memory_region("in", key, size)
    try:
        shm.set_shared_memory_region(region, [np.ones((1, size // 4), np.float32)])
        with Server(["--model-repository", str(tmp_path), "--allow-client-shm", "--grpc-stream-max-inflight", "4",
                     "--max-inflight-request-bytes", str(3 << 20)]) as s:
            s.grpc_client().register_system_shared_memory("in", key, size)
            big = np.zeros((1, (2 << 20) // 4), np.float32)
            unread = raw_grpc.unread_stream(s.grpc_port, [request(i) for i in range(16)])
            try:
                # Up to 4 replies wait in the stream, 4 more on their way to the connection.
                wait_for(lambda: metric(s, "ferry_inflight_request_bytes") >= 4 * size, "the replies are held")
                # Held replies are bytes, not requests: once the stream's requests are answered,
                # in flight are the stream and this scrape.
                wait_for(lambda: metric(s, "ferry_inflight_requests") <= 2, "only the stream is in flight")
                inp = grpcclient.InferInput("INPUT0", list(big.shape), "FP32")
                inp.set_data_from_numpy(big)
                with pytest.raises(InferenceServerException) as err:
                    s.grpc_client().infer("fast", [inp])
                assert err.value.status() == "StatusCode.RESOURCE_EXHAUSTED", err.value
                assert "--max-inflight-request-bytes" in err.value.message()
            finally:
                unread.close()
            wait_for(lambda: metric(s, "ferry_inflight_request_bytes") == 0, "the held replies are given back")
            out = s.grpc_client().infer("fast", [inp]).as_numpy("OUTPUT0")
            np.testing.assert_array_equal(out, big)
    finally:
        shm.destroy_shared_memory_region(region)


def shm_identity_repo(tmp_path, size):
    """An identity model, and a request of it whose 4-byte-per-element input is `size` bytes
    of the system shared-memory region "in"."""
    models.identity(str(tmp_path), "fast", "FP32", config=False)
    (tmp_path / "fast" / "config.pbtxt").write_text("""max_batch_size: 8
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ -1 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ -1 ] } ]
""")
    req = service_pb2.ModelInferRequest(model_name="fast")
    t = req.inputs.add(name="INPUT0", datatype="FP32")
    t.shape.extend([1, size // 4])
    t.parameters["shared_memory_region"].string_param = "in"
    t.parameters["shared_memory_byte_size"].int64_param = size
    return req.SerializeToString()


@pytest.mark.parametrize("end", [False, True], ids=["open", "half-closed"])
def test_a_grpc_stream_whose_client_takes_no_reply_is_ended_after_the_stall_timeout(tmp_path, end):
    """A client that keeps its stream open (or has sent all it had) and reads nothing holds its
    replies for the stall timeout, then its stream is ended and the replies given back, while
    it is still connected."""
    import tritonclient.utils.shared_memory as shm
    size = 256 << 10
    message = shm_identity_repo(tmp_path, size)
    key = f"/ferry_stall_{os.getpid()}"
    region = shm.create_shared_memory_region("in", key, size)
    try:
        with Server(["--model-repository", str(tmp_path), "--allow-client-shm", "--grpc-stream-max-inflight", "4",
                     "--grpc-stream-stall-timeout-secs", "1"]) as s:
            s.grpc_client().register_system_shared_memory("in", key, size)
            # Half-closed, the 4 replies fit in the channel (tonic takes one or two): nothing
            # waits in the stream itself.
            unread = raw_grpc.unread_stream(s.grpc_port, [message] * (4 if end else 16), end=end)
            try:
                wait_for(lambda: metric(s, "ferry_inflight_request_bytes") >= (1 if end else 3) * size, "the replies are held")
                wait_for(lambda: metric(s, "ferry_inflight_request_bytes") == 0, "the stalled stream is ended")
                s.wait_log("took none of its replies")
                x = np.ones((1, 8), np.float32)
                inp = grpcclient.InferInput("INPUT0", list(x.shape), "FP32")
                inp.set_data_from_numpy(x)
                np.testing.assert_array_equal(s.grpc_client().infer("fast", [inp]).as_numpy("OUTPUT0"), x)
            finally:
                unread.close()
    finally:
        shm.destroy_shared_memory_region(region)


def test_a_grpc_stream_that_ended_is_no_longer_in_flight(tmp_path):
    """Once a stream's client has sent all it had and read every reply, the stream no longer
    counts as a request in flight (a stop does not wait for it), long before any stall timeout."""
    import queue
    shm_identity_repo(tmp_path, 16)
    with Server(["--model-repository", str(tmp_path)]) as s:
        baseline = metric(s, "ferry_inflight_requests")  # the scrape itself
        client, done = s.grpc_client(), queue.Queue()
        client.start_stream(callback=lambda result, error: done.put(error))
        x = np.ones((1, 64), np.float32)
        inp = grpcclient.InferInput("INPUT0", list(x.shape), "FP32")
        inp.set_data_from_numpy(x)
        for i in range(200):
            client.async_stream_infer("fast", [inp], request_id=str(i))
        # Ends its side at once: the last replies are still on their way when the server has
        # answered all (stop_stream returns once the stream has ended).
        client.stop_stream()
        assert [done.get(timeout=30) for _ in range(200)] == [None] * 200
        wait_for(lambda: metric(s, "ferry_inflight_requests") == baseline, "the stream is no longer in flight",
                 seconds=20)


def test_a_shared_memory_input_is_charged_before_it_is_read(tmp_path):
    """The bytes a request names in shared memory count against the admission budget before
    they are copied: naming more than the budget is refused without reading them."""
    import tritonclient.utils.shared_memory as shm
    size = 4 << 20
    message = service_pb2.ModelInferRequest.FromString(shm_identity_repo(tmp_path, size))
    key = f"/ferry_charged_{os.getpid()}"
    region = shm.create_shared_memory_region("in", key, size)
    try:
        with Server(["--model-repository", str(tmp_path), "--allow-client-shm",
                     "--max-inflight-request-bytes", str(1 << 20)]) as s:
            s.grpc_client().register_system_shared_memory("in", key, size)
            status, text, _ = raw_grpc.call(s.grpc_port, "/inference.GRPCInferenceService/ModelInfer",
                                            message.SerializeToString())
            assert status == 8 and "--max-inflight-request-bytes" in text, (status, text)  # RESOURCE_EXHAUSTED
            # A size the budget has room for is read and answered.
            message.inputs[0].shape[:] = [1, 1024]
            message.inputs[0].parameters["shared_memory_byte_size"].int64_param = 4096
            status, text, _ = raw_grpc.call(s.grpc_port, "/inference.GRPCInferenceService/ModelInfer",
                                            message.SerializeToString())
            assert status == 0, (status, text)
            assert metric(s, "ferry_inflight_request_bytes") == 0
    finally:
        shm.destroy_shared_memory_region(region)


# Sends, per request, the response that MODE names: one the config allows, then a bad one.
ROGUE = '''
import numpy as np
import triton_python_backend_utils as pb_utils

BAD = {
    "name": lambda: pb_utils.Tensor("SECRET", np.array([1], dtype=np.int32)),
    "datatype": lambda: pb_utils.Tensor("OUT", np.array([1.5], dtype=np.float32)),
    "shape": lambda: pb_utils.Tensor("OUT", np.zeros((3, 2), dtype=np.int32)),
}


class TritonPythonModel:
    def initialize(self, args):
        self.decoupled = pb_utils.using_decoupled_model_transaction_policy(__import__("json").loads(args["model_config"])) \\
            if hasattr(pb_utils, "using_decoupled_model_transaction_policy") else "decoupled" in args["model_name"]

    def execute(self, requests):
        out = []
        for request in requests:
            mode = pb_utils.get_input_tensor_by_name(request, "MODE").as_numpy().reshape(-1)[0].decode()
            good = pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array([7], dtype=np.int32)),
                                               pb_utils.Tensor("EXTRA", np.array([8], dtype=np.int32))])
            bad = pb_utils.InferenceResponse([BAD[mode]()])
            if self.decoupled:
                sender = request.get_response_sender()
                sender.send(good)
                sender.send(bad, flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            else:
                out.append(bad if mode != "good" else good)
        return None if self.decoupled else out
'''


def rogue_config(decoupled):
    policy = "model_transaction_policy { decoupled: true }" if decoupled else ""
    return f"""
backend: "python"
max_batch_size: 0
{policy}
input [ {{ name: "MODE" data_type: TYPE_STRING dims: [ 1 ] }} ]
output [ {{ name: "OUT" data_type: TYPE_INT32 dims: [ 1 ] }}, {{ name: "EXTRA" data_type: TYPE_INT32 dims: [ 1 ] }} ]
"""


@pytest.mark.parametrize("mode,error", [
    ("name", "sent an output 'SECRET', which its config does not have"),
    ("datatype", None),  # the model's own datatype passes through, as Triton's does
])
def test_decoupled_outputs_are_checked_as_batch_outputs_are(tmp_path, mode, error):
    repo = str(tmp_path)
    models.python_model(repo, "rogue_decoupled", ROGUE, rogue_config(True))
    models.python_model(repo, "rogue", ROGUE, rogue_config(False))
    with Server(["--model-repository", repo]) as s:
        client = s.grpc_client()
        import queue
        got = queue.Queue()
        client.start_stream(callback=lambda result, error: got.put((result, error)))
        mode_input = grpcclient.InferInput("MODE", [1], "BYTES").set_data_from_numpy(np.array([mode.encode()], dtype=np.object_))
        client.async_stream_infer("rogue_decoupled", [mode_input], outputs=[grpcclient.InferRequestedOutput("OUT")])
        first, e = got.get(timeout=30)
        assert e is None
        # Only the output asked for reaches the client.
        assert first.as_numpy("OUT").tolist() == [7] and first.as_numpy("EXTRA") is None
        second, e = got.get(timeout=30)
        if error is None:
            assert e is None and second.as_numpy("OUT").tolist() == [1.5], (second, e)
        else:
            assert e is not None and error in str(e), (second, e)
        client.stop_stream()
        if mode == "datatype":
            asked = [grpcclient.InferRequestedOutput("OUT")]
            assert client.infer("rogue", [mode_input], outputs=asked).as_numpy("OUT").tolist() == [1.5]


SLOW_LOAD = '''
import time
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        time.sleep(1.5)

    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.get_input_tensor_by_name(r, "INPUT0")]) for r in requests]
'''


def test_two_sagemaker_loads_of_one_name_do_not_both_proceed(tmp_path):
    import threading
    from platforms import request
    from test_sagemaker import port, sagemaker
    root = tmp_path / "models"
    for mid in ("a", "b"):
        models.python_model(str(root / mid), "model", SLOW_LOAD, STUCK.replace("max_batch_size: 8", "max_batch_size: 0"))
    env = {"SAGEMAKER_MULTI_MODEL": "true", "FERRY_SAGEMAKER_MODELS_ROOT": str(root)}
    with sagemaker(tmp_path / "unused", env=env) as s:
        statuses = []

        def load(mid):
            statuses.append(request(port(s), "POST", "/models", {"model_name": "same", "url": str(root / mid / "model")})[0])

        threads = [threading.Thread(target=load, args=(m,)) for m in ("a", "b")]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert sorted(statuses) == [200, 409], statuses
        assert request(port(s), "GET", "/models/same")[0] == 200


def rgba16_png(w, h):
    """A real w x h 16-bit RGBA PNG, all zero: 8 bytes a pixel once decoded."""
    chunk = lambda kind, data: struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    rows = zlib.compress(b"\0" * ((w * 8 + 1) * h), 9)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 16, 6, 0, 0, 0))
            + chunk(b"IDAT", rows) + chunk(b"IEND", b""))


def test_decoding_an_image_is_charged_before_it_is_decoded(tmp_path):
    repo = str(tmp_path)
    image_model(repo, "imagenet", {"preset": "imagenet"}, (3, 224, 224))
    with Server(["--model-repository", repo, "--max-inflight-request-bytes=67108864"]) as s:
        client = s.client()
        before = peak_rss(s)
        # 4,000 x 4,000 16-bit RGBA: 128 MB decoded from a 100 KB request, over a 64 MB budget.
        with pytest.raises(InferenceServerException, match="--max-inflight-request-bytes"):
            infer_image(client, "imagenet", rgba16_png(4000, 4000))
        assert peak_rss(s) - before < 64 << 20
        assert infer_image(client, "imagenet", rgba16_png(300, 200)).as_numpy("PIXELS").shape == (1, 3, 224, 224)
        assert metric(s, "ferry_inflight_request_bytes") == 0


def test_ids_of_length_zero_decode_to_empty_texts(tmp_path):
    import shutil
    from conftest import EXAMPLES
    os.makedirs(tmp_path / "dec" / "1")
    shutil.copy(os.path.join(EXAMPLES, "color_match_text", "1", "tokenizer.json"), tmp_path / "dec" / "1")
    models.write(str(tmp_path / "dec" / "config.pbtxt"), """
backend: "ferry_tokenizer"
max_batch_size: 0
parameters [ { key: "direction" value { string_value: "decode" } } ]
input [ { name: "IDS" data_type: TYPE_INT64 dims: [ -1, -1 ] } ]
output [ { name: "TEXT" data_type: TYPE_STRING dims: [ -1 ] } ]
""")
    with Server(["--model-repository", str(tmp_path), "--max-inflight-request-bytes=67108864"]) as s:
        client = s.client()
        ids = httpclient.InferInput("IDS", [5, 0], "INT64").set_data_from_numpy(np.zeros((5, 0), dtype=np.int64))
        assert client.infer("dec", [ids]).as_numpy("TEXT").tolist() == [b""] * 5
        # A billion empty texts from a request of no bytes: refused before they are made.
        import http.client
        conn = http.client.HTTPConnection("127.0.0.1", s.port, timeout=30)
        body = {"inputs": [{"name": "IDS", "shape": [1_000_000_000, 0], "datatype": "INT64", "data": []}]}
        conn.request("POST", "/v2/models/dec/infer", body=json.dumps(body))
        r = conn.getresponse()
        assert r.status == 503 and "--max-inflight-request-bytes" in r.read().decode()
        assert client.is_server_live()
