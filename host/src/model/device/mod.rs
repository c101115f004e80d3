//! What every device forward shares, whatever the architecture: weights uploaded in their device
//! formats (`weights`), one step's per-token inputs checked and laid out for the kernels
//! (`step`), and the ranks of a multi-device model run concurrently with a failing rank
//! releasing its peers (`ranks`). The architectures themselves are `device_llama` and
//! `device_deepseek`.

pub mod ranks;
pub mod step;
pub mod weights;
#[cfg(test)]
pub(crate) mod ref_runtime;

use kernels::gpu::{Kernels, Runtime};

use super::{ForwardError, LoadedModel};
use crate::mesh::device_collective::DeviceGroup;

/// How many devices `m`'s device forward runs on (one per rank: a whole model, or the ranks it
/// was loaded as), `None` for architectures without a device forward (Kimi-Linear), which keep
/// the CPU forward. Placement asks before opening any device.
pub fn device_ranks(m: &LoadedModel) -> Option<usize> {
    m.model.llama_ranks().map(<[_]>::len).or_else(|| m.model.deepseek_ranks().map(<[_]>::len))
}

/// Moves `m` onto `gpus`, one rank per device, the ranks exchanging partial sums through
/// `group`; a model without a device forward is given back unchanged (logged).
pub fn place_on_devices<R: Runtime + 'static>(m: LoadedModel, gpus: Vec<Kernels<R>>, group: Box<dyn DeviceGroup<R>>) -> Result<LoadedModel, ForwardError> {
    if m.model.deepseek_ranks().is_some() {
        return super::device_deepseek::place_on_devices(m, gpus, group);
    }
    super::device_llama::place_on_devices(m, gpus, group)
}
