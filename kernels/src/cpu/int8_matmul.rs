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
//! magnitude (what llama.cpp serves GGUF checkpoints with). With AVX-512 VNNI ([`tile_vnni`]) one
//! `vpdpbusd` does the 32 products of two weight rows at once, which is what makes the kernel
//! competitive with the f32 path at batches too (docs/engine-benchmarks.md).
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
//! the scalar, AVX2, AVX-VNNI and AVX-512 VNNI paths ([`Int8Path`]) give the same bits, and a
//! row's result does not depend on its batch.
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
        let fits = full
            .iter()
            .all(|&[s, mz]| half(s).to_f32() == s && (half(mz).to_f32() - mz).abs() <= mz.abs() * (1.0 / 16384.0));
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
        let (mut q, mut scale, mut scaled_sum) =
            (vec![0i8; n * k], Vec::with_capacity(blocks), Vec::with_capacity(blocks));
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
            let p: i32 = (4 * l..4 * l + 4)
                .map(|p| (packed.code(o, b * BLOCK + element_at(bits, p)) as i32 - c) * q[p] as i32)
                .sum();
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

/// `[s, s·(c − z)]` of parameter entry `i` (row-major (row, group)), f16 ones read with F16C.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn group_params(params: &Int8Params, i: usize) -> [f32; 2] {
    match params {
        Int8Params::F16(v) => {
            debug_assert!(i < v.len());
            let bits = (v.as_ptr().add(i) as *const i32).read_unaligned();
            let f = _mm_cvtph_ps(_mm_cvtsi32_si128(bits));
            [_mm_cvtss_f32(f), _mm_cvtss_f32(_mm_movehdup_ps(f))]
        }
        Int8Params::F32(v) => v[i],
    }
}

/// Defines `$name`, the 256-bit tile: `R` activation rows from `i0` × weight rows
/// `o0..o0+C`, codes of `BITS` bits. Groups are the outer loop so each group's parameters are
/// read once for all its blocks. Compiled twice: plain AVX2 (`vpmaddubsw` + `vpmaddwd` per 32
/// products) and with AVX-VNNI (one `vpdpbusd`, the same exact sums) for the CPUs that have it
/// without AVX-512 (Intel client cores from Alder Lake on, E-core Xeons); a function's target
/// features cannot depend on a generic parameter, hence the macro.
macro_rules! tile_256 {
    ($name:ident, $features:literal, $vnni:literal) => {
        #[cfg(target_arch = "x86_64")]
        #[target_feature(enable = $features)]
        #[allow(clippy::needless_range_loop)] // one index over parallel register arrays reads clearer
        unsafe fn $name<const BITS: u32, const R: usize, const C: usize>(
            w: &IntMatrix,
            params: &Int8Params,
            a: &Q8Activations,
            i0: usize,
            o0: usize,
        ) -> [[f32; C]; R] {
            let (packed, gs, _) = w.parts();
            let nb = a.blocks_per_row();
            let per_group = (gs / BLOCK).min(nb);
            let groups = nb.div_ceil(per_group);
            let mut rows = [std::ptr::null::<u8>(); C];
            for (c, row) in rows.iter_mut().enumerate() {
                *row = packed.row_tail(o0 + c).as_ptr();
            }
            let group = |c: usize, g: usize| group_params(params, (o0 + c) * groups + g);
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
                            let (u, x) = if BITS == 8 { (wabs[c], _mm256_sign_epi8(xv, wv[c])) } else { (wv[c], xv) };
                            let sums = if $vnni {
                                _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, x)
                            } else {
                                _mm256_madd_epi16(_mm256_maddubs_epi16(u, x), ones)
                            };
                            let p = _mm256_cvtepi32_ps(sums);
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
    };
}

tile_256!(tile_avx2, "avx2,fma,f16c", false);
tile_256!(tile_avx_vnni, "avx2,fma,f16c,avxvnni", true);

// ---------------------------------------------------------------------------------------------
// AVX-512 VNNI.

/// `[s_0, s·(c − z)_0, .., s_7, s·(c − z)_7]` of parameter entries `entries` (8 indices).
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
unsafe fn group_params_x8(params: &Int8Params, entries: __m256i) -> __m512 {
    match params {
        // An f16 pair is 32 bits.
        Int8Params::F16(v) => _mm512_cvtph_ps(_mm256_i32gather_epi32::<4>(v.as_ptr() as *const i32, entries)),
        // An f32 pair is 64 bits.
        Int8Params::F32(v) => _mm512_castpd_ps(_mm512_i32gather_pd::<8>(entries, v.as_ptr() as *const f64)),
    }
}

