//! Rotary position embedding in the "rotate half" (GPT-NeoX / Hugging Face) layout: dimension `i`
//! is paired with `i + d/2`. GGUF Llama checkpoints store Q/K rows permuted for the interleaved
//! layout; the loader undoes that permutation so this one kernel serves both formats.

/// Precomputed inverse frequencies `theta^(-2i/d)` for one head size.
#[derive(Clone, Debug)]
pub struct Rope {
    inv_freq: Vec<f32>,
    rotary_dim: usize,
}

impl Rope {
    pub fn new(rotary_dim: usize, theta: f32) -> Self {
        // Computed exactly as transformers does (float32 powers of the base).
        let inv_freq = (0..rotary_dim / 2)
            .map(|i| 1.0f32 / theta.powf((2 * i) as f32 / rotary_dim as f32))
            .collect();
        Self { inv_freq, rotary_dim }
    }

    pub fn from_inv_freq(inv_freq: Vec<f32>) -> Self {
        let rotary_dim = inv_freq.len() * 2;
        Self { inv_freq, rotary_dim }
    }

    /// The inverse frequencies, as the device `rope_neox` kernel takes them.
    pub fn inv_freq(&self) -> &[f32] {
        &self.inv_freq
    }

    pub fn rotary_dim(&self) -> usize {
        self.rotary_dim
    }

    /// Rotates every head of `x` (`heads × head_dim`, contiguous) for position `pos`.
    pub fn apply(&self, x: &mut [f32], head_dim: usize, pos: usize) {
        let half = self.rotary_dim / 2;
        let (sin, cos): (Vec<f32>, Vec<f32>) = self
            .inv_freq
            .iter()
            .map(|f| {
                let a = pos as f32 * f;
                (a.sin(), a.cos())
            })
            .unzip();
        for head in x.chunks_exact_mut(head_dim) {
            for i in 0..half {
                let a = head[i];
                let b = head[i + half];
                head[i] = a * cos[i] - b * sin[i];
                head[i + half] = b * cos[i] + a * sin[i];
            }
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn position_zero_is_identity_and_norm_is_kept() {
        let rope = super::Rope::new(8, 10000.0);
        let mut x: Vec<f32> = (0..16).map(|i| i as f32).collect();
        let orig = x.clone();
        rope.apply(&mut x, 8, 0);
        assert_eq!(x, orig);
        rope.apply(&mut x, 8, 17);
        let n0: f32 = orig.iter().map(|v| v * v).sum();
        let n1: f32 = x.iter().map(|v| v * v).sum();
        assert!((n0 - n1).abs() / n0 < 1e-5);
    }
}
