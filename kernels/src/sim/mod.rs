//! A CPU simulator as a [`Runtime`]: runs the real `.cu` sources (compiled for the host by
//! build.rs, with `kernels/sim/cuda_sim.h` standing in for the CUDA built-ins), at the launch
//! geometry and with the argument lists of the [`Kernels`] wrappers, so kernels and the code
//! composing them are tested on machines without a GPU. Launches are synchronous and
//! deterministic: one cooperative fiber per CUDA thread, the blocks of a grid in contiguous ranges
//! on rayon's threads (or all on the caller's, [`SimRuntime::serial`]); a block's threads run
//! from the first or from the last ([`ThreadOrder`]), which exposes missing barriers.
//!
//! cuBLAS is not simulated: [`Runtime::gemm_bf16`] is a plain CPU loop with f32 accumulation.
//! See docs/cuda.md ("CPU simulator") for what a passing simulator test does and does not prove.

mod buf;
pub mod ffi;

use std::ffi::c_void;

use rayon::prelude::*;

pub use buf::SimBuf;

use crate::cuda::CudaError;
use crate::gpu::{self, DevBuf, Dims, Elem, KArg, Kernels, Runtime};

/// Every kernel on the simulator.
pub type SimGpu = Kernels<SimRuntime>;
pub type SimDevPacked = gpu::DevPacked<SimRuntime>;
pub type SimDevGrouped = gpu::DevGrouped<SimRuntime>;
pub type SimDevMxfp4 = gpu::DevMxfp4<SimRuntime>;
pub type SimKvPool = gpu::kv_pool::DeviceKvPool<SimRuntime>;

fn sim_err(what: &'static str, msg: String) -> CudaError {
    CudaError::Driver { what, msg }
}

/// The order in which a block's simulated threads run between barriers. Fibers switch only at
/// barriers and warp collectives, so a read of another thread's write with no barrier between
/// them (a race on a GPU) sees the write when the writer runs first and misses it otherwise: a
/// kernel that passes its comparisons in both orders has no such race on the paths they cover.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ThreadOrder {
    /// Thread 0 first (the usual order).
    Forward,
    /// The last thread first.
    Reverse,
}

impl ThreadOrder {
    /// `WASMSERVE_SIM_ORDER=reverse` (CI runs the kernel comparisons once more with it), else
    /// forward.
    pub fn from_env() -> Self {
        match std::env::var("WASMSERVE_SIM_ORDER").as_deref() {
            Ok("reverse") => Self::Reverse,
            _ => Self::Forward,
        }
    }
}

#[derive(Debug)]
pub struct SimRuntime {
    parallel: bool,
    order: ThreadOrder,
    /// What [`Runtime::bf16_mma`] answers (the simulator emulates the MMAs either way).
    bf16_mma: bool,
}

impl SimRuntime {
    /// Blocks of a grid run on rayon's threads, a contiguous range each (CUDA guarantees no order
    /// between blocks, so results are the same as [`Self::serial`]'s for any kernel without
    /// cross-block races). Fails (with the reason) only when the simulator library was not built.
    pub fn new() -> Result<Self, CudaError> {
        Self::with_parallel(true)
    }
    /// Every block on the calling thread, in order.
    pub fn serial() -> Result<Self, CudaError> {
        Self::with_parallel(false)
    }
    fn with_parallel(parallel: bool) -> Result<Self, CudaError> {
        if !ffi::BUILT {
            return Err(sim_err("simulator", ffi::NOT_BUILT.to_string()));
        }
        Ok(Self { parallel, order: ThreadOrder::from_env(), bf16_mma: true })
    }
    /// The same runtime posing as a GPU without bf16 tensor cores (before sm_80): callers then
    /// choose the kernels that do without them, as they would there (e.g. to check the rest of
    /// a forward at f32 precision).
    pub fn without_bf16_mma(self) -> Self {
        Self { bf16_mma: false, ..self }
    }
    /// The same runtime with the threads of each block run in `order` between barriers.
    pub fn with_order(self, order: ThreadOrder) -> Self {
        Self { order, ..self }
    }
}

/// The packed argument pointers, shared read-only by the threads running ranges of one grid.
struct ArgPtrs(Vec<*mut c_void>);
// SAFETY: the pointers are only read (by the kernels' argument unpacking) while the launch runs.
unsafe impl Sync for ArgPtrs {}

impl ArgPtrs {
    fn get(&self) -> &[*mut c_void] {
        &self.0
    }
}

impl SimGpu {
    /// The launch wrappers on the simulator.
    pub fn sim() -> Result<Self, CudaError> {
        Ok(Kernels::new(SimRuntime::new()?))
    }
}

/// One packed argument: its value lives here, `args[i]` points at it.
#[repr(C, align(8))]
#[derive(Clone, Copy)]
struct Slot([u8; 8]);

impl Runtime for SimRuntime {
    type Buf<T: Elem> = SimBuf<T>;

    fn describe(&self) -> String {
        "CPU simulator".into()
    }
    fn upload<T: Elem>(&self, host: &[T]) -> Result<SimBuf<T>, CudaError> {
        SimBuf::from_slice(host).ok_or_else(|| {
            sim_err("simulated device memory", format!("out of memory for {} bytes", std::mem::size_of_val(host)))
        })
    }
    fn download<T: Elem>(&self, buf: &SimBuf<T>) -> Result<Vec<T>, CudaError> {
        Ok(buf.to_vec())
    }
    fn zeros<T: Elem>(&self, n: usize) -> Result<SimBuf<T>, CudaError> {
        self.upload(&vec![T::default(); n.max(1)])
    }
    fn write<T: Elem>(&self, buf: &mut SimBuf<T>, offset: usize, host: &[T]) -> Result<(), CudaError> {
        gpu::kernels::check(offset.checked_add(host.len()).is_some_and(|end| end <= buf.len()), || {
            format!("write of {} at {offset} into {}", host.len(), buf.len())
        })?;
        buf.write(offset, host);
        Ok(())
    }
    fn synchronize(&self) -> Result<(), CudaError> {
        Ok(())
    }

