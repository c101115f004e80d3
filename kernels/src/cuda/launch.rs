//! One GPU with every kernel loaded: device buffers, launches and cuBLAS. Callers keep weights
//! and the KV pool in `CudaSlice`s (allocated once, at load time, from the context's memory) and
//! pass them to the launch methods, which check sizes first: a wrong size is an error, never an
//! out-of-bounds access on the device.

use std::collections::HashMap;
use std::sync::Arc;

use cudarc::cublas::{result as blas_result, sys as blas_sys, CudaBlas};
pub use cudarc::driver::CudaSlice;
use cudarc::driver::{CudaContext, CudaFunction, CudaStream, DevicePtr, DevicePtrMut, DeviceRepr, LaunchConfig, PushKernelArg, ValidAsZeroBits};
use cudarc::nvrtc::Ptx;

use super::device::{self, DeviceInfo};
use super::nvrtc::{guarded, PtxCache};
use super::sources::SOURCES;
use super::CudaError;

/// Tokens per launch row-tile in the GEMV kernels (`TOK` in the .cu files).
const TOK: usize = 8;
/// Warps per block in the GEMV kernels (`WARPS` in cubic_gemv.cu).
const GEMV_WARPS: usize = 4;

fn drv<T, E: std::fmt::Debug>(what: &'static str, r: Result<T, E>) -> Result<T, CudaError> {
    r.map_err(|e| CudaError::Driver { what, msg: format!("{e:?}") })
}

fn check(cond: bool, msg: impl FnOnce() -> String) -> Result<(), CudaError> {
    if cond { Ok(()) } else { Err(CudaError::BadArgs(msg())) }
}

/// A packed low-bit matrix on the device (`rows` rows of `stride` bytes plus one padding byte,
/// which the kernels may read when a code straddles the last byte).
pub struct DevPacked {
    pub data: CudaSlice<u8>,
    pub bits: u32,
    pub rows: usize,
    pub cols: usize,
    pub stride: usize,
}

/// Group-quantised weights: INT (`p0` = scale, `p1` = zero) or Cubic (`p0` = s, `p1` = a), one
/// value per (row, group), row-major.
pub struct DevGrouped {
    pub packed: DevPacked,
    pub group_size: usize,
    pub p0: CudaSlice<f32>,
    pub p1: CudaSlice<f32>,
}

pub struct DevMxfp4 {
    pub packed: CudaSlice<u8>,
    pub scales: CudaSlice<u8>,
    pub rows: usize,
    pub cols: usize,
}

/// The paged pool's geometry as the attention kernels see it (see kernels/src/cpu/attention.rs).
pub use crate::cpu::attention::PagedGeometry;


pub struct Gpu {
    pub ctx: Arc<CudaContext>,
    pub stream: Arc<CudaStream>,
    pub info: DeviceInfo,
    funcs: HashMap<&'static str, CudaFunction>,
    blas: CudaBlas,
}

impl Gpu {
    /// Opens device `ordinal`, compiles (or loads from `cache`) every kernel source for its
    /// architecture and loads the modules.
    pub fn new(ordinal: usize, cache: &PtxCache) -> Result<Self, CudaError> {
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
        tracing::info!(device = %info.name, ordinal, arch = info.arch(), kernels = funcs.len(), "CUDA kernels loaded");
        Ok(Self { ctx, stream, info, funcs, blas })
    }

    fn f(&self, name: &str) -> &CudaFunction {
        // Every name used below is in SOURCES; the sources test checks the files define them.
        &self.funcs[name]
    }

