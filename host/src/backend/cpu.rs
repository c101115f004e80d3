//! The CPU backend: each operation is the existing `kernels::cpu` kernel.

use kernels::cpu::bitpack::PackedRows;
use kernels::cpu::cubic::AnyCubic;
use kernels::cpu::mxfp4::Mxfp4Matrix;
use kernels::cpu::quant_int::IntMatrix;

use super::{check, check_attention, check_matmul, Backend, BackendError, KvBlocks, PagedGeometry, TopKTopP, WeightData, WeightId};

enum CpuWeight {
    Int(IntMatrix),
    Cubic(AnyCubic),
    Mxfp4(Mxfp4Matrix),
    /// Widened to f32 once (the CPU multiplies f32).
    Dense { rows: usize, cols: usize, w: Vec<f32> },
}

#[derive(Default)]
pub struct CpuBackend {
    weights: Vec<CpuWeight>,
}

impl CpuBackend {
    pub fn new() -> Self {
        Self::default()
    }
}

fn packed(bits: u32, rows: usize, cols: usize, stride: usize, bytes: &[u8]) -> Result<PackedRows, BackendError> {
    check((1..=8).contains(&bits), || format!("{bits}-bit codes (1..=8 supported)"))?;
    check(stride >= kernels::cpu::bitpack::row_bytes(cols, bits) && bytes.len() == rows * stride, || format!("{} code bytes for {rows} rows of stride {stride}", bytes.len()))?;
    Ok(PackedRows::new(bits, rows, cols, stride, bytes))
}

fn check_groups(rows: usize, cols: usize, gs: usize, a: &[f32], b: &[f32]) -> Result<(), BackendError> {
    check(gs > 0, || "group size 0".into())?;
    let n = rows * cols.div_ceil(gs);
    check(a.len() == n && b.len() == n, || format!("{} / {} group parameters for {n} groups", a.len(), b.len()))
}

impl Backend for CpuBackend {
    fn name(&self) -> String {
        "cpu".into()
    }

    fn load_weight(&mut self, w: WeightData) -> Result<WeightId, BackendError> {
        let cw = match w {
            WeightData::Int { bits, rows, cols, stride, packed: p, group_size, scale, zero } => {
                check_groups(rows, cols, group_size, scale, zero)?;
                CpuWeight::Int(IntMatrix::new(packed(bits, rows, cols, stride, p)?, group_size, scale, zero))
            }
            WeightData::Cubic { bits, rows, cols, stride, packed: p, group_size, scale, shape } => {
                check_groups(rows, cols, group_size, scale, shape)?;
                CpuWeight::Cubic(AnyCubic::new(packed(bits, rows, cols, stride, p)?, group_size, scale, shape))
            }
            WeightData::Mxfp4 { rows, cols, packed: p, scales } => {
                check(cols % 32 == 0 && p.len() == rows * cols / 2 && scales.len() == rows * cols / 32, || format!("MXFP4 {rows}x{cols}: {} code bytes, {} scales", p.len(), scales.len()))?;
                CpuWeight::Mxfp4(Mxfp4Matrix::new(rows, cols, p, scales))
            }
            WeightData::Bf16 { rows, cols, data } => {
                check(data.len() == rows * cols, || format!("bf16 {rows}x{cols}: {} values", data.len()))?;
                CpuWeight::Dense { rows, cols, w: data.iter().map(|&b| half::bf16::from_bits(b).to_f32()).collect() }
            }
        };
        self.weights.push(cw);
        Ok(WeightId(self.weights.len() - 1))
    }

    fn matmul_t(&self, id: WeightId, x: &[f32], out: &mut [f32], n: usize) -> Result<(), BackendError> {
        let w = self.weights.get(id.0).ok_or(BackendError::UnknownWeight(id.0))?;
        let (rows, cols) = match w {
            CpuWeight::Int(m) => (m.rows(), m.cols()),
            CpuWeight::Cubic(m) => (m.rows(), m.cols()),
            CpuWeight::Mxfp4(m) => (m.rows(), m.cols()),
            CpuWeight::Dense { rows, cols, .. } => (*rows, *cols),
        };
        check_matmul(rows, cols, x, out, n)?;
        match w {
            CpuWeight::Int(m) => m.matmul_t(x, out, n),
            CpuWeight::Cubic(m) => m.matmul_t(x, out, n),
            CpuWeight::Mxfp4(m) => m.matmul_t(x, out, n),
            CpuWeight::Dense { w, .. } => kernels::cpu::matmul::matmul_t(x, w, out, n, cols, rows),
        }
        Ok(())
    }

    fn rms_norm(&self, x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) -> Result<(), BackendError> {
        check(!weight.is_empty() && x.len() % weight.len() == 0 && x.len() == out.len(), || "rms_norm: sizes".into())?;
        kernels::cpu::norm::rms_norm(x, weight, eps, out);
        Ok(())
    }

    fn silu_mul(&self, gate_up: &[f32], out: &mut [f32], tokens: usize, d: usize) -> Result<(), BackendError> {
        check(gate_up.len() == tokens * 2 * d && out.len() == tokens * d, || "silu_mul: sizes".into())?;
        for t in 0..tokens {
            let row = &gate_up[t * 2 * d..(t + 1) * 2 * d];
            kernels::cpu::activation::silu_mul(&row[..d], &row[d..], &mut out[t * d..(t + 1) * d]);
        }
        Ok(())
    }

    fn attention_decode(&self, q: &[f32], kv: &KvBlocks, tables: &[i32], lens: &[i32], geo: &PagedGeometry, scale: f32, out: &mut [f32]) -> Result<(), BackendError> {
        check_attention(q, kv, tables, lens, geo, out)?;
        kernels::cpu::attention::paged_attention_decode(q, kv, tables, lens, geo, scale, out);
        Ok(())
    }

    fn sample(&self, logits: &[f32], vocab: usize, p: TopKTopP, u: &[f32]) -> Result<Vec<u32>, BackendError> {
        check(vocab > 0 && logits.len() == u.len() * vocab && p.temperature > 0.0, || "sample: sizes or temperature".into())?;
        Ok(logits.chunks_exact(vocab).zip(u).map(|(l, &u)| kernels::cpu::sample::sample_top_k_top_p(l, p.temperature, p.top_k, p.top_p, u) as u32).collect())
    }
}
