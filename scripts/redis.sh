#!/usr/bin/env bash
# Makes Debian's Redis server available to the response-cache tests without root and without
# starting a system service: uses redis-server from PATH when there is one, else downloads the
# Debian packages once into .work/redis and unpacks them there. Sourced by scripts/test.sh;
# exports REDIS_SERVER and REDIS_CLI.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if command -v redis-server >/dev/null && command -v redis-cli >/dev/null; then
  REDIS_SERVER="$(command -v redis-server)"
  REDIS_CLI="$(command -v redis-cli)"
else
  dir="$root/.work/redis"
  if [ ! -x "$dir/bin/redis-server" ]; then
    mkdir -p "$dir/debs" "$dir/root" "$dir/bin"
    # (as root, apt warns that it downloads unsandboxed; harmless here)
    (cd "$dir/debs" && apt-get download -q redis-tools libjemalloc2 liblzf1 >/dev/null 2>&1) \
      || { echo "cannot download Debian's redis-tools (apt-get download redis-tools)" >&2; exit 1; }
    for deb in "$dir"/debs/*.deb; do dpkg -x "$deb" "$dir/root"; done
    libs="$dir/root/usr/lib/x86_64-linux-gnu:$dir/root/usr/lib"
    # Debian's redis-server is redis-check-rdb under another name: it acts by the name it runs as.
    ln -sf "$dir/root/usr/bin/redis-check-rdb" "$dir/bin/redis-server-real"
    printf '#!/bin/bash\nLD_LIBRARY_PATH="%s${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" exec -a redis-server "%s" "$@"\n' \
      "$libs" "$dir/bin/redis-server-real" > "$dir/bin/redis-server"
    printf '#!/bin/sh\nLD_LIBRARY_PATH="%s${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" exec "%s" "$@"\n' \
      "$libs" "$dir/root/usr/bin/redis-cli" > "$dir/bin/redis-cli"
    chmod +x "$dir/bin/redis-server" "$dir/bin/redis-cli"
  fi
  REDIS_SERVER="$dir/bin/redis-server"
  REDIS_CLI="$dir/bin/redis-cli"
fi
export REDIS_SERVER REDIS_CLI
