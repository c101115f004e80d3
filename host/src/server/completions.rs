//! `POST /v1/completions`: the legacy text completion API (raw prompts, no chat template).

use std::sync::Arc;
use std::time::Instant;

use axum::extract::State;
use axum::response::{IntoResponse, Response};
use serde_json::{json, Value};

use super::error::{ApiError, ApiResult};
use super::extract::OpenAiJson;
use super::generation::{collect, GenEvent, Generation, Usage};
use super::logprobs::{vllm_prompt_logprobs, LegacyLogprobs};
use super::openai::{parse_prompts, CompletionRequest, PromptInput};
use super::sse::{stream_response, ChunkFormatter};
use super::state::{unix_now, AppState};
use crate::engine::TokenLogprob;
use crate::model::LoadedModel;
use crate::tenancy::http::{self as tenancy, CallerExt};

/// Prompts one request may carry, and choices (prompts x n) in all.
const MAX_PROMPTS: usize = 64;
const MAX_CHOICES: usize = 256;

/// OpenAI's default for this endpoint (chat defaults to the rest of the context).
const DEFAULT_MAX_TOKENS: usize = 16;

pub async fn handler(State(state): State<AppState>, caller: CallerExt, OpenAiJson(req): OpenAiJson<CompletionRequest>) -> ApiResult<Response> {
    let started = Instant::now();
    state.check_model(req.model.as_deref())?;
    tenancy::check_model(&caller, &state.served_model_name)?;
    if req.suffix.as_deref().is_some_and(|s| !s.is_empty()) {
        return Err(ApiError::not_supported("suffix", "'suffix' is not supported"));
    }
    let n = req.sampling.n.unwrap_or(1);
    if req.best_of.is_some_and(|b| b != n) {
        return Err(ApiError::not_supported("best_of", "'best_of' other than 'n' is not supported"));
    }
    let echo = req.echo.unwrap_or(false);
    // echo + logprobs scores the prompt too (what lm-evaluation-harness's loglikelihood tasks
    // ask for), returned whole: a stream would have to hold its echo until the scores exist.
    let score_prompt = echo && req.logprobs.is_some();
    if score_prompt && req.sampling.is_stream() {
        return Err(ApiError::not_supported("echo", "'echo' together with 'logprobs' is not supported when streaming"));
    }
    // Before the tokenizing: a caller at its limits gets its 429 without costing that work.
    tenancy::precheck(&state, &caller)?;
    let in_flight = state.enter()?;
    let tok = &state.model.tokenizer;
    let prompts = parse_prompts(&req.prompt)?;
    // One request may not take the whole queue (nor get a "queue full" no retry can cure).
    if prompts.len() > MAX_PROMPTS || (prompts.len() as u64).saturating_mul(n) > MAX_CHOICES as u64 {
        return Err(ApiError::invalid_param("prompt", format!("at most {MAX_PROMPTS} prompts and {MAX_CHOICES} choices (prompts x n) per request, got {} x {n}", prompts.len())));
    }
    // Tokenized on the blocking pool (see chat::render_chat_off_runtime).
    let st = state.clone();
    let prompts: Vec<Vec<u32>> = super::chat::off_runtime(move || {
        prompts
            .into_iter()
            .map(|p| match p {
                PromptInput::Text(t) => st.model.tokenizer.encode(&t, true).map_err(ApiError::internal),
                PromptInput::Ids(ids) => Ok(ids),
            })
            .collect::<Result<_, _>>()
    })
    .await??;
    let max_tokens = req.max_tokens.map_or(DEFAULT_MAX_TOKENS, |m| m.min(usize::MAX as u64) as usize);
    let mut base = req.sampling.to_engine_request(max_tokens)?;
    let vllm_prompt_k = base.prompt_logprobs;
    base.constraint = super::structured::from_sampling_fields(&req.sampling)?;
    let n = base.n;
    let mut echoes = Vec::new();
    let mut first_tokens = Vec::new();
    let mut reqs: Vec<_> = prompts
        .into_iter()
        .map(|mut ids| {
            req.sampling.truncate_prompt(&mut ids, state.engine.max_model_len());
            if echo {
                echoes.push(tok.decode(&ids, base.skip_special_tokens));
                first_tokens.push(ids.first().copied());
            }
            let mut r = base.clone();
            r.prompt_ids = ids;
            r.logprobs = req.logprobs.map(|k| k as usize);
            // One scoring pass serves the echo's logprobs and vLLM's `prompt_logprobs`: the
            // wider of the two, each cut to its own width below.
            if score_prompt {
                r.prompt_logprobs = r.prompt_logprobs.max(r.logprobs);
            }
            r
        })
        .collect();
    let admission = tenancy::admit(&state, &caller, "/v1/completions", started, &mut reqs)?;
    let mut gen = Generation::submit(&state, in_flight, started, reqs)
        .map_err(|e| match e.code {
            Some("context_length_exceeded") => e.with_param("prompt"),
            _ => e,
        })?
        .with_admission(admission);
    let rate_headers = gen.rate_headers();
    // Choice i belongs to prompt i / n, so its echo is that prompt's text.
    let echo_of = |choice: usize| echoes.get(choice / n).cloned().unwrap_or_default();

    let id = format!("cmpl-{:032x}", rand::random::<u128>());
    gen.set_request_id(&id);
    let created = unix_now();
    let model = state.served_model_name.clone();
    let want_logprobs = req.logprobs.is_some();
    if req.sampling.is_stream() {
        let echoes: Vec<String> = (0..gen.num_choices()).map(echo_of).collect();
        let fmt = CompletionChunks { id, created, model, m: state.model.clone(), logprobs: Vec::new(), want_logprobs, echoes };
        let mut resp = stream_response(gen, fmt, req.sampling.include_usage());
        tenancy::add_headers(&mut resp, &rate_headers);
        return Ok(resp);
    }
    let (choices, usage) = collect(gen).await?;
    let choices: Vec<Value> = choices
        .into_iter()
        .enumerate()
        .map(|(i, c)| {
            let logprobs = if want_logprobs {
                let mut l = LegacyLogprobs::default();
                if let (true, Some(Some(first))) = (score_prompt, first_tokens.get(i / n)) {
                    l.push_unscored(tok, *first);
                    let k = req.logprobs.unwrap_or(0) as usize;
                    for x in c.prompt_logprobs.iter().flatten() {
                        l.push(tok, &TokenLogprob { top: x.top[..k.min(x.top.len())].to_vec(), ..x.clone() });
                    }
                }
                c.logprobs.iter().for_each(|x| l.push(tok, x));
                l.take()
            } else {
                Value::Null
            };
            let text = if echo { echo_of(i) + &c.text } else { c.text };
            let mut choice = json!({"index": i, "text": text, "logprobs": logprobs, "finish_reason": c.finish_reason.map(|r| r.as_str())});
            if let (Some(k), Some(scored)) = (vllm_prompt_k, &c.prompt_logprobs) {
                choice["prompt_logprobs"] = vllm_prompt_logprobs(tok, scored, k);
            }
            choice
        })
        .collect();
    let mut resp = axum::Json(json!({
        "id": id,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": choices,
        "usage": usage.to_json(),
    }))
    .into_response();
    tenancy::add_headers(&mut resp, &rate_headers);
    Ok(resp)
}

