//! Where the model's forward runs, from `--device`: the CPU model as loaded, or, for a CUDA
//! device, a single-device Llama moved onto it (`model::device_llama`). Other architectures keep
//! the CPU forward and the log says so; a device that cannot be opened is an error naming the
//! cause for an explicit `cuda:N`, and a logged fallback for `auto`.

use super::DeviceSpec;
use crate::model::device_llama::single_device_llama;
use crate::model::LoadedModel;

/// Moves `m` to the device `spec` names (unchanged for `cpu`).
pub fn place_model(m: LoadedModel, spec: &DeviceSpec) -> Result<LoadedModel, String> {
    let ordinal = match spec {
        DeviceSpec::Cpu => return Ok(m),
        DeviceSpec::Cuda(ords) => match ords.as_slice() {
            &[o] => o,
            _ => return Err(format!("--device {spec}: the device forward runs a model on one device; several ordinals (one per parallel rank) are not implemented for it yet")),
        },
        DeviceSpec::Auto => 0,
        DeviceSpec::Sim => return onto_sim(m),
    };
    // Decided before a device is opened: a model without a device forward stays on the CPU.
    match single_device_llama(&m).map(|l| l.is_some()) {
        Err(e) => return Err(format!("--device {spec}: {e}")),
        Ok(false) => {
            tracing::warn!(architecture = ?m.model.config().architecture, "no device forward for this architecture yet: its forward runs on the CPU");
            return Ok(m);
        }
        Ok(true) => {}
    }
    match onto_cuda(m, ordinal) {
        Placed::Moved(m) => {
            tracing::info!(ordinal, "the model's forward runs on the CUDA device");
            Ok(m)
        }
        Placed::Failed(e) => Err(format!("--device {spec}: {e}")),
        Placed::Unavailable(m, e) if *spec == DeviceSpec::Auto => {
            tracing::warn!("--device auto: no usable CUDA device ({e}); the model runs on the CPU");
            Ok(m)
        }
        Placed::Unavailable(_, e) => Err(format!("--device {spec}: cannot use CUDA device {ordinal}: {e}. Use --device cpu (or auto, which falls back to the CPU).")),
    }
}

/// `--device sim` (development and tests): the device forward on the CUDA-kernel simulator.
fn onto_sim(m: LoadedModel) -> Result<LoadedModel, String> {
    match single_device_llama(&m).map(|l| l.is_some()) {
        Err(e) => return Err(format!("--device sim: {e}")),
        Ok(false) => return Err("--device sim: the simulator runs the single-device Llama forward only; this model has none".into()),
        Ok(true) => {}
    }
    let gpu = kernels::sim::SimGpu::sim().map_err(|e| format!("--device sim: {e}"))?;
    tracing::warn!("--device sim: the model's forward runs on the CUDA-kernel simulator (a development/test device, far slower than --device cpu)");
    crate::model::device_llama::place_on_device(m, gpu).map_err(|e| format!("--device sim: {e}"))
}

// Without the `cuda` feature only `Unavailable` is ever built.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
enum Placed {
    Moved(LoadedModel),
    /// The device could not be opened; the model is given back unchanged.
    Unavailable(LoadedModel, String),
    /// The device opened but the upload failed.
    Failed(String),
}

#[cfg(feature = "cuda")]
fn onto_cuda(m: LoadedModel, ordinal: usize) -> Placed {
    use kernels::cuda::nvrtc::PtxCache;
    match kernels::cuda::launch::Gpu::open(ordinal, &PtxCache::new(PtxCache::default_dir())) {
        Ok(gpu) => match crate::model::device_llama::place_on_device(m, gpu) {
            Ok(m) => Placed::Moved(m),
            Err(e) => Placed::Failed(e.to_string()),
        },
        Err(e) => Placed::Unavailable(m, e.to_string()),
    }
}

#[cfg(not(feature = "cuda"))]
fn onto_cuda(m: LoadedModel, _ordinal: usize) -> Placed {
    Placed::Unavailable(m, kernels::cuda::CudaError::NotBuilt.to_string())
}

