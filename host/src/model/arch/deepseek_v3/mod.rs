//! DeepSeek-V3 (and V2) decoder: embeddings, pre-norm layers of MLA attention (model/layers/mla) and a
//! dense SwiGLU MLP for the first `first_k_dense_replace` layers, MoE (model/layers/moe) after, final
//! RMSNorm, `lm_head`. transformers `DeepseekV3ForCausalLM`.
//!
//! One `DeepseekV3Model` can also be one expert-parallel rank (`load_ep_rank`, driven by
//! `arch::deepseek_v3::parallel::ExpertParallelDeepseek`): it holds every non-expert weight and only its range of the
//! routed experts, and its MoE layers exchange token rows with the other ranks.

pub mod device;
pub mod parallel;

use kernels::cpu::matmul::matmul_t;

use crate::model::arch::llama::SharedKv;
use crate::model::config::{AttentionKind, FfnKind, LayerSpec, ModelConfig};
use crate::model::error::LoadError;
use crate::model::format::source::WeightSource;
use crate::model::kv::{BatchRow, CacheLayout, KvCache};
use crate::model::layers::decoder::final_norm_rows;
use crate::model::layers::linear::Linear;
use crate::model::layers::mla::{MlaConfig, MlaLayer};
use crate::model::layers::moe::ffn::{decoder_layers, Ffn, PreNormLayer};
use crate::model::layers::moe::mlp::Activation;
use crate::model::layers::moe::ExpertParallelMoe;
use crate::model::layers::moe::MoeConfig;
use crate::model::tensor::Tensor;
use crate::model::LanguageModel;
use crate::parallel::EpRank;
use crate::parallel::{Collective, CollectiveError};

/// The registry's entry for DeepSeek-V3: whole, expert-parallel ([`parallel::ExpertParallelDeepseek`]) or with its
/// attention heads split too (tensor-parallel); on devices through [`device`].
pub struct DeepseekV3;

impl crate::model::registry::ArchitectureSpec for DeepseekV3 {
    fn name(&self) -> &'static str {
        "DeepSeek-V3"
    }

    fn load(&self, cfg: ModelConfig, src: &dyn WeightSource) -> Result<Box<dyn LanguageModel>, LoadError> {
        Ok(Box::new(DeepseekV3Model::load(cfg, src)?))
    }

    fn load_tensor_parallel(
        &self,
        cfg: ModelConfig,
        src: &dyn WeightSource,
        tp: usize,
    ) -> Result<Box<dyn LanguageModel>, LoadError> {
        Ok(Box::new(parallel::ExpertParallelDeepseek::load_tensor_parallel(cfg, src, tp)?))
    }

    fn expert_parallel(&self) -> bool {
        true
    }

    fn load_expert_parallel(
        &self,
        cfg: ModelConfig,
        src: &dyn WeightSource,
        ep: usize,
    ) -> Result<Box<dyn LanguageModel>, LoadError> {
        Ok(Box::new(parallel::ExpertParallelDeepseek::load(cfg, src, ep)?))
    }
}

pub(crate) struct Layer {
    pub(crate) attn_norm: Tensor,
    pub(crate) attn: MlaLayer,
    pub(crate) ffn_norm: Tensor,
    pub(crate) ffn: Ffn,
}

impl PreNormLayer for Layer {
    fn pre_norm(&self) -> (&Tensor, &Tensor, &Ffn) {
        (&self.attn_norm, &self.ffn_norm, &self.ffn)
    }
}

// Crate-visible fields: the device forward (model/device/decoder) uploads them.
pub struct DeepseekV3Model {
    pub(crate) cfg: ModelConfig,
    pub(crate) embed: Tensor,
    pub(crate) layers: Vec<Layer>,
    pub(crate) norm: Tensor,
    /// `None` when the output projection is tied to the embedding matrix.
    pub(crate) lm_head: Option<Linear>,
    pub(crate) ep: EpRank,
    /// Attention heads split over the ranks (`load_tp_rank`): `o_proj` outputs are partial sums.
    pub(crate) split_heads: bool,
}

impl DeepseekV3Model {
    /// `cfg.hf_config` must hold the checkpoint's `config.json` (MLA and MoE fields are read from
    /// it). Projections load through `WeightSource::linear`, so quantized experts stay packed.
    pub fn load(cfg: ModelConfig, src: &dyn WeightSource) -> Result<Self, LoadError> {
        Self::load_ep_rank(cfg, src, EpRank { rank: 0, size: 1 })
    }

