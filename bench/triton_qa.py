#!/usr/bin/env python3
"""Run Triton's own Python-backend QA tests against ferry.

For each selected suite this reproduces what the suite's test.sh in Triton's `qa/` tree sets up:
the models copied from `qa/python_models` (with the same renames and config edits) into a fresh
model repository in a temporary folder, the server arguments (mapped to ferry's; flags ferry lacks
are dropped and noted), ferry on HTTP 8000 / gRPC 8001 / metrics 8002 (the tests hard-code them),
then the suite's test files run with `python -m pytest -q -rA` from a copy of that suite's folder
(with qa/common beside it, and SERVER_LOG, MODELDIR, MODEL_NAME... set as test.sh does). Checks
that test.sh makes on the server log (message counts, expected start-up failures) are recorded as
tests named `[phase] ...`. ferry is stopped with SIGTERM (then SIGKILL) after each phase.

Parts that need a GPU, CUDA shared memory, torch (when the model Python lacks it), conda packs,
Triton's data sets (/data/inferenceserver) or Triton-internal tools are skipped and listed.
The shared-memory leak probe (qa/common/shm_util.py needs Triton's `triton_shm_monitor`) is turned
off with TEST_JETSON=1, which also drops python_test.py's two CUDA-shared-memory tests.

    source .venv/bin/activate   # tritonclient, numpy, pytest; also the Python ferry runs models with
    python bench/triton_qa.py --qa /path/to/server/qa [--ferry target/debug/ferry] [--only suite,...]
        [--python-backend DIR]  # a python_backend checkout (examples/decoupled/square_*), else
                                # square_int32 and the tests that need it are skipped
        [--json /tmp/triton_qa.json] [--timeout 600] [--workdir DIR]

Prints a table (suite, passed, failed, errored, skipped, then each failing test's one-line
reason) and writes the same as JSON.
"""
import argparse
import glob
import importlib.util
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field

BP = "L0_backend_python"
PORTS = (8000, 8001, 8002)
DROPPED_FLAGS = ("--backend-directory", "--cuda-memory-pool-byte-size")  # ferry lacks these
BASE = ["--log-verbose=1"]  # test.sh's BASE_SERVER_ARGS, less --backend-directory
HAS_TORCH = importlib.util.find_spec("torch") is not None
HAS_GPU = shutil.which("nvidia-smi") is not None and subprocess.run(["nvidia-smi"], capture_output=True).returncode == 0
TORCH_RE = re.compile(r"^\s*(import|from)\s+torch\b", re.M)


# ---------------------------------------------------------------------------------------------
# What each test.sh sets up
# ---------------------------------------------------------------------------------------------
def M(dst, src=None, files=("model.py",), cfg="config.pbtxt", sed=(), append=(), root="qa"):
    """A model folder `dst`: `files` of `src` (`python_models/<src>`, or a path under qa/) into
    `dst/1/` (an entry may be (from, to) or a glob), `cfg` (relative to src; None: none) into
    `dst/config.pbtxt`, then `sed` (regex, replacement) edits and `append`ed lines."""
    return dict(dst=dst, src=src or dst, files=files, cfg=cfg, sed=sed, append=append, root=root)


def T(path):
    """Every model folder of a repository shipped in the qa tree (copied as is)."""
    return dict(tree=path)


def name(n):
    return (r"^name:.*", f'name: "{n}"')


def R(target, tag="", env=None, needs="", unittest=False):
    """One pytest run: a file or node id, relative to the suite folder (`unittest`: run as
    `python <file> -v`, as test.sh does, for tests pytest cannot drive)."""
    return dict(target=target, tag=tag, env=env or {}, needs=needs, unittest=unittest)


@dataclass
class Phase:
    name: str
    models: list
    args: list = field(default_factory=lambda: list(BASE))
    runs: list = field(default_factory=list)
    log: str = "server.log"
    expect: str = "ready"  # "ready", or "fail": the server must exit at start-up
    # (pattern, op, count[, "torch"]) on the log once ferry stopped; count "models": as many as
    # the repository's model files that hold the pattern
    checks: list = field(default_factory=list)
    env: dict = field(default_factory=dict)  # for ferry and the tests
    posts: list = field(default_factory=list)  # (path, json) POSTed before the tests
    skip: dict = field(default_factory=dict)  # "Class::test" -> reason (deselected)
    needs: str = ""  # "torch": skip the whole phase without it
    kill9: bool = False  # test.sh's non-graceful exit check


@dataclass
class Suite:
    folder: str  # relative to qa/, the tests' working directory
    phases: list
    skipped: list = field(default_factory=list)  # (part, reason) of test.sh not reproduced


