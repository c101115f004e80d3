//! Sharding across devices: a device mesh (tensor-parallel × expert-parallel layout), the
//! collective-communication interface ranks exchange activations through, and an in-process
//! implementation that runs N simulated devices as N threads on the CPU.
//!
//! Design notes: docs/sharding.md.

pub mod collective;
pub mod device_collective;
pub mod ep;
pub mod ep_model;
mod group;
pub mod layout;
pub mod local;
pub mod split;
pub mod tp;

pub use ep::{DispatchStats, ExpertParallelMoe};
pub use ep_model::{ExpertParallelDeepseek, ExpertParallelKimiLinear};
pub use collective::{Collective, CollectiveError, Element, ReduceElement};
pub use layout::{DeviceMesh, MeshCoord, MeshError};
pub use local::LocalCollective;
pub use split::{even_range, Split};
pub use tp::TensorParallel;
