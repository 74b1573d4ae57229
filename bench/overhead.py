#!/usr/bin/env python3
"""The cost of observability: the same perf_analyzer run against ferry with metrics and tracing
off, and with metrics on (scraped every second) plus tracing at the default rate (1 request in
1000) exported to a local OTLP/HTTP sink, alternating rounds so drift hits both alike. Writes its
section of RESULTS.md.

Usage (after `source bench/tools.sh`): python bench/overhead.py [--rounds 3]
"""
import argparse
import http.server
import os
import statistics
import threading
import time
import urllib.request

import run

OFF = ["--allow-metrics=false"]


def sink():
    """An OTLP/HTTP receiver that accepts and drops every export."""
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args):
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    return httpd.server_address[1]


def measure(repo, model, protocol, c, extra, scrape_port=None):
    http_port, grpc_port = run.free_port(), run.free_port()
    args = list(extra)
    if scrape_port:
        args.append(f"--metrics-port={scrape_port}")
    proc = run.start_server(repo, http_port, grpc_port, args)
    stop = threading.Event()

    def scrape():
        while not stop.wait(1.0):
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{scrape_port}/metrics", timeout=2).read()
            except OSError:
                pass

    if scrape_port:
        threading.Thread(target=scrape, daemon=True).start()
    try:
        base = f"http://127.0.0.1:{http_port}"
        data = run.input_data(base, model)
        url = f"127.0.0.1:{http_port if protocol == 'http' else grpc_port}"
        return run.perf(model, url, protocol, c, data, 3000)["throughput"]
    finally:
        stop.set()
        proc.terminate()
        proc.wait(30)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--repo", default=os.path.join(run.BENCH, ".work", "ref", "model_repository"))
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args()
    os.makedirs(run.WORK, exist_ok=True)
    otlp = sink()
    on = [f"--trace-config=opentelemetry,url=127.0.0.1:{otlp}/v1/traces"]
    rows = []
    for model, protocol, c in [("identity_fp32", "http", 16), ("mlp_small", "http", 16), ("mlp_small", "grpc", 16)]:
        off_runs, on_runs = [], []
        for _ in range(a.rounds):
            off_runs.append(measure(os.path.abspath(a.repo), model, protocol, c, OFF))
            on_runs.append(measure(os.path.abspath(a.repo), model, protocol, c, on, scrape_port=run.free_port()))
        off, on_ = statistics.mean(off_runs), statistics.mean(on_runs)
        rows.append((model, protocol, c, off, on_, off_runs, on_runs))
        print(f"{model} {protocol} c{c}: off {off:.0f}  on {on_:.0f}  ({(on_ / off - 1) * 100:+.1f}%)", flush=True)
    lines = [
        f"Commit `{run.commit_label()}`, {time.strftime('%Y-%m-%d')}: mean of {a.rounds} alternating rounds of 3 s "
        "perf_analyzer windows. Off: `--allow-metrics=false`, no tracing. On: metrics scraped every second, "
        "tracing at the default rate (1 in 1000) exported over OTLP/HTTP to a local sink.",
        "",
        "| model | protocol | concurrency | off, infer/s | on, infer/s | change | rounds off | rounds on |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for model, protocol, c, off, on_, off_runs, on_runs in rows:
        lines.append(f"| {model} | {protocol} | {c} | {off:.0f} | {on_:.0f} | {(on_ / off - 1) * 100:+.1f}% | "
                     f"{', '.join(f'{x:.0f}' for x in off_runs)} | {', '.join(f'{x:.0f}' for x in on_runs)} |")
    run.replace_section(os.path.join(run.BENCH, "RESULTS.md"), "Cost of metrics and tracing", "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
