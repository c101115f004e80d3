//! The default model (SmolLM2-135M-Instruct Q4_1 GGUF) against transformers loading the same file
//! (fixtures written by tests/reference/make_fixtures.py): tokenizer ids, logits and greedy
//! continuations, plus the chat answer.

mod common;

use serde_json::Value;
use wasmserve::chat_template::jinja::JinjaChatTemplate;
use wasmserve::chat_template::{ChatTemplate, ChatTemplateInput};
use wasmserve::engine::block_pool::KvDtype;
use wasmserve::engine::{EngineConfig, EngineCore, EngineEvent, EngineRequest};
use wasmserve::generate::{generate, GenerateRequest};
use wasmserve::model::kv::{BatchRow, ContiguousKvCache};
use wasmserve::sampling::SamplingParams;

/// Max |ours - transformers| over every checked logit. Both run f32 on the same dequantised
/// weights (our Q4_1/Q8_0 decoding is bit-exact with gguf-py's); the rest is summation order.
const LOGIT_TOLERANCE: f32 = 5e-4;
/// Max |ours - transformers| with `--cpu-activations int8` (see its test).
const INT8_LOGIT_BOUND: f32 = 3.0;

fn fixtures() -> Value {
    let p = common::repo_root().join("tests/reference/smollm2/fixtures.json");
    serde_json::from_str(&std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))).unwrap()
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()
}

fn f32s(v: &Value) -> Vec<f32> {
    v.as_array().unwrap().iter().map(|x| x.as_f64().unwrap() as f32).collect()
}

/// All positions' logits for a prompt, computed in one prefill.
fn prefill_logits(prompt: &[u32]) -> Vec<Vec<f32>> {
    let m = common::smollm2();
    let cfg = m.config();
    let rows: Vec<BatchRow> = (0..prompt.len()).map(|pos| BatchRow { seq: 0, pos }).collect();
    let all: Vec<usize> = (0..prompt.len()).collect();
    let mut kv = ContiguousKvCache::new(cfg.num_layers(), cfg.kv_width(), 1);
    let flat = m.model.forward(prompt, &rows, &mut kv, &all);
    flat.chunks(cfg.vocab_size).map(|c| c.to_vec()).collect()
}

#[test]
fn tokenizer_ids_match_transformers() {
    let f = fixtures();
    let m = common::smollm2();
    let mut checked = 0;
    for p in f["prompts"].as_array().unwrap() {
        assert_eq!(
            m.tokenizer.encode(p["text"].as_str().unwrap(), true).unwrap(),
            ids(&p["ids"]),
            "prompt {:?}",
            p["text"]
        );
        checked += 1;
    }
    for c in f["tokenizer_cases"].as_array().unwrap() {
        assert_eq!(
            m.tokenizer.encode(c["text"].as_str().unwrap(), false).unwrap(),
            ids(&c["ids"]),
            "case {:?}",
            c["text"]
        );
        checked += 1;
    }
    assert!(checked >= 30);
}

#[test]
fn logits_match_transformers() {
    let f = fixtures();
    let dir = common::repo_root().join("tests/reference/smollm2");
    let mut worst = 0.0f32;
    for p in f["prompts"].as_array().unwrap() {
        let prompt = ids(&p["ids"]);
        let ours = prefill_logits(&prompt);
        let probe_ids = ids(&p["logits_probe_ids"]);
        for (pos, probe) in p["logits_probe"].as_array().unwrap().iter().enumerate() {
            for (&id, want) in probe_ids.iter().zip(f32s(probe)) {
                worst = worst.max(kernels::compare::abs_error(ours[pos][id as usize], want));
            }
        }
        for (pos, top) in p["logits_top"].as_array().unwrap().iter().enumerate() {
            for pair in top.as_array().unwrap() {
                let (id, want) = (pair[0].as_u64().unwrap() as usize, pair[1].as_f64().unwrap() as f32);
                worst = worst.max(kernels::compare::abs_error(ours[pos][id], want));
            }
            // The best token agrees at every position.
            let best = top[0][0].as_u64().unwrap() as u32;
            assert_eq!(wasmserve::sampling::argmax(&ours[pos]), best, "argmax at position {pos}");
        }
        let bytes = std::fs::read(dir.join(p["last_logits_file"].as_str().unwrap())).unwrap();
        let last: Vec<f32> = bytes.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect();
        assert_eq!(last.len(), ours.last().unwrap().len());
        worst = worst.max(kernels::compare::max_abs_error(ours.last().unwrap(), &last));
    }
    eprintln!("max |logit - transformers| = {worst}");
    assert!(worst <= LOGIT_TOLERANCE, "max logit difference {worst} > {LOGIT_TOLERANCE}");
}

