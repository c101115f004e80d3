//! Dot products with runtime SIMD dispatch.
//!
//! The body is written with eight independent lanes so LLVM turns it into packed vector code; the
//! AVX2+FMA copy is the same body compiled with those features enabled and chosen at run time, so
//! one binary runs everywhere and still uses the wide units where they exist.

use std::sync::OnceLock;

macro_rules! dot_body {
    ($a:expr, $b:expr, $fma:expr) => {{
        let a: &[f32] = $a;
        let b: &[f32] = $b;
        debug_assert_eq!(a.len(), b.len());
        let mut acc = [0.0f32; 16];
        let chunks = a.len() / 16;
        for c in 0..chunks {
            let xa = &a[c * 16..c * 16 + 16];
            let xb = &b[c * 16..c * 16 + 16];
            for i in 0..16 {
                acc[i] = if $fma { xa[i].mul_add(xb[i], acc[i]) } else { acc[i] + xa[i] * xb[i] };
            }
        }
        let mut tail = 0.0f32;
        for i in chunks * 16..a.len() {
            tail += a[i] * b[i];
        }
        // Pairwise lane reduction keeps the rounding error small and independent of length.
        let mut w = 8;
        while w > 0 {
            for i in 0..w {
                acc[i] += acc[i + w];
            }
            w /= 2;
        }
        acc[0] + tail
    }};
}

fn dot_portable(a: &[f32], b: &[f32]) -> f32 {
    dot_body!(a, b, false)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn dot_avx2(a: &[f32], b: &[f32]) -> f32 {
    dot_body!(a, b, true)
}

type DotFn = fn(&[f32], &[f32]) -> f32;

fn select() -> DotFn {
    #[cfg(target_arch = "x86_64")]
    {
        if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
            // SAFETY: the features this function needs were detected on this CPU just above.
            return |a, b| unsafe { dot_avx2(a, b) };
        }
    }
    dot_portable
}

static DOT: OnceLock<DotFn> = OnceLock::new();

/// `sum(a[i] * b[i])`. Panics in debug builds when the lengths differ.
#[inline]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len(), "dot: length mismatch");
    (DOT.get_or_init(select))(a, b)
}

/// Name of the implementation chosen for this CPU (for logs and benchmarks).
pub fn dot_impl_name() -> &'static str {
    #[cfg(target_arch = "x86_64")]
    {
        if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
            return "avx2+fma";
        }
    }
    "portable"
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_naive_sum() {
        for n in [0usize, 1, 7, 16, 33, 576, 1537] {
            let a: Vec<f32> = (0..n).map(|i| ((i * 37 % 101) as f32 - 50.0) / 17.0).collect();
            let b: Vec<f32> = (0..n).map(|i| ((i * 53 % 97) as f32 - 48.0) / 13.0).collect();
            let want: f64 = a.iter().zip(&b).map(|(x, y)| *x as f64 * *y as f64).sum();
            let got = dot(&a, &b) as f64;
            assert!((got - want).abs() <= 1e-4 * (1.0 + want.abs()), "n={n}: {got} vs {want}");
            assert!((dot_portable(&a, &b) as f64 - want).abs() <= 1e-4 * (1.0 + want.abs()));
        }
    }
}
