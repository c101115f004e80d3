//! Block Attention Residuals (Kimi K3; arXiv:2603.15031), which replace the plain residual add.
//!
//! The decoder keeps, instead of one residual stream, the list of block snapshots (the stream as
//! it stood entering every `block_size`-th layer, the embeddings first) and the partial sum of
//! the layer outputs since the last snapshot. Every sub-layer reads a learned softmax mix of those
//! candidates (docs/formats.md §5.3):
//!
//! ```text
//! score_c = Σ_d rmsnorm(v_c)_d · norm_d · proj_d      (v_c: the snapshots, then the partial sum)
//! mix     = Σ_c softmax(score)_c · v_c                   (raw candidates, not normed)
//! ```
//!
//! Written from TokenSpeed (lightseekorg/tokenspeed f4d8ec6: `tokenspeed_kernel/ops/attn_res/torch.py`
//! for the mix, `runtime/models/kimi_k3.py` `KimiLinearDecoderLayer` / `KimiLinearModel.forward` for
//! where the snapshots are taken and which mixes read how many of them).

use rayon::prelude::*;

use kernels::cpu::attn_res::mix_row;
use kernels::cpu::norm::rms_norm;

use crate::model::error::LoadError;
use crate::model::format::source::WeightSource;
use crate::model::layers::decoder::{add_residual, embed_tokens};
use crate::model::layers::moe::expert_parallel::ExpertParallelMoe;
use crate::model::layers::moe::ffn::PreNormLayer;

/// One mix: its score weights (`norm.weight · proj.weight`, multiplied once at load, as the
/// score only ever uses their product).
pub struct ResidualMix {
    pub(crate) score_weight: Vec<f32>,
}

impl ResidualMix {
    /// `{norm}.weight` `[d]` and `{proj}.weight` `[1, d]` (a projection to one score).
    pub fn load(src: &dyn WeightSource, norm: &str, proj: &str, d: usize) -> Result<Self, LoadError> {
        let norm = src.load(&format!("{norm}.weight"), &[d])?;
        let proj = src.load(&format!("{proj}.weight"), &[1, d])?;
        Ok(Self::from_weights(norm.as_slice(), proj.as_slice()))
    }

    pub fn from_weights(norm: &[f32], proj: &[f32]) -> Self {
        Self { score_weight: norm.iter().zip(proj).map(|(n, p)| n * p).collect() }
    }

    /// The mix of `blocks` (each `n` rows of `d`) and `partial` (`n` rows), row by row; with no
    /// blocks the only candidate is `partial` itself. `eps` is the RMSNorm epsilon.
    pub fn mix(&self, blocks: &[Vec<f32>], partial: &[f32], eps: f32) -> Vec<f32> {
        let d = self.score_weight.len();
        if blocks.is_empty() {
            return partial.to_vec();
        }
        let mut out = vec![0.0f32; partial.len()];
        out.par_chunks_mut(d).enumerate().for_each(|(row, out)| {
            let span = row * d..(row + 1) * d;
            let candidates: Vec<&[f32]> =
                blocks.iter().map(|b| &b[span.clone()]).chain(std::iter::once(&partial[span.clone()])).collect();
            mix_row(&candidates, &self.score_weight, eps, out);
        });
        out
    }
}

/// A decoder layer's two mixes: before its token mixer and before its FFN.
pub struct LayerMixes {
    pub attention: ResidualMix,
    pub mlp: ResidualMix,
}

/// Every mix of a model: one pair per layer and the one before the final norm.
pub struct AttnRes {
    /// A snapshot is taken entering layers `0, block_size, 2·block_size, …`.
    pub block_size: usize,
    pub layers: Vec<LayerMixes>,
    pub output: ResidualMix,
}

