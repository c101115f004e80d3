//! One forward step's inputs for the device kernels, checked once on the host before any device
//! is touched (so on a multi-device model a rank can only fail on its device, never by
//! disagreeing with its peers about the batch): per token its id, position, pool row to write
//! (slot mapping) and the block table and length its attention reads.

use crate::model::config::ModelConfig;
use crate::model::kv::{BatchRow, BlockCopy, KvCache, KvRow, PagedView, SlotOp};
use crate::model::ForwardError;

/// The paged addressing a device model reads, for callers without the engine's block pool
/// (single-request generation, tests): block tables and copy-on-write copies. The K/V themselves
/// live in the model's device pool, so the row accessors are never called.
pub struct BlockTables {
    pub block_size: usize,
    pub tables: Vec<Vec<u32>>,
    pub copies: Vec<BlockCopy>,
    /// Each sequence's recurrent-state slot, and the resets/forks to apply first (models with
    /// linear-attention layers; empty otherwise).
    pub slots: Vec<Option<usize>>,
    pub slot_ops: Vec<SlotOp>,
}

impl BlockTables {
    /// Tables and copies of a model without recurrent state.
    pub fn new(block_size: usize, tables: Vec<Vec<u32>>, copies: Vec<BlockCopy>) -> Self {
        Self { block_size, tables, copies, slots: Vec::new(), slot_ops: Vec::new() }
    }
}

impl KvCache for BlockTables {
    fn write(&mut self, _: usize, _: usize, _: usize, _: &[f32], _: &[f32]) {
        unreachable!("a device model writes K/V into its own pool")
    }
    fn key(&self, _: usize, _: usize, _: usize) -> KvRow<'_> {
        unreachable!("a device model reads K/V from its own pool")
    }
    fn value(&self, _: usize, _: usize, _: usize) -> KvRow<'_> {
        unreachable!("a device model reads K/V from its own pool")
    }
    fn paged_view(&self) -> Option<PagedView<'_>> {
        Some(PagedView {
            block_size: self.block_size,
            tables: &self.tables,
            copies: &self.copies,
            slots: &self.slots,
            slot_ops: &self.slot_ops,
        })
    }
}

fn invalid(msg: String) -> ForwardError {
    ForwardError::Invalid(msg)
}

/// Checks a step against a device pool of `pool` = (blocks, block size), `None` when the pool was
/// never allocated: the batch ([`step_inputs`]) and the copy-on-write copies.
pub fn checked_step(
    cfg: &ModelConfig,
    tokens: &[u32],
    rows: &[BatchRow],
    view: &PagedView<'_>,
    logit_rows: &[usize],
    pool: Option<(usize, usize)>,
) -> Result<StepInputs, ForwardError> {
    let Some((num_blocks, block_size)) = pool else {
        return Err(invalid("the device KV pool is not allocated (DeviceKv::allocate)".into()));
    };
    if block_size != view.block_size {
        return Err(invalid(format!("block size {} in the batch, {block_size} in the device pool", view.block_size)));
    }
    if let Some(c) = view
        .copies
        .iter()
        .find(|c| c.src as usize >= num_blocks || c.dst as usize >= num_blocks || c.slots > block_size)
    {
        return Err(invalid(format!(
            "block copy {} -> {} of {} slots outside the device pool of {num_blocks} blocks of {block_size}",
            c.src, c.dst, c.slots
        )));
    }
    step_inputs(cfg, tokens, rows, block_size, view.tables, num_blocks, logit_rows)
}

