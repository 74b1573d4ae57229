#!/usr/bin/env bash
# The foundation benchmark: perf_analyzer over HTTP at concurrency 1, 4 and 16 on the example
# models, written to bench/RESULTS.md with the commit measured.
set -euo pipefail
cd "$(dirname "$0")/.."
source bench/tools.sh
cargo build --release
"$BENCH_PYTHON" bench/run.py --models simple,simple_string \
  --protocols http --concurrency 1,4,16 --title "Example models over HTTP" "$@"
