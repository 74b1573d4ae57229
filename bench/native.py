#!/usr/bin/env python3
"""Built-in processing steps against Python steps (after `source bench/tools.sh` and a release
build), on 640x480 JPEG photos:

  - pre-processing alone: `ferry_image` (ImageNet preset: resize 256, crop 224, normalise) against
    a Python model doing the same with PIL and numpy, at concurrency 1 and 16 (perf_analyzer);
  - the pipeline three ways, c1 and c16: native steps (ferry_image, DenseNet-121 in ONNX Runtime,
    ferry_postprocess top-1 with labels, an ensemble), the same with Python steps, and the ONNX
    model alone with the client doing the pre-processing (PIL in tritonclient's threads);
  - CPU time per request: the server and its Python processes, from /proc;
  - the floor under any pre-processing of this photo: PIL's JPEG decoding alone (libjpeg-turbo),
    in-process, beside the Python step's whole `prepare`, in the same sitting.

Writes the section "Native processing steps" of bench/RESULTS.md.
"""
import base64
import io
import os
import shutil
import subprocess
import sys
import threading
import time

import numpy as np

BENCH = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(BENCH)
sys.path.insert(0, BENCH)
sys.path.insert(0, os.path.join(ROOT, "tests", "python"))
import models  # noqa: E402
import run  # noqa: E402

PRE_PY = '''
import base64
import io
import numpy as np
import triton_python_backend_utils as pb_utils
from PIL import Image

MEAN = np.array([0.485, 0.456, 0.406], dtype=np.float32).reshape(3, 1, 1)
STD = np.array([0.229, 0.224, 0.225], dtype=np.float32).reshape(3, 1, 1)


def prepare(data):
    img = Image.open(io.BytesIO(base64.b64decode(data))).convert("RGB")
    w, h = img.size
    s = 256 / min(w, h)
    img = img.resize((256, int(h * s)) if w <= h else (int(w * s), 256), Image.BILINEAR)
    left, top = int(round((img.width - 224) / 2.0)), int(round((img.height - 224) / 2.0))
    x = np.asarray(img.crop((left, top, left + 224, top + 224)), dtype=np.float32).transpose(2, 0, 1) / 255.0
    return (x - MEAN) / STD


class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor("PIXELS", prepare(
            pb_utils.get_input_tensor_by_name(r, "IMAGE").as_numpy().reshape(-1)[0]).astype(np.float32))])
            for r in requests]
'''

POST_PY = '''
import os
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.labels = open(os.path.join(args["model_repository"], "labels.txt")).read().split()

    def execute(self, requests):
        out = []
        for r in requests:
            x = pb_utils.get_input_tensor_by_name(r, "LOGITS").as_numpy().reshape(-1)
            p = np.exp(x - x.max())
            p /= p.sum()
            i = int(p.argmax())
            out.append(pb_utils.InferenceResponse([
                pb_utils.Tensor("LABEL", np.array([self.labels[i].encode()], dtype=np.object_)),
                pb_utils.Tensor("SCORE", np.array([p[i]], dtype=np.float32))]))
        return out
'''

IMAGE_IN = 'input [ { name: "IMAGE" data_type: TYPE_STRING dims: [ 1 ] } ]'
PIXELS = '{ name: "PIXELS" data_type: TYPE_FP32 dims: [ 3, 224, 224 ] }'
LABEL_OUT = ('output [ { name: "LABEL" data_type: TYPE_STRING dims: [ 1 ] }, '
             '{ name: "SCORE" data_type: TYPE_FP32 dims: [ 1 ] } ]')


def ensemble(pre, post):
    return f"""
platform: "ensemble"
max_batch_size: 0
{IMAGE_IN}
{LABEL_OUT}
ensemble_scheduling {{ step [
  {{ model_name: "{pre}" model_version: -1 input_map {{ key: "IMAGE" value: "IMAGE" }}
     output_map {{ key: "PIXELS" value: "pixels" }} }},
  {{ model_name: "densenet_onnx" model_version: -1 input_map {{ key: "data_0" value: "pixels" }}
     output_map {{ key: "fc6_1" value: "logits" }} }},
  {{ model_name: "{post}" model_version: -1 input_map {{ key: "LOGITS" value: "logits" }}
     output_map [ {{ key: "LABEL" value: "LABEL" }}, {{ key: "SCORE" value: "SCORE" }} ] }} ] }}
"""


