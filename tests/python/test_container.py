"""The real image, run the way each platform runs it: built from container/Dockerfile with the
base images of container/bases.sh (the engine here cannot pull), then SageMaker's way (`docker run
IMAGE serve`, port 8080, /opt/ml/model mounted read only, SIGTERM then a kill after 30 s) and
Vertex AI's (AIP_* variables, the model repository read from AIP_STORAGE_URI on the local GCS
server). The platform contract tests of test_sagemaker.py and test_vertex.py run against both.

Skipped where no Docker engine answers, unless FERRY_REQUIRE_DOCKER=1 (CI sets it)."""
import json
import os
import shutil
import subprocess
import sys
import time
import urllib.request
import uuid

import numpy as np
import pytest

from buckets import StorageServer, free_port
from conftest import copy_example
import models
from ferry_server import ROOT
from platforms import kserve_simple, request, snapshot
import test_vertex

# The contract tests, collected here again with this module's fixtures (the container).
from test_sagemaker import (  # noqa: F401
    test_binary_content_type_both_ways, test_instances_and_execution_parameters, test_oversize_names_sagemakers_limit,
    test_ping_and_invocations)
from test_vertex import (  # noqa: F401
    test_binary_content_type, test_kserve_json_on_the_predict_route, test_listens_on_the_platform_port_only,
    test_methods_and_unknown_paths, test_oversize_is_413_naming_the_limit, test_redirect_header, test_vertex_instances)


