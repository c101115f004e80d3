//! Prefill attention: the rows of a prompt chunk (consecutive batch rows of one sequence at
//! consecutive positions) read the same cache rows, so they run in tiles that stage each K/V row
//! once for a block's worth of (row, head) query vectors, instead of once per vector as the
//! decode kernel does. Two kernels (kernels/cuda/paged_attention.cu), one tile plan each:
//! * `paged_flash_prefill_*` (`flash_prefill_tile`): tensor cores, [`FLASH_VECS`] vectors per
//!   block, Q/K/V/P rounded to bf16 for the products; bf16 and FP8 caches with head_dim a
//!   multiple of 16 up to [`FLASH_MAX_HEAD_DIM`] on sm_80 and later;
//! * `paged_prefill_*` (`prefill_tile`): CUDA cores, f32 products, [`PREFILL_VECS`] vectors per
//!   block; everything else (f32 caches keep their precision).
//!
//! The result of every row is the decode kernel's (the CPU reference
//! `cpu::attention::paged_attention_decode` with len = pos + 1); the host plans the tiles.

use super::kernels::{check, Kernels, PagedGeometry};
use super::kv_pool::KvStorage;
use super::runtime::{DevBuf, Dims, KArg as A, Runtime};
use crate::cuda::CudaError;

/// Query vectors per block of `paged_prefill_*` (`PF_VECS` in paged_attention.cu: 8 warps × 2).
pub const PREFILL_VECS: usize = 16;
/// Query vectors per block of `paged_flash_prefill_*` (`FL_VECS`: 4 warps × 16 MMA rows).
pub const FLASH_VECS: usize = 64;
/// The widest head `paged_flash_prefill_*` takes (`FL_MAX_D`).
pub const FLASH_MAX_HEAD_DIM: usize = 128;

/// Which prefill kernel runs, which fixes the tile plan.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PrefillKernel {
    /// `paged_prefill_*`.
    CudaCores,
    /// `paged_flash_prefill_*`.
    TensorCores,
}

impl PrefillKernel {
    /// The kernel for a cache of `storage` with heads of `head_dim` on a runtime that has (or
    /// lacks) bf16 MMA. f32 caches stay on the CUDA cores: rounding Q, K, V and P to bf16 would
    /// undo what `--kv-cache-dtype float32` asks for.
    pub fn choose(storage: KvStorage, head_dim: usize, bf16_mma: bool) -> Self {
        let shape_fits = head_dim.is_multiple_of(16) && head_dim > 0 && head_dim <= FLASH_MAX_HEAD_DIM;
        if bf16_mma && shape_fits && storage != KvStorage::F32 {
            PrefillKernel::TensorCores
        } else {
            PrefillKernel::CudaCores
        }
    }

    /// Query vectors per block.
    pub fn vectors(self) -> usize {
        match self {
            PrefillKernel::CudaCores => PREFILL_VECS,
            PrefillKernel::TensorCores => FLASH_VECS,
        }
    }

    /// Rows per tile for a GQA group of `group` query heads per kv head: as many rows as fill a
    /// block's vectors, at least one (a larger group is split over gridDim.z).
    pub fn rows_per_tile(self, group: usize) -> usize {
        (self.vectors() / group.max(1)).max(1)
    }
}

/// [`PrefillKernel::CudaCores`]' rows per tile (the plan `paged_prefill_*` takes).
pub fn rows_per_tile(group: usize) -> usize {
    PrefillKernel::CudaCores.rows_per_tile(group)
}

/// Tiles `(first row, rows)` of at most `rows_per_tile` rows, flattened, covering each run
/// `(first row, rows)` of the batch (a run: consecutive rows of one sequence at consecutive
/// positions, which is what the kernel assumes of a tile).
pub fn prefill_tiles(runs: &[(usize, usize)], rows_per_tile: usize) -> Vec<i32> {
    let mut tiles = Vec::new();
    for &(first, rows) in runs {
        for start in (first..first + rows).step_by(rows_per_tile.max(1)) {
            tiles.extend([start as i32, rows_per_tile.min(first + rows - start) as i32]);
        }
    }
    tiles
}

impl<R: Runtime> Kernels<R> {
    /// Attention of the rows in `num_tiles` tiles (`tiles`: `(first row, rows)` pairs from
    /// [`prefill_tiles`] with this geometry's [`rows_per_tile`]) over f32 K/V blocks; `q`, `out`,
    /// `tables` and `lens` are the whole batch's, as for [`Kernels::paged_attention_f32`], and
    /// rows outside the tiles are left untouched. The caller guarantees what the kernel assumes:
    /// each tile is one run, block tables and lengths inside the pool.
    #[allow(clippy::too_many_arguments)]
    pub fn paged_prefill_f32(
        &self,
        g: &PagedGeometry,
        q: &R::Buf<f32>,
        k: &R::Buf<f32>,
        v: &R::Buf<f32>,
        tables: &R::Buf<i32>,
        lens: &R::Buf<i32>,
        tiles: &R::Buf<i32>,
        num_tiles: usize,
        scale: f32,
        out: &mut R::Buf<f32>,
    ) -> Result<(), CudaError> {
        self.paged_prefill(
            "paged_prefill_f32",
            g,
            q,
            vec![A::F32s(k), A::F32s(v)],
            tables,
            lens,
            tiles,
            num_tiles,
            scale,
            out,
        )
    }

