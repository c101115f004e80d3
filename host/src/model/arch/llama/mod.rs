//! Llama-architecture decoder (RMSNorm, RoPE, grouped-query attention, SwiGLU, optional tied
//! embeddings), run as one batched pass over an arbitrary mix of tokens from many sequences.
//!
//! One `LlamaModel` can also be one tensor-parallel rank's part of the model (see
//! docs/sharding.md): q/k/v/gate/up keep a range of output rows (whole heads, a slice of the
//! intermediate size), o/down the matching input columns, followed by an all-reduce; the
//! embedding and the output projection are split by vocabulary. With one rank every range is
//! the whole tensor and every collective is a no-op, so the single-device model is the same code.

pub mod device;
pub mod parallel;

use kernels::cpu::activation::silu_mul;
use kernels::cpu::matmul::matmul_t;
use kernels::cpu::norm::rms_norm;
use kernels::cpu::rope::Rope;
use kernels::cpu::softmax::softmax_in_place;
use rayon::prelude::*;
use std::sync::RwLock;

use crate::model::shard::even_range;
use crate::model::shard::Split;
use crate::parallel::{Collective, CollectiveError, LocalCollective};

use crate::model::config::ModelConfig;
use crate::model::device::placement::Placeable;
use crate::model::error::LoadError;
use crate::model::format::source::WeightSource;
use crate::model::kv::{BatchRow, CacheLayout, KvCache, LayerKvShape};
use crate::model::layers::decoder::{add_residual, final_norm_rows};
use crate::model::layers::linear::Linear;
use crate::model::registry::ArchitectureSpec;
use crate::model::tensor::Tensor;
use crate::model::LanguageModel;
use crate::parallel::TpRank;

/// The registry's entry for Llama-family models (Llama 2/3, Mistral, SmolLM): whole or
/// tensor-parallel ([`parallel::TensorParallel`]); on devices through [`device`].
pub struct Llama;

impl ArchitectureSpec for Llama {
    fn name(&self) -> &'static str {
        "Llama"
    }

    fn load(&self, cfg: ModelConfig, src: &dyn WeightSource) -> Result<Box<dyn LanguageModel>, LoadError> {
        Ok(Box::new(LlamaModel::load(cfg, src)?))
    }

    fn load_tensor_parallel(
        &self,
        cfg: ModelConfig,
        src: &dyn WeightSource,
        tp: usize,
    ) -> Result<Box<dyn LanguageModel>, LoadError> {
        Ok(Box::new(parallel::TensorParallel::load(cfg, src, tp)?))
    }
}

/// Fields are visible to the sibling `arch::llama::device`, which uploads these same weights.
pub(super) struct Layer {
    pub(super) attn_norm: Tensor,
    pub(super) q: Linear,
    pub(super) k: Linear,
    pub(super) v: Linear,
    pub(super) o: Linear,
    pub(super) ffn_norm: Tensor,
    pub(super) gate: Linear,
    pub(super) up: Linear,
    pub(super) down: Linear,
}

/// The cache a rank's forward pass works on: shared by all ranks of a batch, each writing and
/// reading only its own cache layers (`layer * tp + rank`), so writes take the lock briefly and
/// attention reads run concurrently.
pub type SharedKv<'a> = RwLock<&'a mut dyn KvCache>;

pub struct LlamaModel {
    pub(super) cfg: ModelConfig,
    pub(super) tp: TpRank,
    /// Attention and key/value heads this rank computes.
    pub(super) heads: usize,
    pub(super) kv_heads: usize,
    /// The vocabulary rows of the embedding (and untied output projection) this rank holds.
    pub(super) vocab: std::ops::Range<usize>,
    /// This rank's vocabulary rows of the embedding matrix.
    pub(super) embed: Tensor,
    pub(super) layers: Vec<Layer>,
    pub(super) norm: Tensor,
    /// `None` when the output projection is tied to the embedding matrix.
    pub(super) lm_head: Option<Linear>,
    pub(super) rope: Rope,
}

impl LlamaModel {
    pub fn load(cfg: ModelConfig, src: &dyn WeightSource) -> Result<Self, LoadError> {
        Self::load_rank(cfg, src, TpRank::SINGLE)
    }

