"""`ferry tune`: on a small model it finishes within its budget, reports every point it measured,
writes a complete config.pbtxt that loads and serves as it is (with auto-complete off), and its
throughput is the same order as perf_analyzer measures against that config. Its HTML report
renders its charts in a real browser with the JSON report's numbers; two models are tuned
together into two configs that serve; constraints nothing meets are named. No speed is asserted."""
import json
import math
import os
import re
import shutil
import subprocess

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

import models
from browser import chromium, full_page_screenshot
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
               "--output", str(out), "--report", str(report), "--target-rps", "5000", "--latency-budget-ms", "500")
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
    assert "In-process ceiling" in text and "Best within p99 <= 500 ms:" in text
    assert re.search(r"Sizing: \d+ replicas? of this \d+-core machine for 5000 requests/s at p99 <= [\d.]+ ms", text), text
    # The autoscaling targets come from the point measured: the load it held, 80% of its rate.
    sizing = report["sizing"]
    assert sizing["replicas"] == math.ceil(5000 / best["sample"]["throughput"])
    assert sizing["measured_load"] == best["sample"]["load"] and sizing["inference_load_target"] > 0
    assert f"autoscaling.inferenceLoad.averageValue={sizing['inference_load_target']}" in text
    assert f"target_inference_load = {sizing['inference_load_target']}" in text
    rpm = int(best["sample"]["throughput"] * 60 * 0.8)
    assert sizing["requests_per_minute_target"] == rpm and f"request-counts-per-minute={rpm}" in text
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
    for args, named in [
        (["--model", "other", "--mix", "mlp=70"], "give 'other' a weight"),
        (["--mix", "nope=1"], "'nope' is not one of the --model names"),
        (["--mix", "mlp=-1"], "above 0"),
        (["--latency-percentile", "p90"], "p99 or p95"),
        (["--objective", "cost"], "throughput or latency"),
        (["--max-memory-mib", "0"], "--max-memory-mib"),
        (["--model", "mlp"], "give each model once"),
        (["--budget-secs", "18446744073709551615"], "--budget-secs must be from 1 to 86400"),
        (["--concurrency", "100000"], "from 1 to 1024"),
        (["--latency-budget-ms", "1e308"], "at most"),
        (["--report", str(tmp_path / "same"), "--report-html", str(tmp_path / "same")], "must be different files"),
        (["--report-html", str(tmp_path)], "is a folder"),
    ]:
        run = tune("--model-repository", repo, "--model", "mlp", *args)
        assert run.returncode != 0 and named in run.stderr, (args, run.stderr)


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


