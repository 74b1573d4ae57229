"""How a Python model answers, as Triton runs it: the response sender in models that are and are
not decoupled (responses before, on and after return; the final flag alone; sending after the
final flag), `async def execute` running a decoupled model's requests concurrently, request
rescheduling, decoupled BLS (its iterator, async_exec and cancel), and the errors Triton raises:
BLS from initialize, a decoupled execute returning responses, a failing finalize."""
import json
import os
import queue

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

import models
from ferry_server import Server

# Each request says, in its PLAN input (JSON), what the model does: `before` responses sent
# before execute returns (then the final flag alone if `final_before`), a response returned
# (`returned`), `after` responses sent from a thread once execute returned (then `final_after`).
# Each response is one INT32 naming when it was made: 1000+k before, 0 returned, 2000+k after.
# With `wait_next`, the thread first waits for the model's next execute() (so that it surely
# sends after this one returned). What the sender raises after return is logged.
SENDER = '''
import json
import threading
import numpy as np
import triton_python_backend_utils as pb_utils


def answer(value):
    return pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array([value], np.int32))])


class TritonPythonModel:
    def initialize(self, args):
        self.decoupled = pb_utils.using_decoupled_model_transaction_policy(json.loads(args["model_config"]))
        self.calls, self.called = 0, threading.Condition()

    def send(self, sender, plan, key, base):
        for k in range(plan.get(key, 0)):
            sender.send(answer(base + k))
        if plan.get("final_" + key):
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def later(self, sender, plan, call):
        if plan.get("wait_next"):
            with self.called:
                self.called.wait_for(lambda: self.calls > call)
        try:
            self.send(sender, plan, "after", 2000)
        except pb_utils.TritonModelException as e:
            pb_utils.Logger.log_warn(f"after return: {e}")

    def execute(self, requests):
        with self.called:
            self.calls += 1
            call = self.calls
            self.called.notify_all()
        out = []
        for r in requests:
            plan = json.loads(pb_utils.get_input_tensor_by_name(r, "PLAN").as_numpy().reshape(-1)[0])
            sender = r.get_response_sender()
            self.send(sender, plan, "before", 1000)
            threading.Thread(target=self.later, args=(sender, plan, call), daemon=True).start()
            out.append(answer(0) if plan.get("returned") else None)
        if all(o is None for o in out):
            return None
        return out
'''

PLAN_IO = """
backend: "python"
max_batch_size: 0
input [ { name: "PLAN" data_type: TYPE_STRING dims: [ 1 ] } ]
output [ { name: "OUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
"""
DECOUPLED = "\nmodel_transaction_policy { decoupled: true }\n"


def plan_input(lib, plan):
    x = lib.InferInput("PLAN", [1], "BYTES")
    return x.set_data_from_numpy(np.array([json.dumps(plan).encode()], dtype=np.object_))


def stream(s, model, plans, timeout=30):
    """Every request on one gRPC stream; the (values, errors) each got, in arrival order."""
    got = queue.Queue()
    with grpcclient.InferenceServerClient(s.grpc_url) as client:
        client.start_stream(lambda result, error: got.put((result, error)))
        for i, plan in enumerate(plans):
            client.async_stream_infer(model, [plan_input(grpcclient, plan)], request_id=str(i),
                                      enable_empty_final_response=True)
        values, errors, finals = [], [], 0
        while finals < len(plans):
            result, error = got.get(timeout=timeout)
            if error is not None:
                errors.append(error.message())
                finals += 1
                continue
            params = result.get_response().parameters
            if result.as_numpy("OUT") is not None:
                values.append(int(result.as_numpy("OUT")[0]))
            if params["triton_final_response"].bool_param:
                finals += 1
        client.stop_stream()
    return values, errors


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    repo = str(tmp_path_factory.mktemp("senders"))
    models.python_model(repo, "sender", SENDER, PLAN_IO)
    models.python_model(repo, "sender_decoupled", SENDER, PLAN_IO + DECOUPLED)
    with Server(["--model-repository", repo]) as s:
        yield s


def infer(s, plan):
    client = s.client()
    return int(client.infer("sender", [plan_input(httpclient, plan)]).as_numpy("OUT")[0])


