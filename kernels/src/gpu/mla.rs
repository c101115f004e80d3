//! Launch wrappers of DeepSeek MLA's device kernels (`kernels/cuda/mla.cu` and the
//! `mla_attention_*` kernels of `kernels/cuda/paged_attention.cu`); CPU references in
//! `crate::cpu::mla` and `crate::cpu::rope::rope_rows`. The host composes an MLA layer from these,
//! the cache stores of [`super::kv_store`] (through [`super::latent_pool::DeviceLatentPool`]) and
//! the generic kernels (RMSNorm, GEMVs).

use super::kernels::check;
use super::kv_pool::KvStorage;
use super::runtime::{DevBuf, Dims, KArg as A};
use super::{Kernels, Runtime};
use crate::cpu::mla::LatentGeometry;
use crate::cuda::CudaError;

/// Largest latent (`kv_lora_rank`) and rotary widths the attention kernels hold in shared memory
/// (`MLA_MAX_LORA`, `MLA_MAX_ROPE` in paged_attention.cu); DeepSeek-V3 uses 512 and 64.
pub const MLA_MAX_LORA: usize = 1024;
pub const MLA_MAX_ROPE: usize = 256;
/// Heads per block of the MLA attention kernels (`MLA_HEADS` in paged_attention.cu).
const MLA_HEADS: usize = 8;
/// Blocks an MLA attention launch aims for before it splits positions (about two per SM of a
/// large GPU: H100 has 132), the fewest positions worth a split of their own, and the most
/// splits.
const MLA_TARGET_BLOCKS: usize = 256;
const MLA_MIN_SPLIT: usize = 64;
const MLA_MAX_SPLITS: usize = 64;

/// How many shares a token's positions are split into when `blocks` (token, head group) blocks
/// attend over at most `max_len` positions each: enough to reach about [`MLA_TARGET_BLOCKS`],
/// each share at least [`MLA_MIN_SPLIT`] positions long (the combine costs a pass over the
/// partial contexts). 1 for a big batch or short contexts.
pub fn mla_splits(blocks: usize, max_len: usize) -> usize {
    MLA_TARGET_BLOCKS.div_ceil(blocks.max(1)).min(max_len / MLA_MIN_SPLIT).clamp(1, MLA_MAX_SPLITS)
}
/// Query vectors per block of `mla_flash_prefill_*` (`FM_VECS` in paged_attention.cu: two row
/// groups of 16 MMA rows) and the widest latent and rotary key it takes (`FM_MAX_LORA`,
/// `FM_MAX_ROPE`).
pub const MLA_FLASH_VECS: usize = 32;
/// Warps per row group of `mla_flash_prefill_*` (`FM_SPLIT`): a block is
/// `MLA_FLASH_VECS / 16 * MLA_FLASH_SPLIT` warps (16, the kernel's `__launch_bounds__`).
const MLA_FLASH_SPLIT: usize = 8;
pub const MLA_FLASH_MAX_LORA: usize = 512;
pub const MLA_FLASH_MAX_ROPE: usize = 64;

/// Whether prompt chunks over a latent cache of `storage` with these widths take the tensor-core
/// kernel (`mla_flash_prefill_*`) on a runtime with (or without) bf16 MMA: bf16 and FP8 caches
/// (an f32 cache keeps f32 products), DeepSeek-V3/Kimi-sized rows, sm_80+.
pub fn mla_flash_prefill_fits(storage: KvStorage, lora: usize, rope: usize, bf16_mma: bool) -> bool {
    bf16_mma && storage != KvStorage::F32 && (1..=MLA_FLASH_MAX_LORA).contains(&lora) && rope <= MLA_FLASH_MAX_ROPE
}

/// Rows per tile of `mla_flash_prefill_*` for `heads` query heads (all sharing the latent): as
/// many rows as fill a block's vectors, at least one (more heads are split over gridDim.z).
pub fn mla_flash_rows_per_tile(heads: usize) -> usize {
    (MLA_FLASH_VECS / heads.max(1)).max(1)
}

