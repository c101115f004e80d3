//! DeepSeek MLA's device kernels against their CPU references, written once over any runtime and
//! run by `cuda_vs_cpu.rs` on the simulator and on a CUDA device:
//!
//! * the per-token pieces (`copy_cols`, `rope_rows`, `head_matvec_bf16`/`_f32`, `sigmoid_mul`) on odd
//!   sizes, and their size checks;
//! * the single-tensor pool stores, bit for bit;
//! * the latent pool: slot-mapped writes into scattered blocks, a copy-on-write block copy and the
//!   absorbed attention over sequences of several lengths (0, 1, crossing blocks) in every storage
//!   type, with and without a rotary slice;
//! * the absorbed decomposition itself: `W_ukᵀ` folded into the query, pool attention, then
//!   `W_uv`, against plain attention over expanded per-head keys and values.

use kernels::cpu;
use kernels::cpu::attention::KvBlocks;
use kernels::cpu::mla::LatentGeometry;
use kernels::gpu::kv_pool::KvStorage;
use kernels::gpu::{DeviceLatentPool, Kernels, Runtime};

use super::test_data::uniform;
use super::{assert_close, Tol};

fn bf16_bits(x: &[f32]) -> Vec<u16> {
    x.iter().map(|&f| half::bf16::from_f32(f).to_bits()).collect()
}

/// `copy_cols`, `rope_rows`, `head_matvec_bf16` and `sigmoid_mul` on sizes that leave partial
/// warps, blocks and token tiles.
pub fn mla_pieces_match_cpu<R: Runtime>(g: &Kernels<R>, t: &Tol) {
    // copy_cols: a plain copy, bit for bit.
    let (rows, width, offset, count) = (13, 57, 9, 30);
    let src = uniform(rows * width, 21, -3.0, 3.0);
    let mut want = vec![0.0; rows * count];
    cpu::mla::copy_cols(&src, &mut want, rows, width, offset, count);
    let dsrc = g.upload(&src).unwrap();
    let mut dout = g.zeros::<f32>(rows * count).unwrap();
    g.copy_cols(&dsrc, &mut dout, rows, width, offset, count).unwrap();
    assert_eq!(g.download(&dout).unwrap(), want, "copy_cols");
    assert!(g.copy_cols(&dsrc, &mut dout, rows, width, 28, count).is_err(), "columns past the row are an error");
    assert!(g.copy_cols(&dsrc, &mut dout, rows + 1, width, offset, count).is_err(), "too small buffers are an error");

    // rope_rows: 5 tokens x 3 rows; half 40 gives lanes with one and two pairs, half 3 idle lanes.
    let (tokens, per_token) = (5, 3);
    let positions = [0i32, 1, 17, 4095, 60_000];
    let dp = g.upload(&positions).unwrap();
    for half in [40usize, 3] {
        let inv: Vec<f32> = (0..half)
            .map(|i| 1.0f32 / 10000f32.powf((2 * i) as f32 / (2 * half) as f32) * if i % 3 == 0 { 0.25 } else { 1.0 })
            .collect();
        let di = g.upload(&inv).unwrap();
        let x = uniform(tokens * per_token * 2 * half, 22 + half as u64, -2.0, 2.0);
        for (interleave, factor) in [(false, 1.0f32), (true, 1.0), (true, 1.3), (false, 0.7)] {
            let mut want = x.clone();
            cpu::rope::rope_rows_batch(&mut want, &positions, per_token, &inv, interleave, factor);
            let mut dx = g.upload(&x).unwrap();
            g.rope_rows(&mut dx, &dp, &di, tokens, per_token, interleave, factor).unwrap();
            assert_close(
                &format!("rope_rows half={half} interleave={interleave} factor={factor}"),
                &g.download(&dx).unwrap(),
                &want,
                t.rope,
            );
        }
    }
    let mut dx = g.zeros::<f32>(2 * 257).unwrap();
    assert!(
        g.rope_rows(&mut dx, &dp, &g.zeros::<f32>(257).unwrap(), 1, 1, true, 1.0).is_err(),
        "more than 256 pairs is an error"
    );
    assert!(
        g.rope_rows(&mut dx, &dp, &g.zeros::<f32>(8).unwrap(), 6, 1, true, 1.0).is_err(),
        "more tokens than positions is an error"
    );

    // head_matvec_bf16: 19 tokens (tiles of 8, 8, 3), 37 rows (a partial block of 4 warps), 70 cols.
    let (tokens, heads, rows, cols) = (19, 3, 37, 70);
    let w = bf16_bits(&uniform(heads * rows * cols, 23, -0.5, 0.5));
    let x = uniform(tokens * heads * cols, 24, -1.0, 1.0);
    let mut want = vec![0.0; tokens * heads * rows];
    cpu::mla::head_matvec_bf16(&w, &x, &mut want, tokens, heads, rows, cols);
    let (dw, dx) = (g.upload(&w).unwrap(), g.upload(&x).unwrap());
    let mut dout = g.zeros::<f32>(want.len()).unwrap();
    g.head_matvec_bf16(&dw, &dx, &mut dout, tokens, heads, rows, cols).unwrap();
    assert_close("head_matvec_bf16", &g.download(&dout).unwrap(), &want, t.gemv);
    assert!(
        g.head_matvec_bf16(&dw, &dx, &mut dout, tokens, heads, rows, cols + 1).is_err(),
        "too small buffers are an error"
    );
    assert!(g.head_matvec_bf16(&dw, &dx, &mut dout, 0, 70_000, 0, 0).is_err(), "more heads than gridDim.y is an error");
    // head_matvec_f32: the same with f32 weights.
    let wf = uniform(heads * rows * cols, 25, -0.5, 0.5);
    cpu::mla::head_matvec_f32(&wf, &x, &mut want, tokens, heads, rows, cols);
    g.head_matvec_f32(&g.upload(&wf).unwrap(), &dx, &mut dout, tokens, heads, rows, cols).unwrap();
    assert_close("head_matvec_f32", &g.download(&dout).unwrap(), &want, t.gemv);

    // sigmoid_mul: the same expf on the simulator.
    let n = 1001;
    let (x, gate) = (uniform(n, 25, -4.0, 4.0), uniform(n, 26, -12.0, 12.0));
    let mut want = x.clone();
    cpu::mla::sigmoid_mul(&mut want, &gate);
    let (mut dx, dg) = (g.upload(&x).unwrap(), g.upload(&gate).unwrap());
    g.sigmoid_mul(&mut dx, &dg, n).unwrap();
    assert_close("sigmoid_mul", &g.download(&dx).unwrap(), &want, t.rope);
    assert!(g.sigmoid_mul(&mut dx, &dg, n + 1).is_err(), "too small buffers are an error");
}

