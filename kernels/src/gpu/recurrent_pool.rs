//! The per-sequence state of a model's KDA layers in device memory, one slot per sequence: per
//! layer the convolution history `[slots][3P][kernel − 1]` and the recurrent state
//! `[slots][heads][head_dim][head_dim]` (fp32), the layouts `Kernels::kda_conv_silu` and
//! `Kernels::kda_recurrent` advance (the host `KdaState`'s layout per slot). Unlike the paged KV
//! pool its size does not grow with the sequence: a slot is reset when a sequence starts and
//! copied when one forks. Allocated once, at start-up.

use super::kv_pool::bad;
use super::{Kernels, Runtime};
use crate::cuda::CudaError;

/// One KDA layer's states of every slot.
struct LayerState<R: Runtime> {
    conv: R::Buf<f32>,
    recurrent: R::Buf<f32>,
}

pub struct DeviceRecurrentPool<R: Runtime> {
    pub slots: usize,
    pub heads: usize,
    pub head_dim: usize,
    pub kernel: usize,
    layers: Vec<LayerState<R>>,
}

impl<R: Runtime> DeviceRecurrentPool<R> {
    /// `layers` KDA layers of `heads` x `head_dim` with a `kernel`-tap conv over 3*heads*head_dim channels; zeroed.
    pub fn new(
        gpu: &Kernels<R>,
        layers: usize,
        slots: usize,
        heads: usize,
        head_dim: usize,
        kernel: usize,
    ) -> Result<Self, CudaError> {
        if slots == 0 || heads == 0 || head_dim == 0 || kernel < 2 {
            return Err(bad(format!(
                "recurrent pool: {slots} slots, {heads} heads of {head_dim}, kernel {kernel} (at least 2)"
            )));
        }
        let mut pool = Self { slots, heads, head_dim, kernel, layers: Vec::with_capacity(layers) };
        for _ in 0..layers {
            let (conv, recurrent) = (gpu.zeros(slots * pool.conv_len())?, gpu.zeros(slots * pool.recurrent_len())?);
            pool.layers.push(LayerState { conv, recurrent });
        }
        tracing::info!(
            layers,
            slots,
            heads,
            head_dim,
            kernel,
            bytes = 4 * layers * slots * (pool.conv_len() + pool.recurrent_len()),
            "device KDA state pool allocated"
        );
        Ok(pool)
    }

    /// KDA layers held.
    pub fn layers(&self) -> usize {
        self.layers.len()
    }

    /// Floats of convolution history per slot and layer: `3 · heads · head_dim · (kernel − 1)`.
    pub fn conv_len(&self) -> usize {
        3 * self.heads * self.head_dim * (self.kernel - 1)
    }

    /// Floats of recurrent state per slot and layer: `heads · head_dim²`.
    pub fn recurrent_len(&self) -> usize {
        self.heads * self.head_dim * self.head_dim
    }

    /// Back to the state before any token, in every layer.
    pub fn reset(&mut self, gpu: &Kernels<R>, slot: usize) -> Result<(), CudaError> {
        let (cl, rl) = (self.conv_len(), self.recurrent_len());
        for l in &mut self.layers {
            gpu.zero_slot_f32(&mut l.conv, cl, slot)?;
            gpu.zero_slot_f32(&mut l.recurrent, rl, slot)?;
        }
        Ok(())
    }

    /// Slot `to` becomes a copy of slot `from`, in every layer (a forked sequence).
    pub fn fork(&mut self, gpu: &Kernels<R>, from: usize, to: usize) -> Result<(), CudaError> {
        let (cl, rl) = (self.conv_len(), self.recurrent_len());
        for l in &mut self.layers {
            gpu.copy_slot_f32(&mut l.conv, cl, from, to)?;
            gpu.copy_slot_f32(&mut l.recurrent, rl, from, to)?;
        }
        Ok(())
    }

    /// Layer `layer`'s convolution histories, the `conv_state` of `Kernels::kda_conv_silu`.
    /// Panics when `layer` is not below [`Self::layers`] (a caller bug, like a bad slice index).
    pub fn conv_state(&mut self, layer: usize) -> &mut R::Buf<f32> {
        &mut self.layers[layer].conv
    }

    /// Layer `layer`'s recurrent states, the `state` of `Kernels::kda_recurrent` (whose
    /// `KdaGeometry::slots` is [`Self::slots`]). Panics as [`Self::conv_state`].
    pub fn recurrent_state(&mut self, layer: usize) -> &mut R::Buf<f32> {
        &mut self.layers[layer].recurrent
    }
}
