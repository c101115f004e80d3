//! Launch wrappers of Kimi Delta Attention's device kernels (`kernels/cuda/kda.cu`): the short
//! convolution and the gated delta rule recurrence over a batch of sequences grouped as a CSR (see
//! [`crate::cpu::kda`], whose `conv_silu_batch` and `recurrent_batch` are their references), and
//! the slot copy / reset of a per-slot state buffer ([`super::recurrent_pool::DeviceRecurrentPool`]
//! holds one per layer). The host composes a KDA layer from these and the generic GEMVs.
//!
//! The CSR arrays live on the device, so the wrappers check their lengths only; the kernels clamp
//! offsets to `seq_rows` and skip rows `>= n` and slots outside the state buffer. Two sequences of
//! one launch must not share a slot (their updates would race).

use super::kernels::check;
use super::mla::GRID_YZ_MAX;
use super::runtime::{DevBuf, Dims, KArg as A};
use super::{Kernels, Runtime};
use crate::cpu::kda::query_scale;
use crate::cuda::CudaError;

pub use crate::cpu::kda::KdaGeometry;

/// Largest convolution kernel (`KDA_MAX_KERNEL` in kda.cu: the window is held in registers).
pub const KDA_MAX_KERNEL: usize = 8;
/// Largest head dimension (`KDA_MAX_HEAD_DIM` in kda.cu: one thread per state column).
pub const KDA_MAX_HEAD_DIM: usize = 256;
/// Threads per block of `kda_conv_silu` (one per channel).
const CONV_THREADS: usize = 128;

/// A CSR grouping's lengths: `seq_start` `[seqs + 1]`, `seq_slot` `[seqs]`, every count an `i32`.
fn check_csr<T: DevBuf>(
    what: &str,
    seq_rows: &T,
    seq_start: &T,
    seq_slot: &T,
    seqs: usize,
    n: usize,
) -> Result<(), CudaError> {
    check(seq_start.len() > seqs && seq_slot.len() >= seqs, || {
        format!("{what}: seq_start {} / seq_slot {} entries for {seqs} sequences", seq_start.len(), seq_slot.len())
    })?;
    check(seqs < i32::MAX as usize && n <= i32::MAX as usize && seq_rows.len() <= i32::MAX as usize, || {
        format!("{what}: {seqs} sequences, {n} rows, {} row entries exceed i32", seq_rows.len())
    })
}

/// Sequences per launch along gridDim.y; the kernels stride over the rest.
fn seq_grid(seqs: usize) -> u32 {
    seqs.min(GRID_YZ_MAX) as u32
}

impl<R: Runtime> Kernels<R> {
    /// Depthwise causal conv + SiLU of `mixed` [n, channels] (rows in batch order) into `out` [n, channels]; conv_state [slots, channels, kernel-1] is read and advanced for each sequence's slot. weight [channels, kernel].
    ///
    /// `slots` is `conv_state.len() / (channels · (kernel − 1))`. Reference:
    /// [`crate::cpu::kda::conv_silu_batch`] (bit for bit on the simulator). Output rows of no
    /// sequence are left as they were.
    #[allow(clippy::too_many_arguments)]
    pub fn kda_conv_silu(
        &self,
        mixed: &R::Buf<f32>,
        weight: &R::Buf<f32>,
        conv_state: &mut R::Buf<f32>,
        seq_rows: &R::Buf<i32>,
        seq_start: &R::Buf<i32>,
        seq_slot: &R::Buf<i32>,
        seqs: usize,
        n: usize,
        channels: usize,
        kernel: usize,
        out: &mut R::Buf<f32>,
    ) -> Result<(), CudaError> {
        check((2..=KDA_MAX_KERNEL).contains(&kernel) && (1..=i32::MAX as usize).contains(&channels), || {
            format!("kda_conv_silu: kernel {kernel} (2..={KDA_MAX_KERNEL}), {channels} channels")
        })?;
        check(mixed.len() >= n * channels && out.len() >= n * channels && weight.len() >= channels * kernel, || {
            format!("kda_conv_silu: mixed {} / out {} / weight {} elements for {n} rows of {channels} channels, kernel {kernel}", mixed.len(), out.len(), weight.len())
        })?;
        let slots = conv_state.len() / (channels * (kernel - 1));
        check(slots >= 1, || {
            format!(
                "kda_conv_silu: conv_state of {} elements holds no slot of {channels} x {}",
                conv_state.len(),
                kernel - 1
            )
        })?;
        check_csr("kda_conv_silu", seq_rows, seq_start, seq_slot, seqs, n)?;
        if seqs == 0 || n == 0 {
            return Ok(()); // no rows to convolve, no state to advance
        }
        let dims = Dims::new((channels.div_ceil(CONV_THREADS) as u32, seq_grid(seqs), 1), CONV_THREADS as u32);
        let args = [
            A::F32s(mixed),
            A::F32s(weight),
            A::F32s(conv_state),
            A::I32s(seq_rows),
            A::I32s(seq_start),
            A::I32s(seq_slot),
            A::I32(seqs as i32),
            A::I32(seq_rows.len() as i32),
            A::I32(n as i32),
            A::I32(slots.min(i32::MAX as usize) as i32),
            A::I32(channels as i32),
            A::I32(kernel as i32),
            A::F32s(out),
        ];
        self.go("kda_conv_silu", dims, &args)
    }

