//! `ExpertParallelDeepseek`: a DeepSeek-V3 model with its routed experts split over N simulated
//! devices (`kimi_linear::parallel` is the same for Kimi-Linear, whose KDA and latent layers are
//! replicated as the MLA layers are here). Each rank is its own `DeepseekV3Model` holding every non-expert weight (attention,
//! dense layers, norms, embeddings, routers, shared experts) and one contiguous range of each MoE
//! layer's routed experts; ranks meet only inside the MoE layers (`ExpertParallelMoe`).
//!
//! Attention is replicated rather than data-parallel: every rank runs the whole batch, so the
//! hidden states entering each MoE layer are the same on all ranks and the block runs through
//! `forward_replicated` (rank r routes and finishes token slice r, the slices are all-gathered).
//! Splitting the tokens there keeps the routing, shared experts and dispatch traffic at 1/N per
//! rank; splitting the *sequences* across ranks for attention too (DeepSeek's DP attention) would
//! need one cache per rank holding only its sequences, which the engine's single cache does not
//! model yet (docs/sharding.md).

use std::sync::RwLock;

use crate::model::arch::deepseek_v3::DeepseekV3Model;
use crate::model::arch::llama::SharedKv;
use crate::model::config::ModelConfig;
use crate::model::error::LoadError;
use crate::model::format::source::WeightSource;
use crate::model::kv::{BatchRow, CacheLayout, KvCache};
use crate::model::LanguageModel;

use crate::model::shard::load_on_threads;
use crate::parallel::group::run_on_ranks;

pub struct ExpertParallelDeepseek {
    ranks: Vec<DeepseekV3Model>,
}

impl ExpertParallelDeepseek {
    /// The ranks, in rank order.
    pub fn ranks(&self) -> &[DeepseekV3Model] {
        &self.ranks
    }

    /// Loads `ep` ranks, each on its own thread reading only its experts from `src`. Refuses
    /// `ep == 0` and more ranks than a layer has routed experts.
    pub fn load(cfg: ModelConfig, src: &dyn WeightSource, ep: usize) -> Result<Self, LoadError> {
        Self::load_ranks(cfg, src, ep, false)
    }

    /// `tp` ranks with the MLA heads split over them as well (TP attention, EP MoE on the same
    /// group; `DeepseekV3Model::load_tp_rank`). Refuses sizes that do not divide the heads.
    pub fn load_tensor_parallel(cfg: ModelConfig, src: &dyn WeightSource, tp: usize) -> Result<Self, LoadError> {
        Self::load_ranks(cfg, src, tp, true)
    }

    fn load_ranks(cfg: ModelConfig, src: &dyn WeightSource, ep: usize, split_heads: bool) -> Result<Self, LoadError> {
        let ranks = load_on_threads(&cfg, src, ep, |cfg, r| {
            if split_heads {
                DeepseekV3Model::load_tp_rank(cfg, src, r)
            } else {
                DeepseekV3Model::load_ep_rank(cfg, src, r)
            }
        })?;
        tracing::info!(ranks = ep, split_heads, "expert-parallel DeepSeek ranks loaded");
        Ok(Self { ranks })
    }

    pub fn ep_size(&self) -> usize {
        self.ranks.len()
    }
}

/// The engine serves it like any model: one forward call runs every rank and returns rank 0's
/// logits (every rank computes the same).
impl LanguageModel for ExpertParallelDeepseek {
    #[cfg(test)]
    fn as_any(&self) -> Option<&dyn std::any::Any> {
        Some(self)
    }

    fn config(&self) -> &ModelConfig {
        self.ranks[0].config()
    }

    /// Each rank's own copy of the latent cache: rank r's rows of layer l live in cache layer
    /// `l * ep + r`.
    fn cache_layout(&self) -> CacheLayout {
        self.ranks[0].ep_cache_layout()
    }

    fn device_form(&self) -> Option<&dyn crate::model::device::placement::Placeable> {
        Some(self)
    }

    /// The single-device forward contract with the experts split over the ranks; `kv` must have
    /// [`Self::cache_layout`].
    fn forward(&self, tokens: &[u32], rows: &[BatchRow], kv: &mut dyn KvCache, logit_rows: &[usize]) -> Vec<f32> {
        let shared: SharedKv<'_> = RwLock::new(kv);
        run_on_ranks(&self.ranks, "ep", |model, comm| model.forward_rank(tokens, rows, &shared, logit_rows, comm))
    }
}
