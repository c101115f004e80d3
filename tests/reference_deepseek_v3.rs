//! DeepSeek-V3 (MLA + MoE) against transformers on the tiny random model made by
//! tests/reference/make_tiny_deepseek_v3.py (YaRN factor 4 past its original 32 positions,
//! interleaved rope, q_lora, grouped noaux_tc routing, shared expert):
//!  - prefill logits and 32 greedy decode steps through `forward` with a contiguous cache,
//!  - the same 32 steps through the paged engine (greedy tokens and the logprobs it reports,
//!    which are the raw logits minus their log-sum-exp): plain, chunked prefill, under a block
//!    budget that forces preemption, and with prefix-cache hits,
//!  - single gated-MLA layers (DeepSeek with YaRN; Kimi NoPE) against transformers' attention
//!    module with the output gate added,
//!  - load errors (missing tensor, wrong shape, bad config) named.

mod common;

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

use kernels::cpu::fp8::{quantize_e4m3, E4M3_TO_F32};
use serde_json::Value;
use tokio::sync::mpsc::unbounded_channel;
use wasmserve::engine::block_pool::{KvDtype, PoolShape};
use wasmserve::engine::{EngineConfig, EngineCore, EngineEvent, EngineRequest};
use wasmserve::model::error::LoadError;
use wasmserve::model::format::hf_source::SafetensorsSource;
use wasmserve::model::format::source::WeightSource;
use wasmserve::model::kv::{BatchRow, CacheLayout, ContiguousKvCache, KvCache, KvRow};
use wasmserve::model::layers::mla::{MlaConfig, MlaLayer};
use wasmserve::model::LoadedModel;
use wasmserve::sampling::SamplingParams;

/// Max |ours − transformers| on logits of magnitude ≤ 7; both f32 on the same bf16 weights
/// (the reference is rounded to 1e-5).
const LOGIT_TOLERANCE: f32 = 1e-4;

fn dir() -> PathBuf {
    common::repo_root().join("tests/reference/deepseek_v3")
}

fn model() -> Arc<LoadedModel> {
    static M: OnceLock<Arc<LoadedModel>> = OnceLock::new();
    M.get_or_init(|| Arc::new(wasmserve::model::load(&dir().join("model")).expect("loading the tiny DeepSeek-V3")))
        .clone()
}

use common::ReferenceCase as Case;

fn cases() -> Vec<Case> {
    common::reference_cases(&dir().join("model/reference.json"))
}

fn max_diff(got: &[f32], want: &[f32]) -> f32 {
    assert_eq!(got.len(), want.len());
    kernels::compare::max_abs_error(got, want)
}

fn argmax(x: &[f32]) -> u32 {
    x.iter().enumerate().max_by(|a, b| a.1.total_cmp(b.1)).unwrap().0 as u32
}

fn log_softmax(x: &[f32]) -> Vec<f32> {
    let m = x.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
    let lse = m + x.iter().map(|v| ((v - m) as f64).exp()).sum::<f64>().ln() as f32;
    x.iter().map(|v| v - lse).collect()
}