    /// The recurrence for every (sequence, head): conv [n, 3P] (q | k | v after conv+SiLU), f [n, P] (forget-gate projection, before dt_bias), beta [n, heads] (logits, before sigmoid), gate [n, P] (output-gate projection, before sigmoid); dt_bias [P]; decay_rate [heads] (= exp(A_log)); o_norm [head_dim]; state [slots, heads, head_dim, head_dim] read and advanced; out [n, P] = the gated-normed head outputs (o_proj's input).
    ///
    /// Reference: [`crate::cpu::kda::recurrent_batch`]. One block of `head_dim` threads (rounded
    /// up to whole warps) per (sequence, head); `head_dim` at most [`KDA_MAX_HEAD_DIM`].
    #[allow(clippy::too_many_arguments)]
    pub fn kda_recurrent(
        &self,
        conv: &R::Buf<f32>,
        f: &R::Buf<f32>,
        beta: &R::Buf<f32>,
        gate: &R::Buf<f32>,
        dt_bias: &R::Buf<f32>,
        decay_rate: &R::Buf<f32>,
        o_norm: &R::Buf<f32>,
        state: &mut R::Buf<f32>,
        seq_rows: &R::Buf<i32>,
        seq_start: &R::Buf<i32>,
        seq_slot: &R::Buf<i32>,
        g: &KdaGeometry,
        out: &mut R::Buf<f32>,
    ) -> Result<(), CudaError> {
        let (n, heads, hd, p) = (g.n, g.heads, g.head_dim, g.proj_dim());
        check(
            (1..=KDA_MAX_HEAD_DIM).contains(&hd) && (1..=i32::MAX as usize).contains(&heads) && g.slots >= 1,
            || format!("kda_recurrent: {heads} heads of {hd} (1..={KDA_MAX_HEAD_DIM}), {} slots", g.slots),
        )?;
        check(
            conv.len() >= n * 3 * p
                && f.len() >= n * p
                && gate.len() >= n * p
                && out.len() >= n * p
                && beta.len() >= n * heads,
            || {
                format!("kda_recurrent: conv {} / f {} / gate {} / out {} / beta {} elements for {n} rows of {heads} x {hd}", conv.len(), f.len(), gate.len(), out.len(), beta.len())
            },
        )?;
        check(dt_bias.len() >= p && decay_rate.len() >= heads && o_norm.len() >= hd, || {
            format!(
                "kda_recurrent: dt_bias {} / decay_rate {} / o_norm {} elements for {heads} heads of {hd}",
                dt_bias.len(),
                decay_rate.len(),
                o_norm.len()
            )
        })?;
        check(state.len() >= g.slots * g.state_len(), || {
            format!("kda_recurrent: state of {} elements for {} slots of {heads} x {hd} x {hd}", state.len(), g.slots)
        })?;
        check_csr("kda_recurrent", seq_rows, seq_start, seq_slot, g.seqs, n)?;
        if g.seqs == 0 || n == 0 {
            return Ok(());
        }
        let dims = Dims::new((heads as u32, seq_grid(g.seqs), 1), hd.next_multiple_of(32) as u32);
        let (has_lb, lb) = (g.lower_bound.is_some() as i32, g.lower_bound.unwrap_or(0.0));
        let args = [
            A::F32s(conv),
            A::F32s(f),
            A::F32s(beta),
            A::F32s(gate),
            A::F32s(dt_bias),
            A::F32s(decay_rate),
            A::F32s(o_norm),
            A::F32s(state),
            A::I32s(seq_rows),
            A::I32s(seq_start),
            A::I32s(seq_slot),
            A::I32(g.seqs as i32),
            A::I32(seq_rows.len() as i32),
            A::I32(n as i32),
            A::I32(g.slots.min(i32::MAX as usize) as i32),
            A::I32(heads as i32),
            A::I32(hd as i32),
            A::F32(query_scale(hd)),
            A::F32(g.eps),
            A::I32(has_lb),
            A::F32(lb),
            A::F32s(out),
        ];
        self.go("kda_recurrent", dims, &args)
    }

    /// buf[dst*len .. (dst+1)*len] = buf[src*len ..] (fork a slot) and buf[slot*len ..] = 0 (reset a slot), for a state buffer of `len` floats per slot.
    ///
    /// Copying a slot onto itself does nothing.
    pub fn copy_slot_f32(&self, buf: &mut R::Buf<f32>, len: usize, src: usize, dst: usize) -> Result<(), CudaError> {
        Self::check_slot("copy_slot_f32", buf.len(), len, src.max(dst))?;
        if src == dst {
            return Ok(());
        }
        self.copy_span_f32(buf, src * len, dst * len, len)
    }

    /// `buf[slot·len .. (slot + 1)·len] = 0` (see [`Self::copy_slot_f32`]).
    pub fn zero_slot_f32(&self, buf: &mut R::Buf<f32>, len: usize, slot: usize) -> Result<(), CudaError> {
        Self::check_slot("zero_slot_f32", buf.len(), len, slot)?;
        let dims = Self::elementwise_dims("zero_slot_f32", len)?;
        self.go("zero_span_f32", dims, &[A::F32s(buf), A::I64((slot * len) as i64), A::I64(len as i64)])
    }

    /// Slot `slot` of `len` floats lies inside a buffer of `buf_len`.
    fn check_slot(what: &str, buf_len: usize, len: usize, slot: usize) -> Result<(), CudaError> {
        check(len > 0 && (slot + 1).checked_mul(len).is_some_and(|end| end <= buf_len), || {
            format!("{what}: slot {slot} of {len} floats in a buffer of {buf_len}")
        })
    }
}
