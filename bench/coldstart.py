#!/usr/bin/env python3
"""Cold start from a bucket: time from process start to ready for a model of a few hundred MB
held by the local storage emulator, against a plain sequential download of the same objects.

An emulator on loopback answers at memory speed, which no cloud store does: there, one stream
delivers tens of MB/s and every request waits for its first byte. So both the plain download and
ferry reach the emulator through a proxy that holds each connection to --stream-mib MiB/s and
delays each response's first byte by --first-byte-ms, the per-stream behaviour parallel ranged
reads exist to overcome.

Runs the release binary (cargo build --release first) against moto (S3) and fake-gcs-server
(GCS), the same servers the tests use:

    source scripts/venv.sh && python bench/coldstart.py --mib 256
"""
import argparse
import asyncio
import json
import os
import re
import threading
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


class Throttle:
    """A TCP proxy to 127.0.0.1:`port`: each connection's responses at most `mib_per_s`, and
    `first_byte_ms` before the first bytes of each response."""

    def __init__(self, port, mib_per_s, first_byte_ms):
        self.upstream, self.rate, self.latency = port, mib_per_s * 1048576, first_byte_ms / 1000
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        server = asyncio.run_coroutine_threadsafe(asyncio.start_server(self.handle, "127.0.0.1", 0), self.loop).result()
        port_here = server.sockets[0].getsockname()[1]
        self.endpoint = f"http://127.0.0.1:{port_here}"
        # fake-gcs-server answers the XML API only for the host it was told it serves.
        self.host_here, self.host_there = f"127.0.0.1:{port_here}".encode(), f"127.0.0.1:{port}".encode()

    async def handle(self, reader, writer):
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.upstream)
        state = {"asked": False}

        async def requests():
            while data := await reader.read(65536):
                state["asked"] = True
                up_writer.write(data.replace(self.host_here, self.host_there))
                await up_writer.drain()
            up_writer.close()

        async def responses():
            loop = asyncio.get_running_loop()
            due = loop.time()
            while data := await up_reader.read(65536):
                if state["asked"]:
                    state["asked"] = False
                    await asyncio.sleep(self.latency)
                    due = max(due, loop.time())
                due += len(data) / self.rate
                await asyncio.sleep(max(0.0, due - loop.time()))
                writer.write(data)
                await writer.drain()
            writer.close()

        try:
            await asyncio.gather(requests(), responses())
        except (ConnectionError, OSError):
            writer.close()
            up_writer.close()


def through(bucket, endpoint):
    """The same bucket, reached at `endpoint`."""
    bucket.endpoint = endpoint
    if bucket.scheme == "s3":
        import boto3
        bucket.s3 = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id="testing",
                                 aws_secret_access_key="testing")
    return bucket


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


def parallel_download(bucket, keys, dest, part):
    """The same objects in ranged parts of `part` bytes, 16 at once, from Python threads: what the
    emulator itself can serve in parallel."""
    import concurrent.futures
    sizes = {}
    for key in keys:
        if bucket.scheme == "s3":
            sizes[key] = bucket.s3.head_object(Bucket=bucket.name, Key=key)["ContentLength"]
        else:
            quoted = urllib.parse.quote(key, safe="")
            with urllib.request.urlopen(f"{bucket.endpoint}/storage/v1/b/{bucket.name}/o/{quoted}") as r:
                sizes[key] = int(json.loads(r.read())["size"])
    jobs = [(k, start, min(start + part, size) - 1) for k, size in sizes.items() for start in range(0, max(size, 1), part)]

    def fetch(job):
        key, first, last = job
        if bucket.scheme == "s3":
            data = bucket.s3.get_object(Bucket=bucket.name, Key=key, Range=f"bytes={first}-{last}")["Body"].read()
        else:
            quoted = urllib.parse.quote(key, safe="")
            req = urllib.request.Request(f"{bucket.endpoint}/storage/v1/b/{bucket.name}/o/{quoted}?alt=media",
                                         headers={"Range": f"bytes={first}-{last}"})
            with urllib.request.urlopen(req) as r:
                data = r.read()
        with open(os.path.join(dest, f"{key.replace('/', '_')}.{first}"), "wb") as f:
            f.write(data)
        return len(data)

    started = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        total = sum(pool.map(fetch, jobs))
    return time.perf_counter() - started, total