@pytest.mark.parametrize("plan,want", [
    ({"returned": True}, 0),
    ({"before": 1, "final_before": True}, 1000),
    ({"before": 1}, 1000),  # a response, then execute returns None: the response is the answer
    ({"after": 1, "final_after": True}, 2000),
    ({"after": 1}, 2000),
])
def test_a_model_that_is_not_decoupled_answers_through_its_sender_before_or_after_return(server, plan, want):
    assert infer(server, plan) == want


def test_a_model_that_is_not_decoupled_cannot_send_the_final_flag_alone(server):
    with pytest.raises(InferenceServerException, match="Non-decoupled model cannot send complete final before"):
        infer(server, {"final_before": True})
    assert infer(server, {"returned": True}) == 0, "the model keeps serving"


def test_a_second_response_of_a_model_that_is_not_decoupled_is_refused(server):
    # The first response is the answer; the second send raised inside execute.
    assert infer(server, {"before": 2, "final_before": True}) == 1000
    assert server.wait_log("Non-decoupled model cannot send more than one response")


def test_a_response_returned_after_the_sender_closed_is_not_a_second_answer(server):
    assert infer(server, {"before": 1, "final_before": True, "returned": True}) == 1000
    assert infer(server, {"returned": True, "after": 1, "final_after": True, "wait_next": True}) == 0
    assert infer(server, {"returned": True}) == 0
    assert server.wait_log("after return: Unable to send response. Non-decoupled model cannot send more than one")


def test_a_request_no_one_answers_gets_an_error_not_a_hang(server):
    with pytest.raises(InferenceServerException, match="gave no response for this request"):
        infer(server, {})


def test_several_requests_of_one_batch_each_answered_their_own_way(server):
    plans = [{"returned": True}, {"before": 1, "final_before": True}, {"after": 1, "final_after": True}]
    values, errors = stream(server, "sender", plans)
    assert sorted(values) == [0, 1000, 2000] and errors == []


@pytest.mark.parametrize("plan,want", [
    ({"final_before": True}, []),
    ({"final_after": True}, []),
    ({"before": 2, "final_before": True}, [1000, 1001]),
    ({"after": 2, "final_after": True}, [2000, 2001]),
    ({"before": 1, "after": 3, "final_after": True}, [1000, 2000, 2001, 2002]),
    ({}, []),  # nothing sent and the request let go: it ends with the final flag
])
def test_a_decoupled_model_sends_before_during_and_after_return(server, plan, want):
    values, errors = stream(server, "sender_decoupled", [plan])
    assert values == want and errors == []


def test_a_decoupled_model_that_returns_responses_gets_tritons_error(server):
    values, errors = stream(server, "sender_decoupled", [{"returned": True}])
    assert values == [] and len(errors) == 1
    assert "using the decoupled mode and the execute function must return None" in errors[0]
    # Sent before the return: the response stands and the error reaches no one.
    values, errors = stream(server, "sender_decoupled", [{"before": 1, "final_before": True, "returned": True}])
    assert values == [1000] and errors == []


def test_sending_after_the_final_flag_raises_tritons_error(server):
    values, errors = stream(server, "sender_decoupled", [{"final_before": True, "after": 1, "wait_next": True}])
    assert values == [] and errors == []
    stream(server, "sender_decoupled", [{"final_before": True}])
    assert server.wait_log("after return: Unable to send response. Response sender has been closed.")


def test_a_decoupled_model_answers_many_requests_on_one_stream(server):
    plans = [{"final_before": True}, {"final_after": True}, {"before": 1, "final_before": True},
             {"after": 2, "final_after": True}, {"before": 1, "after": 1, "final_after": True}]
    values, errors = stream(server, "sender_decoupled", plans)
    assert sorted(values) == [1000, 1000, 2000, 2000, 2001] and errors == []


