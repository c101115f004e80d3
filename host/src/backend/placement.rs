//! Where the model's forward runs, from `--device`: the CPU model as loaded, or, for CUDA
//! devices, a Llama, DeepSeek-V3 or Kimi-Linear moved onto them (`model::arch::llama::device`,
//! `model::device::decoder`), one device per rank with NCCL between them (DeepSeek-V3 and
//! Kimi-Linear tensor- or expert-parallel, Llama tensor-parallel). Architectures without a device
//! forward keep the CPU forward and the log says so; a device that cannot be opened is an error
//! naming the cause for an explicit `cuda:N`, and a logged fallback for `auto`.

use super::DeviceSpec;
use crate::model::device::weights::DenseWeights;
use crate::model::device::{device_ranks, place_on_devices};
use crate::model::LoadedModel;
use crate::parallel::device_collective::{DeviceGroup, LocalDeviceGroup, SoleRank};

/// Moves `m` to the device(s) `spec` names (unchanged for `cpu`): one device per tensor-parallel
/// rank, so `--device cuda:0,1` goes with `--tensor-parallel-size 2`. `dense` (`--dtype`) is how
/// a device holds dense weights; the CPU forward always computes in f32.
pub fn place_model(m: LoadedModel, spec: &DeviceSpec, dense: DenseWeights) -> Result<LoadedModel, String> {
    if *spec == DeviceSpec::Cpu {
        return Ok(m);
    }
    // Decided before a device is opened: a model without a device forward stays on the CPU.
    let Some(ranks) = device_ranks(&m) else {
        if *spec == DeviceSpec::Sim {
            return Err("--device sim: the simulator runs the device forwards (Llama, DeepSeek-V3, Kimi-Linear) only; this model has none".into());
        }
        tracing::warn!(architecture = ?m.model.config().architecture, "no device forward for this architecture yet: its forward runs on the CPU");
        return Ok(m);
    };
    let ordinals: Vec<usize> = match spec {
        DeviceSpec::Cpu => unreachable!("handled above"),
        DeviceSpec::Sim => return onto_sim(m, ranks, dense),
        DeviceSpec::Cuda(ords) => ords.clone(),
        DeviceSpec::Auto => (0..ranks).collect(),
    };
    if ordinals.len() != ranks {
        return Err(format!(
            "--device {spec} names {} device(s) but the model is loaded as {ranks} rank(s): give one device per tensor- or expert-parallel rank (e.g. --device cuda:0,1 --tensor-parallel-size 2)",
            ordinals.len()
        ));
    }
    match onto_cuda(m, &ordinals, dense) {
        Placed::Moved(m) => {
            tracing::info!(?ordinals, "the model's forward runs on the CUDA device(s)");
            note_cpu_activations(&m);
            Ok(m)
        }
        Placed::Failed(e) => Err(format!("--device {spec}: {e}")),
        Placed::Unavailable(m, e) if *spec == DeviceSpec::Auto => {
            tracing::warn!("--device auto: no usable CUDA device ({e}); the model runs on the CPU");
            Ok(m)
        }
        Placed::Unavailable(_, e) => Err(format!("--device {spec}: cannot use CUDA device(s) {ordinals:?}: {e}. Use --device cpu (or auto, which falls back to the CPU).")),
    }
}

/// `--device sim` (development and tests): the device forward on the CUDA-kernel simulator, one
/// simulated device per tensor-parallel rank, their all-reduces staged through the host.
fn onto_sim(m: LoadedModel, ranks: usize, dense: DenseWeights) -> Result<LoadedModel, String> {
    let gpus = (0..ranks)
        .map(|_| kernels::sim::SimGpu::sim())
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| format!("--device sim: {e}"))?;
    let group: Box<dyn DeviceGroup<_>> =
        if ranks == 1 { Box::new(SoleRank) } else { Box::new(LocalDeviceGroup { world: ranks }) };
    tracing::warn!(ranks, "--device sim: the model's forward runs on the CUDA-kernel simulator (a development/test device, far slower than --device cpu)");
    let m = place_on_devices(m, gpus, group, dense).map_err(|e| format!("--device sim: {e}"))?;
    note_cpu_activations(&m);
    Ok(m)
}

