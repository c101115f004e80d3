//! `y = x · Wᵀ` for 4- and 8-bit integer weights ([`IntMatrix`]) with the activations quantised
//! to 8 bits per 32-value block, multiplied with integer dot products (llama.cpp's arithmetic for
//! Q4_0 / Q4_1 / Q8_0 against Q8 activations).
//!
//! Why: on a CPU without AVX-512 a decode step is bound by how many instructions it takes to turn
//! a packed weight into a product. The f32 path ([`super::packed_matmul`]) decodes every weight to f32 (a table permute
//! per 8 weights) and issues one FMA per 8 products; here 32 products of 4-bit codes and 8-bit
//! activations are one `vpmaddubsw` + `vpmaddwd` after two bit operations, about 2.5x fewer
//! instructions per weight. The price is the activations' rounding: each block of 32 inputs is
//! `dx · q` with `q` in −127..=127, a relative error of at most `1/254` of the block's largest
//! magnitude (what llama.cpp serves GGUF checkpoints with).
//!
//! Definitions. Block `b` of row `i` has `dx = max|x| / 127`, `q = round(x / dx)` (half away from
//! zero) and `xs = dx · Σq` (f32). Weight `(u − z) · s` with `u` the code, group parameters
//! `[s, z]`; `c` is 0 for 4-bit codes and 128 for 8-bit ones (which are multiplied as signed
//! `u − 128`, so a byte product never saturates `vpmaddubsw`). Then for each output
//! `out[i][o] = reduce8(acc) + zacc` where, over blocks `b` in order,
//! `acc[l] = fma(s·dx, P[l], acc[l])` with `P[l]` the exact integer sum of `(u − c)·q` over
//! the block's byte positions `4l .. 4l+4`, and `zacc = fma(mz, xs, zacc)` with `s` and
//! `mz = s·(c − z)` as stored in [`Int8Params`] (f16 where lossless); `reduce8`
//! halves the lanes pairwise (`a[i] += a[i+w]`, `w = 4, 2, 1`). The integer sums are exact, so
//! the scalar and AVX2 paths give the same bits, and a row's result does not depend on its batch.
//!
//! Byte positions: for 8-bit codes position `p` is element `p` of the block; for 4-bit codes the
//! 16 packed bytes hold elements `2p` (low nibble) and `2p+1` (high nibble), which AVX2 splits
//! into positions `0..16` (low nibbles: even elements) and `16..32` (odd elements), so the
//! quantised activations are stored in that order too.

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

use rayon::prelude::*;

#[cfg(target_arch = "x86_64")]
use super::packed_matmul::{prefetch_rows, reduce8_avx};
use super::packed_matmul::{reduce_halving, Isa, OutPtr};
use super::quant_int::IntMatrix;

/// Activations quantised together (one scale per block).
pub const BLOCK: usize = 32;
/// Output lanes of the canonical accumulation (one AVX2 register of f32).
const LANES: usize = 8;

/// Whether `w` can be multiplied with 8-bit activations: 4- or 8-bit codes, rows of whole blocks
/// and groups that are whole blocks (or one group per row).
pub fn eligible(w: &IntMatrix) -> bool {
    let (_, gs, _) = w.parts();
    let k = w.cols();
    matches!(w.bits(), 4 | 8) && k > 0 && k.is_multiple_of(BLOCK) && (gs.is_multiple_of(BLOCK) || gs >= k)
}

/// Element of a block held at byte position `p` for codes of `bits` bits (see the module doc).
#[inline(always)]
fn element_at(bits: u32, p: usize) -> usize {
    if bits == 4 {
        if p < 16 {
            2 * p
        } else {
            2 * (p - 16) + 1
        }
    } else {
        p
    }
}

/// What the 8-bit-activation arithmetic reads per (row, group): `[s, s·(c − z)]`. Held as f16
/// when that loses nothing that matters (`s` exact, `s·(c − z)` within 2^-14 of its value: GGUF's
/// f16 `d` and `m` come back exactly), halving the parameter bytes a decode step streams (a
/// quarter of a 4-bit GGUF layer's bytes at f32); otherwise f32.
#[derive(Clone)]
pub enum Int8Params {
    F16(Vec<[u16; 2]>),
    F32(Vec<[f32; 2]>),
}