/// Rotary pairs per row `rope_rows` handles (32 lanes × `ROPE_PAIRS` in mla.cu).
pub const ROPE_ROWS_MAX_PAIRS: usize = 256;
/// Warps per block and tokens per tile of `head_matvec_bf16` (`HM_WARPS`, `HM_TOK` in mla.cu).
const HM_WARPS: usize = 4;
const HM_TOK: usize = 8;
/// CUDA's limit on gridDim.y and gridDim.z.
pub(crate) const GRID_YZ_MAX: usize = 65535;

impl<R: Runtime> Kernels<R> {
    /// `out[r, 0..count] = src[r, offset..offset + count]` for `r < rows` (src rows `width` wide).
    pub fn copy_cols(
        &self,
        src: &R::Buf<f32>,
        out: &mut R::Buf<f32>,
        rows: usize,
        width: usize,
        offset: usize,
        count: usize,
    ) -> Result<(), CudaError> {
        check(offset + count <= width && width <= i32::MAX as usize, || {
            format!("copy_cols: columns {offset}..{} of rows {width} wide", offset + count)
        })?;
        check(src.len() >= rows * width && out.len() >= rows * count, || {
            format!("copy_cols: src {} / out {} elements for {rows} rows of {width} -> {count}", src.len(), out.len())
        })?;
        if rows * count == 0 {
            return Ok(()); // nothing to copy, and CUDA refuses an empty grid
        }
        let dims = Self::elementwise_dims("copy_cols", rows * count)?;
        self.go(
            "copy_cols",
            dims,
            &[
                A::F32s(src),
                A::F32s(out),
                A::I64(rows as i64),
                A::I32(width as i32),
                A::I32(offset as i32),
                A::I32(count as i32),
            ],
        )
    }

    /// RoPE on dense rows of dim = 2 * inv_freq.len(): row r (of tokens * rows_per_token) belongs
    /// to token r / rows_per_token and rotates by positions[token]; with `interleave` the row's
    /// pairs (x0,x1),(x2,x3).. are first reordered to (x0,x2,..,x1,x3,..) (DeepSeek), then
    /// rotate-half, then every element is multiplied by `attention_factor` (YaRN; skipped when it
    /// is 1.0): exactly [`crate::cpu::rope::rope_rows`].
    #[allow(clippy::too_many_arguments)]
    pub fn rope_rows(
        &self,
        x: &mut R::Buf<f32>,
        positions: &R::Buf<i32>,
        inv_freq: &R::Buf<f32>,
        tokens: usize,
        rows_per_token: usize,
        interleave: bool,
        attention_factor: f32,
    ) -> Result<(), CudaError> {
        let half = inv_freq.len();
        let rows = tokens * rows_per_token;
        check(half <= ROPE_ROWS_MAX_PAIRS, || {
            format!("rope_rows: {half} rotary pairs (at most {ROPE_ROWS_MAX_PAIRS})")
        })?;
        check(x.len() >= rows * 2 * half && positions.len() >= tokens, || {
            format!(
                "rope_rows: x {} / positions {} for {tokens} tokens x {rows_per_token} rows of {}",
                x.len(),
                positions.len(),
                2 * half
            )
        })?;
        if rows == 0 || half == 0 {
            return Ok(());
        }
        // One warp per row, 4 per block.
        check(rows.div_ceil(4) <= i32::MAX as usize, || format!("rope_rows: {rows} rows exceed one launch's grid"))?;
        let dims = Dims::new((rows.div_ceil(4) as u32, 1, 1), 128);
        let args = [
            A::F32s(x),
            A::I32s(positions),
            A::F32s(inv_freq),
            A::I64(rows as i64),
            A::I32(rows_per_token as i32),
            A::I32(half as i32),
            A::I32(interleave as i32),
            A::F32(attention_factor),
        ];
        self.go("rope_rows", dims, &args)
    }

