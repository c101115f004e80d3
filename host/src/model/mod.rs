//! Model loading: checkpoint formats, the architecture registry and the forward pass.

pub mod config;
pub mod error;
pub mod ggml;
pub mod gguf;
pub mod gguf_source;
pub mod hf_source;
pub mod kda;
pub mod kv;
pub mod linear;
pub mod llama;
pub mod moe;
pub mod quant;
pub mod source;
pub mod tensor;

use std::path::{Path, PathBuf};
use std::time::Instant;

use config::ModelConfig;
use error::LoadError;
use llama::LlamaModel;

use crate::tokenizer::Tokenizer;

/// A model ready to run: weights, tokenizer and chat template.
pub struct LoadedModel {
    /// Name served as the OpenAI `model` id (file stem or directory name).
    pub name: String,
    pub path: PathBuf,
    pub model: LlamaModel,
    pub tokenizer: Tokenizer,
}

impl LoadedModel {
    pub fn config(&self) -> &ModelConfig {
        self.model.config()
    }
}

/// Loads a `.gguf` file or a Hugging Face directory (`config.json` + safetensors + tokenizer).
pub fn load(path: &Path) -> Result<LoadedModel, LoadError> {
    let started = Instant::now();
    let name = path.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_else(|| "model".into());
    let (model, tokenizer) = if path.is_dir() {
        let cfg_path = path.join("config.json");
        let text = std::fs::read_to_string(&cfg_path).map_err(|e| LoadError::Io { file: cfg_path.clone(), source: e })?;
        let raw: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| LoadError::Corrupt { file: cfg_path.clone(), detail: format!("invalid JSON: {e}") })?;
        let cfg = ModelConfig::from_hf_config(&cfg_path, &raw)?;
        let src = quant::QuantizedSource::wrap(hf_source::SafetensorsSource::open(path)?, &cfg_path, &raw)?;
        let tokenizer = Tokenizer::from_hf_dir(path, &raw)?;
        (LlamaModel::load(cfg, src.as_ref())?, tokenizer)
    } else {
        let file = gguf::GgufFile::open(path)?;
        let cfg = ModelConfig::from_gguf(&file)?;
        let tokenizer = Tokenizer::from_gguf(&file)?;
        let src = gguf_source::GgufSource::new(file);
        (LlamaModel::load(cfg, &src)?, tokenizer)
    };
    let cfg = model.config();
    tracing::info!(
        model = %path.display(),
        layers = cfg.num_layers(),
        hidden = cfg.hidden_size,
        vocab = cfg.vocab_size,
        secs = format!("{:.2}", started.elapsed().as_secs_f64()),
        "model loaded"
    );
    Ok(LoadedModel { name, path: path.to_path_buf(), model, tokenizer })
}
