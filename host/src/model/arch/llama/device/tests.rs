//! `DeviceLlama` against `LlamaModel::forward` on the CPU: a tiny random Llama (2 layers, GQA,
//! tied and untied head, dense and packed-quantized projections), mixed prefill + decode
//! batches over several sequences through a paged pool with scattered block ids, a
//! copy-on-write fork, f32/bf16/FP8 K/V. Generic over the runtime: the reference runtime here
//! (CPU kernels), and the simulator (`.cu` sources) where it is available.

use kernels::cpu::bitpack::PackedRows;
use kernels::cpu::cubic::AnyCubic;
use kernels::cpu::mxfp4::Mxfp4Matrix;
use kernels::cpu::quant_int::IntMatrix;
use kernels::cpu::rope::Rope;
use kernels::gpu::kv_pool::KvStorage;
use kernels::gpu::{Kernels, Runtime};

use crate::model::arch::llama::device::DeviceLlama;
use crate::model::arch::llama::{Layer, LlamaModel, TpRank};
use crate::model::config::ModelConfig;
use crate::model::device::ref_runtime::RefRuntime;
use crate::model::device::step::BlockTables;
use crate::model::device::test_util::{self, ids};
use crate::model::device::weights::DenseWeights;
use crate::model::format::quant::IntLinear;
use crate::model::kv::{BatchRow, BlockCopy, ContiguousKvCache, KvCache};
use crate::model::layers::linear::Linear;
use crate::model::tensor::Tensor;
use crate::model::{DeviceKv as _, LanguageModel};
use crate::parallel::device_collective::LocalDeviceGroup;

const D: usize = 64;
const HEADS: usize = 4;
const KV_HEADS: usize = 2;
const HD: usize = 16;
const INTER: usize = 96;
const VOCAB: usize = 80;
const LAYERS: usize = 2;
const BS: usize = 4;
const BLOCKS: usize = 40;

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u32 {
        self.0 = self.0.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (self.0 >> 33) as u32
    }
    /// Uniform in [-a, a), rounded to bf16 so dense weights are exact on both sides.
    fn vals(&mut self, n: usize, a: f32) -> Vec<f32> {
        (0..n)
            .map(|_| half::bf16::from_f32((self.next() as f32 / (1u64 << 31) as f32 - 0.5) * 2.0 * a).to_f32())
            .collect()
    }
}

