//! Tokenization: a thin wrapper over the `tokenizers` crate (`tokenizer.json`, GGUF vocabularies)
//! or, for models that ship `tiktoken.model` instead (Kimi), `tiktoken-rs` ([`tiktoken`]), plus
//! what the engine needs around it (BOS/EOS handling, special-token sets, the chat template
//! shipped with the model).

mod gguf_vocab;
pub mod incremental;
pub mod tiktoken;

use std::path::Path;

use serde_json::Value;

use crate::model::error::LoadError;
use crate::model::format::gguf::GgufFile;

/// The vocabulary and its encoder. One per model: boxing the larger variant would save nothing.
#[allow(clippy::large_enum_variant)]
enum Vocab {
    Hf(tokenizers::Tokenizer),
    Tiktoken(tiktoken::TiktokenVocab),
}

pub struct Tokenizer {
    inner: Vocab,
    pub bos_token_id: Option<u32>,
    pub eos_token_ids: Vec<u32>,
    /// Whether `encode(.., add_special_tokens = true)` prepends BOS (GGUF `add_bos_token`).
    pub add_bos: bool,
    pub chat_template: Option<String>,
    pub bos_token: Option<String>,
    pub eos_token: Option<String>,
    /// The longest token's text, bytes (see [`Self::max_token_bytes`]); computed on first use.
    pub(crate) max_token_bytes: std::sync::OnceLock<usize>,
}

impl Tokenizer {
    pub fn from_gguf(g: &GgufFile) -> Result<Self, LoadError> {
        gguf_vocab::build(g)
    }

    /// From a Hugging Face directory: `tokenizer.json` (or, when there is none, `tiktoken.model`),
    /// with BOS/EOS and the chat template from `tokenizer_config.json` / `chat_template.jinja` /
    /// `generation_config.json`.
    pub fn from_hf_dir(dir: &Path, model_config: &Value) -> Result<Self, LoadError> {
        let read_json = |name: &str| -> Result<Value, LoadError> {
            let p = dir.join(name);
            match std::fs::read_to_string(&p) {
                Ok(s) => serde_json::from_str(&s)
                    .map_err(|e| LoadError::Corrupt { file: p, detail: format!("invalid JSON: {e}") }),
                Err(_) => Ok(Value::Null),
            }
        };
        let tcfg = read_json("tokenizer_config.json")?;
        let gen_cfg = read_json("generation_config.json")?;
        let tok_path = dir.join("tokenizer.json");
        let inner = if tok_path.exists() || !dir.join("tiktoken.model").exists() {
            Vocab::Hf(
                tokenizers::Tokenizer::from_file(&tok_path)
                    .map_err(|e| LoadError::Tokenizer { file: tok_path.clone(), detail: e.to_string() })?,
            )
        } else {
            Vocab::Tiktoken(tiktoken::TiktokenVocab::load(dir, &tcfg, model_config)?)
        };
        // Special tokens in tokenizer_config may be strings or {"content": ...} objects.
        let token_str = |v: Option<&Value>| -> Option<String> {
            match v? {
                Value::String(s) => Some(s.clone()),
                Value::Object(o) => o.get("content").and_then(Value::as_str).map(str::to_string),
                _ => None,
            }
        };
        let bos_token = token_str(tcfg.get("bos_token"));
        let eos_token = token_str(tcfg.get("eos_token"));
        let ids_of = |v: Option<&Value>| -> Vec<u32> {
            match v {
                Some(Value::Number(n)) => n.as_u64().map(|x| vec![x as u32]).unwrap_or_default(),
                Some(Value::Array(a)) => a.iter().filter_map(Value::as_u64).map(|x| x as u32).collect(),
                _ => vec![],
            }
        };
        // Kimi K3 keeps its text model's ids in `text_config`.
        let text_config = model_config.get("text_config").unwrap_or(&Value::Null);
        let mut eos_token_ids = ids_of(gen_cfg.get("eos_token_id"));
        if eos_token_ids.is_empty() {
            eos_token_ids = ids_of(model_config.get("eos_token_id").or_else(|| text_config.get("eos_token_id")));
        }
        if let Some(id) = eos_token.as_deref().and_then(|t| inner.token_to_id(t)) {
            if !eos_token_ids.contains(&id) {
                eos_token_ids.push(id);
            }
        }
        let bos_token_id = bos_token.as_deref().and_then(|t| inner.token_to_id(t)).or_else(|| {
            let id = model_config.get("bos_token_id").or_else(|| text_config.get("bos_token_id"));
            id.and_then(Value::as_u64).map(|v| v as u32)
        });
        let chat_template = match std::fs::read_to_string(dir.join("chat_template.jinja")) {
            Ok(t) => Some(t),
            Err(_) => match tcfg.get("chat_template") {
                Some(Value::String(s)) => Some(s.clone()),
                // A list of named templates: use "default".
                Some(Value::Array(list)) => list
                    .iter()
                    .find(|t| t.get("name").and_then(Value::as_str) == Some("default"))
                    .and_then(|t| t.get("template"))
                    .and_then(Value::as_str)
                    .map(str::to_string),
                _ => None,
            },
        };
        // tokenizer.json's post-processor decides about BOS; add it ourselves only when asked to.
        let post_processor = matches!(&inner, Vocab::Hf(t) if t.get_post_processor().is_some());
        let add_bos = tcfg.get("add_bos_token").and_then(Value::as_bool).unwrap_or(false) && !post_processor;
        Ok(Self {
            inner,
            bos_token_id,
            eos_token_ids,
            add_bos,
            chat_template,
            bos_token,
            eos_token,
            max_token_bytes: Default::default(),
        })
    }