/// What one step uploads: per token its id, position, pool row to write, and the block table
/// and length its attention reads.
#[derive(Debug)]
pub struct StepInputs {
    pub ids: Vec<i32>,
    pub positions: Vec<i32>,
    pub slots: Vec<i32>,
    /// `[tokens, max_blocks]`: each token's sequence table (its blocks up to its own position).
    pub tables: Vec<i32>,
    /// Each token's attention length, pos + 1.
    pub lens: Vec<i32>,
    pub max_blocks: usize,
    /// `(first row, rows)` of every run of at least two consecutive batch rows of one sequence
    /// at consecutive positions (a prompt chunk), in batch order: the rows a prefill attention
    /// kernel can take together because they read the same cache rows.
    pub prompt_runs: Vec<(usize, usize)>,
    pub logit_rows: Vec<i32>,
    /// For models with recurrent layers: the rows grouped by sequence with their state slots,
    /// and the slot resets/forks to apply before the step (`None`/empty otherwise).
    pub recurrent: Option<RecurrentRows>,
    pub slot_ops: Vec<SlotOp>,
}

/// A batch's rows grouped by sequence for recurrent layers, which must run each sequence's rows
/// in position order on its own state: sequence `i` (in order of first appearance) has the batch
/// rows `rows[start[i]..start[i + 1]]` and the state slot `slot[i]`.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct RecurrentRows {
    pub rows: Vec<i32>,
    pub start: Vec<i32>,
    pub slot: Vec<i32>,
}

impl RecurrentRows {
    pub fn seqs(&self) -> usize {
        self.slot.len()
    }
}

/// Groups `rows` by sequence for a model with `capacity` state slots, checking what the kernels
/// cannot: every sequence in the batch has a slot below `capacity`, no two share one, its rows
/// are consecutive positions in batch order, and every slot operation names slots in range.
pub fn recurrent_rows(
    rows: &[BatchRow],
    slots: &[Option<usize>],
    ops: &[SlotOp],
    capacity: usize,
) -> Result<RecurrentRows, ForwardError> {
    for op in ops {
        let (a, b) = match *op {
            SlotOp::Reset(s) => (s, s),
            SlotOp::Fork { from, to } => (from, to),
        };
        if a.max(b) >= capacity {
            return Err(invalid(format!("recurrent slot operation {op:?} outside the {capacity} device slots")));
        }
    }
    let mut order: Vec<usize> = Vec::new();
    let mut members: Vec<Vec<usize>> = Vec::new();
    let mut index_of = std::collections::HashMap::new();
    for (i, r) in rows.iter().enumerate() {
        let k = *index_of.entry(r.seq).or_insert_with(|| {
            order.push(r.seq);
            members.push(Vec::new());
            order.len() - 1
        });
        members[k].push(i);
    }
    let mut out =
        RecurrentRows { rows: Vec::with_capacity(rows.len()), start: vec![0], slot: Vec::with_capacity(order.len()) };
    let mut used = std::collections::HashSet::new();
    for (seq, idx) in order.iter().zip(&members) {
        let slot = slots
            .get(*seq)
            .copied()
            .flatten()
            .ok_or_else(|| invalid(format!("batch sequence {seq} has no recurrent-state slot")))?;
        if slot >= capacity || !used.insert(slot) {
            return Err(invalid(format!(
                "batch sequence {seq}: recurrent-state slot {slot} is outside the {capacity} device slots or shared"
            )));
        }
        if let Some(w) = idx.windows(2).find(|w| rows[w[1]].pos != rows[w[0]].pos + 1) {
            return Err(invalid(format!(
                "batch sequence {seq}: positions {} then {}: a recurrent layer needs consecutive positions in order",
                rows[w[0]].pos, rows[w[1]].pos
            )));
        }
        out.rows.extend(idx.iter().map(|&i| i as i32));
        out.start.push(out.rows.len() as i32);
        out.slot.push(slot as i32);
    }
    Ok(out)
}

