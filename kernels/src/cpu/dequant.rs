//! Dequantisation of a whole packed matrix to bf16 and f32 → bf16 narrowing: the CPU reference
//! for `kernels/cuda/dequant.cu`, which expands a packed weight into bf16 so that a prefill-size
//! batch runs on the dense bf16 GEMM. The decoded values come from each format's own
//! `dequantize_row` (no second decoder); the narrowing is `half`'s round-to-nearest-even, the
//! same rounding (and quiet-NaN rule) as the prelude's `f32_to_bf16`.

use super::cubic::AnyCubic;
use super::mxfp4::Mxfp4Matrix;
use super::quant_int::IntMatrix;

/// A packed weight format that can decode one row to f32.
pub trait DequantizeRows {
    fn rows(&self) -> usize;
    fn cols(&self) -> usize;
    fn dequantize_row(&self, r: usize) -> Vec<f32>;
}

macro_rules! rows_via_inherent {
    ($($t:ty),*) => {$(
        impl DequantizeRows for $t {
            fn rows(&self) -> usize {
                <$t>::rows(self)
            }
            fn cols(&self) -> usize {
                <$t>::cols(self)
            }
            fn dequantize_row(&self, r: usize) -> Vec<f32> {
                <$t>::dequantize_row(self, r)
            }
        }
    )*};
}
rows_via_inherent!(IntMatrix, AnyCubic, Mxfp4Matrix);

/// `x` narrowed to bf16 bit patterns, round to nearest even.
pub fn f32_to_bf16_rows(x: &[f32]) -> Vec<u16> {
    x.iter().map(|&v| half::bf16::from_f32(v).to_bits()).collect()
}

/// The whole matrix as bf16 bit patterns, `[rows, cols]` row-major.
pub fn dequantize_bf16(w: &impl DequantizeRows) -> Vec<u16> {
    let mut out = Vec::with_capacity(w.rows() * w.cols());
    for r in 0..w.rows() {
        out.extend(w.dequantize_row(r).into_iter().map(|v| half::bf16::from_f32(v).to_bits()));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::bitpack::PackedRows;

    #[test]
    fn narrowing_rounds_to_nearest_even_and_keeps_nan_quiet() {
        let below_half = f32::from_bits(0x3f80_7fff); // 1 + just under half a bf16 ulp
        let tie_even = f32::from_bits(0x3f80_8000); // exactly half: stays on the even 0x3f80
        let tie_odd = f32::from_bits(0x3f81_8000); // exactly half above an odd: rounds up
        let got = f32_to_bf16_rows(&[below_half, tie_even, tie_odd, f32::from_bits(0x7f80_0001), -0.0]);
        assert_eq!(got[..3], [0x3f80, 0x3f80, 0x3f82]);
        assert_eq!(got[3] & 0x7fc0, 0x7fc0, "signalling NaN becomes a quiet NaN");
        assert_eq!(got[4], 0x8000);
    }

    #[test]
    fn int_matrix_dequantises_to_the_rounded_row_values() {
        // 3-bit codes, 5 columns, group size 2 (the last group is partial).
        let codes = [0u8, 7, 3, 4, 5, 1, 2, 6, 7, 0];
        let w = IntMatrix::new(
            PackedRows::from_codes(3, 2, 5, &codes),
            2,
            &[0.5, 0.25, 2.0, 1.0, 0.125, 3.0],
            &[4.0, 4.0, 0.0, 4.0, 4.0, 1.0],
        );
        let want: Vec<f32> = vec![-2.0, 1.5, -0.25, 0.0, 10.0, -3.0, -2.0, 0.25, 0.375, -3.0];
        assert_eq!(dequantize_bf16(&w), f32_to_bf16_rows(&want));
    }
}
