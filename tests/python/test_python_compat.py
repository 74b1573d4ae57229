"""Python models written for Triton, as Triton runs them: `pb_utils` names and values, the
`initialize` arguments, sequence ids and flags on requests, configs without inputs or outputs,
models split over files that import each other, and the load API's file overrides as Triton's own
clients send them."""
import json
import os

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

import models
from ferry_server import Server

# Checks pb_utils against Triton's values in initialize (a mismatch fails the load, naming it),
# and answers with what it was given.
NAMES = '''
import json
import numpy as np
import triton_python_backend_utils as pb_utils

EXPECTED = [
    (pb_utils.numpy_to_triton_type(np.float32), 11), (pb_utils.numpy_to_triton_type(np.bool_), 1),
    (pb_utils.numpy_to_triton_type(np.object_), 13), (pb_utils.numpy_to_triton_type(np.bytes_), 13),
    (pb_utils.triton_to_numpy_type(8), np.int32), (pb_utils.triton_to_numpy_type(13), np.object_),
    (pb_utils.TRITON_STRING_TO_NUMPY["TYPE_FP16"], np.float16), (pb_utils.triton_string_to_numpy("TYPE_STRING"), np.object_),
    (pb_utils.TRITONSERVER_REQUEST_FLAG_SEQUENCE_START, 1), (pb_utils.TRITONSERVER_REQUEST_FLAG_SEQUENCE_END, 2),
    (pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL, 1), (pb_utils.TRITONSERVER_REQUEST_RELEASE_ALL, 1),
    (pb_utils.TRITONSERVER_REQUEST_RELEASE_RESCHEDULE, 2),
    (pb_utils.Tensor("x", np.zeros(2, np.float32)).triton_dtype(), 11),
    (pb_utils.using_decoupled_model_transaction_policy({"model_transaction_policy": {"decoupled": True}}), True),
    (pb_utils.using_decoupled_model_transaction_policy({}), False),
]


class TritonPythonModel:
    def initialize(self, args):
        for i, (got, want) in enumerate(EXPECTED):
            if got != want:
                raise pb_utils.TritonModelException(f"check {i}: got {got!r}, want {want!r}")
        self.args = {k: v for k, v in args.items() if k != "model_config"}
        self.decoupled = pb_utils.using_decoupled_model_transaction_policy(json.loads(args["model_config"]))
        for level in (pb_utils.Logger.INFO, pb_utils.Logger.WARNING, pb_utils.Logger.ERROR, pb_utils.Logger.VERBOSE):
            pb_utils.Logger.log(f"level {level} works", level)

    def execute(self, requests):
        out = []
        for r in requests:
            seen = dict(self.args, correlation_id=r.correlation_id(), flags=r.flags(), model=r.model_name(),
                        decoupled=self.decoupled)
            text = np.array([json.dumps(seen).encode()], dtype=np.object_)
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", text)]))
        return out
'''

IO = """
backend: "python"
max_batch_size: 0
input [ { name: "IN" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "OUT" data_type: TYPE_STRING dims: [ 1 ] } ]
"""

SEQUENCE = IO.replace('max_batch_size: 0', 'max_batch_size: 1') + """
sequence_batching {
  control_input [ { name: "START" control [ { kind: CONTROL_SEQUENCE_START int32_false_true: [ 0, 1 ] } ] } ]
}
"""


def seen(client, model, lib=httpclient, **kw):
    shape = [1, 1] if "sequence_id" in kw else [1]
    x = lib.InferInput("IN", shape, "INT32").set_data_from_numpy(np.zeros(shape, dtype=np.int32))
    return json.loads(client.infer(model, [x], **kw).as_numpy("OUT").reshape(-1)[0])


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    repo = str(tmp_path_factory.mktemp("compat"))
    models.python_model(repo, "init_args", NAMES, IO + 'instance_group [ { count: 2 kind: KIND_CPU } ]')
    models.python_model(repo, "default_group", NAMES, IO)
    models.python_model(repo, "seq", NAMES, SEQUENCE)
    with Server(["--model-repository", repo]) as s:
        yield s


