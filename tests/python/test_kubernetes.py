"""The Helm chart (deploy/helm/ferry) and the KServe runtime (deploy/kserve): rendered and linted by
Helm's own library (helm-python-sdk), every object validated against Kubernetes' schemas
(kubernetes-validate, offline), the wiring checked, and the containers' command lines run through
the real binary (they parse, and the probes' paths answer on the probes' ports)."""
import os
import shutil
import subprocess
import time
import urllib.error
import urllib.request

import helm_python as helm
import kubernetes_validate
import yaml

from buckets import free_port
from ferry_server import BINARY, ROOT, Server


CHART = os.path.join(ROOT, "deploy", "helm", "ferry")
KSERVE = os.path.join(ROOT, "deploy", "kserve")
KUBE_VERSION = "1.30.0"
# Kinds from CRDs (Prometheus Operator, KServe): checked by hand below, not by Kubernetes' schemas.
CUSTOM = {"ServiceMonitor", "ClusterServingRuntime", "ServingRuntime", "InferenceService"}

EVERYTHING = {
    "modelRepository": "gs://my-models/triton",
    "gpu": {"count": 2, "nodeSelector": {"cloud.google.com/gke-accelerator": "nvidia-l4"}},
    "autoscaling": {"enabled": True},
    "serviceMonitor": {"enabled": True, "labels": {"release": "kube-prometheus-stack"}},
    "serviceAccount": {"annotations": {"iam.gke.io/gcp-service-account": "ferry@p.iam.gserviceaccount.com"}},
}


def render(values=None):
    """The chart's objects by kind, validated against Kubernetes' schemas."""
    chart = helm.Chart.load(CHART)
    out = chart.render(values or {}, name="ferry", namespace="ml", is_install=True)
    objects = {}
    for path, text in out.items():
        if not path.endswith(".yaml"):
            continue
        for doc in yaml.safe_load_all(text):
            if not doc:
                continue
            if doc["kind"] not in CUSTOM:
                kubernetes_validate.validate(doc, KUBE_VERSION, strict=True)
            assert doc["kind"] not in objects, f"two {doc['kind']} objects"
            objects[doc["kind"]] = doc
    return objects


def container(objects):
    (c,) = objects["Deployment"]["spec"]["template"]["spec"]["containers"]
    return c


def flag(args, name):
    values = [a.split("=", 1)[1] for a in args if a.startswith(f"--{name}=")]
    assert len(values) == 1, f"--{name} given {len(values)} times in {args}"
    return values[0]


def test_lint_is_clean():
    for values in ({}, EVERYTHING):
        report = helm.lint(CHART, values, strict=True, kube_version=f"v{KUBE_VERSION}")
        assert report["errors"] == [], report
        assert [m for m in report["messages"] if m["severity"] >= 2] == [], report


def test_defaults_render_valid_objects_without_gpu_or_crds():
    objects = render()
    assert set(objects) == {"Deployment", "Service", "ServiceAccount", "PodDisruptionBudget", "Secret"}
    c = container(objects)
    assert not any("nvidia.com/gpu" in (c["resources"].get(k) or {}) for k in ("limits", "requests"))
    spec = objects["Deployment"]["spec"]["template"]["spec"]
    assert "tolerations" not in spec and "nodeSelector" not in spec
    assert objects["Deployment"]["spec"]["replicas"] == 2
    # No repository named: the embedded examples, so `helm install` alone serves something.
    assert not any(a.startswith("--model-repository") for a in c["args"])


