"""ferry's PyTorch backend: runs a TorchScript model (platform pytorch_libtorch, `model.pt`) or an
AOTInductor package (platform torch_aoti, `model.pt2`) on the PyTorch of the Python it runs in,
as Triton's PyTorch backend names its tensors: inputs `<name>__<i>` (or `ARGS[i]`) by position,
else by the names of `forward`'s arguments (`KWARGS[name]` for a package), else in config order;
outputs `<name>__<i>` (or `RESULT[i]`) by position in what the model returns, else in config order.
The requests of one batch run as one call, concatenated on the batch dimension, and the outputs
are split back per request."""
import json
import os
import re
import sys
import warnings

import numpy as np
import triton_python_backend_utils as pb_utils

# Triton's PyTorch backend parameters, and what each is for.
FLAGS = {"DISABLE_OPTIMIZED_EXECUTION", "INFERENCE_MODE", "DISABLE_CUDNN", "ENABLE_WEIGHT_SHARING",
         "ENABLE_CACHE_CLEANING", "ENABLE_JIT_EXECUTOR", "ENABLE_JIT_PROFILING"}
COUNTS = {"INTRA_OP_THREAD_COUNT", "INTER_OP_THREAD_COUNT"}
JIT_ONLY = {"DISABLE_OPTIMIZED_EXECUTION", "ENABLE_JIT_EXECUTOR", "ENABLE_JIT_PROFILING"}
GPU_ONLY = {"DISABLE_CUDNN", "ENABLE_CACHE_CLEANING"}
# BF16 values as the runner holds them between ferry and torch: their bits, in a dtype of their own
# (numpy has no bfloat16), so that batches concatenate and split as any other array.
BF16 = np.dtype([("bf16", "<u2")])
POSITION = re.compile(r"^(?:.+__(\d+)|ARGS\[(\d+)\]|RESULT\[(\d+)\])$")
KEYWORD = re.compile(r"^KWARGS\[(.+)\]$")


def fail(message):
    raise pb_utils.TritonModelException(message)


def bf16_bits(tensor, torch):
    """A bfloat16 tensor's values as the runner holds them (BF16)."""
    return tensor.detach().cpu().contiguous().view(torch.int16).numpy().view(BF16)


def as_float(array, torch):
    """An output as float32 for comparing (BF16 ones through torch)."""
    if array.dtype != BF16:
        return array
    return torch.from_numpy(np.ascontiguousarray(array).view(np.int16)).view(torch.bfloat16).float().numpy()


def flag(name, value):
    v = value.strip().lower()
    if v in ("true", "1", "yes", "on"):
        return True
    if v in ("false", "0", "no", "off"):
        return False
    fail(f"parameter {name}: '{value}' is not true or false")


def positions(names, what):
    """Each name's position by the `__<i>` convention, or None when not every name follows it."""
    found = []
    for n in names:
        m = POSITION.match(n)
        if not m:
            return None
        found.append(int(next(g for g in m.groups() if g is not None)))
    if sorted(found) != list(range(len(found))):
        fail(f"{what} {names} are numbered {sorted(found)}: the positions must be 0..{len(found) - 1}, each once")
    return found


