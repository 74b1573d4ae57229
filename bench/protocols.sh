#!/usr/bin/env bash
# HTTP against gRPC: perf_analyzer at concurrency 1, 4, 16 and 64 on the example models, written to
# bench/RESULTS.md with the commit measured.
set -euo pipefail
cd "$(dirname "$0")/.."
source bench/tools.sh
cargo build --release
"$BENCH_PYTHON" bench/run.py --models simple,simple_string --protocols http,grpc \
  --concurrency 1,4,16,64 --title "Example models over HTTP and gRPC" "$@"
