#!/usr/bin/env bash
# The reference models of ../shared/bench/REFERENCE.md (generated with its make_models.py), over HTTP
# and gRPC at concurrency 1, 4, 16 and 64, with dynamic batching on (their configs) and off, and
# ONNX Runtime in-process at the batch size ferry formed beside it (the ceiling).
set -euo pipefail
cd "$(dirname "$0")/.."
source bench/tools.sh
cargo build --release
generator="${MAKE_MODELS:-../shared/bench/make_models.py}"
ref=bench/.work/ref/model_repository
[ -d "$ref" ] || "$BENCH_PYTHON" "$generator" --out bench/.work/ref
off=bench/.work/ref_nobatch/model_repository
rm -rf "$off" && mkdir -p "$off"
for m in "$ref"/*/; do
  name=$(basename "$m")
  mkdir -p "$off/$name" && ln -s "$(realpath "$m/1")" "$off/$name/1"
  # Same config without the dynamic_batching block: each request runs alone.
  python3 -c "import re,sys; print(re.sub(r'dynamic_batching \{[^}]*\}\n', '', open(sys.argv[1]).read()), end='')" \
    "$m/config.pbtxt" > "$off/$name/config.pbtxt"
done
models="${MODELS:-identity_fp32,mlp_small,text_classifier,cnn_small}"
"$BENCH_PYTHON" bench/run.py --repo "$ref" --models "$models" --protocols http,grpc --concurrency 1,4,16,64 \
  --ceiling --title "Reference models, dynamic batching on" "$@"
"$BENCH_PYTHON" bench/run.py --repo "$off" --models "$models" --protocols http,grpc --concurrency 1,4,16,64 \
  --title "Reference models, dynamic batching off" "$@"