    /// Loads expert-parallel rank `ep.rank` of `ep.size`: attention, dense layers, norms,
    /// embeddings, routers and shared experts whole, of each MoE layer's routed experts only the
    /// rank's contiguous range (`parallel::ep::experts_of`). `size == 1` is the plain model.
    pub fn load_ep_rank(cfg: ModelConfig, src: &dyn WeightSource, ep: EpRank) -> Result<Self, LoadError> {
        Self::load_ranked(cfg, src, ep, false)
    }

    /// As [`Self::load_ep_rank`] with the MLA heads split over the same ranks too
    /// (`MlaLayer::load_heads`; `o_proj` row-parallel, summed by an all-reduce): tensor-parallel
    /// attention in front of expert-parallel MoE layers. Dense MLPs stay replicated.
    pub fn load_tp_rank(cfg: ModelConfig, src: &dyn WeightSource, ranks: EpRank) -> Result<Self, LoadError> {
        Self::load_ranked(cfg, src, ranks, true)
    }

    fn load_ranked(
        mut cfg: ModelConfig,
        src: &dyn WeightSource,
        ep: EpRank,
        split_heads: bool,
    ) -> Result<Self, LoadError> {
        let file = src.file_of("config.json").with_file_name("config.json");
        let raw = cfg.hf_config.clone().ok_or_else(|| LoadError::Config {
            file: file.clone(),
            detail: "DeepSeek-V3 needs the Hugging Face config.json (MLA and MoE fields)".into(),
        })?;
        let mla = MlaConfig::from_hf_config(&file, &raw)?;
        let moe = MoeConfig::from_hf_config(&file, &raw)?;
        let d = cfg.hidden_size;
        if mla.hidden_size != d || mla.num_heads != cfg.num_heads {
            return Err(LoadError::Config { file, detail: "MLA and model dimensions disagree".into() });
        }
        let embed = src.load("model.embed_tokens.weight", &[cfg.vocab_size, d])?;
        let mut layers = Vec::with_capacity(cfg.num_layers());
        let mut specs = Vec::with_capacity(cfg.num_layers());
        for i in 0..cfg.num_layers() {
            let p = format!("model.layers.{i}");
            let ffn = Ffn::load(moe.as_ref(), src, i, d, cfg.intermediate_size, Activation::Silu, ep)?;
            specs.push(LayerSpec {
                attention: AttentionKind::Mla,
                ffn: if ffn.is_moe() { FfnKind::Moe } else { FfnKind::DenseSwiGlu },
            });
            layers.push(Layer {
                attn_norm: src.load(&format!("{p}.input_layernorm.weight"), &[d])?,
                attn: if split_heads {
                    MlaLayer::load_heads(&mla, src, &format!("{p}.self_attn"), ep.rank, ep.size)?
                } else {
                    MlaLayer::load(&mla, src, &format!("{p}.self_attn"))?
                },
                ffn_norm: src.load(&format!("{p}.post_attention_layernorm.weight"), &[d])?,
                ffn,
            });
            tracing::debug!(layer = i, of = cfg.num_layers(), "loaded DeepSeek layer");
        }
        cfg.layers = specs;
        let norm = src.load("model.norm.weight", &[d])?;
        let lm_head = if cfg.tie_word_embeddings && !src.contains("lm_head.weight") {
            None
        } else {
            Some(src.linear("lm_head", cfg.vocab_size, d)?)
        };
        if ep.size > 1 && !split_heads && !layers.iter().any(|l| l.ffn.is_expert_parallel()) {
            return Err(LoadError::Config {
                file: src.file_of("model.embed_tokens.weight"),
                detail: "expert parallelism needs a model with MoE layers".into(),
            });
        }
        Ok(Self { cfg, embed, layers, norm, lm_head, ep, split_heads })
    }

    pub fn ep_rank(&self) -> EpRank {
        self.ep
    }

    /// The single-rank cache layout: one compressed-latent layer per decoder layer.
    fn rank_cache_layout(&self) -> CacheLayout {
        CacheLayout {
            layers: self.layers.iter().map(|l| Some(l.attn.cache_shape())).collect(),
            recurrent_bytes_per_seq: 0,
        }
    }

