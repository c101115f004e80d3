//! Model loading: checkpoint formats, the architecture registry and the forward pass.

pub mod activations;
pub mod arch;
pub mod config;
pub mod device;
pub mod error;
pub mod format;
pub mod kv;
pub mod layers;
pub mod registry;
pub mod shard;
pub mod tensor;
pub mod tokenizer;
pub mod unused;

use std::path::{Path, PathBuf};
use std::time::Instant;

use config::ModelConfig;
use error::LoadError;
use format::source::WeightSource;
use kv::{BatchRow, CacheLayout, KvCache};

use tokenizer::Tokenizer;

/// Runs a single-device CPU forward pass on one of rayon's worker threads and waits for it. Its
/// parallel matmuls (seven per Llama layer per step) then fork inside the pool; started from
/// outside it, each one is injected and waited for on a futex, which cost a quarter of SmolLM2's
/// single-stream decode step on 2 cores (docs/engine-benchmarks.md). Not for tensor- or
/// expert-parallel ranks: they block on each other, which pool threads must not do.
pub(crate) fn on_compute_pool<R: Send>(forward: impl FnOnce() -> R + Send) -> R {
    rayon::scope(|_| forward())
}

/// What the engine, generation and benchmarks need from an architecture: its configuration, what
/// it caches per token and per sequence, and one batched forward pass.
pub trait LanguageModel: Send + Sync {
    fn config(&self) -> &ModelConfig;

    /// Per-layer cache rows (which the paged pool is shaped after) and recurrent state size.
    fn cache_layout(&self) -> CacheLayout;

    /// Runs `tokens` (one per entry of `rows`) through the model, storing what each layer caches
    /// in `kv`, and returns logits (`logit_rows.len() × vocab`) for the rows listed in
    /// `logit_rows`. Callers pass token ids below `vocab_size` and, for every row, have already
    /// run (earlier, or earlier in this batch) all positions before it of the same sequence.
    fn forward(&self, tokens: &[u32], rows: &[BatchRow], kv: &mut dyn KvCache, logit_rows: &[usize]) -> Vec<f32>;

    /// [`Self::forward`] for models that can fail at run time (a device model: driver errors,
    /// a cache it cannot use); the engine calls this one and fails the batch's requests on an
    /// error instead of panicking. CPU models never fail here.
    fn try_forward(
        &self,
        tokens: &[u32],
        rows: &[BatchRow],
        kv: &mut dyn KvCache,
        logit_rows: &[usize],
    ) -> Result<Vec<f32>, ForwardError> {
        Ok(self.forward(tokens, rows, kv, logit_rows))
    }

    /// The model's own device-resident K/V pool, for models that keep K/V on a device: the engine
    /// then sizes it (`DeviceKv::allocate`) and keeps only block bookkeeping on the host.
    fn device_kv(&self) -> Option<&dyn DeviceKv> {
        None
    }

    /// How this model moves onto devices (one per rank), if its architecture has a device
    /// forward (`model::device::placement`).
    fn device_form(&self) -> Option<&dyn device::placement::Placeable> {
        None
    }

    /// The concrete CPU model, for tests that need what is behind a loaded one.
    #[cfg(test)]
    fn as_any(&self) -> Option<&dyn std::any::Any> {
        None
    }

    /// A fresh (no tokens yet) recurrent state for one sequence, for models with linear-attention
    /// layers (`cache_layout().recurrent_bytes_per_seq > 0`); their `forward` reads the batch's
    /// states from `KvCache::recurrent`.
    fn new_recurrent_state(&self) -> Option<layers::kda::state::SequenceState> {
        None
    }

    /// A contiguous cache for `num_seqs` sequences, with recurrent states when the model has them
    /// (single-request generation and benchmarks).
    fn contiguous_cache(&self, num_seqs: usize) -> kv::ContiguousKvCache {
        kv::ContiguousKvCache::for_layout(&self.cache_layout(), num_seqs).with_recurrent(self.new_recurrent_state())
    }
}

