//! Every CUDA kernel against its CPU reference in `kernels::cpu`, on random inputs, written once over
//! any [`Runtime`] and run on two: the CPU simulator (`sim::`, the real `.cu` sources compiled for
//! the host: always runs) and a CUDA device (`cuda::`).
//!
//! Without a GPU each `cuda::` test prints `SKIPPED ...: <reason>` and passes, unless
//! `WASMSERVE_REQUIRE_GPU=1` (bench/gpu-check.sh sets it), where a missing GPU fails. Likewise the
//! `sim::` tests skip when no C++ compiler built the simulator, unless `WASMSERVE_REQUIRE_SIM=1` (CI).

use kernels::cpu;
use kernels::cpu::attention::{KvBlocks, PagedGeometry};
use kernels::cpu::bitpack::PackedRows;
use kernels::gpu::{Kernels, Runtime};
use kernels::sim::SimGpu;

mod k3_checks;
mod kda_checks;
mod mla_checks;
mod moe_checks;
mod prefill_gemm;
mod test_data;

use k3_checks::*;
use kda_checks::*;
use mla_checks::*;
use moe_checks::*;
use test_data::{codes, uniform};

fn required(var: &str) -> bool {
    std::env::var_os(var).is_some_and(|v| v == "1")
}

fn sim(test: &str) -> Option<SimGpu> {
    match SimGpu::sim() {
        Ok(g) => Some(g),
        Err(e) if required("WASMSERVE_REQUIRE_SIM") => panic!("{test}: {e}"),
        Err(e) => {
            eprintln!("SKIPPED {test}: {e}");
            None
        }
    }
}

#[cfg(feature = "cuda")]
fn gpu(test: &str) -> Option<&'static kernels::cuda::launch::Gpu> {
    use kernels::cuda::launch::Gpu;
    use kernels::cuda::nvrtc::PtxCache;
    static GPU: std::sync::OnceLock<Result<Gpu, String>> = std::sync::OnceLock::new();
    match GPU.get_or_init(|| Gpu::open(0, &PtxCache::new(PtxCache::default_dir())).map_err(|e| e.to_string())) {
        Ok(g) => Some(g),
        Err(e) if required("WASMSERVE_REQUIRE_GPU") => panic!("{test}: {e}"),
        Err(e) => {
            eprintln!("SKIPPED {test}: no usable CUDA device: {e}");
            None
        }
    }
}

/// What each runtime must meet. Summation orders differ from the CPU references (warp trees vs
/// serial loops), so GEMV-like results match to rounding, not bit for bit; the simulator computes
/// in the same IEEE f32 with the same libm as the references, so it is held closer.
struct Tol {
    /// GEMV, attention, GEMM: max error relative to the largest reference magnitude.
    gemv: f32,
    /// Tensor-core attention against a reference given the same bf16 operands: P's rounding to
    /// bf16 for P·V and the summation order.
    mma: f32,
    /// RoPE: the simulator calls the references' sincosf; CUDA's differs in the last ulps.
    rope: f32,
    /// Sampled tokens that match neither the CPU reference's draw nor an f64-accurate one.
    unexplained_draws: usize,
}
const SIM_TOL: Tol = Tol { gemv: 1e-6, mma: 4e-3, rope: 0.0, unexplained_draws: 0 };
#[cfg(feature = "cuda")]
const CUDA_TOL: Tol = Tol { gemv: 1e-5, mma: 4e-3, rope: 2e-6, unexplained_draws: 1 };

/// One `#[test]` per check and runtime: `sim::<check>` and `cuda::<check>`.
macro_rules! on_every_runtime {
    ($($check:ident),* $(,)?) => {
        mod sim {
            $(#[test]
            fn $check() {
                if let Some(g) = super::sim(concat!("sim::", stringify!($check))) {
                    super::$check(&g, &super::SIM_TOL)
                }
            })*
        }
        #[cfg(feature = "cuda")]
        mod cuda {
            $(#[test]
            fn $check() {
                if let Some(g) = super::gpu(concat!("cuda::", stringify!($check))) {
                    super::$check(g, &super::CUDA_TOL)
                }
            })*
        }
    };
}

on_every_runtime!(
    int_gemv_matches_cpu_for_every_width_and_batch,
    cubic_gemv_matches_cpu,
    mxfp4_gemv_matches_cpu,
    norms_rope_and_swiglu_match_cpu,
    paged_attention_matches_cpu_for_f32_bf16_and_fp8,
    paged_prefill_matches_cpu_for_every_storage_and_group,
    paged_flash_prefill_matches_cpu_within_bf16_rounding,
    sampling_draws_the_same_tokens_as_cpu,
    moe_grouping_and_expert_gemv_match_cpu,
    cublas_bf16_gemm_matches_cpu,
    device_kv_pool_writes_and_attends_like_the_cpu_reference,
    dequant_kernels_match_cpu_bit_for_bit,
    matmul_quant_matches_cpu_on_both_sides_of_the_threshold,
    gathers_and_bf16_narrowing_match_cpu,
    kv_batch_writes_and_block_copies_match_cpu,
    moe_routing_matches_route_token_bit_for_bit,
    moe_tiles_match_cpu_for_skewed_routing,
    moe_gemv_matches_cpu_for_every_format,
    moe_matmul_multiplies_crowded_experts_with_the_gemm,
    moe_combine_matches_cpu,
    moe_layer_end_to_end_matches_per_token_cpu,
    mla_pieces_match_cpu,
    kv_stores_match_cpu_bit_for_bit,
    latent_pool_writes_copies_and_attends_like_cpu,
    latent_attention_splits_long_contexts,
    mla_flash_prefill_matches_cpu_within_bf16_rounding,
    absorbed_mla_equals_expanded_attention,
    kda_conv_matches_cpu,
    kda_recurrent_matches_cpu_for_both_gates_and_head_dims,
    kda_slot_copy_zero_and_pool_work,
    attn_res_mix_and_situ_match_cpu,
);

