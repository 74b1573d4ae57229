#!/usr/bin/env bash
# Server CPU per request on the light reference models at a fixed offered rate, over HTTP binary,
# HTTP JSON and gRPC, with dynamic batching on and off (bench/cost.py); --profile adds perf's top
# entries. Written to bench/RESULTS.md with the commit measured.
set -euo pipefail
cd "$(dirname "$0")/.."
source bench/tools.sh
cargo build --release
source bench/ref_repos.sh
# The test environment has the official clients (tritonclient's protobufs, grpcio).
source scripts/venv.sh >/dev/null
python bench/cost.py --on "$REF_ON" --off "$REF_OFF" "$@"