DYN12 = "dynamic_batching { preferred_batch_size: [8], max_queue_delay_microseconds: 12000000 }"
DECOUPLED = "model_transaction_policy { decoupled: True }"
SQUARE = M("square_int32", "examples/decoupled", [("square_model.py", "model.py")],
           "square_config.pbtxt", root="pb")
TORCH = "needs torch"
# With torch, some models move tensors to CUDA: without a GPU their response thread dies and the
# test waits for ever.
GPU = "needs a GPU when torch is present"
PB = "needs python_backend's square_int32"


def identity_as(dst, dtype=None, extra_sed=(), **kw):
    sed = [name(dst)] + ([("TYPE_FP32", dtype)] if dtype else []) + list(extra_sed)
    return M(dst, "identity_fp32", sed=sed, **kw)


TOP_MODELS = [
    M("identity_fp32"), M("identity_bf16"),
    identity_as("identity_uint8", "TYPE_UINT8", [(r"^max_batch_size:.*", "max_batch_size: 8")],
                append=[DYN12]),
    identity_as("identity_uint8_nobatch", "TYPE_UINT8", [(r"^max_batch_size:.*", "")]),
    identity_as("identity_uint32", "TYPE_UINT32"), identity_as("identity_bool", "TYPE_BOOL"),
    identity_as("default_model_name", files=[("model.py", "mymodel.py")],
                append=['default_model_filename: "mymodel.py"']),
    M("pytorch_fp32_fp32", sed=[name("pytorch_fp32_fp32")]), M("delayed_model"),
    M("init_args", sed=[("TRITON_DIR_PATH", "$TRITON_DIR")]), M("optional"),
    M("non_contiguous"), M("string"), M("string_fixed"), M("dlpack_identity"),
]
SHM5M = "--backend-config=python,shm-default-byte-size=5242880"
NONEXIST = [identity_as("non_existent_model", files=())]
NONEXIST_LOG = [("Failed to preinitialize Python stub: Python model file not found in "
                 "'{repo}/non_existent_model/1/model.py'", ">=", 1),
                ("failed to load 'non_existent_model'", ">=", 1)]


def response_sender(dst, asyncio=False, decoupled=False, batching=False):
    files = ["model_common.py", ("model_async.py", "model.py") if asyncio else "model.py"]
    append = ([DECOUPLED] if decoupled else []) + (
        ["dynamic_batching { max_queue_delay_microseconds: 500000 }"] if batching else [])
    return M(dst, "response_sender", files, append=append)


def log_counts(normal, verbose):
    msgs = ["Specific Msg!", "Info Msg!", "Warning Msg!", "Error Msg!"]
    return [(m, "==", normal) for m in msgs] + [("Verbose Msg!", "==", verbose)]


BLS_INIT_MSG = "BLS is only supported during the 'execute' function."
SHM_LEAK = "../test_infer_shm_leak.py"

