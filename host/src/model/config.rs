//! Architecture description read from a checkpoint's config (GGUF metadata or HF `config.json`).
//!
//! The layer plan is a list of per-layer specs so later architectures can mix attention kinds
//! (full attention, latent attention, linear attention) and feed-forward kinds (dense, MoE).

use std::path::Path;

use serde_json::Value;

use crate::model::error::LoadError;
use crate::model::format::gguf::{GgufFile, MetaValue};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Architecture {
    /// Llama family: RMSNorm, RoPE, grouped-query attention, SwiGLU (Llama 2/3, Mistral, SmolLM).
    Llama,
    /// DeepSeek-V3: MLA attention, dense first layers then MoE (model/arch/deepseek_v3/mod.rs).
    DeepseekV3,
    /// Kimi-Linear: KDA linear attention and MLA full attention, dense MLP or MoE
    /// (model/arch/kimi_linear/mod.rs).
    KimiLinear,
    /// Kimi K3 (`KimiK3ForConditionalGeneration`): the Kimi-Linear text backbone with Block
    /// Attention Residuals under `language_model.`, config nested in `text_config`
    /// (model/arch/kimi_k3/mod.rs).
    KimiK3,
}

impl Architecture {
    /// Every architecture (registry order: how errors list them).
    pub const ALL: [Architecture; 4] =
        [Architecture::Llama, Architecture::DeepseekV3, Architecture::KimiLinear, Architecture::KimiK3];
    pub const SUPPORTED: &'static str = "llama (also mistral, smollm), deepseek_v3, kimi_linear, kimi_k3";

