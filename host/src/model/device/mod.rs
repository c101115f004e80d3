//! What every device forward shares, whatever the architecture: weights uploaded in their device
//! formats (`weights`), one step's per-token inputs checked and laid out for the kernels
//! (`step`), and the ranks of a multi-device model run concurrently with a failing rank
//! releasing its peers (`ranks`). The architectures themselves are `device_llama` and
//! `device_deepseek`.

pub(crate) mod attention_split;
pub mod model;
pub mod ranks;
pub mod step;
pub mod weights;
#[cfg(test)]
pub(crate) mod ref_runtime;
#[cfg(test)]
pub(crate) mod test_util;

use kernels::gpu::{Kernels, Runtime};

use super::device_deepseek::{DeviceDeepseek, DeviceKimiLinear};
use super::device_llama::DeviceLlama;
use super::{ForwardError, LoadedModel};
use crate::mesh::device_collective::DeviceGroup;
use weights::DenseWeights;

/// How many devices `m`'s device forward runs on (one per rank: a whole model, or the ranks it
/// was loaded as), `None` for models without a device forward, which keep the CPU forward.
/// Placement asks before opening any device.
pub fn device_ranks(m: &LoadedModel) -> Option<usize> {
    m.model.llama_ranks().map(<[_]>::len).or_else(|| m.model.deepseek_ranks().map(<[_]>::len)).or_else(|| m.model.kimi_linear_ranks().map(<[_]>::len))
}

/// Moves `m` onto `gpus`, one rank per device (the model must have been loaded with as many
/// ranks: `--tensor-parallel-size`), the ranks exchanging partial sums through `group`, dense
/// weights held as `dense` says; a model without a device forward is given back unchanged
/// (logged). The host copy of the weights is dropped.
pub fn place_on_devices<R: Runtime + 'static>(m: LoadedModel, gpus: Vec<Kernels<R>>, group: Box<dyn DeviceGroup<R>>, dense: DenseWeights) -> Result<LoadedModel, ForwardError> {
    let Some(ranks) = device_ranks(&m) else {
        tracing::warn!(architecture = ?m.model.config().architecture, "no device forward for this architecture yet: its forward runs on the CPU");
        return Ok(m);
    };
    if ranks != gpus.len() {
        return Err(ForwardError::Invalid(format!(
            "the model is loaded as {ranks} rank(s) but {} device(s) were given: one device per rank (--tensor-parallel-size or --expert-parallel-size must equal the number of devices)",
            gpus.len()
        )));
    }
    let model: Box<dyn super::LanguageModel> = match (m.model.llama_ranks(), m.model.deepseek_ranks(), m.model.kimi_linear_ranks()) {
        (Some(l), _, _) => Box::new(DeviceLlama::from_ranks_with(l, gpus, group, dense)?),
        (None, Some(d), _) => Box::new(DeviceDeepseek::from_ranks_with(d, gpus, group, dense)?),
        (None, None, Some(k)) => Box::new(DeviceKimiLinear::from_kimi_ranks(k, gpus, group, dense)?),
        (None, None, None) => unreachable!("device_ranks found ranks"),
    };
    Ok(LoadedModel { model, ..m })
}
