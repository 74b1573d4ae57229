#!/usr/bin/env python3
"""Drives a release build of ferry with perf_analyzer and writes a table to bench/RESULTS.md.

Usage (after `source bench/tools.sh`, which exports PERF_ANALYZER):
  python bench/run.py --repo examples --models simple,simple_string --protocols http \
      --concurrency 1,4,16 --title "Example models"

For each model it writes realistic input data (from the model's metadata) for perf_analyzer,
measures each protocol and concurrency in 3 s windows, and reads the server's statistics to report
the average batch the server formed. The section of RESULTS.md with the same title is replaced.
"""
import argparse
import csv
import datetime
import glob
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import time
import urllib.request

import numpy as np

BENCH = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(BENCH)
WORK = os.path.join(BENCH, ".work")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url):
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read())


def start_server(repo, http_port, grpc_port, extra):
    import onnxruntime
    lib = sorted(glob.glob(os.path.join(os.path.dirname(onnxruntime.__file__), "capi", "libonnxruntime.so*")))[-1]
    cmd = [os.environ.get("FERRY_BENCH_BIN") or os.path.join(ROOT, "target", "release", "ferry"), "serve", "--model-repository", repo,
           "--http-address=127.0.0.1", f"--http-port={http_port}", f"--grpc-port={grpc_port}",
           f"--onnxruntime-library={lib}", *extra]
    log = open(os.path.join(WORK, "server.log"), "w")
    return wait_ready(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT), http_port, "ferry", log.name)


def wait_ready(proc, http_port, what, log):
    """`proc` once it answers ready on `http_port`; exits the bench if it ends or takes 2 minutes."""
    deadline = time.time() + 120
    while time.time() < deadline:
        if proc.poll() is not None:
            sys.exit(f"{what} exited; see {log}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/v2/health/ready", timeout=2) as r:
                if r.status == 200:
                    return proc
        except OSError:
            pass
        time.sleep(0.1)
    proc.kill()
    sys.exit(f"{what} did not become ready")


def input_data(base, model):
    """perf_analyzer --input-data JSON: one realistic sample per input (no batch dim)."""
    meta = get(f"{base}/v2/models/{model}")
    config = get(f"{base}/v2/models/{model}/config")
    rng = np.random.default_rng(1)
    batching = config.get("max_batch_size", 0) > 0
    sample = {}
    for t in meta["inputs"]:
        shape = [d if d > 0 else 1 for d in (t["shape"][1:] if batching else t["shape"])]
        n = int(np.prod(shape))
        dt = t["datatype"]
        if dt == "BYTES":
            values = [str(int(v)) for v in rng.integers(0, 100, n)]
        elif dt.startswith("INT") or dt.startswith("UINT"):
            values = rng.integers(0, 100, n).tolist()
        elif dt == "BOOL":
            values = rng.integers(0, 2, n).astype(bool).tolist()
        else:
            values = rng.standard_normal(n).round(4).tolist()
        sample[t["name"]] = {"content": values, "shape": shape}
    path = os.path.join(WORK, f"{model}.input.json")
    with open(path, "w") as f:
        json.dump({"data": [sample]}, f)
    return path


def stats(base, model):
    s = get(f"{base}/v2/models/{model}/stats")["model_stats"][0]
    return s["inference_count"], s["execution_count"]


def perf(model, url, protocol, concurrency, data, interval_ms, extra=()):
    out = os.path.join(WORK, f"{model}-{protocol}-c{concurrency}.csv")
    cmd = [os.environ["PERF_ANALYZER"], "-m", model, "-u", url, "-i", protocol,
           f"--concurrency-range={concurrency}:{concurrency}", f"--measurement-interval={interval_ms}",
           "--input-data", data, "--max-trials=10", "--stability-percentage=25", "-f", out, *extra]
    run = subprocess.run(cmd, capture_output=True, text=True)
    if run.returncode != 0:
        print(run.stdout[-3000:], run.stderr[-3000:], file=sys.stderr)
        raise SystemExit(f"perf_analyzer failed for {model} {protocol} c{concurrency}")
    with open(out) as f:
        row = next(csv.DictReader(f))
    us = lambda k: float(row.get(k, 0) or 0)
    return {
        "throughput": float(row["Inferences/Second"]),
        "p50": us("p50 latency") / 1000, "p99": us("p99 latency") / 1000,
        "queue": us("Server Queue"), "compute": us("Server Compute Input") + us("Server Compute Infer") + us("Server Compute Output"),
    }


def perf_batched(base, model, url, protocol, concurrency, data, interval_ms):
    """`perf`'s figures, plus the requests the server counted over the run ("count") and the
    average batch it formed ("batch"), from its statistics before and after."""
    before = stats(base, model)
    r = perf(model, url, protocol, concurrency, data, interval_ms)
    after = stats(base, model)
    r["count"] = after[0] - before[0]
    r["batch"] = r["count"] / max(after[1] - before[1], 1)
    return r


def time_calls(call, rows, seconds=3.0, warm=3):
    """`call()` repeated for `seconds` after `warm` untimed calls, each computing `rows` rows:
    rows per second, and the p50 of one call in ms."""
    for _ in range(warm):
        call()
    times, end = [], time.perf_counter() + seconds
    while time.perf_counter() < end:
        t = time.perf_counter()
        call()
        times.append(time.perf_counter() - t)
    return rows * len(times) / sum(times), 1000 * statistics.median(times)


