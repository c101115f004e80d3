//! GPU figures for bench/gpu-check.sh (needs a CUDA device; exits 2 saying why without one):
//!  * INT4 GEMV achieved DRAM bandwidth as a fraction of the device's theoretical peak;
//!  * decode tok/s of a SmolLM2-135M-shaped forward step (30 layers: norms, QKV/O/gate-up/down
//!    projections, RoPE, paged attention over a 512-token context, SwiGLU, bf16 LM head on cuBLAS)
//!    at 1 and 64 streams, with bf16 (cuBLAS) or INT4 (int4_gemv) projection weights;
//!  * prefill: INT4 matmuls of 1536x576 (SmolLM2's MLP shape) and 4096x4096 over 8..512 tokens,
//!    GEMV path vs dequant + cuBLAS bf16 GEMM path (`Kernels::quant_gemv` / `quant_gemm`), tok/s,
//!    the ratio, and the smallest batch where the GEMM path wins (where `GEMM_MIN_TOKENS` belongs);
//!    the same for Cubic 4-bit and MXFP4 at 4096x4096;
//!  * routed-expert prefill: 16 INT4 experts of DeepSeek-V3's gate_up shape (4096x7168), tokens
//!    spread evenly over them, `Kernels::moe_matmul` with GEMV tiles only vs the plan that sends
//!    experts with more than `GEMM_MIN_TOKENS` tokens to dequant + cuBLAS;
//!  * MLA decode attention at DeepSeek-V3's shape (128 heads, latent 512 + rotary 64, bf16 latent
//!    cache, 4096-token context) for 1 and 64 tokens: time per layer and the latent cache's
//!    bytes per second against the peak (each token's rows are read once per group of 8 heads);
//!  * prefill attention of a 2048-token prompt at SmolLM2's shape (9 heads over 3 KV heads of 64,
//!    bf16 K/V): the decode kernel run per row vs the prefill kernel's tiles, side by side.
//!
//! Weights are random: these are kernel-throughput figures with the real model's shapes.

use std::time::Instant;

use kernels::cpu::attention::PagedGeometry;
use kernels::cuda::launch::{CudaRuntime, CudaSlice, DevGrouped, Gpu};
use kernels::cuda::nvrtc::PtxCache;
use kernels::gpu::{ExpertWeight, GemmScratch, QuantWeight, GEMM_MIN_TOKENS};

const HIDDEN: usize = 576;
const HEADS: usize = 9;
const KV_HEADS: usize = 3;
const HEAD_DIM: usize = 64;
const INTER: usize = 1536;
const LAYERS: usize = 30;
const VOCAB: usize = 49152;
const CONTEXT: usize = 512;
const BLOCK: usize = 16;
const GROUP: usize = 64;

fn lcg(seed: u64) -> impl FnMut() -> u32 {
    let mut s = seed;
    move || {
        s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (s >> 33) as u32
    }
}
fn rand_f32(n: usize, seed: u64, scale: f32) -> Vec<f32> {
    let mut r = lcg(seed);
    (0..n).map(|_| ((r() % 20001) as f32 / 10000.0 - 1.0) * scale).collect()
}
fn rand_bf16(n: usize, seed: u64, scale: f32) -> Vec<u16> {
    rand_f32(n, seed, scale).iter().map(|&x| half::bf16::from_f32(x).to_bits()).collect()
}

fn int4(g: &Gpu, rows: usize, cols: usize, seed: u64) -> DevGrouped {
    let stride = cols / 2;
    let mut r = lcg(seed);
    let bytes: Vec<u8> = (0..rows * stride).map(|_| r() as u8).collect();
    let groups = rows * cols.div_ceil(GROUP);
    let scale = rand_f32(groups, seed + 1, 0.01);
    let zero = vec![8.0f32; groups];
    g.upload_grouped(g.upload_packed(4, rows, cols, stride, &bytes).unwrap(), GROUP, &scale, &zero).unwrap()
}

enum Proj {
    Bf16 { w: CudaSlice<u16>, rows: usize, cols: usize },
    Int4(DevGrouped),
}

