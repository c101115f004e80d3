//! `y = x · Wᵀ` straight from packed low-bit weights (INT, MXFP4, Cubic), never expanding `W`.
//!
//! A `Codec` says how a code and its group's two parameters turn into an f32 weight; this module
//! does the rest. Each parallel task owns a slice of weight rows. Small batches (`n ≤ 4`, i.e.
//! decode steps) dequantise each 16-weight chunk in registers and use it for every activation row
//! at once; larger batches dequantise a strip of 4 rows into an L1-sized scratch and reuse it
//! across register tiles. Either way each weight is decoded once per call.
//!
//! Dequantising in registers: for codes of at most 4 bits the group's 16 possible weights are
//! computed once per group (the codec's vector formula applied to the codes 0..16) into a
//! register and each chunk is one table permute (`vpermps`), which costs less than any formula
//! and is exact by construction. Wider codes use the codec's vector formula per chunk. With
//! VBMI, codes of ≤ 4 bits reach their lanes through one `vpmultishiftqb` (packed_matmul/avx512.rs).
//!
//! Canonical order (batch and ISA invariance): every output `out[i][o]` is
//! `reduce16(acc)` with `acc[l] = fma(x[i][j], w[o][j], acc[l])` over `j = l, l+16, l+32, …`
//! in increasing `j` (accumulators start at +0.0; a last partial chunk is done element by
//! element into the same lanes), and `reduce16` halves the lanes pairwise (`a[i] += a[i+w]` for
//! `w = 8, 4, 2, 1`). The scalar, AVX2 and AVX-512 paths, direct or through the scratch, all
//! implement exactly this, and every path produces bit-identical weights, so a row's result does
//! not depend on the batch it is in, its place in a register tile, or the instruction set.

use std::sync::OnceLock;

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

use rayon::prelude::*;

use super::bitpack::{code_at, PackedRows};

#[cfg(target_arch = "x86_64")]
mod avx512;

pub const LANES: usize = 16;
/// Weight rows decoded together into the scratch (one register tile's worth of columns).
const STRIP: usize = 4;
/// Batches up to this size decode each weight chunk in registers and use it for every row at
/// once; larger ones decode a strip into scratch once and reuse it across register tiles.
const DIRECT_MAX_N: usize = 4;

/// Instruction set a kernel call runs with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Isa {
    Scalar,
    Avx2,
    Avx512,
    /// AVX-512 plus VBMI: codes of ≤ 4 bits are spread to lanes by one `vpmultishiftqb` of a
    /// broadcast 64-bit load instead of two or three shuffles (the shuffle port is the limit).
    Avx512Vbmi,
}

impl Isa {
    /// The widest instruction set this CPU has (detected once).
    pub fn detect() -> Isa {
        static ISA: OnceLock<Isa> = OnceLock::new();
        *ISA.get_or_init(|| *Self::available().last().unwrap())
    }

    /// Every instruction set usable here, narrowest first (tests run them all).
    pub fn available() -> Vec<Isa> {
        let mut v = vec![Isa::Scalar];
        #[cfg(target_arch = "x86_64")]
        {
            if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
                v.push(Isa::Avx2);
                if is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512bw") {
                    v.push(Isa::Avx512);
                    if is_x86_feature_detected!("avx512vbmi") {
                        v.push(Isa::Avx512Vbmi);
                    }
                }
            }
        }
        v
    }

    pub fn name(self) -> &'static str {
        match self {
            Isa::Scalar => "scalar",
            Isa::Avx2 => "avx2+fma",
            Isa::Avx512 => "avx512f+bw",
            Isa::Avx512Vbmi => "avx512f+bw+vbmi",
        }
    }
}

