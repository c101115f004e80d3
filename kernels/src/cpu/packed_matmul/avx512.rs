//! AVX-512 decoders and the direct (decode-step) kernel, generated twice: for AVX-512F+BW and
//! for AVX-512F+BW+VBMI. They differ only in how codes of ≤ 4 bits reach 32-bit lanes; the
//! VBMI variant takes one `vpmultishiftqb` of a broadcast 64-bit load (the broadcast is done by
//! the load unit) where the other needs two or three shuffles, and shuffles share one port with
//! the table permute. Both produce the same lanes, hence the same results bit for bit.
//!
//! A macro rather than generics because `#[target_feature]` cannot depend on a type parameter,
//! and a helper compiled without VBMI cannot inline a VBMI instruction.

use std::arch::x86_64::*;

use super::{all_tables, finish_avx512, tail_weights, Codec, LANES};

/// Shuffle/shift tables of the generic spread (16 source bytes per 128-bit lane).
static TABLES: [([u8; 64], [u32; 16]); 9] = all_tables::<16>();

/// `vpmultishiftqb` controls for codes of ≤ 4 bits: byte 0 of lane `l` takes the 8 bits that
/// start at bit `l·bits` of the broadcast 64-bit word (16 codes take at most 64 bits; offsets
/// wrap within the word, which only ever adds bits above the code). Other bytes are don't-care.
static MULTISHIFT: [[u8; 64]; 5] = {
    let mut t = [[0u8; 64]; 5];
    let mut b = 1;
    while b <= 4 {
        let mut l = 0;
        while l < 16 {
            t[b][4 * l] = (l * b) as u8;
            l += 1;
        }
        b += 1;
    }
    t
};

