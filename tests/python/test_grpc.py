"""KServe v2 over gRPC with the official tritonclient.grpc: every RPC, unary and streaming."""
import queue
import time

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException

import models
from conftest import EXAMPLES


def infer(client, model, arrays, outputs=None, **kw):
    inputs = []
    for name, (datatype, arr) in arrays.items():
        i = grpcclient.InferInput(name, list(arr.shape), datatype)
        i.set_data_from_numpy(arr)
        inputs.append(i)
    requested = [grpcclient.InferRequestedOutput(o) for o in outputs] if outputs else None
    return client.infer(model, inputs, outputs=requested, **kw)


@pytest.mark.parametrize("datatype", list(models.DATATYPES))
def test_every_datatype_round_trips(server, datatype):
    arr = models.sample(datatype, (2, 7))
    out = infer(server.grpc_client(), f"identity_{datatype.lower()}", {"INPUT0": (datatype, arr)}).as_numpy("OUTPUT0")
    assert out.shape == arr.shape and out.dtype == arr.dtype
    np.testing.assert_array_equal(out, arr)


def test_examples_and_unbatched(server):
    client = server.grpc_client()
    a = models.RNG.integers(-50, 50, size=(3, 16), dtype=np.int32)
    r = infer(client, "simple", {"INPUT0": ("INT32", a), "INPUT1": ("INT32", a)})
    np.testing.assert_array_equal(r.as_numpy("OUTPUT0"), 2 * a)
    np.testing.assert_array_equal(r.as_numpy("OUTPUT1"), 0 * a)
    assert r.get_response().model_version == "1"
    x = models.sample("FP32", (9,))
    np.testing.assert_array_equal(infer(client, "identity_fp32_nobatch", {"INPUT0": ("FP32", x)}).as_numpy("OUTPUT0"), x)


def test_typed_contents_from_a_generic_kserve_client(server):
    """tritonclient always sends raw_input_contents; other KServe clients use typed contents."""
    stub = service_pb2_grpc.GRPCInferenceServiceStub(grpc.insecure_channel(server.grpc_url))
    req = service_pb2.ModelInferRequest(model_name="simple", id="typed")
    for name in ("INPUT0", "INPUT1"):
        t = req.inputs.add(name=name, datatype="INT32", shape=[1, 16])
        t.contents.int_contents.extend(range(16))
    resp = stub.ModelInfer(req)
    assert resp.id == "typed"
    assert len(resp.raw_output_contents) == len(resp.outputs) == 2
    assert list(np.frombuffer(resp.raw_output_contents[0], dtype=np.int32)) == [2 * i for i in range(16)]
    req = service_pb2.ModelInferRequest(model_name="identity_bytes")
    t = req.inputs.add(name="INPUT0", datatype="BYTES", shape=[1, 2])
    t.contents.bytes_contents.extend([b"ab", b"c"])
    resp = stub.ModelInfer(req)
    assert resp.raw_output_contents[0] == b"\x02\x00\x00\x00ab\x01\x00\x00\x00c"
    req = service_pb2.ModelInferRequest(model_name="simple")
    for name in ("INPUT0", "INPUT1"):
        t = req.inputs.add(name=name, datatype="INT32", shape=[1, 16])
        t.contents.fp32_contents.extend([1.0] * 16)
    with pytest.raises(grpc.RpcError) as err:
        stub.ModelInfer(req)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "unexpected explicit tensor data for input tensor 'INPUT0'" in err.value.details()


def test_streaming_many_requests_in_flight(server):
    client = server.grpc_client()
    replies = queue.Queue()
    client.start_stream(callback=lambda result, error: replies.put((result, error)))
    sent = {}
    for k in range(64):
        a = np.full((1, 16), k, dtype=np.int32)
        sent[str(k)] = a
        inputs = [grpcclient.InferInput(n, [1, 16], "INT32").set_data_from_numpy(a) for n in ("INPUT0", "INPUT1")]
        client.async_stream_infer("simple", inputs, request_id=str(k))
    bad = [grpcclient.InferInput("INPUT0", [1, 16], "INT32").set_data_from_numpy(sent["0"])]
    client.async_stream_infer("simple", bad, request_id="missing-input")
    seen, errors = set(), []
    for _ in range(65):
        result, error = replies.get(timeout=30)
        if error is not None:
            errors.append(str(error))
            continue
        resp = result.get_response()
        assert resp.parameters["triton_final_response"].bool_param is True
        np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), 2 * sent[resp.id])
        seen.add(resp.id)
    client.stop_stream()
    assert seen == set(sent)
    assert len(errors) == 1 and "missing required input(s) ['INPUT1']" in errors[0]