fn cfg(tied: bool) -> ModelConfig {
    let raw = serde_json::json!({
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": D, "intermediate_size": INTER,
        "num_hidden_layers": LAYERS, "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS, "vocab_size": VOCAB,
        "rms_norm_eps": 1e-5, "max_position_embeddings": 256, "rope_theta": 10000.0, "tie_word_embeddings": tied
    });
    ModelConfig::from_hf_config(std::path::Path::new("config.json"), &raw).unwrap()
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Weights {
    Dense,
    /// q/k/v/o INT4 (g32), gate/up Cubic 3-bit (g32), down MXFP4.
    Packed,
}

fn dense(r: &mut Rng, rows: usize, cols: usize) -> Linear {
    Linear::Dense(Tensor::owned(vec![rows, cols], r.vals(rows * cols, 0.6 / (cols as f32).sqrt() * 1.7)))
}

fn codes(r: &mut Rng, n: usize, bits: u32) -> Vec<u8> {
    (0..n).map(|_| (r.next() % (1 << bits)) as u8).collect()
}

fn int4(r: &mut Rng, rows: usize, cols: usize) -> Linear {
    let g = 32;
    let groups = rows * cols / g;
    let scale: Vec<f32> = r.vals(groups, 1.0).iter().map(|v| 0.02 + v.abs() * 0.03).collect();
    let zero: Vec<f32> = (0..groups).map(|i| (7 + i % 3) as f32).collect();
    Linear::Int(IntLinear::new(
        IntMatrix::new(PackedRows::from_codes(4, rows, cols, &codes(r, rows * cols, 4)), g, &scale, &zero),
        None,
    ))
}

fn cubic3(r: &mut Rng, rows: usize, cols: usize) -> Linear {
    let g = 32;
    let groups = rows * cols / g;
    let s: Vec<f32> = r.vals(groups, 1.0).iter().map(|v| 0.05 + v.abs() * 0.05).collect();
    let a = r.vals(groups, 0.3);
    Linear::Cubic(AnyCubic::new(PackedRows::from_codes(3, rows, cols, &codes(r, rows * cols, 3)), g, &s, &a))
}

fn mxfp4(r: &mut Rng, rows: usize, cols: usize) -> Linear {
    let packed: Vec<u8> = (0..rows * cols / 2).map(|_| r.next() as u8).collect();
    let scales: Vec<u8> = (0..rows * cols / 32).map(|i| 120 + (i % 3) as u8).collect();
    Linear::Mxfp4(Mxfp4Matrix::new(rows, cols, &packed, &scales))
}

fn tiny_llama(tied: bool, w: Weights, seed: u64) -> LlamaModel {
    let mut r = Rng(seed);
    let cfg = cfg(tied);
    let norm = |r: &mut Rng| Tensor::owned(vec![D], r.vals(D, 0.3).iter().map(|v| 1.0 + v).collect());
    let layers = (0..LAYERS)
        .map(|_| {
            let lin = |r: &mut Rng, rows, cols, packed: fn(&mut Rng, usize, usize) -> Linear| {
                if w == Weights::Packed {
                    packed(r, rows, cols)
                } else {
                    dense(r, rows, cols)
                }
            };
            Layer {
                attn_norm: norm(&mut r),
                q: lin(&mut r, HEADS * HD, D, int4),
                k: lin(&mut r, KV_HEADS * HD, D, int4),
                v: lin(&mut r, KV_HEADS * HD, D, int4),
                o: lin(&mut r, D, HEADS * HD, int4),
                ffn_norm: norm(&mut r),
                gate: lin(&mut r, INTER, D, cubic3),
                up: lin(&mut r, INTER, D, cubic3),
                down: lin(&mut r, D, INTER, mxfp4),
            }
        })
        .collect();
    let embed = Tensor::owned(vec![VOCAB, D], r.vals(VOCAB * D, 1.0));
    let lm_head = (!tied).then(|| dense(&mut r, VOCAB, D));
    LlamaModel {
        rope: Rope::new(HD, cfg.rope_theta),
        cfg,
        tp: TpRank::SINGLE,
        heads: HEADS,
        kv_heads: KV_HEADS,
        vocab: 0..VOCAB,
        embed,
        layers,
        norm: Tensor::owned(vec![D], vec![1.0; D]),
        lm_head,
    }
}

/// One batch: (sequence, first position, tokens) chunks.
type Step = Vec<(usize, usize, usize)>;

/// Runs `steps` through both models and returns the worst logit error relative to the largest
/// reference logit of its row.
fn worst_error<R: Runtime>(gpu: Kernels<R>, tied: bool, w: Weights, storage: KvStorage) -> f32 {
    worst_error_with(gpu, tied, w, storage, DenseWeights::Bf16)
}

fn worst_error_with<R: Runtime>(
    gpu: Kernels<R>,
    tied: bool,
    w: Weights,
    storage: KvStorage,
    dense: DenseWeights,
) -> f32 {
    let cpu = tiny_llama(tied, w, 7);
    let dev = DeviceLlama::from_ranks_with(
        std::slice::from_ref(&cpu),
        vec![gpu],
        Box::new(crate::parallel::device_collective::SoleRank),
        dense,
    )
    .unwrap();
    dev.allocate(BLOCKS, BS, storage).unwrap();
    let mut rng = Rng(99);
    // Sequence 3 forks sequence 0 after its 6-token prompt (same prompt), then decodes on its own.
    let mut prompts: Vec<Vec<u32>> = (0..4).map(|_| (0..16).map(|_| rng.next() % VOCAB as u32).collect()).collect();
    let shared: Vec<u32> = prompts[0][..6].to_vec();
    prompts[3][..6].copy_from_slice(&shared);
    // Scattered block ids, never shared except seq 3's full first block (a prefix hit).
    let mut ids: Vec<u32> = (0..BLOCKS as u32).rev().collect();
    for i in 0..ids.len() {
        ids.swap(i, (i * 7 + 3) % BLOCKS);
    }
    let mut next = ids.into_iter();
    let mut tables: Vec<Vec<u32>> = vec![Vec::new(); 4];
    let steps: Vec<Step> = vec![
        vec![(0, 0, 6), (1, 0, 3)],
        vec![(1, 3, 4), (2, 0, 5), (0, 6, 1)],
        // Seq 3 joins with seq 0's first 6 positions: block 0 shared, block 1 copied (2 slots).
        vec![(3, 6, 1), (0, 7, 1), (2, 5, 8), (1, 7, 1)],
        vec![(0, 8, 1), (1, 8, 1), (3, 7, 1), (2, 13, 0)],
        vec![(3, 8, 1)],
    ];
    let mut host = ContiguousKvCache::new(LAYERS, KV_HEADS * HD, 4);
    // The CPU reference computes seq 3's shared prefix itself (same tokens, same K/V).
    let pre: Vec<BatchRow> = (0..6).map(|p| BatchRow { seq: 3, pos: p }).collect();
    cpu.forward(&prompts[3][..6], &pre, &mut host, &[]);
    let mut worst = 0.0f32;
    for step in steps {
        let mut copies = Vec::new();
        let (mut tokens, mut rows, mut logit_rows) = (Vec::new(), Vec::new(), Vec::new());
        for &(s, start, count) in &step {
            if count == 0 {
                continue;
            }
            if s == 3 && tables[3].is_empty() {
                let shared = tables[0][0];
                let copy = next.next().unwrap();
                copies.push(BlockCopy { src: tables[0][1], dst: copy, slots: 6 % BS });
                tables[3] = vec![shared, copy];
            }
            while tables[s].len() < (start + count).div_ceil(BS) {
                tables[s].push(next.next().unwrap());
            }
            tokens.extend_from_slice(&prompts[s][start..start + count]);
            rows.extend((start..start + count).map(|pos| BatchRow { seq: s, pos }));
            logit_rows.push(rows.len() - 1);
        }
        let want = cpu.forward(&tokens, &rows, &mut host, &logit_rows);
        let got =
            dev.try_forward(&tokens, &rows, &mut BlockTables::new(BS, tables.clone(), copies), &logit_rows).unwrap();
        assert_eq!(got.len(), want.len());
        for (g, w) in got.chunks(VOCAB).zip(want.chunks(VOCAB)) {
            let err = kernels::compare::max_rel_error(g, w, 1e-3);
            worst = worst.max(err);
        }
    }
    worst
}

/// One prefill batch larger than the GEMV range (4 prompts of 16 = 64 tokens >
/// `GEMM_MIN_TOKENS`), so packed weights take the dequantise + bf16 GEMM path, then one decode
/// step per sequence (the GEMV path again); worst logit error relative to the row's largest.
fn long_prefill_error<R: Runtime>(gpu: Kernels<R>, w: Weights) -> f32 {
    let cpu = tiny_llama(false, w, 11);
    let dev = DeviceLlama::from_llama(&cpu, gpu).unwrap();
    dev.allocate(BLOCKS, BS, KvStorage::F32).unwrap();
    let mut rng = Rng(5);
    let prompts: Vec<Vec<u32>> = (0..4).map(|_| (0..16).map(|_| rng.next() % VOCAB as u32).collect()).collect();
    assert!(prompts.len() * 16 > kernels::gpu::kernels::GEMM_MIN_TOKENS, "the prefill must exceed the GEMV range");
    let tables: Vec<Vec<u32>> = (0..4u32).map(|s| (0..5).map(|b| s * 5 + b).collect()).collect();
    let mut host = ContiguousKvCache::new(LAYERS, KV_HEADS * HD, 4);
    let (mut tokens, mut rows, mut logit_rows) = (Vec::new(), Vec::new(), Vec::new());
    for (s, p) in prompts.iter().enumerate() {
        tokens.extend_from_slice(p);
        rows.extend((0..16).map(|pos| BatchRow { seq: s, pos }));
        logit_rows.push(rows.len() - 1);
    }
    let decode_tokens: Vec<u32> = (0..4).map(|_| rng.next() % VOCAB as u32).collect();
    let decode_rows: Vec<BatchRow> = (0..4).map(|s| BatchRow { seq: s, pos: 16 }).collect();
    let mut worst = 0.0f32;
    for (t, r, l) in [(&tokens, &rows, &logit_rows), (&decode_tokens, &decode_rows, &vec![0, 1, 2, 3])] {
        let want = cpu.forward(t, r, &mut host, l);
        let got = dev.try_forward(t, r, &mut BlockTables::new(BS, tables.clone(), Vec::new()), l).unwrap();
        for (g, w) in got.chunks(VOCAB).zip(want.chunks(VOCAB)) {
            worst = worst.max(kernels::compare::max_rel_error(g, w, 1e-3));
        }
    }
    worst
}

/// Dense weights: the only device-side rounding is the bf16 activations entering the GEMMs
/// (2^-9 relative per element): about 1e-3 to 3e-3 of the largest logit here, bf16 K/V adds
/// little. (Skipping the fork's block copy, for instance, gives 6e-2.)
#[test]
fn reference_runtime_matches_the_cpu_llama_dense_tied_and_untied() {
    for tied in [true, false] {
        for (storage, tol) in [(KvStorage::F32, 1e-2), (KvStorage::Bf16, 1e-2)] {
            let e = worst_error(Kernels::new(RefRuntime), tied, Weights::Dense, storage);
            eprintln!("dense tied={tied} {storage:?}: worst relative logit error {e:.2e}");
            assert!(e < tol, "tied={tied} {storage:?}: {e}");
        }
    }
}

/// `--dtype float32`: dense weights and their inputs stay f32 (the tied head gets an f32 copy of
/// the embedding), so only summation order differs from the CPU model.
#[test]
fn reference_runtime_with_f32_dense_weights_matches_the_cpu_llama_to_rounding() {
    for tied in [true, false] {
        let e = worst_error_with(Kernels::new(RefRuntime), tied, Weights::Dense, KvStorage::F32, DenseWeights::F32);
        eprintln!("f32 dense tied={tied}: worst relative logit error {e:.2e}");
        assert!(e < 1e-5, "tied={tied}: {e}");
    }
}

/// Packed weights multiply f32 activations on both sides (only summation order differs); the
/// output projection is a bf16 GEMM either way (dense lm_head, or the tied embedding), so its
/// activation rounding bounds the error, plus FP8 K/V's 3 mantissa bits.
#[test]
fn reference_runtime_matches_the_cpu_llama_with_packed_weights_and_fp8_kv() {
    let e = worst_error(Kernels::new(RefRuntime), false, Weights::Packed, KvStorage::F32);
    eprintln!("packed f32 KV: {e:.2e}");
    assert!(e < 1e-2, "{e}");
    let e = worst_error(Kernels::new(RefRuntime), true, Weights::Packed, KvStorage::Fp8);
    eprintln!("packed FP8 KV: {e:.2e}");
    assert!(e < 0.15, "{e}");
}

#[test]
fn a_contiguous_cache_or_a_missing_pool_is_an_error() {
    let cpu = tiny_llama(true, Weights::Dense, 1);
    let dev = DeviceLlama::from_llama(&cpu, Kernels::new(RefRuntime)).unwrap();
    let mut host = ContiguousKvCache::new(LAYERS, KV_HEADS * HD, 1);
    let row = [BatchRow { seq: 0, pos: 0 }];
    let e = dev.try_forward(&[1], &row, &mut host, &[0]).unwrap_err();
    assert!(e.to_string().contains("paged KV cache"), "{e}");
    let e = dev.try_forward(&[1], &row, &mut BlockTables::new(BS, vec![vec![0]], vec![]), &[0]).unwrap_err();
    assert!(e.to_string().contains("not allocated"), "{e}");
    dev.allocate(4, BS, KvStorage::F32).unwrap();
    assert!(dev.allocate(8, BS, KvStorage::F32).is_err(), "a second, different pool is refused");
    let e = dev.try_forward(&[1], &row, &mut BlockTables::new(BS, vec![vec![9]], vec![]), &[0]).unwrap_err();
    assert!(e.to_string().contains("outside the device pool"), "{e}");
}

/// The tiny bf16 checkpoint of tests/reference/tiny_llama (made with transformers).
fn tiny_checkpoint() -> (crate::model::LoadedModel, serde_json::Value) {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/reference/tiny_llama");
    let reference = serde_json::from_str(&std::fs::read_to_string(dir.join("reference.json")).unwrap()).unwrap();
    (crate::model::load(&dir).unwrap(), reference)
}

/// Through `place_on_device`, every position's logits against transformers' (f32 compute from the
/// same bf16 weights). The device path rounds GEMM activations to bf16, so the bound is that
/// rounding's (about 2^-9 relative per input, accumulated over two layers), not the CPU's 2e-4.
#[test]
fn device_llama_matches_transformers_on_the_tiny_checkpoint() {
    matches_transformers_on_the_tiny_checkpoint(Kernels::new(RefRuntime));
}

fn matches_transformers_on_the_tiny_checkpoint<R: Runtime + 'static>(gpu: Kernels<R>) {
    let (m, reference) = tiny_checkpoint();
    logits_match_transformers(super::place_on_device(m, gpu).unwrap(), &reference);
}