macro_rules! avx512_kernels {
    ($module:ident, $features:literal, $vbmi:literal) => {
        pub(super) mod $module {
            use super::*;

            #[derive(Clone, Copy)]
            struct Spread {
                bits: u32,
                ctl: __m512i,
                shift: __m512i,
                mask: __m512i,
            }

            #[inline]
            #[target_feature(enable = $features)]
            unsafe fn spread(bits: u32) -> Spread {
                let (ctl, shift) = &TABLES[bits as usize];
                let ctl = if $vbmi && bits <= 4 { &MULTISHIFT[bits as usize] } else { ctl };
                Spread {
                    bits,
                    ctl: _mm512_loadu_si512(ctl.as_ptr() as *const __m512i),
                    shift: _mm512_loadu_si512(shift.as_ptr() as *const __m512i),
                    mask: _mm512_set1_epi32((1i32 << bits) - 1),
                }
            }

            /// Codes `j .. j+16` (`j` a multiple of 16) as 32-bit lanes whose low `bits` bits
            /// are the code; higher bits are masked off only when `masked`.
            #[inline]
            #[target_feature(enable = $features)]
            unsafe fn codes16(row: *const u8, j: usize, s: Spread, masked: bool) -> __m512i {
                let v = match s.bits {
                    // 16 codes start on a byte boundary and fit in 8 bytes.
                    b if $vbmi && b <= 4 => {
                        let src = (row.add(j * b as usize / 8) as *const u64).read_unaligned();
                        _mm512_multishift_epi64_epi8(s.ctl, _mm512_set1_epi64(src as i64))
                    }
                    // Byte i's low nibble is element 2i; shifting 16-bit words right by 4
                    // brings element 2i+1 into the low nibble of byte 2i; interleaving restores
                    // element order.
                    4 => {
                        let b = _mm_loadl_epi64(row.add(j / 2) as *const __m128i);
                        _mm512_cvtepu8_epi32(_mm_unpacklo_epi8(b, _mm_srli_epi16(b, 4)))
                    }
                    8 => return _mm512_cvtepu8_epi32(_mm_loadu_si128(row.add(j) as *const __m128i)),
                    // 16 codes take 2·bits ≤ 16 bytes; every 128-bit lane gets all of them.
                    b => {
                        let src = _mm_loadu_si128(row.add(j * b as usize / 8) as *const __m128i);
                        _mm512_srlv_epi32(_mm512_shuffle_epi8(_mm512_broadcast_i32x4(src), s.ctl), s.shift)
                    }
                };
                if masked {
                    _mm512_and_si512(v, s.mask)
                } else {
                    v
                }
            }

            /// A group's parameters and, for codes of ≤ 4 bits, its 16 weights by code
            /// (repeated with period `2^bits`, so bits above a code are harmless), computed by
            /// the codec's own vector formula on the codes `0..16 mod 2^bits`.
            #[derive(Clone, Copy)]
            struct Group {
                table: __m512,
                p0: __m512,
                p1: __m512,
            }

            #[inline]
            #[target_feature(enable = $features)]
            unsafe fn group<C: Codec, const TABLE: bool>(p: [f32; 2], bits: u32) -> Group {
                let (p0, p1) = (_mm512_set1_ps(p[0]), _mm512_set1_ps(p[1]));
                let table = if let (true, Some(t)) = (TABLE, C::SCALED_TABLE) {
                    _mm512_loadu_ps(t.as_ptr())
                } else if TABLE {
                    let iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
                    C::value_avx512(_mm512_and_si512(iota, _mm512_set1_epi32((1i32 << bits) - 1)), p0, p1)
                } else {
                    _mm512_setzero_ps()
                };
                Group { table, p0, p1 }
            }

            /// Weights `j .. j+16` of a row.
            #[inline]
            #[target_feature(enable = $features)]
            unsafe fn weights16<C: Codec, const TABLE: bool>(row: *const u8, j: usize, s: Spread, g: Group) -> __m512 {
                if TABLE {
                    // vpermps reads the low 4 bits of each index.
                    let v = _mm512_permutexvar_ps(codes16(row, j, s, false), g.table);
                    if C::SCALED_TABLE.is_some() {
                        _mm512_mul_ps(v, g.p0)
                    } else {
                        v
                    }
                } else {
                    C::value_avx512(codes16(row, j, s, true), g.p0, g.p1)
                }
            }

            /// Weights `lo..hi` (multiples of 16, inside one group with parameters `p`).
            #[target_feature(enable = $features)]
            pub(in super::super) unsafe fn decode_range<C: Codec, const TABLE: bool>(
                row: &[u8],
                bits: u32,
                lo: usize,
                hi: usize,
                p: [f32; 2],
                dst: &mut [f32],
            ) {
                let s = spread(bits);
                let g = group::<C, TABLE>(p, bits);
                debug_assert!(hi * bits as usize / 8 + 16 <= row.len());
                let mut j = lo;
                while j < hi {
                    _mm512_storeu_ps(dst.as_mut_ptr().add(j), weights16::<C, TABLE>(row.as_ptr(), j, s, g));
                    j += LANES;
                }
            }

            /// `R` activation rows × weight rows `o0..o0+CC`, each weight chunk decoded once in
            /// registers for all rows (canonical lane order: one accumulator per output).
            #[target_feature(enable = $features)]
            pub(in super::super) unsafe fn direct<C: Codec, const TABLE: bool, const R: usize, const CC: usize>(
                w: &C,
                x: [&[f32]; R],
                o0: usize,
            ) -> [[f32; CC]; R] {
                let p = w.packed();
                let (k, gs, bits) = (p.cols(), w.group_size(), p.bits());
                let s = spread(bits);
                let full = k / LANES * LANES;
                let rows: [*const u8; CC] = std::array::from_fn(|c| p.row_tail(o0 + c).as_ptr());
                let mut acc = [[_mm512_setzero_ps(); CC]; R];
                let mut lo = 0;
                while lo < full {
                    let g = lo / gs;
                    let hi = ((g + 1) * gs).min(full);
                    let mut gt = [group::<C, TABLE>(w.params(o0, g), bits); CC];
                    for c in 1..CC {
                        gt[c] = group::<C, TABLE>(w.params(o0 + c, g), bits);
                    }
                    let mut j = lo;
                    while j < hi {
                        super::super::prefetch_rows(&rows, j, bits, p.stride());
                        let mut xv = [_mm512_setzero_ps(); R];
                        for r in 0..R {
                            xv[r] = _mm512_loadu_ps(x[r].as_ptr().add(j));
                        }
                        for c in 0..CC {
                            let wv = weights16::<C, TABLE>(rows[c], j, s, gt[c]);
                            for r in 0..R {
                                acc[r][c] = _mm512_fmadd_ps(xv[r], wv, acc[r][c]);
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
                        out[r][c] = finish_avx512(acc[r][c], &x[r][full..], &wt[..k - full]);
                    }
                }
                out
            }
        }
    };
}

avx512_kernels!(bw, "avx512f,avx512bw", false);
avx512_kernels!(vbmi, "avx512f,avx512bw,avx512vbmi", true);