def test_pb_utils_names_and_values_are_tritons(server):
    # initialize checked them: the model loaded, and logged at every level.
    assert server.client().is_model_ready("init_args")
    for level in ("INFO", "WARN", "ERROR"):
        assert server.wait_log(f"level {level} works"), level


def test_initialize_gets_the_arguments_triton_gives(server):
    names = {seen(server.client(), "init_args")["model_instance_name"] for _ in range(8)}
    assert names <= {"init_args_0_0", "init_args_0_1"} and names, names
    got = seen(server.client(), "init_args")
    assert (got["model_name"], got["model_version"], got["model_instance_kind"], got["model_instance_device_id"]) == \
        ("init_args", "1", "CPU", "0")
    assert got["model_repository"].endswith("/init_args") and got["model"] == "init_args"
    # No instance_group: one group named after the model, as Triton's.
    assert seen(server.client(), "default_group")["model_instance_name"] == "default_group_0"


@pytest.mark.parametrize("lib", [httpclient, grpcclient], ids=["http", "grpc"])
def test_sequence_requests_carry_their_correlation_id_and_flags(server, lib):
    client = server.client() if lib is httpclient else server.grpc_client()
    first = seen(client, "seq", lib, sequence_id=42, sequence_start=True)
    middle = seen(client, "seq", lib, sequence_id=42)
    last = seen(client, "seq", lib, sequence_id=42, sequence_end=True)
    assert [(r["correlation_id"], r["flags"]) for r in (first, middle, last)] == [(42, 1), (42, 0), (42, 2)]
    both = seen(client, "seq", lib, sequence_id="abc", sequence_start=True, sequence_end=True)
    assert (both["correlation_id"], both["flags"]) == ("abc", 3)


GENERATOR = '''
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array([7], dtype=np.int32))]) for _ in requests]
'''

SINK = '''
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse([]) for _ in requests]
'''


def test_configs_without_inputs_or_outputs_load_and_answer(tmp_path):
    repo = str(tmp_path)
    models.python_model(repo, "generator", GENERATOR, """
backend: "python"
max_batch_size: 0
output [ { name: "OUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
""")
    models.python_model(repo, "sink", SINK, """
backend: "python"
max_batch_size: 0
input [ { name: "IN" data_type: TYPE_INT32 dims: [ 1 ] } ]
""")
    with Server(["--model-repository", repo]) as s:
        client = s.client()
        assert client.infer("generator", []).as_numpy("OUT").tolist() == [7]
        x = httpclient.InferInput("IN", [1], "INT32").set_data_from_numpy(np.array([1], dtype=np.int32))
        assert client.infer("sink", [x]).get_response()["outputs"] == []
        assert s.grpc_client().infer("generator", []).as_numpy("OUT").tolist() == [7]


MULTI = '''
import file1
import triton_python_backend_utils as pb_utils
from . import file2
from .helpers.names import NAME


class TritonPythonModel:
    def initialize(self, args):
        if (file1.FILE_NAME, file2.FILE_NAME, NAME) != ("FILE1", "FILE2", "NESTED"):
            raise pb_utils.TritonModelException("imports do not work")

    def execute(self, requests):
        x = [pb_utils.get_input_tensor_by_name(r, "IN").as_numpy() for r in requests]
        return [pb_utils.InferenceResponse([pb_utils.Tensor("OUT", v)]) for v in x]
'''


def test_a_model_over_several_files_imports_its_siblings(tmp_path):
    repo = str(tmp_path)
    models.python_model(repo, "multi_file", MULTI, IO.replace("TYPE_STRING", "TYPE_INT32"))
    version = os.path.join(repo, "multi_file", "1")
    models.write(os.path.join(version, "file1.py"), 'FILE_NAME = "FILE1"\n')
    models.write(os.path.join(version, "file2.py"), 'FILE_NAME = "FILE2"\n')
    models.write(os.path.join(version, "helpers", "__init__.py"), "")
    models.write(os.path.join(version, "helpers", "names.py"), 'NAME = "NESTED"\n')
    with Server(["--model-repository", repo]) as s:
        x = httpclient.InferInput("IN", [1], "INT32").set_data_from_numpy(np.array([5], dtype=np.int32))
        assert s.client().infer("multi_file", [x]).as_numpy("OUT").tolist() == [5]


