//! `POST /v1/completions`: the legacy text completion API (raw prompts, no chat template).

use std::sync::Arc;

use axum::extract::State;
use axum::response::{IntoResponse, Response};
use serde_json::{json, Value};

use super::admission::Gate;
use super::error::{ApiError, ApiResult};
use super::extract::OpenAiJson;
use super::generation::{collect, GenEvent, Usage};
use super::logprobs::{vllm_prompt_logprobs, LegacyLogprobs, TokenNames};
use super::openai::{parse_prompts, CompletionRequest, PromptInput};
use super::sse::{stream_response, ChunkFormatter};
use super::state::{unix_now, AppState};
use super::tenancy::{self as tenancy, CallerExt};
use super::token_ids::StreamTokenIds;
use crate::model::LoadedModel;

/// Prompts one request may carry, and choices (prompts x n) in all.
const MAX_PROMPTS: usize = 64;
const MAX_CHOICES: usize = 256;

/// Prompt-logprob entries (a scored token or one of its alternatives) one response may carry,
/// summed over its choices: every choice repeats its prompt's scores, so prompts x n x width
/// would otherwise let one request build a response of gigabytes.
const MAX_PROMPT_LOGPROB_ENTRIES: usize = 1 << 19;

/// OpenAI's default for this endpoint (chat defaults to the rest of the context).
const DEFAULT_MAX_TOKENS: usize = 16;

