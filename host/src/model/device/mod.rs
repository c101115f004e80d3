//! What every device forward shares, whatever the architecture: weights uploaded in their device
//! formats (`weights`), one step's per-token inputs checked and laid out for the kernels
//! (`step`), and the ranks of a multi-device model run concurrently with a failing rank
//! releasing its peers (`ranks`). The architectures themselves are `device_llama` and
//! `device_deepseek`.

pub mod ranks;
pub mod step;
pub mod weights;
#[cfg(test)]
pub(crate) mod ref_runtime;
