//! Builds a byte-level BPE tokenizer from GGUF metadata (`tokenizer.ggml.*`).
//!
//! The GGUF vocabulary, merges and token types are turned into the `tokenizer.json` description
//! the `tokenizers` crate reads, with the pre-tokenizer that matches `tokenizer.ggml.pre` (the
//! same per-model split rules llama.cpp and the Hugging Face tokenizers use).

use std::str::FromStr;

use serde_json::{json, Map, Value};

use super::{Tokenizer, Vocab};
use crate::model::error::LoadError;
use crate::model::format::gguf::{GgufFile, MetaValue};

/// llama.cpp token types.
const TOKEN_TYPE_CONTROL: i64 = 3;
const TOKEN_TYPE_USER_DEFINED: i64 = 4;

const LLAMA3_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const QWEN2_SPLIT: &str =
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

fn byte_level(use_regex: bool) -> Value {
    json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": use_regex})
}

fn split(pattern: &str) -> Value {
    json!({"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": false})
}

/// The pre-tokenizer for a `tokenizer.ggml.pre` value, and whether BPE ignores merges for
/// whole-word vocabulary hits (Llama 3 style).
fn pre_tokenizer_for(pre: &str) -> (Value, bool) {
    match pre {
        // GPT-2's own regex inside ByteLevel; these models split digits one by one first.
        "smollm" | "starcoder" | "refact" | "codeshell" | "exaone" | "minerva-7b" => (
            json!({"type": "Sequence", "pretokenizers": [{"type": "Digits", "individual_digits": true}, byte_level(true)]}),
            false,
        ),
        "llama-bpe" | "llama3" | "falcon3" | "pixtral" => {
            (json!({"type": "Sequence", "pretokenizers": [split(LLAMA3_SPLIT), byte_level(false)]}), true)
        }
        "qwen2" | "deepseek-r1-qwen" | "megrez" => {
            (json!({"type": "Sequence", "pretokenizers": [split(QWEN2_SPLIT), byte_level(false)]}), false)
        }
        "gpt-2" | "gpt2" | "default" | "mpt" | "olmo" | "jais" | "trillion" => (byte_level(true), false),
        other => {
            tracing::warn!(pre = other, "unknown tokenizer.ggml.pre; using GPT-2 pre-tokenization (as llama.cpp does)");
            (byte_level(true), false)
        }
    }
}

fn strings(g: &GgufFile, key: &str) -> Result<Vec<String>, LoadError> {
    let arr = g.meta(key).and_then(MetaValue::as_array).ok_or_else(|| LoadError::Tokenizer {
        file: g.path.clone(),
        detail: format!("metadata key {key} is missing or not an array"),
    })?;
    arr.iter()
        .map(|v| v.as_str().map(str::to_string))
        .collect::<Option<Vec<_>>>()
        .ok_or_else(|| LoadError::Tokenizer { file: g.path.clone(), detail: format!("{key} holds non-string values") })
}

pub(super) fn build(g: &GgufFile) -> Result<Tokenizer, LoadError> {
    let err = |detail: String| LoadError::Tokenizer { file: g.path.clone(), detail };
    let model = g.meta("tokenizer.ggml.model").and_then(MetaValue::as_str).unwrap_or("");
    if model != "gpt2" {
        return Err(err(format!("tokenizer.ggml.model '{model}' is not supported (supported: gpt2 byte-level BPE)")));
    }
    let tokens = strings(g, "tokenizer.ggml.tokens")?;
    let merges = strings(g, "tokenizer.ggml.merges")?;
    let types: Vec<i64> = match g.meta("tokenizer.ggml.token_type").and_then(MetaValue::as_array) {
        Some(a) => a.iter().map(|v| v.as_i64().unwrap_or(1)).collect(),
        None => vec![1; tokens.len()],
    };
    if types.len() != tokens.len() {
        return Err(err(format!("{} token types for {} tokens", types.len(), tokens.len())));
    }
    let pre = g.meta("tokenizer.ggml.pre").and_then(MetaValue::as_str).unwrap_or("default");
    let (pre_tokenizer, ignore_merges) = pre_tokenizer_for(pre);

    let mut vocab = Map::with_capacity(tokens.len());
    let mut added = Vec::new();
    for (id, (tok, &ty)) in tokens.iter().zip(&types).enumerate() {
        vocab.insert(tok.clone(), json!(id));
        if ty == TOKEN_TYPE_CONTROL || ty == TOKEN_TYPE_USER_DEFINED {
            added.push(json!({
                "id": id, "content": tok, "single_word": false, "lstrip": false, "rstrip": false,
                "normalized": false, "special": ty == TOKEN_TYPE_CONTROL,
            }));
        }
    }
    let spec = json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": null,
        "pre_tokenizer": pre_tokenizer,
        "post_processor": null,
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
        "model": {
            "type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
            "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false,
            "ignore_merges": ignore_merges, "vocab": vocab, "merges": merges,
        },
    });
    let inner =
        tokenizers::Tokenizer::from_str(&spec.to_string()).map_err(|e| err(format!("building BPE tokenizer: {e}")))?;

    let id =
        |key: &str| g.meta(key).and_then(MetaValue::as_u64).map(|v| v as u32).filter(|&v| (v as usize) < tokens.len());
    let bos_token_id = id("tokenizer.ggml.bos_token_id");
    let mut eos_token_ids: Vec<u32> =
        ["tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"]
            .iter()
            .filter_map(|k| id(k))
            .collect();
    eos_token_ids.dedup();
    Ok(Tokenizer {
        inner: Vocab::Hf(inner),
        bos_token_id,
        add_bos: g.meta("tokenizer.ggml.add_bos_token").and_then(MetaValue::as_bool).unwrap_or(false),
        bos_token: bos_token_id.map(|i| tokens[i as usize].clone()),
        eos_token: eos_token_ids.first().map(|&i| tokens[i as usize].clone()),
        eos_token_ids,
        chat_template: g.meta("tokenizer.chat_template").and_then(MetaValue::as_str).map(str::to_string),
        max_token_bytes: Default::default(),
    })
}
