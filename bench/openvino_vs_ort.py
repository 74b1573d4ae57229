#!/usr/bin/env python3
"""OpenVINO beside ONNX Runtime in ferry on the same models (after `source bench/tools.sh` and a
release build), in the test venv (which has openvino):

    source scripts/venv.sh && source bench/tools.sh && python bench/openvino_vs_ort.py

The reference cnn_small (ResNet-18 topology, FP32 [3,224,224]) and mlp_small of
../shared/bench/make_models.py, one CPU instance each with the reference's dynamic batching,
served three ways from the same ONNX file: ONNX Runtime (`onnxruntime_onnx`, 2 intra-op threads),
OpenVINO in FP32 (`INFERENCE_PRECISION_HINT: f32`), and OpenVINO at its default precision (bf16
on CPUs that have it). perf_analyzer over gRPC at c1 and c16, batch 1 per request, each beside the
same file run in this process by the same runtime at the batch ferry formed. Writes the
section "OpenVINO beside ONNX Runtime" of bench/RESULTS.md.

With `--alternate ROUNDS`: cnn_small at c16 with its input in system shared memory (the client's
600 KB per request taken off the shared cores), each run followed at once by the same file
in-process at the batch formed, the runtimes in turn, ROUNDS times; and each runtime in-process at
batch 1 and 8. Writes the section "OpenVINO beside ONNX Runtime: c16, alternated with in-process".
"""
import datetime
import os
import statistics
import sys

import numpy as np
import openvino

BENCH = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, BENCH)
sys.path.insert(0, os.path.join(BENCH, "..", "..", "shared", "bench"))
import make_models  # noqa: E402
import run  # noqa: E402

WORK = os.path.join(BENCH, ".work", "openvino")
INTERVAL_MS = int(os.environ.get("BENCH_INTERVAL_MS", "5000"))


def build():
    repo = os.path.join(WORK, "repo")
    names = []
    for base, maker in (("cnn_small", lambda p: make_models.make_cnn(p, np.random.default_rng(make_models.SEED + 2))),
                        ("mlp_small", lambda p: make_models.make_mlp(p, np.random.default_rng(make_models.SEED + 1)))):
        onnx_config = make_models.config_pbtxt(base, "onnx", 2)
        for flavor, precision in (("ort", None), ("ov_f32", "f32"), ("ov_default", "")):
            name = f"{base}_{flavor}"
            names.append(name)
            path = os.path.join(repo, name, "1", "model.onnx")
            if not os.path.exists(path):
                os.makedirs(os.path.dirname(path), exist_ok=True)
                maker(path)
            text = onnx_config.replace(f'name: "{base}"', f'name: "{name}"')
            if precision is not None:
                text = text.replace('platform: "onnxruntime_onnx"', 'backend: "openvino"\ndefault_model_filename: "model.onnx"')
                text = "\n".join(line for line in text.splitlines() if "op_thread_count" not in line) + "\n"
                text += 'parameters { key: "INFERENCE_NUM_THREADS" value: { string_value: "2" } }\n'
                if precision:
                    text += f'parameters {{ key: "INFERENCE_PRECISION_HINT" value: {{ string_value: "{precision}" }} }}\n'
            with open(os.path.join(repo, name, "config.pbtxt"), "w") as f:
                f.write(text)
    return repo, names


def in_process(repo, name, batch, seconds=3.0):
    """The same file in this process, as ferry runs it (OpenVINO with ferry's properties, or ONNX
    Runtime with 2 intra-op threads), at `batch` rows (rounded): rows/s and one call's p50 (ms)."""
    path = os.path.join(repo, name, "1", "model.onnx")
    batch = max(1, round(batch))
    if name.endswith("_ort"):
        import onnxruntime as ort
        opts = ort.SessionOptions()
        opts.intra_op_num_threads, opts.inter_op_num_threads = 2, 1
        session = ort.InferenceSession(path, opts, providers=["CPUExecutionProvider"])
        meta = session.get_inputs()[0]
        x = np.random.default_rng(0).random([batch] + [d for d in meta.shape[1:]], dtype=np.float32)
        call = lambda: session.run(None, {meta.name: x})
    else:
        core = openvino.Core()
        model = core.read_model(path)
        model.reshape({model.inputs[0]: openvino.PartialShape([batch] + list(model.inputs[0].partial_shape)[1:])})
        props = {"PERFORMANCE_HINT": "LATENCY", "NUM_STREAMS": "1", "INFERENCE_NUM_THREADS": "2"}
        if name.endswith("_ov_f32"):
            props["INFERENCE_PRECISION_HINT"] = "f32"
        compiled = core.compile_model(model, "CPU", props)
        request = compiled.create_infer_request()
        shape = [int(d) for d in compiled.inputs[0].shape]
        x = np.random.default_rng(0).random(shape, dtype=np.float32)
        call = lambda: request.infer({0: x})
    return run.time_calls(call, batch, seconds, warm=1)


