//! Every kernel's launch wrapper, written once over any [`Runtime`]: sizes are checked first (a
//! wrong size is an error, never an out-of-bounds access on the device), then the grid and the
//! argument list the `.cu` signature expects are built. Callers keep weights and the KV pool in
//! runtime buffers allocated once, at load time.

use std::ops::{Deref, Range};

use super::runtime::{DevBuf, Dims, Elem, KArg, Runtime};
use crate::cuda::CudaError;

pub use crate::cpu::attention::PagedGeometry;

/// Tokens per launch row-tile in the GEMV kernels (`TOK` in cuda/prelude.cuh).
pub const TOK: usize = 8;
/// Warps per block in the GEMV kernels (`WARPS` in cubic_gemv.cu).
pub const GEMV_WARPS: usize = 4;

pub(crate) fn check(cond: bool, msg: impl FnOnce() -> String) -> Result<(), CudaError> {
    if cond {
        Ok(())
    } else {
        Err(CudaError::BadArgs(msg()))
    }
}

/// A packed low-bit matrix on the device (`rows` rows of `stride` bytes plus padding bytes,
/// which the kernels may read when a code straddles the last byte).
pub struct DevPacked<R: Runtime> {
    pub data: R::Buf<u8>,
    pub bits: u32,
    pub rows: usize,
    pub cols: usize,
    pub stride: usize,
}

/// Group-quantised weights: INT (`p0` = scale, `p1` = zero) or Cubic (`p0` = s, `p1` = a), one
/// value per (row, group), row-major.
pub struct DevGrouped<R: Runtime> {
    pub packed: DevPacked<R>,
    pub group_size: usize,
    pub p0: R::Buf<f32>,
    pub p1: R::Buf<f32>,
}

pub struct DevMxfp4<R: Runtime> {
    pub packed: R::Buf<u8>,
    pub scales: R::Buf<u8>,
    pub rows: usize,
    pub cols: usize,
}

/// Above this many tokens [`Kernels::matmul_quant`] dequantises the weight to bf16 and runs the
/// dense tensor-core GEMM; at or below it the GEMV kernels run.
///
/// Why 32 (an estimate until `examples/gpu_bench.rs` measures it): the GEMV re-reads the packed
/// weight once per 8-token tile and multiplies on the f32 CUDA cores, so its cost grows linearly
/// with the batch; the dequant path costs a fixed write and read of 2 bf16 bytes per weight
/// (8 passes over an INT4 weight, 4 over INT8) plus a tensor-core GEMM that is nearly flat in
/// the batch at these sizes. On bandwidth alone that breaks even near 32–64 tokens; the GEMV's
/// f32 FMA work (8 FMAs per decoded weight per tile) pulls the crossing lower.
pub const GEMM_MIN_TOKENS: usize = 32;

/// A packed weight of any quantized format, for the format-independent matmul entry points.
pub enum QuantWeight<'a, R: Runtime> {
    /// Pack-quantized INT (`p0` = scale, `p1` = zero).
    Int(&'a DevGrouped<R>),
    /// Cubic codebook (`p0` = s, `p1` = a).
    Cubic(&'a DevGrouped<R>),
    Mxfp4(&'a DevMxfp4<R>),
}

// By hand: a derive would demand `R: Clone`, but only references are copied.
impl<R: Runtime> Clone for QuantWeight<'_, R> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<R: Runtime> Copy for QuantWeight<'_, R> {}

impl<R: Runtime> QuantWeight<'_, R> {
    pub fn rows(&self) -> usize {
        match self {
            QuantWeight::Int(w) | QuantWeight::Cubic(w) => w.packed.rows,
            QuantWeight::Mxfp4(w) => w.rows,
        }
    }
    pub fn cols(&self) -> usize {
        match self {
            QuantWeight::Int(w) | QuantWeight::Cubic(w) => w.packed.cols,
            QuantWeight::Mxfp4(w) => w.cols,
        }
    }
}

/// Which kernels a [`Kernels::matmul_quant`] call ran.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MatmulPath {
    Gemv,
    DequantGemm,
}

/// Caller-owned bf16 scratch for the prefill GEMM path, allocated once (e.g. for the largest
/// weight and the largest prefill chunk) and reused by every layer: the dequantised weight
/// `[rows, cols]` and the narrowed activations `[n, cols]`.
pub struct GemmScratch<R: Runtime> {
    pub weight: R::Buf<u16>,
    pub x: R::Buf<u16>,
}

/// A runtime with the kernel launch wrappers on top. Derefs to the runtime (its device info,
/// stream, ...).
pub struct Kernels<R: Runtime> {
    pub rt: R,
}

impl<R: Runtime> Deref for Kernels<R> {
    type Target = R;
    fn deref(&self) -> &R {
        &self.rt
    }
}

type A<'a, R> = KArg<'a, R>;

impl<R: Runtime> Kernels<R> {
    pub fn new(rt: R) -> Self {
        Self { rt }
    }

    pub fn upload<T: Elem>(&self, host: &[T]) -> Result<R::Buf<T>, CudaError> {
        self.rt.upload(host)
    }
    pub fn download<T: Elem>(&self, dev: &R::Buf<T>) -> Result<Vec<T>, CudaError> {
        self.rt.download(dev)
    }
    pub fn zeros<T: Elem>(&self, n: usize) -> Result<R::Buf<T>, CudaError> {
        self.rt.zeros(n.max(1))
    }
    pub fn synchronize(&self) -> Result<(), CudaError> {
        self.rt.synchronize()
    }

