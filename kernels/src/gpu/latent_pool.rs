//! The MLA latent cache in device memory: per layer and pool row (block · block_size + slot), the
//! normed latent `c` (`lora` wide) as the key row and the rotated shared `k_rope` (`rope` wide) as
//! the value row — the host block pool's layout for an MLA layer (`LayerKvShape` with groups 1),
//! so the engine's block tables index it unchanged. bf16 rounds to nearest even; FP8 E4M3 keeps
//! one scale per pool row for the key row and one for the value row (they differ in magnitude).
//! A NoPE model (`rope` 0) stores no value rows.

use super::kv_pool::{bad, KvLayer, KvStorage, RowShape};
use super::{Kernels, Runtime};
use crate::cpu::mla::LatentGeometry;
use crate::cuda::CudaError;

/// Key row = latent, value row = rotary key, one FP8 scale each (the host's groups = 1).
fn latent_shape(lora: usize, rope: usize) -> RowShape {
    RowShape { key_width: lora, value_width: rope, groups: 1 }
}

pub struct DeviceLatentPool<R: Runtime> {
    pub num_blocks: usize,
    pub block_size: usize,
    pub lora: usize,
    pub rope: usize,
    pub storage: KvStorage,
    layers: Vec<KvLayer<R>>,
}

impl<R: Runtime> DeviceLatentPool<R> {
    pub fn new(
        gpu: &Kernels<R>,
        layers: usize,
        num_blocks: usize,
        block_size: usize,
        lora: usize,
        rope: usize,
        storage: KvStorage,
    ) -> Result<Self, CudaError> {
        if lora == 0 || block_size == 0 {
            return Err(bad(format!("latent pool: latent {lora} wide, block size {block_size}")));
        }
        let layers = (0..layers)
            .map(|_| KvLayer::new(gpu, storage, num_blocks * block_size, latent_shape(lora, rope)))
            .collect::<Result<_, CudaError>>()?;
        tracing::info!(num_blocks, block_size, lora, rope, ?storage, "device MLA latent pool allocated");
        Ok(Self { num_blocks, block_size, lora, rope, storage, layers })
    }

    /// Stores n rows: latent [n, lora] as the key row and k_rope [n, rope] as the value row of
    /// pool rows `slots` (block * block_size + slot), narrowed on the device to the storage type.
    pub fn write_rows(
        &mut self,
        gpu: &Kernels<R>,
        layer: usize,
        latent: &R::Buf<f32>,
        k_rope: &R::Buf<f32>,
        slots: &R::Buf<i32>,
        n: usize,
    ) -> Result<(), CudaError> {
        let (lora, rope) = (self.lora, self.rope);
        let nl = self.layers.len();
        let st = self.layers.get_mut(layer).ok_or_else(|| bad(format!("latent write: no layer {layer} of {nl}")))?;
        // The rotary rows are skipped when there are none (NoPE): nothing to store.
        match st {
            KvLayer::F32 { k, v } => {
                gpu.kv_store_f32(latent, slots, k, n, lora)?;
                if rope > 0 {
                    gpu.kv_store_f32(k_rope, slots, v, n, rope)?;
                }
            }
            KvLayer::Bf16 { k, v } => {
                gpu.kv_store_bf16(latent, slots, k, n, lora)?;
                if rope > 0 {
                    gpu.kv_store_bf16(k_rope, slots, v, n, rope)?;
                }
            }
            KvLayer::Fp8 { k, v, ks, vs } => {
                gpu.kv_store_fp8(latent, slots, k, ks, n, lora)?;
                if rope > 0 {
                    gpu.kv_store_fp8(k_rope, slots, v, vs, n, rope)?;
                }
            }
        }
        Ok(())
    }

    /// Copy-on-write of the first `slots` positions of block src into dst, every layer (as
    /// [`super::kv_pool::DeviceKvPool::copy_block`]).
    pub fn copy_block(&mut self, gpu: &Kernels<R>, src: usize, dst: usize, slots: usize) -> Result<(), CudaError> {
        let shape = latent_shape(self.lora, self.rope);
        super::kv_pool::copy_block(
            &mut self.layers,
            gpu,
            "latent",
            self.num_blocks,
            self.block_size,
            src,
            dst,
            slots,
            shape,
        )
    }

