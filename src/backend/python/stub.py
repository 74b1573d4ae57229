"""The process ferry starts for one instance of a Python model: loads model.py, answers ferry's
initialize / execute / finalize over a Unix socket, with tensors in shared memory (inputs in a
region ferry writes, outputs in one this process owns). BLS calls and log lines go back to ferry
over the same socket. Runs on any Python >= 3.9 with numpy."""
import asyncio
import collections
import gc
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
import time
import traceback
import weakref

import numpy as np

import triton_python_backend_utils as pb_utils


# Longest Logger message sent whole (as printed lines are cut at 16 KiB).
MAX_LOG_CHARS = 16 << 10


def encode(msg):
    """A message as strict JSON: NaN and infinities raise ValueError (no JSON has them), and text
    that is not valid Unicode (lone surrogates, from bytes decoded with surrogateescape) is sent
    with those characters replaced."""
    return json.dumps(msg, allow_nan=False, ensure_ascii=False).encode("utf-8", "replace")


# What a request whose client went away ends with, and how often held requests are checked.
CANCELLED = "Request was cancelled: its client went away"
HELD_CHECK_SECONDS = 0.5
REPLIES = frozenset(("infer_result", "control_result", "cancelled_result"))
# What a BLS stream may hold unread before it is cut (as ferry bounds a client's stream).
STREAM_BACKLOG, STREAM_BACKLOG_BYTES = 64, 64 << 20


class Channel:
    """Length-prefixed JSON messages, each followed by binary blobs. Whichever thread waits reads:
    the main thread when it waits for work, a thread blocked on a BLS call or a cancellation check
    when the main thread is busy, so the common path has no hand-off between threads."""

    def __init__(self, sock):
        self.sock = sock
        self.file = sock.makefile("rb")
        self.wlock = threading.Lock()
        # Re-entrant: a finalizer may run on a thread that holds it.
        self.cond = threading.Condition(threading.RLock())
        self.reading = self.closed = False
        self.seq = 0
        self.waiting = {}
        self.work = collections.deque()
        self.async_pending = 0
        self.streams_open = 0  # decoupled BLS calls not finished: their responses are read at once
        self.holding = {}  # async_exec's iterators waiting for their first response
        self.helper = None
        # BLS may run from initialize() on (in threads too) until finalize() begins.
        self.executing = False

    def send(self, msg, blobs=()):
        self.send_encoded(encode(msg), blobs)

    def send_encoded(self, body, blobs=()):
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
                    seq = msg.get("seq")
                    done = self.waiting.get(seq) if msg.get("more") else self.waiting.pop(seq, None)
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
        """Reads while asynchronous BLS calls or BLS streams are out (the main thread may be in
        its event loop, or busy in execute), so that ferry never waits to write them."""
        try:
            while True:
                with self.cond:
                    while not self.async_pending and not self.streams_open and not self.closed:
                        self.cond.wait()
                self.wait_for(lambda: not self.async_pending and not self.streams_open)
        except EOFError:
            return

    def _start_helper(self):  # under self.cond
        if self.helper is None:
            self.helper = threading.Thread(target=self._read_for_async, daemon=True)
            self.helper.start()
        self.cond.notify_all()

    # --- what triton_python_backend_utils calls ---
    def log(self, level, message):
        if len(message) > MAX_LOG_CHARS:
            message = f"{message[:MAX_LOG_CHARS]}… ({len(message) - MAX_LOG_CHARS} more characters cut)"
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

    def infer_stream(self, request, inputs):
        """A decoupled BLS call: an iterator of its responses, the last marked final. The
        channel holds the iterator weakly: one the model lets go of before the end cancels
        the call."""
        msg, blobs = bls_message(request, inputs)
        msg["decoupled"] = True
        iterator = ResponseIterator(self)
        ref = weakref.ref(iterator)

        def push(m, b):  # under self.cond
            it = ref()
            if it is not None:
                it._push(m, b)
            if not m.get("more"):
                self.streams_open -= 1

        with self.cond:
            self.streams_open += 1
            self._start_helper()
            self._call(msg, list(blobs), push)
            iterator.seq = msg["seq"]
        weakref.finalize(iterator, self._dropped, msg["seq"])
        return iterator

    def _dropped(self, seq):
        """A BLS stream's iterator is gone: the call is cancelled, what it still sends dropped."""
        with self.cond:
            if seq not in self.waiting:
                return
        self.cancel_later(seq)

    def cancel_later(self, seq):
        """Cancels a BLS stream from a thread of its own (the caller may hold any lock)."""
        def cancel():
            try:
                self.send({"op": "cancel_infer", "seq": seq})
            except OSError:
                pass
        threading.Thread(target=cancel, daemon=True).start()

    def response_message(self, handle, response, final):
        """A decoupled model's response as sent (None: only the final flag); raises when the
        response cannot be sent, before anything is."""
        meta, blobs, error, params = [], [], None, None
        if response is not None:
            for t in response.output_tensors():
                datatype, data = tensor_bytes(t)
                meta.append({"name": t.name(), "datatype": datatype, "shape": t.shape()})
                blobs.append(bytes(data))
            error, params = error_json(response), params_json(response)
        msg = {"op": "response", "handle": handle, "final": final, "empty": response is None,
               "outputs": meta, "error": error, "parameters": params}
        return encode(msg), blobs

    def respond(self, handle, response, final):
        self.send_encoded(*self.response_message(handle, response, final))

    def cancelled(self, handle):
        reply, _ = self._blocking({"op": "cancelled", "handle": handle})
        return bool(reply.get("cancelled"))

    def cancelled_in_batch(self, index):
        """Whether the client of the running batch's request `index` left."""
        reply, _ = self._blocking({"op": "cancelled", "index": index})
        return bool(reply.get("cancelled"))

    def control(self, msg):
        if not self.executing:
            # Only execute() is answered (initialize() would wait for the whole stub timeout).
            raise pb_utils.TritonModelException(f"{msg['op']} is only supported during the 'execute' function.")
        reply, _ = self._blocking({**msg, "op": "control", "call": msg["op"]})
        if reply.get("error"):
            raise pb_utils.TritonModelException(reply["error"])
        return reply


