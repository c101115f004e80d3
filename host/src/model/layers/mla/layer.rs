//! One MLA attention layer (transformers `DeepseekV3Attention`, Kimi `KimiLinearAttention`):
//!
//! ```text
//! q            = q_b_proj(RMSNorm(q_a_proj x))  |  q_proj x            → heads × (nope | rope)
//! [c_kv|k_rope]= kv_a_proj_with_mqa x ;  c_kv = kv_a_layernorm(c_kv)    (k_rope: one shared head)
//! RoPE on q_rope and k_rope (not for NoPE)
//! cache row    = key: c_kv (kv_lora_rank), value: k_rope (qk_rope_head_dim)
//! o            = attention (absorbed form, see absorb.rs) [· sigmoid(g_proj x) if gated]
//! out          = o_proj(o)
//! ```
//! The latent and the rotary key are kept as the cache's key and value rows (rather than one
//! concatenated row) so an FP8 pool gives each its own scale: they differ in magnitude.

use kernels::cpu::norm::rms_norm;
use rayon::prelude::*;

use crate::model::error::LoadError;
use crate::model::format::source::WeightSource;
use crate::model::kv::{BatchRow, KvCache, LayerKvShape};
use crate::model::layers::linear::Linear;
use crate::model::layers::mla::absorb::Absorbed;
use crate::model::layers::mla::config::MlaConfig;
use crate::model::layers::mla::rope::MlaRotary;
use crate::model::shard::Split;
use crate::model::tensor::Tensor;

pub(crate) enum QPath {
    Plain(Linear),
    LowRank { a: Linear, norm: Tensor, b: Linear },
}

// Crate-visible fields: the device forward (model/device/decoder) uploads them.
pub struct MlaLayer {
    pub(crate) cfg: MlaConfig,
    pub(crate) q: QPath,
    pub(crate) kv_a: Linear,
    pub(crate) kv_a_norm: Tensor,
    pub(crate) absorbed: Absorbed,
    pub(crate) gate: Option<Linear>,
    pub(crate) o: Linear,
    pub(crate) rotary: Option<MlaRotary>,
    pub(crate) scale: f32,
}

impl MlaLayer {
    /// Loads `{prefix}.q_a_proj / q_a_layernorm / q_b_proj` (or `q_proj`), `kv_a_proj_with_mqa`,
    /// `kv_a_layernorm`, `kv_b_proj`, `o_proj` and, when gated, `g_proj` — e.g. prefix
    /// `model.layers.3.self_attn`. `kv_b_proj` must be dense (it is split per head for the
    /// absorbed form); the other projections may be stored in any format `WeightSource` keeps.
    pub fn load(cfg: &MlaConfig, src: &dyn WeightSource, prefix: &str) -> Result<Self, LoadError> {
        Self::load_heads(cfg, src, prefix, 0, 1)
    }