/// The tiny checkpoint loaded as `tp` tensor-parallel ranks, one device from `gpu` each, their
/// all-reduces through a host-staged local group.
fn tensor_parallel_checkpoint<R: Runtime + 'static>(
    tp: usize,
    gpu: impl Fn() -> Kernels<R>,
) -> (crate::model::LoadedModel, serde_json::Value) {
    let (_, reference) = tiny_checkpoint();
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/reference/tiny_llama");
    let m = crate::model::load_tp(&dir, tp).unwrap();
    let gpus = (0..tp).map(|_| gpu()).collect();
    (super::place_on_devices(m, gpus, Box::new(LocalDeviceGroup { world: tp })).unwrap(), reference)
}

/// Every position's logits of a placed tiny checkpoint against transformers'.
fn logits_match_transformers(m: crate::model::LoadedModel, reference: &serde_json::Value) {
    let dev = m.model.device_kv().expect("a Llama is placed on the device");
    dev.allocate(16, BS, KvStorage::F32).unwrap();
    let vocab = m.config().vocab_size;
    let mut worst = 0.0f32;
    for (c, case) in reference["cases"].as_array().unwrap().iter().enumerate() {
        let toks = ids(&case["ids"]);
        let rows: Vec<BatchRow> = (0..toks.len()).map(|pos| BatchRow { seq: 0, pos }).collect();
        let all: Vec<usize> = (0..toks.len()).collect();
        // Each case in its own blocks (4 cases x at most 4 blocks of 4).
        let table: Vec<u32> = (0..toks.len().div_ceil(BS) as u32).map(|b| c as u32 * 4 + b).collect();
        let got = m.model.try_forward(&toks, &rows, &mut BlockTables::new(BS, vec![table], vec![]), &all).unwrap();
        for (p, want) in case["logits"].as_array().unwrap().iter().enumerate() {
            for (v, w) in want.as_array().unwrap().iter().enumerate() {
                worst = worst.max(kernels::compare::abs_error(got[p * vocab + v], w.as_f64().unwrap() as f32));
            }
        }
    }
    eprintln!("tiny checkpoint, device forward vs transformers: max |logit difference| {worst:.2e}");
    assert!(worst < 2e-2, "{worst}");
}

