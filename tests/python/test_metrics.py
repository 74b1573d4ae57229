"""Prometheus metrics with Triton's names, types and labels, ferry's autoscaling gauges, and the
CloudWatch embedded-metric lines: scraped before and after traffic."""
import json
import os
import re
import urllib.error
import urllib.request

import numpy as np
import pytest
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

import models
from conftest import EXAMPLES, copy_example
from ferry_server import Server

SAMPLE = re.compile(r"^(\w+)(\{[^}]*\})? (\S+)$")


def parse(text):
    """{(name, frozenset(labels)): value} and {name: type}."""
    values, types = {}, {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split()
            types[name] = kind
        elif line and not line.startswith("#"):
            m = SAMPLE.match(line)
            assert m, f"not a Prometheus sample: {line!r}"
            labels = frozenset(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
            values[(m.group(1), labels)] = float(m.group(3))
    return values, types


def value(values, name, **labels):
    return values[(name, frozenset(labels.items()))]


def simple_inputs(value_a=1):
    a = np.full((1, 16), value_a, dtype=np.int32)
    return [httpclient.InferInput(n, [1, 16], "INT32").set_data_from_numpy(a) for n in ("INPUT0", "INPUT1")]


def string_inputs(text):
    a = np.array([[text] * 16], dtype=np.object_)
    return [httpclient.InferInput(n, [1, 16], "BYTES").set_data_from_numpy(a) for n in ("INPUT0", "INPUT1")]


# The families and types a dashboard or alert written for Triton reads.
TRITON_FAMILIES = {
    "nv_inference_request_success": "counter",
    "nv_inference_request_failure": "counter",
    "nv_inference_count": "counter",
    "nv_inference_exec_count": "counter",
    "nv_inference_pending_request_count": "gauge",
    "nv_inference_request_duration_us": "counter",
    "nv_inference_queue_duration_us": "counter",
    "nv_inference_compute_input_duration_us": "counter",
    "nv_inference_compute_infer_duration_us": "counter",
    "nv_inference_compute_output_duration_us": "counter",
    "nv_cpu_utilization": "gauge",
    "nv_cpu_memory_total_bytes": "gauge",
    "nv_cpu_memory_used_bytes": "gauge",
}


def test_counters_move_by_the_right_amounts(fresh_repo):
    copy_example(fresh_repo, "simple")
    copy_example(fresh_repo, "simple_string")
    with Server(["--model-repository", fresh_repo]) as s:
        client = s.client()
        before, types = parse(s.metrics())
        for name, kind in TRITON_FAMILIES.items():
            assert types.get(name) == kind, f"{name}: {types.get(name)}"
        assert value(before, "nv_inference_request_success", model="simple", version="1") == 0
        for reason in ("BACKEND", "CANCELED", "OTHER", "REJECTED"):
            assert value(before, "nv_inference_request_failure", model="simple", reason=reason, version="1") == 0
        for k in range(5):
            client.infer("simple", simple_inputs(k))
        a = np.ones((3, 16), dtype=np.int32)
        client.infer("simple", [httpclient.InferInput(n, [3, 16], "INT32").set_data_from_numpy(a) for n in ("INPUT0", "INPUT1")])
        with pytest.raises(InferenceServerException):
            client.infer("simple", simple_inputs()[:1])  # a missing input: OTHER
        with pytest.raises(InferenceServerException):
            client.infer("simple_string", string_inputs("not a number"))  # the model fails: BACKEND
        after, _ = parse(s.metrics())
        m = dict(model="simple", version="1")
        assert value(after, "nv_inference_request_success", **m) == 6
        assert value(after, "nv_inference_count", **m) == 8
        assert 1 <= value(after, "nv_inference_exec_count", **m) <= 6
        assert value(after, "nv_inference_request_failure", reason="OTHER", **m) == 1
        assert value(after, "nv_inference_request_failure", model="simple_string", version="1", reason="BACKEND") == 1
        assert value(after, "nv_inference_pending_request_count", **m) == 0
        assert value(after, "ferry_inference_load", **m) == 0
        for d in ("request", "queue", "compute_input", "compute_infer", "compute_output"):
            assert value(after, f"nv_inference_{d}_duration_us", **m) > value(before, f"nv_inference_{d}_duration_us", **m)
        # The statistics extension and the metrics agree.
        stats = client.get_inference_statistics("simple")["model_stats"][0]
        assert stats["inference_stats"]["success"]["count"] == 6 and stats["inference_count"] == 8
        assert stats["execution_count"] == value(after, "nv_inference_exec_count", **m)
        assert 0 <= value(after, "nv_cpu_utilization") <= 1 and value(after, "nv_cpu_memory_total_bytes") > 0
        assert not any(k[0].startswith("nv_gpu_") for k in after), "no GPU here: no GPU series"
        assert s.wait_log("no GPU metrics")


def test_queue_rejections_count_as_rejected(fresh_repo):
    config = ('name: "timed"\nmax_batch_size: 8\ndynamic_batching { preferred_batch_size: [ 8 ] '
              'max_queue_delay_microseconds: 4000000 default_queue_policy { default_timeout_microseconds: 100000 } }\n')
    models.add_mul(fresh_repo, "timed", config=config)
    with Server(["--model-repository", fresh_repo]) as s:
        a = np.ones((1, 4), dtype=np.float32)
        with pytest.raises(InferenceServerException, match="timeout"):
            s.client().infer("timed", [httpclient.InferInput(n, [1, 4], "FP32").set_data_from_numpy(a) for n in "ab"])
        values, _ = parse(s.metrics())
        assert value(values, "nv_inference_request_failure", model="timed", version="1", reason="REJECTED") == 1


def test_summaries_and_histograms_when_configured(fresh_repo):
    copy_example(fresh_repo, "simple")
    args = ["--model-repository", fresh_repo, "--metrics-config=summary_latencies=true",
            "--metrics-config=histogram_latencies=true", "--metrics-config=summary_quantiles=0.5:0.05,0.99:0.001"]
    with Server(args) as s:
        for k in range(4):
            s.client().infer("simple", simple_inputs(k))
        text = s.metrics()
        values, types = parse(text)
        m = dict(model="simple", version="1")
        assert types["nv_inference_request_summary_us"] == "summary"
        assert value(values, "nv_inference_request_summary_us_count", **m) == value(values, "nv_inference_request_success", **m)
        assert value(values, "nv_inference_queue_summary_us_sum", **m) == value(values, "nv_inference_queue_duration_us", **m)
        assert value(values, "nv_inference_compute_infer_summary_us", quantile="0.99", **m) > 0
        assert types["nv_inference_first_response_histogram_ms"] == "histogram"
        assert value(values, "nv_inference_first_response_histogram_ms_count", **m) == 4
        assert value(values, "nv_inference_first_response_histogram_ms_bucket", le="+Inf", **m) == 4


def test_metric_tags_become_labels_and_switches_work(fresh_repo):
    copy_example(fresh_repo, "simple")
    with open(f"{fresh_repo}/simple/config.pbtxt", "a") as f:
        f.write('metric_tags { key: "team" value: "search" }\n')
    with Server(["--model-repository", fresh_repo, "--allow-cpu-metrics=false"]) as s:
        values, _ = parse(s.metrics())
        assert value(values, "nv_inference_count", model="simple", version="1", _team="search") == 0
        assert not any(k[0].startswith("nv_cpu_") for k in values)
        base = f"http://127.0.0.1:{s.metrics_port}"
        with urllib.request.urlopen(f"{base}/elsewhere") as r:
            assert r.status == 200 and r.read() == b""
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(urllib.request.Request(f"{base}/metrics", data=b"", method="POST"))
        assert err.value.code == 405
    with Server(["--model-repository", EXAMPLES, "--allow-metrics=false"]) as s:
        assert s.metrics_port is None and "Prometheus metrics service" not in s.log()


def test_cloudwatch_embedded_metric_lines():
    with Server(["--model-repository", EXAMPLES, "--emf-interval-secs=1"]) as s:
        assert s.wait_log('"_aws"')
        line = next(l for l in s.log().splitlines() if l.startswith('{"_aws"'))
        doc = json.loads(line)
        assert doc["_aws"]["CloudWatchMetrics"][0]["Namespace"] == "ferry"
        served = {m for m in os.listdir(EXAMPLES) if os.path.isfile(os.path.join(EXAMPLES, m, "config.pbtxt"))}
        assert doc["model"] in served and doc["InferenceLoad"] == 0
