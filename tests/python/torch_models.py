"""Makes the PyTorch test models with the official PyTorch (run by FERRY_TORCH_PYTHON, not by the
test's own Python): TorchScript models in a Triton repository, and for each the
inputs and the outputs PyTorch itself computes in-process (`expected.npz`), for the tests to
compare ferry's answers with.

    python torch_models.py <repository>
"""
import os
import sys
from typing import List

import numpy as np
import torch

torch.manual_seed(0)
np.random.seed(0)


class Mlp(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(16, 32)
        self.b = torch.nn.Linear(32, 4)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


class Cnn(torch.nn.Module):
    """Conv and batch norm over an image of any size, pooled to 8 features."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.bn = torch.nn.BatchNorm2d(8)
        self.bn.running_mean.uniform_(-0.5, 0.5)
        self.bn.running_var.uniform_(0.5, 1.5)

    def forward(self, x):
        return torch.relu(self.bn(self.conv(x))).mean(dim=(2, 3))


class Two(torch.nn.Module):
    """Inputs named by forward's arguments, two outputs."""

    def forward(self, count: torch.Tensor, scale: torch.Tensor):
        return count + scale, count * scale


class Accumulate(torch.nn.Module):
    """A running sum kept in the sequence batcher's implicit state."""

    def forward(self, x, total):
        return x + total, x + total


class Keyed(torch.nn.Module):
    """Outputs in a dict, matched to the config by key."""

    def forward(self, x):
        return {"plus": x + 1, "double": (x * 2).double()}


class Pair(torch.nn.Module):
    def forward(self, a, b):
        return a + b


class Half(torch.nn.Module):
    def forward(self, x):
        return x * 2 + 1


class Words(torch.nn.Module):
    def forward(self, texts: List[str]) -> List[str]:
        return [t.upper() for t in texts]


class Stash(torch.nn.Module):
    """Keeps each input for the next call (state in an attribute)."""

    def __init__(self):
        super().__init__()
        self.prev = torch.zeros(4)

    def forward(self, x):
        out = self.prev.clone()
        self.prev = x
        return out


class Counter(torch.nn.Module):
    """Assigns an attribute on every call: instances sharing weights must not share it."""

    def __init__(self):
        super().__init__()
        self.last = torch.zeros(1, 4)

    def forward(self, x):
        self.last = x + 1.0
        return self.last


class IntDivide(torch.nn.Module):
    def forward(self, a, b):
        return torch.div(a, b, rounding_mode="trunc")


class Divmod(torch.nn.Module):
    """Python's divmod on ints: integer division by an operator of its own name."""

    def forward(self, x):
        q, r = divmod(int(x[0]), int(x[1]))
        return torch.tensor([q, r])


def truncate(a, b):
    return torch.div(a, b, rounding_mode="trunc")


class Forked(torch.nn.Module):
    """The division in work started by torch.jit.fork, a subgraph of its own."""

    def forward(self, a, b):
        return torch.jit.wait(torch.jit.fork(truncate, a, b))


class Views(torch.nn.Module):
    """Outputs that are views PyTorch resolves lazily: a negated view and an "efficient zero"."""

    def forward(self, x):
        return torch._neg_view(x), torch._efficientzerotensor([x.size(0)])


class NoWords(torch.nn.Module):
    def forward(self, x) -> List[str]:
        return []


def write(repo, name, config, files):
    os.makedirs(os.path.join(repo, name, "1"), exist_ok=True)
    with open(os.path.join(repo, name, "config.pbtxt"), "w") as f:
        f.write(f'name: "{name}"\n' + config)
    for file, save in files.items():
        save(os.path.join(repo, name, "1", file))


def main(repo):
    expected = {}
    mlp = Mlp().eval()
    x = np.random.rand(5, 16).astype(np.float32)
    write(repo, "mlp", '''platform: "pytorch_libtorch"
max_batch_size: 8
dynamic_batching { max_queue_delay_microseconds: 20000 }
instance_group [ { count: 1 kind: KIND_CPU } ]
parameters [ { key: "INTRA_OP_THREAD_COUNT" value { string_value: "1" } },
             { key: "ENABLE_WEIGHT_SHARING" value { string_value: "true" } } ]
input [ { name: "INPUT__0" data_type: TYPE_FP32 dims: [ 16 ] } ]
output [ { name: "OUTPUT__0" data_type: TYPE_FP32 dims: [ 4 ] } ]
''', {"model.pt": lambda p: torch.jit.trace(mlp, torch.from_numpy(x[:1])).save(p)})
    with torch.no_grad():
        expected["mlp_in"], expected["mlp_out"] = x, mlp(torch.from_numpy(x)).numpy()

    # A parameter that changes libtorch for the whole process: this one runs in a process of its own.
    write(repo, "mlp_jit", '''platform: "pytorch_libtorch"
max_batch_size: 8
parameters [ { key: "ENABLE_JIT_PROFILING" value { string_value: "false" } } ]
input [ { name: "INPUT__0" data_type: TYPE_FP32 dims: [ 16 ] } ]
output [ { name: "OUTPUT__0" data_type: TYPE_FP32 dims: [ 4 ] } ]
''', {"model.pt": lambda p: torch.jit.trace(mlp, torch.from_numpy(x[:1])).save(p)})

    write(repo, "stash", '''platform: "pytorch_libtorch"
max_batch_size: 0
input [ { name: "INPUT__0" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "OUTPUT__0" data_type: TYPE_FP32 dims: [ 4 ] } ]
''', {"model.pt": lambda p: torch.jit.script(Stash()).save(p)})
    write(repo, "counter", '''platform: "pytorch_libtorch"
max_batch_size: 0
instance_group [ { count: 4 kind: KIND_CPU } ]
parameters [ { key: "ENABLE_WEIGHT_SHARING" value { string_value: "true" } } ]
input [ { name: "INPUT__0" data_type: TYPE_FP32 dims: [ 1, 4 ] } ]
output [ { name: "OUTPUT__0" data_type: TYPE_FP32 dims: [ 1, 4 ] } ]
''', {"model.pt": lambda p: torch.jit.script(Counter()).save(p)})
    # Integer division faults the process on INT64_MIN / -1: it runs in a process of its own.
    for name, module, inputs in (("intdiv", IntDivide, 2), ("divmod", Divmod, 1), ("forked", Forked, 2)):
        tensors = ", ".join(f'{{ name: "INPUT__{i}" data_type: TYPE_INT64 dims: [ 2 ] }}' for i in range(inputs))
        write(repo, name, f'''platform: "pytorch_libtorch"
max_batch_size: 0
input [ {tensors} ]
output [ {{ name: "OUTPUT__0" data_type: TYPE_INT64 dims: [ 2 ] }} ]
''', {"model.pt": lambda p, m=module: torch.jit.script(m()).save(p)})
    write(repo, "views", '''platform: "pytorch_libtorch"
max_batch_size: 0
input [ { name: "INPUT__0" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "OUTPUT__0" data_type: TYPE_FP32 dims: [ 4 ] }, { name: "OUTPUT__1" data_type: TYPE_FP32 dims: [ 4 ] } ]
''', {"model.pt": lambda p: torch.jit.script(Views()).save(p)})
    write(repo, "nowords", '''platform: "pytorch_libtorch"
max_batch_size: 0
input [ { name: "INPUT__0" data_type: TYPE_FP32 dims: [ 1 ] } ]
output [ { name: "OUTPUT__0" data_type: TYPE_STRING dims: [ -1 ] } ]
''', {"model.pt": lambda p: torch.jit.script(NoWords()).save(p)})

    # The MLP as an ensemble step, warmed up before it serves.
    write(repo, "mlp_warm", '''platform: "pytorch_libtorch"
max_batch_size: 8
input [ { name: "INPUT__0" data_type: TYPE_FP32 dims: [ 16 ] } ]
output [ { name: "OUTPUT__0" data_type: TYPE_FP32 dims: [ 4 ] } ]
model_warmup [ { name: "ones" batch_size: 2 inputs { key: "INPUT__0" value { data_type: TYPE_FP32 dims: [ 16 ] random_data: true } } } ]
''', {"model.pt": lambda p: torch.jit.trace(mlp, torch.from_numpy(x[:1])).save(p)})
    os.makedirs(os.path.join(repo, "pipeline", "1"), exist_ok=True)
    with open(os.path.join(repo, "pipeline", "config.pbtxt"), "w") as f:
        f.write('''name: "pipeline"
platform: "ensemble"
max_batch_size: 8
input [ { name: "X" data_type: TYPE_FP32 dims: [ 16 ] } ]
output [ { name: "Y" data_type: TYPE_FP32 dims: [ 4 ] } ]
ensemble_scheduling { step [ { model_name: "mlp_warm" model_version: -1
  input_map { key: "INPUT__0" value: "X" } output_map { key: "OUTPUT__0" value: "Y" } } ] }
''')

    cnn = Cnn().eval()
    write(repo, "cnn", '''backend: "pytorch"
max_batch_size: 4
input [ { name: "INPUT__0" data_type: TYPE_FP32 dims: [ 3, -1, -1 ] } ]
output [ { name: "OUTPUT__0" data_type: TYPE_FP32 dims: [ 8 ] } ]
''', {"model.pt": lambda p: torch.jit.script(cnn).save(p)})
    # A warm-up sample the model itself fails on: the load fails (warm-up runs the model).
    write(repo, "cnn_cold", '''backend: "pytorch"
max_batch_size: 4
input [ { name: "INPUT__0" data_type: TYPE_FP32 dims: [ 3, -1, -1 ] } ]
output [ { name: "OUTPUT__0" data_type: TYPE_FP32 dims: [ 8 ] } ]
model_warmup [ { name: "empty" batch_size: 1 inputs { key: "INPUT__0" value { data_type: TYPE_FP32 dims: [ 3, 0, 4 ] zero_data: true } } } ]
''', {"model.pt": lambda p: torch.jit.script(cnn).save(p)})
    for k, (h, w) in enumerate([(12, 10), (7, 9)]):
        img = np.random.rand(2, 3, h, w).astype(np.float32)
        with torch.no_grad():
            expected[f"cnn_in{k}"], expected[f"cnn_out{k}"] = img, cnn(torch.from_numpy(img)).numpy()

    write(repo, "two", '''platform: "pytorch_libtorch"
max_batch_size: 0
input [ { name: "scale" data_type: TYPE_INT64 dims: [ 3 ] }, { name: "count" data_type: TYPE_INT64 dims: [ 3 ] } ]
output [ { name: "SUM__0" data_type: TYPE_INT64 dims: [ 3 ] }, { name: "PRODUCT__1" data_type: TYPE_INT64 dims: [ 3 ] } ]
''', {"model.pt": lambda p: torch.jit.script(Two()).save(p)})
    a, b = np.array([1, 2, 3], dtype=np.int64), np.array([10, -20, 1 << 40], dtype=np.int64)
    expected["two_count"], expected["two_scale"] = a, b
    expected["two_sum"], expected["two_product"] = [t.numpy() for t in Two()(torch.from_numpy(a), torch.from_numpy(b))]

    write(repo, "accumulate", '''platform: "pytorch_libtorch"
max_batch_size: 2
input [ { name: "INPUT__0" data_type: TYPE_FP32 dims: [ 1 ] } ]
output [ { name: "OUTPUT__0" data_type: TYPE_FP32 dims: [ 1 ] } ]
sequence_batching {
  max_sequence_idle_microseconds: 600000000
  state [ { input_name: "TOTAL__1" output_name: "TOTAL__1_OUT" data_type: TYPE_FP32 dims: [ 1 ]
            initial_state: { data_type: TYPE_FP32 dims: [ 1 ] zero_data: true name: "zero" } } ]
}
''', {"model.pt": lambda p: torch.jit.script(Accumulate()).save(p)})

    write(repo, "keyed", '''platform: "pytorch_libtorch"
max_batch_size: 4
input [ { name: "INPUT__0" data_type: TYPE_FP32 dims: [ 2 ] } ]
output [ { name: "double" data_type: TYPE_FP64 dims: [ 2 ] }, { name: "plus" data_type: TYPE_FP32 dims: [ 2 ] } ]
''', {"model.pt": lambda p: torch.jit.script(Keyed()).save(p)})
    # The config says FP32 where the model makes FP64: every request fails, naming both.
    write(repo, "mistyped", '''platform: "pytorch_libtorch"
max_batch_size: 4
input [ { name: "INPUT__0" data_type: TYPE_FP32 dims: [ 2 ] } ]
output [ { name: "double" data_type: TYPE_FP32 dims: [ 2 ] }, { name: "plus" data_type: TYPE_FP32 dims: [ 2 ] } ]
''', {"model.pt": lambda p: torch.jit.script(Keyed()).save(p)})
    # Three inputs for a forward of two: refused at load.
    write(repo, "miscounted", '''platform: "pytorch_libtorch"
max_batch_size: 0
input [ { name: "INPUT__0" data_type: TYPE_FP32 dims: [ 1 ] }, { name: "INPUT__1" data_type: TYPE_FP32 dims: [ 1 ] },
        { name: "INPUT__2" data_type: TYPE_FP32 dims: [ 1 ] } ]
output [ { name: "OUTPUT__0" data_type: TYPE_FP32 dims: [ 1 ] } ]
''', {"model.pt": lambda p: torch.jit.script(Pair()).save(p)})

    write(repo, "half", '''platform: "pytorch_libtorch"
max_batch_size: 4
dynamic_batching { }
input [ { name: "INPUT__0" data_type: TYPE_FP16 dims: [ 4 ] } ]
output [ { name: "OUTPUT__0" data_type: TYPE_FP16 dims: [ 4 ] } ]
''', {"model.pt": lambda p: torch.jit.script(Half()).save(p)})
    h = np.random.rand(3, 4).astype(np.float16)
    expected["half_in"], expected["half_out"] = h, Half()(torch.from_numpy(h)).numpy()

    # bfloat16 weights, inputs and outputs; the inputs bfloat16 values already (clients truncate).
    mlp16 = Mlp().eval().to(torch.bfloat16)
    write(repo, "mlp_bf16", '''platform: "pytorch_libtorch"
max_batch_size: 8
dynamic_batching { max_queue_delay_microseconds: 20000 }
input [ { name: "INPUT__0" data_type: TYPE_BF16 dims: [ 16 ] } ]
output [ { name: "OUTPUT__0" data_type: TYPE_BF16 dims: [ 4 ] } ]
''', {"model.pt": lambda p: torch.jit.trace(mlp16, torch.from_numpy(x[:1]).to(torch.bfloat16)).save(p)})
    x16 = torch.from_numpy(x).to(torch.bfloat16)
    with torch.no_grad():
        expected["bf16_in"], expected["bf16_out"] = x16.float().numpy(), mlp16(x16).float().numpy()

    write(repo, "words", '''platform: "pytorch_libtorch"
max_batch_size: 0
input [ { name: "INPUT__0" data_type: TYPE_STRING dims: [ -1 ] } ]
output [ { name: "OUTPUT__0" data_type: TYPE_STRING dims: [ -1 ] } ]
''', {"model.pt": lambda p: torch.jit.script(Words()).save(p)})

    write(repo, "corrupt", '''platform: "pytorch_libtorch"
max_batch_size: 0
input [ { name: "INPUT__0" data_type: TYPE_FP32 dims: [ 1 ] } ]
output [ { name: "OUTPUT__0" data_type: TYPE_FP32 dims: [ 1 ] } ]
''', {"model.pt": lambda p: open(p, "wb").write(b"PK\x03\x04 not a TorchScript archive")})

    np.savez(os.path.join(repo, "..", "expected.npz"), **expected)


if __name__ == "__main__":
    main(sys.argv[1])
