//! The key/value cache interface the forward pass writes to and attends over.
//!
//! The model only says "sequence `s`, position `p`"; where those values live (one contiguous
//! buffer per sequence, or blocks of a shared paged pool, in f32 or FP8) is up to the cache.

use kernels::cpu::dot::dot;
use kernels::cpu::fp8::E4M3_TO_F32;

use crate::model::layers::kda::state::{OwnedStates, RecurrentStates, SequenceState};

/// Position of one token of a batch: which sequence of the batch it belongs to, and where.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BatchRow {
    pub seq: usize,
    pub pos: usize,
}

/// What one layer keeps per cached token: a key row and a value row of fixed widths, each
/// split into `groups` equal parts (one FP8 scale per part; for grouped-query attention a part is
/// one KV head). Latent attention stores its compressed latent here instead of per-head keys, so
/// the widths differ per layer and between key and value.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LayerKvShape {
    pub key_width: usize,
    pub value_width: usize,
    /// Scale groups of each row; `key_width` and `value_width` are multiples of it.
    pub groups: usize,
}

impl LayerKvShape {
    /// Grouped-query attention: `kv_heads` heads of `head_dim` for both keys and values.
    pub fn heads(kv_heads: usize, head_dim: usize) -> Self {
        Self { key_width: kv_heads * head_dim, value_width: kv_heads * head_dim, groups: kv_heads }
    }
}

/// What a model keeps per sequence: per layer, its per-token cache rows (`None` for layers that
/// keep none, such as linear-attention layers), plus fixed-size recurrent state.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CacheLayout {
    pub layers: Vec<Option<LayerKvShape>>,
    /// Bytes of recurrent (non-paged) state one sequence needs across all layers; 0 when the
    /// model has none. The engine budgets it beside the paged blocks.
    pub recurrent_bytes_per_seq: usize,
}

impl CacheLayout {
    /// Every layer the same grouped-query shape (Llama-style models).
    pub fn uniform(num_layers: usize, shape: LayerKvShape) -> Self {
        Self { layers: vec![Some(shape); num_layers], recurrent_bytes_per_seq: 0 }
    }

    pub fn num_layers(&self) -> usize {
        self.layers.len()
    }

    /// The cache of `ranks` devices that each keep their own part of every layer (replicated or
    /// head-split attention): layer `l` of rank `r` is cache layer `l * ranks + r`, and each
    /// rank's recurrent state is counted once per rank.
    pub fn per_rank(&self, ranks: usize) -> Self {
        let layers = self.layers.iter().flat_map(|l| std::iter::repeat_n(*l, ranks)).collect();
        Self { layers, recurrent_bytes_per_seq: self.recurrent_bytes_per_seq * ranks }
    }

    /// Cache floats (keys + values) one token takes over all layers.
    pub fn floats_per_token(&self) -> usize {
        self.layers.iter().flatten().map(|s| s.key_width + s.value_width).sum()
    }
}

/// One cached token's keys or values for a layer (`LayerKvShape::key_width` / `value_width`).
pub enum KvRow<'a> {
    F32(&'a [f32]),
    /// bf16 bit patterns.
    Bf16(&'a [u16]),
    /// E4M3 codes with one scale per group of `codes.len() / scales.len()` elements.
    Fp8 {
        codes: &'a [u8],
        scales: &'a [f32],
    },
}

impl KvRow<'_> {
    /// `q · row[start..start + q.len()]`.
    #[inline]
    pub fn dot_span(&self, start: usize, q: &[f32]) -> f32 {
        let r = start..start + q.len();
        match self {
            KvRow::F32(v) => dot(q, &v[r]),
            KvRow::Bf16(v) => v[r].iter().zip(q).map(|(&b, &x)| half::bf16::from_bits(b).to_f32() * x).sum(),
            KvRow::Fp8 { codes, scales } => {
                let group = codes.len() / scales.len();
                let mut total = 0.0;
                // Walk the span group by group so each partial sum is scaled once.
                let mut at = start;
                while at < r.end {
                    let g = at / group;
                    let end = ((g + 1) * group).min(r.end);
                    let s: f32 = codes[at..end]
                        .iter()
                        .zip(&q[at - start..end - start])
                        .map(|(&c, &x)| E4M3_TO_F32[c as usize] * x)
                        .sum();
                    total += s * scales[g];
                    at = end;
                }
                total
            }
        }
    }

    /// `out += w * row[start..start + out.len()]`.
    #[inline]
    pub fn axpy_span(&self, start: usize, w: f32, out: &mut [f32]) {
        let r = start..start + out.len();
        match self {
            KvRow::F32(v) => {
                for (o, &x) in out.iter_mut().zip(&v[r]) {
                    *o += w * x;
                }
            }
            KvRow::Bf16(v) => {
                for (o, &b) in out.iter_mut().zip(&v[r]) {
                    *o += w * half::bf16::from_bits(b).to_f32();
                }
            }
            KvRow::Fp8 { codes, scales } => {
                let group = codes.len() / scales.len();
                for (i, o) in r.zip(out.iter_mut()) {
                    *o += w * scales[i / group] * E4M3_TO_F32[codes[i] as usize];
                }
            }
        }
    }

    /// `q · row[head]` for rows made of equal heads of `head_dim`.
    #[inline]
    pub fn dot_head(&self, head: usize, head_dim: usize, q: &[f32]) -> f32 {
        self.dot_span(head * head_dim, &q[..head_dim])
    }

    /// `out += w * row[head]`.
    #[inline]
    pub fn axpy_head(&self, head: usize, head_dim: usize, w: f32, out: &mut [f32]) {
        self.axpy_span(head * head_dim, w, &mut out[..head_dim])
    }
}

