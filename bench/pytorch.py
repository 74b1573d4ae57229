#!/usr/bin/env python3
"""PyTorch models in ferry (after `source bench/tools.sh` and a release build), run by a Python
that has torch and onnxruntime (bench/openai_embeddings.py says how to make one):

    source bench/tools.sh && /tmp/st/bin/python bench/pytorch.py

A ResNet-18-sized CNN (3x224x224, random weights) and a small MLP (64-256-256-10), each as
TorchScript and as an AOTInductor package, with dynamic batching: perf_analyzer over gRPC at c1
and c16 (batch 1 per request), beside the same model in-process on the same PyTorch at the batch
ferry formed (the eager module for TorchScript and ONNX, the loaded package for AOTInductor), and
beside the same model exported to ONNX in ferry. Writes the section "PyTorch models" of
bench/RESULTS.md.
"""
import datetime
import os
import sys

import numpy as np
import torch

BENCH = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, BENCH)
import run  # noqa: E402

WORK = os.path.join(BENCH, ".work", "pytorch")
INTERVAL_MS = int(os.environ.get("BENCH_INTERVAL_MS", "4000"))


class Block(torch.nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.c1 = torch.nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.b1 = torch.nn.BatchNorm2d(cout)
        self.c2 = torch.nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.b2 = torch.nn.BatchNorm2d(cout)
        self.down = None
        if stride != 1 or cin != cout:
            self.down = torch.nn.Sequential(torch.nn.Conv2d(cin, cout, 1, stride, bias=False), torch.nn.BatchNorm2d(cout))

    def forward(self, x):
        y = self.b2(self.c2(torch.relu(self.b1(self.c1(x)))))
        return torch.relu(y + (x if self.down is None else self.down(x)))


class ResNet18(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = torch.nn.Sequential(torch.nn.Conv2d(3, 64, 7, 2, 3, bias=False), torch.nn.BatchNorm2d(64),
                                        torch.nn.ReLU(), torch.nn.MaxPool2d(3, 2, 1))
        layers, cin = [], 64
        for cout, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
            layers += [Block(cin, cout, stride), Block(cout, cout, 1)]
            cin = cout
        self.layers = torch.nn.Sequential(*layers)
        self.fc = torch.nn.Linear(512, 1000)

    def forward(self, x):
        return self.fc(self.layers(self.stem(x)).mean(dim=(2, 3)))


def mlp():
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256), torch.nn.ReLU(),
                               torch.nn.Linear(256, 10))


def config(name, platform, dims_in, dims_out, batch):
    return f'''name: "{name}"
platform: "{platform}"
max_batch_size: {batch}
dynamic_batching {{ }}
input [ {{ name: "INPUT__0" data_type: TYPE_FP32 dims: {dims_in} }} ]
output [ {{ name: "OUTPUT__0" data_type: TYPE_FP32 dims: {dims_out} }} ]
'''


def build():
    repo = os.path.join(WORK, "repo")
    models = {}
    torch.manual_seed(0)
    for base, model, shape, out in (("resnet18", ResNet18(), [3, 224, 224], [1000]), ("mlp", mlp(), [64], [10])):
        model.eval()
        models[base] = (model, shape)
        example = torch.randn(2, *shape)
        variants = [("ts", "pytorch_libtorch", "model.pt"), ("onnx", "onnxruntime_onnx", "model.onnx"),
                    ("aoti", "torch_aoti", "model.pt2")]
        for suffix, platform, file in variants:
            name = f"{base}_{suffix}"
            path = os.path.join(repo, name, "1", file)
            if os.path.exists(path):
                continue
            os.makedirs(os.path.dirname(path), exist_ok=True)
            if suffix == "ts":
                torch.jit.trace(model, example).save(path)
            elif suffix == "onnx":
                torch.onnx.export(model, (example,), path, input_names=["INPUT__0"], output_names=["OUTPUT__0"],
                                  dynamic_axes={"INPUT__0": {0: "b"}, "OUTPUT__0": {0: "b"}}, dynamo=False)
            else:
                import torch.fx.experimental._config as fx_config
                # Else the batch Dim starts at 2 (at export, and again when Inductor compiles).
                with fx_config.patch(backed_size_oblivious=True):
                    ep = torch.export.export(model, (example,), dynamic_shapes=({0: torch.export.Dim("b", min=1, max=16)},))
                    torch._inductor.aoti_compile_and_package(ep, package_path=path)
            with open(os.path.join(repo, name, "config.pbtxt"), "w") as f:
                f.write(config(name, platform, shape, out, 16))
    return repo, models


def in_process(model, shape, batch):
    """Rows per second of the model in this process at `batch`, PyTorch's own threads."""
    x = torch.randn(max(1, round(batch)), *shape)
    with torch.inference_mode():
        return run.time_calls(lambda: model(x), x.shape[0])[0]


def package(repo, name):
    """The AOTInductor package of `name`, loaded in this process."""
    return torch._inductor.aoti_load_package(os.path.join(repo, name, "1", "model.pt2"))


def main():
    repo, models = build()
    rows = run.grpc_sweep(repo, sorted(os.listdir(repo)), INTERVAL_MS, [f"--backend-config=pytorch,python={sys.executable}"])
    lines = [
        f"Commit `{run.commit_label()}`, {datetime.date.today()}, {os.cpu_count()} cores, release build, "
        f"torch {torch.__version__} (PyPI), perf_analyzer over gRPC, batch 1 per request, dynamic batching "
        f"(max 16), random weights. \"In-process\" is the same model called by PyTorch in this process at "
        f"the batch ferry formed (rounded), with PyTorch's default threads (for `_aoti`, the package "
        f"loaded by `torch._inductor.aoti_load_package`). TorchScript and AOTInductor packages run "
        f"inside the server.",
        "",
        "| model | c | infer/s | p50 ms | p99 ms | batch formed | in-process rows/s at that batch | share |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, c, r, batch in rows:
        base_name = name.rsplit("_", 1)[0]
        model, shape = models[base_name]
        ceiling = in_process(package(repo, name) if name.endswith("_aoti") else model, shape, batch)
        lines.append(f"| {name} | {c} | {r['throughput']:.0f} | {r['p50']:.2f} | {r['p99']:.2f} | {batch:.1f} | "
                     f"{ceiling:.0f} | {r['throughput'] / ceiling:.2f} |")
    p50 = {(n, c): r["p50"] for n, c, r, _ in rows}
    lines += ["", f"- MLP p50 at c1: TorchScript {p50[('mlp_ts', 1)]:.2f} ms, AOTInductor {p50[('mlp_aoti', 1)]:.2f} ms, "
              f"ONNX in ferry {p50[('mlp_onnx', 1)]:.2f} ms (target: within 0.1 ms of ONNX)."]
    run.replace_section(os.path.join(BENCH, "RESULTS.md"), "PyTorch models", "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
