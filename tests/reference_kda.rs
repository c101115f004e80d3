//! A single Kimi Delta Attention layer against transformers' own KDA code
//! (tests/reference/make_tiny_kimi_linear.py): the Kimi-Linear variant (softplus forget gate,
//! low-rank output gate) and the K3 variant (lower-bound gate, full-rank `g_proj`), each run
//!  - whole prompts of two sequences in one batch (transformers: its chunked path),
//!  - a prefill then one token per step (transformers: through its cache, recurrent path),
//!  - ragged chunks of both sequences interleaved, rows of the two sequences mixed in a batch.

mod common;

use serde_json::{json, Value};
use wasmserve::model::format::hf_source::SafetensorsSource;
use wasmserve::model::format::source::WeightSource;
use wasmserve::model::kv::BatchRow;
use wasmserve::model::layers::kda::state::KdaState;
use wasmserve::model::layers::kda::{KdaConfig, KdaLayer};

/// Max |ours − transformers|; outputs are O(1–4), both in f32 (different summation orders, and
/// transformers' chunked form of the recurrence for whole prompts).
const TOLERANCE: f32 = 1e-4;

struct Case {
    layer: KdaLayer,
    inputs: Vec<Vec<f32>>,
    whole: Vec<Vec<f32>>,
    stepped: Vec<Vec<f32>>,
    splits: Vec<usize>,
}

fn load_case(name: &str) -> Case {
    let dir = common::repo_root().join("tests/reference/kimi_linear");
    let meta: Value = serde_json::from_str(&std::fs::read_to_string(dir.join("kda_layers.json")).unwrap()).unwrap();
    let m = &meta["cases"][name];
    // The config the way a Kimi checkpoint writes it.
    let mut lac =
        json!({"num_heads": m["num_heads"], "head_dim": m["head_dim"], "short_conv_kernel_size": m["conv_kernel"]});
    if m["gate_lower_bound"].is_number() {
        lac["gate_lower_bound"] = m["gate_lower_bound"].clone();
    }
    if m["use_full_rank_gate"].as_bool().unwrap() {
        lac["use_full_rank_gate"] = json!(true);
    }
    let raw = json!({"hidden_size": m["hidden_size"], "rms_norm_eps": m["rms_norm_eps"], "linear_attn_config": lac});
    let cfg = KdaConfig::from_hf_config(&dir.join("config.json"), &raw).unwrap();
    assert_eq!(cfg.full_rank_gate, m["use_full_rank_gate"].as_bool().unwrap());
    let src = SafetensorsSource::open(&dir).unwrap();
    let layer = KdaLayer::load(cfg.clone(), &src, &format!("{name}.self_attn")).expect("loading the KDA layer");
    let seqs = m["sequences"].as_array().unwrap();
    let get = |what: &str, i: usize, len: usize| {
        src.load(&format!("{name}.{what}.{i}"), &[len, cfg.hidden_size]).unwrap().as_slice().to_vec()
    };
    let lens: Vec<usize> = seqs.iter().map(|s| s["len"].as_u64().unwrap() as usize).collect();
    Case {
        layer,
        inputs: lens.iter().enumerate().map(|(i, &l)| get("input", i, l)).collect(),
        whole: lens.iter().enumerate().map(|(i, &l)| get("output", i, l)).collect(),
        stepped: lens.iter().enumerate().map(|(i, &l)| get("stepped", i, l)).collect(),
        splits: seqs.iter().map(|s| s["split"].as_u64().unwrap() as usize).collect(),
    }
}

/// Runs a schedule: each step lists (sequence, how many next tokens); returns every sequence's
/// outputs in position order.
fn run(case: &Case, schedule: &[Vec<(usize, usize)>]) -> Vec<Vec<f32>> {
    let cfg = case.layer.config();
    let d = cfg.hidden_size;
    let mut states: Vec<KdaState> = case.inputs.iter().map(|_| KdaState::new(cfg)).collect();
    let mut outs: Vec<Vec<f32>> = case.inputs.iter().map(|_| Vec::new()).collect();
    let mut done = vec![0usize; case.inputs.len()];
    for step in schedule {
        let (mut x, mut rows) = (Vec::new(), Vec::new());
        for &(s, count) in step {
            for pos in done[s]..done[s] + count {
                x.extend_from_slice(&case.inputs[s][pos * d..(pos + 1) * d]);
                rows.push(BatchRow { seq: s, pos });
            }
            done[s] += count;
        }
        let mut refs: Vec<&mut KdaState> = states.iter_mut().collect();
        let y = case.layer.forward(&x, &rows, &mut refs);
        for (i, r) in rows.iter().enumerate() {
            assert_eq!(outs[r.seq].len(), r.pos * d);
            outs[r.seq].extend_from_slice(&y[i * d..(i + 1) * d]);
        }
    }
    for (s, st) in states.iter().enumerate() {
        assert_eq!(st.tokens, case.inputs[s].len() / d, "state counts every token");
    }
    outs
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    kernels::compare::max_abs_error(a, b)
}

