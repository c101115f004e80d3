//! Mixture-of-experts feed-forward blocks (DeepSeek-V2/V3, Kimi-Linear, Kimi K3 latent MoE):
//! config parsing, routing, grouped expert execution, shared experts. See docs/moe.md.
//!
//! - [`config::MoeConfig`]: MoE fields of `config.json`, layer plan (dense first layers).
//! - [`router::Router`]: softmax/sigmoid scores, greedy / group-limited / noaux_tc top-k.
//! - [`experts::Experts`]: tokens grouped by expert, each expert run once per step.
//! - [`latent::Latent`]: down/up projections and norm of latent MoE.
//! - [`mlp::GatedMlp`]: one gated MLP (an expert, the shared experts, or a dense layer's MLP).
//! - [`layer::MoeLayer`]: the whole block.
//! - [`ffn::Ffn`]: a decoder layer's feed-forward half (dense, MoE, or an expert-parallel rank's
//!   share) and the pre-norm layer body of the MoE decoders.

pub mod config;
pub mod expert_parallel;
pub mod experts;
pub(crate) mod ffn;
pub mod latent;
pub mod layer;
pub mod mlp;
pub mod router;

pub use expert_parallel::{DispatchStats, ExpertParallelMoe};

pub use config::MoeConfig;
pub use layer::MoeLayer;
pub use router::Routing;