/// The engine serving through the device path: K/V only in the device pool (the host pool holds
/// none), greedy continuations equal to transformers'.
#[test]
fn engine_serves_the_device_model_with_kv_in_the_device_pool() {
    engine_serves_with_kv_in_the_device_pool(Kernels::new(RefRuntime));
}

fn engine_serves_with_kv_in_the_device_pool<R: Runtime + 'static>(gpu: Kernels<R>) {
    let (m, reference) = tiny_checkpoint();
    engine_greedy_matches_transformers(super::place_on_device(m, gpu).unwrap(), &reference);
}

fn engine_greedy_matches_transformers(m: crate::model::LoadedModel, reference: &serde_json::Value) {
    test_util::engine_greedy_matches_transformers(m, reference, BS, "tiny Llama");
}

/// Tensor parallelism over 2 and 4 devices: the heads, the MLP and the vocabulary split, the
/// partial sums all-reduced after the embedding and each row-parallel projection. With 4 ranks
/// the 2 KV heads are replicated (each rank owns one query head and a copy of its KV head).
/// Same bound against transformers as one device: only the summation order changes.
#[test]
fn tensor_parallel_device_llama_matches_transformers_on_the_tiny_checkpoint() {
    for tp in [2, 4] {
        let (m, reference) = tensor_parallel_checkpoint(tp, || Kernels::new(RefRuntime));
        assert!(m.model.device_kv().is_some());
        eprintln!("tp={tp}:");
        logits_match_transformers(m, &reference);
    }
}

