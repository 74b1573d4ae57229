#!/usr/bin/env bash
# Builds ferry's image.
#   container/build.sh [--tag ferry:latest]              build everything inside Docker (needs the
#                                                        rust and distroless base images)
#   container/build.sh --from-host [--debug | --binary PATH] [--tag T]
#                                                        use this machine's cargo build and the
#                                                        ONNX Runtime library of .venv; with base
#                                                        images built by container/bases.sh when
#                                                        the engine cannot pull
# Prints the image's size.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
tag="ferry:latest"
from_host=false
profile=release
binary=""
while [ $# -gt 0 ]; do
  case "$1" in
    --tag) tag="$2"; shift 2 ;;
    --from-host) from_host=true; shift ;;
    --debug) profile=debug; shift ;;
    --binary) binary="$2"; shift 2 ;;
    *) echo "unknown argument $1" >&2; exit 2 ;;
  esac
done
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
  cp "$ORT_DYLIB_PATH" container/prebuilt/
  bash container/bases.sh
  args+=(--build-arg BUILDER=ferry.local/builder:bookworm)
fi
docker build "${args[@]}" -f container/Dockerfile -t "$tag" .
find container/prebuilt -mindepth 1 ! -name README.md -delete
docker image inspect -f '{{.Size}}' "$tag" | awk -v t="$tag" '{printf "%s: %.1f MB\n", t, $1/1e6}'
