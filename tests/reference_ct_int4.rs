//! compressed-tensors `pack-quantized` checkpoints made by the compressed-tensors package itself
//! (tests/reference/make_ct_int4.py): our dequantised weights equal its decompression bit for
//! bit, and our logits match transformers running the same checkpoints.

mod common;

use std::path::{Path, PathBuf};

use half::bf16;
use safetensors::{Dtype, SafeTensors};
use serde_json::Value;
use wasmserve::model::format::hf_source::SafetensorsSource;
use wasmserve::model::format::quant::ct_config::CtConfig;
use wasmserve::model::format::quant::ct_linear::load_int_linear;
use wasmserve::model::kv::{BatchRow, ContiguousKvCache};

/// Max |ours − transformers| when transformers multiplies with the exact dequantised weights
/// (compressed-tensors' decompression with f32 scales): both are f32 forward passes over the same
/// weights, so this is the tiny_llama tolerance.
const EXACT_TOLERANCE: f32 = 2e-4;
/// Max |ours − transformers| on its `dequantize=True` load path (used where its compressed-module
/// path cannot load the checkpoint: asymmetric zero points), which decompresses to bf16, each
/// weight rounded to 8 significant bits, while we keep the exact products. On its compressed-module
/// path (f32 scales in an f32 model) it computes the exact products too and EXACT_TOLERANCE holds.
const BF16_LOAD_TOLERANCE: f32 = 0.05;
/// Max |ours − exact-weight transformers| with `--cpu-activations int8` (see its test).
const INT8_TOLERANCE: f32 = 0.3;

fn dir(name: &str) -> PathBuf {
    common::repo_root().join("tests/reference/ct").join(name)
}

struct Reference {
    meta: Value,
    bytes: Vec<u8>,
}

impl Reference {
    fn open(name: &str) -> Self {
        let base = dir(name).with_extension("reference.json");
        let meta = serde_json::from_str(&std::fs::read_to_string(&base).unwrap()).unwrap();
        let bytes = std::fs::read(dir(name).with_extension("reference.safetensors")).unwrap();
        Self { meta, bytes }
    }

    fn tensor(&self, name: &str) -> (Dtype, Vec<usize>, Vec<u8>) {
        let st = SafeTensors::deserialize(&self.bytes).unwrap();
        let t = st.tensor(name).unwrap_or_else(|_| panic!("reference tensor {name}"));
        (t.dtype(), t.shape().to_vec(), t.data().to_vec())
    }

    fn f32s(&self, name: &str) -> Vec<f32> {
        let (dtype, _, data) = self.tensor(name);
        assert_eq!(dtype, Dtype::F32);
        data.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
    }
}

fn ct_config(path: &Path) -> CtConfig {
    let cfg: Value = serde_json::from_str(&std::fs::read_to_string(path.join("config.json")).unwrap()).unwrap();
    CtConfig::parse(&cfg["quantization_config"]).unwrap().unwrap()
}

/// Every checked weight, dequantised by us, against compressed-tensors' decompression: f32 bits
/// against its f32-scale decompression, and rounded to bf16 against its native bf16 output.
fn check_decompression(name: &str) {
    let path = dir(name);
    let reference = Reference::open(name);
    let cfg = ct_config(&path);
    let src = SafetensorsSource::open(&path).unwrap();
    let modules = reference.meta["decompressed"].as_array().unwrap();
    assert!(!modules.is_empty());
    for module in modules {
        let module = module.as_str().unwrap();
        let (dtype, shape, native) = reference.tensor(&format!("{module}.native"));
        assert_eq!(dtype, Dtype::BF16);
        let (rows, cols) = (shape[0], shape[1]);
        let scheme = cfg.scheme_for(module).unwrap_or_else(|| panic!("{name}: {module} not quantized"));
        let lin = load_int_linear(&src, module, rows, cols, &scheme.weights).unwrap();
        let exact = reference.f32s(&format!("{module}.f32"));
        for r in 0..rows {
            let ours = lin.dequantize_row(r);
            for c in 0..cols {
                let i = r * cols + c;
                assert_eq!(
                    ours[c].to_bits(),
                    exact[i].to_bits(),
                    "{name} {module}[{r},{c}]: f32 {} vs {}",
                    ours[c],
                    exact[i]
                );
                let want = u16::from_le_bytes([native[2 * i], native[2 * i + 1]]);
                assert_eq!(bf16::from_f32(ours[c]).to_bits(), want, "{name} {module}[{r},{c}]: bf16");
            }
        }
    }
}

fn max_logit_diff(name: &str) {
    max_logit_diff_tp(name, 1);
}