    /// out[t, h, r] = sum_c W[h, r, c] * x[t, h, c]; W bf16 bits [heads, rows, cols], x
    /// [tokens, heads, cols], out [tokens, heads, rows] (MLA's per-head `W_ukᵀ` and `W_uv`).
    #[allow(clippy::too_many_arguments)]
    pub fn head_matvec_bf16(
        &self,
        w: &R::Buf<u16>,
        x: &R::Buf<f32>,
        out: &mut R::Buf<f32>,
        tokens: usize,
        heads: usize,
        rows: usize,
        cols: usize,
    ) -> Result<(), CudaError> {
        self.head_matvec("head_matvec_bf16", A::U16s(w), w.len(), x, out, tokens, heads, rows, cols)
    }

    /// As [`Self::head_matvec_bf16`] with f32 weights (exact checks of f32 checkpoints).
    #[allow(clippy::too_many_arguments)]
    pub fn head_matvec_f32(
        &self,
        w: &R::Buf<f32>,
        x: &R::Buf<f32>,
        out: &mut R::Buf<f32>,
        tokens: usize,
        heads: usize,
        rows: usize,
        cols: usize,
    ) -> Result<(), CudaError> {
        self.head_matvec("head_matvec_f32", A::F32s(w), w.len(), x, out, tokens, heads, rows, cols)
    }

    #[allow(clippy::too_many_arguments)]
    fn head_matvec(
        &self,
        name: &'static str,
        w: A<'_, R>,
        w_len: usize,
        x: &R::Buf<f32>,
        out: &mut R::Buf<f32>,
        tokens: usize,
        heads: usize,
        rows: usize,
        cols: usize,
    ) -> Result<(), CudaError> {
        check(
            w_len >= heads * rows * cols && x.len() >= tokens * heads * cols && out.len() >= tokens * heads * rows,
            || {
                format!(
                    "{name}: w {w_len} / x {} / out {} elements for {tokens} tokens x {heads} heads of {rows}x{cols}",
                    x.len(),
                    out.len()
                )
            },
        )?;
        check(
            heads <= GRID_YZ_MAX
                && tokens <= i32::MAX as usize
                && cols <= i32::MAX as usize
                && rows.div_ceil(HM_WARPS) <= i32::MAX as usize,
            || format!("{name}: {tokens} tokens x {heads} heads of {rows}x{cols} exceed one launch's grid"),
        )?;
        if tokens * heads * rows == 0 {
            return Ok(());
        }
        // Token tiles beyond gridDim.z's limit are covered by the kernel's stride loop.
        let dims = Dims::new(
            (rows.div_ceil(HM_WARPS) as u32, heads as u32, tokens.div_ceil(HM_TOK).min(GRID_YZ_MAX) as u32),
            (HM_WARPS * 32) as u32,
        );
        self.go(
            name,
            dims,
            &[
                w,
                A::F32s(x),
                A::F32s(out),
                A::I32(tokens as i32),
                A::I32(heads as i32),
                A::I32(rows as i32),
                A::I32(cols as i32),
            ],
        )
    }

    /// x[i] *= 1 / (1 + exp(-g[i])) for i < n (MLA output gate).
    pub fn sigmoid_mul(&self, x: &mut R::Buf<f32>, g: &R::Buf<f32>, n: usize) -> Result<(), CudaError> {
        check(x.len() >= n && g.len() >= n, || format!("sigmoid_mul: x {} / g {} elements for {n}", x.len(), g.len()))?;
        if n == 0 {
            return Ok(());
        }
        let dims = Self::elementwise_dims("sigmoid_mul", n)?;
        self.go("sigmoid_mul", dims, &[A::F32s(x), A::F32s(g), A::I64(n as i64)])
    }

    /// Absorbed MLA attention over an f32 latent cache (`c` the latents `[pool row][lora]`, `kr`
    /// the rotary keys `[pool row][rope]`), one query token per entry of `lens`: see
    /// [`crate::cpu::mla::mla_attention`]. As with paged attention, the caller guarantees the block
    /// tables and lengths stay inside the pool.
    #[allow(clippy::too_many_arguments)]
    pub fn mla_attention_f32(
        &self,
        g: &LatentGeometry,
        q_lat: &R::Buf<f32>,
        q_rope: &R::Buf<f32>,
        c: &R::Buf<f32>,
        kr: &R::Buf<f32>,
        tables: &R::Buf<i32>,
        lens: &R::Buf<i32>,
        scale: f32,
        ctx: &mut R::Buf<f32>,
    ) -> Result<(), CudaError> {
        self.mla_attention("mla_attention_f32", g, q_lat, q_rope, [A::F32s(c), A::F32s(kr)], tables, lens, scale, ctx)
    }

