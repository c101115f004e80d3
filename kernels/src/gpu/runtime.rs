//! What a device runtime provides to the launch wrappers in [`super::kernels`]: buffers, copies,
//! one kernel launch by name, and the dense bf16 GEMM. Two runtimes implement it: the CUDA driver
//! (`crate::cuda::launch::CudaRuntime`, kernels compiled with NVRTC) and the CPU simulator
//! (`crate::sim`), which runs the same `.cu` sources compiled for the host so that the kernels,
//! their launch geometry and the code composing them are tested on machines without a GPU.

use crate::cuda::CudaError;

/// Element types kernels take buffers of. With the `cuda` feature they must also be cudarc's
/// device types; the four listed are.
#[cfg(feature = "cuda")]
pub trait ElemBound: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits + Unpin {}
#[cfg(feature = "cuda")]
impl<T: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits + Unpin> ElemBound for T {}
#[cfg(not(feature = "cuda"))]
pub trait ElemBound {}
#[cfg(not(feature = "cuda"))]
impl<T> ElemBound for T {}

pub trait Elem: ElemBound + Copy + Default + Send + Sync + std::fmt::Debug + 'static {}
impl Elem for f32 {}
impl Elem for i32 {}
impl Elem for u8 {}
impl Elem for u16 {}

/// A device buffer's element count (launch wrappers check sizes against it before launching).
pub trait DevBuf {
    fn len(&self) -> usize;
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Grid and block dimensions of one launch (CUDA's `<<<grid, block, shared>>>`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Dims {
    pub grid: (u32, u32, u32),
    pub block: (u32, u32, u32),
    pub shared_mem_bytes: u32,
}

impl Dims {
    pub fn new(grid: (u32, u32, u32), block: u32) -> Self {
        Self { grid, block: (block, 1, 1), shared_mem_bytes: 0 }
    }
}

/// One kernel argument: a buffer (passed as its device pointer) or a scalar, in the order of
/// the kernel's parameter list.
pub enum KArg<'a, R: Runtime + ?Sized> {
    F32s(&'a R::Buf<f32>),
    I32s(&'a R::Buf<i32>),
    U8s(&'a R::Buf<u8>),
    U16s(&'a R::Buf<u16>),
    I32(i32),
    I64(i64),
    F32(f32),
}

pub trait Runtime {
    type Buf<T: Elem>: DevBuf;

    /// E.g. `NVIDIA H200 (sm_90)` or `simulator`.
    fn describe(&self) -> String;
    fn upload<T: Elem>(&self, host: &[T]) -> Result<Self::Buf<T>, CudaError>;
    fn download<T: Elem>(&self, buf: &Self::Buf<T>) -> Result<Vec<T>, CudaError>;
    /// A zero-filled buffer of `n` elements (at least one: CUDA has no empty allocations).
    fn zeros<T: Elem>(&self, n: usize) -> Result<Self::Buf<T>, CudaError>;
    /// Copies `host` into `buf[offset..offset + host.len()]`.
    fn write<T: Elem>(&self, buf: &mut Self::Buf<T>, offset: usize, host: &[T]) -> Result<(), CudaError>;
    fn synchronize(&self) -> Result<(), CudaError>;
    /// Launches `kernel` (a name listed in `crate::cuda::sources::SOURCES`).
    ///
    /// # Safety
    /// `args` must match the kernel's parameter list in order and type, and every buffer must be
    /// large enough for what the kernel reads and writes at these dimensions (the wrappers in
    /// [`super::kernels`] check sizes before calling this).
    unsafe fn launch(&self, kernel: &'static str, dims: Dims, args: &[KArg<'_, Self>]) -> Result<(), CudaError>;
    /// `out[n, m] (f32) = x[n, k] (bf16) · W[m, k]ᵀ (bf16)`, f32 accumulation (cuBLAS on CUDA),
    /// where W is rows `w_row0..w_row0 + m` of `w` (one expert of an expert-stacked weight).
    #[allow(clippy::too_many_arguments)]
    fn gemm_bf16(
        &self,
        x: &Self::Buf<u16>,
        w: &Self::Buf<u16>,
        w_row0: usize,
        out: &mut Self::Buf<f32>,
        n: usize,
        k: usize,
        m: usize,
    ) -> Result<(), CudaError>;
    /// Whether kernels may issue bf16 tensor-core MMAs (`mma_bf16_16816` in cuda/prelude.cuh:
    /// sm_80 and later). The simulator emulates them.
    fn bf16_mma(&self) -> bool {
        true
    }
}