    /// A tensor-parallel rank's part: heads `rank * h/size ..` of `size` equal groups (`size`
    /// must divide the heads). The per-head projections (`q_b_proj`/`q_proj`, `kv_b_proj`,
    /// `g_proj`) keep their rows, `o_proj` its columns, so `forward` returns this rank's partial
    /// `o_proj` output, to be summed over the ranks. The latent path (`q_a_proj`,
    /// `kv_a_proj_with_mqa`, norms) is shared by all heads and loaded whole: every rank caches
    /// the same latent rows.
    pub fn load_heads(
        cfg: &MlaConfig,
        src: &dyn WeightSource,
        prefix: &str,
        rank: usize,
        size: usize,
    ) -> Result<Self, LoadError> {
        if size == 0 || rank >= size || !cfg.num_heads.is_multiple_of(size) {
            return Err(LoadError::Config {
                file: src.file_of(&format!("{prefix}.kv_b_proj.weight")),
                detail: format!(
                    "tensor-parallel rank {rank} of {size} over {} MLA heads (the size must divide the heads)",
                    cfg.num_heads
                ),
            });
        }
        let full = cfg;
        let local = MlaConfig { num_heads: cfg.num_heads / size, ..cfg.clone() };
        let cfg = &local;
        let heads = rank * cfg.num_heads..(rank + 1) * cfg.num_heads;
        // Rows (or columns) of a per-head matrix of `per_head` features per head for this rank.
        let part = |per_head: usize| heads.start * per_head..heads.end * per_head;
        let rows = |per_head: usize| if size == 1 { Split::Full } else { Split::Rows(part(per_head)) };
        let d = cfg.hidden_size;
        let (h, lora, nope, rope, v) =
            (cfg.num_heads, cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim);
        let q = match cfg.q_lora_rank {
            None => QPath::Plain(src.linear_split(
                &format!("{prefix}.q_proj"),
                full.q_width(),
                d,
                &rows(cfg.qk_head_dim()),
            )?),
            Some(r) => QPath::LowRank {
                a: src.linear(&format!("{prefix}.q_a_proj"), r, d)?,
                norm: src.load(&format!("{prefix}.q_a_layernorm.weight"), &[r])?,
                b: src.linear_split(&format!("{prefix}.q_b_proj"), full.q_width(), r, &rows(cfg.qk_head_dim()))?,
            },
        };
        let kv_b = src.load_split(
            &format!("{prefix}.kv_b_proj.weight"),
            &[full.num_heads * (nope + v), lora],
            &rows(nope + v),
        )?;
        let layer = Self {
            q,
            kv_a: src.linear(&format!("{prefix}.kv_a_proj_with_mqa"), lora + rope, d)?,
            kv_a_norm: src.load(&format!("{prefix}.kv_a_layernorm.weight"), &[lora])?,
            absorbed: Absorbed::new(kv_b.as_slice(), h, nope, rope, v, lora),
            gate: if cfg.output_gate {
                Some(src.linear_split(&format!("{prefix}.g_proj"), full.num_heads * v, d, &rows(v))?)
            } else {
                None
            },
            o: src.linear_split(
                &format!("{prefix}.o_proj"),
                d,
                full.num_heads * v,
                &if size == 1 { Split::Full } else { Split::Cols(part(v)) },
            )?,
            rotary: cfg.rope.as_ref().map(|r| MlaRotary::new(r, rope)),
            scale: cfg.softmax_scale(),
            cfg: cfg.clone(),
        };
        tracing::debug!(
            prefix,
            heads = h,
            kv_lora = lora,
            rope = layer.rotary.is_some(),
            gated = cfg.output_gate,
            "loaded MLA layer"
        );
        Ok(layer)
    }

    pub fn config(&self) -> &MlaConfig {
        &self.cfg
    }

    /// What this layer caches per token: the latent (key row) and the rotary key (value row).
    pub fn cache_shape(&self) -> LayerKvShape {
        LayerKvShape { key_width: self.cfg.kv_lora_rank, value_width: self.cfg.qk_rope_head_dim, groups: 1 }
    }

    /// `x`: the normed hidden states, one row of `hidden_size` per entry of `rows`. Writes each
    /// row's latent into `kv` at (`layer_index`, seq, pos), attends over positions `0..=pos` of
    /// its sequence and returns `rows.len() × hidden_size` (the `o_proj` output).
    pub fn forward(&self, x: &[f32], rows: &[BatchRow], kv: &mut dyn KvCache, layer_index: usize) -> Vec<f32> {
        let cfg = &self.cfg;
        let n = rows.len();
        assert_eq!(x.len(), n * cfg.hidden_size, "MLA: input is not {n} rows of {}", cfg.hidden_size);
        let (lora, nope, rope) = (cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim);
        let mut q = match &self.q {
            QPath::Plain(p) => p.forward(x, n),
            QPath::LowRank { a, norm, b } => {
                let qa = a.forward(x, n);
                let mut normed = vec![0.0f32; qa.len()];
                rms_norm(&qa, norm.as_slice(), cfg.lora_norm_eps, &mut normed);
                b.forward(&normed, n)
            }
        };
        let mut ckv = self.kv_a.forward(x, n);
        let qk = nope + rope;
        q.par_chunks_mut(cfg.q_width()).zip(ckv.par_chunks_mut(lora + rope)).zip(rows.par_iter()).for_each(
            |((qr, cr), row)| {
                let (c, k_rope) = cr.split_at_mut(lora);
                let raw = c.to_vec();
                rms_norm(&raw, self.kv_a_norm.as_slice(), cfg.lora_norm_eps, c);
                if let Some(rot) = &self.rotary {
                    rot.apply(k_rope, row.pos);
                    for head in qr.chunks_exact_mut(qk) {
                        rot.apply(&mut head[nope..], row.pos);
                    }
                }
            },
        );
        for (cr, row) in ckv.chunks_exact(lora + rope).zip(rows) {
            let (c, k_rope) = cr.split_at(lora);
            kv.write(layer_index, row.seq, row.pos, c, k_rope);
        }
        let mut attn = self.absorbed.attend(layer_index, &q, rows, &*kv, self.scale);
        if let Some(g) = &self.gate {
            let gv = g.forward(x, n);
            for (a, &gi) in attn.iter_mut().zip(&gv) {
                *a *= 1.0 / (1.0 + (-gi).exp());
            }
        }
        self.o.forward(&attn, n)
    }
}
