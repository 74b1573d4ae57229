"""The process ferry starts for one instance of a Python model: loads model.py, answers ferry's
initialize / execute / finalize over a Unix socket, with tensors in shared memory (inputs in a
region ferry writes, outputs in one this process owns). BLS calls and log lines go back to ferry
over the same socket. Runs on any Python >= 3.9 with numpy."""
import asyncio
import importlib.util
import inspect
import json
import mmap
import os
import queue
import socket
import struct
import sys
import threading
import traceback

import numpy as np

import triton_python_backend_utils as pb_utils


class Channel:
    """Length-prefixed JSON messages, each followed by binary blobs."""

    def __init__(self, sock):
        self.sock = sock
        self.lock = threading.Lock()
        self.seq = 0
        self.waiting = {}

    def send(self, msg, blobs=()):
        body = json.dumps(msg).encode()
        parts = [struct.pack("<I", len(body)), body, struct.pack("<I", len(blobs))]
        for b in blobs:
            parts.append(struct.pack("<Q", len(b)))
            parts.append(b)
        with self.lock:
            for p in parts:
                self.sock.sendall(p)

    def _exact(self, n):
        buf = bytearray(n)
        view, got = memoryview(buf), 0
        while got < n:
            k = self.sock.recv_into(view[got:], n - got)
            if k == 0:
                raise EOFError("ferry closed the channel")
            got += k
        return buf

    def recv(self):
        (n,) = struct.unpack("<I", self._exact(4))
        msg = json.loads(self._exact(n))
        (count,) = struct.unpack("<I", self._exact(4))
        blobs = []
        for _ in range(count):
            (size,) = struct.unpack("<Q", self._exact(8))
            blobs.append(self._exact(size))
        return msg, blobs

    def _call(self, msg, blobs, done):
        with self.lock:
            self.seq += 1
            seq = self.seq
            self.waiting[seq] = done
        msg["seq"] = seq
        self.send(msg, blobs)

    def resolve(self, msg, blobs):
        done = self.waiting.pop(msg.get("seq"), None)
        if done is not None:
            done(msg, blobs)

    def _blocking(self, msg, blobs=()):
        box, ready = [], threading.Event()
        self._call(msg, list(blobs), lambda m, b: (box.append((m, b)), ready.set()))
        ready.wait()
        return box[0]

    # --- what triton_python_backend_utils calls ---
    def log(self, level, message):
        self.send({"op": "log", "level": level, "message": message})

    def infer(self, request, inputs):
        msg, blobs = self._blocking(*bls_message(request, inputs))
        return bls_response(msg, blobs)

    def infer_async(self, request, inputs, done):
        msg, blobs = bls_message(request, inputs)
        self._call(msg, blobs, lambda m, b: done(bls_response(m, b)))

    def respond(self, handle, response, final):
        """A decoupled model's response (None: only the final flag)."""
        meta, blobs, error = [], [], None
        if response is not None:
            for t in response.output_tensors():
                datatype, data = tensor_bytes(t)
                meta.append({"name": t.name(), "datatype": datatype, "shape": list(t.as_numpy().shape)})
                blobs.append(bytes(data))
            err = response.error()
            if err is not None:
                error = {"message": err.message() if hasattr(err, "message") else str(err),
                         "code": err.code() if hasattr(err, "code") else 1}
        self.send({"op": "response", "handle": handle, "final": final, "empty": response is None,
                   "outputs": meta, "error": error}, blobs)

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
    array = np.ascontiguousarray(array)
    return pb_utils.numpy_to_triton_type(array.dtype), memoryview(array).cast("B")


def params_text(params):
    return json.dumps(params) if params else "{}"


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
        self.outputs = OutputRegion(f"ferry-py-{os.getpid()}")
        self.loop = None

    def load_module(self, path):
        sys.path.insert(0, os.path.dirname(path))
        spec = importlib.util.spec_from_file_location("ferry_user_model", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module

    def auto_complete(self, msg):
        cls = self.load_module(msg["model_path"]).TritonPythonModel
        config = pb_utils.ModelConfig(msg["config"])
        if hasattr(cls, "auto_complete_config"):
            config = cls.auto_complete_config(config)
        return {"config": config.as_dict()}

    def initialize(self, msg):
        self.model = self.load_module(msg["model_path"]).TritonPythonModel()
        if hasattr(self.model, "initialize"):
            self.model.initialize(msg["args"])
        return {}

    def input_view(self, region):
        name, size = region["name"], region["size"]
        if self.inputs[0] != name or self.inputs[1] is None or len(self.inputs[1]) < size:
            fd = os.open(f"/dev/shm/{name}", os.O_RDWR)
            try:
                self.inputs = (name, mmap.mmap(fd, size))
            finally:
                os.close(fd)
        return self.inputs[1]

    def execute(self, msg):
        area = self.input_view(msg["region"]) if msg["requests"] and msg.get("region") else None
        requests = []
        for r in msg["requests"]:
            tensors = []
            for t in r["inputs"]:
                buf = memoryview(area)[t["offset"]:t["offset"] + t["size"]]
                tensors.append(tensor_from(t["name"], t["datatype"], t["shape"], buf))
            request = pb_utils.InferenceRequest(
                inputs=tensors, requested_output_names=r["outputs"], request_id=r.get("id", ""),
                correlation_id=r.get("correlation_id", 0), parameters=params_text(r.get("parameters")))
            request._handle = r.get("handle")
            requests.append(request)
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
        packed, total = [], 0
        for resp in responses:
            outs = []
            for t in (resp.output_tensors() if resp is not None else []):
                datatype, data = tensor_bytes(t)
                outs.append((t.name(), datatype, list(t.as_numpy().shape), data))
                total += (len(data) + 7) // 8 * 8
            packed.append((resp, outs))
        self.outputs.ensure(max(total, 1))
        out, at = [], 0
        for resp, outs in packed:
            meta = []
            for name, datatype, shape, data in outs:
                self.outputs.map[at:at + len(data)] = data
                meta.append({"name": name, "datatype": datatype, "shape": shape, "offset": at, "size": len(data)})
                at += (len(data) + 7) // 8 * 8
            err = resp.error() if resp is not None else pb_utils.TritonError("execute() returned None for this request")
            error = {"message": err.message() if hasattr(err, "message") else str(err),
                     "code": err.code() if hasattr(err, "code") else 1} if err is not None else None
            params = resp.parameters() if resp is not None else ""
            out.append({"outputs": meta, "error": error, "parameters": json.loads(params) if params not in ("", "{}") else {}})
        return {"region": {"name": self.outputs.name, "size": self.outputs.size}, "responses": out}

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
    work = queue.Queue()

    def read():
        try:
            while True:
                msg, blobs = channel.recv()
                if msg["op"] in ("infer_result", "control_result", "cancelled_result"):
                    channel.resolve(msg, blobs)
                else:
                    work.put(msg)
        except (EOFError, OSError):
            work.put({"op": "finalize", "gone": True})

    threading.Thread(target=read, daemon=True).start()
    try:
        while True:
            msg = work.get()
            op = msg["op"]
            try:
                reply = getattr(stub, op)(msg)
                reply["op"] = "done"
            except Exception as e:  # noqa: BLE001 - every failure goes back to ferry, named
                reply = {"op": "done", "error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()}
            if msg.get("gone"):
                break
            channel.send(reply)
            if op in ("finalize", "auto_complete"):
                break
    finally:
        stub.outputs.drop()


if __name__ == "__main__":
    main()
