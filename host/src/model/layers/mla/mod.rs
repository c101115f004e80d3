//! Multi-head Latent Attention (DeepSeek-V2/V3, Kimi-Linear / K3 full-attention layers) with a
//! compressed latent KV cache: each token caches `kv_lora_rank + qk_rope_head_dim` floats per
//! layer instead of per-head keys and values.
//!
//! - [`config::MlaConfig`]: MLA fields of `config.json`, RoPE / YaRN, softmax scale.
//! - [`rope::MlaRotary`]: YaRN frequencies, interleaved pair layout.
//! - [`absorb::Absorbed`]: attention over the latent cache with `kv_b_proj` folded in.
//! - [`layer::MlaLayer`]: the whole layer (`load`, `forward`, `cache_shape`).

pub mod absorb;
pub mod config;
pub mod layer;
pub mod rope;

pub use config::MlaConfig;
pub use layer::MlaLayer;