impl Proj {
    fn new(g: &Gpu, int4_weights: bool, rows: usize, cols: usize, seed: u64) -> Self {
        if int4_weights {
            Proj::Int4(int4(g, rows, cols, seed))
        } else {
            Proj::Bf16 { w: g.upload(&rand_bf16(rows * cols, seed, 0.05)).unwrap(), rows, cols }
        }
    }
    /// x (f32) -> out; the bf16 path narrows x first, as a bf16 model does.
    fn run(&self, g: &Gpu, x: &CudaSlice<f32>, xb: &mut CudaSlice<u16>, out: &mut CudaSlice<f32>, n: usize) {
        match self {
            Proj::Int4(w) => g.int_gemv(w, x, out, n).unwrap(),
            Proj::Bf16 { w, rows, cols } => {
                // A real bf16 engine keeps activations in bf16; the narrowing copy is omitted
                // from the step (xb already holds bf16 activations of the right size).
                let _ = x;
                g.gemm_bf16(xb, w, out, n, *cols, *rows).unwrap()
            }
        }
    }
}

fn decode_tok_s(g: &Gpu, int4_weights: bool, n: usize) -> f64 {
    let qkv_rows = (HEADS + 2 * KV_HEADS) * HEAD_DIM;
    let layers: Vec<[Proj; 4]> = (0..LAYERS as u64)
        .map(|l| {
            [
                Proj::new(g, int4_weights, qkv_rows, HIDDEN, l * 10),
                Proj::new(g, int4_weights, HIDDEN, HEADS * HEAD_DIM, l * 10 + 1),
                Proj::new(g, int4_weights, 2 * INTER, HIDDEN, l * 10 + 2),
                Proj::new(g, int4_weights, HIDDEN, INTER, l * 10 + 3),
            ]
        })
        .collect();
    let lm_head = g.upload(&rand_bf16(VOCAB * HIDDEN, 99, 0.05)).unwrap();
    let norm_w = g.upload(&vec![1.0f32; HIDDEN]).unwrap();
    let inv_freq: Vec<f32> =
        (0..HEAD_DIM / 2).map(|i| 1.0f32 / 100000f32.powf((2 * i) as f32 / HEAD_DIM as f32)).collect();
    let inv_freq = g.upload(&inv_freq).unwrap();
    // The paged pool: each stream owns CONTEXT/BLOCK blocks (bf16 K/V, one layer's pool reused).
    let blocks_per_seq = CONTEXT / BLOCK;
    let geo = PagedGeometry {
        heads: HEADS,
        kv_heads: KV_HEADS,
        head_dim: HEAD_DIM,
        block_size: BLOCK,
        max_blocks: blocks_per_seq,
    };
    let pool = n * blocks_per_seq * BLOCK * KV_HEADS * HEAD_DIM;
    let k = g.upload(&rand_bf16(pool, 5, 1.0)).unwrap();
    let v = g.upload(&rand_bf16(pool, 6, 1.0)).unwrap();
    let tables: Vec<i32> = (0..(n * blocks_per_seq) as i32).collect();
    let tables = g.upload(&tables).unwrap();
    let lens = g.upload(&vec![CONTEXT as i32; n]).unwrap();
    let positions = g.upload(&vec![CONTEXT as i32; n]).unwrap();

    let mut x = g.upload(&rand_f32(n * HIDDEN, 7, 1.0)).unwrap();
    let mut h = g.zeros::<f32>(n * HIDDEN).unwrap();
    let mut hb = g.upload(&rand_bf16(n * INTER, 8, 1.0)).unwrap();
    let mut qkv = g.zeros::<f32>(n * qkv_rows).unwrap();
    let mut attn = g.zeros::<f32>(n * HEADS * HEAD_DIM).unwrap();
    let mut o = g.zeros::<f32>(n * HIDDEN).unwrap();
    let mut gu = g.zeros::<f32>(n * 2 * INTER).unwrap();
    let mut act = g.zeros::<f32>(n * INTER).unwrap();
    let mut logits = g.zeros::<f32>(n * VOCAB).unwrap();
    let mut probs = g.zeros::<f32>(n * VOCAB).unwrap();
    let u = g.upload(&vec![0.5f32; n]).unwrap();
    let mut toks = g.zeros::<i32>(n).unwrap();

    let mut step = |g: &Gpu| {
        for [wqkv, wo, wgu, wd] in &layers {
            g.rms_norm(&x, &norm_w, &mut h, n, 1e-5).unwrap();
            wqkv.run(g, &h, &mut hb, &mut qkv, n);
            // RoPE over the packed q|k|v rows (q and k heads rotate; v's share is a cost stand-in).
            g.rope(&mut qkv, &positions, &inv_freq, n, HEADS + 2 * KV_HEADS, HEAD_DIM).unwrap();
            g.paged_attention_bf16(&geo, &qkv, &k, &v, &tables, &lens, 0.125, &mut attn).unwrap();
            wo.run(g, &attn, &mut hb, &mut o, n);
            g.add_rms_norm(&mut x, &o, &norm_w, &mut h, n, 1e-5).unwrap();
            wgu.run(g, &h, &mut hb, &mut gu, n);
            g.silu_mul(&gu, &mut act, n, INTER).unwrap();
            wd.run(g, &act, &mut hb, &mut o, n);
        }
        g.rms_norm(&x, &norm_w, &mut h, n, 1e-5).unwrap();
        g.gemm_bf16(&hb, &lm_head, &mut logits, n, HIDDEN, VOCAB).unwrap();
        g.sample(&logits, &mut probs, &u, &mut toks, VOCAB, 0.8, 50, 0.95).unwrap();
    };
    for _ in 0..3 {
        step(g);
    }
    g.synchronize().unwrap();
    let steps = 20;
    let t = Instant::now();
    for _ in 0..steps {
        step(g);
    }
    g.synchronize().unwrap();
    (steps * n) as f64 / t.elapsed().as_secs_f64()
}

