#!/usr/bin/env bash
# Makes the official PyTorch from PyPI available to the PyTorch backend's tests: a venv with
# torch (and numpy) in a cache outside the checkout, built once per version and reused by later
# runs and clean clones on the same machine (the wheel and its CUDA library wheels are about
# 4 GB; no GPU is needed). FERRY_TORCH_PYTHON, when set, names a Python that has torch and skips
# all this. Sourced by scripts/test.sh; exports FERRY_TORCH_PYTHON.
set -euo pipefail
torch_version="2.15.0"
if [ -z "${FERRY_TORCH_PYTHON:-}" ]; then
  cache="${FERRY_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/ferry}"
  venv="$cache/torch-$torch_version"
  if [ ! -f "$venv/.ready" ]; then
    rm -rf "$venv"
    mkdir -p "$cache"
    python3 -m venv "$venv"
    "$venv/bin/python" -m pip install --quiet "torch==$torch_version" numpy
    touch "$venv/.ready"
  fi
  FERRY_TORCH_PYTHON="$venv/bin/python"
fi
export FERRY_TORCH_PYTHON
