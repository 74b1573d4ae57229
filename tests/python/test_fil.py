"""Tree models (`backend: "fil"`) through the real server, on the XGBoost and LightGBM libraries of
their PyPI packages: XGBoost binary (JSON, UBJSON), multi-class, regression (the default
`model_type` and file) and LightGBM binary and multi-class models, each compared with the same
model's in-process prediction over HTTP (binary and JSON) and gRPC, and an XGBoost model with
categorical splits and one with multi-target trees; `predict_proba`,
`output_class` and `threshold` as FIL gives them; inputs and outputs auto-completed; batches formed
under concurrency; a wrong feature count or datatype answered 400; a corrupt file, treelite and a
missing library failing only their own model; an ensemble of an XGBoost and a LightGBM model,
warm-up and two instances."""
import json
import os
import re
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

xgb = pytest.importorskip("xgboost")
lgb = pytest.importorskip("lightgbm")

from ferry_server import Server

FEATURES = 8
RNG = np.random.default_rng(7)
ROWS = RNG.normal(size=(40, FEATURES)).astype(np.float32)
ROWS[3, 2] = np.nan  # a missing value takes the tree's default branch, in both


def write(repo, name, files, params, io=True, width=1, max_batch_size=64, extra=""):
    d = os.path.join(repo, name)
    os.makedirs(os.path.join(d, "1"))
    for fname, data in files.items():
        with open(os.path.join(d, "1", fname), "wb") as f:
            f.write(data)
    parameters = "\n".join(
        f'parameters {{ key: "{k}" value: {{ string_value: "{v}" }} }}' for k, v in params.items())
    tensors = ""
    if io:
        tensors = (f'input [{{ name: "input__0" data_type: TYPE_FP32 dims: [ {FEATURES} ] }}]\n'
                   f'output [{{ name: "output__0" data_type: TYPE_FP32 dims: [ {width} ] }}]\n')
    with open(os.path.join(d, "config.pbtxt"), "w") as f:
        f.write(f'backend: "fil"\nmax_batch_size: {max_batch_size}\n{tensors}{parameters}\n'
                f'instance_group [{{ kind: KIND_CPU }}]\n{extra}')


def xgb_model(objective, y, **params):
    booster = xgb.train({"objective": objective, "max_depth": 4, "eta": 0.3, **params},
                        xgb.DMatrix(TRAIN, label=y), num_boost_round=20)
    return booster


def saved(booster, suffix):
    raw = booster.save_raw(raw_format={"json": "json", "ubj": "ubj"}[suffix])
    return bytes(raw)