/// The single-tensor stores: same bits as the CPU references (and so as the host block pool).
pub fn kv_stores_match_cpu_bit_for_bit<R: Runtime>(g: &Kernels<R>, _t: &Tol) {
    let (n, width, pool_rows) = (7, 45, 20);
    // Magnitudes differ per row (distinct FP8 scales); row 4 is all zeros (scale 1).
    let x: Vec<f32> = uniform(n * width, 31, -1.0, 1.0)
        .iter()
        .enumerate()
        .map(|(i, v)| if i / width == 4 { 0.0 } else { v * (1 + i / width) as f32 })
        .collect();
    let slots = [17i32, 2, 3, 8, 0, 19, 9];
    let (dx, ds) = (g.upload(&x).unwrap(), g.upload(&slots).unwrap());

    let mut want = vec![0f32; pool_rows * width];
    cpu::kv_write::kv_store_f32(&x, &slots, width, &mut want);
    let mut dc = g.zeros::<f32>(pool_rows * width).unwrap();
    g.kv_store_f32(&dx, &ds, &mut dc, n, width).unwrap();
    assert_eq!(g.download(&dc).unwrap(), want, "kv_store_f32");

    let mut want = vec![0u16; pool_rows * width];
    cpu::kv_write::kv_store_bf16(&x, &slots, width, &mut want);
    let mut db = g.zeros::<u16>(pool_rows * width).unwrap();
    g.kv_store_bf16(&dx, &ds, &mut db, n, width).unwrap();
    assert_eq!(g.download(&db).unwrap(), want, "kv_store_bf16");

    let (mut codes, mut scales) = (vec![0u8; pool_rows * width], vec![0f32; pool_rows]);
    cpu::kv_write::kv_store_fp8(&x, &slots, width, &mut codes, &mut scales);
    let (mut d8, mut dsc) = (g.zeros::<u8>(pool_rows * width).unwrap(), g.zeros::<f32>(pool_rows).unwrap());
    g.kv_store_fp8(&dx, &ds, &mut d8, &mut dsc, n, width).unwrap();
    assert_eq!(g.download(&dsc).unwrap(), scales, "kv_store_fp8 scales");
    assert_eq!(g.download(&d8).unwrap(), codes, "kv_store_fp8 codes");
    assert_eq!(scales[0], 1.0, "an all-zero row keeps scale 1");

    assert!(g.kv_store_f32(&dx, &ds, &mut dc, n + 1, width).is_err(), "more rows than slots is an error");
    assert!(g.kv_store_f32(&dx, &ds, &mut dc, n, 0).is_err(), "zero-width rows are an error");
    assert!(
        g.kv_store_fp8(&dx, &ds, &mut d8, &mut g.zeros::<f32>(pool_rows - 1).unwrap(), n, width).is_err(),
        "a scale per pool row is required"
    );
}

