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
    let rows = |v: &Value| -> Vec<Vec<f32>> { v.as_array().unwrap().iter().map(|r| r.as_array().unwrap().iter().map(|x| x.as_f64().unwrap() as f32).collect()).collect() };
    let ids = |v: &Value| -> Vec<u32> { v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect() };
    r["cases"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| ReferenceCase { ids: ids(&c["ids"]), prefill: rows(&c["prefill_logits"]), greedy: ids(&c["greedy_ids"]), steps: rows(&c["step_logits"]) })
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
pub fn engine_greedy_tokens(model: Arc<LoadedModel>, config: wasmserve::engine::EngineConfig, prompts: &[&[u32]], max_tokens: usize) -> Vec<Vec<u32>> {
    use tokio::sync::mpsc::unbounded_channel;
    use wasmserve::engine::{EngineCore, EngineEvent, EngineRequest};
    use wasmserve::sampling::SamplingParams;
    let mut core = EngineCore::new(model, config);
    let mut rxs = Vec::new();
    for (i, p) in prompts.iter().enumerate() {
        let (tx, rx) = unbounded_channel();
        let req = EngineRequest { prompt_ids: p.to_vec(), sampling: SamplingParams::greedy(), max_tokens, ignore_eos: true, ..Default::default() };
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
                    EngineEvent::Error(e) => panic!("engine error: {e}"),
                    _ => {}
                }
            }
            toks
        })
        .collect()
}
