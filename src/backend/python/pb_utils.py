"""triton_python_backend_utils as ferry provides it: Triton's Python-model API (tensors, requests,
responses, errors, logging, BLS and model control), talking to ferry through the stub's channel.
Written for ferry from Triton's documented API; any Python >= 3.9 with numpy."""
import json
import struct
import threading

import numpy as np

TRITONSERVER_REQUEST_FLAG_SEQUENCE_START = 1
TRITONSERVER_REQUEST_FLAG_SEQUENCE_END = 2
TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1
TRITONSERVER_REQUEST_RELEASE_ALL = 1
TRITONSERVER_REQUEST_RELEASE_RESCHEDULE = 2

_NP = {
    "BOOL": np.bool_, "UINT8": np.uint8, "UINT16": np.uint16, "UINT32": np.uint32, "UINT64": np.uint64,
    "INT8": np.int8, "INT16": np.int16, "INT32": np.int32, "INT64": np.int64,
    "FP16": np.float16, "FP32": np.float32, "FP64": np.float64, "BYTES": np.object_,
}
_CHANNEL = None  # set by the stub: sends messages to ferry and waits for replies

TRITON_STRING_TO_NUMPY = {("TYPE_STRING" if k == "BYTES" else "TYPE_" + k): (bool if k == "BOOL" else v)
                          for k, v in _NP.items()}
# TRITONSERVER_DataType's values, as Triton's numpy_to_triton_type and Tensor.triton_dtype give them.
_CODES = ["BOOL", "UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64", "FP16", "FP32", "FP64",
          "BYTES"]


def triton_string_to_numpy(triton_type):
    name = triton_type[5:] if triton_type.startswith("TYPE_") else triton_type
    if name == "STRING":
        name = "BYTES"
    return _NP[name]


_BY_DTYPE = {np.dtype(v): k for k, v in _NP.items() if v is not np.object_}


def _wire_type(dtype):
    """The protocol's name of a numpy dtype (FP32, BYTES, ...)."""
    dtype = np.dtype(dtype)
    found = _BY_DTYPE.get(dtype)
    if found is not None:
        return found
    if dtype.kind in ("O", "S", "U"):
        return "BYTES"
    raise TritonModelException(f"numpy dtype {dtype} has no Triton datatype")


def numpy_to_triton_type(data_type):
    """TRITONSERVER_DataType's value of a numpy type (1 BOOL ... 11 FP32, 12 FP64, 13 BYTES), or
    None, as Triton's."""
    try:
        return _CODES.index(_wire_type(data_type)) + 1
    except (TritonModelException, TypeError):
        return None


def triton_to_numpy_type(data_type):
    """The numpy type of a TRITONSERVER_DataType value, or None."""
    if isinstance(data_type, int) and 1 <= data_type <= len(_CODES):
        return _NP[_CODES[data_type - 1]]
    return None


def using_decoupled_model_transaction_policy(model_config):
    """Whether the model (its config, as a dict) is decoupled."""
    policy = model_config.get("model_transaction_policy") or {}
    return bool(policy.get("decoupled", False))


def serialize_byte_tensor(array):
    out = bytearray()
    for item in np.asarray(array, dtype=np.object_).reshape(-1):
        b = item if isinstance(item, bytes) else str(item).encode() if not isinstance(item, (bytearray, memoryview)) else bytes(item)
        out += struct.pack("<I", len(b))
        out += b
    return bytes(out)


def deserialize_bytes_tensor(buf, count=None):
    items, pos, view = [], 0, memoryview(buf)
    while pos < len(view) and (count is None or len(items) < count):
        (n,) = struct.unpack_from("<I", view, pos)
        items.append(bytes(view[pos + 4:pos + 4 + n]))
        pos += 4 + n
    return np.array(items, dtype=np.object_)


