"""Python models that misbehave around the response sender and BLS streams, each of which once
wedged the server, leaked or left a request open: a model that does not read the BLS stream it
opened (the server stays responsive), one that drops the stream's iterator (the call is cancelled),
clients that leave a decoupled model that keeps its senders (their budget comes back), a final
response that cannot be sent (the request still ends), a process that died while idle (the next
request is served by its replacement), and a response returned for a rescheduled request."""
import json
import os
import queue
import signal
import time

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

import models
from ferry_server import Server
from test_python_senders import COUNTER, DECOUPLED, PLAN_IO, plan_input

# Opens a BLS stream to "counter" and does not read it until the file its request names exists.
SLOW_READER = '''
import json
import os
import time
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        out = []
        for r in requests:
            how = json.loads(pb_utils.get_input_tensor_by_name(r, "PLAN").as_numpy().reshape(-1)[0])
            plan = pb_utils.Tensor("PLAN", np.array([json.dumps({"count": how["count"]}).encode()], np.object_))
            call = pb_utils.InferenceRequest(model_name="counter", requested_output_names=["OUT"], inputs=[plan])
            responses = call.exec(decoupled=True)
            if "opened" in how:
                open(f"{how['opened']}.{os.getpid()}", "w").close()
            if how.get("drop"):
                next(iter(responses))
                del responses
                seen = "dropped"
            else:
                while not os.path.exists(how["wait_for"]):
                    time.sleep(0.02)
                seen = [int(x.as_numpy()[0]) if (x := pb_utils.get_output_tensor_by_name(r2, "OUT")) is not None
                        else r2.error().message() for r2 in responses]
            text = json.dumps({"seen": seen})
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array([text.encode()], np.object_))]))
        return out
'''


def repo_with_reader(tmp_path):
    repo = str(tmp_path / "repo")
    models.python_model(repo, "reader", SLOW_READER, PLAN_IO.replace("TYPE_INT32", "TYPE_STRING") +
                        'instance_group [ { count: 2 kind: KIND_CPU } ]')
    models.python_model(repo, "counter", COUNTER, PLAN_IO + DECOUPLED + 'instance_group [ { count: 2 kind: KIND_CPU } ]')
    models.identity(repo, "echo", "FP32")
    return repo


def echo(client, n):
    x = httpclient.InferInput("INPUT0", [1, n], "FP32").set_data_from_numpy(np.ones((1, n), np.float32))
    return client.infer("echo", [x]).as_numpy("OUTPUT0")


def test_a_model_that_does_not_read_its_bls_streams_does_not_stall_the_server(tmp_path):
    with Server(["--model-repository", repo_with_reader(tmp_path)]) as s:
        client = httpclient.InferenceServerClient(f"127.0.0.1:{s.port}", concurrency=2, network_timeout=60)
        gate, opened = str(tmp_path / "go"), str(tmp_path / "opened")
        # Two streams of 200 responses each that their callers leave unread for now.
        pending = [client.async_infer("reader", [plan_input(httpclient, {"count": 200, "wait_for": gate,
                                                                         "opened": opened})]) for _ in range(2)]
        deadline = time.time() + 60
        while len([f for f in os.listdir(tmp_path) if f.startswith("opened.")]) < 2:
            assert time.time() < deadline, "the streams never opened"
            time.sleep(0.05)
        # Meanwhile the server answers everything else.
        other = httpclient.InferenceServerClient(f"127.0.0.1:{s.port}", network_timeout=20)
        for _ in range(5):
            assert other.is_server_live() and other.is_model_ready("echo")
            assert echo(other, 4).tolist() == [[1, 1, 1, 1]]
        open(gate, "w").close()
        for p in pending:
            seen = json.loads(p.get_result().as_numpy("OUT")[0])["seen"]
            # The unread stream was cut, as a client's would be, with a clear error at its end.
            assert seen[:10] == list(range(10)) and "fell behind" in str(seen[-1]), seen[-3:]


def test_dropping_a_bls_streams_iterator_cancels_the_call(tmp_path):
    with Server(["--model-repository", repo_with_reader(tmp_path)]) as s:
        said = json.loads(s.client().infer("reader", [plan_input(httpclient, {"count": -1, "drop": True})])
                          .as_numpy("OUT")[0])
        assert said["seen"] == "dropped"
        assert s.wait_log("counter saw the cancel after")


# A decoupled model that keeps every sender and never answers.
HOARDER = '''
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.kept = []

    def execute(self, requests):
        self.kept.extend(r.get_response_sender() for r in requests)
        return None
'''


