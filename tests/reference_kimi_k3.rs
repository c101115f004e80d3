//! Tiny Kimi K3 checkpoints in the three published layouts (tests/reference/make_tiny_kimi_k3.py:
//! INT4 compressed-tensors on every Linear but lm_head/router/vision, MXFP4 routed experts with
//! `quantization_config` in `text_config`, QuantTrio's Cubic experts at mixed widths), against a torch reference forward written from
//! TokenSpeed and vLLM-cubic (Block Attention Residuals, KDA, gated NoPE-MLA, latent MoE, SiTU):
//! prefill logits and 16 greedy steps, through `forward`, through the engine (batched, chunked,
//! preempted) and split over 2 tensor- or expert-parallel ranks. A checkpoint with a tensor no
//! layer reads is refused, naming it.

mod common;

use std::collections::BTreeMap;
use std::path::PathBuf;

use tokio::sync::mpsc::unbounded_channel;
use wasmserve::engine::{EngineConfig, EngineCore, EngineEvent, EngineRequest};
use wasmserve::model::kv::BatchRow;
use wasmserve::model::LoadedModel;
use wasmserve::sampling::SamplingParams;

use common::ReferenceCase as Case;

/// Max |ours − reference| on logits (|logits| up to ~4). The reference is float64 (rounded to
/// 1e-5); ours is f32, and this random 5-layer model amplifies f32 rounding: the generator's own
/// forward in f32 is 0.5-6e-4 off its float64 result depending on the seed (the fixture's seed is
/// one of the better ones). Measured here: 9.1e-5 (INT4), 1.2e-4 (Cubic), 3.0e-4 (MXFP4, in
/// decode steps).
const TOLERANCE: f32 = 5e-4;

const LAYOUTS: [&str; 3] = ["int4", "mxfp4", "cubic"];

fn dir(layout: &str) -> PathBuf {
    common::repo_root().join("tests/reference/kimi_k3").join(layout)
}

fn cases(layout: &str) -> Vec<Case> {
    common::reference_cases(&dir(layout).join("reference.json"))
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    kernels::compare::max_abs_error(a, b)
}

/// Prefill logits at every position, then 16 decode steps fed the reference's greedy tokens.
fn check_forward(m: &LoadedModel, layout: &str, what: &str) -> f32 {
    let vocab = m.config().vocab_size;
    let mut worst = 0.0f32;
    for c in cases(layout) {
        let mut kv = m.model.contiguous_cache(1);
        let rows: Vec<BatchRow> = (0..c.ids.len()).map(|pos| BatchRow { seq: 0, pos }).collect();
        let all: Vec<usize> = (0..rows.len()).collect();
        let logits = m.model.forward(&c.ids, &rows, &mut kv, &all);
        for (p, want) in c.prefill.iter().enumerate() {
            let d = max_diff(&logits[p * vocab..(p + 1) * vocab], want);
            worst = worst.max(d);
            assert!(d < TOLERANCE, "{what}: prefill position {p} of {}: max diff {d}", c.ids.len());
        }
        let mut last = logits[(rows.len() - 1) * vocab..].to_vec();
        for (k, want) in c.steps.iter().enumerate() {
            let d = max_diff(&last, want);
            worst = worst.max(d);
            assert!(d < TOLERANCE, "{what}: decode step {k}: max diff {d}");
            let pos = c.ids.len() + k;
            last = m.model.forward(&[c.greedy[k]], &[BatchRow { seq: 0, pos }], &mut kv, &[0]);
        }
    }
    worst
}

#[test]
fn every_layout_matches_the_reference_forward() {
    for layout in LAYOUTS {
        let m = wasmserve::model::load(&dir(layout)).unwrap_or_else(|e| panic!("loading {layout}: {e}"));
        assert_eq!(m.config().architecture, wasmserve::model::config::Architecture::KimiK3);
        // KDA layers 0-2 keep no rows; MLA layers 3-4 one 64-wide latent + 32-wide key row.
        let layout_of = m.model.cache_layout();
        let widths: Vec<_> = layout_of.layers.iter().map(|l| l.map(|s| (s.key_width, s.value_width))).collect();
        assert_eq!(widths, vec![None, None, None, Some((64, 32)), Some((64, 32))]);
        let worst = check_forward(&m, layout, layout);
        eprintln!("{layout}: max |logit diff| vs the reference {worst:.2e}");
    }
}

#[test]
fn sharded_over_two_ranks_matches_the_reference() {
    let layout = "int4";
    let tp = wasmserve::model::load_tp(&dir(layout), 2).expect("TP=2");
    let worst = check_forward(&tp, layout, "tp=2");
    eprintln!("tp=2: max |logit diff| {worst:.2e}");
    let ep = wasmserve::model::load_ep(&dir("mxfp4"), 2).expect("EP=2");
    let worst = check_forward(&ep, "mxfp4", "ep=2");
    eprintln!("ep=2: max |logit diff| {worst:.2e}");
}

fn log_softmax(x: &[f32]) -> Vec<f32> {
    let m = x.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
    let lse = m + x.iter().map(|v| (v - m).exp()).sum::<f32>().ln();
    x.iter().map(|v| v - lse).collect()
}

