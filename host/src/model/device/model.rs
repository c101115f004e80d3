//! A model whose forward runs on one or more devices, whatever the architecture: the ranks'
//! states (one per device), the group their collectives go through, and what the engine sees of
//! it (`LanguageModel`, `DeviceKv`). An architecture supplies its per-device state as a
//! [`DeviceRank`]: its pool and its part of one step.

use kernels::gpu::kv_pool::KvStorage;
use kernels::gpu::Runtime;

use crate::model::config::ModelConfig;
use crate::model::device::ranks::{run_step, RankState};
use crate::model::device::step::{checked_step, recurrent_rows, StepInputs};
use crate::model::kv::{BatchRow, BlockCopy, CacheLayout, KvCache, PagedView};
use crate::model::shard::even_range;
use crate::model::{DeviceKv, ForwardError, LanguageModel};
use crate::parallel::device_collective::{DeviceCollective, DeviceGroup};

/// One device's part of a model.
pub trait DeviceRank {
    type Rt: Runtime;
    /// The device, as its runtime names it.
    fn describe(&self) -> String;
    /// (blocks, block size, storage) of this device's K/V pool, once allocated.
    fn pool(&self) -> Option<(usize, usize, KvStorage)>;
    /// Allocates this device's K/V pool for every layer of `cfg`.
    fn allocate(
        &mut self,
        cfg: &ModelConfig,
        num_blocks: usize,
        block_size: usize,
        storage: KvStorage,
    ) -> Result<(), ForwardError>;
    /// The recurrent-state slots this device holds, once allocated (`None` for models without
    /// recurrent layers, or before `allocate_recurrent`).
    fn recurrent_slots(&self) -> Option<usize> {
        None
    }
    /// Allocates `slots` zeroed recurrent states (models with recurrent layers).
    fn allocate_recurrent(&mut self, slots: usize) -> Result<(), ForwardError> {
        let _ = slots;
        Ok(())
    }
    /// This device's part of one step: `copies` (copy-on-write) first, then the forward, meeting
    /// the other ranks in `comm`. Returns this rank's part of the logits (see [`Logits`]).
    fn forward(
        &mut self,
        cfg: &ModelConfig,
        copies: &[BlockCopy],
        inp: &StepInputs,
        comm: &dyn DeviceCollective<Self::Rt>,
    ) -> Result<Vec<f32>, ForwardError>;
}

/// How the ranks' outputs make the step's logits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Logits {
    /// Rank `r` returns its vocabulary columns (`even_range(vocab, ranks, r)`): stitched.
    VocabColumns,
    /// Rank 0 returns them all (the others return nothing).
    FirstRank,
}

pub struct DeviceModel<S: DeviceRank> {
    cfg: ModelConfig,
    describe: String,
    ranks: Vec<RankState<S>>,
    group: Box<dyn DeviceGroup<S::Rt>>,
    layout: CacheLayout,
    logits: Logits,
    /// For messages: e.g. `DeviceLlama`.
    kind: &'static str,
}

/// One device per rank, and rank `r` (its (rank, size) position as loaded) on device `r`.
pub fn check_ranks(what: &str, positions: &[(usize, usize)], devices: usize) -> Result<(), ForwardError> {
    let size = positions.len();
    if size == 0 || devices != size {
        return Err(ForwardError::Invalid(format!("{size} {what} ranks and {devices} devices: one device per rank")));
    }
    match positions.iter().enumerate().find(|&(r, &p)| p != (r, size)) {
        Some((r, (rank, of))) => Err(ForwardError::Invalid(format!(
            "device {r} was given {what} rank {rank} of {of} (expected rank {r} of {size})"
        ))),
        None => Ok(()),
    }
}

impl<S: DeviceRank> DeviceModel<S> {
    /// `ranks[r]` runs on device `r`; `layout` is what the engine sizes its block budget from
    /// (every rank's pool holds the same blocks).
    pub fn new(
        kind: &'static str,
        cfg: ModelConfig,
        ranks: Vec<S>,
        group: Box<dyn DeviceGroup<S::Rt>>,
        layout: CacheLayout,
        logits: Logits,
    ) -> Result<Self, ForwardError> {
        if ranks.is_empty() || group.world_size() != ranks.len() {
            return Err(ForwardError::Invalid(format!(
                "{} ranks and a group of {}: one device per rank",
                ranks.len(),
                group.world_size()
            )));
        }
        let names: Vec<String> = ranks.iter().map(DeviceRank::describe).collect();
        let describe =
            if names.len() == 1 { names[0].clone() } else { format!("{} ranks on {}", names.len(), names.join(", ")) };
        Ok(Self { cfg, describe, ranks: ranks.into_iter().map(RankState::new).collect(), group, layout, logits, kind })
    }