#[test]
fn prefill_and_32_decode_steps_match_transformers() {
    let m = model();
    let vocab = m.config().vocab_size;
    let layout = m.model.cache_layout();
    // The compressed cache: kv_lora_rank (24) + qk_rope_head_dim (8) floats per token and layer.
    assert_eq!(layout.floats_per_token(), 4 * (24 + 8));
    let mut worst = 0.0f32;
    for case in cases() {
        let n = case.ids.len();
        let mut kv = ContiguousKvCache::for_layout(&layout, 1);
        let rows: Vec<BatchRow> = (0..n).map(|pos| BatchRow { seq: 0, pos }).collect();
        let logits = m.model.forward(&case.ids, &rows, &mut kv, &(0..n).collect::<Vec<_>>());
        for (p, want) in case.prefill.iter().enumerate() {
            let d = max_diff(&logits[p * vocab..(p + 1) * vocab], want);
            assert!(d <= LOGIT_TOLERANCE, "prefill position {p} of {n}: max diff {d}");
            worst = worst.max(d);
        }
        // Step 0 is the last prefill position; each later step feeds the previous greedy token.
        let mut last = logits[(n - 1) * vocab..].to_vec();
        for (k, want) in case.steps.iter().enumerate() {
            if k > 0 {
                last = m.model.forward(&[case.greedy[k - 1]], &[BatchRow { seq: 0, pos: n + k - 1 }], &mut kv, &[0]);
            }
            let d = max_diff(&last, want);
            assert!(d <= LOGIT_TOLERANCE, "decode step {k} (prompt {n}): max diff {d}");
            assert_eq!(argmax(&last), case.greedy[k], "greedy token at step {k}");
            worst = worst.max(d);
        }
    }
    eprintln!("forward: worst logit diff vs transformers {worst:.2e}");
}

#[test]
fn two_sequences_in_one_batch_match_transformers() {
    // Rows of both prompts mixed in one forward pass, then both decoded in the same steps.
    let m = model();
    let vocab = m.config().vocab_size;
    let cs = cases();
    let mut kv = ContiguousKvCache::for_layout(&m.model.cache_layout(), 2);
    let (mut tokens, mut rows) = (Vec::new(), Vec::new());
    for (s, c) in cs.iter().enumerate() {
        for (p, &t) in c.ids.iter().enumerate() {
            tokens.push(t);
            rows.push(BatchRow { seq: s, pos: p });
        }
    }
    let lasts: Vec<usize> = vec![cs[0].ids.len() - 1, tokens.len() - 1];
    let logits = m.model.forward(&tokens, &rows, &mut kv, &lasts);
    for (s, c) in cs.iter().enumerate() {
        assert!(max_diff(&logits[s * vocab..(s + 1) * vocab], &c.steps[0]) <= LOGIT_TOLERANCE);
    }
    for k in 1..cs[0].steps.len() {
        let toks: Vec<u32> = cs.iter().map(|c| c.greedy[k - 1]).collect();
        let rows: Vec<BatchRow> =
            cs.iter().enumerate().map(|(s, c)| BatchRow { seq: s, pos: c.ids.len() + k - 1 }).collect();
        let out = m.model.forward(&toks, &rows, &mut kv, &[0, 1]);
        for (s, c) in cs.iter().enumerate() {
            let d = max_diff(&out[s * vocab..(s + 1) * vocab], &c.steps[k]);
            assert!(d <= LOGIT_TOLERANCE, "batched step {k}, sequence {s}: {d}");
        }
    }
}

struct EngineRun {
    tokens: Vec<u32>,
    /// Per step: (chosen token's logprob, top-5 alternatives).
    logprobs: Vec<(f32, Vec<(u32, f32)>)>,
    cached: usize,
}

static NEXT_ID: AtomicU64 = AtomicU64::new(1);

fn run_engine(core: &mut EngineCore, prompts: &[&[u32]]) -> Vec<EngineRun> {
    let mut rxs = Vec::new();
    for p in prompts {
        let (tx, rx) = unbounded_channel();
        let req = EngineRequest {
            prompt_ids: p.to_vec(),
            sampling: SamplingParams::greedy(),
            max_tokens: 32,
            ignore_eos: true,
            logprobs: Some(5),
            ..Default::default()
        };
        core.add_request(NEXT_ID.fetch_add(1, Ordering::Relaxed), req, tx).unwrap();
        rxs.push(rx);
    }
    let mut steps = 0;
    while core.step() {
        steps += 1;
        assert!(steps < 10_000, "engine did not finish");
    }
    rxs.iter_mut()
        .map(|rx| {
            let mut r = EngineRun { tokens: vec![], logprobs: vec![], cached: 0 };
            while let Ok(ev) = rx.try_recv() {
                match ev {
                    EngineEvent::Token { token, logprob, .. } => {
                        r.tokens.push(token);
                        let lp = logprob.expect("logprobs requested");
                        r.logprobs.push((lp.logprob, lp.top));
                    }
                    EngineEvent::Finished { cached_tokens, .. } => r.cached = cached_tokens,
                    EngineEvent::PromptLogprobs(_) => panic!("prompt logprobs were not asked for"),
                    EngineEvent::Error(e) => panic!("engine error: {e}"),
                }
            }
            r
        })
        .collect()
}