    pub fn upload<T: DeviceRepr>(&self, host: &[T]) -> Result<CudaSlice<T>, CudaError> {
        drv("cuMemcpyHtoD", self.stream.clone_htod(host))
    }
    pub fn download<T: DeviceRepr + Default + Clone>(&self, dev: &CudaSlice<T>) -> Result<Vec<T>, CudaError> {
        drv("cuMemcpyDtoH", self.stream.clone_dtoh(dev))
    }
    pub fn zeros<T: DeviceRepr + ValidAsZeroBits>(&self, n: usize) -> Result<CudaSlice<T>, CudaError> {
        drv("cuMemAlloc", self.stream.alloc_zeros(n.max(1)))
    }
    pub fn synchronize(&self) -> Result<(), CudaError> {
        drv("cuStreamSynchronize", self.stream.synchronize())
    }

    /// Uploads a packed matrix given as `rows × stride` bytes (adds the padding byte).
    pub fn upload_packed(&self, bits: u32, rows: usize, cols: usize, stride: usize, bytes: &[u8]) -> Result<DevPacked, CudaError> {
        check((1..=8).contains(&bits), || format!("{bits}-bit codes"))?;
        check(stride >= (cols * bits as usize).div_ceil(8) && bytes.len() == rows * stride, || format!("{} bytes for {rows} rows of stride {stride}", bytes.len()))?;
        let mut padded = Vec::with_capacity(bytes.len() + 4);
        padded.extend_from_slice(bytes);
        padded.resize(bytes.len() + 4, 0);
        Ok(DevPacked { data: self.upload(&padded)?, bits, rows, cols, stride })
    }

    pub fn upload_grouped(&self, packed: DevPacked, group_size: usize, p0: &[f32], p1: &[f32]) -> Result<DevGrouped, CudaError> {
        let n = packed.rows * packed.cols.div_ceil(group_size.max(1));
        check(group_size > 0 && p0.len() == n && p1.len() == n, || format!("{} / {} group parameters for {n} groups", p0.len(), p1.len()))?;
        Ok(DevGrouped { packed, group_size, p0: self.upload(p0)?, p1: self.upload(p1)? })
    }

    /// gridDim.y is capped at 65535 tiles of 8 tokens (524k tokens): far above any batch.
    fn gemv_cfg(rows: usize, n: usize) -> LaunchConfig {
        LaunchConfig { grid_dim: (rows.div_ceil(GEMV_WARPS) as u32, n.div_ceil(TOK) as u32, 1), block_dim: ((GEMV_WARPS * 32) as u32, 1, 1), shared_mem_bytes: 0 }
    }

    fn check_gemv(rows: usize, cols: usize, x: &CudaSlice<f32>, out: &CudaSlice<f32>, n: usize) -> Result<(), CudaError> {
        check(n > 0 && x.len() >= n * cols && out.len() >= n * rows, || format!("gemv: x {} / out {} elements for n={n}, {rows}x{cols}", x.len(), out.len()))
    }

    /// `out[n, rows] = x[n, cols] · Wᵀ` for pack-quantized INT weights (4-bit word fast path when
    /// the layout allows it).
    pub fn int_gemv(&self, w: &DevGrouped, x: &CudaSlice<f32>, out: &mut CudaSlice<f32>, n: usize) -> Result<(), CudaError> {
        let p = &w.packed;
        Self::check_gemv(p.rows, p.cols, x, out, n)?;
        let (stride, rows, cols, gs, n_) = (p.stride as i64, p.rows as i32, p.cols as i32, w.group_size as i32, n as i32);
        let fast = p.bits == 4 && p.stride % 4 == 0 && w.group_size % 8 == 0;
        let bits = p.bits as i32;
        let mut b = self.stream.launch_builder(self.f(if fast { "int4_gemv" } else { "int_gemv" }));
        b.arg(&p.data).arg(&stride).arg(&w.p0).arg(&w.p1).arg(x).arg(out).arg(&rows).arg(&cols);
        if !fast {
            b.arg(&bits);
        }
        b.arg(&gs).arg(&n_);
        // SAFETY: argument list matches the kernel signature; sizes checked above.
        drv("int_gemv", unsafe { b.launch(Self::gemv_cfg(p.rows, n)) }).map(|_| ())
    }

