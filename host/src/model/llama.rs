//! Llama-architecture decoder (RMSNorm, RoPE, grouped-query attention, SwiGLU, optional tied
//! embeddings), run as one batched pass over an arbitrary mix of tokens from many sequences.

use kernels::cpu::activation::silu_mul;
use kernels::cpu::matmul::matmul_t;
use kernels::cpu::norm::rms_norm;
use kernels::cpu::rope::Rope;
use kernels::cpu::softmax::softmax_in_place;
use rayon::prelude::*;

use super::config::ModelConfig;
use super::error::LoadError;
use super::kv::{BatchRow, CacheLayout, KvCache, LayerKvShape};
use super::LanguageModel;
use super::linear::Linear;
use super::source::WeightSource;
use super::tensor::Tensor;

struct Layer {
    attn_norm: Tensor,
    q: Linear,
    k: Linear,
    v: Linear,
    o: Linear,
    ffn_norm: Tensor,
    gate: Linear,
    up: Linear,
    down: Linear,
}

pub struct LlamaModel {
    cfg: ModelConfig,
    embed: Tensor,
    layers: Vec<Layer>,
    norm: Tensor,
    /// `None` when the output projection is tied to the embedding matrix.
    lm_head: Option<Linear>,
    rope: Rope,
}

impl LlamaModel {
    pub fn load(cfg: ModelConfig, src: &dyn WeightSource) -> Result<Self, LoadError> {
        let (d, hd) = (cfg.hidden_size, cfg.head_dim);
        // Linear layers by module name: dense, or kept packed when the checkpoint is quantized.
        let dense = |name: &str, rows: usize, cols: usize| src.linear(name.strip_suffix(".weight").unwrap_or(name), rows, cols);
        let embed = src.load("model.embed_tokens.weight", &[cfg.vocab_size, d])?;
        let mut layers = Vec::with_capacity(cfg.num_layers());
        for i in 0..cfg.num_layers() {
            let p = format!("model.layers.{i}");
            layers.push(Layer {
                attn_norm: src.load(&format!("{p}.input_layernorm.weight"), &[d])?,
                q: dense(&format!("{p}.self_attn.q_proj.weight"), cfg.num_heads * hd, d)?,
                k: dense(&format!("{p}.self_attn.k_proj.weight"), cfg.num_kv_heads * hd, d)?,
                v: dense(&format!("{p}.self_attn.v_proj.weight"), cfg.num_kv_heads * hd, d)?,
                o: dense(&format!("{p}.self_attn.o_proj.weight"), d, cfg.num_heads * hd)?,
                ffn_norm: src.load(&format!("{p}.post_attention_layernorm.weight"), &[d])?,
                gate: dense(&format!("{p}.mlp.gate_proj.weight"), cfg.intermediate_size, d)?,
                up: dense(&format!("{p}.mlp.up_proj.weight"), cfg.intermediate_size, d)?,
                down: dense(&format!("{p}.mlp.down_proj.weight"), d, cfg.intermediate_size)?,
            });
            tracing::debug!(layer = i, of = cfg.num_layers(), "loaded layer");
        }
        let norm = src.load("model.norm.weight", &[d])?;
        let lm_head = if cfg.tie_word_embeddings && !src.contains("lm_head.weight") {
            None
        } else {
            Some(dense("lm_head.weight", cfg.vocab_size, d)?)
        };
        let rope = Rope::new(hd, cfg.rope_theta);
        Ok(Self { cfg, embed, layers, norm, lm_head, rope })
    }

}

impl LanguageModel for LlamaModel {
    fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    fn cache_layout(&self) -> CacheLayout {
        CacheLayout::uniform(self.cfg.num_layers(), LayerKvShape::heads(self.cfg.num_kv_heads, self.cfg.head_dim))
    }

