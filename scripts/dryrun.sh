#!/usr/bin/env bash
# Sourced by the deploy scripts (vertex/deploy.sh, sagemaker/deploy.sh): run a command, or, when
# $dry_run is true, print it shell-quoted after "+ " and run nothing.

# run CMD...: runs it, or prints it in a dry run.
run() {
  if ${dry_run:-false}; then printf '+'; printf ' %q' "$@"; printf '\n'; else "$@"; fi
}

# capture PLACEHOLDER CMD...: prints the command's output; a dry run prints the command (on
# stderr, so that $(capture ...) keeps only the answer) and answers PLACEHOLDER.
capture() {
  local placeholder="$1"; shift
  if ${dry_run:-false}; then printf '+' >&2; printf ' %q' "$@" >&2; printf '\n' >&2; echo "$placeholder"; else "$@"; fi
}
