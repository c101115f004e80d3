//! Engine tests on the real SmolLM2 model: batched, chunked, prefix-cached and preempted runs must
//! produce exactly what a lone run (the simple contiguous-cache generator) produces.

mod common;

use std::collections::BTreeMap;

use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};
use wasmserve::engine::block_pool::KvDtype;
use wasmserve::engine::{EngineConfig, EngineCore, EngineEvent, EngineRequest, SubmitError};
use wasmserve::generate::{generate, FinishReason, GenerateRequest};
use wasmserve::sampling::SamplingParams;

fn prompts() -> Vec<Vec<u32>> {
    let m = common::smollm2();
    let texts = [
        "The capital of France is",
        "Once upon a time, in a land far away, there lived a",
        "def fibonacci(n):\n    ",
        "1, 2, 3, 4,",
        "The three primary colors are",
        "Water boils at a temperature of",
        "In 1492, Columbus",
        "A haiku about autumn:\n",
        "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog. Then the fox",
        "SELECT * FROM users WHERE",
        "Photosynthesis is the process by which",
        "My favourite recipe for pancakes starts with",
        "Q: What is 7 times 8?\nA:",
        "The largest planet in our solar system is",
        "Hello",
        "Translate to French: good morning ->",
    ];
    texts.iter().map(|t| m.tokenizer.encode(t, true).unwrap()).collect()
}

fn alone(prompt: &[u32], max_tokens: usize) -> Vec<u32> {
    let m = common::smollm2();
    let req = GenerateRequest {
        prompt_ids: prompt.to_vec(),
        sampling: SamplingParams::greedy(),
        max_tokens,
        stop: vec![],
        ignore_eos: true,
        kv_dtype: KvDtype::F32,
    };
    generate(&m, &req, |_| {}).unwrap().tokens
}

fn greedy(prompt: &[u32], max_tokens: usize) -> EngineRequest {
    EngineRequest {
        prompt_ids: prompt.to_vec(),
        sampling: SamplingParams::greedy(),
        max_tokens,
        ignore_eos: true,
        ..Default::default()
    }
}

struct Collected {
    tokens: BTreeMap<usize, Vec<u32>>,
    finish: BTreeMap<usize, FinishReason>,
    cached: usize,
}

fn drain(rx: &mut UnboundedReceiver<EngineEvent>) -> Collected {
    let mut c = Collected { tokens: BTreeMap::new(), finish: BTreeMap::new(), cached: 0 };
    while let Ok(ev) = rx.try_recv() {
        match ev {
            EngineEvent::Token { index, token, .. } => c.tokens.entry(index).or_default().push(token),
            EngineEvent::Finished { index, reason, cached_tokens, .. } => {
                c.finish.insert(index, reason);
                c.cached = cached_tokens;
            }
            EngineEvent::PromptLogprobs(_) => panic!("prompt logprobs were not asked for"),
            EngineEvent::Error(e) => panic!("engine error: {e}"),
        }
    }
    c
}

fn run_all(core: &mut EngineCore, reqs: Vec<EngineRequest>) -> Vec<Collected> {
    let mut rxs = Vec::new();
    for (i, r) in reqs.into_iter().enumerate() {
        let (tx, rx) = unbounded_channel();
        core.add_request(i as u64 + 1, r, tx).unwrap();
        rxs.push(rx);
    }
    let mut steps = 0;
    while core.step() {
        steps += 1;
        assert!(steps < 100_000, "engine did not finish");
    }
    rxs.iter_mut().map(drain).collect()
}

fn core(cfg: EngineConfig) -> EngineCore {
    EngineCore::new(common::smollm2(), cfg)
}

