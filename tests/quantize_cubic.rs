//! `wasmserve quantize` end to end on the tiny bf16 Llama (tests/reference/tiny_llama): Cubic
//! and INT outputs load, decode as docs/cubic-format.md specifies (re-derived here from the raw
//! tensors), follow a mixed per-layer policy, and run.

mod common;

use std::path::{Path, PathBuf};

use half::f16;
use safetensors::SafeTensors;
use serde_json::Value;
use wasmserve::model::format::hf_source::SafetensorsSource;
use wasmserve::model::format::quant::cubic::{load_cubic, CubicConfig};
use wasmserve::model::format::source::WeightSource;
use wasmserve::model::kv::{BatchRow, ContiguousKvCache};
use wasmserve::quantize::{quantize, FormatArg, QuantizeArgs};

fn tmp(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("wasmserve-quantize-{}-{tag}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

fn args(output: &Path, format: FormatArg, bits: u32, group: usize, policy: Option<PathBuf>) -> QuantizeArgs {
    QuantizeArgs {
        input: common::repo_root().join("tests/reference/tiny_llama"),
        output: output.to_path_buf(),
        format: Some(format),
        bits: Some(bits),
        group_size: Some(group),
        policy,
        quiet: true,
    }
}

/// Level of code `i` straight from the spec text: h = 2^(b−1), t = (i − h)/h, w = s·fma(a·t, t·t, t).
fn spec_level(i: u32, bits: u32, s: f32, a: f32) -> f32 {
    let h = (1u32 << (bits - 1)) as f32;
    let t = (i as f32 - h) / h;
    s * (a * t).mul_add(t * t, t)
}

fn last_logits(dir: &Path) -> Vec<f32> {
    let m = wasmserve::model::load(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
    let ids = m.tokenizer.encode("The quick brown fox", true).unwrap();
    let rows: Vec<BatchRow> = (0..ids.len()).map(|pos| BatchRow { seq: 0, pos }).collect();
    let mut kv = ContiguousKvCache::new(m.config().num_layers(), m.config().kv_width(), 1);
    m.model.forward(&ids, &rows, &mut kv, &[ids.len() - 1])
}

#[test]
fn cubic_mixed_policy_round_trip() {
    let policy = tmp("policy.json");
    std::fs::write(
        &policy,
        r#"{"rules": [{"match": "re:.*mlp\\.down_proj$", "bits": 4, "group_size": 64},
                      {"match": "model.layers.1.self_attn.q_proj", "skip": true}]}"#,
    )
    .unwrap();
    let out = tmp("cubic");
    let report = quantize(&args(&out, FormatArg::Cubic, 3, 32, Some(policy))).unwrap();
    eprintln!("{}", report.table());
    assert!(report.by_kind.contains_key("cubic b3 g32") && report.by_kind.contains_key("cubic b4 g64"));

    let cfg: Value = serde_json::from_str(&std::fs::read_to_string(out.join("config.json")).unwrap()).unwrap();
    let q = CubicConfig::parse(&cfg["quantization_config"]).unwrap().unwrap();
    assert_eq!(q.modules["model.layers.0.mlp.down_proj"].bits, 4);
    assert_eq!(q.modules["model.layers.0.mlp.up_proj"].bits, 3);
    assert!(!q.modules.contains_key("model.layers.1.self_attn.q_proj"));
    assert!(!q.modules.contains_key("lm_head"));

    // Decode every quantized weight from the raw tensors by the spec and compare with the loader.
    let bytes = std::fs::read(out.join("model.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let src = SafetensorsSource::open(&out).unwrap();
    let dense = SafetensorsSource::open(&common::repo_root().join("tests/reference/tiny_llama")).unwrap();
    for (module, layer) in &q.modules {
        let codes = st.tensor(&format!("{module}.cubic_codes")).unwrap();
        let scale = st.tensor(&format!("{module}.cubic_scale")).unwrap();
        let shape = st.tensor(&format!("{module}.cubic_shape")).unwrap();
        let (rows, stride) = (codes.shape()[0], codes.shape()[1]);
        let cols = stride * 8 / layer.bits as usize;
        let groups = scale.shape()[1];
        let f = |t: &safetensors::tensor::TensorView, k: usize| {
            f16::from_le_bytes([t.data()[2 * k], t.data()[2 * k + 1]]).to_f32()
        };
        let m = load_cubic(&src, module, rows, cols, *layer).unwrap();
        let original = dense.load(&format!("{module}.weight"), &[rows, cols]).unwrap();
        for r in 0..rows {
            let got = m.dequantize_row(r);
            for j in 0..cols {
                let bit = j * layer.bits as usize;
                let row = &codes.data()[r * stride..];
                let pair = row[bit / 8] as u32 | (*row.get(bit / 8 + 1).unwrap_or(&0) as u32) << 8;
                let code = (pair >> (bit % 8)) & ((1 << layer.bits) - 1);
                let g = r * groups + j / layer.group_size;
                let want = spec_level(code, layer.bits, f(&scale, g), f(&shape, g));
                assert_eq!(got[j].to_bits(), want.to_bits(), "{module}[{r},{j}]");
                // Nearest level for the stored parameters.
                let x = original.as_slice()[r * cols + j];
                for i in 0..(1 << layer.bits) {
                    assert!((x - want).abs() <= (x - spec_level(i, layer.bits, f(&scale, g), f(&shape, g))).abs());
                }
            }
        }
    }
    // Skipped layers stay bf16 and the model runs.
    assert!(src.contains("model.layers.1.self_attn.q_proj.weight"));
    assert!(last_logits(&out).iter().all(|v| v.is_finite()));
    assert!(out.join("tokenizer.json").exists() && out.join("chat_template.jinja").exists());

    // Refuses to overwrite.
    let err = quantize(&args(&out, FormatArg::Cubic, 3, 32, None)).err().expect("second run must refuse").to_string();
    assert!(err.contains("refusing to overwrite"), "{err}");
}

#[test]
fn more_bits_track_the_dense_model() {
    let dense = last_logits(&common::repo_root().join("tests/reference/tiny_llama"));
    let mut prev = f32::INFINITY;
    for (bits, tag) in [(3, "c3"), (5, "c5"), (8, "c8")] {
        let out = tmp(tag);
        quantize(&args(&out, FormatArg::Cubic, bits, 32, None)).unwrap();
        let diff = kernels::compare::max_abs_error(&last_logits(&out), &dense);
        eprintln!("cubic {bits} bits: max |logit − dense| {diff:.4}");
        assert!(diff < prev, "{bits} bits: {diff} not below {prev}");
        prev = diff;
    }
    assert!(prev < 0.05, "8-bit cubic should be close to dense: {prev}");
}

#[test]
fn int_output_is_a_compressed_tensors_checkpoint() {
    let out = tmp("int4");
    let report = quantize(&args(&out, FormatArg::Int, 4, 32, None)).unwrap();
    let s = &report.by_kind["int4 g32"];
    assert!((s.bits_per_weight() - 4.5).abs() < 1e-9, "4 bits + bf16 scale per 32");
    let cfg: Value = serde_json::from_str(&std::fs::read_to_string(out.join("config.json")).unwrap()).unwrap();
    assert_eq!(cfg["quantization_config"]["quant_method"], "compressed-tensors");
    let dense = last_logits(&common::repo_root().join("tests/reference/tiny_llama"));
    let diff = kernels::compare::max_abs_error(&last_logits(&out), &dense);
    eprintln!("int4 g32: max |logit − dense| {diff:.4}, NRMSE {:.4}", s.nrmse());
    assert!(diff.is_finite() && diff < 1.0);
}
