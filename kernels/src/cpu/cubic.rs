//! Cubic low-bit weights (docs/cubic-format.md): `b`-bit codes whose `2^b` levels are
//! `s · (t + a·t³)` on the INT-like grid `t_i = (i − 2^(b−1)) / 2^(b−1)` (which contains 0), with
//! per-group scale `s` (its sign mirrors the grid) and shape `a`.
//!
//! Levels are defined by these f32 operations (so every implementation gets the same bits):
//! `h = 2^(b−1)`, `t_i = (i − h) / h` (exact), `w = s · fma(a·t_i, t_i·t_i, t_i)`.

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

use super::bitpack::PackedRows;
use super::packed_matmul::{decode_row, packed_matmul_t, Codec, Isa};

/// `t_i` for code `i` of `bits` bits: `(i − h)/h`, `h = 2^(bits−1)` (exact in f32).
#[inline(always)]
pub fn grid(i: u32, bits: u32) -> f32 {
    let h = (1u32 << (bits - 1)) as f32;
    (i as f32 - h) / h
}

/// The level of code `i` with unit scale: `fma(a·t, t·t, t)`.
#[inline(always)]
pub fn unit_level(i: u32, bits: u32, a: f32) -> f32 {
    let t = grid(i, bits);
    (a * t).mul_add(t * t, t)
}

/// The weight of code `i`: `s · unit_level`.
#[inline(always)]
pub fn level(i: u32, bits: u32, s: f32, a: f32) -> f32 {
    s * unit_level(i, bits, a)
}

/// Cubic matrices of one bit width (the codec needs `b` statically: one type per width).
pub struct CubicMatrix<const B: u32> {
    packed: PackedRows,
    group_size: usize,
    groups_per_row: usize,
    /// `[s, a]` per (row, group).
    params: Vec<[f32; 2]>,
}

impl<const B: u32> CubicMatrix<B> {
    /// `scale` and `shape` hold `rows × ceil(cols / group_size)` values, row-major.
    pub fn new(packed: PackedRows, group_size: usize, scale: &[f32], shape: &[f32]) -> Self {
        assert_eq!(packed.bits(), B, "CubicMatrix<{B}> with {}-bit codes", packed.bits());
        let groups_per_row = packed.cols().div_ceil(group_size);
        let n = packed.rows() * groups_per_row;
        assert!(
            scale.len() == n && shape.len() == n,
            "CubicMatrix: {} / {} parameters for {n} groups",
            scale.len(),
            shape.len()
        );
        Self { packed, group_size, groups_per_row, params: scale.iter().zip(shape).map(|(&s, &a)| [s, a]).collect() }
    }

    pub fn rows(&self) -> usize {
        self.packed.rows()
    }
    pub fn cols(&self) -> usize {
        self.packed.cols()
    }

    pub fn dequantize_row(&self, r: usize) -> Vec<f32> {
        let mut v = vec![0.0; self.cols()];
        decode_row(Isa::detect(), self, r, &mut v);
        v
    }

    pub fn matmul_t(&self, x: &[f32], out: &mut [f32], n: usize) {
        packed_matmul_t(self, x, out, n)
    }
}

impl<const B: u32> Codec for CubicMatrix<B> {
    fn packed(&self) -> &PackedRows {
        &self.packed
    }
    fn group_size(&self) -> usize {
        self.group_size
    }
    #[inline(always)]
    fn params(&self, row: usize, group: usize) -> [f32; 2] {
        self.params[row * self.groups_per_row + group]
    }
    #[inline(always)]
    fn value(code: u32, p: [f32; 2]) -> f32 {
        level(code, B, p[0], p[1])
    }
    // Codes of ≤ 4 bits go through per-group tables; these serve 5..8 bits.
    #[cfg(target_arch = "x86_64")]
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn value_avx2(codes: __m256i, p0: __m256, p1: __m256) -> __m256 {
        // (i − h)·(1/h) is exact, hence equal to the scalar (i − h)/h.
        let h = (1u32 << (B - 1)) as f32;
        let t = _mm256_mul_ps(_mm256_sub_ps(_mm256_cvtepi32_ps(codes), _mm256_set1_ps(h)), _mm256_set1_ps(1.0 / h));
        _mm256_mul_ps(p0, _mm256_fmadd_ps(_mm256_mul_ps(p1, t), _mm256_mul_ps(t, t), t))
    }
    #[cfg(target_arch = "x86_64")]
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw")]
    unsafe fn value_avx512(codes: __m512i, p0: __m512, p1: __m512) -> __m512 {
        // (i − h)·(1/h) is exact, hence equal to the scalar (i − h)/h.
        let h = (1u32 << (B - 1)) as f32;
        let t = _mm512_mul_ps(_mm512_sub_ps(_mm512_cvtepi32_ps(codes), _mm512_set1_ps(h)), _mm512_set1_ps(1.0 / h));
        _mm512_mul_ps(p0, _mm512_fmadd_ps(_mm512_mul_ps(p1, t), _mm512_mul_ps(t, t), t))
    }
}

/// A Cubic matrix of any supported width.
pub enum AnyCubic {
    B1(CubicMatrix<1>),
    B2(CubicMatrix<2>),
    B3(CubicMatrix<3>),
    B4(CubicMatrix<4>),
    B5(CubicMatrix<5>),
    B6(CubicMatrix<6>),
    B7(CubicMatrix<7>),
    B8(CubicMatrix<8>),
}

macro_rules! each {
    ($self:expr, $m:ident => $e:expr) => {
        match $self {
            AnyCubic::B1($m) => $e,
            AnyCubic::B2($m) => $e,
            AnyCubic::B3($m) => $e,
            AnyCubic::B4($m) => $e,
            AnyCubic::B5($m) => $e,
            AnyCubic::B6($m) => $e,
            AnyCubic::B7($m) => $e,
            AnyCubic::B8($m) => $e,
        }
    };
}