/// As [`tile_avx2`] for `P` pairs of weight rows from `o0`, both rows of a pair in one 512-bit
/// register: one `vpdpbusd` gives 16 lanes' exact 4-product sums (the `P[l]` of the definition
/// for both rows) where AVX2 needs `vpmaddubsw` + `vpmaddwd` per 8 lanes, and the scale and
/// accumulate steps also cover two rows per instruction. Same integer sums, same f32 operations
/// per lane in the same order, so the same bits as the reference.
///
/// A pair's accumulator lanes: for 8-bit codes `[row 2p: l0..8 | row 2p+1: l0..8]`; for 4-bit
/// codes (both rows' low nibbles, then both rows' high nibbles, split by one shift)
/// `[2p: l0..4 | 2p+1: l0..4 | 2p: l4..8 | 2p+1: l4..8]`, put in order at the end. 8-bit codes
/// go in unsigned (`u`, not `u − 128`) with every lane starting from `−128 · Σq` over its four
/// positions, which is the same exact integer.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
#[allow(clippy::needless_range_loop)] // one index over parallel register arrays reads clearer
unsafe fn tile_vnni<const BITS: u32, const R: usize, const P: usize>(
    w: &IntMatrix,
    params: &Int8Params,
    a: &Q8Activations,
    i0: usize,
    o0: usize,
) -> [[[f32; 2]; P]; R] {
    let (packed, gs, _) = w.parts();
    let nb = a.blocks_per_row();
    let per_group = (gs / BLOCK).min(nb);
    let groups = nb.div_ceil(per_group);
    let rows: [[*const u8; 2]; P] =
        std::array::from_fn(|p| [packed.row_tail(o0 + 2 * p).as_ptr(), packed.row_tail(o0 + 2 * p + 1).as_ptr()]);
    let (q, scale, scaled_sum) = (a.q.as_ptr(), a.scale.as_ptr(), a.scaled_sum.as_ptr());
    let zero = _mm512_setzero_si512();
    let mut acc = [[_mm512_setzero_ps(); P]; R];
    // `zacc` of every (activation row, weight row) at once: lane `c` is weight row `o0 + c`.
    let mut zacc = [_mm256_setzero_ps(); R];
    // Parameter entry of weight row o0 + c (c < 8; rows past the tile repeat its last row) in
    // group 0: the tile's rows are `groups` entries apart.
    let entries = _mm256_mullo_epi32(
        _mm256_min_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(2 * P as i32 - 1)),
        _mm256_set1_epi32(groups as i32),
    );
    let entries = _mm256_add_epi32(entries, _mm256_set1_epi32((o0 * groups) as i32));
    // Lanes of `[s_0, mz_0, s_1, mz_1, ..]` that a pair's `s` register takes: `s` of its first
    // row in the first row's lanes, of its second row in the others.
    let s_lanes = if BITS == 4 {
        _mm512_setr_epi32(0, 0, 0, 0, 2, 2, 2, 2, 0, 0, 0, 0, 2, 2, 2, 2)
    } else {
        _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 2, 2, 2, 2, 2, 2, 2, 2)
    };
    let mz_lanes = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 1, 3, 5, 7, 9, 11, 13, 15);
    for g in 0..groups {
        // Every row's `[s, s·(c − z)]` in one gather instead of 2 × 2P scalar loads and
        // broadcasts (with groups of 32 this runs every block).
        let all = group_params_x8(params, _mm256_add_epi32(entries, _mm256_set1_epi32(g as i32)));
        let s: [__m512; P] = std::array::from_fn(|p| {
            _mm512_permutexvar_ps(_mm512_add_epi32(s_lanes, _mm512_set1_epi32(4 * p as i32)), all)
        });
        let mz = _mm512_castps512_ps256(_mm512_permutexvar_ps(mz_lanes, all));
        for b in g * per_group..((g + 1) * per_group).min(nb) {
            let mut wv = [zero; P];
            for p in 0..P {
                prefetch_rows(&rows[p], b * BLOCK, BITS, packed.stride());
                let [r0, r1] = rows[p];
                wv[p] = if BITS == 4 {
                    let both = _mm256_inserti128_si256::<1>(
                        _mm256_castsi128_si256(_mm_loadu_si128(r0.add(b * 16) as *const __m128i)),
                        _mm_loadu_si128(r1.add(b * 16) as *const __m128i),
                    );
                    let split = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(both), _mm256_srli_epi16::<4>(both));
                    _mm512_and_si512(split, _mm512_set1_epi8(0x0F))
                } else {
                    _mm512_inserti64x4::<1>(
                        _mm512_castsi256_si512(_mm256_loadu_si256(r0.add(b * 32) as *const __m256i)),
                        _mm256_loadu_si256(r1.add(b * 32) as *const __m256i),
                    )
                };
            }
            for r in 0..R {
                let at = (i0 + r) * nb + b;
                let x = _mm512_castsi256_si512(_mm256_loadu_si256(q.add(at * BLOCK) as *const __m256i));
                // Positions facing the weight lanes: [0..16, 0..16, 16..32, 16..32] for 4-bit
                // codes, [0..32, 0..32] for 8-bit ones.
                let xv =
                    if BITS == 4 { _mm512_shuffle_i64x2::<0x50>(x, x) } else { _mm512_shuffle_i64x2::<0x44>(x, x) };
                let start = if BITS == 8 {
                    _mm512_sub_epi32(zero, _mm512_slli_epi32::<7>(_mm512_dpbusd_epi32(zero, _mm512_set1_epi8(1), xv)))
                } else {
                    zero
                };
                let dx = _mm512_set1_ps(*scale.add(at));
                for p in 0..P {
                    let sums = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(start, wv[p], xv));
                    acc[r][p] = _mm512_fmadd_ps(_mm512_mul_ps(s[p], dx), sums, acc[r][p]);
                }
                zacc[r] = _mm256_fmadd_ps(mz, _mm256_set1_ps(*scaled_sum.add(at)), zacc[r]);
            }
        }
    }
    let in_order = _mm512_setr_epi32(0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15);
    let mut out = [[[0.0f32; 2]; P]; R];
    for r in 0..R {
        let mut z = [0.0f32; 8];
        _mm256_storeu_ps(z.as_mut_ptr(), zacc[r]);
        for p in 0..P {
            let v = if BITS == 4 { _mm512_permutexvar_ps(in_order, acc[r][p]) } else { acc[r][p] };
            let high = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(v)));
            out[r][p] = [reduce8_avx(_mm512_castps512_ps256(v)) + z[2 * p], reduce8_avx(high) + z[2 * p + 1]];
        }
    }
    out
}