def test_probes_ports_and_service():
    objects = render(EVERYTHING)
    c = container(objects)
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {"http": 8000, "grpc": 8001, "metrics": 8002}
    # What the server is told to listen on is what the ports and probes name.
    assert int(flag(c["args"], "http-port")) == ports["http"]
    assert int(flag(c["args"], "grpc-port")) == ports["grpc"]
    assert int(flag(c["args"], "metrics-port")) == ports["metrics"]
    assert flag(c["args"], "model-repository") == "gs://my-models/triton"
    for probe, path in (("startupProbe", "/v2/health/ready"), ("readinessProbe", "/v2/health/ready"),
                        ("livenessProbe", "/v2/health/live")):
        assert c[probe]["httpGet"] == {"path": path, "port": "http"}, probe
    startup = c["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 1800, "large downloads need time"
    service = objects["Service"]
    assert service["spec"]["selector"].items() <= objects["Deployment"]["spec"]["template"]["metadata"]["labels"].items()
    sports = {p["name"]: p for p in service["spec"]["ports"]}
    assert sports["grpc"]["appProtocol"] == "grpc"
    assert {n: p["targetPort"] for n, p in sports.items()} == {"http": "http", "grpc": "grpc", "metrics": "metrics"}


def test_gpu_requests_and_placement():
    objects = render(EVERYTHING)
    c = container(objects)
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 2
    assert c["resources"]["limits"]["memory"] == "8Gi", "the other limits stay"
    spec = objects["Deployment"]["spec"]["template"]["spec"]
    assert spec["nodeSelector"] == {"cloud.google.com/gke-accelerator": "nvidia-l4"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"]


def test_grace_period_covers_the_drain():
    for shutdown in ({}, {"exitTimeoutSecs": 120, "preStopSleepSeconds": 20}):
        objects = render({"shutdown": shutdown})
        c = container(objects)
        exit_timeout = int(flag(c["args"], "exit-timeout-secs"))
        assert exit_timeout == shutdown.get("exitTimeoutSecs", 30)
        sleep = c["lifecycle"]["preStop"]["sleep"]["seconds"]
        grace = objects["Deployment"]["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
        assert grace >= sleep + exit_timeout, (grace, sleep, exit_timeout)


def test_service_account_for_bucket_credentials():
    objects = render(EVERYTHING)
    sa = objects["ServiceAccount"]
    assert sa["metadata"]["annotations"] == {"iam.gke.io/gcp-service-account": "ferry@p.iam.gserviceaccount.com"}
    assert objects["Deployment"]["spec"]["template"]["spec"]["serviceAccountName"] == sa["metadata"]["name"]


def test_service_monitor_scrapes_the_metrics_port():
    objects = render(EVERYTHING)
    sm = objects["ServiceMonitor"]
    assert sm["apiVersion"] == "monitoring.coreos.com/v1"
    assert sm["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert sm["spec"]["selector"]["matchLabels"].items() <= objects["Service"]["metadata"]["labels"].items()
    (endpoint,) = sm["spec"]["endpoints"]
    assert endpoint["port"] == "metrics" and endpoint["path"] == "/metrics"
    assert "metrics" in {p["name"] for p in objects["Service"]["spec"]["ports"]}


def test_hpa_scales_on_the_metric_ferry_exports():
    objects = render(EVERYTHING)
    hpa = objects["HorizontalPodAutoscaler"]
    assert "replicas" not in objects["Deployment"]["spec"], "the HPA owns the replica count"
    assert hpa["spec"]["scaleTargetRef"]["name"] == objects["Deployment"]["metadata"]["name"]
    pods = [m for m in hpa["spec"]["metrics"] if m["type"] == "Pods"]
    cpu = [m for m in hpa["spec"]["metrics"] if m["type"] == "Resource"]
    assert len(pods) == 1 and cpu[0]["resource"]["name"] == "cpu"
    name = pods[0]["pods"]["metric"]["name"]
    # The adapter rule in the chart's values and in the file for prometheus-adapter's chart agree
    # and name the same metric.
    values = yaml.safe_load(open(os.path.join(CHART, "values.yaml")))
    adapter = yaml.safe_load(open(os.path.join(ROOT, "deploy", "helm", "prometheus-adapter-values.yaml")))
    assert adapter["rules"]["custom"] == [values["autoscaling"]["adapterRule"]]
    rule = values["autoscaling"]["adapterRule"]
    assert rule["name"]["as"] == name
    assert rule["seriesQuery"].startswith(name + "{")
    # ...and it is the family the real server exports.
    with Server() as s:
        assert f"# TYPE {name} gauge" in s.metrics()
    # CPU alone when the queue metric is off.
    only_cpu = render({"autoscaling": {"enabled": True, "inferenceLoad": {"enabled": False}}})
    assert [m["type"] for m in only_cpu["HorizontalPodAutoscaler"]["spec"]["metrics"]] == ["Resource"]


def wait_http(port, path, proc, timeout=60):
    deadline = time.time() + timeout
    while time.time() < deadline:
        assert proc.poll() is None, "ferry exited"
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=2) as r:
                return r.status
        except (urllib.error.URLError, ConnectionError):
            time.sleep(0.1)
    raise AssertionError(f"{path} did not answer 200 on {port} within {timeout}s")


def expand(args, env):
    """`$(NAME)` in a container's arguments, as the kubelet expands them from its environment."""
    import re
    return [re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), a) for a in args]


def run_args(args, tmp_path, replace, env=None):
    """Runs the binary with a manifest's arguments (ports and folders swapped for free ones here)."""
    free = {name: free_port() for name in ("http-port", "grpc-port", "metrics-port")}
    out = []
    for a in expand(args, env or {}):
        key = a[2:].split("=", 1)[0] if a.startswith("--") else None
        if key in free:
            a = f"--{key}={free[key]}"
        elif key in replace:
            a = f"--{key}={replace[key]}"
        out.append(a)
    log = open(tmp_path / "ferry.log", "w")
    proc = subprocess.Popen([BINARY, *out], stdout=log, stderr=subprocess.STDOUT)
    return proc, free


def test_defaults_close_admin_apis_mount_shared_memory_and_no_token():
    objects = render()
    pod = objects["Deployment"]["spec"]["template"]["spec"]
    assert pod["automountServiceAccountToken"] is False
    assert objects["ServiceAccount"]["automountServiceAccountToken"] is False
    c = container(objects)
    (key,) = [e for e in c["env"] if e["name"] == "FERRY_ADMIN_KEY"]
    secret = objects["Secret"]
    assert key["valueFrom"]["secretKeyRef"] == {"name": secret["metadata"]["name"], "key": "admin-key"}
    import base64
    assert len(base64.b64decode(secret["data"]["admin-key"])) == 40
    restricted = "model-repository,logging,trace:admin-key=$(FERRY_ADMIN_KEY)"
    assert flag(c["args"], "http-restricted-api") == restricted
    assert flag(c["args"], "grpc-restricted-protocol") == restricted
    (dshm,) = [v for v in pod["volumes"] if v["name"] == "dshm"]
    assert dshm["emptyDir"] == {"medium": "Memory", "sizeLimit": "1Gi"}
    assert {"name": "dshm", "mountPath": "/dev/shm"} in c["volumeMounts"]
    # An existing Secret instead, or the APIs left open on purpose.
    mine = render({"adminApi": {"existingSecret": "mine", "secretKey": "k"}})
    assert "Secret" not in mine
    (key,) = [e for e in container(mine)["env"] if e["name"] == "FERRY_ADMIN_KEY"]
    assert key["valueFrom"]["secretKeyRef"] == {"name": "mine", "key": "k"}
    open_ = render({"adminApi": {"restrict": False}})
    assert "Secret" not in open_ and not any("restricted" in a for a in container(open_)["args"])


def test_chart_command_line_runs_and_probes_answer(tmp_path):
    repo = tmp_path / "repo"
    shutil.copytree(os.path.join(ROOT, "examples", "simple"), repo / "simple")
    c = container(render({"modelRepository": "/models", "modelControlMode": "poll"}))
    env = {"FERRY_ADMIN_KEY": "k3y"}
    proc, ports = run_args(c["args"], tmp_path, {"model-repository": repo, "model-cache-dir": tmp_path / "cache"}, env)
    try:
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert wait_http(ports["http-port"], c[probe]["httpGet"]["path"], proc) == 200
        with urllib.request.urlopen(f"http://127.0.0.1:{ports['metrics-port']}/metrics", timeout=5) as r:
            assert b"ferry_inference_load" in r.read()
        # The repository API needs the admin key; inference does not.
        index = urllib.request.Request(f"http://127.0.0.1:{ports['http-port']}/v2/repository/index", data=b"{}")
        try:
            urllib.request.urlopen(index, timeout=5)
            raise AssertionError("the repository index answered without the admin key")
        except urllib.error.HTTPError as e:
            assert e.code == 403
        index.add_header("admin-key", "k3y")
        with urllib.request.urlopen(index, timeout=5) as r:
            assert r.status == 200
    finally:
        proc.terminate()
        proc.wait(30)


def kserve(name):
    with open(os.path.join(KSERVE, name)) as f:
        return yaml.safe_load(f)


def test_kserve_runtime_speaks_v2_on_its_ports(tmp_path):
    runtime = kserve("servingruntime.yaml")
    assert runtime["apiVersion"] == "serving.kserve.io/v1alpha1"
    assert runtime["kind"] == "ClusterServingRuntime"
    spec = runtime["spec"]
    assert set(spec["protocolVersions"]) == {"v2", "grpc-v2"}
    assert {f["name"] for f in spec["supportedModelFormats"]} == {"triton", "onnx"}
    (c,) = spec["containers"]
    assert c["name"] == "kserve-container"
    assert flag(c["args"], "model-repository") == "/mnt/models", "where KServe's storage initializer puts models"
    http, grpc = int(flag(c["args"], "http-port")), int(flag(c["args"], "grpc-port"))
    assert [p["containerPort"] for p in c["ports"]] == [http] == [8080]
    assert spec["annotations"]["prometheus.kserve.io/port"] == flag(c["args"], "metrics-port")
    for isvc_file, protocol in (("inferenceservice.yaml", "v2"), ("inferenceservice-grpc.yaml", "grpc-v2")):
        isvc = kserve(isvc_file)
        assert isvc["apiVersion"] == "serving.kserve.io/v1beta1" and isvc["kind"] == "InferenceService"
        model = isvc["spec"]["predictor"]["model"]
        assert model["runtime"] == runtime["metadata"]["name"]
        assert model["protocolVersion"] == protocol
        assert model["modelFormat"]["name"] in {f["name"] for f in spec["supportedModelFormats"]}
        if protocol == "grpc-v2":
            assert model["ports"] == [{"name": "h2c", "containerPort": grpc, "protocol": "TCP"}]
    # The runtime's command line, run: serves the repository KServe would have downloaded.
    repo = tmp_path / "mnt-models"
    shutil.copytree(os.path.join(ROOT, "examples", "simple"), repo / "simple")
    proc, ports = run_args(c["args"], tmp_path, {"model-repository": repo})
    try:
        assert wait_http(ports["http-port"], "/v2/health/ready", proc) == 200
        assert wait_http(ports["http-port"], "/v2/models/simple/ready", proc) == 200
    finally:
        proc.terminate()
        proc.wait(30)
