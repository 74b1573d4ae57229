"""ferry started the way Vertex AI starts a custom container (AIP_* variables), walking the
checklist of ../shared/spec/vertex-ai.md §14."""
import json
import os
import time

import numpy as np
import pytest
import tritonclient.http as httpclient

import models
from conftest import EXAMPLES, copy_example
from ferry_server import Server
from platforms import binary_simple, connect_quickly, kserve_simple, request, slow_model

HEALTH = "/v1/endpoints/123/deployedModels/456"
PREDICT = "/v1/endpoints/123/deployedModels/456:predict"
BINARY = "application/vnd.vertex-ai-triton.binary+json"


def vertex_env(**extra):
    env = {"AIP_MODE": "PREDICTION", "AIP_HTTP_PORT": "0", "AIP_HEALTH_ROUTE": HEALTH, "AIP_PREDICT_ROUTE": PREDICT,
           "AIP_STORAGE_URI": ""}
    env.update(extra)
    return env


def vertex(args, env=None, **kw):
    return Server(args, env=vertex_env(**(env or {})), services=("Vertex AI",), **kw)


@pytest.fixture(scope="module")
def simple_only(tmp_path_factory):
    repo = str(tmp_path_factory.mktemp("vertex"))
    copy_example(repo, "simple")
    with vertex(["--model-repository", repo]) as s:
        yield s


def port(s):
    return s.ports["Vertex AI"]


def test_listens_on_the_platform_port_only(simple_only):
    assert "HTTP KServe v2 service" not in simple_only.log() and "gRPC KServe v2 service" not in simple_only.log()
    assert "mode=\"vertex\"" in simple_only.log()
    assert request(port(simple_only), "GET", HEALTH)[0] == 200


def test_methods_and_unknown_paths(simple_only):
    assert request(port(simple_only), "POST", HEALTH)[0] == 405
    assert request(port(simple_only), "GET", PREDICT)[0] == 405
    status, _, body = request(port(simple_only), "GET", "/nothing/here")
    assert status == 404 and json.loads(body) == {"error": "Not Found"}


def test_invoke_routes_reach_the_kserve_routes(simple_only):
    # Vertex forwards `…/invoke/{path}` as `/{path}` (invokeRoutePrefix "/*", dedicated endpoints).
    p = port(simple_only)
    assert request(p, "GET", "/v2/health/ready")[0] == 200
    status, _, body = request(p, "GET", "/v2/models/simple")
    assert status == 200 and json.loads(body)["name"] == "simple"
    status, _, body = request(p, "POST", "/v2/models/simple/infer", kserve_simple(list(range(16)), [1] * 16))
    assert status == 200 and json.loads(body)["outputs"][0]["data"] == [i + 1 for i in range(16)]
    assert request(p, "GET", "/v2/models/simple/infer")[0] == 405
    assert request(p, "GET", "/v2/models/nope/ready")[0] == 404
    # What changes the server stays closed, as through the redirect header.
    for path in ["/v2/repository/models/simple/unload", "/v2/systemsharedmemory/region/r/register"]:
        status, _, body = request(p, "POST", path, b"{}")
        assert status == 403 and b"invoke routes" in body, (path, body)
    assert request(p, "GET", HEALTH)[0] == 200


def test_kserve_json_on_the_predict_route(simple_only):
    a, b = list(range(16)), [1] * 16
    status, headers, body = request(port(simple_only), "POST", PREDICT, kserve_simple(a, b))
    assert status == 200 and headers["Content-Type"] == "application/json"
    doc = json.loads(body)
    assert (doc["model_name"], doc["model_version"]) == ("simple", "1")
    out = {o["name"]: o for o in doc["outputs"]}
    assert out["OUTPUT0"]["shape"] == [1, 16] and out["OUTPUT0"]["data"] == [x + 1 for x in a]


def test_vertex_instances(simple_only):
    instances = [{"INPUT0": list(range(16)), "INPUT1": [2] * 16}, {"INPUT0": [5] * 16, "INPUT1": [1] * 16}]
    status, _, body = request(port(simple_only), "POST", PREDICT, {"instances": instances, "parameters": {}})
    assert status == 200, body
    predictions = json.loads(body)["predictions"]
    assert len(predictions) == 2
    assert predictions[0]["OUTPUT0"] == [x + 2 for x in range(16)] and predictions[0]["OUTPUT1"] == [x - 2 for x in range(16)]
    assert predictions[1]["OUTPUT0"] == [6] * 16
    status, _, body = request(port(simple_only), "POST", PREDICT, {"instances": [{"INPUT0": [1] * 16}]})
    assert status == 400 and "instance 0 has no value for input 'INPUT1'" in json.loads(body)["error"]


