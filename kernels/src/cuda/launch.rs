//! The CUDA driver as a [`Runtime`]: one context and stream, every kernel compiled (NVRTC, PTX
//! cached on disk) and loaded, cuBLAS for the dense bf16 GEMM. The launch wrappers themselves
//! live in `crate::gpu::kernels`, shared with the CPU simulator; [`Gpu`] is them on this runtime.

use std::collections::HashMap;
use std::sync::Arc;

use cudarc::cublas::{result as blas_result, sys as blas_sys, CudaBlas};
pub use cudarc::driver::CudaSlice;
use cudarc::driver::{CudaContext, CudaFunction, CudaStream, DevicePtr, DevicePtrMut, LaunchConfig, PushKernelArg};
use cudarc::nvrtc::Ptx;

use super::device::{self, DeviceInfo};
use super::nvrtc::{guarded, PtxCache};
use super::sources::SOURCES;
use super::CudaError;
use crate::gpu::{self, DevBuf, Dims, Elem, KArg, Kernels, Runtime};

pub use crate::gpu::PagedGeometry;

/// Every kernel on one CUDA device.
pub type Gpu = Kernels<CudaRuntime>;
pub type DevPacked = gpu::DevPacked<CudaRuntime>;
pub type DevGrouped = gpu::DevGrouped<CudaRuntime>;
pub type DevMxfp4 = gpu::DevMxfp4<CudaRuntime>;

fn drv<T, E: std::fmt::Debug>(what: &'static str, r: Result<T, E>) -> Result<T, CudaError> {
    r.map_err(|e| CudaError::Driver { what, msg: format!("{e:?}") })
}

pub struct CudaRuntime {
    pub ctx: Arc<CudaContext>,
    pub stream: Arc<CudaStream>,
    pub info: DeviceInfo,
    funcs: HashMap<&'static str, CudaFunction>,
    blas: CudaBlas,
}

impl<T> DevBuf for CudaSlice<T> {
    fn len(&self) -> usize {
        CudaSlice::len(self)
    }
}

impl CudaRuntime {
    /// Opens device `ordinal`, compiles (or loads from `cache`) every kernel source for its
    /// architecture and loads the modules.
    pub fn open(ordinal: usize, cache: &PtxCache) -> Result<Self, CudaError> {
        let ctx = device::open(ordinal)?;
        let info = device::info(&ctx)?;
        let stream = ctx.default_stream();
        let mut funcs = HashMap::new();
        for src in SOURCES {
            let ptx = cache.get_or_compile(src, info.arch())?;
            let module = drv("cuModuleLoadData", guarded("cuModuleLoadData", || ctx.load_module(Ptx::from_src(ptx)))?)?;
            for &k in src.kernels {
                funcs.insert(k, drv("cuModuleGetFunction", module.load_function(k))?);
            }
        }
        let blas = drv("cublasCreate", guarded("cublasCreate", || CudaBlas::new(stream.clone()))?)?;
        keep_pool_memory(&ctx);
        tracing::info!(device = %info.name, ordinal, arch = info.arch(), kernels = funcs.len(), "CUDA kernels loaded");
        Ok(Self { ctx, stream, info, funcs, blas })
    }
}

/// The forward allocates its activations per step (`Runtime::zeros`), which cudarc takes from the
/// device's stream-ordered memory pool (`cuMemAllocAsync`) where the driver has one. That pool's
/// default release threshold is 0: every synchronisation would hand freed memory back to the OS
/// and the next step would map it again. Keeping it (threshold = unlimited) makes the pool a
/// caching allocator, so per-step buffers cost a pool lookup, not a driver allocation. Best
/// effort: a driver without pools keeps cudarc's synchronous allocation, logged.
fn keep_pool_memory(ctx: &Arc<CudaContext>) {
    use cudarc::driver::sys;
    if !ctx.has_async_alloc() {
        tracing::warn!("this CUDA driver has no stream-ordered allocator: per-step activation buffers use cuMemAlloc");
        return;
    }
    let set = || -> Result<(), String> {
        ctx.bind_to_thread().map_err(|e| format!("{e:?}"))?;
        let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
        // SAFETY: a valid device of a live context; `pool` receives the device's default pool.
        let r = unsafe { sys::cuDeviceGetDefaultMemPool(&mut pool, ctx.cu_device()) };
        if r != sys::CUresult::CUDA_SUCCESS {
            return Err(format!("cuDeviceGetDefaultMemPool: {r:?}"));
        }
        let mut threshold: u64 = u64::MAX;
        // SAFETY: the attribute takes a cuuint64_t, which `threshold` is.
        let r = unsafe {
            sys::cuMemPoolSetAttribute(
                pool,
                sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
                (&mut threshold as *mut u64).cast(),
            )
        };
        if r != sys::CUresult::CUDA_SUCCESS {
            return Err(format!("cuMemPoolSetAttribute(RELEASE_THRESHOLD): {r:?}"));
        }
        Ok(())
    };
    match guarded("cuMemPoolSetAttribute", set) {
        Ok(Ok(())) => tracing::debug!("device memory pool keeps freed memory for reuse"),
        Ok(Err(e)) => tracing::warn!(
            "cannot make the device memory pool cache freed memory ({e}); per-step buffers may be slower"
        ),
        Err(e) => tracing::warn!("cannot make the device memory pool cache freed memory ({e})"),
    }
}

