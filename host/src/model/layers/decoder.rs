//! The pieces every decoder's forward pass shares around its layers: the embedding lookup, the
//! residual add, and the final norm of only the rows whose logits are wanted.

use kernels::cpu::norm::rms_norm;

/// One `d`-wide row of `embed` (`[vocab, d]`) per token. Callers pass ids below the vocabulary
/// size (the engine validates prompts); an id outside is a bug, hence the assert.
pub fn embed_tokens(embed: &[f32], d: usize, tokens: &[u32]) -> Vec<f32> {
    let vocab = embed.len() / d.max(1);
    let mut hidden = vec![0.0f32; tokens.len() * d];
    for (h, &t) in hidden.chunks_exact_mut(d).zip(tokens) {
        let t = t as usize;
        assert!(t < vocab, "token id {t} out of range");
        h.copy_from_slice(&embed[t * d..(t + 1) * d]);
    }
    hidden
}

/// `hidden += delta`, element-wise.
pub fn add_residual(hidden: &mut [f32], delta: &[f32]) {
    for (h, a) in hidden.iter_mut().zip(delta) {
        *h += a;
    }
}

/// RMSNorm of the rows `rows` of `hidden` (`d` wide), in that order: only the rows whose logits
/// are wanted go through the final norm and the (large) vocabulary projection.
pub fn final_norm_rows(hidden: &[f32], d: usize, rows: &[usize], norm: &[f32], eps: f32) -> Vec<f32> {
    let mut picked = Vec::with_capacity(rows.len() * d);
    for &r in rows {
        picked.extend_from_slice(&hidden[r * d..(r + 1) * d]);
    }
    let mut normed = vec![0.0f32; picked.len()];
    rms_norm(&picked, norm, eps, &mut normed);
    normed
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn embeds_adds_and_norms_the_picked_rows() {
        let embed = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0];
        let mut h = embed_tokens(&embed, 2, &[2, 0]);
        assert_eq!(h, [5.0, 6.0, 1.0, 2.0]);
        add_residual(&mut h, &[1.0, 1.0, -1.0, 2.0]);
        assert_eq!(h, [6.0, 7.0, 0.0, 4.0]);
        // Row 1 only: [0, 4] has RMS sqrt(8), so it normalises to [0, sqrt(2)].
        let n = final_norm_rows(&h, 2, &[1], &[1.0, 1.0], 0.0);
        assert!((n[0]).abs() < 1e-6 && (n[1] - 2f32.sqrt()).abs() < 1e-6, "{n:?}");
    }
}
