#!/usr/bin/env bash
# The reference models of ../shared/bench/REFERENCE.md (generated with its make_models.py), over HTTP
# and gRPC at concurrency 1, 4, 16 and 64, with dynamic batching on (their configs) and off, and
# ONNX Runtime in-process at the batch size ferry formed beside it (the ceiling).
set -euo pipefail
cd "$(dirname "$0")/.."
source bench/tools.sh
cargo build --release
source bench/ref_repos.sh
models="${MODELS:-identity_fp32,mlp_small,text_classifier,cnn_small}"
"$BENCH_PYTHON" bench/run.py --repo "$REF_ON" --models "$models" --protocols http,grpc --concurrency 1,4,16,64 \
  --ceiling --title "Reference models, dynamic batching on" "$@"
"$BENCH_PYTHON" bench/run.py --repo "$REF_OFF" --models "$models" --protocols http,grpc --concurrency 1,4,16,64 \
  --title "Reference models, dynamic batching off" "$@"