    /// As [`Self::mla_attention_f32`] over bf16 (bit patterns) rows.
    #[allow(clippy::too_many_arguments)]
    pub fn mla_attention_bf16(
        &self,
        g: &LatentGeometry,
        q_lat: &R::Buf<f32>,
        q_rope: &R::Buf<f32>,
        c: &R::Buf<u16>,
        kr: &R::Buf<u16>,
        tables: &R::Buf<i32>,
        lens: &R::Buf<i32>,
        scale: f32,
        ctx: &mut R::Buf<f32>,
    ) -> Result<(), CudaError> {
        self.mla_attention("mla_attention_bf16", g, q_lat, q_rope, [A::U16s(c), A::U16s(kr)], tables, lens, scale, ctx)
    }

    /// As [`Self::mla_attention_f32`] over E4M3 rows with one scale per pool row of each.
    #[allow(clippy::too_many_arguments)]
    pub fn mla_attention_fp8(
        &self,
        g: &LatentGeometry,
        q_lat: &R::Buf<f32>,
        q_rope: &R::Buf<f32>,
        c: &R::Buf<u8>,
        kr: &R::Buf<u8>,
        c_scales: &R::Buf<f32>,
        kr_scales: &R::Buf<f32>,
        tables: &R::Buf<i32>,
        lens: &R::Buf<i32>,
        scale: f32,
        ctx: &mut R::Buf<f32>,
    ) -> Result<(), CudaError> {
        // A scale for every stored row (kr is a 1-element placeholder when rope is 0).
        check(c_scales.len() * g.lora >= c.len() && (g.rope == 0 || kr_scales.len() * g.rope >= kr.len()), || {
            format!(
                "mla_attention_fp8: {} / {} scales for {} / {} codes",
                c_scales.len(),
                kr_scales.len(),
                c.len(),
                kr.len()
            )
        })?;
        self.mla_attention(
            "mla_attention_fp8",
            g,
            q_lat,
            q_rope,
            [A::U8s(c), A::U8s(kr), A::F32s(c_scales), A::F32s(kr_scales)],
            tables,
            lens,
            scale,
            ctx,
        )
    }

    /// Absorbed MLA attention for the rows of prompt chunks on the tensor cores: `tiles` (`num_tiles`
    /// `(first row, rows)` pairs from `prefill::prefill_tiles` with [`mla_flash_rows_per_tile`])
    /// cover runs of consecutive rows of one sequence; their ctx rows get what
    /// [`Self::mla_attention_bf16`] would give (up to bf16 rounding of Q, K and P), other rows are
    /// left untouched. `q_lat`, `q_rope`, `tables`, `lens`, `ctx` are the whole batch's.
    #[allow(clippy::too_many_arguments)]
    pub fn mla_flash_prefill_bf16(
        &self,
        g: &LatentGeometry,
        q_lat: &R::Buf<f32>,
        q_rope: &R::Buf<f32>,
        c: &R::Buf<u16>,
        kr: &R::Buf<u16>,
        tables: &R::Buf<i32>,
        lens: &R::Buf<i32>,
        tiles: &R::Buf<i32>,
        num_tiles: usize,
        scale: f32,
        ctx: &mut R::Buf<f32>,
    ) -> Result<(), CudaError> {
        self.mla_flash_prefill(
            "mla_flash_prefill_bf16",
            KvStorage::Bf16,
            g,
            q_lat,
            q_rope,
            vec![A::U16s(c), A::U16s(kr)],
            tables,
            lens,
            tiles,
            num_tiles,
            scale,
            ctx,
        )
    }