# Request "wait" waits for request "go" inside the same instance: it only ends if both run at
# once (one after the other, the first would wait for ever and the client's timeout fails it).
ASYNC = '''
import asyncio
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.go = None

    async def execute(self, requests):
        if self.go is None:
            self.go = asyncio.Event()
        for r in requests:
            word = pb_utils.get_input_tensor_by_name(r, "PLAN").as_numpy().reshape(-1)[0]
            sender = r.get_response_sender()
            if word == b"raise":
                raise ValueError("asked to fail")
            if word == b"wait":
                await self.go.wait()
                sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array([1], np.int32))]))
            else:
                self.go.set()
                sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array([2], np.int32))]))
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
'''


def test_async_execute_runs_a_decoupled_models_requests_concurrently(tmp_path):
    repo = str(tmp_path)
    models.python_model(repo, "together", ASYNC, PLAN_IO + DECOUPLED)
    with Server(["--model-repository", repo]) as s:
        got = queue.Queue()
        with grpcclient.InferenceServerClient(s.grpc_url) as client:
            client.start_stream(lambda result, error: got.put((result, error)))
            for word in ("wait", "go"):
                x = grpcclient.InferInput("PLAN", [1], "BYTES").set_data_from_numpy(
                    np.array([word.encode()], dtype=np.object_))
                client.async_stream_infer("together", [x])
            values = sorted(int(got.get(timeout=30)[0].as_numpy("OUT")[0]) for _ in range(2))
            assert values == [1, 2]
            # A coroutine that raises: its request ends with the error, and the log has it.
            x = grpcclient.InferInput("PLAN", [1], "BYTES").set_data_from_numpy(np.array([b"raise"], np.object_))
            client.async_stream_infer("together", [x])
            result, error = got.get(timeout=30)
            assert result is None and "ValueError: asked to fail" in error.message()
            client.stop_stream()
        assert s.wait_log("ValueError: asked to fail")


# Iterative models: each request runs `n` times (rescheduled until then); the non-decoupled one
# answers at the end with how many runs it took, the decoupled one sends one response per run.
RESCHEDULE = '''
import json
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.decoupled = pb_utils.using_decoupled_model_transaction_policy(json.loads(args["model_config"]))
        self.runs = {}

    def execute(self, requests):
        out = []
        for r in requests:
            n = int(json.loads(pb_utils.get_input_tensor_by_name(r, "PLAN").as_numpy().reshape(-1)[0])["n"])
            runs = self.runs[r.request_id()] = self.runs.get(r.request_id(), 0) + 1
            done = runs >= n
            response = pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array([runs], np.int32))])
            if self.decoupled:
                r.get_response_sender().send(response, flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL if done else 0)
            if not done:
                r.set_release_flags(pb_utils.TRITONSERVER_REQUEST_RELEASE_RESCHEDULE)
            out.append(None if self.decoupled or not done else response)
        return None if self.decoupled else out
'''


def test_rescheduled_requests_run_again_until_the_model_releases_them(tmp_path):
    repo = str(tmp_path)
    models.python_model(repo, "iterate", RESCHEDULE, PLAN_IO)
    models.python_model(repo, "iterate_decoupled", RESCHEDULE, PLAN_IO + DECOUPLED)
    with Server(["--model-repository", repo]) as s:
        client = s.client()
        answer = client.infer("iterate", [plan_input(httpclient, {"n": 4})], request_id="a")
        assert int(answer.as_numpy("OUT")[0]) == 4
        values, errors = stream(s, "iterate_decoupled", [{"n": 3}])
        assert values == [1, 2, 3] and errors == []


# A driver of BLS on a decoupled model: `how` says sync exec, async_exec or cancel after one.
BLS_DRIVER = '''
import json
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        try:
            pb_utils.InferenceRequest(model_name="counter", requested_output_names=["OUT"], inputs=[]).exec()
            self.init_error = "none"
        except Exception as e:
            self.init_error = str(e)

    async def execute(self, requests):
        out = []
        for r in requests:
            how = json.loads(pb_utils.get_input_tensor_by_name(r, "PLAN").as_numpy().reshape(-1)[0])
            plan = pb_utils.Tensor("PLAN", np.array([json.dumps({"count": how["count"]}).encode()], np.object_))
            call = pb_utils.InferenceRequest(model_name="counter", requested_output_names=["OUT"], inputs=[plan])
            if how["way"] == "exec":
                responses = call.exec(decoupled=True)
            else:
                responses = await call.async_exec(decoupled=True)
            seen = []
            for response in responses:
                if response.has_error():
                    seen.append(response.error().message())
                    break
                t = pb_utils.get_output_tensor_by_name(response, "OUT")
                if t is not None:
                    seen.append(int(t.as_numpy()[0]))
                if how.get("cancel") and len(seen) == how["cancel"]:
                    responses.cancel()
            again = [int(pb_utils.get_output_tensor_by_name(x, "OUT").as_numpy()[0]) for x in responses
                     if pb_utils.get_output_tensor_by_name(x, "OUT") is not None]
            text = json.dumps({"seen": seen, "again": again, "init_error": self.init_error})
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array([text.encode()], np.object_))]))
        return out
'''

