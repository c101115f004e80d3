//! The key/value cache interface the forward pass writes to and attends over.
//!
//! The model only says "sequence `s`, position `p`"; where those values live (one contiguous
//! buffer per sequence, or blocks of a shared paged pool) is up to the implementation.

/// Position of one token of a batch: which sequence of the batch it belongs to, and where.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BatchRow {
    pub seq: usize,
    pub pos: usize,
}

pub trait KvCache: Sync {
    /// Stores this token's keys and values (`num_kv_heads * head_dim` each) for `layer`.
    fn write(&mut self, layer: usize, seq: usize, pos: usize, k: &[f32], v: &[f32]);
    /// Keys of `seq` at `pos` for `layer` (written earlier, in this or a previous step).
    fn key(&self, layer: usize, seq: usize, pos: usize) -> &[f32];
    fn value(&self, layer: usize, seq: usize, pos: usize) -> &[f32];
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

    /// Drops everything at or after `pos` (to roll back, or restart a sequence).
    pub fn truncate(&mut self, seq: usize, pos: usize) {
        for (k, v) in &mut self.seqs[seq] {
            k.truncate(pos * self.width);
            v.truncate(pos * self.width);
        }
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

    fn key(&self, layer: usize, seq: usize, pos: usize) -> &[f32] {
        &self.seqs[seq][layer].0[pos * self.width..(pos + 1) * self.width]
    }

    fn value(&self, layer: usize, seq: usize, pos: usize) -> &[f32] {
        &self.seqs[seq][layer].1[pos * self.width..(pos + 1) * self.width]
    }
}
