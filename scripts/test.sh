#!/usr/bin/env bash
# The whole test suite: formatting and lints, Rust unit tests, then the integration tests that start
# the real binary on 127.0.0.1 port 0 and drive it with the official Python clients.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/venv.sh
source bench/tools.sh
source scripts/redis.sh
# Headless Chromium (Debian's) for the tests that open HTML pages in a real browser.
source scripts/chromium.sh
# PyTorch from PyPI for the PyTorch backend's tests (about 4 GB, cached outside the checkout);
# FERRY_SKIP_TORCH=1 leaves it out (those tests then skip).
if [ "${FERRY_SKIP_TORCH:-}" != 1 ]; then source scripts/torch.sh; fi
# TensorFlow (CPU) from PyPI, which the TensorFlow tests save their models with (about 270 MB,
# cached outside the checkout); FERRY_SKIP_TF=1 leaves it out (those tests then skip).
if [ "${FERRY_SKIP_TF:-}" != 1 ]; then source scripts/tensorflow.sh; fi
cargo fmt --all -- --check
cargo clippy --all-targets --locked -- -D warnings
cargo test --locked
cargo build --locked
FERRY_BIN="$PWD/target/debug/ferry" python -m pytest tests/python -q "$@"
