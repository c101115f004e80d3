//! Data-free fitting of Cubic groups (docs/cubic-format.md §4): per group, search the shape `a`
//! and least-squares scale `s` minimising the squared error of nearest-level reconstruction, with
//! the final choice measured under the f16-rounded parameters that get stored.

use half::f16;
use kernels::cpu::bitpack::pack_row;
use kernels::cpu::cubic::{level, unit_level};
use rayon::prelude::*;

use super::stats::Stats;

const COARSE: [f32; 6] = [0.0, 0.15, 0.3, 0.5, 0.8, 1.2];
const REFINE: f32 = 0.075;
const MAX_SHAPE: f32 = 2.0;
/// Alternating assignment / least-squares scale steps per candidate shape.
const SCALE_STEPS: usize = 3;

pub struct CubicTensors {
    /// `cubic_codes`: `rows × row_bytes` dense bit streams.
    pub codes: Vec<u8>,
    /// `cubic_scale`, `cubic_shape`: f16 bits `[rows, groups]`.
    pub scale: Vec<u16>,
    pub shape: Vec<u16>,
    pub stats: Stats,
}

/// Index of the value in ascending `vals` nearest to `x` (ties to the lower one).
#[inline]
fn nearest(vals: &[f32], x: f32) -> usize {
    let i = vals.partition_point(|&v| v < x);
    if i == 0 {
        0
    } else if i == vals.len() || x - vals[i - 1] <= vals[i] - x {
        i - 1
    } else {
        i
    }
}

/// A group's levels in ascending order with their codes (a negative scale reverses them).
struct Levels {
    vals: Vec<f32>,
    codes: Vec<u8>,
}

impl Levels {
    fn new(bits: u32, s: f32, a: f32) -> Self {
        let mut pairs: Vec<(f32, u8)> = (0..1u32 << bits).map(|i| (level(i, bits, s, a), i as u8)).collect();
        if s < 0.0 {
            pairs.reverse();
        }
        Self { vals: pairs.iter().map(|p| p.0).collect(), codes: pairs.iter().map(|p| p.1).collect() }
    }

    #[inline]
    fn code(&self, x: f32) -> (u8, f32) {
        let k = nearest(&self.vals, x);
        (self.codes[k], self.vals[k])
    }
}

/// One alternating step: assign each weight its nearest level under scale `s`, then return the
/// least-squares scale `Σ x·u / Σ u²` for those unit levels `u`.
fn refit_scale(x: &[f32], bits: u32, a: f32, s: f32) -> f32 {
    let lv = Levels::new(bits, s, a);
    let (mut num, mut den) = (0.0f64, 0.0f64);
    for &v in x {
        let u = unit_level(lv.code(v).0 as u32, bits, a) as f64;
        num += v as f64 * u;
        den += u * u;
    }
    if den > 0.0 {
        (num / den) as f32
    } else {
        s
    }
}

/// Squared error and clipped count of `x` under the stored parameters (exact decoder levels).
fn measure(x: &[f32], bits: u32, s: f32, a: f32) -> (f64, u64) {
    let lv = Levels::new(bits, s, a);
    let (lo, hi) = (lv.vals[0], *lv.vals.last().unwrap());
    let mut err = 0.0f64;
    let mut clipped = 0;
    for &v in x {
        err += ((v - lv.code(v).1) as f64).powi(2);
        clipped += (v < lo || v > hi) as u64;
    }
    (err, clipped)
}

/// Best stored (error², clipped, s, a) so far.
type Best = (f64, u64, f16, f16);

/// Tries shapes `shapes` with both grid orientations (`signs`), keeping the best in `best`.
fn search(x: &[f32], bits: u32, amax: f32, shapes: &[f32], signs: &[f32], best: &mut Best) {
    for &a in shapes {
        let a = f16::from_f32(a.clamp(0.0, MAX_SHAPE)).to_f32();
        for &sign in signs {
            // Start with the long (negative-code) side of the grid covering max|w|.
            let mut s = sign * amax / (1.0 + a);
            for _ in 0..SCALE_STEPS {
                s = refit_scale(x, bits, a, s);
            }
            let s16 = f16::from_f32(s);
            let (err, clipped) = measure(x, bits, s16.to_f32(), a);
            if err < best.0 {
                *best = (err, clipped, s16, f16::from_f32(a));
            }
        }
    }
}