/// The engine's greedy tokens are transformers', and every reported logprob (chosen and top 5)
/// is transformers' log-softmax of that step's logits.
fn check_against_reference(run: &EngineRun, case: &Case, what: &str) -> f32 {
    assert_eq!(run.tokens, case.greedy, "{what}: greedy tokens");
    let mut worst = 0.0f32;
    for (k, ((lp, top), want)) in run.logprobs.iter().zip(&case.steps).enumerate() {
        let ls = log_softmax(want);
        worst = worst.max(kernels::compare::abs_error(*lp, ls[case.greedy[k] as usize]));
        assert_eq!(top.len(), 5);
        for &(t, l) in top {
            worst = worst.max(kernels::compare::abs_error(l, ls[t as usize]));
        }
    }
    assert!(worst <= LOGIT_TOLERANCE, "{what}: max logprob diff {worst}");
    worst
}

fn engine(cfg: EngineConfig) -> EngineCore {
    EngineCore::new(model(), cfg)
}

#[test]
fn paged_engine_plain_and_chunked_prefill_match_transformers() {
    let cs = cases();
    let prompts: Vec<&[u32]> = cs.iter().map(|c| c.ids.as_slice()).collect();
    let mut worst = 0.0f32;
    for (what, cfg) in [
        ("plain", EngineConfig { enable_prefix_caching: false, ..Default::default() }),
        // 40-token prompt in chunks of at most 7 tokens, decode rows batched beside them.
        ("chunked", EngineConfig { enable_prefix_caching: false, max_num_batched_tokens: 7, ..Default::default() }),
        ("fp32 blocks of 4", EngineConfig { enable_prefix_caching: false, block_size: 4, ..Default::default() }),
    ] {
        let mut core = engine(cfg);
        let out = run_engine(&mut core, &prompts);
        for (r, c) in out.iter().zip(&cs) {
            worst = worst.max(check_against_reference(r, c, what));
        }
        assert_eq!(core.pool().unreferenced(), core.pool().num_blocks());
    }
    eprintln!("engine: worst logprob diff vs transformers {worst:.2e}");
}

#[test]
fn paged_engine_preemption_mid_decode_matches_transformers() {
    let cs = cases();
    let m = model();
    let block_bytes = PoolShape::new(&m.model.cache_layout(), 16).block_bytes(KvDtype::F32);
    // Prompts of 9 and 40 tokens each growing by 32: 3 + 5 blocks needed, 6 available, so one
    // sequence is preempted mid-decode and recomputed later.
    let mut core =
        engine(EngineConfig { kv_cache_bytes: 6 * block_bytes, enable_prefix_caching: false, ..Default::default() });
    let prompts: Vec<&[u32]> = cs.iter().map(|c| c.ids.as_slice()).collect();
    let out = run_engine(&mut core, &prompts);
    assert!(core.stats().preemptions_total > 0, "the budget did not force preemption");
    for (r, c) in out.iter().zip(&cs) {
        check_against_reference(r, c, "preempted");
    }
    assert_eq!(core.pool().unreferenced(), core.pool().num_blocks());
}

