//! OpenAI request bodies and the checks that turn them into engine requests.
//!
//! Unknown fields are ignored (clients send `extra_body` fields and newer options freely);
//! fields we accept but cannot honour are rejected explicitly rather than silently dropped.

use std::collections::HashMap;

use serde::Deserialize;
use serde_json::{Map, Value};

use super::error::ApiError;
use super::extract::{from_value, JsonBody};
use super::logprobs::TokenNames;
use super::sse::StreamSettings;
use super::token_ids::StreamTokenIds;
use crate::engine::EngineRequest;
use crate::sampling::SamplingParams;

#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum StopField {
    One(String),
    Many(Vec<String>),
}

#[derive(Debug, Default, Deserialize)]
pub struct StreamOptions {
    #[serde(default)]
    pub include_usage: Option<bool>,
    /// vLLM's: with `include_usage`, every chunk carries the usage so far (not only the last).
    #[serde(default)]
    pub continuous_usage_stats: Option<bool>,
}

/// Sampling and stopping fields shared by chat and text completions (plus vLLM's extensions).
#[derive(Debug, Default, Deserialize)]
pub struct SamplingFields {
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<i64>,
    pub min_p: Option<f32>,
    pub n: Option<u64>,
    pub stop: Option<StopField>,
    pub seed: Option<i64>,
    pub presence_penalty: Option<f32>,
    pub frequency_penalty: Option<f32>,
    pub repetition_penalty: Option<f32>,
    pub logit_bias: Option<HashMap<String, f32>>,
    /// vLLM's: only these token ids may be sampled.
    pub allowed_token_ids: Option<Vec<u32>>,
    pub user: Option<String>,
    pub stream: Option<bool>,
    pub stream_options: Option<StreamOptions>,
    pub ignore_eos: Option<bool>,
    pub stop_token_ids: Option<Vec<u32>>,
    pub skip_special_tokens: Option<bool>,
    pub min_tokens: Option<u64>,
    pub include_stop_str_in_output: Option<bool>,
    /// vLLM's: keep only the prompt's last this many tokens (-1: as many as the context holds).
    pub truncate_prompt_tokens: Option<i64>,
    /// vLLM's prompt logprobs: the k best alternatives at each prompt position (-1: the whole
    /// vocabulary, which `max_logprobs` then refuses, as vLLM's default does).
    pub prompt_logprobs: Option<i64>,
    /// vLLM's structured outputs (`{"choice": [...]}` or `{"json": schema}`) and their older
    /// spellings (see `structured.rs`).
    pub structured_outputs: Option<Value>,
    /// vLLM's: the prompt's and the answer's token ids beside the text (`token_ids`,
    /// `prompt_token_ids`).
    pub return_token_ids: Option<bool>,
    /// vLLM's: logprobs name tokens `token_id:<id>` rather than by their text.
    pub return_tokens_as_token_ids: Option<bool>,
    pub guided_choice: Option<Value>,
    pub guided_json: Option<Value>,
}

#[derive(Debug, Deserialize)]
pub struct ChatCompletionRequest {
    pub model: Option<String>,
    pub messages: Vec<Value>,
    pub max_tokens: Option<u64>,
    pub max_completion_tokens: Option<u64>,
    pub logprobs: Option<bool>,
    pub top_logprobs: Option<u64>,
    pub tools: Option<Vec<Value>>,
    pub tool_choice: Option<Value>,
    /// OpenAI's deprecated function calling (`functions`, `function_call`): refused by name rather
    /// than dropped, since answers would come back as `tool_calls` the legacy client never reads.
    #[serde(default)]
    pub functions: Option<Value>,
    #[serde(default)]
    pub function_call: Option<Value>,
    pub parallel_tool_calls: Option<bool>,
    pub response_format: Option<Value>,
    pub reasoning_effort: Option<String>,
    pub chat_template_kwargs: Option<Map<String, Value>>,
    /// vLLM's per-request Jinja template: refused (templates are the deployment's plugins; vLLM
    /// too refuses one unless started with --trust-request-chat-template).
    pub chat_template: Option<Value>,
    pub add_generation_prompt: Option<bool>,
    /// vLLM's: the model continues the final message instead of starting a new one.
    pub continue_final_message: Option<bool>,
    /// vLLM's: whether the tokenizer adds its special tokens (BOS) to the rendered chat.
    pub add_special_tokens: Option<bool>,
    /// Read from the same object by `JsonBody::from_json`.
    #[serde(skip)]
    pub sampling: SamplingFields,
}

#[derive(Debug, Deserialize)]
pub struct CompletionRequest {
    pub model: Option<String>,
    pub prompt: Value,
    pub max_tokens: Option<u64>,
    pub logprobs: Option<u64>,
    pub echo: Option<bool>,
    pub suffix: Option<String>,
    pub best_of: Option<u64>,
    /// vLLM's: whether the tokenizer adds its special tokens (BOS) to a text prompt.
    pub add_special_tokens: Option<bool>,
    /// Read from the same object by `JsonBody::from_json`.
    #[serde(skip)]
    pub sampling: SamplingFields,
}