def test_load_api_file_overrides_with_a_leading_slash(tmp_path):
    config = json.dumps({"name": "uploaded", "backend": "python", "max_batch_size": 0,
                         "output": [{"name": "OUT", "data_type": "TYPE_INT32", "dims": [1]}]})
    with Server(["--model-repository", str(tmp_path), "--model-control-mode=explicit"]) as s:
        client = s.client()
        client.load_model("uploaded", config=config, files={"file:/1/model.py": GENERATOR.encode()})
        assert client.infer("uploaded", []).as_numpy("OUT").tolist() == [7]
        grpc = s.grpc_client()
        grpc.load_model("uploaded2", config=config.replace("uploaded", "uploaded2"),
                        files={"file:/1/model.py": GENERATOR.encode()})
        assert grpc.infer("uploaded2", []).as_numpy("OUT").tolist() == [7]


CHATTY = '''
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        out = []
        for r in requests:
            n = int(pb_utils.get_input_tensor_by_name(r, "IN").as_numpy()[0])
            pb_utils.Logger.log_info(f"info {n}")
            pb_utils.Logger.log_warn(f"warning {n}")
            pb_utils.Logger.log(f"verbose {n}", pb_utils.Logger.VERBOSE)
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array([n], dtype=np.int32))]))
        return out
'''


def test_python_logs_follow_the_log_settings_set_at_run_time(tmp_path):
    repo = str(tmp_path)
    models.python_model(repo, "chatty", CHATTY, IO.replace("TYPE_STRING", "TYPE_INT32"))
    with Server(["--model-repository", repo]) as s:
        client = s.client()
        call = lambda n: client.infer("chatty", [httpclient.InferInput("IN", [1], "INT32").set_data_from_numpy(
            np.array([n], dtype=np.int32))])
        call(1)
        assert s.wait_log("info 1") and s.wait_log("warning 1")
        assert "verbose 1" not in s.log(), "verbose is off by default"
        client.update_log_settings({"log_verbose_level": 1})
        call(2)
        assert s.wait_log("verbose 2")
        client.update_log_settings({"log_verbose_level": 0, "log_info": False})
        call(3)
        assert s.wait_log("warning 3")
        assert "info 3" not in s.log() and "verbose 3" not in s.log()


# A backend written in Python, as vLLM's ships: its model.py completes the config and reads the
# model's own files from the model's folder.
BACKEND = '''
import json
import os
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    @staticmethod
    def auto_complete_config(config):
        config.add_input({"name": "IN", "data_type": "TYPE_INT32", "dims": [1]})
        config.add_output({"name": "OUT", "data_type": "TYPE_INT32", "dims": [1]})
        return config

    def initialize(self, args):
        with open(os.path.join(args["model_repository"], args["model_version"], "model.json")) as f:
            self.add = json.load(f)["add"]

    def execute(self, requests):
        out = []
        for r in requests:
            x = pb_utils.get_input_tensor_by_name(r, "IN").as_numpy()
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", x + self.add)]))
        return out
'''


def test_a_python_based_backend_runs_models_that_name_it(tmp_path):
    backends, repo = tmp_path / "backends", str(tmp_path / "models")
    models.write(str(backends / "adder" / "model.py"), BACKEND)
    for name, add in (("plus_one", 1), ("plus_ten", 10)):
        models.write(os.path.join(repo, name, "config.pbtxt"), 'backend: "adder"\nmax_batch_size: 0\n')
        models.write(os.path.join(repo, name, "1", "model.json"), json.dumps({"add": add}))
    models.write(os.path.join(repo, "nowhere", "config.pbtxt"), 'backend: "vllm"\nmax_batch_size: 0\n')
    os.makedirs(os.path.join(repo, "nowhere", "1"))
    with Server(["--model-repository", repo, f"--backend-directory={backends}", "--exit-on-error=false"]) as s:
        client = s.client()
        x = httpclient.InferInput("IN", [1], "INT32").set_data_from_numpy(np.array([5], dtype=np.int32))
        assert client.infer("plus_one", [x]).as_numpy("OUT").tolist() == [6]
        assert client.infer("plus_ten", [x]).as_numpy("OUT").tolist() == [15]
        assert client.get_model_metadata("plus_one")["platform"] == "adder"
        reason = {m["name"]: m for m in client.get_model_repository_index()}["nowhere"]["reason"]
        assert "backend 'vllm' is not served" in reason and "--backend-directory" in reason, reason