    /// Loads only tensor-parallel rank `tp.rank`'s part of every weight. Attention heads and
    /// key/value heads must divide evenly (a rank owns the KV heads its query heads read); the
    /// intermediate size and the vocabulary may split unevenly.
    pub fn load_rank(cfg: ModelConfig, src: &dyn WeightSource, tp: TpRank) -> Result<Self, LoadError> {
        let (d, hd) = (cfg.hidden_size, cfg.head_dim);
        let main_file = src.file_of("model.embed_tokens.weight");
        if tp.size == 0 || tp.rank >= tp.size {
            return Err(LoadError::Config {
                file: main_file,
                detail: format!("tensor-parallel rank {} of {}", tp.rank, tp.size),
            });
        }
        if !cfg.num_heads.is_multiple_of(tp.size) {
            return Err(LoadError::Config {
                file: main_file,
                detail: format!(
                    "tensor parallel size {} does not divide the {} attention heads",
                    tp.size, cfg.num_heads
                ),
            });
        }
        let heads = cfg.num_heads / tp.size;
        // Key/value heads split like the query heads; with fewer KV heads than ranks each KV head
        // is replicated on the ranks whose query heads read it (as vLLM does).
        let (kv_heads, kv_first) = if cfg.num_kv_heads.is_multiple_of(tp.size) {
            let kv = cfg.num_kv_heads / tp.size;
            (kv, tp.rank * kv)
        } else if tp.size.is_multiple_of(cfg.num_kv_heads) {
            (1, tp.rank * cfg.num_kv_heads / tp.size)
        } else {
            return Err(LoadError::Config {
                file: main_file,
                detail: format!(
                    "tensor parallel size {} neither divides nor is a multiple of the {} key/value heads",
                    tp.size, cfg.num_kv_heads
                ),
            });
        };
        let q_rows = Split::Rows(tp.rank * heads * hd..(tp.rank + 1) * heads * hd);
        let kv_rows = Split::Rows(kv_first * hd..(kv_first + kv_heads) * hd);
        let o_cols = Split::Cols(tp.rank * heads * hd..(tp.rank + 1) * heads * hd);
        let inter = even_range(cfg.intermediate_size, tp.size, tp.rank);
        let vocab = even_range(cfg.vocab_size, tp.size, tp.rank);
        // Linear layers by module name: dense, or kept packed when the checkpoint is quantized.
        let linear = |name: &str, rows: usize, cols: usize, split: &Split| {
            src.linear_split(name.strip_suffix(".weight").unwrap_or(name), rows, cols, split)
        };
        let embed = src.load_split("model.embed_tokens.weight", &[cfg.vocab_size, d], &Split::Rows(vocab.clone()))?;
        let mut layers = Vec::with_capacity(cfg.num_layers());
        for i in 0..cfg.num_layers() {
            let p = format!("model.layers.{i}");
            let (inter_rows, inter_cols) = (Split::Rows(inter.clone()), Split::Cols(inter.clone()));
            layers.push(Layer {
                attn_norm: src.load(&format!("{p}.input_layernorm.weight"), &[d])?,
                q: linear(&format!("{p}.self_attn.q_proj.weight"), cfg.num_heads * hd, d, &q_rows)?,
                k: linear(&format!("{p}.self_attn.k_proj.weight"), cfg.num_kv_heads * hd, d, &kv_rows)?,
                v: linear(&format!("{p}.self_attn.v_proj.weight"), cfg.num_kv_heads * hd, d, &kv_rows)?,
                o: linear(&format!("{p}.self_attn.o_proj.weight"), d, cfg.num_heads * hd, &o_cols)?,
                ffn_norm: src.load(&format!("{p}.post_attention_layernorm.weight"), &[d])?,
                gate: linear(&format!("{p}.mlp.gate_proj.weight"), cfg.intermediate_size, d, &inter_rows)?,
                up: linear(&format!("{p}.mlp.up_proj.weight"), cfg.intermediate_size, d, &inter_rows)?,
                down: linear(&format!("{p}.mlp.down_proj.weight"), d, cfg.intermediate_size, &inter_cols)?,
            });
            tracing::debug!(layer = i, of = cfg.num_layers(), tp_rank = tp.rank, "loaded layer");
        }
        let norm = src.load("model.norm.weight", &[d])?;
        let lm_head = if !cfg.tie_word_embeddings || src.contains("lm_head.weight") {
            Some(linear("lm_head.weight", cfg.vocab_size, d, &Split::Rows(vocab.clone()))?)
        } else if src.keeps_packed("model.embed_tokens.weight") {
            // Tied to a quantized embedding (GGUF Q8_0, ...): the logits are multiplied from its
            // packed codes, as llama.cpp does, rather than from the dense copy the lookups use
            // (the largest single weight read per token in a small model). A tensor that could
            // not stay packed after all would only be a second dense copy: the embedding serves.
            match linear("model.embed_tokens.weight", cfg.vocab_size, d, &Split::Rows(vocab.clone()))? {
                Linear::Dense(_) => None,
                packed => Some(packed),
            }
        } else {
            None
        };
        let rope = Rope::new(hd, cfg.rope_theta);
        Ok(Self { cfg, tp, heads, kv_heads, vocab, embed, layers, norm, lm_head, rope })
    }