/// The pool's rows as the CPU stores them (the host block pool's bits), for the CPU reference.
enum CpuRows {
    F32(Vec<f32>, Vec<f32>),
    Bf16(Vec<u16>, Vec<u16>),
    Fp8 { c: Vec<u8>, kr: Vec<u8>, cs: Vec<f32>, krs: Vec<f32> },
}

impl CpuRows {
    fn new(storage: KvStorage, rows: usize, lora: usize, rope: usize) -> Self {
        match storage {
            KvStorage::F32 => CpuRows::F32(vec![0.0; rows * lora], vec![0.0; rows * rope]),
            KvStorage::Bf16 => CpuRows::Bf16(vec![0; rows * lora], vec![0; rows * rope]),
            KvStorage::Fp8 => CpuRows::Fp8 {
                c: vec![0; rows * lora],
                kr: vec![0; rows * rope],
                cs: vec![0.0; rows],
                krs: vec![0.0; rows],
            },
        }
    }

    fn store(&mut self, latent: &[f32], k_rope: &[f32], slots: &[i32], lora: usize, rope: usize) {
        use cpu::kv_write::{kv_store_bf16, kv_store_f32, kv_store_fp8};
        match self {
            CpuRows::F32(c, kr) => {
                kv_store_f32(latent, slots, lora, c);
                kv_store_f32(k_rope, slots, rope, kr);
            }
            CpuRows::Bf16(c, kr) => {
                kv_store_bf16(latent, slots, lora, c);
                kv_store_bf16(k_rope, slots, rope, kr);
            }
            CpuRows::Fp8 { c, kr, cs, krs } => {
                kv_store_fp8(latent, slots, lora, c, cs);
                kv_store_fp8(k_rope, slots, rope, kr, krs);
            }
        }
    }

    /// The host pool's copy-on-write: rows `src..src + n` onto `dst..`.
    fn copy_rows(&mut self, src: usize, dst: usize, n: usize, lora: usize, rope: usize) {
        fn cp<T: Copy>(v: &mut [T], w: usize, src: usize, dst: usize, n: usize) {
            v.copy_within(src * w..(src + n) * w, dst * w);
        }
        match self {
            CpuRows::F32(c, kr) => {
                cp(c, lora, src, dst, n);
                cp(kr, rope, src, dst, n);
            }
            CpuRows::Bf16(c, kr) => {
                cp(c, lora, src, dst, n);
                cp(kr, rope, src, dst, n);
            }
            CpuRows::Fp8 { c, kr, cs, krs } => {
                cp(c, lora, src, dst, n);
                cp(kr, rope, src, dst, n);
                cp(cs, 1, src, dst, n);
                cp(krs, 1, src, dst, n);
            }
        }
    }

    fn blocks(&self) -> KvBlocks<'_> {
        match self {
            CpuRows::F32(c, kr) => KvBlocks::F32 { k: c, v: kr },
            CpuRows::Bf16(c, kr) => KvBlocks::Bf16 { k: c, v: kr },
            CpuRows::Fp8 { c, kr, cs, krs } => KvBlocks::Fp8 { k: c, v: kr, k_scales: cs, v_scales: krs },
        }
    }
}