def test_binary_content_type(simple_only):
    a, b = list(range(16)), [3] * 16
    body, n = binary_simple(a, b)
    status, headers, data = request(port(simple_only), "POST", PREDICT, body, {"Content-Type": f"{BINARY};json-header-size={n}"})
    assert status == 200, data
    length = int(headers["Inference-Header-Content-Length"])
    result = httpclient.InferenceServerClient.parse_response_body(data, header_length=length)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0").flatten(), np.array(a) + 3)
    for bad in [f"x{BINARY};json-header-size={n}", f"{BINARY};json-header-size=abc", f"{BINARY};json-header-size=-1",
                f"{BINARY};json-header-size={len(body) + 1}", f"{BINARY};json-header-size=99999999999"]:
        assert request(port(simple_only), "POST", PREDICT, body, {"Content-Type": bad})[0] == 400, bad
    assert request(port(simple_only), "GET", HEALTH)[0] == 200


def test_redirect_header(simple_only):
    p = port(simple_only)
    redirect = lambda target: {"X-Vertex-Ai-Triton-Redirect": target}
    status, _, body = request(p, "POST", PREDICT, kserve_simple([1] * 16, [1] * 16), redirect("v2/models/simple/infer"))
    assert status == 200 and json.loads(body)["model_name"] == "simple"
    assert request(p, "POST", PREDICT, b"", redirect("/v2/models/simple/ready"))[0] == 200
    assert request(p, "POST", PREDICT, b"", redirect("v2/models/nope/ready"))[0] == 404
    for target, needle in [("v2", b"extensions"), ("v2/models/simple", b"platform"), ("v2/models/simple/config", b"version_policy"),
                           ("v2/models/stats", b"model_stats"), ("v2/repository/index", b"state"),
                           ("metrics", b"nv_inference_request_success")]:
        status, _, body = request(p, "POST", PREDICT, b"", redirect(target))
        assert status == 200 and needle in body, (target, body[:200])
    for target in ["v2/repository/models/simple/load", "v2/repository/models/simple/unload",
                   "v2/systemsharedmemory/region/r/register"]:
        assert request(p, "POST", PREDICT, b"{}", redirect(target))[0] == 403, target
    assert request(p, "POST", PREDICT, b"", redirect("v2/trace/setting"))[0] == 400
    assert request(p, "GET", PREDICT, b"", redirect("v2"))[0] == 405


def test_oversize_is_413_naming_the_limit(simple_only):
    status, _, body = request(port(simple_only), "POST", PREDICT, b"{" + b" " * 1_600_000 + b"}")
    msg = json.loads(body)["error"]
    assert status == 413 and "1500000" in msg and "--http-max-input-size" in msg and "Vertex AI" in msg


def test_health_is_503_while_loading_then_200(fresh_repo):
    slow_model(fresh_repo)
    s = vertex(["--model-repository", fresh_repo], wait_ready=False)
    try:
        assert connect_quickly(port(s), within=5)
        # Not ready from the first answer; the detail names the model once its load has begun.
        deadline = time.time() + 60
        while True:
            status, _, body = request(port(s), "GET", HEALTH)
            assert status == 503, body
            doc = json.loads(body)
            assert doc["ready"] is False, doc
            if "slow" in doc["detail"] or time.time() > deadline:
                break
            time.sleep(0.05)
        assert "slow" in doc["detail"], doc
        s.wait_ready(120)
        assert request(port(s), "GET", HEALTH)[0] == 200
    finally:
        s.stop()


