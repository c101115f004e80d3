//! One row of Kimi K3's Block Attention Residual mix (docs/formats.md §5.3; TokenSpeed
//! `tokenspeed_kernel/ops/attn_res/torch.py`): the candidates (block snapshots, then the partial
//! sum) each score `Σ_d rmsnorm(v)_d · w_d` (`w` = norm weight × projection, multiplied once),
//! and the output is their softmax-weighted sum. The reference for `attn_res.cu`.

/// `out = Σ_c softmax(score)_c · candidates[c]`, `eps` the RMSNorm epsilon. With one candidate
/// the output is that candidate.
pub fn mix_row(candidates: &[&[f32]], w: &[f32], eps: f32, out: &mut [f32]) {
    let d = w.len();
    assert!(!candidates.is_empty() && candidates.iter().all(|c| c.len() == d) && out.len() == d);
    if candidates.len() == 1 {
        out.copy_from_slice(candidates[0]);
        return;
    }
    let scores: Vec<f32> = candidates
        .iter()
        .map(|v| {
            let mean_square = v.iter().map(|x| x * x).sum::<f32>() / d as f32;
            let dot: f32 = v.iter().zip(w).map(|(x, w)| x * w).sum();
            dot / (mean_square + eps).sqrt()
        })
        .collect();
    let top = scores.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
    let weights: Vec<f32> = scores.iter().map(|s| (s - top).exp()).collect();
    let total: f32 = weights.iter().sum();
    out.fill(0.0);
    for (v, e) in candidates.iter().zip(&weights) {
        let a = e / total;
        out.iter_mut().zip(v.iter()).for_each(|(o, x)| *o += a * x);
    }
}