class TritonError(Exception):
    UNKNOWN, INTERNAL, NOT_FOUND, INVALID_ARG, UNAVAILABLE, UNSUPPORTED, ALREADY_EXISTS, CANCELLED = range(8)
    _NAMES = ["UNKNOWN", "INTERNAL", "NOT_FOUND", "INVALID_ARG", "UNAVAILABLE", "UNSUPPORTED", "ALREADY_EXISTS",
              "CANCELLED"]

    def __init__(self, message, code=INTERNAL):
        if not isinstance(code, int) or isinstance(code, bool):
            raise TypeError(f"TritonError code must be one of TritonError's codes (an int), not {type(code).__name__}")
        super().__init__(message)
        self._message, self._code = str(message), code

    def message(self):
        return self._message

    def code(self):
        return self._code


class TritonModelException(Exception):
    pass


def _torch():
    """PyTorch, which BF16 tensors need (numpy has no bfloat16; DLPack carries them to torch)."""
    try:
        import torch
    except ImportError as e:
        raise TritonModelException(f"BF16 tensors pass through DLPack to PyTorch, which cannot be imported here ({e})")
    return torch


class Tensor:
    # BF16 tensors keep their bits in a uint16 array; numpy has no bfloat16 to show them as.
    _bf16 = False

    def __init__(self, name, array, dtype=None):
        if not isinstance(name, str):
            raise TypeError(f"Tensor name must be a str, not {type(name).__name__}")
        if array is None:
            raise TypeError("Tensor data must be a numpy array, not None")
        self._name = name
        if dtype is not None:
            array = np.asarray(array, dtype=triton_string_to_numpy(dtype))
        if not isinstance(array, np.ndarray):
            array = np.asarray(array)
        if array.dtype.kind in ("S", "U"):
            array = np.array([x.encode() if isinstance(x, str) else bytes(x) for x in array.reshape(-1)],
                             dtype=np.object_).reshape(array.shape)
        self._array = array

    @classmethod
    def _wrap(cls, name, array):
        """A tensor over an array ferry already checked (no conversion)."""
        t = cls.__new__(cls)
        t._name, t._array = name, array
        return t

    @classmethod
    def _wrap_bf16(cls, name, bits):
        """A BF16 tensor over its bits (a uint16 array)."""
        t = cls._wrap(name, bits)
        t._bf16 = True
        return t

    def name(self):
        return self._name

    def as_numpy(self):
        if self._bf16:
            raise TritonModelException(f"Tensor '{self._name}': tensor dtype is BF16 and cannot be converted to numpy; "
                                       "use to_dlpack() (and from_dlpack() for results)")
        return self._array

    def triton_dtype(self):
        return 14 if self._bf16 else numpy_to_triton_type(self._array.dtype)

    def data_type(self):
        return "BF16" if self._bf16 else _wire_type(self._array.dtype)

    def shape(self):
        return list(self._array.shape)

    def is_cpu(self):
        return True

    def to_dlpack(self):
        if self._bf16:
            torch = _torch()
            import warnings
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # a view of this request's input (torch cannot mark it read-only)
                bits = torch.from_numpy(np.ascontiguousarray(self._array).view(np.int16))
            return torch.utils.dlpack.to_dlpack(bits.view(torch.bfloat16))
        return self._array.__dlpack__()

    @staticmethod
    def from_dlpack(name, capsule):
        """A tensor from a DLPack capsule or an object with `__dlpack__` (numpy, PyTorch, ...);
        BF16 ones through PyTorch."""
        if type(capsule).__name__ == "PyCapsule":
            try:
                import torch
            except ImportError:
                return Tensor(name, np.from_dlpack(_Capsule(capsule)))
            capsule = torch.utils.dlpack.from_dlpack(capsule)
        if not hasattr(capsule, "__dlpack__"):
            raise TritonModelException("from_dlpack needs a DLPack capsule or an object with __dlpack__ (a CPU tensor)")
        if str(getattr(capsule, "dtype", "")) == "torch.bfloat16":
            torch = _torch()
            bits = capsule.detach().cpu().contiguous().view(torch.int16).numpy().view(np.uint16)
            return Tensor._wrap_bf16(name, bits)
        return Tensor(name, np.from_dlpack(capsule))

    def __repr__(self):
        return f"Tensor({self._name!r}, {self._array!r})"


