#!/usr/bin/env bash
# The prepared check for a machine with one NVIDIA GPU (issue #9). Under 8 minutes on an H100/H200
# with the release target prebuilt; prints every figure on its own line (grep for "FIGURE"), and the
# steps that failed at the end (it goes on past a failed step; exit 1 if any failed).
# Two ways to get the binaries: `cargo` here (a GPU machine with a Rust toolchain), or the bundle
# bench/gpu-bundle builds on the dev machine (.gpu-bundle/, or $WASMSERVE_GPU_BUNDLE), for a GPU
# machine with neither a toolchain nor a network. Without the real model (no network), the model
# steps use a random-weight checkpoint of SmolLM2-135M's shapes that bench/make_random_smollm2.py
# writes with transformers, and compare our device forward with transformers' logits on it.
#   1. builds with the `cuda` feature (the default) and the GPU benchmark example (or unpacks them);
#   2. runs every GPU-vs-CPU kernel comparison with WASMSERVE_REQUIRE_GPU=1 (a missing or unusable
#      GPU fails instead of skipping) and the NVRTC compile tests;
#   3. opens cuda:0 through the server's --device path with the SmolLM2 checkpoints (bf16 and
#      INT4 compressed-tensors when present under models/), which compiles and loads every kernel;
#   4. prints INT4 GEMV achieved bandwidth as a fraction of the GPU's peak and SmolLM2-135M-shaped
#      decode tok/s at 1 and 64 streams (bf16 cuBLAS and INT4), from kernels/examples/gpu_bench.rs.
#   5. the device Llama forward (DeviceLlama on CUDA) against transformers' SmolLM2 logits and
#      greedy continuations through the engine (tests/device_smollm2.rs);
#   6. the device DeepSeek-V3 forward (MLA + MoE) and the Kimi-Linear one (KDA + MLA + MoE), each
#      as one rank and as two expert-parallel ranks sharing the GPU, against transformers and the
#      CPU model on the tiny checkpoints, and their engine decode.
# Step 3 now serves through the device forward (a single-device Llama with --device cuda:0 runs
# DeviceLlama, K/V in device memory); step 4's decode figures are a GPU forward of the real
# model's shapes with random weights.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$root/target}"
export WASMSERVE_KERNEL_CACHE="${WASMSERVE_KERNEL_CACHE:-$CARGO_TARGET_DIR/ptx-cache}"
log() { echo "== $*" >&2; }
figure() { echo "FIGURE $*"; }
# A GPU machine is lent for minutes, once: a failing or hung step is recorded and the script goes
# on to the next one, so that one broken check does not cost every other figure. The failures are
# listed at the end (and the script exits 1); only a failed build stops it (see `required`).
failures=/tmp/gpu-check-failures; : > "$failures"
step() { # step <seconds> <command...>
  local limit="$1"; shift
  local rc=0
  # Through bash so that the t_* functions below (exported) can be steps too.
  timeout --kill-after=10 "$limit" bash -c '"$@"' step "$@" || rc=$?
  if [ "$rc" -ne 0 ]; then
    local why="exit $rc"; { [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; } && why="timed out after ${limit}s"
    echo "$* ($why)" >> "$failures"   # a file: steps piped into tee run in a subshell
    echo "== step failed ($why): $*" >&2
  fi
  return 0
}
required() { # required <seconds> <command...>: a step the rest cannot do without
  local before; before=$(wc -l < "$failures")
  step "$@"
  [ "$(wc -l < "$failures")" -eq "$before" ] || { echo "== a required step failed: stopping" >&2; exit 1; }
}
start=$(date +%s)

log "GPU"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || echo "(nvidia-smi not found)"
# NVRTC: the toolkit's, a pip-installed one (torch ships nvidia-cuda-nvrtc-cu12), else the PyPI
# wheel via scripts/setup-nvrtc (needs the package index). Its PTX must not be newer than the
# driver supports: prefer the toolkit that matches the driver.
nvrtc_dir=""
for d in "${CUDA_HOME:-/nonexistent}/lib64" /usr/local/cuda/lib64 $(python3 -c 'import site,glob;print(" ".join(glob.glob(site.getsitepackages()[0]+"/nvidia/cuda_nvrtc/lib")))' 2>/dev/null || true); do
  if ls "$d"/libnvrtc.so* >/dev/null 2>&1; then nvrtc_dir="$d"; break; fi
done
if [ -n "$nvrtc_dir" ]; then
  [ -e "$nvrtc_dir/libnvrtc.so" ] || echo "note: $nvrtc_dir has no unversioned libnvrtc.so; cudarc also tries libnvrtc.so.12" >&2
  export LD_LIBRARY_PATH="$nvrtc_dir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
elif ! ldconfig -p 2>/dev/null | grep -q 'libnvrtc\.so'; then
  eval "$(scripts/setup-nvrtc --env)"
fi
echo "NVRTC from: ${nvrtc_dir:-ldconfig or .venv-nvrtc}" >&2
# cuBLAS (and NCCL) from pip wheels too when the toolkit lacks them (after the system paths).
for d in $(python3 -c 'import site,glob;print(" ".join(glob.glob(site.getsitepackages()[0]+"/nvidia/*/lib")))' 2>/dev/null || true); do
  export LD_LIBRARY_PATH="${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}$d"
done
# cudarc (built against CUDA 12.8) asks for libnvrtc.so / libcublas.so unversioned or with major
# version 12; a CUDA 13 install may only ship libX.so.13: link the unversioned names to what is there.
shim=/tmp/wasmserve-cuda-libs; mkdir -p "$shim"
for lib in nvrtc cublas cublasLt nccl; do
  if ! ldconfig -p 2>/dev/null | grep -q "lib$lib\.so "; then
    for d in $(echo "${LD_LIBRARY_PATH:-}" | tr ':' ' ') /usr/local/cuda/lib64; do
      f=$(ls "$d"/lib$lib.so.* 2>/dev/null | head -1 || true)
      [ -n "$f" ] && { ln -sf "$f" "$shim/lib$lib.so"; break; }
    done
  fi
done
export LD_LIBRARY_PATH="$shim${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export WASMSERVE_REQUIRE_NVRTC=1 WASMSERVE_REQUIRE_GPU=1

bundle="${WASMSERVE_GPU_BUNDLE:-$root/.gpu-bundle}"
if [ -e "$bundle/bin.tar.gz" ]; then
  log "binaries from the bundle ($bundle, built from commit $(cut -c1-12 "$bundle/commit"))"
  bin=/tmp/wasmserve-gpu-bin; rm -rf "$bin"; mkdir -p "$bin"
  tar -xzf "$bundle/bin.tar.gz" -C "$bin" --strip-components=1
  wasmserve="$bin/wasmserve"; gpu_bench="$bin/gpu_bench"
  built_in=$(cat "$bundle/root" 2>/dev/null || true)
  if [ -n "$built_in" ] && [ "$built_in" != "$root" ] && [ ! -e "$built_in" ]; then
    # The tests' fixture paths are the build machine's checkout: point it at this one.
    mkdir -p "$(dirname "$built_in")" && ln -s "$root" "$built_in" || echo "cannot link $built_in to $root: fixture-based tests will fail" >&2
  fi
  t_kernels_lib() { "$bin/kernels-lib" "$@"; }
  t_cuda_vs_cpu() { "$bin/cuda_vs_cpu" "$@"; }
  t_wasmserve_lib() { "$bin/wasmserve-lib" "$@"; }
  t_device_smollm2() { "$bin/device_smollm2" "$@"; }
else
  log "build (release, feature cuda)"
  required 300 cargo build --release -p wasmserve --bin wasmserve
  required 240 cargo build --release -p kernels --example gpu_bench --tests
  bin="$CARGO_TARGET_DIR/release"; wasmserve="$bin/wasmserve"; gpu_bench="$CARGO_TARGET_DIR/release/examples/gpu_bench"
  t_kernels_lib() { cargo test --release -p kernels --lib -- "$@"; }
  t_cuda_vs_cpu() { cargo test --release -p kernels --test cuda_vs_cpu -- "$@"; }
  t_wasmserve_lib() { cargo test --release -p wasmserve --lib -- "$@"; }
  t_device_smollm2() { cargo test --release -p wasmserve --test device_smollm2 -- "$@"; }
fi
export bin
export -f t_kernels_lib t_cuda_vs_cpu t_wasmserve_lib t_device_smollm2

log "NVRTC compile + GPU-vs-CPU kernel comparisons"
step 120 t_kernels_lib cuda:: --nocapture
step 180 t_cuda_vs_cpu cuda:: --nocapture --test-threads=1 2>&1 | tee /tmp/gpu-check-kernels.log
grep -E "max error|identical draws" /tmp/gpu-check-kernels.log | sed 's/^/FIGURE kernel /' || true
step 120 t_wasmserve_lib backend --nocapture

log "GPU figures"
step 180 "$gpu_bench" | tee /tmp/gpu-check-bench.log
sed 's/^/FIGURE /' /tmp/gpu-check-bench.log

# The models: the real SmolLM2 when it is here (or can be fetched), and always the random-weight
# one of its shapes (bf16, and INT4 made from it by our quantizer), with transformers' logits.
models=()
if [ -e models/SmolLM2-135M-Instruct.Q4_1.gguf ] || timeout 120 scripts/fetch-default-model >/dev/null 2>&1; then
  log "SmolLM2 device forward vs transformers (CUDA)"
  step 240 t_device_smollm2 cuda --nocapture --test-threads=1 2>&1 | tee /tmp/gpu-check-device-llama.log
  grep -E "max \|logit|tokens agree|through the engine|prefilled" /tmp/gpu-check-device-llama.log | sed 's/^/FIGURE device-llama /' || true
  models+=(models/SmolLM2-135M-Instruct.Q4_1.gguf)
else
  echo "the real SmolLM2 is not here and cannot be fetched: random weights of its shapes only" >&2
fi
for m in "${WASMSERVE_BF16_MODEL:-models/SmolLM2-135M-Instruct-bf16}" "${WASMSERVE_INT4_MODEL:-models/SmolLM2-135M-Instruct-INT4}"; do
  [ -e "$m" ] && models+=("$m")
done
random=/tmp/random-smollm2-135m
log "random-weight SmolLM2-135M (transformers) and its INT4 quantization"
step 180 python3 bench/make_random_smollm2.py "$random"
step 180 "$wasmserve" quantize --input "$random" --output "$random-int4" --format int --bits 4 --group-size 128 >/dev/null
WASMSERVE_RANDOM_SMOLLM2="$random" step 240 t_device_smollm2 random_smollm2 --nocapture --test-threads=1 2>&1 | tee /tmp/gpu-check-random.log
grep -E "worst relative logit error" /tmp/gpu-check-random.log | sed 's/^/FIGURE device-llama /' || true
models+=("$random" "$random-int4")

log "DeepSeek-V3 and Kimi-Linear device forwards (MLA latent cache, KDA state, MoE routing and expert GEMVs) vs transformers and the CPU model (CUDA)"
step 180 t_wasmserve_lib device::decoder::tests::cuda --nocapture --test-threads=1 2>&1 | tee /tmp/gpu-check-deepseek.log
grep -E "max \|logit|median" /tmp/gpu-check-deepseek.log | sed 's/^/FIGURE device-deepseek /' || true
models+=(tests/reference/deepseek_v3/model tests/reference/kimi_linear/model)

log "engine decode with --device cuda:0 (the device forward; --kv-cache-dtype auto: bf16 K/V, prompts on the tensor-core prefill)"
for m in "${models[@]}"; do
  out=$(step 150 "$wasmserve" --device cuda:0 bench engine --model "$m" --concurrency 1,64 --steps 16 2>&1)
  echo "$out" | grep -E "compute device|CUDA kernels loaded|uploaded to the device|KV cache (Bf16|F32|Fp8)" >&2 || true
  echo "$out" | grep -vE "^\s*$" | tail -n 4 | sed "s|^|FIGURE engine $(basename "$m") |"
done
ngpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | wc -l || echo 1)
if [ "${ngpu:-1}" -ge 2 ]; then
  log "tensor parallel over 2 GPUs (NCCL): host-staged collectives, then the device forward's ranks"
  WASMSERVE_REQUIRE_NCCL=1 step 240 t_wasmserve_lib nccl two_gpus --nocapture --test-threads=1 2>&1 | tee /tmp/gpu-check-tp.log
  grep -E "max \|logit" /tmp/gpu-check-tp.log | sed 's/^/FIGURE tp2 /' || true
  out=$(step 150 "$wasmserve" --device cuda:0,1 bench engine --model tests/reference/tiny_llama --tensor-parallel-size 2 --concurrency 1,64 --steps 16 2>&1)
  echo "$out" | grep -vE "^\s*$" | tail -n 4 | sed "s|^|FIGURE engine tp2 tiny_llama |"
else
  log "one GPU: the NCCL device all-reduce on a group of one (the two-GPU checks need two)"
  step 60 t_wasmserve_lib nccl_device_all_reduce_on_one_gpu --nocapture 2>&1 | tail -n 3 >&2
fi
figure "gpu-check wall time $(( $(date +%s) - start )) s"
if [ -s "$failures" ]; then
  sed 's/^/FIGURE failed step: /' "$failures"
  exit 1
fi
figure "gpu-check: every step passed"
