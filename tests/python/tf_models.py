"""Writes the TensorFlow test models, run by FERRY_TF_PYTHON (a Python with tensorflow):

    python tf_models.py REPO

into REPO: `scorer` (a tf.Module SavedModel with two inputs and two outputs by signature name),
`two_signatures` (the same module with a second signature, served by TF_SIGNATURE_DEF),
`scorer_graphdef` (the same function frozen into a GraphDef), `keras_cnn` (a Keras CNN exported as
a SavedModel, its config left to auto-complete) and `keras_cnn_bf16` (the same, at OpenVINO's
default precision); and REPO/../tf_expected.npz with TensorFlow's own outputs."""
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

REPO = sys.argv[1]
RNG = np.random.default_rng(5)


class Scorer(tf.Module):
    def __init__(self):
        super().__init__()
        self.w = tf.Variable(RNG.normal(size=(4, 3)).astype(np.float32))

    @tf.function(input_signature=[tf.TensorSpec([None, 4], tf.float32, name="features"),
                                  tf.TensorSpec([None, 2], tf.int64, name="ids")])
    def __call__(self, features, ids):
        return {"scores": tf.nn.softmax(features @ self.w), "doubled": ids * 2 + 1}

    @tf.function(input_signature=[tf.TensorSpec([None, 4], tf.float32, name="x")])
    def predict(self, x):
        return {"total": tf.reduce_sum(x @ self.w, axis=1, keepdims=True) * 3.0}


def write(name, text):
    os.makedirs(os.path.join(REPO, name, "1"), exist_ok=True)
    with open(os.path.join(REPO, name, "config.pbtxt"), "w") as f:
        f.write(text)


def main():
    expected = {}
    features = RNG.normal(size=(5, 4)).astype(np.float32)
    ids = RNG.integers(0, 1000, size=(5, 2)).astype(np.int64)
    expected["features"], expected["ids"] = features, ids
    m = Scorer()
    out = m(features, ids)
    expected["scores"], expected["doubled"] = out["scores"].numpy(), out["doubled"].numpy()
    write("scorer", '''platform: "tensorflow_savedmodel"
max_batch_size: 8
dynamic_batching { max_queue_delay_microseconds: 20000 }
input [{ name: "features" data_type: TYPE_FP32 dims: [ 4 ] }, { name: "ids" data_type: TYPE_INT64 dims: [ 2 ] }]
output [{ name: "scores" data_type: TYPE_FP32 dims: [ 3 ] }, { name: "doubled" data_type: TYPE_INT64 dims: [ 2 ] }]
''')
    tf.saved_model.save(m, os.path.join(REPO, "scorer", "1", "model.savedmodel"), signatures={"serving_default": m.__call__})
    # Two signatures; the config serves the other one (TF_SIGNATURE_DEF), its inputs and outputs
    # auto-completed from that signature.
    write("two_signatures", 'platform: "tensorflow_savedmodel"\nmax_batch_size: 8\n'
          'parameters { key: "TF_SIGNATURE_DEF" value: { string_value: "predict" } }\n')
    tf.saved_model.save(m, os.path.join(REPO, "two_signatures", "1", "model.savedmodel"),
                        signatures={"serving_default": m.__call__, "predict": m.predict})
    expected["total"] = m.predict(features)["total"].numpy()

    from tensorflow.python.framework.convert_to_constants import convert_variables_to_constants_v2
    frozen = convert_variables_to_constants_v2(m.__call__.get_concrete_function())
    outputs = {k: v.name.split(":")[0] for k, v in zip(sorted(out), frozen.outputs)}
    # The frozen graph's outputs are its Identity nodes, in the signature's (sorted) order.
    write("scorer_graphdef", f'''platform: "tensorflow_graphdef"
max_batch_size: 8
input [{{ name: "features" data_type: TYPE_FP32 dims: [ 4 ] }}, {{ name: "ids" data_type: TYPE_INT64 dims: [ 2 ] }}]
output [{{ name: "{outputs['doubled']}" data_type: TYPE_INT64 dims: [ 2 ] }},
        {{ name: "{outputs['scores']}" data_type: TYPE_FP32 dims: [ 3 ] }}]
''')
    tf.io.write_graph(frozen.graph.as_graph_def(), os.path.join(REPO, "scorer_graphdef", "1"), "model.graphdef",
                      as_text=False)
    expected["graphdef_names"] = np.array([outputs["doubled"], outputs["scores"]])

    tf.keras.utils.set_random_seed(3)
    image = tf.keras.Input(shape=(16, 16, 3), name="image")
    x = tf.keras.layers.Conv2D(8, 3, padding="same", activation="relu")(image)
    x = tf.keras.layers.BatchNormalization()(x)
    x = tf.keras.layers.GlobalAveragePooling2D()(x)
    logits = tf.keras.layers.Dense(5, name="logits")(x)
    model = tf.keras.Model(image, logits)
    images = RNG.normal(size=(6, 16, 16, 3)).astype(np.float32)
    expected["images"], expected["logits"] = images, model(images, training=False).numpy()
    for name, precision in (("keras_cnn", None), ("keras_cnn_bf16", "bf16")):
        extra = (f'parameters {{ key: "INFERENCE_PRECISION_HINT" value: {{ string_value: "{precision}" }} }}\n'
                 if precision else "")
        write(name, f'platform: "tensorflow_savedmodel"\nmax_batch_size: 8\n{extra}')
        model.export(os.path.join(REPO, name, "1", "model.savedmodel"), verbose=False)
    np.savez(os.path.join(REPO, "..", "tf_expected.npz"), **expected)


if __name__ == "__main__":
    main()
