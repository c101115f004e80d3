//! The Hugging Face directory path (sharded bf16 safetensors + index, tokenizer.json,
//! chat_template.jinja) against transformers on a tiny random Llama made by
//! tests/reference/make_tiny_llama.py.

mod common;

use serde_json::Value;
use wasmserve::chat_template::jinja::JinjaChatTemplate;
use wasmserve::chat_template::{ChatTemplate, ChatTemplateInput};
use wasmserve::engine::block_pool::KvDtype;
use wasmserve::generate::{generate, GenerateRequest};
use wasmserve::model::kv::{BatchRow, ContiguousKvCache};
use wasmserve::sampling::SamplingParams;

/// Max |ours - transformers| over all logits; both compute in f32 from the same bf16 weights.
const LOGIT_TOLERANCE: f32 = 2e-4;

#[test]
fn sharded_bf16_checkpoint_matches_transformers() {
    let dir = common::repo_root().join("tests/reference/tiny_llama");
    let reference: Value = serde_json::from_str(&std::fs::read_to_string(dir.join("reference.json")).unwrap()).unwrap();
    let m = wasmserve::model::load(&dir).expect("loading the tiny HF checkpoint");
    let cfg = m.config();
    assert_eq!(cfg.vocab_size, reference["vocab_size"].as_u64().unwrap() as usize);
    for case in reference["cases"].as_array().unwrap() {
        let text = case["text"].as_str().unwrap();
        let want_ids: Vec<u32> = case["ids"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect();
        assert_eq!(m.tokenizer.encode(text, true).unwrap(), want_ids, "tokenizer.json ids for {text:?}");

        let rows: Vec<BatchRow> = (0..want_ids.len()).map(|pos| BatchRow { seq: 0, pos }).collect();
        let all_rows: Vec<usize> = (0..want_ids.len()).collect();
        let mut kv = ContiguousKvCache::new(cfg.num_layers(), cfg.kv_width(), 1);
        let logits = m.model.forward(&want_ids, &rows, &mut kv, &all_rows);
        let mut max_diff = 0.0f32;
        for (p, want_row) in case["logits"].as_array().unwrap().iter().enumerate() {
            for (v, w) in want_row.as_array().unwrap().iter().enumerate() {
                max_diff = max_diff
                    .max(kernels::compare::abs_error(logits[p * cfg.vocab_size + v], w.as_f64().unwrap() as f32));
            }
        }
        assert!(max_diff <= LOGIT_TOLERANCE, "{text:?}: max logit difference {max_diff}");

        let req = GenerateRequest {
            prompt_ids: want_ids.clone(),
            sampling: SamplingParams::greedy(),
            max_tokens: 12,
            stop: vec![],
            ignore_eos: true,
            kv_dtype: KvDtype::F32,
        };
        let got = generate(&m, &req, |_| {}).unwrap().tokens;
        let want: Vec<u32> =
            case["greedy_ids"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect();
        assert_eq!(got, want, "greedy continuation of {text:?}");
    }
    let tmpl =
        JinjaChatTemplate::new(m.tokenizer.chat_template.as_deref().expect("chat_template.jinja read"), None, None)
            .unwrap();
    let out = tmpl
        .render(&ChatTemplateInput {
            messages: vec![serde_json::json!({"role": "user", "content": "hi"})],
            add_generation_prompt: true,
            ..Default::default()
        })
        .unwrap();
    assert_eq!(out, "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n");
    assert_eq!(m.tokenizer.eos_token_ids, vec![2]);
}
