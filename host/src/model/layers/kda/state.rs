//! Per-sequence recurrent state of KDA layers: fixed size, independent of the sequence length.
//!
//! Unlike keys/values, which grow with every token and live in the paged pool, a KDA layer keeps
//! only its short-convolution history and one fp32 matrix per head. Whoever owns sequences (the
//! engine, single-request generation) owns one `SequenceState` per sequence and hands the model a
//! `RecurrentStates` view for each batch.

use crate::model::layers::kda::KdaConfig;

/// One KDA layer's state for one sequence.
#[derive(Clone, Debug, PartialEq)]
pub struct KdaState {
    /// The last `conv_kernel - 1` inputs of each of the `3 * P` convolution channels (q, k, v
    /// projections, in that order), channel-major and oldest first: `[3P][kernel - 1]`.
    pub conv: Vec<f32>,
    /// Gated delta rule state `S`, fp32, `[heads][head_dim (key)][head_dim (value)]`: the output
    /// of a head is `Sᵀ q`. (K3's reference stores it value-first; only the layout differs.)
    pub recurrent: Vec<f32>,
    /// Tokens folded into this state so far (the position the next token must have).
    pub tokens: usize,
}

impl KdaState {
    pub fn new(cfg: &KdaConfig) -> Self {
        Self {
            conv: vec![0.0; 3 * cfg.proj_dim() * (cfg.conv_kernel - 1)],
            recurrent: vec![0.0; cfg.num_heads * cfg.head_dim * cfg.head_dim],
            tokens: 0,
        }
    }

    /// Back to the state before any token (reuse without reallocating).
    pub fn reset(&mut self) {
        self.conv.fill(0.0);
        self.recurrent.fill(0.0);
        self.tokens = 0;
    }

    /// Bytes of state one KDA layer keeps per sequence.
    pub fn bytes(cfg: &KdaConfig) -> usize {
        4 * (3 * cfg.proj_dim() * (cfg.conv_kernel - 1) + cfg.num_heads * cfg.head_dim * cfg.head_dim)
    }
}

/// All KDA layers' state of one sequence, indexed by the layer's ordinal among the model's KDA
/// layers (not its layer index).
#[derive(Clone, Debug, PartialEq)]
pub struct SequenceState {
    pub layers: Vec<KdaState>,
}

impl SequenceState {
    pub fn new(layers: &[KdaConfig]) -> Self {
        Self { layers: layers.iter().map(KdaState::new).collect() }
    }

    pub fn reset(&mut self) {
        self.layers.iter_mut().for_each(KdaState::reset);
    }

    pub fn bytes(layers: &[KdaConfig]) -> usize {
        layers.iter().map(KdaState::bytes).sum()
    }
}

/// A batch's view of its sequences' recurrent states.
pub trait RecurrentStates {
    /// The state of KDA layer `ordinal` for every sequence of the batch, in batch order (entry
    /// `b` belongs to the rows with `BatchRow::seq == b`).
    fn layer(&mut self, ordinal: usize) -> Vec<&mut KdaState>;
}

/// One `SequenceState` per batch sequence, owned: single-request generation and tests.
pub struct OwnedStates(pub Vec<SequenceState>);

impl OwnedStates {
    pub fn new(layers: &[KdaConfig], num_seqs: usize) -> Self {
        Self((0..num_seqs).map(|_| SequenceState::new(layers)).collect())
    }
}

impl RecurrentStates for OwnedStates {
    fn layer(&mut self, ordinal: usize) -> Vec<&mut KdaState> {
        self.0.iter_mut().map(|s| &mut s.layers[ordinal]).collect()
    }
}

/// Borrowed states in batch order (the engine's slots for one step).
impl RecurrentStates for Vec<&mut SequenceState> {
    fn layer(&mut self, ordinal: usize) -> Vec<&mut KdaState> {
        self.iter_mut().map(|s| &mut s.layers[ordinal]).collect()
    }
}
