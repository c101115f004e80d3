//! Kimi-Linear's full-attention layers: DeepSeek-style multi-head latent attention without RoPE
//! ("NoPE": `mla_use_nope`), as transformers' `KimiLinearAttention` computes it.
//!
//! ```text
//! q            = q_proj x  (or q_b(RMSNorm(q_a x)))        per head [nope | rot]
//! [c | k_rot]  = kv_a_proj_with_mqa x,  c = RMSNorm(c)     one shared latent row per token
//! k_h = [W_k,h c | k_rot],  v_h = W_v,h c                  W = kv_b_proj, per head [k | v] rows
//! ```
//! The cache keeps only `c` (key row) and `k_rot` (value row). Attention runs in latent space:
//! `q_nope·(W_k,h c) = (W_k,hᵀ q_nope)·c`, and the softmax-weighted latent is lifted by `W_v,h`
//! once per query, so no per-head keys or values are ever materialised.

use std::path::Path;

use kernels::cpu::norm::rms_norm;
use kernels::cpu::softmax::softmax_in_place;
use rayon::prelude::*;
use serde_json::Value;

use crate::model::error::LoadError;
use crate::model::kv::{BatchRow, KvCache, LayerKvShape};
use crate::model::linear::Linear;
use crate::model::source::WeightSource;
use crate::model::tensor::Tensor;

/// transformers builds the latent norms with their default eps, not the config's.
const LATENT_NORM_EPS: f32 = 1e-6;

#[derive(Clone, Debug, PartialEq)]
pub struct LatentAttentionConfig {
    pub hidden_size: usize,
    pub num_heads: usize,
    pub q_lora_rank: Option<usize>,
    pub kv_lora_rank: usize,
    pub qk_nope_head_dim: usize,
    pub qk_rope_head_dim: usize,
    pub v_head_dim: usize,
}

impl LatentAttentionConfig {
    pub fn from_hf_config(file: &Path, raw: &Value) -> Result<Self, LoadError> {
        let err = |detail: String| LoadError::Config { file: file.to_path_buf(), detail };
        let uint = |k: &str| raw.get(k).and_then(Value::as_u64).map(|v| v as usize).ok_or_else(|| err(format!("field '{k}' is missing or not an integer")));
        if raw.get("mla_use_nope").and_then(Value::as_bool) == Some(false) {
            return Err(err("Kimi-Linear latent attention with RoPE (mla_use_nope: false) is not supported".into()));
        }
        let q_lora_rank = match raw.get("q_lora_rank").filter(|v| !v.is_null()) {
            None => None,
            Some(v) => Some(v.as_u64().filter(|&r| r > 0).ok_or_else(|| err(format!("q_lora_rank must be a positive integer or null, got {v}")))? as usize),
        };
        let cfg = Self {
            hidden_size: uint("hidden_size")?,
            num_heads: uint("num_attention_heads")?,
            q_lora_rank,
            kv_lora_rank: uint("kv_lora_rank")?,
            qk_nope_head_dim: uint("qk_nope_head_dim")?,
            qk_rope_head_dim: uint("qk_rope_head_dim")?,
            v_head_dim: uint("v_head_dim")?,
        };
        if cfg.num_heads == 0 || cfg.kv_lora_rank == 0 || cfg.v_head_dim == 0 || cfg.qk_rope_head_dim == 0 {
            return Err(err(format!("zero-sized latent attention dimension in {cfg:?}")));
        }
        Ok(cfg)
    }

    fn qk_head_dim(&self) -> usize {
        self.qk_nope_head_dim + self.qk_rope_head_dim
    }

    /// What one token caches: the normed latent as the key row, the shared rot key as the value.
    pub fn kv_shape(&self) -> LayerKvShape {
        LayerKvShape { key_width: self.kv_lora_rank, value_width: self.qk_rope_head_dim, groups: 1 }
    }
}

enum Query {
    Direct(Linear),
    LowRank { a: Linear, norm: Tensor, b: Linear },
}

pub struct LatentAttention {
    cfg: LatentAttentionConfig,
    q: Query,
    kv_a: Linear,
    kv_a_norm: Tensor,
    /// `kv_b_proj`, `[heads · (nope + v)][kv_lora_rank]`, dense: read per head in latent space.
    kv_b: Tensor,
    o: Linear,
}

