//! Kimi-Linear (transformers' `KimiLinearForCausalLM`): a hybrid decoder whose layers are either
//! Kimi Delta Attention (linear attention with a fixed-size per-sequence state, `kda/`) or
//! multi-head latent attention without RoPE (`mla/`, `mla_use_nope`), each followed by a dense SwiGLU MLP (the first
//! `first_k_dense_replace` layers) or a mixture of experts (`moe/`).
//!
//! The layer plan comes from `linear_attn_config` (`kda/plan.rs`); KDA layers cache nothing per
//! token and read their state from `KvCache::recurrent`, latent layers cache one latent row.
//!
//! One `KimiLinearModel` can also be one rank of a sharded model (driven by
//! `arch::kimi_linear::parallel::ExpertParallelKimiLinear`), as `DeepseekV3Model` can: an expert-parallel rank
//! (`load_ep_rank`) holds every non-expert weight and its range of each MoE layer's routed
//! experts, its token mixers replicated over its own copy of the latent rows and KDA states; a
//! tensor-parallel rank (`load_tp_rank`) also holds only its share of the KDA and MLA heads.

pub mod device;
pub mod parallel;

use crate::model::arch::llama::SharedKv;
use crate::model::config::{Architecture, ModelConfig};
use crate::model::error::LoadError;
use crate::model::format::source::WeightSource;
use crate::model::kv::{BatchRow, CacheLayout, KvCache};
use crate::model::layers::attn_res::AttnRes;
use crate::model::layers::decoder::final_norm_rows;
use crate::model::layers::kda::plan::{layer_plan, MixerKind};
use crate::model::layers::kda::state::SequenceState;
use crate::model::layers::kda::{KdaConfig, KdaLayer};
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

// Crate-visible: the device forward (model/device/decoder) uploads them.
// One per layer, built once: boxing the larger variant would save nothing that matters.
#[allow(clippy::large_enum_variant)]
pub(crate) enum Mixer {
    /// `ordinal`: index among the KDA layers, which is where its state lives.
    Kda {
        layer: KdaLayer,
        ordinal: usize,
    },
    Latent(MlaLayer),
}

/// The registry's entry for Kimi-Linear: whole, expert-parallel ([`parallel::ExpertParallelKimiLinear`]) or with its
/// attention heads split too (tensor-parallel); on devices through [`device`].
pub struct KimiLinear;

impl crate::model::registry::ArchitectureSpec for KimiLinear {
    fn name(&self) -> &'static str {
        "Kimi-Linear"
    }

    fn load(&self, cfg: ModelConfig, src: &dyn WeightSource) -> Result<Box<dyn LanguageModel>, LoadError> {
        Ok(Box::new(KimiLinearModel::load(cfg, src)?))
    }

    fn load_tensor_parallel(
        &self,
        cfg: ModelConfig,
        src: &dyn WeightSource,
        tp: usize,
    ) -> Result<Box<dyn LanguageModel>, LoadError> {
        Ok(Box::new(parallel::ExpertParallelKimiLinear::load_tensor_parallel(cfg, src, tp)?))
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
        Ok(Box::new(parallel::ExpertParallelKimiLinear::load(cfg, src, ep)?))
    }
}

pub(crate) struct Layer {
    pub(crate) attn_norm: Tensor,
    pub(crate) mixer: Mixer,
    pub(crate) ffn_norm: Tensor,
    pub(crate) ffn: Ffn,
}

impl PreNormLayer for Layer {
    fn pre_norm(&self) -> (&Tensor, &Tensor, &Ffn) {
        (&self.attn_norm, &self.ffn_norm, &self.ffn)
    }
}

pub struct KimiLinearModel {
    pub(crate) cfg: ModelConfig,
    pub(crate) embed: Tensor,
    pub(crate) layers: Vec<Layer>,
    /// Block Attention Residuals in place of the residual add (Kimi K3, `attn_res_block_size`).
    pub(crate) attn_res: Option<AttnRes>,
    pub(crate) norm: Tensor,
    pub(crate) lm_head: Linear,
    /// Config of each KDA layer, in layer order (the shape of a sequence's recurrent state).
    pub(crate) kda: Vec<KdaConfig>,
    /// One rank's cache: latent rows of the MLA layers, the KDA states' bytes.
    pub(crate) cache: CacheLayout,
    pub(crate) ep: EpRank,
    /// The KDA and MLA heads are split over the ranks (`load_tp_rank`): mixer outputs are partial
    /// sums, and the KDA states hold this rank's heads.
    pub(crate) split_heads: bool,
}