#[test]
fn sixteen_concurrent_requests_equal_lone_runs() {
    let prompts = prompts();
    let lens: Vec<usize> = (0..16).map(|i| 4 + (i * 5) % 17).collect();
    let mut c = core(EngineConfig { max_num_batched_tokens: 64, ..Default::default() });
    let out = run_all(&mut c, prompts.iter().zip(&lens).map(|(p, &n)| greedy(p, n)).collect());
    for (i, (p, &n)) in prompts.iter().zip(&lens).enumerate() {
        assert_eq!(out[i].tokens[&0], alone(p, n), "request {i} differs from its lone run");
        assert_eq!(out[i].finish[&0], FinishReason::Length);
    }
    assert_eq!(c.pool().unreferenced(), c.pool().num_blocks(), "all blocks back after completion");
}

#[test]
fn prefix_cache_hit_skips_recompute_and_gives_identical_output() {
    let m = common::smollm2();
    let long = m.tokenizer.encode(&"The history of the Roman Empire spans many centuries. ".repeat(8), true).unwrap();
    assert!(long.len() > 64);
    let mut c = core(EngineConfig::default());
    let first = run_all(&mut c, vec![greedy(&long, 12)]);
    let prompt_tokens_after_first = c.stats().prompt_tokens_total;
    let hits_before = c.stats().prefix_cache_hits;
    let second = run_all(&mut c, vec![greedy(&long, 12)]);
    let s = c.stats();
    let computed = s.prompt_tokens_total - prompt_tokens_after_first;
    assert!(s.prefix_cache_hits > hits_before, "no prefix-cache hit");
    assert_eq!(second[0].cached, (long.len() - 1) / 16 * 16, "every full prompt block served from cache");
    assert_eq!(computed as usize, long.len() - second[0].cached, "only the uncached tail was computed");
    assert_eq!(first[0].tokens[&0], second[0].tokens[&0]);
    assert_eq!(first[0].tokens[&0], alone(&long, 12));
    // A different salt (tenant) must not share the cached blocks.
    let mut other = greedy(&long, 4);
    other.cache_salt = "tenant-b".into();
    let third = run_all(&mut c, vec![other]);
    assert_eq!(third[0].cached, 0, "salted request reused another tenant's cache");
}

#[test]
fn preemption_under_tiny_block_budget_completes_identically() {
    let prompts = prompts();
    let mc = common::smollm2();
    let cfgm = mc.config();
    let block_bytes = 2 * cfgm.num_layers() * 16 * cfgm.kv_width() * 4;
    // 12 blocks = 192 tokens for 8 sequences that need ~30-60 tokens each: preemption is forced.
    let mut c =
        core(EngineConfig { kv_cache_bytes: 12 * block_bytes, max_num_batched_tokens: 64, ..Default::default() });
    let chosen: Vec<Vec<u32>> = prompts.into_iter().take(8).collect();
    let out = run_all(&mut c, chosen.iter().map(|p| greedy(p, 24)).collect());
    assert!(c.stats().preemptions_total > 0, "the budget did not force preemption");
    for (i, p) in chosen.iter().enumerate() {
        assert_eq!(out[i].tokens[&0], alone(p, 24), "request {i} changed after preemption");
    }
    assert_eq!(c.pool().unreferenced(), c.pool().num_blocks());
}

#[test]
fn abort_mid_stream_frees_all_blocks() {
    let prompts = prompts();
    let mut c = core(EngineConfig::default());
    let (tx, mut rx) = unbounded_channel();
    c.add_request(1, greedy(&prompts[1], 200), tx).unwrap();
    let (tx2, rx2) = unbounded_channel();
    c.add_request(2, greedy(&prompts[2], 200), tx2).unwrap();
    for _ in 0..5 {
        c.step();
    }
    assert!(drain(&mut rx).tokens[&0].len() >= 3);
    assert!(c.pool().unreferenced() < c.pool().num_blocks());
    c.abort(1);
    drop(rx2); // a client that hangs up is aborted by the engine itself on the next token
    c.step();
    assert!(!c.has_work());
    assert_eq!(c.pool().unreferenced(), c.pool().num_blocks(), "pool back to full");
}