class ResponseIterator:
    """The responses of a decoupled BLS call, as they arrive; iterating again after the last one
    starts over from the first, as Triton's does."""

    def __init__(self, channel):
        self.channel, self.seq = channel, None
        self.pending, self.seen, self.finished, self.index = collections.deque(), [], False, 0
        self.pending_bytes = 0
        self.first = None

    def _push(self, msg, blobs):  # runs under channel.cond
        if self.finished:
            return
        size = sum(len(b) for b in blobs)
        self.pending.append((bls_response(msg, blobs), size))
        self.pending_bytes += size
        self.finished = not msg.get("more")
        if not self.finished and (len(self.pending) > STREAM_BACKLOG or self.pending_bytes > STREAM_BACKLOG_BYTES):
            # The model reads this stream too slowly: it ends here, as a client's would.
            self.finished = True
            self.pending.append((pb_utils.InferenceResponse(error=pb_utils.TritonError(
                f"the model fell behind reading this BLS stream by {STREAM_BACKLOG} responses or "
                f"{STREAM_BACKLOG_BYTES} bytes; the call was cancelled", pb_utils.TritonError.UNAVAILABLE)), 0))
            self.channel.cancel_later(self.seq)
        if self.first is not None:
            first, self.first = self.first, None
            first(self)

    def _on_first(self, done):
        """Calls done(self) once the first response is in (async_exec)."""
        channel = self.channel
        with channel.cond:
            if self.pending or self.finished:
                done(self)
                return
            channel.async_pending += 1
            # Held until then: nothing else holds an iterator that async_exec has not handed over.
            channel.holding[self.seq] = self

            def first(it):
                channel.async_pending -= 1
                channel.holding.pop(it.seq, None)
                done(it)

            self.first = first
            channel._start_helper()

    def __iter__(self):
        if self.finished and not self.pending and self.index >= len(self.seen):
            self.index = 0
        return self

    def __next__(self):
        if self.index < len(self.seen):
            self.index += 1
            return self.seen[self.index - 1]
        self.channel.wait_for(lambda: self.pending or self.finished)
        with self.channel.cond:
            if not self.pending:
                raise StopIteration
            response, size = self.pending.popleft()
            self.pending_bytes -= size
        self.seen.append(response)
        self.index = len(self.seen)
        return response

    def cancel(self):
        """Cancels the call: the model it calls sees its request cancelled."""
        if not self.finished and self.seq is not None:
            self.channel.send({"op": "cancel_infer", "seq": self.seq})