/// Sequences over a pool of 9 blocks of 4: A (6 positions: block 5, then 2 in block 2), B (13:
/// A's full block 5, a copy-on-write of A's partial block 2 into block 7 continued there, then
/// blocks 0 and 8), C (empty) and D (1 position, block 3).
const BS: usize = 4;
const BLOCKS: usize = 9;
const MAX_BLOCKS: usize = 4;
const TABLES: [i32; 16] = [5, 2, 0, 0, 5, 7, 0, 8, 0, 0, 0, 0, 3, 0, 0, 0];
const LENS: [i32; 4] = [6, 13, 0, 1];

fn pool_row(seq: usize, pos: usize) -> i32 {
    TABLES[seq * MAX_BLOCKS + pos / BS] * BS as i32 + (pos % BS) as i32
}

/// Rows of latents (magnitude varying per row, so FP8 scales differ) and rotary keys.
fn latent_rows(n: usize, lora: usize, rope: usize, seed: u64) -> (Vec<f32>, Vec<f32>) {
    let c =
        uniform(n * lora, seed, -1.0, 1.0).iter().enumerate().map(|(i, v)| v * (1 + (i / lora) % 4) as f32).collect();
    (c, uniform(n * rope, seed + 1, -3.0, 3.0))
}

/// Writes the sequences into a device pool and its CPU mirror (two batches around the block copy;
/// layer 0 gets other rows, which layer 1's attention must not see) and compares the attention.
fn pool_case<R: Runtime>(g: &Kernels<R>, t: &Tol, storage: KvStorage, heads: usize, lora: usize, rope: usize) {
    let what = format!("latent pool {storage:?} lora={lora} rope={rope}");
    let mut pool = DeviceLatentPool::new(g, 2, BLOCKS, BS, lora, rope, storage).unwrap();
    let mut cpu_rows = CpuRows::new(storage, BLOCKS * BS, lora, rope);
    let up = |x: &[f32]| g.upload(x).unwrap();
    // Batch 1: A's positions and D's (scattered slots); batch 2 after the copy: B's own positions.
    let batch1: Vec<i32> = (0..6).map(|p| pool_row(0, p)).chain([pool_row(3, 0)]).collect();
    let batch2: Vec<i32> = (6..13).map(|p| pool_row(1, p)).collect();
    for (i, slots) in [batch1, batch2].iter().enumerate() {
        let n = slots.len();
        let (c, kr) = latent_rows(n, lora, rope, 40 + i as u64 * 7);
        let ds = g.upload(slots).unwrap();
        // At least one element: a NoPE pool takes a 1-element placeholder for k_rope.
        let dkr = if rope > 0 { up(&kr) } else { g.zeros::<f32>(1).unwrap() };
        pool.write_rows(g, 1, &up(&c), &dkr, &ds, n).unwrap();
        let (c0, kr0) = latent_rows(n, lora, rope, 90 + i as u64);
        pool.write_rows(g, 0, &up(&c0), &if rope > 0 { up(&kr0) } else { g.zeros::<f32>(1).unwrap() }, &ds, n).unwrap();
        cpu_rows.store(&c, &kr, slots, lora, rope);
        if i == 0 {
            // B shares A's first 6 positions: block 5 by reference, block 2's 2 slots by copy.
            pool.copy_block(g, 2, 7, 2).unwrap();
            cpu_rows.copy_rows(2 * BS, 7 * BS, 2, lora, rope);
        }
    }
    assert!(
        pool.copy_block(g, 2, 7, BS + 1).is_err() && pool.copy_block(g, BLOCKS, 7, 1).is_err(),
        "{what}: copy out of range is an error"
    );
    assert!(
        pool.write_rows(g, 2, &up(&[0.0; 1]), &up(&[0.0; 1]), &g.upload(&[0i32]).unwrap(), 1).is_err(),
        "{what}: no layer 2"
    );

    let n = LENS.len();
    let geo = LatentGeometry { heads, lora, rope, block_size: BS, max_blocks: MAX_BLOCKS };
    let q_lat = uniform(n * heads * lora, 50, -0.3, 0.3);
    let q_rope = uniform((n * heads * rope).max(1), 51, -0.3, 0.3);
    let scale = 1.0 / ((lora + rope) as f32).sqrt() * 4.0;
    let mut want = vec![0.0; n * heads * lora];
    cpu::mla::mla_attention(
        &q_lat,
        &q_rope[..n * heads * rope],
        &cpu_rows.blocks(),
        &TABLES,
        &LENS,
        &geo,
        scale,
        &mut want,
    );
    let (dt, dl) = (g.upload(&TABLES).unwrap(), g.upload(&LENS).unwrap());
    let mut ctx = g.upload(&vec![7.0f32; want.len()]).unwrap();
    pool.attention(g, 1, heads, MAX_BLOCKS, &up(&q_lat), &up(&q_rope), &dt, &dl, scale, &mut ctx).unwrap();
    let got = g.download(&ctx).unwrap();
    assert!(got[2 * heads * lora..3 * heads * lora].iter().all(|&v| v == 0.0), "{what}: an empty sequence gives zeros");
    assert_close(&what, &got, &want, t.gemv);
    assert!(
        pool.attention(g, 1, heads, MAX_BLOCKS, &up(&q_lat[1..]), &up(&q_rope), &dt, &dl, scale, &mut ctx).is_err(),
        "{what}: short q_lat is an error"
    );
}

