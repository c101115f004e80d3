//! The key/value cache interface the forward pass writes to and attends over.
//!
//! The model only says "sequence `s`, position `p`"; where those values live (one contiguous
//! buffer per sequence, or blocks of a shared paged pool, in f32 or FP8) is up to the cache.

use kernels::cpu::dot::dot;
use kernels::cpu::fp8::E4M3_TO_F32;

/// Position of one token of a batch: which sequence of the batch it belongs to, and where.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BatchRow {
    pub seq: usize,
    pub pos: usize,
}

/// One cached token's keys or values for all KV heads of a layer.
pub enum KvRow<'a> {
    F32(&'a [f32]),
    /// E4M3 codes with one scale per KV head.
    Fp8 { codes: &'a [u8], scales: &'a [f32] },
}

impl KvRow<'_> {
    /// `q · row[head]`.
    #[inline]
    pub fn dot_head(&self, head: usize, head_dim: usize, q: &[f32]) -> f32 {
        let r = head * head_dim..(head + 1) * head_dim;
        match self {
            KvRow::F32(v) => dot(q, &v[r]),
            KvRow::Fp8 { codes, scales } => {
                let s: f32 = codes[r].iter().zip(q).map(|(&c, &x)| E4M3_TO_F32[c as usize] * x).sum();
                s * scales[head]
            }
        }
    }

    /// `out += w * row[head]`.
    #[inline]
    pub fn axpy_head(&self, head: usize, head_dim: usize, w: f32, out: &mut [f32]) {
        let r = head * head_dim..(head + 1) * head_dim;
        match self {
            KvRow::F32(v) => {
                for (o, &x) in out.iter_mut().zip(&v[r]) {
                    *o += w * x;
                }
            }
            KvRow::Fp8 { codes, scales } => {
                let ws = w * scales[head];
                for (o, &c) in out.iter_mut().zip(&codes[r]) {
                    *o += ws * E4M3_TO_F32[c as usize];
                }
            }
        }
    }
}

/// `Send + Sync` so tensor-parallel ranks (threads) can share one cache behind a lock.
pub trait KvCache: Send + Sync {
    /// Stores this token's keys and values (`num_kv_heads * head_dim` each) for `layer`.
    fn write(&mut self, layer: usize, seq: usize, pos: usize, k: &[f32], v: &[f32]);
    /// Keys of `seq` at `pos` for `layer` (written earlier, in this or a previous step).
    fn key(&self, layer: usize, seq: usize, pos: usize) -> KvRow<'_>;
    fn value(&self, layer: usize, seq: usize, pos: usize) -> KvRow<'_>;
}

/// One growable buffer per sequence and layer: the simplest cache, used by single-request
/// generation and as the reference the paged cache is tested against.
pub struct ContiguousKvCache {
    width: usize,
    /// [seq][layer] -> (keys, values), each `positions * width`
    seqs: Vec<Vec<(Vec<f32>, Vec<f32>)>>,
}

impl ContiguousKvCache {
    pub fn new(num_layers: usize, width: usize, num_seqs: usize) -> Self {
        Self { width, seqs: (0..num_seqs).map(|_| vec![(Vec::new(), Vec::new()); num_layers]).collect() }
    }

    /// Positions stored for `seq` (taken from layer 0).
    pub fn len(&self, seq: usize) -> usize {
        self.seqs[seq][0].0.len() / self.width
    }

    pub fn is_empty(&self, seq: usize) -> bool {
        self.len(seq) == 0
    }
}

impl KvCache for ContiguousKvCache {
    fn write(&mut self, layer: usize, seq: usize, pos: usize, k: &[f32], v: &[f32]) {
        let w = self.width;
        let (ks, vs) = &mut self.seqs[seq][layer];
        let need = (pos + 1) * w;
        if ks.len() < need {
            ks.resize(need, 0.0);
            vs.resize(need, 0.0);
        }
        ks[pos * w..need].copy_from_slice(k);
        vs[pos * w..need].copy_from_slice(v);
    }

    fn key(&self, layer: usize, seq: usize, pos: usize) -> KvRow<'_> {
        KvRow::F32(&self.seqs[seq][layer].0[pos * self.width..(pos + 1) * self.width])
    }

    fn value(&self, layer: usize, seq: usize, pos: usize) -> KvRow<'_> {
        KvRow::F32(&self.seqs[seq][layer].1[pos * self.width..(pos + 1) * self.width])
    }
}
