#!/usr/bin/env python3
"""ferry beside a real Triton 2.51 with its C++ ONNX Runtime backend (bench/triton.sh), on the
reference models, in one sitting, both servers loading the same ONNX Runtime library:

- throughput, p50 and the batch formed: perf_analyzer at each concurrency, over HTTP and gRPC, the
  servers taking turns cell by cell, round after round;
- server CPU per request under that load: user + system time of every server thread from /proc
  over the perf_analyzer run, divided by the requests the server's statistics counted in it;
- server CPU per request at a fixed offered rate below saturation (bench/cost.py's paced clients);
- resident memory when idle, one second after ready.

Writes the section "Against Triton 2.51 with its ONNX Runtime backend, side by side" of
bench/RESULTS.md.

Usage (after `source bench/tools.sh`, `source bench/ref_repos.sh` and `source bench/triton.sh`):
  python bench/vs_triton.py [--rounds 2] [--models mlp_small,identity_fp32]
"""
import argparse
import os
import resource
import statistics
import subprocess
import sys
import time

import cost
import run

TITLE = "Against Triton 2.51 with its ONNX Runtime backend, side by side"


def start_triton(repo):
    home = os.environ.get("TRITON_HOME") or sys.exit("TRITON_HOME is not set: source bench/triton.sh")
    http_port, grpc_port = run.free_port(), run.free_port()
    log = open(os.path.join(run.WORK, "triton.log"), "w")
    proc = subprocess.Popen([os.path.join(home, "bin", "tritonserver"), f"--model-repository={repo}",
                             f"--backend-directory={os.path.join(home, 'backends')}", f"--http-port={http_port}",
                             f"--grpc-port={grpc_port}", f"--metrics-port={run.free_port()}"],
                            stdout=log, stderr=subprocess.STDOUT)
    run.wait_ready(proc, http_port, "tritonserver", log.name)
    return {"proc": proc, "http": http_port, "grpc": grpc_port, "base": f"http://127.0.0.1:{http_port}"}


def resident_mib(pid):
    with open(f"/proc/{pid}/status") as f:
        return int(next(line for line in f if line.startswith("VmRSS:")).split()[1]) / 1024


def loaded(srv, model, protocol, c, data, interval_ms):
    """perf_analyzer's figures, the batch formed, and the CPU µs per request under load of the server
    and of perf_analyzer itself (which shares the cores)."""
    pid, url = srv["proc"].pid, f"127.0.0.1:{srv['http' if protocol == 'http' else 'grpc']}"
    cpu, client = cost.cpu_seconds(pid), children_cpu()
    r = run.perf_batched(srv["base"], model, url, protocol, c, data, interval_ms)
    cpu, client, n = cost.cpu_seconds(pid) - cpu, children_cpu() - client, max(r["count"], 1)
    return {**r, "cpu_us": cpu * 1e6 / n, "client_us": client * 1e6 / n}


def children_cpu():
    """User + system CPU seconds of the finished child processes (perf_analyzer's runs)."""
    u = resource.getrusage(resource.RUSAGE_CHILDREN)
    return u.ru_utime + u.ru_stime


