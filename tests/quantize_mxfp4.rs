//! `wasmserve quantize` with an MXFP4 source (tests/reference/ct/ct_mxfp4: a Llama whose MLP is
//! compressed-tensors `mxfp4-pack-quantized`, made by tests/reference/make_mxfp4.py). The
//! requantized output must be exactly what quantizing the decoded f32 weights gives (the decoded
//! weights checked against transformers' own decompression), load, and run; the report's
//! checkpoint-wide bits per weight must count every stored byte; refusals are clean errors.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use half::bf16;
use safetensors::{Dtype, SafeTensors};
use serde_json::Value;
use wasmserve::model::format::hf_source::SafetensorsSource;
use wasmserve::model::format::quant::mxfp4_linear::load_ct_mxfp4;
use wasmserve::model::kv::{BatchRow, ContiguousKvCache};
use wasmserve::quantize::cubic_fit::quantize_cubic;
use wasmserve::quantize::int_rtn::quantize_int;
use wasmserve::quantize::{quantize, FormatArg, QuantizeArgs};

fn source() -> PathBuf {
    common::repo_root().join("tests/reference/ct/ct_mxfp4")
}

fn tmp(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("wasmserve-qmx-{}-{tag}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

fn args(output: &Path, format: FormatArg, bits: u32, group: usize, policy: Option<PathBuf>) -> QuantizeArgs {
    QuantizeArgs {
        input: source(),
        output: output.to_path_buf(),
        format: Some(format),
        bits: Some(bits),
        group_size: Some(group),
        policy,
        quiet: true,
    }
}

/// The MXFP4 modules of the source with their decoded f32 weights `[rows, cols]`; the modules
/// transformers decompressed for the fixture are compared with its values bit for bit.
fn decoded_modules() -> Vec<(String, usize, usize, Vec<f32>)> {
    let src = SafetensorsSource::open(&source()).unwrap();
    let refs = std::fs::read(common::repo_root().join("tests/reference/ct/ct_mxfp4.reference.safetensors")).unwrap();
    let refs = SafeTensors::deserialize(&refs).unwrap();
    let mut out = Vec::new();
    let names: Vec<String> = src.names().map(str::to_string).collect();
    for name in names {
        let Some(module) = name.strip_suffix(".weight_packed") else { continue };
        let p = src.raw(&name).unwrap();
        let (rows, cols) = (p.shape[0], p.shape[1] * 2);
        let m = load_ct_mxfp4(&src, module, rows, cols).unwrap();
        let w: Vec<f32> = (0..rows).flat_map(|r| m.dequantize_row(r)).collect();
        if let Ok(t) = refs.tensor(&format!("{module}.native")) {
            assert_eq!(t.dtype(), Dtype::BF16);
            for (i, c) in t.data().chunks_exact(2).enumerate() {
                assert_eq!(
                    bf16::from_le_bytes([c[0], c[1]]).to_f32().to_bits(),
                    w[i].to_bits(),
                    "{module}[{i}] vs transformers"
                );
            }
        }
        out.push((module.to_string(), rows, cols, w));
    }
    assert_eq!(out.len(), 6, "fixture has 2 layers × 3 MLP projections in MXFP4");
    out
}

fn bytes_of(st: &SafeTensors, name: &str) -> Vec<u8> {
    st.tensor(name).unwrap_or_else(|_| panic!("{name} missing")).data().to_vec()
}

fn u16s(v: &[u16]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn runs(dir: &Path) {
    let m = wasmserve::model::load(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
    let ids = m.tokenizer.encode("The quick brown fox", true).unwrap();
    let rows: Vec<BatchRow> = (0..ids.len()).map(|pos| BatchRow { seq: 0, pos }).collect();
    let mut kv = ContiguousKvCache::new(m.config().num_layers(), m.config().kv_width(), 1);
    let logits = m.model.forward(&ids, &rows, &mut kv, &[ids.len() - 1]);
    assert!(!logits.is_empty() && logits.iter().all(|v| v.is_finite()));
}

/// Parameters of the source (every tensor's elements; an MXFP4 pair counts its `[out, in]`).
fn source_params() -> u64 {
    let bytes = std::fs::read(source().join("model.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    st.tensors()
        .iter()
        .map(|(name, t)| match name {
            n if n.ends_with(".weight_scale") => 0,
            n if n.ends_with(".weight_packed") => (t.shape()[0] * t.shape()[1] * 2) as u64,
            _ => t.shape().iter().product::<usize>() as u64,
        })
        .sum()
}

fn stored_bits(dir: &Path) -> u64 {
    let bytes = std::fs::read(dir.join("model.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    st.tensors().iter().map(|(_, t)| t.data().len() as u64 * 8).sum()
}

#[test]
fn mxfp4_source_requantizes_to_int4_exactly_like_its_decoded_weights() {
    let decoded = decoded_modules();
    let policy = tmp("policy.json");
    std::fs::write(&policy, r#"{"rules": [{"match": "model.layers.1.mlp.up_proj", "skip": true}]}"#).unwrap();
    let out = tmp("int4");
    let report = quantize(&args(&out, FormatArg::Int, 4, 64, Some(policy))).unwrap();
    let table = report.table();
    eprintln!("{table}");

    let cfg: Value = serde_json::from_str(&std::fs::read_to_string(out.join("config.json")).unwrap()).unwrap();
    assert_eq!(cfg["quantization_config"]["format"], "pack-quantized");
    let bytes = std::fs::read(out.join("model.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    for (module, rows, cols, w) in &decoded {
        if module == "model.layers.1.mlp.up_proj" {
            // Kept unquantized: the decoded values as BF16 (exact), no MXFP4 tensors left.
            let want: Vec<u16> = w.iter().map(|v| bf16::from_f32(*v).to_bits()).collect();
            assert_eq!(bytes_of(&st, &format!("{module}.weight")), u16s(&want), "{module}");
            assert!(
                st.tensor(&format!("{module}.weight_packed")).is_err()
                    && st.tensor(&format!("{module}.weight_scale")).is_err()
            );
            continue;
        }
        let t = quantize_int(w, *rows, *cols, 4, 64, true);
        assert_eq!(bytes_of(&st, &format!("{module}.weight_packed")), t.packed, "{module} codes");
        assert_eq!(bytes_of(&st, &format!("{module}.weight_scale")), u16s(&t.scale), "{module} scales");
    }
    assert_eq!(report.checkpoint_params, source_params());
    assert_eq!(report.checkpoint_bits, stored_bits(&out));
    assert!(
        table.contains(&format!("checkpoint: {:.4} effective bits per weight", report.checkpoint_bits_per_weight())),
        "{table}"
    );
    runs(&out);
}

#[test]
fn mxfp4_source_requantizes_to_cubic_exactly_like_its_decoded_weights() {
    let decoded = decoded_modules();
    let out = tmp("cubic3");
    let report = quantize(&args(&out, FormatArg::Cubic, 3, 64, None)).unwrap();
    eprintln!("{}", report.table());
    let bytes = std::fs::read(out.join("model.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    for (module, rows, cols, w) in &decoded {
        let t = quantize_cubic(w, *rows, *cols, 3, 64);
        assert_eq!(bytes_of(&st, &format!("{module}.cubic_codes")), t.codes, "{module} codes");
        assert_eq!(bytes_of(&st, &format!("{module}.cubic_scale")), u16s(&t.scale), "{module} scales");
        assert_eq!(bytes_of(&st, &format!("{module}.cubic_shape")), u16s(&t.shape), "{module} shapes");
    }
    assert_eq!(report.checkpoint_params, source_params());
    assert_eq!(report.checkpoint_bits, stored_bits(&out));
    runs(&out);
}

/// Runs the real binary as a user would (no backtrace requested); returns (success, stderr).
fn wasmserve(args: &[&str]) -> (bool, String) {
    let o = Command::new(env!("CARGO_BIN_EXE_wasmserve"))
        .args(args)
        .env("RUST_LOG", "error")
        .env_remove("RUST_BACKTRACE")
        .env_remove("RUST_LIB_BACKTRACE")
        .output()
        .unwrap();
    (o.status.success(), String::from_utf8_lossy(&o.stderr).into_owned())
}

#[test]
fn refusing_to_overwrite_is_a_one_line_error() {
    let out = tmp("exists");
    std::fs::create_dir_all(&out).unwrap();
    std::fs::write(out.join("keep.txt"), "mine").unwrap();
    let input = common::repo_root().join("tests/reference/tiny_llama");
    let (ok, err) = wasmserve(&[
        "quantize",
        "--input",
        input.to_str().unwrap(),
        "--output",
        out.to_str().unwrap(),
        "--format",
        "int",
        "--quiet",
    ]);
    assert!(!ok, "must exit non-zero");
    assert!(!err.contains("panicked"), "{err}");
    let lines: Vec<&str> = err.lines().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(lines.len(), 1, "{err}");
    assert!(lines[0].contains("already exists; refusing to overwrite"), "{err}");
    assert_eq!(std::fs::read_to_string(out.join("keep.txt")).unwrap(), "mine", "existing output left untouched");
    assert_eq!(std::fs::read_dir(&out).unwrap().count(), 1);
}

#[test]
fn int_quantized_source_is_refused_cleanly() {
    let out = tmp("from-int");
    let input = common::repo_root().join("tests/reference/ct/ct_int4_sym");
    let (ok, err) = wasmserve(&[
        "quantize",
        "--input",
        input.to_str().unwrap(),
        "--output",
        out.to_str().unwrap(),
        "--format",
        "cubic",
        "--quiet",
    ]);
    assert!(!ok && !err.contains("panicked"), "{err}");
    assert!(err.contains("only mxfp4-pack-quantized sources can be requantized"), "{err}");
    assert!(!out.exists());
}
