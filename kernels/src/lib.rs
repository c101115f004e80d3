//! Hot compute kernels.
//!
//! `cpu` holds the CPU implementations the engine runs on machines without an accelerator; they are
//! also the reference that the CUDA sources (compiled at run time with NVRTC) are tested against.
//! `gpu` is the device layer (the `Runtime` trait and every kernel's launch wrapper over it), `cuda`
//! the CUDA driver runtime, and `sim` a CPU simulator runtime that runs the same `.cu` sources
//! (compiled for the host by build.rs) so they are tested without a GPU. `compare` measures an
//! output against its reference for the tests (NaN-aware).
pub mod compare;
pub mod cpu;
pub mod cuda;
pub mod gpu;
pub mod sim;