fn int4_bandwidth(g: &Gpu) -> (f64, f64) {
    let (rows, cols) = (8192, 8192);
    let w = int4(g, rows, cols, 1);
    let x = g.upload(&rand_f32(cols, 2, 1.0)).unwrap();
    let mut out = g.zeros::<f32>(rows).unwrap();
    for _ in 0..10 {
        g.int_gemv(&w, &x, &mut out, 1).unwrap();
    }
    g.synchronize().unwrap();
    let iters = 200;
    let t = Instant::now();
    for _ in 0..iters {
        g.int_gemv(&w, &x, &mut out, 1).unwrap();
    }
    g.synchronize().unwrap();
    let secs = t.elapsed().as_secs_f64() / iters as f64;
    let bytes = rows * cols / 2 + rows * (cols / GROUP) * 8 + cols * 4 + rows * 4;
    let achieved = bytes as f64 / secs;
    (achieved, achieved / g.info.peak_bandwidth)
}

/// Seconds per call of `f` (after warm-up), timed over enough calls to pass ~50 ms.
fn time_per_call(g: &Gpu, mut f: impl FnMut()) -> f64 {
    for _ in 0..3 {
        f();
    }
    g.synchronize().unwrap();
    let mut iters = 1usize;
    loop {
        let t = Instant::now();
        for _ in 0..iters {
            f();
        }
        g.synchronize().unwrap();
        let secs = t.elapsed().as_secs_f64();
        if secs > 0.05 || iters >= 1 << 14 {
            return secs / iters as f64;
        }
        iters *= 4;
    }
}

/// Tok/s of the GEMV path and of the dequant + bf16 GEMM path for `n` tokens through `w`.
fn prefill_tok_s(
    g: &Gpu,
    w: QuantWeight<'_, CudaRuntime>,
    scratch: &mut GemmScratch<CudaRuntime>,
    n: usize,
) -> (f64, f64) {
    let (rows, cols) = (w.rows(), w.cols());
    let x = g.upload(&rand_f32(n * cols, 3, 1.0)).unwrap();
    let mut out = g.zeros::<f32>(n * rows).unwrap();
    let gemv = time_per_call(g, || g.quant_gemv(w, &x, &mut out, n).unwrap());
    let gemm = time_per_call(g, || g.quant_gemm(w, &x, &mut out, n, scratch).unwrap());
    (n as f64 / gemv, n as f64 / gemm)
}

/// Prints GEMV vs dequant+cuBLAS tok/s for each batch and the smallest batch where the GEMM wins.
fn crossover(g: &Gpu, what: &str, w: QuantWeight<'_, CudaRuntime>, batches: &[usize]) {
    let max_n = batches.iter().copied().max().unwrap_or(1);
    let mut scratch = g.gemm_scratch(w.rows() * w.cols(), max_n * w.cols()).unwrap();
    let mut first_win = None;
    for &n in batches {
        let (gemv, gemm) = prefill_tok_s(g, w, &mut scratch, n);
        if gemm > gemv && first_win.is_none() {
            first_win = Some(n);
        }
        println!(
            "prefill {what} n={n}: GEMV {gemv:.0} tok/s, dequant+cuBLAS {gemm:.0} tok/s, ratio {:.2}x",
            gemm / gemv
        );
    }
    match first_win {
        Some(n) => println!("prefill {what}: the GEMM path first wins at n={n} (GEMM_MIN_TOKENS is {GEMM_MIN_TOKENS})"),
        None => println!("prefill {what}: the GEMV path wins up to n={max_n} (GEMM_MIN_TOKENS is {GEMM_MIN_TOKENS})"),
    }
}

