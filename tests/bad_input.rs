//! Broken checkpoints give clear errors naming the file and the tensor, never a panic.

mod common;

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use safetensors::tensor::{Dtype, TensorView};
use serde_json::json;
use wasmserve::model::error::LoadError;

fn tmpdir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("wasmserve-bad-input-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn load_err(path: &Path) -> String {
    match wasmserve::model::load(path) {
        Ok(_) => panic!("{} loaded but should have failed", path.display()),
        Err(e) => e.to_string(),
    }
}

/// A tiny Llama in HF layout (hidden 8, 2 heads, 1 KV head, 1 layer, vocab 4).
fn tiny_config() -> serde_json::Value {
    json!({"model_type": "llama", "hidden_size": 8, "intermediate_size": 16, "num_attention_heads": 2,
           "num_key_value_heads": 1, "num_hidden_layers": 1, "vocab_size": 4, "rms_norm_eps": 1e-5,
           "rope_theta": 10000.0, "max_position_embeddings": 64, "tie_word_embeddings": true})
}

fn tiny_tensors() -> Vec<(String, Vec<usize>)> {
    let p = "model.layers.0";
    vec![
        ("model.embed_tokens.weight".into(), vec![4, 8]),
        ("model.norm.weight".into(), vec![8]),
        (format!("{p}.input_layernorm.weight"), vec![8]),
        (format!("{p}.post_attention_layernorm.weight"), vec![8]),
        (format!("{p}.self_attn.q_proj.weight"), vec![8, 8]),
        (format!("{p}.self_attn.k_proj.weight"), vec![4, 8]),
        (format!("{p}.self_attn.v_proj.weight"), vec![4, 8]),
        (format!("{p}.self_attn.o_proj.weight"), vec![8, 8]),
        (format!("{p}.mlp.gate_proj.weight"), vec![16, 8]),
        (format!("{p}.mlp.up_proj.weight"), vec![16, 8]),
        (format!("{p}.mlp.down_proj.weight"), vec![8, 16]),
    ]
}

fn write_tiny_hf(dir: &Path, config: serde_json::Value, skip: Option<&str>, int_dtype_for: Option<&str>) {
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    let tokenizer = json!({"version": "1.0", "truncation": null, "padding": null, "added_tokens": [], "normalizer": null,
        "pre_tokenizer": {"type": "Whitespace"}, "post_processor": null, "decoder": null,
        "model": {"type": "WordLevel", "vocab": {"a": 0, "b": 1, "c": 2, "d": 3}, "unk_token": "a"}});
    std::fs::write(dir.join("tokenizer.json"), tokenizer.to_string()).unwrap();
    let data: Vec<(String, Vec<usize>, Dtype, Vec<u8>)> = tiny_tensors()
        .into_iter()
        .filter(|(n, _)| Some(n.as_str()) != skip)
        .map(|(n, shape)| {
            let count: usize = shape.iter().product();
            let (dtype, bytes) = if Some(n.as_str()) == int_dtype_for {
                (Dtype::I32, (0..count as i32).flat_map(|v| v.to_le_bytes()).collect())
            } else {
                (Dtype::F32, (0..count).flat_map(|i| (0.01 * i as f32).to_le_bytes()).collect())
            };
            (n, shape, dtype, bytes)
        })
        .collect();
    let views: HashMap<String, TensorView> =
        data.iter().map(|(n, s, d, b)| (n.clone(), TensorView::new(*d, s.clone(), b).unwrap())).collect();
    safetensors::serialize_to_file(views, None, &dir.join("model.safetensors")).unwrap();
}

#[test]
fn tiny_valid_hf_checkpoint_loads_and_runs() {
    let dir = tmpdir("valid");
    write_tiny_hf(&dir, tiny_config(), None, None);
    let m = wasmserve::model::load(&dir).expect("tiny checkpoint loads");
    let mut kv = wasmserve::model::kv::ContiguousKvCache::new(1, 4, 1);
    let rows = [wasmserve::model::kv::BatchRow { seq: 0, pos: 0 }, wasmserve::model::kv::BatchRow { seq: 0, pos: 1 }];
    let logits = m.model.forward(&[1, 2], &rows, &mut kv, &[1]);
    assert_eq!(logits.len(), 4);
    assert!(logits.iter().all(|v| v.is_finite()));
}

