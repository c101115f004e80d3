//! The collective-communication interface, shaped like NCCL so a CUDA implementation drops in.
//!
//! A value implementing [`Collective`] is one rank's handle on a communicator (NCCL's
//! `ncclComm_t`): every rank of the group calls the same collectives in the same order, each
//! with its own buffers. Mapping to NCCL (through cudarc's `nccl::Comm`, which is generic over
//! the element type just as these methods are):
//!
//! | here | NCCL |
//! |---|---|
//! | `rank()`, `world_size()` | `ncclCommUserRank`, `ncclCommCount` |
//! | `all_reduce_sum(buf)` | `ncclAllReduce(buf, buf, n, T, ncclSum, comm, stream)` (in place) |
//! | `all_gather(send, recv)` | `ncclAllGather(send, recv, send.len(), T, comm, stream)`; `recv` is `world × send.len()`, rank-major |
//! | `broadcast(buf, root)` | `ncclBroadcast(buf, buf, n, T, root, comm, stream)` |
//! | `all_to_all_v(send, send_counts, recv, recv_counts)` | `ncclGroupStart`; per peer `p`: `ncclSend(send[off_p..], send_counts[p], T, p)` + `ncclRecv(recv[off'_p..], recv_counts[p], T, p)`; `ncclGroupEnd` (NCCL has no all-to-all-v primitive; this is how vLLM and DeepSpeed build it) |
//! | `exchange_counts(send_counts)` | the same grouped send/recv with one `u64` per peer |
//! | `barrier()` | an `ncclAllReduce` of one element, then `cudaStreamSynchronize` |
//!
//! Element types are `f32`/`u32`/`u64` ([`Element`], NCCL's `ncclFloat32`/`ncclUint32`/`ncclUint64`).
//!
//! Two rules every implementation keeps so that results are reproducible and identical on all
//! ranks: a sum is accumulated in rank order `0, 1, …, world-1` for every element (NCCL gives the
//! same guarantee only with `NCCL_ALGO=Ring` and a fixed topology — see docs/sharding.md), and a
//! failure on one rank (a panic, mismatched lengths) turns into an error on every rank instead of
//! leaving the others blocked forever.

use std::any::Any;

/// Types collectives move (NCCL's `ncclDataType_t`).
pub trait Element: Copy + Default + Send + Sync + Any {
    /// NCCL's name for the type, for error messages and the future NCCL mapping.
    const NCCL_NAME: &'static str;
}

/// Types `all_reduce_sum` adds.
pub trait ReduceElement: Element + std::ops::AddAssign {}

impl Element for f32 {
    const NCCL_NAME: &'static str = "ncclFloat32";
}
impl Element for u32 {
    const NCCL_NAME: &'static str = "ncclUint32";
}
impl Element for u64 {
    const NCCL_NAME: &'static str = "ncclUint64";
}
impl ReduceElement for f32 {}
impl ReduceElement for u32 {}
impl ReduceElement for u64 {}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CollectiveError {
    #[error("{op}: rank {rank} passed {got} elements, rank 0 passed {want} (every rank must pass the same length)")]
    LengthMismatch { op: &'static str, rank: usize, got: usize, want: usize },
    #[error("{op}: {detail}")]
    BadArgument { op: &'static str, detail: String },
    #[error("{op}: ranks passed different element types (rank {rank} is not {want})")]
    TypeMismatch { op: &'static str, rank: usize, want: &'static str },
    #[error("collective aborted: another rank failed ({reason})")]
    Aborted { reason: String },
}

pub trait Collective: Send + Sync {
    fn rank(&self) -> usize;
    fn world_size(&self) -> usize;

    /// Sums `buf` element-wise over all ranks, in place; every rank gets the same values.
    fn all_reduce_sum<T: ReduceElement>(&self, buf: &mut [T]) -> Result<(), CollectiveError>;

    /// Concatenates every rank's `send` (all the same length) into `recv`, rank-major.
    fn all_gather<T: Element>(&self, send: &[T], recv: &mut [T]) -> Result<(), CollectiveError>;

    /// Copies `root`'s `buf` into every other rank's `buf`.
    fn broadcast<T: Element>(&self, buf: &mut [T], root: usize) -> Result<(), CollectiveError>;

    /// Tells each peer how many elements this rank will send it: `send_counts[p]` goes to rank
    /// `p`; returns `recv_counts`, where `recv_counts[p]` is what rank `p` will send here.
    fn exchange_counts(&self, send_counts: &[usize]) -> Result<Vec<usize>, CollectiveError>;

    /// All-to-all with per-peer counts: `send` is the concatenation, in peer order, of the
    /// `send_counts[p]` elements for each rank `p`; `recv` receives, in peer order, the
    /// `recv_counts[p]` elements rank `p` sent here (get `recv_counts` from [`Self::exchange_counts`]).
    fn all_to_all_v<T: Element>(
        &self,
        send: &[T],
        send_counts: &[usize],
        recv: &mut [T],
        recv_counts: &[usize],
    ) -> Result<(), CollectiveError>;

    /// Returns once every rank has called it.
    fn barrier(&self) -> Result<(), CollectiveError>;

    /// Marks the group failed so ranks blocked in (or later entering) a collective return
    /// [`CollectiveError::Aborted`] instead of waiting for this rank forever.
    fn abort(&self, reason: &str);
}
