#!/usr/bin/env bash
# The prepared check for a machine with one NVIDIA GPU (issue #9). Under 8 minutes on an H100/H200
# with the release target prebuilt; prints every figure on its own line (grep for "FIGURE").
#   1. builds with the `cuda` feature (the default) and the GPU benchmark example;
#   2. runs every GPU-vs-CPU kernel comparison with WASMSERVE_REQUIRE_GPU=1 (a missing or unusable
#      GPU fails instead of skipping) and the NVRTC compile tests;
#   3. opens cuda:0 through the server's --device path with the SmolLM2 checkpoints (bf16 and
#      INT4 compressed-tensors when present under models/), which compiles and loads every kernel;
#   4. prints INT4 GEMV achieved bandwidth as a fraction of the GPU's peak and SmolLM2-135M-shaped
#      decode tok/s at 1 and 64 streams (bf16 cuBLAS and INT4), from kernels/examples/gpu_bench.rs.
#   5. the device Llama forward (DeviceLlama on CUDA) against transformers' SmolLM2 logits and
#      greedy continuations through the engine (tests/device_smollm2.rs).
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
step() { # step <seconds> <command...>: a hung step fails the script instead of eating the budget
  local limit="$1"; shift
  timeout --kill-after=10 "$limit" "$@"
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
export WASMSERVE_REQUIRE_NVRTC=1 WASMSERVE_REQUIRE_GPU=1

log "build (release, feature cuda)"
step 300 cargo build --release -p wasmserve --bin wasmserve
step 240 cargo build --release -p kernels --example gpu_bench --tests

log "NVRTC compile + GPU-vs-CPU kernel comparisons"
step 120 cargo test --release -p kernels --lib cuda:: -- --nocapture
step 180 cargo test --release -p kernels --test cuda_vs_cpu -- cuda:: --nocapture --test-threads=1 2>&1 | tee "$CARGO_TARGET_DIR/gpu-check-kernels.log"
grep -E "max error|identical draws" "$CARGO_TARGET_DIR/gpu-check-kernels.log" | sed 's/^/FIGURE kernel /' || true
step 120 cargo test --release -p wasmserve --lib backend -- --nocapture

log "GPU figures"
step 180 "$CARGO_TARGET_DIR/release/examples/gpu_bench" | tee "$CARGO_TARGET_DIR/gpu-check-bench.log"
sed 's/^/FIGURE /' "$CARGO_TARGET_DIR/gpu-check-bench.log"

log "SmolLM2 device forward vs transformers (CUDA)"
step 240 cargo test --release -p wasmserve --test device_smollm2 cuda -- --nocapture --test-threads=1 2>&1 | tee "$CARGO_TARGET_DIR/gpu-check-device-llama.log"
grep -E "max \|logit|tokens agree|through the engine|prefilled" "$CARGO_TARGET_DIR/gpu-check-device-llama.log" | sed 's/^/FIGURE device-llama /' || true

log "SmolLM2 with --device cuda:0 (engine with the device forward)"
# bf16 / INT4 checkpoints: pass their paths (e.g. made with bench/quant/gguf_to_hf.py and
# `wasmserve quantize`); the default Q4_1 GGUF comes from scripts/fetch-default-model.
[ -e models/SmolLM2-135M-Instruct.Q4_1.gguf ] || step 120 scripts/fetch-default-model
for m in "${WASMSERVE_BF16_MODEL:-models/SmolLM2-135M-Instruct-bf16}" "${WASMSERVE_INT4_MODEL:-models/SmolLM2-135M-Instruct-INT4}" models/SmolLM2-135M-Instruct.Q4_1.gguf; do
  [ -e "$m" ] || { echo "skip $m (not present)"; continue; }
  out=$(step 120 "$CARGO_TARGET_DIR/release/wasmserve" --device cuda:0 bench engine --model "$m" --concurrency 1,64 --steps 8 2>&1) || { echo "$out"; exit 1; }
  echo "$out" | grep -E "compute device|CUDA kernels loaded" >&2 || true
  echo "$out" | grep -vE "^\s*$" | tail -n 4 | sed "s|^|FIGURE engine $(basename "$m") |"
done
figure "gpu-check wall time $(( $(date +%s) - start )) s"
