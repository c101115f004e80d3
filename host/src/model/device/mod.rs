//! What every device forward shares, whatever the architecture: weights uploaded in their device
//! formats (`weights`), one step's per-token inputs checked and laid out for the kernels
//! (`step`), and the ranks of a multi-device model run concurrently with a failing rank
//! releasing its peers (`ranks`). The architectures' own device forwards are `arch::llama::device`
//! and the MLA/KDA/MoE `decoder` (DeepSeek-V3, Kimi-Linear); `placement` moves a loaded model
//! onto devices without naming an architecture.

pub(crate) mod attention_split;
pub mod decoder;
pub mod model;
pub mod placement;
pub mod ranks;
#[cfg(test)]
pub(crate) mod ref_runtime;
pub mod step;
#[cfg(test)]
pub(crate) mod test_util;
pub mod weights;

use kernels::gpu::{Kernels, Runtime};

use super::{ForwardError, LoadedModel};
use crate::parallel::device_collective::DeviceGroup;
use weights::DenseWeights;

/// How many devices `m`'s device forward runs on (one per rank: a whole model, or the ranks it
/// was loaded as), `None` for models without a device forward, which keep the CPU forward.
/// Placement asks before opening any device.
pub fn device_ranks(m: &LoadedModel) -> Option<usize> {
    m.model.device_form().map(|p| p.ranks())
}

/// Moves `m` onto `gpus`, one rank per device (the model must have been loaded with as many
/// ranks: `--tensor-parallel-size`), the ranks exchanging partial sums through `group`, dense
/// weights held as `dense` says; a model without a device forward is given back unchanged
/// (logged). The host copy of the weights is dropped.
pub fn place_on_devices<R: Runtime + 'static>(
    m: LoadedModel,
    gpus: Vec<Kernels<R>>,
    group: Box<dyn DeviceGroup<R>>,
    dense: DenseWeights,
) -> Result<LoadedModel, ForwardError> {
    let Some(form) = m.model.device_form() else {
        tracing::warn!(architecture = ?m.model.config().architecture, "no device forward for this architecture yet: its forward runs on the CPU");
        return Ok(m);
    };
    let ranks = form.ranks();
    if ranks != gpus.len() {
        return Err(ForwardError::Invalid(format!(
            "the model is loaded as {ranks} rank(s) but {} device(s) were given: one device per rank (--tensor-parallel-size or --expert-parallel-size must equal the number of devices)",
            gpus.len()
        )));
    }
    let model = placement::place(form, gpus, group, dense)?;
    Ok(LoadedModel { model, ..m })
}
