#!/usr/bin/env python3
"""--adaptive-queue-delay against Triton's wait, on the reference models with their dynamic
batching: perf_analyzer at c1 (requests one at a time: the lone request skips the delay) and c16
(requests overlap: the wait and the batches should be as without the flag), over HTTP and gRPC,
the two settings alternated round after round. Writes the section "Adaptive queue delay" of
bench/RESULTS.md.

Usage (after `source bench/tools.sh` and `source bench/ref_repos.sh`):
  python bench/adaptive.py [--rounds 2] [--models identity_fp32,mlp_small,cnn_small]
"""
import argparse
import datetime
import os
import statistics

import run

SETTINGS = (("Triton's wait", []), ("adaptive", ["--adaptive-queue-delay"]))


def sweep(repo, models, protocols, concurrencies, extra, interval_ms):
    """{(model, protocol, c): (perf's figures, the batch formed)} for one server."""
    http_port, grpc_port = run.free_port(), run.free_port()
    os.makedirs(run.WORK, exist_ok=True)
    proc = run.start_server(repo, http_port, grpc_port, extra)
    base, out = f"http://127.0.0.1:{http_port}", {}
    try:
        for model in models:
            data = run.input_data(base, model)
            for protocol in protocols:
                url = f"127.0.0.1:{http_port if protocol == 'http' else grpc_port}"
                for c in concurrencies:
                    if model == "cnn_small" and c > 1:
                        continue  # compute-bound: c16 batches the same either way, and takes long
                    r = run.perf_batched(base, model, url, protocol, c, data, interval_ms)
                    out[(model, protocol, c)] = (r, r["batch"])
    finally:
        proc.terminate()
        proc.wait()
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--repo", default=os.environ.get("REF_ON", os.path.join(run.BENCH, ".work/ref/model_repository")))
    p.add_argument("--models", default="identity_fp32,mlp_small,cnn_small")
    p.add_argument("--protocols", default="http,grpc")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--interval-ms", type=int, default=3000)
    a = p.parse_args()
    models, protocols = a.models.split(","), a.protocols.split(",")
    results = {name: [] for name, _ in SETTINGS}
    for _ in range(a.rounds):
        for name, extra in SETTINGS:
            results[name].append(sweep(a.repo, models, protocols, (1, 16), extra, a.interval_ms))
    keys = sorted(results[SETTINGS[0][0]][0])
    lines = [
        f"Commit `{run.commit_label()}`, {datetime.date.today()}, release build, 2 cores, perf_analyzer 2.50 "
        f"(synchronous, {a.interval_ms / 1000:g} s windows), the reference models with their dynamic batching "
        f"(bench/.work/ref), served without and with `--adaptive-queue-delay`, the two in turn, {a.rounds} rounds. "
        "Each cell: the rounds' figures.",
        "",
        "| model | protocol | c | infer/s, Triton's wait | infer/s, adaptive | p50 ms, Triton's wait | p50 ms, adaptive "
        "| queue µs, Triton's wait | queue µs, adaptive | batch, Triton's wait | batch, adaptive |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for key in keys:
        cells = []
        for field in ("throughput", "p50", "queue"):
            for name, _ in SETTINGS:
                vals = [r[key][0][field] for r in results[name]]
                cells.append(", ".join(f"{v:.2f}" if field == "p50" else f"{v:.0f}" for v in vals))
        for name, _ in SETTINGS:
            cells.append(", ".join(f"{r[key][1]:.1f}" for r in results[name]))
        lines.append(f"| {key[0]} | {key[1]} | {key[2]} | " + " | ".join(cells) + " |")
    lines.append("")
    for key in keys:
        t = [statistics.median(r[key][0]["throughput"] for r in results[name]) for name, _ in SETTINGS]
        lines.append(f"- {key[0]} {key[1]} c{key[2]}: adaptive at {t[1] / t[0]:.2f}× the throughput of Triton's wait (medians).")
    body = "\n".join(lines) + "\n"
    print(body)
    run.replace_section(os.path.join(run.BENCH, "RESULTS.md"), "Adaptive queue delay", body)


if __name__ == "__main__":
    main()
