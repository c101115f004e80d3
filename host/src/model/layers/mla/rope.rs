//! RoPE for MLA's rotary slices: YaRN frequencies and attention factor computed as transformers'
//! `_compute_yarn_parameters` does, and DeepSeek's interleaved pair layout.
//!
//! With `interleave`, a slice `(x0,x1,x2,x3,…)` holds rotary pairs `(x0,x1),(x2,x3),…`; it is
//! first reordered to `(x0,x2,…,x1,x3,…)` and then rotated in the rotate-half layout. The result
//! stays in that reordered layout — exactly what transformers' `apply_rotary_pos_emb_interleave`
//! returns — which is fine because queries and cached keys are reordered the same way and only
//! their dot products are used.

use kernels::cpu::rope::{rope_rows, Rope};

use crate::model::layers::mla::config::{yarn_get_mscale, MlaRope, Yarn};

pub struct MlaRotary {
    pub(crate) rope: Rope,
    pub(crate) interleave: bool,
    /// YaRN multiplies cos and sin by this (so each rotated slice is scaled by it).
    pub(crate) attention_factor: f32,
    dim: usize,
}

impl MlaRotary {
    pub fn new(cfg: &MlaRope, dim: usize) -> Self {
        let (inv_freq, attention_factor) = match &cfg.yarn {
            None => ((0..dim / 2).map(|i| 1.0f32 / cfg.theta.powf((2 * i) as f32 / dim as f32)).collect(), 1.0),
            Some(y) => yarn_inv_freq(y, cfg.theta, dim),
        };
        Self { rope: Rope::from_inv_freq(inv_freq), interleave: cfg.interleave, attention_factor, dim }
    }

    /// Rotates every `dim`-wide slice of `x` for position `pos` (`kernels::cpu::rope::rope_rows`,
    /// the device kernel's reference).
    pub fn apply(&self, x: &mut [f32], pos: usize) {
        debug_assert_eq!(self.rope.inv_freq().len() * 2, self.dim);
        rope_rows(x, pos, self.rope.inv_freq(), self.interleave, self.attention_factor);
    }
}

/// (inverse frequencies, attention factor) of YaRN over a `dim`-wide rotary slice.
fn yarn_inv_freq(y: &Yarn, theta: f32, dim: usize) -> (Vec<f32>, f32) {
    let factor = y.factor as f64;
    let attention_factor = match y.attention_factor {
        Some(a) => a,
        None => match (y.mscale, y.mscale_all_dim) {
            (Some(m), Some(ma)) if m != 0.0 && ma != 0.0 => {
                (yarn_get_mscale(factor, m as f64) / yarn_get_mscale(factor, ma as f64)) as f32
            }
            _ => yarn_get_mscale(factor, 1.0) as f32,
        },
    };
    // The correction range is computed in f64 like Python; the frequencies in f32 like torch.
    let (base, orig) = (theta as f64, y.original_max_position_embeddings as f64);
    let correction_dim = |rot: f64| (dim as f64 * (orig / (rot * 2.0 * std::f64::consts::PI)).ln()) / (2.0 * base.ln());
    let (mut low, mut high) = (correction_dim(y.beta_fast as f64), correction_dim(y.beta_slow as f64));
    if y.truncate {
        low = low.floor();
        high = high.ceil();
    }
    let (low, mut high) = (low.max(0.0), high.min(dim as f64 - 1.0));
    if low == high {
        high += 0.001; // transformers' guard against a zero-width ramp
    }
    let (low, high) = (low as f32, high as f32);
    let inv = (0..dim / 2)
        .map(|i| {
            let pos_freq = theta.powf((2 * i) as f32 / dim as f32);
            let extrapolation = 1.0 / pos_freq;
            let interpolation = 1.0 / (y.factor * pos_freq);
            let ramp = ((i as f32 - low) / (high - low)).clamp(0.0, 1.0);
            let extra_factor = 1.0 - ramp;
            interpolation * (1.0 - extra_factor) + extrapolation * extra_factor
        })
        .collect();
    (inv, attention_factor)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn interleaved_pairs_rotate_together() {
        let cfg = MlaRope { theta: 10000.0, interleave: true, yarn: None };
        let r = MlaRotary::new(&cfg, 4);
        // pairs (1,2) and (3,4) at position 0: only the reordering happens.
        let mut x = [1.0f32, 2.0, 3.0, 4.0];
        r.apply(&mut x, 0);
        assert_eq!(x, [1.0, 3.0, 2.0, 4.0]);
        // pair (1,0) by angle 1 rad (first frequency is 1): (cos 1, sin 1) lands in slots 0 and 2.
        let mut y = [1.0f32, 0.0, 0.0, 0.0];
        r.apply(&mut y, 1);
        assert!((y[0] - 1f32.cos()).abs() < 1e-6 && (y[2] - 1f32.sin()).abs() < 1e-6);
    }

    #[test]
    fn yarn_keeps_high_frequencies_and_interpolates_low_ones() {
        let y = Yarn {
            factor: 4.0,
            original_max_position_embeddings: 128,
            beta_fast: 32.0,
            beta_slow: 1.0,
            mscale: None,
            mscale_all_dim: None,
            attention_factor: None,
            truncate: true,
        };
        let (inv, af) = yarn_inv_freq(&y, 10000.0, 16);
        assert_eq!(inv[0], 1.0);
        let last = 1.0 / 10000f32.powf(14.0 / 16.0);
        assert!((inv[7] - last / 4.0).abs() < 1e-9);
        assert!((af - (0.1 * 4f32.ln() + 1.0)).abs() < 1e-6);
    }
}