#[derive(Debug, Deserialize)]
pub struct TokenizeRequest {
    pub model: Option<String>,
    pub prompt: Option<String>,
    pub messages: Option<Vec<Value>>,
    pub add_special_tokens: Option<bool>,
    pub add_generation_prompt: Option<bool>,
    pub continue_final_message: Option<bool>,
    pub tools: Option<Vec<Value>>,
    pub chat_template_kwargs: Option<Map<String, Value>>,
    pub return_token_strs: Option<bool>,
}

#[derive(Debug, Deserialize)]
pub struct DetokenizeRequest {
    pub model: Option<String>,
    pub tokens: Vec<u32>,
}

impl JsonBody for ChatCompletionRequest {
    fn from_json(v: Value) -> Result<Self, ApiError> {
        let mut r: Self = from_value(&v)?;
        r.sampling = from_value(&v)?;
        Ok(r)
    }
}

impl JsonBody for CompletionRequest {
    fn from_json(v: Value) -> Result<Self, ApiError> {
        let mut r: Self = from_value(&v)?;
        r.sampling = from_value(&v)?;
        Ok(r)
    }
}

impl JsonBody for TokenizeRequest {
    fn from_json(v: Value) -> Result<Self, ApiError> {
        from_value(&v)
    }
}

impl JsonBody for DetokenizeRequest {
    fn from_json(v: Value) -> Result<Self, ApiError> {
        from_value(&v)
    }
}

impl SamplingFields {
    pub fn is_stream(&self) -> bool {
        self.stream.unwrap_or(false)
    }

    pub fn returns_token_ids(&self) -> bool {
        self.return_token_ids.unwrap_or(false)
    }

    pub fn token_names(&self) -> TokenNames {
        if self.return_tokens_as_token_ids.unwrap_or(false) {
            TokenNames::Ids
        } else {
            TokenNames::Text
        }
    }

    pub fn include_usage(&self) -> bool {
        self.stream_options.as_ref().and_then(|o| o.include_usage).unwrap_or(false)
    }

    fn continuous_usage(&self) -> bool {
        self.include_usage() && self.stream_options.as_ref().and_then(|o| o.continuous_usage_stats).unwrap_or(false)
    }

    /// How the stream's chunks are dressed: usage (final or on every chunk) and token ids.
    pub fn stream_settings(&self, token_ids: Option<StreamTokenIds>) -> StreamSettings {
        StreamSettings { include_usage: self.include_usage(), continuous_usage: self.continuous_usage(), token_ids }
    }

    /// Applies `truncate_prompt_tokens` (checked by `to_engine_request`): the prompt's last
    /// `k` tokens, as vLLM keeps them. `-1` keeps what leaves room for one generated token in
    /// `max_model_len` (the engine refuses a prompt that fills the context).
    pub fn truncate_prompt(&self, ids: &mut Vec<u32>, max_model_len: usize) {
        let keep = match self.truncate_prompt_tokens {
            None => return,
            Some(-1) => max_model_len.saturating_sub(1),
            Some(k) => usize::try_from(k).unwrap_or(usize::MAX),
        };
        if ids.len() > keep {
            ids.drain(..ids.len() - keep);
        }
    }