/// Why a forward pass failed (device models only; see [`LanguageModel::try_forward`]).
#[derive(Debug, thiserror::Error)]
pub enum ForwardError {
    #[error("device error in the forward pass: {0}")]
    Device(#[from] kernels::cuda::CudaError),
    #[error("{0}")]
    Invalid(String),
}

impl From<crate::parallel::CollectiveError> for ForwardError {
    fn from(e: crate::parallel::CollectiveError) -> Self {
        ForwardError::Invalid(format!("tensor-parallel collective failed: {e}"))
    }
}

impl From<crate::parallel::device_collective::DeviceCollectiveError> for ForwardError {
    fn from(e: crate::parallel::device_collective::DeviceCollectiveError) -> Self {
        use crate::parallel::device_collective::DeviceCollectiveError as E;
        match e {
            E::Device(d) => ForwardError::Device(d),
            E::Group(g) => g.into(),
            E::Invalid(m) => ForwardError::Invalid(m),
        }
    }
}

/// A device K/V pool a model owns, addressed by the engine's block ids.
pub trait DeviceKv: Send + Sync {
    /// Allocates (once) `num_blocks` blocks of `block_size` positions for every layer.
    fn allocate(
        &self,
        num_blocks: usize,
        block_size: usize,
        storage: kernels::gpu::kv_pool::KvStorage,
    ) -> Result<(), ForwardError>;
    /// Allocates (once) `slots` recurrent-state slots (models with linear-attention layers; the
    /// engine lends their ids to sequences and reports resets and forks through
    /// `PagedView::slot_ops`). A model without recurrent state has nothing to allocate.
    fn allocate_recurrent(&self, slots: usize) -> Result<(), ForwardError> {
        let _ = slots;
        Ok(())
    }
}

pub use registry::{build, build_ep, build_tp};

/// A model ready to run: weights, tokenizer and chat template.
pub struct LoadedModel {
    /// Name served as the OpenAI `model` id (file stem or directory name).
    pub name: String,
    pub path: PathBuf,
    pub model: Box<dyn LanguageModel>,
    pub tokenizer: Tokenizer,
    /// How its CPU forward feeds packed integer layers (`--cpu-activations`).
    pub cpu_activations: activations::CpuActivations,
}

impl LoadedModel {
    pub fn config(&self) -> &ModelConfig {
        self.model.config()
    }
}

/// Loads a `.gguf` file or a Hugging Face directory (`config.json` + safetensors + tokenizer).
pub fn load(path: &Path) -> Result<LoadedModel, LoadError> {
    load_tp(path, 1)
}

/// [`load`] with the model split over `tp` tensor-parallel ranks ([`build_tp`]).
pub fn load_tp(path: &Path, tp: usize) -> Result<LoadedModel, LoadError> {
    load_with_options(path, &LoadOptions { tensor_parallel: tp, ..Default::default() })
}

/// [`load`] with the routed experts split over `ep` expert-parallel ranks ([`build_ep`]).
pub fn load_ep(path: &Path, ep: usize) -> Result<LoadedModel, LoadError> {
    load_with_options(path, &LoadOptions { expert_parallel: ep, ..Default::default() })
}

/// How [`load_with_options`] builds a model.
#[derive(Clone, Copy, Debug)]
pub struct LoadOptions {
    /// Tensor-parallel ranks ([`build_tp`]).
    pub tensor_parallel: usize,
    /// Expert-parallel ranks ([`build_ep`]); used when `tensor_parallel` is 1.
    pub expert_parallel: usize,
    /// How the CPU forward feeds packed integer layers ([`activations`]).
    pub cpu_activations: activations::CpuActivations,
}

impl Default for LoadOptions {
    fn default() -> Self {
        Self { tensor_parallel: 1, expert_parallel: 1, cpu_activations: activations::CpuActivations::default() }
    }
}

/// [`load`] with sharding and the CPU activation precision chosen (the command line's loader):
/// opens a `.gguf` file or a Hugging Face directory and builds the model from it.
pub fn load_with_options(path: &Path, opts: &LoadOptions) -> Result<LoadedModel, LoadError> {
    if opts.tensor_parallel > 1 && opts.expert_parallel > 1 {
        let detail = format!(
            "tensor parallelism ({}) with expert parallelism ({}): combining both is not implemented yet",
            opts.tensor_parallel, opts.expert_parallel
        );
        return Err(LoadError::Config { file: path.to_path_buf(), detail });
    }
    let started = Instant::now();
    let name = path.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_else(|| "model".into());
    let (model, tokenizer) = if path.is_dir() {
        let cfg_path = path.join("config.json");
        let text =
            std::fs::read_to_string(&cfg_path).map_err(|e| LoadError::Io { file: cfg_path.clone(), source: e })?;
        let raw: serde_json::Value = serde_json::from_str(&text)
            .map_err(|e| LoadError::Corrupt { file: cfg_path.clone(), detail: format!("invalid JSON: {e}") })?;
        let cfg = ModelConfig::from_hf_config(&cfg_path, &raw)?;
        let src =
            format::quant::QuantizedSource::wrap(format::hf_source::SafetensorsSource::open(path)?, &cfg_path, &raw)?;
        let tokenizer = Tokenizer::from_hf_dir(path, &raw)?;
        let model = build_with_options(cfg, src.as_ref(), opts)?;
        unused::check(model.config(), src.as_ref(), path)?;
        (model, tokenizer)
    } else {
        let file = format::gguf::GgufFile::open(path)?;
        let cfg = ModelConfig::from_gguf(&file)?;
        let tokenizer = Tokenizer::from_gguf(&file)?;
        let src = format::gguf_source::GgufSource::new(file);
        (build_with_options(cfg, &src, opts)?, tokenizer)
    };
    let cfg = model.config();
    let (sharding, ranks) = if opts.tensor_parallel == 1 && opts.expert_parallel != 1 {
        ("ep", opts.expert_parallel)
    } else {
        ("tp", opts.tensor_parallel)
    };
    tracing::info!(
        model = %path.display(),
        layers = cfg.num_layers(),
        hidden = cfg.hidden_size,
        vocab = cfg.vocab_size,
        sharding,
        ranks,
        cpu_activations = %opts.cpu_activations,
        secs = format!("{:.2}", started.elapsed().as_secs_f64()),
        "model loaded"
    );
    Ok(LoadedModel { name, path: path.to_path_buf(), model, tokenizer, cpu_activations: opts.cpu_activations })
}

/// [`build_tp`] or [`build_ep`] as `opts` asks, from `src` wrapped for 8-bit activations when
/// `opts.cpu_activations` is `int8`.
fn build_with_options(
    cfg: ModelConfig,
    src: &dyn WeightSource,
    opts: &LoadOptions,
) -> Result<Box<dyn LanguageModel>, LoadError> {
    let wrapped;
    let src: &dyn WeightSource = if opts.cpu_activations == activations::CpuActivations::Int8 {
        wrapped = activations::Int8ActivationSource::new(src);
        &wrapped
    } else {
        src
    };
    match opts.tensor_parallel {
        1 => build_ep(cfg, src, opts.expert_parallel),
        tp => build_tp(cfg, src, tp),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tensor_and_expert_parallelism_together_are_refused_before_loading() {
        let opts = LoadOptions { tensor_parallel: 2, expert_parallel: 2, ..Default::default() };
        match load_with_options(Path::new("/nonexistent/model.gguf"), &opts) {
            Err(LoadError::Config { detail, .. }) => assert!(detail.contains("not implemented"), "{detail}"),
            Err(other) => panic!("expected a configuration error, got {other}"),
            Ok(_) => panic!("loaded"),
        }
    }
}
