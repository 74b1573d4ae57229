"""perf_analyzer (the C++ client Triton ships) runs clean against ferry over HTTP and gRPC, in
sync, async, streaming and shared-memory modes, and reads server-side times from our statistics.
Speed is not asserted here (bench/ measures it)."""
import json
import os
import subprocess

import pytest

from conftest import EXAMPLES
from ferry_server import Server

PERF_ANALYZER = os.environ.get("PERF_ANALYZER")


@pytest.fixture(scope="module")
def pa_server():
    if not PERF_ANALYZER:
        pytest.fail("PERF_ANALYZER is not set: run the suite through scripts/test.sh, which fetches perf_analyzer")
    with Server(["--model-repository", EXAMPLES, "--allow-client-shm"]) as s:
        yield s


@pytest.mark.parametrize(
    "protocol,mode",
    [("http", []), ("grpc", []), ("grpc", ["--async"]), ("grpc", ["--streaming"]), ("http", ["--async"]),
     ("http", ["--shared-memory=system"]), ("grpc", ["--shared-memory=system"])],
    ids=["http", "grpc", "grpc-async", "grpc-streaming", "http-async", "http-shm", "grpc-shm"],
)
def test_perf_analyzer_runs_clean(pa_server, protocol, mode):
    url = pa_server.url if protocol == "http" else pa_server.grpc_url
    cmd = [PERF_ANALYZER, "-m", "simple", "-u", url, "-i", protocol, "--concurrency-range=2:2",
           "--measurement-interval=400", "--max-trials=4", "--stability-percentage=100", *mode]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    out = run.stdout + run.stderr
    assert run.returncode == 0, out
    assert "throughput:" in out and "infer/sec" in out, out
    # The server-side breakdown perf_analyzer prints comes from ferry's statistics extension.
    assert "Server:" in out and "queue" in out and "compute infer" in out, out
    assert "error" not in out.lower(), out


def test_perf_analyzer_string_model(pa_server, tmp_path):
    # simple_string adds numbers written as strings: the input data must hold numbers.
    data = tmp_path / "input.json"
    data.write_text(json.dumps({"data": [{"INPUT0": [str(i) for i in range(16)], "INPUT1": ["1"] * 16}]}))
    cmd = [PERF_ANALYZER, "-m", "simple_string", "-u", pa_server.grpc_url, "-i", "grpc", "--concurrency-range=1:1",
           "--measurement-interval=400", "--max-trials=4", "--stability-percentage=100", f"--input-data={data}"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
