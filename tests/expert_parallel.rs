//! Expert parallelism on simulated devices (threads) against the MoE fixtures of
//! tests/reference/make_moe_layers.py: every rank holds a contiguous range of the experts, token
//! rows travel to their experts' ranks and back through `all_to_all_v`, and the block's output
//! must equal both the one-device block (EP=1) and the independent reference (transformers
//! `DeepseekV3MoE` / `DeepseekV2Moe` / `KimiLinearMoE`, and the K3 latent-MoE torch code).
//!
//! Then whole models: the tiny DeepSeek-V3 and Kimi-Linear checkpoints split over 2 and 4 ranks
//! against one device and transformers' logits, directly and through the paged engine.
//!
//! Tolerances: ranks' partial sums are added in rank order, one device adds experts in expert
//! order, so results agree to rounding (~1e-7 relative), not bit for bit; the bar is 1e-5.

mod common;

use std::path::PathBuf;

use wasmserve::model::format::hf_source::SafetensorsSource;
use wasmserve::model::format::source::WeightSource;
use wasmserve::model::layers::moe::expert_parallel::experts_of;
use wasmserve::model::layers::moe::{DispatchStats, ExpertParallelMoe};
use wasmserve::model::layers::moe::{MoeConfig, MoeLayer};
use wasmserve::parallel::{DeviceMesh, LocalCollective};

const CASES: [&str; 4] = ["deepseek_v3", "deepseek_v2", "kimi_linear", "kimi_latent"];

fn case_dir(name: &str) -> PathBuf {
    common::repo_root().join("tests/reference/moe").join(name)
}

struct Case {
    cfg: MoeConfig,
    src: SafetensorsSource,
    n: usize,
    input: Vec<f32>,
    output: Vec<f32>,
}

fn case(name: &str) -> Case {
    let dir = case_dir(name);
    let file = dir.join("config.json");
    let raw = serde_json::from_str(&std::fs::read_to_string(&file).unwrap()).unwrap();
    let cfg = MoeConfig::from_hf_config(&file, &raw).unwrap().expect("an MoE config");
    let io = SafetensorsSource::open(&dir.join("io")).unwrap();
    let n = io.shape_of("input").unwrap()[0];
    let get = |t: &str| io.load(t, &[n, cfg.hidden_size]).unwrap().as_slice().to_vec();
    let (input, output) = (get("input"), get("output"));
    Case { src: SafetensorsSource::open(&dir).unwrap(), cfg, n, input, output }
}

fn rel_err(got: &[f32], want: &[f32]) -> f32 {
    assert_eq!(got.len(), want.len());
    kernels::compare::max_rel_error(got, want, 0.0)
}

fn load_ranks(c: &Case, ep: usize) -> Vec<ExpertParallelMoe> {
    (0..ep).map(|r| ExpertParallelMoe::load(&c.cfg, &c.src, &c.cfg.prefix(1), r, ep).unwrap()).collect()
}

