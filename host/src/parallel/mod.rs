//! The lowest layer of sharding, free of any model: a device mesh (tensor-parallel ×
//! expert-parallel layout), which part of a model a rank holds, the collective-communication
//! interface ranks exchange activations through (on host slices and on device buffers), and an
//! in-process implementation that runs N simulated devices as N threads on the CPU. The sharded
//! models themselves live with their architectures (`model::arch::<name>::parallel`).
//!
//! Design notes: docs/sharding.md.

pub mod collective;
pub mod device_collective;
pub(crate) mod group;
pub mod layout;
pub mod local;
pub mod ranks;

pub use collective::{Collective, CollectiveError, Element, ReduceElement};
pub use layout::{DeviceMesh, MeshCoord, MeshError};
pub use local::LocalCollective;
pub use ranks::{EpRank, TpRank};