/// Relative max error of `got` against `want`, scaled by the largest reference magnitude.
fn assert_close(what: &str, got: &[f32], want: &[f32], tol: f32) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    let scale = want.iter().fold(1e-6f32, |m, v| m.max(v.abs()));
    let worst = kernels::compare::max_abs_error(got, want) / scale;
    eprintln!("{what}: max error {worst:.2e} of max |ref| {scale:.3}");
    assert!(worst <= tol, "{what}: max relative error {worst} > {tol}");
}

/// `cpu::sample::sample_top_k_top_p` with every mass summed in f64 (the top-k count is exact).
fn f64_draw(logits: &[f32], temperature: f32, top_k: usize, top_p: f32, u: f32) -> usize {
    let p = cpu::sample::unnormalised_probs(logits, temperature);
    let mass = |t: f32| p.iter().filter(|&&x| x >= t).map(|&x| x as f64).sum::<f64>();
    let mut tau = cpu::sample::threshold(&p, top_k, 1.0);
    if top_p < 1.0 {
        let total = mass(tau);
        let (mut lo, mut hi) = (tau.to_bits(), 0x7f80_0000u32);
        while lo < hi {
            let mid = lo + (hi - lo).div_ceil(2);
            if mass(f32::from_bits(mid)) >= top_p as f64 * total {
                lo = mid
            } else {
                hi = mid - 1
            }
        }
        tau = f32::from_bits(lo);
    }
    let target = u as f64 * mass(tau);
    let mut run = 0.0f64;
    let mut last = 0;
    for (i, &x) in p.iter().enumerate().filter(|(_, &x)| x >= tau) {
        run += x as f64;
        last = i;
        if run > target {
            return i;
        }
    }
    last
}

fn packed_rows(codes: &[u8], bits: u32, rows: usize, cols: usize) -> (PackedRows, Vec<u8>, usize) {
    let p = PackedRows::from_codes(bits, rows, cols, codes);
    // Pad rows to whole int32 words, as compressed-tensors stores them (exercises the fast path).
    let dense = cpu::bitpack::row_bytes(cols, bits);
    let stride = dense.div_ceil(4) * 4;
    let mut bytes = vec![0u8; rows * stride];
    for r in 0..rows {
        bytes[r * stride..r * stride + dense]
            .copy_from_slice(&cpu::bitpack::pack_row(&codes[r * cols..(r + 1) * cols], bits));
    }
    let _ = p;
    (PackedRows::new(bits, rows, cols, stride, &bytes), bytes, stride)
}

fn int_gemv_matches_cpu_for_every_width_and_batch<R: Runtime>(g: &Kernels<R>, t: &Tol) {
    for &(bits, rows, cols, gs) in
        &[(4u32, 129usize, 512usize, 128usize), (4, 64, 384, 32), (8, 33, 256, 64), (3, 17, 200, 200), (2, 9, 96, 32)]
    {
        let c = codes(rows * cols, bits, bits as u64 * 31 + cols as u64);
        let groups = rows * cols.div_ceil(gs);
        let scale: Vec<f32> =
            uniform(groups, 5, 1e-3, 2e-2).into_iter().map(|s| half::bf16::from_f32(s).to_f32()).collect();
        let zero: Vec<f32> = codes(groups, bits, 6).into_iter().map(|z| z as f32).collect();
        let (rows_cpu, bytes, stride) = packed_rows(&c, bits, rows, cols);
        let w = cpu::quant_int::IntMatrix::new(rows_cpu, gs, &scale, &zero);
        let dw =
            g.upload_grouped(g.upload_packed(bits, rows, cols, stride, &bytes).unwrap(), gs, &scale, &zero).unwrap();
        for n in [1usize, 3, 8, 17] {
            let x = uniform(n * cols, n as u64, -1.0, 1.0);
            let mut want = vec![0.0; n * rows];
            w.matmul_t(&x, &mut want, n);
            let dx = g.upload(&x).unwrap();
            let mut dout = g.zeros::<f32>(n * rows).unwrap();
            g.int_gemv(&dw, &dx, &mut dout, n).unwrap();
            assert_close(
                &format!("int{bits} gemv {rows}x{cols} g{gs} n={n}"),
                &g.download(&dout).unwrap(),
                &want,
                t.gemv,
            );
        }
    }
}

fn cubic_gemv_matches_cpu<R: Runtime>(g: &Kernels<R>, t: &Tol) {
    for bits in [2u32, 3, 4, 8] {
        let (rows, cols, gs) = (37, 544, 32);
        let c = codes(rows * cols, bits, bits as u64);
        let groups = rows * cols / gs;
        let s: Vec<f32> = uniform(groups, 7, -0.02, 0.02);
        let a: Vec<f32> = uniform(groups, 8, 0.0, 1.0);
        let (rows_cpu, bytes, stride) = packed_rows(&c, bits, rows, cols);
        let w = cpu::cubic::AnyCubic::new(rows_cpu, gs, &s, &a);
        let dw = g.upload_grouped(g.upload_packed(bits, rows, cols, stride, &bytes).unwrap(), gs, &s, &a).unwrap();
        for n in [1usize, 9] {
            let x = uniform(n * cols, 11, -1.0, 1.0);
            let mut want = vec![0.0; n * rows];
            w.matmul_t(&x, &mut want, n);
            let (dx, mut dout) = (g.upload(&x).unwrap(), g.zeros::<f32>(n * rows).unwrap());
            g.cubic_gemv(&dw, &dx, &mut dout, n).unwrap();
            assert_close(&format!("cubic{bits} gemv n={n}"), &g.download(&dout).unwrap(), &want, t.gemv);
        }
    }
}

