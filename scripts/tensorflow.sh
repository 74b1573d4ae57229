#!/usr/bin/env bash
# Makes the official TensorFlow (CPU) from PyPI available to the TensorFlow tests, which save
# SavedModels and GraphDefs with it: a cached venv (scripts/cached_venv.sh; the wheel is about
# 270 MB). The server itself never loads TensorFlow (OpenVINO reads the models). FERRY_TF_PYTHON,
# when set, names a Python that has tensorflow and skips all this. Sourced by scripts/test.sh;
# exports FERRY_TF_PYTHON.
set -euo pipefail
tf_version="2.21.0"
if [ -z "${FERRY_TF_PYTHON:-}" ]; then
  source "$(dirname "${BASH_SOURCE[0]}")/cached_venv.sh"
  FERRY_TF_PYTHON="$(cached_venv "tensorflow-$tf_version" "tensorflow-cpu==$tf_version" numpy)"
fi
export FERRY_TF_PYTHON
