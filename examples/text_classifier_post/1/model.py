"""Logits -> label and score (softmax)."""
import numpy as np
import triton_python_backend_utils as pb_utils

LABELS = np.array([b"negative", b"neutral", b"positive"], dtype=np.object_)


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            logits = pb_utils.get_input_tensor_by_name(request, "LOGITS").as_numpy()
            exp = np.exp(logits - logits.max(axis=1, keepdims=True))
            probs = exp / exp.sum(axis=1, keepdims=True)
            best = probs.argmax(axis=1)
            responses.append(pb_utils.InferenceResponse([
                pb_utils.Tensor("LABEL", LABELS[best].reshape(-1, 1)),
                pb_utils.Tensor("SCORE", probs.max(axis=1).reshape(-1, 1).astype(np.float32)),
            ]))
        return responses
