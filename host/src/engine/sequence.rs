//! One sequence (one choice of a request) as the scheduler tracks it.

use super::api::RequestId;
use super::block_pool::{hash_block, BlockHash, BlockId, BlockPool};
use super::recurrent_slots::SlotId;

/// Prompt rows of one sequence scheduled per step while it collects prompt logprobs: each row
/// returns a vocabulary of logits (128 rows of a 150k vocabulary: 77 MB).
pub const PROMPT_LOGPROB_ROWS: usize = 128;
use crate::model::tokenizer::incremental::IncrementalDecoder;
use crate::sampling::constraint::Constraint;
use crate::sampling::stop::StopChecker;
use crate::sampling::Sampler;

pub struct Sequence {
    pub request: RequestId,
    pub index: usize,
    /// Prompt followed by generated tokens.
    pub tokens: Vec<u32>,
    pub prompt_len: usize,
    /// Tokens whose keys/values are in the cache.
    pub num_computed: usize,
    pub blocks: Vec<BlockId>,
    /// Recurrent-state slot (models with linear-attention layers), holding exactly the first
    /// `num_computed` tokens; taken with the first blocks, dropped with them.
    pub slot: Option<SlotId>,
    /// Prefix-cache hashes of the full blocks at the front of `blocks`.
    pub hashes: Vec<BlockHash>,
    pub sampler: Sampler,
    pub decoder: IncrementalDecoder,
    pub stops: StopChecker,
    /// Generation ends when this many tokens were generated.
    pub max_tokens: usize,
    /// `Some(k)`: collect the prompt's logprobs with `k` alternatives (choice 0 only).
    pub prompt_logprobs: Option<usize>,
    /// The prompt logprobs so far: entry `j` is prompt token `j + 1`'s. Kept across a
    /// preemption, so a recompute only adds what is missing; emptied once sent.
    pub prompt_lp: Vec<crate::engine::TokenLogprob>,
    /// Whether `prompt_lp` was sent.
    pub prompt_lp_sent: bool,
    /// Prompt tokens served from the prefix cache at first admission (for usage accounting).
    pub cached_tokens: usize,
    /// Whether the sequence has been admitted before (so a re-admission is a recompute).
    pub admitted_once: bool,
    /// Admission order, for FCFS and for choosing whom to preempt (newest first).
    pub arrival: u64,
    pub priority: i32,
    /// Output constraint state, when the request asked for one.
    pub constraint: Option<Constraint>,
    pub tenant: String,
    /// The tenant's weight for fair sharing of batch slots.
    pub weight: f64,
    pub salt: String,
    /// When the request reached the engine, and when this sequence was first admitted (for the
    /// queue-wait / time-to-first-token debug log).
    pub submitted: std::time::Instant,
    pub admitted_at: Option<std::time::Instant>,
}

impl Sequence {
    pub fn generated(&self) -> usize {
        self.tokens.len() - self.prompt_len
    }

    /// Tokens still to run through the model before the next sample.
    pub fn remaining(&self) -> usize {
        self.tokens.len() - self.num_computed
    }

    pub fn is_prefilling(&self) -> bool {
        self.remaining() > 1
    }

    /// Whether the logits of row `pos` are wanted for the prompt logprobs (they score prompt
    /// token `pos + 1`, and it was not scored before a preemption).
    pub fn wants_prompt_logprob(&self, pos: usize) -> bool {
        self.prompt_logprobs.is_some()
            && !self.prompt_lp_sent
            && pos + 1 < self.prompt_len
            && pos >= self.prompt_lp.len()
    }

    /// The most prompt tokens to schedule in one step: a prompt-logprobs prompt returns one
    /// row of logits per token, so its chunks are capped to bound that memory.
    pub fn chunk_limit(&self) -> usize {
        if self.prompt_logprobs.is_some() && !self.prompt_lp_sent {
            PROMPT_LOGPROB_ROWS
        } else {
            usize::MAX
        }
    }

    /// Drops all blocks and the recurrent state (for preemption or when done): the sequence
    /// recomputes from its first token if it runs again.
    pub fn release_blocks(&mut self, pool: &mut BlockPool) {
        for b in self.blocks.drain(..) {
            pool.release(b);
        }
        if let Some(slot) = self.slot.take() {
            pool.recurrent.release(slot);
        }
        self.hashes.clear();
        self.num_computed = 0;
    }

    /// Takes cached blocks for the longest cached prefix (always leaving at least one token to
    /// compute, since the next sample needs its logits).
    pub fn attach_cached_prefix(&mut self, pool: &mut BlockPool) -> usize {
        let bs = pool.shape().block_size;
        let max_blocks = (self.tokens.len() - 1) / bs;
        let mut parent = None;
        for i in 0..max_blocks {
            let h = hash_block(parent, &self.salt, &self.tokens[i * bs..(i + 1) * bs]);
            match pool.lookup(h) {
                Some(b) => {
                    self.blocks.push(b);
                    self.hashes.push(h);
                    parent = Some(h);
                }
                None => break,
            }
        }
        self.num_computed = self.blocks.len() * bs;
        self.num_computed
    }

    /// Registers the blocks that became full since the last call.
    pub fn register_full_blocks(&mut self, pool: &mut BlockPool) {
        let bs = pool.shape().block_size;
        let full = self.num_computed / bs;
        while self.hashes.len() < full {
            let i = self.hashes.len();
            let h = hash_block(self.hashes.last().copied(), &self.salt, &self.tokens[i * bs..(i + 1) * bs]);
            pool.register(self.blocks[i], h);
            self.hashes.push(h);
        }
    }

    /// Blocks needed to hold positions up to `upto` (exclusive) that are not allocated yet,
    /// counting a copy for a shared partially-filled block that will be written to.
    pub fn blocks_needed(&self, upto: usize, pool: &BlockPool) -> usize {
        let bs = pool.shape().block_size;
        let need = upto.div_ceil(bs).saturating_sub(self.blocks.len());
        let cow = !self.num_computed.is_multiple_of(bs) && pool.refcount(self.blocks[self.num_computed / bs]) > 1;
        need + cow as usize
    }

    /// Allocates blocks so positions below `upto` are writable; copies a shared partial block
    /// first (copy-on-write), and takes a recurrent-state slot if the model needs one and the
    /// sequence has none. Returns false (allocating nothing new) if the pool runs dry.
    pub fn reserve(&mut self, upto: usize, pool: &mut BlockPool) -> bool {
        let needs_slot = pool.recurrent.enabled() && self.slot.is_none();
        if self.blocks_needed(upto, pool) > pool.available() || (needs_slot && pool.recurrent.available() == 0) {
            return false;
        }
        if needs_slot {
            // A fresh state holds no tokens, so nothing may count as computed (no cached prefix).
            debug_assert_eq!(self.num_computed, 0, "a recurrent sequence resumed without its state");
            self.slot = pool.recurrent.allocate();
        }
        let bs = pool.shape().block_size;
        if !self.num_computed.is_multiple_of(bs) {
            let i = self.num_computed / bs;
            let b = self.blocks[i];
            if pool.refcount(b) > 1 {
                let copy = pool.allocate().expect("checked available");
                pool.copy_block(b, copy, self.num_computed % bs);
                pool.release(b);
                self.blocks[i] = copy;
            }
        }
        while self.blocks.len() < upto.div_ceil(bs) {
            self.blocks.push(pool.allocate().expect("checked available"));
        }
        true
    }
}