def test_clients_that_leave_a_model_that_keeps_their_senders_give_their_budget_back(tmp_path):
    repo = str(tmp_path)
    models.python_model(repo, "hoarder", HOARDER, PLAN_IO + DECOUPLED)
    models.identity(repo, "echo", "FP32")
    with Server(["--model-repository", repo, "--max-inflight-request-bytes=4000000"]) as s:
        big = {"pad": "x" * 500_000}
        for _ in range(3):
            got = queue.Queue()
            with grpcclient.InferenceServerClient(s.grpc_url) as client:
                client.start_stream(lambda result, error: got.put((result, error)))
                for _ in range(6):
                    client.async_stream_infer("hoarder", [plan_input(grpcclient, big)])
                time.sleep(0.5)
                client.stop_stream(cancel_requests=True)
        # Eighteen 500 kB requests left behind in a 4 MB budget: the budget is whole again (a
        # 3.2 MB request fits only in a budget nearly whole).
        deadline = time.time() + 30
        while True:
            try:
                assert echo(s.client(), 800_000).shape == (1, 800_000)
                break
            except InferenceServerException as e:
                assert time.time() < deadline, f"the budget never came back: {e}"
                time.sleep(0.2)


# Its final response holds an output that cannot be sent; the model re-raises what send raised.
UNSENDABLE = '''
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        for r in requests:
            bad = pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array([1 + 2j], np.complex128))])
            r.get_response_sender().send(bad, flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
'''


def first_reply(s, model, plan):
    """The first (result, error) of one request on a gRPC stream."""
    got = queue.Queue()
    with grpcclient.InferenceServerClient(s.grpc_url) as client:
        client.start_stream(lambda result, error: got.put((result, error)))
        client.async_stream_infer(model, [plan_input(grpcclient, plan)])
        reply = got.get(timeout=30)
        client.stop_stream()
    return reply


def test_a_final_response_that_cannot_be_sent_still_ends_its_request(tmp_path):
    repo = str(tmp_path)
    models.python_model(repo, "unsendable", UNSENDABLE, PLAN_IO + DECOUPLED)
    with Server(["--model-repository", repo]) as s:
        result, error = first_reply(s, "unsendable", {})
        assert result is None and "complex128" in error.message(), error


PID = '''
import os
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.decoupled = pb_utils.using_decoupled_model_transaction_policy(__import__("json").loads(args["model_config"]))

    def execute(self, requests):
        answers = [pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array([os.getpid()], np.int32))])
                   for _ in requests]
        if not self.decoupled:
            return answers
        for r, a in zip(requests, answers):
            r.get_response_sender().send(a, flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
'''


@pytest.mark.parametrize("decoupled", [False, True], ids=["plain", "decoupled"])
def test_a_process_that_died_while_idle_is_replaced_before_the_next_request(tmp_path, decoupled):
    repo = str(tmp_path)
    models.python_model(repo, "pid", PID, PLAN_IO + (DECOUPLED if decoupled else ""))

    def pid_of(s):
        if not decoupled:
            return int(s.client().infer("pid", [plan_input(httpclient, {})]).as_numpy("OUT")[0])
        result, error = first_reply(s, "pid", {})
        assert error is None, error
        return int(result.as_numpy("OUT")[0])

    with Server(["--model-repository", repo]) as s:
        first = pid_of(s)
        os.kill(first, signal.SIGKILL)

        def dying():
            # Until every thread of it is gone (its leader shows Z before that).
            try:
                return "Z" not in open(f"/proc/{first}/stat").read().split()[2] or \
                    len(os.listdir(f"/proc/{first}/task")) > 1
            except OSError:
                return False

        while dying():
            time.sleep(0.05)
        assert pid_of(s) != first


RESCHEDULE_AND_ANSWER = '''
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        for r in requests:
            r.set_release_flags(pb_utils.TRITONSERVER_REQUEST_RELEASE_RESCHEDULE)
        return [pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array([1], np.int32))]) for _ in requests]
'''


def test_a_response_returned_for_a_rescheduled_request_is_tritons_error(tmp_path):
    repo = str(tmp_path)
    models.python_model(repo, "both", RESCHEDULE_AND_ANSWER, PLAN_IO)
    with Server(["--model-repository", repo]) as s:
        with pytest.raises(InferenceServerException, match="Expected a None object in the execute function return"):
            s.client().infer("both", [plan_input(httpclient, {})])


# {"forever": true}: rescheduled for ever; {"hold": true}: its sender kept and never used;
# otherwise answered 7. One instance, so a request it never lets go of would hold it for good.
NEVER_LETS_GO = '''
import json
import numpy as np
import triton_python_backend_utils as pb_utils

HELD = []


class TritonPythonModel:
    def execute(self, requests):
        for r in requests:
            how = json.loads(pb_utils.get_input_tensor_by_name(r, "PLAN").as_numpy().reshape(-1)[0])
            if how.get("forever"):
                r.set_release_flags(pb_utils.TRITONSERVER_REQUEST_RELEASE_RESCHEDULE)
            elif how.get("hold"):
                HELD.append((r, r.get_response_sender()))
            else:
                out = pb_utils.Tensor("OUT", np.array([7], np.int32))
                r.get_response_sender().send(pb_utils.InferenceResponse([out]),
                                             flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
'''


