//! The device mesh: `world = tp × ep` ranks laid out with the tensor-parallel axis innermost, so
//! the ranks of one TP group are adjacent (on a real node they share the fastest links, and TP
//! all-reduces run once per layer, far more often than EP all-to-alls).

use std::fmt;

/// Where one rank sits in the mesh.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MeshCoord {
    /// Index within its tensor-parallel group (`0..tp`).
    pub tp_rank: usize,
    /// Index within its expert-parallel group (`0..ep`).
    pub ep_rank: usize,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MeshError {
    #[error("device mesh: {axis} size must be at least 1 (got 0)")]
    ZeroAxis { axis: &'static str },
    #[error("device mesh: tp {tp} × ep {ep} = {world} ranks exceeds the limit of {max}")]
    TooLarge { tp: usize, ep: usize, world: usize, max: usize },
    #[error("device mesh: rank {rank} out of range for a world of {world}")]
    BadRank { rank: usize, world: usize },
}

/// Simulated devices are threads; far more than cores only measures the scheduler.
pub const MAX_WORLD: usize = 64;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeviceMesh {
    tp: usize,
    ep: usize,
}

impl DeviceMesh {
    pub fn new(tp: usize, ep: usize) -> Result<Self, MeshError> {
        if tp == 0 {
            return Err(MeshError::ZeroAxis { axis: "tensor-parallel" });
        }
        if ep == 0 {
            return Err(MeshError::ZeroAxis { axis: "expert-parallel" });
        }
        let world = tp.saturating_mul(ep);
        if world > MAX_WORLD {
            return Err(MeshError::TooLarge { tp, ep, world, max: MAX_WORLD });
        }
        Ok(Self { tp, ep })
    }

    /// One device: no sharding.
    pub fn single() -> Self {
        Self { tp: 1, ep: 1 }
    }

    pub fn tp_size(&self) -> usize {
        self.tp
    }

    pub fn ep_size(&self) -> usize {
        self.ep
    }

    pub fn world_size(&self) -> usize {
        self.tp * self.ep
    }

    pub fn coord(&self, rank: usize) -> Result<MeshCoord, MeshError> {
        if rank >= self.world_size() {
            return Err(MeshError::BadRank { rank, world: self.world_size() });
        }
        Ok(MeshCoord { tp_rank: rank % self.tp, ep_rank: rank / self.tp })
    }

    pub fn rank_of(&self, c: MeshCoord) -> Result<usize, MeshError> {
        if c.tp_rank >= self.tp || c.ep_rank >= self.ep {
            return Err(MeshError::BadRank { rank: c.ep_rank * self.tp + c.tp_rank, world: self.world_size() });
        }
        Ok(c.ep_rank * self.tp + c.tp_rank)
    }

    /// The global ranks of the tensor-parallel group at `ep_rank`, in TP order.
    pub fn tp_group(&self, ep_rank: usize) -> Vec<usize> {
        (0..self.tp).map(|t| ep_rank * self.tp + t).collect()
    }

    /// The global ranks of the expert-parallel group at `tp_rank`, in EP order.
    pub fn ep_group(&self, tp_rank: usize) -> Vec<usize> {
        (0..self.ep).map(|e| e * self.tp + tp_rank).collect()
    }
}

impl fmt::Display for DeviceMesh {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "tp{}×ep{}", self.tp, self.ep)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout_is_tp_innermost_and_groups_partition_the_world() {
        let m = DeviceMesh::new(2, 3).unwrap();
        assert_eq!(m.world_size(), 6);
        assert_eq!(m.coord(3).unwrap(), MeshCoord { tp_rank: 1, ep_rank: 1 });
        for r in 0..6 {
            assert_eq!(m.rank_of(m.coord(r).unwrap()).unwrap(), r);
        }
        assert_eq!(m.tp_group(2), vec![4, 5]);
        assert_eq!(m.ep_group(1), vec![1, 3, 5]);
        let mut all: Vec<usize> = (0..3).flat_map(|e| m.tp_group(e)).collect();
        all.sort();
        assert_eq!(all, (0..6).collect::<Vec<_>>());
        assert!(m.coord(6).is_err());
    }

    #[test]
    fn bad_sizes_are_errors() {
        assert_eq!(DeviceMesh::new(0, 1), Err(MeshError::ZeroAxis { axis: "tensor-parallel" }));
        assert!(matches!(DeviceMesh::new(1, 0), Err(MeshError::ZeroAxis { .. })));
        assert!(matches!(DeviceMesh::new(16, 16), Err(MeshError::TooLarge { .. })));
    }
}
