//! `--device cpu | cuda:0[,1..] | auto`: parsing and the guarded probe of the devices.
//!
//! `auto` uses CUDA device 0 when a driver and a device are there, else the CPU with a log line
//! saying why. An explicit `cuda:N` that cannot be honoured is an error naming the cause (no
//! libcuda, no device N, NVRTC missing...), never a panic and never a silent CPU run.

use std::fmt;

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DeviceSpec {
    Cpu,
    /// CUDA device ordinals (several: one per tensor-/expert-parallel rank on this node).
    Cuda(Vec<usize>),
    Auto,
    /// Development and tests only: the model's device forward on the CPU simulator of the CUDA
    /// kernels (`kernels::sim`, the real `.cu` sources compiled for the host). Orders of magnitude
    /// slower than the CPU path; it exists to exercise the device path end to end without a GPU.
    Sim,
}

impl DeviceSpec {
    pub fn parse(s: &str) -> Result<Self, String> {
        let s = s.trim();
        match s {
            "cpu" => return Ok(DeviceSpec::Cpu),
            "auto" => return Ok(DeviceSpec::Auto),
            "cuda" => return Ok(DeviceSpec::Cuda(vec![0])),
            "sim" => return Ok(DeviceSpec::Sim),
            _ => {}
        }
        let list = s.strip_prefix("cuda:").ok_or_else(|| format!("unknown device {s:?}: expected cpu, auto or cuda:N[,M...] (or sim: the kernel simulator, for development)"))?;
        let mut ords = Vec::new();
        for part in list.split(',') {
            let part = part.trim().trim_start_matches("cuda:");
            let n: usize = part.parse().map_err(|_| format!("bad CUDA device ordinal {part:?} in {s:?}"))?;
            if ords.contains(&n) {
                return Err(format!("CUDA device {n} listed twice in {s:?}"));
            }
            ords.push(n);
        }
        Ok(DeviceSpec::Cuda(ords))
    }
}

impl fmt::Display for DeviceSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DeviceSpec::Cpu => write!(f, "cpu"),
            DeviceSpec::Auto => write!(f, "auto"),
            DeviceSpec::Sim => write!(f, "sim"),
            DeviceSpec::Cuda(o) => write!(f, "cuda:{}", o.iter().map(|n| n.to_string()).collect::<Vec<_>>().join(",")),
        }
    }
}

/// The devices `--device` resolved to.
pub struct Selected {
    /// One per device: `cpu`, or e.g. `cuda:0 (NVIDIA H200, sm_90, 139.8 GiB)`.
    pub devices: Vec<String>,
    /// Set when `auto` fell back to the CPU: why CUDA was not used.
    pub fallback_reason: Option<String>,
}

impl Selected {
    pub fn describe(&self) -> String {
        self.devices.join(", ")
    }
}

/// Checks that the devices `spec` asks for are usable, before the model is loaded: the driver,
/// each device's primary context, and NVRTC (which compiles the kernels). Only probes: the kernels
/// are compiled and loaded once, by `placement::place_model` (the device forward), so nothing is
/// held twice for the whole run.
pub fn select(spec: &DeviceSpec) -> Result<Selected, String> {
    match spec {
        // The simulator runs the model's forward only (backend::placement).
        DeviceSpec::Cpu | DeviceSpec::Sim => Ok(Selected { devices: vec!["cpu".into()], fallback_reason: None }),
        DeviceSpec::Cuda(ords) => {
            let mut devices = Vec::new();
            for &o in ords {
                devices.push(probe_cuda(o).map_err(|e| format!("--device {spec}: cannot use CUDA device {o}: {e}. Use --device cpu (or auto, which falls back to the CPU)."))?);
            }
            Ok(Selected { devices, fallback_reason: None })
        }
        DeviceSpec::Auto => match probe_cuda(0) {
            Ok(d) => Ok(Selected { devices: vec![d], fallback_reason: None }),
            Err(e) => {
                let reason = format!("no usable CUDA device ({e}); running on the CPU");
                tracing::warn!("--device auto: {reason}");
                Ok(Selected { devices: vec!["cpu".into()], fallback_reason: Some(reason) })
            }
        },
    }
}

#[cfg(feature = "cuda")]
fn probe_cuda(ordinal: usize) -> Result<String, String> {
    use kernels::cuda::{device, nvrtc};
    let ctx = device::open(ordinal).map_err(|e| e.to_string())?;
    let info = device::info(&ctx).map_err(|e| e.to_string())?;
    nvrtc::nvrtc_available().map_err(|e| e.to_string())?;
    Ok(format!(
        "cuda:{ordinal} ({}, {}, {:.1} GiB)",
        info.name,
        info.arch(),
        info.total_memory as f64 / (1u64 << 30) as f64
    ))
}

#[cfg(not(feature = "cuda"))]
fn probe_cuda(_ordinal: usize) -> Result<String, String> {
    Err(kernels::cuda::CudaError::NotBuilt.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_device_lists_and_rejects_junk() {
        assert_eq!(DeviceSpec::parse("cpu").unwrap(), DeviceSpec::Cpu);
        assert_eq!(DeviceSpec::parse("auto").unwrap(), DeviceSpec::Auto);
        assert_eq!(DeviceSpec::parse("sim").unwrap(), DeviceSpec::Sim);
        assert_eq!(DeviceSpec::Sim.to_string(), "sim");
        assert_eq!(DeviceSpec::parse("cuda").unwrap(), DeviceSpec::Cuda(vec![0]));
        assert_eq!(DeviceSpec::parse("cuda:0").unwrap(), DeviceSpec::Cuda(vec![0]));
        assert_eq!(DeviceSpec::parse("cuda:0,1,3").unwrap(), DeviceSpec::Cuda(vec![0, 1, 3]));
        assert_eq!(DeviceSpec::parse("cuda:0,cuda:1").unwrap(), DeviceSpec::Cuda(vec![0, 1]));
        assert_eq!(DeviceSpec::parse("cuda:0,1").unwrap().to_string(), "cuda:0,1");
        for bad in ["gpu", "cuda:", "cuda:x", "cuda:0,0", "cuda:-1", ""] {
            assert!(DeviceSpec::parse(bad).is_err(), "{bad:?} accepted");
        }
    }

    /// Where there is no driver (CI, this repository's dev machines), an explicit CUDA device is a
    /// clear error and `auto` falls back with its reason; on a GPU machine both open CUDA.
    #[test]
    fn cuda_without_a_driver_is_a_clear_error_and_auto_falls_back() {
        let have_gpu = probe_cuda(0).is_ok();
        let sel = select(&DeviceSpec::Auto).unwrap();
        if have_gpu {
            assert!(sel.fallback_reason.is_none());
            assert!(sel.describe().starts_with("cuda:0"), "{}", sel.describe());
            eprintln!("GPU present: {}", sel.describe());
            return;
        }
        assert_eq!(sel.describe(), "cpu");
        let reason = sel.fallback_reason.unwrap();
        assert!(reason.contains("no usable CUDA device"), "{reason}");
        let err = select(&DeviceSpec::Cuda(vec![0])).err().expect("cuda:0 must fail without a GPU");
        eprintln!("--device cuda:0 here: {err}");
        assert!(err.contains("cannot use CUDA device 0") && err.contains("--device cpu"), "{err}");
        #[cfg(feature = "cuda")]
        assert!(err.contains("libcuda") || err.contains("no CUDA device"), "the cause is named: {err}");
    }
}