#[test]
fn paged_engine_prefix_cache_hits_match_transformers() {
    let cs = cases();
    let long = &cs[1];
    let mut core = engine(EngineConfig::default());
    let first = run_engine(&mut core, &[&long.ids]);
    check_against_reference(&first[0], long, "first");
    let hits = core.stats().prefix_cache_hits;
    // Same prompt again, plus the short prompt beside it: the long one reuses its two full
    // blocks (32 latent rows per layer) from the cache.
    let second = run_engine(&mut core, &[&long.ids, &cs[0].ids]);
    assert!(core.stats().prefix_cache_hits > hits, "no prefix-cache hit");
    assert_eq!(second[0].cached, 32, "both full prompt blocks served from the cache");
    check_against_reference(&second[0], long, "prefix-cached");
    check_against_reference(&second[1], &cs[0], "beside the cached one");
}

fn gated_case(name: &str) -> (MlaLayer, MlaConfig, Vec<f32>, Vec<f32>, usize) {
    let d = dir();
    let meta: Value = serde_json::from_str(&std::fs::read_to_string(d.join("mla_gated.json")).unwrap()).unwrap();
    let m = &meta["cases"][name];
    let cfg = MlaConfig::from_hf_config(&d.join("mla_gated.json"), &m["config"]).unwrap();
    assert!(cfg.output_gate);
    let src = SafetensorsSource::open(&d).unwrap();
    let layer = MlaLayer::load(&cfg, &src, &format!("{name}.self_attn")).expect("loading the gated MLA layer");
    let len = m["len"].as_u64().unwrap() as usize;
    let x = src.load(&format!("{name}.input"), &[len, cfg.hidden_size]).unwrap().as_slice().to_vec();
    let y = src.load(&format!("{name}.output"), &[len, cfg.hidden_size]).unwrap().as_slice().to_vec();
    (layer, cfg, x, y, len)
}

#[test]
fn gated_mla_layers_match_transformers_whole_and_stepped() {
    for (name, rope) in [("dsv3_gated", true), ("kimi_gated", false)] {
        let (layer, cfg, x, want, len) = gated_case(name);
        assert_eq!(cfg.rope.is_some(), rope);
        let h = cfg.hidden_size;
        let layout = CacheLayout { layers: vec![Some(layer.cache_shape())], recurrent_bytes_per_seq: 0 };
        // Whole prompt in one pass.
        let mut kv = ContiguousKvCache::for_layout(&layout, 1);
        let rows: Vec<BatchRow> = (0..len).map(|pos| BatchRow { seq: 0, pos }).collect();
        let whole = layer.forward(&x, &rows, &mut kv, 0);
        let d = max_diff(&whole, &want);
        assert!(d <= 1e-4, "{name}: whole-prompt max diff {d}");
        // A prefill of 11 then one token per call, through the cache.
        let mut kv = ContiguousKvCache::for_layout(&layout, 1);
        let mut stepped = layer.forward(&x[..11 * h], &rows[..11], &mut kv, 0);
        for p in 11..len {
            stepped.extend(layer.forward(&x[p * h..(p + 1) * h], &rows[p..p + 1], &mut kv, 0));
        }
        let d = max_diff(&stepped, &want);
        assert!(d <= 1e-4, "{name}: stepped max diff {d}");
        eprintln!("{name}: max |out| {:.2}, max diff {d:.2e}", want.iter().fold(0.0f32, |a, v| a.max(v.abs())));
    }
}

