//! MLA attention over the compressed latent cache, in DeepSeek's "absorbed" form.
//!
//! Per head h, `kv_b_proj` expands a cached latent `c` (kv_lora_rank) into a no-RoPE key
//! `W_uk[h]·c` and a value `W_uv[h]·c`. Instead of expanding every cached position, the key
//! matrix is folded into the query and the value matrix applied after the weighted sum:
//!
//! ```text
//! q_nope·(W_uk c_s) = (W_ukᵀ q_nope)·c_s           score_s = scale·(q_lat·c_s + q_rope·k_rope_s)
//! Σ_s p_s (W_uv c_s) = W_uv (Σ_s p_s c_s)           out     = W_uv · ctx
//! ```
//!
//! Why it is cheaper: expanding costs `kv_lora × heads × (nope + v)` multiply-adds per cached
//! position per step (and would need a per-head key/value cache to avoid it); absorbed costs
//! `(nope + v) × kv_lora` per head once per query token, and each cached position then costs one
//! `kv_lora + rope` dot and axpy per head — the cache stays at `kv_lora + rope` floats a token.

use kernels::cpu::dot::dot;
use kernels::cpu::softmax::softmax_in_place;
use rayon::prelude::*;

use crate::model::kv::{BatchRow, KvCache};

/// `kv_b_proj` split per head into the key part `[nope][lora]` and value part `[v][lora]`.
pub struct Absorbed {
    heads: usize,
    nope: usize,
    rope: usize,
    v: usize,
    lora: usize,
    /// `[heads][nope][lora]`
    pub(crate) w_uk: Vec<f32>,
    /// `[heads][v][lora]`
    pub(crate) w_uv: Vec<f32>,
}

impl Absorbed {
    /// From `kv_b_proj.weight` `[heads·(nope+v), lora]` (transformers' row order: per head, the
    /// nope key rows then the value rows).
    pub fn new(kv_b: &[f32], heads: usize, nope: usize, rope: usize, v: usize, lora: usize) -> Self {
        assert_eq!(kv_b.len(), heads * (nope + v) * lora, "kv_b_proj size");
        let (mut w_uk, mut w_uv) = (Vec::with_capacity(heads * nope * lora), Vec::with_capacity(heads * v * lora));
        for h in 0..heads {
            let at = h * (nope + v) * lora;
            w_uk.extend_from_slice(&kv_b[at..at + nope * lora]);
            w_uv.extend_from_slice(&kv_b[at + nope * lora..at + (nope + v) * lora]);
        }
        Self { heads, nope, rope, v, lora, w_uk, w_uv }
    }

    /// Attention of every (row, head): `q` is `rows × heads × (nope + rope)` (rope part already
    /// rotated), the cache of `layer` holds per position the latent as its key row and the rotated
    /// shared `k_rope` as its value row. Returns `rows × heads × v`.
    pub fn attend(&self, layer: usize, q: &[f32], rows: &[BatchRow], kv: &dyn KvCache, scale: f32) -> Vec<f32> {
        let (heads, nope, rope, v, lora) = (self.heads, self.nope, self.rope, self.v, self.lora);
        let qk = nope + rope;
        let mut out = vec![0.0f32; rows.len() * heads * v];
        out.par_chunks_mut(v).enumerate().for_each(|(idx, o)| {
            let (r, h) = (idx / heads, idx % heads);
            let row = rows[r];
            let qh = &q[(r * heads + h) * qk..(r * heads + h + 1) * qk];
            let (q_nope, q_rope) = qh.split_at(nope);
            // q_lat = W_uk[h]ᵀ q_nope
            let mut q_lat = vec![0.0f32; lora];
            let uk = &self.w_uk[h * nope * lora..(h + 1) * nope * lora];
            for (i, &qi) in q_nope.iter().enumerate() {
                for (l, &w) in q_lat.iter_mut().zip(&uk[i * lora..(i + 1) * lora]) {
                    *l += qi * w;
                }
            }
            let mut scores: Vec<f32> = (0..=row.pos)
                .map(|p| {
                    let mut s = kv.key(layer, row.seq, p).dot_span(0, &q_lat);
                    if rope > 0 {
                        s += kv.value(layer, row.seq, p).dot_span(0, q_rope);
                    }
                    s * scale
                })
                .collect();
            softmax_in_place(&mut scores);
            let mut ctx = vec![0.0f32; lora];
            for (p, &w) in scores.iter().enumerate() {
                kv.key(layer, row.seq, p).axpy_span(0, w, &mut ctx);
            }
            let uv = &self.w_uv[h * v * lora..(h + 1) * v * lora];
            for (i, oi) in o.iter_mut().enumerate() {
                *oi = dot(&uv[i * lora..(i + 1) * lora], &ctx);
            }
        });
        out
    }
}