fn mxfp4_gemv_matches_cpu<R: Runtime>(g: &Kernels<R>, t: &Tol) {
    let (rows, cols) = (70, 640);
    let packed = codes(rows * cols / 2, 8, 3);
    let scales: Vec<u8> = codes(rows * cols / 32, 3, 4).into_iter().map(|e| 118 + e).collect();
    let w = cpu::mxfp4::Mxfp4Matrix::new(rows, cols, &packed, &scales);
    let dw = g.upload_mxfp4(rows, cols, &packed, &scales).unwrap();
    for n in [1usize, 5, 12] {
        let x = uniform(n * cols, 12, -1.0, 1.0);
        let mut want = vec![0.0; n * rows];
        w.matmul_t(&x, &mut want, n);
        let (dx, mut dout) = (g.upload(&x).unwrap(), g.zeros::<f32>(n * rows).unwrap());
        g.mxfp4_gemv(&dw, &dx, &mut dout, n).unwrap();
        assert_close(&format!("mxfp4 gemv n={n}"), &g.download(&dout).unwrap(), &want, t.gemv);
    }
}

fn norms_rope_and_swiglu_match_cpu<R: Runtime>(g: &Kernels<R>, t: &Tol) {
    let (rows, d) = (5, 576);
    let x = uniform(rows * d, 1, -3.0, 3.0);
    let w = uniform(d, 2, 0.5, 1.5);
    let mut want = vec![0.0; rows * d];
    cpu::norm::rms_norm(&x, &w, 1e-5, &mut want);
    let (dx, dw) = (g.upload(&x).unwrap(), g.upload(&w).unwrap());
    let mut dy = g.zeros::<f32>(rows * d).unwrap();
    g.rms_norm(&dx, &dw, &mut dy, rows, 1e-5).unwrap();
    assert_close("rms_norm", &g.download(&dy).unwrap(), &want, 1e-6);

    let delta = uniform(rows * d, 3, -1.0, 1.0);
    let mut xr = x.clone();
    cpu::norm::add_rms_norm(&mut xr, &delta, &w, 1e-5, &mut want);
    let (mut dx2, ddelta) = (g.upload(&x).unwrap(), g.upload(&delta).unwrap());
    g.add_rms_norm(&mut dx2, &ddelta, &dw, &mut dy, rows, 1e-5).unwrap();
    assert_close("add_rms_norm (out)", &g.download(&dy).unwrap(), &want, 1e-6);
    assert_close("add_rms_norm (residual)", &g.download(&dx2).unwrap(), &xr, 0.0);

    let (tokens, heads, hd) = (4, 3, 64);
    let rope = cpu::rope::Rope::new(hd, 10000.0);
    let positions = [0i32, 1, 17, 4095];
    let q = uniform(tokens * heads * hd, 4, -1.0, 1.0);
    let mut want = q.clone();
    for (t, &p) in positions.iter().enumerate() {
        rope.apply(&mut want[t * heads * hd..(t + 1) * heads * hd], hd, p as usize);
    }
    let inv: Vec<f32> = (0..hd / 2).map(|i| 1.0f32 / 10000f32.powf((2 * i) as f32 / hd as f32)).collect();
    let (mut dq, dp, di) = (g.upload(&q).unwrap(), g.upload(&positions).unwrap(), g.upload(&inv).unwrap());
    g.rope(&mut dq, &dp, &di, tokens, heads, hd).unwrap();
    // sin/cos of large angles differ in the last ulps between libm and CUDA's sincosf.
    assert_close("rope", &g.download(&dq).unwrap(), &want, t.rope);

    let (t, dd) = (3, 1536);
    let gu = uniform(t * 2 * dd, 5, -6.0, 6.0);
    let mut want = vec![0.0; t * dd];
    for i in 0..t {
        cpu::activation::silu_mul(
            &gu[i * 2 * dd..i * 2 * dd + dd],
            &gu[i * 2 * dd + dd..(i + 1) * 2 * dd],
            &mut want[i * dd..(i + 1) * dd],
        );
    }
    let (dgu, mut dout) = (g.upload(&gu).unwrap(), g.zeros::<f32>(t * dd).unwrap());
    g.silu_mul(&dgu, &mut dout, t, dd).unwrap();
    assert_close("silu_mul", &g.download(&dout).unwrap(), &want, 1e-6);
}

