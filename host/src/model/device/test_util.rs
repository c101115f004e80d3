//! Helpers the device forwards' tests share: the simulator (or a skip), reference fixtures'
//! token lists, and the engine serving a placed model against transformers' greedy tokens.

use kernels::sim::SimGpu;

use crate::model::LoadedModel;

/// The CPU simulator, or `None` after printing why the test skips (a failure instead under
/// `WASMSERVE_REQUIRE_SIM=1`, as CI sets).
pub fn sim(test: &str) -> Option<SimGpu> {
    match SimGpu::sim() {
        Ok(g) => Some(g),
        Err(e) if std::env::var_os("WASMSERVE_REQUIRE_SIM").is_some_and(|v| v == "1") => panic!("{test}: {e}"),
        Err(e) => {
            eprintln!("SKIPPED {test}: {e}");
            None
        }
    }
}

pub fn ids(v: &serde_json::Value) -> Vec<u32> {
    v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()
}

/// The engine serving `m` (a model placed on devices: K/V only in their pools) with blocks of
/// `block_size`: each reference case's prompt greedily continued for 12 tokens equals
/// transformers' (`greedy_ids`); the first case runs with n = 2, so its second choice forks the
/// prompt's blocks (a copy-on-write of the partial last one, on the device).
pub fn engine_greedy_matches_transformers(
    m: LoadedModel,
    reference: &serde_json::Value,
    block_size: usize,
    what: &str,
) {
    use crate::engine::{EngineConfig, EngineCore, EngineEvent, EngineRequest};
    use crate::sampling::SamplingParams;
    const TOKENS: usize = 12;
    let m = std::sync::Arc::new(m);
    let cfg = EngineConfig { block_size, kv_cache_bytes: 1 << 20, max_num_batched_tokens: 7, ..Default::default() };
    let mut core = EngineCore::try_new(m, cfg).unwrap();
    assert!(core.pool().is_external(), "no host K/V for a device model");
    let mut rxs = Vec::new();
    for (i, case) in reference["cases"].as_array().unwrap().iter().enumerate() {
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        let n = if i == 0 { 2 } else { 1 };
        let req = EngineRequest {
            prompt_ids: ids(&case["ids"]),
            sampling: SamplingParams::greedy(),
            max_tokens: TOKENS,
            ignore_eos: true,
            n,
            ..Default::default()
        };
        core.add_request(i as u64 + 1, req, tx).unwrap();
        let want = ids(&case["greedy_ids"]);
        rxs.push((rx, want[..TOKENS.min(want.len())].to_vec()));
    }
    while core.step() {}
    for (mut rx, want) in rxs {
        let mut got: std::collections::BTreeMap<usize, Vec<u32>> = Default::default();
        while let Ok(ev) = rx.try_recv() {
            match ev {
                EngineEvent::Token { index, token, .. } => got.entry(index).or_default().push(token),
                EngineEvent::PromptLogprobs(_) => panic!("prompt logprobs were not asked for"),
                EngineEvent::Error(e) => panic!("{what}: engine error: {e}"),
                _ => {}
            }
        }
        assert!(!got.is_empty(), "{what}: no tokens");
        for (index, toks) in got {
            assert_eq!(toks, want, "{what}: greedy continuation {index} through the device path");
        }
    }
    assert_eq!(core.pool().unreferenced(), core.pool().num_blocks(), "{what}: every block released");
}
