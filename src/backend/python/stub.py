"""The process ferry starts for one instance of a Python model: loads model.py, answers ferry's
initialize / execute / finalize over a Unix socket, with tensors in shared memory (inputs in a
region ferry writes, outputs in one this process owns). BLS calls and log lines go back to ferry
over the same socket. Runs on any Python >= 3.9 with numpy."""
import asyncio
import collections
import importlib.machinery
import importlib.util
import inspect
import json
import mmap
import os
import socket
import struct
import sys
import threading
import traceback

import numpy as np

import triton_python_backend_utils as pb_utils


REPLIES = frozenset(("infer_result", "control_result", "cancelled_result"))


class Channel:
    """Length-prefixed JSON messages, each followed by binary blobs. Whichever thread waits reads:
    the main thread when it waits for work, a thread blocked on a BLS call or a cancellation check
    when the main thread is busy, so the common path has no hand-off between threads."""

    def __init__(self, sock):
        self.sock = sock
        self.file = sock.makefile("rb")
        self.wlock = threading.Lock()
        self.cond = threading.Condition(threading.Lock())
        self.reading = self.closed = False
        self.seq = 0
        self.waiting = {}
        self.work = collections.deque()
        self.async_pending = 0
        self.helper = None

    def send(self, msg, blobs=()):
        body = json.dumps(msg).encode()
        parts = [struct.pack("<I", len(body)), body, struct.pack("<I", len(blobs))]
        for b in blobs:
            parts.append(struct.pack("<Q", len(b)))
            parts.append(b)
        data = b"".join(parts) if sum(len(p) for p in parts) < (1 << 16) else None
        with self.wlock:
            if data is not None:
                self.sock.sendall(data)
            else:
                for p in parts:
                    self.sock.sendall(p)

    def _exact(self, n):
        data = self.file.read(n)
        if len(data) != n:
            raise EOFError("ferry closed the channel")
        return data

    def _read_one(self):
        (n,) = struct.unpack("<I", self._exact(4))
        msg = json.loads(self._exact(n))
        (count,) = struct.unpack("<I", self._exact(4))
        blobs = []
        for _ in range(count):
            (size,) = struct.unpack("<Q", self._exact(8))
            blobs.append(self._exact(size))
        return msg, blobs

    def wait_for(self, ready):
        """Returns once ready() holds (checked under the lock); reads the socket meanwhile when
        no other thread does. EOFError once ferry is gone."""
        cond = self.cond
        while True:
            with cond:
                while not ready():
                    if self.closed:
                        raise EOFError("ferry closed the channel")
                    if not self.reading:
                        self.reading = True
                        break
                    cond.wait()
                else:
                    return
            try:
                msg, blobs = self._read_one()
            except (EOFError, OSError, ValueError):
                with cond:
                    self.reading, self.closed = False, True
                    cond.notify_all()
                raise EOFError("ferry closed the channel") from None
            with cond:
                self.reading = False
                if msg.get("op") in REPLIES:
                    done = self.waiting.pop(msg.get("seq"), None)
                    try:
                        if done is not None:
                            done(msg, blobs)
                    except Exception:  # noqa: BLE001 - a failing callback must not stop this reader
                        traceback.print_exc()
                else:
                    self.work.append(msg)
                cond.notify_all()

    def next_work(self):
        self.wait_for(lambda: self.work)
        with self.cond:
            return self.work.popleft()

    def _call(self, msg, blobs, done):
        with self.cond:
            self.seq += 1
            seq = self.seq
            self.waiting[seq] = done
        msg["seq"] = seq
        self.send(msg, blobs)

    def _blocking(self, msg, blobs=()):
        box = []
        self._call(msg, list(blobs), lambda m, b: box.append((m, b)))
        self.wait_for(lambda: box)
        return box[0]

    def _read_for_async(self):
        """Reads while asynchronous BLS calls are out (the main thread is in its event loop)."""
        try:
            while True:
                with self.cond:
                    while not self.async_pending and not self.closed:
                        self.cond.wait()
                self.wait_for(lambda: not self.async_pending)
        except EOFError:
            return

    # --- what triton_python_backend_utils calls ---
    def log(self, level, message):
        self.send({"op": "log", "level": level, "message": message})

    def infer(self, request, inputs):
        msg, blobs = self._blocking(*bls_message(request, inputs))
        return bls_response(msg, blobs)

    def infer_async(self, request, inputs, done):
        msg, blobs = bls_message(request, inputs)

        def finished(m, b):  # runs under self.cond
            self.async_pending -= 1
            done(bls_response(m, b))

        with self.cond:
            self.async_pending += 1
            if self.helper is None:
                self.helper = threading.Thread(target=self._read_for_async, daemon=True)
                self.helper.start()
            self.cond.notify_all()
        self._call(msg, blobs, finished)

    def respond(self, handle, response, final):
        """A decoupled model's response (None: only the final flag)."""
        meta, blobs, error, params = [], [], None, None
        if response is not None:
            for t in response.output_tensors():
                datatype, data = tensor_bytes(t)
                meta.append({"name": t.name(), "datatype": datatype, "shape": list(t.as_numpy().shape)})
                blobs.append(bytes(data))
            error, params = error_json(response), params_json(response)
        self.send({"op": "response", "handle": handle, "final": final, "empty": response is None,
                   "outputs": meta, "error": error, "parameters": params}, blobs)

    def cancelled(self, handle):
        reply, _ = self._blocking({"op": "cancelled", "handle": handle})
        return bool(reply.get("cancelled"))

    def control(self, msg):
        reply, _ = self._blocking({"op": "control", **msg})
        if reply.get("error"):
            raise pb_utils.TritonModelException(reply["error"])
        return reply