TRAIN = RNG.normal(size=(500, FEATURES)).astype(np.float32)
BINARY_Y = (TRAIN[:, 0] + TRAIN[:, 1] * TRAIN[:, 2] > 0).astype(np.float32)
MULTI_Y = np.digitize(TRAIN[:, 0] + TRAIN[:, 3], [-0.7, 0.7]).astype(np.float32)  # 3 classes
REG_Y = (2 * TRAIN[:, 0] - TRAIN[:, 4] ** 2).astype(np.float32)
QUAD_Y = np.digitize(TRAIN[:, 1] - TRAIN[:, 5], [-1, 0, 1]).astype(np.float32)  # 4 classes
CAT_TRAIN = TRAIN.copy()
CAT_TRAIN[:, 5] = RNG.integers(0, 7, size=len(TRAIN))
CAT_Y = ((CAT_TRAIN[:, 5] % 3 == 0) ^ (CAT_TRAIN[:, 0] > 0)).astype(np.float32)
CAT_ROWS = ROWS.copy()
CAT_ROWS[:, 5] = np.arange(len(ROWS)) % 9 - 1.0  # each category, an unseen one, and a negative one
LGB_CAT_ROWS = CAT_ROWS.copy()
LGB_CAT_ROWS[2, 5] = np.nan  # a missing category goes right (JSON requests leave rows 0-3 out)
BIG_ROWS = RNG.normal(size=(1500, FEATURES)).astype(np.float32)
BIG_ROWS[:4, 3] = np.nan  # JSON requests leave rows 0-3 out
# Zeros where a model trained with zero_as_missing takes its default branch.
ZERO_TRAIN, ZERO_ROWS = TRAIN.copy(), ROWS.copy()
ZERO_TRAIN[::4, 1] = 0.0
ZERO_ROWS[::3, 1] = 0.0


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    repo = str(tmp_path_factory.mktemp("fil"))
    expected = {}
    binary = xgb_model("binary:logistic", BINARY_Y)
    p = binary.inplace_predict(ROWS)
    expected["xgb_binary"] = p.reshape(-1, 1)
    write(repo, "xgb_binary", {"xgboost.json": saved(binary, "json")},
          {"model_type": "xgboost_json", "output_class": "false"}, extra="dynamic_batching { max_queue_delay_microseconds: 20000 }\n")
    expected["xgb_proba"] = np.stack([1 - p, p], axis=1)
    write(repo, "xgb_proba", {"xgboost.ubj": saved(binary, "ubj")},
          {"model_type": "xgboost_ubj", "output_class": "true", "predict_proba": "true"}, width=2)
    expected["xgb_class"] = (p > 0.3).astype(np.float32).reshape(-1, 1)
    write(repo, "xgb_class", {"xgboost.ubj": saved(binary, "ubj")},
          {"model_type": "xgboost_ubj", "output_class": "true", "threshold": "0.3",
           "storage_type": "AUTO", "algo": "ALGO_AUTO"},
          extra=f'''instance_group [{{ kind: KIND_CPU count: 2 }}]
model_warmup [{{ name: "w" batch_size: 4
  inputs {{ key: "input__0" value: {{ data_type: TYPE_FP32 dims: [ {FEATURES} ] random_data: true }} }} }}]
''')

    multi = xgb_model("multi:softprob", MULTI_Y, num_class=3)
    probs = multi.inplace_predict(ROWS)
    expected["xgb_multi"] = probs
    # No input or output in the config: both come from the model.
    write(repo, "xgb_multi", {"xgboost.json": saved(multi, "json")}, {"model_type": "xgboost_json"}, io=False)
    # A batch large enough for ferry's walk to split it over the instance's two threads.
    expected["xgb_big"] = multi.inplace_predict(BIG_ROWS)
    write(repo, "xgb_big", {"xgboost.json": saved(multi, "json")},
          {"model_type": "xgboost_json", "cpu_nthread": "2"}, width=3, max_batch_size=2048)
    expected["xgb_multi_class"] = probs.argmax(axis=1).astype(np.float32).reshape(-1, 1)
    write(repo, "xgb_multi_class", {"model.json": saved(multi, "json")},
          {"model_type": "xgboost_json", "output_class": "true"},
          extra='default_model_filename: "model.json"\n')
    softmax = xgb_model("multi:softmax", MULTI_Y, num_class=3)
    expected["xgb_softmax"] = softmax.inplace_predict(ROWS).reshape(-1, 1)
    write(repo, "xgb_softmax", {"xgboost.json": saved(softmax, "json")},
          {"model_type": "xgboost_json", "output_class": "true"})

    reg = xgb_model("reg:squarederror", REG_Y)
    expected["xgb_reg"] = reg.inplace_predict(ROWS).reshape(-1, 1)
    # The default model_type (xgboost) and file (xgboost.model); XGBoost tells the format from the bytes.
    write(repo, "xgb_reg", {"xgboost.model": saved(reg, "ubj")}, {"output_class": "false"})

    lbin = lgb.train({"objective": "binary", "num_leaves": 15, "verbose": -1, "num_threads": 1},
                     lgb.Dataset(TRAIN, label=BINARY_Y), num_boost_round=20)
    lp = lbin.predict(ROWS.astype(np.float64))
    expected["lgb_proba"] = np.stack([1 - lp, lp], axis=1).astype(np.float32)
    write(repo, "lgb_proba", {"model.txt": lbin.model_to_string().encode()},
          {"model_type": "lightgbm", "output_class": "true", "predict_proba": "true"}, width=2)
    lmulti = lgb.train({"objective": "multiclass", "num_class": 4, "num_leaves": 15, "verbose": -1,
                        "num_threads": 1}, lgb.Dataset(TRAIN, label=QUAD_Y), num_boost_round=15)
    lprobs = lmulti.predict(ROWS.astype(np.float64))
    expected["lgb_multi"] = lprobs.astype(np.float32)
    write(repo, "lgb_multi", {"model.txt": lmulti.model_to_string().encode()},
          {"model_type": "lightgbm", "output_class": "false", "cpu_nthread": "2"}, width=4,
          extra="dynamic_batching { max_queue_delay_microseconds: 20000 }\n")
    # A batch large enough for LightGBM to split over the instance's two threads.
    expected["lgb_big"] = lmulti.predict(BIG_ROWS.astype(np.float64)).astype(np.float32)
    write(repo, "lgb_big", {"model.txt": lmulti.model_to_string().encode()},
          {"model_type": "lightgbm", "cpu_nthread": "2"}, width=4, max_batch_size=2048)
    expected["lgb_multi_class"] = lprobs.argmax(axis=1).astype(np.float32).reshape(-1, 1)
    write(repo, "lgb_multi_class", {"model.txt": lmulti.model_to_string().encode()},
          {"model_type": "lightgbm", "output_class": "true"})

    # More of LightGBM's rules: categorical splits (with missing and negative categories), zero as
    # missing, Poisson (exp), one-vs-rest and a random forest (averaged).
    def lgb_model(name, params, x, y, rows, width=1, **dataset):
        booster = lgb.train({"num_leaves": 15, "verbose": -1, "num_threads": 1, "min_data_in_leaf": 5, **params},
                            lgb.Dataset(x, label=y, **dataset), num_boost_round=20)
        expected[name] = booster.predict(rows.astype(np.float64)).reshape(len(rows), width).astype(np.float32)
        write(repo, name, {"model.txt": booster.model_to_string().encode()}, {"model_type": "lightgbm"}, width=width)
        return booster

    cat = lgb_model("lgb_cat", {"objective": "binary", "cat_smooth": 1, "min_data_per_group": 5}, CAT_TRAIN, CAT_Y,
                    LGB_CAT_ROWS, categorical_feature=[5])
    assert re.search(r"^num_cat=[1-9]", cat.model_to_string(), re.M), "no categorical split was trained"
    lgb_model("lgb_zero", {"objective": "regression", "zero_as_missing": True}, ZERO_TRAIN, REG_Y, ZERO_ROWS)
    lgb_model("lgb_poisson", {"objective": "poisson"}, TRAIN, np.round(np.exp(TRAIN[:, 0] * 0.7)), ROWS)
    lgb_model("lgb_ova", {"objective": "multiclassova", "num_class": 3}, TRAIN, MULTI_Y, ROWS, width=3)
    lgb_model("lgb_rf", {"objective": "regression", "boosting": "rf", "bagging_freq": 1, "bagging_fraction": 0.7,
                         "feature_fraction": 0.8}, TRAIN, REG_Y, ROWS)

    # Categorical splits (XGBoost's own, trained with enable_categorical), predicted by XGBoost.
    cat_booster = xgb.train({"objective": "binary:logistic", "max_depth": 4, "max_cat_to_onehot": 1},
                            xgb.DMatrix(CAT_TRAIN, label=CAT_Y, enable_categorical=True,
                                        feature_types=["q"] * 5 + ["c"] + ["q"] * 2), num_boost_round=15)
    assert 1 in json.loads(saved(cat_booster, "json"))["learner"]["gradient_booster"]["model"]["trees"][0]["split_type"]
    expected["xgb_categorical"] = cat_booster.inplace_predict(CAT_ROWS).reshape(-1, 1)
    write(repo, "xgb_categorical", {"xgboost.ubj": saved(cat_booster, "ubj")}, {"model_type": "xgboost_ubj"})

    # Multi-target trees (vector leaves, XGBoost's multi_output_tree), predicted by XGBoost.
    mt = xgb.train({"tree_method": "hist", "multi_strategy": "multi_output_tree", "max_depth": 3},
                   xgb.DMatrix(TRAIN, label=np.stack([REG_Y, TRAIN[:, 1] - TRAIN[:, 6]], axis=1)), num_boost_round=10)
    expected["xgb_multi_target"] = mt.inplace_predict(ROWS)
    write(repo, "xgb_multi_target", {"xgboost.json": saved(mt, "json")}, {"model_type": "xgboost_json"}, width=2)
    write(repo, "x_targets_class", {"xgboost.ubj": saved(mt, "ubj")}, {"model_type": "xgboost_ubj", "output_class": "true"},
          io=False)
    mt_doc = json.loads(saved(mt, "json"))

    def mt_edit(name, edit):
        d = json.loads(json.dumps(mt_doc))
        edit(d["learner"]["gradient_booster"]["model"]["trees"][0])
        write(repo, name, {"xgboost.json": json.dumps(d).encode()}, {"model_type": "xgboost_json"}, io=False)
    first_leaf = mt_doc["learner"]["gradient_booster"]["model"]["trees"][0]["left_children"].index(-1)
    mt_edit("x_leaf_row_far", lambda t: t["right_children"].__setitem__(first_leaf, 100000000))
    mt_edit("x_leaf_row_twice", lambda t: t["right_children"].__setitem__(first_leaf, t["right_children"][first_leaf + 1]))
    mt_edit("x_vector_size", lambda t: t["tree_param"].__setitem__("size_leaf_vector", "3"))
    mt_edit("x_leaf_weights", lambda t: t.__setitem__("leaf_weights", t["leaf_weights"][:-1]))
    # What XGBoost's multi-target reader takes as given (a missing one crashes it), and XGBoost
    # 2's layout, which it reads the same way.
    mt_edit("x_mt_no_loss", lambda t: t.pop("loss_changes"))
    mt_edit("x_mt_no_hessian", lambda t: t.pop("sum_hessian"))

    def v2_layout(t):
        t.pop("leaf_weights")
        t["right_children"] = [r if l != -1 else -1 for l, r in zip(t["left_children"], t["right_children"])]
    mt_edit("x_mt_v2", v2_layout)

    # Without a batch dimension, and any row width in the config: the backend checks the width.
    write(repo, "xgb_nobatch", {"xgboost.json": saved(binary, "json")}, {"model_type": "xgboost_json"}, io=False,
          max_batch_size=0, extra='input [{ name: "input__0" data_type: TYPE_FP32 dims: [ -1, -1 ] }]\n')
    expected["xgb_nobatch"] = expected["xgb_binary"]
    write(repo, "cold", {"xgboost.json": saved(binary, "json")}, {"model_type": "xgboost_json"}, io=False,
          max_batch_size=0, extra='''input [{ name: "input__0" data_type: TYPE_FP32 dims: [ -1, -1 ] }]
model_warmup [{ name: "w" batch_size: 1
  inputs { key: "input__0" value: { data_type: TYPE_FP32 dims: [ 2, 5 ] zero_data: true } } }]
''')

    # Both binary models side by side, in one ensemble.
    os.makedirs(os.path.join(repo, "both", "1"))
    with open(os.path.join(repo, "both", "config.pbtxt"), "w") as f:
        f.write(f'''platform: "ensemble"
max_batch_size: 64
input [{{ name: "ROWS" data_type: TYPE_FP32 dims: [ {FEATURES} ] }}]
output [{{ name: "XGB" data_type: TYPE_FP32 dims: [ 2 ] }}, {{ name: "LGB" data_type: TYPE_FP32 dims: [ 2 ] }}]
ensemble_scheduling {{ step [
  {{ model_name: "xgb_proba" model_version: -1 input_map {{ key: "input__0" value: "ROWS" }}
    output_map {{ key: "output__0" value: "XGB" }} }},
  {{ model_name: "lgb_proba" model_version: -1 input_map {{ key: "input__0" value: "ROWS" }}
    output_map {{ key: "output__0" value: "LGB" }} }} ] }}
''')

    # Failures, each of its own model.
    write(repo, "corrupt", {"xgboost.json": b'{"learner": {"gradient_booster": 17'}, {"model_type": "xgboost_json"})
    write(repo, "lgb_corrupt", {"model.txt": b"tree\nversion=v4\nnum_class=banana\n"}, {"model_type": "lightgbm"})
    # A model file is untrusted: what it declares sizes every prediction's buffers.
    for name, key, value in (("many_features", "num_feature", "4000000000"), ("many_classes", "num_class", "1000000000")):
        doc = json.loads(saved(multi, "json"))
        doc["learner"]["learner_model_param"][key] = value
        write(repo, name, {"xgboost.json": json.dumps(doc).encode()}, {"model_type": "xgboost_json"}, io=False)
    text = lmulti.model_to_string().replace("num_class=4", "num_class=1000000000", 1)
    write(repo, "lgb_many_classes", {"model.txt": text.encode()}, {"model_type": "lightgbm"}, io=False)
    hostile(repo, binary, lmulti, lbin)
    write(repo, "treelite", {"checkpoint.tl": b"\0" * 64}, {"model_type": "treelite_checkpoint"})
    write(repo, "bad_type", {"xgboost.json": saved(binary, "json")}, {"model_type": "catboost"})
    write(repo, "wrong_width", {"xgboost.json": saved(multi, "json")}, {"model_type": "xgboost_json"}, width=2)
    write(repo, "shap", {"xgboost.json": saved(binary, "json")}, {"model_type": "xgboost_json"},
          extra=f'output [{{ name: "treeshap_output" data_type: TYPE_FP32 dims: [ {FEATURES + 1} ] }}]\n')
    return repo, expected


