//! Row gathers: the CPU reference for `kernels/cuda/gather.cu` (embedding lookup from an f32 or
//! bf16 table, picking the logit rows, and narrowing activations to bf16 for the bf16 GEMM).

/// `out[r] = src[rows[r]]` for rows of `d` values.
pub fn gather_rows(src: &[f32], rows: &[i32], d: usize, out: &mut [f32]) {
    for (o, &r) in out.chunks_exact_mut(d).zip(rows) {
        o.copy_from_slice(&src[r as usize * d..(r as usize + 1) * d]);
    }
}

/// As [`gather_rows`] from a table of bf16 bit patterns, widened to f32 (exact).
pub fn gather_rows_bf16(src: &[u16], rows: &[i32], d: usize, out: &mut [f32]) {
    for (o, &r) in out.chunks_exact_mut(d).zip(rows) {
        for (y, &b) in o.iter_mut().zip(&src[r as usize * d..(r as usize + 1) * d]) {
            *y = half::bf16::from_bits(b).to_f32();
        }
    }
}

/// Round to nearest even bf16 (the GEMM's input rounding).
pub fn narrow_bf16(x: &[f32]) -> Vec<u16> {
    x.iter().map(|&v| half::bf16::from_f32(v).to_bits()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gathers_rows_in_the_order_asked() {
        let src: Vec<f32> = (0..12).map(|i| i as f32).collect();
        let mut out = vec![0.0; 9];
        gather_rows(&src, &[3, 0, 3], 3, &mut out);
        assert_eq!(out, [9.0, 10.0, 11.0, 0.0, 1.0, 2.0, 9.0, 10.0, 11.0]);
        let b = narrow_bf16(&src);
        let mut wide = vec![0.0; 6];
        gather_rows_bf16(&b, &[1, 2], 3, &mut wide);
        assert_eq!(wide, [3.0, 4.0, 5.0, 6.0, 7.0, 8.0]);
    }
}
