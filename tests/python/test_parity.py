"""Protocol details real clients hit, checked side by side with Triton's behaviour: large model
uploads through the load API, header forwarding, Python models found by model.py, unsupported
platforms named, an output asked for twice, flags refused at start-up, and the memory each version
holds in the statistics."""
import json
import os
import subprocess

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

import models
from ferry_server import BINARY, Server

PARAMS = '''
import json
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor(
            "PARAMS", np.array([[r.parameters().encode()]], dtype=np.object_))]) for r in requests]
'''

PARAMS_CONFIG = """
backend: "python"
max_batch_size: 0
input [ { name: "X" data_type: TYPE_FP32 dims: [ 1 ] } ]
output [ { name: "PARAMS" data_type: TYPE_STRING dims: [ 1, 1 ] } ]
"""


def test_a_model_bigger_than_2mb_uploads_through_the_load_api(fresh_repo, tmp_path):
    big = str(tmp_path / "big")
    models.add_mul(big, "m")
    onnx_bytes = open(os.path.join(big, "m", "1", "model.onnx"), "rb").read()
    # Pad the file with a large unused initializer: a 3 MB model.
    import onnx
    from onnx import numpy_helper
    model = onnx.load_from_string(onnx_bytes)
    model.graph.initializer.append(numpy_helper.from_array(np.zeros(3 << 18, dtype=np.float32), "padding"))
    onnx_bytes = model.SerializeToString()
    assert len(onnx_bytes) > 3 << 20
    config = json.dumps({"name": "big", "backend": "onnxruntime", "max_batch_size": 4})
    with Server(["--model-repository", fresh_repo, "--model-control-mode=explicit"]) as s:
        for client in (s.client(), s.grpc_client()):
            client.load_model("big", config=config, files={"file:1/model.onnx": onnx_bytes})
            assert client.is_model_ready("big")


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_headers_matching_the_forward_pattern_become_parameters(fresh_repo, protocol):
    models.python_model(fresh_repo, "params", PARAMS, PARAMS_CONFIG)
    args = ["--model-repository", fresh_repo, "--http-header-forward-pattern", "^x-team-.*",
            "--grpc-header-forward-pattern", "^x-team-.*"]
    with Server(args) as s:
        lib = httpclient if protocol == "http" else grpcclient
        client = s.client() if protocol == "http" else s.grpc_client()
        x = lib.InferInput("X", [1], "FP32").set_data_from_numpy(np.ones(1, dtype=np.float32))
        # gRPC metadata keys are lowercase by rule; HTTP's are matched case-insensitively.
        key = "X-Team-Id" if protocol == "http" else "x-team-id"
        r = client.infer("params", [x], headers={key: "blue", "x-other": "no"})
        params = json.loads(r.as_numpy("PARAMS")[0][0])
        assert params.get("x-team-id") == "blue" and "x-other" not in params, params


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_reserved_names_are_not_forwarded_and_values_arrive_byte_for_byte(fresh_repo, protocol):
    models.python_model(fresh_repo, "params", PARAMS, PARAMS_CONFIG)
    with Server(["--model-repository", fresh_repo, "--http-header-forward-pattern", ".*",
                 "--grpc-header-forward-pattern", ".*"]) as s:
        lib = httpclient if protocol == "http" else grpcclient
        client = s.client() if protocol == "http" else s.grpc_client()
        x = lambda: [lib.InferInput("X", [1], "FP32").set_data_from_numpy(np.ones(1, dtype=np.float32))]
        quoted = 'say "hi" \\ there'
        params = json.loads(client.infer("params", x(), headers={"my_header": quoted}).as_numpy("PARAMS")[0][0])
        assert params["my_header"] == quoted, params
        for reserved in ("sequence_id", "priority", "timeout", "headers", "binary_data_output", "triton_anything"):
            with pytest.raises(InferenceServerException,
                               match=f"Header '{reserved}' is reserved for Triton usage and cannot be forwarded"):
                client.infer("params", x(), headers={reserved: "dummy-value"})


def test_reserved_parameters_keep_their_kinds(fresh_repo):
    models.python_model(fresh_repo, "params", PARAMS, PARAMS_CONFIG)
    with Server(["--model-repository", fresh_repo]) as s:
        # Sent raw: tritonclient refuses reserved names itself; the server checks them too.
        import urllib.request
        body = {"inputs": [{"name": "X", "shape": [1], "datatype": "FP32", "data": [1.0]}]}
        for params, error in [({"sequence_start": "yes"}, b"'sequence_start' parameter, expected bool_param"),
                              ({"sequence_id": 1.5}, b"'sequence_id' parameter, expected int64_param or string_param"),
                              ({"triton_x": 1}, b"reserved for Triton usage"), ({"timeout": "soon"}, b"'timeout'"),
                              ({"priority": -1}, b"'priority'")]:
            req = urllib.request.Request(f"http://{s.url}/v2/models/params/infer",
                                         json.dumps({**body, "parameters": params}).encode(),
                                         {"Content-Type": "application/json"})
            with pytest.raises(urllib.error.HTTPError) as e:
                urllib.request.urlopen(req, timeout=30)
            assert e.value.code == 400 and error in e.value.read(), params