/// How packed codes become weights. Weights come in groups of `group_size()` consecutive columns
/// of one row sharing two parameters; `group_size` is a multiple of 16 or covers the whole row.
///
/// The vector formulas are only used for codes wider than 4 bits and must return results
/// bit-identical to `value`; the defaults fall back to `value` lane by lane.
pub trait Codec: Sync {
    fn packed(&self) -> &PackedRows;
    fn group_size(&self) -> usize;
    /// The parameters of group `group` of row `row` (meaning is the codec's).
    fn params(&self, row: usize, group: usize) -> [f32; 2];
    fn value(code: u32, p: [f32; 2]) -> f32;
    /// `Some(t)` when a ≤ 4-bit weight is `t[code] · p[0]` (MXFP4). The vector kernels then
    /// permute this constant table and multiply by the broadcast scale instead of building a
    /// table per group: with 32-weight blocks that per-group setup was most of the work.
    /// The product is the same f32 multiply as in `value`, so results stay bit-identical.
    const SCALED_TABLE: Option<&'static [f32; 16]> = None;
    /// # Safety
    /// The CPU must support AVX2 and FMA.
    #[cfg(target_arch = "x86_64")]
    #[inline]
    unsafe fn value_avx2(codes: __m256i, p0: __m256, p1: __m256) -> __m256 {
        let (mut c, mut a, mut b, mut o) = ([0u32; 8], [0f32; 8], [0f32; 8], [0f32; 8]);
        _mm256_storeu_si256(c.as_mut_ptr() as *mut __m256i, codes);
        _mm256_storeu_ps(a.as_mut_ptr(), p0);
        _mm256_storeu_ps(b.as_mut_ptr(), p1);
        for l in 0..8 {
            o[l] = Self::value(c[l], [a[l], b[l]]);
        }
        _mm256_loadu_ps(o.as_ptr())
    }
    /// # Safety
    /// The CPU must support AVX-512F and AVX-512BW.
    #[cfg(target_arch = "x86_64")]
    #[inline]
    unsafe fn value_avx512(codes: __m512i, p0: __m512, p1: __m512) -> __m512 {
        let (mut c, mut a, mut b, mut o) = ([0u32; 16], [0f32; 16], [0f32; 16], [0f32; 16]);
        _mm512_storeu_si512(c.as_mut_ptr() as *mut __m512i, codes);
        _mm512_storeu_ps(a.as_mut_ptr(), p0);
        _mm512_storeu_ps(b.as_mut_ptr(), p1);
        for l in 0..16 {
            o[l] = Self::value(c[l], [a[l], b[l]]);
        }
        _mm512_loadu_ps(o.as_ptr())
    }
}

/// Dequantises row `r` of `w` into `dst` (length `cols`) with the given instruction set.
pub fn decode_row<C: Codec>(isa: Isa, w: &C, r: usize, dst: &mut [f32]) {
    let p = w.packed();
    let (k, gs, bits) = (p.cols(), w.group_size(), p.bits());
    assert_eq!(dst.len(), k);
    let row = p.row_tail(r);
    let full = k / LANES * LANES;
    let mut lo = 0;
    while lo < full {
        let g = lo / gs;
        let hi = ((g + 1) * gs).min(full);
        let params = w.params(r, g);
        let table = bits <= 4;
        match isa {
            // SAFETY: the vector paths are only chosen when Isa::available lists them.
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512Vbmi if table => unsafe {
                avx512::vbmi::decode_range::<C, true>(row, bits, lo, hi, params, dst)
            },
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512Vbmi => unsafe { avx512::vbmi::decode_range::<C, false>(row, bits, lo, hi, params, dst) },
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 if table => unsafe { avx512::bw::decode_range::<C, true>(row, bits, lo, hi, params, dst) },
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => unsafe { avx512::bw::decode_range::<C, false>(row, bits, lo, hi, params, dst) },
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 if table => unsafe { decode_range_avx2::<C, true>(row, bits, lo, hi, params, dst) },
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => unsafe { decode_range_avx2::<C, false>(row, bits, lo, hi, params, dst) },
            _ => {
                for j in lo..hi {
                    dst[j] = C::value(code_at(row, bits, j), params);
                }
            }
        }
        lo = hi;
    }
    for j in full..k {
        dst[j] = C::value(code_at(row, bits, j), w.params(r, j / gs));
    }
}