#[test]
fn tensor_parallel_engine_serves_with_kv_in_each_ranks_device_pool() {
    let (m, reference) = tensor_parallel_checkpoint(2, || Kernels::new(RefRuntime));
    engine_greedy_matches_transformers(m, &reference);
}

/// A device failing in the middle of a step (after the ranks' first all-reduce) fails that step
/// with its error; the peer waiting in the next all-reduce is released instead of hanging, and
/// the following step runs normally.
#[test]
fn a_rank_failing_mid_step_fails_the_step_not_its_peers_or_the_next_step() {
    use crate::model::device::ref_runtime::Flaky;
    let (_, reference) = tiny_checkpoint();
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/reference/tiny_llama");
    let m = crate::model::load_tp(&dir, 2).unwrap();
    let gpus = vec![Kernels::new(Flaky::new(usize::MAX)), Kernels::new(Flaky::new(6))];
    let m = super::place_on_devices(m, gpus, Box::new(LocalDeviceGroup { world: 2 })).unwrap();
    m.model.device_kv().unwrap().allocate(16, BS, KvStorage::F32).unwrap();
    let case = &reference["cases"][0];
    let toks = ids(&case["ids"]);
    let rows: Vec<BatchRow> = (0..toks.len()).map(|pos| BatchRow { seq: 0, pos }).collect();
    let last = vec![toks.len() - 1];
    let tables = || BlockTables::new(BS, vec![(0..toks.len().div_ceil(BS) as u32).collect()], vec![]);
    let e = m.model.try_forward(&toks, &rows, &mut tables(), &last).unwrap_err();
    assert!(
        e.to_string().contains("injected launch failure"),
        "the failing rank's own error, not its peer's abort: {e}"
    );
    let got = m.model.try_forward(&toks, &rows, &mut tables(), &last).unwrap();
    let want: Vec<f32> = case["logits"]
        .as_array()
        .unwrap()
        .last()
        .unwrap()
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_f64().unwrap() as f32)
        .collect();
    let worst = kernels::compare::max_abs_error(&got, &want);
    assert!(worst < 2e-2, "the step after the failure: {worst}");
}

