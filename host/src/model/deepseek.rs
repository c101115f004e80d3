//! DeepSeek-V3 (and V2) decoder: embeddings, pre-norm layers of MLA attention (model/mla) and a
//! dense SwiGLU MLP for the first `first_k_dense_replace` layers, MoE (model/moe) after, final
//! RMSNorm, `lm_head`. transformers `DeepseekV3ForCausalLM`.

use kernels::cpu::matmul::matmul_t;
use kernels::cpu::norm::rms_norm;

use super::config::{AttentionKind, FfnKind, LayerSpec, ModelConfig};
use super::error::LoadError;
use super::kv::{BatchRow, CacheLayout, KvCache};
use super::linear::Linear;
use super::mla::{MlaConfig, MlaLayer};
use super::moe::mlp::{Activation, GatedMlp};
use super::moe::{MoeConfig, MoeLayer};
use super::source::WeightSource;
use super::tensor::Tensor;
use super::LanguageModel;

enum Ffn {
    Dense(GatedMlp),
    Moe(MoeLayer),
}

struct Layer {
    attn_norm: Tensor,
    attn: MlaLayer,
    ffn_norm: Tensor,
    ffn: Ffn,
}

pub struct DeepseekV3Model {
    cfg: ModelConfig,
    embed: Tensor,
    layers: Vec<Layer>,
    norm: Tensor,
    /// `None` when the output projection is tied to the embedding matrix.
    lm_head: Option<Linear>,
}

impl DeepseekV3Model {
    /// `cfg.hf_config` must hold the checkpoint's `config.json` (MLA and MoE fields are read from
    /// it). Projections load through `WeightSource::linear`, so quantized experts stay packed.
    pub fn load(mut cfg: ModelConfig, src: &dyn WeightSource) -> Result<Self, LoadError> {
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
            let ffn = match &moe {
                Some(m) if m.is_moe_layer(i) => Ffn::Moe(MoeLayer::load(m, src, &m.prefix(i))?),
                _ => Ffn::Dense(GatedMlp::load(src, &format!("{p}.mlp"), ["gate_proj", "up_proj", "down_proj"], d, cfg.intermediate_size, Activation::Silu)?),
            };
            specs.push(LayerSpec { attention: AttentionKind::Mla, ffn: if matches!(ffn, Ffn::Moe(_)) { FfnKind::Moe } else { FfnKind::DenseSwiGlu } });
            layers.push(Layer {
                attn_norm: src.load(&format!("{p}.input_layernorm.weight"), &[d])?,
                attn: MlaLayer::load(&mla, src, &format!("{p}.self_attn"))?,
                ffn_norm: src.load(&format!("{p}.post_attention_layernorm.weight"), &[d])?,
                ffn,
            });
            tracing::debug!(layer = i, of = cfg.num_layers(), "loaded DeepSeek layer");
        }
        cfg.layers = specs;
        let norm = src.load("model.norm.weight", &[d])?;
        let lm_head = if cfg.tie_word_embeddings && !src.contains("lm_head.weight") { None } else { Some(src.linear("lm_head", cfg.vocab_size, d)?) };
        Ok(Self { cfg, embed, layers, norm, lm_head })
    }
}

impl LanguageModel for DeepseekV3Model {
    fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    fn cache_layout(&self) -> CacheLayout {
        CacheLayout { layers: self.layers.iter().map(|l| Some(l.attn.cache_shape())).collect(), recurrent_bytes_per_seq: 0 }
    }

    fn forward(&self, tokens: &[u32], rows: &[BatchRow], kv: &mut dyn KvCache, logit_rows: &[usize]) -> Vec<f32> {
        let cfg = &self.cfg;
        let (n, d) = (tokens.len(), cfg.hidden_size);
        assert_eq!(n, rows.len(), "forward: one BatchRow per token");
        let embed = self.embed.as_slice();
        let mut hidden = vec![0.0f32; n * d];
        for (h, &t) in hidden.chunks_exact_mut(d).zip(tokens) {
            let t = t as usize;
            assert!(t < cfg.vocab_size, "token id {t} out of range");
            h.copy_from_slice(&embed[t * d..(t + 1) * d]);
        }
        let mut normed = vec![0.0f32; n * d];
        for (li, layer) in self.layers.iter().enumerate() {
            rms_norm(&hidden, layer.attn_norm.as_slice(), cfg.rms_norm_eps, &mut normed);
            let a = layer.attn.forward(&normed, rows, kv, li);
            hidden.iter_mut().zip(&a).for_each(|(h, v)| *h += v);
            rms_norm(&hidden, layer.ffn_norm.as_slice(), cfg.rms_norm_eps, &mut normed);
            let f = match &layer.ffn {
                Ffn::Dense(m) => m.forward(&normed, n),
                Ffn::Moe(m) => m.forward(&normed, n),
            };
            hidden.iter_mut().zip(&f).for_each(|(h, v)| *h += v);
        }
        // Only the requested rows go through the final norm and the vocabulary projection.
        let mut picked = Vec::with_capacity(logit_rows.len() * d);
        for &r in logit_rows {
            picked.extend_from_slice(&hidden[r * d..(r + 1) * d]);
        }
        let mut final_normed = vec![0.0f32; picked.len()];
        rms_norm(&picked, self.norm.as_slice(), cfg.rms_norm_eps, &mut final_normed);
        match &self.lm_head {
            Some(head) => head.forward(&final_normed, logit_rows.len()),
            None => {
                let mut logits = vec![0.0f32; logit_rows.len() * cfg.vocab_size];
                matmul_t(&final_normed, embed, &mut logits, logit_rows.len(), d, cfg.vocab_size);
                logits
            }
        }
    }
}
