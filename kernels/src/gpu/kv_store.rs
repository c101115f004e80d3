//! Launch wrappers of the single-tensor pool stores (`kv_store_*` in `kernels/cuda/kv_write.cu`,
//! CPU references `crate::cpu::kv_write::kv_store_*`): `n` rows of `width` written at pool rows
//! `slots`, for pools whose key and value rows differ in width (MLA's latent and rotary key). Slot
//! ids are the caller's (the engine's block tables only hold the pool's blocks).

use super::kernels::check;
use super::runtime::{DevBuf, Dims, KArg as A};
use super::{Kernels, Runtime};
use crate::cuda::CudaError;

impl<R: Runtime> Kernels<R> {
    fn check_store(
        what: &str,
        x: &R::Buf<f32>,
        slots: &R::Buf<i32>,
        n: usize,
        width: usize,
        cache_len: usize,
    ) -> Result<(), CudaError> {
        check(width > 0 && width <= i32::MAX as usize && n <= i32::MAX as usize, || {
            format!("{what}: {n} rows of {width}")
        })?;
        check(slots.len() >= n && x.len() >= n * width && cache_len / width > 0, || {
            format!(
                "{what}: {n} rows of {width} from {} values / {} slots into a cache of {cache_len}",
                x.len(),
                slots.len()
            )
        })
    }

    /// `cache[slots[t]] = x[t]` for `n` rows of `width`.
    pub fn kv_store_f32(
        &self,
        x: &R::Buf<f32>,
        slots: &R::Buf<i32>,
        cache: &mut R::Buf<f32>,
        n: usize,
        width: usize,
    ) -> Result<(), CudaError> {
        Self::check_store("kv_store_f32", x, slots, n, width, cache.len())?;
        if n == 0 {
            return Ok(()); // nothing to store, and CUDA refuses an empty grid
        }
        let dims = Self::elementwise_dims("kv_store_f32", n * width)?;
        self.go(
            "kv_store_f32",
            dims,
            &[A::F32s(x), A::I32s(slots), A::F32s(cache), A::I32(n as i32), A::I32(width as i32)],
        )
    }

    /// As [`Self::kv_store_f32`] into bf16 (round to nearest even).
    pub fn kv_store_bf16(
        &self,
        x: &R::Buf<f32>,
        slots: &R::Buf<i32>,
        cache: &mut R::Buf<u16>,
        n: usize,
        width: usize,
    ) -> Result<(), CudaError> {
        Self::check_store("kv_store_bf16", x, slots, n, width, cache.len())?;
        if n == 0 {
            return Ok(());
        }
        let dims = Self::elementwise_dims("kv_store_bf16", n * width)?;
        self.go(
            "kv_store_bf16",
            dims,
            &[A::F32s(x), A::I32s(slots), A::U16s(cache), A::I32(n as i32), A::I32(width as i32)],
        )
    }

    /// As [`Self::kv_store_f32`] into E4M3 codes with one scale per pool row (`scales[slots[t]]`,
    /// amax / 448), as the host block pool quantises a row of one scale group.
    pub fn kv_store_fp8(
        &self,
        x: &R::Buf<f32>,
        slots: &R::Buf<i32>,
        codes: &mut R::Buf<u8>,
        scales: &mut R::Buf<f32>,
        n: usize,
        width: usize,
    ) -> Result<(), CudaError> {
        Self::check_store("kv_store_fp8", x, slots, n, width, codes.len())?;
        check(scales.len() >= codes.len() / width, || {
            format!("kv_store_fp8: {} scales for {} rows of codes", scales.len(), codes.len() / width)
        })?;
        if n == 0 {
            return Ok(());
        }
        // One block per row: the row's amax, then its codes.
        self.go(
            "kv_store_fp8",
            Dims::new((n as u32, 1, 1), 128),
            &[A::F32s(x), A::I32s(slots), A::U8s(codes), A::F32s(scales), A::I32(n as i32), A::I32(width as i32)],
        )
    }
}