SUITES = {
    "python_test": Suite(BP, [
        Phase("main", TOP_MODELS, BASE + ["--allow-client-shm=true", SHM5M],
              [R("python_test.py")], log="inference_server.log",
              skip={"PythonTest::test_bf16": TORCH + " (identity_bf16)",
                    "PythonTest::test_infer_pytorch": TORCH + " (pytorch_fp32_fp32)"}),
        Phase("nongraceful_exit", TOP_MODELS, BASE + [SHM5M], log="inference_server.log",
              kill9=True),
    ], skipped=[("PythonTest::test_gpu_tensor_error, ::test_dlpack_tensor_error",
                 "CUDA shared memory (dropped by TEST_JETSON=1)"),
                ("shared-memory page count / leak probes", "Triton-internal shm regions"),
                ("add_sub_gpu (KIND_GPU)", "needs a GPU"),
                ("shm-default-byte-size region size check",
                 "Triton's triton_python_backend_shm_region_* files")]),
    "multi_file": Suite(BP, [Phase("multi_file", [
        M("multi_file", files=["*.py"], cfg="../identity_fp32/config.pbtxt",
          sed=[name("multi_file")])], BASE + [SHM5M])]),
    "model_env": Suite(BP, [Phase("model_env", [M("model_env")], BASE + [SHM5M],
                                  env={"MY_ENV": "MY_ENV"})]),
    "start_errors": Suite(BP, [
        Phase("init_exit", [M("init_exit")], BASE + [SHM5M], expect="fail",
              checks=[("Stub process 'init_exit_0_0' is not healthy.", ">=", 1)]),
        Phase("non_existent_model", NONEXIST, expect="fail", checks=NONEXIST_LOG,
              log="non_existent_model_server.log"),
        Phase("non_existent_model_auto_config_disabled", NONEXIST,
              BASE + ["--disable-auto-complete-config"], expect="fail", checks=NONEXIST_LOG,
              log="non_existent_model_server_auto_config_disabled.log"),
    ]),
    "argument_validation": Suite(f"{BP}/argument_validation", [Phase(
        "main", [T(f"{BP}/argument_validation/models")], log="arg_validation_server.log",
        runs=[R(SHM_LEAK, "argument_validation", {"MODEL_NAME": "argument_validation"})])]),
    "async_execute": Suite(f"{BP}/async_execute", [Phase(
        "main", [M("async_execute_decouple"), M("async_execute_decouple_bls")],
        log="concurrency_test.server.log", runs=[R("concurrency_test.py")])]),
    "bls": Suite(f"{BP}/bls", [
        Phase("main", [M(m) for m in (
            "bls", "dlpack_add_sub", "bls_async", "bls_memory", "bls_memory_async", "add_sub",
            "execute_error", "identity_fp32", "dlpack_identity")] + [SQUARE] + [
            M("dlpack_square"), M("identity_fp32_timeout")],
            BASE + ["--cuda-memory-pool-byte-size=0:67108864"], env={"BLS_KIND": "non_decoupled"},
            log="bls_non_decoupled.64.inference_server.log",
            runs=[R(SHM_LEAK, m, {"MODEL_NAME": m}, "" if "memory" in m else "gpu")
                  for m in ("bls", "bls_memory", "bls_memory_async", "bls_async")],
            checks=[("Request timeout: 11000000000", ">=", 1, "torch")]),
        Phase("bls_init_error", [M("bls_init_error")], expect="fail",
              log="bls_init_error_server.log", checks=[(BLS_INIT_MSG, ">=", 1)]),
        Phase("bls_finalize_error", [M("bls_finalize_error")],
              log="bls_finalize_error_server.log", checks=[(BLS_INIT_MSG, ">=", 1)]),
        Phase("bls_parameters", [M("bls_parameters")], log="bls_parameters.server.log",
              runs=[R("bls_parameters_test.py")]),
    ], skipped=[("onnx_nobatch_sequence_int32, libtorch_gpu, libtorch_cpu models",
                 "Triton data sets (/data/inferenceserver)"),
                ("bls_model_loading (+ warmup)", "needs onnx_int32_int32_int32 from Triton data"),
                ("CUDA memory pool 256 MB and BLS_KIND=decoupled reruns", "same tests again")]),
    "decoupled": Suite(f"{BP}/decoupled", [Phase(
        "main", [T(f"{BP}/decoupled/models"), M("identity_fp32"),
                 M("execute_cancel", append=[DECOUPLED]), M("response_sender_until_cancelled"),
                 SQUARE, M("dlpack_add_sub")],
        log="decoupled_server.log", runs=[R("decoupled_test.py")],
        skip={"DecoupledTest::test_decoupled_bls": TORCH + " (decoupled_bls, dlpack_add_sub); " + GPU,
              "DecoupledTest::test_decoupled_bls_stream": PB + " (--python-backend)"},
        checks=[(m, ">=", 1, "torch") for m in ("Specific Msg!", "Info Msg!", "Warning Msg!",
                                                "Error Msg!")]  # logged by decoupled_bls
        # test.sh wants 3: one per model that prints it (fewer when some are dropped)
        + [(m, "==", "models") for m in ("Finalize invoked", "Finalize complete...")])]),
    "ensemble": Suite(f"{BP}/ensemble", [Phase(
        "main", [M("ensemble", files=()), M("add_sub_1", "add_sub"), M("add_sub_2", "add_sub")],
        log="ensemble_server.log", runs=[R("ensemble_test.py")],
        skip={"EnsembleTest::test_ensemble_gpu": "needs a GPU and Triton's libtorch model"})]),
    "io": Suite(f"{BP}/io", [
        *[Phase(f"ensemble_io_{t}", [M(f"dlpack_io_identity_{i}", src, sed=[
            name(f"dlpack_io_identity_{i}")]) for i in (1, 2, 3)] + [M("ensemble_io", files=())],
            log="io_server.log", env={"TRIAL": t}, needs="torch",
            runs=[R("io_test.py::IOTest::test_ensemble_io", t)])
          for t, src in (("default", "dlpack_io_identity"),
                         ("decoupled", "dlpack_io_identity_decoupled"))],
        Phase("empty_gpu_output", [M("dlpack_empty_output")], log="io_server.log",
              needs="torch", runs=[R("io_test.py::IOTest::test_empty_gpu_output")]),
        Phase("variable_gpu_output", [M("variable_gpu_output")], log="io_server.log",
              needs="torch", runs=[R("io_test.py::IOTest::test_variable_gpu_output")]),
        Phase("requested_output", [M("add_sub"), M("dlpack_io_identity_decoupled")],
              log="io_server.log", runs=[
                  R("io_test.py::IOTest::test_requested_output_default"),
                  R("io_test.py::IOTest::test_requested_output_decoupled", needs="torch")]),
        Phase("prior_crash", [M("llm", f"{BP}/io/requested_output_model")], log="io_server.log",
              runs=[R("io_test.py::IOTest::test_requested_output_decoupled_prior_crash")]),
    ]),
    "lifecycle": Suite(f"{BP}/lifecycle", [
        Phase("main", [
            M("error_code"), M("execute_cancel"),
            M("execute_error", sed=[name("execute_error"),
                                    (r"^max_batch_size:.*", "max_batch_size: 8")],
              append=[DYN12]),
            M("execute_grpc_error", sed=[name("execute_grpc_error"),
                                         (r"^max_batch_size:.*", "max_batch_size: 8")],
              append=[DYN12.replace("12000000", "1200000")]),
            M("decoupled_grpc_error"), M("execute_return_error"),
            M("wrong_model", sed=[name("wrong_model"), ("TYPE_FP32", "TYPE_UINT32")])],
            log="lifecycle_server.log", runs=[R("lifecycle_test.py")]),
        Phase("init_error", [M("init_error")], expect="fail", log="lifecycle_server.log",
              checks=[("name 'lorem_ipsum' is not defined", ">=", 1)]),
        Phase("fini_error", [M("fini_error")], log="lifecycle_server.log",
              checks=[("name 'undefined_variable' is not defined", ">=", 1)]),
        Phase("auto_complete_error", [M("auto_complete_error", cfg=None)],
              BASE + ["--strict-model-config=false"], expect="fail", log="lifecycle_server.log",
              checks=[("name 'undefined_variable' is not defined", ">=", 1)]),
    ], skipped=[("lifecycle_test.py iterations 2-5", "same tests again")]),
    "logging": Suite(f"{BP}/logging", [
        Phase("default", [M("identity_fp32_logging")], [], log="logging_server.log",
              runs=[R("logging_test.py")], checks=log_counts(4, 0)),
        Phase("verbose", [M("identity_fp32_logging")], [], log="logging_server.log",
              posts=[("/v2/logging", {"log_verbose_level": 1})], runs=[R("logging_test.py")],
              checks=log_counts(4, 3)),
        Phase("disabled", [M("identity_fp32_logging")], [], log="logging_server.log",
              posts=[("/v2/logging", {k: False}) for k in ("log_info", "log_warning",
                                                            "log_error")],
              runs=[R("logging_test.py")], checks=log_counts(1, 0)),
    ]),
    "model_control": Suite(f"{BP}/model_control", [Phase(
        "main", [M("identity_fp32"), M("simple_identity_fp32", files=())],
        BASE + ["--model-control-mode=explicit"], log="model_control_server.log",
        runs=[R("model_control_test.py")])],
        skipped=[("model_control_test.py::ModelIDValidationTest rerun", "same tests again")]),
    "request_rescheduling": Suite(f"{BP}/request_rescheduling", [Phase(
        "main", [M(m) for m in ("bls_request_rescheduling", "request_rescheduling_addsub",
                                "iterative_sequence", "wrong_return_type")],
        BASE + ["--model-control-mode=explicit", "--load-model=*"],
        log="request_rescheduling_server.log",
        runs=[R(SHM_LEAK, "bls_request_rescheduling", {"MODEL_NAME": "bls_request_rescheduling"}),
              R("grpc_endpoint_test.py")])]),
    "response_sender": Suite(f"{BP}/response_sender", [
        Phase("main", [
            response_sender("response_sender"),
            response_sender("response_sender_decoupled", decoupled=True),
            response_sender("response_sender_async", asyncio=True),
            response_sender("response_sender_decoupled_async", asyncio=True, decoupled=True),
            response_sender("response_sender_batching", batching=True),
            response_sender("response_sender_decoupled_batching", decoupled=True, batching=True),
            response_sender("response_sender_async_batching", asyncio=True, batching=True),
            response_sender("response_sender_decoupled_async_batching", True, True, True)],
            log="response_sender_test.server.log", runs=[R("response_sender_test.py")]),
        Phase("complete_final", [M("response_sender_complete_final")],
              log="response_sender_complete_final_test.server.log",
              runs=[R("response_sender_complete_final_test.py")]),
    ]),
    "string_io": Suite("L0_string_io", [Phase(
        "main", [M("string_identity", sed=[(r"\[ 1 \]", "[ 8 ]")])], [],
        # test_util.TestResultCollector breaks under pytest: run as test.sh does
        log="inference_server.log", runs=[R("string_client_test.py", unittest=True)])],
        skipped=[("onnx_zero_1_object model", "Triton data sets (unused by the test)")]),
}