impl Int8Params {
    /// From the matrix's `[s, z]` per group.
    pub fn new(bits: u32, groups: &[[f32; 2]]) -> Self {
        let centre = if bits == 8 { 128.0f32 } else { 0.0 };
        let full: Vec<[f32; 2]> = groups.iter().map(|&[s, z]| [s, s * (centre - z)]).collect();
        let half = |v: f32| half::f16::from_f32(v);
        let fits = full.iter().all(|&[s, mz]| half(s).to_f32() == s && (half(mz).to_f32() - mz).abs() <= mz.abs() * (1.0 / 16384.0));
        if fits {
            Int8Params::F16(full.iter().map(|&[s, mz]| [half(s).to_bits(), half(mz).to_bits()]).collect())
        } else {
            Int8Params::F32(full)
        }
    }

    /// `[s, s·(c − z)]` of entry `i` (row-major (row, group)) as the kernels read it.
    #[inline(always)]
    fn get(&self, i: usize) -> [f32; 2] {
        match self {
            Int8Params::F16(v) => v[i].map(|h| half::f16::from_bits(h).to_f32()),
            Int8Params::F32(v) => v[i],
        }
    }

    pub fn bytes(&self) -> usize {
        match self {
            Int8Params::F16(v) => v.len() * 4,
            Int8Params::F32(v) => v.len() * 8,
        }
    }
}

/// `n` activation rows of `k` values quantised per block, laid out in the byte-position order
/// of `bits`-bit weights.
pub struct Q8Activations {
    k: usize,
    q: Vec<i8>,
    /// `dx` per (row, block); NaN when the block holds a non-finite value, so the outputs it
    /// touches are NaN as with f32 activations.
    scale: Vec<f32>,
    /// `dx · Σq` per (row, block).
    scaled_sum: Vec<f32>,
}

impl Q8Activations {
    pub fn quantize(x: &[f32], n: usize, k: usize, bits: u32) -> Self {
        assert_eq!(x.len(), n * k);
        assert!(k.is_multiple_of(BLOCK), "8-bit activations need rows of whole {BLOCK}-value blocks, not {k}");
        let blocks = n * k / BLOCK;
        let (mut q, mut scale, mut scaled_sum) = (vec![0i8; n * k], Vec::with_capacity(blocks), Vec::with_capacity(blocks));
        for (src, dst) in x.chunks_exact(BLOCK).zip(q.chunks_exact_mut(BLOCK)) {
            let finite = src.iter().all(|v| v.is_finite());
            let amax = src.iter().fold(0.0f32, |m, v| m.max(v.abs()));
            let dx = amax / 127.0;
            let inv = if amax > 0.0 { 127.0 / amax } else { 0.0 };
            let mut sum = 0i32;
            for (p, d) in dst.iter_mut().enumerate() {
                let v = (src[element_at(bits, p)] * inv).round() as i8;
                *d = v;
                sum += v as i32;
            }
            scale.push(if finite { dx } else { f32::NAN });
            scaled_sum.push(if finite { dx * sum as f32 } else { f32::NAN });
        }
        Self { k, q, scale, scaled_sum }
    }

    fn blocks_per_row(&self) -> usize {
        self.k / BLOCK
    }
}

#[inline(always)]
fn reduce8(a: [f32; LANES]) -> f32 {
    reduce_halving(a)
}

/// The stored `[s, s·(c − z)]` of `w` (the plain `[s, z]` converted when `w` is not switched).
fn int8_params(w: &IntMatrix) -> std::borrow::Cow<'_, Int8Params> {
    match w.int8_params() {
        Some(p) => std::borrow::Cow::Borrowed(p),
        None => std::borrow::Cow::Owned(Int8Params::new(w.bits(), w.parts().2)),
    }
}

/// The canonical result for activation row `i` and weight row `o` (the definition every path
/// follows, in plain scalar code).
pub fn dot_reference(w: &IntMatrix, a: &Q8Activations, i: usize, o: usize) -> f32 {
    let (packed, gs, _) = w.parts();
    let params = int8_params(w);
    let bits = w.bits();
    let c = if bits == 8 { 128 } else { 0 };
    let nb = a.blocks_per_row();
    let groups_per_row = w.cols().div_ceil(gs);
    let (mut acc, mut zacc) = ([0.0f32; LANES], 0.0f32);
    for b in 0..nb {
        let [s, mz] = params.get(o * groups_per_row + b * BLOCK / gs);
        let d = s * a.scale[i * nb + b];
        let q = &a.q[(i * nb + b) * BLOCK..][..BLOCK];
        for (l, lane) in acc.iter_mut().enumerate() {
            let p: i32 = (4 * l..4 * l + 4).map(|p| (packed.code(o, b * BLOCK + element_at(bits, p)) as i32 - c) * q[p] as i32).sum();
            *lane = d.mul_add(p as f32, *lane);
        }
        zacc = mz.mul_add(a.scaled_sum[i * nb + b], zacc);
    }
    reduce8(acc) + zacc
}