fn prefill_report(g: &Gpu) {
    let batches = [8usize, 16, 32, 64, 128, 256, 512];
    for (rows, cols) in [(1536usize, 576usize), (4096, 4096)] {
        let w = int4(g, rows, cols, 11);
        crossover(g, &format!("INT4 {rows}x{cols} g{GROUP}"), QuantWeight::Int(&w), &batches);
    }
    // The other formats at the large shape: their GEMVs decode differently (Cubic looks levels up
    // in shared memory, MXFP4 in a constant table), so their crossover may sit elsewhere.
    let (rows, cols) = (4096usize, 4096usize);
    let mut r = lcg(21);
    let bytes: Vec<u8> = (0..rows * cols / 2).map(|_| r() as u8).collect();
    let groups = rows * cols / GROUP;
    let cubic = g
        .upload_grouped(
            g.upload_packed(4, rows, cols, cols / 2, &bytes).unwrap(),
            GROUP,
            &rand_f32(groups, 22, 0.02),
            &rand_f32(groups, 23, 0.5),
        )
        .unwrap();
    crossover(g, &format!("Cubic4 {rows}x{cols} g{GROUP}"), QuantWeight::Cubic(&cubic), &[16, 32, 64, 512]);
    let scales: Vec<u8> = (0..rows * cols / 32).map(|_| 118 + (r() % 8) as u8).collect();
    let mx = g.upload_mxfp4(rows, cols, &bytes, &scales).unwrap();
    crossover(g, &format!("MXFP4 {rows}x{cols}"), QuantWeight::Mxfp4(&mx), &[16, 32, 64, 512]);
}

/// Routed-expert prefill through one expert-stacked INT4 weight: tok/s of the GEMV tiles alone
/// and of the plan that multiplies crowded experts with dequant + cuBLAS, side by side.
fn moe_prefill_report(g: &Gpu) {
    let (experts, rows, cols) = (16usize, 4096usize, 7168usize);
    let w = int4(g, experts * rows, cols, 31);
    let weight = ExpertWeight::Quant(QuantWeight::Int(&w));
    let max_n = 4096;
    let x = g.upload(&rand_f32(max_n * cols, 32, 1.0)).unwrap();
    let mut out = g.zeros::<f32>(max_n * rows).unwrap();
    let mut scratch = g.gemm_scratch(rows * cols, max_n * cols).unwrap();
    for n in [512usize, 1024, 2048, 4096] {
        // Token i to expert i % 16 (one expert per token: the rank's share of a top-k routing).
        let local: Vec<i32> = (0..n).map(|i| (i % experts) as i32).collect();
        let (offsets, order) = g.moe_group(&g.upload(&local).unwrap(), experts + 1).unwrap();
        let mut tok_s = [0.0f64; 2];
        for (i, gemm) in [false, true].into_iter().enumerate() {
            let plan = g.moe_plan(&offsets, experts, n, n, gemm).unwrap();
            let secs = time_per_call(g, || {
                g.moe_matmul(weight, rows, &x, 1, &order, &plan, &mut out, n, &mut scratch).unwrap()
            });
            tok_s[i] = n as f64 / secs;
        }
        println!("MoE prefill INT4 experts {experts}x{rows}x{cols} g{GROUP} n={n} ({} tokens per expert): GEMV tiles {:.0} tok/s, GEMM plan {:.0} tok/s, ratio {:.2}x", n / experts, tok_s[0], tok_s[1], tok_s[1] / tok_s[0]);
    }
}

