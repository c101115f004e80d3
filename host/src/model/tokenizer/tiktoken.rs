//! Tokenizers shipped as `tiktoken.model` (one `<base64 bytes> <rank>` line per token) with
//! `tokenizer_config.json`, the form Kimi models ship instead of `tokenizer.json`. Encoding is
//! tiktoken's byte-pair encoding through the `tiktoken-rs` crate; this module only assembles its
//! inputs the way the model authors' loader does:
//!
//! - the base vocabulary is the ranks, ids `0..=max rank`;
//! - every id from there up to config.json's `vocab_size` (or 256 slots when absent) is a special
//!   token: named by `tokenizer_config.json`'s `added_tokens_decoder`, else
//!   `<|reserved_token_{id}|>`; entries marked `"special": false` (Kimi's think and tool-call
//!   markers) stay in decoded text when special tokens are skipped;
//! - the pre-tokenizer pattern is Kimi's for Kimi (and DeepSeek-V3) models, else `cl100k_base`'s.
//!
//! Sources (read, not copied): Moonshot's `tokenization_kimi.py` as vLLM's Rust tokenizer loads it
//! for `kimi_k3` (QuantTrio/vllm-cubic 413ca1c `rust/src/tokenizer/src/tiktoken.rs`:
//! `KIMI_PATTERN`, `detect_bpe_pattern`, the reserved-slot naming); the pattern strings are data
//! that must match theirs character for character. Conformance: tests/reference_tiktoken.rs
//! against Python `tiktoken` on the same ranks, pattern and specials.

use std::collections::{HashMap, HashSet};
use std::path::Path;

use base64::Engine as _;
use serde_json::Value;

use crate::model::error::LoadError;

/// Kimi's pre-tokenizer pattern (`tokenization_kimi.py`): Han runs alone, cased words with an
/// optional contraction, numbers in threes, punctuation runs, whitespace.
pub const KIMI_PATTERN: &str = r"[\p{Han}]+|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// `cl100k_base`'s pattern, the default for other tiktoken files (as transformers' converter).
pub const CL100K_PATTERN: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// Special-token slots after the ranks when config.json gives no `vocab_size`.
const DEFAULT_RESERVED: u32 = 256;

pub struct TiktokenVocab {
    bpe: tiktoken_rs::CoreBPE,
    /// Bytes of base token `id`.
    pieces: Vec<Vec<u8>>,
    /// Name of special token `num_base + i`.
    specials: Vec<String>,
    special_ids: HashMap<String, u32>,
    /// Added tokens marked `"special": false`: kept when special tokens are skipped.
    kept: HashSet<u32>,
    num_base: u32,
}

/// The pattern for a model config (`model_type` at the top or in `text_config`).
pub fn pattern_for(model_config: &Value) -> &'static str {
    let ty = |v: &Value| v.get("model_type").and_then(Value::as_str).map(str::to_string);
    let types = [ty(model_config), model_config.get("text_config").and_then(ty)];
    let kimi = types
        .iter()
        .flatten()
        .any(|t| matches!(t.as_str(), "kimi" | "kimi_k2" | "kimi_k25" | "kimi_k3" | "kimi_linear" | "deepseek_v3"));
    if kimi {
        KIMI_PATTERN
    } else {
        CL100K_PATTERN
    }
}

