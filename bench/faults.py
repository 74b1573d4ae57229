#!/usr/bin/env python3
"""Storage faults during downloads: ferry (release build, poll mode) follows a bucket on moto (S3)
and fake-gcs-server (GCS) through a proxy that breaks a share of its connections — resets,
HTTP 500s, responses cut short, stalls — while new versions of a 16 MiB model are uploaded and
clients keep sending requests. What must hold: every request is answered by a whole version (the
output says which), never an error; each new version serves eventually (retried), or the old one
keeps serving.

Writes the "Storage faults" part of the section "Overload and faults" of bench/RESULTS.md.

    source scripts/venv.sh && python bench/faults.py [--versions 4] [--fault-rate 0.3]
"""
import argparse
import asyncio
import copy
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests", "python"))
sys.path.insert(0, os.path.join(ROOT, "bench"))
from buckets import StorageServer, free_port  # noqa: E402
import coldstart  # noqa: E402
import run  # noqa: E402


class Faulty:
    """A TCP proxy to 127.0.0.1:`port` that breaks `rate` of its connections, each one way."""

    KINDS = ("reset", "http500", "truncate", "stall")

    def __init__(self, port, rate, seed=11):
        self.upstream, self.rate, self.rng = port, rate, random.Random(seed)
        self.counts = {k: 0 for k in ("passed", *self.KINDS)}
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        server = asyncio.run_coroutine_threadsafe(asyncio.start_server(self.handle, "127.0.0.1", 0), self.loop).result()
        here = server.sockets[0].getsockname()[1]
        self.endpoint = f"http://127.0.0.1:{here}"
        self.host_here, self.host_there = f"127.0.0.1:{here}".encode(), f"127.0.0.1:{port}".encode()

    async def handle(self, reader, writer):
        kind = self.rng.choice(self.KINDS) if self.rng.random() < self.rate else "passed"
        self.counts[kind] += 1
        try:
            if kind == "reset":
                writer.transport.abort()
                return
            if kind == "http500":
                await reader.read(65536)
                writer.write(b"HTTP/1.1 500 Internal Server Error\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
                await writer.drain()
                writer.close()
                return
            if kind == "stall":
                await reader.read(65536)
                await asyncio.sleep(20)
                writer.transport.abort()
                return
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.upstream)
            cut = self.rng.randint(200, 200_000) if kind == "truncate" else None

            async def requests():
                while data := await reader.read(65536):
                    up_writer.write(data.replace(self.host_here, self.host_there))
                    await up_writer.drain()
                up_writer.close()

            async def responses():
                sent = 0
                while data := await up_reader.read(65536):
                    if cut is not None and sent + len(data) >= cut:
                        writer.write(data[: cut - sent])
                        await writer.drain()
                        writer.transport.abort()
                        return
                    sent += len(data)
                    writer.write(data)
                    await writer.drain()
                writer.close()

            await asyncio.gather(requests(), responses())
        except (ConnectionError, OSError):
            writer.close()


def model_files(folder, version):
    """y = a + b + version, padded to 16 MiB with an initializer the graph also reads."""
    pad = np.zeros((4, 1 << 20), dtype=np.float32)
    a, b = (helper.make_tensor_value_info(n, TensorProto.FLOAT, ["batch", 4]) for n in ("a", "b"))
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])
    nodes = [helper.make_node("ReduceSum", ["pad"], ["zero"], keepdims=0),
             helper.make_node("Add", ["a", "b"], ["s"]), helper.make_node("Add", ["s", "off"], ["t"]),
             helper.make_node("Add", ["t", "zero"], ["y"])]
    inits = [numpy_helper.from_array(pad, "pad"), numpy_helper.from_array(np.array(float(version), np.float32), "off")]
    m = helper.make_model(helper.make_graph(nodes, "m", [a, b], [y], initializer=inits),
                          opset_imports=[helper.make_opsetid("", 13)])
    m.ir_version = 8
    path = os.path.join(folder, str(version), "model.onnx")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    onnx.save(m, path)
    return path


def infer(port):
    body = json.dumps({"inputs": [{"name": n, "shape": [1, 4], "datatype": "FP32", "data": [1, 1, 1, 1]} for n in "ab"]})
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v2/models/m/infer", data=body.encode())
    with urllib.request.urlopen(req, timeout=30) as r:
        return round(json.loads(r.read())["outputs"][0]["data"][0] - 2)


