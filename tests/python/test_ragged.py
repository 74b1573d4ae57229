"""Ragged batching as Triton's L0_batch_input checks it: requests of different lengths batch into
one flat tensor with no padding, the batch inputs (`batch_input`) tell the model where each
request's elements are, and `batch_output` scatters a flat output back by each request's input
shape. Four requests are sent at once to a model whose batch is 4 and whose queue delay is far
longer than sending takes, so they always form one batch (no timing decides it)."""
import os
import queue
from functools import partial

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from onnx import TensorProto, helper

import models
from ferry_server import Server

F = TensorProto.FLOAT
ONE_BATCH = "dynamic_batching { max_queue_delay_microseconds: 30000000 }"


def ragged_model(repo, name, kinds, dims="-1"):
    """Triton's test model: each output is a [batch, n] outer product of ones (one row per request,
    from BATCH_AND_SIZE_INPUT's length) and one of its three 1-D inputs, so every request gets the
    whole of that input back."""
    vi = helper.make_tensor_value_info
    nodes = [
        helper.make_node("Constant", [], ["row"], value=helper.make_tensor("r", TensorProto.INT64, [2], [1, -1])),
        helper.make_node("Constant", [], ["col"], value=helper.make_tensor("c", TensorProto.INT64, [2], [-1, 1])),
        helper.make_node("Div", ["BATCH_AND_SIZE_INPUT", "BATCH_AND_SIZE_INPUT"], ["ones"]),
        helper.make_node("Reshape", ["ones", "col"], ["expander"]),
    ]
    for src, out in [("RAGGED_INPUT", "RAGGED_OUTPUT"), ("BATCH_AND_SIZE_INPUT", "BATCH_AND_SIZE_OUTPUT"),
                     ("BATCH_INPUT", "BATCH_OUTPUT")]:
        nodes.append(helper.make_node("Reshape", [src, "row"], [src + "_row"]))
        nodes.append(helper.make_node("MatMul", ["expander", src + "_row"], [out]))
    inputs = [vi(n, F, [f"n{i}"]) for i, n in enumerate(["RAGGED_INPUT", "BATCH_AND_SIZE_INPUT", "BATCH_INPUT"])]
    outputs = [vi(n, F, ["b", f"m{i}"]) for i, n in
               enumerate(["RAGGED_OUTPUT", "BATCH_AND_SIZE_OUTPUT", "BATCH_OUTPUT"])]
    models.save(helper.make_graph(nodes, name, inputs, outputs), os.path.join(repo, name, "1", "model.onnx"))
    first, second = kinds
    models.write(os.path.join(repo, name, "config.pbtxt"), f"""
max_batch_size: 4
input [ {{ name: "RAGGED_INPUT" data_type: TYPE_FP32 dims: [ {dims} ] allow_ragged_batch: true }} ]
output [ {{ name: "RAGGED_OUTPUT" data_type: TYPE_FP32 dims: [ -1 ] }},
         {{ name: "BATCH_AND_SIZE_OUTPUT" data_type: TYPE_FP32 dims: [ -1 ] }},
         {{ name: "BATCH_OUTPUT" data_type: TYPE_FP32 dims: [ -1 ] }} ]
batch_input [
  {{ kind: {first} target_name: "BATCH_AND_SIZE_INPUT" data_type: TYPE_FP32 source_input: "RAGGED_INPUT" }},
  {{ kind: {second} target_name: "BATCH_INPUT" data_type: TYPE_FP32 source_input: "RAGGED_INPUT" }}
]
{ONE_BATCH}
""")


def item_shape_model(repo, name="batch_item"):
    """BATCH_OUTPUT is BATCH_INPUT (BATCH_ITEM_SHAPE, one row per batch item) unchanged."""
    vi = helper.make_tensor_value_info
    graph = helper.make_graph([helper.make_node("Identity", ["BATCH_INPUT"], ["BATCH_OUTPUT"])], name,
                              [vi("RAGGED_INPUT", F, ["n"]), vi("BATCH_INPUT", F, ["b", 2])],
                              [vi("BATCH_OUTPUT", F, ["b", 2])])
    models.save(graph, os.path.join(repo, name, "1", "model.onnx"))
    models.write(os.path.join(repo, name, "config.pbtxt"), f"""
max_batch_size: 4
input [ {{ name: "RAGGED_INPUT" data_type: TYPE_FP32 dims: [ -1, -1 ] allow_ragged_batch: true }} ]
output [ {{ name: "BATCH_OUTPUT" data_type: TYPE_FP32 dims: [ 2 ] }} ]
batch_input [ {{ kind: BATCH_ITEM_SHAPE target_name: "BATCH_INPUT" data_type: TYPE_FP32 source_input: "RAGGED_INPUT" }} ]
{ONE_BATCH}
""")