def test_html_report_renders_its_charts_with_the_json_numbers(tuned, tmp_path):
    _, out, report, run = tuned
    page = out.with_suffix(".report.html")
    assert page.is_file() and f"Report written to {page}" in run.stdout
    html = page.read_text()
    assert "http://" not in html.replace("http://www.w3.org", "") and "https://" not in html, "self-contained"
    assert "<script" not in html
    points = report["points"]
    clean = [(i, s) for i, p in enumerate(points) for s in p["samples"] if s["errors"] == 0 and s["requests"] > 0]
    with chromium() as d:
        d.get(page.as_uri())
        charts = d.find_elements("css selector", "svg.chart")
        ids = {c.get_attribute("id") for c in charts}
        assert {"chart-pareto", "chart-throughput", "chart-latency", "chart-batch", "chart-memory",
                "chart-ceiling"} <= ids, ids
        for c in charts:
            assert c.size["width"] > 200 and c.size["height"] > 100, (c.get_attribute("id"), c.size)
        # Every clean sample is a mark on the throughput-latency chart, with the JSON's numbers.
        dots = d.find_elements("css selector", "#chart-pareto circle.dot:not(.chosen)")
        assert len(dots) == len(clean)
        marks = sorted((int(e.get_attribute("data-point")), int(e.get_attribute("data-concurrency")),
                        float(e.get_attribute("data-throughput")), float(e.get_attribute("data-latency"))) for e in dots)
        assert marks == sorted((i, s["concurrency"], s["throughput"], s["p99_ms"]) for i, s in clean)
        assert d.find_elements("css selector", "#chart-pareto polyline.pareto")
        budget = d.find_elements("css selector", "#chart-pareto line.rule.budget")
        assert len(budget) == 1 and float(budget[0].get_attribute("data-value")) == 500
        chosen = d.find_element("css selector", "#chart-pareto circle.dot.chosen")
        assert int(chosen.get_attribute("data-point")) == report["best"]["index"]
        assert float(chosen.get_attribute("data-throughput")) == report["best"]["sample"]["throughput"]
        assert len(d.find_elements("css selector", "#chart-batch rect.bar")) == len(points)
        assert len(d.find_elements("css selector", "#chart-ceiling circle.dot")) == len(report["ceiling"])
        # The table holds every number of every sample, as the JSON has it.
        rows = d.find_elements("css selector", "#numbers tbody tr[data-model='all']")
        table = sorted((int(r.get_attribute("data-point")), int(r.get_attribute("data-concurrency")),
                        float(r.get_attribute("data-throughput")), float(r.get_attribute("data-p50")),
                        float(r.get_attribute("data-p95")), float(r.get_attribute("data-p99")),
                        float(r.get_attribute("data-batch")), int(r.get_attribute("data-bytes")),
                        int(r.get_attribute("data-errors"))) for r in rows)
        assert table == sorted((i, s["concurrency"], s["throughput"], s["p50_ms"], s["p95_ms"], s["p99_ms"],
                                s["avg_batch"], p["memory_bytes"], s["errors"])
                               for i, p in enumerate(points) for s in p["samples"])
        rec = d.find_element("css selector", "#recommended")
        assert int(rec.get_attribute("data-point")) == report["best"]["index"]
        assert report["best"]["reasons"][0] in rec.text
        assert "autoscaling.inferenceLoad.averageValue" in d.find_element("css selector", "#sizing").text
        assert d.find_element("css selector", "#machine").text.count("\n") >= 4
        # No script error, no failed resource.
        severe = [e for e in d.get_log("browser") if e["level"] == "SEVERE"]
        assert not severe, severe
        # It prints: Chromium's own print to PDF lays it out into pages.
        import base64
        pdf = base64.b64decode(d.print_page())
        assert pdf.startswith(b"%PDF") and len(re.findall(rb"/Type\s*/Page(?!s)", pdf)) >= 2, len(pdf)
        shot = os.environ.get("FERRY_TUNE_SCREENSHOT") or str(tmp_path / "report.png")
        full_page_screenshot(d, shot)
        assert os.path.getsize(shot) > 20_000
    # On a phone the charts still fit the page: nothing scrolls sideways but the table.
    with chromium(phone=True) as d:
        d.get(page.as_uri())
        width = d.execute_script("return document.documentElement.scrollWidth")
        assert width <= d.execute_script("return window.innerWidth") + 1, width
        assert d.find_element("css selector", "#chart-pareto").size["width"] <= 390
        full_page_screenshot(d, tmp_path / "phone.png")