/// Fits one group; writes its codes into `codes` and returns (scale, shape, error², clipped).
fn fit_group(x: &[f32], bits: u32, codes: &mut [u8]) -> (f16, f16, f64, u64) {
    let amax = x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    if amax == 0.0 || !amax.is_finite() {
        codes.fill(1 << (bits - 1)); // the zero level
        return (f16::ZERO, f16::ZERO, 0.0, 0);
    }
    let mut best: Best = (f64::INFINITY, 0, f16::ZERO, f16::ZERO);
    search(x, bits, amax, &COARSE, &[1.0, -1.0], &mut best);
    if bits > 1 {
        let (a0, sign) = (best.3.to_f32(), best.2.to_f32().signum());
        search(x, bits, amax, &[a0 - REFINE, a0 + REFINE], &[sign], &mut best);
    }
    let (err, clipped, s16, a16) = best;
    let lv = Levels::new(bits, s16.to_f32(), a16.to_f32());
    for (c, &v) in codes.iter_mut().zip(x) {
        *c = lv.code(v).0;
    }
    (s16, a16, err, clipped)
}

/// Fits every group of `w` (`[rows, cols]`, row-major; the last group of a row may be partial).
pub fn quantize_cubic(w: &[f32], rows: usize, cols: usize, bits: u32, gs: usize) -> CubicTensors {
    assert_eq!(w.len(), rows * cols);
    let per_row: Vec<(Vec<u8>, Vec<u16>, Vec<u16>, Stats)> = w
        .par_chunks(cols)
        .map(|row| {
            let mut codes = vec![0u8; cols];
            let (mut sc, mut sh, mut st) = (Vec::new(), Vec::new(), Stats::default());
            for (g, c) in row.chunks(gs).zip(codes.chunks_mut(gs)) {
                let (s, a, err, clipped) = fit_group(g, bits, c);
                sc.push(s.to_bits());
                sh.push(a.to_bits());
                st.err2 += err;
                st.w2 += g.iter().map(|&v| (v as f64).powi(2)).sum::<f64>();
                st.clipped += clipped;
                st.weights += g.len() as u64;
                st.bits += g.len() as u64 * bits as u64 + 32;
            }
            (pack_row(&codes, bits), sc, sh, st)
        })
        .collect();
    let mut t = CubicTensors { codes: Vec::new(), scale: Vec::new(), shape: Vec::new(), stats: Stats::default() };
    for (c, sc, sh, st) in per_row {
        t.codes.extend_from_slice(&c);
        t.scale.extend_from_slice(&sc);
        t.shape.extend_from_slice(&sh);
        t.stats.add(&st);
    }
    t
}

#[cfg(test)]
mod tests {
    use super::*;
    use kernels::cpu::bitpack::code_at;
    use kernels::cpu::cubic::level;

    fn gaussianish(n: usize, seed: u64) -> Vec<f32> {
        // Sum of uniforms: bell-shaped, deterministic.
        let mut s = seed;
        let mut next = || {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (s >> 40) as f32 / (1u64 << 24) as f32 - 0.5
        };
        (0..n).map(|_| (0..6).map(|_| next()).sum::<f32>() * 0.02).collect()
    }

    #[test]
    fn codes_are_nearest_levels_and_stats_match_the_decoder() {
        let (rows, cols, gs, bits) = (3, 1000, 512, 3);
        let w = gaussianish(rows * cols, 1);
        let t = quantize_cubic(&w, rows, cols, bits, gs);
        let stride = cols * bits as usize / 8;
        let mut err = 0.0f64;
        for r in 0..rows {
            for j in 0..cols {
                let g = r * 2 + j / gs;
                let (s, a) = (f16::from_bits(t.scale[g]).to_f32(), f16::from_bits(t.shape[g]).to_f32());
                let code = code_at(&t.codes[r * stride..], bits, j);
                let back = level(code, bits, s, a);
                let x = w[r * cols + j];
                for i in 0..8 {
                    assert!((x - back).abs() <= (x - level(i, bits, s, a)).abs(), "not the nearest level");
                }
                err += ((x - back) as f64).powi(2);
            }
        }
        assert!((err - t.stats.err2).abs() <= 1e-9 * err.max(1e-30));
    }

    #[test]
    fn beats_uniform_on_bell_shaped_weights() {
        let w = gaussianish(512 * 64, 2);
        let cubic = quantize_cubic(&w, 64, 512, 3, 512).stats;
        let uniform = super::super::int_rtn::quantize_int(&w, 64, 512, 3, 512, true).stats;
        // Lloyd-Max optimum for 8 levels on a Gaussian: NRMSE 0.186.
        assert!(cubic.nrmse() < 0.85 * uniform.nrmse(), "cubic {} vs int3 {}", cubic.nrmse(), uniform.nrmse());
    }
}