def hostile(repo, binary, lmulti, lbin):
    """Model files that crash or hang the frameworks' own readers, each a model of its own."""
    doc = json.loads(saved(binary, "json"))

    def xgb_edit(name, edit):
        d = json.loads(json.dumps(doc))
        edit(d["learner"]["gradient_booster"]["model"])
        write(repo, name, {"xgboost.json": json.dumps(d).encode()}, {"model_type": "xgboost_json"}, io=False)

    def tree0(key, index, value):
        return lambda m: m["trees"][0][key].__setitem__(index, value)

    xgb_edit("x_cycle", tree0("left_children", 0, 0))
    xgb_edit("x_child_far", tree0("left_children", 0, 100000000))
    xgb_edit("x_feature_far", tree0("split_indices", 0, 900000))
    xgb_edit("x_tree_info", lambda m: m.__setitem__("tree_info", [7] * len(m["tree_info"])))
    xgb_edit("x_parent", lambda m: m["trees"][0]["parents"].__setitem__(1, 1000000000))
    xgb_edit("x_tree_id", lambda m: m["trees"][1].__setitem__("id", 0))

    def categorical(m):
        t = m["trees"][0]
        t["split_type"][0], t["categories_nodes"], t["categories_segments"] = 1, [0], [0]
        t["categories_sizes"], t["categories"] = [2], [3, -100000000]
    xgb_edit("x_categorical", categorical)

    def categories(nodes, sizes, cats):
        def edit(m):
            t = m["trees"][0]
            for i in nodes:
                t["split_type"][i] = 1
            t["categories_nodes"], t["categories_segments"] = nodes, [0] * len(nodes)
            t["categories_sizes"], t["categories"] = sizes, cats
        return edit
    # A bitset XGBoost would size from the largest category; splits listed out of order; none.
    xgb_edit("x_category_far", categories([0], [2], [1, 2 ** 30]))
    xgb_edit("x_category_order", categories([2, 0], [1, 1], [1]))
    xgb_edit("x_category_none", categories([0], [0], []))
    # What XGBoost's reader and ferry's would read differently: a \u escape in a key (XGBoost
    # keeps it as written), a key twice in UBJSON (XGBoost keeps the first).
    text = saved(binary, "json").replace(b'"left_children"', b'"left\\u005fchildren"', 1)
    write(repo, "x_escape", {"xgboost.json": text}, {"model_type": "xgboost_json"}, io=False)
    import struct
    ubj = saved(binary, "ubj")
    key = b"L" + struct.pack(">q", 13) + b"left_children"
    at = ubj.index(key) + len(key)  # a typed int32 array: [$l#L<count> then the values
    count = struct.unpack(">q", ubj[at + 5:at + 13])[0]
    value = ubj[at:at + 13] + struct.pack(">i", 100000000) + ubj[at + 17:at + 13 + 4 * count]
    write(repo, "x_ubj_twice", {"xgboost.ubj": ubj[:at - len(key)] + key + value + ubj[at - len(key):]},
          {"model_type": "xgboost_ubj"}, io=False)
    write(repo, "x_empty", {"xgboost.json": b""}, {"model_type": "xgboost_json"}, io=False)
    write(repo, "x_legacy", {"xgboost.model": b"\x00\x00\x00?binf\x01\x02"}, {}, io=False)
    text = lbin.model_to_string()
    tree = text[text.index("Tree=0"):]
    feature_line = next(line for line in tree.splitlines() if line.startswith("split_feature="))
    child_line = next(line for line in tree.splitlines() if line.startswith("left_child="))
    no_sizes = "\n".join(line for line in text.splitlines() if not line.startswith("tree_sizes=")) + "\n"
    for name, model in {
        "l_half": text[:len(text) // 2],
        "l_feature_far": text.replace(feature_line, "split_feature=2000000000" + feature_line[feature_line.index(" "):], 1),
        "l_child_far": no_sizes.replace(child_line, "left_child=100000000" + child_line[child_line.index(" "):], 1),
        "l_cycle": no_sizes.replace(child_line, "left_child=0" + child_line[child_line.index(" "):], 1),
        "l_per_iteration": text.replace("num_tree_per_iteration=1", "num_tree_per_iteration=0", 1),
        "l_classes": lmulti.model_to_string().replace("num_class=4", "num_class=2", 1),
        # A lone \r breaks a line for LightGBM; a blank line ends its tree.
        "l_carriage": no_sizes.replace(child_line, child_line + "\rleft_child=100000000" + child_line[child_line.index(" "):], 1),
        "l_after_blank": no_sizes.replace(child_line, "left_child=100000000" + child_line[child_line.index(" "):], 1)
        .replace("\nTree=1", "\n" + child_line + "\n\nTree=1", 1),
    }.items():
        write(repo, name, {"model.txt": model.encode()}, {"model_type": "lightgbm"}, io=False)
    # Not regular files: a pipe would block the read forever, a device never ends.
    for name, target in (("x_fifo", None), ("x_zero", "/dev/zero")):
        write(repo, name, {}, {"model_type": "xgboost_json"}, io=False)
        path = os.path.join(repo, name, "1", "xgboost.json")
        os.mkfifo(path) if target is None else os.symlink(target, path)
    reg = xgb_model("reg:squarederror", REG_Y)
    write(repo, "x_proba_regression", {"xgboost.json": saved(reg, "json")},
          {"model_type": "xgboost_json", "predict_proba": "true"}, io=False)
    # Many classes and few features: a small request asks for a large output.
    wide = lgb.train({"objective": "multiclass", "num_class": 200, "num_leaves": 4, "verbose": -1, "min_data_in_leaf": 1},
                     lgb.Dataset(TRAIN[:, :1], label=np.arange(500) % 200), num_boost_round=1)
    write(repo, "l_wide", {"model.txt": wide.model_to_string().encode()}, {"model_type": "lightgbm"}, io=False,
          max_batch_size=0, extra='input [{ name: "input__0" data_type: TYPE_FP32 dims: [ -1, 1 ] }]\n')


HOSTILE = {
    "x_cycle": "tree 0: ", "x_child_far": "tree 0: ", "x_feature_far": "feature 900000",
    "x_tree_info": "tree_info names output 7", "x_empty": "is empty", "x_legacy": "old binary format",
    "l_half": "tree ",  # where the cut falls: an array shorter than its tree's leaves "l_feature_far": "feature 2000000000", "l_child_far": "node 100000000",
    "l_cycle": "twice", "l_per_iteration": "num_tree_per_iteration 0", "l_classes": "num_class is 2 and num_tree_per_iteration 4",
    "x_fifo": "not a regular file", "x_zero": "not a regular file",
    "x_proba_regression": "predict_proba needs a classifier",
    "x_parent": "parent is 1000000000", "x_tree_id": "tree 1 says it is tree 0",
    "x_categorical": "node 0 splits on category -100000000", "x_category_far": "splits on category 1073741824",
    "x_category_order": "but the categorical splits are nodes",
    "x_targets_class": "output_class and predict_proba take a model of one target; this one predicts 2",
    "x_leaf_row_far": "names leaf weights row 100000000", "x_leaf_row_twice": "one another leaf has",
    "x_vector_size": "leaf vectors of 3 values in a model of 2 targets", "x_leaf_weights": "leaf weights for leaf vectors of 2",
    "x_mt_no_loss": "without loss_changes or sum_hessian", "x_mt_no_hessian": "without loss_changes or sum_hessian",
    "x_mt_v2": "XGBoost 2's layout", "x_category_none": "outside the categories (0 + 0)", "x_escape": "\\u escape",
    "x_ubj_twice": "appears twice", "l_carriage": "appears twice", "l_after_blank": "a line between trees",
}


def test_hostile_model_files_fail_their_load_and_nothing_else(server):
    c = httpclient.InferenceServerClient(server.url)
    index = {m["name"]: m for m in c.get_model_repository_index()}
    for name, want in HOSTILE.items():
        assert index[name]["state"] == "UNAVAILABLE", (name, index[name])
        assert want in index[name]["reason"], (name, index[name]["reason"])
    for model in SERVED:
        assert c.is_model_ready(model), model


def test_an_output_too_large_is_refused(server):
    c = httpclient.InferenceServerClient(server.url)
    assert c.is_model_ready("l_wide")
    with pytest.raises(InferenceServerException, match=r"\[400\].*would give 200000000 output values"):
        http_infer(server, "l_wide", np.zeros((1_000_000, 1), dtype=np.float32))
    assert http_infer(server, "l_wide", np.zeros((3, 1), dtype=np.float32)).shape == (3, 200)


@pytest.fixture(scope="module")
def server(made):
    with Server(["--model-repository", made[0], "--exit-on-error=false"]) as s:
        yield s


@pytest.fixture(scope="module")
def expected(made):
    return made[1]


SERVED = ["xgb_binary", "xgb_proba", "xgb_class", "xgb_multi", "xgb_multi_class", "xgb_softmax", "xgb_reg",
          "lgb_proba", "lgb_multi", "lgb_multi_class", "xgb_nobatch", "xgb_categorical", "xgb_multi_target",
          "lgb_cat", "lgb_zero", "lgb_poisson", "lgb_ova", "lgb_rf", "lgb_big", "xgb_big"]
ROWS_OF = {"xgb_categorical": CAT_ROWS, "lgb_cat": LGB_CAT_ROWS, "lgb_zero": ZERO_ROWS, "lgb_big": BIG_ROWS,
           "xgb_big": BIG_ROWS}


def http_infer(server, model, x, binary=True):
    c = httpclient.InferenceServerClient(server.url)
    i = httpclient.InferInput("input__0", list(x.shape), "FP32")
    i.set_data_from_numpy(x, binary_data=binary)
    out = httpclient.InferRequestedOutput("output__0", binary_data=binary)
    return c.infer(model, [i], outputs=[out]).as_numpy("output__0")


def grpc_infer(server, model, x):
    c = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
    i = grpcclient.InferInput("input__0", list(x.shape), "FP32")
    i.set_data_from_numpy(x)
    return c.infer(model, [i]).as_numpy("output__0")


@pytest.mark.parametrize("model", SERVED)
def test_outputs_equal_the_frameworks_own_prediction(server, expected, model):
    want, rows = expected[model], ROWS_OF.get(model, ROWS)
    np.testing.assert_allclose(http_infer(server, model, rows), want, rtol=1e-5, atol=1e-6)
    # JSON carries no NaN: the JSON request leaves out the row with a missing value.
    np.testing.assert_allclose(http_infer(server, model, rows[4:], binary=False), want[4:], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(grpc_infer(server, model, rows[:1]), want[:1], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(grpc_infer(server, model, rows[3:4]), want[3:4], rtol=1e-5, atol=1e-6)


def test_an_ensemble_runs_both_frameworks(server, expected):
    c = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
    i = grpcclient.InferInput("ROWS", list(ROWS.shape), "FP32")
    i.set_data_from_numpy(ROWS)
    r = c.infer("both", [i])
    np.testing.assert_allclose(r.as_numpy("XGB"), expected["xgb_proba"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(r.as_numpy("LGB"), expected["lgb_proba"], rtol=1e-5, atol=1e-6)


def test_warm_up_runs_the_forest(server):
    c = httpclient.InferenceServerClient(server.url)
    assert c.is_model_ready("xgb_class")  # two instances, each warmed with random rows
    # A sample the forest refuses fails the load, with the forest's reason.
    index = {m["name"]: m for m in c.get_model_repository_index()}
    assert index["cold"]["state"] == "UNAVAILABLE"
    assert "rows of 5 features; the model takes 8" in index["cold"]["reason"], index["cold"]


def test_common_xgboost_forests_are_walked_by_ferry_once_they_agree_with_xgboost(server):
    # Logged at load; the outputs above are compared with XGBoost's own either way.
    walked = [line for line in server.log().splitlines() if "evaluated by ferry" in line]
    for model in ["xgb_binary", "xgb_multi", "xgb_softmax", "xgb_reg", "xgb_big"]:
        assert any(model in line for line in walked), (model, walked)


def test_inputs_and_outputs_come_from_the_model(server):
    c = httpclient.InferenceServerClient(server.url)
    config = c.get_model_config("xgb_multi")
    assert config["input"][0]["name"] == "input__0" and config["input"][0]["dims"] == [FEATURES]
    assert config["output"][0]["name"] == "output__0" and config["output"][0]["dims"] == [3]
    meta = c.get_model_metadata("lgb_proba")
    assert meta["inputs"] == [{"name": "input__0", "datatype": "FP32", "shape": [-1, FEATURES]}]
    assert meta["outputs"] == [{"name": "output__0", "datatype": "FP32", "shape": [-1, 2]}]


@pytest.mark.parametrize("model", ["xgb_binary", "lgb_multi"])
def test_batches_form_under_concurrency(server, expected, model):
    want = expected[model]
    c = httpclient.InferenceServerClient(server.url)
    before = c.get_inference_statistics(model)["model_stats"][0]
    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(lambda k: http_infer(server, model, ROWS[k % 40:k % 40 + 1]), range(64)))
    for k, got in enumerate(results):
        np.testing.assert_allclose(got, want[k % 40:k % 40 + 1], rtol=1e-5, atol=1e-6)
    after = c.get_inference_statistics(model)["model_stats"][0]
    inferences = after["inference_count"] - before["inference_count"]
    executions = after["execution_count"] - before["execution_count"]
    assert inferences == 64
    assert executions < inferences, (executions, inferences)


def test_bad_inputs_are_400_and_the_server_keeps_serving(server, expected):
    c = httpclient.InferenceServerClient(server.url)
    for model in ["xgb_binary", "lgb_multi"]:
        with pytest.raises(InferenceServerException, match=r"\[400\].*input__0") as e:
            http_infer(server, model, np.zeros((2, FEATURES + 1), dtype=np.float32))
        assert "Expected [-1,8], got [2,9]" in str(e.value), e.value
        i = httpclient.InferInput("input__0", [1, FEATURES], "FP64")
        i.set_data_from_numpy(np.zeros((1, FEATURES)))
        with pytest.raises(InferenceServerException, match=r"\[400\].*FP64"):
            c.infer(model, [i])
    with pytest.raises(InferenceServerException, match=r"\[400\].*rows of 5 features; the model takes 8"):
        http_infer(server, "xgb_nobatch", np.zeros((2, 5), dtype=np.float32))
    np.testing.assert_allclose(http_infer(server, "xgb_binary", ROWS), expected["xgb_binary"], rtol=1e-5)


def test_failures_stay_with_their_model(server):
    c = httpclient.InferenceServerClient(server.url)
    index = {m["name"]: m for m in c.get_model_repository_index()}
    reasons = {name: index[name]["reason"] for name in
               ["corrupt", "lgb_corrupt", "treelite", "bad_type", "wrong_width", "shap", "many_features",
                "many_classes", "lgb_many_classes"]}
    for name, reason in reasons.items():
        assert index[name]["state"] == "UNAVAILABLE", (name, index[name])
        assert f"'{name}'" in reason or name in reason, (name, reason)
    assert "not an XGBoost JSON model" in reasons["corrupt"], reasons["corrupt"]
    assert "num_class is not an integer" in reasons["lgb_corrupt"], reasons["lgb_corrupt"]
    assert "written by Treelite 0.0.0; ferry reads Treelite 4" in reasons["treelite"], reasons["treelite"]
    assert "model_type is 'catboost'" in reasons["bad_type"]
    assert "output__0" in reasons["wrong_width"] and "3" in reasons["wrong_width"], reasons["wrong_width"]
    assert "treeshap_output" in reasons["shap"]
    assert "4000000000 features; ferry takes tree models of up to" in reasons["many_features"], reasons
    # XGBoost checks the class count against the model itself; its message, without a stack trace.
    assert "1000000000 classes and 1 targets; ferry takes tree models of up to 16384" in reasons["many_classes"]
    assert "num_class is 1000000000 and num_tree_per_iteration 4" in reasons["lgb_many_classes"], reasons
    for model in SERVED:
        assert c.is_model_ready(model), model


def test_a_missing_library_fails_only_its_models(made, expected):
    with Server(["--model-repository", made[0], "--exit-on-error=false",
                 "--backend-config=fil,lightgbm-library=/nonexistent/lib_lightgbm.so"]) as s:
        c = httpclient.InferenceServerClient(s.url)
        index = {m["name"]: m for m in c.get_model_repository_index()}
        reason = index["lgb_proba"]["reason"]
        assert index["lgb_proba"]["state"] == "UNAVAILABLE"
        assert "no LightGBM library at '/nonexistent/lib_lightgbm.so'" in reason, reason
        assert "fil,lightgbm-library" in reason
        np.testing.assert_allclose(http_infer(s, "xgb_reg", ROWS), expected["xgb_reg"], rtol=1e-5, atol=1e-6)
