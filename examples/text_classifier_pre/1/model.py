"""Text -> features: counts of each character's code modulo 16, normalised to sum 1."""
import numpy as np
import triton_python_backend_utils as pb_utils


def features(text):
    counts = np.bincount(np.frombuffer(text.lower(), dtype=np.uint8) % 16, minlength=16).astype(np.float32)
    return counts / max(counts.sum(), 1.0)


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            texts = pb_utils.get_input_tensor_by_name(request, "TEXT").as_numpy().reshape(-1)
            out = np.stack([features(t) for t in texts])
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("FEATURES", out)]))
        return responses