struct CompletionChunks {
    id: String,
    created: u64,
    model: String,
    m: Arc<LoadedModel>,
    /// Per choice, keeping each choice's running text offset across chunks.
    logprobs: Vec<LegacyLogprobs>,
    want_logprobs: bool,
    echoes: Vec<String>,
}

impl CompletionChunks {
    fn chunk(&self, choice: Value) -> Value {
        json!({"id": self.id, "object": "text_completion", "created": self.created, "model": self.model, "choices": [choice]})
    }
}

impl ChunkFormatter for CompletionChunks {
    fn start(&mut self, choices: usize) -> Vec<Value> {
        self.logprobs = (0..choices).map(|_| LegacyLogprobs::default()).collect();
        let echoes = std::mem::take(&mut self.echoes);
        echoes
            .iter()
            .enumerate()
            .filter(|(_, e)| !e.is_empty())
            .map(|(i, e)| self.chunk(json!({"index": i, "text": e, "logprobs": null, "finish_reason": null})))
            .collect()
    }

    fn token(&mut self, ev: &GenEvent) -> Option<Value> {
        let GenEvent::Token { choice, text, logprob, .. } = ev else { return None };
        let lp = match logprob {
            Some(l) if self.want_logprobs => {
                let acc = &mut self.logprobs[*choice];
                acc.push(&self.m.tokenizer, l);
                acc.take()
            }
            _ if text.is_empty() => return None,
            _ => Value::Null,
        };
        Some(self.chunk(json!({"index": choice, "text": text, "logprobs": lp, "finish_reason": null})))
    }

    fn finish(&mut self, ev: &GenEvent) -> Vec<Value> {
        let GenEvent::Finished { choice, reason, text } = ev else { return vec![] };
        vec![self.chunk(json!({"index": choice, "text": text, "logprobs": null, "finish_reason": reason.as_str()}))]
    }

    fn usage(&mut self, usage: &Usage) -> Value {
        json!({"id": self.id, "object": "text_completion", "created": self.created, "model": self.model, "choices": [], "usage": usage.to_json()})
    }
}