class TritonPythonModel:
    def initialize(self, args):
        cfg = json.loads(args["model_config"])
        try:
            import torch
        except Exception as e:  # an ImportError, or a broken install
            fail(f"PyTorch is not importable by {sys.executable} ({type(e).__name__}: {e}); install torch there, or "
                 "name a Python that has it with --backend-config pytorch,python=<path> or FERRY_PYTORCH_PYTHON")
        self.torch = torch
        self.aoti = cfg.get("platform") == "torch_aoti"
        self.batching = int(cfg.get("max_batch_size", 0)) > 0
        gpu = args["model_instance_kind"] == "GPU"
        self.device = torch.device(f"cuda:{args['model_instance_device_id']}" if gpu else "cpu")
        params = {k: (v or {}).get("string_value", "") for k, v in (cfg.get("parameters") or {}).items()}
        self.settings(params, gpu)
        name = cfg.get("default_model_filename") or ("model.pt2" if self.aoti else "model.pt")
        path = os.path.join(args["model_repository"], args["model_version"], name)
        if not os.path.exists(path):
            fail(f"model file '{path}' not found")
        if not os.path.isfile(path):
            fail(f"model file '{path}' is not a regular file")
        if self.aoti:
            # The package checks each call's shapes and dtypes against what it was compiled for
            # (else it reads past a short input, or computes a batch it was not built for).
            os.environ["AOTI_RUNTIME_CHECK_INPUTS"] = "1"
        try:
            warnings.filterwarnings("ignore", message=".*is deprecated. Please switch to `torch.export`")
            if self.aoti:
                self.model = torch._inductor.aoti_load_package(path)
                arg_names = []
            else:
                self.model = torch.jit.load(path, map_location=self.device)
                self.model.eval()
                schema_args = self.model.forward.schema.arguments[1:]
                arg_names = [a.name for a in schema_args]
                required = sum(1 for a in schema_args if a.default_value is None)
        except Exception as e:
            fail(f"cannot load '{path}' with torch {torch.__version__}: {type(e).__name__}: {str(e)[:2000]}")
        self.inputs = [(i["name"], i.get("data_type", "")) for i in cfg.get("input", [])]
        self.outputs = [(o["name"], o.get("data_type", "")) for o in cfg.get("output", [])]
        # What each output must be: its numpy dtype, and its dims (None: not checked, a reshape).
        self.expect = {o["name"]: (o.get("data_type", ""), None if o.get("reshape") else [int(d) for d in o.get("dims", [])])
                       for o in cfg.get("output", [])}
        self.check_types(cfg)
        # The sequence batcher's control inputs and implicit state reach the model as tensors too.
        sequence = cfg.get("sequence_batching") or {}
        for c in sequence.get("control_input", []):
            self.inputs.append((c["name"], next((k.get("data_type", "") for k in c.get("control", [])), "")))
        for st in sequence.get("state", []):
            self.inputs.append((st["input_name"], st.get("data_type", "")))
            self.outputs.append((st["output_name"], st.get("data_type", "")))
        self.plan_inputs([n for n, _ in self.inputs], arg_names)
        if not self.aoti:
            given = sum(1 for how, where in self.plan if how == "arg" or where in arg_names)
            top = max((p + 1 for how, p in self.plan if how == "arg"), default=0)
            if top > len(arg_names) or given < required:
                fail(f"configuration expects {len(self.plan)} inputs, the model's forward takes {len(arg_names)} "
                     f"({required} required: {arg_names})")
        self.out_positions = positions([n for n, _ in self.outputs], "outputs") or list(range(len(self.outputs)))
        if self.aoti and self.batching:
            self.check_batch(int(cfg["max_batch_size"]), cfg.get("input", []))

    def check_types(self, cfg):
        """What the runner cannot pass, refused at load rather than on each request."""
        batching = int(cfg.get("max_batch_size", 0)) > 0
        for t in cfg.get("input", []) + cfg.get("output", []):
            dt, dims = t.get("data_type", ""), [int(d) for d in t.get("dims", [])]
            if dt == "TYPE_STRING" and (dims != [1] if batching else len(dims) != 1):
                fail(f"tensor '{t['name']}' is TYPE_STRING with dims {dims}: string tensors are one-dimensional "
                     f"(a List[str]{': dims [ 1 ], one string per batch row' if batching else ''})")

    def check_batch(self, rows, inputs):
        """A package computes the batch sizes it was exported for, and silently misreads others:
        one row alone and the same row `rows` times must agree (tried when every other
        dimension is fixed, so that the inputs can be made)."""
        if any(d < 0 for i in inputs for d in i.get("dims", [])):
            return
        rng = np.random.default_rng(0)
        one = []
        for i in inputs:
            dtype = np.float32 if i["data_type"] == "TYPE_BF16" else pb_utils.triton_string_to_numpy(i["data_type"])
            shape = [1] + list(i.get("dims", []))
            one.append(rng.standard_normal(shape).astype(dtype) if np.dtype(dtype).kind == "f" else np.ones(shape, dtype))
            if i["data_type"] == "TYPE_BF16":
                one[-1] = bf16_bits(self.torch.from_numpy(one[-1]).to(self.torch.bfloat16), self.torch)
        why = None
        try:
            single = self.call([a.copy() for a in one])  # copies: a model may write its inputs in place
            many = self.call([np.repeat(a, rows, axis=0) for a in one])
            for s, m in zip(single, many):
                m, s = as_float(m, self.torch), as_float(s, self.torch)
                if m.shape[:1] != (rows,) or not np.allclose(m, np.repeat(s, rows, axis=0), rtol=1e-3, atol=1e-4):
                    why = f"{rows} copies of one row do not give {rows} copies of its answer"
        except Exception as e:
            why = f"{type(e).__name__}: {str(e)[:500]}"
        if why:
            fail(f"max_batch_size {rows} is more than this package's batch dimension takes (export it with a "
                 f"dynamic batch Dim of max >= {rows}, or lower max_batch_size): {why}")

    def settings(self, params, gpu):
        torch = self.torch
        for key in sorted(params):
            if key in FLAGS and (key in JIT_ONLY and self.aoti or key in GPU_ONLY and not gpu):
                pb_utils.Logger.log_warn(f"parameter {key} does not apply to this model "
                                         f"({'an AOTInductor package' if key in JIT_ONLY else 'a CPU instance'})")
            if key == "ENABLE_WEIGHT_SHARING" and flag(key, params[key]):
                pb_utils.Logger.log_warn("parameter ENABLE_WEIGHT_SHARING does not apply in ferry: each instance is "
                                         "a process of its own, holding its own weights")
        self.inference_mode = flag("INFERENCE_MODE", params.get("INFERENCE_MODE", "true"))
        self.clean_cache = gpu and flag("ENABLE_CACHE_CLEANING", params.get("ENABLE_CACHE_CLEANING", "false"))
        for key in COUNTS & params.keys():
            try:
                n = int(params[key])
            except ValueError:
                fail(f"parameter {key}: '{params[key]}' is not an integer")
            if n < 1 or n > 1024:
                fail(f"parameter {key}: {n} is not between 1 and 1024")
            (torch.set_num_threads if key == "INTRA_OP_THREAD_COUNT" else torch.set_num_interop_threads)(n)
        if not self.aoti:
            if flag("DISABLE_OPTIMIZED_EXECUTION", params.get("DISABLE_OPTIMIZED_EXECUTION", "false")):
                torch._C._set_graph_executor_optimize(False)
            if "ENABLE_JIT_EXECUTOR" in params:
                torch._C._jit_set_profiling_executor(flag("ENABLE_JIT_EXECUTOR", params["ENABLE_JIT_EXECUTOR"]))
            if "ENABLE_JIT_PROFILING" in params:
                torch._C._jit_set_profiling_mode(flag("ENABLE_JIT_PROFILING", params["ENABLE_JIT_PROFILING"]))
        if gpu and "DISABLE_CUDNN" in params:
            torch.backends.cudnn.enabled = not flag("DISABLE_CUDNN", params["DISABLE_CUDNN"])

    def plan_inputs(self, names, arg_names):
        """How each config input reaches the model: ("arg", position) or ("kw", name)."""
        at = positions(names, "inputs")
        if at is not None:
            self.plan = [("arg", p) for p in at]
        elif all(KEYWORD.match(n) for n in names):
            self.plan = [("kw", KEYWORD.match(n).group(1)) for n in names]
        elif arg_names and set(names) <= set(arg_names):
            self.plan = [("arg", arg_names.index(n)) for n in names]
        elif arg_names and len(arg_names) < len(names):
            fail(f"the model's forward takes {len(arg_names)} inputs ({arg_names}), the config names "
                 f"{len(names)} ({names})")
        else:
            self.plan = [("arg", p) for p in range(len(names))]

    def to_torch(self, array, datatype):
        if array.dtype == BF16:
            t = self.torch.from_numpy(np.ascontiguousarray(array).view(np.int16)).view(self.torch.bfloat16)
            return t.to(self.device) if self.device.type != "cpu" else t
        if datatype == "TYPE_STRING":
            try:
                return [x.decode("utf-8") if isinstance(x, bytes) else str(x) for x in array.reshape(-1)]
            except UnicodeDecodeError as e:
                fail(f"a string input holds bytes that are not UTF-8 ({e}); TorchScript strings are text")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # read-only arrays over shared memory: never written
            t = self.torch.from_numpy(np.ascontiguousarray(array))
        return t.to(self.device) if self.device.type != "cpu" else t

    def call(self, arrays, rows=None):
        """Runs the model on `arrays`; each output is checked against the config (`rows`: the
        batch rows it must have, for a batching model)."""
        args, kwargs = {}, {}
        for (how, where), (name, datatype), a in zip(self.plan, self.inputs, arrays):
            if a is None:
                continue
            (args if how == "arg" else kwargs)[where] = self.to_torch(a, datatype)
        missing = [p for p in range(len(args)) if p not in args]
        if missing:
            fail(f"no value for the model's input at position {missing[0]} (a missing optional input)")
        guard = self.torch.inference_mode() if self.inference_mode else self.torch.no_grad()
        with guard:
            result = self.model(*[args[p] for p in range(len(args))], **kwargs)
        if isinstance(result, dict):
            names = [n for n, _ in self.outputs]
            if not set(names) <= set(result):
                fail(f"the model returns a dict with keys {sorted(result)}; the config's outputs {names} must be among them")
            return [self.check(self.to_numpy(result[n], n, dt), n, rows) for n, dt in self.outputs]
        elif not isinstance(result, (list, tuple)) or (result and isinstance(result[0], str)):
            result = [result]
        if max(self.out_positions, default=-1) >= len(result):
            fail(f"the model returned {len(result)} outputs; the config names {len(self.outputs)}")
        outs = [self.to_numpy(result[p], name, dt) for p, (name, dt) in zip(self.out_positions, self.outputs)]
        return [self.check(o, name, rows) for o, (name, _) in zip(outs, self.outputs)]

    def check(self, out, name, rows):
        """An output as the config declares it: its datatype, and its shape where dims are fixed."""
        datatype, dims = self.expect.get(name, ("", None))
        if datatype:
            want = BF16 if datatype == "TYPE_BF16" else np.dtype(pb_utils.triton_string_to_numpy(datatype))
            if out.dtype != want and not (want.kind == "O" and out.dtype.kind == "O"):
                fail(f"output '{name}': the configuration expects {datatype}, the model returned {out.dtype}")
        if dims is None:
            return out
        shape = list(out.shape)
        if self.batching:
            if not shape or (rows is not None and shape[0] != rows):
                fail(f"output '{name}' has shape {shape}: a batch of {rows} needs {rows} rows")
            shape = shape[1:]
        if datatype != "TYPE_STRING" and (len(shape) != len(dims) or any(d >= 0 and d != s for d, s in zip(dims, shape))):
            fail(f"output '{name}' has shape {list(out.shape)}, which the configuration's dims {dims} do not take")
        return out

    def to_numpy(self, value, name, datatype):
        if isinstance(value, (list, tuple)) and all(isinstance(x, str) for x in value):
            return np.array([x.encode() for x in value], dtype=np.object_)
        if not isinstance(value, self.torch.Tensor):
            fail(f"output '{name}' is a {type(value).__name__}, not a tensor")
        value = value.detach()
        if value.dtype == self.torch.bfloat16:
            return bf16_bits(value, self.torch)
        return value.cpu().numpy()

    def execute(self, requests):
        arrays = [[pb_utils.get_input_tensor_by_name(r, n) for n, _ in self.inputs] for r in requests]
        arrays = [[None if t is None else t._array.view(BF16) if t._bf16 else t.as_numpy() for t in row] for row in arrays]
        responses = [None] * len(requests)
        # Requests whose shapes agree past the batch dimension run as one call.
        groups = {}
        for k, row in enumerate(arrays):
            key = tuple(None if a is None else (a.shape[1:] if self.batching else a.shape) for a in row)
            groups.setdefault(key if self.batching else k, []).append(k)
        for members in groups.values():
            if len(members) == 1:
                responses[members[0]] = self.alone(arrays[members[0]])
                continue
            try:
                sizes = [self.rows(arrays[k]) for k in members]
                joined = [None if arrays[members[0]][i] is None else np.concatenate([arrays[k][i] for k in members])
                          for i in range(len(self.inputs))]
                outs = self.call(joined, sum(sizes))
                parts = [np.split(o, np.cumsum(sizes)[:-1]) for o in outs]
                for j, k in enumerate(members):
                    responses[k] = self.respond([p[j] for p in parts])
            except Exception:
                # One request must not fail the others of its batch: each runs alone to find out.
                for k in members:
                    responses[k] = self.alone(arrays[k])
        if self.clean_cache:
            self.torch.cuda.empty_cache()
        return responses

    def rows(self, row):
        return next((a.shape[0] for a in row if a is not None and a.ndim), 1) if self.batching else None

    def alone(self, row):
        try:
            return self.respond(self.call(row, self.rows(row)))
        except pb_utils.TritonModelException as e:
            return pb_utils.InferenceResponse(error=pb_utils.TritonError(str(e)))
        except Exception as e:
            return pb_utils.InferenceResponse(
                error=pb_utils.TritonError(f"PyTorch execute failure: {type(e).__name__}: {str(e)[:2000]}"))

    def respond(self, outs):
        return pb_utils.InferenceResponse([pb_utils.Tensor._wrap_bf16(n, o.view(np.uint16)) if o.dtype == BF16
                                           else pb_utils.Tensor(n, o) for (n, _), o in zip(self.outputs, outs)])
