//! The prefill GEMM comparisons (`prefill_gemm`, shared with the GPU suite) on the CPU
//! simulator: the real `dequant.cu` and GEMV sources executed on the host, cuBLAS replaced by the
//! simulator's f32 loop over the bf16 values.
//!
//! Without the simulator (no C++ compiler at build time) each test prints `SKIPPED ...` and
//! passes, unless `WASMSERVE_REQUIRE_SIM=1` (CI), where it fails.

mod prefill_gemm;

use kernels::sim::SimGpu;

fn sim(test: &str) -> Option<SimGpu> {
    match SimGpu::sim() {
        Ok(g) => Some(g),
        Err(e) if std::env::var_os("WASMSERVE_REQUIRE_SIM").is_some_and(|v| v == "1") => panic!("{test}: {e}"),
        Err(e) => {
            eprintln!("SKIPPED {test}: {e}");
            None
        }
    }
}

#[test]
fn dequant_kernels_match_cpu_bit_for_bit_in_the_simulator() {
    let Some(g) = sim("dequant_kernels_match_cpu_bit_for_bit_in_the_simulator") else { return };
    prefill_gemm::dequant_matches_cpu_bit_for_bit(&g);
}

#[test]
fn matmul_quant_matches_cpu_on_both_sides_of_the_threshold_in_the_simulator() {
    let Some(g) = sim("matmul_quant_matches_cpu_on_both_sides_of_the_threshold_in_the_simulator") else { return };
    prefill_gemm::matmul_quant_matches_cpu(&g);
}