    fn forward(&self, tokens: &[u32], rows: &[BatchRow], kv: &mut dyn KvCache, logit_rows: &[usize]) -> Vec<f32> {
        let cfg = &self.cfg;
        let (n, d, hd) = (tokens.len(), cfg.hidden_size, cfg.head_dim);
        assert_eq!(n, rows.len(), "forward: one BatchRow per token");
        let embed = self.embed.as_slice();
        let mut hidden = vec![0.0f32; n * d];
        for (h, &t) in hidden.chunks_exact_mut(d).zip(tokens) {
            let t = t as usize;
            assert!(t < cfg.vocab_size, "token id {t} out of range");
            h.copy_from_slice(&embed[t * d..(t + 1) * d]);
        }
        let mut normed = vec![0.0f32; n * d];
        for (li, layer) in self.layers.iter().enumerate() {
            rms_norm(&hidden, layer.attn_norm.as_slice(), cfg.rms_norm_eps, &mut normed);
            let mut q = layer.q.forward(&normed, n);
            let mut k = layer.k.forward(&normed, n);
            let v = layer.v.forward(&normed, n);
            let (qw, kw) = (cfg.num_heads * hd, cfg.num_kv_heads * hd);
            q.par_chunks_mut(qw).zip(k.par_chunks_mut(kw)).zip(rows.par_iter()).for_each(|((qr, kr), row)| {
                self.rope.apply(qr, hd, row.pos);
                self.rope.apply(kr, hd, row.pos);
            });
            for (i, row) in rows.iter().enumerate() {
                kv.write(li, row.seq, row.pos, &k[i * kw..(i + 1) * kw], &v[i * kw..(i + 1) * kw]);
            }
            let attn = self.attention(li, &q, rows, &*kv);
            let o = layer.o.forward(&attn, n);
            for (h, a) in hidden.iter_mut().zip(&o) {
                *h += a;
            }
            rms_norm(&hidden, layer.ffn_norm.as_slice(), cfg.rms_norm_eps, &mut normed);
            let gate = layer.gate.forward(&normed, n);
            let up = layer.up.forward(&normed, n);
            let mut act = vec![0.0f32; gate.len()];
            silu_mul(&gate, &up, &mut act);
            let down = layer.down.forward(&act, n);
            for (h, a) in hidden.iter_mut().zip(&down) {
                *h += a;
            }
        }
        // Only the requested rows go through the final norm and the (large) vocabulary projection.
        let mut picked = Vec::with_capacity(logit_rows.len() * d);
        for &r in logit_rows {
            picked.extend_from_slice(&hidden[r * d..(r + 1) * d]);
        }
        let mut final_normed = vec![0.0f32; picked.len()];
        rms_norm(&picked, self.norm.as_slice(), cfg.rms_norm_eps, &mut final_normed);
        match &self.lm_head {
            Some(head) => head.forward(&final_normed, logit_rows.len()),
            None => {
                let mut logits = vec![0.0f32; logit_rows.len() * cfg.vocab_size];
                matmul_t(&final_normed, embed, &mut logits, logit_rows.len(), d, cfg.vocab_size);
                logits
            }
        }
    }

}

impl LlamaModel {
    /// Causal softmax attention of every (row, head) over its sequence's cached positions `0..=pos`.
    fn attention(&self, layer: usize, q: &[f32], rows: &[BatchRow], kv: &dyn KvCache) -> Vec<f32> {
        let cfg = &self.cfg;
        let hd = cfg.head_dim;
        let heads = cfg.num_heads;
        let group = cfg.num_heads / cfg.num_kv_heads;
        let scale = 1.0 / (hd as f32).sqrt();
        let mut out = vec![0.0f32; q.len()];
        out.par_chunks_mut(hd).enumerate().for_each(|(idx, o)| {
            let (r, h) = (idx / heads, idx % heads);
            let row = rows[r];
            let kvh = h / group;
            let qh = &q[r * heads * hd + h * hd..r * heads * hd + (h + 1) * hd];
            let mut scores: Vec<f32> =
                (0..=row.pos).map(|p| kv.key(layer, row.seq, p).dot_head(kvh, hd, qh) * scale).collect();
            softmax_in_place(&mut scores);
            o.fill(0.0);
            for (p, &w) in scores.iter().enumerate() {
                kv.value(layer, row.seq, p).axpy_head(kvh, hd, w, o);
            }
        });
        out
    }
}