fn paged_attention_matches_cpu_for_f32_bf16_and_fp8<R: Runtime>(g: &Kernels<R>, t: &Tol) {
    let geo = PagedGeometry { heads: 8, kv_heads: 2, head_dim: 64, block_size: 16, max_blocks: 8 };
    let num_blocks = 20;
    let width = geo.kv_heads * geo.head_dim;
    let pool_rows = num_blocks * geo.block_size;
    let lens = [1i32, 16, 17, 100, 0];
    // Scattered, non-contiguous block tables (what a fragmented pool hands out).
    let mut tables = vec![0i32; lens.len() * geo.max_blocks];
    let mut next = 19i32;
    for (s, &len) in lens.iter().enumerate() {
        for b in 0..(len as usize).div_ceil(geo.block_size) {
            tables[s * geo.max_blocks + b] = next;
            next = (next + 7) % num_blocks as i32;
        }
    }
    let q = uniform(lens.len() * geo.heads * geo.head_dim, 1, -1.0, 1.0);
    let k = uniform(pool_rows * width, 2, -2.0, 2.0);
    let v = uniform(pool_rows * width, 3, -2.0, 2.0);
    let scale = 1.0 / (geo.head_dim as f32).sqrt();
    let n_out = q.len();
    let (dq, dt, dl) = (g.upload(&q).unwrap(), g.upload(&tables).unwrap(), g.upload(&lens).unwrap());
    let mut dout = g.zeros::<f32>(n_out).unwrap();
    let mut want = vec![0.0; n_out];

    cpu::attention::paged_attention_decode(&q, &KvBlocks::F32 { k: &k, v: &v }, &tables, &lens, &geo, scale, &mut want);
    g.paged_attention_f32(&geo, &dq, &g.upload(&k).unwrap(), &g.upload(&v).unwrap(), &dt, &dl, scale, &mut dout)
        .unwrap();
    assert_close("paged attention f32", &g.download(&dout).unwrap(), &want, t.gemv);

    let (kb, vb) = (bf16_rows(&k), bf16_rows(&v));
    cpu::attention::paged_attention_decode(
        &q,
        &KvBlocks::Bf16 { k: &kb, v: &vb },
        &tables,
        &lens,
        &geo,
        scale,
        &mut want,
    );
    g.paged_attention_bf16(&geo, &dq, &g.upload(&kb).unwrap(), &g.upload(&vb).unwrap(), &dt, &dl, scale, &mut dout)
        .unwrap();
    assert_close("paged attention bf16", &g.download(&dout).unwrap(), &want, t.gemv);

    // FP8 with one scale per (row, kv head), as the pool stores it.
    let ((kc, ks), (vc, vs)) = (fp8_rows(&k, geo.head_dim), fp8_rows(&v, geo.head_dim));
    cpu::attention::paged_attention_decode(
        &q,
        &KvBlocks::Fp8 { k: &kc, v: &vc, k_scales: &ks, v_scales: &vs },
        &tables,
        &lens,
        &geo,
        scale,
        &mut want,
    );
    let (dkc, dvc, dks, dvs) =
        (g.upload(&kc).unwrap(), g.upload(&vc).unwrap(), g.upload(&ks).unwrap(), g.upload(&vs).unwrap());
    g.paged_attention_fp8(&geo, &dq, &dkc, &dvc, &dks, &dvs, &dt, &dl, scale, &mut dout).unwrap();
    assert_close("paged attention fp8", &g.download(&dout).unwrap(), &want, t.gemv);
}

/// K/V rows as the pool stores them in FP8: E4M3 codes and one scale per `head_dim` chunk
/// (per row and kv head).
fn fp8_rows(x: &[f32], head_dim: usize) -> (Vec<u8>, Vec<f32>) {
    let mut codes = vec![0u8; x.len()];
    let scales = x
        .chunks(head_dim)
        .enumerate()
        .map(|(i, ch)| cpu::fp8::quantize_e4m3(ch, &mut codes[i * head_dim..(i + 1) * head_dim]))
        .collect();
    (codes, scales)
}

fn bf16_rows(x: &[f32]) -> Vec<u16> {
    x.iter().map(|&f| half::bf16::from_f32(f).to_bits()).collect()
}

/// A batch of prompt chunks for the prefill kernels: sequence A prefilled from position 0 (37
/// rows: several stages of staged keys), a decode row of C (not in a tile: must stay untouched),
/// B's chunk after a cached prefix (positions 20..=29), scattered blocks of 4.
struct PrefillBatch {
    bs: usize,
    num_blocks: usize,
    max_blocks: usize,
    runs: [(usize, usize); 2],
    n: usize,
    tables: Vec<i32>,
    lens: Vec<i32>,
}

impl PrefillBatch {
    fn new() -> Self {
        let (bs, num_blocks, max_blocks) = (4usize, 32usize, 10usize);
        // Each sequence's blocks scattered over the pool (a stride coprime with 32).
        let table = |s: usize, blocks: usize| -> Vec<i32> {
            (0..blocks).map(|b| ((s * 10 + b) * 13 % num_blocks) as i32).collect()
        };
        let seq_tables = [table(0, 10), table(1, 8), table(2, 9)];
        // (sequence, position) per batch row; runs (0, 37) and (38, 10); row 37 is a decode row.
        let rows: Vec<(usize, usize)> =
            (0..37).map(|p| (0, p)).chain([(2, 33)]).chain((20..30).map(|p| (1, p))).collect();
        let n = rows.len();
        let mut tables = vec![0i32; n * max_blocks];
        for (i, &(s, p)) in rows.iter().enumerate() {
            tables[i * max_blocks..i * max_blocks + p / bs + 1].copy_from_slice(&seq_tables[s][..p / bs + 1]);
        }
        let lens = rows.iter().map(|&(_, p)| p as i32 + 1).collect();
        Self { bs, num_blocks, max_blocks, runs: [(0, 37), (38, 10)], n, tables, lens }
    }

    fn in_tiles(&self, i: usize) -> bool {
        self.runs.iter().any(|&(f, c)| (f..f + c).contains(&i))
    }

    /// Checks `got` (the kernel's output over a buffer of 7.0s) against `want` on the tile rows
    /// and that no other row was written.
    fn check(&self, what: &str, got: &[f32], want: &[f32], per_row: usize, tol: f32) {
        for i in (0..self.n).filter(|&i| !self.in_tiles(i)) {
            assert!(
                got[i * per_row..(i + 1) * per_row].iter().all(|&x| x == 7.0),
                "{what}: row {i} is in no tile but was written"
            );
        }
        let pick = |x: &[f32]| -> Vec<f32> {
            (0..self.n).filter(|&i| self.in_tiles(i)).flat_map(|i| x[i * per_row..(i + 1) * per_row].to_vec()).collect()
        };
        assert_close(what, &pick(got), &pick(want), tol);
    }
}

