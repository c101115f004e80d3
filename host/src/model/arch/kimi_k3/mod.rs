//! Kimi K3 (`KimiK3ForConditionalGeneration`, `model_type: kimi_k3`): a MoonViT3d vision tower
//! in front of the Kimi-Linear text backbone (KDA and gated NoPE-MLA layers, latent MoE with SiTU
//! experts) whose residual stream is Block Attention Residuals (`layers::attn_res`).
//!
//! The text model is `arch::kimi_linear` itself: `ModelConfig` reads `text_config`, which names
//! `attn_res_block_size` and `hidden_act: situ`, and the weights come through [`Prefixed`] because
//! the checkpoint stores them under `language_model.`. Sharded forms are Kimi-Linear's.
//! The vision tower is not served yet: its tensors are skipped by name (model::unused), with a
//! log line, until image input lands.
//!
//! Sources read (no code copied): lightseekorg/tokenspeed f4d8ec6
//! `python/tokenspeed/runtime/models/kimi_k3.py`, `runtime/configs/kimi_k3_config.py`.

use crate::model::arch::kimi_linear::KimiLinear;
use crate::model::config::ModelConfig;
use crate::model::error::LoadError;
use crate::model::format::prefixed::Prefixed;
use crate::model::format::source::WeightSource;
use crate::model::registry::ArchitectureSpec;
use crate::model::LanguageModel;

/// Where K3 keeps its text model's tensors.
pub const TEXT_PREFIX: &str = "language_model.";

/// Tensor-name prefixes of the vision tower and its projector (served by the image-input work).
pub const VISION_PREFIXES: [&str; 2] = ["vision_tower.", "mm_projector."];

/// The registry's entry for Kimi K3: Kimi-Linear's, over the weights under [`TEXT_PREFIX`].
pub struct KimiK3;

impl ArchitectureSpec for KimiK3 {
    fn name(&self) -> &'static str {
        "Kimi K3"
    }

    fn load(&self, cfg: ModelConfig, src: &dyn WeightSource) -> Result<Box<dyn LanguageModel>, LoadError> {
        KimiLinear.load(cfg, &Prefixed::new(src, TEXT_PREFIX))
    }

    fn load_tensor_parallel(
        &self,
        cfg: ModelConfig,
        src: &dyn WeightSource,
        tp: usize,
    ) -> Result<Box<dyn LanguageModel>, LoadError> {
        KimiLinear.load_tensor_parallel(cfg, &Prefixed::new(src, TEXT_PREFIX), tp)
    }

    fn expert_parallel(&self) -> bool {
        KimiLinear.expert_parallel()
    }

    fn load_expert_parallel(
        &self,
        cfg: ModelConfig,
        src: &dyn WeightSource,
        ep: usize,
    ) -> Result<Box<dyn LanguageModel>, LoadError> {
        KimiLinear.load_expert_parallel(cfg, &Prefixed::new(src, TEXT_PREFIX), ep)
    }
}
