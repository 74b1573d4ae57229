#!/usr/bin/env bash
# The fuzz targets of tests/fuzz.rs for longer than CI runs them: every decoder a client or a
# bucket reaches, and the shared-memory bookkeeping; no panic, allocations within their bounds.
#   bench/fuzz.sh [ITERATIONS]   (default 1,000,000 per target)
set -euo pipefail
cd "$(dirname "$0")/.."
FERRY_FUZZ_ITERS="${1:-1000000}" cargo test --release --test fuzz -- --nocapture 2>&1 | grep -E "inputs|test result|panicked"