def ragged_io_model(repo, name="ragged_io"):
    """A 1-D identity whose flat output goes back to each request in its own input's shape."""
    models.identity(repo, name, "FP32", batched=False, config=False)
    models.write(os.path.join(repo, name, "config.pbtxt"), f"""
max_batch_size: 4
input [ {{ name: "INPUT0" data_type: TYPE_FP32 dims: [ -1 ] allow_ragged_batch: true }} ]
output [ {{ name: "OUTPUT0" data_type: TYPE_FP32 dims: [ -1 ] }} ]
batch_output [ {{ target_name: "OUTPUT0" kind: BATCH_SCATTER_WITH_INPUT_SHAPE source_input: "INPUT0" }} ]
{ONE_BATCH}
""")


PYTHON_COUNTS = '''
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        out = []
        for r in requests:
            acc = pb_utils.get_input_tensor_by_name(r, "ENDS").as_numpy()
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", acc.astype(np.int32))]))
        return out
'''


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    repo = str(tmp_path_factory.mktemp("ragged"))
    ragged_model(repo, "ragged_element_count_acc_zero",
                 ("BATCH_ELEMENT_COUNT", "BATCH_ACCUMULATED_ELEMENT_COUNT_WITH_ZERO"))
    ragged_model(repo, "ragged_acc_shape", ("BATCH_ACCUMULATED_ELEMENT_COUNT", "BATCH_MAX_ELEMENT_COUNT_AS_SHAPE"))
    ragged_model(repo, "batch_item_flatten", ("BATCH_ACCUMULATED_ELEMENT_COUNT", "BATCH_ITEM_SHAPE_FLATTEN"), "-1, -1")
    item_shape_model(repo)
    ragged_io_model(repo)
    models.python_model(repo, "py_counts", PYTHON_COUNTS, """
backend: "python"
max_batch_size: 4
input [ { name: "IN" data_type: TYPE_FP32 dims: [ -1 ] allow_ragged_batch: true } ]
output [ { name: "OUT" data_type: TYPE_INT32 dims: [ -1 ] } ]
batch_input [ { kind: BATCH_ACCUMULATED_ELEMENT_COUNT_WITH_ZERO target_name: "ENDS" data_type: TYPE_INT64
                source_input: "IN" } ]
""")
    with Server(["--model-repository", repo]) as s:
        yield s


def send_together(s, model, shapes, output, name="RAGGED_INPUT"):
    """One request per shape, filled with its first dim, all in flight at once on one stream;
    the results by request."""
    client = grpcclient.InferenceServerClient(s.grpc_url)
    got = queue.Queue()
    client.start_stream(callback=partial(lambda q, result, error: q.put((result, error)), got))
    try:
        for i, shape in enumerate(shapes):
            x = grpcclient.InferInput(name, shape, "FP32")
            x.set_data_from_numpy(np.full(shape, shape[1] if len(shape) == 2 else shape[0], np.float32))
            client.async_stream_infer(model, [x], request_id=str(i),
                                      outputs=[grpcclient.InferRequestedOutput(output)])
        results = {}
        for _ in shapes:
            result, error = got.get(timeout=60)
            assert error is None, error.message()
            results[int(result.get_response().id)] = result.as_numpy(output)
        return [results[i] for i in range(len(shapes))]
    finally:
        client.stop_stream()
        client.close()


RAGGED = [[1, 2], [1, 4], [1, 1], [1, 3]]


def test_ragged_input_is_one_flat_tensor_of_every_request(server):
    want = np.asarray([[2] * 2 + [4] * 4 + [1] + [3] * 3], np.float32)
    for got in send_together(server, "ragged_acc_shape", RAGGED, "RAGGED_OUTPUT"):
        np.testing.assert_array_equal(got, want)


def test_element_counts(server):
    for got in send_together(server, "ragged_element_count_acc_zero", RAGGED, "BATCH_AND_SIZE_OUTPUT"):
        np.testing.assert_array_equal(got, [[2, 4, 1, 3]])
    for got in send_together(server, "ragged_acc_shape", RAGGED, "BATCH_AND_SIZE_OUTPUT"):
        np.testing.assert_array_equal(got, [[2, 6, 7, 10]])
    for got in send_together(server, "ragged_element_count_acc_zero", RAGGED, "BATCH_OUTPUT"):
        np.testing.assert_array_equal(got, [[0, 2, 6, 7, 10]])


