//! Uploading a loaded Llama's weights to a device, once, in the formats the device kernels
//! multiply: dense weights as bf16 (cuBLAS-style `gemm_bf16`), pack-quantized INT, Cubic and
//! MXFP4 kept packed: their GEMV kernels for decode-sized batches, dequantise + bf16 GEMM above
//! `kernels::gpu::kernels::GEMM_MIN_TOKENS` tokens (`Kernels::matmul_quant`).
//!
//! Precision: dense weights are narrowed f32 -> bf16. The default checkpoints are bf16, so for
//! them this is exact (the loader widened bf16 to f32); an f32 checkpoint loses the low mantissa
//! bits, which is what any bf16 serving engine does. Activations entering the bf16 GEMM are
//! rounded to bf16 as well (as transformers in bf16 does); everything else (norms, RoPE,
//! attention, residual) stays f32.

use kernels::cpu::bitpack::PackedRows;
use kernels::gpu::kernels::{GemmScratch, QuantWeight};
use kernels::gpu::{DevGrouped, DevMxfp4, Kernels, Runtime};

use crate::model::layers::linear::Linear;
use crate::model::tensor::Tensor;
use crate::model::ForwardError;

/// How dense (unquantized) weights are held on the device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DenseWeights {
    /// bf16, multiplied by the bf16 GEMM (cuBLAS) with bf16-rounded activations: serving.
    Bf16,
    /// f32 with f32 activations (the `matmul_f32` kernel, no tensor cores): the device then
    /// differs from the CPU model only in summation order, which accuracy checks rely on when a
    /// rounding-sized difference can change a discrete choice (MoE routing).
    F32,
}

impl DenseWeights {
    /// `--dtype`: `bfloat16` (also `bf16`, `auto`) or `float32` (also `f32`, `float`), as vLLM
    /// spells them.
    pub fn parse(s: &str) -> Result<Self, String> {
        match s {
            "auto" | "bfloat16" | "bf16" => Ok(Self::Bf16),
            "float32" | "f32" | "float" => Ok(Self::F32),
            other => Err(format!("unknown dtype '{other}' (expected bfloat16 or float32)")),
        }
    }
}

/// One linear layer's weight on the device.
pub enum DevLinear<R: Runtime> {
    Bf16 { w: R::Buf<u16>, rows: usize, cols: usize },
    F32 { w: R::Buf<f32>, rows: usize, cols: usize },
    Int(DevGrouped<R>),
    Cubic(DevGrouped<R>),
    Mxfp4(DevMxfp4<R>),
}

/// Host-side parts of a weight in one device format, possibly several layers' rows stacked (the
/// fused gate+up projection that `silu_mul` reads as `[tokens, 2 · intermediate]`).
enum Parts {
    Bf16 {
        rows: usize,
        cols: usize,
        data: Vec<u16>,
    },
    F32 {
        rows: usize,
        cols: usize,
        data: Vec<f32>,
    },
    Grouped {
        cubic: bool,
        bits: u32,
        rows: usize,
        cols: usize,
        stride: usize,
        bytes: Vec<u8>,
        group_size: usize,
        p0: Vec<f32>,
        p1: Vec<f32>,
    },
    Mxfp4 {
        rows: usize,
        cols: usize,
        packed: Vec<u8>,
        scales: Vec<u8>,
    },
}

fn grouped(cubic: bool, packed: &PackedRows, group_size: usize, params: &[[f32; 2]]) -> Parts {
    Parts::Grouped {
        cubic,
        bits: packed.bits(),
        rows: packed.rows(),
        cols: packed.cols(),
        stride: packed.stride(),
        bytes: packed.bytes().to_vec(),
        group_size,
        p0: params.iter().map(|p| p[0]).collect(),
        p1: params.iter().map(|p| p[1]).collect(),
    }
}

