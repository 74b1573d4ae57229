#!/bin/bash
# GPU checks on a machine with an NVIDIA GPU (run from the repository root, with a release build and
# Python with torch and onnxruntime): NVML metrics read by the real binary, idle and under load,
# and the clear refusal of KIND_GPU instance groups. Everything lands in $OUT (default bench/.work/gpu).
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/.." || exit 1
OUT="${OUT:-bench/.work/gpu}"
mkdir -p "$OUT"
bin="${FERRY_BIN:-target/release/ferry}"
rm -f /tmp/busy
nvidia-smi --query-gpu=name,uuid,memory.total,memory.used,utilization.gpu,power.draw,power.limit --format=csv > $OUT/nvidia-smi.csv 2>&1
get() { python3 -c "import sys,urllib.request; print(urllib.request.urlopen(sys.argv[1], timeout=5).read().decode())" "$1"; }
$bin serve --http-address=127.0.0.1 --http-port=18000 --grpc-port=18001 --metrics-port=18002 --metrics-interval-ms=500 > $OUT/ferry.log 2>&1 &
pid=$!
for _ in $(seq 150); do get http://127.0.0.1:18000/v2/health/ready >/dev/null 2>&1 && break; sleep 0.2; done
sleep 1.5
get http://127.0.0.1:18002/metrics > $OUT/metrics_idle.txt 2>&1
python3 - > $OUT/load.txt 2>&1 <<'PY' &
import time, torch
a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
b = a @ a; torch.cuda.synchronize(); open("/tmp/busy", "w").close()
end = time.time() + 8
n = 0
while time.time() < end:
    b = a @ a; n += 1
torch.cuda.synchronize(); print("matmuls", n)
PY
load=$!
for _ in $(seq 300); do [ -e /tmp/busy ] && break; sleep 0.1; done
sleep 3
get http://127.0.0.1:18002/metrics > $OUT/metrics_busy.txt 2>&1
nvidia-smi --query-gpu=utilization.gpu,memory.used,power.draw --format=csv >> $OUT/nvidia-smi.csv 2>&1
wait $load
get http://127.0.0.1:18000/v2/models/simple/infer > /dev/null 2>&1
kill $pid; wait $pid
# A KIND_GPU instance group: refused at load, naming the model and the reason.
mkdir -p /tmp/gpurepo/gpu_simple/1
cp examples/simple/1/model.onnx /tmp/gpurepo/gpu_simple/1/
sed -e 's/name: "simple"/name: "gpu_simple"/' examples/simple/config.pbtxt > /tmp/gpurepo/gpu_simple/config.pbtxt
printf 'instance_group [ { kind: KIND_GPU count: 1 gpus: [ 0 ] } ]\n' >> /tmp/gpurepo/gpu_simple/config.pbtxt
timeout 60 $bin serve --model-repository=/tmp/gpurepo --http-port=18100 --grpc-port=18101 --metrics-port=18102 > $OUT/gpu_model.log 2>&1
echo "exit $?" >> $OUT/gpu_model.log
grep -c . $OUT/metrics_idle.txt; grep '^nv_gpu\|^nv_energy' $OUT/metrics_idle.txt $OUT/metrics_busy.txt; tail -3 $OUT/gpu_model.log; cat $OUT/nvidia-smi.csv $OUT/load.txt