#[test]
fn greedy_continuations_match_transformers() {
    let f = fixtures();
    let m = common::smollm2();
    for p in f["prompts"].as_array().unwrap() {
        let want = ids(&p["greedy_ids"]);
        let req = GenerateRequest {
            prompt_ids: ids(&p["ids"]),
            sampling: SamplingParams::greedy(),
            max_tokens: want.len(),
            stop: vec![],
            ignore_eos: true,
            kv_dtype: KvDtype::F32,
        };
        let out = generate(&m, &req, |_| {}).unwrap();
        assert_eq!(out.tokens, want, "greedy continuation of {:?}", p["text"]);
    }
}

#[test]
fn chat_template_and_answer_match_transformers() {
    let f = fixtures();
    let m = common::smollm2();
    let chat = &f["chat"];
    let tmpl = JinjaChatTemplate::new(
        m.tokenizer.chat_template.as_deref().unwrap(),
        m.tokenizer.bos_token.as_deref(),
        m.tokenizer.eos_token.as_deref(),
    )
    .unwrap();
    let messages = chat["messages"].as_array().unwrap().clone();
    let prompt =
        tmpl.render(&ChatTemplateInput { messages, add_generation_prompt: true, ..Default::default() }).unwrap();
    assert_eq!(prompt, chat["prompt"].as_str().unwrap(), "rendered chat prompt");
    let prompt_ids = m.tokenizer.encode(&prompt, true).unwrap();
    assert_eq!(prompt_ids, ids(&chat["ids"]));
    let req = GenerateRequest {
        prompt_ids,
        sampling: SamplingParams::greedy(),
        max_tokens: 32,
        stop: vec![],
        ignore_eos: false,
        kv_dtype: KvDtype::F32,
    };
    let out = generate(&m, &req, |_| {}).unwrap();
    assert!(out.text.contains("Paris"), "answer: {:?}", out.text);
    assert_eq!(out.text, chat["greedy_text"].as_str().unwrap().trim_end());
}

/// The accuracy cost of FP8 KV storage, measured on the fixture prompts: how many of the 32
/// transformers greedy tokens the engine reproduces before the first divergence, f32 vs fp8.
#[test]
fn fp8_kv_cache_accuracy_on_fixtures() {
    let f = fixtures();
    let agree = |dtype: KvDtype| -> (usize, usize) {
        let mut core = EngineCore::new(common::smollm2(), EngineConfig { kv_dtype: dtype, ..Default::default() });
        let mut rxs = Vec::new();
        let prompts = f["prompts"].as_array().unwrap();
        for (i, p) in prompts.iter().enumerate() {
            let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
            let req = EngineRequest {
                prompt_ids: ids(&p["ids"]),
                sampling: SamplingParams::greedy(),
                max_tokens: 32,
                ignore_eos: true,
                ..Default::default()
            };
            core.add_request(i as u64, req, tx).unwrap();
            rxs.push(rx);
        }
        while core.step() {}
        let (mut same, mut total) = (0, 0);
        for (p, rx) in prompts.iter().zip(rxs.iter_mut()) {
            let mut got = Vec::new();
            while let Ok(ev) = rx.try_recv() {
                if let EngineEvent::Token { token, .. } = ev {
                    got.push(token);
                }
            }
            let want = ids(&p["greedy_ids"]);
            total += want.len();
            same += got.iter().zip(&want).take_while(|(a, b)| a == b).count();
        }
        (same, total)
    };
    let (f32_same, total) = agree(KvDtype::F32);
    let (bf16_same, _) = agree(KvDtype::Bf16);
    let (fp8_same, _) = agree(KvDtype::Fp8E4m3);
    eprintln!("greedy tokens matching transformers before first divergence: f32 KV {f32_same}/{total}, bf16 KV {bf16_same}/{total}, fp8 KV {fp8_same}/{total}");
    assert_eq!(f32_same, total, "the paged engine in f32 reproduces transformers exactly");
    assert!(bf16_same * 3 >= total * 2, "bf16 KV diverges too early: {bf16_same}/{total}");
    assert!(fp8_same * 3 >= total, "fp8 KV diverges too early: {fp8_same}/{total}");
}

