#!/usr/bin/env python3
"""Tree models in ferry (after `source bench/tools.sh` and a release build), in the test venv
(which has xgboost-cpu and lightgbm):

    source scripts/venv.sh && source bench/tools.sh && python bench/fil.py

An XGBoost binary classifier of 300 trees (depth 6) and a LightGBM one of 300 trees (63 leaves),
both on 32 features trained on random rows, served by `backend: "fil"` with dynamic batching:
perf_analyzer over gRPC at c1 and c16 (one row per request), beside the same booster predicting
in this process at the batch ferry formed (the framework's own threads), and the in-process p50
of one call at batch 1. Writes the section "Tree models (FIL)" of bench/RESULTS.md.
"""
import datetime
import os
import sys

import lightgbm as lgb
import numpy as np
import xgboost as xgb

BENCH = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, BENCH)
import run  # noqa: E402

WORK = os.path.join(BENCH, ".work", "fil")
INTERVAL_MS = int(os.environ.get("BENCH_INTERVAL_MS", "4000"))
FEATURES, TREES = 32, 300


def config(name, model_type):
    return f'''backend: "fil"
max_batch_size: 256
dynamic_batching {{ }}
input [ {{ name: "input__0" data_type: TYPE_FP32 dims: [ {FEATURES} ] }} ]
output [ {{ name: "output__0" data_type: TYPE_FP32 dims: [ 1 ] }} ]
parameters {{ key: "model_type" value: {{ string_value: "{model_type}" }} }}
parameters {{ key: "output_class" value: {{ string_value: "false" }} }}
instance_group [ {{ kind: KIND_CPU }} ]
'''


def build():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(5000, FEATURES)).astype(np.float32)
    y = (x[:, 0] * x[:, 1] + np.sin(x[:, 2]) - x[:, 3] > 0).astype(np.float32)
    repo = os.path.join(WORK, "repo")
    boosters = {}
    xb = xgb.train({"objective": "binary:logistic", "max_depth": 6, "eta": 0.1}, xgb.DMatrix(x, label=y), TREES)
    lb = lgb.train({"objective": "binary", "num_leaves": 63, "verbose": -1}, lgb.Dataset(x, label=y), TREES)
    for name, model_type, file, data, predict in (
        ("xgboost", "xgboost_ubj", "xgboost.ubj", bytes(xb.save_raw("ubj")), xb.inplace_predict),
        ("lightgbm", "lightgbm", "model.txt", lb.model_to_string().encode(), lb.predict),
    ):
        os.makedirs(os.path.join(repo, name, "1"), exist_ok=True)
        with open(os.path.join(repo, name, "1", file), "wb") as f:
            f.write(data)
        with open(os.path.join(repo, name, "config.pbtxt"), "w") as f:
            f.write(config(name, model_type))
        boosters[name] = predict
    return repo, boosters


def in_process(predict, batch):
    """Rows per second at `batch`, and the p50 of one call, in ms."""
    x = np.random.default_rng(1).normal(size=(max(1, round(batch)), FEATURES)).astype(np.float32)
    return run.time_calls(lambda: predict(x), x.shape[0], warm=20)


def main():
    repo, boosters = build()
    rows = run.grpc_sweep(repo, sorted(boosters), INTERVAL_MS)
    lines = [
        f"Commit `{run.commit_label()}`, {datetime.date.today()}, {os.cpu_count()} cores, release build, "
        f"xgboost {xgb.__version__} and lightgbm {lgb.__version__} (PyPI), binary classifiers of {TREES} trees "
        f"on {FEATURES} features, perf_analyzer over gRPC, one row per request, dynamic batching (max 256). "
        f"\"In-process\" is the same booster called from Python in this process at the batch ferry formed "
        f"(rounded), with the framework's default threads.",
        "",
        "| model | c | infer/s | p50 ms | p99 ms | batch formed | in-process rows/s at that batch | share | "
        "in-process p50 ms of that call |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, c, r, batch in rows:
        ceiling, call_ms = in_process(boosters[name], batch)
        lines.append(f"| {name} | {c} | {r['throughput']:.0f} | {r['p50']:.3f} | {r['p99']:.3f} | {batch:.1f} | "
                     f"{ceiling:.0f} | {r['throughput'] / ceiling:.2f} | {call_ms:.3f} |")
    run.replace_section(os.path.join(BENCH, "RESULTS.md"), "Tree models (FIL)", "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