def test_a_batchs_replies_leave_a_stream_in_request_order(tmp_path):
    """Requests of one stream that run as one batch are answered in the order they were sent, as
    Triton's are (its lifecycle test_batch_error reads a stream's replies by position)."""
    from ferry_server import Server
    models.identity(str(tmp_path), "batched", "FP32", config=False)
    with open(tmp_path / "batched" / "config.pbtxt", "w") as f:
        f.write("""max_batch_size: 8
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ -1 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ -1 ] } ]
dynamic_batching { preferred_batch_size: [ 4 ] max_queue_delay_microseconds: 10000000 }
instance_group [ { count: 1 kind: KIND_CPU } ]
""")
    with Server(["--model-repository", str(tmp_path)]) as s:
        client = s.grpc_client()
        replies = queue.Queue()
        client.start_stream(callback=lambda result, error: replies.put((result, error)))
        rounds = 25
        for r in range(rounds):
            for k in range(4):
                x = np.full((1, 3), 4 * r + k, dtype=np.float32)
                client.async_stream_infer("batched", [grpcclient.InferInput("INPUT0", [1, 3], "FP32").set_data_from_numpy(x)],
                                          request_id=str(4 * r + k))
            order = []
            for _ in range(4):
                result, error = replies.get(timeout=30)
                assert error is None, error
                order.append(int(result.get_response().id))
                assert result.as_numpy("OUTPUT0")[0, 0] == order[-1]
            assert order == [4 * r + k for k in range(4)], (r, order)
        client.stop_stream()
        stats = client.get_inference_statistics("batched").model_stats[0]
        # Every round ran as one batch of four (the 10 s delay never ran out).
        assert (stats.inference_count, stats.execution_count) == (4 * rounds, rounds)
        # 400 at once on one stream: the one instance runs their batches one after the other, and
        # the replies leave in the order sent (tokio's budget once sent some late).
        replies = queue.Queue()
        client.start_stream(callback=lambda result, error: replies.put((result, error)))
        for k in range(400):
            x = np.full((1, 3), k, dtype=np.float32)
            client.async_stream_infer("batched", [grpcclient.InferInput("INPUT0", [1, 3], "FP32").set_data_from_numpy(x)],
                                      request_id=str(k))
        order = []
        for _ in range(400):
            result, error = replies.get(timeout=60)
            assert error is None, error
            order.append(int(result.get_response().id))
        client.stop_stream()
        assert order == list(range(400)), [(i, k) for i, k in enumerate(order) if i != k][:8]


def test_a_stream_nobody_reads_holds_no_other_clients_work(tmp_path):
    """A client that stops reading its stream keeps its replies waiting, and nothing else: its
    requests still finish in the server. Here its request leads a response-cache miss; another
    client's identical request waits for that request to fill the cache, and is answered."""
    import raw_grpc
    from ferry_server import Server
    for name, extra in (("cached", "dynamic_batching { max_queue_delay_microseconds: 300000 }\nresponse_cache { enable: true }"),
                        ("fast", "")):
        models.identity(str(tmp_path), name, "FP32", config=False)
        with open(tmp_path / name / "config.pbtxt", "w") as f:
            f.write(f"""max_batch_size: 8
input [ {{ name: "INPUT0" data_type: TYPE_FP32 dims: [ -1 ] }} ]
output [ {{ name: "OUTPUT0" data_type: TYPE_FP32 dims: [ -1 ] }} ]
{extra}
""")

    def request(model, x, rid):
        req = service_pb2.ModelInferRequest(model_name=model, id=rid)
        t = req.inputs.add(name="INPUT0", datatype="FP32")
        t.shape.extend(x.shape)
        req.raw_input_contents.append(x.tobytes())
        return req.SerializeToString()

    x = np.arange(8, dtype=np.float32).reshape(1, 8)
    fillers = [request("fast", np.zeros((1, 1024), np.float32), f"f{i}") for i in range(12)]
    with Server(["--model-repository", str(tmp_path), "--grpc-stream-max-inflight", "4",
                 "--cache-config", "local,size=1048576"]) as s:
        unread = raw_grpc.unread_stream(s.grpc_port, [request("cached", x, "A"), *fillers])
        try:
            time.sleep(1.0)  # A's request has run (300 ms in the batcher); its replies wait
            r = infer(s.grpc_client(), "cached", {"INPUT0": ("FP32", x)}, client_timeout=10)
            np.testing.assert_array_equal(r.as_numpy("OUTPUT0"), x)
            stats = s.grpc_client().get_inference_statistics("cached").model_stats[0].inference_stats
            assert (stats.cache_miss.count, stats.cache_hit.count) == (1, 1), stats
        finally:
            unread.close()