# ---------------------------------------------------------------------------------------------
# Building repositories, running ferry and pytest
# ---------------------------------------------------------------------------------------------
class Ctx:
    def __init__(self, args):
        self.qa = os.path.abspath(args.qa)
        self.pb = os.path.abspath(args.python_backend) if args.python_backend else None
        self.ferry = os.path.abspath(args.ferry)
        self.timeout = args.timeout
        self.work = os.path.abspath(args.workdir or tempfile.mkdtemp(prefix="triton_qa_"))
        # the copy of qa/ (init_args wants its repository at $TRITON_DIR/qa/L0_backend_python)
        self.tree = os.path.join(self.work, "qa")
        self.server = None


def build_repo(ctx, repo, models, notes):
    """Fresh repository at `repo`; returns the names of models dropped (torch, python_backend)."""
    shutil.rmtree(repo, ignore_errors=True)
    os.makedirs(repo)
    for m in models:
        if "tree" in m:
            shutil.copytree(os.path.join(ctx.qa, m["tree"]), repo, dirs_exist_ok=True)
            continue
        if m["root"] == "pb" and not ctx.pb:
            continue
        base = ctx.pb if m["root"] == "pb" else ctx.qa
        src = os.path.join(base, m["src"] if "/" in m["src"] else f"python_models/{m['src']}")
        dst = os.path.join(repo, m["dst"])
        os.makedirs(os.path.join(dst, "1"))
        for f in m["files"]:
            a, b = f if isinstance(f, tuple) else (f, None)
            for p in sorted(glob.glob(os.path.join(src, a))):
                shutil.copy(p, os.path.join(dst, "1", b or os.path.basename(p)))
        if m["cfg"]:
            with open(os.path.join(src, m["cfg"])) as f:
                text = f.read()
            for pat, rep in m["sed"]:
                text = re.sub(pat, rep, text, flags=re.M)
            text += "".join(line + "\n" for line in m["append"])
            with open(os.path.join(dst, "config.pbtxt"), "w") as f:
                f.write(text)
    dropped = []
    for d in sorted(os.listdir(repo)):
        srcs = "".join(open(p).read() for p in glob.glob(os.path.join(repo, d, "1", "*.py")))
        if not HAS_TORCH and TORCH_RE.search(srcs):
            shutil.rmtree(os.path.join(repo, d))
            dropped.append(d)
    if dropped:
        notes.append(f"models dropped ({TORCH}): {', '.join(dropped)}")
    return dropped


