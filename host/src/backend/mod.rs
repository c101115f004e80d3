//! Where the model runs: `--device` parsing and the guarded probe of the devices (`device`),
//! moving a loaded model onto them (`placement`, through `model::device::placement`), and NCCL
//! between a node's GPUs (`nccl`, with the `cuda` feature). The kernels themselves are
//! `kernels::gpu` (launch wrappers over a runtime) and `kernels::cuda` / `kernels::sim` (the
//! runtimes); docs/cuda.md.

pub mod device;
#[cfg(feature = "cuda")]
pub mod nccl;
pub mod placement;

pub use device::{select, DeviceSpec, Selected};
pub use placement::place_model;