    /// As [`Self::mla_flash_prefill_bf16`] over E4M3 rows with one scale per pool row of each.
    #[allow(clippy::too_many_arguments)]
    pub fn mla_flash_prefill_fp8(
        &self,
        g: &LatentGeometry,
        q_lat: &R::Buf<f32>,
        q_rope: &R::Buf<f32>,
        c: &R::Buf<u8>,
        kr: &R::Buf<u8>,
        c_scales: &R::Buf<f32>,
        kr_scales: &R::Buf<f32>,
        tables: &R::Buf<i32>,
        lens: &R::Buf<i32>,
        tiles: &R::Buf<i32>,
        num_tiles: usize,
        scale: f32,
        ctx: &mut R::Buf<f32>,
    ) -> Result<(), CudaError> {
        check(c_scales.len() * g.lora >= c.len() && (g.rope == 0 || kr_scales.len() * g.rope >= kr.len()), || {
            format!(
                "mla_flash_prefill_fp8: {} / {} scales for {} / {} codes",
                c_scales.len(),
                kr_scales.len(),
                c.len(),
                kr.len()
            )
        })?;
        self.mla_flash_prefill(
            "mla_flash_prefill_fp8",
            KvStorage::Fp8,
            g,
            q_lat,
            q_rope,
            vec![A::U8s(c), A::U8s(kr), A::F32s(c_scales), A::F32s(kr_scales)],
            tables,
            lens,
            tiles,
            num_tiles,
            scale,
            ctx,
        )
    }

    #[allow(clippy::too_many_arguments)]
    fn mla_flash_prefill(
        &self,
        name: &'static str,
        storage: KvStorage,
        g: &LatentGeometry,
        q_lat: &R::Buf<f32>,
        q_rope: &R::Buf<f32>,
        cache: Vec<A<'_, R>>,
        tables: &R::Buf<i32>,
        lens: &R::Buf<i32>,
        tiles: &R::Buf<i32>,
        num_tiles: usize,
        scale: f32,
        ctx: &mut R::Buf<f32>,
    ) -> Result<(), CudaError> {
        let (n, heads, lora, rope) = (lens.len(), g.heads, g.lora, g.rope);
        check(mla_flash_prefill_fits(storage, lora, rope, self.rt.bf16_mma()), || {
            format!("{name}: latent {lora} / rotary {rope} wide (at most {MLA_FLASH_MAX_LORA} / {MLA_FLASH_MAX_ROPE}) on {} (bf16 MMA: {})", self.rt.describe(), self.rt.bf16_mma())
        })?;
        check(heads >= 1 && n <= i32::MAX as usize && g.block_size > 0, || {
            format!("{name}: {n} tokens x {heads} heads, block size {}", g.block_size)
        })?;
        check(
            q_lat.len() >= n * heads * lora
                && q_rope.len() >= n * heads * rope
                && ctx.len() >= n * heads * lora
                && tables.len() >= n * g.max_blocks,
            || {
                format!(
                    "{name}: q_lat {} / q_rope {} / ctx {} / tables {} elements for {n} tokens",
                    q_lat.len(),
                    q_rope.len(),
                    ctx.len(),
                    tables.len()
                )
            },
        )?;
        check(tiles.len() >= 2 * num_tiles && num_tiles <= i32::MAX as usize, || {
            format!("{name}: {} tile entries for {num_tiles} tiles", tiles.len())
        })?;
        let z = (mla_flash_rows_per_tile(heads) * heads).div_ceil(MLA_FLASH_VECS);
        check(z <= GRID_YZ_MAX, || format!("{name}: {heads} heads exceed one launch's grid"))?;
        if num_tiles == 0 {
            return Ok(()); // no prompt chunk in the batch; CUDA refuses an empty grid
        }
        let mut args: Vec<A<'_, R>> = vec![A::F32s(q_lat), A::F32s(q_rope)];
        args.extend(cache);
        args.extend([
            A::I32s(tables),
            A::I32s(lens),
            A::I32s(tiles),
            A::F32s(ctx),
            A::I32(heads as i32),
            A::I32(lora as i32),
            A::I32(rope as i32),
            A::I32(g.block_size as i32),
            A::I32(g.max_blocks as i32),
            A::F32(scale),
        ]);
        self.go(
            name,
            Dims::new((num_tiles as u32, 1, z as u32), (MLA_FLASH_VECS / 16 * MLA_FLASH_SPLIT * 32) as u32),
            &args,
        )
    }