class _Capsule:
    """A bare DLPack capsule as numpy's from_dlpack takes one (a CPU tensor)."""

    def __init__(self, capsule):
        self._capsule = capsule

    def __dlpack__(self, **_):
        return self._capsule

    def __dlpack_device__(self):
        return (1, 0)


def get_input_tensor_by_name(request, name):
    for t in request.inputs():
        if t.name() == name:
            return t
    return None


def get_output_tensor_by_name(response, name):
    for t in response.output_tensors():
        if t.name() == name:
            return t
    return None


def get_input_config_by_name(model_config, name):
    return next((i for i in model_config.get("input", []) if i["name"] == name), None)


def get_output_config_by_name(model_config, name):
    return next((o for o in model_config.get("output", []) if o["name"] == name), None)


_UNSET = object()


def _typed(name, value, kinds, what):
    """Triton's argument checks (its bindings raise TypeError for a wrong type)."""
    if not isinstance(value, kinds) or isinstance(value, bool) and bool not in kinds:
        raise TypeError(f"{what}: '{name}' must be {' or '.join(k.__name__ for k in kinds)}, not {type(value).__name__}")
    return value


def _parameters_text(parameters, what):
    """Parameters as Triton takes them: a dict (or its JSON text) of str keys and bool, int or
    str values; anything else raises TypeError."""
    if parameters is None:
        return "{}"
    if isinstance(parameters, str):
        try:
            parsed = json.loads(parameters)
        except ValueError as e:
            raise TypeError(f"{what} parameters must be a JSON object: {e}") from None
    elif isinstance(parameters, dict):
        parsed = parameters
    else:
        raise TypeError(f"{what} parameters must be a dict or its JSON text, not {type(parameters).__name__}")
    if not isinstance(parsed, dict):
        raise TypeError(f"{what} parameters must be a JSON object")
    for key, value in parsed.items():
        if not isinstance(key, str) or not isinstance(value, (bool, int, str)):
            raise TypeError(f"{what} parameter {key!r}: values must be bool, int or str, not {type(value).__name__}")
    return json.dumps(parsed, ensure_ascii=False) if parsed else "{}"


class InferenceResponse:
    def __init__(self, output_tensors=_UNSET, error=None, parameters=None):
        if output_tensors is _UNSET:
            output_tensors = []
        _typed("output_tensors", output_tensors, (list, tuple), "InferenceResponse")
        self._outputs = list(output_tensors)
        if any(not isinstance(t, Tensor) for t in self._outputs):
            raise TritonModelException("InferenceResponse output_tensors must be a list of pb_utils.Tensor")
        self._error = error
        self._parameters = _parameters_text(parameters, "InferenceResponse")

    def output_tensors(self):
        return self._outputs

    def has_error(self):
        return self._error is not None

    def error(self):
        return self._error

    def parameters(self):
        return self._parameters


class _Box:
    """What has been answered for one request: shared by its sender(s), the stub and the
    finalizer that runs once the model holds neither the request nor its sender."""
    __slots__ = ("decoupled", "handle", "closed", "response", "count", "abandoned", "sender_made", "on_done",
                 "running", "error", "index", "cancelled")

    def __init__(self, decoupled, handle, index=None):
        self.decoupled, self.handle, self.running, self.error = decoupled, handle, True, None
        self.index = index  # its place in the batch, while that runs (a request with no stream)
        self.closed = self.abandoned = self.sender_made = self.cancelled = False
        self.response, self.count, self.on_done = None, 0, None

    def done(self):
        return self.closed or self.abandoned