/// The latent pool in every storage type, with a rotary slice, without one (NoPE), at
/// DeepSeek-V3's widths (lora 512, rope 64), and with more heads than one block takes.
pub fn latent_pool_writes_copies_and_attends_like_cpu<R: Runtime>(g: &Kernels<R>, t: &Tol) {
    for storage in [KvStorage::F32, KvStorage::Bf16, KvStorage::Fp8] {
        pool_case(g, t, storage, 3, 100, 24);
        pool_case(g, t, storage, 2, 40, 0);
        pool_case(g, t, storage, 2, 512, 64);
        // Two blocks of heads per token, the second partial (8 + 3).
        pool_case(g, t, storage, 11, 512, 64);
    }
    // The kernel's shared-memory limits are checked before any launch.
    let (up, dl) = (|x: &[f32]| g.upload(x).unwrap(), g.upload(&[1i32]).unwrap());
    for (lora, rope) in [(1025, 0), (8, 257)] {
        let pool = DeviceLatentPool::new(g, 1, 1, 1, lora, rope, KvStorage::F32).unwrap();
        let mut ctx = g.zeros::<f32>(lora).unwrap();
        let r = pool.attention(
            g,
            0,
            1,
            1,
            &up(&vec![0.0; lora]),
            &up(&vec![0.0; rope]),
            &g.upload(&[0i32]).unwrap(),
            &dl,
            1.0,
            &mut ctx,
        );
        assert!(r.is_err(), "lora {lora} / rope {rope} must be refused");
    }
    assert!(DeviceLatentPool::new(g, 1, 1, 1, 0, 8, KvStorage::F32).is_err(), "a zero-width latent is an error");
}