#[test]
fn too_long_and_invalid_requests_are_refused() {
    let c = core(EngineConfig::default());
    let too_long = vec![1u32; c.max_model_len() + 1];
    assert!(matches!(c.validate(&greedy(&too_long, 1)), Err(SubmitError::PromptTooLong { .. })));
    assert!(matches!(c.validate(&greedy(&[], 1)), Err(SubmitError::Invalid(_))));
    assert!(matches!(c.validate(&greedy(&[999_999], 1)), Err(SubmitError::Invalid(_))));
    let mut bad = greedy(&[1, 2], 1);
    bad.sampling.top_p = 0.0;
    assert!(matches!(c.validate(&bad), Err(SubmitError::Invalid(_))));
}

#[test]
fn n_choices_share_prompt_blocks_and_each_equals_the_lone_run() {
    let prompts = prompts();
    let mut c = core(EngineConfig::default());
    let mut req = greedy(&prompts[8], 10);
    req.n = 3;
    let out = run_all(&mut c, vec![req]);
    let want = alone(&prompts[8], 10);
    for i in 0..3 {
        assert_eq!(out[0].tokens[&i], want, "choice {i}");
    }
    // Seeded sampling: choices differ from each other but the whole request is reproducible.
    let sampled = |c: &mut EngineCore| {
        let mut r = greedy(&prompts[0], 12);
        r.n = 2;
        r.sampling = SamplingParams { temperature: 1.0, seed: Some(7), ..Default::default() };
        run_all(c, vec![r]).remove(0).tokens
    };
    let a = sampled(&mut c);
    assert_eq!(a, sampled(&mut c));
    assert_ne!(a[&0], a[&1]);
    assert_eq!(c.pool().unreferenced(), c.pool().num_blocks());
}

#[test]
fn fp8_kv_cache_stays_close_to_f32() {
    let prompts = prompts();
    let mut f32c = core(EngineConfig::default());
    let mut fp8c = core(EngineConfig { kv_dtype: KvDtype::Fp8E4m3, ..Default::default() });
    let reqs: Vec<EngineRequest> = prompts.iter().take(6).map(|p| greedy(p, 16)).collect();
    let a = run_all(&mut f32c, reqs.clone());
    let b = run_all(&mut fp8c, reqs);
    let (mut same, mut total) = (0, 0);
    for (x, y) in a.iter().zip(&b) {
        for (p, q) in x.tokens[&0].iter().zip(&y.tokens[&0]) {
            total += 1;
            if p != q {
                break;
            }
            same += 1;
        }
    }
    eprintln!("fp8 KV: {same}/{total} greedy tokens agree with f32 before the first divergence");
    assert!(same * 2 >= total, "fp8 KV diverges too early: {same}/{total}");
}

#[test]
fn text_held_back_for_a_possible_stop_string_is_released_at_eos() {
    let m = common::smollm2();
    let prompt = m
        .tokenizer
        .encode("<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n", true)
        .unwrap();
    let mut c = core(EngineConfig::default());
    let (tx, mut rx) = unbounded_channel();
    // "." could begin ".!", so it is held back until EOS ends the choice.
    let req = EngineRequest {
        prompt_ids: prompt,
        sampling: SamplingParams::greedy(),
        max_tokens: 32,
        stop: vec![".!".into()],
        ..Default::default()
    };
    c.add_request(1, req, tx).unwrap();
    while c.step() {}
    let mut text = String::new();
    while let Ok(ev) = rx.try_recv() {
        match ev {
            EngineEvent::Token { text: t, .. } | EngineEvent::Finished { text: t, .. } => text.push_str(&t),
            EngineEvent::PromptLogprobs(_) => panic!("prompt logprobs were not asked for"),
            EngineEvent::Error(e) => panic!("{e}"),
        }
    }
    assert_eq!(text, "The capital of France is Paris.");
}