// ---------------------------------------------------------------------------------------------
// AVX2.

/// A block's 32 weight bytes in position order: 4-bit codes as unsigned 0..16, 8-bit codes as
/// signed `u − 128`.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn block_bytes<const BITS: u32>(row: *const u8, b: usize) -> __m256i {
    if BITS == 4 {
        let v = _mm256_broadcastsi128_si256(_mm_loadu_si128(row.add(b * 16) as *const __m128i));
        let hi = _mm256_srli_epi16(v, 4);
        _mm256_and_si256(_mm256_blend_epi32(v, hi, 0xF0), _mm256_set1_epi8(0x0F))
    } else {
        _mm256_xor_si256(_mm256_loadu_si256(row.add(b * 32) as *const __m256i), _mm256_set1_epi8(-128))
    }
}

/// `R` activation rows from `i0` × weight rows `o0..o0+C`, codes of `BITS` bits. Groups are
/// the outer loop so each group's parameters are read once for all its blocks.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::needless_range_loop)] // one index over parallel register arrays reads clearer
unsafe fn tile_avx2<const BITS: u32, const R: usize, const C: usize>(w: &IntMatrix, params: &Int8Params, a: &Q8Activations, i0: usize, o0: usize) -> [[f32; C]; R] {
    let (packed, gs, _) = w.parts();
    let nb = a.blocks_per_row();
    let per_group = (gs / BLOCK).min(nb);
    let groups = nb.div_ceil(per_group);
    let mut rows = [std::ptr::null::<u8>(); C];
    for (c, row) in rows.iter_mut().enumerate() {
        *row = packed.row_tail(o0 + c).as_ptr();
    }
    // `[s, s·(c − z)]` of row o0+c's group g.
    let group = |c: usize, g: usize| -> [f32; 2] {
        let i = (o0 + c) * groups + g;
        // SAFETY: i < rows × groups (o0 + c is a row of w, g one of its groups).
        unsafe { match params {
            Int8Params::F16(v) => {
                let bits = (v.as_ptr().add(i) as *const i32).read_unaligned();
                let f = _mm_cvtph_ps(_mm_cvtsi32_si128(bits));
                [_mm_cvtss_f32(f), _mm_cvtss_f32(_mm_movehdup_ps(f))]
            }
            Int8Params::F32(v) => *v.as_ptr().add(i),
        } }
    };
    let (q, scale, scaled_sum) = (a.q.as_ptr(), a.scale.as_ptr(), a.scaled_sum.as_ptr());
    let ones = _mm256_set1_epi16(1);
    let mut acc = [[_mm256_setzero_ps(); C]; R];
    let mut zacc = [[0.0f32; C]; R];
    for g in 0..groups {
        // `s` and `s·(c − z)` of each weight row's group.
        let mut s = [0.0f32; C];
        let mut mz = [0.0f32; C];
        for c in 0..C {
            [s[c], mz[c]] = group(c, g);
        }
        for b in g * per_group..((g + 1) * per_group).min(nb) {
            let mut wv = [_mm256_setzero_si256(); C];
            // 8-bit: |u − 128| is the unsigned operand and its sign moves onto the activations.
            let mut wabs = [_mm256_setzero_si256(); C];
            // Without it this kernel decoded SmolLM2 no faster than the f32 one (both waiting on
            // loads).
            prefetch_rows(&rows, b * BLOCK, BITS, packed.stride());
            for c in 0..C {
                wv[c] = block_bytes::<BITS>(rows[c], b);
                if BITS == 8 {
                    wabs[c] = _mm256_abs_epi8(wv[c]);
                }
            }
            for r in 0..R {
                let at = (i0 + r) * nb + b;
                let xv = _mm256_loadu_si256(q.add(at * BLOCK) as *const __m256i);
                let (dx, xs) = (*scale.add(at), *scaled_sum.add(at));
                for c in 0..C {
                    let pairs = if BITS == 8 { _mm256_maddubs_epi16(wabs[c], _mm256_sign_epi8(xv, wv[c])) } else { _mm256_maddubs_epi16(wv[c], xv) };
                    let p = _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, ones));
                    acc[r][c] = _mm256_fmadd_ps(_mm256_set1_ps(s[c] * dx), p, acc[r][c]);
                    zacc[r][c] = mz[c].mul_add(xs, zacc[r][c]);
                }
            }
        }
    }
    let mut out = [[0.0f32; C]; R];
    for r in 0..R {
        for c in 0..C {
            out[r][c] = reduce8_avx(acc[r][c]) + zacc[r][c];
        }
    }
    out
}

