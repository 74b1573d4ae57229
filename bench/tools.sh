#!/usr/bin/env bash
# Fetches the load generator into bench/.work (once): perf_analyzer from the tritonclient 2.50.0
# manylinux wheel on PyPI, the CUDA runtime library it links against (PyPI, used without a GPU),
# and Debian's libb64. Sourced by the benchmark scripts; exports PERF_ANALYZER.
set -euo pipefail
bench="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
work="$bench/.work"
mkdir -p "$work"
pa_dir="$work/tritonclient-2.50.0.data/data/bin"
if [ ! -x "$pa_dir/perf_analyzer" ]; then
  python3 -m pip download --quiet --no-deps --only-binary=:all: --platform manylinux1_x86_64 \
    tritonclient==2.50.0 -d "$work"
  (cd "$work" && python3 -m zipfile -e tritonclient-2.50.0-py3-none-manylinux1_x86_64.whl unpacked \
     && mkdir -p "$pa_dir" && cp unpacked/tritonclient-2.50.0.data/data/bin/perf_analyzer "$pa_dir/" \
     && rm -rf unpacked)
  chmod +x "$pa_dir/perf_analyzer"
fi
if [ ! -x "$work/venv/bin/python" ]; then
  python3 -m venv "$work/venv"
  "$work/venv/bin/pip" install --quiet nvidia-cuda-runtime-cu12 onnxruntime numpy onnx
fi
if ! ldconfig -p | grep -q libb64.so.0d; then
  if [ "$(id -u)" = 0 ]; then apt-get install -y -q libb64-0d >/dev/null; else
    echo "perf_analyzer needs Debian's libb64-0d: sudo apt-get install libb64-0d" >&2; exit 1; fi
fi
cudart="$(dirname "$(find "$work/venv" -name 'libcudart.so.12' | head -n 1)")"
export LD_LIBRARY_PATH="$cudart${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export PERF_ANALYZER="$pa_dir/perf_analyzer"
export BENCH_PYTHON="$work/venv/bin/python"