pub async fn handler(
    State(state): State<AppState>,
    caller: CallerExt,
    OpenAiJson(req): OpenAiJson<CompletionRequest>,
) -> ApiResult<Response> {
    let (gate, ()) = Gate::open(&state, &caller, "/v1/completions", req.model.as_deref(), || {
        if req.suffix.as_deref().is_some_and(|s| !s.is_empty()) {
            return Err(ApiError::not_supported("suffix", "'suffix' is not supported"));
        }
        if req.best_of.is_some_and(|b| b != req.sampling.n.unwrap_or(1)) {
            return Err(ApiError::not_supported("best_of", "'best_of' other than 'n' is not supported"));
        }
        Ok(())
    })?;
    let n = req.sampling.n.unwrap_or(1);
    let echo = req.echo.unwrap_or(false);
    // echo + logprobs scores the prompt too (what lm-evaluation-harness's loglikelihood tasks
    // ask for); a stream holds each echo back until its prompt's scores are in.
    let score_prompt = echo && req.logprobs.is_some();
    let tok = &state.model.tokenizer;
    let prompts = parse_prompts(&req.prompt)?;
    // One request may not take the whole queue (nor get a "queue full" no retry can cure).
    if prompts.len() > MAX_PROMPTS || (prompts.len() as u64).saturating_mul(n) > MAX_CHOICES as u64 {
        return Err(ApiError::invalid_param(
            "prompt",
            format!(
                "at most {MAX_PROMPTS} prompts and {MAX_CHOICES} choices (prompts x n) per request, got {} x {n}",
                prompts.len()
            ),
        ));
    }
    // Tokenized on a blocking thread under the prompt-work bound (see chat::render_chat_off_runtime);
    // a text certain to be over the context is refused before it is tokenized.
    let (st, add_special_tokens) = (state.clone(), req.add_special_tokens.unwrap_or(true));
    let max_prompt_tokens = req.sampling.truncate_prompt_tokens.is_none().then(|| state.engine.max_model_len());
    let bytes = prompts.iter().map(|p| if let PromptInput::Text(t) = p { t.len() } else { 0 }).sum();
    let prompts: Vec<Vec<u32>> = state
        .prompt_work
        .run(bytes, move || {
            prompts
                .into_iter()
                .map(|p| match p {
                    PromptInput::Text(t) => {
                        super::chat::check_prompt_size(&st, &t, max_prompt_tokens, "prompt")?;
                        st.model.tokenizer.encode(&t, add_special_tokens).map_err(ApiError::internal)
                    }
                    PromptInput::Ids(ids) => Ok(ids),
                })
                .collect::<Result<_, _>>()
        })
        .await??;
    // OpenAI's (and vLLM's) `echo` with `max_tokens: 0`: the prompt alone, with its scores when
    // `logprobs` asks. The engine samples one token (its forward scores the last prompt
    // position anyway), which the response leaves out but the usage counts, as vLLM's does.
    let echo_only = echo && req.max_tokens == Some(0);
    let max_tokens = match req.max_tokens {
        _ if echo_only => 1,
        Some(m) => m.min(usize::MAX as u64) as usize,
        None => DEFAULT_MAX_TOKENS,
    };
    let mut base = req.sampling.to_engine_request(max_tokens)?;
    let vllm_prompt_k = base.prompt_logprobs;
    base.constraint = super::structured::from_sampling_fields(&req.sampling)?;
    let n = base.n;
    let mut echoes = Vec::new();
    let mut first_tokens = Vec::new();
    let reqs: Vec<_> = prompts
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
    let entries_per_token = score_prompt as usize * (1 + req.logprobs.unwrap_or(0) as usize)
        + vllm_prompt_k.map_or(0, |k| k.saturating_add(1));
    let entries = reqs.iter().fold(0usize, |sum, r| {
        sum.saturating_add(r.prompt_ids.len().saturating_mul(n).saturating_mul(entries_per_token))
    });
    if entries > MAX_PROMPT_LOGPROB_ENTRIES {
        // A width over the logprobs cap (`-1`: the vocabulary) is that error, not this one.
        for r in &reqs {
            state.engine.validate(r).map_err(ApiError::from).map_err(legacy_logprobs_param)?;
        }
        let param = if vllm_prompt_k.is_some() { "prompt_logprobs" } else { "logprobs" };
        return Err(ApiError::invalid_param(
            param,
            format!("scoring these prompts would return {entries} logprob entries (prompt tokens x n x alternatives); at most {MAX_PROMPT_LOGPROB_ENTRIES}: ask for fewer prompts, choices or alternatives"),
        ));
    }
    let prompt_ids: Vec<Vec<u32>> =
        if req.sampling.returns_token_ids() { reqs.iter().map(|r| r.prompt_ids.clone()).collect() } else { Vec::new() };
    let mut gen = gate
        .submit(reqs, |e| match e.code {
            Some("context_length_exceeded") => e.with_param("prompt"),
            _ => legacy_logprobs_param(e),
        })
        .await?;
    let rate_headers = gen.rate_headers();
    // Choice i belongs to prompt i / n, so its echo is that prompt's text.
    let echo_of = |choice: usize| echoes.get(choice / n).cloned().unwrap_or_default();

    let id = format!("cmpl-{:032x}", rand::random::<u128>());
    gen.set_request_id(&id);
    let created = unix_now();
    let model = state.served_model_name.clone();
    let want_logprobs = req.logprobs.is_some();
    let names = req.sampling.token_names();
    if req.sampling.is_stream() {
        let echoes: Vec<String> = (0..gen.num_choices()).map(echo_of).collect();
        let scored_echo = score_prompt.then(|| ScoredEcho { first_tokens, k: req.logprobs.unwrap_or(0) as usize, n });
        let fmt = CompletionChunks {
            id,
            created,
            model,
            m: state.model.clone(),
            logprobs: Vec::new(),
            names,
            want_logprobs,
            echoes,
            echo_only,
            scored_echo,
        };
        let token_ids = req.sampling.returns_token_ids().then(|| StreamTokenIds::new(prompt_ids, n, false, !echo_only));
        let mut resp = stream_response(gen, fmt, req.sampling.stream_settings(token_ids));
        tenancy::add_headers(&mut resp, &rate_headers);
        return Ok(resp);
    }
    let (choices, usage) = collect(gen).await?;
    let choices: Vec<Value> = choices
        .into_iter()
        .enumerate()
        .map(|(i, c)| {
            let logprobs = if want_logprobs {
                let mut l = LegacyLogprobs::new(names);
                if let (true, Some(Some(first))) = (score_prompt, first_tokens.get(i / n)) {
                    l.push_prompt(
                        tok,
                        *first,
                        c.prompt_logprobs.as_deref().unwrap_or_default(),
                        req.logprobs.unwrap_or(0) as usize,
                    );
                }
                if !echo_only {
                    c.logprobs.iter().for_each(|x| l.push(tok, x));
                }
                l.take()
            } else {
                Value::Null
            };
            let text = match (echo, echo_only) {
                (true, true) => echo_of(i),
                (true, false) => echo_of(i) + &c.text,
                _ => c.text,
            };
            // Zero tokens asked, zero given: the length limit ended it, whatever was sampled.
            let finish_reason = if echo_only { Some("length") } else { c.finish_reason.map(|r| r.as_str()) };
            let mut choice = json!({"index": i, "text": text, "logprobs": logprobs, "finish_reason": finish_reason});
            if let (Some(k), Some(scored)) = (vllm_prompt_k, &c.prompt_logprobs) {
                choice["prompt_logprobs"] = vllm_prompt_logprobs(tok, scored, k);
            }
            if let Some(ids) = prompt_ids.get(i / n) {
                choice["token_ids"] = if echo_only { json!([]) } else { json!(c.tokens) };
                choice["prompt_token_ids"] = json!(ids);
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
    names: TokenNames,
    want_logprobs: bool,
    echoes: Vec<String>,
    /// `echo` with `max_tokens: 0`: the sampled token is not part of the answer.
    echo_only: bool,
    /// `echo` with `logprobs`: each echo waits for its prompt's scores.
    scored_echo: Option<ScoredEcho>,
}

struct ScoredEcho {
    /// Per prompt, its first token (the one with no score).
    first_tokens: Vec<Option<u32>>,
    /// Alternatives per token (`logprobs`).
    k: usize,
    /// Choices per prompt.
    n: usize,
}

impl CompletionChunks {
    fn chunk(&self, choice: Value) -> Value {
        json!({"id": self.id, "object": "text_completion", "created": self.created, "model": self.model, "choices": [choice]})
    }
}

impl ChunkFormatter for CompletionChunks {
    fn start(&mut self, choices: usize) -> Vec<Value> {
        self.logprobs = (0..choices).map(|_| LegacyLogprobs::new(self.names)).collect();
        if self.scored_echo.is_some() {
            return Vec::new();
        }
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
        if self.echo_only {
            return None;
        }
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

    fn prompt_logprobs(&mut self, ev: &GenEvent) -> Vec<Value> {
        let (GenEvent::PromptLogprobs { prompt, logprobs }, Some(se)) = (ev, &self.scored_echo) else { return vec![] };
        let first = se.first_tokens.get(*prompt).copied().flatten();
        let (k, choices) = (se.k, *prompt * se.n..(*prompt + 1) * se.n);
        choices
            .filter_map(|c| {
                let acc = self.logprobs.get_mut(c)?;
                acc.push_prompt(&self.m.tokenizer, first?, logprobs, k);
                let lp = acc.take();
                let echo = std::mem::take(self.echoes.get_mut(c)?);
                Some(self.chunk(json!({"index": c, "text": echo, "logprobs": lp, "finish_reason": null})))
            })
            .collect()
    }

    fn finish(&mut self, ev: &GenEvent) -> Vec<Value> {
        let GenEvent::Finished { choice, reason, text } = ev else { return vec![] };
        let (text, reason) = if self.echo_only { ("", "length") } else { (text.as_str(), reason.as_str()) };
        vec![self.chunk(json!({"index": choice, "text": text, "logprobs": null, "finish_reason": reason}))]
    }

    fn usage(&mut self, usage: &Usage) -> Value {
        json!({"id": self.id, "object": "text_completion", "created": self.created, "model": self.model, "choices": [], "usage": usage.to_json()})
    }
}

/// The engine names the alternatives' width `top_logprobs` (the chat field); a text completion
/// asks for it as `logprobs`, so its errors name that.
fn legacy_logprobs_param(e: ApiError) -> ApiError {
    match e.param.as_deref() {
        Some("top_logprobs") => {
            let message = e.message.replace("'top_logprobs'", "'logprobs'");
            ApiError { message, ..e }.with_param("logprobs")
        }
        _ => e,
    }
}