    /// The engine request for one prompt, minus the prompt ids and logprobs.
    pub fn to_engine_request(&self, max_tokens: usize) -> Result<EngineRequest, ApiError> {
        if self.stream_options.is_some() && !self.is_stream() {
            return Err(ApiError::invalid_param(
                "stream_options",
                "'stream_options' is only allowed when 'stream' is true",
            ));
        }
        let mut sampling = SamplingParams::default();
        if let Some(t) = self.temperature {
            sampling.temperature = t;
        }
        if let Some(p) = self.top_p {
            sampling.top_p = p;
        }
        // vLLM uses -1 for "no top-k"; OpenAI has no top_k at all.
        sampling.top_k = match self.top_k {
            Some(k) if k > 0 => k as usize,
            Some(0) | Some(-1) | None => 0,
            Some(k) => {
                return Err(ApiError::invalid_param(
                    "top_k",
                    format!("'top_k' must be -1 (disabled) or positive, got {k}"),
                ))
            }
        };
        if let Some(m) = self.min_p {
            sampling.min_p = m;
        }
        if let Some(p) = self.presence_penalty {
            sampling.presence_penalty = p;
        }
        if let Some(p) = self.frequency_penalty {
            sampling.frequency_penalty = p;
        }
        if let Some(p) = self.repetition_penalty {
            sampling.repetition_penalty = p;
        }
        // Negative seeds are valid in OpenAI's API; any bijection onto u64 keeps them distinct.
        sampling.seed = self.seed.map(|s| s as u64);
        if let Some(bias) = &self.logit_bias {
            for (k, &v) in bias {
                let id: u32 = k.trim().parse().map_err(|_| {
                    ApiError::invalid_param("logit_bias", format!("logit_bias key '{k}' is not a token id"))
                })?;
                if !(-100.0..=100.0).contains(&v) {
                    return Err(ApiError::invalid_param(
                        "logit_bias",
                        format!("logit_bias values must be in [-100, 100], got {v}"),
                    ));
                }
                sampling.logit_bias.insert(id, v);
            }
        }
        if let Some(ids) = &self.allowed_token_ids {
            if ids.is_empty() {
                return Err(ApiError::invalid_param(
                    "allowed_token_ids",
                    "'allowed_token_ids' must list at least one token id",
                ));
            }
            sampling.allowed_token_ids = Some(ids.clone());
        }
        sampling.validate().map_err(|m| {
            let param = m.split('\'').nth(1).unwrap_or("").to_string();
            ApiError::invalid_param(&param, m)
        })?;
        let stop = match &self.stop {
            None => vec![],
            Some(StopField::One(s)) => vec![s.clone()],
            Some(StopField::Many(v)) => v.clone(),
        };
        let stop: Vec<String> = stop.into_iter().filter(|s| !s.is_empty()).collect();
        let prompt_logprobs = match self.prompt_logprobs {
            None => None,
            Some(-1) => Some(usize::MAX),
            Some(k) if k >= 0 => Some(usize::try_from(k).unwrap_or(usize::MAX)),
            Some(k) => {
                return Err(ApiError::invalid_param(
                    "prompt_logprobs",
                    format!("'prompt_logprobs' must be -1 or at least 0, got {k}"),
                ))
            }
        };
        // As in vLLM: the scores exist only once the whole prompt is computed, and a stream has
        // no place for them.
        if prompt_logprobs.is_some() && self.is_stream() {
            return Err(ApiError::not_supported(
                "prompt_logprobs",
                "'prompt_logprobs' is not supported when streaming",
            ));
        }
        if let Some(t) = self.truncate_prompt_tokens {
            if t == 0 || t < -1 {
                return Err(ApiError::invalid_param(
                    "truncate_prompt_tokens",
                    format!("'truncate_prompt_tokens' must be -1 or at least 1, got {t}"),
                ));
            }
        }
        let n = self.n.unwrap_or(1);
        if n == 0 {
            return Err(ApiError::invalid_param("n", "'n' must be at least 1"));
        }
        if max_tokens == 0 {
            return Err(ApiError::invalid_param("max_tokens", "'max_tokens' must be at least 1"));
        }
        Ok(EngineRequest {
            prompt_ids: vec![],
            sampling,
            max_tokens,
            stop,
            min_tokens: self.min_tokens.map_or(0, |m| m.min(usize::MAX as u64) as usize),
            include_stop_str_in_output: self.include_stop_str_in_output.unwrap_or(false),
            stop_token_ids: self.stop_token_ids.clone().unwrap_or_default(),
            ignore_eos: self.ignore_eos.unwrap_or(false),
            n: n.min(usize::MAX as u64) as usize,
            logprobs: None,
            prompt_logprobs,
            skip_special_tokens: self.skip_special_tokens.unwrap_or(true),
            ..Default::default()
        })
    }
}

/// What the prompt of a text completion can be: text(s) or token ids.
pub enum PromptInput {
    Text(String),
    Ids(Vec<u32>),
}

pub fn parse_prompts(v: &Value) -> Result<Vec<PromptInput>, ApiError> {
    let bad = || {
        ApiError::invalid_param(
            "prompt",
            "'prompt' must be a string, an array of strings, an array of token ids or an array of token-id arrays",
        )
    };
    let ids = |a: &[Value]| -> Result<Vec<u32>, ApiError> {
        a.iter().map(|x| x.as_u64().filter(|&t| t <= u32::MAX as u64).map(|t| t as u32).ok_or_else(bad)).collect()
    };
    let out = match v {
        Value::String(s) => vec![PromptInput::Text(s.clone())],
        Value::Array(a) if a.is_empty() => return Err(ApiError::invalid_param("prompt", "'prompt' must not be empty")),
        Value::Array(a) if a.iter().all(Value::is_string) => {
            a.iter().map(|s| PromptInput::Text(s.as_str().unwrap().to_string())).collect()
        }
        Value::Array(a) if a.iter().all(Value::is_number) => vec![PromptInput::Ids(ids(a)?)],
        Value::Array(a) if a.iter().all(Value::is_array) => {
            a.iter().map(|x| ids(x.as_array().unwrap()).map(PromptInput::Ids)).collect::<Result<_, _>>()?
        }
        _ => return Err(bad()),
    };
    Ok(out)
}