    fn from_name(name: &str) -> Option<Self> {
        match name {
            "llama" | "mistral" | "smollm" | "LlamaForCausalLM" | "MistralForCausalLM" => Some(Self::Llama),
            "deepseek_v3" | "DeepseekV3ForCausalLM" => Some(Self::DeepseekV3),
            "kimi_linear" | "KimiLinearForCausalLM" => Some(Self::KimiLinear),
            "kimi_k3" | "KimiK3ForConditionalGeneration" => Some(Self::KimiK3),
            _ => None,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AttentionKind {
    /// Multi-head / grouped-query softmax attention with RoPE.
    Gqa,
    /// Multi-head latent attention (model/layers/mla), compressed latent cache.
    Mla,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FfnKind {
    /// SwiGLU MLP: `down(silu(gate(x)) * up(x))`.
    DenseSwiGlu,
    /// Mixture of experts (model/layers/moe).
    Moe,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LayerSpec {
    pub attention: AttentionKind,
    pub ffn: FfnKind,
}

#[derive(Clone, Debug)]
pub struct ModelConfig {
    pub architecture: Architecture,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub rms_norm_eps: f32,
    pub rope_theta: f32,
    pub max_position_embeddings: usize,
    pub tie_word_embeddings: bool,
    pub layers: Vec<LayerSpec>,
    /// The checkpoint's `config.json`, for architectures whose own modules parse further fields
    /// (MLA, MoE); `None` for GGUF.
    pub hf_config: Option<std::sync::Arc<Value>>,
}

impl ModelConfig {
    pub fn num_layers(&self) -> usize {
        self.layers.len()
    }

    /// Values per token per layer in the K (or V) cache.
    pub fn kv_width(&self) -> usize {
        self.num_kv_heads * self.head_dim
    }

    fn validate(self, file: &Path) -> Result<Self, LoadError> {
        let bad = |detail: String| Err(LoadError::Config { file: file.to_path_buf(), detail });
        if self.hidden_size == 0
            || self.num_heads == 0
            || self.num_kv_heads == 0
            || self.layers.is_empty()
            || self.vocab_size == 0
        {
            return bad(format!(
                "zero-sized model dimension (hidden {}, heads {}, kv heads {}, layers {}, vocab {})",
                self.hidden_size,
                self.num_heads,
                self.num_kv_heads,
                self.layers.len(),
                self.vocab_size
            ));
        }
        if !self.num_heads.is_multiple_of(self.num_kv_heads) {
            return bad(format!(
                "{} attention heads is not a multiple of {} key/value heads",
                self.num_heads, self.num_kv_heads
            ));
        }
        if !self.head_dim.is_multiple_of(2) {
            return bad(format!("head_dim {} is odd; RoPE needs an even size", self.head_dim));
        }
        Ok(self)
    }

    pub fn from_gguf(g: &GgufFile) -> Result<Self, LoadError> {
        let file = &g.path;
        let arch_name = g.meta("general.architecture").and_then(MetaValue::as_str).ok_or_else(|| {
            LoadError::Config { file: file.clone(), detail: "metadata key general.architecture is missing".into() }
        })?;
        let architecture = Architecture::from_name(arch_name).ok_or_else(|| LoadError::UnknownArchitecture {
            file: file.clone(),
            arch: arch_name.to_string(),
            supported: Architecture::SUPPORTED.into(),
        })?;
        let key = |k: &str| format!("{arch_name}.{k}");
        let req = |k: &str| -> Result<u64, LoadError> {
            g.meta(&key(k)).and_then(MetaValue::as_u64).ok_or_else(|| LoadError::Config {
                file: file.clone(),
                detail: format!("metadata key {} is missing or not an integer", key(k)),
            })
        };
        let hidden_size = req("embedding_length")? as usize;
        let num_heads = req("attention.head_count")? as usize;
        let num_kv_heads = g
            .meta(&key("attention.head_count_kv"))
            .and_then(MetaValue::as_u64)
            .map(|v| v as usize)
            .unwrap_or(num_heads);
        let head_dim = g
            .meta(&key("attention.key_length"))
            .and_then(MetaValue::as_u64)
            .map(|v| v as usize)
            .unwrap_or(hidden_size / num_heads.max(1));
        let vocab_size = match g.meta(&key("vocab_size")).and_then(MetaValue::as_u64) {
            Some(v) => v as usize,
            None => g.meta("tokenizer.ggml.tokens").and_then(MetaValue::as_array).map(|a| a.len()).unwrap_or(0),
        };
        let n_layers = req("block_count")? as usize;
        let spec = LayerSpec { attention: AttentionKind::Gqa, ffn: FfnKind::DenseSwiGlu };
        Self {
            architecture,
            vocab_size,
            hidden_size,
            intermediate_size: req("feed_forward_length")? as usize,
            num_heads,
            num_kv_heads,
            head_dim,
            rms_norm_eps: g.meta(&key("attention.layer_norm_rms_epsilon")).and_then(MetaValue::as_f64).unwrap_or(1e-5)
                as f32,
            rope_theta: g.meta(&key("rope.freq_base")).and_then(MetaValue::as_f64).unwrap_or(10000.0) as f32,
            max_position_embeddings: g.meta(&key("context_length")).and_then(MetaValue::as_u64).unwrap_or(2048)
                as usize,
            tie_word_embeddings: g.tensor("output.weight").is_none(),
            layers: vec![spec; n_layers],
            hf_config: None,
        }
        .validate(file)
    }

    pub fn from_hf_config(file: &Path, cfg: &Value) -> Result<Self, LoadError> {
        let cfg_err = |detail: String| LoadError::Config { file: file.to_path_buf(), detail };
        let arch_name = cfg
            .get("model_type")
            .and_then(Value::as_str)
            .or_else(|| cfg.get("architectures").and_then(|a| a.get(0)).and_then(Value::as_str))
            .ok_or_else(|| cfg_err("neither model_type nor architectures is set".into()))?;
        let architecture = Architecture::from_name(arch_name).ok_or_else(|| LoadError::UnknownArchitecture {
            file: file.to_path_buf(),
            arch: arch_name.to_string(),
            supported: Architecture::SUPPORTED.into(),
        })?;
        // Kimi K3 keeps the text model's fields in `text_config` (vision in `vision_config`); the
        // text model is what every later parser reads.
        let cfg = match architecture {
            Architecture::KimiK3 => cfg
                .get("text_config")
                .filter(|t| t.is_object())
                .ok_or_else(|| cfg_err("kimi_k3 config without a text_config object".into()))?,
            _ => cfg,
        };
        let req = |k: &str| -> Result<usize, LoadError> {
            cfg.get(k)
                .and_then(Value::as_u64)
                .map(|v| v as usize)
                .ok_or_else(|| cfg_err(format!("field '{k}' is missing or not an integer")))
        };
        let hidden_size = req("hidden_size")?;
        let num_heads = req("num_attention_heads")?;
        let num_kv_heads =
            cfg.get("num_key_value_heads").and_then(Value::as_u64).map(|v| v as usize).unwrap_or(num_heads);
        let head_dim =
            cfg.get("head_dim").and_then(Value::as_u64).map(|v| v as usize).unwrap_or(hidden_size / num_heads.max(1));
        // transformers >= 5 nests RoPE settings in `rope_parameters`; older configs use
        // `rope_theta` and `rope_scaling` at the top level.
        let rope = cfg.get("rope_parameters").filter(|v| v.is_object());
        let scaling = rope.or_else(|| cfg.get("rope_scaling").filter(|v| !v.is_null()));
        if let Some(scaling) = scaling {
            let kind =
                scaling.get("rope_type").or_else(|| scaling.get("type")).and_then(Value::as_str).unwrap_or("default");
            // MLA parses its own RoPE scaling (YaRN) in model/layers/mla/config.rs.
            if kind != "default" && architecture != Architecture::DeepseekV3 {
                return Err(cfg_err(format!("rope scaling type '{kind}' is not supported yet")));
            }
        }
        let rope_theta = rope
            .and_then(|r| r.get("rope_theta"))
            .or_else(|| cfg.get("rope_theta"))
            .and_then(Value::as_f64)
            .unwrap_or(10000.0) as f32;
        for flag in ["attention_bias", "mlp_bias"] {
            if cfg.get(flag).and_then(Value::as_bool) == Some(true) {
                return Err(cfg_err(format!("'{flag}: true' is not supported yet")));
            }
        }
        // Kimi's MLPs may run SiTU (model/layers/moe/mlp.rs parses its betas); everything else SiLU.
        let kimi = matches!(architecture, Architecture::KimiLinear | Architecture::KimiK3);
        if let Some(act) =
            cfg.get("hidden_act").and_then(Value::as_str).filter(|a| *a != "silu" && !(kimi && *a == "situ"))
        {
            let expected = if kimi { "silu or situ" } else { "silu" };
            return Err(cfg_err(format!("hidden_act '{act}' is not supported (expected {expected})")));
        }
        let spec = LayerSpec { attention: AttentionKind::Gqa, ffn: FfnKind::DenseSwiGlu };
        Self {
            architecture,
            vocab_size: req("vocab_size")?,
            hidden_size,
            intermediate_size: req("intermediate_size")?,
            num_heads,
            num_kv_heads,
            head_dim,
            rms_norm_eps: cfg.get("rms_norm_eps").and_then(Value::as_f64).unwrap_or(1e-5) as f32,
            rope_theta,
            max_position_embeddings: cfg.get("max_position_embeddings").and_then(Value::as_u64).unwrap_or(2048)
                as usize,
            tie_word_embeddings: cfg.get("tie_word_embeddings").and_then(Value::as_bool).unwrap_or(false),
            layers: vec![spec; req("num_hidden_layers")?],
            hf_config: Some(std::sync::Arc::new(cfg.clone())),
        }
        .validate(file)
    }
}