    unsafe fn launch(&self, kernel: &'static str, dims: Dims, args: &[KArg<'_, Self>]) -> Result<(), CudaError> {
        let mut slots = vec![Slot([0; 8]); args.len()];
        let mut kinds = String::with_capacity(args.len());
        for (slot, a) in slots.iter_mut().zip(args) {
            let p = slot.0.as_mut_ptr();
            // SAFETY: each slot is 8 bytes, aligned to 8: room for any of these values.
            unsafe {
                match a {
                    KArg::F32s(b) => (p as *mut *mut c_void).write(b.ptr() as *mut c_void),
                    KArg::I32s(b) => (p as *mut *mut c_void).write(b.ptr() as *mut c_void),
                    KArg::U8s(b) => (p as *mut *mut c_void).write(b.ptr() as *mut c_void),
                    KArg::U16s(b) => (p as *mut *mut c_void).write(b.ptr() as *mut c_void),
                    KArg::I32(v) => (p as *mut i32).write(*v),
                    KArg::I64(v) => (p as *mut i64).write(*v),
                    KArg::F32(v) => (p as *mut f32).write(*v),
                }
            }
            kinds.push(match a {
                KArg::F32s(_) | KArg::I32s(_) | KArg::U8s(_) | KArg::U16s(_) => 'p',
                KArg::I32(_) => 'i',
                KArg::I64(_) => 'l',
                KArg::F32(_) => 'f',
            });
        }
        let ptrs = ArgPtrs(slots.iter_mut().map(|s| s.0.as_mut_ptr() as *mut c_void).collect());
        let (g, b) = (dims.grid, dims.block);
        let (grid, block) = ([g.0, g.1, g.2], [b.0, b.1, b.2]);
        let total = g.0 as u64 * g.1 as u64 * g.2 as u64;
        let threads = if self.parallel { rayon::current_num_threads() as u64 } else { 1 };
        tracing::trace!(kernel, ?grid, ?block, threads, "simulated launch");
        // SAFETY: the caller guarantees buffer sizes (see `Runtime::launch`); the argument kinds
        // are checked against the kernel's signature on the C side; blocks of one grid do not
        // race under CUDA's rules, which the kernels follow.
        let run = |r: std::ops::Range<u64>| unsafe {
            ffi::launch(
                kernel,
                grid,
                block,
                dims.shared_mem_bytes,
                ptrs.get(),
                &kinds,
                r,
                self.order == ThreadOrder::Reverse,
            )
        };
        let result = if threads > 1 && total > 1 {
            // A few ranges per thread so uneven blocks (attention over different lengths) balance.
            let chunk = total.div_ceil(threads * 4).max(1);
            let ranges: Vec<_> = (0..total.div_ceil(chunk)).map(|i| i * chunk..((i + 1) * chunk).min(total)).collect();
            let results: Vec<Result<(), String>> = ranges.into_par_iter().map(run).collect();
            results.into_iter().collect::<Result<(), String>>()
        } else {
            run(0..total.max(1))
        };
        result.map_err(|m| sim_err("simulator", m))?;
        for (i, a) in args.iter().enumerate() {
            let intact = match a {
                KArg::F32s(b) => b.guards_intact(),
                KArg::I32s(b) => b.guards_intact(),
                KArg::U8s(b) => b.guards_intact(),
                KArg::U16s(b) => b.guards_intact(),
                _ => true,
            };
            if !intact {
                return Err(sim_err(
                    "simulator",
                    format!("{kernel}: argument {i} was written out of bounds (the padding around it changed)"),
                ));
            }
        }
        Ok(())
    }

    /// Not cuBLAS: `out[i, j] = Σ_k x[i, k]·w[j, k]` over the bf16 values in f32, in k order.
    fn bf16_mma(&self) -> bool {
        self.bf16_mma
    }
    fn gemm_bf16(
        &self,
        x: &SimBuf<u16>,
        w: &SimBuf<u16>,
        w_row0: usize,
        out: &mut SimBuf<f32>,
        n: usize,
        k: usize,
        m: usize,
    ) -> Result<(), CudaError> {
        gpu::kernels::check(x.len() >= n * k && w.len() >= (w_row0 + m) * k && out.len() >= n * m, || {
            "gemm_bf16: buffer sizes".into()
        })?;
        let widen = |b: u16| f32::from_bits((b as u32) << 16);
        let (xs, ws) = (&x.as_slice()[..n * k], &w.as_slice()[w_row0 * k..(w_row0 + m) * k]);
        let mut res = vec![0.0f32; n * m];
        // One output element per task, each summed in k order: deterministic however rayon splits.
        res.par_iter_mut().enumerate().for_each(|(idx, o)| {
            let (i, j) = (idx / m, idx % m);
            *o = xs[i * k..(i + 1) * k]
                .iter()
                .zip(&ws[j * k..(j + 1) * k])
                .fold(0.0f32, |acc, (&a, &b)| acc + widen(a) * widen(b));
        });
        out.write(0, &res);
        Ok(())
    }
}
