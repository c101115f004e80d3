//! MoE blocks against independent references (tests/reference/make_moe_layers.py):
//! transformers' DeepseekV3MoE (sigmoid, noaux_tc, groups), DeepseekV2Moe (softmax,
//! group_limited_greedy), KimiLinearMoE (Kimi names), and a K3 latent-MoE block whose reference
//! is torch code written from the formula (transformers has no latent MoE). Also: expert-parallel
//! partial sums, quantized experts with mixed widths (Cubic W2/W3, INT4) against the same
//! layer with the weights dequantised to f32, and clear load errors.

mod common;

use std::path::{Path, PathBuf};

use serde_json::{json, Value};
use wasmserve::model::error::LoadError;
use wasmserve::model::format::hf_source::SafetensorsSource;
use wasmserve::model::format::quant::QuantizedSource;
use wasmserve::model::format::source::WeightSource;
use wasmserve::model::layers::linear::Linear;
use wasmserve::model::layers::moe::{MoeConfig, MoeLayer};
use wasmserve::model::tensor::Tensor;
use wasmserve::quantize::{quantize, FormatArg, QuantizeArgs};

const CASES: [&str; 4] = ["deepseek_v3", "deepseek_v2", "kimi_linear", "kimi_latent"];

fn case_dir(name: &str) -> PathBuf {
    common::repo_root().join("tests/reference/moe").join(name)
}

fn config_of(dir: &Path) -> (MoeConfig, Value) {
    let file = dir.join("config.json");
    let raw: Value = serde_json::from_str(&std::fs::read_to_string(&file).unwrap()).unwrap();
    (MoeConfig::from_hf_config(&file, &raw).unwrap().expect("an MoE config"), raw)
}

struct Io {
    n: usize,
    input: Vec<f32>,
    output: Vec<f32>,
    experts: Vec<f32>,
    weights: Vec<f32>,
}

fn io(name: &str, cfg: &MoeConfig) -> Io {
    let src = SafetensorsSource::open(&case_dir(name).join("io")).unwrap();
    let n = src.shape_of("input").unwrap()[0];
    let (h, k) = (cfg.hidden_size, cfg.top_k);
    let get = |t: &str, shape: &[usize]| src.load(t, shape).unwrap().as_slice().to_vec();
    Io {
        n,
        input: get("input", &[n, h]),
        output: get("output", &[n, h]),
        experts: get("routing.experts", &[n, k]),
        weights: get("routing.weights", &[n, k]),
    }
}

/// Max |a − b| relative to the largest reference value.
fn rel_err(got: &[f32], want: &[f32]) -> f32 {
    assert_eq!(got.len(), want.len());
    kernels::compare::max_rel_error(got, want, 0.0)
}

fn load(name: &str) -> (MoeConfig, MoeLayer, Io) {
    let dir = case_dir(name);
    let (cfg, _) = config_of(&dir);
    let src = SafetensorsSource::open(&dir).unwrap();
    let layer = MoeLayer::load(&cfg, &src, &cfg.prefix(1)).unwrap_or_else(|e| panic!("{name}: {e}"));
    let io = io(name, &cfg);
    (cfg, layer, io)
}

#[test]
fn layers_match_their_references() {
    for name in CASES {
        let (cfg, layer, io) = load(name);
        // Layer 0 is the dense first layer in every case (first_k_dense_replace 1).
        assert!(!cfg.is_moe_layer(0) && cfg.is_moe_layer(1), "{name}: layer plan");
        let routing = layer.route(&io.input, io.n);
        for t in 0..io.n {
            let (ids, ws) = routing.token(t);
            let mut pairs: Vec<(u32, f32)> = ids.iter().copied().zip(ws.iter().copied()).collect();
            pairs.sort_by_key(|p| p.0);
            let want_ids: Vec<u32> = io.experts[t * cfg.top_k..(t + 1) * cfg.top_k].iter().map(|&e| e as u32).collect();
            assert_eq!(pairs.iter().map(|p| p.0).collect::<Vec<_>>(), want_ids, "{name}: token {t} experts");
            for (p, &w) in pairs.iter().zip(&io.weights[t * cfg.top_k..]) {
                assert!(
                    (p.1 - w).abs() <= 1e-5 * w.abs().max(1e-3),
                    "{name}: token {t} expert {} weight {} vs {w}",
                    p.0,
                    p.1
                );
            }
        }
        let out = layer.forward(&io.input, io.n);
        let err = rel_err(&out, &io.output);
        eprintln!("{name}: max |ours - reference| / max |reference| = {err:.2e}");
        assert!(err < 1e-5, "{name}: relative error {err}");
    }
}

