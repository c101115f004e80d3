//! Collectives on device buffers: what the device forward's tensor-parallel ranks exchange their
//! partial sums through. One rank's handle is a [`DeviceCollective`]; a [`DeviceGroup`] hands
//! every rank its handle for one forward step.
//!
//! Implementations:
//! - [`SoleRank`]: a group of one (a whole model on one device); every collective is a no-op.
//! - [`HostStaged`] over any host [`Collective`]: copy the buffer down, run the host collective,
//!   copy it back. [`LocalDeviceGroup`] uses it with [`LocalCollective`] so that several
//!   simulated (or reference) devices in one process form a group: that is how tensor-parallel
//!   device forwards are tested without GPUs.
//! - NCCL on the ranks' own CUDA streams, no host copies (`backend::nccl::NcclDeviceGroup`).
//!
//! A collective is ordered after the work the rank already queued on its device (on CUDA the
//! communicator shares the runtime's stream; the host-staged path downloads, which waits).

use std::sync::Arc;

use kernels::cuda::CudaError;
use kernels::gpu::{Kernels, Runtime};

use super::collective::{Collective, CollectiveError};
use super::local::LocalCollective;

/// Why a device collective failed: the device (driver, NCCL) or the group (a peer aborted,
/// mismatched arguments). The model's forward maps it to its own error.
#[derive(Debug, thiserror::Error)]
pub enum DeviceCollectiveError {
    #[error("{0}")]
    Device(#[from] CudaError),
    #[error("tensor-parallel collective failed: {0}")]
    Group(#[from] CollectiveError),
    #[error("{0}")]
    Invalid(String),
}

/// One rank's handle on a group of devices, for one forward step.
pub trait DeviceCollective<R: Runtime>: Send + Sync {
    fn rank(&self) -> usize;
    fn world_size(&self) -> usize;
    /// Sums `buf[..n]` element-wise over the group, in place, on every rank. `gpu` is this rank's
    /// device (the one `buf` lives on).
    fn all_reduce_sum(&self, gpu: &Kernels<R>, buf: &mut R::Buf<f32>, n: usize) -> Result<(), DeviceCollectiveError>;
    /// Marks the group failed so ranks waiting in (or later entering) a collective return an error
    /// instead of waiting for this rank forever.
    fn abort(&self, reason: &str);
}

/// Where each forward step gets its ranks' handles (rank `r` gets element `r`).
pub trait DeviceGroup<R: Runtime>: Send + Sync {
    fn world_size(&self) -> usize;
    fn step_comms(&self) -> Result<Vec<Arc<dyn DeviceCollective<R>>>, DeviceCollectiveError>;
}

/// The group of one device.
pub struct SoleRank;

impl<R: Runtime> DeviceCollective<R> for SoleRank {
    fn rank(&self) -> usize {
        0
    }
    fn world_size(&self) -> usize {
        1
    }
    fn all_reduce_sum(
        &self,
        _gpu: &Kernels<R>,
        _buf: &mut R::Buf<f32>,
        _n: usize,
    ) -> Result<(), DeviceCollectiveError> {
        Ok(())
    }
    fn abort(&self, _reason: &str) {}
}

impl<R: Runtime> DeviceGroup<R> for SoleRank {
    fn world_size(&self) -> usize {
        1
    }
    fn step_comms(&self) -> Result<Vec<Arc<dyn DeviceCollective<R>>>, DeviceCollectiveError> {
        Ok(vec![Arc::new(SoleRank)])
    }
}

/// A host collective used on device buffers by staging them through host memory.
pub struct HostStaged<C>(pub C);

impl<R: Runtime, C: Collective> DeviceCollective<R> for HostStaged<C> {
    fn rank(&self) -> usize {
        self.0.rank()
    }
    fn world_size(&self) -> usize {
        self.0.world_size()
    }
    fn all_reduce_sum(&self, gpu: &Kernels<R>, buf: &mut R::Buf<f32>, n: usize) -> Result<(), DeviceCollectiveError> {
        let mut host = gpu.download(buf)?;
        if host.len() < n {
            return Err(DeviceCollectiveError::Invalid(format!(
                "all_reduce_sum of {n} elements on a buffer of {}",
                host.len()
            )));
        }
        self.0.all_reduce_sum(&mut host[..n])?;
        gpu.write(buf, 0, &host[..n])?;
        Ok(())
    }
    fn abort(&self, reason: &str) {
        self.0.abort(reason)
    }
}

/// `world` devices of one process as one group: a fresh [`LocalCollective`] group per step, so a
/// step that failed (and aborted its group) does not poison the next.
pub struct LocalDeviceGroup {
    pub world: usize,
}

impl<R: Runtime> DeviceGroup<R> for LocalDeviceGroup {
    fn world_size(&self) -> usize {
        self.world
    }
    fn step_comms(&self) -> Result<Vec<Arc<dyn DeviceCollective<R>>>, DeviceCollectiveError> {
        Ok(LocalCollective::group(self.world)
            .into_iter()
            .map(|c| Arc::new(HostStaged(c)) as Arc<dyn DeviceCollective<R>>)
            .collect())
    }
}
