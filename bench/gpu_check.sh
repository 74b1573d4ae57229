#!/bin/bash
# The GPU proof, one script for a machine with an NVIDIA GPU and no network:
#   1. preflight: the driver (nvidia-smi), Python packages (numpy, onnx, onnxruntime-gpu, tritonclient,
#      pytest; installed from $WHEELS with --no-index when missing and given), ONNX Runtime's CUDA
#      provider able to start with the CUDA libraries already there, else with those of the nvidia-*
#      Python packages or $CUDA_LIBS brought along;
#   2. a smoke check: the same model on KIND_GPU and KIND_CPU, outputs compared, GPU memory;
#   3. the GPU tests (tests/python/test_gpu.py, test_gpu_device.py) against this binary;
#   4. the benchmark (bench/gpu_bench.py): ResNet-50- and BERT-base-shaped models, FP32 and FP16,
#      c1/16/64 over gRPC beside ONNX Runtime in-process, written to bench/RESULTS.md ("GPU").
#   FERRY_BIN=target/release/ferry [ORT_GPU_DIR=dir] [WHEELS=dir] [CUDA_LIBS=dir] bench/gpu_check.sh
# Writes $OUT/gpu_check.txt (and $OUT/RESULTS.md, the updated results file).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
OUT="${OUT:-bench/.work/gpu}"
mkdir -p "$OUT"
bin="${FERRY_BIN:-target/release/ferry}"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || { echo "no NVIDIA driver here"; exit 1; }
missing="$(python3 -c "
import importlib.util as u
print(' '.join(m for m in ('numpy', 'onnx', 'onnxruntime', 'tritonclient', 'pytest', 'grpc') if u.find_spec(m) is None))")"
if [ -n "$missing" ]; then
  if [ -n "${WHEELS:-}" ]; then
    python3 -m pip install -q --no-index --find-links "$WHEELS" numpy onnx onnxruntime-gpu 'tritonclient[all]' pytest || exit 1
  else
    echo "missing Python packages: $missing (give WHEELS=dir with their wheels)"; exit 1
  fi
fi
ort_dir="${ORT_GPU_DIR:-$(python3 -c "import onnxruntime, os; print(os.path.join(os.path.dirname(onnxruntime.__file__), 'capi'))")}"
lib="$(ls "$ort_dir"/libonnxruntime.so.* | head -n 1)"
cuda_libs="$(python3 -c "import glob, os, nvidia; print(':'.join(sorted({os.path.dirname(p) for d in nvidia.__path__ for p in glob.glob(os.path.join(d, '**', 'lib*.so*'), recursive=True)})))" 2>/dev/null)"
cuda_ok() {
  python3 -c "
import onnxruntime as ort, sys
s = ort.InferenceSession('examples/simple/1/model.onnx', providers=['CUDAExecutionProvider'])
sys.exit(0 if 'CUDAExecutionProvider' in s.get_providers() else 1)" 2>/dev/null
}
export LD_LIBRARY_PATH="${ort_dir}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
if cuda_ok; then
  echo "ONNX Runtime's CUDA provider starts with the CUDA libraries already on this machine"
else
  export LD_LIBRARY_PATH="${CUDA_LIBS:-}:${cuda_libs}:${LD_LIBRARY_PATH}"
  cuda_ok || { echo "ONNX Runtime's CUDA provider cannot start: bring CUDA_LIBS (cudart, cuBLAS, cuDNN for its CUDA major)"; exit 1; }
  echo "ONNX Runtime's CUDA provider starts with the libraries brought along"
fi
export FERRY_ORT_GPU="$lib"
repo=/tmp/ferry-gpu-repo
rm -rf "$repo"
python3 - "$repo" <<'PY'
import os, sys, numpy as np, onnx
from onnx import TensorProto, helper, numpy_helper
repo = sys.argv[1]
rng = np.random.default_rng(0)
w1 = (rng.standard_normal((2048, 2048)) / 45).astype(np.float32)
w2 = (rng.standard_normal((2048, 256)) / 45).astype(np.float32)
x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 2048])
y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 256])
nodes = [helper.make_node("MatMul", ["x", "w1"], ["h"]), helper.make_node("Relu", ["h"], ["r"]),
         helper.make_node("MatMul", ["r", "w2"], ["y"])]
graph = helper.make_graph(nodes, "mlp", [x], [y], initializer=[numpy_helper.from_array(w1, "w1"), numpy_helper.from_array(w2, "w2")])
model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]); model.ir_version = 8
for name, kind in (("mlp_gpu", "KIND_GPU"), ("mlp_cpu", "KIND_CPU")):
    os.makedirs(f"{repo}/{name}/1")
    onnx.save(model, f"{repo}/{name}/1/model.onnx")
    open(f"{repo}/{name}/config.pbtxt", "w").write(
        f'name: "{name}"\nmax_batch_size: 64\ninput [ {{ name: "x" data_type: TYPE_FP32 dims: [ 2048 ] }} ]\n'
        f'output [ {{ name: "y" data_type: TYPE_FP32 dims: [ 256 ] }} ]\n'
        f'instance_group [ {{ kind: {kind} count: 2 }} ]\ndynamic_batching {{ }}\n')
