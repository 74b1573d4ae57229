#!/usr/bin/env bash
# Makes the official TensorFlow (CPU) from PyPI available to the TensorFlow tests, which save
# SavedModels and GraphDefs with it: a venv in a cache outside the checkout, built once per version
# and reused by later runs and clean clones on the same machine (the wheel is about 270 MB). The
# server itself never loads TensorFlow (OpenVINO reads the models). FERRY_TF_PYTHON, when set,
# names a Python that has tensorflow and skips all this. Sourced by scripts/test.sh; exports
# FERRY_TF_PYTHON.
set -euo pipefail
tf_version="2.21.0"
if [ -z "${FERRY_TF_PYTHON:-}" ]; then
  cache="${FERRY_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/ferry}"
  venv="$cache/tensorflow-$tf_version"
  if [ ! -f "$venv/.ready" ]; then
    rm -rf "$venv"
    mkdir -p "$cache"
    python3 -m venv "$venv"
    "$venv/bin/python" -m pip install --quiet "tensorflow-cpu==$tf_version" numpy
    touch "$venv/.ready"
  fi
  FERRY_TF_PYTHON="$venv/bin/python"
fi
export FERRY_TF_PYTHON
