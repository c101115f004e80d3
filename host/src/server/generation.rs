//! Runs one API request's engine requests (one per prompt, each with `n` choices) and turns
//! their events into per-choice events with global choice indices, recording latency metrics
//! on the way. Dropping a `Generation` drops the engine streams, which aborts the requests.

use std::pin::Pin;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use futures_util::stream::{self, SelectAll, Stream, StreamExt};

use super::admission::Admitted;
use super::error::ApiError;
use super::state::{AppState, InFlight};
use super::tenancy::Admission;
use crate::engine::FinishReason;
use crate::engine::{EngineEvent, RequestStream, TokenLogprob};
use crate::plugins::apply::Applied;

type Events = Pin<Box<dyn Stream<Item = (usize, EngineEvent)> + Send>>;

pub enum GenEvent {
    Token {
        choice: usize,
        token: u32,
        text: String,
        logprob: Option<TokenLogprob>,
    },
    Finished {
        choice: usize,
        reason: FinishReason,
        text: String,
    },
    /// The logprobs of prompt `prompt`'s tokens after its first (asked with `prompt_logprobs`).
    PromptLogprobs {
        prompt: usize,
        logprobs: Vec<TokenLogprob>,
    },
    Error(String),
}

#[derive(Clone, Copy, Debug, Default)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub cached_tokens: usize,
}

impl Usage {
    pub fn to_json(&self) -> serde_json::Value {
        serde_json::json!({
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        })
    }
}

pub struct Generation {
    state: AppState,
    events: SelectAll<Events>,
    n: usize,
    total_choices: usize,
    finished: usize,
    /// Per prompt: (prompt tokens, cached tokens), known once a choice of it finishes.
    prompts: Vec<Option<(usize, usize)>>,
    /// Tokens submitted per prompt, for the usage so far while it runs.
    prompt_lens: Vec<usize>,
    completion_tokens: usize,
    /// Tokens streamed so far, over all choices.
    streamed_tokens: usize,
    /// Per choice: tokens streamed, and once it finished the engine's count of its completion
    /// tokens (what a prompt's policies are told, and an aborted request is charged for).
    choices: Vec<ChoiceProgress>,
    started: Instant,
    first_token: Option<Instant>,
    last_token: Vec<Option<Instant>>,
    failed: bool,
    /// The tenant's admission (`serve --db`): settled, with its usage row, when the request ends.
    admission: Option<Admission>,
    /// Per prompt, the request policies that saw it, told the outcome once its choices ended
    /// (taken then, so each is told once); empty when no policy applies.
    policies: Vec<Option<Applied>>,
    _in_flight: InFlight,
}

#[derive(Clone, Copy, Default)]
struct ChoiceProgress {
    streamed: usize,
    /// The engine's completion tokens, once the choice finished.
    finished: Option<usize>,
}

impl Generation {
    /// Submits every request of an admitted API request (all with the same `n`); if one is
    /// refused the others are aborted and the refusal is returned.
    pub(super) fn submit(state: &AppState, admitted: Admitted) -> Result<Self, ApiError> {
        let Admitted { reqs, policies, tenancy: admission, in_flight, started } = admitted;
        let n = reqs.first().map_or(1, |r| r.n);
        let num_prompts = reqs.len();
        let prompt_lens = reqs.iter().map(|r| r.prompt_ids.len()).collect();
        let mut streams: Vec<RequestStream> = Vec::with_capacity(num_prompts);
        for req in reqs {
            match state.engine.submit(req) {
                Ok(s) => streams.push(s),
                Err(e) => return Err(e.into()),
            }
        }
        let mut events = SelectAll::new();
        for (p, rs) in streams.into_iter().enumerate() {
            let s = stream::unfold(rs, |mut rs| async move { rs.next().await.map(|e| (e, rs)) }).map(move |e| (p, e));
            events.push(Box::pin(s) as Events);
        }
        Ok(Self {
            state: state.clone(),
            events,
            n,
            total_choices: n * num_prompts,
            finished: 0,
            prompts: vec![None; num_prompts],
            prompt_lens,
            completion_tokens: 0,
            streamed_tokens: 0,
            choices: vec![ChoiceProgress::default(); n * num_prompts],
            started,
            first_token: None,
            last_token: vec![None; n * num_prompts],
            failed: false,
            admission,
            policies: policies.into_iter().map(Some).collect(),
            _in_flight: in_flight,
        })
    }