    pub fn cubic_gemv(&self, w: &DevGrouped, x: &CudaSlice<f32>, out: &mut CudaSlice<f32>, n: usize) -> Result<(), CudaError> {
        let p = &w.packed;
        Self::check_gemv(p.rows, p.cols, x, out, n)?;
        let (stride, rows, cols, bits, gs, n_) = (p.stride as i64, p.rows as i32, p.cols as i32, p.bits as i32, w.group_size as i32, n as i32);
        let mut b = self.stream.launch_builder(self.f("cubic_gemv"));
        b.arg(&p.data).arg(&stride).arg(&w.p0).arg(&w.p1).arg(x).arg(out).arg(&rows).arg(&cols).arg(&bits).arg(&gs).arg(&n_);
        // SAFETY: as above.
        drv("cubic_gemv", unsafe { b.launch(Self::gemv_cfg(p.rows, n)) }).map(|_| ())
    }

    pub fn upload_mxfp4(&self, rows: usize, cols: usize, packed: &[u8], scales: &[u8]) -> Result<DevMxfp4, CudaError> {
        check(cols % 32 == 0 && packed.len() == rows * cols / 2 && scales.len() == rows * cols / 32, || format!("MXFP4 {rows}x{cols}: {} code bytes, {} scales", packed.len(), scales.len()))?;
        Ok(DevMxfp4 { packed: self.upload(packed)?, scales: self.upload(scales)?, rows, cols })
    }

    pub fn mxfp4_gemv(&self, w: &DevMxfp4, x: &CudaSlice<f32>, out: &mut CudaSlice<f32>, n: usize) -> Result<(), CudaError> {
        Self::check_gemv(w.rows, w.cols, x, out, n)?;
        let (rows, cols, n_) = (w.rows as i32, w.cols as i32, n as i32);
        let mut b = self.stream.launch_builder(self.f("mxfp4_gemv"));
        b.arg(&w.packed).arg(&w.scales).arg(x).arg(out).arg(&rows).arg(&cols).arg(&n_);
        // SAFETY: as above.
        drv("mxfp4_gemv", unsafe { b.launch(Self::gemv_cfg(w.rows, n)) }).map(|_| ())
    }

