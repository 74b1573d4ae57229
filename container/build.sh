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
#     too. With --from-host the packages are installed by this machine's pip (nothing is cached).
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
    host_ferry="$binary"
  else
    if [ "$profile" = release ]; then cargo build --release --locked; else cargo build --locked; fi
    host_ferry="target/$profile/ferry"
  fi
  cp "$host_ferry" container/prebuilt/ferry
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
dangling_before="$(docker images -q -f dangling=true | sort)"
docker build "${args[@]}" -f container/Dockerfile -t "$tag" .
find container/prebuilt -mindepth 1 ! -name README.md -delete
if $python; then
  packages="numpy $python_packages"
  python_args=(--build-arg "PYTHON_PACKAGES=$packages")
  if $from_host; then
    bash container/bases.sh --python
    python_base=docker.io/library/python:3.11-slim-bookworm
    with_packages=ferry.local/python-packages:build
    # The packages are installed here, by this machine's pip for the base's Python (its version,
    # every manylinux tag its glibc runs: Debian 12's 2.36), into a copy of the base's file system
    # that is imported as the one image the Python image starts from: nothing is downloaded or
    # copied twice (PyTorch installs as about 5.5 GB), and the build needs no index.
    stage="$root/container/.work/python-root"
    trap 'rm -rf "$stage"' EXIT
    rm -rf "$stage" && mkdir -p "$stage"
    cid="$(docker create "$python_base" /bin/sh)"
    docker export "$cid" | tar -C "$stage" --numeric-owner -x
    docker rm "$cid" >/dev/null
    read -r site pyver < <(docker run --rm --entrypoint python3 "$python_base" -c \
      'import sys, sysconfig; print(sysconfig.get_paths()["purelib"], "%d.%d" % sys.version_info[:2])')
    platforms=(--platform manylinux2014_x86_64)
    for minor in $(seq 17 36); do platforms+=(--platform "manylinux_2_${minor}_x86_64"); done
    # shellcheck disable=SC2086 # the package list splits on purpose
    python3 -m pip install -q --no-cache-dir --only-binary=:all: "${platforms[@]}" --python-version "$pyver" \
      --implementation cp --target "$stage$site" $packages
    # Console scripts name this machine's interpreter; the image runs its packages as modules.
    rm -rf "${stage:?}$site/bin"
    # ferry's TorchScript shim, compiled here against the image's own PyTorch (the image has no
    # compiler), so TorchScript runs inside the server there too; without a compiler here the
    # image runs TorchScript in processes.
    if $pytorch && command -v "${CXX:-c++}" >/dev/null; then
      version="$(sed -n "s/^__version__ = '\(.*\)'/\1/p" "$stage$site/torch/version.py")"
      "$host_ferry" __torchscript-shim "$stage$site/torch/lib/libtorch_cpu.so" \
        "container/prebuilt/libferry_torchscript-${version}.so"
    fi
    # The base's environment (PATH, LANG…) carries over; `docker import` starts with none.
    changes=()
    while IFS= read -r e; do
      [ -n "$e" ] && changes+=(--change "ENV ${e%%=*}=\"${e#*=}\"")
    done < <(docker image inspect -f '{{range .Config.Env}}{{println .}}{{end}}' "$python_base")
    # Each file leaves the copy once it is in the stream, so the disk never holds the packages twice.
    tar -C "$stage" --numeric-owner --remove-files -c . | docker import "${changes[@]}" - "$with_packages" >/dev/null
    rm -rf "$stage"
    python_args=(--build-arg "PYTHON_BASE=$with_packages" --build-arg PYTHON_PACKAGES=)
  fi
  docker build --pull=false --build-arg FERRY="$tag" "${python_args[@]}" \
    -f container/Dockerfile.python -t "$final_tag" .
  find container/prebuilt -mindepth 1 ! -name README.md -delete
  docker rmi -f "$tag" >/dev/null
  if $from_host; then docker rmi "$with_packages" >/dev/null; fi
  tag="$final_tag"
fi
# The build stages' images are left untagged (the Python image's would keep the packages' layers
# after the image goes): those this build left are removed.
comm -13 <(echo "$dangling_before") <(docker images -q -f dangling=true | sort) | xargs -r docker rmi >/dev/null
docker image inspect -f '{{.Size}}' "$tag" | awk -v t="$tag" '{printf "%s: %.1f MB\n", t, $1/1e6}'