def repository():
    repo = os.path.join(run.WORK, "native-repo")
    shutil.rmtree(repo, ignore_errors=True)
    models.densenet(repo)

    def write(name, config, code=None):
        models.write(os.path.join(repo, name, "config.pbtxt"), f'name: "{name}"\n' + config)
        os.makedirs(os.path.join(repo, name, "1"), exist_ok=True)
        if code:
            models.write(os.path.join(repo, name, "1", "model.py"), code)

    write("pre_native", f'backend: "ferry_image"\nmax_batch_size: 0\n'
          'parameters [ { key: "preset" value { string_value: "imagenet" } } ]\n'
          f'{IMAGE_IN}\noutput [ {PIXELS} ]\n')
    write("pre_python", f'backend: "python"\nmax_batch_size: 0\n{IMAGE_IN}\noutput [ {PIXELS} ]\n', PRE_PY)
    # The same two steps configured as the migration's pre-processing model: dynamic batching, one
    # instance (a batch's images spread over the instance's threads natively; one Python process).
    batched = 'max_batch_size: 16\ndynamic_batching { }\n' + IMAGE_IN
    write("pre_native_batched", 'backend: "ferry_image"\n' + batched
          + '\nparameters [ { key: "preset" value { string_value: "imagenet" } } ]\n'
          f'output [ {PIXELS} ]\n')
    write("pre_python_batched", 'backend: "python"\n' + batched + f'\noutput [ {PIXELS} ]\n',
          PRE_PY.replace(").astype(np.float32))])", ")[None].astype(np.float32))])"))
    logits_in = 'input [ { name: "LOGITS" data_type: TYPE_FP32 dims: [ 1000 ] } ]'
    write("post_native", 'backend: "ferry_postprocess"\nmax_batch_size: 0\nparameters [ '
          '{ key: "operation" value { string_value: "topk" } }, { key: "k" value { string_value: "1" } }, '
          '{ key: "activation" value { string_value: "softmax" } }, '
          '{ key: "labels" value { string_value: "labels.txt" } } ]\n'
          f'{logits_in}\n{LABEL_OUT}\n')
    write("post_python", f'backend: "python"\nmax_batch_size: 0\n{logits_in}\n{LABEL_OUT}\n', POST_PY)
    for post in ("post_native", "post_python"):
        shutil.copy(os.path.join(repo, "densenet_onnx", "labels.txt"), os.path.join(repo, post, "labels.txt"))
    write("pipeline_native", ensemble("pre_native", "post_native"))
    write("pipeline_python", ensemble("pre_python", "post_python"))
    return repo


def photo_jpeg():
    from PIL import Image
    rng = np.random.default_rng(4)
    y, x = np.mgrid[0:480, 0:640]
    img = np.stack([x * 255 / 640, y * 255 / 480, (x * y) % 256], -1) + rng.normal(0, 10, (480, 640, 3))
    buf = io.BytesIO()
    Image.fromarray(np.clip(img, 0, 255).astype(np.uint8)).save(buf, "JPEG", quality=90)
    return buf.getvalue()


def in_process_ms(jpeg, rounds=3, n=100):
    """CPU ms per image in this process, the best of `rounds`: PIL's decoding alone (to RGB) and
    the Python step's whole `prepare` (its code, run without the backend)."""
    import types
    from PIL import Image
    sys.modules.setdefault("triton_python_backend_utils", types.ModuleType("triton_python_backend_utils"))
    step = {}
    exec(PRE_PY, step)
    text = base64.b64encode(jpeg)

    def best(f):
        times = []
        for _ in range(rounds):
            t = time.process_time()
            for _ in range(n):
                f()
            times.append((time.process_time() - t) / n * 1000)
        return min(times)

    return best(lambda: Image.open(io.BytesIO(jpeg)).convert("RGB")), best(lambda: step["prepare"](text))


def cpu_seconds(pid):
    """CPU time of `pid` and its live children (the Python processes)."""
    tick = os.sysconf("SC_CLK_TCK")
    pids = [pid] + [int(p) for p in subprocess.run(["ps", "--ppid", str(pid), "-o", "pid="], capture_output=True,
                                                   text=True).stdout.split()]
    total = 0
    for p in pids:
        try:
            fields = open(f"/proc/{p}/stat").read().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])
        except OSError:
            pass
    return total / tick


def served(base, model):
    return run.get(f"{base}/v2/models/{model}/stats")["model_stats"][0]["inference_stats"]["success"]["count"]


def client_side(port, concurrency, jpeg, seconds=15):
    """The ONNX model alone, each client thread pre-processing with PIL before sending."""
    import tritonclient.http as httpclient
    exec(PRE_PY.split("class TritonPythonModel")[0].replace("import triton_python_backend_utils as pb_utils", ""),
         globals())
    data = base64.b64encode(jpeg)
    latencies, stop, lock = [], time.time() + seconds, threading.Lock()

    def worker():
        client = httpclient.InferenceServerClient(f"127.0.0.1:{port}")
        while time.time() < stop:
            t0 = time.perf_counter()
            x = prepare(data).astype(np.float32)  # noqa: F821 - defined by the exec above
            inp = httpclient.InferInput("data_0", [3, 224, 224], "FP32").set_data_from_numpy(x, binary_data=True)
            client.infer("densenet_onnx", [inp])
            with lock:
                latencies.append(time.perf_counter() - t0)

    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    started = time.time()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    took = time.time() - started
    ms = np.array(latencies) * 1000
    return {"throughput": len(latencies) / took, "p50": float(np.percentile(ms, 50)), "p99": float(np.percentile(ms, 99))}