impl AttnRes {
    /// The checkpoint's mixes: per layer `{layer}.self_attention_res_{norm,proj}` and
    /// `{layer}.mlp_res_{norm,proj}` (`layer(i)` names layer i's prefix), and
    /// `model.output_attn_res_{norm,proj}`.
    pub fn load(
        src: &dyn WeightSource,
        num_layers: usize,
        d: usize,
        block_size: usize,
        layer: impl Fn(usize) -> String,
    ) -> Result<Self, LoadError> {
        let layers = (0..num_layers)
            .map(|i| {
                let p = layer(i);
                Ok(LayerMixes {
                    attention: ResidualMix::load(
                        src,
                        &format!("{p}.self_attention_res_norm"),
                        &format!("{p}.self_attention_res_proj"),
                        d,
                    )?,
                    mlp: ResidualMix::load(src, &format!("{p}.mlp_res_norm"), &format!("{p}.mlp_res_proj"), d)?,
                })
            })
            .collect::<Result<Vec<_>, LoadError>>()?;
        let output = ResidualMix::load(src, "model.output_attn_res_norm", "model.output_attn_res_proj", d)?;
        Ok(Self { block_size, layers, output })
    }

    /// The stream entering the final norm for `tokens`: embedded (`embed` is `[vocab, d]`), then
    /// every layer's body with its pre-norms (epsilon `eps`) around its token mixer
    /// `mix(layer index, layer, normed)` and its FFN (expert-parallel blocks through
    /// `expert_parallel`), each sub-layer reading its residual mix and adding its output to the
    /// block's partial sum. The AttnRes counterpart of `moe::ffn::decoder_layers`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn decoder_layers<L: PreNormLayer, E>(
        &self,
        embed: &[f32],
        d: usize,
        tokens: &[u32],
        layers: &[L],
        eps: f32,
        mut mix: impl FnMut(usize, &L, &[f32]) -> Result<Vec<f32>, E>,
        mut expert_parallel: impl FnMut(&ExpertParallelMoe, &[f32], usize) -> Result<Vec<f32>, E>,
    ) -> Result<Vec<f32>, E> {
        assert_eq!(layers.len(), self.layers.len(), "one pair of residual mixes per layer");
        let n = tokens.len();
        let mut partial = embed_tokens(embed, d, tokens);
        let mut blocks: Vec<Vec<f32>> = Vec::new();
        let mut normed = vec![0.0f32; n * d];
        for (li, (layer, mixes)) in layers.iter().zip(&self.layers).enumerate() {
            let (attn_norm, ffn_norm, ffn) = layer.pre_norm();
            // The mix reads the snapshots taken so far; a block's first layer then snapshots the
            // stream it was given and starts a new partial sum with its own output.
            rms_norm(&mixes.attention.mix(&blocks, &partial, eps), attn_norm.as_slice(), eps, &mut normed);
            let out = mix(li, layer, &normed)?;
            if li % self.block_size == 0 {
                blocks.push(std::mem::replace(&mut partial, out));
            } else {
                add_residual(&mut partial, &out);
            }
            rms_norm(&mixes.mlp.mix(&blocks, &partial, eps), ffn_norm.as_slice(), eps, &mut normed);
            add_residual(&mut partial, &ffn.forward(&normed, n, &mut expert_parallel)?);
        }
        Ok(self.output.mix(&blocks, &partial, eps))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_candidate_passes_through_and_equal_scores_average() {
        let m = ResidualMix::from_weights(&[1.0, 1.0], &[0.0, 0.0]);
        assert_eq!(m.mix(&[], &[3.0, 4.0], 1e-5), vec![3.0, 4.0]);
        // Zero score weights: every candidate scores 0, so the mix is their mean.
        let out = m.mix(&[vec![1.0, 1.0, 2.0, 0.0]], &[3.0, 5.0, 0.0, 2.0], 1e-5);
        assert_eq!(out, vec![2.0, 3.0, 1.0, 1.0]);
    }

    #[test]
    fn scores_follow_the_normed_candidates() {
        // Weight on the first coordinate: a candidate pointing along it scores rms-normed 2^0.5
        // against 0 for the other, whatever their lengths.
        let m = ResidualMix::from_weights(&[2.0, 1.0], &[0.5, 0.0]);
        let (a, b) = ([10.0f32, 0.0], [0.0f32, 1.0]);
        let out = m.mix(&[a.to_vec()], &b, 0.0);
        let (sa, sb) = (2f32.sqrt(), 0.0f32);
        let wa = sa.exp() / (sa.exp() + sb.exp());
        assert!((out[0] - wa * 10.0).abs() < 1e-5 && (out[1] - (1.0 - wa)).abs() < 1e-5, "{out:?}");
    }
}