#[test]
fn expert_parallel_partial_sums_add_up() {
    for name in ["deepseek_v3", "kimi_latent"] {
        let (_, layer, io) = load(name);
        let n = io.n;
        let routing = layer.route(&io.input, n);
        let xe = layer.expert_input(&io.input, n);
        let xe = xe.as_deref().unwrap_or(&io.input);
        // Three "devices" owning experts e % 3.
        let mut sum = vec![0.0f32; xe.len()];
        for dev in 0..3 {
            let part = layer.forward_experts(xe, n, &routing, &|e| e % 3 == dev);
            sum.iter_mut().zip(part).for_each(|(s, p)| *s += p);
        }
        let mut out = layer.finish_routed(&sum, n);
        let shared = layer.forward_shared(&io.input, n).expect("cases have shared experts");
        out.iter_mut().zip(shared).for_each(|(o, s)| *o += s);
        let err = rel_err(&out, &io.output);
        assert!(err < 1e-5, "{name}: split over 3 devices, relative error {err}");
    }
}

/// Every quantized Linear comes back dequantised to f32 (the same numbers, multiplied densely).
struct Dequantized(Box<dyn WeightSource>);

impl WeightSource for Dequantized {
    fn load(&self, name: &str, shape: &[usize]) -> Result<Tensor, LoadError> {
        self.0.load(name, shape)
    }
    fn contains(&self, name: &str) -> bool {
        self.0.contains(name)
    }
    fn file_of(&self, name: &str) -> PathBuf {
        self.0.file_of(name)
    }
    fn linear(&self, module: &str, rows: usize, cols: usize) -> Result<Linear, LoadError> {
        let dense = |row: &dyn Fn(usize) -> Vec<f32>| {
            Linear::Dense(Tensor::owned(vec![rows, cols], (0..rows).flat_map(row).collect()))
        };
        Ok(match self.0.linear(module, rows, cols)? {
            Linear::Cubic(q) => dense(&|r| q.dequantize_row(r)),
            Linear::Int(q) => dense(&|r| q.dequantize_row(r)),
            Linear::Mxfp4(q) => dense(&|r| q.dequantize_row(r)),
            d => d,
        })
    }
}

