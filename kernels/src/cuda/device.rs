//! Finding CUDA devices without crashing where there are none. cudarc panics when libcuda is
//! missing, so the library is looked for first and every driver call runs under `catch_unwind`.

use std::sync::Arc;

use cudarc::driver::{sys::CUdevice_attribute, CudaContext};

use super::nvrtc::guarded;
use super::CudaError;

#[derive(Clone, Debug)]
pub struct DeviceInfo {
    pub ordinal: usize,
    pub name: String,
    /// Compute capability, e.g. (9, 0) for H100/H200.
    pub compute_capability: (i32, i32),
    pub total_memory: usize,
    /// Theoretical DRAM bandwidth in bytes/s (memory clock × bus width × 2, DDR).
    pub peak_bandwidth: f64,
}

impl DeviceInfo {
    /// NVRTC's `--gpu-architecture` for this device.
    pub fn arch(&self) -> &'static str {
        match self.compute_capability {
            (7, 0) => "sm_70",
            (7, 5) => "sm_75",
            (8, 0) => "sm_80",
            (8, 6) => "sm_86",
            (8, 9) => "sm_89",
            (9, 0) => "sm_90",
            (10, 0) => "sm_100",
            (12, 0) => "sm_120",
            (major, _) if major >= 9 => "sm_90",
            _ => "sm_80",
        }
    }
}

/// `Ok(())` when a libcuda can be loaded, else which library is missing.
pub fn driver_available() -> Result<(), CudaError> {
    for name in cudarc::get_lib_name_candidates("cuda") {
        // SAFETY: loading libcuda runs its initialisers only.
        if unsafe { libloading::Library::new(&name) }.is_ok() {
            return Ok(());
        }
    }
    Err(CudaError::LibraryMissing { lib: "cuda", hint: "no NVIDIA driver on this machine" })
}

fn driver<T, E: std::fmt::Debug>(what: &'static str, f: impl FnOnce() -> Result<T, E>) -> Result<T, CudaError> {
    guarded(what, f)?.map_err(|e| CudaError::Driver { what, msg: format!("{e:?}") })
}

/// Number of CUDA devices (0 never: no driver or no device is an error saying which).
pub fn device_count() -> Result<usize, CudaError> {
    driver_available()?;
    let n = driver("cuDeviceGetCount", CudaContext::device_count)?;
    if n <= 0 {
        return Err(CudaError::NoSuchDevice { ordinal: 0, count: 0 });
    }
    Ok(n as usize)
}

/// Opens device `ordinal`'s primary context.
pub fn open(ordinal: usize) -> Result<Arc<CudaContext>, CudaError> {
    let count = device_count()?;
    if ordinal >= count {
        return Err(CudaError::NoSuchDevice { ordinal, count });
    }
    driver("cuCtxCreate", || CudaContext::new(ordinal))
}

/// Describes an opened device.
pub fn info(ctx: &Arc<CudaContext>) -> Result<DeviceInfo, CudaError> {
    let attr = |a| driver("cuDeviceGetAttribute", || ctx.attribute(a));
    let name = driver("cuDeviceGetName", || ctx.name())?;
    let cc = (
        attr(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?,
        attr(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?,
    );
    let clock_khz = attr(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MEMORY_CLOCK_RATE)? as f64;
    let bus_bits = attr(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_GLOBAL_MEMORY_BUS_WIDTH)? as f64;
    let total_memory = driver("cuDeviceTotalMem", || ctx.total_mem()).unwrap_or(0);
    Ok(DeviceInfo {
        ordinal: ctx.ordinal(),
        name,
        compute_capability: cc,
        total_memory,
        peak_bandwidth: 2.0 * clock_khz * 1e3 * bus_bits / 8.0,
    })
}