def docker_answers():
    try:
        return subprocess.run(["docker", "info"], capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


if not docker_answers():
    if os.environ.get("FERRY_REQUIRE_DOCKER") == "1":
        raise RuntimeError("FERRY_REQUIRE_DOCKER=1 but no Docker engine answers `docker info`")
    pytest.skip("no Docker engine", allow_module_level=True)

IMAGE = "ferry:pytest"


@pytest.fixture(scope="module")
def image():
    """The image, with the debug binary the suite already built (CI builds no release binary)."""
    subprocess.run(["bash", os.path.join(ROOT, "container", "build.sh"), "--from-host", "--debug", "--tag", IMAGE],
                   check=True, stdout=subprocess.DEVNULL)
    return IMAGE


class Container:
    """One `docker run -d`; quacks like ferry_server.Server for the platform tests."""

    def __init__(self, image, run_args, command=(), service="SageMaker", port=None, container_port=8080):
        self.name = f"ferry-test-{uuid.uuid4().hex[:8]}"
        started = time.monotonic()
        subprocess.run(["docker", "run", "-d", "--name", self.name, *run_args, image, *command], check=True,
                       stdout=subprocess.DEVNULL)
        if port is None:
            out = subprocess.run(["docker", "port", self.name, f"{container_port}/tcp"], capture_output=True, text=True,
                                 check=True).stdout
            port = int(out.split("\n")[0].rsplit(":", 1)[1])
        self.ports = {service: port}
        self.ready_after = None
        deadline = time.monotonic() + 120
        health = {"SageMaker": "/ping", "Vertex AI": test_vertex.HEALTH}.get(service, "/v2/health/ready")
        while time.monotonic() < deadline:
            try:
                if request(port, "GET", health, timeout=2)[0] == 200:
                    self.ready_after = time.monotonic() - started
                    break
            except OSError:
                pass
            if self.state()["Status"] == "exited":
                break
            time.sleep(0.05)
        assert self.ready_after is not None, f"container never became healthy:\n{self.log()}"

    def state(self):
        out = subprocess.run(["docker", "inspect", "-f", "{{json .State}}", self.name], capture_output=True, text=True)
        return json.loads(out.stdout) if out.returncode == 0 else {"Status": "gone"}

    def log(self):
        out = subprocess.run(["docker", "logs", self.name], capture_output=True, text=True)
        return out.stdout + out.stderr

    def stop(self, grace=30):
        """SageMaker's way: SIGTERM, then a kill after `grace` seconds. Returns (seconds, exit code)."""
        started = time.monotonic()
        subprocess.run(["docker", "stop", "-t", str(grace), self.name], capture_output=True)
        took = time.monotonic() - started
        code = self.state().get("ExitCode")
        subprocess.run(["docker", "rm", "-f", self.name], capture_output=True)
        return took, code


def opt_ml_model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("opt_ml_model")
    copy_example(str(folder), "simple")
    # The image runs as a non-root user: the mounted folder must be readable by others, as
    # SageMaker's extracted model is.
    subprocess.run(["chmod", "-R", "a+rX", str(folder)], check=True)
    return folder


@pytest.fixture(scope="module")
def single(image, tmp_path_factory):
    folder = opt_ml_model(tmp_path_factory)
    before = snapshot(folder)
    c = Container(image, ["-p", "127.0.0.1::8080", "-v", f"{folder}:/opt/ml/model:ro"], command=["serve"])
    print(f"SageMaker way: healthy {c.ready_after:.2f} s after docker run")
    yield c
    took, code = c.stop()
    assert code == 0 and took < 30, f"SIGTERM: exit {code} after {took:.1f} s"
    assert snapshot(folder) == before


@pytest.fixture(scope="module")
def simple_only(image, tmp_path_factory):
    """Vertex AI's way: the repository is AIP_STORAGE_URI on the GCS server; host networking so
    the container reaches it on loopback."""
    src = str(tmp_path_factory.mktemp("vertex_src"))
    copy_example(src, "simple")
    storage = StorageServer("gcs")
    bucket = storage.bucket("vertex-models")
    bucket.upload_dir(src, "deployed/model")
    port = free_port()
    env = {**test_vertex.vertex_env(AIP_HTTP_PORT=str(port), AIP_STORAGE_URI=bucket.url("deployed/model")),
           "STORAGE_EMULATOR_HOST": storage.endpoint, "FERRY_STORAGE_ANONYMOUS": "true"}
    run_args = ["--network", "host"]
    for k, v in env.items():
        run_args += ["-e", f"{k}={v}"]
    try:
        c = Container(image, run_args, service="Vertex AI", port=port)
        print(f"Vertex AI way: healthy {c.ready_after:.2f} s after docker run")
        yield c
        took, code = c.stop()
        assert code == 0, f"SIGTERM: exit {code} after {took:.1f} s"
    finally:
        storage.stop()


def test_the_image_runs_as_nonroot_and_serves_the_examples_by_default(image):
    user = subprocess.run(["docker", "image", "inspect", "-f", "{{.Config.User}}", image], capture_output=True,
                          text=True, check=True).stdout.strip()
    assert user == "65532:65532"
    exposed = subprocess.run(["docker", "image", "inspect", "-f", "{{json .Config.ExposedPorts}}", image],
                             capture_output=True, text=True, check=True).stdout
    assert set(json.loads(exposed)) == {"8080/tcp", "8000/tcp", "8001/tcp", "8002/tcp"}
    # Plain `docker run IMAGE`: KServe v2 on 8000 with the embedded examples.
    c = Container(image, ["-p", "127.0.0.1::8000"], service="kserve", container_port=8000)
    try:
        status, _, body = request(c.ports["kserve"], "POST", "/v2/models/simple/infer",
                                  kserve_simple([1] * 16, [1] * 16))
        assert status == 200 and json.loads(body)["outputs"][0]["data"] == [2] * 16
        # No Python in this image: the pipeline that needs none is served all the same.
        assert request(c.ports["kserve"], "GET", "/v2/models/color_match/ready")[0] == 200
    finally:
        c.stop()


def test_sigterm_during_requests_drains_and_exits_cleanly(image, tmp_path_factory):
    folder = opt_ml_model(tmp_path_factory)
    c = Container(image, ["-p", "127.0.0.1::8080", "-v", f"{folder}:/opt/ml/model:ro"], command=["serve"])
    assert request(c.ports["SageMaker"], "POST", "/invocations", kserve_simple([1] * 16, [1] * 16))[0] == 200
    took, code = c.stop()
    assert code == 0 and took < 30, f"exit {code} after {took:.1f} s"


PY_IMAGE = "ferry:pytest-python"
TORCH_IMAGE = "ferry:pytest-pytorch"

USES = '''
import numpy as np
import triton_python_backend_utils as pb_utils
import {module}


class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor(
            "WHERE", np.array([{module}.WHERE.encode()], dtype=np.object_))]) for _ in requests]
'''

USES_CONFIG = """
backend: "python"
max_batch_size: 0
input [ { name: "X" data_type: TYPE_FP32 dims: [ 1 ] } ]
output [ { name: "WHERE" data_type: TYPE_STRING dims: [ 1 ] } ]
"""


def tiny_wheel(folder):
    """A wheel of one module, `tiny`, for pip to install with no index."""
    import zipfile
    path = os.path.join(folder, "tiny-1.0-py3-none-any.whl")
    files = {"tiny.py": "WHERE = 'pip'\n",
             "tiny-1.0.dist-info/METADATA": "Metadata-Version: 2.1\nName: tiny\nVersion: 1.0\n",
             "tiny-1.0.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: ferry-tests\nRoot-Is-Purelib: true\n"
                                         "Tag: py3-none-any\n"}
    record = "".join(f"{name},,\n" for name in files) + "tiny-1.0.dist-info/RECORD,,\n"
    with zipfile.ZipFile(path, "w") as z:
        for name, text in {**files, "tiny-1.0.dist-info/RECORD": record}.items():
            z.writestr(name, text)
    return os.path.basename(path)


def env_archive(path):
    """A venv-shaped EXECUTION_ENV_PATH archive: the image's interpreter, its own `envmarker`."""
    import io
    import tarfile
    with tarfile.open(path, "w:gz") as tar:
        def add(name, text):
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(data), 0o644
            tar.addfile(info, io.BytesIO(data))
        add("pyvenv.cfg", "home = /usr/bin\ninclude-system-site-packages = true\nversion = 3.11\n")
        add("lib/python3.11/site-packages/envmarker.py", "WHERE = 'archive'\n")
        link = tarfile.TarInfo("bin/python3")
        link.type, link.linkname = tarfile.SYMTYPE, "/usr/bin/python3"
        tar.addfile(link)


def openvino_ir(model_dir, rows):
    """An OpenVINO IR (Y = X @ W, converted from ONNX by OpenVINO here) and its output on `rows`
    from OpenVINO in-process."""
    import openvino as ov
    from onnx import TensorProto, helper, numpy_helper
    w = numpy_helper.from_array(np.random.default_rng(5).normal(size=(4, 3)).astype(np.float32), "W")
    graph = helper.make_graph([helper.make_node("MatMul", ["X", "W"], ["Y"])], "ir",
                              [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["n", 4])],
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["n", 3])], [w])
    os.makedirs(os.path.join(model_dir, "1"))
    onnx_path = os.path.join(model_dir, "model.onnx")
    models.save(graph, onnx_path)
    ov.save_model(ov.convert_model(onnx_path), os.path.join(model_dir, "1", "model.xml"))
    os.remove(onnx_path)
    with open(os.path.join(model_dir, "config.pbtxt"), "w") as f:
        f.write('backend: "openvino"\nmax_batch_size: 8\n'
                'parameters { key: "INFERENCE_PRECISION_HINT" value: { string_value: "f32" } }\n')
    core = ov.Core()
    compiled = core.compile_model(core.read_model(os.path.join(model_dir, "1", "model.xml")), "CPU",
                                  {"INFERENCE_PRECISION_HINT": "f32"})
    return compiled(rows)[compiled.outputs[0]].flatten().tolist()