    pub fn tp_rank(&self) -> TpRank {
        self.tp
    }

    /// Values per token per cache layer this rank writes (its KV heads × head size).
    pub fn cache_width(&self) -> usize {
        self.kv_heads * self.cfg.head_dim
    }
}

impl LanguageModel for LlamaModel {
    fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    /// The cache this rank works on. Ranks of a tensor-parallel group share one cache, each
    /// writing its own KV heads into its own layers (`layer * tp + rank`), so the shared layout
    /// has `tp` times the layers, each as wide as this rank's KV heads (all ranks hold the same
    /// number). With one rank this is the plain per-layer layout.
    fn cache_layout(&self) -> CacheLayout {
        CacheLayout::uniform(
            self.cfg.num_layers() * self.tp.size,
            LayerKvShape::heads(self.kv_heads, self.cfg.head_dim),
        )
    }

    /// A rank of a tensor-parallel group moves too: the device forward runs it with its peers.
    fn device_form(&self) -> Option<&dyn Placeable> {
        Some(self)
    }

    /// Single-device forward. A rank of a larger group runs only through
    /// [`LlamaModel::forward_rank`] (the [`parallel::TensorParallel`] wrapper does that), since
    /// it needs its peers to produce anything.
    fn forward(&self, tokens: &[u32], rows: &[BatchRow], kv: &mut dyn KvCache, logit_rows: &[usize]) -> Vec<f32> {
        assert_eq!(
            self.tp.size, 1,
            "LlamaModel::forward on one tensor-parallel rank; use arch::llama::parallel::TensorParallel"
        );
        crate::model::on_compute_pool(|| {
            let comm = LocalCollective::group(1).pop().expect("one rank");
            self.forward_rank(tokens, rows, &RwLock::new(kv), logit_rows, &comm)
                .expect("a one-rank group has no peer to fail")
        })
    }
}

