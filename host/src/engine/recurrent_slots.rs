//! Fixed-size recurrent-state slots, one per running sequence, beside the paged KV blocks.
//!
//! Linear-attention layers (KDA) keep a state whose size does not grow with the sequence, so it
//! is not paged: the engine preallocates a bounded number of whole-sequence slots at start (their
//! bytes come out of the KV budget) and lends one to each running sequence. A slot's state folds
//! in every token before `num_computed`; it cannot be rewound or rebuilt from cached KV blocks, so
//! a preempted sequence loses its slot and recomputes from its first token.

use crate::model::kv::SlotOp;
use crate::model::layers::kda::state::{KdaState, SequenceState};

/// Index of a slot in the pool.
pub type SlotId = usize;

pub struct RecurrentSlots {
    /// Preallocated states; a free slot's content is stale until `allocate` resets it. Empty when
    /// the model keeps the states itself (`external`).
    slots: Vec<SequenceState>,
    in_use: Vec<bool>,
    /// Free slots, lowest id last (so tests and logs see ids in order).
    free: Vec<SlotId>,
    bytes_per_slot: usize,
    /// The states live in the model's (device) memory: resets and forks are recorded for the
    /// next batch to apply there instead of being done here.
    external: bool,
    pending: Vec<SlotOp>,
}

impl RecurrentSlots {
    /// A pool for a model without recurrent state: no slots, never needed.
    pub fn none() -> Self {
        Self {
            slots: Vec::new(),
            in_use: Vec::new(),
            free: Vec::new(),
            bytes_per_slot: 0,
            external: false,
            pending: Vec::new(),
        }
    }

    /// `count` slots shaped like `template` (a fresh state of the model).
    pub fn new(template: SequenceState, count: usize, bytes_per_slot: usize) -> Self {
        Self {
            slots: vec![template; count],
            in_use: vec![false; count],
            free: (0..count).rev().collect(),
            bytes_per_slot,
            external: false,
            pending: Vec::new(),
        }
    }

    /// `count` slot ids whose states the model keeps (a device model's own state pool): this
    /// side lends ids and records what the model must do to them ([`Self::take_pending`]).
    pub fn external(count: usize, bytes_per_slot: usize) -> Self {
        Self {
            slots: Vec::new(),
            in_use: vec![false; count],
            free: (0..count).rev().collect(),
            bytes_per_slot,
            external: true,
            pending: Vec::new(),
        }
    }

    /// The resets and forks since the last call, in order (external slots only; empty otherwise).
    pub fn take_pending(&mut self) -> Vec<SlotOp> {
        std::mem::take(&mut self.pending)
    }

    /// How many slots to preallocate: one per possible running sequence (`max_num_seqs`), but in
    /// at most 7/8 of the KV budget, so paged blocks for the full-attention layers always remain;
    /// at least one, so a lone request can run. 0 when the model keeps no recurrent state.
    pub fn count_for(bytes_per_seq: usize, max_num_seqs: usize, kv_cache_bytes: usize) -> usize {
        if bytes_per_seq == 0 {
            return 0;
        }
        max_num_seqs.min((kv_cache_bytes - kv_cache_bytes / 8) / bytes_per_seq).max(1)
    }

    /// Whether sequences need a slot (the model has recurrent layers).
    pub fn enabled(&self) -> bool {
        !self.in_use.is_empty()
    }

    /// Whether the states live in the model rather than here.
    pub fn is_external(&self) -> bool {
        self.external
    }

    pub fn capacity(&self) -> usize {
        self.in_use.len()
    }

    pub fn available(&self) -> usize {
        self.free.len()
    }

    /// Bytes all slots take.
    pub fn total_bytes(&self) -> usize {
        self.capacity() * self.bytes_per_slot
    }

    /// Takes a free slot, reset to the state before any token.
    pub fn allocate(&mut self) -> Option<SlotId> {
        let id = self.free.pop()?;
        if self.external {
            self.pending.push(SlotOp::Reset(id));
        } else {
            self.slots[id].reset();
        }
        self.in_use[id] = true;
        Some(id)
    }

    /// Takes a free slot holding a copy of `from`'s state (a forked choice continuing the same
    /// prompt).
    pub fn fork(&mut self, from: SlotId) -> Option<SlotId> {
        assert!(self.in_use[from], "recurrent slot {from} forked while free");
        let id = self.free.pop()?;
        if self.external {
            self.pending.push(SlotOp::Fork { from, to: id });
            self.in_use[id] = true;
            return Some(id);
        }
        let (a, b) = (from.min(id), from.max(id));
        let (lo, hi) = self.slots.split_at_mut(b);
        if from < id {
            hi[0].clone_from(&lo[a]);
        } else {
            lo[a].clone_from(&hi[0]);
        }
        self.in_use[id] = true;
        Some(id)
    }