impl Gpu {
    /// [`CudaRuntime::open`] with the launch wrappers on top.
    pub fn open(ordinal: usize, cache: &PtxCache) -> Result<Self, CudaError> {
        Ok(Kernels::new(CudaRuntime::open(ordinal, cache)?))
    }
}

impl Runtime for CudaRuntime {
    type Buf<T: Elem> = CudaSlice<T>;

    fn describe(&self) -> String {
        format!("{} ({})", self.info.name, self.info.arch())
    }
    fn bf16_mma(&self) -> bool {
        self.info.compute_capability >= (8, 0)
    }
    fn upload<T: Elem>(&self, host: &[T]) -> Result<CudaSlice<T>, CudaError> {
        drv("cuMemcpyHtoD", self.stream.clone_htod(host))
    }
    fn download<T: Elem>(&self, dev: &CudaSlice<T>) -> Result<Vec<T>, CudaError> {
        drv("cuMemcpyDtoH", self.stream.clone_dtoh(dev))
    }
    fn zeros<T: Elem>(&self, n: usize) -> Result<CudaSlice<T>, CudaError> {
        drv("cuMemAlloc", self.stream.alloc_zeros(n.max(1)))
    }
    fn write<T: Elem>(&self, buf: &mut CudaSlice<T>, offset: usize, host: &[T]) -> Result<(), CudaError> {
        gpu::kernels::check(offset + host.len() <= buf.len(), || {
            format!("write of {} at {offset} into {}", host.len(), buf.len())
        })?;
        drv("cuMemcpyHtoD", self.stream.memcpy_htod(host, &mut buf.slice_mut(offset..offset + host.len())))
    }
    fn synchronize(&self) -> Result<(), CudaError> {
        drv("cuStreamSynchronize", self.stream.synchronize())
    }

    unsafe fn launch(&self, kernel: &'static str, dims: Dims, args: &[KArg<'_, Self>]) -> Result<(), CudaError> {
        let f = self.funcs.get(kernel).ok_or_else(|| CudaError::BadArgs(format!("no kernel {kernel} loaded")))?;
        let mut b = self.stream.launch_builder(f);
        // Scalars are pushed by reference, so they need a home that outlives the builder.
        let (mut i32s, mut i64s, mut f32s) =
            (Vec::with_capacity(args.len()), Vec::with_capacity(args.len()), Vec::with_capacity(args.len()));
        for a in args {
            match *a {
                KArg::I32(v) => i32s.push(v),
                KArg::I64(v) => i64s.push(v),
                KArg::F32(v) => f32s.push(v),
                _ => {}
            }
        }
        let (mut ii, mut il, mut ff) = (0, 0, 0);
        for a in args {
            match a {
                KArg::F32s(s) => b.arg(*s),
                KArg::I32s(s) => b.arg(*s),
                KArg::U8s(s) => b.arg(*s),
                KArg::U16s(s) => b.arg(*s),
                KArg::I32(_) => {
                    ii += 1;
                    b.arg(&i32s[ii - 1])
                }
                KArg::I64(_) => {
                    il += 1;
                    b.arg(&i64s[il - 1])
                }
                KArg::F32(_) => {
                    ff += 1;
                    b.arg(&f32s[ff - 1])
                }
            };
        }
        let cfg = LaunchConfig { grid_dim: dims.grid, block_dim: dims.block, shared_mem_bytes: dims.shared_mem_bytes };
        // SAFETY: the caller guarantees the argument list and sizes (see `Runtime::launch`).
        drv(kernel, unsafe { b.launch(cfg) }).map(|_| ())
    }

    /// cuBLAS `cublasGemmEx`. Row-major W[m, k] is column-major Wᵀ, so cuBLAS computes
    /// outᵀ = W · xᵀ with op(A) = Aᵀ on the stored W.
    fn gemm_bf16(
        &self,
        x: &CudaSlice<u16>,
        w: &CudaSlice<u16>,
        w_row0: usize,
        out: &mut CudaSlice<f32>,
        n: usize,
        k: usize,
        m: usize,
    ) -> Result<(), CudaError> {
        let (alpha, beta) = (1.0f32, 0.0f32);
        // A raw cuBLAS call does not make the context current, and tensor-parallel ranks drive
        // their devices from fresh threads.
        drv("cuCtxSetCurrent", self.ctx.bind_to_thread())?;
        let (xp, _gx) = x.device_ptr(&self.stream);
        let (wp, _gw) = w.device_ptr(&self.stream);
        let wp = wp + (w_row0 * k * std::mem::size_of::<u16>()) as u64; // W's first row
        let (op, _go) = out.device_ptr_mut(&self.stream);
        // SAFETY: pointers are live device buffers of the sizes `Kernels::gemm_bf16` checked (rows
        // w_row0..w_row0 + m of w included), on this stream.
        let r = unsafe {
            blas_result::gemm_ex(
                *self.blas.handle(),
                blas_sys::cublasOperation_t::CUBLAS_OP_T,
                blas_sys::cublasOperation_t::CUBLAS_OP_N,
                m as i32,
                n as i32,
                k as i32,
                &alpha as *const f32 as *const _,
                wp as *const _,
                blas_sys::cudaDataType_t::CUDA_R_16BF,
                k as i32,
                xp as *const _,
                blas_sys::cudaDataType_t::CUDA_R_16BF,
                k as i32,
                &beta as *const f32 as *const _,
                op as *mut _,
                blas_sys::cudaDataType_t::CUDA_R_32F,
                m as i32,
                blas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                blas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        };
        drv("cublasGemmEx", r)
    }
}