#[test]
fn truncated_gguf_names_file_and_tensor() {
    let src = common::default_model_path();
    let bytes = std::fs::read(&src).unwrap();
    let dir = tmpdir("truncated");
    // Cut inside the tensor data: the header parses, the last tensors do not fit.
    let path = dir.join("cut.gguf");
    std::fs::write(&path, &bytes[..bytes.len() / 2]).unwrap();
    let err = load_err(&path);
    assert!(err.contains("cut.gguf") && err.contains("truncated") && err.contains("tensor '"), "{err}");
    // Cut inside the header.
    let path = dir.join("header.gguf");
    std::fs::write(&path, &bytes[..1000]).unwrap();
    let err = load_err(&path);
    assert!(err.contains("header.gguf") && err.contains("truncated"), "{err}");
    // Not a GGUF at all.
    let path = dir.join("junk.gguf");
    std::fs::write(&path, b"this is not a model").unwrap();
    assert!(load_err(&path).contains("not a GGUF file"));
}

#[test]
fn gguf_with_unknown_architecture_is_refused() {
    let bytes = std::fs::read(common::default_model_path()).unwrap();
    // Patch the value of general.architecture ("llama") to "llamb", same length.
    let key = b"general.architecture";
    let at = bytes.windows(key.len()).position(|w| w == key).unwrap();
    let mut patched = bytes.clone();
    let value_at = at + key.len() + 4 + 8; // type u32, string length u64
    assert_eq!(&patched[value_at..value_at + 5], b"llama");
    patched[value_at + 4] = b'b';
    let dir = tmpdir("arch");
    let path = dir.join("arch.gguf");
    std::fs::write(&path, &patched).unwrap();
    let err = load_err(&path);
    assert!(err.contains("arch.gguf") && err.contains("unknown architecture 'llamb'"), "{err}");
}

#[test]
fn safetensors_header_lying_about_sizes() {
    let dir = tmpdir("lying");
    write_tiny_hf(&dir, tiny_config(), None, None);
    // Rewrite the header so one tensor claims more bytes than the file holds.
    let path = dir.join("model.safetensors");
    let bytes = std::fs::read(&path).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let mut header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let t = header.get_mut("model.norm.weight").unwrap();
    let start = t["data_offsets"][0].as_u64().unwrap();
    t["data_offsets"][1] = json!(start + 1_000_000);
    let mut text = header.to_string().into_bytes();
    while !text.len().is_multiple_of(8) {
        text.push(b' ');
    }
    let mut out = (text.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(&text);
    out.extend_from_slice(&bytes[8 + n..]);
    std::fs::write(&path, out).unwrap();
    let err = load_err(&dir);
    assert!(err.contains("model.safetensors"), "{err}");
    assert!(err.contains("model.norm.weight") || err.contains("offset") || err.contains("header"), "{err}");
}

#[test]
fn missing_tensor_is_named() {
    let dir = tmpdir("missing");
    write_tiny_hf(&dir, tiny_config(), Some("model.layers.0.mlp.up_proj.weight"), None);
    let err = load_err(&dir);
    assert!(err.contains("missing tensor 'model.layers.0.mlp.up_proj.weight'"), "{err}");
}

#[test]
fn wrong_dtype_is_named() {
    let dir = tmpdir("dtype");
    write_tiny_hf(&dir, tiny_config(), None, Some("model.layers.0.self_attn.k_proj.weight"));
    let err = load_err(&dir);
    assert!(
        err.contains("model.safetensors")
            && err.contains("model.layers.0.self_attn.k_proj.weight")
            && err.contains("I32"),
        "{err}"
    );
}

#[test]
fn wrong_shape_is_named() {
    let dir = tmpdir("shape");
    let mut cfg = tiny_config();
    cfg["intermediate_size"] = json!(32);
    write_tiny_hf(&dir, cfg, None, None);
    let err = load_err(&dir);
    assert!(err.contains("model.layers.0.mlp.gate_proj.weight") && err.contains("expected [32, 8]"), "{err}");
}

#[test]
fn unknown_hf_architecture_is_refused() {
    let dir = tmpdir("unknown-arch");
    let mut cfg = tiny_config();
    cfg["model_type"] = json!("mamba9000");
    write_tiny_hf(&dir, cfg, None, None);
    let err = load_err(&dir);
    assert!(err.contains("config.json") && err.contains("unknown architecture 'mamba9000'"), "{err}");
}

#[test]
fn errors_are_values_not_panics() {
    // Every variant formats with the file name; none of the above panicked to get here.
    let e = LoadError::MissingTensor { file: "x.gguf".into(), tensor: "t".into() };
    assert_eq!(e.to_string(), "x.gguf: missing tensor 't'");
}