pub fn step_inputs(
    cfg: &ModelConfig,
    tokens: &[u32],
    rows: &[BatchRow],
    block_size: usize,
    tables: &[Vec<u32>],
    num_blocks: usize,
    logit_rows: &[usize],
) -> Result<StepInputs, ForwardError> {
    let n = tokens.len();
    if rows.len() != n {
        return Err(invalid(format!("forward: {} batch rows for {n} tokens", rows.len())));
    }
    if let Some(&t) = tokens.iter().find(|&&t| t as usize >= cfg.vocab_size) {
        return Err(invalid(format!("token id {t} is outside the vocabulary (size {})", cfg.vocab_size)));
    }
    if let Some(&r) = logit_rows.iter().find(|&&r| r >= n) {
        return Err(invalid(format!("logit row {r} of a batch of {n} tokens")));
    }
    let mut slots = Vec::with_capacity(n);
    for r in rows {
        let table = tables
            .get(r.seq)
            .ok_or_else(|| invalid(format!("batch sequence {} has no block table ({} given)", r.seq, tables.len())))?;
        let block = *table.get(r.pos / block_size).ok_or_else(|| {
            invalid(format!("sequence {} position {} is past its {} blocks", r.seq, r.pos, table.len()))
        })? as usize;
        if block >= num_blocks {
            return Err(invalid(format!("block {block} is outside the device pool of {num_blocks}")));
        }
        slots.push((block * block_size + r.pos % block_size) as i32);
    }
    let max_blocks = rows.iter().map(|r| r.pos / block_size + 1).max().unwrap_or(1);
    let mut flat = vec![0i32; n * max_blocks];
    for (i, r) in rows.iter().enumerate() {
        let need = r.pos / block_size + 1;
        // Attention reads every block up to the row's own: all must be inside the pool.
        for (dst, &b) in flat[i * max_blocks..i * max_blocks + need].iter_mut().zip(&tables[r.seq]) {
            if b as usize >= num_blocks {
                return Err(invalid(format!("block {b} is outside the device pool of {num_blocks}")));
            }
            *dst = b as i32;
        }
    }
    Ok(StepInputs {
        ids: tokens.iter().map(|&t| t as i32).collect(),
        positions: rows.iter().map(|r| r.pos as i32).collect(),
        slots,
        tables: flat,
        lens: rows.iter().map(|r| r.pos as i32 + 1).collect(),
        max_blocks,
        prompt_runs: prompt_runs(rows),
        logit_rows: logit_rows.iter().map(|&r| r as i32).collect(),
        recurrent: None,
        slot_ops: Vec::new(),
    })
}