    /// The device(s), as the runtime names them.
    pub fn device(&self) -> &str {
        &self.describe
    }

    /// Every rank's step ([`run_step`]: each on its own thread, a failing rank releasing its
    /// peers), checked once on the host first, then the logits from the ranks' parts.
    fn forward_ranks(
        &self,
        tokens: &[u32],
        rows: &[BatchRow],
        view: &PagedView<'_>,
        logit_rows: &[usize],
    ) -> Result<Vec<f32>, ForwardError> {
        let (pool, recurrent) = {
            let first = self.ranks[0].lock();
            (first.pool().map(|(blocks, size, _)| (blocks, size)), first.recurrent_slots())
        };
        let mut inp = checked_step(&self.cfg, tokens, rows, view, logit_rows, pool)?;
        if let Some(capacity) = recurrent {
            inp.recurrent = Some(recurrent_rows(rows, view.slots, view.slot_ops, capacity)?);
            inp.slot_ops = view.slot_ops.to_vec();
        }
        let comms = if self.ranks.len() > 1 { self.group.step_comms()? } else { Vec::new() };
        let parts = run_step(&self.ranks, &comms, |state, comm| state.forward(&self.cfg, view.copies, &inp, comm))?;
        Ok(match self.logits {
            Logits::VocabColumns if parts.len() > 1 => stitch_vocab(&parts, logit_rows.len(), self.cfg.vocab_size),
            // One rank, or rank 0 holding them all.
            _ => parts.into_iter().next().unwrap_or_default(),
        })
    }
}

/// Full `[m, vocab]` logits from rank `r`'s `[m, |even_range(vocab, ranks, r)|]` columns.
fn stitch_vocab(parts: &[Vec<f32>], m: usize, vocab: usize) -> Vec<f32> {
    let mut logits = vec![0.0f32; m * vocab];
    for (r, part) in parts.iter().enumerate() {
        let cols = even_range(vocab, parts.len(), r);
        for (dst, src) in logits.chunks_exact_mut(vocab).zip(part.chunks_exact(cols.len().max(1))) {
            dst[cols.clone()].copy_from_slice(src);
        }
    }
    logits
}

impl<S: DeviceRank> LanguageModel for DeviceModel<S> {
    fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    fn cache_layout(&self) -> CacheLayout {
        self.layout.clone()
    }

    /// The infallible entry point has no way to report a device error; the engine calls
    /// [`LanguageModel::try_forward`]. Reaching this with a failure is a caller bug (e.g. a
    /// contiguous cache), reported with the error's text.
    fn forward(&self, tokens: &[u32], rows: &[BatchRow], kv: &mut dyn KvCache, logit_rows: &[usize]) -> Vec<f32> {
        match self.try_forward(tokens, rows, kv, logit_rows) {
            Ok(l) => l,
            Err(e) => panic!("{}::forward: {e} (callers that can see device errors use try_forward)", self.kind),
        }
    }

    fn try_forward(
        &self,
        tokens: &[u32],
        rows: &[BatchRow],
        kv: &mut dyn KvCache,
        logit_rows: &[usize],
    ) -> Result<Vec<f32>, ForwardError> {
        let view = kv.paged_view().ok_or_else(|| ForwardError::Invalid("the device forward needs the engine's paged KV cache (its K/V live in the device pool); contiguous caches are not supported".into()))?;
        self.forward_ranks(tokens, rows, &view, logit_rows)
    }

    fn device_kv(&self) -> Option<&dyn DeviceKv> {
        Some(self)
    }
}

impl<S: DeviceRank> DeviceKv for DeviceModel<S> {
    fn allocate_recurrent(&self, slots: usize) -> Result<(), ForwardError> {
        for rank in &self.ranks {
            let mut st = rank.lock();
            match st.recurrent_slots() {
                Some(have) if have == slots => continue,
                Some(have) => {
                    return Err(ForwardError::Invalid(format!(
                        "the device recurrent state is already allocated ({have} slots)"
                    )))
                }
                None => st.allocate_recurrent(slots)?,
            }
        }
        Ok(())
    }

    /// The same blocks on every rank, each holding that rank's part of every layer.
    fn allocate(&self, num_blocks: usize, block_size: usize, storage: KvStorage) -> Result<(), ForwardError> {
        for rank in &self.ranks {
            let mut st = rank.lock();
            match st.pool() {
                Some(p) if p == (num_blocks, block_size, storage) => continue,
                Some((blocks, size, storage)) => {
                    return Err(ForwardError::Invalid(format!(
                        "the device KV pool is already allocated ({blocks} blocks of {size}, {storage:?})"
                    )))
                }
                None => st.allocate(&self.cfg, num_blocks, block_size, storage)?,
            }
        }
        Ok(())
    }
}
