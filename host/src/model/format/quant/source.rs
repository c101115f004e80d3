//! A safetensors checkpoint with a quantization config: Linear layers the config targets come
//! back packed; everything else (ignored layers, norms, embeddings) loads as before, in the
//! checkpoint's dtype widened to f32.

use std::path::{Path, PathBuf};

use serde_json::Value;

use crate::model::error::LoadError;
use crate::model::format::hf_source::SafetensorsSource;
use crate::model::format::quant::ct_config::{CtConfig, CtFormat};
use crate::model::format::quant::ct_linear::load_int_linear;
use crate::model::format::quant::cubic::{load_cubic, CubicConfig};
use crate::model::format::quant::cubic_pack::{load_cubic_pack, CubicPackConfig};
use crate::model::format::quant::mxfp4_linear::load_ct_mxfp4;
use crate::model::format::source::WeightSource;
use crate::model::layers::linear::Linear;
use crate::model::tensor::Tensor;

enum Config {
    CompressedTensors(CtConfig),
    /// QuantTrio's `cubic-pack-quantized`.
    CubicPack(CubicPackConfig),
    /// The earlier in-house cubic layout (`version: 1`, per-module list).
    Cubic(CubicConfig),
}

pub struct QuantizedSource {
    inner: SafetensorsSource,
    config: Config,
    config_file: PathBuf,
}

/// A config.json's `quantization_config`: at the top, or inside `text_config` as Kimi K3's
/// releases keep it; `None` when absent or null.
pub fn quantization_config(cfg: &Value) -> Option<&Value> {
    let in_text = cfg.get("text_config").and_then(|t| t.get("quantization_config"));
    cfg.get("quantization_config").or(in_text).filter(|q| !q.is_null())
}

impl QuantizedSource {
    /// Wraps `inner` when `config.json` has a `quantization_config` (at the top, or inside
    /// `text_config` as Kimi K3's MXFP4 release keeps it); returns it unchanged (boxed)
    /// otherwise. Unknown quantization methods are refused rather than misread.
    pub fn wrap(inner: SafetensorsSource, config_file: &Path, cfg: &Value) -> Result<Box<dyn WeightSource>, LoadError> {
        let Some(q) = quantization_config(cfg) else {
            return Ok(Box::new(inner));
        };
        let err = |detail: String| LoadError::Config {
            file: config_file.to_path_buf(),
            detail: format!("quantization_config: {detail}"),
        };
        let config = if let Some(ct) = CtConfig::parse(q).map_err(err)? {
            Config::CompressedTensors(ct)
        } else if let Some(c) = CubicPackConfig::parse(q).map_err(err)? {
            Config::CubicPack(c)
        } else if let Some(c) = CubicConfig::parse(q).map_err(err)? {
            Config::Cubic(c)
        } else {
            let method = q.get("quant_method").and_then(Value::as_str).unwrap_or("(none)");
            return Err(err(format!(
                "quant_method '{method}' is not supported (supported: compressed-tensors, cubic)"
            )));
        };
        Ok(Box::new(Self { inner, config, config_file: config_file.to_path_buf() }))
    }
}

impl WeightSource for QuantizedSource {
    fn load(&self, name: &str, shape: &[usize]) -> Result<Tensor, LoadError> {
        if let Some(module) = name.strip_suffix(".weight") {
            if self.inner.contains(&format!("{module}.weight_packed"))
                || self.inner.contains(&format!("{module}.cubic_codes"))
            {
                // A weight the model needs in f32 (MLA's kv_b_proj for the absorbed form, K3's
                // [1, hidden] AttnRes projections) that the checkpoint quantized: decoded once
                // here, as vLLM does for the absorbed MLA weights.
                if let [rows, cols] = shape {
                    let dense = self.linear(module, *rows, *cols)?.to_dense();
                    return Ok(Tensor::owned(shape.to_vec(), dense));
                }
                return Err(LoadError::BadTensor {
                    file: self.inner.file_of(name),
                    tensor: name.to_string(),
                    detail: format!("stored quantized, but a {}-dimensional weight cannot be", shape.len()),
                });
            }
        }
        self.inner.load(name, shape)
    }

    fn contains(&self, name: &str) -> bool {
        self.inner.contains(name)
            || name.strip_suffix(".weight").is_some_and(|m| {
                self.inner.contains(&format!("{m}.weight_packed")) || self.inner.contains(&format!("{m}.cubic_codes"))
            })
    }

    fn file_of(&self, name: &str) -> PathBuf {
        self.inner.file_of(name)
    }

    fn unread(&self) -> Option<Vec<String>> {
        self.inner.unread()
    }

    fn shape_of(&self, name: &str) -> Option<Vec<usize>> {
        self.inner.shape_of(name)
    }

    fn linear(&self, module: &str, rows: usize, cols: usize) -> Result<Linear, LoadError> {
        let ct = match &self.config {
            Config::CompressedTensors(ct) => ct,
            Config::CubicPack(c) => {
                let scheme = c
                    .scheme_for(module)
                    .map_err(|detail| LoadError::Config { file: self.config_file.clone(), detail })?;
                let packed = self.inner.contains(&format!("{module}.weight_packed"));
                return match scheme {
                    Some(s) if packed => load_cubic_pack(&self.inner, module, rows, cols, s).map(Linear::CubicPack),
                    // Targeted but stored dense (QuantTrio's `cq` converter targets every Linear
                    // and converts only experts): dense, as vLLM loads it.
                    _ => self.inner.load(&format!("{module}.weight"), &[rows, cols]).map(Linear::Dense),
                };
            }
            Config::Cubic(c) => {
                return match c.modules.get(module) {
                    Some(layer) => load_cubic(&self.inner, module, rows, cols, *layer).map(Linear::Cubic),
                    None => self.inner.load(&format!("{module}.weight"), &[rows, cols]).map(Linear::Dense),
                }
            }
        };
        let Some(scheme) = ct.scheme_for(module) else {
            return self.inner.load(&format!("{module}.weight"), &[rows, cols]).map(Linear::Dense);
        };
        if !self.inner.contains(&format!("{module}.weight_packed")) {
            // A module a config group targets that the checkpoint kept dense loads dense (vLLM
            // does the same); one with neither form is an error naming both.
            if self.inner.contains(&format!("{module}.weight")) {
                return self.inner.load(&format!("{module}.weight"), &[rows, cols]).map(Linear::Dense);
            }
            return Err(LoadError::Config {
                file: self.config_file.clone(),
                detail: format!(
                    "'{module}' is quantized by config group '{}' but the checkpoint has neither {module}.weight_packed nor {module}.weight",
                    scheme.group
                ),
            });
        }
        match scheme.format {
            CtFormat::PackQuantized => {
                load_int_linear(&self.inner, module, rows, cols, &scheme.weights).map(Linear::Int)
            }
            CtFormat::Mxfp4PackQuantized => load_ct_mxfp4(&self.inner, module, rows, cols).map(Linear::Mxfp4),
        }
    }
}
