//! How one step's attention rows are split between a decode and a prefill attention kernel:
//! prompt chunks (`StepInputs::prompt_runs`) go to the prefill kernel in tiles that share their
//! cache reads (`kernels::gpu::prefill` for Llama's K/V, `mla_flash_prefill_*` for MLA's latent
//! rows), the remaining rows (decode) to the decode kernel. Built once per step, used by every
//! layer.

use kernels::cuda::CudaError;
use kernels::gpu::prefill::prefill_tiles;
use kernels::gpu::{Kernels, Runtime};

use crate::model::device::step::StepInputs;

pub(crate) struct AttentionSplit<R: Runtime> {
    /// The prefill kernel's `(first row, rows)` tiles and their number (0: no prompt chunk).
    pub tiles: R::Buf<i32>,
    pub num_tiles: usize,
    /// Whether any row is left for the decode kernel.
    pub decode_rows: bool,
    /// The decode kernel's lengths when some rows are in tiles: theirs set to 0, so the decode
    /// kernel passes over them (the prefill kernel writes them after it). `None`: use the
    /// step's lengths.
    pub decode_lens: Option<R::Buf<i32>>,
}

impl<R: Runtime> AttentionSplit<R> {
    /// The split for `inp` with prompt chunks in tiles of `rows_per_tile` rows (the pool's
    /// prefill kernel's plan for the GQA group).
    pub fn new(gpu: &Kernels<R>, inp: &StepInputs, rows_per_tile: usize) -> Result<Self, CudaError> {
        let tiles = prefill_tiles(&inp.prompt_runs, rows_per_tile);
        let num_tiles = tiles.len() / 2;
        let mut lens = inp.lens.clone();
        for &(first, rows) in &inp.prompt_runs {
            lens[first..first + rows].fill(0);
        }
        let decode_rows = lens.iter().any(|&l| l > 0);
        let decode_lens = if num_tiles > 0 && decode_rows { Some(gpu.upload(&lens)?) } else { None };
        // At least one element: a zero-length device buffer is not allocatable everywhere.
        let tiles = gpu.upload(if tiles.is_empty() { &[0, 0][..] } else { &tiles })?;
        Ok(Self { tiles, num_tiles, decode_rows, decode_lens })
    }
}
