//! Latent MoE (Kimi K3, NVIDIA Nemotron-3 "LatentMoE"; docs/formats.md §5.4): the
//! routed experts live in a smaller width. The hidden state is projected down
//! (`routed_expert_down_proj`), the experts' weighted sum is RMS-normalised there
//! (`routed_expert_norm`, when `latent_moe_use_norm`) and projected back up
//! (`routed_expert_up_proj`). The norm is not linear, so with experts split across devices the
//! partial sums must be added *before* [`Latent::up`].

use kernels::cpu::norm::rms_norm;

use crate::model::error::LoadError;
use crate::model::format::source::WeightSource;
use crate::model::layers::linear::Linear;
use crate::model::layers::moe::config::MoeConfig;

// Crate-visible: the device forward uploads them.
pub struct Latent {
    pub(crate) down: Linear,
    pub(crate) norm: Option<Vec<f32>>,
    pub(crate) up: Linear,
    pub(crate) eps: f32,
}

impl Latent {
    pub fn load(cfg: &MoeConfig, src: &dyn WeightSource, prefix: &str) -> Result<Option<Self>, LoadError> {
        let Some(l) = cfg.latent else { return Ok(None) };
        let (h, r) = (cfg.hidden_size, l.hidden_size);
        let norm = if l.use_norm {
            Some(src.load(&format!("{prefix}.routed_expert_norm.weight"), &[r])?.as_slice().to_vec())
        } else {
            None
        };
        Ok(Some(Self {
            down: src.linear(&format!("{prefix}.routed_expert_down_proj"), r, h)?,
            norm,
            up: src.linear(&format!("{prefix}.routed_expert_up_proj"), h, r)?,
            eps: cfg.rms_norm_eps,
        }))
    }

    /// `n` hidden rows → `n` latent rows, the routed experts' input.
    pub fn down(&self, x: &[f32], n: usize) -> Vec<f32> {
        self.down.forward(x, n)
    }

    /// The (complete) weighted expert sum in latent width → its contribution in hidden width.
    pub fn up(&self, y: &[f32], n: usize) -> Vec<f32> {
        match &self.norm {
            Some(w) => {
                let mut normed = vec![0.0; y.len()];
                rms_norm(y, w, self.eps, &mut normed);
                self.up.forward(&normed, n)
            }
            None => self.up.forward(y, n),
        }
    }

    pub fn weight_bytes(&self) -> usize {
        self.down.weight_bytes() + self.up.weight_bytes() + self.norm.as_ref().map_or(0, |w| w.len() * 4)
    }
}
