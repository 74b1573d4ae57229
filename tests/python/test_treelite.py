"""Treelite checkpoints (`model_type: treelite_checkpoint`) through the real server: scikit-learn
forests (random forest classifiers and regressors, a multi-output regressor, gradient boosting,
an isolation forest) and XGBoost and LightGBM models (categorical splits) converted by Treelite,
saved with Treelite 4's `Model.serialize`, and compared with Treelite's own reference predictor
(GTIL) over HTTP (binary and JSON) and gRPC; `output_class` and `predict_proba`; inputs and
outputs auto-completed; batches formed under concurrency; corrupt and hostile checkpoints failing
only their own model."""
import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import tritonclient.http as httpclient

treelite = pytest.importorskip("treelite")
sklearn_ensemble = pytest.importorskip("sklearn.ensemble")

from ferry_server import Server
from test_fil import FEATURES, grpc_infer, http_infer, write

RNG = np.random.default_rng(11)
TRAIN = RNG.normal(size=(400, FEATURES)).astype(np.float32)
ROWS = RNG.normal(size=(40, FEATURES)).astype(np.float32)
ROWS[3, 2] = np.nan  # a missing value takes each split's default branch
BINARY_Y = (TRAIN[:, 0] + TRAIN[:, 1] * TRAIN[:, 2] > 0).astype(int)
MULTI_Y = np.digitize(TRAIN[:, 0] + TRAIN[:, 3], [-0.7, 0.7])  # 3 classes
REG_Y = 2 * TRAIN[:, 0] - TRAIN[:, 4] ** 2


def gtil(model, rows):
    """Treelite's own prediction, one row of `targets × classes` values per input row."""
    import json
    dtype = np.float64 if json.loads(model.dump_as_json())["threshold_type"] == "float64" else np.float32
    out = treelite.gtil.predict(model, rows.astype(dtype))
    return out.reshape(len(rows), -1).astype(np.float32)


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    repo = str(tmp_path_factory.mktemp("treelite"))
    expected = {}

    def save(name, model, params, **kw):
        path = os.path.join(repo, "checkpoint.tl")
        model.serialize(path)
        with open(path, "rb") as f:
            data = f.read()
        os.remove(path)
        write(repo, name, {kw.pop("file", "checkpoint.tl"): data},
              {"model_type": "treelite_checkpoint", **params}, **kw)
        return data

    sk = sklearn_ensemble
    tl_sk = treelite.sklearn.import_model
    rf = tl_sk(sk.RandomForestClassifier(n_estimators=12, max_depth=6, random_state=0).fit(TRAIN, BINARY_Y))
    p = gtil(rf, ROWS)
    expected["rf_proba"] = p
    save("rf_proba", rf, {"output_class": "true", "predict_proba": "true"}, width=2,
         extra="dynamic_batching { max_queue_delay_microseconds: 20000 }\n")
    expected["rf_class"] = p.argmax(axis=1).astype(np.float32).reshape(-1, 1)
    save("rf_class", rf, {"output_class": "true"}, extra="instance_group [{ kind: KIND_CPU count: 2 }]\n")

    multi = tl_sk(sk.RandomForestClassifier(n_estimators=8, max_depth=5, random_state=1).fit(TRAIN, MULTI_Y))
    expected["rf_multi"] = gtil(multi, ROWS)
    # No input or output in the config, and a file of its own name: both from the checkpoint.
    save("rf_multi", multi, {}, io=False, file="forest.tl", extra='default_model_filename: "forest.tl"\n')

    reg = tl_sk(sk.ExtraTreesRegressor(n_estimators=10, max_depth=6, random_state=2).fit(TRAIN, REG_Y))
    expected["et_reg"] = gtil(reg, ROWS)
    save("et_reg", reg, {"output_class": "false"})

    two = tl_sk(sk.RandomForestRegressor(n_estimators=6, max_depth=5, random_state=3)
                .fit(TRAIN, np.stack([REG_Y, TRAIN[:, 1]], axis=1)))
    expected["rf_two_targets"] = gtil(two, ROWS)
    save("rf_two_targets", two, {}, width=2)
    save("rf_two_targets_class", two, {"output_class": "true"}, io=False)

    gb = tl_sk(sk.GradientBoostingClassifier(n_estimators=15, max_depth=3, random_state=4).fit(TRAIN, MULTI_Y))
    expected["gb_multi"] = gtil(gb, ROWS)
    save("gb_multi", gb, {"output_class": "false"}, width=3)

    iso = tl_sk(sk.IsolationForest(n_estimators=20, random_state=5).fit(TRAIN))
    expected["isolation"] = gtil(iso, ROWS)
    save("isolation", iso, {}, io=False)

    xgb = pytest.importorskip("xgboost")
    booster = xgb.train({"objective": "binary:logistic", "max_depth": 4}, xgb.DMatrix(TRAIN, label=BINARY_Y),
                        num_boost_round=20)
    path = os.path.join(repo, "xgb.json")
    booster.save_model(path)
    from_xgb = treelite.frontend.load_xgboost_model(path)
    os.remove(path)
    expected["from_xgboost"] = gtil(from_xgb, ROWS)
    save("from_xgboost", from_xgb, {})

    lgb = pytest.importorskip("lightgbm")
    cats = TRAIN.copy()
    cats[:, 5] = RNG.integers(0, 6, size=len(cats))
    label = ((cats[:, 5] % 3 == 0) ^ (cats[:, 0] > 0)).astype(int)
    lbin = lgb.train({"objective": "binary", "num_leaves": 8, "verbose": -1, "min_data_per_group": 5,
                      "cat_smooth": 1, "num_threads": 1},
                     lgb.Dataset(cats, label=label, categorical_feature=[5]), num_boost_round=10)
    path = os.path.join(repo, "lgb.txt")
    lbin.save_model(path)
    from_lgb = treelite.frontend.load_lightgbm_model(path)
    os.remove(path)
    assert '"node_type": "categorical_test_node"' in from_lgb.dump_as_json()
    rows = ROWS.copy()
    rows[:, 5] = np.arange(len(rows)) % 7 - 0.5  # listed, unlisted, negative and fractional categories
    expected["from_lightgbm"] = (gtil(from_lgb, rows), rows)
    save("from_lightgbm", from_lgb, {})

    good = save("good", rf, {}, io=False)
    hostile(repo, good)
    return repo, expected


