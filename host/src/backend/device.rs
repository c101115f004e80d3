//! `--device cpu | cuda:0[,1..] | auto`: parsing and the guarded probe that picks a backend.
//!
//! `auto` uses CUDA device 0 when a driver and a device are there, else the CPU with a log line
//! saying why. An explicit `cuda:N` that cannot be honoured is an error naming the cause (no
//! libcuda, no device N, NVRTC missing...), never a panic and never a silent CPU run.

use std::fmt;

use super::cpu::CpuBackend;
use super::Backend;

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

/// The chosen backends, one per device (one for the CPU).
pub struct Selected {
    pub backends: Vec<Box<dyn Backend>>,
    /// Set when `auto` fell back to the CPU: why CUDA was not used.
    pub fallback_reason: Option<String>,
}

impl Selected {
    pub fn describe(&self) -> String {
        self.backends.iter().map(|b| b.name()).collect::<Vec<_>>().join(", ")
    }
}

/// Opens the backends `spec` asks for.
pub fn select(spec: &DeviceSpec) -> Result<Selected, String> {
    match spec {
        // The simulator runs the model's forward only (backend::placement); kernel-level backend
        // operations stay on the CPU.
        DeviceSpec::Cpu | DeviceSpec::Sim => Ok(Selected { backends: vec![Box::new(CpuBackend::new())], fallback_reason: None }),
        DeviceSpec::Cuda(ords) => {
            let mut backends: Vec<Box<dyn Backend>> = Vec::new();
            for &o in ords {
                backends.push(open_cuda(o).map_err(|e| format!("--device {spec}: cannot use CUDA device {o}: {e}. Use --device cpu (or auto, which falls back to the CPU)."))?);
            }
            Ok(Selected { backends, fallback_reason: None })
        }
        DeviceSpec::Auto => match open_cuda(0) {
            Ok(b) => Ok(Selected { backends: vec![b], fallback_reason: None }),
            Err(e) => {
                let reason = format!("no usable CUDA device ({e}); running on the CPU");
                tracing::warn!("--device auto: {reason}");
                Ok(Selected { backends: vec![Box::new(CpuBackend::new())], fallback_reason: Some(reason) })
            }
        },
    }
}

#[cfg(feature = "cuda")]
fn open_cuda(ordinal: usize) -> Result<Box<dyn Backend>, String> {
    super::cuda::CudaBackend::open(ordinal).map(|b| Box::new(b) as Box<dyn Backend>).map_err(|e| e.to_string())
}

#[cfg(not(feature = "cuda"))]
fn open_cuda(_ordinal: usize) -> Result<Box<dyn Backend>, String> {
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
        let have_gpu = open_cuda(0).is_ok();
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