/// The compressed-tensors W4A16 fixture (tests/reference/ct/ct_int4_sym, group 128) on `tp`
/// devices, its INT4 layers kept packed (at TP=2 down_proj's 384 input columns are cut at 192,
/// inside a group): every position's logits against transformers running the checkpoint.
/// Returns the worst |difference| relative to each row's largest reference logit.
fn ct_int4_error<R: Runtime + 'static>(tp: usize, gpu: impl Fn() -> Kernels<R>) -> f32 {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/reference/ct");
    let meta: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("ct_int4_sym.reference.json")).unwrap()).unwrap();
    let bytes = std::fs::read(dir.join("ct_int4_sym.reference.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let m = crate::model::load_tp(&dir.join("ct_int4_sym"), tp).unwrap();
    let gpus = (0..tp).map(|_| gpu()).collect();
    let group: Box<dyn crate::parallel::device_collective::DeviceGroup<R>> = if tp == 1 {
        Box::new(crate::parallel::device_collective::SoleRank)
    } else {
        Box::new(LocalDeviceGroup { world: tp })
    };
    let m = super::place_on_devices(m, gpus, group).unwrap();
    m.model.device_kv().unwrap().allocate(16, BS, KvStorage::F32).unwrap();
    let vocab = m.config().vocab_size;
    let mut worst = 0.0f32;
    for (c, case) in meta["cases"].as_array().unwrap().iter().enumerate() {
        let toks = ids(&case["ids"]);
        let rows: Vec<BatchRow> = (0..toks.len()).map(|pos| BatchRow { seq: 0, pos }).collect();
        let all: Vec<usize> = (0..toks.len()).collect();
        let table: Vec<u32> = (0..toks.len().div_ceil(BS) as u32).map(|b| c as u32 * 8 + b).collect();
        let got = m.model.try_forward(&toks, &rows, &mut BlockTables::new(BS, vec![table], vec![]), &all).unwrap();
        let t = st.tensor(&format!("logits.transformers.{c}")).unwrap();
        let want: Vec<f32> = t.data().chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect();
        assert_eq!(want.len(), got.len());
        for (g, w) in got.chunks(vocab).zip(want.chunks(vocab)) {
            worst = worst.max(kernels::compare::max_rel_error(g, w, 1e-3));
        }
    }
    worst
}

/// The INT4 GEMV on packed weights multiplies f32 activations; the bf16 rounding of the dense
/// lm_head's GEMM input bounds the difference, whole or split.
#[test]
fn packed_int4_checkpoint_matches_transformers_on_one_and_two_devices() {
    for tp in [1, 2] {
        let e = ct_int4_error(tp, || Kernels::new(RefRuntime));
        eprintln!("ct_int4_sym on {tp} device(s): worst relative logit difference vs transformers {e:.2e}");
        assert!(e < 1e-2, "tp={tp}: {e}");
    }
}

/// Ranks and devices must pair up, and a rank's position must be its device's.
#[test]
fn ranks_and_devices_must_match() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/reference/tiny_llama");
    let m = crate::model::load_tp(&dir, 2).unwrap();
    let e = super::place_on_devices(
        m,
        vec![Kernels::new(RefRuntime)],
        Box::new(crate::parallel::device_collective::SoleRank),
    )
    .err()
    .unwrap();
    assert!(e.to_string().contains("2 rank(s) but 1 device(s)"), "{e}");
    let mut swapped = [tiny_llama(true, Weights::Dense, 1), tiny_llama(true, Weights::Dense, 1)];
    swapped[0].tp = TpRank { rank: 1, size: 2 };
    swapped[1].tp = TpRank { rank: 0, size: 2 };
    let e = super::DeviceLlama::from_ranks(
        &swapped,
        vec![Kernels::new(RefRuntime), Kernels::new(RefRuntime)],
        Box::new(LocalDeviceGroup { world: 2 }),
    )
    .err()
    .unwrap();
    assert!(e.to_string().contains("device 0 was given tensor-parallel rank 1 of 2"), "{e}");
}

/// A model whose forward fails (as a device error would).
struct Failing(crate::model::config::ModelConfig);

impl LanguageModel for Failing {
    fn config(&self) -> &crate::model::config::ModelConfig {
        &self.0
    }
    fn cache_layout(&self) -> crate::model::kv::CacheLayout {
        crate::model::kv::CacheLayout::uniform(
            self.0.num_layers(),
            crate::model::kv::LayerKvShape::heads(self.0.num_kv_heads, self.0.head_dim),
        )
    }
    fn forward(&self, _: &[u32], _: &[BatchRow], _: &mut dyn KvCache, _: &[usize]) -> Vec<f32> {
        unreachable!("the engine calls try_forward")
    }
    fn try_forward(
        &self,
        _: &[u32],
        _: &[BatchRow],
        _: &mut dyn KvCache,
        _: &[usize],
    ) -> Result<Vec<f32>, crate::model::ForwardError> {
        Err(crate::model::ForwardError::Invalid("injected device failure".into()))
    }
}

