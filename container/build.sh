#!/usr/bin/env bash
# Builds ferry's image.
#   container/build.sh [--tag ferry:latest]              build everything inside Docker (needs the
#                                                        rust and distroless base images)
#   container/build.sh --from-host [--debug | --binary PATH] [--tag T]
#                                                        use this machine's cargo build and the
#                                                        ONNX Runtime library of .venv; with base
#                                                        images built by container/bases.sh when
#                                                        the engine cannot pull
#   add --gpu for the GPU image: onnxruntime-gpu and the CUDA runtime libraries it links, from PyPI;
#     --cuda 13 (default: onnxruntime-gpu 1.31.1, NVIDIA driver >= 580) or --cuda 12 (onnxruntime-gpu
#     1.26.0, the last built for CUDA 12: driver >= 525, what older SageMaker and Vertex hosts run)
#   add --python for the Python image (container/Dockerfile.python, tag ferry:python by default):
#                                                        the same on a Python base with numpy
#   add --pytorch [--torch VERSION] for the PyTorch image (tag ferry:pytorch by default): the
#     Python image with the official PyTorch from PyPI (default 2.15.0, the version the tests use)
#     and the CUDA library wheels it needs even on a CPU; with --gpu, the GPU image's ONNX Runtime
#     too. Wheels downloaded on the host are kept in container/.work/ for the next build.
# Prints the image's size.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
tag=""
from_host=false
python=false
pytorch=false
torch_version=2.15.0
profile=release
binary=""
gpu=false
cuda=13
while [ $# -gt 0 ]; do
  case "$1" in
    --tag) tag="$2"; shift 2 ;;
    --from-host) from_host=true; shift ;;
    --debug) profile=debug; shift ;;
    --binary) binary="$2"; shift 2 ;;
    --gpu) gpu=true; shift ;;
    --cuda) cuda="$2"; shift 2 ;;
    --python) python=true; shift ;;
    --pytorch) python=true; pytorch=true; shift ;;
    --torch) torch_version="$2"; shift 2 ;;
    *) echo "unknown argument $1" >&2; exit 2 ;;
  esac
done
# What the GPU image carries besides ONNX Runtime: the CUDA libraries its CUDA provider links or
# opens (cuDNN for convolutions, nvrtc for fused kernels), for the CUDA major version asked for.
case "$cuda" in
  13) ort_gpu_version=1.31.1
      cuda_packages="nvidia-cuda-runtime==13.* nvidia-cublas==13.* nvidia-curand==10.* nvidia-cufft==12.* nvidia-cudnn-cu13==9.* nvidia-cuda-nvrtc==13.*" ;;
  12) ort_gpu_version=1.26.0
      cuda_packages="nvidia-cuda-runtime-cu12==12.* nvidia-cublas-cu12==12.* nvidia-curand-cu12==10.* nvidia-cufft-cu12==11.* nvidia-cudnn-cu12==9.* nvidia-cuda-nvrtc-cu12==12.*" ;;
  *) echo "--cuda takes 12 or 13, got '$cuda'" >&2; exit 2 ;;
esac
if [ -z "$tag" ]; then
  if $pytorch; then tag="ferry:pytorch"; elif $python; then tag="ferry:python"; else tag="ferry:latest"; fi
fi
python_packages=""
if $pytorch; then python_packages="torch==${torch_version}"; fi
# The Python image starts from the plain one, built first under a tag of its own.
final_tag="$tag"
if $python; then tag="ferry.local/for-python:build"; fi
find container/prebuilt -mindepth 1 ! -name README.md -delete
args=(--pull=false)
if $from_host; then
  source scripts/venv.sh
  if [ -n "$binary" ]; then
    cp "$binary" container/prebuilt/ferry
  else
    if [ "$profile" = release ]; then cargo build --release --locked; else cargo build --locked; fi
    cp "target/$profile/ferry" container/prebuilt/ferry
  fi
  if [ "$profile" = release ]; then strip container/prebuilt/ferry; fi
  if $gpu; then
    rm -rf container/.work/wheels
    # shellcheck disable=SC2086 # the package list splits on purpose
    python3 -m pip download -q --no-deps --only-binary=:all: --platform manylinux_2_28_x86_64 \
      --platform manylinux_2_27_x86_64 --platform manylinux2014_x86_64 --python-version 3.11 \
      "onnxruntime-gpu==${ort_gpu_version}" $cuda_packages -d container/.work/wheels
    rm -rf container/.work/unpacked
    for w in container/.work/wheels/*.whl; do python3 -m zipfile -e "$w" container/.work/unpacked; done
    cp -P container/.work/unpacked/onnxruntime/capi/libonnxruntime*.so* container/prebuilt/
    rm -f container/prebuilt/libonnxruntime_providers_tensorrt.so
    find container/.work/unpacked/nvidia -name 'lib*.so*' ! -name 'libcufftw*' ! -name 'libnvblas*' -exec cp {} container/prebuilt/ \;
  else
    cp "$ORT_DYLIB_PATH" container/prebuilt/
  fi
  bash container/bases.sh
  args+=(--build-arg BUILDER=ferry.local/builder:bookworm)
fi
if $gpu && ! $from_host; then
  args+=(--build-arg ONNXRUNTIME_PACKAGE=onnxruntime-gpu --build-arg "ONNXRUNTIME_VERSION=${ort_gpu_version}"
         --build-arg "CUDA_PACKAGES=${cuda_packages}")
fi
docker build "${args[@]}" -f container/Dockerfile -t "$tag" .
find container/prebuilt -mindepth 1 ! -name README.md -delete
if $python; then
  if $from_host; then
    # The wheels for the base's Python (numpy; PyTorch and what it depends on), so the build
    # needs no index; kept per package list, as PyTorch's are about 4 GB.
    wheels="container/.work/wheels-$(echo "numpy $python_packages" | tr -c 'A-Za-z0-9.\n' '_')"
    if [ ! -f "$wheels/.ready" ]; then
      rm -rf "$wheels"
      # Every manylinux tag the base's glibc (Debian 12: 2.36) runs.
      platforms=(--platform manylinux2014_x86_64)
      for minor in $(seq 17 36); do platforms+=(--platform "manylinux_2_${minor}_x86_64"); done
      # shellcheck disable=SC2086 # the package list splits on purpose
      python3 -m pip download -q --only-binary=:all: "${platforms[@]}" --python-version 3.11 \
        numpy $python_packages -d "$wheels"
      touch "$wheels/.ready"
    fi
    mkdir -p container/prebuilt/wheels
    cp -al "$wheels"/*.whl container/prebuilt/wheels/ 2>/dev/null || cp "$wheels"/*.whl container/prebuilt/wheels/
    bash container/bases.sh --python
  fi
  docker build --pull=false --build-arg FERRY="$tag" --build-arg "PYTHON_PACKAGES=$python_packages" \
    -f container/Dockerfile.python -t "$final_tag" .
  find container/prebuilt -mindepth 1 ! -name README.md -delete
  docker rmi -f "$tag" >/dev/null
  tag="$final_tag"
fi
docker image inspect -f '{{.Size}}' "$tag" | awk -v t="$tag" '{printf "%s: %.1f MB\n", t, $1/1e6}'