/// Which code multiplies: the instruction sets of [`Isa`] refined by the VNNI extensions this
/// kernel can use. Every path computes the same bits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Int8Path {
    Scalar,
    /// 256-bit tiles, `vpmaddubsw` + `vpmaddwd`.
    Avx2,
    /// 256-bit tiles, `vpdpbusd` (AVX-VNNI, no AVX-512 needed).
    AvxVnni,
    /// 512-bit pair tiles ([`tile_vnni`]); the odd weight row at a task's edge takes AVX2.
    Avx512Vnni,
}

impl Int8Path {
    /// The best path within instruction set `isa` on this CPU. The vector tiles read f16
    /// parameters with F16C (every AVX2 CPU has it; checked anyway).
    pub fn for_isa(isa: Isa) -> Int8Path {
        #[cfg(target_arch = "x86_64")]
        {
            if isa == Isa::Scalar || !is_x86_feature_detected!("f16c") {
                return Int8Path::Scalar;
            }
            let avx512 = matches!(isa, Isa::Avx512 | Isa::Avx512Vbmi);
            if avx512 && is_x86_feature_detected!("avx512vl") && is_x86_feature_detected!("avx512vnni") {
                Int8Path::Avx512Vnni
            } else if is_x86_feature_detected!("avxvnni") {
                Int8Path::AvxVnni
            } else {
                Int8Path::Avx2
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            let _ = isa;
            Int8Path::Scalar
        }
    }

    /// Every path usable here (tests and benchmarks run them all).
    pub fn available() -> Vec<Int8Path> {
        let mut paths = vec![Int8Path::Scalar];
        let best = Int8Path::for_isa(Isa::detect());
        #[cfg(target_arch = "x86_64")]
        if best != Int8Path::Scalar {
            paths.push(Int8Path::Avx2);
            if is_x86_feature_detected!("avxvnni") {
                paths.push(Int8Path::AvxVnni);
            }
        }
        if !paths.contains(&best) {
            paths.push(best);
        }
        paths
    }

    pub fn name(self) -> &'static str {
        match self {
            Int8Path::Scalar => "scalar",
            Int8Path::Avx2 => "avx2",
            Int8Path::AvxVnni => "avx-vnni",
            Int8Path::Avx512Vnni => "avx512-vnni",
        }
    }
}

