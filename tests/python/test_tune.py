"""`ferry tune`: on a small model it finishes within its budget, reports every point it measured,
writes a complete config.pbtxt that loads and serves as it is (with auto-complete off), and its
throughput is the same order as perf_analyzer measures against that config. No speed is asserted."""
import json
import os
import re
import shutil
import subprocess

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

import models
from ferry_server import BINARY, Server

BUDGET = 24


def mlp(repo, name="mlp", width=128, layers=3):
    """X [-1, 64] -> three dense layers with ReLU -> Y [-1, 16]; enough work that a batch costs more
    than its request's protocol overhead."""
    rng = np.random.default_rng(0)
    nodes, inits, prev, dim = [], [], "X", 64
    for i in range(layers):
        out = 16 if i == layers - 1 else width
        w = numpy_helper.from_array((rng.standard_normal((dim, out)) * 0.1).astype(np.float32), f"W{i}")
        inits.append(w)
        mm = f"mm{i}"
        nodes.append(helper.make_node("MatMul", [prev, f"W{i}"], [mm]))
        prev = "Y" if i == layers - 1 else f"h{i}"
        nodes.append(helper.make_node("Relu" if i < layers - 1 else "Identity", [mm], [prev]))
        dim = out
    graph = helper.make_graph(
        nodes, name,
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["batch", 64])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["batch", 16])], inits)
    models.save(graph, os.path.join(repo, name, "1", "model.onnx"))
    models.write(os.path.join(repo, name, "config.pbtxt"), """
max_batch_size: 4
input [ { name: "X" data_type: TYPE_FP32 dims: [ 64 ] } ]
output [ { name: "Y" data_type: TYPE_FP32 dims: [ 16 ] } ]
instance_group [ { count: 1 kind: KIND_CPU } ]
""")


