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
        let inv_freq = (0..rotary_dim / 2).map(|i| 1.0f32 / theta.powf((2 * i) as f32 / rotary_dim as f32)).collect();
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
        rotate_half(x, head_dim, &self.inv_freq, pos);
    }
}

/// The rotation itself: the first `2·inv_freq.len()` dimensions of every `head_dim`-wide head,
/// dimension `i` paired with `i + inv_freq.len()`, by the f32 angle `pos · inv_freq[i]` (the
/// device kernels compute the same angle and the same `a·c − b·s` products).
fn rotate_half(x: &mut [f32], head_dim: usize, inv_freq: &[f32], pos: usize) {
    let half = inv_freq.len();
    let (sin, cos): (Vec<f32>, Vec<f32>) = inv_freq
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

/// RoPE of MLA's rotary slices (DeepSeek-V3, Kimi): every `2·inv_freq.len()`-wide row of `x` at
/// position `pos`. With `interleave` a row's pairs `(x0,x1),(x2,x3),…` are first reordered to
/// `(x0,x2,…,x1,x3,…)` (DeepSeek's layout; the row stays reordered, which is harmless since
/// queries and keys are reordered alike and only their dot products are used), then rotated in
/// the rotate-half layout; then every element is multiplied by `attention_factor` (YaRN's
/// scaling of cos and sin; skipped when it is 1). The device kernel `rope_rows` computes the same.
pub fn rope_rows(x: &mut [f32], pos: usize, inv_freq: &[f32], interleave: bool, attention_factor: f32) {
    let d = 2 * inv_freq.len();
    if d == 0 {
        return; // no rotary slice (NoPE)
    }
    if interleave {
        let mut tmp = vec![0.0f32; d];
        for s in x.chunks_exact_mut(d) {
            for i in 0..d / 2 {
                tmp[i] = s[2 * i];
                tmp[d / 2 + i] = s[2 * i + 1];
            }
            s.copy_from_slice(&tmp);
        }
    }
    rotate_half(x, d, inv_freq, pos);
    if attention_factor != 1.0 {
        x.iter_mut().for_each(|v| *v *= attention_factor);
    }
}

/// [`rope_rows`] over a batch as the device kernel takes it: `x` holds `positions.len() ×
/// rows_per_token` rows; the rows of token `t` rotate by `positions[t]`.
pub fn rope_rows_batch(
    x: &mut [f32],
    positions: &[i32],
    rows_per_token: usize,
    inv_freq: &[f32],
    interleave: bool,
    attention_factor: f32,
) {
    let per_token = rows_per_token * 2 * inv_freq.len();
    if per_token == 0 {
        return;
    }
    for (rows, &pos) in x.chunks_exact_mut(per_token).zip(positions) {
        rope_rows(rows, pos as usize, inv_freq, interleave, attention_factor);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn interleaved_pairs_rotate_together_and_the_factor_scales() {
        let inv = [1.0f32, 0.01];
        // Pairs (1,2) and (3,4) at position 0: only the reordering happens.
        let mut x = [1.0f32, 2.0, 3.0, 4.0];
        rope_rows(&mut x, 0, &inv, true, 1.0);
        assert_eq!(x, [1.0, 3.0, 2.0, 4.0]);
        // Pair (1,0) by angle 1 rad lands in slots 0 and 2, both rows of the slice.
        let mut y = [1.0f32, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0];
        rope_rows(&mut y, 1, &inv, true, 2.0);
        for r in y.chunks(4) {
            assert_eq!((r[0], r[2]), (2.0 * 1f32.cos(), 2.0 * 1f32.sin()));
        }
        // Without interleave it is Rope::apply exactly; no rotary slice is a no-op.
        let (mut a, mut b) = ([0.3f32, -1.0, 2.0, 0.5], [0.3f32, -1.0, 2.0, 0.5]);
        rope_rows(&mut a, 7, &inv, false, 1.0);
        Rope::from_inv_freq(inv.to_vec()).apply(&mut b, 4, 7);
        assert_eq!(a, b);
        rope_rows(&mut a, 7, &[], true, 3.0);
        assert_eq!(a, b);
    }

    #[test]
    fn the_batch_form_rotates_each_token_by_its_position() {
        let inv = [0.5f32, 0.25, 0.125];
        let x: Vec<f32> = (0..36).map(|i| (i as f32 * 0.37).sin()).collect();
        let mut got = x.clone();
        rope_rows_batch(&mut got, &[3, 0, 11], 2, &inv, true, 1.25);
        for (t, pos) in [3usize, 0, 11].into_iter().enumerate() {
            let mut want = x[t * 12..(t + 1) * 12].to_vec();
            rope_rows(&mut want, pos, &inv, true, 1.25);
            assert_eq!(got[t * 12..(t + 1) * 12], want[..]);
        }
    }

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