/// The CUDA-core prefill kernel over [`PrefillBatch`] against the decode reference per row
/// (len = pos + 1). GQA groups of 3 (5 rows per tile, the last tile partial), 1 (16 rows), 8 (2
/// rows) and 20 (1 row, two blocks of vectors), head widths 40, 64, 32, 16 and 256; every
/// storage type.
fn paged_prefill_matches_cpu_for_every_storage_and_group<R: Runtime>(g: &Kernels<R>, t: &Tol) {
    use kernels::gpu::prefill::{prefill_tiles, rows_per_tile};
    let b = PrefillBatch::new();
    let (n, (dt, dl)) = (b.n, (g.upload(&b.tables).unwrap(), g.upload(&b.lens).unwrap()));
    for (gi, &(heads, kv_heads, head_dim)) in
        [(6usize, 2usize, 40usize), (4, 4, 64), (16, 2, 32), (40, 2, 16), (2, 1, 256)].iter().enumerate()
    {
        let geo = PagedGeometry { heads, kv_heads, head_dim, block_size: b.bs, max_blocks: b.max_blocks };
        let (pool_rows, width) = (b.num_blocks * b.bs, kv_heads * head_dim);
        let q = uniform(n * heads * head_dim, 30 + gi as u64, -1.0, 1.0);
        let k = uniform(pool_rows * width, 40 + gi as u64, -2.0, 2.0);
        let v = uniform(pool_rows * width, 50 + gi as u64, -2.0, 2.0);
        let scale = 1.0 / (head_dim as f32).sqrt();
        let tiles = prefill_tiles(&b.runs, rows_per_tile(heads / kv_heads));
        let (dq, dtiles, num_tiles) = (g.upload(&q).unwrap(), g.upload(&tiles).unwrap(), tiles.len() / 2);
        let per_row = heads * head_dim;
        let mut want = vec![0.0; n * per_row];
        let fresh = || g.upload(&vec![7.0f32; n * per_row]).unwrap();
        cpu::attention::paged_attention_decode(
            &q,
            &KvBlocks::F32 { k: &k, v: &v },
            &b.tables,
            &b.lens,
            &geo,
            scale,
            &mut want,
        );
        let mut out = fresh();
        g.paged_prefill_f32(
            &geo,
            &dq,
            &g.upload(&k).unwrap(),
            &g.upload(&v).unwrap(),
            &dt,
            &dl,
            &dtiles,
            num_tiles,
            scale,
            &mut out,
        )
        .unwrap();
        b.check(
            &format!("prefill f32 {heads}/{kv_heads}x{head_dim}"),
            &g.download(&out).unwrap(),
            &want,
            per_row,
            t.gemv,
        );
        if gi > 0 {
            continue;
        }
        let (kb, vb) = (bf16_rows(&k), bf16_rows(&v));
        cpu::attention::paged_attention_decode(
            &q,
            &KvBlocks::Bf16 { k: &kb, v: &vb },
            &b.tables,
            &b.lens,
            &geo,
            scale,
            &mut want,
        );
        let mut out = fresh();
        g.paged_prefill_bf16(
            &geo,
            &dq,
            &g.upload(&kb).unwrap(),
            &g.upload(&vb).unwrap(),
            &dt,
            &dl,
            &dtiles,
            num_tiles,
            scale,
            &mut out,
        )
        .unwrap();
        b.check("prefill bf16", &g.download(&out).unwrap(), &want, per_row, t.gemv);
        let ((kc, ks), (vc, vs)) = (fp8_rows(&k, head_dim), fp8_rows(&v, head_dim));
        cpu::attention::paged_attention_decode(
            &q,
            &KvBlocks::Fp8 { k: &kc, v: &vc, k_scales: &ks, v_scales: &vs },
            &b.tables,
            &b.lens,
            &geo,
            scale,
            &mut want,
        );
        let mut out = fresh();
        let (dkc, dvc, dks, dvs) =
            (g.upload(&kc).unwrap(), g.upload(&vc).unwrap(), g.upload(&ks).unwrap(), g.upload(&vs).unwrap());
        g.paged_prefill_fp8(&geo, &dq, &dkc, &dvc, &dks, &dvs, &dt, &dl, &dtiles, num_tiles, scale, &mut out).unwrap();
        b.check("prefill fp8", &g.download(&out).unwrap(), &want, per_row, t.gemv);
        // Fewer tile entries than tiles is an error before any launch.
        assert!(g
            .paged_prefill_f32(
                &geo,
                &dq,
                &g.upload(&k).unwrap(),
                &g.upload(&v).unwrap(),
                &dt,
                &dl,
                &dtiles,
                num_tiles + 1,
                scale,
                &mut out
            )
            .is_err());
    }
}

