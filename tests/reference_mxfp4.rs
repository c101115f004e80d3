//! MXFP4 against independent encoders/decoders (tests/reference/make_mxfp4.py): a Llama whose MLP
//! compressed-tensors quantized to `mxfp4-pack-quantized`, and the same bytes in gpt-oss's
//! `*_blocks`/`*_scales` layout decoded by transformers' gpt-oss code.

mod common;

use std::path::PathBuf;

use half::bf16;
use safetensors::{Dtype, SafeTensors};
use serde_json::Value;
use wasmserve::model::format::hf_source::SafetensorsSource;
use wasmserve::model::format::quant::mxfp4_linear::{load_ct_mxfp4, load_gpt_oss_expert};
use wasmserve::model::kv::{BatchRow, ContiguousKvCache};

/// Max |ours − transformers| logits. MXFP4 weights are exact in bf16, so transformers' bf16
/// decompression holds the same weight values we multiply with; only f32 summation order differs.
const LOGIT_TOLERANCE: f32 = 2e-4;

fn ct_dir() -> PathBuf {
    common::repo_root().join("tests/reference/ct")
}

fn bf16s(st: &SafeTensors, name: &str) -> (Vec<usize>, Vec<u16>) {
    let t = st.tensor(name).unwrap_or_else(|_| panic!("{name}"));
    assert_eq!(t.dtype(), Dtype::BF16);
    (t.shape().to_vec(), t.data().chunks_exact(2).map(|c| u16::from_le_bytes([c[0], c[1]])).collect())
}

#[test]
fn compressed_tensors_mxfp4_decodes_bit_exactly() {
    let dir = ct_dir().join("ct_mxfp4");
    let bytes = std::fs::read(ct_dir().join("ct_mxfp4.reference.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let meta: Value =
        serde_json::from_str(&std::fs::read_to_string(ct_dir().join("ct_mxfp4.reference.json")).unwrap()).unwrap();
    let src = SafetensorsSource::open(&dir).unwrap();
    for module in meta["decompressed"].as_array().unwrap() {
        let module = module.as_str().unwrap();
        let (shape, want) = bf16s(&st, &format!("{module}.native"));
        let m = load_ct_mxfp4(&src, module, shape[0], shape[1]).unwrap();
        for r in 0..shape[0] {
            let row = m.dequantize_row(r);
            for (c, v) in row.iter().enumerate() {
                assert_eq!(bf16::from_f32(*v).to_f32(), *v, "MXFP4 values are exact in bf16");
                assert_eq!(bf16::from_f32(*v).to_bits(), want[r * shape[1] + c], "{module}[{r},{c}]");
            }
        }
    }
}

#[test]
fn compressed_tensors_mxfp4_llama_matches_transformers() {
    let dir = ct_dir().join("ct_mxfp4");
    let bytes = std::fs::read(ct_dir().join("ct_mxfp4.reference.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let meta: Value =
        serde_json::from_str(&std::fs::read_to_string(ct_dir().join("ct_mxfp4.reference.json")).unwrap()).unwrap();
    let m = wasmserve::model::load(&dir).unwrap();
    let cfg = m.config();
    let mut max = 0.0f32;
    for (i, case) in meta["cases"].as_array().unwrap().iter().enumerate() {
        let ids: Vec<u32> = case["ids"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect();
        let rows: Vec<BatchRow> = (0..ids.len()).map(|pos| BatchRow { seq: 0, pos }).collect();
        let all: Vec<usize> = (0..ids.len()).collect();
        let mut kv = ContiguousKvCache::new(cfg.num_layers(), cfg.kv_width(), 1);
        let logits = m.model.forward(&ids, &rows, &mut kv, &all);
        let t = st.tensor(&format!("logits.transformers.{i}")).unwrap();
        let want: Vec<f32> = t.data().chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
        assert_eq!(want.len(), logits.len());
        max = max.max(kernels::compare::max_abs_error(&logits, &want));
    }
    eprintln!("ct_mxfp4: max |logit diff| vs transformers ({}) {max:.2e}", meta["transformers_route"]);
    assert!(max <= LOGIT_TOLERANCE, "{max}");
}

#[test]
fn gpt_oss_blocks_decode_like_transformers() {
    let path = ct_dir().join("gpt_oss_blocks.safetensors");
    let bytes = std::fs::read(&path).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    // transformers returns [E, in, out] (transposed for x @ W).
    let (shape, want) = bf16s(&st, "reference.dequantized");
    let (e, cols, rows) = (shape[0], shape[1], shape[2]);
    assert_eq!(e, 2);
    let dir = std::env::temp_dir().join(format!("wasmserve-gptoss-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::copy(&path, dir.join("model.safetensors")).unwrap();
    let src = SafetensorsSource::open(&dir).unwrap();
    for expert in 0..e {
        let m = load_gpt_oss_expert(&src, "experts.down_proj", expert).unwrap();
        assert_eq!((m.rows(), m.cols()), (rows, cols));
        for r in 0..rows {
            let row = m.dequantize_row(r);
            for c in 0..cols {
                assert_eq!(
                    bf16::from_f32(row[c]).to_bits(),
                    want[(expert * cols + c) * rows + r],
                    "expert {expert} [{r},{c}]"
                );
            }
        }
    }
}