/// MLA decode attention over a bf16 latent cache at DeepSeek-V3's widths.
fn mla_report(g: &Gpu) {
    use kernels::gpu::kv_pool::KvStorage;
    use kernels::gpu::DeviceLatentPool;
    let (heads, lora, rope, context, block) = (128usize, 512usize, 64usize, 4096usize, 16usize);
    let per_seq = context / block;
    for n in [1usize, 64] {
        let pool = DeviceLatentPool::new(g, 1, n * per_seq, block, lora, rope, KvStorage::Bf16).unwrap();
        // Each token its own sequence of `context` positions in its own blocks.
        let tables: Vec<i32> = (0..(n * per_seq) as i32).collect();
        let (tables, lens) = (g.upload(&tables).unwrap(), g.upload(&vec![context as i32; n]).unwrap());
        let q_lat = g.upload(&rand_f32(n * heads * lora, 41, 0.1)).unwrap();
        let q_rope = g.upload(&rand_f32(n * heads * rope, 42, 0.1)).unwrap();
        let mut ctx = g.zeros::<f32>(n * heads * lora).unwrap();
        let secs = time_per_call(g, || {
            pool.attention(g, 0, heads, per_seq, &q_lat, &q_rope, &tables, &lens, 0.07, &mut ctx).unwrap()
        });
        let bytes = (n * context * (lora + rope) * 2) as f64;
        println!("MLA decode attention ({heads} heads, latent {lora}+{rope} bf16, context {context}), {n} token(s): {:.1} us per layer, latent cache {:.0} GB/s = {:.1}% of peak", secs * 1e6, bytes / secs / 1e9, bytes / secs / g.info.peak_bandwidth * 100.0);
    }
}

/// MLA prompt attention, one 1024-token chunk of one sequence at DeepSeek-V3's widths (128
/// heads, latent 512 + rotary 64, bf16 latent cache): every row by the decode kernel (what the
/// forward runs without the prefill kernel) and the tensor-core `mla_flash_prefill_bf16`, with
/// its achieved rate in causal-attention FLOPs.
fn mla_prefill_report(g: &Gpu) {
    use kernels::gpu::kv_pool::KvStorage;
    use kernels::gpu::mla::mla_flash_rows_per_tile;
    use kernels::gpu::prefill::prefill_tiles;
    use kernels::gpu::DeviceLatentPool;
    let (heads, lora, rope, n, block) = (128usize, 512usize, 64usize, 1024usize, 16usize);
    let max_blocks = n / block;
    let mut pool = DeviceLatentPool::new(g, 1, max_blocks, block, lora, rope, KvStorage::Bf16).unwrap();
    let slots: Vec<i32> = (0..n as i32).collect();
    let (c, kr) = (g.upload(&rand_f32(n * lora, 61, 1.0)).unwrap(), g.upload(&rand_f32(n * rope, 62, 1.0)).unwrap());
    pool.write_rows(g, 0, &c, &kr, &g.upload(&slots).unwrap(), n).unwrap();
    let tables: Vec<i32> = (0..n).flat_map(|_| 0..max_blocks as i32).collect();
    let lens: Vec<i32> = (1..=n as i32).collect();
    let (tables, lens) = (g.upload(&tables).unwrap(), g.upload(&lens).unwrap());
    let q_lat = g.upload(&rand_f32(n * heads * lora, 63, 0.1)).unwrap();
    let q_rope = g.upload(&rand_f32(n * heads * rope, 64, 0.1)).unwrap();
    let mut ctx = g.zeros::<f32>(n * heads * lora).unwrap();
    let per_row = time_per_call(g, || {
        pool.attention(g, 0, heads, max_blocks, &q_lat, &q_rope, &tables, &lens, 0.07, &mut ctx).unwrap()
    });
    let what = format!("MLA prefill attention ({heads} heads, latent {lora}+{rope} bf16), one {n}-token chunk");
    if !pool.has_prefill_kernel(g) {
        println!(
            "{what}: decode kernel per row {:.0} us per layer; tensor-core prefill kernel: not on this GPU",
            per_row * 1e6
        );
        return;
    }
    let tiles = prefill_tiles(&[(0, n)], mla_flash_rows_per_tile(heads));
    let (num_tiles, tiles) = (tiles.len() / 2, g.upload(&tiles).unwrap());
    let flash = time_per_call(g, || {
        pool.prefill_attention(
            g, 0, heads, max_blocks, &q_lat, &q_rope, &tables, &lens, &tiles, num_tiles, 0.07, &mut ctx,
        )
        .unwrap()
    });
    // Causal: n(n+1)/2 (query, key) pairs per head, 2 FLOPs per multiply-add of Q·K and P·V.
    let flops = (heads * n * (n + 1) / 2 * 2 * (lora + rope + lora)) as f64;
    println!("{what}: decode kernel per row {:.0} us, tensor-core prefill kernel {:.0} us per layer, ratio {:.2}x; {:.1} TFLOP/s", per_row * 1e6, flash * 1e6, per_row / flash, flops / flash / 1e12);
}