def test_a_folder_with_model_py_is_a_python_model(fresh_repo):
    models.python_model(fresh_repo, "params", PARAMS, None)
    models.write(os.path.join(fresh_repo, "params", "config.pbtxt"), PARAMS_CONFIG.replace('backend: "python"', ""))
    with Server(["--model-repository", fresh_repo]) as s:
        assert s.client().get_model_config("params")["backend"] == "python"


def test_unsupported_platforms_are_named_with_a_way_forward(fresh_repo):
    for name, platform in [("trt", "tensorrt_plan"), ("tf", "tensorflow_savedmodel")]:
        os.makedirs(os.path.join(fresh_repo, name, "1"))
        models.write(os.path.join(fresh_repo, name, "config.pbtxt"), f'platform: "{platform}"\nmax_batch_size: 0\n')
    with Server(["--model-repository", fresh_repo, "--exit-on-error=false"]) as s:
        index = {m["name"]: m["reason"] for m in s.client().get_model_repository_index()}
        assert "platform 'tensorrt_plan' is not served by ferry" in index["trt"] and "TensorRT" in index["trt"]
        # TensorFlow models are served (through OpenVINO): this one lacks its SavedModel folder.
        assert "model.savedmodel" in index["tf"], index["tf"]


def test_an_output_requested_twice_is_refused():
    from conftest import EXAMPLES
    with Server(["--model-repository", EXAMPLES]) as s:
        a = np.ones((1, 16), dtype=np.int32)
        for lib, client in ((httpclient, s.client()), (grpcclient, s.grpc_client())):
            ins = [lib.InferInput(n, [1, 16], "INT32").set_data_from_numpy(a) for n in ("INPUT0", "INPUT1")]
            outs = [lib.InferRequestedOutput("OUTPUT0"), lib.InferRequestedOutput("OUTPUT0")]
            with pytest.raises(InferenceServerException, match="requested more than once"):
                client.infer("simple", ins, outputs=outs)


def test_a_zero_input_size_is_refused_at_start_up():
    for flag in ["--http-max-input-size=0", "--http-max-input-size=-1"]:
        out = subprocess.run([BINARY, "serve", flag], capture_output=True, text=True, timeout=30)
        assert out.returncode != 0 and "http-max-input-size" in out.stderr, out.stderr


def matmul_model(repo, name, rows, cols):
    """y = x @ W with W of rows x cols FP32 kept as a weight (nothing folds it away)."""
    from onnx import TensorProto, helper, numpy_helper
    w = np.random.default_rng(0).standard_normal((rows, cols), dtype=np.float32)
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", rows])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", cols])
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "W"], ["y"])], name, [x], [y],
                              initializer=[numpy_helper.from_array(w, "W")])
    models.save(graph, os.path.join(repo, name, "1", "model.onnx"), opset=13)
    models.write(os.path.join(repo, name, "config.pbtxt"), f'name: "{name}"\nmax_batch_size: 8\n')


def test_statistics_report_the_memory_each_version_holds(tmp_path):
    repo = str(tmp_path)
    matmul_model(repo, "weights", 1024, 4096)
    models.add_mul(repo, "small")
    models.python_model(repo, "py", PARAMS, PARAMS_CONFIG)
    with Server(["--model-repository", repo]) as s:
        http = {m["name"]: m["memory_usage"] for m in s.client().get_inference_statistics()["model_stats"]}
        grpc = {m.name: [{"type": u.type, "id": u.id, "byte_size": u.byte_size} for u in m.memory_usage]
                for m in s.grpc_client().get_inference_statistics().model_stats}
    assert http == grpc
    weights = 1024 * 4096 * 4
    [held] = http["weights"]
    assert held["type"] == "CPU" and held["id"] == 0
    assert held["byte_size"] >= weights, f"a 16 MiB weight is held: {held}"
    [small] = http["small"]
    assert small["byte_size"] < weights, (small, held)
    [py] = http["py"]
    assert py["type"] == "CPU" and py["byte_size"] > 4 << 20, f"the Python process's resident memory: {py}"
