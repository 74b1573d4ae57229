#!/usr/bin/env bash
# Builds ferry (release) and serves the embedded example repository on port 8000, with ONNX Runtime
# from PyPI. Extra arguments go to `ferry serve`.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/venv.sh
cargo build --release
exec target/release/ferry serve "$@"