/// The checkpoint split over `tp` tensor-parallel ranks (the packed layers cut into row and
/// column parts, a column cut inside a 128-wide group included) against the same references.
fn max_logit_diff_tp(name: &str, tp: usize) {
    let path = dir(name);
    let reference = Reference::open(name);
    let m = wasmserve::model::load_tp(&path, tp).unwrap_or_else(|e| panic!("loading {name} as {tp} ranks: {e}"));
    let (mut d_exact, mut d_tf) = (0.0f32, 0.0f32);
    for (i, case) in reference.meta["cases"].as_array().unwrap().iter().enumerate() {
        let ids: Vec<u32> = case["ids"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect();
        assert_eq!(m.tokenizer.encode(case["text"].as_str().unwrap(), true).unwrap(), ids);
        let rows: Vec<BatchRow> = (0..ids.len()).map(|pos| BatchRow { seq: 0, pos }).collect();
        let all: Vec<usize> = (0..ids.len()).collect();
        let mut kv = m.model.contiguous_cache(1);
        let logits = m.model.forward(&ids, &rows, &mut kv, &all);
        for (variant, d) in [("exact", &mut d_exact), ("transformers", &mut d_tf)] {
            let want = reference.f32s(&format!("logits.{variant}.{i}"));
            assert_eq!(want.len(), logits.len());
            *d = d.max(kernels::compare::max_abs_error(&logits, &want));
        }
    }
    let route = reference.meta["transformers_route"].as_str().unwrap();
    eprintln!("{name} (tp={tp}): max |logit diff| vs transformers: exact weights {d_exact:.2e}, its own load ({route}) {d_tf:.2e}");
    assert!(d_exact <= EXACT_TOLERANCE, "{name}: {d_exact} vs exact-weight transformers");
    let tol = if route == "dequantize=True" { BF16_LOAD_TOLERANCE } else { EXACT_TOLERANCE };
    assert!(d_tf <= tol, "{name}: {d_tf} vs transformers ({route})");
}

/// A copy of a fixture checkpoint with its config.json edited.
fn edited_copy(name: &str, tag: &str, edit: impl FnOnce(&mut Value)) -> PathBuf {
    let to = std::env::temp_dir().join(format!("wasmserve-ct-{}-{tag}", std::process::id()));
    let _ = std::fs::remove_dir_all(&to);
    std::fs::create_dir_all(&to).unwrap();
    for e in std::fs::read_dir(dir(name)).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
    }
    let mut cfg: Value = serde_json::from_str(&std::fs::read_to_string(to.join("config.json")).unwrap()).unwrap();
    edit(&mut cfg);
    std::fs::write(to.join("config.json"), cfg.to_string()).unwrap();
    to
}

fn load_error(path: &Path) -> String {
    match wasmserve::model::load(path) {
        Ok(_) => panic!("{} loaded but should not", path.display()),
        Err(e) => {
            eprintln!("refused: {e}");
            e.to_string()
        }
    }
}

#[test]
fn unsupported_quantization_configs_are_refused_clearly() {
    let p = edited_copy("ct_int4_sym", "gptq", |c| c["quantization_config"]["quant_method"] = "gptq".into());
    assert!(load_error(&p).contains("quant_method 'gptq' is not supported"), "{}", load_error(&p));
    // A config that says lm_head is quantized when the checkpoint holds it in bf16 loads it dense,
    // as vLLM does (RedHatAI's K3 INT4 config targets modules the checkpoint keeps dense).
    let p = edited_copy("ct_int4_sym", "lmhead", |c| c["quantization_config"]["ignore"] = serde_json::json!([]));
    wasmserve::model::load(&p).expect("a targeted module stored dense loads dense");
    // Group size that disagrees with the stored scales.
    let p = edited_copy("ct_int4_sym", "gs", |c| {
        c["quantization_config"]["config_groups"]["group_0"]["weights"]["group_size"] = 64.into()
    });
    assert!(load_error(&p).contains("weight_scale"), "{}", load_error(&p));
}

#[test]
fn w4a16_symmetric_group128() {
    check_decompression("ct_int4_sym");
    max_logit_diff("ct_int4_sym");
}

#[test]
fn w4a16_asymmetric_zero_points() {
    check_decompression("ct_int4_asym");
    max_logit_diff("ct_int4_asym");
}

/// Tensor parallelism keeps the layers packed: each rank holds its rows of q/k/v/gate/up and its
/// columns of o/down. With 2 ranks the MLP's 384 input columns of down_proj are cut at 192, inside
/// a 128-wide group; with 4 ranks o_proj's 128 columns are cut into 32-wide parts of one group.
#[test]
fn tensor_parallel_ranks_keep_packed_layers_and_match_transformers() {
    for name in ["ct_int4_sym", "ct_int4_asym", "ct_mixed"] {
        for tp in [2, 4] {
            max_logit_diff_tp(name, tp);
        }
    }
}