def tensor_bytes(t):
    array = t.as_numpy()
    if array.dtype == np.object_ or array.dtype.kind in ("S", "U"):
        return "BYTES", pb_utils.serialize_byte_tensor(array)
    array = np.ascontiguousarray(array).reshape(-1)
    return pb_utils._wire_type(array.dtype), memoryview(array).cast("B")


NUMPY = {k: np.dtype(v) for k, v in pb_utils._NP.items() if k != "BYTES"}
WIRE = {v: k for k, v in NUMPY.items()}


def error_json(response):
    """A response's error as ferry reads it, or None."""
    err = response.error()
    if err is None:
        return None
    return {"message": err.message() if hasattr(err, "message") else str(err),
            "code": err.code() if hasattr(err, "code") else 1}


def params_json(response):
    """A response's parameters as an object, or None when it has none."""
    text = response.parameters()
    return json.loads(text) if text not in ("", "{}") else None


def params_text(params):
    return json.dumps(params) if params else "{}"


def sequence_of(params):
    """A request's correlation id and flags (START 1, END 2), from its sequence parameters."""
    if not params or "sequence_id" not in params:
        return 0, 0
    flags = (pb_utils.TRITONSERVER_REQUEST_FLAG_SEQUENCE_START if params.get("sequence_start") else 0) | \
            (pb_utils.TRITONSERVER_REQUEST_FLAG_SEQUENCE_END if params.get("sequence_end") else 0)
    return params["sequence_id"], flags


def tensor_from(name, datatype, shape, buf):
    if datatype == "BYTES":
        count = int(np.prod(shape)) if shape else 1
        return pb_utils.Tensor(name, pb_utils.deserialize_bytes_tensor(buf, count).reshape(shape))
    return pb_utils.Tensor(name, np.frombuffer(buf, dtype=pb_utils.triton_string_to_numpy(datatype)).reshape(shape))


def bls_message(request, inputs):
    meta, blobs = [], []
    for t in inputs:
        datatype, data = tensor_bytes(t)
        meta.append({"name": t.name(), "datatype": datatype, "shape": list(t.as_numpy().shape)})
        blobs.append(bytes(data))
    return {"op": "infer", "request": {**request, "inputs": meta}}, blobs


def bls_response(msg, blobs):
    if msg.get("error"):
        err = msg["error"]
        return pb_utils.InferenceResponse(error=pb_utils.TritonError(err["message"], err.get("code", 1)))
    outs = [tensor_from(o["name"], o["datatype"], o["shape"], bytes(b)) for o, b in zip(msg["outputs"], blobs)]
    return pb_utils.InferenceResponse(outs, parameters=msg.get("parameters") or {})


class OutputRegion:
    """Shared memory this process owns, where response tensors go; grown by replacing it."""

    def __init__(self, prefix):
        self.prefix, self.gen, self.name, self.size, self.map = prefix, 0, None, 0, None

    def ensure(self, size):
        if size <= self.size:
            return
        size = max(size, 2 * self.size, 1 << 20)
        self.gen += 1
        name = f"{self.prefix}-{self.gen}"
        fd = os.open(f"/dev/shm/{name}", os.O_CREAT | os.O_RDWR | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, size)
            new = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self.drop()
        self.name, self.size, self.map = name, size, new

    def drop(self):
        if self.name:
            try:
                os.unlink(f"/dev/shm/{self.name}")
            except FileNotFoundError:
                pass