fn check(name: &str) {
    let case = load_case(name);
    let d = case.layer.config().hidden_size;
    let lens: Vec<usize> = case.inputs.iter().map(|x| x.len() / d).collect();

    // Whole prompts, both sequences in one batch (the second one's rows first).
    let outs = run(&case, &[vec![(1, lens[1]), (0, lens[0])]]);
    for s in 0..lens.len() {
        let e = max_diff(&outs[s], &case.whole[s]);
        eprintln!("{name} seq {s} whole prompt: max diff {e:.2e}");
        assert!(e <= TOLERANCE, "{name} seq {s} whole prompt: max diff {e}");
    }

    // transformers' prefill + cached decode, and ours: the same split, one token per step after.
    let mut schedule = vec![vec![(0, case.splits[0]), (1, case.splits[1])]];
    let mut left: Vec<usize> = (0..lens.len()).map(|s| lens[s] - case.splits[s]).collect();
    while left.iter().any(|&l| l > 0) {
        let step: Vec<(usize, usize)> = (0..lens.len()).filter(|&s| left[s] > 0).map(|s| (s, 1)).collect();
        for &(s, _) in &step {
            left[s] -= 1;
        }
        schedule.push(step);
    }
    let outs = run(&case, &schedule);
    for s in 0..lens.len() {
        let e = max_diff(&outs[s], &case.stepped[s]);
        eprintln!("{name} seq {s} prefill + decode: max diff {e:.2e}");
        assert!(e <= TOLERANCE, "{name} seq {s} prefill + decode: max diff {e}");
    }

    // Ragged chunks (chunked prefill of a long prompt beside another sequence's decode steps).
    let mut schedule = Vec::new();
    let (mut a, mut b) = (0usize, 0usize);
    while a < lens[0] || b < lens[1] {
        let mut step = Vec::new();
        let ca = 13.min(lens[0] - a);
        let cb = if b == 0 { 3.min(lens[1]) } else { 1.min(lens[1] - b) };
        if cb > 0 {
            step.push((1, cb));
        }
        if ca > 0 {
            step.push((0, ca));
        }
        a += ca;
        b += cb;
        schedule.push(step);
    }
    let outs = run(&case, &schedule);
    for s in 0..lens.len() {
        let e = max_diff(&outs[s], &case.whole[s]);
        eprintln!("{name} seq {s} ragged chunks: max diff {e:.2e}");
        assert!(e <= TOLERANCE, "{name} seq {s} ragged chunks: max diff {e}");
    }
}

#[test]
fn kimi_linear_kda_layer_matches_transformers() {
    check("kimi_linear");
}

#[test]
fn k3_kda_layer_matches_transformers() {
    check("k3");
}

#[test]
fn bad_kda_configs_are_named_errors() {
    let f = std::path::Path::new("config.json");
    let e = KdaConfig::from_hf_config(f, &json!({"hidden_size": 8, "linear_attn_config": {"head_dim": 4}}))
        .unwrap_err()
        .to_string();
    assert!(e.contains("num_heads is missing"), "{e}");
    let e = KdaConfig::from_hf_config(
        f,
        &json!({"hidden_size": 8, "linear_attn_config": {"num_heads": 2, "head_dim": 4, "gate_lower_bound": 1.0}}),
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("negative"), "{e}");
    let e = KdaConfig::from_hf_config(
        f,
        &json!({"hidden_size": 8, "linear_attn_config": {"num_heads": 2, "head_dim": 4, "num_v_heads": 4}}),
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("grouped value heads"), "{e}");
}

#[test]
fn missing_kda_tensor_is_a_named_error() {
    let dir = common::repo_root().join("tests/reference/kimi_linear");
    let src = SafetensorsSource::open(&dir).unwrap();
    let raw =
        json!({"hidden_size": 48, "linear_attn_config": {"num_heads": 3, "head_dim": 16, "use_full_rank_gate": true}});
    let cfg = KdaConfig::from_hf_config(&dir.join("config.json"), &raw).unwrap();
    // The Kimi-Linear case has the low-rank gate only: asking for g_proj must name it.
    let e = KdaLayer::load(cfg, &src, "kimi_linear.self_attn").err().expect("g_proj is absent").to_string();
    assert!(e.contains("kimi_linear.self_attn.g_proj.weight"), "{e}");
}
