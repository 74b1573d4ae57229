"""TensorFlow models (`platform: "tensorflow_savedmodel"` / `"tensorflow_graphdef"`, which
Triton no longer serves) through the real server, read by OpenVINO's TensorFlow reader: a
tf.Module SavedModel with two inputs and two outputs named by its signature, the same function
frozen into a GraphDef (tensors named by their nodes), and a Keras CNN exported as a SavedModel
with its config auto-completed; each compared with TensorFlow's own outputs over HTTP and gRPC;
batched under concurrency; a signature other than serving_default refused, saying why.

The models are made by FERRY_TF_PYTHON (scripts/tensorflow.sh makes one); without it these
tests skip, unless FERRY_REQUIRE_TF=1 (CI sets it)."""
import os
import subprocess
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from conftest import framework_python
from ferry_server import Server

TF_PYTHON = framework_python("FERRY_TF_PYTHON", "FERRY_REQUIRE_TF", "tensorflow.sh", "TensorFlow")
pytest.importorskip("openvino")

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    root = tmp_path_factory.mktemp("tf")
    repo = root / "repo"
    repo.mkdir()
    subprocess.run([TF_PYTHON, os.path.join(HERE, "tf_models.py"), str(repo)], check=True)
    bad = repo / "missing_signature"
    (bad / "1").mkdir(parents=True)
    os.symlink(repo / "two_signatures" / "1" / "model.savedmodel", bad / "1" / "model.savedmodel")
    (bad / "config.pbtxt").write_text('platform: "tensorflow_savedmodel"\nmax_batch_size: 8\n'
                                      'parameters { key: "TF_SIGNATURE_DEF" value: { string_value: "classify" } }\n')
    return str(repo), dict(np.load(root / "tf_expected.npz"))


@pytest.fixture(scope="module")
def server(made):
    with Server(["--model-repository", made[0], "--exit-on-error=false"], timeout=120) as s:
        yield s


@pytest.fixture(scope="module")
def expected(made):
    return made[1]


def infer(server, model, arrays, protocol="http", binary=True):
    types = {np.float32: "FP32", np.int64: "INT64"}
    if protocol == "http":
        c, mod = httpclient.InferenceServerClient(server.url), httpclient
    else:
        c, mod = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}"), grpcclient
    inputs = []
    for name, a in arrays.items():
        i = mod.InferInput(name, list(a.shape), types[a.dtype.type])
        if protocol == "http":
            i.set_data_from_numpy(a, binary_data=binary)
        else:
            i.set_data_from_numpy(a)
        inputs.append(i)
    return c.infer(model, inputs)


@pytest.mark.parametrize("protocol,binary", [("http", True), ("http", False), ("grpc", True)])
def test_a_savedmodel_by_its_signature_names(server, expected, protocol, binary):
    r = infer(server, "scorer", {"features": expected["features"], "ids": expected["ids"]}, protocol, binary)
    np.testing.assert_allclose(r.as_numpy("scores"), expected["scores"], rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(r.as_numpy("doubled"), expected["doubled"])
    meta = httpclient.InferenceServerClient(server.url).get_model_metadata("scorer")
    assert meta["platform"] == "tensorflow_savedmodel"
    assert [(t["name"], t["datatype"]) for t in meta["inputs"]] == [("features", "FP32"), ("ids", "INT64")]


def test_a_graphdef_by_its_node_names(server, expected):
    doubled, scores = expected["graphdef_names"]
    r = infer(server, "scorer_graphdef", {"features": expected["features"], "ids": expected["ids"]}, "grpc")
    np.testing.assert_allclose(r.as_numpy(str(scores)), expected["scores"], rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(r.as_numpy(str(doubled)), expected["doubled"])


def test_a_keras_cnn_auto_completed(server, expected):
    c = httpclient.InferenceServerClient(server.url)
    config = c.get_model_config("keras_cnn")
    assert [(i["name"], [int(d) for d in i["dims"]]) for i in config["input"]] == [("image", [16, 16, 3])]
    assert [(o["name"], [int(d) for d in o["dims"]]) for o in config["output"]] == [("output_0", [5])]
    assert config["backend"] == "tensorflow" and config["platform"] == "tensorflow_savedmodel"
    for k in (1, 4):
        r = infer(server, "keras_cnn", {"image": expected["images"][:k]})
        # FP32 by default for TensorFlow models: TensorFlow's numbers.
        np.testing.assert_allclose(r.as_numpy("output_0"), expected["logits"][:k], rtol=1e-4, atol=1e-5)
    # At bf16 (where the CPU has it) the same model rounds, within bf16's precision.
    r = infer(server, "keras_cnn_bf16", {"image": expected["images"]})
    np.testing.assert_allclose(r.as_numpy("output_0"), expected["logits"], rtol=5e-2, atol=5e-2)


def test_batches_form_under_concurrency(server, expected):
    c = httpclient.InferenceServerClient(server.url)
    before = c.get_inference_statistics("scorer")["model_stats"][0]
    f, ids = expected["features"], expected["ids"]
    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(lambda k: infer(server, "scorer", {"features": f[k % 5:k % 5 + 1], "ids": ids[k % 5:k % 5 + 1]}),
                                range(48)))
    for k, r in enumerate(results):
        np.testing.assert_allclose(r.as_numpy("scores"), expected["scores"][k % 5:k % 5 + 1], rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(r.as_numpy("doubled"), expected["doubled"][k % 5:k % 5 + 1])
    after = c.get_inference_statistics("scorer")["model_stats"][0]
    inferences = after["inference_count"] - before["inference_count"]
    executions = after["execution_count"] - before["execution_count"]
    assert inferences == 48 and executions < inferences, (executions, inferences)


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_the_signature_tf_signature_def_names(server, expected, protocol):
    c = httpclient.InferenceServerClient(server.url)
    meta = c.get_model_metadata("two_signatures")
    assert meta["inputs"] == [{"name": "x", "datatype": "FP32", "shape": [-1, 4]}], meta
    assert meta["outputs"] == [{"name": "total", "datatype": "FP32", "shape": [-1, 1]}], meta
    r = infer(server, "two_signatures", {"x": expected["features"]}, protocol=protocol)
    np.testing.assert_allclose(r.as_numpy("total"), expected["total"], rtol=1e-5, atol=1e-5)


def test_refusals_name_the_reason(server, expected):
    c = httpclient.InferenceServerClient(server.url)
    index = {m["name"]: m for m in c.get_model_repository_index()}
    reason = index["missing_signature"]["reason"]
    assert index["missing_signature"]["state"] == "UNAVAILABLE"
    assert "TF_SIGNATURE_DEF 'classify': the SavedModel has no signature 'classify' (it has: predict, serving_default)" \
        in reason, reason
    with pytest.raises(InferenceServerException, match=r"\[400\].*features"):
        infer(server, "scorer", {"features": np.zeros((1, 5), dtype=np.float32), "ids": expected["ids"][:1]})
    assert c.is_model_ready("scorer")