/// The tensor-core prefill (`mla_flash_prefill_*` through `DeviceLatentPool::prefill_attention`)
/// over the prompt-chunk batch of `PrefillBatch` (a 37-row chunk from position 0, a 10-row chunk
/// after a cached prefix, a decode row that must stay untouched), bf16 and FP8 pools, against
/// `cpu::mla` given the same bf16-rounded scaled queries (the rows are exact on both sides: bf16,
/// or E4M3 codes with their scales): what remains is P's rounding, bounded by `t.mma`.
/// Widths: the tiny DeepSeek fixture's (latent 24, rotary 8: both padded to whole MMA chunks),
/// Kimi's NoPE (16, 0), DeepSeek-V3's (512, 64; 16 heads: 2 rows per tile) and 40 heads (one row,
/// its vectors over two blocks, the second partial).
pub fn mla_flash_prefill_matches_cpu_within_bf16_rounding<R: Runtime>(g: &Kernels<R>, t: &Tol) {
    use kernels::gpu::mla::mla_flash_rows_per_tile;
    use kernels::gpu::prefill::prefill_tiles;
    let b = super::PrefillBatch::new();
    let (n, pool_rows) = (b.n, b.num_blocks * b.bs);
    let (dt, dl) = (g.upload(&b.tables).unwrap(), g.upload(&b.lens).unwrap());
    let up = |x: &[f32]| g.upload(x).unwrap();
    let all_rows: Vec<i32> = (0..pool_rows as i32).collect();
    for (ci, &(heads, lora, rope)) in
        [(4usize, 24usize, 8usize), (4, 16, 0), (16, 512, 64), (40, 64, 16)].iter().enumerate()
    {
        let (c, kr) = latent_rows(pool_rows, lora, rope, 200 + ci as u64);
        let q_lat = uniform(n * heads * lora, 210 + ci as u64, -0.3, 0.3);
        let q_rope = uniform((n * heads * rope).max(1), 220 + ci as u64, -0.3, 0.3);
        let scale = 1.0 / ((lora + rope) as f32).sqrt() * 4.0;
        let round = |x: &[f32]| -> Vec<f32> { x.iter().map(|&v| half::bf16::from_f32(v * scale).to_f32()).collect() };
        let (ql16, qr16) = (round(&q_lat), round(&q_rope));
        let geo = LatentGeometry { heads, lora, rope, block_size: b.bs, max_blocks: b.max_blocks };
        let tiles = prefill_tiles(&b.runs, mla_flash_rows_per_tile(heads));
        let (dtiles, num_tiles) = (g.upload(&tiles).unwrap(), tiles.len() / 2);
        let per_row = heads * lora;
        for storage in [KvStorage::Bf16, KvStorage::Fp8] {
            let what = format!("MLA flash prefill {storage:?} heads={heads} lora={lora} rope={rope}");
            let mut pool = DeviceLatentPool::new(g, 1, b.num_blocks, b.bs, lora, rope, storage).unwrap();
            assert!(pool.has_prefill_kernel(g), "{what}: the tensor-core kernel must take it");
            let dkr = if rope > 0 { up(&kr) } else { g.zeros::<f32>(1).unwrap() };
            pool.write_rows(g, 0, &up(&c), &dkr, &g.upload(&all_rows).unwrap(), pool_rows).unwrap();
            let mut cpu_rows = CpuRows::new(storage, pool_rows, lora, rope);
            cpu_rows.store(&c, &kr, &all_rows, lora, rope);
            let mut want = vec![0.0; n * per_row];
            cpu::mla::mla_attention(
                &ql16,
                &qr16[..n * heads * rope],
                &cpu_rows.blocks(),
                &b.tables,
                &b.lens,
                &geo,
                1.0,
                &mut want,
            );
            let mut ctx = up(&vec![7.0f32; n * per_row]);
            pool.prefill_attention(
                g,
                0,
                heads,
                b.max_blocks,
                &up(&q_lat),
                &up(&q_rope),
                &dt,
                &dl,
                &dtiles,
                num_tiles,
                scale,
                &mut ctx,
            )
            .unwrap();
            b.check(&what, &g.download(&ctx).unwrap(), &want, per_row, t.mma);
        }
    }
    // An f32 pool and widths past the kernel's registers are refused, not launched.
    let (q, tiles) = (g.zeros::<f32>(n * 1024).unwrap(), g.upload(&[0i32, 1]).unwrap());
    for (storage, lora, rope) in [(KvStorage::F32, 64, 16), (KvStorage::Bf16, 1024, 0), (KvStorage::Bf16, 64, 128)] {
        let pool = DeviceLatentPool::new(g, 1, b.num_blocks, b.bs, lora, rope, storage).unwrap();
        assert!(!pool.has_prefill_kernel(g), "{storage:?} {lora}/{rope}");
        let mut ctx = g.zeros::<f32>(n * lora).unwrap();
        assert!(
            pool.prefill_attention(g, 0, 1, b.max_blocks, &q, &q, &dt, &dl, &tiles, 1, 1.0, &mut ctx).is_err(),
            "{storage:?} {lora}/{rope}"
        );
    }
}