    /// An upper bound on the bytes of text one token stands for: the longest vocabulary entry
    /// (special tokens included) as stored, which is never shorter than the text it decodes to
    /// (byte-level entries spell a byte with one character of up to two UTF-8 bytes, SentencePiece
    /// spells a space with the three-byte `▁`, byte fallback a byte as `<0xNN>`). So a text of
    /// `b` bytes encodes to at least `b / max_token_bytes` tokens, before normalization.
    pub fn max_token_bytes(&self) -> usize {
        *self.max_token_bytes.get_or_init(|| match &self.inner {
            Vocab::Hf(t) => t.get_vocab(true).keys().map(String::len).max().unwrap_or(1).max(1),
            Vocab::Tiktoken(t) => t.max_token_bytes(),
        })
    }

    /// A lower bound on the tokens `text` encodes to, without encoding it: what lets a prompt far
    /// over the context be refused before tokenizing megabytes. Halved once more for normalizers
    /// that shrink text (NFKC folds some 3-byte characters to 1-2 bytes).
    pub fn min_tokens(&self, text_bytes: usize) -> usize {
        text_bytes / (2 * self.max_token_bytes())
    }

    pub fn vocab_size(&self) -> usize {
        self.inner.vocab_size()
    }

    /// Encodes `text`. Special-token text (e.g. `<|im_start|>`) is always recognised, as in HF.
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, String> {
        let mut ids = match &self.inner {
            Vocab::Hf(t) => {
                t.encode_fast(text, add_special_tokens).map_err(|e| format!("tokenizer: {e}"))?.get_ids().to_vec()
            }
            Vocab::Tiktoken(t) => t.encode(text),
        };
        if add_special_tokens && self.add_bos {
            if let Some(bos) = self.bos_token_id {
                if ids.first() != Some(&bos) {
                    ids.insert(0, bos);
                }
            }
        }
        Ok(ids)
    }

    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> String {
        match &self.inner {
            Vocab::Hf(t) => t.decode(ids, skip_special_tokens).unwrap_or_default(),
            Vocab::Tiktoken(t) => t.decode(ids, skip_special_tokens),
        }
    }

    pub fn id_to_token(&self, id: u32) -> Option<String> {
        match &self.inner {
            Vocab::Hf(t) => t.id_to_token(id),
            Vocab::Tiktoken(t) => t.id_to_token(id),
        }
    }

    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    pub fn is_eos(&self, id: u32) -> bool {
        self.eos_token_ids.contains(&id)
    }

    /// The bytes each token stands for (`None` for added/special tokens), for constraints that
    /// work on the output bytes. Byte-level BPE pieces are mapped back through GPT-2's
    /// byte-to-character table; other vocabularies fall back to decoding the token alone.
    pub fn token_bytes(&self) -> Vec<Option<Vec<u8>>> {
        let inner = match &self.inner {
            Vocab::Hf(t) => t,
            Vocab::Tiktoken(t) => return (0..t.vocab_size() as u32).map(|id| t.token_bytes(id)).collect(),
        };
        let added = inner.get_added_tokens_decoder();
        let unbyte = byte_level_decoder();
        (0..self.vocab_size() as u32)
            .map(|id| {
                if added.contains_key(&id) {
                    return None;
                }
                let piece = inner.id_to_token(id)?;
                piece
                    .chars()
                    .map(|c| unbyte.get(&c).copied())
                    .collect::<Option<Vec<u8>>>()
                    .or_else(|| Some(self.decode(&[id], false).into_bytes()))
            })
            .collect()
    }
}

impl Vocab {
    fn vocab_size(&self) -> usize {
        match self {
            Vocab::Hf(t) => t.get_vocab_size(true),
            Vocab::Tiktoken(t) => t.vocab_size(),
        }
    }

    fn token_to_id(&self, token: &str) -> Option<u32> {
        match self {
            Vocab::Hf(t) => t.token_to_id(token),
            Vocab::Tiktoken(t) => t.token_to_id(token),
        }
    }
}

/// GPT-2's `bytes_to_unicode` inverted: the character each byte is written as in byte-level BPE
/// vocabularies, mapped back to the byte.
fn byte_level_decoder() -> std::collections::HashMap<char, u8> {
    let mut printable: Vec<u32> = (b'!' as u32..=b'~' as u32).chain(0xA1..=0xAC).chain(0xAE..=0xFF).collect();
    let mut chars: Vec<u32> = printable.clone();
    let mut extra = 0;
    for b in 0..256u32 {
        if !printable.contains(&b) {
            printable.push(b);
            chars.push(256 + extra);
            extra += 1;
        }
    }
    printable.into_iter().zip(chars).map(|(b, c)| (char::from_u32(c).unwrap(), b as u8)).collect()
}