fn parts(name: &str, l: &Linear, dense: DenseWeights) -> Result<Parts, ForwardError> {
    Ok(match l {
        Linear::Dense(t) if dense == DenseWeights::F32 => {
            Parts::F32 { rows: t.shape[0], cols: t.shape[1], data: t.as_slice().to_vec() }
        }
        Linear::Dense(t) => {
            Parts::Bf16 { rows: t.shape[0], cols: t.shape[1], data: kernels::cpu::gather::narrow_bf16(t.as_slice()) }
        }
        Linear::Int(q) => {
            if q.perm.is_some() {
                // The device GEMV reads input features in order; act-order checkpoints would need
                // a gather of x per layer first.
                return Err(ForwardError::Invalid(format!(
                    "{name}: activation-ordered (g_idx) INT weights are not supported by the device forward yet"
                )));
            }
            let (p, g, params) = q.w.parts();
            grouped(false, p, g, params)
        }
        Linear::Cubic(c) => {
            let (p, g, params) = c.parts();
            grouped(true, p, g, params)
        }
        Linear::CubicPack(_) => {
            return Err(ForwardError::Invalid(format!(
                "{name}: cubic-pack-quantized weights have no device kernels yet (they run on the CPU)"
            )))
        }
        Linear::Mxfp4(m) => {
            let (packed, scales) = m.parts();
            Parts::Mxfp4 { rows: m.rows(), cols: m.cols(), packed: packed.to_vec(), scales: scales.to_vec() }
        }
    })
}

/// `a`'s rows then `b`'s, when both are in the same format and layout.
fn stack(name: &str, a: Parts, b: Parts) -> Result<Parts, ForwardError> {
    let mismatch = || {
        ForwardError::Invalid(format!("{name}: the stacked projections are stored in different formats or layouts; the device forward needs one format to fuse them"))
    };
    Ok(match (a, b) {
        (Parts::Bf16 { rows, cols, mut data }, Parts::Bf16 { rows: r2, cols: c2, data: d2 }) if cols == c2 => {
            data.extend(d2);
            Parts::Bf16 { rows: rows + r2, cols, data }
        }
        (Parts::F32 { rows, cols, mut data }, Parts::F32 { rows: r2, cols: c2, data: d2 }) if cols == c2 => {
            data.extend(d2);
            Parts::F32 { rows: rows + r2, cols, data }
        }
        (
            Parts::Grouped { cubic, bits, rows, cols, stride, mut bytes, group_size, mut p0, mut p1 },
            Parts::Grouped {
                cubic: c2,
                bits: b2,
                rows: r2,
                cols: k2,
                stride: s2,
                bytes: y2,
                group_size: g2,
                p0: q0,
                p1: q1,
            },
        ) if cubic == c2 && bits == b2 && cols == k2 && stride == s2 && group_size == g2 => {
            bytes.extend(y2);
            p0.extend(q0);
            p1.extend(q1);
            Parts::Grouped { cubic, bits, rows: rows + r2, cols, stride, bytes, group_size, p0, p1 }
        }
        (
            Parts::Mxfp4 { rows, cols, mut packed, mut scales },
            Parts::Mxfp4 { rows: r2, cols: c2, packed: p2, scales: s2 },
        ) if cols == c2 => {
            packed.extend(p2);
            scales.extend(s2);
            Parts::Mxfp4 { rows: rows + r2, cols, packed, scales }
        }
        _ => return Err(mismatch()),
    })
}

fn upload<R: Runtime>(gpu: &Kernels<R>, p: Parts) -> Result<DevLinear<R>, ForwardError> {
    Ok(match p {
        Parts::Bf16 { rows, cols, data } => DevLinear::Bf16 { w: gpu.upload(&data)?, rows, cols },
        Parts::F32 { rows, cols, data } => DevLinear::F32 { w: gpu.upload(&data)?, rows, cols },
        Parts::Grouped { cubic, bits, rows, cols, stride, bytes, group_size, p0, p1 } => {
            let g = gpu.upload_grouped(gpu.upload_packed(bits, rows, cols, stride, &bytes)?, group_size, &p0, &p1)?;
            if cubic {
                DevLinear::Cubic(g)
            } else {
                DevLinear::Int(g)
            }
        }
        Parts::Mxfp4 { rows, cols, packed, scales } => {
            DevLinear::Mxfp4(gpu.upload_mxfp4(rows, cols, &packed, &scales)?)
        }
    })
}

impl<R: Runtime> DevLinear<R> {
    /// Dense weights as bf16 (the serving form).
    pub fn upload(gpu: &Kernels<R>, name: &str, l: &Linear) -> Result<Self, ForwardError> {
        Self::upload_as(gpu, name, l, DenseWeights::Bf16)
    }

    pub fn upload_as(gpu: &Kernels<R>, name: &str, l: &Linear, dense: DenseWeights) -> Result<Self, ForwardError> {
        upload(gpu, parts(name, l, dense)?)
    }

