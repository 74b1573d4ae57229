#!/usr/bin/env python3
"""Writes the ONNX files of the embedded example repository (the folders next to this script).

  simple         INPUT0, INPUT1 INT32 [16] -> OUTPUT0 = INPUT0 + INPUT1, OUTPUT1 = INPUT0 - INPUT1
  simple_string  the same on numbers written as strings (BYTES in, BYTES out)
  text_classifier_onnx  FEATURES FP32 [16] -> LOGITS FP32 [3]: a fixed linear layer, the ONNX
                 step of the text_classifier pipeline (Python pre-processing, this model, Python
                 post-processing, wired by the text_classifier ensemble)

They answer the client examples that ship with tritonclient (simple_http_infer_client.py,
simple_http_string_infer_client.py and their gRPC twins). The config.pbtxt files are written by hand.
Usage: python examples/make_examples.py
"""
import os

import onnx
from onnx import TensorProto, helper

HERE = os.path.dirname(os.path.abspath(__file__))


def save(graph, name):
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], producer_name="examples/make_examples.py")
    model.ir_version = 8
    onnx.checker.check_model(model)
    path = os.path.join(HERE, name, "1", "model.onnx")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    onnx.save(model, path)


def add_sub(name, elem, cast_through=None):
    io = lambda n: helper.make_tensor_value_info(n, elem, ["batch", 16])
    nodes, a, b = [], "INPUT0", "INPUT1"
    if cast_through is not None:
        nodes += [helper.make_node("Cast", ["INPUT0"], ["a"], to=cast_through),
                  helper.make_node("Cast", ["INPUT1"], ["b"], to=cast_through)]
        a, b = "a", "b"
    sum_out, diff_out = ("s", "d") if cast_through is not None else ("OUTPUT0", "OUTPUT1")
    nodes += [helper.make_node("Add", [a, b], [sum_out]), helper.make_node("Sub", [a, b], [diff_out])]
    if cast_through is not None:
        nodes += [helper.make_node("Cast", ["s"], ["OUTPUT0"], to=elem),
                  helper.make_node("Cast", ["d"], ["OUTPUT1"], to=elem)]
    save(helper.make_graph(nodes, name, [io("INPUT0"), io("INPUT1")], [io("OUTPUT0"), io("OUTPUT1")]), name)


def linear(name):
    import numpy as np
    from onnx import numpy_helper
    rng = np.random.default_rng(1)
    weights = numpy_helper.from_array(rng.standard_normal((16, 3)).astype(np.float32), "W")
    bias = numpy_helper.from_array(np.array([0.1, 0.0, -0.1], dtype=np.float32), "B")
    x = helper.make_tensor_value_info("FEATURES", TensorProto.FLOAT, ["batch", 16])
    y = helper.make_tensor_value_info("LOGITS", TensorProto.FLOAT, ["batch", 3])
    nodes = [helper.make_node("MatMul", ["FEATURES", "W"], ["m"]), helper.make_node("Add", ["m", "B"], ["LOGITS"])]
    save(helper.make_graph(nodes, name, [x], [y], initializer=[weights, bias]), name)


if __name__ == "__main__":
    add_sub("simple", TensorProto.INT32)
    add_sub("simple_string", TensorProto.STRING, cast_through=TensorProto.INT32)
    linear("text_classifier_onnx")