/// One call's operands: the weights and their parameters, the quantised activations, and the
/// output (`m` columns) the tiles are stored into.
#[derive(Clone, Copy)]
struct Job<'a> {
    isa: Isa,
    w: &'a IntMatrix,
    params: &'a Int8Params,
    a: &'a Q8Activations,
    m: usize,
    out: OutPtr,
}

/// One tile computed and stored into the output.
#[inline(always)]
fn run_tile<const R: usize, const C: usize>(job: Job<'_>, i0: usize, o0: usize) {
    let Job { isa, w, params, a, m, out } = job;
    let res: [[f32; C]; R] = match isa {
        // SAFETY: every vector Isa implies AVX2 and FMA (Isa::available lists them only then).
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 | Isa::Avx512 | Isa::Avx512Vbmi if w.bits() == 4 => unsafe { tile_avx2::<4, R, C>(w, params, a, i0, o0) },
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 | Isa::Avx512 | Isa::Avx512Vbmi => unsafe { tile_avx2::<8, R, C>(w, params, a, i0, o0) },
        _ => std::array::from_fn(|r| std::array::from_fn(|c| dot_reference(w, a, i0 + r, o0 + c))),
    };
    for (r, row) in res.iter().enumerate() {
        for (c, v) in row.iter().enumerate() {
            // SAFETY: (i0+r, o0+c) is inside out; column o0+c belongs to the calling task alone.
            unsafe { *out.0.add((i0 + r) * m + o0 + c) = *v };
        }
    }
}

/// Activation rows per pass over a task's weights: 32 rows of int8 activations stay in L2
/// (48 KiB for k = 1536) while every weight tile of the task is applied to them.
const ROWS_PER_PASS: usize = 32;

/// Weight rows `start..end` against every activation row: single rows in tiles of 1×4 (four
/// independent accumulators), batches in tiles of up to 4 rows × 2 weight rows.
fn run_rows(job: Job<'_>, n: usize, start: usize, end: usize) {
    let (th, tw) = if n == 1 { (1, 4) } else { (4, 2) };
    let mut i0 = 0;
    while i0 < n {
        let i_end = (i0 + ROWS_PER_PASS).min(n);
        let mut o = start;
        while o < end {
            let cw = if end - o >= tw { tw } else { 1 };
            let mut i = i0;
            while i < i_end {
                let rh = th.min(i_end - i);
                macro_rules! go {
                    ($($r:literal, $c:literal);*) => {
                        match (rh, cw) {
                            $(($r, $c) => run_tile::<$r, $c>(job, i, o),)*
                            _ => unreachable!(),
                        }
                    };
                }
                go!(1,1; 1,2; 1,4; 2,1; 2,2; 3,1; 3,2; 4,1; 4,2);
                i += rh;
            }
            o += cw;
        }
        i0 = i_end;
    }
}

/// `out[n, m] = x[n, k] · Wᵀ` with `x` quantised to 8 bits per block, on the widest instruction
/// set here. `w` must be [`eligible`].
pub fn int8_matmul_t(w: &IntMatrix, x: &[f32], out: &mut [f32], n: usize) {
    int8_matmul_t_isa(Isa::detect(), w, x, out, n)
}