# Sends `count` responses (-1: until its request is cancelled), then the final flag alone.
COUNTER = '''
import json
import time
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        for r in requests:
            count = json.loads(pb_utils.get_input_tensor_by_name(r, "PLAN").as_numpy().reshape(-1)[0])["count"]
            sender, k = r.get_response_sender(), 0
            while k != count and not (count < 0 and sender.is_cancelled()) and k < 100000:
                sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array([k], np.int32))]))
                k += 1
                if count < 0:
                    time.sleep(0.01)
            if count < 0:
                pb_utils.Logger.log_info(f"counter saw the cancel after {k}")
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
'''


def driver_says(client, how):
    x = plan_input(httpclient, how)
    return json.loads(client.infer("driver", [x]).as_numpy("OUT")[0])


def test_bls_on_a_decoupled_model_streams_its_responses(tmp_path):
    repo = str(tmp_path)
    models.python_model(repo, "driver", BLS_DRIVER, PLAN_IO.replace("TYPE_INT32", "TYPE_STRING") +
                        'instance_group [ { count: 1 kind: KIND_CPU } ]')
    models.python_model(repo, "counter", COUNTER, PLAN_IO + DECOUPLED + 'instance_group [ { count: 2 kind: KIND_CPU } ]')
    with Server(["--model-repository", repo]) as s:
        client = s.client()
        said = driver_says(client, {"way": "exec", "count": 3})
        assert said["seen"] == [0, 1, 2] and said["again"] == [0, 1, 2]
        assert said["init_error"] == "BLS is only supported during the 'execute' function."
        assert driver_says(client, {"way": "async", "count": 5})["seen"] == [0, 1, 2, 3, 4]
        assert driver_says(client, {"way": "exec", "count": 0})["seen"] == []
        cancelled = driver_says(client, {"way": "exec", "count": -1, "cancel": 2})
        assert cancelled["seen"][:2] == [0, 1] and "cancelled" in str(cancelled["seen"][-1])
        assert s.wait_log("counter saw the cancel after")
        # Many calls leave no shared memory behind.
        before = len(os.listdir("/dev/shm"))
        for _ in range(50):
            driver_says(client, {"way": "exec", "count": 2})
        assert len(os.listdir("/dev/shm")) <= before


FAILING_FINALIZE = '''
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array([1], np.int32))]) for _ in requests]

    def finalize(self):
        raise RuntimeError("finalize went wrong on purpose")
'''

FAILING_INIT = '''
class TritonPythonModel:
    def initialize(self, args):
        raise KeyError("initialize went wrong on purpose")

    def execute(self, requests):
        return None
'''


def test_errors_in_finalize_and_initialize_are_logged_with_the_models_own_message(tmp_path):
    repo = str(tmp_path)
    models.python_model(repo, "bad_end", FAILING_FINALIZE, PLAN_IO)
    models.python_model(repo, "bad_start", FAILING_INIT, PLAN_IO)
    args = ["--model-repository", repo, "--model-control-mode=explicit", "--load-model=bad_end",
            "--backend-config=python,shm-default-byte-size=5242880", "--backend-config=python,shm-growth-byte-size=1048576"]
    with Server(args) as s:
        client = s.client()
        client.unload_model("bad_end")
        assert s.wait_log("finalize went wrong on purpose")
        with pytest.raises(InferenceServerException, match="initialize went wrong on purpose"):
            client.load_model("bad_start")
        assert s.wait_log("KeyError")
        assert client.is_server_live()