impl KimiLinearModel {
    /// Loads the model; `cfg.hf_config` must hold its `config.json`, whose Kimi-specific parts
    /// (`linear_attn_config`, MLA and MoE fields) the rest of `ModelConfig` does not carry.
    pub fn load(cfg: ModelConfig, src: &dyn WeightSource) -> Result<Self, LoadError> {
        Self::load_ep_rank(cfg, src, EpRank { rank: 0, size: 1 })
    }

    /// Loads expert-parallel rank `ep.rank` of `ep.size`: the token mixers, dense layers, norms,
    /// embeddings, routers and shared experts whole, of each MoE layer's routed experts only the
    /// rank's contiguous range (`parallel::ep::experts_of`). `size == 1` is the plain model.
    pub fn load_ep_rank(cfg: ModelConfig, src: &dyn WeightSource, ep: EpRank) -> Result<Self, LoadError> {
        Self::load_ranked(cfg, src, ep, false)
    }

    /// As [`Self::load_ep_rank`] with the heads of every token mixer split over the same ranks
    /// (`KdaLayer::load_heads`, `MlaLayer::load_heads`: q/k/v and gates column-parallel,
    /// `o_proj` row-parallel, summed by an all-reduce): tensor-parallel KDA and MLA layers in front
    /// of expert-parallel MoE layers. Dense MLPs stay replicated.
    pub fn load_tp_rank(cfg: ModelConfig, src: &dyn WeightSource, ranks: EpRank) -> Result<Self, LoadError> {
        Self::load_ranked(cfg, src, ranks, true)
    }

    fn load_ranked(cfg: ModelConfig, src: &dyn WeightSource, ep: EpRank, split_heads: bool) -> Result<Self, LoadError> {
        let d = cfg.hidden_size;
        let (rank, size) = if split_heads { (ep.rank, ep.size) } else { (0, 1) };
        let file = src.file_of("config.json").with_file_name("config.json");
        let raw = cfg.hf_config.clone().ok_or_else(|| LoadError::Config {
            file: file.clone(),
            detail: "Kimi-Linear is loaded from a Hugging Face config.json".into(),
        })?;
        let (file, raw) = (file.as_path(), raw.as_ref());
        let plan = layer_plan(file, raw, cfg.num_layers())?;
        let kda_cfg = KdaConfig::from_hf_config(file, raw)?;
        let mut latent_cfg =
            if plan.contains(&MixerKind::FullAttention) { Some(MlaConfig::from_hf_config(file, raw)?) } else { None };
        if let Some(mla) = latent_cfg.as_mut().filter(|_| cfg.architecture == Architecture::KimiK3) {
            // K3's servers (TokenSpeed, vLLM-cubic `kimi_k3/nvidia/mla.py`) build q_a_layernorm and
            // kv_a_layernorm with rms_norm_eps, not transformers' DeepSeek default of 1e-6.
            mla.lora_norm_eps = cfg.rms_norm_eps;
        }
        if latent_cfg.as_ref().is_some_and(|m| m.rope.is_some()) {
            // Kimi-Linear's full-attention layers are NoPE; a config asking for RoPE is not one.
            return Err(LoadError::Config {
                file: file.to_path_buf(),
                detail: "Kimi-Linear MLA layers with RoPE (mla_use_nope: false) are not supported".into(),
            });
        }
        let moe = MoeConfig::from_hf_config(file, raw)?;
        // K3 runs SiTU in its dense layer-0 MLP too (and in the experts, via MoeConfig).
        let dense_activation =
            Activation::from_hf_config(raw).map_err(|detail| LoadError::Config { file: file.to_path_buf(), detail })?;
        let attn_res = match attn_res_block_size(file, raw, cfg.architecture)? {
            Some(block) => Some(AttnRes::load(src, plan.len(), d, block, |i| format!("model.layers.{i}"))?),
            None => None,
        };
        let mut layers = Vec::with_capacity(plan.len());
        let mut kda = Vec::new();
        let mut cache_layers = Vec::with_capacity(plan.len());
        for (i, kind) in plan.iter().enumerate() {
            let p = format!("model.layers.{i}");
            let mixer = match (kind, &latent_cfg) {
                (MixerKind::Kda, _) => {
                    cache_layers.push(None);
                    let layer = KdaLayer::load_heads(kda_cfg.clone(), src, &format!("{p}.self_attn"), rank, size)?;
                    // The state holds this rank's heads.
                    kda.push(layer.config().clone());
                    Mixer::Kda { layer, ordinal: kda.len() - 1 }
                }
                (MixerKind::FullAttention, Some(lc)) => {
                    // Every head reads the whole latent row: the cache shape does not shrink.
                    let mla = MlaLayer::load_heads(lc, src, &format!("{p}.self_attn"), rank, size)?;
                    cache_layers.push(Some(mla.cache_shape()));
                    Mixer::Latent(mla)
                }
                (MixerKind::FullAttention, None) => {
                    unreachable!("latent config is read when the plan has full attention")
                }
            };
            let ffn = Ffn::load(moe.as_ref(), src, i, d, cfg.intermediate_size, dense_activation, ep)?;
            layers.push(Layer {
                attn_norm: src.load(&format!("{p}.input_layernorm.weight"), &[d])?,
                mixer,
                ffn_norm: src.load(&format!("{p}.post_attention_layernorm.weight"), &[d])?,
                ffn,
            });
            tracing::debug!(layer = i, kind = ?kind, "loaded Kimi-Linear layer");
        }
        let embed = src.load("model.embed_tokens.weight", &[cfg.vocab_size, d])?;
        let lm_head = if src.contains("lm_head.weight") || !cfg.tie_word_embeddings {
            src.linear("lm_head", cfg.vocab_size, d)?
        } else {
            src.linear("model.embed_tokens", cfg.vocab_size, d)?
        };
        if ep.size > 1 && !split_heads && !layers.iter().any(|l| l.ffn.is_expert_parallel()) {
            return Err(LoadError::Config {
                file: src.file_of("model.embed_tokens.weight"),
                detail: "expert parallelism needs a model with MoE layers".into(),
            });
        }
        let cache = CacheLayout { layers: cache_layers, recurrent_bytes_per_seq: SequenceState::bytes(&kda) };
        Ok(Self {
            norm: src.load("model.norm.weight", &[d])?,
            cfg,
            embed,
            layers,
            attn_res,
            lm_head,
            kda,
            cache,
            ep,
            split_heads,
        })
    }