    /// As [`Self::paged_prefill_f32`] over bf16 (bit patterns) K/V blocks.
    #[allow(clippy::too_many_arguments)]
    pub fn paged_prefill_bf16(
        &self,
        g: &PagedGeometry,
        q: &R::Buf<f32>,
        k: &R::Buf<u16>,
        v: &R::Buf<u16>,
        tables: &R::Buf<i32>,
        lens: &R::Buf<i32>,
        tiles: &R::Buf<i32>,
        num_tiles: usize,
        scale: f32,
        out: &mut R::Buf<f32>,
    ) -> Result<(), CudaError> {
        self.paged_prefill(
            "paged_prefill_bf16",
            g,
            q,
            vec![A::U16s(k), A::U16s(v)],
            tables,
            lens,
            tiles,
            num_tiles,
            scale,
            out,
        )
    }

    /// As [`Self::paged_prefill_f32`] over E4M3 K/V blocks with one scale per (row, kv head).
    #[allow(clippy::too_many_arguments)]
    pub fn paged_prefill_fp8(
        &self,
        g: &PagedGeometry,
        q: &R::Buf<f32>,
        k: &R::Buf<u8>,
        v: &R::Buf<u8>,
        k_scales: &R::Buf<f32>,
        v_scales: &R::Buf<f32>,
        tables: &R::Buf<i32>,
        lens: &R::Buf<i32>,
        tiles: &R::Buf<i32>,
        num_tiles: usize,
        scale: f32,
        out: &mut R::Buf<f32>,
    ) -> Result<(), CudaError> {
        let cache = vec![A::U8s(k), A::U8s(v), A::F32s(k_scales), A::F32s(v_scales)];
        self.paged_prefill("paged_prefill_fp8", g, q, cache, tables, lens, tiles, num_tiles, scale, out)
    }

    /// As [`Self::paged_prefill_bf16`] on the tensor cores ([`PrefillKernel::TensorCores`]):
    /// `tiles` planned with its [`PrefillKernel::rows_per_tile`]; an error where
    /// [`PrefillKernel::choose`] would not pick it (head_dim, no bf16 MMA).
    #[allow(clippy::too_many_arguments)]
    pub fn paged_flash_prefill_bf16(
        &self,
        g: &PagedGeometry,
        q: &R::Buf<f32>,
        k: &R::Buf<u16>,
        v: &R::Buf<u16>,
        tables: &R::Buf<i32>,
        lens: &R::Buf<i32>,
        tiles: &R::Buf<i32>,
        num_tiles: usize,
        scale: f32,
        out: &mut R::Buf<f32>,
    ) -> Result<(), CudaError> {
        self.check_flash("paged_flash_prefill_bf16", g, KvStorage::Bf16)?;
        self.prefill_launch(
            "paged_flash_prefill_bf16",
            PrefillKernel::TensorCores,
            g,
            q,
            vec![A::U16s(k), A::U16s(v)],
            tables,
            lens,
            tiles,
            num_tiles,
            scale,
            out,
        )
    }

    /// As [`Self::paged_flash_prefill_bf16`] over E4M3 K/V blocks with one scale per (row, kv head).
    #[allow(clippy::too_many_arguments)]
    pub fn paged_flash_prefill_fp8(
        &self,
        g: &PagedGeometry,
        q: &R::Buf<f32>,
        k: &R::Buf<u8>,
        v: &R::Buf<u8>,
        k_scales: &R::Buf<f32>,
        v_scales: &R::Buf<f32>,
        tables: &R::Buf<i32>,
        lens: &R::Buf<i32>,
        tiles: &R::Buf<i32>,
        num_tiles: usize,
        scale: f32,
        out: &mut R::Buf<f32>,
    ) -> Result<(), CudaError> {
        self.check_flash("paged_flash_prefill_fp8", g, KvStorage::Fp8)?;
        let cache = vec![A::U8s(k), A::U8s(v), A::F32s(k_scales), A::F32s(v_scales)];
        self.prefill_launch(
            "paged_flash_prefill_fp8",
            PrefillKernel::TensorCores,
            g,
            q,
            cache,
            tables,
            lens,
            tiles,
            num_tiles,
            scale,
            out,
        )
    }

