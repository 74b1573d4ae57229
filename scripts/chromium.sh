#!/usr/bin/env bash
# Headless Chromium and its chromedriver from Debian's packages, for the tests that open ferry's
# HTML pages in a real browser (the `ferry tune` report). Uses them from PATH when installed; else
# installs Debian's `chromium` and `chromium-driver` when it may (root, or sudo without a password).
# Sourced by scripts/test.sh; exports FERRY_CHROMIUM and FERRY_CHROMEDRIVER when they are there.
if ! command -v chromium >/dev/null || ! command -v chromedriver >/dev/null; then
  as_root=()
  if [ "$(id -u)" != 0 ]; then
    if sudo -n true 2>/dev/null; then as_root=(sudo -n); else as_root=(false); fi
  fi
  if [ "${as_root[0]:-}" != false ]; then
    export DEBIAN_FRONTEND=noninteractive
    pkgs=(chromium chromium-driver)
    "${as_root[@]}" apt-get install -y -q --no-install-recommends "${pkgs[@]}" >/dev/null 2>&1 \
      || { "${as_root[@]}" apt-get update -q >/dev/null 2>&1 \
           && "${as_root[@]}" apt-get install -y -q --no-install-recommends "${pkgs[@]}" >/dev/null 2>&1; } \
      || echo "scripts/chromium.sh: could not install Debian's chromium and chromium-driver" >&2
  else
    echo "scripts/chromium.sh: chromium is not installed and this user cannot install it; the browser tests skip" >&2
  fi
fi
if command -v chromium >/dev/null && command -v chromedriver >/dev/null; then
  FERRY_CHROMIUM="$(command -v chromium)"
  FERRY_CHROMEDRIVER="$(command -v chromedriver)"
  export FERRY_CHROMIUM FERRY_CHROMEDRIVER
fi
