//! A checkpoint tensor that no layer reads stops the load, named: a silently unread tensor means
//! the forward is not the checkpoint's (that is how Kimi K3's Attention Residuals once went
//! unnoticed). The few tensors that are knowingly not served are skipped by name, each kind with
//! one log line:
//!
//! - Kimi K3's vision tower and projector (`vision_tower.*`, `mm_projector.*`): image input is
//!   not served yet;
//! - multi-token-prediction layers past `num_hidden_layers` (DeepSeek-V3's
//!   `num_nextn_predict_layers`): speculative decoding is not implemented;
//! - `*.rotary_emb.inv_freq`: a buffer older transformers saved, recomputed from the config.

use std::path::Path;

use crate::model::arch::kimi_k3;
use crate::model::config::{Architecture, ModelConfig};
use crate::model::error::LoadError;
use crate::model::format::source::WeightSource;

/// Why a tensor nothing read is allowed, or `None` when it is an error.
fn skipped(cfg: &ModelConfig, name: &str) -> Option<&'static str> {
    if cfg.architecture == Architecture::KimiK3 && kimi_k3::VISION_PREFIXES.iter().any(|p| name.starts_with(p)) {
        return Some("the vision tower (image input is not served yet)");
    }
    if name.ends_with(".rotary_emb.inv_freq") {
        return Some("rotary inverse frequencies (recomputed from the config)");
    }
    let layer = name
        .strip_prefix(kimi_k3::TEXT_PREFIX)
        .unwrap_or(name)
        .strip_prefix("model.layers.")
        .and_then(|rest| rest.split('.').next())
        .and_then(|i| i.parse::<usize>().ok());
    if layer.is_some_and(|i| i >= cfg.num_layers()) {
        return Some("multi-token-prediction layers (speculative decoding is not implemented)");
    }
    None
}

/// Refuses the load when `src` holds tensors the model built from it never read (outside the
/// skip list above), naming them; logs what was skipped.
pub fn check(cfg: &ModelConfig, src: &dyn WeightSource, checkpoint: &Path) -> Result<(), LoadError> {
    let Some(unread) = src.unread() else { return Ok(()) };
    let mut skipped_kinds: std::collections::BTreeMap<&'static str, usize> = Default::default();
    let mut errors = Vec::new();
    for name in unread {
        match skipped(cfg, &name) {
            Some(kind) => *skipped_kinds.entry(kind).or_default() += 1,
            None => errors.push(name),
        }
    }
    for (kind, tensors) in skipped_kinds {
        tracing::warn!(tensors, "checkpoint tensors not loaded: {kind}");
    }
    if errors.is_empty() {
        return Ok(());
    }
    const SHOWN: usize = 8;
    let more = if errors.len() > SHOWN { format!(" and {} more", errors.len() - SHOWN) } else { String::new() };
    Err(LoadError::UnusedTensors {
        file: checkpoint.to_path_buf(),
        count: errors.len(),
        names: format!("{}{more}", errors[..errors.len().min(SHOWN)].join(", ")),
    })
}