def time_to_ready(bucket, cache, extra):
    """(seconds from process start to ready, seconds ferry logged for the download or None)."""
    port = free_port()
    cmd = [BINARY, "serve", "--model-repository", bucket.url("repo"), *bucket.server_args(), f"--model-cache-dir={cache}",
           "--http-address=127.0.0.1", f"--http-port={port}", "--grpc-port=0", "--metrics-port=0", "--log-format=json",
           *extra]
    env = {**os.environ, **bucket.server_env()}
    log = tempfile.TemporaryFile(mode="w+")
    started = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        while True:
            if proc.poll() is not None:
                log.seek(0)
                raise RuntimeError(f"ferry exited with {proc.returncode}: {cmd}\n{log.read()[-3000:]}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/health/ready", timeout=1) as r:
                    if r.status == 200:
                        ready = time.perf_counter() - started
                        break
            except OSError:
                pass
            time.sleep(0.01)
    finally:
        proc.terminate()
        proc.wait()
    log.seek(0)
    download = None
    for line in log:
        if '"downloaded"' in line:
            m = re.search(r'"seconds":([0-9.eE+-]+)', line)
            download = float(m.group(1)) if m else None
    return ready, download


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--kinds", default="gcs,s3")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--stream-mib", type=float, default=40, help="MiB/s one connection delivers")
    ap.add_argument("--part-mib", type=int, default=16, help="ferry's --storage-part-mib")
    ap.add_argument("--first-byte-ms", type=float, default=30, help="wait before each response's first byte")
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
            proxy = Throttle(int(storage.endpoint.rsplit(":", 1)[1]), args.stream_mib, args.first_byte_ms)
            bucket = through(bucket, proxy.endpoint)
            results = {"sequential download": [], "parallel ranged download, Python threads": [],
                       "ferry, parallel ranged reads": [],
                       "ferry, one stream per object": [], "ferry, restart with a warm cache": []}
            for run in range(args.runs):
                dest = tempfile.mkdtemp(dir=work)
                seconds, total = sequential_download(bucket, keys, dest)
                results["sequential download"].append((seconds, seconds))
                seconds, _ = parallel_download(bucket, keys, tempfile.mkdtemp(dir=work), args.part_mib << 20)
                results["parallel ranged download, Python threads"].append((seconds, seconds))
                cache = os.path.join(work, f"cache-{kind}-{run}")
                parallel = [f"--storage-part-mib={args.part_mib}"]
                results["ferry, parallel ranged reads"].append(time_to_ready(bucket, cache, parallel))
                results["ferry, restart with a warm cache"].append(time_to_ready(bucket, cache, parallel))
                results["ferry, one stream per object"].append(
                    time_to_ready(bucket, cache + "-seq", ["--storage-parallelism=1", "--storage-part-mib=1000000"]))
            for name, values in results.items():
                best = min(values, key=lambda v: v[0])
                rows.append((kind, name, best[0], best[1], total))
        finally:
            storage.stop()
    lines = [
        f"Commit `{bench_run.commit_label()}`, {time.strftime('%Y-%m-%d')}, release build, 2 cores: one model of "
        f"{total / 1048576:.0f} MiB in {len(keys)} objects held by the local emulator (moto for S3, fake-gcs-server "
        f"for GCS), reached through a proxy that holds each connection to {args.stream_mib:g} MiB/s and waits "
        f"{args.first_byte_ms:g} ms before each response (a cloud store's per-stream behaviour; on bare loopback the "
        f"emulators answer at memory speed and there is nothing to win). Best of {args.runs} runs. \"download\" is "
        "the plain sequential fetch (boto3 for S3, the JSON API for GCS, one object after another, written to disk) "
        f"or the time ferry logs for its download and digest checks (parts of {args.part_mib} MiB, 16 at once); \"ready\" is process start to "
        "`/v2/health/ready`, which adds loading the model into ONNX Runtime. The Python-threads row fetches the "
        "same ranged parts 16 at once, outside ferry: the most the emulator serves in parallel on these 2 cores.",
        "",
        "| store | what | download s | ready s | download MiB/s | download vs sequential |",
        "|---|---|---:|---:|---:|---:|",
    ]
    base = {kind: d for kind, name, _, d, _ in rows if name == "sequential download"}
    for kind, name, ready, download, size in rows:
        if name.endswith("download") or "Python" in name:
            lines.append(f"| {kind} | {name} | {download:.2f} | – | {size / 1048576 / download:.0f} | "
                         f"{base[kind] / download:.1f}× |")
        elif download is None:
            lines.append(f"| {kind} | {name} | nothing to fetch | {ready:.2f} | – | – |")
        else:
            lines.append(f"| {kind} | {name} | {download:.2f} | {ready:.2f} | {size / 1048576 / download:.0f} | "
                         f"{base[kind] / download:.1f}× |")
    print("\n".join(lines))
    bench_run.replace_section(os.path.join(ROOT, "bench", "RESULTS.md"), "Cold start from a bucket", "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
