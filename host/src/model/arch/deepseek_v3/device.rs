//! DeepSeek-V3 on devices: the shared MLA/KDA/MoE device decoder (`model::device::decoder`) holds
//! the layers; this says how a whole model or its ranks become one.

use kernels::gpu::{Kernels, Runtime};

use super::parallel::ExpertParallelDeepseek;
use super::DeepseekV3Model;
use crate::model::device::decoder::DeviceDeepseek;
use crate::model::device::placement::DeviceForward;
use crate::model::device::weights::DenseWeights;
use crate::model::{ForwardError, LanguageModel};
use crate::parallel::device_collective::DeviceGroup;

/// A whole model on one device (a lone expert-parallel rank has no device form).
impl DeviceForward for DeepseekV3Model {
    fn device_ranks(&self) -> usize {
        1
    }
    fn onto_devices<R: Runtime + 'static>(
        &self,
        gpus: Vec<Kernels<R>>,
        group: Box<dyn DeviceGroup<R>>,
        dense: DenseWeights,
    ) -> Result<Box<dyn LanguageModel>, ForwardError> {
        Ok(Box::new(DeviceDeepseek::from_ranks_with(std::slice::from_ref(self), gpus, group, dense)?))
    }
}

/// Its sharded ranks, one device each.
impl DeviceForward for ExpertParallelDeepseek {
    fn device_ranks(&self) -> usize {
        self.ranks().len()
    }
    fn onto_devices<R: Runtime + 'static>(
        &self,
        gpus: Vec<Kernels<R>>,
        group: Box<dyn DeviceGroup<R>>,
        dense: DenseWeights,
    ) -> Result<Box<dyn LanguageModel>, ForwardError> {
        Ok(Box::new(DeviceDeepseek::from_ranks_with(self.ranks(), gpus, group, dense)?))
    }
}
