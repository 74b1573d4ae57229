#!/usr/bin/env python3
"""Memory per extra instance of a PyTorch model in ferry (after a release build), run by a Python
that has torch:

    /root/.cache/ferry/torch-2.15.0/bin/python bench/pytorch_memory.py

An MLP of 64 MiB of FP32 weights (2048-4096-2048) as TorchScript and as an AOTInductor package,
served alone with `count: 1` and `count: 3` (and the package with `ENABLE_WEIGHT_SHARING`): the
proportional set size (PSS) of the server and every process under it, from /proc/<pid>/smaps_rollup,
after ready and six requests. Writes the section "PyTorch memory per extra instance" of
bench/RESULTS.md.
"""
import datetime
import json
import os
import subprocess
import sys
import time
import urllib.request

import numpy as np
import torch

BENCH = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, BENCH)
import run  # noqa: E402

WORK = os.path.join(BENCH, ".work", "pytorch_memory")
WEIGHTS_MIB = (2048 * 4096 + 4096 + 4096 * 2048 + 2048) * 4 / 2**20


def build():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(2048, 4096), torch.nn.ReLU(), torch.nn.Linear(4096, 2048)).eval()
    files = {"model.pt": os.path.join(WORK, "model.pt"), "model.pt2": os.path.join(WORK, "model.pt2")}
    os.makedirs(WORK, exist_ok=True)
    example = torch.randn(2, 2048)
    if not os.path.exists(files["model.pt"]):
        torch.jit.trace(model, example).save(files["model.pt"])
    if not os.path.exists(files["model.pt2"]):
        import torch.fx.experimental._config as fx_config
        with fx_config.patch(backed_size_oblivious=True):
            ep = torch.export.export(model, (example,), dynamic_shapes=({0: torch.export.Dim("b", min=1, max=8)},))
        torch._inductor.aoti_compile_and_package(ep, package_path=files["model.pt2"])
    return files


def repo_for(files, platform, count, shared):
    name = f"{'ts' if platform == 'pytorch_libtorch' else 'aoti'}_{count}{'_shared' if shared else ''}"
    root = os.path.join(WORK, "repos", name)
    version = os.path.join(root, "m", "1")
    os.makedirs(version, exist_ok=True)
    file = "model.pt" if platform == "pytorch_libtorch" else "model.pt2"
    target = os.path.join(version, file)
    if not os.path.exists(target):
        os.link(files[file], target)
    sharing = ', { key: "ENABLE_WEIGHT_SHARING" value { string_value: "true" } }' if shared else ""
    with open(os.path.join(root, "m", "config.pbtxt"), "w") as f:
        f.write(f'''name: "m"
platform: "{platform}"
max_batch_size: 8
instance_group [ {{ count: {count} kind: KIND_CPU }} ]
parameters [ {{ key: "INTRA_OP_THREAD_COUNT" value {{ string_value: "1" }} }}{sharing} ]
input [ {{ name: "INPUT__0" data_type: TYPE_FP32 dims: [ 2048 ] }} ]
output [ {{ name: "OUTPUT__0" data_type: TYPE_FP32 dims: [ 2048 ] }} ]
''')
    return name, root


def tree(pid):
    found = [pid]
    for t in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{t}/children") as f:
            for child in f.read().split():
                found += tree(int(child))
    return found


def pss_mib(pid):
    total = 0
    for p in tree(pid):
        with open(f"/proc/{p}/smaps_rollup") as f:
            total += sum(int(line.split()[1]) for line in f if line.startswith("Pss:"))
    return total / 1024


def measure(root):
    http = run.free_port()
    proc = run.start_server(root, http, run.free_port(), [f"--backend-config=pytorch,python={sys.executable}"])
    try:
        body = json.dumps({"inputs": [{"name": "INPUT__0", "shape": [1, 2048], "datatype": "FP32",
                                       "data": np.ones(2048).tolist()}]}).encode()
        for _ in range(6):
            urllib.request.urlopen(urllib.request.Request(f"http://127.0.0.1:{http}/v2/models/m/infer", body)).read()
        time.sleep(1)
        return pss_mib(proc.pid)
    finally:
        proc.terminate()
        proc.wait()


def main():
    files = build()
    results = {}
    for platform, shared in (("pytorch_libtorch", False), ("pytorch_libtorch", True), ("torch_aoti", False),
                             ("torch_aoti", True)):
        for count in (1, 3):
            name, root = repo_for(files, platform, count, shared)
            results[name] = measure(root)
    lines = [
        f"Commit `{run.commit_label()}`, {datetime.date.today()}, release build, torch {torch.__version__} (PyPI). "
        f"An MLP of {WEIGHTS_MIB:.1f} MiB of FP32 weights (2048-4096-2048) served alone, `count: 1` against "
        f"`count: 3`, after ready and six requests: PSS of the server and every process under it.",
        "",
        "| model | PSS, count 1 (MiB) | PSS, count 3 (MiB) | per extra instance (MiB) | per extra instance / weights |",
        "|---|---|---|---|---|",
    ]
    for label, key in (("TorchScript (in the server)", "ts"), ("TorchScript, ENABLE_WEIGHT_SHARING", "ts_shared"),
                       ("AOTInductor package (in the server)", "aoti"),
                       ("AOTInductor package, ENABLE_WEIGHT_SHARING", "aoti_shared")):
        suffix = "_shared" if key.endswith("_shared") else ""
        stem = key.replace("_shared", "")
        one, three = results[f"{stem}_1{suffix}"], results[f"{stem}_3{suffix}"]
        extra = (three - one) / 2
        lines.append(f"| {label} | {one:.0f} | {three:.0f} | {extra:.1f} | {extra / WEIGHTS_MIB:.2f} |")
    run.replace_section(os.path.join(BENCH, "RESULTS.md"), "PyTorch memory per extra instance", "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
