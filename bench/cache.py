#!/usr/bin/env python3
"""The response cache's hit path against the miss path: the same model served with and without
`response_cache`, perf_analyzer sending one repeated input (so every request after the first is a
hit), with the local tier and with only the Redis tier; and the server's own figure for a hit
(lookup + copy, `cache_hit.ns / cache_hit.count` from the statistics extension). Writes its
section of RESULTS.md.

Usage (after `source bench/tools.sh` and `source scripts/redis.sh`; the reference models are
generated into bench/.work/ref as reference.sh does):
  python bench/cache.py [--models mlp_small,cnn_small]
"""
import argparse
import os
import re
import shutil
import subprocess
import time

import run


def cached_repo(ref, models):
    """Each model twice: as generated, and `<name>_cached` with the response cache on."""
    repo = os.path.join(run.WORK, "cache", "model_repository")
    shutil.rmtree(repo, ignore_errors=True)
    for m in models:
        for name, extra in ((m, ""), (f"{m}_cached", "response_cache { enable: true }\n")):
            os.makedirs(os.path.join(repo, name))
            os.symlink(os.path.realpath(os.path.join(ref, m, "1")), os.path.join(repo, name, "1"))
            config = open(os.path.join(ref, m, "config.pbtxt")).read()
            # The model's own name is the first `name:` at the top level (tensors' names follow).
            config = re.sub(r'^name: *"[^"]*"', f'name: "{name}"', config, count=1, flags=re.M)
            with open(os.path.join(repo, name, "config.pbtxt"), "w") as f:
                f.write(config + extra)
    return repo


def redis_server():
    port = run.free_port()
    proc = subprocess.Popen([os.environ["REDIS_SERVER"], "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no"], stdout=subprocess.DEVNULL)
    deadline = time.time() + 30
    while subprocess.run([os.environ["REDIS_CLI"], "-p", str(port), "PING"], capture_output=True, text=True).stdout.strip() != "PONG":
        if time.time() > deadline:
            raise SystemExit("redis-server did not start")
        time.sleep(0.05)
    return proc, port


def measure(repo, models, cache_args, label, concurrency):
    http_port, grpc_port = run.free_port(), run.free_port()
    base = f"http://127.0.0.1:{http_port}"
    proc = run.start_server(repo, http_port, grpc_port, cache_args)
    rows = []
    try:
        for m in models:
            for name in (m, f"{m}_cached"):
                data = run.input_data(base, m if name == m else name)
                for c in concurrency:
                    r = run.perf(name, f"127.0.0.1:{http_port}", "http", c, data, 3000)
                    s = run.get(f"{base}/v2/models/{name}/stats")["model_stats"][0]["inference_stats"]
                    hit = s["cache_hit"]
                    r["hit_us"] = hit["ns"] / hit["count"] / 1000 if hit["count"] else None
                    rows.append((label, name, c, r))
                    print(f"{label:12} {name:22} c{c:<3} {r['throughput']:8.0f} infer/s  p50 {r['p50']:.3f} ms"
                          + (f"  server hit {r['hit_us']:.1f} µs" if r["hit_us"] else ""), flush=True)
    finally:
        proc.terminate()
        proc.wait(30)
    return rows


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--ref", default=os.path.join(run.WORK, "ref", "model_repository"))
    p.add_argument("--models", default="mlp_small,cnn_small")
    p.add_argument("--concurrency", default="1,16")
    a = p.parse_args()
    models = a.models.split(",")
    concurrency = [int(c) for c in a.concurrency.split(",")]
    repo = cached_repo(a.ref, models)
    rows = measure(repo, models, ["--cache-config", "local,size=268435456"], "local", concurrency)
    redis, port = redis_server()
    try:
        shared = ["--cache-config", "redis,host=127.0.0.1", "--cache-config", f"redis,port={port}"]
        rows += [r for r in measure(repo, models, shared, "redis only", concurrency) if r[1].endswith("_cached")]
    finally:
        redis.terminate()
    lines = [
        f"Commit `{run.commit_label()}`, {time.strftime('%Y-%m-%d')}, release build, perf_analyzer over HTTP sending one "
        "repeated input (3 s windows), server and load generator on the same 2 cores. `<model>` runs the model "
        "every time; `<model>_cached` has `response_cache { enable: true }`, so every request after the first is a "
        "hit. \"server hit µs\" is the server's own measure of a hit (lookup + copy: `cache_hit.ns / count` of the "
        "statistics extension), the in-process cost; p50 is what the client saw end to end.",
        "",
        "| cache | model | concurrency | infer/s | p50 ms | p99 ms | server hit µs |",
        "|---|---|---|---|---|---|---|",
    ]
    for label, name, c, r in rows:
        hit = f"{r['hit_us']:.1f}" if r["hit_us"] else "–"
        lines.append(f"| {label} | {name} | {c} | {r['throughput']:.0f} | {r['p50']:.3f} | {r['p99']:.3f} | {hit} |")
    run.replace_section(os.path.join(run.BENCH, "RESULTS.md"), "Response cache: hits against misses", "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
