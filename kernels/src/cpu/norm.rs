//! RMSNorm as in Llama: `y = x / sqrt(mean(x²) + eps) * weight`, accumulated in f32 like PyTorch.

use super::dot::dot;

/// Normalises each row of `x` (`rows × weight.len()`) into `out`.
pub fn rms_norm(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    let d = weight.len();
    assert_eq!(x.len() % d, 0, "rms_norm: input is not a whole number of rows");
    assert_eq!(x.len(), out.len(), "rms_norm: output size differs from input");
    for (xr, yr) in x.chunks_exact(d).zip(out.chunks_exact_mut(d)) {
        let mean_sq = dot(xr, xr) / d as f32;
        let inv = 1.0 / (mean_sq + eps).sqrt();
        for ((y, &v), &w) in yr.iter_mut().zip(xr).zip(weight) {
            *y = w * (v * inv);
        }
    }
}

/// The fused residual step before a norm: `x += delta`, then `out = rms_norm(x)` (the CPU
/// reference for `add_rms_norm` in kernels/cuda/norm.cu).
pub fn add_rms_norm(x: &mut [f32], delta: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    assert_eq!(x.len(), delta.len(), "add_rms_norm: residual and delta differ in size");
    for (a, &b) in x.iter_mut().zip(delta) {
        *a += b;
    }
    rms_norm(x, weight, eps, out);
}

#[cfg(test)]
mod tests {
    #[test]
    fn unit_rows_stay_unit() {
        let x = [1.0f32, -1.0, 1.0, -1.0];
        let mut y = [0.0; 4];
        super::rms_norm(&x, &[2.0; 4], 0.0, &mut y);
        assert_eq!(y, [2.0, -2.0, 2.0, -2.0]);
    }
}
