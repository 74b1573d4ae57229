#!/usr/bin/env bash
# Sourced by the benchmark scripts: the reference models of ../shared/bench/REFERENCE.md (made once
# with its make_models.py) in bench/.work/ref, and the same models without dynamic batching in
# bench/.work/ref_nobatch. Exports REF_ON and REF_OFF, the two model repositories.
generator="${MAKE_MODELS:-../shared/bench/make_models.py}"
REF_ON=bench/.work/ref/model_repository
[ -d "$REF_ON" ] || "$BENCH_PYTHON" "$generator" --out bench/.work/ref
REF_OFF=bench/.work/ref_nobatch/model_repository
rm -rf "$REF_OFF" && mkdir -p "$REF_OFF"
for m in "$REF_ON"/*/; do
  name=$(basename "$m")
  mkdir -p "$REF_OFF/$name" && ln -s "$(realpath "$m/1")" "$REF_OFF/$name/1"
  # Same config without the dynamic_batching block: each request runs alone.
  python3 -c "import re,sys; print(re.sub(r'dynamic_batching \{[^}]*\}\n', '', open(sys.argv[1]).read()), end='')" \
    "$m/config.pbtxt" > "$REF_OFF/$name/config.pbtxt"
done
export REF_ON REF_OFF