/// Runs `f(rank's layer, rank's EP communicator)` on one thread per rank of a 1 × ep mesh.
fn on_ranks<R: Send>(
    ranks: &[ExpertParallelMoe],
    f: impl Fn(usize, &ExpertParallelMoe, &LocalCollective) -> R + Sync,
) -> Vec<R> {
    let comms = LocalCollective::for_mesh(&DeviceMesh::new(1, ranks.len()).unwrap());
    std::thread::scope(|s| {
        let hs: Vec<_> = ranks
            .iter()
            .zip(&comms)
            .enumerate()
            .map(|(r, (m, c))| {
                let f = &f;
                s.spawn(move || f(r, m, &c.ep))
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

#[test]
fn ep_2_3_4_equal_one_device_and_the_reference() {
    for name in CASES {
        let c = case(name);
        let single = MoeLayer::load(&c.cfg, &c.src, &c.cfg.prefix(1)).unwrap().forward(&c.input, c.n);
        let vs_ref = rel_err(&single, &c.output);
        assert!(vs_ref < 1e-5, "{name}: one device vs reference {vs_ref}");
        for ep in [1, 2, 3, 4] {
            let ranks = load_ranks(&c, ep);
            // Contiguous ranges covering all experts; with 16 experts over 3 ranks: 6, 5, 5.
            let held: Vec<_> = ranks.iter().map(ExpertParallelMoe::held).collect();
            assert_eq!(held.first().unwrap().start, 0);
            assert_eq!(held.last().unwrap().end, c.cfg.num_experts);
            assert!(held.windows(2).all(|w| w[0].end == w[1].start), "{name} ep={ep}: {held:?}");
            if ep == 3 {
                assert_eq!(held.iter().map(|r| r.len()).collect::<Vec<_>>(), [6, 5, 5], "uneven expert counts");
            }
            let outs = on_ranks(&ranks, |_, m, comm| m.forward_replicated(&c.input, c.n, comm).unwrap());
            for (r, out) in outs.iter().enumerate() {
                let e1 = rel_err(out, &single);
                let er = rel_err(out, &c.output);
                assert!(e1 < 1e-5 && er < 1e-5, "{name} ep={ep} rank {r}: vs EP=1 {e1}, vs reference {er}");
            }
            eprintln!(
                "{name} ep={ep}: vs EP=1 {:.2e}, vs reference {:.2e}",
                rel_err(&outs[0], &single),
                rel_err(&outs[0], &c.output)
            );
        }
    }
}

#[test]
fn each_token_row_is_sent_once_per_owning_rank() {
    // deepseek_v3: 4 groups of 4 experts, each token keeps 2 groups; over 4 ranks the groups are
    // exactly the ranks' ranges, so every token goes to exactly 2 ranks, not top_k = 4 times.
    let c = case("deepseek_v3");
    let ep = 4;
    let ranks = load_ranks(&c, ep);
    let h = c.cfg.hidden_size;
    let routing = MoeLayer::load(&c.cfg, &c.src, &c.cfg.prefix(1)).unwrap().route(&c.input, c.n);
    let stats: Vec<DispatchStats> = on_ranks(&ranks, |r, m, comm| {
        let mine = wasmserve::model::shard::even_range(c.n, ep, r);
        m.forward_tokens(&c.input[mine.start * h..mine.end * h], mine.len(), comm).unwrap().1
    });
    let mut want_sent = vec![0usize; ep];
    let mut want_recv = vec![0usize; ep];
    for (r, want) in want_sent.iter_mut().enumerate() {
        for t in wasmserve::model::shard::even_range(c.n, ep, r) {
            let mut owners: Vec<usize> = routing
                .token(t)
                .0
                .iter()
                .map(|&e| (0..ep).find(|&o| experts_of(c.cfg.num_experts, ep, o).contains(&(e as usize))).unwrap())
                .collect();
            owners.sort_unstable();
            owners.dedup();
            assert_eq!(owners.len(), 2, "token {t}: one rank per kept group");
            *want += owners.len();
            owners.iter().for_each(|&o| want_recv[o] += 1);
        }
    }
    assert_eq!(stats.iter().map(|s| s.sent_rows).collect::<Vec<_>>(), want_sent);
    assert_eq!(stats.iter().map(|s| s.received_rows).collect::<Vec<_>>(), want_recv);
}

#[test]
fn ranks_without_tokens_or_without_traffic_still_take_part() {
    for name in ["deepseek_v3", "kimi_latent"] {
        let c = case(name);
        let h = c.cfg.hidden_size;
        let ep = 4;
        let ranks = load_ranks(&c, ep);
        // Only rank 0 holds a token (token 0); the other ranks bring none, and since a token
        // picks at most top_k = 4 experts in at most 2 groups, some rank receives nothing.
        let res = on_ranks(&ranks, |r, m, comm| {
            let n = usize::from(r == 0);
            m.forward_tokens(&c.input[..n * h], n, comm).unwrap()
        });
        assert!(rel_err(&res[0].0, &c.output[..h]) < 1e-5, "{name}: token 0 vs reference");
        assert!(
            res[1..].iter().all(|(out, s)| out.is_empty() && s.sent_rows == 0),
            "{name}: tokenless ranks return nothing"
        );
        let idle = res.iter().filter(|(_, s)| s.received_rows == 0).count();
        assert!(
            idle >= 1,
            "{name}: some rank must receive no rows ({:?})",
            res.iter().map(|r| &r.1).collect::<Vec<_>>()
        );
        // Fewer tokens than ranks through the replicated path too (ranks 2, 3 get empty slices).
        let two = on_ranks(&ranks, |_, m, comm| m.forward_replicated(&c.input[..2 * h], 2, comm).unwrap());
        for out in two {
            assert!(rel_err(&out, &c.output[..2 * h]) < 1e-5, "{name}: 2 tokens over 4 ranks");
        }
    }
}

#[test]
fn bad_layouts_are_clear_errors() {
    let c = case("deepseek_v3");
    let err = ExpertParallelMoe::load(&c.cfg, &c.src, &c.cfg.prefix(1), 0, 17)
        .err()
        .expect("17 ranks for 16 experts")
        .to_string();
    assert!(err.contains("expert parallel size 17 exceeds the 16 routed experts"), "{err}");
    let err = ExpertParallelMoe::load(&c.cfg, &c.src, &c.cfg.prefix(1), 2, 2).err().expect("rank 2 of 2").to_string();
    assert!(err.contains("expert-parallel rank 2 of 2"), "{err}");
    // A communicator that does not match the layer's placement is refused before any traffic.
    let rank = ExpertParallelMoe::load(&c.cfg, &c.src, &c.cfg.prefix(1), 0, 2).unwrap();
    let comm = LocalCollective::group(1).pop().unwrap();
    let err =
        rank.forward_tokens(&c.input, c.n, &comm).expect_err("1-rank communicator for a 2-rank layer").to_string();
    assert!(err.contains("communicator is rank 0 of 1"), "{err}");
}

// ---- the whole DeepSeek-V3 model, experts split over ranks ---------------------------------
//
// The tiny fixture of tests/reference/make_tiny_deepseek_v3.py (8 routed experts in 4 groups,
// top-2 of 2 groups, a shared expert, one dense layer then 3 MoE layers): EP=2 and EP=4 must give
// EP=1's prefill logits and 32 greedy decode steps (1e-5 relative to the row's largest logit; the
// only difference is the order partial expert sums are added in) and transformers'
// (reference.json, 1e-4 absolute as in tests/reference_deepseek_v3.rs).

/// The tiny whole-model fixtures (DeepSeek-V3, Kimi-Linear) and their transformers references.
mod reference_model {
    use super::common;
    use std::path::PathBuf;
    use wasmserve::model::kv::BatchRow;
    use wasmserve::model::LoadedModel;

    /// tests/reference/<name>/model.
    pub fn dir(name: &str) -> PathBuf {
        common::repo_root().join("tests/reference").join(name).join("model")
    }

    pub use common::ReferenceCase as Case;

    pub fn cases(name: &str) -> Vec<Case> {
        common::reference_cases(&dir(name).join("reference.json"))
    }

    /// Prefill logits of every prompt position, then the logits of each decode step fed the
    /// reference's greedy token (step 0 is the last prefill position, as in reference.json).
    pub fn run(m: &LoadedModel, case: &Case) -> (Vec<Vec<f32>>, Vec<Vec<f32>>) {
        let vocab = m.config().vocab_size;
        let n = case.ids.len();
        // With the model's recurrent states (Kimi-Linear's KDA layers), when it has them.
        let mut kv = m.model.contiguous_cache(1);
        let rows: Vec<BatchRow> = (0..n).map(|pos| BatchRow { seq: 0, pos }).collect();
        let logits = m.model.forward(&case.ids, &rows, &mut kv, &(0..n).collect::<Vec<_>>());
        let prefill: Vec<Vec<f32>> = logits.chunks(vocab).map(<[f32]>::to_vec).collect();
        let mut steps = vec![prefill[n - 1].clone()];
        for k in 1..case.steps.len() {
            steps.push(m.model.forward(&[case.greedy[k - 1]], &[BatchRow { seq: 0, pos: n + k - 1 }], &mut kv, &[0]));
        }
        (prefill, steps)
    }

    pub fn rel(got: &[f32], want: &[f32]) -> f32 {
        assert_eq!(got.len(), want.len());
        kernels::compare::max_rel_error(got, want, 1e-3)
    }

    pub fn abs(got: &[f32], want: &[f32]) -> f32 {
        assert_eq!(got.len(), want.len());
        kernels::compare::max_abs_error(got, want)
    }

    pub fn argmax(x: &[f32]) -> u32 {
        x.iter().enumerate().max_by(|a, b| a.1.total_cmp(b.1)).unwrap().0 as u32
    }
}

#[test]
fn deepseek_v3_ep_2_and_4_match_one_device_and_transformers() {
    check_sharded("deepseek_v3", "ep", 1e-4, &|ep| {
        wasmserve::model::load_ep(&reference_model::dir("deepseek_v3"), ep).unwrap()
    });
}

/// TP: the MLA heads split over the ranks (`o_proj` partial sums all-reduced) and the routed
/// experts over the same ranks.
#[test]
fn deepseek_v3_tp_2_and_4_match_one_device_and_transformers() {
    let dir = reference_model::dir("deepseek_v3");
    check_sharded("deepseek_v3", "tp", 1e-4, &|tp| wasmserve::model::load_tp(&dir, tp).unwrap());
    let err = wasmserve::model::load_tp(&dir, 3).err().expect("3 ranks for 4 heads").to_string();
    assert!(err.contains("the size must divide the heads"), "{err}");
}

/// Kimi-Linear (4 experts, top-2, a shared expert, 3 MoE layers after a dense one): the KDA and
/// latent layers replicated, every rank advancing its own copy of the KDA states. The bar vs
/// transformers is the single-device model's (tests/reference_kimi_linear.rs: its chunked KDA
/// prefill sums in another order).
#[test]
fn kimi_linear_ep_2_and_4_match_one_device_and_transformers() {
    let dir = reference_model::dir("kimi_linear");
    check_sharded("kimi_linear", "ep", 2e-4, &|ep| wasmserve::model::load_ep(&dir, ep).unwrap());
    let one = wasmserve::model::load(&dir).unwrap().model.cache_layout();
    let two = wasmserve::model::load_ep(&dir, 2).unwrap().model.cache_layout();
    assert_eq!(two.recurrent_bytes_per_seq, 2 * one.recurrent_bytes_per_seq, "each rank keeps its own KDA states");
}

/// `name`'s fixture loaded by `load(ranks)` at 2 and 4 ranks against one device (relative 1e-5)
/// and transformers (absolute `vs_reference`), at every prefill position and decode step, with
/// transformers' greedy tokens.
fn check_sharded(name: &str, what: &str, vs_reference: f32, load: &dyn Fn(usize) -> wasmserve::model::LoadedModel) {
    let cases = reference_model::cases(name);
    let single = wasmserve::model::load(&reference_model::dir(name)).unwrap();
    let want: Vec<_> = cases.iter().map(|c| reference_model::run(&single, c)).collect();
    for ep in [2, 4] {
        let m = load(ep);
        // The mixers are replicated, so each rank keeps its own copy of every layer's cache.
        assert_eq!(m.model.cache_layout().num_layers(), ep * single.model.cache_layout().num_layers());
        let (mut vs_one, mut vs_ref) = (0f32, 0f32);
        for (c, (p1, s1)) in cases.iter().zip(&want) {
            let (prefill, steps) = reference_model::run(&m, c);
            for (p, ((got, one), reference)) in prefill.iter().zip(p1).zip(&c.prefill).enumerate() {
                let (e1, er) = (reference_model::rel(got, one), reference_model::abs(got, reference));
                assert!(
                    e1 <= 1e-5 && er <= vs_reference,
                    "{name} {what}={ep} prefill position {p}: vs one device {e1}, vs transformers {er}"
                );
                (vs_one, vs_ref) = (vs_one.max(e1), vs_ref.max(er));
            }
            assert_eq!(steps.len(), 32);
            for (k, ((got, one), reference)) in steps.iter().zip(s1).zip(&c.steps).enumerate() {
                let (e1, er) = (reference_model::rel(got, one), reference_model::abs(got, reference));
                assert!(
                    e1 <= 1e-5 && er <= vs_reference,
                    "{name} {what}={ep} decode step {k}: vs one device {e1}, vs transformers {er}"
                );
                assert_eq!(reference_model::argmax(got), c.greedy[k], "{name} {what}={ep} greedy token at step {k}");
                (vs_one, vs_ref) = (vs_one.max(e1), vs_ref.max(er));
            }
        }
        eprintln!("{name} {what}={ep}: worst relative logit diff vs one device {vs_one:.2e}, worst abs diff vs transformers {vs_ref:.2e}");
    }
}

/// Greedy tokens per prompt from the paged engine serving `model`.
fn engine_tokens(model: wasmserve::model::LoadedModel, prompts: &[&[u32]]) -> Vec<Vec<u32>> {
    // A small token budget: chunked prefill, prefill and decode rows of both requests mixed.
    let config = wasmserve::engine::EngineConfig {
        max_num_batched_tokens: 7,
        enable_prefix_caching: false,
        ..Default::default()
    };
    common::engine_greedy_tokens(std::sync::Arc::new(model), config, prompts, 32)
}

/// The engine serving each of `models` (what, model) on `name`'s prompts gives transformers'
/// greedy tokens for every prompt.
fn check_engine(name: &str, models: Vec<(String, wasmserve::model::LoadedModel)>) {
    let cases = reference_model::cases(name);
    let prompts: Vec<&[u32]> = cases.iter().map(|c| c.ids.as_slice()).collect();
    let want: Vec<Vec<u32>> = cases.iter().map(|c| c.greedy.clone()).collect();
    for (what, model) in models {
        assert_eq!(engine_tokens(model, &prompts), want, "{name}: engine {what} vs transformers' greedy tokens");
    }
}

/// `name`'s fixture loaded with each of `eps` expert-parallel ranks.
fn ep_models(name: &str, eps: &[usize]) -> Vec<(String, wasmserve::model::LoadedModel)> {
    eps.iter()
        .map(|&ep| (format!("ep={ep}"), wasmserve::model::load_ep(&reference_model::dir(name), ep).unwrap()))
        .collect()
}

#[test]
fn engine_on_deepseek_v3_ep_2_and_4_gives_transformers_greedy_tokens() {
    let mut models = ep_models("deepseek_v3", &[1, 2, 4]);
    models.push(("tp=2".into(), wasmserve::model::load_tp(&reference_model::dir("deepseek_v3"), 2).unwrap()));
    check_engine("deepseek_v3", models);
}

/// Chunked prefill carries each rank's KDA states across chunks; both requests' rows mixed.
#[test]
fn engine_on_kimi_linear_ep_2_gives_transformers_greedy_tokens() {
    check_engine("kimi_linear", ep_models("kimi_linear", &[2]));
}

#[test]
fn deepseek_v3_bad_expert_parallel_sizes_are_clear_errors() {
    let dir = reference_model::dir("deepseek_v3");
    let err = wasmserve::model::load_ep(&dir, 9).err().expect("9 ranks for 8 experts").to_string();
    assert!(err.contains("expert parallel size 9 exceeds the 8 routed experts"), "{err}");
    let err = wasmserve::model::load_ep(&reference_model::dir("kimi_linear"), 5)
        .err()
        .expect("5 ranks for 4 experts")
        .to_string();
    assert!(err.contains("expert parallel size 5 exceeds the 4 routed experts"), "{err}");
    let err = wasmserve::model::load_ep(&dir, 0).err().expect("ep=0").to_string();
    assert!(err.contains("expert parallel size must be at least 1"), "{err}");
    let llama = common::repo_root().join("tests/reference/tiny_llama");
    let err = wasmserve::model::load_ep(&llama, 2).err().expect("Llama has no experts").to_string();
    assert!(err.contains("DeepSeek-V3, Kimi-Linear, Kimi K3 models only, not Llama"), "{err}");
}

/// TP=3 on Kimi-Linear: each rank one KDA head (its q/k/v rows, conv channels, gates, state) and
/// one MLA head, `o_proj` partial sums all-reduced, the 4 experts over the same ranks (2, 1, 1);
/// against one device at every prefill position and 32 decode steps, directly and through the
/// engine (chunked prefill carries each rank's part of the KDA state).
#[test]
fn kimi_linear_tp_3_matches_one_device() {
    let dir = common::kimi_linear_three_mla_heads("expert-parallel");
    let single = wasmserve::model::load(&dir).unwrap();
    let tp = wasmserve::model::load_tp(&dir, 3).unwrap();
    let (one, three) = (single.model.cache_layout(), tp.model.cache_layout());
    // The latent rows are copied per rank; the KDA state is split, so its total stays the same.
    assert_eq!(three.num_layers(), 3 * one.num_layers());
    assert_eq!(
        three.recurrent_bytes_per_seq, one.recurrent_bytes_per_seq,
        "each rank holds a third of every KDA state"
    );
    let cases = reference_model::cases("kimi_linear");
    let mut worst = 0f32;
    for c in &cases {
        let ((p1, s1), (p3, s3)) = (reference_model::run(&single, c), reference_model::run(&tp, c));
        for (k, (got, want)) in p3.iter().chain(&s3).zip(p1.iter().chain(&s1)).enumerate() {
            let e = reference_model::rel(got, want);
            assert!(e <= 1e-5, "tp=3 row {k}: relative difference vs one device {e}");
            worst = worst.max(e);
        }
    }
    eprintln!("kimi_linear (3 MLA heads) tp=3: worst relative logit difference vs one device {worst:.2e}");
    let prompts: Vec<&[u32]> = cases.iter().map(|c| c.ids.as_slice()).collect();
    let want = engine_tokens(wasmserve::model::load(&dir).unwrap(), &prompts);
    assert_eq!(engine_tokens(tp, &prompts), want, "engine tp=3 vs one device's greedy tokens");
    let err = wasmserve::model::load_tp(&dir, 2).err().expect("2 ranks for 3 heads").to_string();
    assert!(err.contains("over 3 KDA heads (the size must divide the heads)"), "{err}");
    std::fs::remove_dir_all(&dir).ok();
}
