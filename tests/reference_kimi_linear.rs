//! The tiny Kimi-Linear model (KDA layers 1, 2, 4 + one latent-attention layer, dense first
//! layer, MoE with shared experts) against transformers' `KimiLinearForCausalLM`
//! (tests/reference/make_tiny_kimi_linear.py: prefill logits and 32 greedy decode steps with each
//! step's full logits), through `forward` directly and through the paged engine: batched,
//! preempted mid-decode, with identical prompts (prefix caching must not reuse KV blocks whose
//! recurrent state it does not have), with chunked prefill, and with n = 2 (forked state).

mod common;

use std::collections::BTreeMap;
use std::sync::{Arc, OnceLock};

use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};
use wasmserve::engine::{EngineConfig, EngineCore, EngineEvent, EngineRequest};
use wasmserve::model::kv::BatchRow;
use wasmserve::model::LoadedModel;
use wasmserve::sampling::SamplingParams;

/// Max |ours − transformers| on logits (and log-probabilities), which are O(1–5): both f32, with
/// different summation orders, and transformers' chunked KDA form for prefills; the reference is
/// rounded to 1e-5. Measured: 2.7e-5 (prefill), 1.7e-5 (decode, engine log-probabilities).
const TOLERANCE: f32 = 2e-4;

use common::ReferenceCase as Case;

fn dir() -> std::path::PathBuf {
    common::repo_root().join("tests/reference/kimi_linear/model")
}

fn model() -> Arc<LoadedModel> {
    static M: OnceLock<Arc<LoadedModel>> = OnceLock::new();
    M.get_or_init(|| Arc::new(wasmserve::model::load(&dir()).expect("loading the tiny Kimi-Linear model"))).clone()
}

fn cases() -> Vec<Case> {
    common::reference_cases(&dir().join("reference.json"))
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    kernels::compare::max_abs_error(a, b)
}

fn log_softmax(x: &[f32]) -> Vec<f32> {
    let m = x.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
    let lse = m + x.iter().map(|v| (v - m).exp()).sum::<f32>().ln();
    x.iter().map(|v| v - lse).collect()
}

#[test]
fn model_declares_kda_state_and_latent_rows() {
    let m = model();
    let layout = m.model.cache_layout();
    // Layers 0, 1, 3 are KDA (no per-token cache); layer 2 caches a 16-wide latent + 8-wide rot key.
    assert_eq!(
        layout.layers.iter().map(|l| l.map(|s| (s.key_width, s.value_width))).collect::<Vec<_>>(),
        vec![None, None, Some((16, 8)), None]
    );
    // Per KDA layer: conv history 3·48·3 floats + 3 heads of 16×16, fp32.
    assert_eq!(layout.recurrent_bytes_per_seq, 3 * 4 * (3 * 48 * 3 + 3 * 16 * 16));
    assert!(m.model.new_recurrent_state().is_some());
}

#[test]
fn forward_matches_transformers_prefill_and_decode() {
    let m = model();
    let mut worst = (0.0f32, 0.0f32);
    for c in cases() {
        let mut kv = m.model.contiguous_cache(1);
        let rows: Vec<BatchRow> = (0..c.ids.len()).map(|pos| BatchRow { seq: 0, pos }).collect();
        let all: Vec<usize> = (0..rows.len()).collect();
        let logits = m.model.forward(&c.ids, &rows, &mut kv, &all);
        let vocab = m.config().vocab_size;
        for (p, want) in c.prefill.iter().enumerate() {
            let d = max_diff(&logits[p * vocab..(p + 1) * vocab], want);
            worst.0 = worst.0.max(d);
            assert!(d < TOLERANCE, "prefill position {p} of a {}-token prompt: max diff {d}", c.ids.len());
        }
        let mut last = logits[(rows.len() - 1) * vocab..].to_vec();
        for (k, want) in c.steps.iter().enumerate() {
            let d = max_diff(&last, want);
            worst.1 = worst.1.max(d);
            assert!(d < TOLERANCE, "decode step {k}: max diff {d}");
            let tok = c.greedy[k];
            let pos = c.ids.len() + k;
            last = m.model.forward(&[tok], &[BatchRow { seq: 0, pos }], &mut kv, &[0]);
        }
    }
    eprintln!("max |logit diff| vs transformers: prefill {:.2e}, decode {:.2e}", worst.0, worst.1);
}

struct Collected {
    tokens: BTreeMap<usize, Vec<u32>>,
    logprobs: BTreeMap<usize, Vec<Vec<f32>>>,
    cached: usize,
}

fn drain(rx: &mut UnboundedReceiver<EngineEvent>, vocab: usize) -> Collected {
    let mut c = Collected { tokens: BTreeMap::new(), logprobs: BTreeMap::new(), cached: 0 };
    while let Ok(ev) = rx.try_recv() {
        match ev {
            EngineEvent::Token { index, token, logprob, .. } => {
                c.tokens.entry(index).or_default().push(token);
                let mut full = vec![f32::NAN; vocab];
                for (t, lp) in logprob.expect("logprobs requested").top {
                    full[t as usize] = lp;
                }
                c.logprobs.entry(index).or_default().push(full);
            }
            EngineEvent::Finished { cached_tokens, .. } => c.cached = cached_tokens,
            EngineEvent::PromptLogprobs(_) => panic!("prompt logprobs were not asked for"),
            EngineEvent::Error(e) => panic!("engine error: {e}"),
        }
    }
    c
}

/// Greedy, 32 tokens, with the whole log-softmax of every step (top `vocab` logprobs).
fn request(ids: &[u32], n: usize) -> EngineRequest {
    let vocab = model().config().vocab_size;
    EngineRequest {
        prompt_ids: ids.to_vec(),
        sampling: SamplingParams::greedy(),
        max_tokens: 32,
        ignore_eos: true,
        logprobs: Some(vocab),
        n,
        ..Default::default()
    }
}

