#!/usr/bin/env bash
# cached_venv NAME PACKAGE...: a venv holding PACKAGE... in a cache outside the checkout
# ($FERRY_CACHE, else $XDG_CACHE_HOME/ferry, else ~/.cache/ferry), built once per NAME (name the
# version in it) and reused by later runs and clean clones on the same machine; a half-built one
# is rebuilt. Prints its python. Sourced by scripts/torch.sh and scripts/tensorflow.sh.
cached_venv() {
  local name="$1"
  shift
  local cache="${FERRY_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/ferry}"
  local venv="$cache/$name"
  if [ ! -f "$venv/.ready" ]; then
    rm -rf "$venv"
    mkdir -p "$cache"
    python3 -m venv "$venv" >&2
    "$venv/bin/python" -m pip install --quiet "$@" >&2
    touch "$venv/.ready"
  fi
  echo "$venv/bin/python"
}