def tune(*args, timeout=240):
    return subprocess.run([BINARY, "tune", *args], capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def tuned(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tune")
    repo = str(tmp / "repo")
    mlp(repo)
    out, report = tmp / "config.pbtxt", tmp / "report.json"
    run = tune("--model-repository", repo, "--model", "mlp", "--budget-secs", str(BUDGET), "--concurrency", "1,8",
               "--output", str(out), "--report", str(report), "--target-rps", "5000")
    assert run.returncode == 0, run.stdout + run.stderr
    return repo, out, json.loads(report.read_text()), run


def test_reports_every_point_within_the_budget(tuned):
    _, _, report, run = tuned
    assert report["elapsed_secs"] <= BUDGET + 5, report["elapsed_secs"]
    points = report["points"]
    assert len(points) >= 4, "the current config, the instance layouts and the queue delays at least"
    assert points[0]["baseline"] and points[0]["point"]["instances"] == 1 and points[0]["point"]["max_batch_size"] == 4
    for p in points:
        assert [s["concurrency"] for s in p["samples"]] == [1, 8]
        for s in p["samples"]:
            assert s["requests"] > 0 and s["errors"] == 0, p
            assert 0 < s["p50_ms"] <= s["p99_ms"]
            assert s["throughput"] > 0
    assert [c["batch"] for c in report["ceiling"]] == [1, 2, 4, 8, 16, 32, 64]
    best = report["best"]
    top = max(s["throughput"] for p in points for s in p["samples"])
    assert best["sample"]["throughput"] >= 0.97 * top
    text = run.stdout
    assert "In-process ceiling" in text and "Best:" in text
    assert re.search(r"Sizing: \d+ replicas? of this \d+-core machine for 5000 requests/s at p99 <= [\d.]+ ms", text), text
    # The progress bar went to stderr, one line per point when not on a terminal.
    assert run.stderr.count("ferry tune [") >= len(points)


def test_recommended_config_loads_and_serves(tuned, tmp_path):
    repo, out, report, _ = tuned
    serve_repo = tmp_path / "repo"
    shutil.copytree(os.path.join(repo, "mlp"), serve_repo / "mlp")
    shutil.copy(out, serve_repo / "mlp" / "config.pbtxt")
    best = report["best"]["point"]
    with Server(["--model-repository", str(serve_repo), "--disable-auto-complete-config"]) as s:
        c = s.client()
        config = c.get_model_config("mlp")
        assert config["max_batch_size"] == best["max_batch_size"]
        assert sum(g["count"] for g in config["instance_group"]) == best["instances"]
        assert config["parameters"]["intra_op_thread_count"]["string_value"] == str(best["threads"])
        import tritonclient.http as httpclient
        x = np.ones((2, 64), np.float32)
        inp = httpclient.InferInput("X", [2, 64], "FP32")
        inp.set_data_from_numpy(x)
        y = c.infer("mlp", [inp]).as_numpy("Y")
        assert y.shape == (2, 16)
        # The same numbers as the model computed in-process.
        import onnxruntime as ort
        sess = ort.InferenceSession(os.path.join(repo, "mlp", "1", "model.onnx"), providers=["CPUExecutionProvider"])
        np.testing.assert_allclose(y, sess.run(None, {"X": x})[0], rtol=1e-5)

        # perf_analyzer against the recommended config, at the concurrency tune chose: the same order.
        pa = os.environ.get("PERF_ANALYZER")
        if not pa:
            pytest.fail("PERF_ANALYZER is not set: run the suite through scripts/test.sh")
        conc = report["best"]["sample"]["concurrency"]
        run = subprocess.run([pa, "-m", "mlp", "-u", s.url, "-i", "http", f"--concurrency-range={conc}:{conc}",
                              "--measurement-interval=1500", "--max-trials=4", "--stability-percentage=100"],
                             capture_output=True, text=True, timeout=120)
        assert run.returncode == 0, run.stdout + run.stderr
        measured = float(re.search(r"Concurrency: \d+, throughput: ([\d.]+) infer/sec", run.stdout).group(1))
        reported = report["best"]["sample"]["throughput"]
        assert reported / 5 <= measured <= reported * 5, (reported, measured)


def test_bad_requests_are_named(tmp_path):
    repo = str(tmp_path)
    mlp(repo)
    run = tune("--model-repository", repo, "--model", "nope", "--budget-secs", "5")
    assert run.returncode != 0 and "nope" in run.stderr, run.stderr
    run = tune("--model-repository", repo, "--model", "mlp", "--budget-secs", "5", "--shape", "Z:3")
    assert run.returncode != 0 and "no input 'Z'" in run.stderr and "X" in run.stderr, run.stderr
    run = tune("--model-repository", repo, "--model", "mlp", "--budget-secs", "5", "--shape", "X:65")
    assert run.returncode != 0 and "[65]" in run.stderr and "[64]" in run.stderr, run.stderr
    run = tune("--model-repository", repo, "--model", "mlp", "--concurrency", "0")
    assert run.returncode != 0 and "--concurrency" in run.stderr, run.stderr


def test_models_that_need_real_values_take_input_data(tmp_path):
    # simple_string adds numbers written as strings: tune's filler text fails every request, and
    # says so with the model's own error; perf_analyzer's input-data file fixes it.
    from conftest import EXAMPLES
    run = tune("--model-repository", EXAMPLES, "--model", "simple_string", "--budget-secs", "4", "--concurrency", "1")
    assert run.returncode != 0 and "the first error:" in run.stderr and "--input-data" in run.stderr, run.stderr
    data = tmp_path / "data.json"
    data.write_text(json.dumps({"data": [{"INPUT0": [str(i) for i in range(16)], "INPUT1": ["1"] * 16}]}))
    report = tmp_path / "r.json"
    run = tune("--model-repository", EXAMPLES, "--model", "simple_string", "--budget-secs", "6", "--concurrency", "1",
               "--input-data", str(data), "--report", str(report))
    assert run.returncode == 0, run.stderr
    assert all(s["errors"] == 0 and s["requests"] > 0 for p in json.loads(report.read_text())["points"] for s in p["samples"])