def tensor_bytes(t):
    if t._bf16:
        return "BF16", memoryview(np.ascontiguousarray(t._array).reshape(-1)).cast("B")
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
    try:
        code = int(err.code()) if hasattr(err, "code") else 1
    except (TypeError, ValueError):
        code = 1
    return {"message": str(err.message() if hasattr(err, "message") else err), "code": code}


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
    if datatype == "BF16":
        return pb_utils.Tensor._wrap_bf16(name, np.frombuffer(buf, dtype=np.uint16).reshape(shape))
    if datatype == "BYTES":
        count = int(np.prod(shape)) if shape else 1
        return pb_utils.Tensor(name, pb_utils.deserialize_bytes_tensor(buf, count).reshape(shape))
    return pb_utils.Tensor(name, np.frombuffer(buf, dtype=pb_utils.triton_string_to_numpy(datatype)).reshape(shape))


def bls_message(request, inputs):
    meta, blobs = [], []
    for t in inputs:
        datatype, data = tensor_bytes(t)
        meta.append({"name": t.name(), "datatype": datatype, "shape": t.shape()})
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


def describe(error):
    """An exception as a client reads it: its type and message."""
    return f"{type(error).__name__}: {error}"


def trace_of(error):
    return "".join(traceback.format_exception(type(error), error, error.__traceback__))


def rescheduled(requests):
    """The requests the model asked to run again (their flags reset for the next run)."""
    again = [r for r in requests if r.release_flags() == pb_utils.TRITONSERVER_REQUEST_RELEASE_RESCHEDULE]
    for r in again:
        r._release_flags = pb_utils.TRITONSERVER_REQUEST_RELEASE_ALL
    return again