impl TiktokenVocab {
    /// Loads `dir/tiktoken.model` with the special tokens of `tokenizer_config` (the parsed
    /// `tokenizer_config.json`, or null) and the vocabulary size and pattern of `model_config`.
    pub fn load(dir: &Path, tokenizer_config: &Value, model_config: &Value) -> Result<Self, LoadError> {
        let path = dir.join("tiktoken.model");
        let err = |detail: String| LoadError::Tokenizer { file: path.clone(), detail };
        let text = std::fs::read_to_string(&path).map_err(|e| err(e.to_string()))?;
        let mut encoder: HashMap<Vec<u8>, u32> = HashMap::new();
        for (n, line) in text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
            let mut parts = line.split_whitespace();
            let (Some(b64), Some(rank), None) = (parts.next(), parts.next(), parts.next()) else {
                return Err(err(format!("line {}: expected '<base64> <rank>'", n + 1)));
            };
            let bytes = base64::engine::general_purpose::STANDARD
                .decode(b64)
                .map_err(|e| err(format!("line {}: invalid base64: {e}", n + 1)))?;
            let rank: u32 = rank.parse().map_err(|_| err(format!("line {}: rank '{rank}' is not a number", n + 1)))?;
            if encoder.insert(bytes, rank).is_some() {
                return Err(err(format!("line {}: the same token twice", n + 1)));
            }
        }
        let num_base = encoder.values().max().map_or(0, |m| m + 1);
        let mut pieces = vec![Vec::new(); num_base as usize];
        for (bytes, &rank) in &encoder {
            pieces[rank as usize] = bytes.clone();
        }
        if pieces.iter().any(Vec::is_empty) {
            return Err(err("the ranks are not contiguous from 0".into()));
        }
        // The added tokens: id -> (name, special).
        let mut added: HashMap<u32, (String, bool)> = HashMap::new();
        if let Some(map) = tokenizer_config.get("added_tokens_decoder").and_then(Value::as_object) {
            for (id, t) in map {
                let id: u32 = id.parse().map_err(|_| err(format!("added_tokens_decoder key '{id}' is not an id")))?;
                let name = t
                    .get("content")
                    .and_then(Value::as_str)
                    .ok_or_else(|| err(format!("added token {id} has no content")))?;
                if id < num_base {
                    return Err(err(format!("added token {id} ('{name}') collides with a base token")));
                }
                added.insert(id, (name.to_string(), t.get("special").and_then(Value::as_bool).unwrap_or(false)));
            }
        }
        let vocab_size = model_config
            .get("vocab_size")
            .or_else(|| model_config.get("text_config").and_then(|t| t.get("vocab_size")))
            .and_then(Value::as_u64)
            .map(|v| v as u32);
        let end = vocab_size
            .unwrap_or(num_base + DEFAULT_RESERVED)
            .max(num_base)
            .max(added.keys().max().map_or(0, |m| m + 1));
        let mut specials = Vec::with_capacity((end - num_base) as usize);
        let mut special_ids = HashMap::new();
        let mut kept = HashSet::new();
        for id in num_base..end {
            let name = match added.get(&id) {
                Some((name, special)) => {
                    if !special {
                        kept.insert(id);
                    }
                    name.clone()
                }
                None => format!("<|reserved_token_{id}|>"),
            };
            if special_ids.insert(name.clone(), id).is_some() {
                return Err(err(format!("special token '{name}' named twice")));
            }
            specials.push(name);
        }
        let pattern = pattern_for(model_config);
        let bpe = tiktoken_rs::CoreBPE::new(
            encoder.into_iter().collect(),
            special_ids.clone().into_iter().collect(),
            pattern,
        )
        .map_err(|e| err(format!("tiktoken: {e}")))?;
        tracing::info!(
            file = %path.display(),
            ranks = num_base,
            specials = specials.len(),
            pattern = if pattern == KIMI_PATTERN { "kimi" } else { "cl100k" },
            "tiktoken tokenizer"
        );
        Ok(Self { bpe, pieces, specials, special_ids, kept, num_base })
    }

    pub fn vocab_size(&self) -> usize {
        self.pieces.len() + self.specials.len()
    }

    /// Encodes `text`, special-token names in it becoming their ids (tiktoken's
    /// `allowed_special="all"`).
    pub fn encode(&self, text: &str) -> Vec<u32> {
        self.bpe.encode_with_special_tokens(text)
    }

    /// Whether `id` is a special (added) token that skipping special tokens drops.
    pub fn is_skipped_special(&self, id: u32) -> bool {
        id >= self.num_base && (id as usize) < self.vocab_size() && !self.kept.contains(&id)
    }

    /// The text of `ids`; unknown ids are left out, special ones too when `skip_special_tokens`
    /// (except those marked `"special": false`). Bytes that do not form UTF-8 become U+FFFD.
    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> String {
        let mut bytes = Vec::new();
        for &id in ids {
            if skip_special_tokens && self.is_skipped_special(id) {
                continue;
            }
            if let Some(b) = self.bytes_of(id) {
                bytes.extend_from_slice(b);
            }
        }
        String::from_utf8_lossy(&bytes).into_owned()
    }

    /// The bytes `id` stands for: a base token's, or a special token's name.
    fn bytes_of(&self, id: u32) -> Option<&[u8]> {
        match id.checked_sub(self.num_base) {
            None => self.pieces.get(id as usize).map(Vec::as_slice),
            Some(i) => self.specials.get(i as usize).map(String::as_bytes),
        }
    }

    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.bytes_of(id).map(|b| String::from_utf8_lossy(b).into_owned())
    }

    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        if let Some(&id) = self.special_ids.get(token) {
            return Some(id);
        }
        match self.bpe.encode_ordinary(token).as_slice() {
            [one] => Some(*one),
            _ => None,
        }
    }

    /// The bytes of base token `id` (`None` for special tokens and unknown ids).
    pub fn token_bytes(&self, id: u32) -> Option<Vec<u8>> {
        (id < self.num_base).then(|| self.pieces[id as usize].clone())
    }

    /// The longest token, in bytes (special names included).
    pub fn max_token_bytes(&self) -> usize {
        self.pieces.iter().map(Vec::len).chain(self.specials.iter().map(String::len)).max().unwrap_or(1).max(1)
    }
}
