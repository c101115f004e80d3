//! The CUDA backend: `kernels::cuda::launch::Gpu` behind the [`Backend`] trait. Weights are
//! uploaded once and stay resident; activations travel per call (see the module docs of
//! `backend`).

use std::sync::Mutex;

use kernels::cuda::launch::{DevGrouped, DevMxfp4, Gpu};
use kernels::cuda::nvrtc::PtxCache;
use kernels::cuda::CudaError;

use cudarc_types::CudaSlice;

use super::{check, check_attention, check_matmul, Backend, BackendError, KvBlocks, PagedGeometry, TopKTopP, WeightData, WeightId};

/// cudarc's types, through the kernels crate (the host does not depend on cudarc directly).
mod cudarc_types {
    pub use kernels::cuda::launch::CudaSlice;
}

enum DevWeight {
    Int(DevGrouped),
    Cubic(DevGrouped),
    Mxfp4(DevMxfp4),
    Bf16 { rows: usize, cols: usize, w: CudaSlice<u16> },
}

impl DevWeight {
    fn shape(&self) -> (usize, usize) {
        match self {
            DevWeight::Int(g) | DevWeight::Cubic(g) => (g.packed.rows, g.packed.cols),
            DevWeight::Mxfp4(m) => (m.rows, m.cols),
            DevWeight::Bf16 { rows, cols, .. } => (*rows, *cols),
        }
    }
}

pub struct CudaBackend {
    gpu: Gpu,
    /// Device-resident weights (the weight pool); a Mutex because cudarc slices are not Sync
    /// across concurrent launches on one stream and launches are serialised anyway.
    weights: Mutex<Vec<DevWeight>>,
}

// SAFETY: every use of the GPU goes through `&self` methods that launch on the single stream of
// this backend; the Mutex serialises weight access.
unsafe impl Sync for CudaBackend {}
unsafe impl Send for CudaBackend {}

impl CudaBackend {
    pub fn open(ordinal: usize) -> Result<Self, CudaError> {
        let gpu = Gpu::open(ordinal, &PtxCache::new(PtxCache::default_dir()))?;
        Ok(Self { gpu, weights: Mutex::new(Vec::new()) })
    }

    pub fn gpu(&self) -> &Gpu {
        &self.gpu
    }
}

impl Backend for CudaBackend {
    fn name(&self) -> String {
        format!("cuda:{} ({})", self.gpu.info.ordinal, self.gpu.info.name)
    }

    fn load_weight(&mut self, w: WeightData) -> Result<WeightId, BackendError> {
        let g = &self.gpu;
        let dw = match w {
            WeightData::Int { bits, rows, cols, stride, packed, group_size, scale, zero } => DevWeight::Int(g.upload_grouped(g.upload_packed(bits, rows, cols, stride, packed)?, group_size, scale, zero)?),
            WeightData::Cubic { bits, rows, cols, stride, packed, group_size, scale, shape } => DevWeight::Cubic(g.upload_grouped(g.upload_packed(bits, rows, cols, stride, packed)?, group_size, scale, shape)?),
            WeightData::Mxfp4 { rows, cols, packed, scales } => DevWeight::Mxfp4(g.upload_mxfp4(rows, cols, packed, scales)?),
            WeightData::Bf16 { rows, cols, data } => {
                check(data.len() == rows * cols, || format!("bf16 {rows}x{cols}: {} values", data.len()))?;
                DevWeight::Bf16 { rows, cols, w: g.upload(data)? }
            }
        };
        let mut ws = self.weights.lock().unwrap_or_else(|p| p.into_inner());
        ws.push(dw);
        Ok(WeightId(ws.len() - 1))
    }

    fn matmul_t(&self, id: WeightId, x: &[f32], out: &mut [f32], n: usize) -> Result<(), BackendError> {
        let ws = self.weights.lock().unwrap_or_else(|p| p.into_inner());
        let w = ws.get(id.0).ok_or(BackendError::UnknownWeight(id.0))?;
        let (rows, cols) = w.shape();
        check_matmul(rows, cols, x, out, n)?;
        let g = &self.gpu;
        let mut dout = g.zeros::<f32>(n * rows)?;
        match w {
            DevWeight::Int(m) => g.int_gemv(m, &g.upload(x)?, &mut dout, n)?,
            DevWeight::Cubic(m) => g.cubic_gemv(m, &g.upload(x)?, &mut dout, n)?,
            DevWeight::Mxfp4(m) => g.mxfp4_gemv(m, &g.upload(x)?, &mut dout, n)?,
            DevWeight::Bf16 { w, .. } => {
                // cuBLAS takes bf16 activations: rounding x to bf16 is what a bf16 model's
                // reference (transformers in bf16) does too.
                let xb: Vec<u16> = x.iter().map(|&v| half::bf16::from_f32(v).to_bits()).collect();
                g.gemm_bf16(&g.upload(&xb)?, w, &mut dout, n, cols, rows)?
            }
        }
        out.copy_from_slice(&g.download(&dout)?);
        Ok(())
    }

    fn rms_norm(&self, x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) -> Result<(), BackendError> {
        check(!weight.is_empty() && x.len() % weight.len() == 0 && x.len() == out.len(), || "rms_norm: sizes".into())?;
        let g = &self.gpu;
        let mut dy = g.zeros::<f32>(x.len())?;
        g.rms_norm(&g.upload(x)?, &g.upload(weight)?, &mut dy, x.len() / weight.len(), eps)?;
        out.copy_from_slice(&g.download(&dy)?);
        Ok(())
    }