    /// The cache of an expert-parallel group: attention is replicated, so every rank keeps its
    /// own copy of each layer's latent rows, in cache layer `layer * size + rank` (as a real
    /// device would in its own memory).
    pub fn ep_cache_layout(&self) -> CacheLayout {
        self.rank_cache_layout().per_rank(self.ep.size)
    }

    /// This rank's part of an expert-parallel forward pass: every rank of the EP group calls it
    /// with the same batch and its own handle on the group's communicator. Attention, dense
    /// layers and the head run replicated (same rows, same results on every rank); each MoE layer
    /// runs `ExpertParallelMoe::forward_replicated`. All ranks return the same logits.
    pub fn forward_rank<C: Collective>(
        &self,
        tokens: &[u32],
        rows: &[BatchRow],
        kv: &SharedKv<'_>,
        logit_rows: &[usize],
        comm: &C,
    ) -> Result<Vec<f32>, CollectiveError> {
        let EpRank { rank, size } = self.ep;
        self.run(
            tokens,
            rows,
            logit_rows,
            |li, attn, normed| {
                let mut out = {
                    let mut cache = kv.write().unwrap_or_else(|e| e.into_inner());
                    attn.forward(normed, rows, &mut **cache, li * size + rank)
                };
                if self.split_heads {
                    comm.all_reduce_sum(&mut out)?;
                }
                Ok(out)
            },
            |moe, normed, n| moe.forward_replicated(normed, n, comm),
        )
    }

    /// The decoder with the two parts that differ between one device and an EP rank supplied by
    /// the caller: `attend(layer, attention, normed)` and `expert_parallel(moe, normed, n)`.
    fn run<E>(
        &self,
        tokens: &[u32],
        rows: &[BatchRow],
        logit_rows: &[usize],
        mut attend: impl FnMut(usize, &MlaLayer, &[f32]) -> Result<Vec<f32>, E>,
        expert_parallel: impl FnMut(&ExpertParallelMoe, &[f32], usize) -> Result<Vec<f32>, E>,
    ) -> Result<Vec<f32>, E> {
        let (cfg, d) = (&self.cfg, self.cfg.hidden_size);
        assert_eq!(tokens.len(), rows.len(), "forward: one BatchRow per token");
        let embed = self.embed.as_slice();
        let hidden = decoder_layers(
            embed,
            d,
            tokens,
            &self.layers,
            cfg.rms_norm_eps,
            |li, l, x| attend(li, &l.attn, x),
            expert_parallel,
        )?;
        let final_normed = final_norm_rows(&hidden, d, logit_rows, self.norm.as_slice(), cfg.rms_norm_eps);
        match &self.lm_head {
            Some(head) => Ok(head.forward(&final_normed, logit_rows.len())),
            None => {
                let mut logits = vec![0.0f32; logit_rows.len() * cfg.vocab_size];
                matmul_t(&final_normed, embed, &mut logits, logit_rows.len(), d, cfg.vocab_size);
                Ok(logits)
            }
        }
    }
}

impl LanguageModel for DeepseekV3Model {
    #[cfg(test)]
    fn as_any(&self) -> Option<&dyn std::any::Any> {
        Some(self)
    }

    fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    fn cache_layout(&self) -> CacheLayout {
        self.rank_cache_layout()
    }

    /// A whole model only: a lone rank of a sharded one cannot run by itself.
    fn device_form(&self) -> Option<&dyn crate::model::device::placement::Placeable> {
        (self.ep.size == 1).then_some(self as &dyn crate::model::device::placement::Placeable)
    }

    /// One device. An expert-parallel rank (`ep_rank().size > 1`) cannot run alone: its MoE
    /// layers need the other ranks, so it is only driven through `forward_rank`.
    fn forward(&self, tokens: &[u32], rows: &[BatchRow], kv: &mut dyn KvCache, logit_rows: &[usize]) -> Vec<f32> {
        // Checked up front: with split heads alone the result would be silently partial.
        assert_eq!(self.ep.size, 1, "a sharded DeepSeek rank runs through forward_rank with its group, not alone");
        let out: Result<Vec<f32>, std::convert::Infallible> = crate::model::on_compute_pool(|| {
            self.run(
                tokens,
                rows,
                logit_rows,
                |li, attn, normed| Ok(attn.forward(normed, rows, &mut *kv, li)),
                |_, _, _| {
                    panic!("an expert-parallel DeepSeek rank runs through forward_rank with its group, not alone")
                },
            )
        });
        match out {
            Ok(v) => v,
            Err(never) => match never {},
        }
    }
}
