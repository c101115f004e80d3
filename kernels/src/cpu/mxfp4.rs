//! MXFP4 (OCP microscaling): FP4 E2M1 codes, one E8M0 scale per 32 consecutive inputs.
//! `w = E2M1[code] · 2^(e − 127)`; codes are packed two per byte, element 2k in the low nibble
//! of byte k (gpt-oss `*_blocks`, compressed-tensors `mxfp4-pack-quantized` `weight_packed`),
//! which is the dense 4-bit layout of `bitpack`. Products are exact (a power-of-two scaling of a
//! 3-significant-bit value), so decoded weights equal every reference decoder's bit for bit.

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

use super::bitpack::PackedRows;
use super::packed_matmul::{decode_row, packed_matmul_t, Codec, Isa};

/// E2M1 by code: bit 3 sign, then 2 exponent bits and 1 mantissa bit.
pub const E2M1: [f32; 16] = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0];
pub const BLOCK: usize = 32;

/// `2^(e − 127)` for an E8M0 byte; 0xFF is NaN (OCP MX spec).
pub fn e8m0_to_f32(e: u8) -> f32 {
    match e {
        255 => f32::NAN,
        // 2^-127 is subnormal in f32: mantissa bit 22.
        0 => f32::from_bits(1 << 22),
        e => f32::from_bits((e as u32) << 23),
    }
}

pub struct Mxfp4Matrix {
    packed: PackedRows,
    /// E8M0 scale bytes, `[rows, cols / 32]` row-major.
    scales: Vec<u8>,
}

impl Mxfp4Matrix {
    /// `packed`: `rows × cols/2` bytes; `scales`: `rows × cols/32` E8M0 bytes. `cols` must be a
    /// multiple of 32.
    pub fn new(rows: usize, cols: usize, packed: &[u8], scales: &[u8]) -> Self {
        assert!(cols.is_multiple_of(BLOCK), "MXFP4: {cols} columns is not a multiple of {BLOCK}");
        assert_eq!(scales.len(), rows * cols / BLOCK, "MXFP4: scale count");
        Self { packed: PackedRows::new(4, rows, cols, cols / 2, packed), scales: scales.to_vec() }
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

    pub fn bytes(&self) -> usize {
        self.packed.packed_bytes() + self.scales.len()
    }

    /// The `rows × cols/2` code bytes and `rows × cols/32` E8M0 scales, to upload to a device.
    pub fn parts(&self) -> (&[u8], &[u8]) {
        (self.packed.bytes(), &self.scales)
    }

    /// `out[n, rows] = x[n, cols] · Wᵀ`.
    pub fn matmul_t(&self, x: &[f32], out: &mut [f32], n: usize) {
        packed_matmul_t(self, x, out, n)
    }
}

impl Codec for Mxfp4Matrix {
    fn packed(&self) -> &PackedRows {
        &self.packed
    }
    fn group_size(&self) -> usize {
        BLOCK
    }
    #[inline(always)]
    fn params(&self, row: usize, group: usize) -> [f32; 2] {
        [e8m0_to_f32(self.scales[row * (self.cols() / BLOCK) + group]), 0.0]
    }
    #[inline(always)]
    fn value(code: u32, p: [f32; 2]) -> f32 {
        E2M1[code as usize & 15] * p[0]
    }
    const SCALED_TABLE: Option<&'static [f32; 16]> = Some(&E2M1);
    // The packed kernels build each block's 16-entry table with these (one permute and one
    // multiply instead of 16 scalar lookups: with 32-weight blocks that was most of the work).
    #[cfg(target_arch = "x86_64")]
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn value_avx2(codes: __m256i, p0: __m256, _p1: __m256) -> __m256 {
        let lo = _mm256_permutevar8x32_ps(_mm256_loadu_ps(E2M1.as_ptr()), codes);
        let hi = _mm256_permutevar8x32_ps(_mm256_loadu_ps(E2M1.as_ptr().add(8)), codes);
        // Bit 3 of the code (the sign) picks the upper half: moved to the lane's sign bit.
        let v = _mm256_blendv_ps(lo, hi, _mm256_castsi256_ps(_mm256_slli_epi32(codes, 28)));
        _mm256_mul_ps(v, p0)
    }
    #[cfg(target_arch = "x86_64")]
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw")]
    unsafe fn value_avx512(codes: __m512i, p0: __m512, _p1: __m512) -> __m512 {
        _mm512_mul_ps(_mm512_permutexvar_ps(codes, _mm512_loadu_ps(E2M1.as_ptr())), p0)
    }
}

#[cfg(test)]
mod tests {
    use super::super::packed_matmul::{dot_canonical, packed_matmul_t_isa};
    use super::*;

    #[test]
    fn decodes_codes_and_scales() {
        assert_eq!(e8m0_to_f32(127), 1.0);
        assert_eq!(e8m0_to_f32(130), 8.0);
        assert_eq!(e8m0_to_f32(120), 1.0 / 128.0);
        assert_eq!(e8m0_to_f32(0), 2f32.powi(-127));
        assert!(e8m0_to_f32(255).is_nan());
        // Byte 0x71: element 0 = code 1 (0.5), element 1 = code 7 (6.0).
        let mut packed = vec![0u8; 16];
        packed[0] = 0x71;
        packed[15] = 0xF9; // elements 30, 31: -0.5, -6.0
        let m = Mxfp4Matrix::new(1, 32, &packed, &[128]);
        let w = m.dequantize_row(0);
        assert_eq!((w[0], w[1], w[2], w[30], w[31]), (1.0, 12.0, 0.0, -1.0, -12.0));
    }

    #[test]
    fn matmul_is_canonical_and_isa_invariant() {
        let (rows, cols, n) = (11, 96, 6);
        let packed: Vec<u8> = (0..rows * cols / 2).map(|i| (i * 73 % 256) as u8).collect();
        let scales: Vec<u8> = (0..rows * cols / 32).map(|i| 120 + (i % 9) as u8).collect();
        let m = Mxfp4Matrix::new(rows, cols, &packed, &scales);
        let x: Vec<f32> = (0..n * cols).map(|i| ((i * 31 % 97) as f32 - 48.0) / 30.0).collect();
        let deq: Vec<Vec<f32>> = (0..rows).map(|r| m.dequantize_row(r)).collect();
        for r in 0..rows {
            for j in 0..cols {
                let code = (packed[r * cols / 2 + j / 2] >> (4 * (j % 2))) & 15;
                assert_eq!(deq[r][j], E2M1[code as usize] * e8m0_to_f32(scales[r * 3 + j / 32]));
            }
        }
        for isa in Isa::available() {
            let mut out = vec![0.0; n * rows];
            packed_matmul_t_isa(isa, &m, &x, &mut out, n);
            for i in 0..n {
                for r in 0..rows {
                    assert_eq!(out[i * rows + r], dot_canonical(&x[i * cols..(i + 1) * cols], &deq[r]), "{isa:?}");
                }
                let mut one = vec![0.0; rows];
                packed_matmul_t_isa(isa, &m, &x[i * cols..(i + 1) * cols], &mut one, 1);
                assert_eq!(one, out[i * rows..(i + 1) * rows]);
            }
        }
    }
}