def test_errors_carry_grpc_codes(server):
    client = server.grpc_client()
    a = np.zeros((1, 16), dtype=np.int32)
    with pytest.raises(InferenceServerException) as err:
        infer(client, "nope", {"INPUT0": ("INT32", a)})
    assert err.value.status() == "StatusCode.NOT_FOUND"
    with pytest.raises(InferenceServerException) as err:
        infer(client, "simple", {"INPUT0": ("INT32", a), "INPUT1": ("INT32", a[:, :8])})
    assert err.value.status() == "StatusCode.INVALID_ARGUMENT" and "Expected [-1,16], got [1,8]" in err.value.message()
    with pytest.raises(InferenceServerException) as err:
        client.is_model_ready("simple", "9")
    assert err.value.status() == "StatusCode.NOT_FOUND"
    with pytest.raises(InferenceServerException) as err:
        client.infer("simple", [], model_version="-1")
    assert err.value.status() == "StatusCode.INVALID_ARGUMENT"


def test_metadata_config_statistics(server):
    client = server.grpc_client()
    assert client.is_server_live() and client.is_server_ready() and client.is_model_ready("simple")
    meta = client.get_server_metadata(as_json=True)
    assert "statistics" in meta["extensions"] and "model_repository" in meta["extensions"]
    m = client.get_model_metadata("simple", as_json=True)
    assert m["inputs"][0]["shape"] == ["-1", "16"] and m["platform"] == "onnxruntime_onnx"
    cfg = client.get_model_config("simple", as_json=True)["config"]
    assert cfg["max_batch_size"] == 8 and cfg["input"][0]["data_type"] == "TYPE_INT32"
    before = client.get_inference_statistics("identity_int64").model_stats[0]
    infer(client, "identity_int64", {"INPUT0": ("INT64", models.sample("INT64", (4, 2)))})
    after = client.get_inference_statistics("identity_int64").model_stats[0]
    assert after.inference_count == before.inference_count + 4
    assert after.inference_stats.success.count == before.inference_stats.success.count + 1
    assert len(client.get_inference_statistics().model_stats) >= 10


def test_classification_and_compression(server):
    client = server.grpc_client()
    x = np.array([[0.1, 3.0, 2.0, -1.0]], dtype=np.float32)
    i = grpcclient.InferInput("INPUT0", [1, 4], "FP32").set_data_from_numpy(x)
    r = client.infer("identity_fp32", [i], outputs=[grpcclient.InferRequestedOutput("OUTPUT0", class_count=2)],
                     compression_algorithm="gzip")
    assert [v.decode() for v in r.as_numpy("OUTPUT0").flatten()] == ["3.000000:1", "2.000000:2"]


def test_health_service(server):
    channel = grpc.insecure_channel(server.grpc_url)
    check = channel.unary_unary("/grpc.health.v1.Health/Check", request_serializer=lambda m: m,
                                response_deserializer=lambda b: b)
    assert check(b"") == b"\x08\x01"  # status: SERVING


def test_large_messages_over_four_mebibytes(server):
    big = models.sample("FP32", (1, 2_000_000))
    out = infer(server.grpc_client(), "identity_fp32", {"INPUT0": ("FP32", big)}).as_numpy("OUTPUT0")
    np.testing.assert_array_equal(out, big)