    fn silu_mul(&self, gate_up: &[f32], out: &mut [f32], tokens: usize, d: usize) -> Result<(), BackendError> {
        check(gate_up.len() == tokens * 2 * d && out.len() == tokens * d, || "silu_mul: sizes".into())?;
        let g = &self.gpu;
        let mut dout = g.zeros::<f32>(out.len())?;
        g.silu_mul(&g.upload(gate_up)?, &mut dout, tokens, d)?;
        out.copy_from_slice(&g.download(&dout)?);
        Ok(())
    }

    fn attention_decode(&self, q: &[f32], kv: &KvBlocks, tables: &[i32], lens: &[i32], geo: &PagedGeometry, scale: f32, out: &mut [f32]) -> Result<(), BackendError> {
        check_attention(q, kv, tables, lens, geo, out)?;
        let g = &self.gpu;
        let (dq, dt, dl) = (g.upload(q)?, g.upload(tables)?, g.upload(lens)?);
        let mut dout = g.zeros::<f32>(out.len())?;
        match kv {
            KvBlocks::F32 { k, v } => g.paged_attention_f32(geo, &dq, &g.upload(k)?, &g.upload(v)?, &dt, &dl, scale, &mut dout)?,
            KvBlocks::Bf16 { k, v } => g.paged_attention_bf16(geo, &dq, &g.upload(k)?, &g.upload(v)?, &dt, &dl, scale, &mut dout)?,
            KvBlocks::Fp8 { k, v, k_scales, v_scales } => g.paged_attention_fp8(geo, &dq, &g.upload(k)?, &g.upload(v)?, &g.upload(k_scales)?, &g.upload(v_scales)?, &dt, &dl, scale, &mut dout)?,
        }
        out.copy_from_slice(&g.download(&dout)?);
        Ok(())
    }

    fn sample(&self, logits: &[f32], vocab: usize, p: TopKTopP, u: &[f32]) -> Result<Vec<u32>, BackendError> {
        check(vocab > 0 && logits.len() == u.len() * vocab && p.temperature > 0.0, || "sample: sizes or temperature".into())?;
        let g = &self.gpu;
        let mut probs = g.zeros::<f32>(logits.len())?;
        let mut out = g.zeros::<i32>(u.len())?;
        g.sample(&g.upload(logits)?, &mut probs, &g.upload(u)?, &mut out, vocab, p.temperature, p.top_k, p.top_p)?;
        Ok(g.download(&out)?.into_iter().take(u.len()).map(|t| t as u32).collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::CpuBackend;

    fn open_or_skip(test: &str) -> Option<CudaBackend> {
        match CudaBackend::open(0) {
            Ok(b) => Some(b),
            Err(e) if std::env::var_os("WASMSERVE_REQUIRE_GPU").is_some_and(|v| v == "1") => panic!("{test}: {e}"),
            Err(e) => {
                eprintln!("SKIPPED {test}: no usable CUDA device: {e}");
                None
            }
        }
    }

    fn close(what: &str, a: &[f32], b: &[f32], tol: f32) {
        let worst = kernels::compare::max_rel_error(a, b, 1e-6);
        assert!(worst <= tol, "{what}: {worst}");
    }

    /// The same weights and inputs through both backends' trait methods.
    #[test]
    fn cuda_backend_matches_cpu_backend_through_the_trait() {
        let Some(mut gpu) = open_or_skip("cuda_backend_matches_cpu_backend_through_the_trait") else { return };
        let mut cpu = CpuBackend::new();
        let (rows, cols, gs, n) = (96, 256, 32, 5);
        let packed: Vec<u8> = (0..rows * cols / 2).map(|i| (i * 37 % 251) as u8).collect();
        let groups = rows * cols / gs;
        let scale: Vec<f32> = (0..groups).map(|i| 0.001 + (i % 17) as f32 * 1e-3).collect();
        let zero: Vec<f32> = (0..groups).map(|i| (i % 16) as f32).collect();
        let data = || WeightData::Int { bits: 4, rows, cols, stride: cols / 2, packed: &packed, group_size: gs, scale: &scale, zero: &zero };
        let (wc, wg) = (cpu.load_weight(data()).unwrap(), gpu.load_weight(data()).unwrap());
        let x: Vec<f32> = (0..n * cols).map(|i| ((i * 13 % 97) as f32 - 48.0) / 50.0).collect();
        let (mut a, mut b) = (vec![0.0; n * rows], vec![0.0; n * rows]);
        cpu.matmul_t(wc, &x, &mut a, n).unwrap();
        gpu.matmul_t(wg, &x, &mut b, n).unwrap();
        close("int4 matmul", &b, &a, 1e-5);
        let w: Vec<f32> = (0..cols).map(|i| 0.5 + (i % 7) as f32 * 0.1).collect();
        let (mut a, mut b) = (vec![0.0; n * cols], vec![0.0; n * cols]);
        cpu.rms_norm(&x, &w, 1e-5, &mut a).unwrap();
        gpu.rms_norm(&x, &w, 1e-5, &mut b).unwrap();
        close("rms_norm", &b, &a, 1e-6);
        // Bad shapes are the same error on both.
        assert!(gpu.matmul_t(wg, &x[1..], &mut b[..n * rows], n).is_err());
        assert!(cpu.matmul_t(wc, &x[1..], &mut a[..n * rows], n).is_err());
    }
}
