//! Top-k / top-p sampling with thresholds found by bisection over f32 bit patterns: the CPU
//! reference for `kernels/cuda/sampling.cu` (same algorithm step for step; the engine's sampler in
//! host/src/sampling is the production CPU path). See the .cu file for the algorithm.

fn count_ge(p: &[f32], t: f32) -> usize {
    p.iter().filter(|&&x| x >= t).count()
}
fn mass_ge(p: &[f32], t: f32) -> f32 {
    p.iter().filter(|&&x| x >= t).sum()
}

/// The kept threshold: tokens with (unnormalised) probability `>= tau` survive top-k and top-p.
pub fn threshold(p: &[f32], top_k: usize, top_p: f32) -> f32 {
    let mut tau = 0.0f32;
    if top_k > 0 && top_k < p.len() {
        let (mut lo, mut hi) = (0u32, 0x7f80_0000u32);
        while lo < hi {
            let mid = lo + (hi - lo).div_ceil(2);
            if count_ge(p, f32::from_bits(mid)) >= top_k {
                lo = mid
            } else {
                hi = mid - 1
            }
        }
        tau = f32::from_bits(lo);
    }
    if top_p < 1.0 {
        let total = mass_ge(p, tau);
        let (mut lo, mut hi) = (tau.to_bits(), 0x7f80_0000u32);
        while lo < hi {
            let mid = lo + (hi - lo).div_ceil(2);
            if mass_ge(p, f32::from_bits(mid)) >= top_p * total {
                lo = mid
            } else {
                hi = mid - 1
            }
        }
        tau = f32::from_bits(lo);
    }
    tau
}

/// Unnormalised softmax `exp((l − max) / temperature)`.
pub fn unnormalised_probs(logits: &[f32], temperature: f32) -> Vec<f32> {
    let m = logits.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
    logits.iter().map(|&l| ((l - m) / temperature).exp()).collect()
}

/// The token drawn for uniform `u ∈ [0, 1)`: the first index whose running kept mass exceeds
/// `u · kept mass`.
pub fn sample_top_k_top_p(logits: &[f32], temperature: f32, top_k: usize, top_p: f32, u: f32) -> usize {
    let p = unnormalised_probs(logits, temperature);
    let tau = threshold(&p, top_k, top_p);
    let target = u * mass_ge(&p, tau);
    let mut run = 0.0;
    let mut last = 0;
    for (i, &x) in p.iter().enumerate() {
        if x < tau {
            continue;
        }
        run += x;
        last = i;
        if run > target {
            return i;
        }
    }
    last
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn top_k_keeps_the_k_largest_and_top_p_the_smallest_covering_set() {
        let logits: Vec<f32> = (0..10).map(|i| i as f32 * 0.5).collect();
        let p = unnormalised_probs(&logits, 1.0);
        let tau = threshold(&p, 3, 1.0);
        assert_eq!(count_ge(&p, tau), 3);
        assert_eq!(tau, p[7]);
        // top_p: the kept set is the smallest prefix (by probability) with mass >= p.
        let tau = threshold(&p, 0, 0.6);
        let kept: Vec<usize> = (0..10).filter(|&i| p[i] >= tau).collect();
        let total: f32 = p.iter().sum();
        let mass: f32 = kept.iter().map(|&i| p[i]).sum();
        assert!(mass >= 0.6 * total && mass - p[kept[0]] < 0.6 * total, "{kept:?}");
        // u = 0 draws the first kept token; u just below 1 the last.
        assert_eq!(sample_top_k_top_p(&logits, 1.0, 3, 1.0, 0.0), 7);
        assert_eq!(sample_top_k_top_p(&logits, 1.0, 3, 1.0, 0.999_999), 9);
        assert_eq!(sample_top_k_top_p(&logits, 1.0, 1, 1.0, 0.5), 9, "top-1 is greedy");
    }
}
