#!/usr/bin/env python3
"""ResNet-18 as two AOTInductor packages at c1 and c16 (after `source bench/tools.sh` and a
release build), run by the Python of scripts/torch.sh:

    source bench/tools.sh && source scripts/torch.sh && $FERRY_TORCH_PYTHON bench/pytorch_batch1.py [ROUNDS]

Both packages are exported with `backed_size_oblivious`; `resnet18_aoti` is compiled with
Inductor's defaults (its input checks start the batch at 2, so ferry pads a single row to two),
`resnet18_aoti1` with `layout_optimization` off (its checks start at 1). Each round starts the
server, runs perf_analyzer over gRPC at c16 and c1, and reads the server's CPU by thread; then the
package is timed in this process at the batches that matter (nothing else running). Prints the
rounds; "PyTorch packages at batch 1" of bench/RESULTS.md is written from them by hand.
"""
import os
import sys
import time
import types

import torch
import torch.fx.experimental._config as fx_config

BENCH = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, BENCH)
import pytorch  # noqa: E402
import run  # noqa: E402

WORK = os.path.join(BENCH, ".work", "pytorch_batch1")
TICK = os.sysconf("SC_CLK_TCK")
# The test venv's ONNX Runtime, which run.start_server hands the server (this Python has none).
ORT_PACKAGE = os.path.join(run.ROOT, ".venv", "lib", f"python{sys.version_info.major}.{sys.version_info.minor}",
                           "site-packages", "onnxruntime", "__init__.py")


def build():
    repo = os.path.join(WORK, "repo")
    for name, configs in (("resnet18_aoti", {}), ("resnet18_aoti1", {"layout_optimization": False})):
        path = os.path.join(repo, name, "1", "model.pt2")
        if os.path.exists(path):
            continue
        torch.manual_seed(0)
        model = pytorch.ResNet18().eval()
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with fx_config.patch(backed_size_oblivious=True):
            ep = torch.export.export(model, (torch.randn(2, 3, 224, 224),),
                                     dynamic_shapes=({0: torch.export.Dim("b", min=1, max=16)},))
            torch._inductor.aoti_compile_and_package(ep, package_path=path, inductor_configs=configs)
        with open(os.path.join(repo, name, "config.pbtxt"), "w") as f:
            f.write(pytorch.config(name, "torch_aoti", [3, 224, 224], [1000], 16))
    return repo


def cpu(path):
    try:
        with open(f"/proc/{path}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / TICK
    except OSError:
        return 0.0


def threads(pid):
    out = {}
    for t in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{t}/comm") as f:
                out[t] = (f.read().strip(), cpu(f"{pid}/task/{t}"))
        except OSError:
            pass
    return out


def serve(repo, name):
    """perf_analyzer at c16 and c1: [(c, infer/s, p50 ms, batch formed, {thread: CPU s})]."""
    os.environ.setdefault("FERRY_BENCH_BIN", os.path.join(run.ROOT, "target", "release", "ferry"))
    fake = types.ModuleType("onnxruntime")
    fake.__file__ = ORT_PACKAGE
    sys.modules["onnxruntime"] = fake
    os.makedirs(run.WORK, exist_ok=True)
    http_port, grpc_port = run.free_port(), run.free_port()
    try:
        proc = run.start_server(repo, http_port, grpc_port, [f"--metrics-port={run.free_port()}",
                                                             f"--backend-config=pytorch,python={sys.executable}"])
    finally:
        # torch looks its optional modules up later; the stand-in must not be one.
        sys.modules.pop("onnxruntime", None)
    base, rows = f"http://127.0.0.1:{http_port}", []
    try:
        data = run.input_data(base, name)
        for c in (16, 1):
            before, t0 = run.stats(base, name), threads(proc.pid)
            r = run.perf(name, f"127.0.0.1:{grpc_port}", "grpc", c, data, 5000)
            after, t1 = run.stats(base, name), threads(proc.pid)
            by_thread = {}
            for t, (comm, used) in t1.items():
                by_thread[comm] = by_thread.get(comm, 0.0) + used - t0.get(t, (comm, 0.0))[1]
            batch = (after[0] - before[0]) / max(after[1] - before[1], 1)
            rows.append((c, r["throughput"], r["p50"], batch, by_thread))
    finally:
        proc.terminate()
        proc.wait()
    return rows


def main():
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    repo = build()
    for name in ("resnet18_aoti", "resnet18_aoti1"):
        for k in range(rounds):
            for c, rate, p50, batch, by_thread in serve(repo, name):
                busy = ", ".join(f"{t} {s:.1f}" for t, s in sorted(by_thread.items(), key=lambda kv: -kv[1])[:3])
                print(f"{name} round {k + 1} c{c}: {rate:.1f} infer/s, p50 {p50:.1f} ms, batch {batch:.1f} "
                      f"(server CPU s by thread: {busy})", flush=True)
            package = torch._inductor.aoti_load_package(os.path.join(repo, name, "1", "model.pt2"))
            for b in (1, 2, 8, 9):
                x = torch.randn(b, 3, 224, 224)
                rate, p50 = run.time_calls(lambda: package(x), b)
                print(f"{name} round {k + 1} in-process batch {b}: {rate:.1f} rows/s, p50 {p50:.1f} ms", flush=True)
            time.sleep(1)


if __name__ == "__main__":
    main()