def main():
    os.makedirs(run.WORK, exist_ok=True)
    repo = repository()
    jpeg = photo_jpeg()
    data = os.path.join(run.WORK, "native.input.json")
    with open(data, "w") as f:
        import json
        json.dump({"data": [{"IMAGE": {"content": [base64.b64encode(jpeg).decode()], "shape": [1]}}]}, f)
    decode_ms, prepare_ms = in_process_ms(jpeg)
    http_port, grpc_port = run.free_port(), run.free_port()
    proc = run.start_server(repo, http_port, grpc_port, ["--metrics-port=0"])
    base = f"http://127.0.0.1:{http_port}"
    rows = []
    try:
        for model in ("pre_native", "pre_python", "pre_native_batched", "pre_python_batched", "pipeline_native",
                      "pipeline_python"):
            for c in (1, 16):
                cpu0, n0 = cpu_seconds(proc.pid), served(base, model)
                r = run.perf(model, f"127.0.0.1:{http_port}", "http", c, data, 5000)
                cpu = (cpu_seconds(proc.pid) - cpu0) / max(1, served(base, model) - n0) * 1000
                rows.append((model, c, r["throughput"], r["p50"], r["p99"], cpu))
                print(rows[-1], flush=True)
        for c in (1, 16):
            cpu0, n0 = cpu_seconds(proc.pid), served(base, "densenet_onnx")
            r = client_side(http_port, c, jpeg)
            cpu = (cpu_seconds(proc.pid) - cpu0) / max(1, served(base, "densenet_onnx") - n0) * 1000
            rows.append(("densenet_onnx + client PIL", c, r["throughput"], r["p50"], r["p99"], cpu))
            print(rows[-1], flush=True)
    finally:
        proc.terminate()
        proc.wait(30)
    lines = [f"Commit `{run.commit_label()}`, release build, 2 cores, load generator on the same machine (perf_analyzer "
             "2.50 over HTTP, 5 s windows; the client-side row is tritonclient threads that pre-process with PIL). "
             "Input: one 640x480 JPEG photo (quality 90), sent as base64 text. Pre-processing: resize the shortest "
             "side to 256 (bilinear), centre crop 224, ImageNet normalisation, FP32 NCHW. Model: DenseNet-121 (the "
             "onnx package's light variant) in ONNX Runtime. CPU ms per request: the server and its Python "
             "processes (the client-side row leaves the pre-processing's CPU in the client, not counted). `pre_*`: "
             "max_batch_size 0, one instance; `pre_*_batched`: max_batch_size 16 with dynamic batching, one "
             "instance.", "",
             "| what | concurrency | requests/s | p50 ms | p99 ms | server CPU ms per request |",
             "|---|---|---|---|---|---|"]
    for model, c, tput, p50, p99, cpu in rows:
        lines.append(f"| {model} | {c} | {tput:.1f} | {p50:.2f} | {p99:.2f} | {cpu:.2f} |")
    by = {(m, c): t for m, c, t, *_ in rows}
    by_cpu = {(m, c): cpu for m, c, *_, cpu in rows}
    lines += ["", "Against the targets of the native processing issue: native pre-processing is "
              + ", ".join(f"{by[('pre_native', c)] / by[('pre_python', c)]:.1f}x the Python step's throughput at c{c}"
                          for c in (1, 16))
              + "; configured as the migration's pre-processing model (dynamic batching, one instance) "
              + ", ".join(f"{by[('pre_native_batched', c)] / by[('pre_python_batched', c)]:.1f}x at c{c}" for c in (1, 16))
              + " (target: at least 5x); the native pipeline reaches "
              + ", ".join(f"{by[('pipeline_native', c)] / by[('densenet_onnx + client PIL', c)] * 100:.0f}% of the "
                          f"ONNX model alone with client-side pre-processing at c{c}" for c in (1, 16))
              + " (target: within 10%).", "",
              f"The floor under any pre-processing of this photo, in-process in the same sitting: PIL decodes it "
              f"(libjpeg-turbo) in {decode_ms:.2f} ms of CPU, and the Python step's whole `prepare` takes "
              f"{prepare_ms:.2f} ms. Per second of CPU, a native step that only decoded, as fast as libjpeg-turbo, "
              f"and cost the server nothing else would serve {by_cpu[('pre_python', 16)] / decode_ms:.1f}x the "
              f"Python step's images ({by_cpu[('pre_python', 16)]:.2f} ms of server CPU per image at c16 / "
              f"{decode_ms:.2f} ms); the batched rows' ratio adds what two cores buy against the Python step's one "
              f"process, less the load generator's share of the same two cores."]
    run.replace_section(os.path.join(BENCH, "RESULTS.md"), "Native processing steps", "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
