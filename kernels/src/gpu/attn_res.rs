//! Launch wrappers of Kimi K3's device kernels beyond its Kimi-Linear layers: the Block Attention
//! Residual mix (`kernels/cuda/attn_res.cu`, CPU reference [`crate::cpu::attn_res::mix_row`]), the
//! partial-sum add and SiTU (`swiglu.cu`, CPU reference [`crate::cpu::activation::situ_mul`]).

use super::kernels::check;
use super::runtime::{DevBuf, KArg as A};
use super::{Kernels, Runtime};
use crate::cuda::CudaError;

/// Most candidates (snapshots + the partial sum) one mix takes (`ATTN_RES_MAX` in attn_res.cu).
pub const ATTN_RES_MAX_CANDIDATES: usize = 64;

impl<R: Runtime> Kernels<R> {
    /// `out[rows, d]` = the AttnRes mix of `stream`'s first `num_blocks` slots (the snapshots)
    /// and slot `num_blocks` (the partial sum), each `rows × d`, with score weights `w` (`d`).
    #[allow(clippy::too_many_arguments)]
    pub fn attn_res_mix(
        &self,
        stream: &R::Buf<f32>,
        num_blocks: usize,
        w: &R::Buf<f32>,
        out: &mut R::Buf<f32>,
        rows: usize,
        eps: f32,
    ) -> Result<(), CudaError> {
        let d = w.len();
        check(num_blocks < ATTN_RES_MAX_CANDIDATES, || format!("attn_res_mix: {num_blocks} snapshots"))?;
        check(stream.len() >= (num_blocks + 1) * rows * d && out.len() >= rows * d, || {
            format!("attn_res_mix: {num_blocks} snapshots and a partial sum of {rows} rows of {d}: buffer sizes")
        })?;
        if rows == 0 {
            return Ok(());
        }
        self.go(
            "attn_res_mix",
            Self::row_dims(rows),
            &[
                A::F32s(stream),
                A::I32(num_blocks as i32),
                A::I64((rows * d) as i64),
                A::F32s(w),
                A::F32s(out),
                A::I32(d as i32),
                A::F32(eps),
            ],
        )
    }

    /// `x[offset..offset + n] += delta[..n]`.
    pub fn add_f32(&self, x: &mut R::Buf<f32>, offset: usize, delta: &R::Buf<f32>, n: usize) -> Result<(), CudaError> {
        check(x.len() >= offset + n && delta.len() >= n, || {
            format!("add_f32: {n} elements at {offset} of {} / {}", x.len(), delta.len())
        })?;
        if n == 0 {
            return Ok(());
        }
        let dims = Self::elementwise_dims("add_f32", n)?;
        self.go("add_f32", dims, &[A::F32s(x), A::I64(offset as i64), A::F32s(delta), A::I64(n as i64)])
    }

    /// `out[t, :] = situ(gate_up[t, :d], gate_up[t, d:])` with `beta` and the optional `linear_beta`.
    pub fn situ_mul(
        &self,
        gate_up: &R::Buf<f32>,
        out: &mut R::Buf<f32>,
        tokens: usize,
        d: usize,
        beta: f32,
        linear_beta: Option<f32>,
    ) -> Result<(), CudaError> {
        check(gate_up.len() >= tokens * 2 * d && out.len() >= tokens * d, || "situ_mul: buffer sizes".into())?;
        check(beta > 0.0 && linear_beta.is_none_or(|b| b > 0.0), || "situ_mul: betas must be positive".into())?;
        if tokens * d == 0 {
            return Ok(());
        }
        let dims = Self::elementwise_dims("situ_mul", tokens * d)?;
        self.go(
            "situ_mul",
            dims,
            &[
                A::F32s(gate_up),
                A::F32s(out),
                A::I32(tokens as i32),
                A::I32(d as i32),
                A::F32(beta),
                A::F32(linear_beta.unwrap_or(0.0)),
            ],
        )
    }
}
