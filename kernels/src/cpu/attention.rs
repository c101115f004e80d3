//! Decode attention over a paged KV pool: the CPU reference for `kernels/cuda/paged_attention.cu`
//! (the engine's own attention lives in the model code; this one mirrors the GPU kernel's
//! arguments so the two can be compared element for element).
//!
//! Layout (host/src/engine/block_pool.rs): K and V are `[block][slot][kv_heads * head_dim]`, FP8
//! scales `[block][slot][kv_heads]`. Sequence `s`'s position `p` is in block
//! `block_tables[s * max_blocks + p / block_size]`, slot `p % block_size`.

use super::fp8::E4M3_TO_F32;

/// One layer's cache in one of the pool's storage types.
pub enum KvBlocks<'a> {
    F32 {
        k: &'a [f32],
        v: &'a [f32],
    },
    /// bf16 bit patterns.
    Bf16 {
        k: &'a [u16],
        v: &'a [u16],
    },
    Fp8 {
        k: &'a [u8],
        v: &'a [u8],
        k_scales: &'a [f32],
        v_scales: &'a [f32],
    },
}

#[derive(Clone, Copy, Debug)]
pub struct PagedGeometry {
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub block_size: usize,
    pub max_blocks: usize,
}

impl KvBlocks<'_> {
    /// Element `i` of kv head `h` at pool row `row` (= block * block_size + slot) of K or V.
    fn get(&self, value: bool, row: usize, h: usize, i: usize, g: &PagedGeometry) -> f32 {
        self.element(value, row, g.kv_heads * g.head_dim, g.kv_heads, h * g.head_dim + i)
    }

    /// Element `i` of pool row `row` of K or V, for rows `width` wide with `groups` FP8 scales
    /// each (element `i` in group `i / (width / groups)`). K and V may differ in width (MLA).
    pub fn element(&self, value: bool, row: usize, width: usize, groups: usize, i: usize) -> f32 {
        let at = row * width + i;
        match self {
            KvBlocks::F32 { k, v } => (if value { v } else { k })[at],
            KvBlocks::Bf16 { k, v } => half::bf16::from_bits((if value { v } else { k })[at]).to_f32(),
            KvBlocks::Fp8 { k, v, k_scales, v_scales } => {
                let s = (if value { v_scales } else { k_scales })[row * groups + i / (width / groups)];
                E4M3_TO_F32[(if value { v } else { k })[at] as usize] * s
            }
        }
    }
}

/// `out[s, h, :] = softmax(scale · q[s, h] · K_sᵀ) · V_s` for every sequence and query head;
/// GQA maps query head `h` to kv head `h / (heads / kv_heads)`. Empty sequences give zeros.
pub fn paged_attention_decode(
    q: &[f32],
    kv: &KvBlocks,
    block_tables: &[i32],
    seq_lens: &[i32],
    g: &PagedGeometry,
    scale: f32,
    out: &mut [f32],
) {
    let d = g.head_dim;
    let group = g.heads / g.kv_heads;
    for (s, &len) in seq_lens.iter().enumerate() {
        let len = len as usize;
        let rows: Vec<usize> = (0..len)
            .map(|p| block_tables[s * g.max_blocks + p / g.block_size] as usize * g.block_size + p % g.block_size)
            .collect();
        for h in 0..g.heads {
            let qh = &q[(s * g.heads + h) * d..][..d];
            let o = &mut out[(s * g.heads + h) * d..][..d];
            o.fill(0.0);
            if len == 0 {
                continue;
            }
            let kvh = h / group;
            let scores: Vec<f32> =
                rows.iter().map(|&r| (0..d).map(|i| qh[i] * scale * kv.get(false, r, kvh, i, g)).sum()).collect();
            let m = scores.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
            let e: Vec<f32> = scores.iter().map(|&x| (x - m).exp()).collect();
            let total: f32 = e.iter().sum();
            for (&r, &w) in rows.iter().zip(&e) {
                for (i, oi) in o.iter_mut().enumerate() {
                    *oi += w / total * kv.get(true, r, kvh, i, g);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One position: attention returns that position's V row whatever the scores.
    #[test]
    fn a_single_position_returns_its_value_row() {
        let g = PagedGeometry { heads: 2, kv_heads: 1, head_dim: 2, block_size: 2, max_blocks: 1 };
        // Pool of 2 blocks; the sequence's only position lives in block 1, slot 0 (row 2).
        let k = [0.0; 8];
        let mut v = [0.0f32; 8];
        v[4] = 3.0;
        v[5] = -1.0;
        let mut out = [9.0; 4];
        paged_attention_decode(&[1.0, 2.0, 3.0, 4.0], &KvBlocks::F32 { k: &k, v: &v }, &[1], &[1], &g, 1.0, &mut out);
        assert_eq!(out, [3.0, -1.0, 3.0, -1.0]);
    }
}
