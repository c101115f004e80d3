//! The architectures this server runs, each registered once: how it loads whole, tensor-parallel
//! and expert-parallel. `ModelConfig` names the architecture (`config::Architecture`, parsed from
//! a checkpoint's config); [`spec`] is the one place that maps it to its folder under `arch/`.
//! (Moving onto devices is the loaded model's own business: `LanguageModel::device_form`.)

use super::arch::{deepseek_v3, kimi_k3, kimi_linear, llama};
use super::config::{Architecture, ModelConfig};
use super::error::LoadError;
use super::format::source::WeightSource;
use super::LanguageModel;

/// What an architecture can do on the CPU. Sharded forms default to a clear refusal.
pub trait ArchitectureSpec: Sync {
    /// The name in errors and logs.
    fn name(&self) -> &'static str;

    /// The whole model from a checkpoint's weights.
    fn load(&self, cfg: ModelConfig, src: &dyn WeightSource) -> Result<Box<dyn LanguageModel>, LoadError>;

    /// The model split over `tp` tensor-parallel ranks (`tp >= 2`).
    fn load_tensor_parallel(
        &self,
        cfg: ModelConfig,
        src: &dyn WeightSource,
        tp: usize,
    ) -> Result<Box<dyn LanguageModel>, LoadError> {
        let _ = (cfg, tp);
        Err(unsupported(src, format!("tensor parallelism is not implemented for {}", self.name())))
    }

    /// Whether [`Self::load_expert_parallel`] is implemented (the architecture has routed experts).
    fn expert_parallel(&self) -> bool {
        false
    }

    /// The model with its routed experts split over `ep` expert-parallel ranks (`ep >= 2`).
    fn load_expert_parallel(
        &self,
        cfg: ModelConfig,
        src: &dyn WeightSource,
        ep: usize,
    ) -> Result<Box<dyn LanguageModel>, LoadError> {
        let _ = (cfg, ep);
        let with: Vec<&str> =
            Architecture::ALL.iter().map(|a| spec(*a)).filter(|s| s.expert_parallel()).map(|s| s.name()).collect();
        let detail =
            format!("expert parallelism is implemented for {} models only, not {}", with.join(", "), self.name());
        Err(unsupported(src, detail))
    }
}

/// A configuration error naming the checkpoint file.
pub fn unsupported(src: &dyn WeightSource, detail: String) -> LoadError {
    LoadError::Config { file: src.file_of("model.embed_tokens.weight"), detail }
}

/// The registry: one line per architecture.
pub fn spec(a: Architecture) -> &'static dyn ArchitectureSpec {
    match a {
        Architecture::Llama => &llama::Llama,
        Architecture::DeepseekV3 => &deepseek_v3::DeepseekV3,
        Architecture::KimiLinear => &kimi_linear::KimiLinear,
        Architecture::KimiK3 => &kimi_k3::KimiK3,
    }
}

/// Builds the architecture `cfg` names from a checkpoint's weights.
pub fn build(cfg: ModelConfig, src: &dyn WeightSource) -> Result<Box<dyn LanguageModel>, LoadError> {
    spec(cfg.architecture).load(cfg, src)
}

/// As [`build`], split over `tp` simulated tensor-parallel devices when `tp != 1` (clear errors
/// when the shapes do not divide, `tp` is 0 or the architecture has no tensor-parallel form).
pub fn build_tp(cfg: ModelConfig, src: &dyn WeightSource, tp: usize) -> Result<Box<dyn LanguageModel>, LoadError> {
    match tp {
        1 => build(cfg, src),
        tp => spec(cfg.architecture).load_tensor_parallel(cfg, src, tp),
    }
}

/// As [`build`], with the routed experts split over `ep` simulated expert-parallel devices when
/// `ep != 1` (clear errors for architectures without experts).
pub fn build_ep(cfg: ModelConfig, src: &dyn WeightSource, ep: usize) -> Result<Box<dyn LanguageModel>, LoadError> {
    match ep {
        1 => build(cfg, src),
        ep => spec(cfg.architecture).load_expert_parallel(cfg, src, ep),
    }
}
