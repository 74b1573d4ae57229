#!/usr/bin/env bash
# Builds, from Debian's packages only, the base images the Dockerfile names, for machines whose
# Docker engine cannot pull (CI, air-gapped hosts):
#   gcr.io/distroless/cc-debian12:nonroot  glibc, libgcc, libstdc++, CA certificates, a nonroot
#                                          user and /tmp; what distroless's cc image holds
#   ferry.local/builder:bookworm           the same plus busybox's shell and tools, for the
#                                          Dockerfile's build stage when ferry is built on the host
#   docker.io/library/python:3.11-slim-bookworm  (with --python) a stand-in for the official Python
#                                          image that container/Dockerfile.python starts from:
#                                          Debian's python3.11, pip from PyPI, busybox's shell
# Each is imported with `docker import` from a root file system unpacked by `dpkg -x`. An image
# already present is kept (--force rebuilds).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
work="$here/.work/bases"
force=false
python=false
for arg in "$@"; do
  case "$arg" in
    --force) force=true ;;
    --python) python=true ;;
    *) echo "unknown argument $arg" >&2; exit 2 ;;
  esac
done
python_tag="docker.io/library/python:3.11-slim-bookworm"
runtime_tag="gcr.io/distroless/cc-debian12:nonroot"
builder_tag="ferry.local/builder:bookworm"

have() { docker image inspect "$1" >/dev/null 2>&1; }

rootfs() { # rootfs DIR PACKAGE...
  local dir="$1"; shift
  rm -rf "$dir" && mkdir -p "$dir" "$work/debs"
  (cd "$work/debs" && apt-get download -q "$@" >/dev/null 2>&1) \
    || { echo "apt-get download $* failed" >&2; exit 1; }
  for p in "$@"; do dpkg -x "$(ls "$work"/debs/"${p}"_*.deb | head -n 1)" "$dir"; done
  rm -rf "$dir/usr/share/doc" "$dir/usr/share/man" "$dir/usr/share/lintian" "$dir/usr/share/locale"
  mkdir -p "$dir/etc/ssl/certs" "$dir/tmp" "$dir/home/nonroot" "$dir/root"
  chmod 1777 "$dir/tmp"
  cp /etc/ssl/certs/ca-certificates.crt "$dir/etc/ssl/certs/ca-certificates.crt"
  printf 'root:x:0:0:root:/root:/sbin/nologin\nnobody:x:65534:65534:nobody:/nonexistent:/sbin/nologin\nnonroot:x:65532:65532:nonroot:/home/nonroot:/sbin/nologin\n' > "$dir/etc/passwd"
  printf 'root:x:0:\nnobody:x:65534:\nnonroot:x:65532:\n' > "$dir/etc/group"
  chown 65532:65532 "$dir/home/nonroot" 2>/dev/null || true
}

import() { # import DIR TAG
  tar -C "$1" --numeric-owner -c . | docker import - "$2" >/dev/null
  echo "built $2 ($(docker image inspect -f '{{.Size}}' "$2" | awk '{printf "%.1f MB", $1/1e6}'))"
}

libs=(libc6 libgcc-s1 libstdc++6 gcc-12-base)
if $force || ! have "$runtime_tag"; then
  rootfs "$work/runtime" "${libs[@]}"
  import "$work/runtime" "$runtime_tag"
fi
if $force || ! have "$builder_tag"; then
  rootfs "$work/builder" "${libs[@]}" busybox-static
  mkdir -p "$work/builder/bin"
  for tool in sh cp mkdir ls touch rm echo test [ cat; do ln -sf busybox "$work/builder/bin/$tool"; done
  import "$work/builder" "$builder_tag"
fi
if $python && { $force || ! have "$python_tag"; }; then
  rootfs "$work/python" "${libs[@]}" busybox-static python3.11 python3.11-minimal libpython3.11-minimal \
    libpython3.11-stdlib media-types libbz2-1.0 libcrypt1 libdb5.3 libexpat1 libffi8 liblzma5 libncursesw6 \
    libnsl2 libreadline8 readline-common libsqlite3-0 libssl3 libtinfo6 libtirpc3 libtirpc-common libuuid1 \
    zlib1g libgssapi-krb5-2 libk5crypto3 libkeyutils1 libkrb5-3 libkrb5support0 libcom-err2 libgdbm6 \
    libgdbm-compat4
  dir="$work/python"
  mkdir -p "$dir/bin" "$dir/usr/local/bin"
  for tool in sh cp mkdir ls touch rm echo test [ cat env; do ln -sf busybox "$dir/bin/$tool"; done
  ln -sf python3.11 "$dir/usr/bin/python3"
  ln -sf /usr/bin/python3.11 "$dir/usr/local/bin/python"
  # As the official image: pip installs where the interpreter looks, without Debian's guard.
  rm -f "$dir"/usr/lib/python3.11/EXTERNALLY-MANAGED
  site="$dir/usr/local/lib/python3.11/dist-packages"
  mkdir -p "$site" "$work/pip"
  python3 -m pip download -q --no-deps --only-binary=:all: pip -d "$work/pip"
  python3 -m zipfile -e "$(ls "$work"/pip/pip-*.whl | head -n 1)" "$site"
  import "$dir" "$python_tag"
fi