/// A copy of the tiny model directory with `edit` applied to its config.json.
fn edited_copy(tag: &str, edit: impl Fn(&mut Value)) -> PathBuf {
    let src = dir().join("model");
    let dst = std::env::temp_dir().join(format!("wasmserve-dsv3-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dst);
    std::fs::create_dir_all(&dst).unwrap();
    for f in ["model.safetensors", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"] {
        std::fs::copy(src.join(f), dst.join(f)).unwrap();
    }
    let mut cfg: Value = serde_json::from_str(&std::fs::read_to_string(src.join("config.json")).unwrap()).unwrap();
    edit(&mut cfg);
    std::fs::write(dst.join("config.json"), serde_json::to_string(&cfg).unwrap()).unwrap();
    dst
}

fn load_err(p: &Path) -> LoadError {
    match wasmserve::model::load(p) {
        Ok(_) => panic!("{} loaded", p.display()),
        Err(e) => e,
    }
}

#[test]
fn load_errors_are_named() {
    // q_lora_rank null: the layer looks for a plain q_proj, which the checkpoint lacks.
    let p = edited_copy("noqlora", |c| c["q_lora_rank"] = Value::Null);
    match load_err(&p) {
        LoadError::MissingTensor { tensor, .. } => assert_eq!(tensor, "model.layers.0.self_attn.q_proj.weight"),
        e => panic!("expected a missing tensor, got {e}"),
    }
    // A latent width that disagrees with the stored kv_a_proj_with_mqa.
    let p = edited_copy("lora", |c| c["kv_lora_rank"] = 20.into());
    match load_err(&p) {
        LoadError::BadTensor { tensor, detail, .. } => {
            assert!(tensor.contains("self_attn.") && detail.contains("shape"), "{tensor}: {detail}")
        }
        e => panic!("expected a shape error, got {e}"),
    }
    for (tag, edit, needle) in [
        (
            "nolora",
            Box::new(|c: &mut Value| {
                c.as_object_mut().unwrap().remove("kv_lora_rank");
            }) as Box<dyn Fn(&mut Value)>,
            "kv_lora_rank",
        ),
        ("rope", Box::new(|c: &mut Value| c["rope_parameters"]["rope_type"] = "longrope".into()), "longrope"),
        ("rope_dim", Box::new(|c: &mut Value| c["qk_rope_head_dim"] = 7.into()), "odd"),
        ("experts", Box::new(|c: &mut Value| c["num_experts_per_tok"] = 9.into()), "num_experts_per_tok"),
    ] {
        let p = edited_copy(tag, edit);
        match load_err(&p) {
            LoadError::Config { detail, .. } => assert!(detail.contains(needle), "{tag}: {detail}"),
            e => panic!("{tag}: expected a config error, got {e}"),
        }
        let _ = std::fs::remove_dir_all(&p);
    }
}

/// A contiguous cache that stores every row as E4M3 codes with one scale per row and reads back
/// the decoded values: what the paged FP8 pool should hold for `groups = 1` rows, built here
/// from the kernel's quantizer alone.
struct FakeFp8(ContiguousKvCache);

fn fp8_round(x: &[f32]) -> Vec<f32> {
    let mut codes = vec![0u8; x.len()];
    let scale = if x.is_empty() { 1.0 } else { quantize_e4m3(x, &mut codes) };
    codes.iter().map(|&c| E4M3_TO_F32[c as usize] * scale).collect()
}

impl KvCache for FakeFp8 {
    fn write(&mut self, layer: usize, seq: usize, pos: usize, k: &[f32], v: &[f32]) {
        self.0.write(layer, seq, pos, &fp8_round(k), &fp8_round(v));
    }
    fn key(&self, layer: usize, seq: usize, pos: usize) -> KvRow<'_> {
        self.0.key(layer, seq, pos)
    }
    fn value(&self, layer: usize, seq: usize, pos: usize) -> KvRow<'_> {
        self.0.value(layer, seq, pos)
    }
}

