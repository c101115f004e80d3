//! A batch's view of the paged pool: sequence `s` of the batch maps positions to blocks through
//! its block table.

use super::block_pool::{BlockId, BlockPool};
use crate::model::kv::{KvCache, KvRow};

pub struct PagedKv<'a> {
    pub pool: &'a mut BlockPool,
    pub tables: Vec<Vec<BlockId>>,
}

impl PagedKv<'_> {
    fn locate(&self, seq: usize, pos: usize) -> (BlockId, usize) {
        let bs = self.pool.shape().block_size;
        (self.tables[seq][pos / bs], pos % bs)
    }
}

impl KvCache for PagedKv<'_> {
    fn write(&mut self, layer: usize, seq: usize, pos: usize, k: &[f32], v: &[f32]) {
        let (b, slot) = self.locate(seq, pos);
        self.pool.write(layer, b, slot, k, v);
    }

    fn key(&self, layer: usize, seq: usize, pos: usize) -> KvRow<'_> {
        let (b, slot) = self.locate(seq, pos);
        self.pool.key(layer, b, slot)
    }

    fn value(&self, layer: usize, seq: usize, pos: usize) -> KvRow<'_> {
        let (b, slot) = self.locate(seq, pos);
        self.pool.value(layer, b, slot)
    }
}