/// The runs of [`StepInputs::prompt_runs`].
fn prompt_runs(rows: &[BatchRow]) -> Vec<(usize, usize)> {
    let mut runs = Vec::new();
    let mut first = 0;
    for i in 1..=rows.len() {
        let continues = i < rows.len() && rows[i].seq == rows[i - 1].seq && rows[i].pos == rows[i - 1].pos + 1;
        if !continues {
            if i - first >= 2 {
                runs.push((first, i - first));
            }
            first = i;
        }
    }
    runs
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> ModelConfig {
        let raw = serde_json::json!({
            "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 1,
            "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 10, "rms_norm_eps": 1e-5,
            "max_position_embeddings": 64, "rope_theta": 10000.0, "tie_word_embeddings": true
        });
        ModelConfig::from_hf_config(std::path::Path::new("config.json"), &raw).unwrap()
    }

    #[test]
    fn step_inputs_map_positions_to_pool_rows_and_per_token_tables() {
        let rows = [
            BatchRow { seq: 0, pos: 0 },
            BatchRow { seq: 0, pos: 1 },
            BatchRow { seq: 0, pos: 2 },
            BatchRow { seq: 1, pos: 5 },
        ];
        let tables = vec![vec![4, 2], vec![1, 3, 0]];
        let s = step_inputs(&cfg(), &[1, 2, 3, 4], &rows, 2, &tables, 5, &[2, 3]).unwrap();
        // seq 1 position 5: block index 2 of its table (block 0), slot 1.
        assert_eq!(s.slots, [8, 9, 4, 1]);
        assert_eq!(s.max_blocks, 3);
        assert_eq!(s.tables, [4, 0, 0, 4, 0, 0, 4, 2, 0, 1, 3, 0]);
        assert_eq!(s.lens, [1, 2, 3, 6]);
        assert_eq!(s.logit_rows, [2, 3]);
    }

    #[test]
    fn prompt_runs_are_consecutive_positions_of_one_sequence() {
        let r = |seq, pos| BatchRow { seq, pos };
        // A chunk of 0 (3 rows), a decode row of 1, a chunk of 2 broken by a gap, 0 again.
        let rows = [r(0, 4), r(0, 5), r(0, 6), r(1, 9), r(2, 0), r(2, 1), r(2, 3), r(2, 4), r(0, 7)];
        assert_eq!(prompt_runs(&rows), [(0, 3), (4, 2), (6, 2)]);
        assert!(prompt_runs(&[r(0, 1), r(1, 2), r(0, 2)]).is_empty(), "decode rows form no run");
        assert!(prompt_runs(&[]).is_empty());
    }

    #[test]
    fn recurrent_rows_group_by_sequence_and_check_slots_and_order() {
        let rows = [
            BatchRow { seq: 1, pos: 4 },
            BatchRow { seq: 0, pos: 0 },
            BatchRow { seq: 1, pos: 5 },
            BatchRow { seq: 0, pos: 1 },
        ];
        let g = recurrent_rows(&rows, &[Some(3), Some(0)], &[SlotOp::Reset(3)], 4).unwrap();
        assert_eq!(g, RecurrentRows { rows: vec![0, 2, 1, 3], start: vec![0, 2, 4], slot: vec![0, 3] });
        assert!(recurrent_rows(&rows, &[Some(3), None], &[], 4)
            .unwrap_err()
            .to_string()
            .contains("no recurrent-state slot"));
        assert!(recurrent_rows(&rows, &[Some(3), Some(3)], &[], 4).unwrap_err().to_string().contains("shared"));
        assert!(recurrent_rows(&rows, &[Some(4), Some(0)], &[], 4).unwrap_err().to_string().contains("outside"));
        assert!(recurrent_rows(&rows, &[Some(1), Some(0)], &[SlotOp::Fork { from: 0, to: 7 }], 4)
            .unwrap_err()
            .to_string()
            .contains("slot operation"));
        let gap = [BatchRow { seq: 0, pos: 0 }, BatchRow { seq: 0, pos: 2 }];
        assert!(recurrent_rows(&gap, &[Some(0)], &[], 1).unwrap_err().to_string().contains("consecutive"));
    }

    #[test]
    fn bad_batches_are_errors_not_panics() {
        let c = cfg();
        let t = vec![vec![0u32]];
        let row = [BatchRow { seq: 0, pos: 0 }];
        assert!(step_inputs(&c, &[10], &row, 2, &t, 1, &[0])
            .unwrap_err()
            .to_string()
            .contains("outside the vocabulary"));
        assert!(step_inputs(&c, &[1], &row, 2, &t, 1, &[1]).unwrap_err().to_string().contains("logit row"));
        assert!(step_inputs(&c, &[1], &[BatchRow { seq: 1, pos: 0 }], 2, &t, 1, &[0])
            .unwrap_err()
            .to_string()
            .contains("no block table"));
        assert!(step_inputs(&c, &[1], &[BatchRow { seq: 0, pos: 2 }], 2, &t, 1, &[0])
            .unwrap_err()
            .to_string()
            .contains("past its"));
        assert!(step_inputs(&c, &[1], &row, 2, &[vec![3]], 1, &[0])
            .unwrap_err()
            .to_string()
            .contains("outside the device pool"));
        // An earlier block of the table (read by attention, not written) is checked too.
        let late = [BatchRow { seq: 0, pos: 2 }];
        assert!(step_inputs(&c, &[1], &late, 2, &[vec![7, 0]], 1, &[0])
            .unwrap_err()
            .to_string()
            .contains("block 7 is outside"));
    }
}