    fn check_flash(&self, name: &str, g: &PagedGeometry, storage: KvStorage) -> Result<(), CudaError> {
        let chosen = PrefillKernel::choose(storage, g.head_dim, self.rt.bf16_mma());
        check(chosen == PrefillKernel::TensorCores, || {
            format!(
                "{name}: head_dim {} (a multiple of 16 up to {FLASH_MAX_HEAD_DIM}) on {} (bf16 MMA: {})",
                g.head_dim,
                self.rt.describe(),
                self.rt.bf16_mma()
            )
        })
    }

    #[allow(clippy::too_many_arguments)]
    fn paged_prefill(
        &self,
        name: &'static str,
        g: &PagedGeometry,
        q: &R::Buf<f32>,
        cache: Vec<A<'_, R>>,
        tables: &R::Buf<i32>,
        lens: &R::Buf<i32>,
        tiles: &R::Buf<i32>,
        num_tiles: usize,
        scale: f32,
        out: &mut R::Buf<f32>,
    ) -> Result<(), CudaError> {
        self.prefill_launch(name, PrefillKernel::CudaCores, g, q, cache, tables, lens, tiles, num_tiles, scale, out)
    }

    #[allow(clippy::too_many_arguments)]
    fn prefill_launch(
        &self,
        name: &'static str,
        kernel: PrefillKernel,
        g: &PagedGeometry,
        q: &R::Buf<f32>,
        cache: Vec<A<'_, R>>,
        tables: &R::Buf<i32>,
        lens: &R::Buf<i32>,
        tiles: &R::Buf<i32>,
        num_tiles: usize,
        scale: f32,
        out: &mut R::Buf<f32>,
    ) -> Result<(), CudaError> {
        Self::attn_check(g, q, tables, lens, out)?;
        check(tiles.len() >= 2 * num_tiles && num_tiles <= i32::MAX as usize, || {
            format!("{name}: {} tile entries for {num_tiles} tiles", tiles.len())
        })?;
        let group = g.heads / g.kv_heads;
        let z = (kernel.rows_per_tile(group) * group).div_ceil(kernel.vectors());
        check(g.kv_heads <= 65535 && z <= 65535, || {
            format!("{name}: {} kv heads of {group} query heads exceed one launch's grid", g.kv_heads)
        })?;
        if num_tiles == 0 {
            return Ok(()); // no prompt chunk in the batch; CUDA refuses an empty grid
        }
        let mut args = vec![A::F32s(q)];
        args.extend(cache);
        args.extend([
            A::I32s(tables),
            A::I32s(lens),
            A::I32s(tiles),
            A::F32s(out),
            A::I32(g.heads as i32),
            A::I32(g.kv_heads as i32),
            A::I32(g.head_dim as i32),
            A::I32(g.block_size as i32),
            A::I32(g.max_blocks as i32),
            A::F32(scale),
        ]);
        let threads = match kernel {
            PrefillKernel::CudaCores => PREFILL_VECS / 2 * 32, // 2 vectors per warp
            PrefillKernel::TensorCores => FLASH_VECS / 16 * 32, // 16 per warp
        };
        self.go(name, Dims::new((num_tiles as u32, g.kv_heads as u32, z as u32), threads as u32), &args)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tiles_cover_each_run_in_order_and_fill_the_block_with_query_vectors() {
        assert_eq!((rows_per_tile(1), rows_per_tile(3), rows_per_tile(8), rows_per_tile(40)), (16, 5, 2, 1));
        // Runs of 12 rows from 0 and 5 rows from 20, 5 rows per tile.
        assert_eq!(prefill_tiles(&[(0, 12), (20, 5)], 5), [0, 5, 5, 5, 10, 2, 20, 5]);
        assert!(prefill_tiles(&[], 5).is_empty());
        assert_eq!([1, 3, 8, 40].map(|g| PrefillKernel::TensorCores.rows_per_tile(g)), [64, 21, 8, 1]);
    }

    #[test]
    fn tensor_cores_take_bf16_and_fp8_caches_whose_heads_fit_the_mma_tiles() {
        use PrefillKernel::*;
        for (storage, head_dim, mma, want) in [
            (KvStorage::Bf16, 64, true, TensorCores),
            (KvStorage::Fp8, 128, true, TensorCores),
            (KvStorage::Bf16, 16, true, TensorCores),
            (KvStorage::F32, 64, true, CudaCores),   // keeps f32 products
            (KvStorage::Bf16, 40, true, CudaCores),  // not a multiple of 16
            (KvStorage::Bf16, 256, true, CudaCores), // wider than the register tiles
            (KvStorage::Bf16, 64, false, CudaCores), // before sm_80
        ] {
            assert_eq!(PrefillKernel::choose(storage, head_dim, mma), want, "{storage:?} x{head_dim} mma={mma}");
        }
    }
}