    /// Returns a slot to the pool; its state is dropped.
    pub fn release(&mut self, id: SlotId) {
        assert!(self.in_use[id], "recurrent slot {id} released twice");
        self.in_use[id] = false;
        self.free.push(id);
    }

    /// Slot `id`'s state (host slots only).
    pub fn get(&self, id: SlotId) -> &SequenceState {
        &self.slots[id]
    }

    /// KDA layer `ordinal`'s state of each slot in `ids` (distinct, in use), in that order: the
    /// batch view the model's recurrent layers advance (host slots only: a model keeping its
    /// states never asks).
    pub fn layer(&mut self, ids: &[SlotId], ordinal: usize) -> Vec<&mut KdaState> {
        assert!(!self.external, "the model keeps these recurrent states itself");
        let mut by_id: Vec<Option<&mut KdaState>> =
            self.slots.iter_mut().map(|s| Some(&mut s.layers[ordinal])).collect();
        ids.iter()
            .map(|&id| {
                assert!(self.in_use[id], "recurrent slot {id} used while free");
                by_id[id].take().unwrap_or_else(|| panic!("recurrent slot {id} appears twice in one batch"))
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::layers::kda::KdaConfig;

    fn cfgs() -> Vec<KdaConfig> {
        let c = KdaConfig {
            hidden_size: 8,
            num_heads: 2,
            head_dim: 2,
            conv_kernel: 3,
            rms_norm_eps: 1e-6,
            gate_lower_bound: None,
            full_rank_gate: false,
        };
        vec![c.clone(), c]
    }

    fn pool(n: usize) -> RecurrentSlots {
        let c = cfgs();
        RecurrentSlots::new(SequenceState::new(&c), n, SequenceState::bytes(&c))
    }

    #[test]
    fn sizing_is_bounded_by_seqs_and_the_budget() {
        assert_eq!(RecurrentSlots::count_for(0, 64, 1 << 30), 0);
        assert_eq!(RecurrentSlots::count_for(1000, 64, 1 << 30), 64);
        assert_eq!(RecurrentSlots::count_for(1000, 64, 8_000), 7);
        assert_eq!(RecurrentSlots::count_for(1000, 64, 100), 1);
        assert!(!RecurrentSlots::none().enabled());
        assert_eq!(pool(3).total_bytes(), 3 * SequenceState::bytes(&cfgs()));
    }

    #[test]
    fn allocation_is_bounded_and_resets_reused_slots() {
        let mut p = pool(2);
        let a = p.allocate().unwrap();
        let b = p.allocate().unwrap();
        assert_ne!(a, b);
        assert_eq!(p.allocate(), None, "pool of 2 gave a third slot");
        p.layer(&[a], 1)[0].recurrent[0] = 5.0;
        p.layer(&[a], 1)[0].tokens = 7;
        p.release(a);
        assert_eq!(p.available(), 1);
        let c = p.allocate().unwrap();
        assert_eq!(c, a);
        assert_eq!(p.get(c).layers[1].tokens, 0, "a reused slot must start from the empty state");
        assert!(p.get(c).layers[1].recurrent.iter().all(|&x| x == 0.0));
    }

    #[test]
    fn fork_copies_the_state_and_views_follow_batch_order() {
        let mut p = pool(3);
        let a = p.allocate().unwrap();
        p.layer(&[a], 0)[0].conv[1] = 3.0;
        p.layer(&[a], 0)[0].tokens = 4;
        let b = p.fork(a).unwrap();
        assert_eq!(p.get(b), p.get(a));
        let mut view = p.layer(&[b, a], 0);
        view[0].tokens = 9;
        assert_eq!(p.get(b).layers[0].tokens, 9);
        assert_eq!(p.get(a).layers[0].tokens, 4, "a fork must not alias its parent");
        // Forking from a higher id into a lower one copies too.
        p.release(a);
        let c = p.fork(b).unwrap();
        assert_eq!(c, a);
        assert_eq!(p.get(c).layers[0].tokens, 9);
    }

    /// External slots hand out ids like host ones and record what the model must do.
    #[test]
    fn external_slots_record_resets_and_forks_in_order() {
        let mut p = RecurrentSlots::external(3, 100);
        assert!(p.enabled() && p.is_external());
        assert_eq!(p.total_bytes(), 300);
        let a = p.allocate().unwrap();
        let b = p.fork(a).unwrap();
        p.release(a);
        let c = p.allocate().unwrap();
        assert_eq!(c, a, "a released id is lent again");
        assert_eq!(p.take_pending(), [SlotOp::Reset(a), SlotOp::Fork { from: a, to: b }, SlotOp::Reset(a)]);
        assert!(p.take_pending().is_empty());
        assert_eq!(p.available(), 1);
    }

    #[test]
    #[should_panic(expected = "released twice")]
    fn double_release_is_caught() {
        let mut p = pool(1);
        let a = p.allocate().unwrap();
        p.release(a);
        p.release(a);
    }
}