impl LatentAttention {
    /// Loads `{prefix}.q_proj` (or `q_a_proj`/`q_a_layernorm`/`q_b_proj`), `kv_a_proj_with_mqa`,
    /// `kv_a_layernorm`, `kv_b_proj`, `o_proj`.
    pub fn load(cfg: LatentAttentionConfig, src: &dyn WeightSource, prefix: &str) -> Result<Self, LoadError> {
        let (d, h, r) = (cfg.hidden_size, cfg.num_heads, cfg.kv_lora_rank);
        let lin = |name: &str, rows, cols| src.linear(&format!("{prefix}.{name}"), rows, cols);
        let q_out = h * cfg.qk_head_dim();
        let q = match cfg.q_lora_rank {
            None => Query::Direct(lin("q_proj", q_out, d)?),
            Some(ql) => Query::LowRank { a: lin("q_a_proj", ql, d)?, norm: src.load(&format!("{prefix}.q_a_layernorm.weight"), &[ql])?, b: lin("q_b_proj", q_out, ql)? },
        };
        Ok(Self {
            q,
            kv_a: lin("kv_a_proj_with_mqa", r + cfg.qk_rope_head_dim, d)?,
            kv_a_norm: src.load(&format!("{prefix}.kv_a_layernorm.weight"), &[r])?,
            kv_b: src.load(&format!("{prefix}.kv_b_proj.weight"), &[h * (cfg.qk_nope_head_dim + cfg.v_head_dim), r])?,
            o: lin("o_proj", d, h * cfg.v_head_dim)?,
            cfg,
        })
    }

    /// Writes each row's latent to `kv` (layer `layer`) and returns the attention output rows.
    pub fn forward(&self, layer: usize, x: &[f32], rows: &[BatchRow], kv: &mut dyn KvCache) -> Vec<f32> {
        let cfg = &self.cfg;
        let (n, h, r, dr) = (rows.len(), cfg.num_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim);
        let (dn, dv, dq) = (cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.qk_head_dim());
        let q = match &self.q {
            Query::Direct(p) => p.forward(x, n),
            Query::LowRank { a, norm, b } => {
                let qa = a.forward(x, n);
                let mut normed = vec![0.0f32; qa.len()];
                rms_norm(&qa, norm.as_slice(), LATENT_NORM_EPS, &mut normed);
                b.forward(&normed, n)
            }
        };
        let ckv = self.kv_a.forward(x, n);
        let mut latent = vec![0.0f32; r];
        for (i, row) in rows.iter().enumerate() {
            let t = &ckv[i * (r + dr)..(i + 1) * (r + dr)];
            rms_norm(&t[..r], self.kv_a_norm.as_slice(), LATENT_NORM_EPS, &mut latent);
            kv.write(layer, row.seq, row.pos, &latent, &t[r..]);
        }
        let kv = &*kv;
        let w = self.kv_b.as_slice();
        let scale = 1.0 / (dq as f32).sqrt();
        let mut out = vec![0.0f32; n * h * dv];
        out.par_chunks_mut(dv).enumerate().for_each(|(idx, o)| {
            let (i, head) = (idx / h, idx % h);
            let row = rows[i];
            let qh = &q[i * h * dq + head * dq..i * h * dq + (head + 1) * dq];
            let (q_nope, q_rot) = qh.split_at(dn);
            let wk = &w[head * (dn + dv) * r..(head * (dn + dv) + dn) * r];
            let wv = &w[(head * (dn + dv) + dn) * r..(head + 1) * (dn + dv) * r];
            // q_nope lifted into latent space: W_kᵀ q_nope.
            let mut q_lat = vec![0.0f32; r];
            for (qi, wrow) in q_nope.iter().zip(wk.chunks_exact(r)) {
                for (l, &wv_) in q_lat.iter_mut().zip(wrow) {
                    *l += qi * wv_;
                }
            }
            let mut scores: Vec<f32> = (0..=row.pos)
                .map(|p| (kv.key(layer, row.seq, p).dot_span(0, &q_lat) + kv.value(layer, row.seq, p).dot_span(0, q_rot)) * scale)
                .collect();
            softmax_in_place(&mut scores);
            let mut o_lat = vec![0.0f32; r];
            for (p, &s) in scores.iter().enumerate() {
                kv.key(layer, row.seq, p).axpy_span(0, s, &mut o_lat);
            }
            for (ov, wrow) in o.iter_mut().zip(wv.chunks_exact(r)) {
                *ov = wrow.iter().zip(&o_lat).map(|(a, b)| a * b).sum();
            }
        });
        self.o.forward(&out, n)
    }
}