#[test]
fn a_flooding_tenant_does_not_starve_another() {
    let prompts = prompts();
    let mut c = core(EngineConfig { max_num_seqs: 4, max_num_batched_tokens: 128, ..Default::default() });
    let mut flood = Vec::new();
    for i in 0..24 {
        let (tx, rx) = unbounded_channel();
        let mut r = greedy(&prompts[i % 16], 3);
        r.tenant = "flood".into();
        c.add_request(i as u64, r, tx).unwrap();
        flood.push(rx);
    }
    let (tx, mut victim) = unbounded_channel();
    let mut r = greedy(&prompts[0], 3);
    r.tenant = "quiet".into();
    c.add_request(100, r, tx).unwrap();
    let mut flood_started = vec![false; flood.len()];
    loop {
        assert!(c.step(), "engine ran out of work before the quiet tenant was served");
        for (i, rx) in flood.iter_mut().enumerate() {
            while let Ok(ev) = rx.try_recv() {
                flood_started[i] |= matches!(ev, EngineEvent::Token { .. });
            }
        }
        if let Ok(EngineEvent::Token { .. }) = victim.try_recv() {
            break;
        }
    }
    let started = flood_started.iter().filter(|&&s| s).count();
    eprintln!("quiet tenant's first token came after {started} of 24 flooding requests had started");
    assert!(started <= 8, "FCFS-like starvation: {started} flooding requests started first");
    while c.step() {}
}

#[test]
fn json_object_mode_yields_one_valid_object() {
    let m = common::smollm2();
    let prompt = m
        .tokenizer
        .encode(
            "<|im_start|>user\nDescribe a cat as JSON with keys name and age.<|im_end|>\n<|im_start|>assistant\n",
            true,
        )
        .unwrap();
    let mut c = core(EngineConfig::default());
    for (i, sampling) in
        [SamplingParams::greedy(), SamplingParams { temperature: 1.0, seed: Some(3), ..Default::default() }]
            .into_iter()
            .enumerate()
    {
        let (tx, mut rx) = unbounded_channel();
        let req = EngineRequest {
            prompt_ids: prompt.clone(),
            sampling,
            max_tokens: 120,
            constraint: Some(wasmserve::sampling::constraint::ConstraintSpec::JsonObject {
                whitespace: Default::default(),
            }),
            ..Default::default()
        };
        c.add_request(i as u64, req, tx).unwrap();
        while c.step() {}
        let (mut text, mut reason) = (String::new(), None);
        while let Ok(ev) = rx.try_recv() {
            match ev {
                EngineEvent::Token { text: t, .. } => text.push_str(&t),
                EngineEvent::Finished { text: t, reason: r, .. } => {
                    text.push_str(&t);
                    reason = Some(r);
                }
                EngineEvent::PromptLogprobs(_) => panic!("prompt logprobs were not asked for"),
                EngineEvent::Error(e) => panic!("{e}"),
            }
        }
        eprintln!("json mode output ({reason:?}): {text:?}");
        if reason == Some(FinishReason::Stop) {
            let v: serde_json::Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("not JSON ({e}): {text}"));
            assert!(v.is_object());
        } else {
            // Cut by max_tokens: still a valid prefix of an object.
            let mut st = wasmserve::sampling::json_constraint::JsonState::default();
            assert!(st.feed(text.as_bytes()), "not a JSON prefix: {text}");
        }
    }
}

#[test]
fn slot_reserve_keeps_a_slot_for_other_tenants() {
    let prompts = prompts();
    let mut c = core(EngineConfig { max_num_seqs: 4, tenant_slot_reserve: 1, ..Default::default() });
    let mut flood = Vec::new();
    for i in 0..8 {
        let (tx, rx) = unbounded_channel();
        let mut r = greedy(&prompts[i], 40);
        r.tenant = "flood".into();
        c.add_request(i as u64, r, tx).unwrap();
        flood.push(rx);
    }
    for _ in 0..3 {
        c.step();
    }
    assert_eq!(c.stats().running, 3, "the flooding tenant holds all but the reserved slot");
    let (tx, mut quiet) = unbounded_channel();
    let mut r = greedy(&prompts[9], 2);
    r.tenant = "quiet".into();
    c.add_request(100, r, tx).unwrap();
    c.step();
    assert!(matches!(quiet.try_recv(), Ok(EngineEvent::Token { .. })), "the quiet tenant was admitted at once");
    while c.step() {}
}