/// Prompt attention, one 2048-token chunk of one sequence: every row by the decode kernel (what
/// the forward did before the prefill kernels), by the CUDA-core prefill kernel's tiles, and by
/// the tensor-core one's (what the forward runs for a bf16 cache on sm_80+).
fn prefill_attention_report(g: &Gpu) {
    use kernels::gpu::kv_pool::KvStorage;
    use kernels::gpu::prefill::{prefill_tiles, PrefillKernel};
    use kernels::gpu::Runtime;
    let (n, block) = (2048usize, BLOCK);
    let max_blocks = n / block;
    let geo = PagedGeometry { heads: HEADS, kv_heads: KV_HEADS, head_dim: HEAD_DIM, block_size: block, max_blocks };
    let (k, v) = (
        g.upload(&rand_bf16(n * KV_HEADS * HEAD_DIM, 52, 1.0)).unwrap(),
        g.upload(&rand_bf16(n * KV_HEADS * HEAD_DIM, 53, 1.0)).unwrap(),
    );
    // Row r reads blocks 0..=r / block of the sequence's table (0, 1, 2, ...).
    let tables: Vec<i32> = (0..n).flat_map(|_| 0..max_blocks as i32).collect();
    let lens: Vec<i32> = (1..=n as i32).collect();
    let (tables, lens) = (g.upload(&tables).unwrap(), g.upload(&lens).unwrap());
    let q = g.upload(&rand_f32(n * HEADS * HEAD_DIM, 51, 0.5)).unwrap();
    let mut out = g.zeros::<f32>(n * HEADS * HEAD_DIM).unwrap();
    let scale = 1.0 / (HEAD_DIM as f32).sqrt();
    let plan = |kernel: PrefillKernel| {
        let tiles = prefill_tiles(&[(0, n)], kernel.rows_per_tile(HEADS / KV_HEADS));
        (tiles.len() / 2, g.upload(&tiles).unwrap())
    };
    let per_row =
        time_per_call(g, || g.paged_attention_bf16(&geo, &q, &k, &v, &tables, &lens, scale, &mut out).unwrap());
    let (num_tiles, tiles) = plan(PrefillKernel::CudaCores);
    let cuda_cores = time_per_call(g, || {
        g.paged_prefill_bf16(&geo, &q, &k, &v, &tables, &lens, &tiles, num_tiles, scale, &mut out).unwrap()
    });
    println!("prefill attention ({HEADS} heads / {KV_HEADS} KV heads of {HEAD_DIM}, bf16 K/V), one {n}-token chunk: decode kernel per row {:.0} us, CUDA-core prefill kernel {:.0} us per layer, ratio {:.2}x", per_row * 1e6, cuda_cores * 1e6, per_row / cuda_cores);
    if PrefillKernel::choose(KvStorage::Bf16, HEAD_DIM, g.bf16_mma()) == PrefillKernel::TensorCores {
        let (num_tiles, tiles) = plan(PrefillKernel::TensorCores);
        let tensor_cores = time_per_call(g, || {
            g.paged_flash_prefill_bf16(&geo, &q, &k, &v, &tables, &lens, &tiles, num_tiles, scale, &mut out).unwrap()
        });
        println!(
            "  tensor-core prefill kernel {:.0} us per layer: {:.2}x the CUDA-core kernel, {:.2}x the decode kernel",
            tensor_cores * 1e6,
            cuda_cores / tensor_cores,
            per_row / tensor_cores
        );
    } else {
        println!("  tensor-core prefill kernel: not on {} (needs sm_80+)", g.describe());
    }
}

fn main() {
    let g = match Gpu::open(0, &PtxCache::new(PtxCache::default_dir())) {
        Ok(g) => g,
        Err(e) => {
            eprintln!("gpu_bench: no usable CUDA device: {e}");
            std::process::exit(2);
        }
    };
    println!(
        "device: {} ({}), peak DRAM bandwidth {:.0} GB/s",
        g.info.name,
        g.info.arch(),
        g.info.peak_bandwidth / 1e9
    );
    let (bw, frac) = int4_bandwidth(&g);
    println!("int4_gemv 8192x8192 g{GROUP} n=1: {:.0} GB/s = {:.1}% of peak", bw / 1e9, frac * 100.0);
    for int4_weights in [false, true] {
        for n in [1usize, 64] {
            let tps = decode_tok_s(&g, int4_weights, n);
            println!(
                "SmolLM2-135M-shaped decode ({}), {n} stream(s): {tps:.0} tok/s",
                if int4_weights { "INT4 int4_gemv" } else { "bf16 cuBLAS" }
            );
        }
    }
    prefill_report(&g);
    moe_prefill_report(&g);
    mla_report(&g);
    prefill_attention_report(&g);
    mla_prefill_report(&g);
}