# Guards every _Box; re-entrant since a finalizer may run while this thread holds it.
_STATE = threading.Condition(threading.RLock())


def _box_cancelled(box):
    """Whether the request's client went away; once seen, it stays so."""
    if box is None or box.cancelled:
        return box is not None
    if box.handle is not None:
        gone = _CHANNEL.cancelled(box.handle)
    else:
        gone = box.index is not None and not box.closed and _CHANNEL.cancelled_in_batch(box.index)
    box.cancelled = box.cancelled or gone
    return box.cancelled


def _settled(box):
    """Wakes whoever waits for `box` (under _STATE)."""
    _STATE.notify_all()
    if box.on_done is not None:
        box.on_done()


def _abandon(box):
    """The model dropped the request and its sender: a decoupled request that never got its
    final flag gets it once execute() is over (its client would wait for ever otherwise)."""
    with _STATE:
        if box.done():
            return
        box.abandoned = True
        _close_abandoned(box)
        _settled(box)


def _ran(box):
    """execute() is over for the request: what it abandoned meanwhile is closed now."""
    with _STATE:
        box.running = False
        _close_abandoned(box)


def _close_abandoned(box):
    if box.abandoned and box.decoupled and not box.closed and not box.running and _CHANNEL is not None:
        box.closed = True
        try:
            _CHANNEL.respond(box.handle, None, True)
        except OSError:
            pass


class _Slot:
    """Held by a request and its sender; when both are gone, the request is abandoned."""
    __slots__ = ("box",)

    def __init__(self, box):
        self.box = box

    def __del__(self):
        box = self.box
        if not (box.closed or box.abandoned):
            _abandon(box)


