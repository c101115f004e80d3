//! The paged KV cache in device memory: per layer, K and V as `[block][slot][kv_heads·head_dim]`
//! (the host block pool's layout, so the engine's block tables index it unchanged), FP8 with one
//! scale per (slot, kv head). Allocated once, at start-up, for the whole pool.

use super::prefill::PrefillKernel;
use super::{Kernels, PagedGeometry, Runtime};
use crate::cuda::CudaError;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KvStorage {
    F32,
    Bf16,
    Fp8,
}

/// One layer's K and V rows (for MLA: latents and rotary keys) in the pool's storage type: K
/// `[pool row][key_width]`, V `[pool row][value_width]`, FP8 scales `[pool row][groups]` each.
pub(crate) enum KvLayer<R: Runtime> {
    F32 { k: R::Buf<f32>, v: R::Buf<f32> },
    Bf16 { k: R::Buf<u16>, v: R::Buf<u16> },
    Fp8 { k: R::Buf<u8>, v: R::Buf<u8>, ks: R::Buf<f32>, vs: R::Buf<f32> },
}

/// A layer's row widths and FP8 scale groups per row.
#[derive(Clone, Copy, Debug)]
pub(crate) struct RowShape {
    pub key_width: usize,
    pub value_width: usize,
    pub groups: usize,
}

impl<R: Runtime> KvLayer<R> {
    /// Zeroed storage for `rows` pool rows (a zero width still gets a 1-element buffer).
    pub(crate) fn new(gpu: &Kernels<R>, storage: KvStorage, rows: usize, s: RowShape) -> Result<Self, CudaError> {
        let (nk, nv) = (rows * s.key_width, rows * s.value_width);
        Ok(match storage {
            KvStorage::F32 => KvLayer::F32 { k: gpu.zeros(nk)?, v: gpu.zeros(nv)? },
            KvStorage::Bf16 => KvLayer::Bf16 { k: gpu.zeros(nk)?, v: gpu.zeros(nv)? },
            KvStorage::Fp8 => KvLayer::Fp8 {
                k: gpu.zeros(nk)?,
                v: gpu.zeros(nv)?,
                ks: gpu.zeros(rows * s.groups)?,
                vs: gpu.zeros(rows * s.groups)?,
            },
        })
    }

    /// Copies pool rows `src..src + n` onto `dst..dst + n` (non-overlapping), K, V and scales.
    pub(crate) fn copy_rows(
        &mut self,
        gpu: &Kernels<R>,
        src: usize,
        dst: usize,
        n: usize,
        s: RowShape,
    ) -> Result<(), CudaError> {
        let (kw, vw) = (s.key_width, s.value_width);
        match self {
            KvLayer::F32 { k, v } => {
                copy_pair([(k, kw), (v, vw)], src, dst, n, |b, a, d, l| gpu.copy_span_f32(b, a, d, l))
            }
            KvLayer::Bf16 { k, v } => {
                copy_pair([(k, kw), (v, vw)], src, dst, n, |b, a, d, l| gpu.copy_span_u16(b, a, d, l))
            }
            KvLayer::Fp8 { k, v, ks, vs } => {
                copy_pair([(k, kw), (v, vw)], src, dst, n, |b, a, d, l| gpu.copy_span_u8(b, a, d, l))?;
                copy_pair([(ks, s.groups), (vs, s.groups)], src, dst, n, |b, a, d, l| gpu.copy_span_f32(b, a, d, l))
            }
        }
    }
}

/// The copy-on-write of a shared partial block: the first `slots` positions of block `src` onto
/// block `dst` in every layer of a pool of `num_blocks` blocks of `block_size` (`what` names the
/// pool in errors).
#[allow(clippy::too_many_arguments)]
pub(crate) fn copy_block<R: Runtime>(
    layers: &mut [KvLayer<R>],
    gpu: &Kernels<R>,
    what: &str,
    num_blocks: usize,
    block_size: usize,
    src: usize,
    dst: usize,
    slots: usize,
    shape: RowShape,
) -> Result<(), CudaError> {
    if src >= num_blocks || dst >= num_blocks || slots > block_size {
        return Err(bad(format!("{what} copy: block {src} -> {dst}, {slots} slots, pool of {num_blocks}")));
    }
    if slots == 0 || src == dst {
        return Ok(());
    }
    for layer in layers {
        layer.copy_rows(gpu, src * block_size, dst * block_size, slots, shape)?;
    }
    Ok(())
}

