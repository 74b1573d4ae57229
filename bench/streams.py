#!/usr/bin/env python3
"""Stateful and streaming models (after `source bench/tools.sh` and a release build):

  - perf_analyzer's sequence mode on a stateful model (the accumulator of the tests: implicit
    state kept by the server, START and CORRID control inputs) at 1, 16 and 64 concurrent
    sequences, beside the same model run in-process by ONNX Runtime with the state carried by
    hand (one thread, batch 1: the ceiling of one sequence);
  - a decoupled Python model sending 64 responses per request: time to the first response and
    responses per second, over the gRPC stream and over HTTP server-sent events.

Writes the section "Sequences and streams" of bench/RESULTS.md.
"""
import csv
import http.client
import json
import os
import queue
import subprocess
import sys
import time

import numpy as np

BENCH = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(BENCH)
sys.path.insert(0, BENCH)
sys.path.insert(0, os.path.join(ROOT, "tests", "python"))
import run  # noqa: E402
import models  # noqa: E402
from test_decoupled import CONFIG, REPEAT  # noqa: E402


def sequence_perf(url, concurrency):
    data = os.path.join(run.WORK, "accumulator.json")
    with open(data, "w") as f:
        json.dump({"data": [{"INPUT": [1.0]}]}, f)
    out = os.path.join(run.WORK, f"seq-c{concurrency}.csv")
    cmd = [os.environ["PERF_ANALYZER"], "-m", "accumulator", "-u", url, "-i", "grpc",
           f"--concurrency-range={concurrency}:{concurrency}", "--sequence-length=20", "--measurement-interval=3000",
           "--input-data", data, "--max-trials=10", "--stability-percentage=25", "-f", out]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        print(r.stdout[-2000:], r.stderr[-2000:], file=sys.stderr)
        raise SystemExit("perf_analyzer failed")
    with open(out) as f:
        row = next(csv.DictReader(f))
    return float(row["Inferences/Second"]), float(row["p99 latency"]) / 1000


def in_process(model_path, steps=20000):
    import onnxruntime as ort
    s = ort.InferenceSession(model_path)
    state = np.zeros((1, 1), dtype=np.float32)
    x = np.ones((1, 1), dtype=np.float32)
    start = np.zeros((1, 1), dtype=np.int32)
    corr = np.ones((1, 1), dtype=np.uint64)
    t = time.perf_counter()
    for _ in range(steps):
        out = s.run(["OUTPUT", "ACC_OUT"], {"INPUT": x, "ACC_IN": state, "START": start, "CORRID": corr})
        state = out[1]
    return steps / (time.perf_counter() - t)


def grpc_stream(url, rounds=20, count=64):
    import tritonclient.grpc as grpcclient
    client = grpcclient.InferenceServerClient(url)
    got = queue.Queue()
    client.start_stream(callback=lambda result, error: got.put((time.perf_counter(), result, error)))
    firsts, rates = [], []
    for _ in range(rounds):
        ins = [grpcclient.InferInput("COUNT", [1], "INT32").set_data_from_numpy(np.array([count], dtype=np.int32)),
               grpcclient.InferInput("DELAY", [1], "FP32").set_data_from_numpy(np.zeros(1, dtype=np.float32)),
               grpcclient.InferInput("FAIL", [1], "INT32").set_data_from_numpy(np.zeros(1, dtype=np.int32))]
        sent = time.perf_counter()
        client.async_stream_infer("repeat", ins)
        stamps = [got.get(timeout=30)[0] for _ in range(count)]
        firsts.append((stamps[0] - sent) * 1000)
        rates.append(count / (stamps[-1] - sent))
    client.stop_stream()
    return float(np.median(firsts)), float(np.median(rates))


def sse(port, rounds=20, count=64):
    firsts, rates = [], []
    body = json.dumps({"COUNT": count, "DELAY": 0.0, "FAIL": 0})
    for _ in range(rounds):
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        sent = time.perf_counter()
        conn.request("POST", "/v2/models/repeat/generate_stream", body=body)
        r = conn.getresponse()
        stamps = []
        while len(stamps) < count:
            line = r.fp.readline()
            if not line:
                break
            if line.startswith(b"data: "):
                stamps.append(time.perf_counter())
        conn.close()
        firsts.append((stamps[0] - sent) * 1000)
        rates.append(len(stamps) / (stamps[-1] - sent))
    return float(np.median(firsts)), float(np.median(rates))


def main():
    os.makedirs(run.WORK, exist_ok=True)
    repo = os.path.join(run.WORK, "streams-repo")
    if not os.path.exists(repo):
        models.accumulator(repo, max_batch_size=64, strategy="oldest { max_candidate_sequences: 64 max_queue_delay_microseconds: 100 }")
        models.python_model(repo, "repeat", REPEAT, CONFIG)
    http_port, grpc_port = run.free_port(), run.free_port()
    proc = run.start_server(repo, http_port, grpc_port, ["--metrics-port=0"])
    rows = []
    try:
        for c in (1, 16, 64):
            rows.append((c, *sequence_perf(f"127.0.0.1:{grpc_port}", c)))
            print(f"sequences c{c}: {rows[-1][1]:.0f} infer/s p99 {rows[-1][2]:.2f} ms", flush=True)
        grpc = grpc_stream(f"127.0.0.1:{grpc_port}")
        events = sse(http_port)
    finally:
        proc.terminate()
        proc.wait(30)
    ceiling = in_process(os.path.join(repo, "accumulator", "1", "model.onnx"))
    lines = [f"Commit `{run.commit_label()}`, release build, {os.cpu_count()} cores, load generator on the same machine.", "",
             "Sequence batcher: perf_analyzer `--sequence-length=20` over gRPC on the accumulator (implicit state kept by "
             "the server, START and CORRID control inputs; `oldest`, 64 candidate sequences, batches up to 64).", "",
             "| concurrent sequences | infer/s | p99 ms |", "|---|---|---|"]
    lines += [f"| {c} | {tput:.0f} | {p99:.2f} |" for c, tput, p99 in rows]
    lines += ["", f"Ceiling: the same model in-process (ONNX Runtime, state carried by hand, one thread, batch 1): "
              f"{ceiling:.0f} steps/s.", "",
              "Decoupled Python model, 64 responses per request (median of 20 requests):", "",
              "| transport | time to first response ms | responses/s |", "|---|---|---|",
              f"| gRPC ModelStreamInfer | {grpc[0]:.2f} | {grpc[1]:.0f} |",
              f"| HTTP generate_stream (SSE) | {events[0]:.2f} | {events[1]:.0f} |"]
    run.replace_section(os.path.join(BENCH, "RESULTS.md"), "Sequences and streams", "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
