"""Cancellation in the sequence batcher as Triton does it (its L0_request_cancellation cases):
requests of a sequence whose START waits for a slot wait in the backlog with it, and cancelling
any waiting request of a sequence cancels the whole sequence (every request of it still waiting
ends CANCELLED, the sequence is released), counted as CANCELED failures."""
import time

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

import models
from ferry_server import Server
from test_bounds import metric, wait_for

# Triton's identity backend, one slot, each execution 4 s long.
SLOW_SEQUENCE = """
backend: "identity"
max_batch_size: 1
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ -1 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ -1 ] } ]
instance_group [ { count: 1 kind: KIND_CPU } ]
sequence_batching { %s max_sequence_idle_microseconds: 60000000 }
parameters [ { key: "execute_delay_ms" value: { string_value: "4000" } } ]
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    repo = str(tmp_path_factory.mktemp("cancel"))
    models.write(f"{repo}/direct/config.pbtxt", SLOW_SEQUENCE % "direct { }")
    models.write(f"{repo}/oldest/config.pbtxt", SLOW_SEQUENCE % "oldest { max_candidate_sequences: 1 }")
    for m in ("direct", "oldest"):
        models.write(f"{repo}/{m}/1/.keep", "")
    with Server(["--model-repository", repo]) as s:
        yield s


def inputs():
    x = grpcclient.InferInput("INPUT0", [1, 4], "FP32")
    return [x.set_data_from_numpy(np.ones([1, 4], np.float32))]


def send(client, model, seq, start=False, end=False):
    got = {}
    future = client.async_infer(model, inputs(), lambda result, error: got.update(result=result, error=error),
                                sequence_id=seq, sequence_start=start, sequence_end=end)
    return future, got


def cancelled(model, server):
    return metric(server, "nv_inference_request_failure", model=model, reason="CANCELED", version="1") or 0


@pytest.mark.parametrize("model", ["direct", "oldest"])
def test_cancelling_a_backlogged_request_cancels_its_sequence(server, model):
    client = server.grpc_client()
    before = cancelled(model, server)
    holder, held = send(client, model, 100, start=True, end=True)
    wait_for(lambda: metric(server, "ferry_sequences_active", model=model, version="1") == 1, "the slot is taken")
    start, first = send(client, model, 101, start=True)
    wait_for(lambda: metric(server, "ferry_sequences_waiting", model=model, version="1") == 1, "the START waits")
    _, second = send(client, model, 101, end=True)
    time.sleep(1)
    # Before, the second was answered at once: "must specify the START flag".
    assert not first and not second, (first, second)
    start.cancel()
    wait_for(lambda: "error" in second, "the rest of the sequence is answered")
    assert second["error"].status() == "StatusCode.CANCELLED", second["error"]
    wait_for(lambda: "result" in held, "the running sequence ends normally")
    assert held["error"] is None
    wait_for(lambda: cancelled(model, server) == before + 2, "both count as cancelled")
    assert metric(server, "ferry_sequences_waiting", model=model, version="1") == 0


@pytest.mark.parametrize("model", ["direct", "oldest"])
def test_cancelling_a_queued_request_cancels_its_sequence(server, model):
    client = server.grpc_client()
    wait_for(lambda: metric(server, "ferry_sequences_active", model=model, version="1") == 0, "a free slot")
    before = cancelled(model, server)
    _, running = send(client, model, 200, start=True)
    wait_for(lambda: metric(server, "ferry_sequences_active", model=model, version="1") == 1, "the sequence runs")
    queued, first = send(client, model, 200)
    _, second = send(client, model, 200)
    time.sleep(1)
    assert not first and not second, (first, second)
    queued.cancel()
    # Before, the second ran after the first request (4 s later) as if nothing happened.
    wait_for(lambda: "error" in second, "the rest of the sequence is answered")
    assert second["error"].status() == "StatusCode.CANCELLED", second["error"]
    wait_for(lambda: "result" in running, "the running request ends normally")
    assert running["error"] is None
    # The sequence is released: its slot is free, and it has to start again.
    wait_for(lambda: metric(server, "ferry_sequences_active", model=model, version="1") == 0, "released")
    wait_for(lambda: cancelled(model, server) == before + 2, "both count as cancelled")
