#!/usr/bin/env python3
"""The ceiling for a batching server: ONNX Runtime itself running a model in-process at a given
batch size, with the same intra-op threads. Prints rows per second.

Usage: python bench/ceiling.py MODEL.onnx BATCH [--threads 2] [--seconds 2]
"""
import argparse
import time

import numpy as np
import onnxruntime as ort


def feed(session, batch, rng):
    inputs = {}
    for i in session.get_inputs():
        shape = [batch if not isinstance(d, int) or d < 0 else d for d in i.shape]
        if "int64" in i.type:
            inputs[i.name] = rng.integers(0, 100, size=shape, dtype=np.int64)
        else:
            inputs[i.name] = rng.standard_normal(shape).astype(np.float32)
    return inputs


def rows_per_second(path, batch, threads=2, seconds=2.0):
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    session = ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
    data = feed(session, batch, np.random.default_rng(0))
    session.run(None, data)
    runs, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        session.run(None, data)
        runs += 1
    return runs * batch / (time.perf_counter() - start)


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("batch", type=int)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seconds", type=float, default=2.0)
    a = p.parse_args()
    print(f"{rows_per_second(a.model, a.batch, a.threads, a.seconds):.0f}")
