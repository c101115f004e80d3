//! `TensorParallel`: a Llama model split over N simulated devices. Each rank is its own
//! `LlamaModel` holding only its slice of the weights, run on its own thread for every forward
//! pass; ranks meet only in the collectives (an all-reduce after each row-parallel projection
//! and the embedding, an all-gather of the vocabulary-split logits).

use std::sync::RwLock;

use crate::model::arch::llama::{LlamaModel, SharedKv};
use crate::model::config::ModelConfig;
use crate::model::error::LoadError;
use crate::model::format::source::WeightSource;
use crate::model::kv::{BatchRow, CacheLayout, KvCache};
use crate::model::LanguageModel;
use crate::parallel::TpRank;

use crate::parallel::group::run_on_ranks;

pub struct TensorParallel {
    ranks: Vec<LlamaModel>,
}

impl TensorParallel {
    /// The ranks, in rank order.
    pub fn ranks(&self) -> &[LlamaModel] {
        &self.ranks
    }

    /// Loads `tp` ranks, each on its own thread reading only its slice from `src`.
    pub fn load(cfg: ModelConfig, src: &dyn WeightSource, tp: usize) -> Result<Self, LoadError> {
        if tp == 0 {
            return Err(LoadError::Config {
                file: src.file_of("model.embed_tokens.weight"),
                detail: "tensor parallel size must be at least 1".into(),
            });
        }
        let ranks = std::thread::scope(|s| {
            let handles: Vec<_> = (0..tp)
                .map(|rank| {
                    let cfg = cfg.clone();
                    s.spawn(move || LlamaModel::load_rank(cfg, src, TpRank { rank, size: tp }))
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().unwrap_or_else(|p| std::panic::resume_unwind(p)))
                .collect::<Result<Vec<_>, _>>()
        })?;
        tracing::info!(tp, "tensor-parallel ranks loaded");
        Ok(Self { ranks })
    }

    pub fn tp_size(&self) -> usize {
        self.ranks.len()
    }

    /// The cache this model needs: each rank keeps its own KV heads in its own layers
    /// (`layer * tp + rank`), so there are `tp` times the layers at `1/tp` of the width (or
    /// one head's width when KV heads are replicated because there are fewer than ranks).
    pub fn cache_layers(&self) -> usize {
        self.config().num_layers() * self.tp_size()
    }

    pub fn cache_width(&self) -> usize {
        self.ranks[0].cache_width()
    }
}

/// The engine serves a `TensorParallel` like any model: one forward call runs every rank and
/// returns rank 0's logits (all ranks hold the same after the all-gather).
impl LanguageModel for TensorParallel {
    fn config(&self) -> &ModelConfig {
        self.ranks[0].config()
    }

    /// [`Self::cache_layers`] layers of [`Self::cache_width`]: rank r's KV heads of layer l live
    /// in cache layer `l * tp + r`.
    fn cache_layout(&self) -> CacheLayout {
        self.ranks[0].cache_layout()
    }

    fn device_form(&self) -> Option<&dyn crate::model::device::placement::Placeable> {
        Some(self)
    }

    /// The single-device forward contract with the work split over the ranks; `kv` must have
    /// [`Self::cache_layout`].
    fn forward(&self, tokens: &[u32], rows: &[BatchRow], kv: &mut dyn KvCache, logit_rows: &[usize]) -> Vec<f32> {
        let shared: SharedKv<'_> = RwLock::new(kv);
        run_on_ranks(&self.ranks, "tp", |model, comm| model.forward_rank(tokens, rows, &shared, logit_rows, comm))
    }
}