def grpc_sweep(repo, names, interval_ms, extra=(), concurrencies=(1, 16)):
    """Serves `repo` and drives each model with perf_analyzer over gRPC at each concurrency:
    [(name, concurrency, perf's figures, the batch the server formed on average)]."""
    http_port, grpc_port = free_port(), free_port()
    os.makedirs(WORK, exist_ok=True)
    proc = start_server(repo, http_port, grpc_port, list(extra))
    base, rows = f"http://127.0.0.1:{http_port}", []
    try:
        for name in names:
            data = input_data(base, name)
            for c in concurrencies:
                r = perf_batched(base, name, f"127.0.0.1:{grpc_port}", "grpc", c, data, interval_ms)
                rows.append((name, c, r, r["batch"]))
    finally:
        proc.terminate()
        proc.wait()
    return rows


def commit_label():
    """The commit measured, marked when tracked files differ from it."""
    commit = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    # RESULTS.md itself is what the benches write, not what they measure.
    dirty = subprocess.run(["git", "-C", ROOT, "status", "--porcelain", "--untracked-files=no", "--", ".",
                            ":(exclude)bench/RESULTS.md"], capture_output=True, text=True).stdout.strip()
    return commit + ("+changes" if dirty else "")


def replace_section(path, title, body):
    text = open(path).read() if os.path.exists(path) else "# Benchmark results\n\nWritten by the scripts in bench/; see bench/README.md.\n"
    pattern = re.compile(rf"\n## {re.escape(title)}\n.*?(?=\n## |\Z)", re.S)
    section = f"\n## {title}\n{body}"
    text = pattern.sub(lambda _: section, text) if pattern.search(text) else text.rstrip("\n") + "\n" + section
    with open(path, "w") as f:
        f.write(text.rstrip("\n") + "\n")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--repo", default=os.path.join(ROOT, "examples"))
    p.add_argument("--models", default="simple,simple_string")
    p.add_argument("--protocols", default="http")
    p.add_argument("--concurrency", default="1,4,16")
    p.add_argument("--interval-ms", type=int, default=3000)
    p.add_argument("--title", default="Example models")
    p.add_argument("--note", default="")
    p.add_argument("--server-arg", action="append", default=[])
    p.add_argument("--results", default=os.path.join(BENCH, "RESULTS.md"))
    p.add_argument("--ceiling", action="store_true", help="also measure ONNX Runtime in-process at the batch formed")
    a = p.parse_args()
    os.makedirs(WORK, exist_ok=True)
    http_port, grpc_port = free_port(), free_port()
    base = f"http://127.0.0.1:{http_port}"
    proc = start_server(os.path.abspath(a.repo), http_port, grpc_port, a.server_arg)
    rows = []
    try:
        for model in a.models.split(","):
            data = input_data(base, model)
            for protocol in a.protocols.split(","):
                url = f"127.0.0.1:{http_port if protocol == 'http' else grpc_port}"
                for c in [int(x) for x in a.concurrency.split(",")]:
                    r = perf_batched(base, model, url, protocol, c, data, a.interval_ms)
                    rows.append((model, protocol, c, r))
                    print(f"{model:16} {protocol:5} c{c:<3} {r['throughput']:9.0f} infer/s  p50 {r['p50']:.2f} ms  batch {r['batch']:.1f}", flush=True)
    finally:
        proc.terminate()
        proc.wait(30)
    if a.ceiling:
        sys.path.insert(0, BENCH)
        import ceiling
        for model, protocol, c, r in rows:
            onnx = os.path.join(os.path.abspath(a.repo), model, "1", "model.onnx")
            r["ceiling"] = ceiling.rows_per_second(onnx, max(1, round(r["batch"])))
    label = commit_label()
    lines = [
        f"Commit `{label}`, {datetime.date.today()}, {os.cpu_count()} cores, release build, "
        f"perf_analyzer 2.50 (synchronous, batch 1 per request, {a.interval_ms / 1000:g} s windows, realistic input data), "
        "server and load generator on the same machine.",
    ]
    if a.note:
        lines += ["", a.note]
    ceiling_head = " ORT in-process at that batch, rows/s |" if a.ceiling else ""
    lines += ["", "| model | protocol | concurrency | infer/s | p50 ms | p99 ms | server queue µs | server compute µs | avg batch formed |" + ceiling_head,
              "|---|---|---|---|---|---|---|---|---|" + ("---|" if a.ceiling else "")]
    for model, protocol, c, r in rows:
        extra = f" {r['ceiling']:.0f} |" if a.ceiling else ""
        lines.append(f"| {model} | {protocol} | {c} | {r['throughput']:.0f} | {r['p50']:.2f} | {r['p99']:.2f} | "
                     f"{r['queue']:.0f} | {r['compute']:.0f} | {r['batch']:.1f} |" + extra)
    replace_section(a.results, a.title, "\n".join(lines) + "\n")
    print(f"wrote '{a.title}' to {a.results}")


if __name__ == "__main__":
    main()
