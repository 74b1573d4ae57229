#!/usr/bin/env python3
"""The image: its size, and the time from `docker run` to ready (the embedded example repository,
KServe v2 health) and from `docker run IMAGE serve` to a 200 on SageMaker's /ping, best and median
of several starts. Writes its section of RESULTS.md.

Usage: container/build.sh --from-host --tag ferry:bench   (a release build), then
       python bench/container.py --image ferry:bench
"""
import argparse
import os
import shutil
import statistics
import subprocess
import tempfile
import time
import urllib.request

import run


def ready_after(image, args, command, path, port):
    name = f"ferry-bench-{os.getpid()}"
    started = time.perf_counter()
    subprocess.run(["docker", "run", "-d", "--name", name, "-p", f"127.0.0.1::{port}", *args, image, *command],
                   check=True, stdout=subprocess.DEVNULL)
    try:
        host_port = None
        while True:
            if host_port is None:
                out = subprocess.run(["docker", "port", name, f"{port}/tcp"], capture_output=True, text=True).stdout
                host_port = int(out.split("\n")[0].rsplit(":", 1)[1]) if out.strip() else None
            if host_port:
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{host_port}{path}", timeout=1) as r:
                        if r.status == 200:
                            return time.perf_counter() - started
                except OSError:
                    pass
            time.sleep(0.01)
    finally:
        subprocess.run(["docker", "rm", "-f", name], capture_output=True)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--image", default="ferry:bench")
    p.add_argument("--runs", type=int, default=7)
    a = p.parse_args()
    size = int(subprocess.run(["docker", "image", "inspect", "-f", "{{.Size}}", a.image], capture_output=True, text=True,
                              check=True).stdout)
    model = tempfile.mkdtemp()
    shutil.copytree(os.path.join(run.ROOT, "examples", "simple"), os.path.join(model, "simple"))
    subprocess.run(["chmod", "-R", "a+rX", model], check=True)
    kserve = [ready_after(a.image, [], [], "/v2/health/ready", 8000) for _ in range(a.runs)]
    sagemaker = [ready_after(a.image, ["-v", f"{model}:/opt/ml/model:ro"], ["serve"], "/ping", 8080) for _ in range(a.runs)]
    lines = [
        f"Commit `{run.commit_label()}`, {time.strftime('%Y-%m-%d')}: image `{a.image}` built by "
        "`container/build.sh --from-host` (release binary, stripped; distroless-style base made from Debian's "
        f"libc6, libgcc-s1 and libstdc++6). Size {size / 1e6:.1f} MB. Start to ready over {a.runs} starts on "
        "this 2-core machine (docker run → first 200, polled every 10 ms):",
        "",
        "| how it starts | best s | median s |",
        "|---|---:|---:|",
        f"| `docker run IMAGE` (embedded examples, `/v2/health/ready`) | {min(kserve):.2f} | {statistics.median(kserve):.2f} |",
        f"| `docker run IMAGE serve`, `/opt/ml/model` read only (`/ping`) | {min(sagemaker):.2f} | "
        f"{statistics.median(sagemaker):.2f} |",
    ]
    print("\n".join(lines))
    run.replace_section(os.path.join(run.BENCH, "RESULTS.md"), "Container image", "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