/// `--cpu-activations int8` changes only the CPU forward; says so once the forward has moved to
/// a device (which runs its own kernels on the same packed codes, with its own activations).
fn note_cpu_activations(m: &LoadedModel) {
    if let Some(note) = cpu_activations_note(m) {
        tracing::warn!("{note}");
    }
}

fn cpu_activations_note(m: &LoadedModel) -> Option<&'static str> {
    (m.cpu_activations == crate::model::activations::CpuActivations::Int8)
        .then_some("--cpu-activations int8 applies to the CPU forward only; the device forward ignores it")
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
fn onto_cuda(m: LoadedModel, ordinals: &[usize], dense: DenseWeights) -> Placed {
    use kernels::cuda::launch::Gpu;
    use kernels::cuda::nvrtc::PtxCache;
    let cache = PtxCache::new(PtxCache::default_dir());
    let gpus = match ordinals.iter().map(|&o| Gpu::open(o, &cache)).collect::<Result<Vec<_>, _>>() {
        Ok(g) => g,
        Err(e) => return Placed::Unavailable(m, e.to_string()),
    };
    let group: Box<dyn DeviceGroup<_>> = if gpus.len() == 1 {
        Box::new(SoleRank)
    } else {
        match super::nccl::NcclDeviceGroup::over(&gpus) {
            Ok(g) => Box::new(g),
            Err(e) => return Placed::Unavailable(m, e.to_string()),
        }
    };
    match place_on_devices(m, gpus, group, dense) {
        Ok(m) => Placed::Moved(m),
        Err(e) => Placed::Failed(e.to_string()),
    }
}

#[cfg(not(feature = "cuda"))]
fn onto_cuda(m: LoadedModel, _ordinals: &[usize], _dense: DenseWeights) -> Placed {
    Placed::Unavailable(m, kernels::cuda::CudaError::NotBuilt.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tiny_tp(tp: usize) -> LoadedModel {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/reference/tiny_llama");
        crate::model::load_tp(&dir, tp).unwrap()
    }

    /// One device per tensor-parallel rank: a count that does not match is refused before any
    /// device is opened, naming both numbers and the fix.
    #[test]
    fn device_count_must_match_the_tensor_parallel_size() {
        let e = place_model(tiny_tp(2), &DeviceSpec::Cuda(vec![0]), DenseWeights::Bf16).err().unwrap();
        assert!(
            e.contains("names 1 device(s) but the model is loaded as 2 rank(s)")
                && e.contains("--device cuda:0,1 --tensor-parallel-size 2"),
            "{e}"
        );
        let e = place_model(tiny_tp(1), &DeviceSpec::Cuda(vec![0, 1]), DenseWeights::Bf16).err().unwrap();
        assert!(e.contains("names 2 device(s) but the model is loaded as 1"), "{e}");
    }

    /// `--device sim` with `--tensor-parallel-size 2`: two simulated devices.
    #[test]
    fn sim_places_one_simulated_device_per_rank() {
        if kernels::sim::SimGpu::sim().is_err() && std::env::var_os("WASMSERVE_REQUIRE_SIM").is_none() {
            eprintln!("SKIPPED sim_places_one_simulated_device_per_rank: the simulator was not built");
            return;
        }
        let m = place_model(tiny_tp(2), &DeviceSpec::Sim, DenseWeights::Bf16).unwrap();
        assert!(m.model.device_kv().is_some(), "the forward runs on the (simulated) devices");
        assert_eq!(m.model.cache_layout().layers.len(), 4, "2 layers x 2 ranks");
        assert_eq!(cpu_activations_note(&m), None);
    }

    /// A model loaded with `--cpu-activations int8` and then moved to a device keeps the setting,
    /// so placement can say that the device forward does not use it.
    #[test]
    fn int8_cpu_activations_are_noted_as_cpu_only() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/reference/tiny_llama");
        let opts = crate::model::LoadOptions {
            cpu_activations: crate::model::activations::CpuActivations::Int8,
            ..Default::default()
        };
        let m = crate::model::load_with_options(&dir, &opts).unwrap();
        assert!(cpu_activations_note(&m).is_some_and(|n| n.contains("CPU forward only")));
        assert_eq!(cpu_activations_note(&tiny_tp(1)), None);
    }
}