def test_the_python_image_runs_python_models_with_added_packages_and_env_archives(tmp_path):
    subprocess.run(["bash", os.path.join(ROOT, "container", "build.sh"), "--from-host", "--debug", "--python",
                    "--tag", PY_IMAGE], check=True, stdout=subprocess.DEVNULL)
    # Users add their packages on top (FROM ferry:python + pip); no index is reachable here.
    ctx = tmp_path / "derived"
    ctx.mkdir()
    wheel = tiny_wheel(str(ctx))
    # XGBoost's wheel, as the tests' own (pip's cache, else PyPI), for a FIL model: ferry finds its
    # libxgboost.so in the image's site-packages.
    import xgboost
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                    f"xgboost-cpu=={xgboost.__version__}", "-d", str(ctx)], check=True)
    (xgb_wheel,) = [w for w in os.listdir(ctx) if w.startswith("xgboost_cpu-")]
    # OpenVINO's wheel for the image's Python (3.11), for an IR model: libopenvino_c.so and its
    # TBB are in the wheel; its Python dependencies are not needed by ferry.
    import importlib.metadata
    import openvino
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                    "--python-version", "3.11", "--platform", "manylinux_2_28_x86_64",
                    "--platform", "manylinux2014_x86_64", "--platform", "manylinux_2_17_x86_64",
                    f"openvino=={importlib.metadata.version('openvino')}", "-d", str(ctx)], check=True)
    (ov_wheel,) = [w for w in os.listdir(ctx) if w.startswith("openvino-")]
    (ctx / "Dockerfile").write_text(f"FROM {PY_IMAGE}\nUSER root\nCOPY {wheel} {xgb_wheel} {ov_wheel} /tmp/\n"
                                    f"RUN python3 -m pip install --no-cache-dir --no-index --no-deps /tmp/{wheel} "
                                    f"/tmp/{xgb_wheel} /tmp/{ov_wheel} && rm /tmp/*.whl\nUSER 65532:65532\n")
    derived = f"{PY_IMAGE}-derived"
    subprocess.run(["docker", "build", "--pull=false", "-t", derived, str(ctx)], check=True, stdout=subprocess.DEVNULL)
    repo = tmp_path / "repo"
    models.python_model(str(repo), "uses_pip", USES.format(module="tiny"), USES_CONFIG)
    models.python_model(str(repo), "uses_env", USES.format(module="envmarker"),
                        USES_CONFIG + 'parameters { key: "EXECUTION_ENV_PATH" '
                        'value { string_value: "$$TRITON_MODEL_DIRECTORY/env.tar.gz" } }\n')
    env_archive(str(repo / "uses_env" / "env.tar.gz"))
    rows = np.random.default_rng(3).normal(size=(200, 4)).astype(np.float32)
    booster = xgboost.train({"objective": "binary:logistic"}, xgboost.DMatrix(rows, label=rows[:, 0] > 0), 5)
    os.makedirs(repo / "trees" / "1")
    (repo / "trees" / "1" / "xgboost.json").write_bytes(bytes(booster.save_raw("json")))
    (repo / "trees" / "config.pbtxt").write_text(
        'backend: "fil"\nmax_batch_size: 8\nparameters { key: "model_type" value: { string_value: "xgboost_json" } }\n')
    want_trees = booster.inplace_predict(rows[:2]).tolist()
    want_ir = openvino_ir(str(repo / "ir"), rows[:2])
    subprocess.run(["chmod", "-R", "a+rX", str(repo)], check=True)
    try:
        # The example pipeline's Python steps serve by default; then the derived image's models.
        for image, mounts, expect in ((PY_IMAGE, [], {"text_classifier": None}),
                                      (derived, ["-v", f"{repo}:/models:ro"],
                                       {"uses_pip": "pip", "uses_env": "archive", "trees": want_trees, "ir": want_ir})):
            command = ["--model-repository", "/models"] if mounts else []
            c = Container(image, ["-p", "127.0.0.1::8000", *mounts], command=command, service="kserve",
                          container_port=8000)
            try:
                port = c.ports["kserve"]
                status, _, body = request(port, "POST", "/v2/repository/index", b"{}")
                ready = {m["name"] for m in json.loads(body) if m.get("state") == "READY"}
                assert set(expect) <= ready, (ready, c.log())
                for name, where in expect.items():
                    if where is None:
                        text = {"inputs": [{"name": "TEXT", "shape": [1, 1], "datatype": "BYTES", "data": ["a fine day"]}]}
                        status, _, out = request(port, "POST", f"/v2/models/{name}/infer", json.dumps(text).encode())
                        got = {o["name"]: o["data"] for o in json.loads(out)["outputs"]} if status == 200 else out
                        assert set(got) == {"LABEL", "SCORE"} and 0 <= got["SCORE"][0] <= 1, got
                        continue
                    if name in ("trees", "ir"):
                        body = {"inputs": [{"name": "input__0" if name == "trees" else "X", "shape": [2, 4],
                                            "datatype": "FP32", "data": rows[:2].flatten().tolist()}]}
                        status, _, out = request(port, "POST", f"/v2/models/{name}/infer", json.dumps(body).encode())
                        assert status == 200, out
                        np.testing.assert_allclose(json.loads(out)["outputs"][0]["data"], where, rtol=1e-5)
                        continue
                    body = {"inputs": [{"name": "X", "shape": [1], "datatype": "FP32", "data": [1]}]}
                    status, _, out = request(port, "POST", f"/v2/models/{name}/infer", json.dumps(body).encode())
                    assert status == 200, out
                    assert json.loads(out)["outputs"][0]["data"] == [where], (name, out)
            finally:
                c.stop()
    finally:
        subprocess.run(["docker", "rmi", "-f", derived, PY_IMAGE], capture_output=True)


