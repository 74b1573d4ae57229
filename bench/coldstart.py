#!/usr/bin/env python3
"""Cold start from a bucket: time from process start to ready for a model of a few hundred MB
held by the local storage emulator, against a plain sequential download of the same objects.

Runs the release binary (cargo build --release first) against moto (S3) and fake-gcs-server
(GCS), the same servers the tests use:

    source scripts/venv.sh && python bench/coldstart.py --mib 256
"""
import argparse
import os
import subprocess
import sys
import tempfile
import time
import urllib.request

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests", "python"))
from buckets import StorageServer, free_port  # noqa: E402

sys.path.insert(0, os.path.join(ROOT, "bench"))
import run as bench_run  # noqa: E402

BINARY = os.path.join(ROOT, "target", "release", "ferry")


def big_model(path, mib):
    """y = x + sum(W): one model.onnx of about `mib` MiB (W is folded away at load)."""
    w = np.random.default_rng(0).standard_normal((mib, 1 << 18), dtype=np.float32)
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 1])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 1])
    nodes = [helper.make_node("ReduceSum", ["W"], ["s"], keepdims=0), helper.make_node("Add", ["x", "s"], ["y"])]
    graph = helper.make_graph(nodes, "big", [x], [y], initializer=[numpy_helper.from_array(w, "W")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    os.makedirs(os.path.join(path, "big", "1"), exist_ok=True)
    onnx.save(model, os.path.join(path, "big", "1", "model.onnx"))
    with open(os.path.join(path, "big", "config.pbtxt"), "w") as f:
        f.write('name: "big"\nmax_batch_size: 8\n')


def sequential_download(bucket, keys, dest):
    """One object after another, one stream each, written to disk: the plain way."""
    started = time.perf_counter()
    total = 0
    for key in keys:
        out = os.path.join(dest, key.replace("/", "_"))
        if bucket.scheme == "s3":
            body = bucket.s3.get_object(Bucket=bucket.name, Key=key)["Body"]
            read = body.read
        else:
            quoted = urllib.parse.quote(key, safe="")
            resp = urllib.request.urlopen(f"{bucket.endpoint}/storage/v1/b/{bucket.name}/o/{quoted}?alt=media")
            read = resp.read
        with open(out, "wb") as f:
            while chunk := read(1 << 20):
                f.write(chunk)
                total += len(chunk)
    return time.perf_counter() - started, total


def time_to_ready(bucket, cache, extra):
    port = free_port()
    cmd = [BINARY, "serve", "--model-repository", bucket.url("repo"), *bucket.server_args(), f"--model-cache-dir={cache}",
           "--http-address=127.0.0.1", f"--http-port={port}", "--grpc-port=0", "--metrics-port=0", *extra]
    env = {**os.environ, **bucket.server_env()}
    started = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"ferry exited with {proc.returncode}: {cmd}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/health/ready", timeout=1) as r:
                    if r.status == 200:
                        return time.perf_counter() - started
            except OSError:
                pass
            time.sleep(0.01)
    finally:
        proc.terminate()
        proc.wait()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--kinds", default="gcs,s3")
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    work = tempfile.mkdtemp(prefix="ferry-coldstart-")
    big_model(os.path.join(work, "src"), args.mib)
    rows = []
    for kind in args.kinds.split(","):
        storage = StorageServer(kind)
        try:
            bucket = storage.bucket("coldstart")
            bucket.upload_dir(os.path.join(work, "src"), "repo")
            keys = bucket.keys("repo/")
            results = {"sequential download": [], "ferry, parallel ranged reads": [],
                       "ferry, one stream per object": [], "ferry, restart with a warm cache": []}
            for run in range(args.runs):
                dest = tempfile.mkdtemp(dir=work)
                seconds, total = sequential_download(bucket, keys, dest)
                results["sequential download"].append(seconds)
                cache = os.path.join(work, f"cache-{kind}-{run}")
                results["ferry, parallel ranged reads"].append(time_to_ready(bucket, cache, []))
                results["ferry, restart with a warm cache"].append(time_to_ready(bucket, cache, []))
                results["ferry, one stream per object"].append(
                    time_to_ready(bucket, cache + "-seq", ["--storage-parallelism=1", "--storage-part-mib=1000000"]))
            for name, values in results.items():
                rows.append((kind, name, min(values), total))
        finally:
            storage.stop()
    lines = [
        f"Commit `{bench_run.commit_label()}`, {time.strftime('%Y-%m-%d')}, release build, 2 cores: one model of "
        f"{total / 1048576:.0f} MiB in {len(keys)} objects held by the local emulator (moto for S3, fake-gcs-server "
        f"for GCS); best of {args.runs} runs. ferry's figures are process start to `/v2/health/ready` (download, "
        "verification, ONNX Runtime load); the sequential download only fetches the objects one stream at a time "
        "(boto3 for S3, the JSON API for GCS) and writes them to disk.",
        "",
        "| store | what | seconds | MiB/s | vs sequential |",
        "|---|---|---:|---:|---:|",
    ]
    base = {kind: seconds for kind, name, seconds, _ in rows if name == "sequential download"}
    for kind, name, seconds, size in rows:
        lines.append(f"| {kind} | {name} | {seconds:.2f} | {size / 1048576 / seconds:.0f} | "
                     f"{base[kind] / seconds:.1f}× |")
    print("\n".join(lines))
    bench_run.replace_section(os.path.join(ROOT, "bench", "RESULTS.md"), "Cold start from a bucket", "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