@pytest.mark.parametrize("how", [{"forever": True}, {"hold": True}], ids=["rescheduled for ever", "never answered"])
@pytest.mark.parametrize("asynchronous", [False, True], ids=["def", "async def"])
def test_a_request_the_model_never_lets_go_ends_when_its_client_leaves(tmp_path, how, asynchronous):
    code = NEVER_LETS_GO.replace("    def execute", "    async def execute") if asynchronous else NEVER_LETS_GO
    models.python_model(str(tmp_path), "clingy", code, PLAN_IO)
    with Server(["--model-repository", str(tmp_path)]) as s:
        client = s.grpc_client()
        with pytest.raises(InferenceServerException, match="Deadline"):
            client.infer("clingy", [plan_input(grpcclient, how)], client_timeout=1)
        # Before, the only instance stayed with the first request for good and this one hung.
        r = client.infer("clingy", [plan_input(grpcclient, {})], client_timeout=30)
        assert r.as_numpy("OUT").tolist() == [7]


@pytest.mark.parametrize("how", [{"forever": True}, {"hold": True}], ids=["rescheduled for ever", "never answered"])
def test_a_request_on_a_stream_the_client_cancels_ends_too(tmp_path, how):
    models.python_model(str(tmp_path), "clingy", NEVER_LETS_GO, PLAN_IO)
    with Server(["--model-repository", str(tmp_path)]) as s:
        client = grpcclient.InferenceServerClient(s.grpc_url)
        client.start_stream(lambda result, error: None)
        client.async_stream_infer("clingy", [plan_input(grpcclient, how)])
        time.sleep(1)
        client.stop_stream(cancel_requests=True)
        client.close()
        # Before, a non-decoupled model's request on a stream outlived the stream for good.
        r = s.grpc_client().infer("clingy", [plan_input(grpcclient, {})], client_timeout=30)
        assert r.as_numpy("OUT").tolist() == [7]


# What a model may put in a message that is no JSON: NaN, lone surrogates, huge log lines.
ODD_TEXT = '''
import json
import threading
import time
import numpy as np
import triton_python_backend_utils as pb_utils

ODD = b"caf\\xe9".decode("utf-8", "surrogateescape")
SEEN = []


class TritonPythonModel:
    def initialize(self, args):
        try:
            pb_utils.is_model_ready("anything")
        except Exception as e:  # Before, this waited for the whole stub timeout.
            pb_utils.Logger.log_info(f"control from initialize: {e}")

    def execute(self, requests):
        out = []
        for r in requests:
            how = json.loads(pb_utils.get_input_tensor_by_name(r, "PLAN").as_numpy().reshape(-1)[0])
            value = 1
            if how.get("nan"):
                value = pb_utils.InferenceResponse([], parameters={"score": float("nan")})
            elif how.get("log"):
                pb_utils.Logger.log_warn("file " + ODD)
                pb_utils.Logger.log_info("x" * 100000)
            elif how.get("raise"):
                raise ValueError("bad name " + ODD)
            elif how.get("watch"):
                sender = r.get_response_sender()

                def watch():
                    for _ in range(30):
                        time.sleep(0.1)
                        SEEN.append((r.is_cancelled(), sender.is_cancelled()))
                threading.Thread(target=watch).start()
                continue
            elif how.get("seen"):
                value = int(all(a and b for a, b in SEEN[-10:]) and len(SEEN) == 30)
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array([value], np.int32))]))
        return out if len(out) == len(requests) else None
'''


def test_text_that_is_no_json_neither_kills_the_process_nor_is_lost(tmp_path):
    models.python_model(str(tmp_path), "odd", ODD_TEXT, PLAN_IO)
    with Server(["--model-repository", str(tmp_path)]) as s:
        client = s.client()
        assert "control from initialize: is_model_ready is only supported during the 'execute' function." in s.log()
        with pytest.raises(InferenceServerException, match="values must be bool, int or str, not float"):
            client.infer("odd", [plan_input(httpclient, {"nan": True})])
        assert client.infer("odd", [plan_input(httpclient, {"log": True})]).as_numpy("OUT").tolist() == [1]
        with pytest.raises(InferenceServerException, match="bad name caf"):
            client.infer("odd", [plan_input(httpclient, {"raise": True})])
        s.wait_log("more characters cut")
        assert "file caf?" in s.log()
        assert "Python process died" not in s.log() and "SIGKILL" not in s.log(), s.log()[-2000:]


def test_is_cancelled_stays_true_once_the_client_left(tmp_path):
    models.python_model(str(tmp_path), "odd", ODD_TEXT, PLAN_IO)
    with Server(["--model-repository", str(tmp_path)]) as s:
        with pytest.raises(InferenceServerException, match="Deadline"):
            s.grpc_client().infer("odd", [plan_input(grpcclient, {"watch": True})], client_timeout=1)
        # Before, the request's flag went back to False once it was ended, and the sender's
        # never turned True for a model that is not decoupled (the watcher polls 30 times).
        seen = lambda: s.client().infer("odd", [plan_input(httpclient, {"seen": True})]).as_numpy("OUT").tolist()
        deadline = time.time() + 30
        while seen() != [1]:
            assert time.time() < deadline, "is_cancelled() did not stay true"
            time.sleep(0.2)