    /// Launch through the runtime; the wrappers (here and in the sibling modules that add
    /// `impl Kernels` blocks) have checked sizes.
    pub(crate) fn go(&self, kernel: &'static str, dims: Dims, args: &[A<'_, R>]) -> Result<(), CudaError> {
        // SAFETY: every caller builds `args` in the order and types of the kernel's signature
        // and has checked the buffers against the sizes the kernel touches at `dims`.
        unsafe { self.rt.launch(kernel, dims, args) }
    }

    /// Uploads a packed matrix given as `rows × stride` bytes (adds the padding bytes).
    pub fn upload_packed(
        &self,
        bits: u32,
        rows: usize,
        cols: usize,
        stride: usize,
        bytes: &[u8],
    ) -> Result<DevPacked<R>, CudaError> {
        check((1..=8).contains(&bits), || format!("{bits}-bit codes"))?;
        check(stride >= (cols * bits as usize).div_ceil(8) && bytes.len() == rows * stride, || {
            format!("{} bytes for {rows} rows of stride {stride}", bytes.len())
        })?;
        let mut padded = Vec::with_capacity(bytes.len() + 4);
        padded.extend_from_slice(bytes);
        padded.resize(bytes.len() + 4, 0);
        Ok(DevPacked { data: self.upload(&padded)?, bits, rows, cols, stride })
    }

    pub fn upload_grouped(
        &self,
        packed: DevPacked<R>,
        group_size: usize,
        p0: &[f32],
        p1: &[f32],
    ) -> Result<DevGrouped<R>, CudaError> {
        let n = packed.rows * packed.cols.div_ceil(group_size.max(1));
        check(group_size > 0 && p0.len() == n && p1.len() == n, || {
            format!("{} / {} group parameters for {n} groups", p0.len(), p1.len())
        })?;
        Ok(DevGrouped { packed, group_size, p0: self.upload(p0)?, p1: self.upload(p1)? })
    }

    pub fn upload_mxfp4(
        &self,
        rows: usize,
        cols: usize,
        packed: &[u8],
        scales: &[u8],
    ) -> Result<DevMxfp4<R>, CudaError> {
        check(cols.is_multiple_of(32) && packed.len() == rows * cols / 2 && scales.len() == rows * cols / 32, || {
            format!("MXFP4 {rows}x{cols}: {} code bytes, {} scales", packed.len(), scales.len())
        })?;
        Ok(DevMxfp4 { packed: self.upload(packed)?, scales: self.upload(scales)?, rows, cols })
    }

    /// gridDim.y is capped at 65535 tiles of 8 tokens (524k tokens): far above any batch.
    pub fn gemv_dims(rows: usize, n: usize) -> Dims {
        Dims::new((rows.div_ceil(GEMV_WARPS) as u32, n.div_ceil(TOK) as u32, 1), (GEMV_WARPS * 32) as u32)
    }

    pub(crate) fn check_gemv(
        rows: usize,
        cols: usize,
        x: &R::Buf<f32>,
        out: &R::Buf<f32>,
        n: usize,
    ) -> Result<(), CudaError> {
        check(n > 0 && x.len() >= n * cols && out.len() >= n * rows, || {
            format!("gemv: x {} / out {} elements for n={n}, {rows}x{cols}", x.len(), out.len())
        })
    }

    /// Whether INT weights take the 4-bit word kernels (`int4_gemv`, `moe_int4_gemv`): each lane
    /// reads whole 32-bit words, so rows must start on a word and groups hold whole words.
    pub(crate) fn int4_fast_path(w: &DevGrouped<R>) -> bool {
        w.packed.bits == 4 && w.packed.stride.is_multiple_of(4) && w.group_size.is_multiple_of(8)
    }

    /// `out[n, rows] = x[n, cols] · Wᵀ` for pack-quantized INT weights (4-bit word fast path when
    /// the layout allows it).
    pub fn int_gemv(
        &self,
        w: &DevGrouped<R>,
        x: &R::Buf<f32>,
        out: &mut R::Buf<f32>,
        n: usize,
    ) -> Result<(), CudaError> {
        let p = &w.packed;
        Self::check_gemv(p.rows, p.cols, x, out, n)?;
        let fast = Self::int4_fast_path(w);
        let mut args = vec![
            A::U8s(&p.data),
            A::I64(p.stride as i64),
            A::F32s(&w.p0),
            A::F32s(&w.p1),
            A::F32s(x),
            A::F32s(out),
            A::I32(p.rows as i32),
            A::I32(p.cols as i32),
        ];
        if !fast {
            args.push(A::I32(p.bits as i32));
        }
        args.extend([A::I32(w.group_size as i32), A::I32(n as i32)]);
        self.go(if fast { "int4_gemv" } else { "int_gemv" }, Self::gemv_dims(p.rows, n), &args)
    }

    pub fn cubic_gemv(
        &self,
        w: &DevGrouped<R>,
        x: &R::Buf<f32>,
        out: &mut R::Buf<f32>,
        n: usize,
    ) -> Result<(), CudaError> {
        let p = &w.packed;
        Self::check_gemv(p.rows, p.cols, x, out, n)?;
        let args = [
            A::U8s(&p.data),
            A::I64(p.stride as i64),
            A::F32s(&w.p0),
            A::F32s(&w.p1),
            A::F32s(x),
            A::F32s(out),
            A::I32(p.rows as i32),
            A::I32(p.cols as i32),
            A::I32(p.bits as i32),
            A::I32(w.group_size as i32),
            A::I32(n as i32),
        ];
        self.go("cubic_gemv", Self::gemv_dims(p.rows, n), &args)
    }

    pub fn mxfp4_gemv(
        &self,
        w: &DevMxfp4<R>,
        x: &R::Buf<f32>,
        out: &mut R::Buf<f32>,
        n: usize,
    ) -> Result<(), CudaError> {
        Self::check_gemv(w.rows, w.cols, x, out, n)?;
        let args = [
            A::U8s(&w.packed),
            A::U8s(&w.scales),
            A::F32s(x),
            A::F32s(out),
            A::I32(w.rows as i32),
            A::I32(w.cols as i32),
            A::I32(n as i32),
        ];
        self.go("mxfp4_gemv", Self::gemv_dims(w.rows, n), &args)
    }

    /// `out[n, rows] = x[n, cols] · Wᵀ` for any quantized format: the GEMV for
    /// `n <= GEMM_MIN_TOKENS`, else dequantise into `scratch` and run the bf16 GEMM (see
    /// [`GEMM_MIN_TOKENS`]). The GEMM path narrows the activations to bf16 (the GEMV keeps f32).
    pub fn matmul_quant(
        &self,
        w: QuantWeight<'_, R>,
        x: &R::Buf<f32>,
        out: &mut R::Buf<f32>,
        n: usize,
        scratch: &mut GemmScratch<R>,
    ) -> Result<MatmulPath, CudaError> {
        if n <= GEMM_MIN_TOKENS {
            self.quant_gemv(w, x, out, n)?;
            Ok(MatmulPath::Gemv)
        } else {
            self.quant_gemm(w, x, out, n, scratch)?;
            Ok(MatmulPath::DequantGemm)
        }
    }

    /// The GEMV kernel of `w`'s format, whatever the batch.
    pub fn quant_gemv(
        &self,
        w: QuantWeight<'_, R>,
        x: &R::Buf<f32>,
        out: &mut R::Buf<f32>,
        n: usize,
    ) -> Result<(), CudaError> {
        match w {
            QuantWeight::Int(w) => self.int_gemv(w, x, out, n),
            QuantWeight::Cubic(w) => self.cubic_gemv(w, x, out, n),
            QuantWeight::Mxfp4(w) => self.mxfp4_gemv(w, x, out, n),
        }
    }

    /// The prefill path whatever the batch: dequantise `w` into `scratch.weight`, narrow `x` into
    /// `scratch.x`, then the dense bf16 GEMM with f32 accumulation.
    pub fn quant_gemm(
        &self,
        w: QuantWeight<'_, R>,
        x: &R::Buf<f32>,
        out: &mut R::Buf<f32>,
        n: usize,
        scratch: &mut GemmScratch<R>,
    ) -> Result<(), CudaError> {
        let (rows, cols) = (w.rows(), w.cols());
        Self::check_gemv(rows, cols, x, out, n)?;
        check(scratch.x.len() >= n * cols, || {
            format!("gemm scratch: {} bf16 activations, need {n} x {cols}", scratch.x.len())
        })?;
        // The weight scratch is checked by `dequant_bf16`, before anything is launched.
        self.dequant_bf16(w, &mut scratch.weight)?;
        self.f32_to_bf16_rows(x, &mut scratch.x, n * cols)?;
        self.gemm_bf16(&scratch.x, &scratch.weight, out, n, cols, rows)
    }

    /// Scratch for [`Self::matmul_quant`] over weights of up to `max_weight` elements and
    /// activations of up to `max_x` elements (tokens × cols).
    pub fn gemm_scratch(&self, max_weight: usize, max_x: usize) -> Result<GemmScratch<R>, CudaError> {
        Ok(GemmScratch { weight: self.zeros(max_weight)?, x: self.zeros(max_x)? })
    }

    /// One thread per element over a flat index; errors when the grid would not fit gridDim.x.
    pub(crate) fn elementwise_dims(what: &str, count: usize) -> Result<Dims, CudaError> {
        check(count.div_ceil(256) <= i32::MAX as usize, || {
            format!("{what}: {count} elements exceed one launch's grid")
        })?;
        Ok(Self::flat_dims(count))
    }

    pub(crate) fn check_grouped(what: &str, w: &DevGrouped<R>) -> Result<(), CudaError> {
        let p = &w.packed;
        let groups = if w.group_size == 0 { 0 } else { p.rows * p.cols.div_ceil(w.group_size) };
        check((1..=8).contains(&p.bits) && w.group_size > 0, || {
            format!("{what}: {}-bit codes, group size {}", p.bits, w.group_size)
        })?;
        // code_at reads the byte after a code's first byte: the upload pads the buffer for it.
        check(p.stride >= (p.cols * p.bits as usize).div_ceil(8) && p.data.len() > p.rows * p.stride, || {
            format!("{what}: {} packed bytes for {} rows of stride {}", p.data.len(), p.rows, p.stride)
        })?;
        check(w.p0.len() >= groups && w.p1.len() >= groups, || {
            format!("{what}: {} / {} group parameters for {groups} groups", w.p0.len(), w.p1.len())
        })
    }

    /// Expands `w` to bf16 bit patterns in `out[..rows * cols]` (row-major `[rows, cols]`); the
    /// values are the format's dequantised weights rounded to nearest even.
    pub fn dequant_bf16(&self, w: QuantWeight<'_, R>, out: &mut R::Buf<u16>) -> Result<(), CudaError> {
        self.dequant_rows_bf16(w, 0..w.rows(), out)
    }

    /// As [`Self::dequant_bf16`] for rows `rows` of `w` only, into `out[..rows.len() * cols]`
    /// (one expert of an expert-stacked weight).
    pub fn dequant_rows_bf16(
        &self,
        w: QuantWeight<'_, R>,
        rows: Range<usize>,
        out: &mut R::Buf<u16>,
    ) -> Result<(), CudaError> {
        let cols = w.cols();
        check(rows.start <= rows.end && rows.end <= w.rows(), || {
            format!("dequant: rows {rows:?} of a {}-row weight", w.rows())
        })?;
        let (row0, n) = (rows.start, rows.len());
        let count = n * cols;
        check(out.len() >= count, || format!("dequant: scratch holds {} bf16 weights, need {n} x {cols}", out.len()))?;
        // One block per row (gridDim.x); rows and columns are ints in the kernels.
        check(w.rows() <= i32::MAX as usize && cols <= i32::MAX as usize, || {
            format!("dequant: {} x {cols} exceeds 32-bit dimensions", w.rows())
        })?;
        if count == 0 {
            return Ok(()); // nothing to write, and CUDA refuses an empty grid
        }
        let dims = Self::row_dims(n);
        let (row0, n) = (A::I32(row0 as i32), A::I32(n as i32));
        match w {
            QuantWeight::Int(g) | QuantWeight::Cubic(g) => {
                let (name, what) = if matches!(w, QuantWeight::Int(_)) {
                    ("dequant_int_bf16", "dequant INT")
                } else {
                    ("dequant_cubic_bf16", "dequant Cubic")
                };
                Self::check_grouped(what, g)?;
                let p = &g.packed;
                let args = [
                    A::U8s(&p.data),
                    A::I64(p.stride as i64),
                    A::F32s(&g.p0),
                    A::F32s(&g.p1),
                    A::U16s(out),
                    row0,
                    n,
                    A::I32(cols as i32),
                    A::I32(p.bits as i32),
                    A::I32(g.group_size as i32),
                ];
                self.go(name, dims, &args)
            }
            QuantWeight::Mxfp4(m) => {
                let all = m.rows * cols;
                check(cols.is_multiple_of(32) && m.packed.len() >= all / 2 && m.scales.len() >= all / 32, || {
                    format!("dequant MXFP4 {}x{cols}: {} code bytes, {} scales", m.rows, m.packed.len(), m.scales.len())
                })?;
                let args = [A::U8s(&m.packed), A::U8s(&m.scales), A::U16s(out), row0, n, A::I32(cols as i32)];
                self.go("dequant_mxfp4_bf16", dims, &args)
            }
        }
    }

    /// `out[..count] = bf16(x[..count])`, round to nearest even.
    pub fn f32_to_bf16_rows(&self, x: &R::Buf<f32>, out: &mut R::Buf<u16>, count: usize) -> Result<(), CudaError> {
        check(x.len() >= count && out.len() >= count, || {
            format!("f32_to_bf16_rows: {count} elements from {} into {}", x.len(), out.len())
        })?;
        let dims = Self::elementwise_dims("f32_to_bf16_rows", count)?;
        self.go("f32_to_bf16_rows", dims, &[A::F32s(x), A::U16s(out), A::I64(count as i64)])
    }

    pub fn row_dims(rows: usize) -> Dims {
        Dims::new((rows as u32, 1, 1), 256)
    }
    pub fn flat_dims(n: usize) -> Dims {
        Dims::new((n.div_ceil(256).max(1) as u32, 1, 1), 256)
    }

    /// RMSNorm of each `d`-wide row of `x` into `y` (`d` = `w.len()`).
    pub fn rms_norm(
        &self,
        x: &R::Buf<f32>,
        w: &R::Buf<f32>,
        y: &mut R::Buf<f32>,
        rows: usize,
        eps: f32,
    ) -> Result<(), CudaError> {
        let d = w.len();
        check(x.len() >= rows * d && y.len() >= rows * d, || "rms_norm: buffer sizes".into())?;
        self.go("rms_norm", Self::row_dims(rows), &[A::F32s(x), A::F32s(w), A::F32s(y), A::I32(d as i32), A::F32(eps)])
    }

    /// `x += delta; y = rms_norm(x)`.
    pub fn add_rms_norm(
        &self,
        x: &mut R::Buf<f32>,
        delta: &R::Buf<f32>,
        w: &R::Buf<f32>,
        y: &mut R::Buf<f32>,
        rows: usize,
        eps: f32,
    ) -> Result<(), CudaError> {
        let d = w.len();
        check(x.len() >= rows * d && delta.len() >= rows * d && y.len() >= rows * d, || {
            "add_rms_norm: buffer sizes".into()
        })?;
        self.go(
            "add_rms_norm",
            Self::row_dims(rows),
            &[A::F32s(x), A::F32s(delta), A::F32s(w), A::F32s(y), A::I32(d as i32), A::F32(eps)],
        )
    }

    /// Rotates `x` ([tokens, heads, head_dim]) in place; token t at `positions[t]`.
    pub fn rope(
        &self,
        x: &mut R::Buf<f32>,
        positions: &R::Buf<i32>,
        inv_freq: &R::Buf<f32>,
        tokens: usize,
        heads: usize,
        head_dim: usize,
    ) -> Result<(), CudaError> {
        let rotary = inv_freq.len() * 2;
        check(rotary <= head_dim && x.len() >= tokens * heads * head_dim && positions.len() >= tokens, || {
            "rope: buffer sizes".into()
        })?;
        let args = [
            A::F32s(x),
            A::I32s(positions),
            A::F32s(inv_freq),
            A::I32(tokens as i32),
            A::I32(heads as i32),
            A::I32(head_dim as i32),
            A::I32(rotary as i32),
        ];
        self.go("rope_neox", Self::flat_dims(tokens * heads * rotary / 2), &args)
    }

    /// `out[t, :] = silu(gate_up[t, :d]) * gate_up[t, d:]`.
    pub fn silu_mul(
        &self,
        gate_up: &R::Buf<f32>,
        out: &mut R::Buf<f32>,
        tokens: usize,
        d: usize,
    ) -> Result<(), CudaError> {
        check(gate_up.len() >= tokens * 2 * d && out.len() >= tokens * d, || "silu_mul: buffer sizes".into())?;
        self.go(
            "silu_mul",
            Self::flat_dims(tokens * d),
            &[A::F32s(gate_up), A::F32s(out), A::I32(tokens as i32), A::I32(d as i32)],
        )
    }

    pub(crate) fn attn_check(
        g: &PagedGeometry,
        q: &R::Buf<f32>,
        tables: &R::Buf<i32>,
        lens: &R::Buf<i32>,
        out: &R::Buf<f32>,
    ) -> Result<usize, CudaError> {
        let seqs = lens.len();
        check(g.head_dim <= 256 && g.kv_heads > 0 && g.heads.is_multiple_of(g.kv_heads), || {
            format!("attention: {} heads over {} kv heads of {}", g.heads, g.kv_heads, g.head_dim)
        })?;
        check(
            q.len() >= seqs * g.heads * g.head_dim
                && out.len() >= seqs * g.heads * g.head_dim
                && tables.len() >= seqs * g.max_blocks,
            || "attention: buffer sizes".into(),
        )?;
        Ok(seqs)
    }
    pub fn attn_dims(g: &PagedGeometry, seqs: usize) -> Dims {
        Dims::new((seqs as u32, g.heads as u32, 1), 128)
    }

    /// Decode attention over f32 K/V blocks, one query row per entry of `lens`. The caller
    /// guarantees the block tables and lengths stay inside the pool (the engine's block pool does).
    #[allow(clippy::too_many_arguments)]
    pub fn paged_attention_f32(
        &self,
        g: &PagedGeometry,
        q: &R::Buf<f32>,
        k: &R::Buf<f32>,
        v: &R::Buf<f32>,
        tables: &R::Buf<i32>,
        lens: &R::Buf<i32>,
        scale: f32,
        out: &mut R::Buf<f32>,
    ) -> Result<(), CudaError> {
        self.paged_attention_16_32("paged_attention_f32", g, q, A::F32s(k), A::F32s(v), tables, lens, scale, out)
    }

    /// As [`Self::paged_attention_f32`] over bf16 (bit patterns) K/V blocks.
    #[allow(clippy::too_many_arguments)]
    pub fn paged_attention_bf16(
        &self,
        g: &PagedGeometry,
        q: &R::Buf<f32>,
        k: &R::Buf<u16>,
        v: &R::Buf<u16>,
        tables: &R::Buf<i32>,
        lens: &R::Buf<i32>,
        scale: f32,
        out: &mut R::Buf<f32>,
    ) -> Result<(), CudaError> {
        self.paged_attention_16_32("paged_attention_bf16", g, q, A::U16s(k), A::U16s(v), tables, lens, scale, out)
    }

    #[allow(clippy::too_many_arguments)]
    fn paged_attention_16_32(
        &self,
        name: &'static str,
        g: &PagedGeometry,
        q: &R::Buf<f32>,
        k: A<'_, R>,
        v: A<'_, R>,
        tables: &R::Buf<i32>,
        lens: &R::Buf<i32>,
        scale: f32,
        out: &mut R::Buf<f32>,
    ) -> Result<(), CudaError> {
        let seqs = Self::attn_check(g, q, tables, lens, out)?;
        let args = [
            A::F32s(q),
            k,
            v,
            A::I32s(tables),
            A::I32s(lens),
            A::F32s(out),
            A::I32(g.heads as i32),
            A::I32(g.kv_heads as i32),
            A::I32(g.head_dim as i32),
            A::I32(g.block_size as i32),
            A::I32(g.max_blocks as i32),
            A::F32(scale),
        ];
        self.go(name, Self::attn_dims(g, seqs), &args)
    }

    #[allow(clippy::too_many_arguments)]
    pub fn paged_attention_fp8(
        &self,
        g: &PagedGeometry,
        q: &R::Buf<f32>,
        k: &R::Buf<u8>,
        v: &R::Buf<u8>,
        k_scales: &R::Buf<f32>,
        v_scales: &R::Buf<f32>,
        tables: &R::Buf<i32>,
        lens: &R::Buf<i32>,
        scale: f32,
        out: &mut R::Buf<f32>,
    ) -> Result<(), CudaError> {
        let seqs = Self::attn_check(g, q, tables, lens, out)?;
        let args = [
            A::F32s(q),
            A::U8s(k),
            A::U8s(v),
            A::F32s(k_scales),
            A::F32s(v_scales),
            A::I32s(tables),
            A::I32s(lens),
            A::F32s(out),
            A::I32(g.heads as i32),
            A::I32(g.kv_heads as i32),
            A::I32(g.head_dim as i32),
            A::I32(g.block_size as i32),
            A::I32(g.max_blocks as i32),
            A::F32(scale),
        ];
        self.go("paged_attention_fp8", Self::attn_dims(g, seqs), &args)
    }

    /// One token per row of `logits` ([seqs, vocab]); `u` holds one uniform draw per row.
    #[allow(clippy::too_many_arguments)]
    pub fn sample(
        &self,
        logits: &R::Buf<f32>,
        probs: &mut R::Buf<f32>,
        u: &R::Buf<f32>,
        out: &mut R::Buf<i32>,
        vocab: usize,
        temperature: f32,
        top_k: usize,
        top_p: f32,
    ) -> Result<(), CudaError> {
        let seqs = u.len();
        check(
            temperature > 0.0 && logits.len() >= seqs * vocab && probs.len() >= seqs * vocab && out.len() >= seqs,
            || "sample: buffer sizes or temperature".into(),
        )?;
        let args = [
            A::F32s(logits),
            A::F32s(probs),
            A::F32s(u),
            A::I32s(out),
            A::I32(vocab as i32),
            A::F32(temperature),
            A::I32(top_k as i32),
            A::F32(top_p),
        ];
        self.go("sample_top_k_top_p", Dims::new((seqs as u32, 1, 1), 1024), &args)
    }

    /// `out[r] = src[rows[r]]` for `d`-wide f32 rows (embedding lookup, logit-row pick). Row ids
    /// are the caller's (token ids checked against the vocabulary, batch rows in range).
    pub fn gather_rows_f32(
        &self,
        src: &R::Buf<f32>,
        rows: &R::Buf<i32>,
        out: &mut R::Buf<f32>,
        n: usize,
        d: usize,
    ) -> Result<(), CudaError> {
        check(rows.len() >= n && out.len() >= n * d && d > 0 && src.len() % d == 0, || {
            format!("gather_rows: {} ids, out {}, src {} for n={n}, d={d}", rows.len(), out.len(), src.len())
        })?;
        self.go(
            "gather_rows_f32",
            Self::flat_dims(n * d),
            &[A::F32s(src), A::I32s(rows), A::F32s(out), A::I32(n as i32), A::I32(d as i32)],
        )
    }

    /// As [`Self::gather_rows_f32`] from a bf16 table (widened to f32).
    pub fn gather_rows_bf16(
        &self,
        src: &R::Buf<u16>,
        rows: &R::Buf<i32>,
        out: &mut R::Buf<f32>,
        n: usize,
        d: usize,
    ) -> Result<(), CudaError> {
        check(rows.len() >= n && out.len() >= n * d && d > 0 && src.len() % d == 0, || {
            format!("gather_rows_bf16: {} ids, out {}, src {} for n={n}, d={d}", rows.len(), out.len(), src.len())
        })?;
        self.go(
            "gather_rows_bf16",
            Self::flat_dims(n * d),
            &[A::U16s(src), A::I32s(rows), A::F32s(out), A::I32(n as i32), A::I32(d as i32)],
        )
    }

    /// `out[..n] = bf16(x[..n])`, round to nearest even (the bf16 GEMM's activation input).
    pub fn narrow_bf16(&self, x: &R::Buf<f32>, out: &mut R::Buf<u16>, n: usize) -> Result<(), CudaError> {
        check(x.len() >= n && out.len() >= n && n <= i32::MAX as usize, || "narrow_bf16: buffer sizes".into())?;
        self.go("narrow_bf16", Self::flat_dims(n), &[A::F32s(x), A::U16s(out), A::I32(n as i32)])
    }

    fn check_kv_write(
        k: &R::Buf<f32>,
        v: &R::Buf<f32>,
        slots: &R::Buf<i32>,
        n: usize,
        width: usize,
        pool_rows: usize,
    ) -> Result<(), CudaError> {
        check(n > 0 && slots.len() >= n && k.len() >= n * width && v.len() >= n * width && pool_rows > 0, || {
            format!("kv_write: {n} rows of {width} into {pool_rows} pool rows")
        })
    }

    /// Stores `n` rows of keys and values (`width` each) at pool rows `slots` (each below the
    /// pool's rows: the engine's block tables only hold its blocks).
    #[allow(clippy::too_many_arguments)]
    pub fn kv_write_f32(
        &self,
        k: &R::Buf<f32>,
        v: &R::Buf<f32>,
        slots: &R::Buf<i32>,
        kc: &mut R::Buf<f32>,
        vc: &mut R::Buf<f32>,
        n: usize,
        width: usize,
    ) -> Result<(), CudaError> {
        Self::check_kv_write(k, v, slots, n, width, kc.len().min(vc.len()) / width.max(1))?;
        self.go(
            "kv_write_f32",
            Self::flat_dims(n * width),
            &[A::F32s(k), A::F32s(v), A::I32s(slots), A::F32s(kc), A::F32s(vc), A::I32(n as i32), A::I32(width as i32)],
        )
    }

    #[allow(clippy::too_many_arguments)]
    pub fn kv_write_bf16(
        &self,
        k: &R::Buf<f32>,
        v: &R::Buf<f32>,
        slots: &R::Buf<i32>,
        kc: &mut R::Buf<u16>,
        vc: &mut R::Buf<u16>,
        n: usize,
        width: usize,
    ) -> Result<(), CudaError> {
        Self::check_kv_write(k, v, slots, n, width, kc.len().min(vc.len()) / width.max(1))?;
        self.go(
            "kv_write_bf16",
            Self::flat_dims(n * width),
            &[A::F32s(k), A::F32s(v), A::I32s(slots), A::U16s(kc), A::U16s(vc), A::I32(n as i32), A::I32(width as i32)],
        )
    }

    /// FP8 E4M3 with one scale per (pool row, kv head), as the host block pool stores it.
    #[allow(clippy::too_many_arguments)]
    pub fn kv_write_fp8(
        &self,
        k: &R::Buf<f32>,
        v: &R::Buf<f32>,
        slots: &R::Buf<i32>,
        kc: &mut R::Buf<u8>,
        vc: &mut R::Buf<u8>,
        ks: &mut R::Buf<f32>,
        vs: &mut R::Buf<f32>,
        n: usize,
        kv_heads: usize,
        head_dim: usize,
    ) -> Result<(), CudaError> {
        let width = kv_heads * head_dim;
        Self::check_kv_write(k, v, slots, n, width, kc.len().min(vc.len()) / width.max(1))?;
        check(ks.len() * head_dim >= kc.len() && vs.len() * head_dim >= vc.len(), || {
            "kv_write_fp8: scale buffers".into()
        })?;
        let args = [
            A::F32s(k),
            A::F32s(v),
            A::I32s(slots),
            A::U8s(kc),
            A::U8s(vc),
            A::F32s(ks),
            A::F32s(vs),
            A::I32(n as i32),
            A::I32(kv_heads as i32),
            A::I32(head_dim as i32),
        ];
        self.go("kv_write_fp8", Dims::new((n as u32, kv_heads as u32, 2), 128), &args)
    }

    fn check_span(len: usize, src: usize, dst: usize, n: usize) -> Result<(), CudaError> {
        check(src + n <= len && dst + n <= len && (src + n <= dst || dst + n <= src), || {
            format!("copy_span: {n} from {src} to {dst} in {len}")
        })
    }

    /// `buf[dst..dst + n] = buf[src..src + n]` (non-overlapping spans).
    pub fn copy_span_f32(&self, buf: &mut R::Buf<f32>, src: usize, dst: usize, n: usize) -> Result<(), CudaError> {
        Self::check_span(buf.len(), src, dst, n)?;
        self.go(
            "copy_span_f32",
            Self::flat_dims(n),
            &[A::F32s(buf), A::I64(src as i64), A::I64(dst as i64), A::I64(n as i64)],
        )
    }
    pub fn copy_span_u16(&self, buf: &mut R::Buf<u16>, src: usize, dst: usize, n: usize) -> Result<(), CudaError> {
        Self::check_span(buf.len(), src, dst, n)?;
        self.go(
            "copy_span_u16",
            Self::flat_dims(n),
            &[A::U16s(buf), A::I64(src as i64), A::I64(dst as i64), A::I64(n as i64)],
        )
    }
    pub fn copy_span_u8(&self, buf: &mut R::Buf<u8>, src: usize, dst: usize, n: usize) -> Result<(), CudaError> {
        Self::check_span(buf.len(), src, dst, n)?;
        self.go(
            "copy_span_u8",
            Self::flat_dims(n),
            &[A::U8s(buf), A::I64(src as i64), A::I64(dst as i64), A::I64(n as i64)],
        )
    }

    /// Dense bf16 GEMM: `out[n, m] (f32) = x[n, k] (bf16) · W[m, k]ᵀ (bf16)`, f32 accumulation.
    pub fn gemm_bf16(
        &self,
        x: &R::Buf<u16>,
        w: &R::Buf<u16>,
        out: &mut R::Buf<f32>,
        n: usize,
        k: usize,
        m: usize,
    ) -> Result<(), CudaError> {
        check(x.len() >= n * k && w.len() >= m * k && out.len() >= n * m, || "gemm_bf16: buffer sizes".into())?;
        self.rt.gemm_bf16(x, w, 0, out, n, k, m)
    }

    /// As [`Self::gemm_bf16`] with W the rows `rows` of `w` (`[.., k]`): one expert of an
    /// expert-stacked bf16 weight, multiplied in place.
    pub fn gemm_bf16_rows(
        &self,
        x: &R::Buf<u16>,
        w: &R::Buf<u16>,
        rows: Range<usize>,
        out: &mut R::Buf<f32>,
        n: usize,
        k: usize,
    ) -> Result<(), CudaError> {
        let m = rows.len();
        check(rows.start <= rows.end && x.len() >= n * k && w.len() >= rows.end * k && out.len() >= n * m, || {
            format!(
                "gemm_bf16: rows {rows:?} of {} weights, x {} / out {} for n={n}, k={k}",
                w.len(),
                x.len(),
                out.len()
            )
        })?;
        self.rt.gemm_bf16(x, w, rows.start, out, n, k, m)
    }
}

