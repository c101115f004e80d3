//! CUDA kernels: the sources in `kernels/cuda/*.cu`, compiled with NVRTC at start-up (PTX cached
//! on disk), and the CUDA driver runtime (cudarc) under the launch wrappers of `crate::gpu`. Every kernel has a CPU reference in `crate::cpu`;
//! tests compare the two on a GPU and skip, saying so, without one.
//!
//! Nothing here links against CUDA: libcuda, libnvrtc and libcublas are dlopen-ed on first use,
//! so the crate builds and its CPU paths run on machines without a driver or toolkit.
pub mod sources;

/// The bindings, for the host crate's CUDA backend (one version, pinned here).
#[cfg(feature = "cuda")]
pub use cudarc;

#[cfg(feature = "cuda")]
pub mod device;
/// The paged KV pool (`crate::gpu::kv_pool`) on a CUDA device.
#[cfg(feature = "cuda")]
pub mod kv_pool {
    pub use crate::gpu::kv_pool::KvStorage;
    pub type DeviceKvPool = crate::gpu::kv_pool::DeviceKvPool<super::launch::CudaRuntime>;
}
#[cfg(feature = "cuda")]
pub mod launch;
#[cfg(feature = "cuda")]
pub mod nvrtc;

/// Why the CUDA path is unavailable or failed.
#[derive(Debug, thiserror::Error)]
pub enum CudaError {
    #[error("CUDA library lib{lib} not found ({hint})")]
    LibraryMissing { lib: &'static str, hint: &'static str },
    #[error("this build has no CUDA support (built without the `cuda` feature)")]
    NotBuilt,
    #[error("no CUDA device {ordinal} (found {count})")]
    NoSuchDevice { ordinal: usize, count: usize },
    #[error("CUDA driver error in {what}: {msg}")]
    Driver { what: &'static str, msg: String },
    #[error("NVRTC failed to compile {source_name}:\n{log}")]
    Nvrtc { source_name: String, log: String },
    #[error("CUDA call {what} panicked: {msg}")]
    Panicked { what: &'static str, msg: String },
    #[error("bad kernel arguments: {0}")]
    BadArgs(String),
}
