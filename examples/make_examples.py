#!/usr/bin/env python3
"""Writes the ONNX files of the embedded example repository (the folders next to this script).

  simple         INPUT0, INPUT1 INT32 [16] -> OUTPUT0 = INPUT0 + INPUT1, OUTPUT1 = INPUT0 - INPUT1
  simple_string  the same on numbers written as strings (BYTES in, BYTES out)
  text_classifier_onnx  FEATURES FP32 [16] -> LOGITS FP32 [3]: a fixed linear layer, the ONNX
                 step of the text_classifier pipeline (Python pre-processing, this model, Python
                 post-processing, wired by the text_classifier ensemble)

  color_match_onnx  PIXELS FP32 [3, 32, 32], input_ids / attention_mask INT64 [8] -> IMAGE_LOGITS,
                 TEXT_LOGITS FP32 [5]: the ONNX step of the color_match pipeline (no Python: ferry_image
                 and ferry_tokenizer before it, ferry_postprocess after), scoring five colours from an
                 image's mean colour and from the colour words of a text; also writes the pipeline's
                 tokenizer.json (needs the `tokenizers` package)

  text_embedding_onnx  input_ids / attention_mask INT64 [16] -> HIDDEN FP32 [16, 8]: a fixed random
                 embedding table, the encoder of the text_embedding pipeline (ferry_tokenizer, this
                 model, ferry_postprocess mean pooling; served as OpenAI's /v1/embeddings); also writes
                 its tokenizer.json

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


COLORS = ["red", "green", "blue", "white", "black"]
PROTOTYPES = [[0.8, 0.15, 0.1], [0.2, 0.6, 0.2], [0.2, 0.4, 0.8], [0.92, 0.92, 0.92], [0.08, 0.08, 0.08]]
# Words and the colour they say (strongly for colour names, weakly for things of that colour).
WORDS = {"red": (0, 4.0), "green": (1, 4.0), "blue": (2, 4.0), "white": (3, 4.0), "black": (4, 4.0),
         "fire": (0, 2.0), "tomato": (0, 2.0), "grass": (1, 2.0), "leaf": (1, 2.0), "sky": (2, 2.0),
         "ocean": (2, 2.0), "snow": (3, 2.0), "milk": (3, 2.0), "night": (4, 2.0), "coal": (4, 2.0)}


def color_match():
    import numpy as np
    from onnx import numpy_helper
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers
    vocab = {"[PAD]": 0, "[UNK]": 1, **{w: i + 2 for i, w in enumerate(WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    os.makedirs(os.path.join(HERE, "color_match_text", "1"), exist_ok=True)
    tok.save(os.path.join(HERE, "color_match_text", "1", "tokenizer.json"))
    # Image: logits = -10 * squared distance of the mean colour to each prototype (the |mean|^2
    # term is the same for every colour, so it is left out: 20 mean.p - 10 |p|^2).
    protos = np.array(PROTOTYPES, dtype=np.float32)
    table = np.zeros((len(vocab), len(COLORS)), dtype=np.float32)
    for w, (c, strength) in WORDS.items():
        table[vocab[w], c] = strength
    inits = [numpy_helper.from_array((20 * protos.T).astype(np.float32), "P"),
             numpy_helper.from_array((-10 * (protos ** 2).sum(1)).astype(np.float32), "PB"),
             numpy_helper.from_array(table, "E"),
             numpy_helper.from_array(np.array([2], dtype=np.int64), "AX2"),
             numpy_helper.from_array(np.array([1], dtype=np.int64), "AX1"),
             numpy_helper.from_array(np.array(1e-9, dtype=np.float32), "EPS")]
    nodes = [
        helper.make_node("ReduceMean", ["PIXELS"], ["mean"], axes=[2, 3], keepdims=0),
        helper.make_node("MatMul", ["mean", "P"], ["dot"]),
        helper.make_node("Add", ["dot", "PB"], ["IMAGE_LOGITS"]),
        helper.make_node("Gather", ["E", "input_ids"], ["emb"]),
        helper.make_node("Cast", ["attention_mask"], ["maskf"], to=TensorProto.FLOAT),
        helper.make_node("Unsqueeze", ["maskf", "AX2"], ["mask3"]),
        helper.make_node("Mul", ["emb", "mask3"], ["masked"]),
        helper.make_node("ReduceSum", ["masked", "AX1"], ["summed"], keepdims=0),
        helper.make_node("ReduceSum", ["maskf", "AX1"], ["count"], keepdims=1),
        helper.make_node("Max", ["count", "EPS"], ["safe"]),
        helper.make_node("Div", ["summed", "safe"], ["TEXT_LOGITS"]),
    ]
    io = helper.make_tensor_value_info
    inputs = [io("PIXELS", TensorProto.FLOAT, ["batch", 3, 32, 32]), io("input_ids", TensorProto.INT64, ["batch", 8]),
              io("attention_mask", TensorProto.INT64, ["batch", 8])]
    outputs = [io("IMAGE_LOGITS", TensorProto.FLOAT, ["batch", 5]), io("TEXT_LOGITS", TensorProto.FLOAT, ["batch", 5])]
    save(helper.make_graph(nodes, "color_match_onnx", inputs, outputs, initializer=inits), "color_match_onnx")
    with open(os.path.join(HERE, "color_match_label", "labels.txt"), "w") as f:
        f.write("".join(c + "\n" for c in COLORS))


def text_embedding():
    import shutil

    import numpy as np
    from onnx import numpy_helper
    src = os.path.join(HERE, "color_match_text", "1", "tokenizer.json")
    os.makedirs(os.path.join(HERE, "text_embedding_tokens", "1"), exist_ok=True)
    shutil.copy(src, os.path.join(HERE, "text_embedding_tokens", "1", "tokenizer.json"))
    vocab = 2 + len(WORDS)
    table = np.random.default_rng(7).standard_normal((vocab, 8)).astype(np.float32)
    nodes = [helper.make_node("Gather", ["E", "input_ids"], ["HIDDEN"])]
    io = helper.make_tensor_value_info
    inputs = [io("input_ids", TensorProto.INT64, ["batch", 16])]
    outputs = [io("HIDDEN", TensorProto.FLOAT, ["batch", 16, 8])]
    graph = helper.make_graph(nodes, "text_embedding_onnx", inputs, outputs, initializer=[numpy_helper.from_array(table, "E")])
    save(graph, "text_embedding_onnx")


if __name__ == "__main__":
    add_sub("simple", TensorProto.INT32)
    add_sub("simple_string", TensorProto.STRING, cast_through=TensorProto.INT32)
    linear("text_classifier_onnx")
    color_match()
    text_embedding()