def ferry_args(args, notes):
    out = []
    for a in args:
        if a.split("=")[0] in DROPPED_FLAGS:
            notes.append(f"flag dropped (ferry lacks it): {a}")
        else:
            out.append(a)
    return out


def port_open(port):
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


def http(method, path, body=None, timeout=3):
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(f"http://localhost:8000{path}", data=data, method=method)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read().decode(errors="replace")
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")
    except OSError as e:
        return None, str(e)


def descendants(pid):
    kids = {}
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            fields = open(stat).read().rsplit(")", 1)[1].split()
            kids.setdefault(int(fields[1]), []).append(int(stat.split("/")[2]))
        except (OSError, IndexError, ValueError):
            pass
    out, todo = [], [pid]
    while todo:
        for c in kids.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def alive(pid):
    try:
        os.kill(pid, 0)
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def kill(pids):
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def start_ferry(ctx, repo, args, log_path, env):
    for _ in range(60):
        if not any(port_open(p) for p in PORTS):
            break
        time.sleep(1)
    cmd = [ctx.ferry, "serve", f"--model-repository={repo}", "--http-port=8000",
           "--grpc-port=8001", "--metrics-port=8002", *args]
    with open(log_path + ".cmd", "w") as f:  # not in the log: tests read it
        f.write(" ".join(cmd) + "\n")
    log = open(log_path, "w")
    ctx.server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    log.close()
    return ctx.server


def wait_ready(proc, limit=180):
    """True once /v2/health/ready answers 200; False if ferry exits or the time runs out."""
    end = time.time() + limit
    while time.time() < end:
        if proc.poll() is not None:
            return False
        if http("GET", "/v2/health/ready", timeout=2)[0] == 200:
            return True
        time.sleep(1)
    return False


def stop_ferry(ctx, notes):
    proc, ctx.server = ctx.server, None
    if proc is None:
        return
    kids = descendants(proc.pid)
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(45)
        except subprocess.TimeoutExpired:
            notes.append("ferry ignored SIGTERM for 45 s: killed")
            proc.kill()
            proc.wait()
    time.sleep(0.5)
    left = [k for k in kids if alive(k)]
    kill(left)
    if left:
        notes.append(f"{len(left)} child process(es) outlived ferry: killed")


def tail(path, n=1):
    try:
        lines = [l.strip() for l in open(path, errors="replace") if l.strip()]
    except OSError:
        return ""
    return " | ".join(lines[-n:])[:300]