def scenario(kind, versions, rate):
    storage = StorageServer(kind)
    folder = tempfile.mkdtemp()
    try:
        bucket = storage.bucket("faults")
        bucket.put("repo/m/config.pbtxt", b'name: "m"\nmax_batch_size: 8\n')
        with open(model_files(folder, 1), "rb") as f:
            bucket.put("repo/m/1/model.onnx", f.read())
        bucket.put("repo/m/1/_READY", b"")
        proxy = Faulty(int(storage.endpoint.rsplit(":", 1)[1]), rate)
        # The server reaches the bucket through the proxy; the uploads here go direct.
        served = coldstart.through(copy.copy(bucket), proxy.endpoint)
        port, grpc = free_port(), free_port()
        endpoint = ["--s3-endpoint" if kind == "s3" else "--gcs-endpoint", proxy.endpoint]
        extra = [*endpoint, "--model-control-mode=poll", "--repository-poll-secs=2", "--storage-part-mib=1",
                 "--storage-retries=4", "--metrics-port=0", f"--model-cache-dir={folder}/cache", "--exit-on-error=false"]
        if kind == "gs":
            extra.append("--storage-anonymous")
        env = {**os.environ, **served.server_env()}
        old_env = dict(os.environ)
        os.environ.update(env)
        try:
            proc = run.start_server(served.url("repo"), port, grpc, extra)
        finally:
            os.environ.clear()
            os.environ.update(old_env)
        seen, bad, answered, swaps = set(), [], 0, []
        try:
            deadline = time.time() + 120
            while time.time() < deadline:
                try:
                    seen.add(infer(port))
                    break
                except OSError:
                    time.sleep(0.5)
            for v in range(2, versions + 2):
                with open(model_files(folder, v), "rb") as f:
                    bucket.put(f"repo/m/{v}/model.onnx", f.read())
                bucket.put(f"repo/m/{v}/_READY", b"")
                started, live = time.time(), False
                while time.time() - started < 90:
                    try:
                        got = infer(port)
                        answered += 1
                        seen.add(got)
                        if got not in range(1, v + 1):
                            bad.append(got)
                        if got == v:
                            live = True
                            break
                    except OSError as e:
                        bad.append(repr(e))
                    time.sleep(0.05)
                swaps.append(time.time() - started if live else None)
        finally:
            proc.terminate()
            proc.wait(60)
        log = open(os.path.join(run.WORK, "server.log")).read()
        failed_loads = len(re.findall(r"(download of model|could not be staged|load failed)", log))
        return {"faults": dict(proxy.counts), "answered": answered, "bad": bad, "swaps": swaps,
                "seen": sorted(x for x in seen if isinstance(x, int)), "failed_loads": failed_loads}
    finally:
        storage.stop()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--versions", type=int, default=4)
    p.add_argument("--fault-rate", type=float, default=0.3)
    a = p.parse_args()
    os.makedirs(run.WORK, exist_ok=True)
    results = {kind: scenario(kind, a.versions, a.fault_rate) for kind in ("s3", "gs")}
    lines = ["### Storage faults", "",
             f"Commit `{run.commit_label()}`. ferry in poll mode (2 s) on a bucket reached through a proxy that breaks "
             f"{a.fault_rate:.0%} of its connections (reset, HTTP 500, response cut short, 20 s stall), 1 MiB ranged parts, "
             f"4 retries; {a.versions} new versions of a 16 MiB model uploaded one after another while a client sends requests "
             "(each answer says which version computed it).", "",
             "| store | connections: passed / reset / 500 / cut / stalled | requests answered | wrong or failed answers | "
             "versions seen | time to serve each new version (s) | failed download or load attempts (log) |",
             "|---|---|---|---|---|---|---|"]
    for kind, r in results.items():
        f = r["faults"]
        swaps = ", ".join("kept old" if s is None else f"{s:.1f}" for s in r["swaps"])
        lines.append(f"| {kind} | {f['passed']} / {f['reset']} / {f['http500']} / {f['truncate']} / {f['stall']} | "
                     f"{r['answered']} | {len(r['bad'])} | {r['seen']} | {swaps} | {r['failed_loads']} |")
        print(kind, r, flush=True)
    section = "\n".join(lines) + "\n"
    path = os.path.join(run.BENCH, "RESULTS.md")
    text = open(path).read()
    title = "\n## Overload and faults\n"
    if title not in text:
        text = text.rstrip("\n") + "\n" + title
    start = text.index(title) + len(title)
    end = text.find("\n## ", start)
    end = len(text) if end < 0 else end
    body = re.sub(r"\n?### Storage faults\n.*?(?=\n### |\Z)", "", text[start:end], flags=re.S)
    text = text[:start] + body.rstrip("\n") + "\n\n" + section + text[end:]
    with open(path, "w") as fh:
        fh.write(text.rstrip("\n") + "\n")


if __name__ == "__main__":
    main()
