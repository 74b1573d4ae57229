#!/usr/bin/env python3
"""Overload and SIGTERM, against the release binary (cargo build --release first):

  1. the sustainable rate: densenet (the onnx package's light DenseNet-121, 600 KB requests) at
     concurrency 4 for 10 s;
  2. ten times that rate, offered open-loop for --seconds (default 60) by a pool of senders, with
     --max-inflight-request-bytes at 32 MiB: answers by status, ferry's peak RSS, and whether it
     stayed up;
  3. the same concurrency-4 run again (does throughput recover?);
  4. SIGTERM under load, --rounds times at a random moment: the exit time, and what the requests
     in flight got (every admitted request must finish; late ones get 503; connection errors are
     requests the closed listener never took);
  5. clients that do not read: 32 generate_stream requests to a decoupled model that sends
     responses of 1 MB as fast as it can (2,000 asked for each), whose clients read nothing for
     10 s: ferry's peak RSS, how many responses the model got to send before it saw each request
     cancelled, whether a reading client is served meanwhile, and what the stuck clients read.

Writes the "Overload" part of the section "Overload and faults" of bench/RESULTS.md.

    source scripts/venv.sh && python bench/overload.py
"""
import argparse
import http.client
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))
sys.path.insert(0, os.path.join(ROOT, "tests", "python"))
import run  # noqa: E402
import models  # noqa: E402

BUDGET = 32 << 20
STREAMS_BUDGET = 4 << 30


def body():
    x = np.random.default_rng(3).standard_normal((3, 224, 224)).astype(np.float32)
    head = json.dumps({"inputs": [{"name": "data_0", "shape": [3, 224, 224], "datatype": "FP32",
                                   "parameters": {"binary_data_size": x.nbytes}}],
                       "outputs": [{"name": "fc6_1", "parameters": {"binary_data": True}}]}).encode()
    return head + x.tobytes(), len(head)


BODY, HEAD = body()


def send(port, timeout=120):
    """One request on its own connection: its status, or the error's class."""
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
        conn.request("POST", "/v2/models/densenet_onnx/infer", body=BODY,
                     headers={"Inference-Header-Content-Length": str(HEAD)})
        r = conn.getresponse()
        r.read()
        conn.close()
        return r.status
    except (OSError, http.client.HTTPException) as e:
        return type(e).__name__