def med(values):
    return statistics.median(values) if values else float("nan")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--repo", default=os.environ.get("REF_ON", os.path.join(run.BENCH, ".work/ref/model_repository")))
    p.add_argument("--models", default="mlp_small,identity_fp32,text_classifier")
    p.add_argument("--concurrencies", default="1,16,64")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--interval-ms", type=int, default=3000)
    p.add_argument("--paced-models", default="identity_fp32,mlp_small")
    p.add_argument("--paced-windows", type=int, default=3)
    p.add_argument("--rate", type=float, default=1000.0)
    p.add_argument("--no-write", action="store_true")
    a = p.parse_args()
    os.makedirs(run.WORK, exist_ok=True)
    models, cs = a.models.split(","), [int(c) for c in a.concurrencies.split(",")]
    servers = {}
    try:
        # Both serve throughout, so the machine's drift hits them alike.
        servers["ferry"] = cost.start(os.environ.get("FERRY_BENCH_BIN") or os.path.join(run.ROOT, "target", "release", "ferry"), a.repo)
        servers["Triton"] = start_triton(a.repo)
        time.sleep(1)
        rss = {name: resident_mib(s["proc"].pid) for name, s in servers.items()}
        print("idle MiB:", rss, flush=True)
        data = {m: run.input_data(servers["ferry"]["base"], m) for m in models}
        figures = {}  # (model, protocol, c, server) -> [runs]
        for k in range(a.rounds):
            order = list(servers) if k % 2 == 0 else list(reversed(servers))
            for model in models:
                for protocol in ("http", "grpc"):
                    for c in cs:
                        for name in order:
                            r = loaded(servers[name], model, protocol, c, data[model], a.interval_ms)
                            figures.setdefault((model, protocol, c, name), []).append(r)
                            print(f"round {k + 1} {model} {protocol} c{c} {name}: {r['throughput']:.0f}/s "
                                  f"p50 {r['p50']:.2f} ms batch {r['batch']:.1f} cpu {r['cpu_us']:.0f} µs "
                                  f"client {r['client_us']:.0f} µs", flush=True)
        paced = {}
        for model in a.paced_models.split(","):
            arrays, outputs = cost.sample(servers["ferry"]["base"], model)
            for protocol in ("http-binary", "grpc"):
                for _ in range(a.paced_windows):
                    for name, srv in servers.items():
                        f = cost.factory_for(srv, model, protocol, arrays, outputs)
                        m = cost.measure(srv["proc"].pid, srv["base"], model, f, a.rate, 4.0, False)
                        paced.setdefault((model, protocol, name), []).append(m["us"] if m["errors"] == 0 else float("nan"))
                print(f"paced {model} {protocol}: " + ", ".join(
                    f"{n} {med(paced[(model, protocol, n)]):.0f} µs" for n in servers), flush=True)
    finally:
        for s in servers.values():
            s["proc"].terminate()
            s["proc"].wait()
    body = [f"Commit `{run.commit_label()}`, {time.strftime('%Y-%m-%d')}, release build, {os.cpu_count()} cores, "
            "one sitting. Triton 2.51 (`tritonserver` of the PyPI wheel nvidia-pytriton 0.7.0) with its C++ ONNX "
            "Runtime backend built from Triton's r24.10 sources (bench/triton.sh); both servers load the same "
            "ONNX Runtime library and the same model repository (the models' own settings: intra-op threads 2, "
            "dynamic batching with Triton's delays). perf_analyzer 2.50, realistic input data, "
            f"{a.interval_ms / 1000:g} s windows; the servers take turns cell by cell, {a.rounds} rounds, "
            "the median of the rounds [their range]. CPU per request: user + system time of every server "
            "thread over the perf_analyzer run, divided by the requests the server counted in it; perf_analyzer's "
            "own CPU (its whole run, measurement trials and warm-up included) over the same count.", "",
            "| model | protocol | c | ferry infer/s | Triton infer/s | ratio | p50 ms, ferry / Triton | batch, ferry / Triton "
            "| server CPU µs per request, ferry / Triton | perf_analyzer CPU µs per request, against ferry / Triton |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    for model in models:
        for protocol in ("http", "grpc"):
            for c in cs:
                f, t = figures[(model, protocol, c, "ferry")], figures[(model, protocol, c, "Triton")]
                ft, tt = [r["throughput"] for r in f], [r["throughput"] for r in t]
                body.append(
                    f"| {model} | {protocol} | {c} | {med(ft):.0f} [{min(ft):.0f}–{max(ft):.0f}] | {med(tt):.0f} "
                    f"[{min(tt):.0f}–{max(tt):.0f}] | {med(ft) / med(tt):.2f}× | {med([r['p50'] for r in f]):.2f} / "
                    f"{med([r['p50'] for r in t]):.2f} | {med([r['batch'] for r in f]):.1f} / {med([r['batch'] for r in t]):.1f} | "
                    f"{med([r['cpu_us'] for r in f]):.0f} / {med([r['cpu_us'] for r in t]):.0f} | "
                    f"{med([r['client_us'] for r in f]):.0f} / {med([r['client_us'] for r in t]):.0f} |")
    body += ["", f"Server CPU per request at {a.rate:.0f} requests/s offered (bench/cost.py's 4 paced client threads, "
             f"4 s windows, the median of {a.paced_windows}, the servers in turn):", "",
             "| model | protocol | ferry µs | Triton µs | ferry / Triton |", "|---|---|---|---|---|"]
    for (model, protocol, name), v in paced.items():
        if name == "ferry":
            fv, tv = med(v), med(paced[(model, protocol, "Triton")])
            body.append(f"| {model} | {protocol} | {fv:.0f} | {tv:.0f} | {fv / tv:.2f} |")
    body += ["", "Resident memory when idle, one second after ready (MiB): "
             + ", ".join(f"{n} {v:.1f}" for n, v in rss.items()) + "."]
    print("\n".join(body))
    if not a.no_write:
        run.replace_section(os.path.join(run.BENCH, "RESULTS.md"), TITLE, "\n".join(body) + "\n")


if __name__ == "__main__":
    main()
