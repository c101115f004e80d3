//! `ExpertParallelKimiLinear`: a Kimi-Linear model with its routed experts (and, tensor-parallel,
//! its KDA and MLA heads) split over N simulated devices, as `deepseek_v3::parallel` does for
//! DeepSeek-V3.

use std::sync::RwLock;

use super::KimiLinearModel;
use crate::model::arch::llama::SharedKv;
use crate::model::config::ModelConfig;
use crate::model::error::LoadError;
use crate::model::format::source::WeightSource;
use crate::model::kv::{BatchRow, CacheLayout, KvCache};
use crate::model::layers::kda::state::SequenceState;
use crate::model::shard::load_on_threads;
use crate::model::LanguageModel;
use crate::parallel::group::run_on_ranks;

/// A Kimi-Linear model with its routed experts split over N simulated devices; the KDA and latent
/// layers run replicated on every rank over the rank's own copy of their state, or with their
/// heads split over the same ranks (`load_tensor_parallel`).
pub struct ExpertParallelKimiLinear {
    ranks: Vec<KimiLinearModel>,
}

impl ExpertParallelKimiLinear {
    /// The ranks, in rank order.
    pub fn ranks(&self) -> &[KimiLinearModel] {
        &self.ranks
    }

    /// Loads `ep` ranks, each on its own thread reading only its experts from `src`. Refuses
    /// `ep == 0`, more ranks than a layer has routed experts and a model without MoE layers.
    pub fn load(cfg: ModelConfig, src: &dyn WeightSource, ep: usize) -> Result<Self, LoadError> {
        Self::load_ranks(cfg, src, ep, false)
    }

    /// `tp` ranks with the KDA and MLA heads split over them as well (TP mixers, EP MoE on the
    /// same group; `KimiLinearModel::load_tp_rank`). Refuses sizes that do not divide the heads.
    pub fn load_tensor_parallel(cfg: ModelConfig, src: &dyn WeightSource, tp: usize) -> Result<Self, LoadError> {
        Self::load_ranks(cfg, src, tp, true)
    }

    fn load_ranks(
        cfg: ModelConfig,
        src: &dyn WeightSource,
        ranks: usize,
        split_heads: bool,
    ) -> Result<Self, LoadError> {
        let ranks = load_on_threads(&cfg, src, ranks, |cfg, r| {
            if split_heads {
                KimiLinearModel::load_tp_rank(cfg, src, r)
            } else {
                KimiLinearModel::load_ep_rank(cfg, src, r)
            }
        })?;
        tracing::info!(ranks = ranks.len(), split_heads, "sharded Kimi-Linear ranks loaded");
        Ok(Self { ranks })
    }
}

impl LanguageModel for ExpertParallelKimiLinear {
    #[cfg(test)]
    fn as_any(&self) -> Option<&dyn std::any::Any> {
        Some(self)
    }

    fn config(&self) -> &ModelConfig {
        self.ranks[0].config()
    }

    /// Each rank's own copy of the latent rows and KDA states (`KimiLinearModel::ep_cache_layout`).
    fn cache_layout(&self) -> CacheLayout {
        self.ranks[0].ep_cache_layout()
    }

    fn device_form(&self) -> Option<&dyn crate::model::device::placement::Placeable> {
        Some(self)
    }

    fn new_recurrent_state(&self) -> Option<SequenceState> {
        self.ranks[0].ep_recurrent_state()
    }

    /// The single-device forward contract with the experts split over the ranks; `kv` must have
    /// [`Self::cache_layout`] and [`Self::new_recurrent_state`]'s states.
    fn forward(&self, tokens: &[u32], rows: &[BatchRow], kv: &mut dyn KvCache, logit_rows: &[usize]) -> Vec<f32> {
        let shared: SharedKv<'_> = RwLock::new(kv);
        run_on_ranks(&self.ranks, "ep", |model, comm| model.forward_rank(tokens, rows, &shared, logit_rows, comm))
    }
}