/// A copy of the first `slots` positions of block `src` into block `dst` (copy-on-write of a
/// shared partial block) that a pool keeping K/V elsewhere (on a device) must apply before the
/// batch's writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BlockCopy {
    pub src: u32,
    pub dst: u32,
    pub slots: usize,
}

/// What happened to recurrent-state slots since the last batch, for a model that keeps the
/// states itself (on a device) while the engine lends the slot ids: a slot lent to a new
/// sequence starts from the empty state; a forked choice starts from a copy of its parent's.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SlotOp {
    Reset(usize),
    Fork { from: usize, to: usize },
}

/// The paged pool's addressing, for models whose K/V live in their own (device) pool under the
/// same block ids: batch sequence `s`'s position `p` is in block `tables[s][p / block_size]`.
/// A model with recurrent state kept beside its pool also reads each batch sequence's slot and
/// the slot operations to apply first (in order).
pub struct PagedView<'a> {
    pub block_size: usize,
    pub tables: &'a [Vec<u32>],
    pub copies: &'a [BlockCopy],
    pub slots: &'a [Option<usize>],
    pub slot_ops: &'a [SlotOp],
}

/// `Send + Sync` so tensor-parallel ranks (threads) can share one cache behind a lock.
pub trait KvCache: Send + Sync {
    /// Stores this token's keys and values (the layer's `LayerKvShape` widths) for `layer`.
    fn write(&mut self, layer: usize, seq: usize, pos: usize, k: &[f32], v: &[f32]);
    /// Keys of `seq` at `pos` for `layer` (written earlier, in this or a previous step).
    fn key(&self, layer: usize, seq: usize, pos: usize) -> KvRow<'_>;
    fn value(&self, layer: usize, seq: usize, pos: usize) -> KvRow<'_>;
    /// The batch sequences' fixed-size recurrent states (linear-attention layers), owned beside
    /// the cache by whoever owns the sequences; `None` for a cache that holds none (models
    /// without recurrent layers never ask).
    fn recurrent(&mut self) -> Option<&mut dyn RecurrentStates> {
        None
    }
    /// Block size and block tables when the cache is paged (`None` for contiguous caches).
    fn paged_view(&self) -> Option<PagedView<'_>> {
        None
    }
}

/// One growable buffer per sequence and layer: the simplest cache, used by single-request
/// generation and as the reference the paged cache is tested against.
pub struct ContiguousKvCache {
    /// Per layer: (key width, value width); layers without a per-token cache have (0, 0).
    widths: Vec<(usize, usize)>,
    /// [seq][layer] -> (keys, values), each `positions * width`
    seqs: Vec<Vec<(Vec<f32>, Vec<f32>)>>,
    /// Positions written per sequence (highest position + 1).
    lens: Vec<usize>,
    /// One recurrent state per sequence, for models with linear-attention layers.
    states: Option<OwnedStates>,
}

impl ContiguousKvCache {
    /// Every layer `width` floats of keys and of values per token.
    pub fn new(num_layers: usize, width: usize, num_seqs: usize) -> Self {
        Self::with_widths(vec![(width, width); num_layers], num_seqs)
    }

    /// Sized for a model's `CacheLayout`.
    pub fn for_layout(layout: &CacheLayout, num_seqs: usize) -> Self {
        Self::with_widths(
            layout.layers.iter().map(|l| l.map_or((0, 0), |s| (s.key_width, s.value_width))).collect(),
            num_seqs,
        )
    }

    fn with_widths(widths: Vec<(usize, usize)>, num_seqs: usize) -> Self {
        let layers = widths.len();
        Self {
            widths,
            seqs: (0..num_seqs).map(|_| vec![(Vec::new(), Vec::new()); layers]).collect(),
            lens: vec![0; num_seqs],
            states: None,
        }
    }

