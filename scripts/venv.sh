#!/usr/bin/env bash
# Creates .venv with tests/requirements.txt (once per change of that file) and prints the path of
# the ONNX Runtime library it holds. Sourced by the other scripts.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$root/.venv"
stamp="$venv/.requirements"
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
fi
if ! cmp -s "$root/tests/requirements.txt" "$stamp"; then
  "$venv/bin/python" -m pip install --quiet --upgrade pip
  "$venv/bin/python" -m pip install --quiet -r "$root/tests/requirements.txt"
  cp "$root/tests/requirements.txt" "$stamp"
fi
ORT_DYLIB_PATH="$("$venv/bin/python" -c 'import glob, os, onnxruntime; print(sorted(glob.glob(os.path.join(os.path.dirname(onnxruntime.__file__), "capi", "libonnxruntime.so*")))[-1])')"
export ORT_DYLIB_PATH
export PATH="$venv/bin:$PATH"