/// Shuffle/shift tables that spread `bits`-bit codes of a chunk over 32-bit lanes: lane `l`
/// takes the (up to) two source bytes holding bits `l·bits ..`, then shifts right by
/// `l·bits mod 8`. `SRC` is how many source bytes one 128-bit lane sees (8 for AVX2, 16 for
/// AVX-512); control bytes past it read zero (they are never needed: a code's last bit is in
/// byte `(l+1)·bits/8 - 1 < SRC`).
const fn spread_tables<const SRC: usize>(bits: u32) -> ([u8; 64], [u32; 16]) {
    let mut ctl = [0x80u8; 64];
    let mut shift = [0u32; 16];
    let mut l = 0;
    while l < 16 {
        let lane = if SRC == 8 { l % 8 } else { l };
        let p = lane * bits as usize;
        let b0 = p / 8;
        ctl[4 * l] = b0 as u8;
        if b0 + 1 < SRC {
            ctl[4 * l + 1] = (b0 + 1) as u8;
        }
        shift[l] = (p % 8) as u32;
        l += 1;
    }
    (ctl, shift)
}

pub(crate) const fn all_tables<const SRC: usize>() -> [([u8; 64], [u32; 16]); 9] {
    let mut t = [([0u8; 64], [0u32; 16]); 9];
    let mut b = 1;
    while b <= 8 {
        t[b] = spread_tables::<SRC>(b as u32);
        b += 1;
    }
    t
}

#[cfg(target_arch = "x86_64")]
static TABLES_AVX2: [([u8; 64], [u32; 16]); 9] = all_tables::<8>();

// ---------------------------------------------------------------------------------------------
// AVX2: a 16-weight chunk is two halves of 8.

#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy)]
struct Spread256 {
    bits: u32,
    ctl: __m256i,
    shift: __m256i,
    mask: __m256i,
}

#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn spread256(bits: u32) -> Spread256 {
    let (ctl, shift) = &TABLES_AVX2[bits as usize];
    Spread256 {
        bits,
        ctl: _mm256_loadu_si256(ctl.as_ptr() as *const __m256i),
        shift: _mm256_loadu_si256(shift.as_ptr() as *const __m256i),
        mask: _mm256_set1_epi32((1i32 << bits) - 1),
    }
}

/// Codes `j .. j+8` (`j` a multiple of 8) as 32-bit lanes whose low `bits` bits are the code;
/// higher bits are masked off only when `masked` (tables do not need it).
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn codes8(row: *const u8, j: usize, s: Spread256, masked: bool) -> __m256i {
    let v = match s.bits {
        // 4 bytes hold 8 nibbles, element 0 lowest: broadcast and shift lane l by 4·l.
        4 => {
            let v = (row.add(j / 2) as *const u32).read_unaligned() as i32;
            _mm256_srlv_epi32(_mm256_set1_epi32(v), _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28))
        }
        8 => return _mm256_cvtepu8_epi32(_mm_loadl_epi64(row.add(j) as *const __m128i)),
        // 8 codes of `bits` bits start on a byte boundary and fit in 8 bytes.
        b => {
            let src = (row.add(j * b as usize / 8) as *const u64).read_unaligned();
            _mm256_srlv_epi32(_mm256_shuffle_epi8(_mm256_set1_epi64x(src as i64), s.ctl), s.shift)
        }
    };
    if masked {
        _mm256_and_si256(v, s.mask)
    } else {
        v
    }
}

#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy)]
struct Group256 {
    lo: __m256,
    hi: __m256,
    p0: __m256,
    p1: __m256,
}

/// A group's parameters and, for codes of ≤ 4 bits, its 16 weights by code (repeated with period
/// `2^bits`, so bits above a code are harmless), from the codec's own vector formula.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn group256<C: Codec, const TABLE: bool>(p: [f32; 2], bits: u32) -> Group256 {
    let (p0, p1) = (_mm256_set1_ps(p[0]), _mm256_set1_ps(p[1]));
    let (lo, hi) = if let (true, Some(t)) = (TABLE, C::SCALED_TABLE) {
        (_mm256_loadu_ps(t.as_ptr()), _mm256_loadu_ps(t.as_ptr().add(8)))
    } else if TABLE {
        let mask = _mm256_set1_epi32((1i32 << bits) - 1);
        let iota = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        let iota_hi = _mm256_add_epi32(iota, _mm256_set1_epi32(8));
        (C::value_avx2(_mm256_and_si256(iota, mask), p0, p1), C::value_avx2(_mm256_and_si256(iota_hi, mask), p0, p1))
    } else {
        (_mm256_setzero_ps(), _mm256_setzero_ps())
    };
    Group256 { lo, hi, p0, p1 }
}