/// A failing forward fails the batch's requests with the reason and frees their blocks; the
/// engine keeps running.
#[test]
fn a_failed_forward_fails_the_requests_not_the_engine() {
    use crate::engine::{EngineConfig, EngineCore, EngineEvent, EngineRequest};
    let (m, _) = tiny_checkpoint();
    let m = std::sync::Arc::new(crate::model::LoadedModel { model: Box::new(Failing(m.config().clone())), ..m });
    let mut core =
        EngineCore::try_new(m, EngineConfig { block_size: 4, kv_cache_bytes: 1 << 20, ..Default::default() }).unwrap();
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    core.add_request(1, EngineRequest { prompt_ids: vec![1, 5, 9], max_tokens: 4, ..Default::default() }, tx).unwrap();
    while core.step() {}
    match rx.try_recv() {
        Ok(EngineEvent::Error(e)) => {
            assert!(e.contains("forward pass failed") && e.contains("injected device failure"), "{e}")
        }
        other => panic!("expected an error event, got {other:?}"),
    }
    assert_eq!(core.stats().forward_errors_total, 1);
    assert!(!core.has_work());
    assert_eq!(core.pool().unreferenced(), core.pool().num_blocks());
}

/// A model whose forward panics (a bug anywhere in a step).
struct Panicking(crate::model::config::ModelConfig);

impl LanguageModel for Panicking {
    fn config(&self) -> &crate::model::config::ModelConfig {
        &self.0
    }
    fn cache_layout(&self) -> crate::model::kv::CacheLayout {
        Failing(self.0.clone()).cache_layout()
    }
    fn forward(&self, _: &[u32], _: &[BatchRow], _: &mut dyn KvCache, _: &[usize]) -> Vec<f32> {
        panic!("injected bug")
    }
}

/// A step that panics fails the requests in flight with the panic's message and frees their
/// blocks; the engine (thread) goes on and serves the next request.
#[test]
fn a_panicking_step_fails_the_requests_not_the_engine() {
    use crate::engine::{Engine, EngineConfig, EngineEvent, EngineRequest};
    let (m, _) = tiny_checkpoint();
    let m = std::sync::Arc::new(crate::model::LoadedModel { model: Box::new(Panicking(m.config().clone())), ..m });
    let engine = Engine::start(m, EngineConfig { block_size: 4, kv_cache_bytes: 1 << 20, ..Default::default() });
    for _ in 0..2 {
        let mut stream = engine
            .submit(EngineRequest { prompt_ids: vec![1, 5, 9], max_tokens: 4, n: 2, ..Default::default() })
            .unwrap();
        match stream.blocking_next() {
            Some(EngineEvent::Error(e)) => assert!(e.contains("internal error in the engine: injected bug"), "{e}"),
            other => panic!("expected an error event, got {other:?}"),
        }
    }
    // The engine thread publishes its stats after the step that sent the error.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while engine.stats().step_panics_total < 2 && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    let stats = engine.stats();
    assert_eq!(stats.step_panics_total, 2);
    assert_eq!(stats.kv_blocks_free, stats.kv_blocks_total);
}

/// The same checks on the CPU simulator, which runs the real `.cu` sources (kernels/sim): the
/// device forward's kernels, launch geometry and composition as a GPU would run them.
mod sim {
    use super::*;
    use kernels::sim::SimGpu;

    use crate::model::device::test_util::sim;

    #[test]
    fn matches_the_cpu_llama_dense_packed_and_every_kv_storage() {
        let cases = [
            (true, Weights::Dense, KvStorage::F32, 1e-2),
            (false, Weights::Dense, KvStorage::Bf16, 1e-2),
            (false, Weights::Packed, KvStorage::F32, 1e-2),
            (true, Weights::Packed, KvStorage::Fp8, 0.15),
        ];
        for (tied, w, storage, tol) in cases {
            let Some(g) = sim("sim::matches_the_cpu_llama") else { return };
            let e = worst_error(g, tied, w, storage);
            eprintln!("sim: tied={tied} {w:?} {storage:?}: worst relative logit error {e:.2e}");
            assert!(e < tol, "tied={tied} {w:?} {storage:?}: {e}");
        }
    }

    /// Packed weights through the prefill GEMM (dequantise, bf16 activations, GEMM): the
    /// activation rounding the dense path has, so the same bound.
    #[test]
    fn a_prefill_above_the_gemv_range_takes_the_dequant_gemm_path() {
        let Some(g) = sim("sim::a_prefill_above_the_gemv_range_takes_the_dequant_gemm_path") else { return };
        let e = long_prefill_error(g, Weights::Packed);
        eprintln!("sim: 64-token prefill, packed weights: worst relative logit error {e:.2e}");
        assert!(e < 1e-2, "{e}");
    }

    #[test]
    fn matches_transformers_on_the_tiny_checkpoint() {
        if let Some(g) = sim("sim::matches_transformers_on_the_tiny_checkpoint") {
            super::matches_transformers_on_the_tiny_checkpoint(g);
        }
    }

    #[test]
    fn engine_serves_with_kv_in_the_device_pool() {
        if let Some(g) = sim("sim::engine_serves_with_kv_in_the_device_pool") {
            super::engine_serves_with_kv_in_the_device_pool(g);
        }
    }

