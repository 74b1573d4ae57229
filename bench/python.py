#!/usr/bin/env python3
"""The cost of Python steps (after `source bench/tools.sh` and a release build):

  - an identity Python model against the identity ONNX model (FP32 [16], dynamic batching) at
    concurrency 1 and 16 over HTTP, p50 and throughput;
  - the text_classifier pipeline of examples/ (Python, ONNX, Python, an ensemble) against its ONNX
    model called directly;
  - an ensemble hop: an ensemble of one ONNX step against that ONNX model;
  - the memory of the Python processes, idle and after 10,000 requests.

Writes the section "Python steps and ensembles" of bench/RESULTS.md.
"""
import os
import shutil
import subprocess
import sys
import time

import numpy as np
import onnx
from onnx import TensorProto, helper

BENCH = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(BENCH)
sys.path.insert(0, BENCH)
import run  # noqa: E402

IDENTITY_PY = '''
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", pb_utils.get_input_tensor_by_name(r, "INPUT0").as_numpy())])
                for r in requests]
'''

CONFIG = """
{backend}
max_batch_size: 8
dynamic_batching {{ }}
input [ {{ name: "INPUT0" data_type: TYPE_FP32 dims: [ 16 ] }} ]
output [ {{ name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 16 ] }} ]
instance_group [ {{ count: 1 kind: KIND_CPU }} ]
"""

HOP = """
platform: "ensemble"
max_batch_size: 8
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 16 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 16 ] } ]
ensemble_scheduling { step [ { model_name: "identity_onnx" model_version: -1
  input_map { key: "INPUT0" value: "INPUT0" } output_map { key: "OUTPUT0" value: "OUTPUT0" } } ] }
"""


def write(path, text):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)


def repository():
    repo = os.path.join(run.WORK, "python-repo")
    shutil.rmtree(repo, ignore_errors=True)
    x = helper.make_tensor_value_info("INPUT0", TensorProto.FLOAT, ["b", 16])
    y = helper.make_tensor_value_info("OUTPUT0", TensorProto.FLOAT, ["b", 16])
    model = helper.make_model(helper.make_graph([helper.make_node("Identity", ["INPUT0"], ["OUTPUT0"])], "id", [x], [y]),
                              opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    os.makedirs(os.path.join(repo, "identity_onnx", "1"))
    onnx.save(model, os.path.join(repo, "identity_onnx", "1", "model.onnx"))
    write(os.path.join(repo, "identity_onnx", "config.pbtxt"), CONFIG.format(backend='platform: "onnxruntime_onnx"'))
    write(os.path.join(repo, "identity_py", "1", "model.py"), IDENTITY_PY)
    write(os.path.join(repo, "identity_py", "config.pbtxt"), CONFIG.format(backend='backend: "python"'))
    write(os.path.join(repo, "ensemble_hop", "config.pbtxt"), HOP)
    write(os.path.join(repo, "ensemble_hop", "1", "README"), "empty version folder\n")
    for m in ("text_classifier", "text_classifier_pre", "text_classifier_onnx", "text_classifier_post"):
        shutil.copytree(os.path.join(ROOT, "examples", m), os.path.join(repo, m))
    return repo


def python_rss(server_pid):
    """RSS (MiB) of each Python process ferry started."""
    out = subprocess.run(["ps", "--ppid", str(server_pid), "-o", "pid=,rss=,args="], capture_output=True, text=True).stdout
    return [int(line.split()[1]) / 1024 for line in out.splitlines() if "ferry_stub.py" in line]


def memory(repo):
    import tritonclient.http as httpclient
    http_port, grpc_port = run.free_port(), run.free_port()
    proc = run.start_server(repo, http_port, grpc_port, [])
    try:
        time.sleep(1)
        idle = python_rss(proc.pid)
        client = httpclient.InferenceServerClient(f"127.0.0.1:{http_port}", concurrency=8)
        x = np.random.default_rng(1).standard_normal((1, 16)).astype(np.float32)
        ins = [httpclient.InferInput("INPUT0", [1, 16], "FP32").set_data_from_numpy(x)]
        text = [httpclient.InferInput("TEXT", [1, 1], "BYTES").set_data_from_numpy(np.array([[b"a fine day"]], dtype=np.object_))]
        for start in range(0, 10_000, 200):
            pending = [client.async_infer("identity_py", ins) for _ in range(100)]
            pending += [client.async_infer("text_classifier", text) for _ in range(100)]
            for p in pending:
                p.get_result()
        after = python_rss(proc.pid)
    finally:
        proc.terminate()
        proc.wait(30)
    return idle, after


def main():
    os.makedirs(run.WORK, exist_ok=True)
    repo = repository()
    title = "Python steps and ensembles"
    note = ("identity_py is an identity Python model (one process, requests batched by the dynamic batcher "
            "into one execute call); ensemble_hop is an ensemble of one step running identity_onnx; "
            "text_classifier is the examples/ pipeline (Python, ONNX, Python) beside its ONNX step alone.")
    subprocess.run([sys.executable, os.path.join(BENCH, "run.py"), "--repo", repo, "--title", title, "--note", note,
                    "--models", "identity_onnx,ensemble_hop,identity_py,text_classifier_onnx,text_classifier",
                    "--protocols", "http", "--concurrency", "1,16"], check=True)
    idle, after = memory(repo)
    lines = ["", f"Python processes' memory (RSS, MiB): idle {', '.join(f'{m:.1f}' for m in idle)}; after 10,000 "
             f"requests (5,000 to identity_py, 5,000 through text_classifier) {', '.join(f'{m:.1f}' for m in after)}."]
    path = os.path.join(BENCH, "RESULTS.md")
    text = open(path).read()
    marker = f"\n## {title}\n"
    start = text.index(marker)
    end = text.find("\n## ", start + len(marker))
    end = len(text) if end < 0 else end
    text = text[:end].rstrip("\n") + "\n" + "\n".join(lines) + "\n" + text[end:]
    with open(path, "w") as f:
        f.write(text)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