/// The tensor-core prefill kernel over [`PrefillBatch`], bf16 and FP8 caches, against the decode
/// reference per row given the same bf16-rounded (and pre-scaled) queries the kernel multiplies
/// (the cache rows are exact on both sides: bf16, or E4M3 codes with their scales): what remains
/// is the rounding of P to bf16 for the P·V product (and the tensor core's summation order),
/// bounded by `t.mma`. A fragment-layout mistake (a wrong row, column or
/// half-word) is an O(1) error. GQA groups of 1 (64 rows per tile: one partial tile per run), 3
/// (21 rows), 8 (8 rows) and 80 (one row, vectors over two blocks); head widths 64, 32, 128, 16.
/// Head widths the kernel cannot take are refused before any launch.
fn paged_flash_prefill_matches_cpu_within_bf16_rounding<R: Runtime>(g: &Kernels<R>, t: &Tol) {
    use kernels::gpu::prefill::{prefill_tiles, PrefillKernel};
    let b = PrefillBatch::new();
    let (n, (dt, dl)) = (b.n, (g.upload(&b.tables).unwrap(), g.upload(&b.lens).unwrap()));
    for (gi, &(heads, kv_heads, head_dim)) in
        [(4usize, 4usize, 64usize), (9, 3, 32), (16, 2, 128), (80, 1, 16)].iter().enumerate()
    {
        let geo = PagedGeometry { heads, kv_heads, head_dim, block_size: b.bs, max_blocks: b.max_blocks };
        let (pool_rows, width) = (b.num_blocks * b.bs, kv_heads * head_dim);
        let q = uniform(n * heads * head_dim, 60 + gi as u64, -1.0, 1.0);
        let k = uniform(pool_rows * width, 70 + gi as u64, -2.0, 2.0);
        let v = uniform(pool_rows * width, 80 + gi as u64, -2.0, 2.0);
        let scale = 1.0 / (head_dim as f32).sqrt();
        let q_bf16: Vec<f32> = q.iter().map(|&x| half::bf16::from_f32(x * scale).to_f32()).collect();
        let tiles = prefill_tiles(&b.runs, PrefillKernel::TensorCores.rows_per_tile(heads / kv_heads));
        let (dq, dtiles, num_tiles) = (g.upload(&q).unwrap(), g.upload(&tiles).unwrap(), tiles.len() / 2);
        let per_row = heads * head_dim;
        let mut want = vec![0.0; n * per_row];
        let fresh = || g.upload(&vec![7.0f32; n * per_row]).unwrap();
        let (kb, vb) = (bf16_rows(&k), bf16_rows(&v));
        cpu::attention::paged_attention_decode(
            &q_bf16,
            &KvBlocks::Bf16 { k: &kb, v: &vb },
            &b.tables,
            &b.lens,
            &geo,
            1.0,
            &mut want,
        );
        let mut out = fresh();
        g.paged_flash_prefill_bf16(
            &geo,
            &dq,
            &g.upload(&kb).unwrap(),
            &g.upload(&vb).unwrap(),
            &dt,
            &dl,
            &dtiles,
            num_tiles,
            scale,
            &mut out,
        )
        .unwrap();
        b.check(
            &format!("flash prefill bf16 {heads}/{kv_heads}x{head_dim}"),
            &g.download(&out).unwrap(),
            &want,
            per_row,
            t.mma,
        );
        // FP8: the kernel multiplies the E4M3 codes (exact in bf16) and applies the row scales to
        // the scores and to P, so the reference reads the FP8 rows as they are.
        let ((kc, ks), (vc, vs)) = (fp8_rows(&k, head_dim), fp8_rows(&v, head_dim));
        cpu::attention::paged_attention_decode(
            &q_bf16,
            &KvBlocks::Fp8 { k: &kc, v: &vc, k_scales: &ks, v_scales: &vs },
            &b.tables,
            &b.lens,
            &geo,
            1.0,
            &mut want,
        );
        let mut out = fresh();
        let (dkc, dvc, dks, dvs) =
            (g.upload(&kc).unwrap(), g.upload(&vc).unwrap(), g.upload(&ks).unwrap(), g.upload(&vs).unwrap());
        g.paged_flash_prefill_fp8(&geo, &dq, &dkc, &dvc, &dks, &dvs, &dt, &dl, &dtiles, num_tiles, scale, &mut out)
            .unwrap();
        b.check(
            &format!("flash prefill fp8 {heads}/{kv_heads}x{head_dim}"),
            &g.download(&out).unwrap(),
            &want,
            per_row,
            t.mma,
        );
    }
    // A head width off the MMA tiles is refused, not launched.
    let geo = PagedGeometry { heads: 2, kv_heads: 1, head_dim: 40, block_size: b.bs, max_blocks: b.max_blocks };
    let (q, kv) = (g.zeros::<f32>(n * 80).unwrap(), g.zeros::<u16>(b.num_blocks * b.bs * 40).unwrap());
    let tiles = g.upload(&[0, 1]).unwrap();
    let err = g
        .paged_flash_prefill_bf16(&geo, &q, &kv, &kv, &dt, &dl, &tiles, 1, 1.0, &mut g.zeros::<f32>(n * 80).unwrap())
        .unwrap_err();
    assert!(err.to_string().contains("head_dim 40"), "{err}");
}

fn sampling_draws_the_same_tokens_as_cpu<R: Runtime>(g: &Kernels<R>, t: &Tol) {
    let (seqs, vocab) = (16, 49152);
    // Distinct logits on a coarse grid plus a spread: no near-ties at the thresholds.
    let logits = uniform(seqs * vocab, 9, -8.0, 8.0);
    let u = uniform(seqs, 10, 0.0, 0.999);
    let dl = g.upload(&logits).unwrap();
    let du = g.upload(&u).unwrap();
    let mut probs = g.zeros::<f32>(seqs * vocab).unwrap();
    let mut out = g.zeros::<i32>(seqs).unwrap();
    for &(temp, k, p) in &[(1.0f32, 50usize, 1.0f32), (0.7, 0, 0.9), (1.0, 40, 0.8), (1.3, 1, 1.0)] {
        g.sample(&dl, &mut probs, &du, &mut out, vocab, temp, k, p).unwrap();
        let got = g.download(&out).unwrap();
        let want: Vec<i32> = (0..seqs)
            .map(|s| cpu::sample::sample_top_k_top_p(&logits[s * vocab..(s + 1) * vocab], temp, k, p, u[s]) as i32)
            .collect();
        let agree = got.iter().zip(&want).filter(|(a, b)| a == b).count();
        // The CPU reference sums 49k probabilities serially in f32; the kernel sums chunk totals,
        // which is more accurate, so a draw near a token boundary may differ. Such a draw must then
        // be what an f64-accurate sampler picks.
        let unexplained: Vec<usize> = (0..seqs)
            .filter(|&s| {
                got[s] != want[s] && got[s] as usize != f64_draw(&logits[s * vocab..(s + 1) * vocab], temp, k, p, u[s])
            })
            .collect();
        eprintln!("sampling T={temp} k={k} p={p}: {agree}/{seqs} identical draws, {} explained by f32 rounding of the reference", seqs - agree - unexplained.len());
        assert!(
            unexplained.len() <= t.unexplained_draws,
            "T={temp} k={k} p={p}: sequences {unexplained:?} differ: device {got:?} cpu {want:?}"
        );
    }
}