/// Weights `j .. j+8` of a row.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn weights8<C: Codec, const TABLE: bool>(row: *const u8, j: usize, s: Spread256, g: Group256) -> __m256 {
    if TABLE {
        // Two 8-entry permutes (low 3 bits) and a blend on bit 3, moved to the sign bit.
        let idx = codes8(row, j, s, false);
        let lo = _mm256_permutevar8x32_ps(g.lo, idx);
        let hi = _mm256_permutevar8x32_ps(g.hi, idx);
        let v = _mm256_blendv_ps(lo, hi, _mm256_castsi256_ps(_mm256_slli_epi32(idx, 28)));
        if C::SCALED_TABLE.is_some() {
            _mm256_mul_ps(v, g.p0)
        } else {
            v
        }
    } else {
        C::value_avx2(codes8(row, j, s, true), g.p0, g.p1)
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn decode_range_avx2<C: Codec, const TABLE: bool>(
    row: &[u8],
    bits: u32,
    lo: usize,
    hi: usize,
    p: [f32; 2],
    dst: &mut [f32],
) {
    let s = spread256(bits);
    let g = group256::<C, TABLE>(p, bits);
    debug_assert!(hi * bits as usize / 8 + 8 <= row.len());
    let mut j = lo;
    while j < hi {
        _mm256_storeu_ps(dst.as_mut_ptr().add(j), weights8::<C, TABLE>(row.as_ptr(), j, s, g));
        j += 8;
    }
}

// ---------------------------------------------------------------------------------------------
// Canonical accumulation.

#[inline(always)]
pub fn reduce16(a: [f32; LANES]) -> f32 {
    reduce_halving(a)
}

/// Sum of `N` (a power of two) lanes by halving: `a[i] += a[i + w]` for `w = N/2, …, 1`.
#[inline(always)]
pub(crate) fn reduce_halving<const N: usize>(mut a: [f32; N]) -> f32 {
    let mut w = N / 2;
    while w > 0 {
        for i in 0..w {
            a[i] += a[i + w];
        }
        w /= 2;
    }
    a[0]
}

/// Finishes lanes after the vector loop: the partial last chunk (`x_tail`, `w_tail`: fewer than
/// 16 values), then the reduction.
#[inline(always)]
fn finish(mut acc: [f32; LANES], x_tail: &[f32], w_tail: &[f32]) -> f32 {
    for (l, (x, w)) in x_tail.iter().zip(w_tail).enumerate() {
        acc[l] = x.mul_add(*w, acc[l]);
    }
    reduce16(acc)
}

/// `reduce16` of lanes `lo ‖ hi` (0-7, 8-15) with the same additions, in registers.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn reduce16_avx(lo: __m256, hi: __m256) -> f32 {
    reduce8_avx(_mm256_add_ps(lo, hi))
}

/// `reduce_halving` of 8 lanes (`a[i] += a[i+w]`, `w = 4, 2, 1`), in registers.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx2,fma")]
pub(crate) unsafe fn reduce8_avx(s8: __m256) -> f32 {
    let s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
    let s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1)))
}

/// Lanes → output: vector reduction when there is no partial chunk, else lane by lane.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn finish_avx(lo: __m256, hi: __m256, x_tail: &[f32], w_tail: &[f32]) -> f32 {
    if x_tail.is_empty() {
        return reduce16_avx(lo, hi);
    }
    let mut lanes = [0.0f32; LANES];
    _mm256_storeu_ps(lanes.as_mut_ptr(), lo);
    _mm256_storeu_ps(lanes.as_mut_ptr().add(8), hi);
    finish(lanes, x_tail, w_tail)
}

#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx512f,avx512bw")]
pub(crate) unsafe fn finish_avx512(acc: __m512, x_tail: &[f32], w_tail: &[f32]) -> f32 {
    let lo = _mm512_castps512_ps256(acc);
    let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc), 1));
    finish_avx(lo, hi, x_tail, w_tail)
}