/// Runs every case's prompt as one greedy request (full log-probabilities) and checks tokens
/// and log-probabilities against the reference; returns the engine for its counters.
fn engine_run(m: std::sync::Arc<LoadedModel>, cs: &[Case], cfg: EngineConfig, what: &str) -> EngineCore {
    let vocab = m.config().vocab_size;
    let mut core = EngineCore::new(m, EngineConfig { max_logprobs: vocab, ..cfg });
    let mut rxs = Vec::new();
    for (i, c) in cs.iter().enumerate() {
        let (tx, rx) = unbounded_channel();
        let req = EngineRequest {
            prompt_ids: c.ids.clone(),
            sampling: SamplingParams::greedy(),
            max_tokens: c.greedy.len(),
            ignore_eos: true,
            logprobs: Some(vocab),
            ..Default::default()
        };
        core.add_request(i as u64 + 1, req, tx).unwrap();
        rxs.push(rx);
    }
    common::drive(&mut core);
    for (c, rx) in cs.iter().zip(&mut rxs) {
        let mut tokens = Vec::new();
        let mut logprobs: BTreeMap<usize, Vec<f32>> = BTreeMap::new();
        while let Ok(ev) = rx.try_recv() {
            match ev {
                EngineEvent::Token { token, logprob, .. } => {
                    let mut full = vec![f32::NAN; vocab];
                    for (t, lp) in logprob.expect("logprobs requested").top {
                        full[t as usize] = lp;
                    }
                    logprobs.insert(tokens.len(), full);
                    tokens.push(token);
                }
                EngineEvent::Error(e) => panic!("{what}: engine error: {e}"),
                _ => {}
            }
        }
        assert_eq!(tokens, c.greedy, "{what}: greedy tokens differ from the reference");
        for (k, lp) in &logprobs {
            let d = max_diff(lp, &log_softmax(&c.steps[*k]));
            assert!(d < TOLERANCE, "{what}: step {k}: max logprob diff {d}");
        }
    }
    core
}

#[test]
fn engine_batched_chunked_and_preempted_match_the_reference() {
    let m = std::sync::Arc::new(wasmserve::model::load(&dir("int4")).unwrap());
    let cs = cases("int4");
    engine_run(m.clone(), &cs, EngineConfig::default(), "batched");
    engine_run(m.clone(), &cs, EngineConfig { max_num_batched_tokens: 5, ..Default::default() }, "chunked");
    // Three state slots and 4 blocks of 16 tokens: the sequences need more by the end (up to 37
    // tokens each), so some are preempted and recomputed.
    let layout = m.model.cache_layout();
    let block_bytes = 16 * layout.floats_per_token() * 4;
    let cfg = EngineConfig {
        kv_cache_bytes: 3 * layout.recurrent_bytes_per_seq + 4 * block_bytes,
        max_num_seqs: 3,
        ..Default::default()
    };
    let core = engine_run(m, &cs, cfg, "preempted");
    assert!(core.stats().preemptions_total > 0, "the pool was meant to force a preemption");
}

/// The INT4 fixture copied with one more tensor, `name`, in a second shard.
fn with_extra_tensor(name: &str) -> PathBuf {
    use safetensors::tensor::{Dtype, TensorView};
    let src = dir("int4");
    let dst = std::env::temp_dir().join(format!("wasmserve-k3-extra-{}", std::process::id()));
    std::fs::create_dir_all(&dst).unwrap();
    for f in std::fs::read_dir(&src).unwrap() {
        let f = f.unwrap().path();
        std::fs::copy(&f, dst.join(f.file_name().unwrap())).unwrap();
    }
    let data = vec![0u8; 2 * 128];
    let view = TensorView::new(Dtype::BF16, vec![1, 128], &data).unwrap();
    safetensors::serialize_to_file(vec![(name.to_string(), view)], None, &dst.join("zz-extra.safetensors")).unwrap();
    dst
}

#[test]
fn a_tensor_no_layer_reads_is_refused_by_name() {
    let name = "language_model.model.layers.1.extra_res_proj.weight";
    let d = with_extra_tensor(name);
    let err = wasmserve::model::load(&d).err().expect("an unread tensor must stop the load").to_string();
    assert!(err.contains(name) && err.contains("no layer"), "{err}");
    std::fs::remove_dir_all(&d).ok();
}

/// The Cubic layout in QuantTrio's dynamic-A8 mode (`--cpu-activations int8`, their
/// `VLLM_CUBIC_DYNAMIC_A8=1`) against the reference forward whose routed experts multiply through
/// their `_reference_dynamic_a8_linear` (reference_a8.json): the int8 rounding of activations is
/// discontinuous, so an f32-vs-f64 difference can move one value to the next int8 step; the
/// tolerance says how far that goes here.
#[test]
fn cubic_in_dynamic_a8_mode_matches_its_reference() {
    let opts = wasmserve::model::LoadOptions {
        cpu_activations: wasmserve::model::activations::CpuActivations::Int8,
        ..Default::default()
    };
    let m = wasmserve::model::load_with_options(&dir("cubic"), &opts).unwrap();
    let a8 = common::reference_cases(&dir("cubic").join("reference_a8.json"));
    let a16 = cases("cubic");
    let vocab = m.config().vocab_size;
    let (mut worst, mut a8_vs_a16) = (0.0f32, 0.0f32);
    for (c, c16) in a8.iter().zip(&a16) {
        let mut kv = m.model.contiguous_cache(1);
        let rows: Vec<BatchRow> = (0..c.ids.len()).map(|pos| BatchRow { seq: 0, pos }).collect();
        let all: Vec<usize> = (0..rows.len()).collect();
        let logits = m.model.forward(&c.ids, &rows, &mut kv, &all);
        for (p, want) in c.prefill.iter().enumerate() {
            worst = worst.max(max_diff(&logits[p * vocab..(p + 1) * vocab], want));
            a8_vs_a16 = a8_vs_a16.max(max_diff(&c16.prefill[p], want));
        }
    }
    eprintln!("cubic dynamic A8: max |logit diff| vs its reference {worst:.2e} (the A8 reference vs the A16 one: {a8_vs_a16:.2})");
    assert!(worst < 1e-4 && a8_vs_a16 > 0.1, "A8 {worst}, A8 vs A16 {a8_vs_a16}");
}
