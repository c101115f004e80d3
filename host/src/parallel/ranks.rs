//! Which part of a sharded model one instance holds.

/// Which expert-parallel part of the model an instance holds (`size == 1`: all of it).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EpRank {
    pub rank: usize,
    pub size: usize,
}

/// Which tensor-parallel part of the model an instance holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TpRank {
    pub rank: usize,
    pub size: usize,
}

impl TpRank {
    pub const SINGLE: TpRank = TpRank { rank: 0, size: 1 };
}
