//! Uniform integer weights (compressed-tensors `pack-quantized`, GPTQ/AWQ-style W4A16/W8A16):
//! `w = (u − z) · s` with `u` the stored unsigned `b`-bit code, `z` the group's stored unsigned
//! zero point (`2^(b−1)` when symmetric) and `s` its scale.
//!
//! `u − z` is a small integer, so with bf16/f16 scales the f32 product is exact: these weights are
//! the mathematically defined dequantised values, which round to compressed-tensors' bf16
//! decompression bit for bit.

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

use super::bitpack::PackedRows;
use super::packed_matmul::{decode_row, packed_matmul_t, Codec, Isa};

pub struct IntMatrix {
    packed: PackedRows,
    group_size: usize,
    groups_per_row: usize,
    /// `[scale, zero]` per (row, group), row-major.
    params: Vec<[f32; 2]>,
    /// Set when inputs are multiplied as 8-bit activations ([`super::int8_matmul`]): the
    /// parameters that arithmetic reads, per (row, group).
    /// (Boxed: most matrices never switch, and every Linear carries this field.)
    int8: Option<Box<super::int8_matmul::Int8Params>>,
}

impl IntMatrix {
    /// `scale` and `zero` hold `rows × ceil(cols / group_size)` values (row-major); `zero` values
    /// are stored unsigned codes. Panics on inconsistent sizes.
    pub fn new(packed: PackedRows, group_size: usize, scale: &[f32], zero: &[f32]) -> Self {
        let groups_per_row = packed.cols().div_ceil(group_size);
        let n = packed.rows() * groups_per_row;
        assert_eq!(scale.len(), n, "IntMatrix: {} scales for {n} groups", scale.len());
        assert_eq!(zero.len(), n, "IntMatrix: {} zero points for {n} groups", zero.len());
        let params = scale.iter().zip(zero).map(|(&s, &z)| [s, z]).collect();
        Self { packed, group_size, groups_per_row, params, int8: None }
    }

    /// This matrix multiplied with its inputs quantised to 8 bits per 32 values and integer dot
    /// products (llama.cpp's arithmetic: faster decode, docs/engine-benchmarks.md, at a relative
    /// input rounding of up to 1/254 per block). `Err` with the reason when the layout does not
    /// allow it ([`super::int8_matmul::eligible`]).
    pub fn with_int8_activations(mut self) -> Result<Self, String> {
        if !super::int8_matmul::eligible(&self) {
            return Err(format!(
                "8-bit activations need 4- or 8-bit codes in rows and groups of whole {}-value blocks; this matrix has {}-bit codes, {} columns, groups of {}",
                super::int8_matmul::BLOCK,
                self.bits(),
                self.cols(),
                self.group_size
            ));
        }
        self.int8 = Some(Box::new(super::int8_matmul::Int8Params::new(self.bits(), &self.params)));
        Ok(self)
    }

    pub fn int8_activations(&self) -> bool {
        self.int8.is_some()
    }

    pub(crate) fn int8_params(&self) -> Option<&super::int8_matmul::Int8Params> {
        self.int8.as_deref()
    }

    pub fn rows(&self) -> usize {
        self.packed.rows()
    }
    pub fn cols(&self) -> usize {
        self.packed.cols()
    }
    pub fn bits(&self) -> u32 {
        self.packed.bits()
    }
    /// The packed codes, group size and `[scale, zero]` per (row, group), to upload to a device.
    pub fn parts(&self) -> (&PackedRows, usize, &[[f32; 2]]) {
        (&self.packed, self.group_size, &self.params)
    }

    /// Row `r` dequantised to f32 (for tests and conversions; inference multiplies packed).
    pub fn dequantize_row(&self, r: usize) -> Vec<f32> {
        let mut v = vec![0.0; self.cols()];
        decode_row(Isa::detect(), self, r, &mut v);
        v
    }

    /// Bytes held: packed codes plus per-group parameters.
    pub fn bytes(&self) -> usize {
        self.packed.packed_bytes() + self.params.len() * 8 + self.int8.as_ref().map_or(0, |p| p.bytes())
    }

    /// `out[n, rows] = x[n, cols] · Wᵀ`.
    pub fn matmul_t(&self, x: &[f32], out: &mut [f32], n: usize) {
        if self.int8.is_some() {
            return super::int8_matmul::int8_matmul_t(self, x, out, n);
        }
        packed_matmul_t(self, x, out, n)
    }
}