    /// Tells prompt `p`'s policies how it ended (once).
    fn observe(&mut self, p: usize, reason: &str) {
        if let Some(applied) = self.policies.get_mut(p).and_then(Option::take) {
            let prompt_tokens = self.prompts[p].map_or(self.prompt_lens[p], |(t, _)| t);
            let completion = self.prompt_choices(p).iter().filter_map(|c| c.finished).sum();
            let reason = reason.to_string();
            // Guest code: on the plugin pool; nothing waits for it.
            self.state.plugin_calls.spawn(move || applied.observe(prompt_tokens, completion, &reason));
        }
    }

    /// Prompt `p`'s choices.
    fn prompt_choices(&self, p: usize) -> &[ChoiceProgress] {
        &self.choices[p * self.n..(p + 1) * self.n]
    }

    /// Tells every policy not yet told that the request ended as `reason` (an error, an abort).
    fn observe_all(&mut self, reason: &str) {
        for p in 0..self.policies.len() {
            self.observe(p, reason);
        }
    }

    pub fn state(&self) -> &AppState {
        &self.state
    }

    /// Names the usage row after the response id.
    pub fn set_request_id(&mut self, id: &str) {
        if let Some(a) = &mut self.admission {
            a.set_request_id(id);
        }
    }

    /// The `x-ratelimit-*` headers for the response.
    pub fn rate_headers(&self) -> Vec<(&'static str, String)> {
        self.admission.as_ref().map(|a| a.headers().to_vec()).unwrap_or_default()
    }

    /// Settles the tenant's reservation and commits the usage row (no-op without tenancy). Call
    /// when the generation ended, before the response completes.
    pub async fn settle(&mut self) -> Result<(), ApiError> {
        let Some(a) = self.admission.take() else { return Ok(()) };
        let status = if self.failed { "error" } else { "ok" };
        a.finish(&self.usage(), status).await.map_err(|e| ApiError::internal(format!("recording usage failed: {e}")))
    }

    pub fn num_choices(&self) -> usize {
        self.total_choices
    }

    pub fn usage(&self) -> Usage {
        let (p, c) = self.prompts.iter().flatten().fold((0, 0), |(p, c), &(pp, cc)| (p + pp, c + cc));
        Usage { prompt_tokens: p, completion_tokens: self.completion_tokens, cached_tokens: c }
    }

    /// What a request that ended early (the client went away, its stream stalled, the handler
    /// gave up) is charged: every prompt whose computation finished (a token of it came out, so
    /// its prefill ran), every token its finished choices generated and every token streamed
    /// for the others. A client cannot avoid paying for work by hanging up.
    pub fn usage_charged(&self) -> Usage {
        let mut u = self.usage();
        for (p, known) in self.prompts.iter().enumerate() {
            let prefilled = self.prompt_choices(p).iter().any(|c| c.streamed > 0);
            if known.is_none() && prefilled {
                u.prompt_tokens += self.prompt_lens[p];
            }
        }
        u.completion_tokens += self.choices.iter().filter(|c| c.finished.is_none()).map(|c| c.streamed).sum::<usize>();
        u
    }

    /// The usage while the request runs (vLLM's `continuous_usage_stats`): the prompts as
    /// submitted and the tokens streamed so far; `usage` once it ended.
    pub fn usage_so_far(&self) -> Usage {
        if self.is_done() {
            return self.usage();
        }
        let prompt_tokens = self.prompt_lens.iter().sum();
        let cached_tokens = self.prompts.iter().flatten().map(|&(_, c)| c).sum();
        Usage { prompt_tokens, completion_tokens: self.streamed_tokens, cached_tokens }
    }

    pub fn is_done(&self) -> bool {
        self.failed || self.finished == self.total_choices
    }