/// `copy(buf, src·w, dst·w, n·w)` for each (buffer, row width) pair; zero-width rows (MLA without
/// a rotary slice) hold nothing to copy.
fn copy_pair<B>(
    pair: [(&mut B, usize); 2],
    src: usize,
    dst: usize,
    n: usize,
    copy: impl Fn(&mut B, usize, usize, usize) -> Result<(), CudaError>,
) -> Result<(), CudaError> {
    for (buf, w) in pair {
        if n * w > 0 {
            copy(buf, src * w, dst * w, n * w)?;
        }
    }
    Ok(())
}

/// GQA rows: `kv_heads` heads of `head_dim` for K and V, one FP8 scale per head.
fn heads_shape(kv_heads: usize, head_dim: usize) -> RowShape {
    RowShape { key_width: kv_heads * head_dim, value_width: kv_heads * head_dim, groups: kv_heads }
}

pub struct DeviceKvPool<R: Runtime> {
    layers: Vec<KvLayer<R>>,
    pub num_blocks: usize,
    pub block_size: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub storage: KvStorage,
}

pub(crate) fn bad(msg: String) -> CudaError {
    CudaError::BadArgs(msg)
}

impl<R: Runtime> DeviceKvPool<R> {
    pub fn new(
        gpu: &Kernels<R>,
        layers: usize,
        num_blocks: usize,
        block_size: usize,
        kv_heads: usize,
        head_dim: usize,
        storage: KvStorage,
    ) -> Result<Self, CudaError> {
        let shape = heads_shape(kv_heads, head_dim);
        let layers = (0..layers)
            .map(|_| KvLayer::new(gpu, storage, num_blocks * block_size, shape))
            .collect::<Result<_, CudaError>>()?;
        tracing::info!(num_blocks, block_size, ?storage, "device KV pool allocated");
        Ok(Self { layers, num_blocks, block_size, kv_heads, head_dim, storage })
    }

    pub fn width(&self) -> usize {
        self.kv_heads * self.head_dim
    }

    /// Stores one position's keys and values (`kv_heads·head_dim` each) in `(block, slot)`: a
    /// one-row [`Self::write_rows`] (uploaded, then narrowed on the device like every other row).
    pub fn write(
        &mut self,
        gpu: &Kernels<R>,
        layer: usize,
        block: usize,
        slot: usize,
        k: &[f32],
        v: &[f32],
    ) -> Result<(), CudaError> {
        let w = self.width();
        if layer >= self.layers.len()
            || block >= self.num_blocks
            || slot >= self.block_size
            || k.len() != w
            || v.len() != w
        {
            return Err(bad(format!(
                "kv write: layer {layer} block {block} slot {slot} with {}/{} values (width {w})",
                k.len(),
                v.len()
            )));
        }
        let row = (block * self.block_size + slot) as i32;
        let (dk, dv, ds) = (gpu.upload(k)?, gpu.upload(v)?, gpu.upload(&[row])?);
        self.write_rows(gpu, layer, &dk, &dv, &ds, 1)
    }

    /// Stores `n` rows of keys and values (`width()` each, f32 on the device) of `layer` at pool
    /// rows `slots` (block · block_size + slot), narrowed on the device to the storage type.
    #[allow(clippy::too_many_arguments)]
    pub fn write_rows(
        &mut self,
        gpu: &Kernels<R>,
        layer: usize,
        k: &R::Buf<f32>,
        v: &R::Buf<f32>,
        slots: &R::Buf<i32>,
        n: usize,
    ) -> Result<(), CudaError> {
        let (w, kvh, hd) = (self.width(), self.kv_heads, self.head_dim);
        match self.layers.get_mut(layer).ok_or_else(|| bad(format!("kv write: no layer {layer}")))? {
            KvLayer::F32 { k: dk, v: dv } => gpu.kv_write_f32(k, v, slots, dk, dv, n, w),
            KvLayer::Bf16 { k: dk, v: dv } => gpu.kv_write_bf16(k, v, slots, dk, dv, n, w),
            KvLayer::Fp8 { k: dk, v: dv, ks, vs } => gpu.kv_write_fp8(k, v, slots, dk, dv, ks, vs, n, kvh, hd),
        }
    }