impl AnyCubic {
    pub fn new(packed: PackedRows, group_size: usize, scale: &[f32], shape: &[f32]) -> Self {
        match packed.bits() {
            1 => AnyCubic::B1(CubicMatrix::new(packed, group_size, scale, shape)),
            2 => AnyCubic::B2(CubicMatrix::new(packed, group_size, scale, shape)),
            3 => AnyCubic::B3(CubicMatrix::new(packed, group_size, scale, shape)),
            4 => AnyCubic::B4(CubicMatrix::new(packed, group_size, scale, shape)),
            5 => AnyCubic::B5(CubicMatrix::new(packed, group_size, scale, shape)),
            6 => AnyCubic::B6(CubicMatrix::new(packed, group_size, scale, shape)),
            7 => AnyCubic::B7(CubicMatrix::new(packed, group_size, scale, shape)),
            _ => AnyCubic::B8(CubicMatrix::new(packed, group_size, scale, shape)),
        }
    }
    pub fn bits(&self) -> u32 {
        each!(self, m => m.packed.bits())
    }
    /// The packed codes, group size and `[s, a]` per (row, group), to upload to a device.
    pub fn parts(&self) -> (&PackedRows, usize, &[[f32; 2]]) {
        each!(self, m => (&m.packed, m.group_size, &m.params[..]))
    }
    pub fn rows(&self) -> usize {
        each!(self, m => m.rows())
    }
    pub fn cols(&self) -> usize {
        each!(self, m => m.cols())
    }
    pub fn dequantize_row(&self, r: usize) -> Vec<f32> {
        each!(self, m => m.dequantize_row(r))
    }
    /// Bytes held: packed codes plus per-group parameters (what a multiply reads).
    pub fn bytes(&self) -> usize {
        each!(self, m => m.packed.packed_bytes() + m.params.len() * 8)
    }
    pub fn matmul_t(&self, x: &[f32], out: &mut [f32], n: usize) {
        each!(self, m => m.matmul_t(x, out, n))
    }
    pub fn matmul_t_isa(&self, isa: Isa, x: &[f32], out: &mut [f32], n: usize) {
        each!(self, m => super::packed_matmul::packed_matmul_t_isa(isa, m, x, out, n))
    }
}

#[cfg(test)]
mod tests {
    use super::super::packed_matmul::dot_canonical;
    use super::*;

    #[test]
    fn grid_contains_zero_and_is_uniform_when_a_is_zero() {
        for bits in 1..=8 {
            let h = 1u32 << (bits - 1);
            for a in [0.0f32, 0.3, 1.0] {
                assert_eq!(unit_level(h, bits, a), 0.0);
                assert_eq!(unit_level(0, bits, a), -(1.0 + a));
                for i in 1..h {
                    assert_eq!(unit_level(h + i, bits, a), -unit_level(h - i, bits, a));
                    assert!(unit_level(h + i, bits, a) > unit_level(h + i - 1, bits, a));
                }
            }
            for i in 0..2 * h {
                assert_eq!(unit_level(i, bits, 0.0), (i as f32 - h as f32) / h as f32);
            }
        }
        assert_eq!(grid(1, 2), -0.5);
        assert_eq!(level(3, 2, -2.0, 0.0), -1.0, "a negative scale mirrors the grid");
    }

    #[test]
    fn every_width_decodes_and_multiplies_identically_on_every_isa() {
        for bits in 1..=8u32 {
            let (rows, cols, gs, n) = (6, 544, 32, 5);
            let codes: Vec<u8> = (0..rows * cols).map(|i| ((i * 97 + 13) % (1 << bits)) as u8).collect();
            let groups = rows * cols / gs;
            let scale: Vec<f32> = (0..groups).map(|g| 0.01 + g as f32 * 1e-4).collect();
            let shape: Vec<f32> = (0..groups).map(|g| (g % 7) as f32 * 0.15).collect();
            let scale: Vec<f32> = scale.iter().enumerate().map(|(g, &s)| if g % 3 == 0 { -s } else { s }).collect();
            let m = AnyCubic::new(PackedRows::from_codes(bits, rows, cols, &codes), gs, &scale, &shape);
            let x: Vec<f32> = (0..n * cols).map(|i| ((i * 31 % 97) as f32 - 48.0) / 30.0).collect();
            let deq: Vec<Vec<f32>> = (0..rows).map(|r| m.dequantize_row(r)).collect();
            for r in 0..rows {
                for j in 0..cols {
                    let g = r * (cols / gs) + j / gs;
                    assert_eq!(deq[r][j], level(codes[r * cols + j] as u32, bits, scale[g], shape[g]), "bits {bits}");
                }
            }
            for isa in Isa::available() {
                let mut out = vec![0.0; n * rows];
                m.matmul_t_isa(isa, &x, &mut out, n);
                for i in 0..n {
                    for r in 0..rows {
                        assert_eq!(
                            out[i * rows + r],
                            dot_canonical(&x[i * cols..(i + 1) * cols], &deq[r]),
                            "{isa:?} bits {bits}"
                        );
                    }
                }
                // Decode-sized batches take the direct (in-register) path: same results.
                for nd in 1..=4 {
                    let mut direct = vec![0.0; nd * rows];
                    m.matmul_t_isa(isa, &x[..nd * cols], &mut direct, nd);
                    assert_eq!(direct, out[..nd * rows], "{isa:?} bits {bits} direct n={nd}");
                }
            }
        }
    }
}
