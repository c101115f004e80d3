//! Kimi-Linear (transformers' `KimiLinearForCausalLM`): a hybrid decoder whose layers are either
//! Kimi Delta Attention (linear attention with a fixed-size per-sequence state, `kda/`) or
//! multi-head latent attention without RoPE (`mla/`, `mla_use_nope`), each followed by a dense SwiGLU MLP (the first
//! `first_k_dense_replace` layers) or a mixture of experts (`moe/`).
//!
//! The layer plan comes from `linear_attn_config` (`kda/plan.rs`); KDA layers cache nothing per
//! token and read their state from `KvCache::recurrent`, latent layers cache one latent row.

use kernels::cpu::norm::rms_norm;

use super::config::ModelConfig;
use super::decoder::{add_residual, embed_tokens, final_norm_rows};
use super::error::LoadError;
use super::kda::plan::{layer_plan, MixerKind};
use super::kda::state::SequenceState;
use super::kda::{KdaConfig, KdaLayer};
use super::kv::{BatchRow, CacheLayout, KvCache};
use super::linear::Linear;
use super::mla::{MlaConfig, MlaLayer};
use super::moe::mlp::{Activation, GatedMlp};
use super::moe::{MoeConfig, MoeLayer};
use super::source::WeightSource;
use super::tensor::Tensor;
use super::LanguageModel;

// Crate-visible: the device forward (model/device_deepseek) uploads them.
pub(crate) enum Mixer {
    /// `ordinal`: index among the KDA layers, which is where its state lives.
    Kda { layer: KdaLayer, ordinal: usize },
    Latent(MlaLayer),
}

pub(crate) enum Ffn {
    Dense(GatedMlp),
    Moe(MoeLayer),
}

pub(crate) struct Layer {
    pub(crate) attn_norm: Tensor,
    pub(crate) mixer: Mixer,
    pub(crate) ffn_norm: Tensor,
    pub(crate) ffn: Ffn,
}

pub struct KimiLinearModel {
    pub(crate) cfg: ModelConfig,
    pub(crate) embed: Tensor,
    pub(crate) layers: Vec<Layer>,
    pub(crate) norm: Tensor,
    pub(crate) lm_head: Linear,
    /// Config of each KDA layer, in layer order (the shape of a sequence's recurrent state).
    pub(crate) kda: Vec<KdaConfig>,
    pub(crate) cache: CacheLayout,
}

impl KimiLinearModel {
    /// Loads the model; `cfg.hf_config` must hold its `config.json`, whose Kimi-specific parts
    /// (`linear_attn_config`, MLA and MoE fields) the rest of `ModelConfig` does not carry.
    pub fn load(cfg: ModelConfig, src: &dyn WeightSource) -> Result<Self, LoadError> {
        let d = cfg.hidden_size;
        let file = src.file_of("config.json").with_file_name("config.json");
        let raw = cfg.hf_config.clone().ok_or_else(|| LoadError::Config { file: file.clone(), detail: "Kimi-Linear is loaded from a Hugging Face config.json".into() })?;
        let (file, raw) = (file.as_path(), raw.as_ref());
        let plan = layer_plan(file, raw, cfg.num_layers())?;
        let kda_cfg = KdaConfig::from_hf_config(file, raw)?;
        let latent_cfg = if plan.contains(&MixerKind::FullAttention) { Some(MlaConfig::from_hf_config(file, raw)?) } else { None };
        if latent_cfg.as_ref().is_some_and(|m| m.rope.is_some()) {
            // Kimi-Linear's full-attention layers are NoPE; a config asking for RoPE is not one.
            return Err(LoadError::Config { file: file.to_path_buf(), detail: "Kimi-Linear MLA layers with RoPE (mla_use_nope: false) are not supported".into() });
        }
        let moe = MoeConfig::from_hf_config(file, raw)?;
        let mut layers = Vec::with_capacity(plan.len());
        let mut kda = Vec::new();
        let mut cache_layers = Vec::with_capacity(plan.len());
        for (i, kind) in plan.iter().enumerate() {
            let p = format!("model.layers.{i}");
            let mixer = match (kind, &latent_cfg) {
                (MixerKind::Kda, _) => {
                    cache_layers.push(None);
                    kda.push(kda_cfg.clone());
                    Mixer::Kda { layer: KdaLayer::load(kda_cfg.clone(), src, &format!("{p}.self_attn"))?, ordinal: kda.len() - 1 }
                }
                (MixerKind::FullAttention, Some(lc)) => {
                    let mla = MlaLayer::load(lc, src, &format!("{p}.self_attn"))?;
                    cache_layers.push(Some(mla.cache_shape()));
                    Mixer::Latent(mla)
                }
                (MixerKind::FullAttention, None) => unreachable!("latent config is read when the plan has full attention"),
            };
            let ffn = match &moe {
                Some(m) if m.is_moe_layer(i) => Ffn::Moe(MoeLayer::load(m, src, &m.prefix(i))?),
                _ => Ffn::Dense(GatedMlp::load(src, &format!("{p}.mlp"), ["gate_proj", "up_proj", "down_proj"], d, cfg.intermediate_size, Activation::Silu)?),
            };
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
        let cache = CacheLayout { layers: cache_layers, recurrent_bytes_per_seq: SequenceState::bytes(&kda) };
        Ok(Self { norm: src.load("model.norm.weight", &[d])?, cfg, embed, layers, lm_head, kda, cache })
    }
}

impl LanguageModel for KimiLinearModel {
    fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    fn cache_layout(&self) -> CacheLayout {
        self.cache.clone()
    }

    fn kimi_linear(&self) -> Option<&KimiLinearModel> {
        Some(self)
    }

    fn new_recurrent_state(&self) -> Option<SequenceState> {
        (!self.kda.is_empty()).then(|| SequenceState::new(&self.kda))
    }

    fn forward(&self, tokens: &[u32], rows: &[BatchRow], kv: &mut dyn KvCache, logit_rows: &[usize]) -> Vec<f32> {
        let cfg = &self.cfg;
        let (n, d) = (tokens.len(), cfg.hidden_size);
        assert_eq!(n, rows.len(), "forward: one BatchRow per token");
        let mut hidden = embed_tokens(self.embed.as_slice(), d, tokens);
        let mut normed = vec![0.0f32; n * d];
        for (li, layer) in self.layers.iter().enumerate() {
            rms_norm(&hidden, layer.attn_norm.as_slice(), cfg.rms_norm_eps, &mut normed);
            let mixed = match &layer.mixer {
                Mixer::Kda { layer: kda, ordinal } => {
                    let states = kv.recurrent().expect("Kimi-Linear needs a cache with recurrent state (LanguageModel::new_recurrent_state)");
                    let mut view = states.layer(*ordinal);
                    kda.forward(&normed, rows, &mut view)
                }
                Mixer::Latent(attn) => attn.forward(&normed, rows, kv, li),
            };
            add_residual(&mut hidden, &mixed);
            rms_norm(&hidden, layer.ffn_norm.as_slice(), cfg.rms_norm_eps, &mut normed);
            let out = match &layer.ffn {
                Ffn::Dense(mlp) => mlp.forward(&normed, n),
                Ffn::Moe(moe) => moe.forward(&normed, n),
            };
            add_residual(&mut hidden, &out);
        }
        let final_normed = final_norm_rows(&hidden, d, logit_rows, self.norm.as_slice(), cfg.rms_norm_eps);
        self.lm_head.forward(&final_normed, logit_rows.len())
    }
}