    #[test]
    fn packed_int4_checkpoint_on_two_devices_matches_transformers() {
        if sim("sim::packed_int4_checkpoint_on_two_devices_matches_transformers").is_none() {
            return;
        }
        let e = ct_int4_error(2, || SimGpu::sim().unwrap());
        eprintln!("sim: ct_int4_sym on 2 devices: worst relative logit difference vs transformers {e:.2e}");
        assert!(e < 1e-2, "{e}");
    }

    /// Two simulated devices, each rank's kernels the real `.cu` sources, run concurrently.
    #[test]
    fn tensor_parallel_matches_transformers_and_serves() {
        if sim("sim::tensor_parallel_matches_transformers_and_serves").is_none() {
            return;
        }
        let (m, reference) = tensor_parallel_checkpoint(2, || SimGpu::sim().unwrap());
        logits_match_transformers(m, &reference);
        let (m, reference) = tensor_parallel_checkpoint(2, || SimGpu::sim().unwrap());
        engine_greedy_matches_transformers(m, &reference);
    }
}

/// On two CUDA devices with NCCL between them (skipped, saying why, without two GPUs and NCCL;
/// `WASMSERVE_REQUIRE_NCCL=1` makes that a failure, as bench/gpu-check.sh sets on a 2-GPU machine).
#[cfg(feature = "cuda")]
mod two_gpus {
    use super::*;
    use kernels::cuda::launch::Gpu;
    use kernels::cuda::nvrtc::PtxCache;

    fn two_gpus(test: &str) -> Option<(Vec<Gpu>, crate::backend::nccl::NcclDeviceGroup)> {
        let cache = PtxCache::new(PtxCache::default_dir());
        let opened = (0..2)
            .map(|o| Gpu::open(o, &cache))
            .collect::<Result<Vec<_>, _>>()
            .and_then(|g| crate::backend::nccl::NcclDeviceGroup::over(&g).map(|n| (g, n)));
        match opened {
            Ok(v) => Some(v),
            Err(e) if std::env::var_os("WASMSERVE_REQUIRE_NCCL").is_some_and(|v| v == "1") => panic!("{test}: {e}"),
            Err(e) => {
                eprintln!("SKIPPED {test}: two CUDA devices with NCCL are needed: {e}");
                None
            }
        }
    }

    /// The NCCL device all-reduce's mechanics (communicator over the runtime's stream, device
    /// pointer, element count, context binding) on the one GPU a lent machine has: a group of one
    /// sums to the input, and an aborted group refuses the next step.
    #[test]
    fn nccl_device_all_reduce_on_one_gpu() {
        let test = "two_gpus::nccl_device_all_reduce_on_one_gpu";
        let gpu = match Gpu::open(0, &PtxCache::new(PtxCache::default_dir())) {
            Ok(g) => g,
            Err(e) if std::env::var_os("WASMSERVE_REQUIRE_GPU").is_some_and(|v| v == "1") => panic!("{test}: {e}"),
            Err(e) => return eprintln!("SKIPPED {test}: no usable CUDA device: {e}"),
        };
        let group = match crate::backend::nccl::NcclDeviceGroup::over(std::slice::from_ref(&gpu)) {
            Ok(g) => g,
            Err(e) if std::env::var_os("WASMSERVE_REQUIRE_NCCL").is_some_and(|v| v == "1") => panic!("{test}: {e}"),
            Err(e) => return eprintln!("SKIPPED {test}: NCCL unavailable: {e}"),
        };
        use crate::parallel::device_collective::DeviceGroup;
        let comms = group.step_comms().unwrap();
        let host: Vec<f32> = (0..1000).map(|i| i as f32 * 0.5 - 3.0).collect();
        let mut buf = gpu.upload(&host).unwrap();
        comms[0].all_reduce_sum(&gpu, &mut buf, 700).unwrap();
        assert_eq!(gpu.download(&buf).unwrap(), host, "a group of one sums to its input");
        comms[0].abort("test");
        assert!(group.step_comms().is_err(), "an aborted group refuses further steps");
        eprintln!("NCCL device all-reduce on one GPU: ok");
    }

    #[test]
    fn tensor_parallel_over_nccl_matches_transformers_and_serves() {
        let test = "two_gpus::tensor_parallel_over_nccl_matches_transformers_and_serves";
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/reference/tiny_llama");
        let (_, reference) = tiny_checkpoint();
        for check in 0..2 {
            let Some((gpus, group)) = two_gpus(test) else { return };
            let m =
                super::super::place_on_devices(crate::model::load_tp(&dir, 2).unwrap(), gpus, Box::new(group)).unwrap();
            if check == 0 {
                logits_match_transformers(m, &reference);
            } else {
                engine_greedy_matches_transformers(m, &reference);
            }
        }
    }
}