PY
mkdir -p "$repo/simple_gpu/1"
cp examples/simple/1/model.onnx "$repo/simple_gpu/1/"
sed 's/name: "simple"/name: "simple_gpu"/' examples/simple/config.pbtxt > "$repo/simple_gpu/config.pbtxt"
echo 'instance_group [ { kind: KIND_GPU count: 2 gpus: [ 0 ] } ]' >> "$repo/simple_gpu/config.pbtxt"
"$bin" serve --model-repository="$repo" --onnxruntime-library="$lib" --http-address=127.0.0.1 --http-port=18200 \
  --grpc-port=18201 --metrics-port=18202 > "$OUT/gpu_ferry.log" 2>&1 &
pid=$!
python3 - > "$OUT/gpu_check.txt" 2>&1 <<'PY'
import json, time, urllib.request, subprocess
import numpy as np
base = "http://127.0.0.1:18200"
def get(path):
    return urllib.request.urlopen(base + path, timeout=30).read().decode()
def infer(model, name, arr, dt="FP32"):
    body = {"inputs": [{"name": name, "shape": list(arr.shape), "datatype": dt, "data": arr.flatten().tolist()}]}
    req = urllib.request.Request(f"{base}/v2/models/{model}/infer", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    return json.loads(urllib.request.urlopen(req, timeout=60).read())
deadline = time.time() + 180
while True:
    try:
        if urllib.request.urlopen(base + "/v2/health/ready", timeout=2).status == 200: break
    except Exception:
        pass
    if time.time() > deadline:
        print("ferry did not become ready"); raise SystemExit(1)
    time.sleep(0.2)
print("ready; index:", get("/v2/repository/index"))
a = np.arange(16, dtype=np.int32).reshape(1, 16)
body = {"inputs": [{"name": "INPUT0", "shape": [1, 16], "datatype": "INT32", "data": a.flatten().tolist()},
                   {"name": "INPUT1", "shape": [1, 16], "datatype": "INT32", "data": [1] * 16}]}
req = urllib.request.Request(f"{base}/v2/models/simple_gpu/infer", data=json.dumps(body).encode())
out = {o["name"]: o["data"] for o in json.loads(urllib.request.urlopen(req).read())["outputs"]}
print("simple_gpu OUTPUT0 == INPUT0 + 1:", out["OUTPUT0"] == [v + 1 for v in range(16)])
x = np.random.default_rng(1).standard_normal((16, 2048)).astype(np.float32)
g = np.array(infer("mlp_gpu", "x", x)["outputs"][0]["data"], dtype=np.float32)
c = np.array(infer("mlp_cpu", "x", x)["outputs"][0]["data"], dtype=np.float32)
print("mlp gpu vs cpu: max abs diff", float(np.abs(g - c).max()), "max abs value", float(np.abs(c).max()),
      "allclose(rtol=1e-2, atol=1e-2):", bool(np.allclose(g, c, rtol=1e-2, atol=1e-2)))
for model in ("mlp_gpu", "mlp_cpu"):
    for _ in range(5): infer(model, "x", x)
    t = time.perf_counter(); n = 40
    for _ in range(n): infer(model, "x", x)
    print(f"{model}: {1000 * (time.perf_counter() - t) / n:.2f} ms per request of 16 rows (JSON, sequential)")
    s = json.loads(get(f"/v2/models/{model}/stats"))["model_stats"][0]
    ci = s["inference_stats"]["compute_infer"]
    print(f"{model}: server compute_infer {ci['ns'] / max(ci['count'], 1) / 1000:.0f} us per request over {ci['count']}")
m = urllib.request.urlopen("http://127.0.0.1:18202/metrics").read().decode()
print("\n".join(l for l in m.splitlines() if l.startswith("nv_gpu_memory_used_bytes") or l.startswith("nv_gpu_utilization")))
print(subprocess.run(["nvidia-smi", "--query-compute-apps=pid,process_name,used_memory", "--format=csv"], capture_output=True, text=True).stdout)
PY
echo "check exit $?" >> "$OUT/gpu_check.txt"
kill "$pid"; wait "$pid"
echo "ferry exit $?" >> "$OUT/gpu_check.txt"
grep -i "error\|warn\|cuda\|GPU visible" "$OUT/gpu_ferry.log" | head -20 >> "$OUT/gpu_check.txt"
FERRY_BIN="$bin" python3 -m pytest -q -p no:cacheprovider -rs tests/python/test_gpu.py tests/python/test_gpu_device.py \
  >> "$OUT/gpu_check.txt" 2>&1
echo "gpu tests exit $?" >> "$OUT/gpu_check.txt"
FERRY_BIN="$bin" python3 bench/gpu_bench.py >> "$OUT/gpu_check.txt" 2>&1
echo "gpu bench exit $?" >> "$OUT/gpu_check.txt"
cp bench/RESULTS.md "$OUT/RESULTS.md"
cat "$OUT/gpu_check.txt"
