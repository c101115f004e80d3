//! `y = x · Wᵀ` for row-major activations `x [n, k]` and weights `W [m, k]` (PyTorch's Linear layout).
//!
//! Hand-written because it is nearly all of the model's time. Work is split over output rows so
//! each core streams a disjoint slice of the weights once per call, whatever the number of
//! activation rows: decode steps of many sequences share one pass over the weights. Inside a task
//! a register tile of up to 4 activation rows × 3 weight rows reuses every loaded vector several
//! times (12 independent FMA chains, 7 loads per 12 FMAs).
//!
//! Batch invariance: every output is accumulated in the same order (8 lanes over k, then the same
//! horizontal sum) whatever the tile it falls in, so a row's result is bit-identical alone, in a
//! batch of 64 or in a prefill chunk. The engine relies on this for batched, chunked, preempted
//! and prefix-cached outputs to equal a lone run.

use std::sync::OnceLock;

use rayon::prelude::*;

const LANES: usize = 8;
const MR: usize = 4;
const NR: usize = 3;

/// Output rows per parallel task: large enough to amortise scheduling, small enough to balance.
fn rows_per_task(m: usize, k: usize) -> usize {
    let target_bytes = 128 * 1024;
    let r = (target_bytes / (k * 4).max(1)).clamp(NR, 384);
    (r / NR * NR).max(NR).min(m.max(1))
}

/// Pointer wrapper so parallel tasks can write disjoint columns of the output.
#[derive(Clone, Copy)]
struct OutPtr(*mut f32);
// SAFETY: every task writes a disjoint set of output columns (its own weight rows).
unsafe impl Send for OutPtr {}
unsafe impl Sync for OutPtr {}

#[inline(always)]
fn hsum(acc: [f32; LANES]) -> f32 {
    ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]))
}

/// Portable tile: `R` activation rows × `C` weight rows.
#[inline(always)]
fn tile_portable<const R: usize, const C: usize>(x: [&[f32]; R], w: [&[f32]; C]) -> [[f32; C]; R] {
    let k = w[0].len();
    let chunks = k / LANES;
    let mut acc = [[[0.0f32; LANES]; C]; R];
    for ch in 0..chunks {
        let o = ch * LANES;
        for r in 0..R {
            for c in 0..C {
                for l in 0..LANES {
                    acc[r][c][l] += x[r][o + l] * w[c][o + l];
                }
            }
        }
    }
    let mut out = [[0.0f32; C]; R];
    for r in 0..R {
        for c in 0..C {
            let mut s = hsum(acc[r][c]);
            for j in chunks * LANES..k {
                s += x[r][j] * w[c][j];
            }
            out[r][c] = s;
        }
    }
    out
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn tile_avx2<const R: usize, const C: usize>(x: [&[f32]; R], w: [&[f32]; C]) -> [[f32; C]; R] {
    use std::arch::x86_64::*;
    let k = w[0].len();
    let chunks = k / LANES;
    let mut acc = [[_mm256_setzero_ps(); C]; R];
    for ch in 0..chunks {
        let o = ch * LANES;
        let mut wv = [_mm256_setzero_ps(); C];
        for c in 0..C {
            wv[c] = _mm256_loadu_ps(w[c].as_ptr().add(o));
        }
        for r in 0..R {
            let xv = _mm256_loadu_ps(x[r].as_ptr().add(o));
            for c in 0..C {
                acc[r][c] = _mm256_fmadd_ps(xv, wv[c], acc[r][c]);
            }
        }
    }
    let mut out = [[0.0f32; C]; R];
    for r in 0..R {
        for c in 0..C {
            let mut lanes = [0.0f32; LANES];
            _mm256_storeu_ps(lanes.as_mut_ptr(), acc[r][c]);
            let mut s = hsum(lanes);
            for j in chunks * LANES..k {
                s = x[r][j].mul_add(w[c][j], s);
            }
            out[r][c] = s;
        }
    }
    out
}

fn use_avx2() -> bool {
    static AVX2: OnceLock<bool> = OnceLock::new();
    *AVX2.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma")
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            false
        }
    })
}

#[inline(always)]
fn tile<const R: usize, const C: usize>(avx2: bool, x: [&[f32]; R], w: [&[f32]; C]) -> [[f32; C]; R] {
    #[cfg(target_arch = "x86_64")]
    if avx2 {
        // SAFETY: avx2 and fma were detected at run time (use_avx2).
        return unsafe { tile_avx2::<R, C>(x, w) };
    }
    let _ = avx2;
    tile_portable::<R, C>(x, w)
}