impl LlamaModel {
    /// This rank's part of the forward pass: every rank of the TP group calls it with the same
    /// batch and its own handle on the group's communicator; all of them return the full logits.
    pub fn forward_rank<C: Collective>(
        &self,
        tokens: &[u32],
        rows: &[BatchRow],
        kv: &SharedKv<'_>,
        logit_rows: &[usize],
        comm: &C,
    ) -> Result<Vec<f32>, CollectiveError> {
        let cfg = &self.cfg;
        let (n, d, hd) = (tokens.len(), cfg.hidden_size, cfg.head_dim);
        assert_eq!(n, rows.len(), "forward: one BatchRow per token");
        // Vocabulary-split embedding: each rank fills the rows of the tokens it holds, the others
        // stay zero, and the sum over ranks is exact (x + 0 = x).
        let embed = self.embed.as_slice();
        let mut hidden = vec![0.0f32; n * d];
        for (h, &t) in hidden.chunks_exact_mut(d).zip(tokens) {
            let t = t as usize;
            assert!(t < cfg.vocab_size, "token id {t} out of range");
            if self.vocab.contains(&t) {
                let local = t - self.vocab.start;
                h.copy_from_slice(&embed[local * d..(local + 1) * d]);
            }
        }
        comm.all_reduce_sum(&mut hidden)?;
        let mut normed = vec![0.0f32; n * d];
        for (li, layer) in self.layers.iter().enumerate() {
            let cache_layer = li * self.tp.size + self.tp.rank;
            rms_norm(&hidden, layer.attn_norm.as_slice(), cfg.rms_norm_eps, &mut normed);
            let mut q = layer.q.forward(&normed, n);
            let mut k = layer.k.forward(&normed, n);
            let v = layer.v.forward(&normed, n);
            let (qw, kw) = (self.heads * hd, self.kv_heads * hd);
            q.par_chunks_mut(qw).zip(k.par_chunks_mut(kw)).zip(rows.par_iter()).for_each(|((qr, kr), row)| {
                self.rope.apply(qr, hd, row.pos);
                self.rope.apply(kr, hd, row.pos);
            });
            {
                let mut cache = kv.write().unwrap_or_else(|e| e.into_inner());
                for (i, row) in rows.iter().enumerate() {
                    cache.write(cache_layer, row.seq, row.pos, &k[i * kw..(i + 1) * kw], &v[i * kw..(i + 1) * kw]);
                }
            }
            let attn = {
                let cache = kv.read().unwrap_or_else(|e| e.into_inner());
                self.attention(cache_layer, &q, rows, &**cache)
            };
            // Row-parallel output projection: each rank's partial sum over its heads, then the sum.
            let mut o = layer.o.forward(&attn, n);
            comm.all_reduce_sum(&mut o)?;
            add_residual(&mut hidden, &o);
            rms_norm(&hidden, layer.ffn_norm.as_slice(), cfg.rms_norm_eps, &mut normed);
            let gate = layer.gate.forward(&normed, n);
            let up = layer.up.forward(&normed, n);
            let mut act = vec![0.0f32; gate.len()];
            silu_mul(&gate, &up, &mut act);
            let mut down = layer.down.forward(&act, n);
            comm.all_reduce_sum(&mut down)?;
            add_residual(&mut hidden, &down);
        }
        let m = logit_rows.len();
        let final_normed = final_norm_rows(&hidden, d, logit_rows, self.norm.as_slice(), cfg.rms_norm_eps);
        let local = match &self.lm_head {
            Some(head) => head.forward(&final_normed, m),
            None => {
                let mut logits = vec![0.0f32; m * self.vocab.len()];
                matmul_t(&final_normed, embed, &mut logits, m, d, self.vocab.len());
                logits
            }
        };
        if self.tp.size == 1 {
            return Ok(local);
        }
        self.gather_logits(&local, m, comm)
    }

    /// Assembles every rank's vocabulary columns into full `m × vocab` logits. Ranks may hold
    /// one row more than others, so each pads its part to the largest before the all-gather.
    fn gather_logits<C: Collective>(&self, local: &[f32], m: usize, comm: &C) -> Result<Vec<f32>, CollectiveError> {
        let (vocab, size) = (self.cfg.vocab_size, self.tp.size);
        let widest = even_range(vocab, size, 0).len();
        let mine = self.vocab.len();
        let mut padded = vec![0.0f32; m * widest];
        for (dst, src) in padded.chunks_exact_mut(widest).zip(local.chunks_exact(mine.max(1))) {
            dst[..mine].copy_from_slice(src);
        }
        let mut gathered = vec![0.0f32; size * m * widest];
        comm.all_gather(&padded, &mut gathered)?;
        let mut logits = vec![0.0f32; m * vocab];
        for r in 0..size {
            let part = even_range(vocab, size, r);
            for i in 0..m {
                let src = &gathered[(r * m + i) * widest..(r * m + i) * widest + part.len()];
                logits[i * vocab + part.start..i * vocab + part.end].copy_from_slice(src);
            }
        }
        Ok(logits)
    }
}

impl LlamaModel {
    /// Causal softmax attention of every (row, head) over its sequence's cached positions `0..=pos`.
    fn attention(&self, layer: usize, q: &[f32], rows: &[BatchRow], kv: &dyn KvCache) -> Vec<f32> {
        let cfg = &self.cfg;
        let hd = cfg.head_dim;
        let heads = self.heads;
        let group = self.heads / self.kv_heads;
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