def test_two_models_tuned_together_write_two_configs_that_serve(tmp_path):
    repo = tmp_path / "repo"
    mlp(str(repo), "big", width=192, layers=3)
    mlp(str(repo), "small", width=32, layers=2)
    out, report = tmp_path / "configs", tmp_path / "r.json"
    run = tune("--model-repository", str(repo), "--model", "big", "--model", "small", "--mix", "big=3,small=1",
               "--budget-secs", "16", "--concurrency", "2,8", "--output", str(out), "--report", str(report))
    assert run.returncode == 0, run.stdout + run.stderr
    r = json.loads(report.read_text())
    assert [m["model"] for m in r["models"]] == ["big", "small"] and r["models"][0]["weight"] == 3
    assert (out / "tune-report.html").is_file()
    assert len(r["points"]) >= 4 and r["points"][0]["baseline"]
    sent = {"big": 0, "small": 0}
    for p in r["points"]:
        assert [m["model"] for m in p["models"]] == ["big", "small"]
        assert p["memory_bytes"] == sum(m["model_bytes"] for m in p["models"])
        for j, s in enumerate(p["samples"]):
            each = [m["samples"][j] for m in p["models"]]
            # The combined sample is the sum of the models' requests, and no model is faster
            # than the slowest request of all.
            assert s["requests"] == sum(e["requests"] for e in each) and s["errors"] == 0
            assert s["p99_ms"] <= max(e["p99_ms"] for e in each) + 1e-9
            for m, e in zip(p["models"], each):
                sent[m["model"]] += e["requests"]
    share = sent["big"] / (sent["big"] + sent["small"])
    assert 0.6 < share < 0.9, sent
    # Both points vary between points: each model had its own search.
    assert len({json.dumps(p["models"][0]["point"]) for p in r["points"]}) > 1
    assert len({json.dumps(p["models"][1]["point"]) for p in r["points"]}) > 1
    best = r["best"]["models"]
    assert "Each model: big" in run.stdout
    serve_repo = tmp_path / "serve"
    for name, b in zip(["big", "small"], best):
        written = out / name / "config.pbtxt"
        assert written.read_text() == b["config"]
        shutil.copytree(repo / name, serve_repo / name)
        shutil.copy(written, serve_repo / name / "config.pbtxt")
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient
    import onnxruntime as ort
    with Server(["--model-repository", str(serve_repo), "--disable-auto-complete-config"]) as s:
        for name, b in zip(["big", "small"], best):
            config = s.client().get_model_config(name)
            assert sum(g["count"] for g in config["instance_group"]) == b["point"]["instances"]
            # The batch the recommended config accepts (tune may choose max_batch_size 1).
            rows = max(1, min(3, config.get("max_batch_size", 0)))
            x = np.random.default_rng(1).standard_normal((rows, 64)).astype(np.float32)
            sess = ort.InferenceSession(str(repo / name / "1" / "model.onnx"), providers=["CPUExecutionProvider"])
            want = sess.run(None, {"X": x})[0]
            h = httpclient.InferInput("X", [rows, 64], "FP32")
            h.set_data_from_numpy(x)
            np.testing.assert_allclose(s.client().infer(name, [h]).as_numpy("Y"), want, rtol=1e-5)
            g = grpcclient.InferInput("X", [rows, 64], "FP32")
            g.set_data_from_numpy(x)
            np.testing.assert_allclose(s.grpc_client().infer(name, [g]).as_numpy("Y"), want, rtol=1e-5)


def test_infeasible_constraints_name_themselves_and_the_closest_point(tmp_path):
    repo = str(tmp_path / "repo")
    mlp(repo)
    report, page = tmp_path / "r.json", tmp_path / "r.html"
    run = tune("--model-repository", repo, "--model", "mlp", "--budget-secs", "5", "--concurrency", "1",
               "--latency-budget-ms", "0.001", "--latency-percentile", "p95", "--min-throughput", "100000000",
               "--report", str(report), "--report-html", str(page))
    assert run.returncode != 0
    err = run.stderr
    assert "no config met p95 <= 0.001 ms, >= 100000000 requests/s" in err, err
    assert "--latency-budget-ms 0.001: no config kept p95 within 0.001 ms (the lowest measured:" in err, err
    assert "--min-throughput 100000000: no config reached" in err and "the closest:" in err, err
    r = json.loads(report.read_text())
    assert r["best"] is None and len(r["infeasible"]["unmet"]) == 2 and r["infeasible"]["closest"] is not None
    assert r["constraints"]["percentile"] == "p95"
    lowest = min(s["p95_ms"] for p in r["points"] for s in p["samples"])
    assert f"(the lowest measured: {lowest:.3f} ms)" in err
    assert "No config met the constraints." in page.read_text()
    # A generous budget in memory but none in latency: only the latency is named.
    run = tune("--model-repository", repo, "--model", "mlp", "--budget-secs", "4", "--concurrency", "1",
               "--latency-budget-ms", "0.001", "--max-memory-mib", "100000")
    assert run.returncode != 0 and "--latency-budget-ms 0.001" in run.stderr and "--max-memory-mib" not in run.stderr