/// One call's operands: the path, the weights and their parameters, the quantised
/// activations, and the output (`m` columns) the tiles are stored into.
#[derive(Clone, Copy)]
struct Job<'a> {
    path: Int8Path,
    w: &'a IntMatrix,
    params: &'a Int8Params,
    a: &'a Q8Activations,
    m: usize,
    out: OutPtr,
}

impl Job<'_> {
    /// Stores result `v` of activation row `i`, weight row `o`.
    #[inline(always)]
    fn store(&self, i: usize, o: usize, v: f32) {
        // SAFETY: (i, o) is inside out; column o belongs to the calling task alone.
        unsafe { *self.out.0.add(i * self.m + o) = v };
    }
}

/// One 256-bit (or scalar) tile computed and stored into the output.
#[inline(always)]
fn run_tile<const R: usize, const C: usize>(job: Job<'_>, i0: usize, o0: usize) {
    let Job { path, w, params, a, .. } = job;
    let four = w.bits() == 4;
    // SAFETY: Int8Path::for_isa picks a vector path only when the CPU has its features
    // (AVX2, FMA and F16C for all; AVX-VNNI or AVX-512 VNNI for those).
    let res: [[f32; C]; R] = unsafe {
        match path {
            #[cfg(target_arch = "x86_64")]
            Int8Path::Avx2 | Int8Path::Avx512Vnni if four => tile_avx2::<4, R, C>(w, params, a, i0, o0),
            #[cfg(target_arch = "x86_64")]
            Int8Path::Avx2 | Int8Path::Avx512Vnni => tile_avx2::<8, R, C>(w, params, a, i0, o0),
            #[cfg(target_arch = "x86_64")]
            Int8Path::AvxVnni if four => tile_avx_vnni::<4, R, C>(w, params, a, i0, o0),
            #[cfg(target_arch = "x86_64")]
            Int8Path::AvxVnni => tile_avx_vnni::<8, R, C>(w, params, a, i0, o0),
            _ => std::array::from_fn(|r| std::array::from_fn(|c| dot_reference(w, a, i0 + r, o0 + c))),
        }
    };
    for (r, row) in res.iter().enumerate() {
        for (c, v) in row.iter().enumerate() {
            job.store(i0 + r, o0 + c, *v);
        }
    }
}

/// One tile of `P` weight-row pairs on AVX-512 VNNI.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn run_tile_vnni<const R: usize, const P: usize>(job: Job<'_>, i0: usize, o0: usize) {
    let Job { path, w, params, a, .. } = job;
    assert_eq!(path, Int8Path::Avx512Vnni);
    // SAFETY: that path is chosen only when the CPU has AVX-512 F/BW/VL/VNNI, AVX2, FMA and F16C.
    let res = unsafe {
        if w.bits() == 4 {
            tile_vnni::<4, R, P>(w, params, a, i0, o0)
        } else {
            tile_vnni::<8, R, P>(w, params, a, i0, o0)
        }
    };
    for (r, row) in res.iter().enumerate() {
        for (p, pair) in row.iter().enumerate() {
            job.store(i0 + r, o0 + 2 * p, pair[0]);
            job.store(i0 + r, o0 + 2 * p + 1, pair[1]);
        }
    }
}

#[cfg(not(target_arch = "x86_64"))]
fn run_tile_vnni<const R: usize, const P: usize>(_: Job<'_>, _: usize, _: usize) {
    unreachable!("VNNI tiles exist on x86-64 only")
}

/// Activation rows per pass over a task's weights: 32 rows of int8 activations stay in L2
/// (48 KiB for k = 1536) while every weight tile of the task is applied to them.
const ROWS_PER_PASS: usize = 32;