def test_the_pytorch_image_serves_torchscript_and_aoti_models_on_its_own_pytorch(tmp_path):
    """`container/build.sh --pytorch`: the Python image with the official PyTorch from PyPI, no
    PyTorch on the host needed at run time, and ferry's TorchScript shim built for it. A TorchScript
    model and an AOTInductor package made by the tests' PyTorch (the same version) serve from the
    image over HTTP inside the server, batched, with the outputs PyTorch computed in-process."""
    torch_python = os.environ.get("FERRY_TORCH_PYTHON")
    if not torch_python:
        if os.environ.get("FERRY_REQUIRE_TORCH") == "1":
            raise RuntimeError("FERRY_REQUIRE_TORCH=1 but FERRY_TORCH_PYTHON is not set (source scripts/torch.sh)")
        pytest.skip("no Python with PyTorch (FERRY_TORCH_PYTHON; scripts/torch.sh makes one)")
    version = subprocess.run([torch_python, "-c", "import torch; print(torch.__version__.split('+')[0])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    made = tmp_path / "made"
    made.mkdir()
    subprocess.run([torch_python, os.path.join(ROOT, "tests", "python", "torch_models.py"), str(made / "repo")],
                   check=True, stdout=subprocess.DEVNULL)
    packages = tmp_path / "packages"
    packages.mkdir()
    subprocess.run([torch_python, os.path.join(ROOT, "tests", "python", "torch_packages.py"), str(packages / "repo"),
                    "mlp"], check=True, stdout=subprocess.DEVNULL)
    expected = dict(np.load(made / "expected.npz"))
    from_package = dict(np.load(packages / "expected.npz"))
    repo = tmp_path / "repo"
    shutil.copytree(made / "repo" / "mlp", repo / "mlp")
    shutil.copytree(packages / "repo" / "mlp_aoti", repo / "mlp_aoti")
    subprocess.run(["chmod", "-R", "a+rX", str(repo)], check=True)
    subprocess.run(["bash", os.path.join(ROOT, "container", "build.sh"), "--from-host", "--debug", "--pytorch",
                    "--torch", version, "--tag", TORCH_IMAGE], check=True, stdout=subprocess.DEVNULL)
    try:
        c = Container(TORCH_IMAGE, ["-p", "127.0.0.1::8000", "-v", f"{repo}:/models:ro"],
                      command=["--model-repository", "/models"], service="kserve", container_port=8000)
        try:
            port = c.ports["kserve"]
            status, _, body = request(port, "POST", "/v2/repository/index", b"{}")
            ready = {m["name"] for m in json.loads(body) if m.get("state") == "READY"}
            assert ready == {"mlp", "mlp_aoti"}, (body, c.log())
            # The image ships ferry's TorchScript shim for its PyTorch: TorchScript runs in the server.
            assert "TorchScript models run inside the server" in c.log(), c.log()
            x, want = expected["mlp_in"], expected["mlp_out"]

            def infer(name, tin, part):
                body = {"inputs": [{"name": tin, "shape": list(part.shape), "datatype": "FP32",
                                    "data": part.flatten().tolist()}]}
                status, _, out = request(port, "POST", f"/v2/models/{name}/infer", json.dumps(body).encode())
                assert status == 200, (name, out)
                return np.array(json.loads(out)["outputs"][0]["data"], np.float32).reshape(len(part), -1)

            np.testing.assert_allclose(infer("mlp", "INPUT__0", x), want, rtol=1e-5, atol=1e-6)
            # One row per request from 8 clients: the package's dynamic batch dimension batches them.
            from concurrent.futures import ThreadPoolExecutor
            px, pwant = from_package["mlp_in"], from_package["mlp_out"]
            with ThreadPoolExecutor(8) as pool:
                got = list(pool.map(lambda k: infer("mlp_aoti", "ARGS[0]", px[k % 5:k % 5 + 1]), range(24)))
            for k, g in enumerate(got):
                np.testing.assert_allclose(g, pwant[k % 5:k % 5 + 1], rtol=1e-4, atol=1e-5)
            status, _, body = request(port, "GET", "/v2/models/mlp_aoti/stats")
            stats = json.loads(body)["model_stats"][0]
            assert stats["inference_count"] == 24 and stats["execution_count"] < 24, stats
        finally:
            c.stop()
    finally:
        subprocess.run(["docker", "rmi", "-f", TORCH_IMAGE], capture_output=True)


def test_the_helm_charts_pod_runs_in_the_image_as_the_kubelet_would(image, tmp_path):
    """The Deployment the chart renders, run by Docker as a kubelet runs it: its command line, user
    65532, read-only root, no capabilities, emptyDirs as tmpfs, the repository on a volume; the
    probes answer on their paths, and a stop drains within the grace period the chart sets."""
    import test_kubernetes
    repo = tmp_path / "models"
    copy_example(str(repo), "simple")
    subprocess.run(["chmod", "-R", "a+rX", str(repo)], check=True)
    objects = test_kubernetes.render({"modelRepository": "/models", "modelControlMode": "poll"})
    pod = objects["Deployment"]["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    user = pod["securityContext"]["runAsUser"]
    assert c["securityContext"]["readOnlyRootFilesystem"] and c["securityContext"]["capabilities"]["drop"] == ["ALL"]
    run_args = ["-p", "127.0.0.1::8000", "-p", "127.0.0.1::8002", "--user", f"{user}:{user}", "--read-only",
                "--cap-drop", "ALL", "--security-opt", "no-new-privileges", "-v", f"{repo}:/models:ro"]
    for mount in c["volumeMounts"]:
        run_args += ["--tmpfs", f"{mount['mountPath']}:uid={user},gid={user}"]
    # The admin key the Secret would hold, expanded into the arguments as the kubelet does.
    env = {"FERRY_ADMIN_KEY": "k3y"}
    run_args += ["-e", "FERRY_ADMIN_KEY=k3y"]
    k = Container(image, run_args, command=test_kubernetes.expand(c["args"], env), service="KServe", container_port=8000)
    try:
        port = k.ports["KServe"]
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert request(port, "GET", c[probe]["httpGet"]["path"])[0] == 200, probe
        status, _, body = request(port, "POST", "/v2/models/simple/infer", kserve_simple([1] * 16, [2] * 16))
        assert status == 200, body
        metrics = subprocess.run(["docker", "port", k.name, "8002/tcp"], capture_output=True, text=True).stdout
        metrics_port = int(metrics.split("\n")[0].rsplit(":", 1)[1])
        assert b"ferry_inference_load" in urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics").read()
    finally:
        grace = pod["terminationGracePeriodSeconds"]
        took, code = k.stop(grace)
    assert code == 0 and took < grace, f"stopped with {code} after {took:.1f} s (grace {grace} s)"