class InferenceRequest:
    """A request ferry handed to `execute`, or a BLS request the model builds and runs."""

    def __init__(self, model_name=None, requested_output_names=None, inputs=None, model_version=-1,
                 parameters=None, timeout=0, request_id="", correlation_id=0, flags=0, preferred_memory=None,
                 trace=None, **_):
        what = "InferenceRequest"
        _typed("model_name", model_name, (str,), what)
        _typed("inputs", inputs, (list, tuple), what)
        _typed("requested_output_names", requested_output_names, (list, tuple), what)
        for n in requested_output_names:
            _typed("requested_output_names", n, (str,), what)
        _typed("correlation_id", correlation_id, (int, str), what)
        _typed("request_id", request_id, (str,), what)
        for key, value in (("model_version", model_version), ("flags", flags), ("timeout", timeout)):
            _typed(key, value, (int,), what)
        self._model_name, self._version, self._timeout = model_name, model_version, timeout
        self._outputs = list(requested_output_names)
        self._inputs = list(inputs)
        if any(not isinstance(t, Tensor) for t in self._inputs):
            raise TritonModelException("InferenceRequest inputs must be a list of pb_utils.Tensor")
        self._parameters = _parameters_text(parameters, "InferenceRequest")
        self._id, self._correlation_id, self._flags = request_id, correlation_id, flags
        self._slot = self._sender = None  # set for the requests ferry hands to execute()
        self._release_flags = TRITONSERVER_REQUEST_RELEASE_ALL

    @classmethod
    def _from_ferry(cls, inputs, outputs, request_id, parameters, box, sequence=(0, 0), model=("", -1)):
        """A request of the batch ferry hands to execute(): `box` holds what it was answered,
        `sequence` is its correlation id and START/END flags, `model` the model's name and version."""
        r = cls.__new__(cls)
        (r._model_name, r._version), r._timeout = model, 0
        r._outputs, r._inputs, r._parameters = outputs, inputs, parameters
        r._id, (r._correlation_id, r._flags), r._slot, r._sender = request_id, sequence, _Slot(box), None
        r._release_flags = TRITONSERVER_REQUEST_RELEASE_ALL
        return r

    def set_release_flags(self, flags):
        """TRITONSERVER_REQUEST_RELEASE_RESCHEDULE: run the request again (iterative models)."""
        if flags not in (TRITONSERVER_REQUEST_RELEASE_ALL, TRITONSERVER_REQUEST_RELEASE_RESCHEDULE):
            raise TritonModelException(f"unknown release flags {flags!r}")
        self._release_flags = flags

    def release_flags(self):
        return self._release_flags

    def inputs(self):
        return self._inputs

    def requested_output_names(self):
        return self._outputs

    def request_id(self):
        return self._id

    def correlation_id(self):
        return self._correlation_id

    def parameters(self):
        return self._parameters

    def flags(self):
        return self._flags

    def model_name(self):
        return self._model_name

    def timeout(self):
        return self._timeout

    def is_cancelled(self):
        """Whether the client went away (its stream closed): the model may stop working on it."""
        return _box_cancelled(self._slot.box if self._slot is not None else None)

    def get_response_sender(self):
        """Sends this request's responses during or after execute(): 0..n for a decoupled model,
        exactly one for any other; the last with TRITONSERVER_RESPONSE_COMPLETE_FINAL."""
        if self._slot is None:
            raise TritonModelException("only the requests ferry hands to execute() have a response sender")
        with _STATE:
            if self._sender is None:
                self._sender = InferenceResponseSender._for(self._slot)
                self._slot.box.sender_made = True
            return self._sender

    def _message(self):
        return {"model_name": self._model_name, "model_version": int(self._version), "id": self._id,
                "requested_output_names": self._outputs, "parameters": json.loads(self._parameters or "{}"),
                "timeout": int(self._timeout or 0)}

    def exec(self, decoupled=False):
        """BLS: runs the request on another model of this server and waits for its response (an
        iterator of responses with decoupled=True)."""
        _bls_allowed()
        if decoupled:
            return _CHANNEL.infer_stream(self._message(), self._inputs)
        return _CHANNEL.infer(self._message(), self._inputs)

    def async_exec(self, decoupled=False):
        """BLS: an awaitable of the response (run it inside `async def execute`)."""
        import asyncio
        _bls_allowed()
        loop = asyncio.get_running_loop()
        future = loop.create_future()

        def done(response):
            loop.call_soon_threadsafe(lambda: future.done() or future.set_result(response))

        if decoupled:
            iterator = _CHANNEL.infer_stream(self._message(), self._inputs)
            iterator._on_first(done)
        else:
            _CHANNEL.infer_async(self._message(), self._inputs, done)
        return future


def _bls_allowed():
    if _CHANNEL is None or not _CHANNEL.executing:
        raise TritonModelException("BLS is only supported during the 'execute' function.")


class InferenceResponseSender:
    """Sends one request's responses; all senders of a request share what it was answered."""

    def __init__(self, *_args, **_kwargs):
        raise TritonModelException("use request.get_response_sender()")

    @classmethod
    def _for(cls, slot):
        s = cls.__new__(cls)
        s._slot = slot
        return s

    def send(self, response=None, flags=0):
        if flags not in (0, TRITONSERVER_RESPONSE_COMPLETE_FINAL):
            raise TritonModelException("Unable to send response. Unsupported flag provided.")
        if flags == 0 and response is None:
            raise TritonModelException(
                "Inference Response object must be provided when the response flags is set to zero.")
        if response is not None and not isinstance(response, InferenceResponse):
            raise TritonModelException(
                f"Expected an 'InferenceResponse' object, found type '{type(response).__name__}'.")
        box, final = self._slot.box, flags == TRITONSERVER_RESPONSE_COMPLETE_FINAL
        # Made first: a response that cannot be sent changes nothing.
        message = _CHANNEL.response_message(box.handle, response, final) if box.decoupled else None
        with _STATE:
            if not box.decoupled:
                if response is not None and box.count > 0:
                    raise TritonModelException(
                        "Unable to send response. Non-decoupled model cannot send more than one response.")
                if response is None and final and box.count == 0:
                    raise TritonModelException(
                        "Unable to send response. Non-decoupled model cannot send complete final before sending a "
                        "response.")
            if box.closed:
                raise TritonModelException("Unable to send response. Response sender has been closed.")
            box.count += 1
            if response is not None:
                box.response = response
            box.closed = final
            if box.decoupled:
                _CHANNEL.send_encoded(*message)
            if final:
                _settled(box)

    def is_cancelled(self):
        return _box_cancelled(self._slot.box)