    /// The cache of an expert- or tensor-parallel group: every rank keeps its own copy of each
    /// latent layer's rows (cache layer `layer * size + rank`; all heads read the whole latent)
    /// and its own state of each KDA layer (state ordinal `ordinal * size + rank`: a copy, or its
    /// heads' part when they are split), as a real device would in its own memory.
    pub fn ep_cache_layout(&self) -> CacheLayout {
        self.cache.per_rank(self.ep.size)
    }

    /// A fresh recurrent state for one sequence of the group: every rank's state of every KDA
    /// layer, in the order of [`Self::ep_cache_layout`].
    pub fn ep_recurrent_state(&self) -> Option<SequenceState> {
        let size = self.ep.size;
        let all: Vec<KdaConfig> = self.kda.iter().flat_map(|c| std::iter::repeat_n(c.clone(), size)).collect();
        (!all.is_empty()).then(|| SequenceState::new(&all))
    }

    /// This rank's part of an expert-parallel forward pass: every rank of the group calls it with
    /// the same batch and its own handle on the group's communicator. The mixers, dense layers
    /// and the head run replicated (over this rank's copies of the cache); each MoE layer runs
    /// `ExpertParallelMoe::forward_replicated`. All ranks return the same logits.
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
            |li, mixer, normed| {
                let mut out = {
                    let mut cache = kv.write().unwrap_or_else(|e| e.into_inner());
                    mix(mixer, normed, rows, &mut **cache, li * size + rank, |ordinal| ordinal * size + rank)
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
    /// the caller: `mixer(layer, mixer, normed)` and `expert_parallel(moe, normed, n)`.
    fn run<E>(
        &self,
        tokens: &[u32],
        rows: &[BatchRow],
        logit_rows: &[usize],
        mut mixer: impl FnMut(usize, &Mixer, &[f32]) -> Result<Vec<f32>, E>,
        expert_parallel: impl FnMut(&ExpertParallelMoe, &[f32], usize) -> Result<Vec<f32>, E>,
    ) -> Result<Vec<f32>, E> {
        let (cfg, d) = (&self.cfg, self.cfg.hidden_size);
        assert_eq!(tokens.len(), rows.len(), "forward: one BatchRow per token");
        let (embed, eps) = (self.embed.as_slice(), cfg.rms_norm_eps);
        let mix = |li, l: &Layer, x: &[f32]| mixer(li, &l.mixer, x);
        let hidden = match &self.attn_res {
            None => decoder_layers(embed, d, tokens, &self.layers, eps, mix, expert_parallel)?,
            Some(res) => res.decoder_layers(embed, d, tokens, &self.layers, eps, mix, expert_parallel)?,
        };
        let final_normed = final_norm_rows(&hidden, d, logit_rows, self.norm.as_slice(), cfg.rms_norm_eps);
        Ok(self.lm_head.forward(&final_normed, logit_rows.len()))
    }
}

/// One layer's token mixer over `kv`: a KDA layer advances the batch's states of state ordinal
/// `state(ordinal)`, a latent layer reads and writes cache layer `cache_layer`.
fn mix(
    mixer: &Mixer,
    normed: &[f32],
    rows: &[BatchRow],
    kv: &mut dyn KvCache,
    cache_layer: usize,
    state: impl Fn(usize) -> usize,
) -> Vec<f32> {
    match mixer {
        Mixer::Kda { layer: kda, ordinal } => {
            let states = kv
                .recurrent()
                .expect("Kimi-Linear needs a cache with recurrent state (LanguageModel::new_recurrent_state)");
            let mut view = states.layer(state(*ordinal));
            kda.forward(normed, rows, &mut view)
        }
        Mixer::Latent(attn) => attn.forward(normed, rows, kv, cache_layer),
    }
}

impl LanguageModel for KimiLinearModel {
    #[cfg(test)]
    fn as_any(&self) -> Option<&dyn std::any::Any> {
        Some(self)
    }

    fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    fn cache_layout(&self) -> CacheLayout {
        self.cache.clone()
    }

    /// A whole model only: a lone rank of a sharded one cannot run by itself.
    fn device_form(&self) -> Option<&dyn crate::model::device::placement::Placeable> {
        (self.ep.size == 1).then_some(self as &dyn crate::model::device::placement::Placeable)
    }

    fn new_recurrent_state(&self) -> Option<SequenceState> {
        (!self.kda.is_empty()).then(|| SequenceState::new(&self.kda))
    }

    /// One device. An expert-parallel rank cannot run alone: its MoE layers need the other ranks,
    /// so it is only driven through `forward_rank`.
    fn forward(&self, tokens: &[u32], rows: &[BatchRow], kv: &mut dyn KvCache, logit_rows: &[usize]) -> Vec<f32> {
        assert_eq!(
            self.ep.size, 1,
            "an expert-parallel Kimi-Linear rank runs through forward_rank with its group, not alone"
        );
        let out: Result<Vec<f32>, std::convert::Infallible> = crate::model::on_compute_pool(|| {
            self.run(
                tokens,
                rows,
                logit_rows,
                |li, mixer, normed| Ok(mix(mixer, normed, rows, &mut *kv, li, |ordinal| ordinal)),
                |_, _, _| {
                    panic!("an expert-parallel Kimi-Linear rank runs through forward_rank with its group, not alone")
                },
            )
        });
        match out {
            Ok(v) => v,
            Err(never) => match never {},
        }
    }
}

/// `attn_res_block_size` of a (text) config: `None` when absent or null (Kimi-Linear), else the
/// number of layers per AttnRes block (K3: 12).
/// K3 without the field gets TokenSpeed's default (12, its checkpoint's value).
fn attn_res_block_size(
    file: &std::path::Path,
    raw: &serde_json::Value,
    arch: Architecture,
) -> Result<Option<usize>, LoadError> {
    match raw.get("attn_res_block_size").filter(|v| !v.is_null()) {
        None if arch == Architecture::KimiK3 => Ok(Some(12)),
        None => Ok(None),
        Some(v) => match v.as_u64() {
            Some(b) if b > 0 => Ok(Some(b as usize)),
            _ => Err(LoadError::Config {
                file: file.to_path_buf(),
                detail: format!("attn_res_block_size must be a positive integer, got {v}"),
            }),
        },
    }
}
