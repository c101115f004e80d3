//! Hot compute kernels.
//!
//! `cpu` holds the CPU implementations the engine runs on machines without an accelerator; they are
//! also the reference that the CUDA sources (compiled at run time with NVRTC) are tested against.
pub mod cpu;
pub mod cuda;
pub mod gpu;
pub mod sim;