/// The canonical dot product of two dequantised rows (the definition every path follows).
pub fn dot_canonical(x: &[f32], w: &[f32]) -> f32 {
    assert_eq!(x.len(), w.len());
    let full = x.len() / LANES * LANES;
    let mut acc = [0.0f32; LANES];
    for j0 in (0..full).step_by(LANES) {
        for l in 0..LANES {
            acc[l] = x[j0 + l].mul_add(w[j0 + l], acc[l]);
        }
    }
    finish(acc, &x[full..], &w[full..])
}

/// The weights of the partial last chunk of row `r` (scalar decode, same values as the vectors).
pub(crate) fn tail_weights<C: Codec>(w: &C, r: usize, full: usize) -> [f32; LANES] {
    let p = w.packed();
    let mut t = [0.0f32; LANES];
    for j in full..p.cols() {
        t[j - full] = C::value(p.code(r, j), w.params(r, j / w.group_size()));
    }
    t
}

// ---------------------------------------------------------------------------------------------
// Scratch path: register tiles over decoded f32 rows.

fn tile_scalar<const R: usize, const C: usize>(x: [&[f32]; R], w: [&[f32]; C]) -> [[f32; C]; R] {
    std::array::from_fn(|r| std::array::from_fn(|c| dot_canonical(x[r], w[c])))
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn tile_avx2<const R: usize, const C: usize>(x: [&[f32]; R], w: [&[f32]; C]) -> [[f32; C]; R] {
    let k = w[0].len();
    let full = k / LANES * LANES;
    let mut acc = [[[_mm256_setzero_ps(); 2]; C]; R];
    let mut j = 0;
    while j < full {
        // Lanes 0-7, then 8-15: C weight registers and one activation register live at a time
        // beside the 2·R·C accumulators, so a 3×2 tile (12 accumulators) fits AVX2's 16.
        for (half, at) in [j, j + 8].into_iter().enumerate() {
            let mut wv = [_mm256_setzero_ps(); C];
            for c in 0..C {
                wv[c] = _mm256_loadu_ps(w[c].as_ptr().add(at));
            }
            for r in 0..R {
                let xv = _mm256_loadu_ps(x[r].as_ptr().add(at));
                for c in 0..C {
                    acc[r][c][half] = _mm256_fmadd_ps(xv, wv[c], acc[r][c][half]);
                }
            }
        }
        j += LANES;
    }
    let mut out = [[0.0f32; C]; R];
    for r in 0..R {
        for c in 0..C {
            out[r][c] = finish_avx(acc[r][c][0], acc[r][c][1], &x[r][full..], &w[c][full..]);
        }
    }
    out
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn tile_avx512<const R: usize, const C: usize>(x: [&[f32]; R], w: [&[f32]; C]) -> [[f32; C]; R] {
    let k = w[0].len();
    let full = k / LANES * LANES;
    let mut acc = [[_mm512_setzero_ps(); C]; R];
    let mut j = 0;
    while j < full {
        let mut wv = [_mm512_setzero_ps(); C];
        for c in 0..C {
            wv[c] = _mm512_loadu_ps(w[c].as_ptr().add(j));
        }
        for r in 0..R {
            let xv = _mm512_loadu_ps(x[r].as_ptr().add(j));
            for c in 0..C {
                acc[r][c] = _mm512_fmadd_ps(xv, wv[c], acc[r][c]);
            }
        }
        j += LANES;
    }
    let mut out = [[0.0f32; C]; R];
    for r in 0..R {
        for c in 0..C {
            out[r][c] = finish_avx512(acc[r][c], &x[r][full..], &w[c][full..]);
        }
    }
    out
}

/// Pointer wrapper so parallel tasks can write disjoint columns of the output.
#[derive(Clone, Copy)]
pub(crate) struct OutPtr(pub(crate) *mut f32);
// SAFETY: every task writes only the output columns of its own weight rows.
unsafe impl Send for OutPtr {}
unsafe impl Sync for OutPtr {}

/// `out[i0..i0+R, o0..o0+C] = x[i0..i0+R] · strip[0..C]ᵀ`.
#[inline(always)]
fn run_tile<const R: usize, const C: usize>(
    isa: Isa,
    x: &[f32],
    strip: &[f32],
    k: usize,
    m: usize,
    i0: usize,
    o0: usize,
    out: OutPtr,
) {
    let xs: [&[f32]; R] = std::array::from_fn(|r| &x[(i0 + r) * k..(i0 + r + 1) * k]);
    let ws: [&[f32]; C] = std::array::from_fn(|c| &strip[c * k..(c + 1) * k]);
    let res = match isa {
        // SAFETY: the vector paths are only chosen when Isa::available lists them.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 | Isa::Avx512Vbmi => unsafe { tile_avx512::<R, C>(xs, ws) },
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { tile_avx2::<R, C>(xs, ws) },
        _ => tile_scalar::<R, C>(xs, ws),
    };
    for r in 0..R {
        for c in 0..C {
            // SAFETY: (i0+r, o0+c) is inside out; column o0+c belongs to the calling task alone.
            unsafe { *out.0.add((i0 + r) * m + o0 + c) = res[r][c] };
        }
    }
}

/// Multiplies every activation row with a decoded strip of `cols` weight rows, in register tiles
/// of up to 4×4 (AVX-512) or 3×2 (AVX2: a 16-lane accumulator takes two of its 16 registers).
fn run_strip(isa: Isa, x: &[f32], n: usize, k: usize, m: usize, strip: &[f32], cols: usize, o0: usize, out: OutPtr) {
    let (th, tw) = if isa == Isa::Avx2 { (3, 2) } else { (4, 4) };
    let mut c0 = 0;
    while c0 < cols {
        let cw = tw.min(cols - c0);
        let ws = &strip[c0 * k..];
        let mut i = 0;
        while i < n {
            let rh = th.min(n - i);
            macro_rules! go {
                ($($r:literal, $c:literal);*) => {
                    match (rh, cw) {
                        $(($r, $c) => run_tile::<$r, $c>(isa, x, ws, k, m, i, o0 + c0, out),)*
                        _ => unreachable!(),
                    }
                };
            }
            go!(1,1; 1,2; 1,3; 1,4; 2,1; 2,2; 2,3; 2,4; 3,1; 3,2; 3,3; 3,4; 4,1; 4,2; 4,3; 4,4);
            i += rh;
        }
        c0 += cw;
    }
}

// ---------------------------------------------------------------------------------------------
// Direct path: small batches, weights decoded in registers.

/// How far ahead of its reads a weight row stream prefetches (bytes).
const PREFETCH_BYTES: usize = 2048;
/// Rows of at least this many packed bytes are not prefetched: the hardware prefetcher follows a
/// long row well, and the extra requests cost a little there (`bench_bandwidth` 16384 columns:
/// neutral to 5% slower; 576 to 4096 columns: 1.1-1.6x faster with them).
const PREFETCH_MAX_ROW_BYTES: usize = 4096;

/// Software prefetch for the direct path's weight rows (`row_bytes` each), at chunk `j` (16
/// codes): a decode step streams every weight once from memory, and on short rows the hardware
/// prefetcher alone left the loads waiting (SmolLM2, 288-byte rows, decoded at 80 tok/s without
/// this and 112 with it; docs/engine-benchmarks.md).
/// Each row asks for the line `PREFETCH_BYTES` past where it reads (rows are contiguous, so that
/// is a later tile's rows), once per 64 bytes read. A prefetch never faults, so addresses past
/// the end are fine.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(crate) fn prefetch_rows<const CC: usize>(rows: &[*const u8; CC], j: usize, bits: u32, row_bytes: usize) {
    let at = j * bits as usize / 8;
    if row_bytes < PREFETCH_MAX_ROW_BYTES && at % 64 < 2 * bits as usize {
        for row in rows {
            // SAFETY: prefetching has no architectural effect and never faults.
            unsafe { _mm_prefetch::<_MM_HINT_T0>(row.wrapping_add(at + PREFETCH_BYTES) as *const i8) };
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn direct_avx2<C: Codec, const TABLE: bool, const R: usize, const CC: usize>(
    w: &C,
    x: [&[f32]; R],
    o0: usize,
) -> [[f32; CC]; R] {
    let p = w.packed();
    let (k, gs, bits) = (p.cols(), w.group_size(), p.bits());
    let s = spread256(bits);
    let full = k / LANES * LANES;
    let mut rows = [std::ptr::null::<u8>(); CC];
    for c in 0..CC {
        rows[c] = p.row_tail(o0 + c).as_ptr();
    }
    // Lanes 0-7 and 8-15 in separate named arrays so every accumulator stays in a register.
    let mut acc_lo = [[_mm256_setzero_ps(); CC]; R];
    let mut acc_hi = [[_mm256_setzero_ps(); CC]; R];
    let mut lo = 0;
    while lo < full {
        let g = lo / gs;
        let hi = ((g + 1) * gs).min(full);
        let mut gt = [group256::<C, TABLE>(w.params(o0, g), bits); CC];
        for c in 1..CC {
            gt[c] = group256::<C, TABLE>(w.params(o0 + c, g), bits);
        }
        let mut j = lo;
        while j < hi {
            prefetch_rows(&rows, j, bits, p.stride());
            let mut xl = [_mm256_setzero_ps(); R];
            let mut xh = [_mm256_setzero_ps(); R];
            for r in 0..R {
                xl[r] = _mm256_loadu_ps(x[r].as_ptr().add(j));
                xh[r] = _mm256_loadu_ps(x[r].as_ptr().add(j + 8));
            }
            for c in 0..CC {
                let wl = weights8::<C, TABLE>(rows[c], j, s, gt[c]);
                let wh = weights8::<C, TABLE>(rows[c], j + 8, s, gt[c]);
                for r in 0..R {
                    acc_lo[r][c] = _mm256_fmadd_ps(xl[r], wl, acc_lo[r][c]);
                    acc_hi[r][c] = _mm256_fmadd_ps(xh[r], wh, acc_hi[r][c]);
                }
            }
            j += LANES;
        }
        lo = hi;
    }
    let mut out = [[0.0f32; CC]; R];
    for c in 0..CC {
        let wt = tail_weights(w, o0 + c, full);
        for r in 0..R {
            out[r][c] = finish_avx(acc_lo[r][c], acc_hi[r][c], &x[r][full..], &wt[..k - full]);
        }
    }
    out
}

/// One direct tile: `R = n` activation rows × weight rows `o0..o0+CC`, stored into `out`.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn run_direct<C: Codec, const R: usize, const CC: usize>(
    isa: Isa,
    w: &C,
    x: &[f32],
    k: usize,
    m: usize,
    o0: usize,
    out: OutPtr,
) {
    let xs: [&[f32]; R] = std::array::from_fn(|r| &x[r * k..(r + 1) * k]);
    let res = match isa {
        // SAFETY: only called for instruction sets that Isa::available lists.
        Isa::Avx512Vbmi if w.packed().bits() <= 4 => unsafe { avx512::vbmi::direct::<C, true, R, CC>(w, xs, o0) },
        Isa::Avx512Vbmi => unsafe { avx512::vbmi::direct::<C, false, R, CC>(w, xs, o0) },
        Isa::Avx512 if w.packed().bits() <= 4 => unsafe { avx512::bw::direct::<C, true, R, CC>(w, xs, o0) },
        Isa::Avx512 => unsafe { avx512::bw::direct::<C, false, R, CC>(w, xs, o0) },
        _ if w.packed().bits() <= 4 => unsafe { direct_avx2::<C, true, R, CC>(w, xs, o0) },
        _ => unsafe { direct_avx2::<C, false, R, CC>(w, xs, o0) },
    };
    for r in 0..R {
        for c in 0..CC {
            // SAFETY: (r, o0+c) is inside out; column o0+c belongs to the calling task alone.
            unsafe { *out.0.add(r * m + o0 + c) = res[r][c] };
        }
    }
}

/// Weight rows `start..end` for a batch of `n ≤ DIRECT_MAX_N` rows, in tiles sized so the
/// accumulators stay in registers (AVX2: two registers per 16-lane accumulator).
#[cfg(target_arch = "x86_64")]
fn run_direct_rows<C: Codec>(
    isa: Isa,
    w: &C,
    x: &[f32],
    n: usize,
    k: usize,
    m: usize,
    start: usize,
    end: usize,
    out: OutPtr,
) {
    let wide = match (isa, n) {
        (Isa::Avx512 | Isa::Avx512Vbmi, _) => 4,
        (_, 1 | 2) => 2,
        _ => 1,
    };
    let mut o = start;
    while o < end {
        let cc = if end - o >= wide { wide } else { 1 };
        macro_rules! go {
            ($($r:literal, $c:literal);*) => {
                match (n, cc) {
                    $(($r, $c) => run_direct::<C, $r, $c>(isa, w, x, k, m, o, out),)*
                    _ => unreachable!(),
                }
            };
        }
        go!(1,1; 1,2; 1,4; 2,1; 2,2; 2,4; 3,1; 3,4; 4,1; 4,4);
        o += cc;
    }
}

// ---------------------------------------------------------------------------------------------
// Entry points.

/// Weight rows per parallel task, a multiple of `STRIP`. The scratch path reuses each decoded
/// strip across activation rows, so its tasks cover about 32 KiB of packed data (L1-sized). The
/// direct path reads every weight once and reuses only the activations (which stay in cache
/// whatever the task size), so its tasks are as large as balancing allows: about 512 KiB, but at
/// least 4 tasks per thread, since per-task scheduling costs about as much as decoding a few
/// thousand weights.
fn rows_per_task(m: usize, packed_row_bytes: usize, direct: bool) -> usize {
    let row = packed_row_bytes.max(1);
    let r = if direct {
        let balanced = m.div_ceil(4 * rayon::current_num_threads());
        (512 * 1024 / row).min(balanced).max(STRIP)
    } else {
        (32 * 1024 / row).clamp(STRIP, 512)
    };
    (r.div_ceil(STRIP) * STRIP).min(m.max(1))
}

/// `out[n, m] = x[n, k] · Wᵀ` with the widest instruction set this CPU has.
pub fn packed_matmul_t<C: Codec>(w: &C, x: &[f32], out: &mut [f32], n: usize) {
    packed_matmul_t_isa(Isa::detect(), w, x, out, n)
}

/// As `packed_matmul_t` with a chosen instruction set (must be one of `Isa::available()`).
pub fn packed_matmul_t_isa<C: Codec>(isa: Isa, w: &C, x: &[f32], out: &mut [f32], n: usize) {
    assert!(
        isa == Isa::detect() || Isa::available().contains(&isa),
        "instruction set {isa:?} is not available on this CPU"
    );
    let p = w.packed();
    let (m, k) = (p.rows(), p.cols());
    let gs = w.group_size();
    assert!(
        gs > 0 && (gs.is_multiple_of(LANES) || gs >= k),
        "group size {gs} must be a multiple of {LANES} or cover the row ({k})"
    );
    assert_eq!(x.len(), n * k, "packed_matmul_t: x has {} values, expected {n}x{k}", x.len());
    assert_eq!(out.len(), n * m, "packed_matmul_t: out has {} values, expected {n}x{m}", out.len());
    if n == 0 || m == 0 {
        return;
    }
    let direct = cfg!(target_arch = "x86_64") && n <= DIRECT_MAX_N && isa != Isa::Scalar;
    let step = rows_per_task(m, p.stride(), direct);
    let out_ptr = OutPtr(out.as_mut_ptr());
    (0..m.div_ceil(step)).into_par_iter().for_each(|task| {
        let (start, end) = (task * step, ((task + 1) * step).min(m));
        #[cfg(target_arch = "x86_64")]
        if direct {
            return run_direct_rows(isa, w, x, n, k, m, start, end, out_ptr);
        }
        let mut strip = vec![0.0f32; STRIP * k];
        let mut o = start;
        while o < end {
            let c = STRIP.min(end - o);
            for (i, dst) in strip.chunks_exact_mut(k).take(c).enumerate() {
                decode_row(isa, w, o + i, dst);
            }
            run_strip(isa, x, n, k, m, &strip, c, o, out_ptr);
            o += c;
        }
    });
}