# Answers each request with the TritonError code it names.
ERROR_CODES = '''
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        out = []
        for r in requests:
            name = pb_utils.get_input_tensor_by_name(r, "IN").as_numpy().reshape(-1)[0].decode()
            if name == "default":
                error = pb_utils.TritonError("no code given")
            else:
                error = pb_utils.TritonError(f"code {name}", getattr(pb_utils.TritonError, name))
            out.append(pb_utils.InferenceResponse(error=error))
        return out
'''


@pytest.mark.parametrize("code,grpc_status,http_status", [
    ("UNKNOWN", "StatusCode.UNKNOWN", 400), ("INTERNAL", "StatusCode.INTERNAL", 500),
    ("NOT_FOUND", "StatusCode.NOT_FOUND", 404), ("INVALID_ARG", "StatusCode.INVALID_ARGUMENT", 400),
    ("UNAVAILABLE", "StatusCode.UNAVAILABLE", 503), ("UNSUPPORTED", "StatusCode.UNIMPLEMENTED", 501),
    ("ALREADY_EXISTS", "StatusCode.ALREADY_EXISTS", 400), ("CANCELLED", "StatusCode.CANCELLED", 400),
    ("default", "StatusCode.INTERNAL", 500),
])
def test_a_python_error_keeps_its_triton_code(tmp_path, code, grpc_status, http_status):
    repo = str(tmp_path)
    models.python_model(repo, "coded", ERROR_CODES, IO.replace("TYPE_INT32", "TYPE_STRING"))
    with Server(["--model-repository", repo]) as s:
        for lib, client in ((grpcclient, s.grpc_client()), (httpclient, s.client())):
            x = lib.InferInput("IN", [1], "BYTES").set_data_from_numpy(np.array([code.encode()], dtype=np.object_))
            with pytest.raises(Exception) as e:
                client.infer("coded", [x])
            if lib is grpcclient:
                assert e.value.status() == grpc_status, e.value
            else:
                assert e.value.status() == str(http_status), e.value


# Loads, checks and unloads another model through pb_utils; checks pb_utils refuses bad
# arguments as Triton's does, and that the model sees no command-line arguments of ferry's.
CONTROLLER = '''
import json
import sys
import numpy as np
import triton_python_backend_utils as pb_utils


def refused(make, kind):
    try:
        make()
    except kind:
        return True
    except Exception:
        return False
    return False


class TritonPythonModel:
    def execute(self, requests):
        seen = {"argv": sys.argv}
        pb_utils.load_model("managed")
        seen["loaded"] = pb_utils.is_model_ready("managed")
        pb_utils.unload_model("managed")
        seen["after_unload"] = pb_utils.is_model_ready("managed")
        seen["checks"] = [
            refused(lambda: pb_utils.InferenceRequest(model_name="x", requested_output_names=[], inputs=[None]),
                    pb_utils.TritonModelException),
            refused(lambda: pb_utils.InferenceResponse(output_tensors=[None]), pb_utils.TritonModelException),
            refused(lambda: pb_utils.Tensor(None, np.zeros(1)), TypeError),
            refused(lambda: pb_utils.Tensor("x", None), TypeError),
            refused(lambda: pb_utils.Logger.log("m", None), TypeError),
        ]
        text = np.array([json.dumps(seen).encode()], dtype=np.object_)
        return [pb_utils.InferenceResponse([pb_utils.Tensor("OUT", text)]) for _ in requests]
'''


def test_model_control_argument_checks_and_argv_from_a_python_model(tmp_path):
    repo = str(tmp_path)
    models.python_model(repo, "controller", CONTROLLER, IO)
    models.identity(repo, "managed", "FP32")
    with Server(["--model-repository", repo, "--model-control-mode=explicit", "--load-model=controller"]) as s:
        said = seen(s.client(), "controller")
        assert said == {"argv": [""], "loaded": True, "after_unload": False, "checks": [True] * 5}, said