#[cfg(test)]
mod tests {
    //! The path choice and the size checks of the quantized matmul, on a runtime that only records
    //! launches (the kernels' numbers are checked against the CPU references by the simulator and
    //! GPU suites in kernels/tests).
    use std::cell::RefCell;

    use super::*;

    struct Host<T>(Vec<T>);
    impl<T> DevBuf for Host<T> {
        fn len(&self) -> usize {
            self.0.len()
        }
    }

    #[derive(Default)]
    struct Recorder {
        launched: RefCell<Vec<&'static str>>,
        grids: RefCell<Vec<(u32, u32, u32)>>,
    }

    impl Runtime for Recorder {
        type Buf<T: Elem> = Host<T>;
        fn describe(&self) -> String {
            "recorder".into()
        }
        fn upload<T: Elem>(&self, host: &[T]) -> Result<Host<T>, CudaError> {
            Ok(Host(host.to_vec()))
        }
        fn download<T: Elem>(&self, buf: &Host<T>) -> Result<Vec<T>, CudaError> {
            Ok(buf.0.clone())
        }
        fn zeros<T: Elem>(&self, n: usize) -> Result<Host<T>, CudaError> {
            Ok(Host(vec![T::default(); n]))
        }
        fn write<T: Elem>(&self, buf: &mut Host<T>, offset: usize, host: &[T]) -> Result<(), CudaError> {
            buf.0[offset..offset + host.len()].copy_from_slice(host);
            Ok(())
        }
        fn synchronize(&self) -> Result<(), CudaError> {
            Ok(())
        }
        unsafe fn launch(&self, kernel: &'static str, dims: Dims, _args: &[KArg<'_, Self>]) -> Result<(), CudaError> {
            self.launched.borrow_mut().push(kernel);
            self.grids.borrow_mut().push(dims.grid);
            Ok(())
        }
        fn gemm_bf16(
            &self,
            _x: &Host<u16>,
            _w: &Host<u16>,
            _w_row0: usize,
            _out: &mut Host<f32>,
            _n: usize,
            _k: usize,
            _m: usize,
        ) -> Result<(), CudaError> {
            self.launched.borrow_mut().push("gemm_bf16");
            Ok(())
        }
    }

    const ROWS: usize = 40;
    const COLS: usize = 96;

    fn int_weight(k: &Kernels<Recorder>, bits: u32) -> DevGrouped<Recorder> {
        let stride = (COLS * bits as usize).div_ceil(8);
        let packed = k.upload_packed(bits, ROWS, COLS, stride, &vec![0u8; ROWS * stride]).unwrap();
        let groups = ROWS * COLS.div_ceil(32);
        k.upload_grouped(packed, 32, &vec![1.0; groups], &vec![0.0; groups]).unwrap()
    }

    fn run(
        k: &Kernels<Recorder>,
        w: QuantWeight<'_, Recorder>,
        n: usize,
        scratch: &mut GemmScratch<Recorder>,
    ) -> (Result<MatmulPath, CudaError>, Vec<&'static str>) {
        let x = k.zeros::<f32>(n * COLS).unwrap();
        let mut out = k.zeros::<f32>(n * ROWS).unwrap();
        k.rt.launched.borrow_mut().clear();
        let r = k.matmul_quant(w, &x, &mut out, n, scratch);
        (r, k.rt.launched.borrow().clone())
    }

    #[test]
    fn small_batches_run_the_gemv_and_large_ones_dequantise_into_the_gemm() {
        let k = Kernels::new(Recorder::default());
        let mut scratch = k.gemm_scratch(ROWS * COLS, 64 * COLS).unwrap();
        let (w3, w4) = (int_weight(&k, 3), int_weight(&k, 4));
        let mx = k.upload_mxfp4(ROWS, COLS, &vec![0u8; ROWS * COLS / 2], &[127u8; ROWS * COLS / 32]).unwrap();
        let cases = [
            (QuantWeight::Int(&w3), "int_gemv", "dequant_int_bf16"),
            (QuantWeight::Int(&w4), "int4_gemv", "dequant_int_bf16"),
            (QuantWeight::Cubic(&w3), "cubic_gemv", "dequant_cubic_bf16"),
            (QuantWeight::Mxfp4(&mx), "mxfp4_gemv", "dequant_mxfp4_bf16"),
        ];
        for (w, gemv, dequant) in cases {
            for n in [1, GEMM_MIN_TOKENS] {
                let (path, launched) = run(&k, w, n, &mut scratch);
                assert_eq!((path.unwrap(), launched), (MatmulPath::Gemv, vec![gemv]), "n={n}");
            }
            for n in [GEMM_MIN_TOKENS + 1, 64] {
                let (path, launched) = run(&k, w, n, &mut scratch);
                assert_eq!(
                    (path.unwrap(), launched),
                    (MatmulPath::DequantGemm, vec![dequant, "f32_to_bf16_rows", "gemm_bf16"]),
                    "n={n}"
                );
            }
        }
    }

    #[test]
    fn a_short_scratch_or_input_is_an_error_before_any_launch() {
        let k = Kernels::new(Recorder::default());
        let w = int_weight(&k, 4);
        let n = 48;
        let mut small_weight = k.gemm_scratch(ROWS * COLS - 1, n * COLS).unwrap();
        let (r, launched) = run(&k, QuantWeight::Int(&w), n, &mut small_weight);
        let msg = r.unwrap_err().to_string();
        assert!(msg.contains("scratch holds 3839 bf16 weights, need 40 x 96"), "{msg}");
        assert!(launched.is_empty());

        let mut small_x = k.gemm_scratch(ROWS * COLS, n * COLS - 1).unwrap();
        let (r, launched) = run(&k, QuantWeight::Int(&w), n, &mut small_x);
        assert!(r.unwrap_err().to_string().contains("need 48 x 96"));
        assert!(launched.is_empty());

        let mut scratch = k.gemm_scratch(ROWS * COLS, n * COLS).unwrap();
        let x = k.zeros::<f32>(n * COLS - 1).unwrap();
        let mut out = k.zeros::<f32>(n * ROWS).unwrap();
        assert!(k.matmul_quant(QuantWeight::Int(&w), &x, &mut out, n, &mut scratch).is_err());
        let mut short_params = int_weight(&k, 4);
        short_params.p1 = k.zeros(1).unwrap();
        let x = k.zeros::<f32>(n * COLS).unwrap();
        let msg =
            k.matmul_quant(QuantWeight::Cubic(&short_params), &x, &mut out, n, &mut scratch).unwrap_err().to_string();
        assert!(msg.contains("group parameters"), "{msg}");
        assert!(k.rt.launched.borrow().is_empty());
    }

    /// The MoE GEMV picks its format's kernel, the INT 4-bit word path under int_gemv's
    /// condition, and grid-strides its tiles when there are more than gridDim.y allows.
    #[test]
    fn moe_gemv_launches_the_format_kernel_and_caps_the_tile_grid() {
        use crate::gpu::moe::ExpertWeight;
        let k = Kernels::new(Recorder::default());
        let (w3, w4) = (int_weight(&k, 3), int_weight(&k, 4));
        let mx = k.upload_mxfp4(ROWS, COLS, &vec![0u8; ROWS * COLS / 2], &[127u8; ROWS * COLS / 32]).unwrap();
        let wb = k.zeros::<u16>(ROWS * COLS).unwrap();
        let a = 70_000;
        let (x, order) = (k.zeros::<f32>(a * COLS).unwrap(), k.zeros::<i32>(a).unwrap());
        let tiles = k.moe_tiles(&k.zeros(2).unwrap(), 1, a).unwrap();
        let mut out = k.zeros::<f32>(a * ROWS / 2).unwrap();
        let cases = [
            (ExpertWeight::Quant(QuantWeight::Int(&w3)), "moe_int_gemv", "int_gemv"),
            (ExpertWeight::Quant(QuantWeight::Int(&w4)), "moe_int4_gemv", "int4_gemv"),
            (ExpertWeight::Quant(QuantWeight::Cubic(&w4)), "moe_cubic_gemv", "cubic_gemv"),
            (ExpertWeight::Quant(QuantWeight::Mxfp4(&mx)), "moe_mxfp4_gemv", "mxfp4_gemv"),
            (ExpertWeight::Bf16 { w: &wb, rows: ROWS, cols: COLS }, "moe_gemv_bf16", ""),
        ];
        for (w, moe, plain) in cases {
            k.rt.launched.borrow_mut().clear();
            k.rt.grids.borrow_mut().clear();
            k.moe_gemv(w, ROWS / 2, &x, 1, &order, &tiles, &mut out, a).unwrap();
            assert_eq!((k.rt.launched.borrow()[0], k.rt.grids.borrow()[0]), (moe, (5, 65535, 1)));
            let ExpertWeight::Quant(q) = w else { continue };
            k.rt.launched.borrow_mut().clear();
            k.quant_gemv(q, &x, &mut out, 1).unwrap();
            assert_eq!(k.rt.launched.borrow()[0], plain);
        }
        k.rt.grids.borrow_mut().clear();
        k.moe_gemv(ExpertWeight::Quant(QuantWeight::Int(&w4)), ROWS, &x, 1, &order, &tiles, &mut out, 3).unwrap();
        assert_eq!(k.rt.grids.borrow()[0], (10, 3, 1), "one grid row per possible tile");
    }
}