    /// Copies the first `slots` positions of block `src` into block `dst` in every layer (the
    /// host pool's copy-on-write of a shared partial block, done here because K/V live here).
    pub fn copy_block(&mut self, gpu: &Kernels<R>, src: usize, dst: usize, slots: usize) -> Result<(), CudaError> {
        let shape = heads_shape(self.kv_heads, self.head_dim);
        copy_block(&mut self.layers, gpu, "kv", self.num_blocks, self.block_size, src, dst, slots, shape)
    }

    /// Decode attention over `layer`; `tables`/`lens` as in [`Kernels::paged_attention_f32`], whose
    /// ids must be below `num_blocks` (the host block pool hands out only those).
    #[allow(clippy::too_many_arguments)]
    pub fn attention(
        &self,
        gpu: &Kernels<R>,
        layer: usize,
        heads: usize,
        max_blocks: usize,
        q: &R::Buf<f32>,
        tables: &R::Buf<i32>,
        lens: &R::Buf<i32>,
        scale: f32,
        out: &mut R::Buf<f32>,
    ) -> Result<(), CudaError> {
        let geo = PagedGeometry {
            heads,
            kv_heads: self.kv_heads,
            head_dim: self.head_dim,
            block_size: self.block_size,
            max_blocks,
        };
        match self.layers.get(layer).ok_or_else(|| bad(format!("kv attention: no layer {layer}")))? {
            KvLayer::F32 { k, v } => gpu.paged_attention_f32(&geo, q, k, v, tables, lens, scale, out),
            KvLayer::Bf16 { k, v } => gpu.paged_attention_bf16(&geo, q, k, v, tables, lens, scale, out),
            KvLayer::Fp8 { k, v, ks, vs } => gpu.paged_attention_fp8(&geo, q, k, v, ks, vs, tables, lens, scale, out),
        }
    }

    /// The prefill kernel [`Self::prefill_attention`] runs on `gpu` for this pool; plan the tiles
    /// with its [`PrefillKernel::rows_per_tile`].
    pub fn prefill_kernel(&self, gpu: &Kernels<R>) -> PrefillKernel {
        PrefillKernel::choose(self.storage, self.head_dim, gpu.bf16_mma())
    }

    /// Prefill attention over `layer` for the rows in `num_tiles` tiles (see
    /// [`crate::gpu::prefill`]), planned for [`Self::prefill_kernel`]; other rows of `out` are
    /// left untouched.
    #[allow(clippy::too_many_arguments)]
    pub fn prefill_attention(
        &self,
        gpu: &Kernels<R>,
        layer: usize,
        heads: usize,
        max_blocks: usize,
        q: &R::Buf<f32>,
        tables: &R::Buf<i32>,
        lens: &R::Buf<i32>,
        tiles: &R::Buf<i32>,
        num_tiles: usize,
        scale: f32,
        out: &mut R::Buf<f32>,
    ) -> Result<(), CudaError> {
        let geo = PagedGeometry {
            heads,
            kv_heads: self.kv_heads,
            head_dim: self.head_dim,
            block_size: self.block_size,
            max_blocks,
        };
        let tensor_cores = self.prefill_kernel(gpu) == PrefillKernel::TensorCores;
        match self.layers.get(layer).ok_or_else(|| bad(format!("kv prefill attention: no layer {layer}")))? {
            KvLayer::F32 { k, v } => gpu.paged_prefill_f32(&geo, q, k, v, tables, lens, tiles, num_tiles, scale, out),
            KvLayer::Bf16 { k, v } if tensor_cores => {
                gpu.paged_flash_prefill_bf16(&geo, q, k, v, tables, lens, tiles, num_tiles, scale, out)
            }
            KvLayer::Bf16 { k, v } => gpu.paged_prefill_bf16(&geo, q, k, v, tables, lens, tiles, num_tiles, scale, out),
            KvLayer::Fp8 { k, v, ks, vs } if tensor_cores => {
                gpu.paged_flash_prefill_fp8(&geo, q, k, v, ks, vs, tables, lens, tiles, num_tiles, scale, out)
            }
            KvLayer::Fp8 { k, v, ks, vs } => {
                gpu.paged_prefill_fp8(&geo, q, k, v, ks, vs, tables, lens, tiles, num_tiles, scale, out)
            }
        }
    }
}