def peak_rss_mib(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return 0.0


def closed_loop(port, concurrency, seconds):
    done, stop = [0], time.time() + seconds

    def worker():
        while time.time() < stop:
            if send(port) == 200:
                done[0] += 1

    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return done[0] / seconds


def open_loop(port, rate, seconds, senders=96):
    outcomes = {}
    lock = threading.Lock()

    def one():
        got = send(port, timeout=60)
        with lock:
            outcomes[got] = outcomes.get(got, 0) + 1

    with ThreadPoolExecutor(senders) as pool:
        start = time.time()
        n = 0
        while time.time() - start < seconds:
            due = start + n / rate
            time.sleep(max(0.0, due - time.time()))
            pool.submit(one)
            n += 1
    return outcomes, n


def start(repo, extra, budget=BUDGET):
    port, grpc = run.free_port(), run.free_port()
    return run.start_server(repo, port, grpc, ["--metrics-port=0", f"--max-inflight-request-bytes={budget}", *extra]), port


def sigterm_round(repo, rng):
    proc, port = start(repo, ["--exit-timeout-secs=30"])
    outcomes = {}
    lock = threading.Lock()

    def client():
        while proc.poll() is None:
            got = send(port, timeout=60)
            with lock:
                outcomes[got] = outcomes.get(got, 0) + 1

    threads = [threading.Thread(target=client) for _ in range(16)]
    for t in threads:
        t.start()
    time.sleep(rng.uniform(1.0, 4.0))
    proc.send_signal(signal.SIGTERM)
    sent = time.time()
    code = proc.wait(60)
    took = time.time() - sent
    for t in threads:
        t.join()
    return took, code, outcomes


def unread_streams(streams=32, seconds=10):
    """Phase 5: (peak RSS MiB, responses sent per request, a reading client served, events read)."""
    repo = os.path.join(run.WORK, "overload-streams")
    if not os.path.exists(os.path.join(repo, "flood")):
        models.flood(repo, instances=4)
    sent = os.path.join(run.WORK, "flood-sent")
    if os.path.exists(sent):
        os.remove(sent)
    os.environ["FERRY_TEST_SENT"] = sent
    # A budget large enough that the streams' own bound (64 responses, 64 MiB) is what holds.
    proc, port = start(repo, [], budget=STREAMS_BUDGET)
    try:
        stuck = []
        for _ in range(streams):
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
            conn.request("POST", "/v2/models/flood/generate_stream", body=json.dumps({"COUNT": 2000}))
            stuck.append(conn)
        time.sleep(seconds)
        rss = peak_rss_mib(proc.pid)
        reader = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        reader.request("POST", "/v2/models/flood/generate_stream", body=json.dumps({"COUNT": 3}))
        served = reader.getresponse().read().decode().count("data:") == 3
        read = []
        for conn in stuck:
            body_text = conn.getresponse().read().decode()
            events = body_text.count("data:")
            read.append((events, "fell behind" in body_text))
            conn.close()
        counts = [int(x) for x in open(sent).read().split()] if os.path.exists(sent) else []
        return rss, counts, served and proc.poll() is None, read
    finally:
        proc.terminate()
        proc.wait(60)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--seconds", type=int, default=60)
    p.add_argument("--rounds", type=int, default=5)
    a = p.parse_args()
    os.makedirs(run.WORK, exist_ok=True)
    repo = os.path.join(run.WORK, "overload-repo")
    if not os.path.exists(os.path.join(repo, "densenet_onnx")):
        models.densenet(repo)
    proc, port = start(repo, [])
    try:
        sustainable = closed_loop(port, 4, 10)
        print(f"sustainable: {sustainable:.1f} req/s", flush=True)
        outcomes, offered = open_loop(port, 10 * sustainable, a.seconds)
        alive = proc.poll() is None
        rss = peak_rss_mib(proc.pid)
        print(f"overload: {offered} offered, {outcomes}, peak RSS {rss:.0f} MiB, alive {alive}", flush=True)
        after = closed_loop(port, 4, 10)
        print(f"after: {after:.1f} req/s", flush=True)
    finally:
        proc.terminate()
        proc.wait(60)
    rng = random.Random(7)
    rounds = [sigterm_round(repo, rng) for _ in range(a.rounds)]
    for took, code, got in rounds:
        print(f"SIGTERM: exit {code} after {took:.2f} s; requests {got}", flush=True)
    s_rss, s_counts, s_served, s_read = unread_streams()
    print(f"unread streams: peak RSS {s_rss:.0f} MiB, sent {s_counts}, served {s_served}, read {s_read}", flush=True)
    label = run.commit_label()
    ok = outcomes.get(200, 0)
    refused = outcomes.get(503, 0)
    other = {k: v for k, v in outcomes.items() if k not in (200, 503)}
    lines = [
        "### Overload", "",
        f"Commit `{label}`, release build, {os.cpu_count()} cores, the load generator on the same machine. "
        f"Model: densenet_onnx (600 KB binary requests, one instance), `--max-inflight-request-bytes={BUDGET >> 20} MiB`.", "",
        "| phase | what was offered | what happened |", "|---|---|---|",
        f"| sustainable | closed loop, 4 clients, 10 s | {sustainable:.1f} req/s |",
        f"| 10x overload | open loop at {10 * sustainable:.0f} req/s for {a.seconds} s ({offered} requests) | "
        f"{ok} answered 200, {refused} refused 503 (Retry-After), other: {other or 'none'}; peak RSS {rss:.0f} MiB; "
        f"server {'up throughout' if alive else 'DIED'} |",
        f"| after | closed loop, 4 clients, 10 s | {after:.1f} req/s |",
        "", "SIGTERM under load (16 clients, signal at a random moment, `--exit-timeout-secs=30`):", "",
        "| round | exit code | exit after SIGTERM | requests: answered / refused 503 / not taken (listener closed) / other |",
        "|---|---|---|---|",
    ]
    for i, (took, code, got) in enumerate(rounds, 1):
        conn = sum(v for k, v in got.items() if isinstance(k, str))
        rest = {k: v for k, v in got.items() if k not in (200, 503) and not isinstance(k, str)}
        lines.append(f"| {i} | {code} | {took:.2f} s | {got.get(200, 0)} / {got.get(503, 0)} / {conn} / {rest or 0} |")
    ended = sum(1 for _, why in s_read if why)
    events = [n for n, _ in s_read]
    lines += [
        "", "Clients that do not read: 32 `generate_stream` requests to a decoupled Python model (4 instances) "
        "that sends 1 MB responses as fast as it can, 2,000 asked for each, the clients reading nothing for 10 s "
        f"(`--max-inflight-request-bytes={STREAMS_BUDGET >> 30} GiB`, so that each stream's own bound is what holds):", "",
        "| what | measured |", "|---|---|",
        f"| peak RSS of ferry | {s_rss:.0f} MiB (everything the model tried to send: {32 * 2000 // 1024} GiB) |",
        f"| responses sent per request before the model saw it cancelled | "
        f"{min(s_counts, default=0)}-{max(s_counts, default=0)} ({len(s_counts)} requests reported: the 32 and "
        f"the reading client's, which asked for 3) |",
        f"| a reading client meanwhile | {'served' if s_served else 'NOT served'} |",
        f"| what the stuck clients read afterwards | {min(events, default=0)}-{max(events, default=0)} events each; "
        f"{ended} of 32 ended by the error saying the client fell behind |",
        "",
    ]
    section = "\n".join(lines) + "\n"
    path = os.path.join(run.BENCH, "RESULTS.md")
    text = open(path).read()
    title = "\n## Overload and faults\n"
    if title not in text:
        text = text.rstrip("\n") + "\n" + title + "\n" + section
    else:
        start_at = text.index(title) + len(title)
        end = text.find("\n## ", start_at)
        end = len(text) if end < 0 else end
        body_text = text[start_at:end]
        import re
        body_text = re.sub(r"\n?### Overload\n.*?(?=\n### |\Z)", "", body_text, flags=re.S)
        text = text[:start_at] + "\n" + section + body_text.lstrip("\n") + text[end:]
    with open(path, "w") as f:
        f.write(text.rstrip("\n") + "\n")
    print("wrote the Overload part of 'Overload and faults'")


if __name__ == "__main__":
    main()
