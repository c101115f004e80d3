#!/usr/bin/env bash
# wasmserve against llama.cpp (the CPU peer) on one GGUF, side by side in one run: single-stream
# greedy decode tok/s after a short prompt, and prefill tok/s of a longer prompt. Rounds alternate
# between the two, so both see the same machine load, and each side's best round is kept; the
# ratios are wasmserve / llama.cpp.
#
#   bench/cpu-vs-llama-cpp.sh [MODEL.gguf]      (default: the default model, fetched if missing)
#   env: THREADS (default: all cores), ROUNDS (3), STEPS decoded (64), DEPTH prompt tokens before
#        the decode (32), PREFILL prompt tokens (128), ACTIVATIONS wasmserve's --cpu-activations
#        modes to measure ("f32 int8"), LLAMA_BENCH_ARGS extra llama-bench flags (e.g.
#        "--repack 0" where llama.cpp's AMX path faults inside a VM)
#
# llama.cpp's llama-bench is built from the source vendored in the PyPI sdist llama-cpp-python
# (MIT), outside the project tree under $WASMSERVE_LLAMA_CPP_DIR (default
# ~/.cache/wasmserve/llama.cpp), with cmake and ninja from a venv there; the first run takes about
# 10 minutes on 2 cores, later runs reuse it. Nothing of llama.cpp is linked into or copied to
# the project.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
model="${1:-models/SmolLM2-135M-Instruct.Q4_1.gguf}"
threads="${THREADS:-$(nproc)}"
rounds="${ROUNDS:-3}"
steps="${STEPS:-64}"
depth="${DEPTH:-32}"
prefill="${PREFILL:-128}"
activations="${ACTIVATIONS:-f32 int8}"
read -r -a llama_args <<<"${LLAMA_BENCH_ARGS:-}"
llama_version="0.3.36"
dir="${WASMSERVE_LLAMA_CPP_DIR:-$HOME/.cache/wasmserve/llama.cpp}"
log() { echo "== $*" >&2; }

if [ ! -e "$model" ] && [ "$model" = models/SmolLM2-135M-Instruct.Q4_1.gguf ]; then
  log "fetching the default model"
  scripts/fetch-default-model >/dev/null
fi

bench_bin="$dir/build-$llama_version/bin/llama-bench"
if [ ! -x "$bench_bin" ]; then
  log "building llama.cpp's llama-bench $llama_version in $dir (once; about 10 minutes on 2 cores)"
  mkdir -p "$dir"
  [ -x "$dir/venv/bin/cmake" ] || { python3 -m venv "$dir/venv" && "$dir/venv/bin/pip" install -q cmake ninja; }
  src="$dir/llama_cpp_python-$llama_version"
  if [ ! -d "$src" ]; then
    "$dir/venv/bin/pip" download -q --no-deps --no-binary llama-cpp-python "llama-cpp-python==$llama_version" -d "$dir"
    tar xzf "$dir/llama_cpp_python-$llama_version.tar.gz" -C "$dir"
  fi
  PATH="$dir/venv/bin:$PATH" cmake -S "$src/vendor/llama.cpp" -B "$dir/build-$llama_version" -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF >&2
  PATH="$dir/venv/bin:$PATH" ninja -C "$dir/build-$llama_version" llama-bench >&2
fi

log "building wasmserve (release)"
cargo build --release --bin wasmserve -q
wasmserve="${CARGO_TARGET_DIR:-target}/release/wasmserve"

# Best (highest) tok/s of each measurement over the rounds.
best() { printf '%s\n' "$@" | sort -g | tail -1; }
declare -A ours_decode=() ours_prefill=()
peer_decode=() peer_prefill=()
for r in $(seq 1 "$rounds"); do
  for act in $activations; do
    log "round $r/$rounds: wasmserve --cpu-activations $act"
    # One process per measurement, as for llama-bench: decode after a DEPTH-token prompt, then prefill.
    out="$(RAYON_NUM_THREADS="$threads" "$wasmserve" bench decode --model "$model" --cpu-activations "$act" --prompt-tokens "$depth" --steps "$steps" --rounds 1 2>&1)"
    ours_decode[$act]+=" $(sed -n 's/.* decode \([0-9.]*\) tok\/s$/\1/p' <<<"$out" | tail -1)"
    out="$(RAYON_NUM_THREADS="$threads" "$wasmserve" bench decode --model "$model" --cpu-activations "$act" --prompt-tokens "$prefill" --steps 1 --rounds 1 2>&1)"
    ours_prefill[$act]+=" $(sed -n 's/.* prefill \([0-9.]*\) tok\/s, .*/\1/p' <<<"$out" | tail -1)"
  done
  log "round $r/$rounds: llama.cpp"
  out="$("$bench_bin" -m "$model" -t "$threads" -p 0 -n "$steps" -d "$depth" -r 1 "${llama_args[@]}" -o jsonl 2>/dev/null)"
  peer_decode+=("$(python3 -c 'import json,sys; print(json.loads(sys.stdin.read().splitlines()[-1])["avg_ts"])' <<<"$out")")
  out="$("$bench_bin" -m "$model" -t "$threads" -p "$prefill" -n 0 -r 1 "${llama_args[@]}" -o jsonl 2>/dev/null)"
  peer_prefill+=("$(python3 -c 'import json,sys; print(json.loads(sys.stdin.read().splitlines()[-1])["avg_ts"])' <<<"$out")")
  log "llama.cpp decode ${peer_decode[-1]} tok/s, prefill ${peer_prefill[-1]} tok/s"
done

pd="$(best "${peer_decode[@]}")" pp="$(best "${peer_prefill[@]}")"
echo "model: $model, $threads threads, best of $rounds rounds; llama.cpp decode $pd tok/s, prefill $pp tok/s"
printf '%-44s %12s %12s %8s\n' "" "wasmserve" "llama.cpp" "ratio"
for act in $activations; do
  # shellcheck disable=SC2086
  od="$(best ${ours_decode[$act]})" op="$(best ${ours_prefill[$act]})"
  printf '%-44s %12.1f %12.1f %7.2fx\n' "decode tok/s, $act ($steps after $depth)" "$od" "$pd" "$(python3 -c "print($od / $pd)")"
  printf '%-44s %12.1f %12.1f %7.2fx\n' "prefill tok/s, $act ($prefill-token prompt)" "$op" "$pp" "$(python3 -c "print($op / $pp)")"
done
