//! The device layer shared by every runtime: the [`Runtime`] trait (buffers, copies, launch by
//! name) and [`Kernels`], each kernel's size-checked launch wrapper written once over it.
pub mod attn_res;
pub mod kda;
pub mod kernels;
pub mod kv_pool;
pub mod kv_store;
pub mod latent_pool;
pub mod mla;
pub mod moe;
pub mod prefill;
pub mod recurrent_pool;
pub mod runtime;

pub use crate::cpu::mla::LatentGeometry;
pub use kda::KdaGeometry;
pub use kernels::{
    DevGrouped, DevMxfp4, DevPacked, GemmScratch, Kernels, MatmulPath, PagedGeometry, QuantWeight, GEMM_MIN_TOKENS,
};
pub use latent_pool::DeviceLatentPool;
pub use moe::{ExpertGroups, ExpertSlots, ExpertWeight, MoePlan, MoeTiles, Routed};
pub use recurrent_pool::DeviceRecurrentPool;
pub use runtime::{DevBuf, Dims, Elem, KArg, Runtime};