    /// Gives every sequence a copy of `fresh` (a model's empty recurrent state), when it has one.
    pub fn with_recurrent(mut self, fresh: Option<SequenceState>) -> Self {
        let n = self.lens.len();
        self.states = fresh.map(|f| OwnedStates(vec![f; n]));
        self
    }

    /// Positions stored for `seq`.
    pub fn len(&self, seq: usize) -> usize {
        self.lens[seq]
    }

    pub fn is_empty(&self, seq: usize) -> bool {
        self.len(seq) == 0
    }
}

impl KvCache for ContiguousKvCache {
    fn write(&mut self, layer: usize, seq: usize, pos: usize, k: &[f32], v: &[f32]) {
        let (kw, vw) = self.widths[layer];
        let (ks, vs) = &mut self.seqs[seq][layer];
        if ks.len() < (pos + 1) * kw {
            ks.resize((pos + 1) * kw, 0.0);
        }
        if vs.len() < (pos + 1) * vw {
            vs.resize((pos + 1) * vw, 0.0);
        }
        ks[pos * kw..(pos + 1) * kw].copy_from_slice(k);
        vs[pos * vw..(pos + 1) * vw].copy_from_slice(v);
        self.lens[seq] = self.lens[seq].max(pos + 1);
    }

    fn key(&self, layer: usize, seq: usize, pos: usize) -> KvRow<'_> {
        let kw = self.widths[layer].0;
        KvRow::F32(&self.seqs[seq][layer].0[pos * kw..(pos + 1) * kw])
    }

    fn value(&self, layer: usize, seq: usize, pos: usize) -> KvRow<'_> {
        let vw = self.widths[layer].1;
        KvRow::F32(&self.seqs[seq][layer].1[pos * vw..(pos + 1) * vw])
    }

    fn recurrent(&mut self) -> Option<&mut dyn RecurrentStates> {
        self.states.as_mut().map(|s| s as &mut dyn RecurrentStates)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kernels::cpu::fp8::quantize_e4m3;

    #[test]
    fn fp8_spans_crossing_scale_groups_match_the_dequantised_row() {
        let x: Vec<f32> = (0..12)
            .map(|i| {
                (i as f32 - 5.0)
                    * if i < 4 {
                        0.01
                    } else if i < 8 {
                        1.0
                    } else {
                        30.0
                    }
            })
            .collect();
        let mut codes = vec![0u8; 12];
        let scales: Vec<f32> =
            (0..3).map(|g| quantize_e4m3(&x[g * 4..(g + 1) * 4], &mut codes[g * 4..(g + 1) * 4])).collect();
        let row = KvRow::Fp8 { codes: &codes, scales: &scales };
        let deq: Vec<f32> = (0..12).map(|i| E4M3_TO_F32[codes[i] as usize] * scales[i / 4]).collect();
        let q: Vec<f32> = (0..7).map(|i| 0.5 + i as f32).collect();
        let want: f32 = q.iter().zip(&deq[3..10]).map(|(a, b)| a * b).sum();
        assert!((row.dot_span(3, &q) - want).abs() <= 1e-4 * want.abs().max(1.0));
        let mut out = vec![1.0f32; 7];
        row.axpy_span(3, 2.0, &mut out);
        for (o, d) in out.iter().zip(&deq[3..10]) {
            assert!((o - (1.0 + 2.0 * d)).abs() < 1e-4);
        }
        // Each group keeps its own scale: the small first group is not flushed by the large third.
        assert!((deq[0] - x[0]).abs() < 0.01 * x[0].abs());
    }

    #[test]
    fn contiguous_cache_follows_per_layer_widths() {
        let layout = CacheLayout {
            layers: vec![
                Some(LayerKvShape { key_width: 3, value_width: 1, groups: 1 }),
                None,
                Some(LayerKvShape::heads(2, 2)),
            ],
            recurrent_bytes_per_seq: 0,
        };
        assert_eq!(layout.floats_per_token(), 3 + 1 + 4 + 4);
        let mut kv = ContiguousKvCache::for_layout(&layout, 2);
        kv.write(0, 1, 0, &[1.0, 2.0, 3.0], &[4.0]);
        kv.write(2, 1, 1, &[5.0; 4], &[6.0; 4]);
        assert_eq!(kv.len(1), 2);
        assert!(kv.is_empty(0));
        match kv.key(0, 1, 0) {
            KvRow::F32(k) => assert_eq!(k, &[1.0, 2.0, 3.0]),
            _ => unreachable!(),
        }
        match kv.value(2, 1, 1) {
            KvRow::F32(v) => assert_eq!(v, &[6.0; 4]),
            _ => unreachable!(),
        }
    }
}