#[test]
fn flooding_tenant_sits_out_the_quiet_tenants_prefill_step_only() {
    // The quiet tenant's prompt is computed in a step of its own (its time to first token does
    // not pay for the flood's batch), and the flood runs again in the very next step.
    let prompts = prompts();
    let mut c = core(EngineConfig { max_num_seqs: 8, tenant_slot_reserve: 1, ..Default::default() });
    let mut flood = Vec::new();
    for i in 0..32 {
        let (tx, rx) = unbounded_channel();
        let mut r = greedy(&prompts[i % 16], 6 + i % 5);
        r.tenant = "flood".into();
        c.add_request(i as u64, r, tx).unwrap();
        flood.push(rx);
    }
    let mut finished = vec![false; flood.len()];
    // Tokens the flood emitted since the last call (noting which requests finished).
    let mut flood_tokens = |flood: &mut Vec<UnboundedReceiver<EngineEvent>>| {
        let mut n = 0;
        for (i, rx) in flood.iter_mut().enumerate() {
            while let Ok(ev) = rx.try_recv() {
                match ev {
                    EngineEvent::Token { .. } => n += 1,
                    EngineEvent::Finished { reason, .. } => finished[i] = reason == FinishReason::Length,
                    EngineEvent::PromptLogprobs(_) => panic!("prompt logprobs were not asked for"),
                    EngineEvent::Error(e) => panic!("engine error: {e}"),
                }
            }
        }
        n
    };
    for _ in 0..4 {
        assert!(c.step());
    }
    assert_eq!(c.stats().running, 7, "the flood holds all but the reserved slot");
    flood_tokens(&mut flood);
    for round in 0..3 {
        let (tx, mut quiet) = unbounded_channel();
        let mut r = greedy(&prompts[8 + round], 2);
        r.tenant = "quiet".into();
        c.add_request(100 + round as u64, r, tx).unwrap();
        assert!(c.step());
        assert!(
            matches!(quiet.try_recv(), Ok(EngineEvent::Token { .. })),
            "the quiet prompt ran in the first step after it arrived"
        );
        assert_eq!(flood_tokens(&mut flood), 0, "the flood's rows ran in the quiet tenant's prefill step");
        assert!(c.step());
        assert!(flood_tokens(&mut flood) > 0, "the flood was held back two steps running");
        while quiet.try_recv().is_ok() {}
    }
    let mut steps = 0;
    while c.step() {
        steps += 1;
        assert!(steps < 10_000);
    }
    flood_tokens(&mut flood);
    assert!(finished.iter().all(|&f| f), "some flood requests did not finish: {finished:?}");
}

/// Prompt token `j + 1`'s logprob from the contiguous-cache forward with every row's logits.
fn prompt_logprobs_alone(prompt: &[u32]) -> Vec<f32> {
    use wasmserve::model::kv::{BatchRow, ContiguousKvCache};
    let m = common::smollm2();
    let cfg = m.config();
    let rows: Vec<BatchRow> = (0..prompt.len()).map(|pos| BatchRow { seq: 0, pos }).collect();
    let scoring: Vec<usize> = (0..prompt.len() - 1).collect();
    let mut kv = ContiguousKvCache::new(cfg.num_layers(), cfg.kv_width(), 1);
    let flat = m.model.forward(prompt, &rows, &mut kv, &scoring);
    flat.chunks(cfg.vocab_size)
        .zip(&prompt[1..])
        .map(|(l, &t)| l[t as usize] - wasmserve::sampling::log_sum_exp(l))
        .collect()
}

