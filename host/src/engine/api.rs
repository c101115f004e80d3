//! The engine's public interface, used by the HTTP server.
//!
//! `Engine::submit` queues a request and returns a stream of [`EngineEvent`]s; dropping the stream
//! (client disconnect) or calling `abort` cancels the request and frees its KV blocks at once.

use serde::Serialize;

use crate::sampling::constraint::ConstraintSpec;
use crate::sampling::SamplingParams;

/// Engine-wide request id.
pub type RequestId = u64;

/// Why a choice stopped: a stop condition (EOS, stop string or id) or its length limit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishReason {
    Stop,
    Length,
}

impl FinishReason {
    pub fn as_str(&self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
        }
    }
}

#[derive(Clone, Debug)]
pub struct EngineRequest {
    pub prompt_ids: Vec<u32>,
    pub sampling: SamplingParams,
    /// Generated tokens per choice at most (already capped by the caller to the context size is
    /// not required: the engine caps it to `max_model_len - prompt_len`).
    pub max_tokens: usize,
    /// vLLM's `min_tokens`: until this many tokens are generated, EOS and `stop_token_ids`
    /// cannot be sampled and stop strings are not looked for. At most `max_tokens`.
    pub min_tokens: usize,
    pub stop: Vec<String>,
    /// vLLM's `include_stop_str_in_output`: the stop string that ends a choice stays in its text.
    pub include_stop_str_in_output: bool,
    /// Extra token ids that end generation (besides the model's EOS, unless `ignore_eos`).
    pub stop_token_ids: Vec<u32>,
    pub ignore_eos: bool,
    /// Number of choices sampled from the same prompt (`n`); they share the prompt's KV blocks.
    pub n: usize,
    /// `None`: no logprobs. `Some(k)`: the chosen token's logprob plus the top `k` alternatives.
    pub logprobs: Option<usize>,
    /// `Some(k)`: the logprob of every prompt token after the first, with the top `k`
    /// alternatives (the legacy completions' `echo` with `logprobs`). Such a request computes
    /// its whole prompt (no prefix-cache hit) in chunks of at most `PROMPT_LOGPROB_ROWS`.
    pub prompt_logprobs: Option<usize>,
    /// Higher runs first when the scheduler has to choose; FCFS within a priority.
    pub priority: i32,
    /// Prefix-cache salt: requests only share cached blocks with the same salt (the tenant).
    pub cache_salt: String,
    /// Tenant for fair scheduling (weighted fair share of batch slots).
    pub tenant: String,
    /// The tenant's weight: tenants get batch slots in proportion to their weights.
    pub tenant_weight: f64,
    /// Whether special tokens are dropped from the text deltas.
    pub skip_special_tokens: bool,
    /// Constrain the output (JSON object, forced tool call).
    pub constraint: Option<ConstraintSpec>,
}

impl Default for EngineRequest {
    fn default() -> Self {
        Self {
            prompt_ids: Vec::new(),
            sampling: SamplingParams::default(),
            max_tokens: 16,
            min_tokens: 0,
            stop: Vec::new(),
            include_stop_str_in_output: false,
            stop_token_ids: Vec::new(),
            ignore_eos: false,
            n: 1,
            logprobs: None,
            prompt_logprobs: None,
            priority: 0,
            cache_salt: String::new(),
            tenant: String::new(),
            tenant_weight: 1.0,
            skip_special_tokens: true,
            constraint: None,
        }
    }
}

#[derive(Clone, Debug, Serialize)]
pub struct TokenLogprob {
    pub token: u32,
    pub logprob: f32,
    /// 1 + how many tokens the distribution ranks strictly above `token` (vLLM's `rank`).
    pub rank: u32,
    /// Best alternatives, best first (`logprobs = Some(k)`, k entries).
    pub top: Vec<(u32, f32)>,
}

impl TokenLogprob {
    /// `token`'s logprob, rank and the `k` best alternatives under the raw `logits`, with one
    /// log-sum-exp shared by all of them.
    pub fn score(logits: &[f32], token: u32, k: usize) -> Self {
        let lse = crate::sampling::log_sum_exp(logits);
        let own = logits[token as usize];
        let rank = 1 + logits.iter().filter(|&&l| l > own).count() as u32;
        TokenLogprob { token, logprob: own - lse, rank, top: crate::sampling::top_logprobs(logits, k, lse) }
    }
}

#[derive(Clone, Debug)]
pub enum EngineEvent {
    /// One generated token of choice `index` and the text that became final with it (may be
    /// empty while a multi-byte character or a possible stop string is held back).
    Token { index: usize, token: u32, text: String, logprob: Option<TokenLogprob> },
    /// Choice `index` ended. `text` is any held-back text released at the end.
    Finished {
        index: usize,
        reason: FinishReason,
        text: String,
        prompt_tokens: usize,
        completion_tokens: usize,
        cached_tokens: usize,
    },
    /// The prompt's logprobs (`prompt_logprobs`): one entry per prompt token after the first,
    /// sent once, before the first `Token`.
    PromptLogprobs(Vec<TokenLogprob>),
    /// The request failed inside the engine; no more events follow.
    Error(String),
}

#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum SubmitError {
    #[error("the request queue is full ({0} waiting); retry later")]
    QueueFull(usize),
    #[error("{0}")]
    Invalid(String),
    /// An invalid request field, named for the API's error `param`.
    #[error("{message}")]
    InvalidParam { param: &'static str, message: String },
    #[error("the prompt has {prompt} tokens, more than this model's context of {max} tokens")]
    PromptTooLong { prompt: usize, max: usize },
    #[error("the server is shutting down")]
    ShuttingDown,
}

#[derive(Clone, Debug, Default, Serialize)]
pub struct EngineStats {
    pub running: usize,
    pub waiting: usize,
    pub kv_blocks_total: usize,
    pub kv_blocks_free: usize,
    pub kv_block_size: usize,
    pub prefix_cache_queries: u64,
    pub prefix_cache_hits: u64,
    pub prompt_tokens_total: u64,
    pub generation_tokens_total: u64,
    pub preemptions_total: u64,
    /// Forward passes that failed (device errors); their batches' requests got an error.
    pub forward_errors_total: u64,
    /// Steps that panicked (a bug); the requests in flight got an error and the engine went on.
    pub step_panics_total: u64,
    pub steps_total: u64,
}

#[cfg(test)]
mod tests {
    use super::TokenLogprob;

    #[test]
    fn score_gives_logprob_rank_and_best_alternatives_of_the_raw_distribution() {
        let logits = [1.0f32, 3.0, 2.0, f32::NEG_INFINITY, 3.0];
        let lse = logits.iter().map(|l| l.exp()).sum::<f32>().ln();
        let s = TokenLogprob::score(&logits, 2, 2);
        assert!((s.logprob - (2.0 - lse)).abs() < 1e-6);
        // Two tokens rank strictly above token 2; ties share the better rank.
        assert_eq!(s.rank, 3);
        assert_eq!(s.top.len(), 2);
        assert!(s.top.iter().all(|&(t, l)| (t == 1 || t == 4) && (l - (3.0 - lse)).abs() < 1e-6));
        assert_eq!(TokenLogprob::score(&logits, 4, 0).rank, 1);
        let impossible = TokenLogprob::score(&logits, 3, 0);
        assert_eq!((impossible.rank, impossible.logprob), (5, f32::NEG_INFINITY));
        assert!(impossible.top.is_empty());
    }
}
