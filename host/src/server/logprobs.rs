//! Logprobs in the two shapes OpenAI uses: chat's `content[{token, logprob, bytes,
//! top_logprobs}]` and the legacy completions' `{tokens, token_logprobs, top_logprobs,
//! text_offset}`; and vLLM's `prompt_logprobs`.

use serde_json::{json, Map, Value};

use crate::engine::TokenLogprob;
use crate::model::tokenizer::Tokenizer;

/// JSON has no -inf; OpenAI-compatible servers report impossible tokens as -9999.
fn finite(lp: f32) -> f32 {
    if lp.is_nan() {
        -9999.0
    } else {
        lp.max(-9999.0)
    }
}

/// The token's own text (special tokens included), as clients expect in `token`.
pub fn piece(tok: &Tokenizer, id: u32) -> String {
    tok.decode(&[id], false)
}

/// How logprobs name their tokens: by text, or as `token_id:<id>` (vLLM's
/// `return_tokens_as_token_ids`), which still tells apart tokens that are only part of a
/// character and decode to the same replacement text alone.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum TokenNames {
    #[default]
    Text,
    Ids,
}

impl TokenNames {
    pub fn name(self, tok: &Tokenizer, id: u32) -> String {
        match self {
            TokenNames::Text => piece(tok, id),
            TokenNames::Ids => format!("token_id:{id}"),
        }
    }
}

pub fn chat_entry(tok: &Tokenizer, names: TokenNames, lp: &TokenLogprob) -> Value {
    let entry = |id: u32, l: f32| {
        let s = names.name(tok, id);
        let bytes: Vec<u8> = s.as_bytes().to_vec();
        (s, bytes, finite(l))
    };
    let (s, bytes, l) = entry(lp.token, lp.logprob);
    let top: Vec<Value> = lp
        .top
        .iter()
        .map(|&(id, l)| {
            let (s, b, l) = entry(id, l);
            json!({"token": s, "logprob": l, "bytes": b})
        })
        .collect();
    json!({"token": s, "logprob": l, "bytes": bytes, "top_logprobs": top})
}

/// vLLM's `prompt_logprobs`: `null` for the first prompt token (nothing comes before it), then
/// for each later one a map from token id to `{logprob, rank, decoded_token}` holding the prompt
/// token first and then the `k` best (the prompt token once, if it is among them).
pub fn vllm_prompt_logprobs(tok: &Tokenizer, scored: &[TokenLogprob], k: usize) -> Value {
    let entry =
        |id: u32, l: f32, rank: usize| json!({"logprob": finite(l), "rank": rank, "decoded_token": piece(tok, id)});
    let rows = scored.iter().map(|lp| {
        let mut m = Map::new();
        m.insert(lp.token.to_string(), entry(lp.token, lp.logprob, lp.rank as usize));
        for (i, &(id, l)) in lp.top.iter().take(k).enumerate() {
            m.entry(id.to_string()).or_insert_with(|| entry(id, l, i + 1));
        }
        Value::Object(m)
    });
    Value::Array(std::iter::once(Value::Null).chain(rows).collect())
}

/// Accumulates the legacy completions logprobs of one choice.
#[derive(Default)]
pub struct LegacyLogprobs {
    names: TokenNames,
    tokens: Vec<Value>,
    token_logprobs: Vec<Value>,
    top_logprobs: Vec<Value>,
    text_offset: Vec<usize>,
    /// Offset of the next token's text within the choice's text.
    offset: usize,
}

impl LegacyLogprobs {
    pub fn new(names: TokenNames) -> Self {
        Self { names, ..Default::default() }
    }

    pub fn push(&mut self, tok: &Tokenizer, lp: &TokenLogprob) {
        self.push_row(tok, lp.token, lp.logprob, &lp.top);
    }

    /// `text_offset` advances by the token's text even when it is named by id: offsets index
    /// the choice's text.
    fn push_row(&mut self, tok: &Tokenizer, token: u32, logprob: f32, alternatives: &[(u32, f32)]) {
        self.push_token(tok, token);
        self.token_logprobs.push(finite(logprob).into());
        let mut top = Map::new();
        for &(id, l) in alternatives {
            top.insert(self.names.name(tok, id), finite(l).into());
        }
        self.top_logprobs.push(Value::Object(top));
    }

    fn push_token(&mut self, tok: &Tokenizer, token: u32) {
        let s = piece(tok, token);
        self.text_offset.push(self.offset);
        self.offset += s.len();
        self.tokens.push(self.names.name(tok, token).into());
    }

    /// An echoed prompt: its first token, which has no logprob (nothing comes before it), then
    /// each scored one with its `k` best alternatives (the scoring may have kept more for
    /// `prompt_logprobs`).
    pub fn push_prompt(&mut self, tok: &Tokenizer, first: u32, scored: &[TokenLogprob], k: usize) {
        self.push_token(tok, first);
        self.token_logprobs.push(Value::Null);
        self.top_logprobs.push(Value::Null);
        for lp in scored {
            self.push_row(tok, lp.token, lp.logprob, &lp.top[..k.min(lp.top.len())]);
        }
    }

    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }

    /// The JSON so far; a streaming caller takes it per chunk (and keeps the running offset).
    pub fn take(&mut self) -> Value {
        let v = json!({
            "tokens": std::mem::take(&mut self.tokens),
            "token_logprobs": std::mem::take(&mut self.token_logprobs),
            "top_logprobs": std::mem::take(&mut self.top_logprobs),
            "text_offset": std::mem::take(&mut self.text_offset),
        });
        v
    }
}
