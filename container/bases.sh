#!/usr/bin/env bash
# Builds, from Debian's packages only, the base images the Dockerfile names, for machines whose
# Docker engine cannot pull (CI, air-gapped hosts):
#   gcr.io/distroless/cc-debian12:nonroot  glibc, libgcc, libstdc++, CA certificates, a nonroot
#                                          user and /tmp; what distroless's cc image holds
#   ferry.local/builder:bookworm           the same plus busybox's shell and tools, for the
#                                          Dockerfile's build stage when ferry is built on the host
# Each is imported with `docker import` from a root file system unpacked by `dpkg -x`. An image
# already present is kept (--force rebuilds).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
work="$here/.work/bases"
force=false
[ "${1:-}" = "--force" ] && force=true
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