impl Codec for IntMatrix {
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
        (code as f32 - p[1]) * p[0]
    }
    #[cfg(target_arch = "x86_64")]
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn value_avx2(codes: __m256i, p0: __m256, p1: __m256) -> __m256 {
        _mm256_mul_ps(_mm256_sub_ps(_mm256_cvtepi32_ps(codes), p1), p0)
    }
    #[cfg(target_arch = "x86_64")]
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw")]
    unsafe fn value_avx512(codes: __m512i, p0: __m512, p1: __m512) -> __m512 {
        _mm512_mul_ps(_mm512_sub_ps(_mm512_cvtepi32_ps(codes), p1), p0)
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::super::packed_matmul::{dot_canonical, packed_matmul_t_isa};
    use super::*;

    /// Deterministic pseudo-random stream (tests must not depend on a crate's RNG).
    pub(crate) fn lcg(seed: u64) -> impl FnMut() -> u32 {
        let mut s = seed;
        move || {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (s >> 33) as u32
        }
    }

    fn random_matrix(bits: u32, rows: usize, cols: usize, gs: usize, seed: u64) -> IntMatrix {
        let mut r = lcg(seed);
        let codes: Vec<u8> = (0..rows * cols).map(|_| (r() % (1 << bits)) as u8).collect();
        let groups = rows * cols.div_ceil(gs);
        let scale: Vec<f32> =
            (0..groups).map(|_| half::bf16::from_f32((r() % 1000) as f32 / 20000.0 + 1e-3).to_f32()).collect();
        let zero: Vec<f32> = (0..groups).map(|_| (r() % (1 << bits)) as f32).collect();
        IntMatrix::new(PackedRows::from_codes(bits, rows, cols, &codes), gs, &scale, &zero)
    }

    /// `n × k` activations uniform in [-1, 1].
    pub(crate) fn activations(n: usize, k: usize, seed: u64) -> Vec<f32> {
        let mut r = lcg(seed);
        (0..n * k).map(|_| (r() % 2001) as f32 / 1000.0 - 1.0).collect()
    }

    #[test]
    fn decoders_agree_across_instruction_sets() {
        for bits in 1..=8 {
            for &(cols, gs) in &[(64usize, 16usize), (200, 200), (384, 128), (77, 77)] {
                let w = random_matrix(bits, 3, cols, gs, bits as u64 * 7 + cols as u64);
                for r in 0..3 {
                    let mut want = vec![0.0f32; cols];
                    decode_row(Isa::Scalar, &w, r, &mut want);
                    for j in 0..cols {
                        let p = w.params(r, j / gs);
                        assert_eq!(want[j], (w.packed.code(r, j) as f32 - p[1]) * p[0]);
                    }
                    for isa in Isa::available() {
                        let mut got = vec![0.0f32; cols];
                        decode_row(isa, &w, r, &mut got);
                        assert_eq!(got, want, "{isa:?} bits {bits} cols {cols} row {r}");
                    }
                }
            }
        }
    }

    #[test]
    fn matmul_is_the_canonical_dot_of_dequantised_rows_on_every_isa() {
        for &(bits, n, k, m, gs) in &[
            (4u32, 1usize, 256usize, 9usize, 128usize),
            (4, 7, 384, 13, 32),
            (8, 5, 96, 6, 96),
            (3, 3, 200, 5, 200),
            (2, 6, 64, 4, 16),
        ] {
            let w = random_matrix(bits, m, k, gs, (bits as u64) << 8 | k as u64);
            let x = activations(n, k, 99 + n as u64);
            let deq: Vec<Vec<f32>> = (0..m).map(|r| w.dequantize_row(r)).collect();
            for isa in Isa::available() {
                let mut out = vec![f32::NAN; n * m];
                packed_matmul_t_isa(isa, &w, &x, &mut out, n);
                for i in 0..n {
                    for o in 0..m {
                        let xr = &x[i * k..(i + 1) * k];
                        assert_eq!(
                            out[i * m + o],
                            dot_canonical(xr, &deq[o]),
                            "{isa:?} ({bits},{n},{k},{m}) [{i},{o}]"
                        );
                        let exact: f64 = xr.iter().zip(&deq[o]).map(|(a, b)| *a as f64 * *b as f64).sum();
                        assert!((out[i * m + o] as f64 - exact).abs() < 1e-4 * (1.0 + exact.abs()));
                    }
                }
            }
        }
    }

    #[test]
    fn rows_are_bit_identical_whatever_the_batch() {
        let (k, m) = (256, 37);
        let w = random_matrix(4, m, k, 128, 5);
        let n = 13;
        let x = activations(n, k, 6);
        for isa in Isa::available() {
            let mut all = vec![0.0; n * m];
            packed_matmul_t_isa(isa, &w, &x, &mut all, n);
            for i in 0..n {
                let mut one = vec![0.0; m];
                packed_matmul_t_isa(isa, &w, &x[i * k..(i + 1) * k], &mut one, 1);
                assert_eq!(one, all[i * m..(i + 1) * m], "{isa:?} row {i}");
                // Any sub-batch starting here gives the same row too.
                let rest = n - i;
                let mut sub = vec![0.0; rest * m];
                packed_matmul_t_isa(isa, &w, &x[i * k..], &mut sub, rest);
                assert_eq!(sub[..m], all[i * m..(i + 1) * m], "{isa:?} sub-batch at {i}");
            }
        }
    }
}
