//! A batch's view of the paged pool: sequence `s` of the batch maps positions to blocks through
//! its block table, and finds its recurrent state (if the model keeps one) in its slot.

use super::block_pool::{BlockId, BlockPool};
use super::recurrent_slots::SlotId;
use crate::model::kv::{BlockCopy, KvCache, KvRow, PagedView, SlotOp};
use crate::model::layers::kda::state::{KdaState, RecurrentStates};

pub struct PagedKv<'a> {
    pub pool: &'a mut BlockPool,
    pub tables: Vec<Vec<BlockId>>,
    /// Per batch sequence, its recurrent-state slot (`None` for models without one).
    pub slots: Vec<Option<SlotId>>,
    /// Copy-on-write copies a device pool applies before this batch (see `BlockPool::new_external`).
    pub copies: Vec<BlockCopy>,
    /// Recurrent-slot resets and forks a model keeping its own states applies first.
    pub slot_ops: Vec<SlotOp>,
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

    fn paged_view(&self) -> Option<PagedView<'_>> {
        Some(PagedView {
            block_size: self.pool.shape().block_size,
            tables: &self.tables,
            copies: &self.copies,
            slots: &self.slots,
            slot_ops: &self.slot_ops,
        })
    }

    fn recurrent(&mut self) -> Option<&mut dyn RecurrentStates> {
        if self.pool.recurrent.enabled() && !self.pool.recurrent.is_external() {
            Some(self)
        } else {
            None
        }
    }
}

impl RecurrentStates for PagedKv<'_> {
    fn layer(&mut self, ordinal: usize) -> Vec<&mut KdaState> {
        // Every running sequence of a recurrent model holds a slot (`Sequence::reserve`).
        let ids: Vec<SlotId> =
            self.slots.iter().map(|s| s.expect("a running sequence without a recurrent slot")).collect();
        self.pool.recurrent.layer(&ids, ordinal)
    }
}