def one_line(text):
    """The first line, long quoted strings (assertIn's haystacks) cut short."""
    lines = [l for l in (text or "").strip().splitlines() if l.strip()]
    line = re.sub(r"\s+", " ", lines[0] if lines else "")
    line = re.sub(r"( not found in )(.{200}).{20,}", r"\1\2...", line)
    return re.sub(r"""(['"])([^'"]{100})[^'"]{20,}\1""", r"\1\2...\1", line)[:400]


def active(why, ctx):
    """Whether a skip applies here: torch ones only without torch, python_backend ones only
    without a checkout, the rest always."""
    if GPU in why:
        return not (HAS_TORCH and HAS_GPU)
    if TORCH in why:
        return not HAS_TORCH
    if PB in why:
        return not ctx.pb
    return True


def collect(target, cwd, env, deselect):
    """The tests a target holds, as "Class::test"."""
    cmd = [sys.executable, "-m", "pytest", "-q", "--collect-only", "-p", "no:cacheprovider",
           target] + [f"--deselect={d}" for d in deselect]
    out = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=120)
    return ["::".join(l.strip().split("::")[1:]) for l in out.stdout.splitlines()
            if "::" in l and " " not in l.strip()]


def run_unittest(ctx, cwd, run, env, logs, tag):
    """`python <file> -v`; its verdicts read from unittest's report on stderr."""
    file = run["target"]
    with open(os.path.join(logs, f"{tag}.out.log"), "w") as out, \
            open(os.path.join(logs, f"{tag}.unittest.log"), "w+") as err:
        try:
            subprocess.run([sys.executable, file, "-v"], cwd=cwd, env=env, stdout=out,
                           stderr=err, timeout=ctx.timeout)
        except subprocess.TimeoutExpired:
            return [(file, "error", f"timed out after {ctx.timeout} s")]
        err.seek(0)
        text = err.read()
    head = re.compile(r"^(test\w*) \((?:[\w.]*\.)?(\w+)\.\1\)")
    results = {}
    for line in text.splitlines():
        m = head.match(line)
        if m:
            results.setdefault(f"{file}::{m[2]}::{m[1]}",
                               ["skipped" if " skipped" in line else "passed", ""])
    for kind, body in re.findall(r"^(FAIL|ERROR): (.*?)(?=^={20,}|^-{20,}\nRan )",
                                 text, re.M | re.S):
        m = head.match(body)
        lines = [l for l in body.splitlines() if l.strip() and not l.startswith("-----")]
        if m:
            results[f"{file}::{m[2]}::{m[1]}"] = [
                "failed" if kind == "FAIL" else "error", one_line(lines[-1])]
    return [(t, o, r) for t, (o, r) in results.items()] or [
        (file, "error", f"unittest ran nothing: {tail(err.name)}")]