def hostile(repo, good):
    """Checkpoints cut short, grown, or pointing outside themselves; each a model of its own."""
    def put(name, data):
        write(repo, name, {"checkpoint.tl": data}, {"model_type": "treelite_checkpoint"}, io=False)

    put("t_half", good[:len(good) // 2])
    put("t_trailing", good + b"\0")
    put("t_zeros", b"\0" * 64)
    put("t_v3", (3).to_bytes(4, "little") + (9).to_bytes(4, "little") + good[8:])
    put("t_trees", good[:14] + (2 ** 63).to_bytes(8, "little") + good[22:])
    put("t_features", good[:22] + (2 ** 31 - 1).to_bytes(4, "little") + good[26:])
    put("t_empty", b"")


HOSTILE = {
    "t_half": "tree ",  # where the cut falls: inside a tree
    "t_trailing": "1 bytes follow the last tree",
    "t_zeros": "written by Treelite 0.0.0", "t_v3": "written by Treelite 3.9",
    "t_trees": "declares 9223372036854775808 trees", "t_features": "declares 2147483647 features",
    "t_empty": "is empty",
    "rf_two_targets_class": "output_class and predict_proba take a model of one target; this one predicts 2",
}

SERVED = ["rf_proba", "rf_class", "rf_multi", "et_reg", "rf_two_targets", "gb_multi", "isolation",
          "from_xgboost", "good"]


@pytest.fixture(scope="module")
def server(made):
    with Server(["--model-repository", made[0], "--exit-on-error=false"]) as s:
        yield s


@pytest.mark.parametrize("model", ["rf_proba", "rf_class", "rf_multi", "et_reg", "rf_two_targets", "gb_multi",
                                   "isolation", "from_xgboost", "from_lightgbm"])
def test_outputs_equal_treelites_own_prediction(server, made, model):
    want, rows = made[1][model] if model == "from_lightgbm" else (made[1][model], ROWS)
    np.testing.assert_allclose(http_infer(server, model, rows), want, rtol=1e-5, atol=1e-6)
    # JSON carries no NaN: the JSON request leaves out the row with a missing value.
    np.testing.assert_allclose(http_infer(server, model, rows[4:], binary=False), want[4:], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(grpc_infer(server, model, rows[:1]), want[:1], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(grpc_infer(server, model, rows[3:4]), want[3:4], rtol=1e-5, atol=1e-6)


def test_inputs_and_outputs_come_from_the_checkpoint(server):
    c = httpclient.InferenceServerClient(server.url)
    config = c.get_model_config("rf_multi")
    assert config["input"][0]["name"] == "input__0" and config["input"][0]["dims"] == [FEATURES]
    assert config["output"][0]["name"] == "output__0" and config["output"][0]["dims"] == [3]
    meta = c.get_model_metadata("isolation")
    assert meta["outputs"] == [{"name": "output__0", "datatype": "FP32", "shape": [-1, 1]}]


def test_batches_form_under_concurrency(server, made):
    want = made[1]["rf_proba"]
    c = httpclient.InferenceServerClient(server.url)
    before = c.get_inference_statistics("rf_proba")["model_stats"][0]
    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(lambda k: http_infer(server, "rf_proba", ROWS[k % 40:k % 40 + 1]), range(64)))
    for k, got in enumerate(results):
        np.testing.assert_allclose(got, want[k % 40:k % 40 + 1], rtol=1e-5, atol=1e-6)
    after = c.get_inference_statistics("rf_proba")["model_stats"][0]
    assert after["inference_count"] - before["inference_count"] == 64
    assert after["execution_count"] - before["execution_count"] < 64


def test_hostile_checkpoints_fail_their_load_and_nothing_else(server):
    c = httpclient.InferenceServerClient(server.url)
    index = {m["name"]: m for m in c.get_model_repository_index()}
    for name, want in HOSTILE.items():
        assert index[name]["state"] == "UNAVAILABLE", (name, index[name])
        assert want in index[name]["reason"] and f"'{name}'" in index[name]["reason"], (name, index[name]["reason"])
    for model in SERVED:
        assert c.is_model_ready(model), model