    fn row_cfg(rows: usize) -> LaunchConfig {
        LaunchConfig { grid_dim: (rows as u32, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 }
    }
    fn flat_cfg(n: usize) -> LaunchConfig {
        LaunchConfig { grid_dim: (n.div_ceil(256).max(1) as u32, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 }
    }

    /// RMSNorm of each `d`-wide row of `x` into `y`.
    pub fn rms_norm(&self, x: &CudaSlice<f32>, w: &CudaSlice<f32>, y: &mut CudaSlice<f32>, rows: usize, eps: f32) -> Result<(), CudaError> {
        let d = w.len();
        check(x.len() >= rows * d && y.len() >= rows * d, || "rms_norm: buffer sizes".into())?;
        let d_ = d as i32;
        let mut b = self.stream.launch_builder(self.f("rms_norm"));
        b.arg(x).arg(w).arg(y).arg(&d_).arg(&eps);
        // SAFETY: as above.
        drv("rms_norm", unsafe { b.launch(Self::row_cfg(rows)) }).map(|_| ())
    }

    /// `x += delta; y = rms_norm(x)`.
    pub fn add_rms_norm(&self, x: &mut CudaSlice<f32>, delta: &CudaSlice<f32>, w: &CudaSlice<f32>, y: &mut CudaSlice<f32>, rows: usize, eps: f32) -> Result<(), CudaError> {
        let d = w.len();
        check(x.len() >= rows * d && delta.len() >= rows * d && y.len() >= rows * d, || "add_rms_norm: buffer sizes".into())?;
        let d_ = d as i32;
        let mut b = self.stream.launch_builder(self.f("add_rms_norm"));
        b.arg(x).arg(delta).arg(w).arg(y).arg(&d_).arg(&eps);
        // SAFETY: as above.
        drv("add_rms_norm", unsafe { b.launch(Self::row_cfg(rows)) }).map(|_| ())
    }

    /// Rotates `x` ([tokens, heads, head_dim]) in place; token t at `positions[t]`.
    pub fn rope(&self, x: &mut CudaSlice<f32>, positions: &CudaSlice<i32>, inv_freq: &CudaSlice<f32>, tokens: usize, heads: usize, head_dim: usize) -> Result<(), CudaError> {
        let rotary = inv_freq.len() * 2;
        check(rotary <= head_dim && x.len() >= tokens * heads * head_dim && positions.len() >= tokens, || "rope: buffer sizes".into())?;
        let (t, h, d, r) = (tokens as i32, heads as i32, head_dim as i32, rotary as i32);
        let mut b = self.stream.launch_builder(self.f("rope_neox"));
        b.arg(x).arg(positions).arg(inv_freq).arg(&t).arg(&h).arg(&d).arg(&r);
        // SAFETY: as above.
        drv("rope_neox", unsafe { b.launch(Self::flat_cfg(tokens * heads * rotary / 2)) }).map(|_| ())
    }

    /// `out[t, :] = silu(gate_up[t, :d]) * gate_up[t, d:]`.
    pub fn silu_mul(&self, gate_up: &CudaSlice<f32>, out: &mut CudaSlice<f32>, tokens: usize, d: usize) -> Result<(), CudaError> {
        check(gate_up.len() >= tokens * 2 * d && out.len() >= tokens * d, || "silu_mul: buffer sizes".into())?;
        let (t, d_) = (tokens as i32, d as i32);
        let mut b = self.stream.launch_builder(self.f("silu_mul"));
        b.arg(gate_up).arg(out).arg(&t).arg(&d_);
        // SAFETY: as above.
        drv("silu_mul", unsafe { b.launch(Self::flat_cfg(tokens * d)) }).map(|_| ())
    }

    fn attn_check(g: &PagedGeometry, q: &CudaSlice<f32>, tables: &CudaSlice<i32>, lens: &CudaSlice<i32>, out: &CudaSlice<f32>) -> Result<usize, CudaError> {
        let seqs = lens.len();
        check(g.head_dim <= 256 && g.kv_heads > 0 && g.heads % g.kv_heads == 0, || format!("attention: {} heads over {} kv heads of {}", g.heads, g.kv_heads, g.head_dim))?;
        check(q.len() >= seqs * g.heads * g.head_dim && out.len() >= seqs * g.heads * g.head_dim && tables.len() >= seqs * g.max_blocks, || "attention: buffer sizes".into())?;
        Ok(seqs)
    }
    fn attn_cfg(g: &PagedGeometry, seqs: usize) -> LaunchConfig {
        LaunchConfig { grid_dim: (seqs as u32, g.heads as u32, 1), block_dim: (128, 1, 1), shared_mem_bytes: 0 }
    }

    /// Decode attention over f32 (`T = f32`) or bf16 (`T = u16`) K/V blocks. The caller
    /// guarantees the block tables and lengths stay inside the pool (the engine's block pool does).
    pub fn paged_attention<T: DeviceRepr>(&self, g: &PagedGeometry, q: &CudaSlice<f32>, k: &CudaSlice<T>, v: &CudaSlice<T>, tables: &CudaSlice<i32>, lens: &CudaSlice<i32>, scale: f32, out: &mut CudaSlice<f32>) -> Result<(), CudaError> {
        let seqs = Self::attn_check(g, q, tables, lens, out)?;
        let name = match std::mem::size_of::<T>() {
            4 => "paged_attention_f32",
            2 => "paged_attention_bf16",
            s => return Err(CudaError::BadArgs(format!("attention over {s}-byte elements"))),
        };
        let (h, kvh, d, bs, mb) = (g.heads as i32, g.kv_heads as i32, g.head_dim as i32, g.block_size as i32, g.max_blocks as i32);
        let mut b = self.stream.launch_builder(self.f(name));
        b.arg(q).arg(k).arg(v).arg(tables).arg(lens).arg(out).arg(&h).arg(&kvh).arg(&d).arg(&bs).arg(&mb).arg(&scale);
        // SAFETY: as above.
        drv(name, unsafe { b.launch(Self::attn_cfg(g, seqs)) }).map(|_| ())
    }

    #[allow(clippy::too_many_arguments)]
    pub fn paged_attention_fp8(&self, g: &PagedGeometry, q: &CudaSlice<f32>, k: &CudaSlice<u8>, v: &CudaSlice<u8>, k_scales: &CudaSlice<f32>, v_scales: &CudaSlice<f32>, tables: &CudaSlice<i32>, lens: &CudaSlice<i32>, scale: f32, out: &mut CudaSlice<f32>) -> Result<(), CudaError> {
        let seqs = Self::attn_check(g, q, tables, lens, out)?;
        let (h, kvh, d, bs, mb) = (g.heads as i32, g.kv_heads as i32, g.head_dim as i32, g.block_size as i32, g.max_blocks as i32);
        let mut b = self.stream.launch_builder(self.f("paged_attention_fp8"));
        b.arg(q).arg(k).arg(v).arg(k_scales).arg(v_scales).arg(tables).arg(lens).arg(out).arg(&h).arg(&kvh).arg(&d).arg(&bs).arg(&mb).arg(&scale);
        // SAFETY: as above.
        drv("paged_attention_fp8", unsafe { b.launch(Self::attn_cfg(g, seqs)) }).map(|_| ())
    }

    /// One token per row of `logits` ([seqs, vocab]); `u` holds one uniform draw per row.
    #[allow(clippy::too_many_arguments)]
    pub fn sample(&self, logits: &CudaSlice<f32>, probs: &mut CudaSlice<f32>, u: &CudaSlice<f32>, out: &mut CudaSlice<i32>, vocab: usize, temperature: f32, top_k: usize, top_p: f32) -> Result<(), CudaError> {
        let seqs = u.len();
        check(temperature > 0.0 && logits.len() >= seqs * vocab && probs.len() >= seqs * vocab && out.len() >= seqs, || "sample: buffer sizes or temperature".into())?;
        let (v, k) = (vocab as i32, top_k as i32);
        let mut b = self.stream.launch_builder(self.f("sample_top_k_top_p"));
        b.arg(logits).arg(probs).arg(u).arg(out).arg(&v).arg(&temperature).arg(&k).arg(&top_p);
        let cfg = LaunchConfig { grid_dim: (seqs as u32, 1, 1), block_dim: (1024, 1, 1), shared_mem_bytes: 0 };
        // SAFETY: as above.
        drv("sample_top_k_top_p", unsafe { b.launch(cfg) }).map(|_| ())
    }

    /// Groups `experts` (assignment → expert id, all in range: the router guarantees it) by expert;
    /// returns `(offsets [num_experts + 1], order [assignments])` on the device.
    pub fn moe_group(&self, experts: &CudaSlice<i32>, num_experts: usize) -> Result<(CudaSlice<i32>, CudaSlice<i32>), CudaError> {
        let a = experts.len() as i32;
        let mut counts = self.zeros::<i32>(num_experts)?;
        let mut offsets = self.zeros::<i32>(num_experts + 1)?;
        let mut order = self.zeros::<i32>(experts.len())?;
        let ne = num_experts as i32;
        let mut b = self.stream.launch_builder(self.f("moe_count"));
        b.arg(experts).arg(&a).arg(&mut counts);
        // SAFETY: as above.
        drv("moe_count", unsafe { b.launch(Self::flat_cfg(experts.len())) })?;
        let mut b = self.stream.launch_builder(self.f("moe_offsets"));
        b.arg(&counts).arg(&ne).arg(&mut offsets);
        // SAFETY: as above.
        drv("moe_offsets", unsafe { b.launch(LaunchConfig { grid_dim: (1, 1, 1), block_dim: (32, 1, 1), shared_mem_bytes: 0 }) })?;
        let mut b = self.stream.launch_builder(self.f("moe_scatter"));
        b.arg(experts).arg(&a).arg(&offsets).arg(&mut order);
        // SAFETY: as above.
        drv("moe_scatter", unsafe { b.launch(LaunchConfig { grid_dim: (num_experts as u32, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 }) })?;
        Ok((offsets, order))
    }

    /// `out[a, :] = W[experts[a]] · x[a / k]` in grouped order (bf16 weights [experts, rows, cols]).
    #[allow(clippy::too_many_arguments)]
    pub fn moe_expert_gemv_bf16(&self, weights: &CudaSlice<u16>, x: &CudaSlice<f32>, experts: &CudaSlice<i32>, order: &CudaSlice<i32>, out: &mut CudaSlice<f32>, rows: usize, cols: usize, k: usize) -> Result<(), CudaError> {
        let a = experts.len();
        check(k > 0 && a % k == 0 && order.len() == a && x.len() >= a / k * cols && out.len() >= a * rows, || "moe_expert_gemv: buffer sizes".into())?;
        // One grid row per assignment: CUDA caps gridDim.y at 65535 (callers chunk larger batches).
        check(a <= 65535, || format!("moe_expert_gemv: {a} assignments in one launch (at most 65535)"))?;
        let (r, c, k_) = (rows as i32, cols as i32, k as i32);
        let mut b = self.stream.launch_builder(self.f("moe_expert_gemv_bf16"));
        b.arg(weights).arg(x).arg(experts).arg(order).arg(out).arg(&r).arg(&c).arg(&k_);
        let cfg = LaunchConfig { grid_dim: (rows.div_ceil(GEMV_WARPS) as u32, a as u32, 1), block_dim: ((GEMV_WARPS * 32) as u32, 1, 1), shared_mem_bytes: 0 };
        // SAFETY: as above.
        drv("moe_expert_gemv_bf16", unsafe { b.launch(cfg) }).map(|_| ())
    }

    /// Dense bf16 GEMM on cuBLAS: `out[n, m] (f32) = x[n, k] (bf16) · W[m, k]ᵀ (bf16)`, f32
    /// accumulation. Row-major W[m, k] is column-major Wᵀ, so cuBLAS computes outᵀ = W · xᵀ with
    /// op(A) = Aᵀ on the stored W.
    pub fn gemm_bf16(&self, x: &CudaSlice<u16>, w: &CudaSlice<u16>, out: &mut CudaSlice<f32>, n: usize, k: usize, m: usize) -> Result<(), CudaError> {
        check(x.len() >= n * k && w.len() >= m * k && out.len() >= n * m, || "gemm_bf16: buffer sizes".into())?;
        let (alpha, beta) = (1.0f32, 0.0f32);
        let (xp, _gx) = x.device_ptr(&self.stream);
        let (wp, _gw) = w.device_ptr(&self.stream);
        let (op, _go) = out.device_ptr_mut(&self.stream);
        // SAFETY: pointers are live device buffers of the checked sizes on this stream.
        let r = unsafe {
            blas_result::gemm_ex(
                *self.blas.handle(),
                blas_sys::cublasOperation_t::CUBLAS_OP_T,
                blas_sys::cublasOperation_t::CUBLAS_OP_N,
                m as i32, n as i32, k as i32,
                &alpha as *const f32 as *const _,
                wp as *const _, blas_sys::cudaDataType_t::CUDA_R_16BF, k as i32,
                xp as *const _, blas_sys::cudaDataType_t::CUDA_R_16BF, k as i32,
                &beta as *const f32 as *const _,
                op as *mut _, blas_sys::cudaDataType_t::CUDA_R_32F, m as i32,
                blas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                blas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        };
        drv("cublasGemmEx", r)
    }
}