    /// Size checks and launch of the three storage variants; `cache` is the kernel's cache
    /// arguments (latents, rotary keys and, for FP8, their scales).
    #[allow(clippy::too_many_arguments)]
    fn mla_attention<const N: usize>(
        &self,
        name: &'static str,
        g: &LatentGeometry,
        q_lat: &R::Buf<f32>,
        q_rope: &R::Buf<f32>,
        cache: [A<'_, R>; N],
        tables: &R::Buf<i32>,
        lens: &R::Buf<i32>,
        scale: f32,
        ctx: &mut R::Buf<f32>,
    ) -> Result<(), CudaError> {
        let (n, heads, lora, rope) = (lens.len(), g.heads, g.lora, g.rope);
        check((1..=MLA_MAX_LORA).contains(&lora) && rope <= MLA_MAX_ROPE, || {
            format!("{name}: latent {lora} / rotary {rope} wide (at most {MLA_MAX_LORA} / {MLA_MAX_ROPE}, latent at least 1)")
        })?;
        check((1..=GRID_YZ_MAX).contains(&heads) && n <= i32::MAX as usize && g.block_size > 0, || {
            format!("{name}: {n} tokens x {heads} heads, block size {}", g.block_size)
        })?;
        check(
            q_lat.len() >= n * heads * lora
                && q_rope.len() >= n * heads * rope
                && ctx.len() >= n * heads * lora
                && tables.len() >= n * g.max_blocks,
            || {
                format!(
                    "{name}: q_lat {} / q_rope {} / ctx {} / tables {} elements for {n} tokens",
                    q_lat.len(),
                    q_rope.len(),
                    ctx.len(),
                    tables.len()
                )
            },
        )?;
        if n == 0 {
            return Ok(());
        }
        // One warp per head, up to MLA_HEADS heads per block (the block shares their cache reads);
        // positions split over gridDim.z when that leaves the GPU short of blocks.
        let group = heads.min(MLA_HEADS);
        let groups = heads.div_ceil(group);
        let splits = mla_splits(n * groups, g.max_blocks * g.block_size);
        let part = if splits > 1 { Some(self.zeros::<f32>(n * heads * splits * (lora + 2))?) } else { None };
        let mut args: Vec<A<'_, R>> = vec![A::F32s(q_lat), A::F32s(q_rope)];
        args.extend(cache);
        // Without splits the kernel never touches `part`: ctx stands in for it.
        args.extend([
            A::I32s(tables),
            A::I32s(lens),
            A::F32s(ctx),
            A::F32s(part.as_ref().unwrap_or(ctx)),
            A::I32(heads as i32),
            A::I32(lora as i32),
            A::I32(rope as i32),
            A::I32(g.block_size as i32),
            A::I32(g.max_blocks as i32),
            A::F32(scale),
        ]);
        self.go(name, Dims::new((n as u32, groups as u32, splits as u32), (32 * group) as u32), &args)?;
        match &part {
            Some(part) => self.go(
                "mla_combine",
                Dims::new((n as u32, heads as u32, 1), 128),
                &[A::F32s(part), A::F32s(ctx), A::I32(heads as i32), A::I32(lora as i32), A::I32(splits as i32)],
            ),
            None => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::mla_splits;

    #[test]
    fn positions_are_split_only_when_blocks_are_few_and_contexts_long() {
        assert_eq!(mla_splits(16, 4096), 16); // one DeepSeek-V3 token: 16 head groups
        assert_eq!(mla_splits(16 * 64, 4096), 1); // a 64-token batch fills the GPU
        assert_eq!(mla_splits(16, 100), 1); // too short to split
        assert_eq!(mla_splits(1, 1 << 20), 64); // capped
        assert_eq!(mla_splits(4, 300), 4);
    }
}