#[test]
fn mixed_groups_int8_channel_and_regex_ignore() {
    let cfg = ct_config(&dir("ct_mixed"));
    assert_eq!(cfg.scheme_for("model.layers.0.mlp.up_proj").unwrap().weights.num_bits, 8);
    assert_eq!(cfg.scheme_for("model.layers.0.self_attn.o_proj").unwrap().weights.group_size, Some(64));
    assert!(cfg.scheme_for("model.layers.1.self_attn.o_proj").is_none(), "ignored by an re: pattern, stays bf16");
    assert!(cfg.scheme_for("lm_head").is_none());
    check_decompression("ct_mixed");
    max_logit_diff("ct_mixed");
}

#[test]
fn activation_order_g_idx() {
    check_decompression("ct_int4_gidx");
    // The repacked (group-contiguous) layout multiplies like the dequantised matrix.
    let path = dir("ct_int4_gidx");
    let cfg = ct_config(&path);
    let src = SafetensorsSource::open(&path).unwrap();
    let module = "model.layers.0.mlp.down_proj";
    let lin = load_int_linear(&src, module, 128, 384, &cfg.scheme_for(module).unwrap().weights).unwrap();
    let x: Vec<f32> = (0..2 * 384).map(|i| ((i * 37 % 101) as f32 - 50.0) / 50.0).collect();
    let mut out = vec![0.0f32; 2 * 128];
    lin.forward(&x, 2, &mut out);
    for r in 0..128 {
        let w = lin.dequantize_row(r);
        for i in 0..2 {
            let want: f64 = x[i * 384..(i + 1) * 384].iter().zip(&w).map(|(a, b)| *a as f64 * *b as f64).sum();
            assert!((out[i * 128 + r] as f64 - want).abs() < 1e-4, "row {r}: {} vs {want}", out[i * 128 + r]);
        }
    }
    let m = wasmserve::model::load(&path).unwrap();
    let mut kv = ContiguousKvCache::new(m.config().num_layers(), m.config().kv_width(), 1);
    let logits = m.model.forward(&[5, 6], &[BatchRow { seq: 0, pos: 0 }, BatchRow { seq: 0, pos: 1 }], &mut kv, &[1]);
    assert!(logits.iter().all(|v| v.is_finite()));
}

/// `--cpu-activations int8` on compressed-tensors checkpoints: the 4- and 8-bit layers (group
/// 128, group 64, per-channel, asymmetric) take 8-bit inputs, whole or split over
/// tensor-parallel ranks. The logits move (the inputs are rounded) but stay within a bound a few
/// times the measured error of the exact-weight reference.
#[test]
fn int8_activations_apply_to_compressed_tensors_layers() {
    use wasmserve::model::activations::CpuActivations;
    use wasmserve::model::LoadOptions;
    for name in ["ct_int4_sym", "ct_int4_asym", "ct_mixed"] {
        let reference = Reference::open(name);
        for tp in [1, 2] {
            let load = |act| {
                wasmserve::model::load_with_options(
                    &dir(name),
                    &LoadOptions { tensor_parallel: tp, cpu_activations: act, ..Default::default() },
                )
                .unwrap()
            };
            let (exact_acts, int8_acts) = (load(CpuActivations::F32), load(CpuActivations::Int8));
            let (mut d_int8, mut scale, mut moved) = (0.0f32, 0.0f32, false);
            for (i, case) in reference.meta["cases"].as_array().unwrap().iter().enumerate() {
                let ids: Vec<u32> =
                    case["ids"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect();
                let rows: Vec<BatchRow> = (0..ids.len()).map(|pos| BatchRow { seq: 0, pos }).collect();
                let all: Vec<usize> = (0..ids.len()).collect();
                let run = |m: &wasmserve::model::LoadedModel| {
                    m.model.forward(&ids, &rows, &mut m.model.contiguous_cache(1), &all)
                };
                let (a, b) = (run(&exact_acts), run(&int8_acts));
                moved |= a != b;
                let want = reference.f32s(&format!("logits.exact.{i}"));
                d_int8 = d_int8.max(kernels::compare::max_abs_error(&b, &want));
                scale = scale.max(want.iter().fold(0.0f32, |m, v| m.max(v.abs())));
            }
            eprintln!("{name} (tp={tp}): int8 activations max |logit diff| {d_int8:.3e} (logits up to {scale:.2})");
            assert!(moved, "{name} tp={tp}: --cpu-activations int8 changed no logit");
            assert!(d_int8 <= INT8_TOLERANCE, "{name} tp={tp}: {d_int8} with int8 activations");
        }
    }
}