def test_max_element_count_as_shape(server):
    for got in send_together(server, "ragged_acc_shape", RAGGED, "BATCH_OUTPUT"):
        assert got.shape == (1, 4)


def test_item_shapes(server):
    flat = send_together(server, "batch_item_flatten", [[1, 4, 1], [1, 1, 2], [1, 1, 2], [1, 2, 2]], "BATCH_OUTPUT")
    for got in flat:
        np.testing.assert_array_equal(got, [[4, 1, 1, 2, 1, 2, 2, 2]])
    # Three requests, four batch items: the batch is complete at 4 rows.
    items = send_together(server, "batch_item", [[2, 1, 2], [1, 1, 2], [1, 2, 2]], "BATCH_OUTPUT")
    np.testing.assert_array_equal(items[0], [[1, 2], [1, 2]])
    np.testing.assert_array_equal(items[1], [[1, 2]])
    np.testing.assert_array_equal(items[2], [[2, 2]])


def test_batch_output_scatters_by_each_requests_input_shape(server):
    got = send_together(server, "ragged_io", [[1, 2], [1, 4], [1, 1], [1, 3]], "OUTPUT0", name="INPUT0")
    for out, n in zip(got, [2, 4, 1, 3]):
        np.testing.assert_array_equal(out, np.full([1, n], n, np.float32))


def test_a_python_model_gets_the_batch_inputs_of_its_own_request(server):
    client = httpclient.InferenceServerClient(server.url)
    x = httpclient.InferInput("IN", [1, 5], "FP32")
    x.set_data_from_numpy(np.zeros([1, 5], np.float32))
    np.testing.assert_array_equal(client.infer("py_counts", [x]).as_numpy("OUT"), [0, 5])
    assert client.is_server_live()


BAD = {
    "less_source": ('batch_input [ { kind: BATCH_ELEMENT_COUNT target_name: "B" data_type: TYPE_FP32 } ]',
                    "batch input kind 'BATCH_ELEMENT_COUNT' expects 1 source input, got 0"),
    "many_source": ('batch_input [ { kind: BATCH_MAX_ELEMENT_COUNT_AS_SHAPE target_name: "B" data_type: TYPE_FP32 '
                    'source_input: ["INPUT0", "INPUT0"] } ]',
                    "batch input kind 'BATCH_MAX_ELEMENT_COUNT_AS_SHAPE' expects 1 source input, got 2"),
    "unknown_source": ('batch_input [ { kind: BATCH_ELEMENT_COUNT target_name: "B" data_type: TYPE_FP32 '
                       'source_input: "NOPE" } ]', "unknown source input name 'NOPE'"),
    "out_less_source": ('batch_output [ { target_name: "OUTPUT0" kind: BATCH_SCATTER_WITH_INPUT_SHAPE } ]',
                        "batch output kind 'BATCH_SCATTER_WITH_INPUT_SHAPE' expects 1 source input, got 0"),
    "out_unknown_target": ('batch_output [ { target_name: "NOPE" kind: BATCH_SCATTER_WITH_INPUT_SHAPE '
                           'source_input: "INPUT0" } ]', "unknown target output name 'NOPE'"),
    "out_twice": ('batch_output [ { target_name: ["OUTPUT0", "OUTPUT0"] kind: BATCH_SCATTER_WITH_INPUT_SHAPE '
                  'source_input: "INPUT0" } ]', "target output name 'OUTPUT0' can only be specified once"),
}


def test_bad_batch_io_configs_fail_their_load_with_tritons_words(tmp_path):
    repo = str(tmp_path)
    for name, (extra, _) in BAD.items():
        models.identity(repo, name, "FP32", config=False)
        models.write(os.path.join(repo, name, "config.pbtxt"), f"""
max_batch_size: 8
input [ {{ name: "INPUT0" data_type: TYPE_FP32 dims: [ -1 ] }} ]
output [ {{ name: "OUTPUT0" data_type: TYPE_FP32 dims: [ -1 ] }} ]
{extra}
""")
    models.identity(repo, "fine", "FP32")
    with Server(["--model-repository", repo, "--exit-on-error=false", "--strict-readiness=false"]) as s:
        index = {m["name"]: m for m in s.client().get_model_repository_index()}
        for name, (_, reason) in BAD.items():
            assert index[name]["state"] == "UNAVAILABLE", index[name]
            assert reason in index[name]["reason"], (name, index[name])
        assert index["fine"]["state"] == "READY"