fn cublas_bf16_gemm_matches_cpu<R: Runtime>(g: &Kernels<R>, t: &Tol) {
    let (n, kk, m) = (19, 576, 130);
    let bf = |v: Vec<f32>| -> Vec<u16> { v.iter().map(|&x| half::bf16::from_f32(x).to_bits()).collect() };
    let (x, w) = (bf(uniform(n * kk, 1, -1.0, 1.0)), bf(uniform(m * kk, 2, -0.2, 0.2)));
    let f = |b: &[u16]| -> Vec<f32> { b.iter().map(|&u| half::bf16::from_bits(u).to_f32()).collect() };
    let (xf, wf) = (f(&x), f(&w));
    let want: Vec<f32> = (0..n * m).map(|i| (0..kk).map(|j| xf[i / m * kk + j] * wf[i % m * kk + j]).sum()).collect();
    let mut dout = g.zeros::<f32>(n * m).unwrap();
    let (dx, dw) = (g.upload(&x).unwrap(), g.upload(&w).unwrap());
    g.gemm_bf16(&dx, &dw, &mut dout, n, kk, m).unwrap();
    assert_close("bf16 gemm", &g.download(&dout).unwrap(), &want, t.gemv);
    // Rows 40..90 of the weight in place (one expert of a stacked weight).
    let rows = 40..90;
    let want: Vec<f32> = (0..n).flat_map(|i| want[i * m..(i + 1) * m][rows.clone()].to_vec()).collect();
    let mut dout = g.zeros::<f32>(n * rows.len()).unwrap();
    g.gemm_bf16_rows(&dx, &dw, rows.clone(), &mut dout, n, kk).unwrap();
    assert_close("bf16 gemm, rows 40..90", &g.download(&dout).unwrap(), &want, t.gemv);
    assert!(g.gemm_bf16_rows(&dx, &dw, 100..131, &mut dout, n, kk).is_err(), "rows past the weight are an error");
}

fn device_kv_pool_writes_and_attends_like_the_cpu_reference<R: Runtime>(g: &Kernels<R>, t: &Tol) {
    use kernels::gpu::kv_pool::{DeviceKvPool, KvStorage};
    let (heads, kvh, hd, bs, blocks, max_blocks) = (4, 2, 32, 8, 6, 3);
    let w = kvh * hd;
    let lens = [5i32, 20];
    let tables = [4i32, 0, 0, 1, 5, 2];
    let q = uniform(lens.len() * heads * hd, 1, -1.0, 1.0);
    let geo = PagedGeometry { heads, kv_heads: kvh, head_dim: hd, block_size: bs, max_blocks };
    for storage in [KvStorage::F32, KvStorage::Bf16, KvStorage::Fp8] {
        let mut pool = DeviceKvPool::new(g, 2, blocks, bs, kvh, hd, storage).unwrap();
        let rows = blocks * bs;
        let (mut kf, mut vf) = (vec![0f32; rows * w], vec![0f32; rows * w]);
        for (s, &len) in lens.iter().enumerate() {
            for p in 0..len as usize {
                let (b, slot) = (tables[s * max_blocks + p / bs] as usize, p % bs);
                let k = uniform(w, (s * 100 + p) as u64, -2.0, 2.0);
                let v = uniform(w, (s * 100 + p) as u64 + 7, -2.0, 2.0);
                pool.write(g, 1, b, slot, &k, &v).unwrap();
                let row = b * bs + slot;
                kf[row * w..(row + 1) * w].copy_from_slice(&k);
                vf[row * w..(row + 1) * w].copy_from_slice(&v);
            }
        }
        assert!(pool.write(g, 1, blocks, 0, &kf[..w], &vf[..w]).is_err(), "block out of range is an error");
        let mut want = vec![0.0; q.len()];
        match storage {
            KvStorage::F32 => cpu::attention::paged_attention_decode(
                &q,
                &KvBlocks::F32 { k: &kf, v: &vf },
                &tables,
                &lens,
                &geo,
                0.2,
                &mut want,
            ),
            KvStorage::Bf16 => cpu::attention::paged_attention_decode(
                &q,
                &KvBlocks::Bf16 { k: &bf16_rows(&kf), v: &bf16_rows(&vf) },
                &tables,
                &lens,
                &geo,
                0.2,
                &mut want,
            ),
            KvStorage::Fp8 => {
                let ((kc, ks), (vc, vs)) = (fp8_rows(&kf, hd), fp8_rows(&vf, hd));
                cpu::attention::paged_attention_decode(
                    &q,
                    &KvBlocks::Fp8 { k: &kc, v: &vc, k_scales: &ks, v_scales: &vs },
                    &tables,
                    &lens,
                    &geo,
                    0.2,
                    &mut want,
                )
            }
        }
        let (dq, dt, dl) = (g.upload(&q).unwrap(), g.upload(&tables).unwrap(), g.upload(&lens).unwrap());
        let mut dout = g.zeros::<f32>(q.len()).unwrap();
        pool.attention(g, 1, heads, max_blocks, &dq, &dt, &dl, 0.2, &mut dout).unwrap();
        assert_close(&format!("device KV pool {storage:?}"), &g.download(&dout).unwrap(), &want, t.gemv);
    }
}

/// The prefill GEMM path (tests/prefill_gemm): the dequant kernels exactly, on every runtime.
fn dequant_kernels_match_cpu_bit_for_bit<R: Runtime>(g: &Kernels<R>, _t: &Tol) {
    prefill_gemm::dequant_matches_cpu_bit_for_bit(g);
}

