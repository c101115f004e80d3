//! Kimi-Linear on devices: the shared MLA/KDA/MoE device decoder (`model::device::decoder`) holds
//! the layers; this says how a whole model or its ranks become one.

use kernels::gpu::{Kernels, Runtime};

use super::parallel::ExpertParallelKimiLinear;
use super::KimiLinearModel;
use crate::model::device::decoder::DeviceKimiLinear;
use crate::model::device::placement::DeviceForward;
use crate::model::device::weights::DenseWeights;
use crate::model::{ForwardError, LanguageModel};
use crate::parallel::device_collective::DeviceGroup;

/// A whole model on one device (a lone expert-parallel rank has no device form).
impl DeviceForward for KimiLinearModel {
    fn device_ranks(&self) -> usize {
        1
    }
    fn onto_devices<R: Runtime + 'static>(
        &self,
        gpus: Vec<Kernels<R>>,
        group: Box<dyn DeviceGroup<R>>,
        dense: DenseWeights,
    ) -> Result<Box<dyn LanguageModel>, ForwardError> {
        Ok(Box::new(DeviceKimiLinear::from_kimi_ranks(std::slice::from_ref(self), gpus, group, dense)?))
    }
}

/// Its sharded ranks, one device each.
impl DeviceForward for ExpertParallelKimiLinear {
    fn device_ranks(&self) -> usize {
        self.ranks().len()
    }
    fn onto_devices<R: Runtime + 'static>(
        &self,
        gpus: Vec<Kernels<R>>,
        group: Box<dyn DeviceGroup<R>>,
        dense: DenseWeights,
    ) -> Result<Box<dyn LanguageModel>, ForwardError> {
        Ok(Box::new(DeviceKimiLinear::from_kimi_ranks(self.ranks(), gpus, group, dense)?))
    }
}