def test_python_model_names_with_shell_characters_are_refused_as_triton_does(tmp_path):
    repo = str(tmp_path)
    with Server(["--model-repository", repo, "--model-control-mode=explicit"]) as s:
        config = json.dumps({"backend": "python", "input": [], "output": []})
        for name in ("model;test", "model$test", "model|test", "model*test"):
            with pytest.raises(Exception, match="Invalid stub name: contains invalid characters"):
                s.client().load_model(name, config=config, files={"file:1/model.py": b"class TritonPythonModel: pass"})
            assert not s.client().is_model_ready(name)


ITERATE = '''
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array([[b"ok"]], np.object_))])
                for _ in requests]
'''


def test_an_iterative_sequence_takes_requests_without_a_correlation_id(tmp_path):
    repo = str(tmp_path)
    models.python_model(repo, "iterative", ITERATE, IO.replace("max_batch_size: 0", "max_batch_size: 1") +
                        "sequence_batching { iterative_sequence: true }")
    models.python_model(repo, "plain_sequence", ITERATE, IO.replace("max_batch_size: 0", "max_batch_size: 1") +
                        "sequence_batching { }")
    with Server(["--model-repository", repo]) as s:
        x = httpclient.InferInput("IN", [1, 1], "INT32").set_data_from_numpy(np.zeros((1, 1), np.int32))
        assert s.client().infer("iterative", [x]).as_numpy("OUT").reshape(-1).tolist() == [b"ok"]
        with pytest.raises(Exception, match="must specify a non-zero or non-empty correlation ID"):
            s.client().infer("plain_sequence", [x])


# Works until its client leaves (at most 60 s), then says so in the log.
PATIENT = '''
import time
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        start = time.time()
        pb_utils.Logger.log_info("patient: started")
        while time.time() - start < 60:
            if requests[0].is_cancelled():
                pb_utils.Logger.log_info("patient: the client left")
                break
            time.sleep(0.05)
        return [pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array([b"done"], np.object_))])
                for _ in requests]
'''


def test_a_model_that_is_not_decoupled_sees_its_client_leave(tmp_path):
    repo = str(tmp_path)
    models.python_model(repo, "patient", PATIENT, IO)
    with Server(["--model-repository", repo]) as s:
        client = s.grpc_client()
        x = grpcclient.InferInput("IN", [1], "INT32").set_data_from_numpy(np.zeros(1, np.int32))
        future = client.async_infer("patient", [x], callback=lambda result, error: None)
        assert s.wait_log("patient: started", timeout=30)
        future.cancel()
        assert s.wait_log("patient: the client left", timeout=30)
        assert "OUT" in str(s.client().get_model_metadata("patient"))


# Answers each request with its place in the batch.
PLACES = '''
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array([[str(i).encode()]], np.object_))])
                for i, _ in enumerate(requests)]
'''


def test_requests_of_one_stream_are_batched_in_the_order_sent(tmp_path):
    import queue
    repo = str(tmp_path)
    config = IO.replace("max_batch_size: 0", "max_batch_size: 8") + \
        "dynamic_batching { preferred_batch_size: [ 6 ] max_queue_delay_microseconds: 20000000 }"
    models.python_model(repo, "places", PLACES, config)
    with Server(["--model-repository", repo]) as s:
        got = queue.Queue()
        with grpcclient.InferenceServerClient(s.grpc_url) as client:
            client.start_stream(lambda result, error: got.put((result, error)))
            for i in range(6):
                x = grpcclient.InferInput("IN", [1, 1], "INT32").set_data_from_numpy(np.zeros((1, 1), np.int32))
                client.async_stream_infer("places", [x], request_id=str(i))
            answers = {}
            for _ in range(6):
                result, error = got.get(timeout=60)
                assert error is None, error
                answers[result.get_response().id] = int(result.as_numpy("OUT").reshape(-1)[0])
            client.stop_stream()
        assert answers == {str(i): i for i in range(6)}, answers