/// `matmul_quant` below the threshold (GEMV, held to the runtime's GEMV tolerance) and above it
/// (dequant + bf16 GEMM, held to the bf16 bound, which is the same on every runtime).
fn matmul_quant_matches_cpu_on_both_sides_of_the_threshold<R: Runtime>(g: &Kernels<R>, t: &Tol) {
    prefill_gemm::matmul_quant_matches_cpu(g, t.gemv);
}

fn gathers_and_bf16_narrowing_match_cpu<R: Runtime>(g: &Kernels<R>, _t: &Tol) {
    let (rows, d, n) = (37, 48, 9);
    let table = uniform(rows * d, 3, -3.0, 3.0);
    let ids: Vec<i32> = (0..n).map(|i| (i * 11 % rows) as i32).collect();
    let mut want = vec![0.0; n * d];
    cpu::gather::gather_rows(&table, &ids, d, &mut want);
    let (dt, di) = (g.upload(&table).unwrap(), g.upload(&ids).unwrap());
    let mut out = g.zeros::<f32>(n * d).unwrap();
    g.gather_rows_f32(&dt, &di, &mut out, n, d).unwrap();
    assert_eq!(g.download(&out).unwrap(), want, "gather_rows_f32 is a copy");
    // Ties and NaN-free random values: round to nearest even, bit for bit.
    let narrow = cpu::gather::narrow_bf16(&table);
    let mut db = g.zeros::<u16>(table.len()).unwrap();
    g.narrow_bf16(&dt, &mut db, table.len()).unwrap();
    assert_eq!(g.download(&db).unwrap(), narrow, "narrow_bf16");
    cpu::gather::gather_rows_bf16(&narrow, &ids, d, &mut want);
    g.gather_rows_bf16(&db, &di, &mut out, n, d).unwrap();
    assert_eq!(g.download(&out).unwrap(), want, "gather_rows_bf16 widens exactly");
    assert!(g.gather_rows_f32(&dt, &di, &mut out, n + 1, d).is_err(), "too few ids is an error");
}

fn kv_batch_writes_and_block_copies_match_cpu<R: Runtime>(g: &Kernels<R>, _t: &Tol) {
    let (kvh, hd, bs, blocks, n) = (2, 32, 4, 5, 7);
    let w = kvh * hd;
    let rows = blocks * bs;
    // Values spanning magnitudes per head, so FP8 scales differ per (row, head).
    let k: Vec<f32> =
        uniform(n * w, 11, -1.0, 1.0).iter().enumerate().map(|(i, v)| v * (1 + i / hd % 5) as f32).collect();
    let v = uniform(n * w, 12, -4.0, 4.0);
    let slots: Vec<i32> = [17, 2, 3, 8, 0, 19, 9].to_vec();
    let (dk, dv, ds) = (g.upload(&k).unwrap(), g.upload(&v).unwrap(), g.upload(&slots).unwrap());
    let (mut kc, mut vc) = (vec![0f32; rows * w], vec![0f32; rows * w]);
    cpu::kv_write::kv_write_f32(&k, &v, &slots, w, &mut kc, &mut vc);
    let (mut gk, mut gv) = (g.zeros::<f32>(rows * w).unwrap(), g.zeros::<f32>(rows * w).unwrap());
    g.kv_write_f32(&dk, &dv, &ds, &mut gk, &mut gv, n, w).unwrap();
    assert_eq!((g.download(&gk).unwrap(), g.download(&gv).unwrap()), (kc.clone(), vc.clone()), "kv_write_f32");
    // Copy block 4's first 3 slots into block 1 (copy-on-write), both sides.
    kc.copy_within(4 * bs * w..(4 * bs + 3) * w, bs * w);
    g.copy_span_f32(&mut gk, 4 * bs * w, bs * w, 3 * w).unwrap();
    assert_eq!(g.download(&gk).unwrap(), kc, "copy_span_f32");
    assert!(g.copy_span_f32(&mut gk, 0, 2, 4).is_err(), "overlapping spans are refused");

    let (mut kb, mut vb) = (vec![0u16; rows * w], vec![0u16; rows * w]);
    cpu::kv_write::kv_write_bf16(&k, &v, &slots, w, &mut kb, &mut vb);
    let (mut gkb, mut gvb) = (g.zeros::<u16>(rows * w).unwrap(), g.zeros::<u16>(rows * w).unwrap());
    g.kv_write_bf16(&dk, &dv, &ds, &mut gkb, &mut gvb, n, w).unwrap();
    assert_eq!((g.download(&gkb).unwrap(), g.download(&gvb).unwrap()), (kb, vb), "kv_write_bf16");

    let (mut k8, mut v8, mut ks, mut vs) =
        (vec![0u8; rows * w], vec![0u8; rows * w], vec![0f32; rows * kvh], vec![0f32; rows * kvh]);
    cpu::kv_write::kv_write_fp8(&k, &v, &slots, kvh, hd, &mut k8, &mut v8, &mut ks, &mut vs);
    let (mut gk8, mut gv8) = (g.zeros::<u8>(rows * w).unwrap(), g.zeros::<u8>(rows * w).unwrap());
    let (mut gks, mut gvs) = (g.zeros::<f32>(rows * kvh).unwrap(), g.zeros::<f32>(rows * kvh).unwrap());
    g.kv_write_fp8(&dk, &dv, &ds, &mut gk8, &mut gv8, &mut gks, &mut gvs, n, kvh, hd).unwrap();
    // Same amax, same division, same nearest-code search: identical codes and scales.
    assert_eq!((g.download(&gks).unwrap(), g.download(&gvs).unwrap()), (ks, vs), "kv_write_fp8 scales");
    assert_eq!((g.download(&gk8).unwrap(), g.download(&gv8).unwrap()), (k8, v8), "kv_write_fp8 codes");
    assert!(g.kv_write_f32(&dk, &dv, &ds, &mut gk, &mut gv, n + 1, w).is_err(), "more rows than slots is an error");
}