class Logger:
    # Triton's pb_utils.Logger levels (LogLevel); what ferry's log shows them as.
    INFO, WARNING, ERROR, VERBOSE = "INFO", "WARN", "ERROR", "VERBOSE"

    @staticmethod
    def log(message, level=INFO):
        if not isinstance(level, str):
            raise TypeError(f"log level must be one of pb_utils.Logger's levels, not {type(level).__name__}")
        level = {"WARNING": "WARN"}.get(str(level), str(level))
        if level not in ("INFO", "WARN", "ERROR", "VERBOSE"):
            raise TritonModelException(f"unknown log level {level!r}: use pb_utils.Logger.INFO, WARNING, ERROR or VERBOSE")
        _CHANNEL.log(level, str(message))

    @staticmethod
    def log_info(message):
        _CHANNEL.log("INFO", _typed("message", message, (str,), "Logger"))

    @staticmethod
    def log_warn(message):
        _CHANNEL.log("WARN", _typed("message", message, (str,), "Logger"))

    @staticmethod
    def log_error(message):
        _CHANNEL.log("ERROR", _typed("message", message, (str,), "Logger"))

    @staticmethod
    def log_verbose(message):
        _CHANNEL.log("VERBOSE", _typed("message", message, (str,), "Logger"))


class ModelConfig:
    """What `auto_complete_config` receives and returns."""

    def __init__(self, config):
        self._config = config

    def as_dict(self):
        return self._config

    def _add(self, key, tensor):
        for name in ("name", "data_type", "dims"):
            if name not in tensor:
                raise TritonModelException(f"{key} '{tensor.get('name', '')}' needs '{name}'")
        items = self._config.setdefault(key, [])
        existing = next((i for i in items if i["name"] == tensor["name"]), None)
        if existing is not None:
            if existing.get("data_type", tensor["data_type"]) != tensor["data_type"] or \
                    list(existing.get("dims", tensor["dims"])) != list(tensor["dims"]):
                raise TritonModelException(f"{key} '{tensor['name']}' is already in the config with another type or dims")
            return
        items.append(dict(tensor))

    def add_input(self, input):
        self._add("input", input)

    def add_output(self, output):
        self._add("output", output)

    def set_max_batch_size(self, max_batch_size):
        self._config["max_batch_size"] = int(max_batch_size)

    def set_dynamic_batching(self):
        if "sequence_batching" not in self._config:
            self._config.setdefault("dynamic_batching", {})

    def set_model_transaction_policy(self, transaction_policy_dict):
        self._config["model_transaction_policy"] = dict(transaction_policy_dict)

    def add_model_warmup(self, model_warmup):
        self._config.setdefault("model_warmup", []).append(model_warmup)


def load_model(model_name, config="", files=None):
    _CHANNEL.control({"op": "load_model", "model_name": model_name, "config": config,
                      "files": {k: list(v) for k, v in (files or {}).items()}})


def unload_model(model_name, unload_dependents=False):
    _CHANNEL.control({"op": "unload_model", "model_name": model_name, "unload_dependents": unload_dependents})


def is_model_ready(model_name, model_version=""):
    return bool(_CHANNEL.control({"op": "is_model_ready", "model_name": model_name,
                                  "model_version": str(model_version)}).get("ready"))