/// Long contexts with few query tokens: the attention splits each token's positions over blocks
/// (`mla_splits`) and merges the shares (`mla_combine`). Sequences of 300, 0, 70 and 1 positions
/// in scattered blocks of 16 (4 shares of at most 75: some shares empty), 3 and 11 heads, every
/// storage type, against `cpu::mla`.
pub fn latent_attention_splits_long_contexts<R: Runtime>(g: &Kernels<R>, t: &Tol) {
    let (bs, blocks, lora, rope) = (16usize, 32usize, 512usize, 64usize);
    let lens = [300i32, 0, 70, 1];
    let max_blocks = (lens[0] as usize).div_ceil(bs);
    assert!(kernels::gpu::mla::mla_splits(lens.len(), max_blocks * bs) > 1, "the case must split");
    let mut tables = vec![0i32; lens.len() * max_blocks];
    let mut next = 0;
    for (s, &len) in lens.iter().enumerate() {
        for b in 0..(len as usize).div_ceil(bs) {
            tables[s * max_blocks + b] = (next * 7 % blocks) as i32; // 7 is coprime with 32
            next += 1;
        }
    }
    let slots: Vec<i32> = lens
        .iter()
        .enumerate()
        .flat_map(|(s, &len)| (0..len as usize).map(move |p| (s, p)))
        .map(|(s, p)| tables[s * max_blocks + p / bs] * bs as i32 + (p % bs) as i32)
        .collect();
    let (c, kr) = latent_rows(slots.len(), lora, rope, 120);
    let up = |x: &[f32]| g.upload(x).unwrap();
    for storage in [KvStorage::F32, KvStorage::Bf16, KvStorage::Fp8] {
        let mut pool = DeviceLatentPool::new(g, 1, blocks, bs, lora, rope, storage).unwrap();
        pool.write_rows(g, 0, &up(&c), &up(&kr), &g.upload(&slots).unwrap(), slots.len()).unwrap();
        let mut cpu_rows = CpuRows::new(storage, blocks * bs, lora, rope);
        cpu_rows.store(&c, &kr, &slots, lora, rope);
        for heads in [3usize, 11] {
            let n = lens.len();
            let geo = LatentGeometry { heads, lora, rope, block_size: bs, max_blocks };
            let q_lat = uniform(n * heads * lora, 121, -0.3, 0.3);
            let q_rope = uniform(n * heads * rope, 122, -0.3, 0.3);
            let scale = 1.0 / ((lora + rope) as f32).sqrt() * 4.0;
            let mut want = vec![0.0; n * heads * lora];
            cpu::mla::mla_attention(&q_lat, &q_rope, &cpu_rows.blocks(), &tables, &lens, &geo, scale, &mut want);
            let mut ctx = g.upload(&vec![7.0f32; want.len()]).unwrap();
            pool.attention(
                g,
                0,
                heads,
                max_blocks,
                &up(&q_lat),
                &up(&q_rope),
                &g.upload(&tables).unwrap(),
                &g.upload(&lens).unwrap(),
                scale,
                &mut ctx,
            )
            .unwrap();
            let got = g.download(&ctx).unwrap();
            assert!(got[heads * lora..2 * heads * lora].iter().all(|&v| v == 0.0), "an empty sequence gives zeros");
            // 300-term softmax sums: the kernel's order against the reference's serial one costs
            // up to 1.1e-6 of the largest output with or without splits (measured), so twice the
            // GEMV tolerance. A wrong merge is O(1).
            assert_close(&format!("split latent attention {storage:?} heads={heads}"), &got, &want, 2.0 * t.gemv);
        }
    }
}

