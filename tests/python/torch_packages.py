"""Makes the AOTInductor test packages (`torch_aoti`, `model.pt2`) with the official PyTorch (run
by FERRY_TORCH_PYTHON): each exported with torch.export and compiled by
`torch._inductor.aoti_compile_and_package`, in a Triton repository, with the inputs and the outputs
the same model computes in-process (`expected.npz` beside the repository).

    python torch_packages.py <repository> [group ...]

The groups (all by default): mlp (mlp_aoti and the variants made from its package), cnn, two,
keyed, half, bf16, embed (indices checked inside a parallel kernel), inplace (writes its input),
divide (integer division).
"""
import io
import os
import shutil
import sys
import zipfile

import numpy as np
import torch
import torch.fx.experimental._config as fx_config

from torch_models import Cnn, Half, Keyed, Mlp, write

torch.manual_seed(1)
np.random.seed(1)


class Embed(torch.nn.Module):
    """Indices into a table: the generated kernel checks each index (inside an OpenMP region, for
    a large enough table)."""

    def __init__(self, rows, width):
        super().__init__()
        self.table = torch.nn.Embedding(rows, width)

    def forward(self, idx):
        return self.table(idx).sum(dim=1)


class InPlace(torch.nn.Module):
    """Writes its input before using it."""

    def forward(self, x):
        x.add_(100)
        return x * 2


class Divide(torch.nn.Module):
    """Integer division: a zero divisor is a hardware fault in the compiled kernel."""

    def forward(self, a, b):
        return torch.div(a, b, rounding_mode="trunc")


class Two(torch.nn.Module):
    """A positional and a keyword INT64 input, two outputs."""

    def forward(self, count, *, scale):
        return count + scale, count * scale


def package(repo, name, module, args, kwargs=None, dynamic=None, oblivious=True):
    """Exports and compiles `module`; the package's path."""
    # Without backed_size_oblivious, PyTorch starts a dynamic Dim at 2 (0/1 specialisation).
    with fx_config.patch(backed_size_oblivious=oblivious):
        ep = torch.export.export(module, args, kwargs=kwargs or {}, dynamic_shapes=dynamic)
        path = os.path.join(repo, f"{name}.pt2")
        torch._inductor.aoti_compile_and_package(ep, package_path=path)
    return path


def place(repo, name, config, path, copy=False):
    write(repo, name, config, {"model.pt2": lambda p: (shutil.copy if copy else os.replace)(path, p)})


def main(repo, groups):
    os.makedirs(repo, exist_ok=True)
    expected = {}
    batch = torch.export.Dim("batch", min=1, max=8)
    mlp = Mlp().eval()
    x = np.random.rand(6, 16).astype(np.float32)
    if "mlp" in groups:
        make_mlp(repo, mlp, x, batch, expected)
    if "cnn" in groups:
        make_cnn(repo, batch, expected)
    if "two" in groups:
        make_two(repo, expected)
    if "keyed" in groups:
        make_keyed(repo, batch, expected)
    if "half" in groups:
        make_half(repo, batch, expected)
    if "bf16" in groups:
        make_bf16(repo, x, batch, expected)
    if "embed" in groups:
        make_embed(repo, batch, expected)
    if "inplace" in groups:
        make_inplace(repo, batch, expected)
    if "divide" in groups:
        make_divide(repo, batch)
    np.savez(os.path.join(repo, "..", "expected.npz"), **expected)


