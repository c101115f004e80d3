//! `y = x · Wᵀ` for row-major activations `x [n, k]` and weights `W [m, k]` (PyTorch's Linear layout).
//!
//! Work is split over output rows so each core streams a disjoint slice of the weights exactly once
//! per call, whatever the number of activation rows: decode steps of many sequences then share one
//! pass over the weights (each weight row stays in L1 while every activation row meets it).
//!
//! Batch invariance: every output is one call of the same `dot` kernel, so a row's result is
//! bit-identical whether it is computed alone, in a batch of 64 or in a prefill chunk. The engine
//! relies on this for batched, chunked, preempted and prefix-cached outputs to equal a lone run.
//! (A packed GEMM would be faster for long prefills but changes summation order with batch shape.)

use rayon::prelude::*;

use super::dot::dot;

/// Output rows per parallel task: large enough to amortise scheduling, small enough to balance.
fn rows_per_task(m: usize, k: usize) -> usize {
    let target_bytes = 256 * 1024;
    (target_bytes / (k * 4).max(1)).clamp(8, 512).min(m.max(1))
}

/// Pointer wrapper so parallel tasks can write disjoint columns of the output.
#[derive(Clone, Copy)]
struct OutPtr(*mut f32);
// SAFETY: every task writes a disjoint set of output columns (its own weight rows).
unsafe impl Send for OutPtr {}
unsafe impl Sync for OutPtr {}

/// `out[n, m] = x[n, k] · w[m, k]ᵀ`. `out` is overwritten.
pub fn matmul_t(x: &[f32], w: &[f32], out: &mut [f32], n: usize, k: usize, m: usize) {
    assert_eq!(x.len(), n * k, "matmul_t: x has {} values, expected {n}x{k}", x.len());
    assert_eq!(w.len(), m * k, "matmul_t: w has {} values, expected {m}x{k}", w.len());
    assert_eq!(out.len(), n * m, "matmul_t: out has {} values, expected {n}x{m}", out.len());
    if n == 0 || m == 0 {
        return;
    }
    let step = rows_per_task(m, k);
    let out_ptr = OutPtr(out.as_mut_ptr());
    (0..m.div_ceil(step)).into_par_iter().for_each(|task| {
        let r0 = task * step;
        let r1 = (r0 + step).min(m);
        let ptr = out_ptr;
        for r in r0..r1 {
            let wr = &w[r * k..(r + 1) * k];
            for i in 0..n {
                let v = dot(&x[i * k..(i + 1) * k], wr);
                // SAFETY: (i, r) lies inside out and column r belongs to this task alone.
                unsafe { *ptr.0.add(i * m + r) = v };
            }
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    fn naive(x: &[f32], w: &[f32], n: usize, k: usize, m: usize) -> Vec<f32> {
        let mut out = vec![0.0; n * m];
        for i in 0..n {
            for r in 0..m {
                out[i * m + r] = (0..k).map(|j| x[i * k + j] as f64 * w[r * k + j] as f64).sum::<f64>() as f32;
            }
        }
        out
    }

    #[test]
    fn matches_naive_for_small_and_large_batches() {
        for &(n, k, m) in &[(1, 64, 10), (3, 576, 100), (17, 96, 1000), (40, 33, 7)] {
            let x: Vec<f32> = (0..n * k).map(|i| ((i * 31 % 89) as f32 - 44.0) / 40.0).collect();
            let w: Vec<f32> = (0..m * k).map(|i| ((i * 17 % 83) as f32 - 41.0) / 50.0).collect();
            let mut out = vec![f32::NAN; n * m];
            matmul_t(&x, &w, &mut out, n, k, m);
            let want = naive(&x, &w, n, k, m);
            for (a, b) in out.iter().zip(&want) {
                assert!((a - b).abs() < 1e-3, "({n},{k},{m}): {a} vs {b}");
            }
        }
    }
}