def main():
    repo, names = build()
    rows = run.grpc_sweep(repo, names, INTERVAL_MS)
    flags = open("/proc/cpuinfo").read()
    bf16 = "amx_bf16" in flags or "avx512_bf16" in flags
    lines = [
        f"Commit `{run.commit_label()}`, {datetime.date.today()}, {os.cpu_count()} cores "
        f"({'with' if bf16 else 'without'} bfloat16 units), release build, OpenVINO {openvino.get_version().split('-')[0]} "
        f"(PyPI) and ONNX Runtime (the test venv's), the same ONNX file each, one CPU instance, 2 threads, "
        f"perf_analyzer over gRPC, batch 1 per request, the reference's dynamic batching. \"In-process\" is the "
        f"same file run from Python in this process by the same runtime with the same settings at the batch ferry "
        f"formed (rounded).",
        "",
        "| model | runtime | c | infer/s | p50 ms | p99 ms | batch formed | in-process rows/s at that batch | share | "
        "in-process p50 ms of that call |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    label = {"ort": "ONNX Runtime", "ov_f32": "OpenVINO f32", "ov_default": "OpenVINO default (bf16)" if bf16 else "OpenVINO default"}
    for name, c, r, batch in rows:
        model, flavor = name.split("_small_")
        ceiling, call_ms = in_process(repo, name, batch)
        lines.append(f"| {model}_small | {label[flavor]} | {c} | {r['throughput']:.0f} | {r['p50']:.2f} | "
                     f"{r['p99']:.2f} | {batch:.1f} | {ceiling:.0f} | {r['throughput'] / ceiling:.2f} | {call_ms:.3f} |")
    tp = {(n, c): r["throughput"] for n, c, r, _ in rows}
    lines.append("")
    for model in ("cnn_small", "mlp_small"):
        for c in (1, 16):
            ort = tp[(f"{model}_ort", c)]
            lines.append(f"- {model} c{c}: OpenVINO f32 {tp[(f'{model}_ov_f32', c)] / ort:.2f}x ONNX Runtime, "
                         f"OpenVINO default {tp[(f'{model}_ov_default', c)] / ort:.2f}x.")
    run.replace_section(os.path.join(BENCH, "RESULTS.md"), "OpenVINO beside ONNX Runtime", "\n".join(lines) + "\n")
    print("\n".join(lines))


def alternated(rounds):
    repo, names = build()
    cnns = [n for n in names if n.startswith("cnn_small")]
    http_port, grpc_port = run.free_port(), run.free_port()
    os.makedirs(run.WORK, exist_ok=True)
    proc = run.start_server(repo, http_port, grpc_port, ["--allow-client-shm=true"])
    base, rows = f"http://127.0.0.1:{http_port}", []
    shm = ["--shared-memory=system", "--output-shared-memory-size=65536"]
    try:
        for k in range(rounds):
            for name in cnns:
                data = run.input_data(base, name)
                before = run.stats(base, name)
                r = run.perf(name, f"127.0.0.1:{grpc_port}", "grpc", 16, data, INTERVAL_MS, shm)
                after = run.stats(base, name)
                batch = (after[0] - before[0]) / max(after[1] - before[1], 1)
                ceiling, call_ms = in_process(repo, name, batch, 5.0)
                rows.append((k + 1, name, r, batch, ceiling, call_ms))
                print(rows[-1], flush=True)
    finally:
        proc.terminate()
        proc.wait()
    flags = open("/proc/cpuinfo").read().split()
    units = ", ".join(f for f in ("avx512_bf16", "amx_bf16") if f in flags) or "no bfloat16 units"
    label = {"ort": "ONNX Runtime", "ov_f32": "OpenVINO f32", "ov_default": "OpenVINO default"}
    lines = [
        f"Commit `{run.commit_label()}`, {datetime.date.today()}, {os.cpu_count()} cores ({units}), OpenVINO "
        f"{openvino.get_version().split('-')[0]}, cnn_small served by each runtime from the same ONNX file (one CPU "
        f"instance, 2 threads, max queue delay 500 µs), perf_analyzer over gRPC at c16 with the input in system "
        f"shared memory, {INTERVAL_MS / 1000:g} s windows; each run followed at once by the same file in-process "
        f"at the batch formed (5 s); the runtimes in turn, {rounds} rounds.",
        "",
        "| round | runtime | infer/s | p50 ms | batch formed | in-process rows/s at that batch | share |",
        "|---|---|---|---|---|---|---|",
    ]
    for k, name, r, batch, ceiling, _ in rows:
        lines.append(f"| {k} | {label[name.split('_small_')[1]]} | {r['throughput']:.1f} | {r['p50']:.1f} | "
                     f"{batch:.2f} | {ceiling:.1f} | {r['throughput'] / ceiling:.3f} |")
    lines.append("")
    for name in cnns:
        shares = sorted(r["throughput"] / c for _, n, r, _, c, _ in rows if n == name)
        lines.append(f"- {label[name.split('_small_')[1]]}: share {shares[0]:.2f}–{shares[-1]:.2f}, "
                     f"median {statistics.median(shares):.3f}.")
    lines += ["", "In-process, the same minutes (rows/s; one call's p50 in ms):", "",
              "| model | runtime | batch 1 | batch 8 |", "|---|---|---|---|"]
    for name in names:
        cells = [in_process(repo, name, b) for b in (1, 8)]
        lines.append(f"| {name.split('_small_')[0]}_small | {label[name.split('_small_')[1]]} | "
                     + " | ".join(f"{tp:.0f} ({ms:.2f})" for tp, ms in cells) + " |")
    run.replace_section(os.path.join(BENCH, "RESULTS.md"), "OpenVINO beside ONNX Runtime: c16, alternated with in-process",
                        "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--alternate"]:
        alternated(int(sys.argv[2]))
    else:
        main()
