//! The feed-forward half of a layer in the MoE decoders (DeepSeek-V3, Kimi-Linear): a dense
//! SwiGLU MLP (the first `first_k_dense_replace` layers), the whole MoE block, or one
//! expert-parallel rank's share of it; and the pre-norm layer stack both decoders run around
//! their own token mixers.

use kernels::cpu::norm::rms_norm;

use crate::model::error::LoadError;
use crate::model::format::source::WeightSource;
use crate::model::layers::decoder::{add_residual, embed_tokens};
use crate::model::layers::moe::expert_parallel::ExpertParallelMoe;
use crate::model::layers::moe::mlp::{Activation, GatedMlp};
use crate::model::layers::moe::{MoeConfig, MoeLayer};
use crate::model::tensor::Tensor;
use crate::parallel::EpRank;

pub(crate) enum Ffn {
    Dense(GatedMlp),
    Moe(MoeLayer),
    /// This rank's share of the routed experts (router and shared experts whole).
    ExpertParallel(ExpertParallelMoe),
}

impl Ffn {
    /// Layer `layer`'s block: an MoE block where `moe` makes it one (whole for `ep.size == 1`,
    /// else rank `ep.rank`'s experts), else the dense MLP (`hidden` → `inter`, `dense_activation`).
    #[allow(clippy::too_many_arguments)]
    pub fn load(
        moe: Option<&MoeConfig>,
        src: &dyn WeightSource,
        layer: usize,
        hidden: usize,
        inter: usize,
        dense_activation: Activation,
        ep: EpRank,
    ) -> Result<Self, LoadError> {
        Ok(match moe {
            Some(m) if m.is_moe_layer(layer) && ep.size == 1 => Ffn::Moe(MoeLayer::load(m, src, &m.prefix(layer))?),
            Some(m) if m.is_moe_layer(layer) => {
                Ffn::ExpertParallel(ExpertParallelMoe::load(m, src, &m.prefix(layer), ep.rank, ep.size)?)
            }
            _ => Ffn::Dense(GatedMlp::load(
                src,
                &format!("model.layers.{layer}.mlp"),
                ["gate_proj", "up_proj", "down_proj"],
                hidden,
                inter,
                dense_activation,
            )?),
        })
    }

    pub fn is_moe(&self) -> bool {
        !matches!(self, Ffn::Dense(_))
    }

    pub fn is_expert_parallel(&self) -> bool {
        matches!(self, Ffn::ExpertParallel(_))
    }

    /// (the dense MLP, the MoE block with this rank's experts): what a device uploads.
    pub fn parts(&self) -> (Option<&GatedMlp>, Option<&MoeLayer>) {
        match self {
            Ffn::Dense(mlp) => (Some(mlp), None),
            Ffn::Moe(moe) => (None, Some(moe)),
            Ffn::ExpertParallel(ep) => (None, Some(ep.layer())),
        }
    }

    /// The block's output for `n` rows `x`; an expert-parallel block runs through
    /// `expert_parallel(block, x, n)`, which meets the other ranks.
    pub fn forward<E>(
        &self,
        x: &[f32],
        n: usize,
        expert_parallel: impl FnOnce(&ExpertParallelMoe, &[f32], usize) -> Result<Vec<f32>, E>,
    ) -> Result<Vec<f32>, E> {
        match self {
            Ffn::Dense(mlp) => Ok(mlp.forward(x, n)),
            Ffn::Moe(moe) => Ok(moe.forward(x, n)),
            Ffn::ExpertParallel(moe) => expert_parallel(moe, x, n),
        }
    }
}

/// A decoder layer with a pre-norm body: (the mixer's norm, the FFN's norm, the FFN).
pub(crate) trait PreNormLayer {
    fn pre_norm(&self) -> (&Tensor, &Tensor, &Ffn);
}

/// The hidden states `[tokens, d]` after every layer of an MoE decoder: `tokens` embedded
/// (`embed` is `[vocab, d]`), then per layer its pre-norm body (norms with epsilon `eps`) around
/// its token mixer `mix(layer index, layer, normed)`; expert-parallel blocks go through
/// `expert_parallel`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn decoder_layers<L: PreNormLayer, E>(
    embed: &[f32],
    d: usize,
    tokens: &[u32],
    layers: &[L],
    eps: f32,
    mut mix: impl FnMut(usize, &L, &[f32]) -> Result<Vec<f32>, E>,
    mut expert_parallel: impl FnMut(&ExpertParallelMoe, &[f32], usize) -> Result<Vec<f32>, E>,
) -> Result<Vec<f32>, E> {
    let n = tokens.len();
    let mut hidden = embed_tokens(embed, d, tokens);
    let mut normed = vec![0.0f32; n * d];
    for (li, layer) in layers.iter().enumerate() {
        let (attn_norm, ffn_norm, ffn) = layer.pre_norm();
        rms_norm(&hidden, attn_norm.as_slice(), eps, &mut normed);
        add_residual(&mut hidden, &mix(li, layer, &normed)?);
        rms_norm(&hidden, ffn_norm.as_slice(), eps, &mut normed);
        add_residual(&mut hidden, &ffn.forward(&normed, n, &mut expert_parallel)?);
    }
    Ok(hidden)
}