/// Computes the block `x[i0..i0+R] × w[r0..r0+C]` and stores it into `out`.
#[inline(always)]
fn run_tile<const R: usize, const C: usize>(
    avx2: bool,
    x: &[f32],
    w: &[f32],
    k: usize,
    m: usize,
    i0: usize,
    r0: usize,
    out: OutPtr,
) {
    let xs: [&[f32]; R] = std::array::from_fn(|r| &x[(i0 + r) * k..(i0 + r + 1) * k]);
    let ws: [&[f32]; C] = std::array::from_fn(|c| &w[(r0 + c) * k..(r0 + c + 1) * k]);
    let res = tile::<R, C>(avx2, xs, ws);
    for r in 0..R {
        for c in 0..C {
            // SAFETY: (i0+r, r0+c) lies inside out; column r0+c belongs to the calling task alone.
            unsafe { *out.0.add((i0 + r) * m + r0 + c) = res[r][c] };
        }
    }
}

fn run_rows<const C: usize>(avx2: bool, x: &[f32], w: &[f32], n: usize, k: usize, m: usize, r0: usize, out: OutPtr) {
    let mut i = 0;
    while i + MR <= n {
        run_tile::<MR, C>(avx2, x, w, k, m, i, r0, out);
        i += MR;
    }
    match n - i {
        0 => {}
        1 => run_tile::<1, C>(avx2, x, w, k, m, i, r0, out),
        2 => run_tile::<2, C>(avx2, x, w, k, m, i, r0, out),
        3 => run_tile::<3, C>(avx2, x, w, k, m, i, r0, out),
        _ => unreachable!(),
    }
}

/// `out[n, m] = x[n, k] · w[m, k]ᵀ`. `out` is overwritten.
pub fn matmul_t(x: &[f32], w: &[f32], out: &mut [f32], n: usize, k: usize, m: usize) {
    assert_eq!(x.len(), n * k, "matmul_t: x has {} values, expected {n}x{k}", x.len());
    assert_eq!(w.len(), m * k, "matmul_t: w has {} values, expected {m}x{k}", w.len());
    assert_eq!(out.len(), n * m, "matmul_t: out has {} values, expected {n}x{m}", out.len());
    if n == 0 || m == 0 {
        return;
    }
    let avx2 = use_avx2();
    let step = rows_per_task(m, k);
    let out_ptr = OutPtr(out.as_mut_ptr());
    (0..m.div_ceil(step)).into_par_iter().for_each(|task| {
        let start = task * step;
        let end = (start + step).min(m);
        let mut r = start;
        while r + NR <= end {
            run_rows::<NR>(avx2, x, w, n, k, m, r, out_ptr);
            r += NR;
        }
        match end - r {
            0 => {}
            1 => run_rows::<1>(avx2, x, w, n, k, m, r, out_ptr),
            2 => run_rows::<2>(avx2, x, w, n, k, m, r, out_ptr),
            _ => unreachable!(),
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

    fn data(n: usize, k: usize, m: usize) -> (Vec<f32>, Vec<f32>) {
        let x: Vec<f32> = (0..n * k).map(|i| ((i * 31 % 89) as f32 - 44.0) / 40.0).collect();
        let w: Vec<f32> = (0..m * k).map(|i| ((i * 17 % 83) as f32 - 41.0) / 50.0).collect();
        (x, w)
    }

    #[test]
    fn matches_naive_for_small_and_large_batches() {
        for &(n, k, m) in &[(1, 64, 10), (3, 576, 100), (17, 96, 1000), (40, 33, 7), (5, 7, 2)] {
            let (x, w) = data(n, k, m);
            let mut out = vec![f32::NAN; n * m];
            matmul_t(&x, &w, &mut out, n, k, m);
            let want = naive(&x, &w, n, k, m);
            for (a, b) in out.iter().zip(&want) {
                assert!((a - b).abs() < 1e-3, "({n},{k},{m}): {a} vs {b}");
            }
        }
    }

    #[test]
    fn rows_are_bit_identical_whatever_the_batch() {
        let (n, k, m) = (13, 200, 31);
        let (x, w) = data(n, k, m);
        let mut all = vec![0.0; n * m];
        matmul_t(&x, &w, &mut all, n, k, m);
        for i in 0..n {
            let mut one = vec![0.0; m];
            matmul_t(&x[i * k..(i + 1) * k], &w, &mut one, 1, k, m);
            assert_eq!(one, all[i * m..(i + 1) * m], "row {i}");
        }
    }
}
