#!/usr/bin/env bash
# Makes the official PyTorch from PyPI available to the PyTorch backend's tests: a cached venv
# with torch and numpy (scripts/cached_venv.sh; the wheel and its CUDA library wheels are about
# 4 GB; no GPU is needed). FERRY_TORCH_PYTHON, when set, names a Python that has torch and skips
# all this. Sourced by scripts/test.sh; exports FERRY_TORCH_PYTHON.
set -euo pipefail
torch_version="2.15.0"
if [ -z "${FERRY_TORCH_PYTHON:-}" ]; then
  source "$(dirname "${BASH_SOURCE[0]}")/cached_venv.sh"
  FERRY_TORCH_PYTHON="$(cached_venv "torch-$torch_version" "torch==$torch_version" numpy)"
fi
export FERRY_TORCH_PYTHON