/// As [`int8_matmul_t`] with a chosen instruction set (one of `Isa::available()`).
pub fn int8_matmul_t_isa(isa: Isa, w: &IntMatrix, x: &[f32], out: &mut [f32], n: usize) {
    assert!(eligible(w), "a {}-bit {}x{} matrix cannot take 8-bit activations", w.bits(), w.rows(), w.cols());
    let (m, k) = (w.rows(), w.cols());
    assert_eq!(x.len(), n * k, "int8_matmul_t: x has {} values, expected {n}x{k}", x.len());
    assert_eq!(out.len(), n * m, "int8_matmul_t: out has {} values, expected {n}x{m}", out.len());
    if n == 0 || m == 0 {
        return;
    }
    let a = Q8Activations::quantize(x, n, k, w.bits());
    let params = int8_params(w);
    // The vector kernel reads f16 parameters with F16C (every AVX2 CPU has it; checked anyway).
    #[cfg(target_arch = "x86_64")]
    let isa = if isa != Isa::Scalar && !is_x86_feature_detected!("f16c") { Isa::Scalar } else { isa };
    // Tasks of about 32 KiB of packed weights (at least 4 per thread for balance): a task's
    // weights stay in L2 while each pass of activation rows goes over them.
    let row_bytes = w.parts().0.stride().max(1);
    let balanced = m.div_ceil(4 * rayon::current_num_threads());
    let step = (32 * 1024 / row_bytes).clamp(4, 512).min(balanced.max(4)).div_ceil(4) * 4;
    let out_ptr = OutPtr(out.as_mut_ptr());
    (0..m.div_ceil(step)).into_par_iter().for_each(|task| {
        let (start, end) = (task * step, ((task + 1) * step).min(m));
        run_rows(Job { isa, w, params: &params, a: &a, m, out: out_ptr }, n, start, end);
    });
}

#[cfg(test)]
mod tests {
    use super::super::bitpack::PackedRows;
    use super::super::quant_int::tests::{activations, lcg};
    use super::*;

    fn matrix(bits: u32, rows: usize, cols: usize, gs: usize, seed: u64) -> IntMatrix {
        let mut r = lcg(seed);
        let codes: Vec<u8> = (0..rows * cols).map(|_| (r() % (1 << bits)) as u8).collect();
        let groups = rows * cols.div_ceil(gs);
        let scale: Vec<f32> = (0..groups).map(|_| (r() % 1000) as f32 / 20000.0 + 1e-3).collect();
        // Integer and fractional zero points (GGUF Q4_1's is −m/d).
        let zero: Vec<f32> = (0..groups).map(|i| (r() % (1 << bits)) as f32 + if i % 3 == 0 { 0.37 } else { 0.0 }).collect();
        IntMatrix::new(PackedRows::from_codes(bits, rows, cols, &codes), gs, &scale, &zero)
    }

    #[test]
    fn eligibility_needs_whole_blocks_and_4_or_8_bits() {
        assert!(eligible(&matrix(4, 2, 64, 32, 1)));
        assert!(eligible(&matrix(8, 2, 96, 96, 1)));
        assert!(eligible(&matrix(4, 2, 256, 128, 1)));
        assert!(!eligible(&matrix(3, 2, 64, 32, 1)));
        assert!(!eligible(&matrix(4, 2, 80, 80, 1)));
        assert!(!eligible(&matrix(4, 2, 64, 16, 1)));
    }

    #[test]
    fn quantised_activations_round_to_the_block_scale() {
        let x = activations(2, 64, 3);
        for bits in [4, 8] {
            let a = Q8Activations::quantize(&x, 2, 64, bits);
            for blk in 0..4 {
                let src = &x[blk * 32..(blk + 1) * 32];
                let amax = src.iter().fold(0.0f32, |m, v| m.max(v.abs()));
                assert_eq!(a.scale[blk], amax / 127.0);
                let mut sum = 0;
                for p in 0..32 {
                    let q = a.q[blk * 32 + p] as i32;
                    sum += q;
                    assert!((q as f32 * a.scale[blk] - src[element_at(bits, p)]).abs() <= a.scale[blk] / 2.0 * 1.0001);
                }
                assert_eq!(a.scaled_sum[blk], a.scale[blk] * sum as f32);
            }
        }
    }

    #[test]
    fn non_finite_activations_give_nan_not_a_finite_guess() {
        let mut x = activations(1, 64, 4);
        x[40] = f32::INFINITY;
        let w = matrix(4, 3, 64, 32, 5);
        let mut out = vec![0.0; 3];
        for isa in Isa::available() {
            int8_matmul_t_isa(isa, &w, &x, &mut out, 1);
            assert!(out.iter().all(|v| v.is_nan()), "{isa:?}: {out:?}");
        }
    }