fn engine_config() -> EngineConfig {
    EngineConfig { max_logprobs: model().config().vocab_size, ..Default::default() }
}

/// Runs the requests to completion; `staggered`: each is submitted only after the previous one
/// finished (so later ones could only reuse what earlier ones left in the cache).
fn run(cfg: EngineConfig, reqs: Vec<EngineRequest>, staggered: bool) -> (Vec<Collected>, EngineCore) {
    let m = model();
    let vocab = m.config().vocab_size;
    let mut core = EngineCore::new(m, cfg);
    let mut out = Vec::new();
    let mut rxs = Vec::new();
    let drive = |core: &mut EngineCore| {
        let mut steps = 0;
        while core.step() {
            steps += 1;
            assert!(steps < 10_000, "engine did not finish");
        }
    };
    for (i, r) in reqs.into_iter().enumerate() {
        let (tx, rx) = unbounded_channel();
        core.add_request(i as u64 + 1, r, tx).unwrap();
        rxs.push(rx);
        if staggered {
            drive(&mut core);
        }
    }
    drive(&mut core);
    for rx in &mut rxs {
        out.push(drain(rx, vocab));
    }
    (out, core)
}

/// Every choice of `got` produced transformers' greedy tokens with matching log-probabilities.
fn check(case: &Case, got: &Collected, what: &str) -> f32 {
    let mut worst = 0.0f32;
    for (index, toks) in &got.tokens {
        assert_eq!(toks, &case.greedy, "{what}: choice {index} tokens differ from transformers");
        for (k, lp) in got.logprobs[index].iter().enumerate() {
            let d = max_diff(lp, &log_softmax(&case.steps[k]));
            worst = worst.max(d);
            assert!(d < TOLERANCE, "{what}: choice {index} step {k}: max logprob diff {d}");
        }
    }
    worst
}

#[test]
fn engine_batch_matches_transformers() {
    let cs = cases();
    let (got, core) = run(engine_config(), cs.iter().map(|c| request(&c.ids, 1)).collect(), false);
    let worst = cs.iter().zip(&got).map(|(c, g)| check(c, g, "batched")).fold(0.0, f32::max);
    eprintln!("engine, batched: max |logprob diff| {worst:.2e}");
    let pool = core.pool();
    assert_eq!(
        pool.recurrent.available(),
        pool.recurrent.capacity(),
        "finished sequences must return their state slots"
    );
    assert_eq!(pool.available(), pool.num_blocks());
}

#[test]
fn engine_matches_after_preemption() {
    let cs = cases();
    let bytes = model().model.cache_layout().recurrent_bytes_per_seq;
    // Three state slots and 5 blocks of 16 tokens (one 96-byte latent row per token): the three
    // sequences need 10 blocks by the end, so the newest are preempted and recomputed.
    let cfg = EngineConfig { kv_cache_bytes: 3 * bytes + 5 * 16 * 96, max_num_seqs: 3, ..engine_config() };
    let (got, core) = run(cfg, cs.iter().map(|c| request(&c.ids, 1)).collect(), false);
    assert!(core.stats().preemptions_total > 0, "the pool was meant to force a preemption");
    let worst = cs.iter().zip(&got).map(|(c, g)| check(c, g, "preempted")).fold(0.0, f32::max);
    eprintln!("engine, {} preemptions: max |logprob diff| {worst:.2e}", core.stats().preemptions_total);
    assert_eq!(core.pool().recurrent.available(), 3);
}

#[test]
fn engine_identical_prompts_do_not_reuse_kv_without_state() {
    let cs = cases();
    let c = &cs[1]; // 23 tokens: one full 16-token block a prefix cache could offer
    let cfg = EngineConfig { enable_prefix_caching: true, ..engine_config() };
    let (got, core) = run(cfg, vec![request(&c.ids, 1), request(&c.ids, 1)], true);
    for (i, g) in got.iter().enumerate() {
        check(c, g, &format!("repeat {i}"));
        assert_eq!(g.cached, 0, "request {i} was served cached KV blocks without their recurrent state");
    }
    assert_eq!(core.stats().prefix_cache_hits, 0);
}

#[test]
fn engine_chunked_prefill_carries_state_across_chunks() {
    let cs = cases();
    // 5 tokens a step: the 23-token prompt takes 5 chunks, interleaved with the other sequences.
    let cfg = EngineConfig { max_num_batched_tokens: 5, ..engine_config() };
    let (got, _) = run(cfg, cs.iter().map(|c| request(&c.ids, 1)).collect(), false);
    for (c, g) in cs.iter().zip(&got) {
        check(c, g, "chunked");
    }
}

#[test]
fn engine_forked_choices_continue_a_copy_of_the_state() {
    let cs = cases();
    let (got, _) = run(engine_config(), vec![request(&cs[0].ids, 3)], false);
    assert_eq!(got[0].tokens.len(), 3);
    check(&cs[0], &got[0], "n=3");
    // Not enough slots for every choice: the rest recompute their prompt when a slot frees up.
    let bytes = model().model.cache_layout().recurrent_bytes_per_seq;
    let cfg = EngineConfig { kv_cache_bytes: 2 * bytes + 8 * 16 * 96, max_num_seqs: 2, ..engine_config() };
    let (got, core) = run(cfg, vec![request(&cs[2].ids, 3)], false);
    assert_eq!(core.pool().recurrent.capacity(), 2);
    assert_eq!(got[0].tokens.len(), 3);
    check(&cs[2], &got[0], "n=3 with 2 slots");
}
