//! Compute backends: the operations a decoder step needs, implemented on the CPU (the existing
//! `kernels::cpu` kernels) and on CUDA (`kernels::cuda`), selected at run time with `--device`.
//!
//! The trait works on host slices: the CUDA backend keeps weights resident on the device (uploaded
//! once by [`Backend::load_weight`]) and moves activations per call, which makes every GPU kernel
//! reachable and testable against the CPU through one interface. The engine's device-resident
//! forward is `model::device_llama` (weights, activations and K/V on the device), chosen by
//! [`placement::place_model`] (docs/cuda.md).
pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
#[cfg(feature = "cuda")]
pub mod nccl;
pub mod device;
pub mod placement;

pub use kernels::cpu::attention::{KvBlocks, PagedGeometry};

pub use device::{select, DeviceSpec, Selected};
pub use placement::place_model;

/// Why a backend operation failed (bad shapes, device errors).
#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    #[error("{0}")]
    Invalid(String),
    #[error("no weight {0} in this backend")]
    UnknownWeight(usize),
    #[error(transparent)]
    Cuda(#[from] kernels::cuda::CudaError),
}

/// A weight matrix `[rows, cols]` as the loaders hold it, to be moved into a backend.
pub enum WeightData<'a> {
    /// compressed-tensors pack-quantized INT: `rows × stride` bytes of LSB-first codes; `scale`
    /// and `zero` (unsigned stored codes) per (row, group).
    Int { bits: u32, rows: usize, cols: usize, stride: usize, packed: &'a [u8], group_size: usize, scale: &'a [f32], zero: &'a [f32] },
    /// Cubic codebook (docs/cubic-format.md): per (row, group) scale `s` and shape `a`.
    Cubic { bits: u32, rows: usize, cols: usize, stride: usize, packed: &'a [u8], group_size: usize, scale: &'a [f32], shape: &'a [f32] },
    /// MXFP4: `rows × cols/2` code bytes, `rows × cols/32` E8M0 scales.
    Mxfp4 { rows: usize, cols: usize, packed: &'a [u8], scales: &'a [u8] },
    /// Dense bf16 bit patterns, row-major.
    Bf16 { rows: usize, cols: usize, data: &'a [u16] },
}

impl WeightData<'_> {
    pub fn shape(&self) -> (usize, usize) {
        match *self {
            WeightData::Int { rows, cols, .. } | WeightData::Cubic { rows, cols, .. } | WeightData::Mxfp4 { rows, cols, .. } | WeightData::Bf16 { rows, cols, .. } => (rows, cols),
        }
    }
}

/// Handle to a weight held by a backend.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WeightId(pub usize);

/// Sampling settings for [`Backend::sample`] (the engine's full sampler, with penalties and
/// constraints, stays on the CPU; this is the plain top-k/top-p draw).
#[derive(Clone, Copy, Debug)]
pub struct TopKTopP {
    pub temperature: f32,
    pub top_k: usize,
    pub top_p: f32,
}

pub trait Backend: Send + Sync {
    /// E.g. `cpu` or `cuda:0 (NVIDIA H200)`.
    fn name(&self) -> String;
    /// Takes a copy of `w`; returns its handle.
    fn load_weight(&mut self, w: WeightData) -> Result<WeightId, BackendError>;
    /// `out[n, rows] = x[n, cols] · Wᵀ`.
    fn matmul_t(&self, w: WeightId, x: &[f32], out: &mut [f32], n: usize) -> Result<(), BackendError>;
    /// RMSNorm of each `weight.len()`-wide row.
    fn rms_norm(&self, x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) -> Result<(), BackendError>;
    /// `out[t] = silu(gate_up[t, :d]) · gate_up[t, d:]`.
    fn silu_mul(&self, gate_up: &[f32], out: &mut [f32], tokens: usize, d: usize) -> Result<(), BackendError>;
    /// Decode attention of one query per sequence over a paged K/V layer.
    #[allow(clippy::too_many_arguments)]
    fn attention_decode(&self, q: &[f32], kv: &KvBlocks, tables: &[i32], lens: &[i32], geo: &PagedGeometry, scale: f32, out: &mut [f32]) -> Result<(), BackendError>;
    /// One token per `vocab`-wide row of `logits`, using uniform draws `u` (one per row).
    fn sample(&self, logits: &[f32], vocab: usize, params: TopKTopP, u: &[f32]) -> Result<Vec<u32>, BackendError>;
}

pub(crate) fn check(cond: bool, msg: impl FnOnce() -> String) -> Result<(), BackendError> {
    if cond { Ok(()) } else { Err(BackendError::Invalid(msg())) }
}

/// Shape checks shared by the backends, so both reject the same inputs with the same words.
pub(crate) fn check_matmul(rows: usize, cols: usize, x: &[f32], out: &[f32], n: usize) -> Result<(), BackendError> {
    check(n > 0 && x.len() == n * cols && out.len() == n * rows, || format!("matmul_t: x has {} values and out {} for n={n} and a {rows}x{cols} weight", x.len(), out.len()))
}

pub(crate) fn check_attention(q: &[f32], kv: &KvBlocks, tables: &[i32], lens: &[i32], g: &PagedGeometry, out: &[f32]) -> Result<(), BackendError> {
    check(g.kv_heads > 0 && g.heads % g.kv_heads == 0 && g.block_size > 0, || format!("attention: {} heads over {} kv heads", g.heads, g.kv_heads))?;
    let per = g.heads * g.head_dim;
    check(q.len() == lens.len() * per && out.len() == q.len() && tables.len() == lens.len() * g.max_blocks, || "attention: q/out/tables sizes disagree with the geometry".into())?;
    let width = g.kv_heads * g.head_dim;
    let pool_rows = match kv {
        KvBlocks::F32 { k, v } => (k.len() == v.len()).then_some(k.len() / width.max(1)),
        KvBlocks::Bf16 { k, v } => (k.len() == v.len()).then_some(k.len() / width.max(1)),
        KvBlocks::Fp8 { k, v, k_scales, v_scales } => (k.len() == v.len() && k_scales.len() == v_scales.len() && k_scales.len() * g.head_dim == k.len()).then_some(k.len() / width.max(1)),
    }
    .ok_or_else(|| BackendError::Invalid("attention: K, V and scale sizes disagree".into()))?;
    let blocks = pool_rows / g.block_size;
    for (s, &len) in lens.iter().enumerate() {
        check(len >= 0 && len as usize <= g.max_blocks * g.block_size, || format!("attention: sequence {s} has length {len}"))?;
        for b in 0..(len as usize).div_ceil(g.block_size) {
            let id = tables[s * g.max_blocks + b];
            check(id >= 0 && (id as usize) < blocks, || format!("attention: sequence {s} block {b} is {id}, pool has {blocks}"))?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::cpu::CpuBackend;
    use super::*;

    /// The CPU backend is the kernels it wraps, and rejects bad shapes with an error, not a panic.
    #[test]
    fn cpu_backend_runs_the_kernels_and_rejects_bad_input() {
        let mut b = CpuBackend::new();
        let w: Vec<u16> = (0..6).map(|i| half::bf16::from_f32(i as f32).to_bits()).collect();
        let id = b.load_weight(WeightData::Bf16 { rows: 2, cols: 3, data: &w }).unwrap();
        let mut out = [0.0; 2];
        b.matmul_t(id, &[1.0, 1.0, 1.0], &mut out, 1).unwrap();
        assert_eq!(out, [3.0, 12.0]);
        assert!(matches!(b.matmul_t(id, &[1.0, 1.0], &mut out, 1), Err(BackendError::Invalid(_))));
        assert!(matches!(b.matmul_t(WeightId(7), &[1.0; 3], &mut out, 1), Err(BackendError::UnknownWeight(7))));
        assert!(b.load_weight(WeightData::Int { bits: 4, rows: 2, cols: 8, stride: 4, packed: &[0; 8], group_size: 8, scale: &[1.0], zero: &[0.0; 2] }).is_err());
        assert!(b.load_weight(WeightData::Mxfp4 { rows: 1, cols: 30, packed: &[0; 15], scales: &[127] }).is_err());

        let geo = PagedGeometry { heads: 2, kv_heads: 1, head_dim: 2, block_size: 2, max_blocks: 2 };
        let kv = [0.5f32; 8]; // 2 blocks x 2 slots x width 2
        let mut o = [0.0; 4];
        b.attention_decode(&[1.0; 4], &KvBlocks::F32 { k: &kv, v: &kv }, &[1, 0], &[3], &geo, 1.0, &mut o).unwrap();
        assert_eq!(o, [0.5; 4]);
        // A block id outside the pool is refused before any read.
        let err = b.attention_decode(&[1.0; 4], &KvBlocks::F32 { k: &kv, v: &kv }, &[2, 0], &[1], &geo, 1.0, &mut o).unwrap_err();
        assert!(err.to_string().contains("pool has 2"), "{err}");

        let toks = b.sample(&[0.0, 5.0, 1.0, 9.0, 0.0, 0.0], 3, TopKTopP { temperature: 1.0, top_k: 1, top_p: 1.0 }, &[0.3, 0.9]).unwrap();
        assert_eq!(toks, [1, 0]);
    }
}