fn tmp(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("wasmserve-moe-{}-{tag}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

fn open_quantized(dir: &Path) -> Box<dyn WeightSource> {
    let (_, raw) = config_of(dir);
    QuantizedSource::wrap(SafetensorsSource::open(dir).unwrap(), &dir.join("config.json"), &raw).unwrap()
}

fn bits_of(l: &Linear) -> Option<u32> {
    match l {
        Linear::Cubic(q) => Some(q.bits()),
        Linear::Int(q) => Some(q.bits()),
        _ => None,
    }
}

/// Quantizes a case with `wasmserve quantize` (router kept f32) and checks the packed layer
/// against the same layer dequantised, and its distance from the f32 reference.
fn quantized_case(
    name: &str,
    format: FormatArg,
    bits: u32,
    policy: Value,
    expect_bits: &dyn Fn(usize) -> u32,
    max_nrmse: f32,
) {
    let out = tmp(&format!("{name}-{format:?}"));
    let policy_file = tmp(&format!("{name}-{format:?}-policy.json"));
    std::fs::write(&policy_file, policy.to_string()).unwrap();
    quantize(&QuantizeArgs {
        input: case_dir(name),
        output: out.clone(),
        format: Some(format),
        bits: Some(bits),
        group_size: Some(32),
        policy: Some(policy_file.clone()),
        quiet: true,
    })
    .unwrap();
    let (cfg, _) = config_of(&out);
    let packed = MoeLayer::load(&cfg, open_quantized(&out).as_ref(), &cfg.prefix(1)).unwrap();
    let dequant = MoeLayer::load(&cfg, &Dequantized(open_quantized(&out)), &cfg.prefix(1)).unwrap();
    for e in 0..cfg.num_experts {
        let m = packed.experts().get(e);
        for l in [&m.gate, &m.up, &m.down] {
            assert_eq!(bits_of(l), Some(expect_bits(e)), "{name}: expert {e} storage");
        }
    }
    let io = io(name, &cfg);
    let got = packed.forward(&io.input, io.n);
    let want = dequant.forward(&io.input, io.n);
    let err = rel_err(&got, &want);
    // Packed kernels and dense matmul sum in different orders.
    assert!(err < 1e-5, "{name} {format:?}: packed vs dequantised relative error {err}");
    let num: f32 = got.iter().zip(&io.output).map(|(a, b)| (a - b) * (a - b)).sum();
    let den: f32 = io.output.iter().map(|b| b * b).sum();
    let nrmse = (num / den).sqrt();
    eprintln!("{name} {format:?}: packed vs dequantised {err:.2e}; NRMSE vs f32 reference {nrmse:.3}");
    assert!(nrmse > 0.0 && nrmse < max_nrmse, "{name} {format:?}: NRMSE vs f32 {nrmse}");
    let _ = std::fs::remove_dir_all(&out);
    let _ = std::fs::remove_file(&policy_file);
}

#[test]
fn cubic_experts_of_mixed_widths() {
    // Experts 0-7 at 2 bits, 8-15 at 3 bits; router f32; shared experts at 4 bits.
    let policy = json!({"rules": [
        {"match": "re:.*\\.gate$", "skip": true},
        {"match": "re:.*shared_experts\\.", "bits": 4},
        {"match": "re:.*experts\\.[0-7]\\.", "bits": 2}
    ]});
    quantized_case("deepseek_v3", FormatArg::Cubic, 3, policy.clone(), &|e| if e < 8 { 2 } else { 3 }, 0.45);
    quantized_case("kimi_latent", FormatArg::Cubic, 3, policy, &|e| if e < 8 { 2 } else { 3 }, 0.45);
}

#[test]
fn int4_experts() {
    let policy = json!({"rules": [{"match": "re:.*\\.gate$", "skip": true}]});
    quantized_case("kimi_linear", FormatArg::Int, 4, policy, &|_| 4, 0.25);
}

#[test]
fn bad_checkpoints_give_clear_errors() {
    let dir = case_dir("deepseek_v3");
    let (cfg, _) = config_of(&dir);
    let src = SafetensorsSource::open(&dir).unwrap();
    let err = |c: &MoeConfig, prefix: &str| MoeLayer::load(c, &src, prefix).err().expect("load must fail").to_string();
    let mut more = cfg.clone();
    more.num_experts = 20;
    more.n_group = 4;
    let e = err(&more, &cfg.prefix(1));
    assert!(e.contains("gate.weight") && e.contains("[16, 64]"), "{e}");
    let mut wide = cfg.clone();
    wide.moe_intermediate_size = 48;
    let e = err(&wide, &cfg.prefix(1));
    assert!(e.contains("experts.0.gate_proj.weight") && e.contains("expected [48, 64]"), "{e}");
    let e = err(&cfg, "model.layers.2.mlp");
    assert!(e.contains("missing tensor 'model.layers.2.mlp.gate.weight'"), "{e}");
    // Kimi names are not DeepSeek names: the wrong family fails on the first expert.
    let mut kimi = cfg.clone();
    kimi.naming = wasmserve::model::layers::moe::config::ExpertNaming::W1W3W2;
    let e = err(&kimi, &cfg.prefix(1));
    assert!(e.contains("experts.0.w1.weight"), "{e}");
}