/// The absorbed decomposition, on the device as the host composes it (split q with copy_cols,
/// `q_lat = W_ukᵀ q_nope` and `out = W_uv ctx` with head_matvec_bf16, the pool's attention in
/// between), against plain attention in f64 over expanded per-head keys `[W_uk[h] c ; kr]` and
/// values `W_uv[h] c`.
pub fn absorbed_mla_equals_expanded_attention<R: Runtime>(g: &Kernels<R>, t: &Tol) {
    let (heads, nope, rope, v, lora) = (4, 24, 16, 20, 72);
    let qk = nope + rope;
    let n = LENS.len();
    // bf16-exact weights, so the reference uses the same numbers the device reads.
    let w_uk = bf16_bits(&uniform(heads * nope * lora, 60, -0.2, 0.2));
    let w_uv = bf16_bits(&uniform(heads * v * lora, 61, -0.2, 0.2));
    let wf = |b: &[u16]| -> Vec<f64> { b.iter().map(|&x| half::bf16::from_bits(x).to_f64()).collect() };
    let (uk, uv) = (wf(&w_uk), wf(&w_uv));
    // W_uk[h] is [nope][lora]; the folded query needs its transpose per head, [lora][nope].
    let mut uk_t = vec![0u16; w_uk.len()];
    for h in 0..heads {
        for i in 0..nope {
            for l in 0..lora {
                uk_t[(h * lora + l) * nope + i] = w_uk[(h * nope + i) * lora + l];
            }
        }
    }

    let mut pool = DeviceLatentPool::new(g, 1, BLOCKS, BS, lora, rope, KvStorage::F32).unwrap();
    let mut c_all = vec![0f32; BLOCKS * BS * lora];
    let mut kr_all = vec![0f32; BLOCKS * BS * rope];
    let slots: Vec<i32> =
        (0..6).map(|p| pool_row(0, p)).chain((4..13).map(|p| pool_row(1, p))).chain([pool_row(3, 0)]).collect();
    let (c, kr) = latent_rows(slots.len(), lora, rope, 70);
    cpu::kv_write::kv_store_f32(&c, &slots, lora, &mut c_all);
    cpu::kv_write::kv_store_f32(&kr, &slots, rope, &mut kr_all);
    pool.write_rows(g, 0, &g.upload(&c).unwrap(), &g.upload(&kr).unwrap(), &g.upload(&slots).unwrap(), slots.len())
        .unwrap();

    let q = uniform(n * heads * qk, 71, -1.0, 1.0);
    let scale = 1.0 / (qk as f32).sqrt();
    let dq = g.upload(&q).unwrap();
    let (mut q_nope, mut q_rope) =
        (g.zeros::<f32>(n * heads * nope).unwrap(), g.zeros::<f32>(n * heads * rope).unwrap());
    g.copy_cols(&dq, &mut q_nope, n * heads, qk, 0, nope).unwrap();
    g.copy_cols(&dq, &mut q_rope, n * heads, qk, nope, rope).unwrap();
    let mut q_lat = g.zeros::<f32>(n * heads * lora).unwrap();
    g.head_matvec_bf16(&g.upload(&uk_t).unwrap(), &q_nope, &mut q_lat, n, heads, lora, nope).unwrap();
    let mut ctx = g.zeros::<f32>(n * heads * lora).unwrap();
    pool.attention(
        g,
        0,
        heads,
        MAX_BLOCKS,
        &q_lat,
        &q_rope,
        &g.upload(&TABLES).unwrap(),
        &g.upload(&LENS).unwrap(),
        scale,
        &mut ctx,
    )
    .unwrap();
    let mut out = g.zeros::<f32>(n * heads * v).unwrap();
    g.head_matvec_bf16(&g.upload(&w_uv).unwrap(), &ctx, &mut out, n, heads, v, lora).unwrap();

    // Plain attention: expand every cached position per head.
    let mut want = vec![0f32; n * heads * v];
    for (s, &len) in LENS.iter().enumerate() {
        for h in 0..heads {
            let qh = &q[(s * heads + h) * qk..][..qk];
            let mut scores = Vec::new();
            let mut values = Vec::new();
            for p in 0..len as usize {
                let r = pool_row(s, p) as usize;
                let cp = &c_all[r * lora..(r + 1) * lora];
                let expand = |w: &[f64], i: usize| {
                    (0..lora).map(|l| w[(h * (w.len() / heads / lora) + i) * lora + l] * cp[l] as f64).sum::<f64>()
                };
                let k_nope: f64 = (0..nope).map(|i| qh[i] as f64 * expand(&uk, i)).sum();
                let k_rope: f64 = (0..rope).map(|i| qh[nope + i] as f64 * kr_all[r * rope + i] as f64).sum();
                scores.push(scale as f64 * (k_nope + k_rope));
                values.push((0..v).map(|i| expand(&uv, i)).collect::<Vec<f64>>());
            }
            let m = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let e: Vec<f64> = scores.iter().map(|s| (s - m).exp()).collect();
            let total: f64 = e.iter().sum();
            for i in 0..v {
                want[(s * heads + h) * v + i] = (e.iter().zip(&values).map(|(w, val)| w * val[i]).sum::<f64>()
                    / total.max(f64::MIN_POSITIVE)) as f32;
            }
        }
    }
    // Different association (absorbed vs expanded) and f32 vs f64: rounding, not a formula gap.
    assert_close("absorbed MLA vs expanded attention", &g.download(&out).unwrap(), &want, t.gemv.max(1e-5));
}
