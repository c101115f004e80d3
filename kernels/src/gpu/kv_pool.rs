//! The paged KV cache in device memory: per layer, K and V as `[block][slot][kv_heads·head_dim]`
//! (the host block pool's layout, so the engine's block tables index it unchanged), FP8 with one
//! scale per (slot, kv head). Allocated once, at start-up, for the whole pool.

use super::{Kernels, PagedGeometry, Runtime};
use crate::cuda::CudaError;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KvStorage {
    F32,
    Bf16,
    Fp8,
}

enum Layer<R: Runtime> {
    F32 { k: R::Buf<f32>, v: R::Buf<f32> },
    Bf16 { k: R::Buf<u16>, v: R::Buf<u16> },
    Fp8 { k: R::Buf<u8>, v: R::Buf<u8>, ks: R::Buf<f32>, vs: R::Buf<f32> },
}

pub struct DeviceKvPool<R: Runtime> {
    layers: Vec<Layer<R>>,
    pub num_blocks: usize,
    pub block_size: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub storage: KvStorage,
}

fn bad(msg: String) -> CudaError {
    CudaError::BadArgs(msg)
}

impl<R: Runtime> DeviceKvPool<R> {
    pub fn new(gpu: &Kernels<R>, layers: usize, num_blocks: usize, block_size: usize, kv_heads: usize, head_dim: usize, storage: KvStorage) -> Result<Self, CudaError> {
        let n = num_blocks * block_size * kv_heads * head_dim;
        let rows = num_blocks * block_size * kv_heads;
        let layers = (0..layers)
            .map(|_| {
                Ok(match storage {
                    KvStorage::F32 => Layer::F32 { k: gpu.zeros(n)?, v: gpu.zeros(n)? },
                    KvStorage::Bf16 => Layer::Bf16 { k: gpu.zeros(n)?, v: gpu.zeros(n)? },
                    KvStorage::Fp8 => Layer::Fp8 { k: gpu.zeros(n)?, v: gpu.zeros(n)?, ks: gpu.zeros(rows)?, vs: gpu.zeros(rows)? },
                })
            })
            .collect::<Result<_, CudaError>>()?;
        tracing::info!(num_blocks, block_size, ?storage, "device KV pool allocated");
        Ok(Self { layers, num_blocks, block_size, kv_heads, head_dim, storage })
    }

    pub fn width(&self) -> usize {
        self.kv_heads * self.head_dim
    }

    /// Stores one position's keys and values (`kv_heads·head_dim` each) in `(block, slot)`: a
    /// one-row [`Self::write_rows`] (uploaded, then narrowed on the device like every other row).
    pub fn write(&mut self, gpu: &Kernels<R>, layer: usize, block: usize, slot: usize, k: &[f32], v: &[f32]) -> Result<(), CudaError> {
        let w = self.width();
        if layer >= self.layers.len() || block >= self.num_blocks || slot >= self.block_size || k.len() != w || v.len() != w {
            return Err(bad(format!("kv write: layer {layer} block {block} slot {slot} with {}/{} values (width {w})", k.len(), v.len())));
        }
        let row = (block * self.block_size + slot) as i32;
        let (dk, dv, ds) = (gpu.upload(k)?, gpu.upload(v)?, gpu.upload(&[row])?);
        self.write_rows(gpu, layer, &dk, &dv, &ds, 1)
    }

    /// Stores `n` rows of keys and values (`width()` each, f32 on the device) of `layer` at pool
    /// rows `slots` (block · block_size + slot), narrowed on the device to the storage type.
    #[allow(clippy::too_many_arguments)]
    pub fn write_rows(&mut self, gpu: &Kernels<R>, layer: usize, k: &R::Buf<f32>, v: &R::Buf<f32>, slots: &R::Buf<i32>, n: usize) -> Result<(), CudaError> {
        let (w, kvh, hd) = (self.width(), self.kv_heads, self.head_dim);
        match self.layers.get_mut(layer).ok_or_else(|| bad(format!("kv write: no layer {layer}")))? {
            Layer::F32 { k: dk, v: dv } => gpu.kv_write_f32(k, v, slots, dk, dv, n, w),
            Layer::Bf16 { k: dk, v: dv } => gpu.kv_write_bf16(k, v, slots, dk, dv, n, w),
            Layer::Fp8 { k: dk, v: dv, ks, vs } => gpu.kv_write_fp8(k, v, slots, dk, dv, ks, vs, n, kvh, hd),
        }
    }

    /// Copies the first `slots` positions of block `src` into block `dst` in every layer (the
    /// host pool's copy-on-write of a shared partial block, done here because K/V live here).
    pub fn copy_block(&mut self, gpu: &Kernels<R>, src: usize, dst: usize, slots: usize) -> Result<(), CudaError> {
        if src >= self.num_blocks || dst >= self.num_blocks || slots > self.block_size {
            return Err(bad(format!("kv copy: block {src} -> {dst}, {slots} slots, pool of {}", self.num_blocks)));
        }
        if slots == 0 || src == dst {
            return Ok(());
        }
        let (w, kvh, bs) = (self.width(), self.kv_heads, self.block_size);
        for layer in &mut self.layers {
            match layer {
                Layer::F32 { k, v } => {
                    for buf in [k, v] {
                        gpu.copy_span_f32(buf, src * bs * w, dst * bs * w, slots * w)?;
                    }
                }
                Layer::Bf16 { k, v } => {
                    for buf in [k, v] {
                        gpu.copy_span_u16(buf, src * bs * w, dst * bs * w, slots * w)?;
                    }
                }
                Layer::Fp8 { k, v, ks, vs } => {
                    for buf in [k, v] {
                        gpu.copy_span_u8(buf, src * bs * w, dst * bs * w, slots * w)?;
                    }
                    for buf in [ks, vs] {
                        gpu.copy_span_f32(buf, src * bs * kvh, dst * bs * kvh, slots * kvh)?;
                    }
                }
            }
        }
        Ok(())
    }

    /// Decode attention over `layer`; `tables`/`lens` as in [`Kernels::paged_attention_f32`], whose
    /// ids must be below `num_blocks` (the host block pool hands out only those).
    #[allow(clippy::too_many_arguments)]
    pub fn attention(&self, gpu: &Kernels<R>, layer: usize, heads: usize, max_blocks: usize, q: &R::Buf<f32>, tables: &R::Buf<i32>, lens: &R::Buf<i32>, scale: f32, out: &mut R::Buf<f32>) -> Result<(), CudaError> {
        let geo = PagedGeometry { heads, kv_heads: self.kv_heads, head_dim: self.head_dim, block_size: self.block_size, max_blocks };
        match self.layers.get(layer).ok_or_else(|| bad(format!("kv attention: no layer {layer}")))? {
            Layer::F32 { k, v } => gpu.paged_attention_f32(&geo, q, k, v, tables, lens, scale, out),
            Layer::Bf16 { k, v } => gpu.paged_attention_bf16(&geo, q, k, v, tables, lens, scale, out),
            Layer::Fp8 { k, v, ks, vs } => gpu.paged_attention_fp8(&geo, q, k, v, ks, vs, tables, lens, scale, out),
        }
    }
}
