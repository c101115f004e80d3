//! Shared helpers for the end-to-end tests: locating and loading the real default model.
#![allow(dead_code)]

use std::path::PathBuf;
use std::sync::{Arc, OnceLock};

use wasmserve::model::LoadedModel;

pub fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_path_buf()
}

pub fn default_model_path() -> PathBuf {
    let p = repo_root().join(wasmserve::DEFAULT_MODEL_PATH);
    assert!(p.exists(), "{} is missing: run scripts/fetch-default-model first", p.display());
    p
}

/// The SmolLM2 model, loaded once per test binary.
pub fn smollm2() -> Arc<LoadedModel> {
    static MODEL: OnceLock<Arc<LoadedModel>> = OnceLock::new();
    MODEL.get_or_init(|| Arc::new(wasmserve::model::load(&default_model_path()).expect("loading SmolLM2"))).clone()
}

/// One prompt of a transformers reference fixture (`reference.json`, written by the
/// tests/reference/make_*.py scripts): prompt ids, the logits of every prompt position, the
/// greedy continuation and the logits of each decode step (step 0 = the last prompt position).
pub struct ReferenceCase {
    pub ids: Vec<u32>,
    pub prefill: Vec<Vec<f32>>,
    pub greedy: Vec<u32>,
    pub steps: Vec<Vec<f32>>,
}

/// The `cases` of a reference.json.
pub fn reference_cases(path: &std::path::Path) -> Vec<ReferenceCase> {
    use serde_json::Value;
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let r: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let rows = |v: &Value| -> Vec<Vec<f32>> {
        v.as_array()
            .unwrap()
            .iter()
            .map(|r| r.as_array().unwrap().iter().map(|x| x.as_f64().unwrap() as f32).collect())
            .collect()
    };
    let ids = |v: &Value| -> Vec<u32> { v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect() };
    r["cases"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| ReferenceCase {
            ids: ids(&c["ids"]),
            prefill: rows(&c["prefill_logits"]),
            greedy: ids(&c["greedy_ids"]),
            steps: rows(&c["step_logits"]),
        })
        .collect()
}

/// Steps `core` until it has nothing left to do (failing a test whose engine never finishes).
pub fn drive(core: &mut wasmserve::engine::EngineCore) {
    let mut steps = 0;
    while core.step() {
        steps += 1;
        assert!(steps < 10_000, "engine did not finish");
    }
}

/// Greedy tokens per prompt (`max_tokens` each, EOS ignored) from an engine serving `model`
/// with `config`; all prompts are submitted at once, so they share batches.
pub fn engine_greedy_tokens(
    model: Arc<LoadedModel>,
    config: wasmserve::engine::EngineConfig,
    prompts: &[&[u32]],
    max_tokens: usize,
) -> Vec<Vec<u32>> {
    use tokio::sync::mpsc::unbounded_channel;
    use wasmserve::engine::{EngineCore, EngineEvent, EngineRequest};
    use wasmserve::sampling::SamplingParams;
    let mut core = EngineCore::new(model, config);
    let mut rxs = Vec::new();
    for (i, p) in prompts.iter().enumerate() {
        let (tx, rx) = unbounded_channel();
        let req = EngineRequest {
            prompt_ids: p.to_vec(),
            sampling: SamplingParams::greedy(),
            max_tokens,
            ignore_eos: true,
            ..Default::default()
        };
        core.add_request(i as u64 + 1, req, tx).unwrap();
        rxs.push(rx);
    }
    drive(&mut core);
    rxs.iter_mut()
        .map(|rx| {
            let mut toks = Vec::new();
            while let Ok(ev) = rx.try_recv() {
                match ev {
                    EngineEvent::Token { token, .. } => toks.push(token),
                    EngineEvent::PromptLogprobs(_) => panic!("prompt logprobs were not asked for"),
                    EngineEvent::Error(e) => panic!("engine error: {e}"),
                    _ => {}
                }
            }
            toks
        })
        .collect()
}

/// A copy of the tiny Kimi-Linear checkpoint whose MLA layer keeps only its first 3 of 4 heads
/// (rows of `q_proj` and `kv_b_proj`, columns of `o_proj`), so that its 3 KDA heads and its MLA
/// heads both divide over 3 tensor-parallel ranks. Still a valid Kimi-Linear; its reference is
/// the one-device model (proven against transformers on the 4-head original). The caller removes
/// the directory (`tag` keeps concurrent test binaries apart).
pub fn kimi_linear_three_mla_heads(tag: &str) -> PathBuf {
    use safetensors::tensor::{Dtype, TensorView};
    let src = repo_root().join("tests/reference/kimi_linear/model");
    let dst = std::env::temp_dir().join(format!("wasmserve-kimi-tp-{}-{tag}", std::process::id()));
    std::fs::create_dir_all(&dst).unwrap();
    for f in ["tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"] {
        std::fs::copy(src.join(f), dst.join(f)).unwrap();
    }
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(src.join("config.json")).unwrap()).unwrap();
    let heads = cfg["num_attention_heads"].as_u64().unwrap() as usize;
    assert_eq!(heads, 4, "the fixture's MLA heads");
    cfg["num_attention_heads"] = 3.into();
    cfg["num_key_value_heads"] = 3.into();
    std::fs::write(dst.join("config.json"), serde_json::to_string_pretty(&cfg).unwrap()).unwrap();
    let bytes = std::fs::read(src.join("model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut out: Vec<(String, Vec<usize>, Vec<u8>)> = Vec::new();
    for (name, t) in st.tensors() {
        assert_eq!(t.dtype(), Dtype::F32, "{name}");
        let (shape, data) = (t.shape().to_vec(), t.data());
        let row_bytes = |s: &[usize]| s[1..].iter().product::<usize>() * 4;
        // Layer 2 is the MLA layer (layers 0, 1 and 3 are KDA).
        let (shape, data) = if name == "model.layers.2.self_attn.q_proj.weight"
            || name == "model.layers.2.self_attn.kv_b_proj.weight"
        {
            // Per-head rows: keep the first 3 heads' rows.
            let keep = shape[0] / heads * 3;
            (vec![keep, shape[1]], data[..keep * row_bytes(&shape)].to_vec())
        } else if name == "model.layers.2.self_attn.o_proj.weight" {
            // Per-head columns.
            let keep = shape[1] / heads * 3;
            let rows: Vec<u8> = data.chunks(row_bytes(&shape)).flat_map(|r| r[..keep * 4].to_vec()).collect();
            (vec![shape[0], keep], rows)
        } else {
            (shape, data.to_vec())
        };
        out.push((name, shape, data));
    }
    let views: Vec<(String, TensorView<'_>)> =
        out.iter().map(|(n, s, d)| (n.clone(), TensorView::new(Dtype::F32, s.clone(), d).unwrap())).collect();
    safetensors::serialize_to_file(views, None, &dst.join("model.safetensors")).unwrap();
    dst
}