    /// A model's output projection: `lm_head` as stored, or, when it is tied to the embedding,
    /// nothing under bf16 (the caller's bf16 gather table doubles as the output weight) and an
    /// f32 copy of the embedding under f32.
    pub fn output_head(
        gpu: &Kernels<R>,
        embed: &Tensor,
        lm_head: Option<&Linear>,
        dense: DenseWeights,
    ) -> Result<Option<Self>, ForwardError> {
        Ok(match (lm_head, dense) {
            (Some(h), _) => Some(Self::upload_as(gpu, "lm_head", h, dense)?),
            (None, DenseWeights::Bf16) => None,
            (None, DenseWeights::F32) => Some(Self::upload_as(
                gpu,
                "lm_head (tied)",
                &Linear::Dense(Tensor::owned(embed.shape.clone(), embed.as_slice().to_vec())),
                dense,
            )?),
        })
    }

    /// `a` and `b` stacked by rows into one weight (one GEMM for both).
    pub fn upload_stacked(gpu: &Kernels<R>, name: &str, a: &Linear, b: &Linear) -> Result<Self, ForwardError> {
        Self::upload_rows(gpu, name, &[a, b], DenseWeights::Bf16)
    }

    /// Every weight of `list` stacked by rows, in order, into one device weight: a fused
    /// projection, or a layer's routed experts (expert `e`'s matrix is rows
    /// `e · rows_per_expert ..`), which must then share one storage format and layout.
    pub fn upload_rows(
        gpu: &Kernels<R>,
        name: &str,
        list: &[&Linear],
        dense: DenseWeights,
    ) -> Result<Self, ForwardError> {
        let mut it = list.iter();
        let first = it.next().ok_or_else(|| ForwardError::Invalid(format!("{name}: nothing to upload")))?;
        let mut all = parts(name, first, dense)?;
        for l in it {
            all = stack(name, all, parts(name, l, dense)?)?;
        }
        upload(gpu, all)
    }

    /// (rows, cols) of the whole (possibly stacked) weight.
    pub fn shape(&self) -> (usize, usize) {
        match self {
            DevLinear::Bf16 { rows, cols, .. } | DevLinear::F32 { rows, cols, .. } => (*rows, *cols),
            DevLinear::Int(g) | DevLinear::Cubic(g) => (g.packed.rows, g.packed.cols),
            DevLinear::Mxfp4(m) => (m.rows, m.cols),
        }
    }

    /// Elements of the bf16 copy the prefill GEMM dequantises this weight into (0 for dense
    /// weights, which are bf16 already).
    pub fn dequant_elements(&self) -> usize {
        match self {
            DevLinear::Bf16 { .. } | DevLinear::F32 { .. } => 0,
            DevLinear::Int(g) | DevLinear::Cubic(g) => g.packed.rows * g.packed.cols,
            DevLinear::Mxfp4(m) => m.rows * m.cols,
        }
    }

    /// The packed weight, for the format-independent entry points (`None` for dense ones).
    pub fn quant(&self) -> Option<QuantWeight<'_, R>> {
        match self {
            DevLinear::Bf16 { .. } | DevLinear::F32 { .. } => None,
            DevLinear::Int(g) => Some(QuantWeight::Int(g)),
            DevLinear::Cubic(g) => Some(QuantWeight::Cubic(g)),
            DevLinear::Mxfp4(m) => Some(QuantWeight::Mxfp4(m)),
        }
    }

    /// `out[n, rows] = x[n, cols] · Wᵀ`. `scratch.x` holds the bf16 copy of `x` (at least
    /// `n · cols`) for dense weights and the prefill GEMM; `scratch.weight` the dequantised
    /// weight (at least [`Self::dequant_elements`]) when `n` is above the GEMV range.
    pub fn forward(
        &self,
        gpu: &Kernels<R>,
        x: &R::Buf<f32>,
        scratch: &mut GemmScratch<R>,
        out: &mut R::Buf<f32>,
        n: usize,
    ) -> Result<(), ForwardError> {
        match self {
            DevLinear::Bf16 { w, rows, cols } => {
                gpu.narrow_bf16(x, &mut scratch.x, n * cols)?;
                gpu.gemm_bf16(&scratch.x, w, out, n, *cols, *rows)?;
            }
            DevLinear::F32 { w, rows, cols } => gpu.matmul_f32(x, w, out, n, *rows, *cols)?,
            packed => {
                let quant = packed.quant().expect("a packed weight");
                let path = gpu.matmul_quant(quant, x, out, n, scratch)?;
                tracing::trace!(n, ?path, "quantized matmul");
            }
        }
        Ok(())
    }
}