/// Tile shape (activation rows, weight rows) for a call of `n` activation rows. 256-bit tiles:
/// single rows against 4 weight rows (independent accumulators), batches 4 × 2. AVX-512 VNNI
/// holds two weight rows per register, so it has the registers for 1 × 8 and 4 × 8
/// (`bench_packed`: 1 × 8 decodes 4-18% faster than 1 × 4, and 4 × 4 batches 15-20% slower
/// than 4 × 8).
fn tile_shape(pairs: bool, n: usize) -> (usize, usize) {
    match (pairs, n) {
        (false, 1) => (1, 4),
        (false, _) => (4, 2),
        (true, 1) => (1, 8),
        (true, _) => (4, 8),
    }
}

/// Weight rows `start..end` against every activation row in tiles of [`tile_shape`] (narrower
/// at the edges: a pair of weight rows, then one row on AVX2).
fn run_rows(job: Job<'_>, n: usize, start: usize, end: usize) {
    // AVX-512 VNNI tiles take weight rows in pairs.
    let pairs = job.path == Int8Path::Avx512Vnni;
    let (th, tw) = tile_shape(pairs, n);
    let mut i0 = 0;
    while i0 < n {
        let i_end = (i0 + ROWS_PER_PASS).min(n);
        let mut o = start;
        while o < end {
            let cw = if end - o >= tw {
                tw
            } else if pairs && end - o >= 2 {
                2
            } else {
                1
            };
            let mut i = i0;
            while i < i_end {
                let rh = th.min(i_end - i);
                macro_rules! go {
                    ($($r:literal: $($c:literal)*);*) => {
                        match (pairs && cw % 2 == 0, rh, cw) {
                            $($((false, $r, $c) => run_tile::<$r, $c>(job, i, o),)*
                            (true, $r, 2) => run_tile_vnni::<$r, 1>(job, i, o),
                            (true, $r, 4) => run_tile_vnni::<$r, 2>(job, i, o),
                            (true, $r, 8) => run_tile_vnni::<$r, 4>(job, i, o),)*
                            _ => unreachable!(),
                        }
                    };
                }
                go!(1: 1 2 4; 2: 1 2; 3: 1 2; 4: 1 2);
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

/// As [`int8_matmul_t`] within a chosen instruction set (one of `Isa::available()`).
pub fn int8_matmul_t_isa(isa: Isa, w: &IntMatrix, x: &[f32], out: &mut [f32], n: usize) {
    int8_matmul_t_path(Int8Path::for_isa(isa), w, x, out, n)
}

/// As [`int8_matmul_t`] on a chosen path (one of [`Int8Path::available`]).
pub fn int8_matmul_t_path(path: Int8Path, w: &IntMatrix, x: &[f32], out: &mut [f32], n: usize) {
    assert!(eligible(w), "a {}-bit {}x{} matrix cannot take 8-bit activations", w.bits(), w.rows(), w.cols());
    let (m, k) = (w.rows(), w.cols());
    assert_eq!(x.len(), n * k, "int8_matmul_t: x has {} values, expected {n}x{k}", x.len());
    assert_eq!(out.len(), n * m, "int8_matmul_t: out has {} values, expected {n}x{m}", out.len());
    if n == 0 || m == 0 {
        return;
    }
    let params = int8_params(w);
    // The 512-bit tiles gather parameters with 32-bit indices.
    let path = if path == Int8Path::Avx512Vnni && m * k.div_ceil(w.parts().1) > i32::MAX as usize {
        Int8Path::Avx2
    } else {
        path
    };
    let a = Q8Activations::quantize(x, n, k, w.bits());
    // Tasks of about 32 KiB of packed weights (at least 4 per thread for balance), whole
    // 8-row tiles: a task's weights stay in L2 while each pass of activation rows goes over them.
    let row_bytes = w.parts().0.stride().max(1);
    let balanced = m.div_ceil(4 * rayon::current_num_threads());
    let step = (32 * 1024 / row_bytes).clamp(4, 512).min(balanced.max(4)).div_ceil(8) * 8;
    let out_ptr = OutPtr(out.as_mut_ptr());
    (0..m.div_ceil(step)).into_par_iter().for_each(|task| {
        let (start, end) = (task * step, ((task + 1) * step).min(m));
        run_rows(Job { path, w, params: &params, a: &a, m, out: out_ptr }, n, start, end);
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
        let zero: Vec<f32> =
            (0..groups).map(|i| (r() % (1 << bits)) as f32 + if i % 3 == 0 { 0.37 } else { 0.0 }).collect();
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
        for path in Int8Path::available() {
            int8_matmul_t_path(path, &w, &x, &mut out, 1);
            assert!(out.iter().all(|v| v.is_nan()), "{path:?}: {out:?}");
        }
    }

    #[test]
    fn every_path_computes_the_reference_and_stays_near_the_f32_product() {
        for &(bits, n, k, m, gs) in &[
            (4u32, 1usize, 256usize, 9usize, 32usize),
            (4, 7, 384, 13, 128),
            (8, 5, 96, 6, 32),
            (8, 1, 64, 11, 64),
            (4, 3, 64, 5, 64),
            (4, 6, 128, 75, 32),
            (8, 5, 64, 75, 64),
            (4, 1, 64, 75, 64),
            (8, 1, 32, 75, 32),
        ] {
            let w = matrix(bits, m, k, gs, (bits as u64) << 8 | k as u64);
            let x = activations(n, k, 99 + n as u64);
            let a = Q8Activations::quantize(&x, n, k, bits);
            let deq: Vec<Vec<f32>> = (0..m).map(|r| w.dequantize_row(r)).collect();
            for path in Int8Path::available() {
                let mut out = vec![f32::NAN; n * m];
                int8_matmul_t_path(path, &w, &x, &mut out, n);
                for i in 0..n {
                    for o in 0..m {
                        let got = out[i * m + o];
                        assert_eq!(
                            got.to_bits(),
                            dot_reference(&w, &a, i, o).to_bits(),
                            "{path:?} ({bits},{n},{k},{m},{gs}) [{i},{o}]"
                        );
                        // Against the exact product of the unquantised activations: each block
                        // contributes at most dx/2 · Σ|w| of rounding error.
                        let xr = &x[i * k..(i + 1) * k];
                        let exact: f64 = xr.iter().zip(&deq[o]).map(|(a, b)| *a as f64 * *b as f64).sum();
                        let bound: f64 = (0..k / BLOCK)
                            .map(|b| {
                                a.scale[i * (k / BLOCK) + b] as f64 / 2.0
                                    * deq[o][b * BLOCK..(b + 1) * BLOCK].iter().map(|v| v.abs() as f64).sum::<f64>()
                            })
                            .sum();
                        assert!(
                            (got as f64 - exact).abs() <= bound * 1.01 + 1e-5,
                            "{path:?} [{i},{o}] {got} vs {exact} (bound {bound})"
                        );
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
            let scale: Vec<f32> =
                (0..groups).map(|_| half::f16::from_f32((r() % 1000) as f32 / 20000.0 + 1e-3).to_f32()).collect();
            let zero = vec![if bits == 8 { 128.0 } else { 8.0 }; groups];
            let w = IntMatrix::new(PackedRows::from_codes(bits, m, k, &codes), 32, &scale, &zero)
                .with_int8_activations()
                .unwrap();
            assert!(matches!(w.int8_params(), Some(Int8Params::F16(_))), "{bits}-bit GGUF-like parameters stay f16");
            let x = activations(n, k, 12);
            let a = Q8Activations::quantize(&x, n, k, bits);
            for path in Int8Path::available() {
                let mut out = vec![0.0; n * m];
                int8_matmul_t_path(path, &w, &x, &mut out, n);
                for i in 0..n {
                    for o in 0..m {
                        assert_eq!(
                            out[i * m + o].to_bits(),
                            dot_reference(&w, &a, i, o).to_bits(),
                            "{path:?} {bits}-bit [{i},{o}]"
                        );
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
            for path in Int8Path::available() {
                let mut all = vec![0.0; n * m];
                int8_matmul_t_path(path, &w, &x, &mut all, n);
                for i in 0..n {
                    let rest = n - i;
                    let mut sub = vec![0.0; rest * m];
                    int8_matmul_t_path(path, &w, &x[i * k..], &mut sub, rest);
                    assert_eq!(sub[..m], all[i * m..(i + 1) * m], "{path:?} {bits}-bit sub-batch at {i}");
                }
            }
        }
    }
}