/// The accuracy cost of `--cpu-activations int8` (8-bit inputs to the Q4_1/Q8_0 layers, as
/// llama.cpp computes), measured against transformers on the fixtures: the largest logit error
/// and how many greedy tokens survive before the first divergence. The bounds are a few times
/// the measured values (docs/engine-benchmarks.md), to catch a broken kernel, not to pin noise.
#[test]
fn int8_activation_accuracy_on_fixtures() {
    use wasmserve::model::activations::CpuActivations;
    use wasmserve::model::LoadOptions;
    let f = fixtures();
    let opts = LoadOptions { cpu_activations: CpuActivations::Int8, ..Default::default() };
    let m = wasmserve::model::load_with_options(&common::default_model_path(), &opts).unwrap();
    let cfg = m.config();
    let (mut worst, mut argmax_same, mut positions, mut greedy_same, mut greedy_total) = (0.0f32, 0, 0, 0, 0);
    let mut differs_from_f32 = false;
    for p in f["prompts"].as_array().unwrap() {
        let prompt = ids(&p["ids"]);
        let rows: Vec<BatchRow> = (0..prompt.len()).map(|pos| BatchRow { seq: 0, pos }).collect();
        let all: Vec<usize> = (0..prompt.len()).collect();
        let mut kv = ContiguousKvCache::new(cfg.num_layers(), cfg.kv_width(), 1);
        let flat = m.model.forward(&prompt, &rows, &mut kv, &all);
        let ours: Vec<&[f32]> = flat.chunks(cfg.vocab_size).collect();
        differs_from_f32 |= prefill_logits(&prompt).iter().zip(&ours).any(|(a, b)| a.as_slice() != *b);
        for (pos, top) in p["logits_top"].as_array().unwrap().iter().enumerate() {
            for pair in top.as_array().unwrap() {
                let (id, want) = (pair[0].as_u64().unwrap() as usize, pair[1].as_f64().unwrap() as f32);
                worst = worst.max((ours[pos][id] - want).abs());
            }
            positions += 1;
            argmax_same += usize::from(wasmserve::sampling::argmax(ours[pos]) == top[0][0].as_u64().unwrap() as u32);
        }
        let want = ids(&p["greedy_ids"]);
        let req = GenerateRequest {
            prompt_ids: prompt,
            sampling: SamplingParams::greedy(),
            max_tokens: want.len(),
            stop: vec![],
            ignore_eos: true,
            kv_dtype: KvDtype::F32,
        };
        let got = generate(&m, &req, |_| {}).unwrap().tokens;
        greedy_total += want.len();
        greedy_same += got.iter().zip(&want).take_while(|(a, b)| a == b).count();
    }
    eprintln!("int8 activations vs transformers: max |logit diff| {worst:.4} on the top-5 logits, argmax {argmax_same}/{positions} prompt positions, greedy {greedy_same}/{greedy_total} before the first divergence");
    assert!(differs_from_f32, "--cpu-activations int8 changed nothing: the int8 kernel is not in use");
    assert!(worst < INT8_LOGIT_BOUND, "int8 activations: logit error {worst} >= {INT8_LOGIT_BOUND}");
    assert!(
        argmax_same * 10 >= positions * 9,
        "int8 activations: argmax agrees at only {argmax_same}/{positions} positions"
    );
    assert!(greedy_same * 3 >= greedy_total, "int8 activations diverge too early: {greedy_same}/{greedy_total}");
}
