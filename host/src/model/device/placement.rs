//! How a loaded model moves onto devices, without the device code naming any architecture.
//!
//! An architecture implements [`DeviceForward`] once, generic over the device runtime, for each
//! CPU form that can move (a whole model, its sharded ranks). A loaded model hands that out as a
//! [`Placeable`] (`LanguageModel::device_form`), the object-safe face of the same thing with one
//! method per runtime this build has (the simulator, CUDA with the `cuda` feature, the reference
//! runtime in tests). [`place`] takes the caller's runtime, generic, to the matching method: the
//! runtimes are a closed list kept here, the architectures an open one kept in their folders.

use std::any::Any;

use kernels::gpu::{Kernels, Runtime};
use kernels::sim::SimRuntime;

use super::weights::DenseWeights;
use crate::model::{ForwardError, LanguageModel};
use crate::parallel::device_collective::DeviceGroup;

/// A CPU model (or its sharded ranks) that its architecture can upload to devices.
pub trait DeviceForward: Send + Sync {
    /// Devices it runs on: one per rank.
    fn device_ranks(&self) -> usize;

    /// The device model: rank `r` on `gpus[r]`, the ranks exchanging partial sums through
    /// `group`, dense weights held as `dense` says.
    fn onto_devices<R: Runtime + 'static>(
        &self,
        gpus: Vec<Kernels<R>>,
        group: Box<dyn DeviceGroup<R>>,
        dense: DenseWeights,
    ) -> Result<Box<dyn LanguageModel>, ForwardError>;
}

/// [`DeviceForward`] as a trait object: implemented for every `DeviceForward`.
pub trait Placeable: Send + Sync {
    fn ranks(&self) -> usize;
    fn on_sim(
        &self,
        gpus: Vec<Kernels<SimRuntime>>,
        group: Box<dyn DeviceGroup<SimRuntime>>,
        dense: DenseWeights,
    ) -> Result<Box<dyn LanguageModel>, ForwardError>;
    #[cfg(feature = "cuda")]
    fn on_cuda(
        &self,
        gpus: Vec<Kernels<kernels::cuda::launch::CudaRuntime>>,
        group: Box<dyn DeviceGroup<kernels::cuda::launch::CudaRuntime>>,
        dense: DenseWeights,
    ) -> Result<Box<dyn LanguageModel>, ForwardError>;
    #[cfg(test)]
    fn on_reference(
        &self,
        gpus: Vec<Kernels<super::ref_runtime::RefRuntime>>,
        group: Box<dyn DeviceGroup<super::ref_runtime::RefRuntime>>,
        dense: DenseWeights,
    ) -> Result<Box<dyn LanguageModel>, ForwardError>;
    #[cfg(test)]
    fn on_flaky(
        &self,
        gpus: Vec<Kernels<super::ref_runtime::Flaky>>,
        group: Box<dyn DeviceGroup<super::ref_runtime::Flaky>>,
        dense: DenseWeights,
    ) -> Result<Box<dyn LanguageModel>, ForwardError>;
}

impl<T: DeviceForward> Placeable for T {
    fn ranks(&self) -> usize {
        self.device_ranks()
    }
    fn on_sim(
        &self,
        gpus: Vec<Kernels<SimRuntime>>,
        group: Box<dyn DeviceGroup<SimRuntime>>,
        dense: DenseWeights,
    ) -> Result<Box<dyn LanguageModel>, ForwardError> {
        self.onto_devices(gpus, group, dense)
    }
    #[cfg(feature = "cuda")]
    fn on_cuda(
        &self,
        gpus: Vec<Kernels<kernels::cuda::launch::CudaRuntime>>,
        group: Box<dyn DeviceGroup<kernels::cuda::launch::CudaRuntime>>,
        dense: DenseWeights,
    ) -> Result<Box<dyn LanguageModel>, ForwardError> {
        self.onto_devices(gpus, group, dense)
    }
    #[cfg(test)]
    fn on_reference(
        &self,
        gpus: Vec<Kernels<super::ref_runtime::RefRuntime>>,
        group: Box<dyn DeviceGroup<super::ref_runtime::RefRuntime>>,
        dense: DenseWeights,
    ) -> Result<Box<dyn LanguageModel>, ForwardError> {
        self.onto_devices(gpus, group, dense)
    }
    #[cfg(test)]
    fn on_flaky(
        &self,
        gpus: Vec<Kernels<super::ref_runtime::Flaky>>,
        group: Box<dyn DeviceGroup<super::ref_runtime::Flaky>>,
        dense: DenseWeights,
    ) -> Result<Box<dyn LanguageModel>, ForwardError> {
        self.onto_devices(gpus, group, dense)
    }
}

type Args<R> = (Vec<Kernels<R>>, Box<dyn DeviceGroup<R>>);

/// Runs `p`'s upload on runtime `R`: the one place a generic runtime meets the object-safe
/// methods (by type identity; a runtime not listed in [`Placeable`] is an error, not a panic).
pub fn place<R: Runtime + 'static>(
    p: &dyn Placeable,
    gpus: Vec<Kernels<R>>,
    group: Box<dyn DeviceGroup<R>>,
    dense: DenseWeights,
) -> Result<Box<dyn LanguageModel>, ForwardError> {
    let args: Box<dyn Any> = Box::new((gpus, group));
    let args = match args.downcast::<Args<SimRuntime>>() {
        Ok(a) => return p.on_sim(a.0, a.1, dense),
        Err(other) => other,
    };
    #[cfg(feature = "cuda")]
    let args = match args.downcast::<Args<kernels::cuda::launch::CudaRuntime>>() {
        Ok(a) => return p.on_cuda(a.0, a.1, dense),
        Err(other) => other,
    };
    #[cfg(test)]
    let args = match args.downcast::<Args<super::ref_runtime::RefRuntime>>() {
        Ok(a) => return p.on_reference(a.0, a.1, dense),
        Err(other) => other,
    };
    #[cfg(test)]
    let args = match args.downcast::<Args<super::ref_runtime::Flaky>>() {
        Ok(a) => return p.on_flaky(a.0, a.1, dense),
        Err(other) => other,
    };
    drop(args);
    Err(ForwardError::Invalid(format!("no device forward is built for the runtime {}", std::any::type_name::<R>())))
}