def make_mlp(repo, mlp, x, batch, expected):
    mlp_pt2 = package(repo, "mlp", mlp, (torch.from_numpy(x[:2]),), dynamic={"x": {0: batch}})
    config = '''platform: "torch_aoti"
max_batch_size: 8
dynamic_batching {{ max_queue_delay_microseconds: 20000 }}
instance_group [ {{ count: {count} kind: KIND_CPU }} ]
parameters [ {{ key: "INTRA_OP_THREAD_COUNT" value {{ string_value: "1" }} }}{extra} ]
input [ {{ name: "ARGS[0]" data_type: TYPE_FP32 dims: [ 16 ] }} ]
output [ {{ name: "RESULT[0]" data_type: TYPE_FP32 dims: [ 4 ] }} ]
'''
    place(repo, "mlp_aoti", config.format(count=1, extra=""), mlp_pt2, copy=True)
    # Two instances, one copy of the weights.
    shared = ', { key: "ENABLE_WEIGHT_SHARING" value { string_value: "true" } }'
    place(repo, "mlp_shared", config.format(count=2, extra=shared), mlp_pt2, copy=True)
    # A model with its own Python environment runs in a PyTorch process instead.
    env = os.path.dirname(os.path.dirname(sys.executable))
    own = f', {{ key: "EXECUTION_ENV_PATH" value {{ string_value: "{env}" }} }}'
    place(repo, "mlp_process", config.format(count=1, extra=own), mlp_pt2, copy=True)
    with torch.no_grad():
        expected["mlp_in"], expected["mlp_out"] = x, mlp(torch.from_numpy(x)).numpy()
    # The compiled library cut short: its load fails, and only its own.
    with zipfile.ZipFile(mlp_pt2) as z:
        entries = {n: z.read(n) for n in z.namelist()}
    cut = io.BytesIO()
    with zipfile.ZipFile(cut, "w") as z:
        for n, data in entries.items():
            z.writestr(n, data[:len(data) // 20] if n.endswith(".so") else data)
    write(repo, "truncated", config.format(count=1, extra=""), {"model.pt2": lambda p: open(p, "wb").write(cut.getvalue())})
    write(repo, "corrupt", config.format(count=1, extra=""), {"model.pt2": lambda p: open(p, "wb").write(b"PK\x03\x04 no")})

    # Exported the plain way, its batch dimension starts at 2: single rows are padded.
    from2 = package(repo, "from2", mlp, (torch.from_numpy(x[:2]),), dynamic={"x": {0: batch}}, oblivious=False)
    place(repo, "mlp_from2", config.format(count=1, extra=""), from2)
    # Exported for one row only: max_batch_size 8 is refused at load, saying why.
    static = package(repo, "static", mlp, (torch.from_numpy(x[:1]),))
    place(repo, "mlp_static", config.format(count=1, extra=""), static)
    os.remove(mlp_pt2)


def make_cnn(repo, batch, expected):
    cnn = Cnn().eval()
    side = torch.export.Dim("side", min=4, max=64)
    other = torch.export.Dim("other", min=4, max=64)
    img = torch.rand(2, 3, 12, 10)
    path = package(repo, "cnn", cnn, (img,), dynamic={"x": {0: batch, 2: side, 3: other}})
    place(repo, "cnn_aoti", '''platform: "torch_aoti"
max_batch_size: 4
dynamic_batching { }
input [ { name: "INPUT__0" data_type: TYPE_FP32 dims: [ 3, -1, -1 ] } ]
output [ { name: "OUTPUT__0" data_type: TYPE_FP32 dims: [ 8 ] } ]
''', path)
    for k, (h, w) in enumerate([(12, 10), (7, 9)]):
        im = np.random.rand(2, 3, h, w).astype(np.float32)
        with torch.no_grad():
            expected[f"cnn_in{k}"], expected[f"cnn_out{k}"] = im, cnn(torch.from_numpy(im)).numpy()


def make_two(repo, expected):
    two = Two()
    a, b = np.array([1, 2, 3], dtype=np.int64), np.array([10, -20, 1 << 40], dtype=np.int64)
    path = package(repo, "two", two, (torch.from_numpy(a),), kwargs={"scale": torch.from_numpy(b)})
    place(repo, "two_aoti", '''platform: "torch_aoti"
max_batch_size: 0
input [ { name: "KWARGS[scale]" data_type: TYPE_INT64 dims: [ 3 ] }, { name: "ARGS[0]" data_type: TYPE_INT64 dims: [ 3 ] } ]
output [ { name: "PRODUCT__1" data_type: TYPE_INT64 dims: [ 3 ] }, { name: "SUM__0" data_type: TYPE_INT64 dims: [ 3 ] } ]
''', path)
    expected["two_count"], expected["two_scale"] = a, b
    expected["two_sum"], expected["two_product"] = [t.numpy() for t in two(torch.from_numpy(a), scale=torch.from_numpy(b))]


def make_keyed(repo, batch, expected):
    keyed = Keyed()
    k_in = np.random.rand(3, 2).astype(np.float32)
    path = package(repo, "keyed", keyed, (torch.from_numpy(k_in[:2]),), dynamic={"x": {0: batch}})
    place(repo, "keyed_aoti", '''platform: "torch_aoti"
max_batch_size: 4
input [ { name: "INPUT__0" data_type: TYPE_FP32 dims: [ 2 ] } ]
output [ { name: "double" data_type: TYPE_FP64 dims: [ 2 ] }, { name: "plus" data_type: TYPE_FP32 dims: [ 2 ] } ]
''', path)
    got = keyed(torch.from_numpy(k_in))
    expected["keyed_in"], expected["keyed_double"], expected["keyed_plus"] = k_in, got["double"].numpy(), got["plus"].numpy()


def make_half(repo, batch, expected):
    h = np.random.rand(3, 4).astype(np.float16)
    path = package(repo, "half", Half(), (torch.from_numpy(h[:2]),), dynamic={"x": {0: batch}})
    place(repo, "half_aoti", '''platform: "torch_aoti"
max_batch_size: 4
dynamic_batching { }
input [ { name: "INPUT__0" data_type: TYPE_FP16 dims: [ 4 ] } ]
output [ { name: "OUTPUT__0" data_type: TYPE_FP16 dims: [ 4 ] } ]
''', path)
    expected["half_in"], expected["half_out"] = h, Half()(torch.from_numpy(h)).numpy()


def make_bf16(repo, x, batch, expected):
    mlp16 = Mlp().eval().to(torch.bfloat16)
    x16 = torch.from_numpy(x).to(torch.bfloat16)
    path = package(repo, "bf16", mlp16, (x16[:2],), dynamic={"x": {0: batch}})
    place(repo, "bf16_aoti", '''platform: "torch_aoti"
max_batch_size: 8
input [ { name: "ARGS[0]" data_type: TYPE_BF16 dims: [ 16 ] } ]
output [ { name: "RESULT[0]" data_type: TYPE_BF16 dims: [ 4 ] } ]
''', path)
    with torch.no_grad():
        expected["bf16_in"], expected["bf16_out"] = x16.float().numpy(), mlp16(x16).float().numpy()


def make_embed(repo, batch, expected):
    # (name, table rows, width, indices per row): the small one's kernel is serial, the large
    # one's parallel.
    for name, rows, width, count in (("embed_small", 100, 8, 5), ("embed_parallel", 1000, 64, 32)):
        embed = Embed(rows, width).eval()
        idx = np.random.randint(0, rows, (3, count)).astype(np.int64)
        path = package(repo, name, embed, (torch.from_numpy(idx[:2]),), dynamic={"idx": {0: batch}})
        place(repo, name, f'''platform: "torch_aoti"
max_batch_size: 8
input [ {{ name: "INPUT__0" data_type: TYPE_INT64 dims: [ {count} ] }} ]
output [ {{ name: "OUTPUT__0" data_type: TYPE_FP32 dims: [ {width} ] }} ]
''', path)
        with torch.no_grad():
            expected[f"{name}_in"], expected[f"{name}_out"] = idx, embed(torch.from_numpy(idx)).numpy()


def make_inplace(repo, batch, expected):
    path = package(repo, "inplace", InPlace(), (torch.rand(2, 4),), dynamic={"x": {0: batch}})
    place(repo, "inplace_aoti", '''platform: "torch_aoti"
max_batch_size: 4
input [ { name: "INPUT__0" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "OUTPUT__0" data_type: TYPE_FP32 dims: [ 4 ] } ]
''', path)
    # Both steps read X: neither may see what the other's package wrote into its input.
    write(repo, "inplace_twice", '''platform: "ensemble"
max_batch_size: 4
input [ { name: "X" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "Y1" data_type: TYPE_FP32 dims: [ 4 ] }, { name: "Y2" data_type: TYPE_FP32 dims: [ 4 ] } ]
ensemble_scheduling { step [
  { model_name: "inplace_aoti" model_version: -1 input_map { key: "INPUT__0" value: "X" } output_map { key: "OUTPUT__0" value: "Y1" } },
  { model_name: "inplace_aoti" model_version: -1 input_map { key: "INPUT__0" value: "X" } output_map { key: "OUTPUT__0" value: "Y2" } }
] }
''', {})


def make_divide(repo, batch):
    a = torch.tensor([[7, -7, 9, 10]] * 2, dtype=torch.int64)
    path = package(repo, "divide", Divide(), (a, a.clone() + 1), dynamic={"a": {0: batch}, "b": {0: batch}})
    place(repo, "divide_aoti", '''platform: "torch_aoti"
max_batch_size: 4
input [ { name: "INPUT__0" data_type: TYPE_INT64 dims: [ 4 ] }, { name: "INPUT__1" data_type: TYPE_INT64 dims: [ 4 ] } ]
output [ { name: "OUTPUT__0" data_type: TYPE_INT64 dims: [ 4 ] } ]
''', path)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:] or ["mlp", "cnn", "two", "keyed", "half", "bf16", "embed", "inplace", "divide"])