/// Runs `reqs` to the end; per request, its prompt logprobs (if sent, checked to come before
/// its first token) and its cached prompt tokens.
fn run_scored(
    core: &mut EngineCore,
    reqs: Vec<EngineRequest>,
) -> Vec<(Option<Vec<wasmserve::engine::TokenLogprob>>, usize)> {
    let mut rxs = Vec::new();
    for (i, r) in reqs.into_iter().enumerate() {
        let (tx, rx) = unbounded_channel();
        core.add_request(1000 + i as u64, r, tx).unwrap();
        rxs.push(rx);
    }
    while core.step() {}
    rxs.iter_mut()
        .map(|rx| {
            let (mut lp, mut cached, mut tokens) = (None, 0, 0);
            while let Ok(ev) = rx.try_recv() {
                match ev {
                    EngineEvent::PromptLogprobs(l) => {
                        assert!(lp.is_none() && tokens == 0, "prompt logprobs sent twice or after a token");
                        lp = Some(l);
                    }
                    EngineEvent::Token { .. } => tokens += 1,
                    EngineEvent::Finished { cached_tokens, .. } => cached = cached_tokens,
                    EngineEvent::Error(e) => panic!("engine error: {e}"),
                }
            }
            (lp, cached)
        })
        .collect()
}

fn assert_scores(got: &[wasmserve::engine::TokenLogprob], prompt: &[u32], k: usize) {
    let want = prompt_logprobs_alone(prompt);
    assert_eq!(
        got.iter().map(|l| l.token).collect::<Vec<_>>(),
        prompt[1..],
        "one score per prompt token after the first"
    );
    for (j, (g, w)) in got.iter().zip(&want).enumerate() {
        assert!((g.logprob - w).abs() < 1e-4, "prompt token {}: {} vs {w}", j + 1, g.logprob);
        assert_eq!(g.top.len(), k);
        assert!(g.top[0].1 >= g.logprob - 1e-6 && g.top.windows(2).all(|p| p[0].1 >= p[1].1));
    }
}

#[test]
fn prompt_logprobs_survive_chunking_preemption_and_skip_the_prefix_cache() {
    use wasmserve::engine::core::PROMPT_LOGPROB_ROWS;
    let m = common::smollm2();
    let long = m.tokenizer.encode(&"The history of the Roman Empire spans many centuries. ".repeat(32), true).unwrap();
    assert!(long.len() > 2 * PROMPT_LOGPROB_ROWS, "three scored chunks");
    let mut c = core(EngineConfig::default());
    run_all(&mut c, vec![greedy(&long, 2)]);
    let mut scored = greedy(&long, 2);
    scored.prompt_logprobs = Some(3);
    let out = run_scored(&mut c, vec![scored]);
    assert_eq!(out[0].1, 0, "a scored prompt is computed whole, not served from the prefix cache");
    assert_scores(out[0].0.as_ref().expect("prompt logprobs sent"), &long, 3);

    // A budget that forces preemption (as above); the scored request, newest, is a victim first.
    let mc = common::smollm2();
    let block_bytes = 2 * mc.config().num_layers() * 16 * mc.config().kv_width() * 4;
    let mut c =
        core(EngineConfig { kv_cache_bytes: 12 * block_bytes, max_num_batched_tokens: 64, ..Default::default() });
    let chosen: Vec<Vec<u32>> = prompts().into_iter().take(8).collect();
    let mut reqs: Vec<EngineRequest> = chosen.iter().map(|p| greedy(p, 24)).collect();
    reqs[7].prompt_logprobs = Some(1);
    let out = run_scored(&mut c, reqs);
    assert!(c.stats().preemptions_total > 0, "the budget did not force preemption");
    assert!(out[..7].iter().all(|o| o.0.is_none()), "only the scored request gets prompt logprobs");
    assert_scores(out[7].0.as_ref().expect("prompt logprobs sent"), &chosen[7], 1);
    assert_eq!(c.pool().unreferenced(), c.pool().num_blocks());
}