    /// Whether [`Self::prefill_attention`] can run here (the tensor-core kernel: bf16 or FP8 rows
    /// of DeepSeek/Kimi widths on sm_80+); without it prompt chunks take [`Self::attention`].
    pub fn has_prefill_kernel(&self, gpu: &Kernels<R>) -> bool {
        super::mla::mla_flash_prefill_fits(self.storage, self.lora, self.rope, gpu.bf16_mma())
    }

    /// [`Self::attention`] for the rows of prompt chunks in `num_tiles` tiles (`(first row, rows)`
    /// pairs from `prefill::prefill_tiles` with `mla::mla_flash_rows_per_tile(heads)`), on the
    /// tensor cores; other rows of `ctx` are left untouched. An error where
    /// [`Self::has_prefill_kernel`] is false.
    #[allow(clippy::too_many_arguments)]
    pub fn prefill_attention(
        &self,
        gpu: &Kernels<R>,
        layer: usize,
        heads: usize,
        max_blocks: usize,
        q_lat: &R::Buf<f32>,
        q_rope: &R::Buf<f32>,
        tables: &R::Buf<i32>,
        lens: &R::Buf<i32>,
        tiles: &R::Buf<i32>,
        num_tiles: usize,
        scale: f32,
        ctx: &mut R::Buf<f32>,
    ) -> Result<(), CudaError> {
        let g = LatentGeometry { heads, lora: self.lora, rope: self.rope, block_size: self.block_size, max_blocks };
        match self
            .layers
            .get(layer)
            .ok_or_else(|| bad(format!("latent prefill attention: no layer {layer} of {}", self.layers.len())))?
        {
            KvLayer::F32 { .. } => {
                Err(bad("latent prefill attention: an f32 pool keeps f32 products (use attention)".into()))
            }
            KvLayer::Bf16 { k, v } => {
                gpu.mla_flash_prefill_bf16(&g, q_lat, q_rope, k, v, tables, lens, tiles, num_tiles, scale, ctx)
            }
            KvLayer::Fp8 { k, v, ks, vs } => {
                gpu.mla_flash_prefill_fp8(&g, q_lat, q_rope, k, v, ks, vs, tables, lens, tiles, num_tiles, scale, ctx)
            }
        }
    }

    /// ctx[t, h, :] (lora wide) = sum over positions p < lens[t] of token t's block table (tables
    /// [n, max_blocks]) of softmax_p(scale * (q_lat[t,h] . c_p + q_rope[t,h] . kr_p)) * c_p.
    /// q_lat [n, heads, lora], q_rope [n, heads, rope] dense. n = lens.len(). The block ids must be
    /// below `num_blocks` (the host block pool hands out only those).
    #[allow(clippy::too_many_arguments)]
    pub fn attention(
        &self,
        gpu: &Kernels<R>,
        layer: usize,
        heads: usize,
        max_blocks: usize,
        q_lat: &R::Buf<f32>,
        q_rope: &R::Buf<f32>,
        tables: &R::Buf<i32>,
        lens: &R::Buf<i32>,
        scale: f32,
        ctx: &mut R::Buf<f32>,
    ) -> Result<(), CudaError> {
        let g = LatentGeometry { heads, lora: self.lora, rope: self.rope, block_size: self.block_size, max_blocks };
        match self
            .layers
            .get(layer)
            .ok_or_else(|| bad(format!("latent attention: no layer {layer} of {}", self.layers.len())))?
        {
            KvLayer::F32 { k, v } => gpu.mla_attention_f32(&g, q_lat, q_rope, k, v, tables, lens, scale, ctx),
            KvLayer::Bf16 { k, v } => gpu.mla_attention_bf16(&g, q_lat, q_rope, k, v, tables, lens, scale, ctx),
            KvLayer::Fp8 { k, v, ks, vs } => {
                gpu.mla_attention_fp8(&g, q_lat, q_rope, k, v, ks, vs, tables, lens, scale, ctx)
            }
        }
    }
}
