"""The sequence batcher through the real server: implicit state kept per sequence, control inputs,
several sequences interleaved, the errors Triton gives, idle release, a full set of slots queuing
new sequences, over HTTP, gRPC and the gRPC stream; Silero VAD streams audio with its recurrent
state kept by the server."""
import queue
import threading
import time

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

import models
from ferry_server import Server

LIBS = {"http": httpclient, "grpc": grpcclient}


def step(client, lib, value, seq, start=False, end=False, model="accumulator"):
    x = lib.InferInput("INPUT", [1, 1], "FP32").set_data_from_numpy(np.array([[value]], dtype=np.float32))
    r = client.infer(model, [x], sequence_id=seq, sequence_start=start, sequence_end=end)
    return float(r.as_numpy("OUTPUT")[0, 0]), float(r.as_numpy("CORR")[0, 0]), float(r.as_numpy("START_OUT")[0, 0])


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    repo = str(tmp_path_factory.mktemp("sequences"))
    models.accumulator(repo)
    models.accumulator(repo, "oldest", strategy="oldest { max_candidate_sequences: 4 max_queue_delay_microseconds: 2000 }")
    models.accumulator(repo, "one_slot", max_batch_size=1, idle_us=300000)
    with Server(["--model-repository", repo]) as s:
        yield s


@pytest.mark.parametrize("protocol", ["http", "grpc"])
@pytest.mark.parametrize("model", ["accumulator", "oldest"])
def test_state_is_kept_per_sequence_with_control_inputs(server, protocol, model):
    client = server.client() if protocol == "http" else server.grpc_client()
    lib = LIBS[protocol]
    a, b = 1000 + len(protocol), 2000 + len(model)
    assert step(client, lib, 1, a, start=True, model=model) == (1.0, a, 1.0)
    assert step(client, lib, 10, b, start=True, model=model) == (10.0, b, 1.0)
    assert step(client, lib, 2, a, model=model) == (3.0, a, 0.0)
    assert step(client, lib, 20, b, model=model) == (30.0, b, 0.0)
    assert step(client, lib, 3, a, end=True, model=model)[0] == 6.0
    assert step(client, lib, 30, b, end=True, model=model)[0] == 60.0
    # The id is free again: a new sequence under it starts from the initial state.
    assert step(client, lib, 5, a, start=True, end=True, model=model)[0] == 5.0


def test_concurrent_interleaved_sequences_keep_their_own_state(server):
    results, errors = {}, []

    def run(seq):
        client = httpclient.InferenceServerClient(server.url)
        total = 0.0
        try:
            for k in range(1, 11):
                got = step(client, httpclient, k, seq, start=k == 1, end=k == 10, model="oldest")[0]
                total += k
                assert got == total, (seq, k, got, total)
            results[seq] = total
        except Exception as e:  # noqa: BLE001 - collected and asserted below
            errors.append(repr(e))

    threads = [threading.Thread(target=run, args=(s,)) for s in range(500, 506)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and all(v == 55.0 for v in results.values()) and len(results) == 6


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_the_errors_triton_gives(server, protocol):
    client = server.client() if protocol == "http" else server.grpc_client()
    lib = LIBS[protocol]
    with pytest.raises(InferenceServerException, match="must specify the START flag on the first request"):
        step(client, lib, 1, 7777)
    step(client, lib, 1, 7778, start=True)
    with pytest.raises(InferenceServerException, match="already active"):
        step(client, lib, 1, 7778, start=True)
    step(client, lib, 1, 7778, end=True)
    with pytest.raises(InferenceServerException, match="non-zero or non-empty correlation ID"):
        x = lib.InferInput("INPUT", [1, 1], "FP32").set_data_from_numpy(np.ones((1, 1), dtype=np.float32))
        client.infer("accumulator", [x])
    with pytest.raises(InferenceServerException, match="is a string"):
        step(client, lib, 1, "seq-a", start=True)
    x = lib.InferInput("INPUT", [2, 1], "FP32").set_data_from_numpy(np.ones((2, 1), dtype=np.float32))
    with pytest.raises(InferenceServerException, match="batch-size 1"):
        client.infer("accumulator", [x], sequence_id=7779, sequence_start=True)


def test_an_idle_sequence_is_released(server):
    client = server.client()
    step(client, httpclient, 1, 4242, start=True, model="one_slot")
    time.sleep(0.8)
    with pytest.raises(InferenceServerException, match="START flag"):
        step(client, httpclient, 1, 4242, model="one_slot")


def test_new_sequences_wait_for_a_free_slot(server):
    client = server.client()
    step(client, httpclient, 1, 1, start=True, model="one_slot")
    done = queue.Queue()

    def second():
        other = httpclient.InferenceServerClient(server.url)
        done.put(step(other, httpclient, 100, 2, start=True, end=True, model="one_slot")[0])

    t = threading.Thread(target=second)
    t.start()
    time.sleep(0.1)
    assert done.empty(), "the second sequence waits: the only slot is taken"
    assert step(client, httpclient, 2, 1, end=True, model="one_slot")[0] == 3.0
    t.join(10)
    assert done.get_nowait() == 100.0


def test_sequences_on_the_grpc_stream(server):
    client = server.grpc_client()
    got = queue.Queue()
    client.start_stream(callback=lambda result, error: got.put((result, error)))
    for k, (start, end) in enumerate([(True, False), (False, False), (False, True)], start=1):
        x = grpcclient.InferInput("INPUT", [1, 1], "FP32").set_data_from_numpy(np.array([[k]], dtype=np.float32))
        client.async_stream_infer("accumulator", [x], sequence_id=9090, sequence_start=start, sequence_end=end)
        r, e = got.get(timeout=30)
        assert e is None, e
        assert float(r.as_numpy("OUTPUT")[0, 0]) == k * (k + 1) / 2
    client.stop_stream()


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_silero_vad_streams_with_implicit_state(fresh_repo, protocol):
    from test_scalars import reference, vad_chunks
    models.silero_vad(fresh_repo, config=models.SILERO_STATEFUL)
    with Server(["--model-repository", fresh_repo]) as s:
        client = s.client() if protocol == "http" else s.grpc_client()
        lib = LIBS[protocol]
        chunks = vad_chunks()
        probs = []
        for i, c in enumerate(chunks):
            ins = [lib.InferInput("input", list(c.shape), "FP32").set_data_from_numpy(c),
                   lib.InferInput("sr", [1], "INT64").set_data_from_numpy(np.array([16000], dtype=np.int64))]
            r = client.infer("silero_vad", ins, sequence_id=77, sequence_start=i == 0, sequence_end=i == len(chunks) - 1)
            probs.append(float(r.as_numpy("output")[0, 0]))
        np.testing.assert_allclose(probs, reference(chunks), rtol=1e-4, atol=1e-5)


def test_sequence_metrics(server):
    from test_metrics import parse, value
    step(server.client(), httpclient, 1, 31337, start=True)
    values, _ = parse(server.metrics())
    assert value(values, "ferry_sequences_active", model="accumulator", version="1") >= 1
    assert value(values, "ferry_sequence_slots", model="accumulator", version="1") == 8
    assert value(values, "ferry_sequence_slots", model="oldest", version="1") == 4
    step(server.client(), httpclient, 1, 31337, end=True)