class Stub:
    def __init__(self, channel):
        self.channel, self.model, self.inputs = channel, None, (None, None)
        # ferry names this process's regions (unguessable, removed by ferry when it ends).
        self.outputs = OutputRegion(f"{sys.argv[2]}-out" if len(sys.argv) > 2 else f"ferry-py-{os.getpid()}")
        self.loop = None
        self.identity = ("", -1)
        self.instance = ""
        self.background = set()

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

    def event_loop(self):
        if self.loop is None:
            self.loop = asyncio.new_event_loop()
            asyncio.set_event_loop(self.loop)
        return self.loop

    def initialize(self, msg):
        args = msg["args"]
        self.identity = (args.get("model_name", ""), int(args.get("model_version") or -1))
        self.instance = args.get("model_instance_name") or self.identity[0]
        self.model = self.load_module(msg["model_path"]).TritonPythonModel()
        if hasattr(self.model, "initialize"):
            done = self.model.initialize(msg["args"])
            if inspect.iscoroutine(done):
                self.event_loop().run_until_complete(done)
        self.channel.executing = True
        return {}

    def is_async(self):
        """Whether execute is a coroutine function: then the process runs an event loop and a
        decoupled model's batches run concurrently, as in Triton."""
        return inspect.iscoroutinefunction(getattr(self.model, "execute", None))

    def input_view(self, region):
        name, size = region
        if self.inputs[0] != name or self.inputs[1] is None or len(self.inputs[1]) < size:
            fd = os.open(f"/dev/shm/{name}", os.O_RDWR)
            try:
                self.inputs = (name, mmap.mmap(fd, size))
            finally:
                os.close(fd)
        return self.inputs[1]

    def requests_of(self, msg, decoupled):
        """The batch's requests, each with the box of what it is answered. Each request: [id,
        parameters, stream handle, requested outputs, inputs], each input [name, datatype,
        shape, offset, size] in the input region. A decoupled model's inputs are copied out of
        it: the model may read them after execute() returns, when the next batch is there."""
        described = msg["requests"]
        area = self.input_view(msg["region"]) if described else None
        frombuffer, dtypes, requests, boxes = np.frombuffer, NUMPY, [], []
        for index, (rid, params, handle, outputs, inputs) in enumerate(described):
            tensors = []
            for name, datatype, shape, offset, size in inputs:
                dtype = dtypes.get(datatype)
                if datatype == "BF16":
                    bits = frombuffer(area, np.uint16, size // 2, offset).reshape(shape)
                    tensors.append(pb_utils.Tensor._wrap_bf16(name, bits.copy() if decoupled else bits))
                elif dtype is None:
                    tensors.append(tensor_from(name, datatype, shape, memoryview(area)[offset:offset + size]))
                else:
                    array = frombuffer(area, dtype, size // dtype.itemsize, offset).reshape(shape)
                    tensors.append(pb_utils.Tensor._wrap(name, array.copy() if decoupled else array))
            box = pb_utils._Box(decoupled, handle, None if decoupled else index)
            boxes.append(box)
            requests.append(pb_utils.InferenceRequest._from_ferry(
                tensors, outputs, rid, params_text(params), box, sequence_of(params), self.identity))
        return requests, boxes

    def outcome(self, boxes, returned, requests):
        """What one run of execute() returned, checked and recorded; the error that fails the
        batch, if any."""
        if boxes and boxes[0].decoupled:
            return self.not_none() if returned is not None else None
        return self.record(boxes, returned, requests)

    def rerun(self, again):
        """Runs what the model rescheduled until it releases them (Triton requeues them; here
        they run again at once, on this instance)."""
        while again := self.without_gone(again):
            boxes = [r._slot.box for r in again]
            more, failed = self.run_once(again)
            if failed is None:
                failed = self.outcome(boxes, more, again)
            if failed is not None:
                self.fail(boxes, failed)
                return
            again = rescheduled(again)

    def run_once(self, requests):
        try:
            returned = self.model.execute(requests)
            if inspect.iscoroutine(returned):
                returned = self.event_loop().run_until_complete(returned)
            return returned, None
        except Exception as e:  # noqa: BLE001 - the model's error goes to its requests
            return None, e

    def not_none(self):
        return pb_utils.TritonModelException(
            f"Python model '{self.instance}' is using the decoupled mode and the execute function must return None.")

    def record(self, boxes, returned, requests):
        """Records the responses a non-decoupled execute() returned; the error that fails the
        batch, if the return breaks Triton's rules."""
        n = len(boxes)
        if returned is None:
            return None
        if not isinstance(returned, (list, tuple)):
            return pb_utils.TritonModelException(
                f"Expected a list in the execute return, found type '{type(returned)}'.")
        if len(returned) != n:
            return pb_utils.TritonModelException(
                "Number of InferenceResponse objects do not match the number of InferenceRequest objects. "
                f"InferenceRequest(s) size is:{n}, and InferenceResponse(s) size is:{len(returned)}")
        with pb_utils._STATE:
            for box, response, request in zip(boxes, returned, requests):
                if response is None:
                    continue
                if request.release_flags() == pb_utils.TRITONSERVER_REQUEST_RELEASE_RESCHEDULE:
                    return pb_utils.TritonModelException(
                        "Expected a None object in the execute function return list for reschduled request, "
                        f"found type '{type(response)}'.")
                if not isinstance(response, pb_utils.InferenceResponse):
                    return pb_utils.TritonModelException(
                        "Expected an 'InferenceResponse' object in the execute function return list, found type "
                        f"'{type(response)}'.")
                if box.count > 0:
                    return pb_utils.TritonModelException(
                        "Unable to send response. Non-decoupled model cannot send more than one response.")
                if box.closed:
                    return pb_utils.TritonModelException("Unable to send response. Response sender has been closed.")
                box.response, box.count, box.closed = response, 1, True
                pb_utils._settled(box)
        return None

    def fail(self, boxes, error):
        """The batch failed: logged as Triton logs it; every request not yet closed is closed
        (a decoupled one gets the error as its final response)."""
        text = f"Failed to process the request(s) for model '{self.instance}', message: {describe(error)}"
        self.channel.log("ERROR", text)
        self.channel.log("VERBOSE", trace_of(error))
        return self.close(boxes, text)

    def without_gone(self, again):
        """The rescheduled requests whose clients are still there; the others end cancelled, as
        Triton's queue drops them (a model that reschedules for ever holds its instance only
        while someone waits)."""
        gone = [r for r in again if r.is_cancelled()]
        if gone:
            self.close([r._slot.box for r in gone], CANCELLED)
        return [r for r in again if not any(r is g for g in gone)]

    def await_held(self, boxes):
        """Waits for the responses of requests the model kept past execute(); one whose client
        went away ends cancelled (a model that never answers holds its instance no longer than
        its clients wait)."""
        while True:
            with pb_utils._STATE:
                if all(b.done() for b in boxes):
                    return
                pb_utils._STATE.wait(timeout=HELD_CHECK_SECONDS)
                pending = [b for b in boxes if not b.done() and b.index is not None]
            gone = [b for b in pending if self.channel.cancelled_in_batch(b.index)]
            if gone:
                self.close(gone, CANCELLED)

    def close(self, boxes, text):
        """Closes every box not yet closed with the error `text`."""
        with pb_utils._STATE:
            for box in boxes:
                box.cancelled = box.cancelled or text == CANCELLED
                if box.closed:
                    continue
                box.closed, box.error = True, text
                if box.decoupled:
                    failed = pb_utils.InferenceResponse(error=pb_utils.TritonError(text))
                    self.channel.respond(box.handle, failed, True)
                pb_utils._settled(box)
        return text

    def settle_decoupled(self, boxes, error):
        if error is not None:
            self.fail(boxes, error)
        for box in boxes:
            pb_utils._ran(box)
        if not all(b.done() for b in boxes):
            gc.collect(1)  # a request dropped in a young cycle ends now, not at some later collection
        return {"decoupled": True}

    def execute(self, msg):
        decoupled = bool(msg.get("decoupled"))
        requests, boxes = self.requests_of(msg, decoupled)
        returned, error = self.run_once(requests)
        if error is None:
            error = self.outcome(boxes, returned, requests)
        if error is None:
            self.rerun(rescheduled(requests))
        del requests, returned
        if decoupled:
            return self.settle_decoupled(boxes, error)
        if error is None and not all(b.done() for b in boxes):
            gc.collect()  # requests the model let go of in a cycle are abandoned now
            self.await_held(boxes)
        return self.answers(boxes, error)

    async def execute_async(self, msg):
        decoupled = bool(msg.get("decoupled"))
        requests, boxes = self.requests_of(msg, decoupled)
        pending, error = None, None
        try:
            pending = self.model.execute(requests)
        except Exception as e:  # noqa: BLE001
            error = e
        if decoupled and error is None and inspect.iscoroutine(pending):
            # Not awaited: the next batch may start while this one runs.
            self.in_background(pending, requests, boxes)
            return {"decoupled": True}
        returned = None
        if error is None:
            try:
                returned = await pending if inspect.iscoroutine(pending) else pending
            except Exception as e:  # noqa: BLE001
                error = e
        if error is None:
            error = self.outcome(boxes, returned, requests)
        again = rescheduled(requests) if error is None else []
        while again := self.without_gone(again):
            again_boxes = [r._slot.box for r in again]
            more, failed = None, None
            try:
                more = self.model.execute(again)
                more = await more if inspect.iscoroutine(more) else more
                failed = self.outcome(again_boxes, more, again)
            except Exception as e:  # noqa: BLE001
                failed = e
            if failed is not None:
                self.fail(again_boxes, failed)
                break
            again = rescheduled(again)
        del requests, returned, pending
        if decoupled:
            return self.settle_decoupled(boxes, error)
        if error is None and not all(b.done() for b in boxes):
            gc.collect()
            loop, settled = asyncio.get_running_loop(), asyncio.Event()

            def check():
                if all(b.done() for b in boxes):
                    settled.set()

            with pb_utils._STATE:
                for b in boxes:
                    b.on_done = lambda: loop.call_soon_threadsafe(check)
            check()
            while not settled.is_set():
                try:
                    await asyncio.wait_for(settled.wait(), HELD_CHECK_SECONDS)
                except asyncio.TimeoutError:
                    gone = [b for b in boxes
                            if not b.done() and b.index is not None and self.channel.cancelled_in_batch(b.index)]
                    self.close(gone, CANCELLED)
        return self.answers(boxes, error)

    def in_background(self, coroutine, requests, boxes):
        task = asyncio.ensure_future(coroutine)
        self.background.add(task)
        task.add_done_callback(lambda t: self.background_done(t, requests, boxes))

    def background_done(self, task, requests, boxes):
        """A decoupled coroutine ended: its error closes what it left open; what it
        rescheduled runs again."""
        self.background.discard(task)
        error = None if task.cancelled() else task.exception()
        if task.cancelled():
            error = pb_utils.TritonModelException("the model's coroutine was cancelled")
        elif error is None:
            error = self.outcome(boxes, task.result(), requests)
        again = self.without_gone(rescheduled(requests)) if error is None else []
        del task
        if again:
            try:
                more = self.model.execute(again)
            except Exception as e:  # noqa: BLE001
                more, error = None, e
            if inspect.iscoroutine(more):
                self.in_background(more, again, [r._slot.box for r in again])
            elif error is None and more is not None:
                error = self.not_none()
        del requests, again
        self.settle_decoupled(boxes, error)

    def answers(self, boxes, error):
        """The reply for a non-decoupled batch once every request is settled."""
        if error is not None:
            if not any(b.response is not None for b in boxes):
                self.fail(boxes, error)
                return {"error": describe(error), "trace": trace_of(error), "instance": self.instance}
            text = self.fail(boxes, error)
            failed = {"message": text, "code": 1}
            return self.write_responses([b.response if b.response is not None else failed for b in boxes])
        missing = {"message": f"model '{self.identity[0]}': execute() gave no response for this request (it returned "
                              "None for it and its response sender sent none)", "code": 1}
        return self.write_responses([b.response if b.response is not None else
                                     {"message": b.error, "code": 1} if b.error else missing for b in boxes])

    def write_responses(self, responses):
        """Outputs go to this process's region; each response is [outputs, error, parameters],
        each output [name, datatype, shape, offset, size]. An item that is a dict is an error."""
        packed, total = [], 0
        for resp in responses:
            outs = []
            for t in (resp.output_tensors() if not isinstance(resp, dict) else ()):
                array = t._array
                datatype = None if t._bf16 else WIRE.get(array.dtype)
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
            if isinstance(resp, dict):
                out.append([meta, resp, None])
                continue
            out.append([meta, error_json(resp), params_json(resp)])
        return {"region": [self.outputs.name, self.outputs.size], "responses": out}

    def finalize(self, msg):
        self.channel.executing = False
        if self.model is not None and hasattr(self.model, "finalize"):
            try:
                done = self.model.finalize()
                if inspect.iscoroutine(done):
                    self.event_loop().run_until_complete(done)
            except Exception as e:  # noqa: BLE001 - logged with the model's own message
                self.channel.log("ERROR", f"Failed to finalize model '{self.identity[0]}': {describe(e)}")
                self.channel.log("VERBOSE", trace_of(e))
                raise
        return {}

    # --- a model whose execute is a coroutine function: an event loop runs in this thread ---
    def serve_async(self):
        loop, channel = self.event_loop(), self.channel

        def read():
            while True:
                try:
                    msg = channel.next_work()
                except EOFError:
                    loop.call_soon_threadsafe(self.dispatch, {"op": "finalize", "eof": True})
                    return
                loop.call_soon_threadsafe(self.dispatch, msg)
                if msg.get("op") == "finalize":
                    return

        threading.Thread(target=read, daemon=True).start()
        loop.run_forever()

    def dispatch(self, msg):
        self.loop.create_task(self.handle_async(msg))

    async def handle_async(self, msg):
        op = msg["op"]
        try:
            if op == "execute":
                reply = await self.execute_async(msg)
            elif op == "finalize":
                if self.background:
                    await asyncio.wait(list(self.background), timeout=5)
                reply = self.finalize(msg)
            else:
                raise pb_utils.TritonModelException(f"unexpected call '{op}'")
            reply["op"] = "done"
        except Exception as e:  # noqa: BLE001 - every failure goes back to ferry, named
            reply = {"op": "done", "error": describe(e), "trace": trace_of(e)}
        if not msg.get("eof"):
            reply_safely(self.channel, reply)
        if op == "finalize":
            self.loop.stop()


def watch_parent():
    """Ends this process when ferry is gone (killed before it could stop it): a model busy in
    execute() never reads the socket that would say so."""
    parent = os.getppid()
    while True:
        time.sleep(1)
        if os.getppid() != parent:
            os._exit(1)


def reply_safely(channel, reply):
    """Sends a reply; one that cannot be encoded (an object the model put in it) becomes an error."""
    try:
        body = encode(reply)
    except (TypeError, ValueError) as e:
        body = encode({"op": "done", "error": f"the model's reply cannot be sent: {describe(e)}"})
    channel.send_encoded(body)


def main():
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(sys.argv[1])
    threading.Thread(target=watch_parent, daemon=True).start()
    channel = Channel(sock)
    pb_utils._CHANNEL = channel
    stub = Stub(channel)
    # The model sees no arguments of ferry's (unittest.main() and argparse in a model read them).
    sys.argv = [""]
    try:
        while True:
            try:
                msg = channel.next_work()
            except EOFError:
                try:
                    stub.finalize({})
                except Exception:  # noqa: BLE001 - logged by finalize
                    pass
                break
            op = msg["op"]
            try:
                reply = getattr(stub, op)(msg)
                reply["op"] = "done"
            except Exception as e:  # noqa: BLE001 - every failure goes back to ferry, named
                reply = {"op": "done", "error": describe(e), "trace": trace_of(e)}
            reply_safely(channel, reply)
            if op in ("finalize", "auto_complete"):
                break
            if op == "initialize" and "error" not in reply and stub.is_async():
                stub.serve_async()
                break
    finally:
        stub.outputs.drop()


if __name__ == "__main__":
    main()