    /// The next event; `None` once every choice finished (or after an error).
    pub async fn next(&mut self) -> Option<GenEvent> {
        if self.is_done() {
            return None;
        }
        let Some((p, ev)) = self.events.next().await else {
            self.failed = true;
            self.state.metrics.count_finished("error");
            self.observe_all("error");
            return Some(GenEvent::Error("the engine stopped before the request finished".into()));
        };
        let now = Instant::now();
        let state = self.state.clone();
        let m = &state.metrics;
        Some(match ev {
            EngineEvent::Token { index, token, text, logprob } => {
                let choice = p * self.n + index;
                self.streamed_tokens += 1;
                self.choices[choice].streamed += 1;
                if self.first_token.is_none() {
                    self.first_token = Some(now);
                    m.ttft.observe_duration(now - self.started);
                }
                if let Some(prev) = self.last_token[choice] {
                    m.itl.observe_duration(now - prev);
                }
                self.last_token[choice] = Some(now);
                GenEvent::Token { choice, token, text, logprob }
            }
            EngineEvent::Finished { index, reason, text, prompt_tokens, completion_tokens, cached_tokens } => {
                let choice = p * self.n + index;
                self.choices[choice].finished = Some(completion_tokens);
                self.prompts[p] = Some((prompt_tokens, cached_tokens));
                self.completion_tokens += completion_tokens;
                self.finished += 1;
                if self.prompt_choices(p).iter().all(|c| c.finished.is_some()) {
                    self.observe(p, reason.as_str());
                }
                if self.finished == self.total_choices {
                    let u = self.usage();
                    m.e2e.observe_duration(now - self.started);
                    m.prompt_tokens.fetch_add(u.prompt_tokens as u64, Ordering::Relaxed);
                    m.generation_tokens.fetch_add(u.completion_tokens as u64, Ordering::Relaxed);
                    m.count_finished(reason.as_str());
                }
                GenEvent::Finished { choice, reason, text }
            }
            EngineEvent::PromptLogprobs(logprobs) => GenEvent::PromptLogprobs { prompt: p, logprobs },
            EngineEvent::Error(msg) => {
                self.failed = true;
                m.count_finished("error");
                self.observe_all("error");
                GenEvent::Error(msg)
            }
        })
    }
}

impl Drop for Generation {
    fn drop(&mut self) {
        if let Some(a) = self.admission.take() {
            let status = if self.failed {
                "error"
            } else if self.is_done() {
                "ok"
            } else {
                "aborted"
            };
            // An early end is charged for the work done, not refunded (see `usage_charged`).
            let usage = if self.is_done() { self.usage() } else { self.usage_charged() };
            a.finish_nowait(&usage, status);
        }
        if !self.is_done() {
            // The client went away (or the handler gave up): the engine streams drop with us.
            self.observe_all("abort");
            self.state.metrics.count_finished("abort");
            tracing::info!(
                finished = self.finished,
                choices = self.total_choices,
                "request aborted before it finished"
            );
        }
    }
}

/// One choice collected in full, for non-streaming responses.
#[derive(Default)]
pub struct Collected {
    pub text: String,
    pub tokens: Vec<u32>,
    pub logprobs: Vec<TokenLogprob>,
    pub finish_reason: Option<FinishReason>,
    /// The choice's prompt's logprobs, when asked for (shared by the prompt's `n` choices).
    pub prompt_logprobs: Option<Arc<[TokenLogprob]>>,
}

pub async fn collect(mut g: Generation) -> Result<(Vec<Collected>, Usage), ApiError> {
    let mut out: Vec<Collected> = (0..g.num_choices()).map(|_| Collected::default()).collect();
    while let Some(ev) = g.next().await {
        match ev {
            GenEvent::Token { choice, token, text, logprob } => {
                let c = &mut out[choice];
                c.text.push_str(&text);
                c.tokens.push(token);
                c.logprobs.extend(logprob);
            }
            GenEvent::Finished { choice, reason, text } => {
                out[choice].text.push_str(&text);
                out[choice].finish_reason = Some(reason);
            }
            GenEvent::PromptLogprobs { prompt, logprobs } => {
                let n = g.n;
                let shared: Arc<[TokenLogprob]> = logprobs.into();
                for c in &mut out[prompt * n..(prompt + 1) * n] {
                    c.prompt_logprobs = Some(shared.clone());
                }
            }
            GenEvent::Error(msg) => {
                let _ = g.settle().await;
                return Err(ApiError::internal(format!("generation failed: {msg}")));
            }
        }
    }
    g.settle().await?;
    Ok((out, g.usage()))
}