#[test]
fn fp8_latent_cache_equals_per_row_e4m3_rounding() {
    // Later steps may pick a different token (greedy margins are as small as 0.01 here), so the
    // first generated token's logprobs — computed over the whole FP8-cached prompt — are compared
    // with `forward` over a cache of E4M3-rounded rows; the drift from f32 transformers is reported.
    let cs = cases();
    let m = model();
    let vocab = m.config().vocab_size;
    let mut core =
        engine(EngineConfig { kv_dtype: KvDtype::Fp8E4m3, enable_prefix_caching: false, ..Default::default() });
    let prompts: Vec<&[u32]> = cs.iter().map(|c| c.ids.as_slice()).collect();
    let out = run_engine(&mut core, &prompts);
    let (mut worst, mut drift) = (0.0f32, 0.0f32);
    for (r, c) in out.iter().zip(&cs) {
        assert_eq!(r.tokens.len(), 32);
        let n = c.ids.len();
        let mut kv = FakeFp8(ContiguousKvCache::for_layout(&m.model.cache_layout(), 1));
        let rows: Vec<BatchRow> = (0..n).map(|pos| BatchRow { seq: 0, pos }).collect();
        let want = log_softmax(&m.model.forward(&c.ids, &rows, &mut kv, &[n - 1])[..vocab]);
        let exact = log_softmax(&c.steps[0]);
        for &(t, l) in &r.logprobs[0].1 {
            worst = worst.max(kernels::compare::abs_error(l, want[t as usize]));
            drift = drift.max(kernels::compare::abs_error(l, exact[t as usize]));
        }
    }
    eprintln!("fp8 latent cache: first-step top-5 logprobs vs E4M3-rounded forward {worst:.1e}, vs f32 transformers {drift:.3}");
    assert!(worst <= 1e-4, "the FP8 pool differs from per-row E4M3 rounding: {worst}");
}

#[test]
fn int8_quantized_experts_load_packed_and_stay_close() {
    // `wasmserve quantize` with a policy that packs only the routed experts (compressed-tensors
    // INT8, groups of 16); the model loads them through WeightSource::linear as packed Linears.
    let out = std::env::temp_dir().join(format!("wasmserve-dsv3-int8-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&out);
    let policy = out.with_extension("policy.json");
    std::fs::write(
        &policy,
        r#"{"format": "int", "bits": 8, "group_size": 16,
        "rules": [{"match": "re:.*mlp\\.experts\\."}, {"match": "re:.*", "skip": true}]}"#,
    )
    .unwrap();
    wasmserve::quantize::run(wasmserve::quantize::QuantizeArgs {
        input: dir().join("model"),
        output: out.clone(),
        format: None,
        bits: None,
        group_size: None,
        policy: Some(policy.clone()),
        quiet: true,
    })
    .expect("quantizing the experts");
    let cfg: Value = serde_json::from_str(&std::fs::read_to_string(out.join("config.json")).unwrap()).unwrap();
    assert_eq!(cfg["quantization_config"]["quant_method"], "compressed-tensors");
    let q = wasmserve::model::load(&out).expect("loading the INT8-expert checkpoint");
    let vocab = q.config().vocab_size;
    // Routing is discontinuous: a rounding-sized change can flip a token's top-2 experts, which
    // moves that position's logits by O(1). So: most positions close, the median very close.
    let mut per = Vec::new();
    for case in cases() {
        let n = case.ids.len();
        let mut kv = ContiguousKvCache::for_layout(&q.model.cache_layout(), 1);
        let rows: Vec<BatchRow> = (0..n).map(|pos| BatchRow { seq: 0, pos }).collect();
        let logits = q.model.forward(&case.ids, &rows, &mut kv, &(0..n).collect::<Vec<_>>());
        per.extend(
            case.prefill.iter().enumerate().map(|(p, want)| max_diff(&logits[p * vocab..(p + 1) * vocab], want)),
        );
    }
    per.sort_by(f32::total_cmp);
    let (median, p90) = (per[per.len() / 2], per[per.len() * 9 / 10]);
    eprintln!("INT8 experts: per-position max logit diff vs transformers (f32 experts): median {median:.3}, p90 {p90:.3}, max {:.3}", per[per.len() - 1]);
    assert!(median > 1e-3, "the experts do not look quantized (median diff {median})");
    assert!(median < 0.1 && p90 < 0.2, "INT8 experts drift too far: median {median}, p90 {p90}");
    let _ = std::fs::remove_dir_all(&out);
    let _ = std::fs::remove_file(&policy);
}