    #[test]
    fn every_isa_computes_the_reference_and_stays_near_the_f32_product() {
        for &(bits, n, k, m, gs) in &[(4u32, 1usize, 256usize, 9usize, 32usize), (4, 7, 384, 13, 128), (8, 5, 96, 6, 32), (8, 1, 64, 11, 64), (4, 3, 64, 5, 64)] {
            let w = matrix(bits, m, k, gs, (bits as u64) << 8 | k as u64);
            let x = activations(n, k, 99 + n as u64);
            let a = Q8Activations::quantize(&x, n, k, bits);
            let deq: Vec<Vec<f32>> = (0..m).map(|r| w.dequantize_row(r)).collect();
            for isa in Isa::available() {
                let mut out = vec![f32::NAN; n * m];
                int8_matmul_t_isa(isa, &w, &x, &mut out, n);
                for i in 0..n {
                    for o in 0..m {
                        let got = out[i * m + o];
                        assert_eq!(got.to_bits(), dot_reference(&w, &a, i, o).to_bits(), "{isa:?} ({bits},{n},{k},{m},{gs}) [{i},{o}]");
                        // Against the exact product of the unquantised activations: each block
                        // contributes at most dx/2 · Σ|w| of rounding error.
                        let xr = &x[i * k..(i + 1) * k];
                        let exact: f64 = xr.iter().zip(&deq[o]).map(|(a, b)| *a as f64 * *b as f64).sum();
                        let bound: f64 = (0..k / BLOCK)
                            .map(|b| a.scale[i * (k / BLOCK) + b] as f64 / 2.0 * deq[o][b * BLOCK..(b + 1) * BLOCK].iter().map(|v| v.abs() as f64).sum::<f64>())
                            .sum();
                        assert!((got as f64 - exact).abs() <= bound * 1.01 + 1e-5, "{isa:?} [{i},{o}] {got} vs {exact} (bound {bound})");
                    }
                }
            }
        }
    }

    /// A GGUF-like matrix (f16 scales, integer zero points), switched: its parameters are
    /// held as f16, and every ISA still computes the reference from them.
    #[test]
    fn half_precision_parameters_are_used_when_lossless() {
        for bits in [4u32, 8] {
            let (n, k, m) = (3, 128, 10);
            let mut r = lcg(11 + bits as u64);
            let codes: Vec<u8> = (0..m * k).map(|_| (r() % (1 << bits)) as u8).collect();
            let groups = m * k / 32;
            let scale: Vec<f32> = (0..groups).map(|_| half::f16::from_f32((r() % 1000) as f32 / 20000.0 + 1e-3).to_f32()).collect();
            let zero = vec![if bits == 8 { 128.0 } else { 8.0 }; groups];
            let w = IntMatrix::new(PackedRows::from_codes(bits, m, k, &codes), 32, &scale, &zero).with_int8_activations().unwrap();
            assert!(matches!(w.int8_params(), Some(Int8Params::F16(_))), "{bits}-bit GGUF-like parameters stay f16");
            let x = activations(n, k, 12);
            let a = Q8Activations::quantize(&x, n, k, bits);
            for isa in Isa::available() {
                let mut out = vec![0.0; n * m];
                int8_matmul_t_isa(isa, &w, &x, &mut out, n);
                for i in 0..n {
                    for o in 0..m {
                        assert_eq!(out[i * m + o].to_bits(), dot_reference(&w, &a, i, o).to_bits(), "{isa:?} {bits}-bit [{i},{o}]");
                    }
                }
            }
        }
        // Fractional zero points that f16 cannot carry keep f32 parameters.
        let w = matrix(4, 4, 64, 32, 3).with_int8_activations().unwrap();
        assert!(matches!(w.int8_params(), Some(Int8Params::F32(_))));
    }

    #[test]
    fn rows_are_bit_identical_whatever_the_batch() {
        let (k, m, n) = (256, 37, 13);
        for bits in [4, 8] {
            let w = matrix(bits, m, k, 32, 5);
            let x = activations(n, k, 6);
            for isa in Isa::available() {
                let mut all = vec![0.0; n * m];
                int8_matmul_t_isa(isa, &w, &x, &mut all, n);
                for i in 0..n {
                    let rest = n - i;
                    let mut sub = vec![0.0; rest * m];
                    int8_matmul_t_isa(isa, &w, &x[i * k..], &mut sub, rest);
                    assert_eq!(sub[..m], all[i * m..(i + 1) * m], "{isa:?} {bits}-bit sub-batch at {i}");
                }
            }
        }
    }
}