def run_pytest(ctx, cwd, run, env, skip, logs, tag):
    """Run one pytest target; returns [(id, outcome, reason)]."""
    if run["unittest"]:
        return run_unittest(ctx, cwd, run, env, logs, tag)
    target, suffix = run["target"], f"[{run['tag']}]" if run["tag"] else ""
    file = target.split("::")[0]
    skips = {f"{file}::{k}": why for k, why in skip.items() if active(why, ctx)}
    xml, log = os.path.join(logs, f"{tag}.xml"), os.path.join(logs, f"{tag}.pytest.log")
    cmd = [sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider",
           f"--junitxml={xml}", target] + [f"--deselect={d}" for d in skips]
    if importlib.util.find_spec("pytest_timeout"):
        cmd.append(f"--timeout={ctx.timeout}")
    results, timed_out = [], False
    with open(log, "w") as out:
        p = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT)
        try:
            p.wait(ctx.timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            p.send_signal(signal.SIGINT)  # pytest still writes the junit file
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
    if os.path.exists(xml):
        for tc in ET.parse(xml).getroot().iter("testcase"):
            tid = f"{file}::{tc.get('classname', '').split('.')[-1]}::{tc.get('name')}{suffix}"
            outcome, reason = "passed", ""
            for kind, label in (("failure", "failed"), ("error", "error"),
                                ("skipped", "skipped")):
                els = tc.findall(kind)  # several: failed subtests
                if els:
                    outcome, el = label, els[0]
                    text = "\n".join(l[1:] for l in (el.text or "").splitlines()
                                     if l.startswith("E "))
                    reason = one_line(el.get("message")) or one_line(text)
                    if len(els) > 1:
                        reason += f" (and {len(els) - 1} more failing subtests)"
                    break
            results.append((tid, outcome, reason))
    rank = {"failed": 0, "error": 1, "skipped": 2, "passed": 3}
    merged = {}
    for tid, outcome, reason in results:  # a failed call and a failed teardown: one row
        if tid not in merged or rank[outcome] < rank[merged[tid][0]]:
            merged[tid] = (outcome, reason)
    results = [(t, o, r) for t, (o, r) in merged.items()]
    if timed_out:
        seen = {r[0] for r in results}
        for t in collect(target, cwd, env, list(skips)):
            if f"{file}::{t}{suffix}" not in seen:
                results.append((f"{file}::{t}{suffix}", "error",
                                f"timed out after {ctx.timeout} s"))
    if not results:
        results.append((target + suffix, "error", f"pytest ran nothing: {tail(log)}"))
    if "::" not in target:
        results += [(k + suffix, "skipped", why) for k, why in skips.items()]
    return results


def check_log(path, checks, repo, label):
    text = open(path, errors="replace").read() if os.path.exists(path) else ""
    out = []
    for c in checks:
        pat, op, n = c[:3]
        if len(c) > 3 and c[3] == "torch" and not HAS_TORCH:
            out.append((label(f"log has {pat!r}"), "skipped", TORCH))
            continue
        pat = pat.replace("{repo}", repo)
        if n == "models":
            n = sum(pat in open(p).read() for p in glob.glob(os.path.join(repo, "*/1/*.py")))
        got = sum(1 for line in text.splitlines() if pat in line)
        ok = got >= n if op == ">=" else got == n
        out.append((label(f"log has {pat!r} {op} {n}"), "passed" if ok else "failed",
                    "" if ok else f"found {got} line(s)"))
    return out


def run_phase(ctx, ph, cwd, logs):
    notes, results = [], []
    label = lambda what: f"[{ph.name}] {what}"  # noqa: E731
    if ph.needs == "torch" and not HAS_TORCH:
        return [(label(r["target"] + (f"[{r['tag']}]" if r["tag"] else "")), "skipped", TORCH)
                for r in ph.runs] or [(label("phase"), "skipped", TORCH)], notes
    repo = os.path.join(cwd, "models")
    build_repo(ctx, repo, ph.models, notes)
    env = dict(os.environ, TEST_JETSON="1", TEST_WINDOWS="0", TRITONSERVER_IPADDR="localhost",
               MODELDIR=os.path.join(ctx.tree, BP), TRITON_DIR=ctx.work, **ph.env)
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    log = os.path.join(cwd, ph.log)
    env["SERVER_LOG"] = log
    proc = start_ferry(ctx, repo, ferry_args(ph.args, notes), log, env)
    try:
        if ph.expect == "fail":
            try:
                proc.wait(90)
                results.append((label("server fails to start"), "passed", ""))
            except subprocess.TimeoutExpired:
                results.append((label("server fails to start"), "failed",
                                "unexpected success starting the server: " + tail(log)))
            stop_ferry(ctx, notes)
            return results + check_log(log, ph.checks, repo, label), notes
        if not wait_ready(proc):
            why = f"server not ready (exit {proc.poll()}): {tail(log, 2)}"
            results.append((label("server starts ready"), "failed", why))
            stop_ferry(ctx, notes)
            for r in ph.runs:
                file = r["target"].split("::")[0]
                for t in collect(r["target"], cwd, env, []):
                    results.append((f"{file}::{t}" + (f"[{r['tag']}]" if r["tag"] else ""),
                                    "error", why))
            return results, notes
        results.append((label("server starts ready"), "passed", ""))
        if ph.kill9:
            time.sleep(5)
            kids = descendants(proc.pid)
            proc.kill()
            proc.wait()
            time.sleep(10)
            left = [k for k in kids if alive(k)]
            results.append((label("children exit after kill -9 of the server"),
                            "failed" if left else "passed",
                            f"{len(left)} of {len(kids)} still running" if left else ""))
            kill(left)
            ctx.server = None
            return results, notes
        for path, body in ph.posts:
            code, text = http("POST", path, body)
            results.append((label(f"POST {path} {json.dumps(body)} -> 200"),
                            "passed" if code == 200 else "failed",
                            "" if code == 200 else f"{code}: {one_line(text)}"))
        for i, r in enumerate(ph.runs):
            if r["needs"] in ("torch", "gpu") and not HAS_TORCH or r["needs"] == "gpu" and not HAS_GPU:
                tid = r["target"] + (f"[{r['tag']}]" if r["tag"] else "")
                results.append((tid, "skipped", TORCH if not HAS_TORCH else GPU))
                continue
            renv = dict(env, **r["env"])
            results += run_pytest(ctx, cwd, r, renv, ph.skip, logs, f"{ph.name}.{i}")
    finally:
        stop_ferry(ctx, notes)
    return results + check_log(log, ph.checks, repo, label), notes


def run_suite(ctx, sname, suite):
    cwd = os.path.join(ctx.tree, suite.folder)
    os.makedirs(cwd, exist_ok=True)
    shutil.copytree(os.path.join(ctx.qa, "common"), os.path.join(ctx.tree, "common"),
                    dirs_exist_ok=True, ignore=shutil.ignore_patterns("*.cu.cc", "gen_*"))
    for src in glob.glob(os.path.join(ctx.qa, suite.folder, "*.py")) + glob.glob(
            os.path.join(ctx.qa, BP, "*.py")):
        dst = os.path.join(ctx.tree, os.path.relpath(src, ctx.qa))
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        shutil.copy(src, dst)
    logs = os.path.join(cwd, "_logs", sname)
    os.makedirs(logs, exist_ok=True)
    tests, notes = [], []
    start = time.time()
    for ph in suite.phases:
        for f in glob.glob(os.path.join(cwd, "*.log")):
            os.remove(f)  # test.sh's rm -f *.log between runs
        res, n = run_phase(ctx, ph, cwd, logs)
        tests += [dict(id=t, outcome=o, reason=r, phase=ph.name) for t, o, r in res]
        notes += [f"{ph.name}: {x}" for x in dict.fromkeys(n)]
        for ext in ("", ".cmd"):
            if os.path.exists(os.path.join(cwd, ph.log + ext)):
                shutil.copy(os.path.join(cwd, ph.log + ext),
                            os.path.join(logs, f"{ph.name}.server.log{ext}"))
    skipped = [dict(part=p, reason=r) for p, r in suite.skipped]
    if not ctx.pb and any(m.get("root") == "pb" for ph in suite.phases for m in ph.models):
        skipped.append(dict(part="square_int32 (+ tests using it)",
                            reason="no --python-backend checkout"))
    count = lambda o: sum(t["outcome"] == o for t in tests)  # noqa: E731
    return dict(folder=suite.folder, workdir=cwd, logs=logs, seconds=round(time.time() - start),
                passed=count("passed"), failed=count("failed"), errored=count("error"),
                skipped=count("skipped"), tests=tests, notes=notes, skipped_parts=skipped)


def print_report(report):
    print(f"\n{'suite':<22}{'passed':>8}{'failed':>8}{'errored':>9}{'skipped':>9}{'secs':>7}")
    for name_, s in report["suites"].items():
        print(f"{name_:<22}{s['passed']:>8}{s['failed']:>8}{s['errored']:>9}{s['skipped']:>9}"
              f"{s['seconds']:>7}")
    for name_, s in report["suites"].items():
        bad = [t for t in s["tests"] if t["outcome"] in ("failed", "error")]
        skip = [t for t in s["tests"] if t["outcome"] == "skipped"]
        if not (bad or skip or s["skipped_parts"] or s["notes"]):
            continue
        print(f"\n== {name_}  (logs: {s['logs']})")
        for t in bad:
            print(f"  {t['outcome'].upper():<6} {t['id']}: {t['reason']}")
        for t in skip:
            print(f"  SKIP   {t['id']}: {t['reason']}")
        for p in s["skipped_parts"]:
            print(f"  SKIP   (test.sh) {p['part']}: {p['reason']}")
        for n in s["notes"]:
            print(f"  note   {n}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--qa", required=True, help="Triton server's qa/ folder")
    ap.add_argument("--ferry", default="target/debug/ferry")
    ap.add_argument("--only", help="comma-separated suites: " + ",".join(SUITES))
    ap.add_argument("--python-backend", help="python_backend checkout (for square_int32)")
    ap.add_argument("--json", default="/tmp/triton_qa.json")
    ap.add_argument("--timeout", type=int, default=600, help="seconds per pytest run")
    ap.add_argument("--workdir", help="where repositories, copies and logs go (default: temp)")
    args = ap.parse_args()
    names = args.only.split(",") if args.only else list(SUITES)
    unknown = [n for n in names if n not in SUITES]
    if unknown:
        ap.error(f"unknown suite(s) {unknown}; known: {', '.join(SUITES)}")
    ctx = Ctx(args)
    if any(port_open(p) for p in PORTS):
        sys.exit(f"a port of {PORTS} is in use: stop whatever listens there first")

    def bail(signum, _frame):
        stop_ferry(ctx, [])
        sys.exit(128 + signum)

    signal.signal(signal.SIGTERM, bail)
    report = dict(ferry=ctx.ferry, qa=ctx.qa, workdir=ctx.work, torch=HAS_TORCH, suites={})
    print(f"work dir: {ctx.work}", flush=True)
    try:
        for n in names:
            print(f"--- {n}", flush=True)
            report["suites"][n] = run_suite(ctx, n, SUITES[n])
            s = report["suites"][n]
            print(f"    {s['passed']} passed, {s['failed']} failed, {s['errored']} errors, "
                  f"{s['skipped']} skipped ({s['seconds']} s)", flush=True)
            with open(args.json, "w") as f:
                json.dump(report, f, indent=1)
    finally:
        stop_ferry(ctx, [])
    print_report(report)
    print(f"\nJSON: {args.json}")


if __name__ == "__main__":
    main()