class Stub:
    def __init__(self, channel):
        self.channel, self.model, self.inputs = channel, None, (None, None)
        # ferry names this process's regions (unguessable, removed by ferry when it ends).
        self.outputs = OutputRegion(f"{sys.argv[2]}-out" if len(sys.argv) > 2 else f"ferry-py-{os.getpid()}")
        self.loop = None
        self.identity = ("", -1)

    def load_module(self, path):
        """model.py as Triton loads it: its folder on sys.path (`import sibling`) and the module
        inside a package of that folder (`from . import sibling`)."""
        folder = os.path.dirname(os.path.abspath(path))
        sys.path.insert(0, folder)
        package = "ferry_model"
        holder = importlib.util.module_from_spec(importlib.machinery.ModuleSpec(package, None, is_package=True))
        holder.__path__ = [folder]
        sys.modules[package] = holder
        name = f"{package}.{os.path.splitext(os.path.basename(path))[0]}"
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
        return module

    def auto_complete(self, msg):
        cls = self.load_module(msg["model_path"]).TritonPythonModel
        config = pb_utils.ModelConfig(msg["config"])
        if hasattr(cls, "auto_complete_config"):
            config = cls.auto_complete_config(config)
        return {"config": config.as_dict()}

    def initialize(self, msg):
        args = msg["args"]
        self.identity = (args.get("model_name", ""), int(args.get("model_version") or -1))
        self.model = self.load_module(msg["model_path"]).TritonPythonModel()
        if hasattr(self.model, "initialize"):
            self.model.initialize(msg["args"])
        return {}

    def input_view(self, region):
        name, size = region
        if self.inputs[0] != name or self.inputs[1] is None or len(self.inputs[1]) < size:
            fd = os.open(f"/dev/shm/{name}", os.O_RDWR)
            try:
                self.inputs = (name, mmap.mmap(fd, size))
            finally:
                os.close(fd)
        return self.inputs[1]

    def execute(self, msg):
        """Runs one batch. Each request: [id, parameters, stream handle, requested outputs,
        inputs], each input [name, datatype, shape, offset, size] in the input region."""
        described = msg["requests"]
        area = self.input_view(msg["region"]) if described else None
        frombuffer, dtypes, requests = np.frombuffer, NUMPY, []
        for rid, params, handle, outputs, inputs in described:
            tensors = []
            for name, datatype, shape, offset, size in inputs:
                dtype = dtypes.get(datatype)
                if dtype is None:
                    tensors.append(tensor_from(name, datatype, shape, memoryview(area)[offset:offset + size]))
                else:
                    tensors.append(pb_utils.Tensor._wrap(name, frombuffer(area, dtype, size // dtype.itemsize, offset).reshape(shape)))
            requests.append(pb_utils.InferenceRequest._from_ferry(
                tensors, outputs, rid, params_text(params), handle, sequence_of(params), self.identity))
        responses = self.model.execute(requests)
        if inspect.iscoroutine(responses):
            if self.loop is None:
                self.loop = asyncio.new_event_loop()
            responses = self.loop.run_until_complete(responses)
        if msg.get("decoupled"):
            # Responses go through each request's sender, now or later.
            return {"decoupled": True}
        if responses is None or len(responses) != len(requests):
            got = "None" if responses is None else len(responses)
            raise pb_utils.TritonModelException(
                f"execute() returned {got} responses for {len(requests)} requests; return one per request")
        return self.write_responses(responses)

    def write_responses(self, responses):
        """Outputs go to this process's region; each response is [outputs, error, parameters],
        each output [name, datatype, shape, offset, size]."""
        packed, total = [], 0
        for resp in responses:
            outs = []
            for t in (resp.output_tensors() if resp is not None else ()):
                array = t.as_numpy()
                datatype = WIRE.get(array.dtype)
                if datatype is None:
                    datatype, data = tensor_bytes(t)
                else:
                    data = np.ascontiguousarray(array).reshape(-1)
                size = data.nbytes if datatype != "BYTES" else len(data)
                outs.append((t.name(), datatype, list(array.shape), data, size))
                total += (size + 7) & ~7
            packed.append((resp, outs))
        self.outputs.ensure(max(total, 1))
        area, out, at = self.outputs.map, [], 0
        for resp, outs in packed:
            meta = []
            for name, datatype, shape, data, size in outs:
                area[at:at + size] = data
                meta.append([name, datatype, shape, at, size])
                at += (size + 7) & ~7
            if resp is None:
                out.append([meta, {"message": "execute() returned None for this request", "code": 1}, None])
                continue
            out.append([meta, error_json(resp), params_json(resp)])
        return {"region": [self.outputs.name, self.outputs.size], "responses": out}

    def finalize(self, msg):
        if self.model is not None and hasattr(self.model, "finalize"):
            self.model.finalize()
        return {}


def main():
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(sys.argv[1])
    channel = Channel(sock)
    pb_utils._CHANNEL = channel
    stub = Stub(channel)
    try:
        while True:
            try:
                msg = channel.next_work()
            except EOFError:
                stub.finalize({})
                break
            op = msg["op"]
            try:
                reply = getattr(stub, op)(msg)
                reply["op"] = "done"
            except Exception as e:  # noqa: BLE001 - every failure goes back to ferry, named
                reply = {"op": "done", "error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()}
            channel.send(reply)
            if op in ("finalize", "auto_complete"):
                break
    finally:
        stub.outputs.drop()


if __name__ == "__main__":
    main()