def test_several_models_need_a_default(fresh_repo):
    copy_example(fresh_repo, "simple")
    copy_example(fresh_repo, "simple_string")
    with vertex(["--model-repository", fresh_repo]) as s:
        status, _, body = request(port(s), "POST", PREDICT, kserve_simple([1] * 16, [1] * 16))
        msg = json.loads(body)["error"]
        assert status == 400 and "simple, simple_string" in msg and "--vertex-ai-default-model" in msg
        assert request(port(s), "GET", HEALTH)[0] == 200, "all models ready"
    with vertex(["--model-repository", fresh_repo, "--vertex-ai-default-model=simple"]) as s:
        assert request(port(s), "POST", PREDICT, kserve_simple([1] * 16, [1] * 16))[0] == 200


def test_storage_uri_is_the_repository_unless_one_is_given(fresh_repo):
    copy_example(fresh_repo, "simple_string")
    with vertex([], env={"AIP_STORAGE_URI": fresh_repo}) as s:
        body = {"instances": [{"INPUT0": ["1"] * 16, "INPUT1": ["2"] * 16}]}
        status, _, data = request(port(s), "POST", PREDICT, body)
        assert status == 200 and json.loads(data)["predictions"][0]["OUTPUT0"] == ["3"] * 16
    with vertex(["--model-repository", EXAMPLES, "--vertex-ai-default-model=simple"], env={"AIP_STORAGE_URI": fresh_repo}) as s:
        assert request(port(s), "POST", PREDICT, kserve_simple([1] * 16, [1] * 16))[0] == 200


def test_raw_binary_with_zero_header_size(fresh_repo):
    models.identity(fresh_repo, "ident", "FP32")
    with vertex(["--model-repository", fresh_repo]) as s:
        x = np.arange(5, dtype=np.float32)
        status, headers, data = request(port(s), "POST", PREDICT, x.tobytes(), {"Content-Type": f"{BINARY};json-header-size=0"})
        assert status == 200, data
        n = int(headers["Inference-Header-Content-Length"])
        np.testing.assert_array_equal(np.frombuffer(data[n:], dtype=np.float32), x)


def test_grpc_can_be_turned_back_on_and_sigterm_drains(fresh_repo):
    copy_example(fresh_repo, "simple")
    s = Server(["--model-repository", fresh_repo, "--allow-grpc"], env=vertex_env(), services=("Vertex AI", "gRPC KServe v2"))
    assert s.grpc_client().is_model_ready("simple")
    s.stop()
    assert s.proc.returncode == 0


def test_without_aip_mode_there_is_no_vertex_listener():
    with Server(["--model-repository", EXAMPLES], env={"AIP_HEALTH_ROUTE": HEALTH, "AIP_PREDICT_ROUTE": PREDICT}) as s:
        assert "Vertex AI service" not in s.log()


def test_grpc_through_vertex_and_a_streamed_predict(fresh_repo):
    """Vertex forwards gRPC to the model's grpcPorts (FERRY_VERTEX_AI_GRPC_PORT / AIP_GRPC_PORT), and
    streamRawPredict of a decoupled model gets server-sent events on the predict route."""
    import tritonclient.grpc as grpcclient
    from test_decoupled import CONFIG, REPEAT

    models.python_model(fresh_repo, "repeat", REPEAT, CONFIG)
    copy_example(fresh_repo, "simple")
    args = ["--model-repository", fresh_repo, "--vertex-ai-default-model=repeat"]
    s = Server(args, env=vertex_env(AIP_GRPC_PORT="0"), services=("Vertex AI", "gRPC KServe v2"))
    try:
        client = grpcclient.InferenceServerClient(s.grpc_url)
        a = np.ones((1, 16), dtype=np.int32)
        ins = [grpcclient.InferInput(n, [1, 16], "INT32").set_data_from_numpy(a) for n in ("INPUT0", "INPUT1")]
        r = client.infer("simple", ins, headers={"x-vertex-ai-endpoint-id": "123"})
        assert r.as_numpy("OUTPUT0")[0, 0] == 2
        import http.client
        conn = http.client.HTTPConnection("127.0.0.1", port(s), timeout=30)
        conn.request("POST", PREDICT, body=json.dumps({"COUNT": 3, "DELAY": 0.0, "FAIL": 0}))
        resp = conn.getresponse()
        assert resp.status == 200 and resp.getheader("Content-Type") == "text/event-stream; charset=utf-8"
        events = [json.loads(l[6:]) for l in resp.read().decode().splitlines() if l.startswith("data: ")]
        assert [e["OUT"] for e in events] == [0, 1, 2]
    finally:
        s.stop()
