//! The engine core: iteration-level scheduling over the paged pool, one batched forward per step.
//!
//! Each step: running sequences first (decodes, then chunks of unfinished prefills), then new
//! sequences from the waiting queue while the token budget, the sequence limit and free blocks
//! allow. When blocks run out the newest running sequence is preempted (its blocks freed, its
//! tokens kept) and recomputed later — usually cheaply, as its full blocks stay in the prefix
//! cache. Synchronous and single-threaded, so it can be tested directly; `Engine` drives it.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use tokio::sync::mpsc::UnboundedSender;

use super::api::{EngineEvent, EngineRequest, EngineStats, RequestId, SubmitError, TokenLogprob};

use super::api::FinishReason;
use super::block_pool::{BlockPool, KvDtype, PoolShape};
use super::fair_share::SlotShares;
use super::paged_kv::PagedKv;
use super::recurrent_slots::RecurrentSlots;
use super::sequence::Sequence;
use crate::model::kv::BatchRow;
use crate::model::tokenizer::incremental::IncrementalDecoder;
use crate::model::LoadedModel;
use crate::sampling::constraint::{Constraint, ConstraintSpec};
use crate::sampling::stop::{StopChecker, StopOutcome};
use crate::sampling::{Sampler, SamplingParams};

#[derive(Clone, Debug)]
pub struct EngineConfig {
    pub block_size: usize,
    /// Bytes of KV cache to preallocate.
    pub kv_cache_bytes: usize,
    pub kv_dtype: KvDtype,
    pub max_num_seqs: usize,
    pub max_num_batched_tokens: usize,
    /// Requests waiting for admission beyond which `submit` answers `QueueFull`.
    pub max_waiting: usize,
    pub enable_prefix_caching: bool,
    /// Largest `n` accepted.
    pub max_n: usize,
    pub max_logprobs: usize,
    /// Batch slots no single tenant may take (multi-tenant serving): a tenant arriving while
    /// another floods the engine finds a slot at once instead of waiting for one to free.
    pub tenant_slot_reserve: usize,
    /// vLLM's `long_prefill_token_threshold`: while requests wait for admission, a running
    /// prompt's chunk is capped at this many tokens, so one long prefill cannot take the whole
    /// step budget every step and keep a newcomer (and its time to first token) waiting for it
    /// to finish. 0: half of `max_num_batched_tokens`.
    pub long_prefill_token_threshold: usize,
    /// An upper bound on prompt + completion tokens (`--max-model-len`); `None`: the model's
    /// maximum, as the KV pool allows.
    pub max_model_len: Option<usize>,
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            block_size: 16,
            kv_cache_bytes: 1 << 30,
            kv_dtype: KvDtype::F32,
            max_num_seqs: 64,
            max_num_batched_tokens: 256,
            max_waiting: 1024,
            enable_prefix_caching: true,
            max_n: 16,
            max_logprobs: 20,
            tenant_slot_reserve: 0,
            long_prefill_token_threshold: 0,
            max_model_len: None,
        }
    }
}

/// Caps on the lists every generated token is checked against: each entry costs work per token
/// (per vocabulary entry, for a constraint's mask), and one request's cost stalls its whole batch.
/// Looser than OpenAI's (4 stop sequences, 300 logit_bias entries, 128 tools).
pub const MAX_STOP_STRINGS: usize = 16;
pub const MAX_STOP_STRING_BYTES: usize = 256;
pub const MAX_STOP_TOKEN_IDS: usize = 256;
pub const MAX_LOGIT_BIAS: usize = 1024;
pub const MAX_CHOICES: usize = 256;
pub const MAX_CHOICE_BYTES: usize = 16 * 1024;
pub const MAX_TOOLS: usize = 128;
pub use super::sequence::PROMPT_LOGPROB_ROWS;

/// The per-token work a request asks for, within the caps above.
fn check_list_sizes(req: &EngineRequest) -> Result<(), SubmitError> {
    let too_many = |param: &'static str, message: String| Err(SubmitError::InvalidParam { param, message });
    if req.stop.len() > MAX_STOP_STRINGS {
        return too_many("stop", format!("'stop' may hold at most {MAX_STOP_STRINGS} strings, got {}", req.stop.len()));
    }
    if let Some(s) = req.stop.iter().find(|s| s.len() > MAX_STOP_STRING_BYTES) {
        return too_many(
            "stop",
            format!("a stop string may be at most {MAX_STOP_STRING_BYTES} bytes, got {}", s.len()),
        );
    }
    if req.stop_token_ids.len() > MAX_STOP_TOKEN_IDS {
        return too_many(
            "stop_token_ids",
            format!("'stop_token_ids' may hold at most {MAX_STOP_TOKEN_IDS} ids, got {}", req.stop_token_ids.len()),
        );
    }
    if req.sampling.logit_bias.len() > MAX_LOGIT_BIAS {
        return too_many(
            "logit_bias",
            format!("'logit_bias' may hold at most {MAX_LOGIT_BIAS} entries, got {}", req.sampling.logit_bias.len()),
        );
    }
    match &req.constraint {
        Some(ConstraintSpec::Choice { choices }) if choices.len() > MAX_CHOICES || choices.iter().map(String::len).sum::<usize>() > MAX_CHOICE_BYTES => {
            too_many("structured_outputs", format!("a choice constraint may hold at most {MAX_CHOICES} choices of {MAX_CHOICE_BYTES} bytes in all, got {}", choices.len()))
        }
        Some(ConstraintSpec::ToolCall { names }) if names.len() > MAX_TOOLS => too_many("tools", format!("at most {MAX_TOOLS} tools, got {}", names.len())),
        _ => Ok(()),
    }
}

/// The checks every request passes before it is queued (also run by `Engine::submit`, so a bad
/// request is refused synchronously instead of failing later in its stream).
pub fn validate_request(
    model: &LoadedModel,
    max_model_len: usize,
    cfg: &EngineConfig,
    req: &EngineRequest,
) -> Result<(), SubmitError> {
    let vocab = model.config().vocab_size;
    if req.prompt_ids.is_empty() {
        return Err(SubmitError::Invalid("the prompt is empty".into()));
    }
    if let Some(&t) = req.prompt_ids.iter().find(|&&t| t as usize >= vocab) {
        return Err(SubmitError::Invalid(format!("token id {t} is outside the vocabulary (size {vocab})")));
    }
    if req.prompt_ids.len() >= max_model_len {
        return Err(SubmitError::PromptTooLong { prompt: req.prompt_ids.len(), max: max_model_len });
    }
    if req.n == 0 || req.n > cfg.max_n {
        return Err(SubmitError::InvalidParam {
            param: "n",
            message: format!("'n' must be between 1 and {}, got {}", cfg.max_n, req.n),
        });
    }
    for (param, k) in [("top_logprobs", req.logprobs), ("prompt_logprobs", req.prompt_logprobs)] {
        if k.is_some_and(|k| k > cfg.max_logprobs) {
            return Err(SubmitError::InvalidParam {
                param,
                message: format!("'{param}' must be at most {}", cfg.max_logprobs),
            });
        }
    }
    check_list_sizes(req)?;
    if req.min_tokens > req.max_tokens {
        return Err(SubmitError::InvalidParam {
            param: "min_tokens",
            message: format!("'min_tokens' must be at most 'max_tokens' ({}), got {}", req.max_tokens, req.min_tokens),
        });
    }
    if req.sampling.allowed_token_ids.as_ref().is_some_and(|a| a.len() > vocab) {
        return Err(SubmitError::InvalidParam {
            param: "allowed_token_ids",
            message: format!("'allowed_token_ids' may list at most the vocabulary's {vocab} ids"),
        });
    }
    if let Some(&t) = req.sampling.allowed_token_ids.iter().flatten().find(|&&t| t as usize >= vocab) {
        return Err(SubmitError::InvalidParam {
            param: "allowed_token_ids",
            message: format!("allowed_token_ids token id {t} is outside the vocabulary"),
        });
    }
    if let Some(&t) = req.sampling.logit_bias.keys().find(|&&t| t as usize >= vocab) {
        return Err(SubmitError::InvalidParam {
            param: "logit_bias",
            message: format!("logit_bias token id {t} is outside the vocabulary"),
        });
    }
    if let Some(&t) = req.stop_token_ids.iter().find(|&&t| t as usize >= vocab) {
        return Err(SubmitError::InvalidParam {
            param: "stop_token_ids",
            message: format!("stop token id {t} is outside the vocabulary"),
        });
    }
    req.sampling.validate().map_err(SubmitError::Invalid)
}

struct RequestState {
    tx: UnboundedSender<EngineEvent>,
    req: EngineRequest,
    /// Choices not finished yet.
    live: usize,
    /// For n > 1: the other choices are forked once the prompt is computed.
    forked: bool,
}

pub struct EngineCore {
    model: Arc<LoadedModel>,
    cfg: EngineConfig,
    pool: BlockPool,
    max_model_len: usize,
    requests: HashMap<RequestId, RequestState>,
    waiting: Vec<Sequence>,
    running: Vec<Sequence>,
    arrivals: u64,
    stats: EngineStats,
    /// Bytes of every token, built on the first constrained request.
    token_bytes: Option<Vec<Option<Vec<u8>>>>,
    /// Tenants whose rows sat out the previous step (see `fair_share`): they run in this one.
    deferred_last: HashSet<String>,
}

impl EngineCore {
    /// [`Self::try_new`] for models that cannot fail to set up (CPU models); panics with the
    /// reason otherwise (servers use `try_new`).
    pub fn new(model: Arc<LoadedModel>, cfg: EngineConfig) -> Self {
        Self::try_new(model, cfg).unwrap_or_else(|e| panic!("{e}"))
    }

    /// Sizes the KV pool and allocates it: on the host, or, for a model keeping K/V on a device
    /// (`LanguageModel::device_kv`), in the model's device pool with host-side bookkeeping only.
    /// Fails when the device pool cannot be allocated.
    pub fn try_new(model: Arc<LoadedModel>, mut cfg: EngineConfig) -> Result<Self, String> {
        let mc = model.config();
        let layout = model.model.cache_layout();
        let shape = PoolShape::new(&layout, cfg.block_size);
        let slots = recurrent_slots(&model, &cfg, layout.recurrent_bytes_per_seq)?;
        if slots.enabled() && cfg.enable_prefix_caching {
            // Cached KV blocks cannot restore a recurrent state for their prefix, so reusing
            // them would skip tokens the state never saw.
            tracing::info!("prefix caching disabled: the model keeps recurrent state");
            cfg.enable_prefix_caching = false;
        }
        let kv_bytes = cfg.kv_cache_bytes.saturating_sub(slots.total_bytes());
        let num_blocks = (kv_bytes / shape.block_bytes(cfg.kv_dtype)).max(1);
        let max_model_len =
            mc.max_position_embeddings.min(num_blocks * cfg.block_size).min(cfg.max_model_len.unwrap_or(usize::MAX));
        tracing::info!(
            blocks = num_blocks,
            block_size = cfg.block_size,
            dtype = ?cfg.kv_dtype,
            tokens = num_blocks * cfg.block_size,
            max_model_len,
            "KV cache pool allocated"
        );
        let pool = match model.model.device_kv() {
            Some(dev) => {
                let storage = cfg.kv_dtype.device_storage();
                dev.allocate(num_blocks, cfg.block_size, storage).map_err(|e| {
                    format!("cannot allocate the device KV pool ({num_blocks} blocks of {}): {e}", cfg.block_size)
                })?;
                tracing::info!(blocks = num_blocks, "K/V live in the device pool; the host keeps block tables only");
                BlockPool::new_external(shape, num_blocks).with_recurrent(slots)
            }
            None => BlockPool::new(shape, num_blocks, cfg.kv_dtype).with_recurrent(slots),
        };
        Ok(Self {
            model,
            cfg,
            pool,
            max_model_len,
            requests: HashMap::new(),
            waiting: Vec::new(),
            running: Vec::new(),
            arrivals: 0,
            stats: EngineStats::default(),
            token_bytes: None,
            deferred_last: HashSet::new(),
        })
    }

    pub fn max_model_len(&self) -> usize {
        self.max_model_len
    }

    pub fn has_work(&self) -> bool {
        !self.waiting.is_empty() || !self.running.is_empty()
    }

    pub fn num_waiting(&self) -> usize {
        self.waiting.len()
    }

    /// Waiting sequences never admitted (preempted ones are not new queue entries).
    pub fn num_waiting_new(&self) -> usize {
        self.waiting.iter().filter(|s| !s.admitted_once).count()
    }

    /// Checks a request without queueing it.
    pub fn validate(&self, req: &EngineRequest) -> Result<(), SubmitError> {
        validate_request(&self.model, self.max_model_len, &self.cfg, req)
    }

    pub fn config(&self) -> &EngineConfig {
        &self.cfg
    }

    pub fn add_request(
        &mut self,
        id: RequestId,
        req: EngineRequest,
        tx: UnboundedSender<EngineEvent>,
    ) -> Result<(), SubmitError> {
        self.validate(&req)?;
        let seq = self.new_sequence(id, 0, &req, req.prompt_ids.clone(), req.sampling.clone());
        self.waiting.push(seq);
        let forked = req.n == 1;
        self.requests.insert(id, RequestState { tx, live: req.n, forked, req });
        Ok(())
    }

    fn new_sequence(
        &mut self,
        id: RequestId,
        index: usize,
        req: &EngineRequest,
        tokens: Vec<u32>,
        sampling: SamplingParams,
    ) -> Sequence {
        self.arrivals += 1;
        let prompt_len = req.prompt_ids.len();
        Sequence {
            request: id,
            index,
            sampler: Sampler::new(sampling, &req.prompt_ids),
            decoder: IncrementalDecoder::with_context(&req.prompt_ids, req.skip_special_tokens),
            stops: match req.include_stop_str_in_output {
                true => StopChecker::new(req.stop.clone()).including_stop(),
                false => StopChecker::new(req.stop.clone()),
            },
            max_tokens: req.max_tokens.min(self.max_model_len - prompt_len),
            prompt_logprobs: if index == 0 { req.prompt_logprobs } else { None },
            prompt_lp: Vec::new(),
            prompt_lp_sent: false,
            tokens,
            prompt_len,
            num_computed: 0,
            blocks: Vec::new(),
            slot: None,
            hashes: Vec::new(),
            cached_tokens: 0,
            admitted_once: false,
            arrival: self.arrivals,
            priority: req.priority,
            constraint: req.constraint.as_ref().map(Constraint::new),
            tenant: req.tenant.clone(),
            weight: req.tenant_weight,
            salt: req.cache_salt.clone(),
            submitted: std::time::Instant::now(),
            admitted_at: None,
        }
    }

    /// Cancels a request: its sequences leave the queues and their blocks are freed at once.
    pub fn abort(&mut self, id: RequestId) {
        if self.requests.remove(&id).is_none() {
            return;
        }
        let pool = &mut self.pool;
        for list in [&mut self.waiting, &mut self.running] {
            list.retain_mut(|s| {
                if s.request == id {
                    s.release_blocks(pool);
                    false
                } else {
                    true
                }
            });
        }
    }

    pub fn stats(&self) -> EngineStats {
        EngineStats {
            running: self.running.len(),
            waiting: self.waiting.len(),
            kv_blocks_total: self.pool.num_blocks(),
            kv_blocks_free: self.pool.unreferenced(),
            kv_block_size: self.cfg.block_size,
            prefix_cache_queries: self.pool.cache_queries,
            prefix_cache_hits: self.pool.cache_hits,
            ..self.stats.clone()
        }
    }

    /// [`Self::step`] for the engine thread: a panic inside the step (a bug, in whatever code a
    /// request reached) fails the requests in flight with an internal error and frees their
    /// blocks, instead of killing the thread every later request needs. Waiting requests stay.
    pub fn step_guarded(&mut self) -> bool {
        match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.step())) {
            Ok(worked) => worked,
            Err(panic) => {
                let what = panic
                    .downcast_ref::<&str>()
                    .map(|s| s.to_string())
                    .or_else(|| panic.downcast_ref::<String>().cloned())
                    .unwrap_or_else(|| "unknown panic".into());
                self.stats.step_panics_total += 1;
                let mut ids: Vec<RequestId> = self.running.iter().map(|s| s.request).collect();
                ids.sort_unstable();
                ids.dedup();
                tracing::error!(panic = %what, requests = ids.len(), "an engine step panicked; failing the requests in flight");
                for id in ids {
                    self.fail_request(id, &format!("internal error in the engine: {what}"));
                }
                true
            }
        }
    }

    /// One scheduling iteration and forward pass. Returns false when there was nothing to do.
    pub fn step(&mut self) -> bool {
        if !self.has_work() {
            return false;
        }
        let started = std::time::Instant::now();
        let mut budget = self.cfg.max_num_batched_tokens;
        // (running index, tokens scheduled)
        let mut plan: Vec<(usize, usize)> = Vec::new();
        let (deferred, favoured_priority) = self.tenants_to_defer();
        let is_deferred = |s: &Sequence| s.priority <= favoured_priority && deferred.contains(&s.tenant);
        let mut num_deferred = 0;

        // A request waiting for admission gets budget this step: running prompts are cut to
        // shorter chunks while one waits (see `long_prefill_token_threshold`).
        let prefill_cap = if !self.waiting.is_empty() && self.running.len() < self.cfg.max_num_seqs {
            self.long_prefill_cap()
        } else {
            usize::MAX
        };

        // 1. Running sequences: decodes first, then prefill chunks; oldest first. Rows of tenants
        //    deferred this step are skipped (they keep their blocks and slots).
        self.running.sort_by_key(|s| (s.is_prefilling(), std::cmp::Reverse(s.priority), s.arrival));
        let mut i = 0;
        while i < self.running.len() && budget > 0 {
            if is_deferred(&self.running[i]) {
                num_deferred += 1;
                i += 1;
                continue;
            }
            let cap = if self.running[i].is_prefilling() {
                long_context_chunk(prefill_cap.min(self.cfg.max_num_batched_tokens), self.running[i].num_computed)
            } else {
                usize::MAX
            };
            let chunk = self.running[i].remaining().min(budget).min(self.running[i].chunk_limit()).min(cap);
            let upto = self.running[i].num_computed + chunk;
            if self.running[i].reserve(upto, &mut self.pool) {
                plan.push((i, chunk));
                budget -= chunk;
                i += 1;
                continue;
            }
            // Out of blocks: preempt the newest other sequence not yet planned, else this one.
            let planned: Vec<usize> = plan.iter().map(|p| p.0).collect();
            let victim = (0..self.running.len())
                .filter(|&j| j != i && !planned.contains(&j))
                .filter(|&j| j > i || !is_deferred(&self.running[j]))
                .min_by_key(|&j| (self.running[j].priority, std::cmp::Reverse(self.running[j].arrival)));
            match victim {
                Some(j)
                    if self.running[j].arrival > self.running[i].arrival
                        || self.running[j].priority < self.running[i].priority =>
                {
                    // (A deferred row before `i` is never the victim, so `num_deferred` stays right.)
                    let mut s = self.running.remove(j);
                    s.release_blocks(&mut self.pool);
                    self.stats.preemptions_total += 1;
                    self.waiting.push(s);
                    if j < i {
                        i -= 1;
                    }
                }
                _ => {
                    let mut s = self.running.remove(i);
                    s.release_blocks(&mut self.pool);
                    self.stats.preemptions_total += 1;
                    self.waiting.push(s);
                }
            }
        }

        // 2. Admit waiting sequences while resources allow, but only when every running sequence
        //    got its turn (no admission past a preemption). Order: priority, then the tenant
        //    furthest below its weighted fair share of batch slots, then arrival.
        if plan.len() + num_deferred == self.running.len() {
            while budget > 0 && self.running.len() < self.cfg.max_num_seqs && !self.waiting.is_empty() {
                let Some(next) = self.next_to_admit(&deferred) else { break };
                let mut s = self.waiting.remove(next);
                // Prompt logprobs need every prompt row computed: no prefix-cache hit (as vLLM).
                if self.cfg.enable_prefix_caching && s.prompt_logprobs.is_none() {
                    let hit = s.attach_cached_prefix(&mut self.pool);
                    if !s.admitted_once {
                        s.cached_tokens = hit;
                    }
                }
                let chunk = s.remaining().min(budget).min(s.chunk_limit());
                if !s.reserve(s.num_computed + chunk, &mut self.pool) {
                    s.release_blocks(&mut self.pool);
                    self.waiting.insert(next, s);
                    break;
                }
                s.admitted_once = true;
                s.admitted_at.get_or_insert_with(std::time::Instant::now);
                budget -= chunk;
                self.running.push(s);
                plan.push((self.running.len() - 1, chunk));
            }
        }
        self.deferred_last = deferred;
        if plan.is_empty() && num_deferred > 0 {
            // The favoured prompt did not fit after all: the deferred rows run next step.
            return true;
        }
        if plan.is_empty() {
            // Nothing fits: a lone sequence larger than the pool. Cannot happen given
            // max_model_len <= pool tokens, but never spin.
            if let Some(s) = self.waiting.first() {
                let id = s.request;
                self.fail_request(id, "the KV cache cannot hold this request");
            }
            return true;
        }
        let tokens: usize = plan.iter().map(|p| p.1).sum();
        self.run_batch(&plan);
        tracing::debug!(
            rows = plan.len(),
            tokens,
            deferred = num_deferred,
            ms = started.elapsed().as_secs_f64() * 1e3,
            "engine step"
        );
        true
    }

    /// The longest chunk a running prompt gets while requests wait for admission.
    fn long_prefill_cap(&self) -> usize {
        match self.cfg.long_prefill_token_threshold {
            0 => (self.cfg.max_num_batched_tokens / 2).max(1),
            t => t.min(self.cfg.max_num_batched_tokens).max(1),
        }
    }

    /// Tenants whose rows sit out this step, and the highest priority among the prompts they
    /// make way for (rows of higher priority than that are never deferred). The prompts
    /// considered are running prefills and the sequence admission would pick next, if a slot
    /// is free for it.
    fn tenants_to_defer(&self) -> (HashSet<String>, i32) {
        let shares = SlotShares::new(
            self.running.iter().map(|s| (s.tenant.as_str(), s.weight)),
            self.waiting.iter().map(|s| (s.tenant.as_str(), s.weight)),
            self.cfg.max_num_seqs,
        );
        let mut prompts: Vec<&Sequence> = self.running.iter().filter(|s| s.is_prefilling()).collect();
        if self.running.len() < self.cfg.max_num_seqs {
            prompts.extend(self.next_to_admit(&HashSet::new()).map(|i| &self.waiting[i]));
        }
        let favoured: Vec<&Sequence> = prompts.into_iter().filter(|s| shares.light(&s.tenant)).collect();
        let deferred = shares.deferred(favoured.iter().map(|s| s.tenant.as_str()), &self.deferred_last);
        (deferred, favoured.iter().map(|s| s.priority).max().unwrap_or(i32::MIN))
    }

    /// Index in `waiting` of the sequence to admit next: highest priority; among those, the
    /// tenant with the fewest running sequences per unit of weight (weighted fair share, so a
    /// tenant flooding the queue cannot starve the others); then first come, first served.
    /// A tenant already holding `max_num_seqs - tenant_slot_reserve` slots is not admitted more
    /// (`None` when nobody waiting may be admitted). Tenants in `deferred` are not admitted.
    fn next_to_admit(&self, deferred: &HashSet<String>) -> Option<usize> {
        let mut share: HashMap<&str, usize> = HashMap::new();
        for s in &self.running {
            *share.entry(s.tenant.as_str()).or_default() += 1;
        }
        let cap = self.cfg.max_num_seqs.saturating_sub(self.cfg.tenant_slot_reserve).max(1);
        let held = |s: &Sequence| share.get(s.tenant.as_str()).copied().unwrap_or(0);
        let key = |s: &Sequence| (std::cmp::Reverse(s.priority), held(s) as f64 / s.weight.max(1e-6), s.arrival);
        (0..self.waiting.len())
            .filter(|&i| held(&self.waiting[i]) < cap && !deferred.contains(&self.waiting[i].tenant))
            .min_by(|&a, &b| {
                key(&self.waiting[a]).partial_cmp(&key(&self.waiting[b])).unwrap_or(std::cmp::Ordering::Equal)
            })
    }

    fn fail_request(&mut self, id: RequestId, msg: &str) {
        if let Some(r) = self.requests.get(&id) {
            let _ = r.tx.send(EngineEvent::Error(msg.to_string()));
        }
        self.abort(id);
    }

    fn run_batch(&mut self, plan: &[(usize, usize)]) {
        let mut tokens = Vec::new();
        let mut rows = Vec::new();
        let mut logit_rows = Vec::new();
        let mut sampled_seqs = Vec::new();
        // (running index, prompt position) of the rows scoring prompt tokens, in `logit_rows` order
        // before each sequence's sampled row.
        let mut prompt_rows: Vec<(usize, usize)> = Vec::new();
        let mut logit_is_prompt = Vec::new();
        let mut tables = Vec::with_capacity(plan.len());
        let mut slots = Vec::with_capacity(plan.len());
        for (b, &(i, chunk)) in plan.iter().enumerate() {
            let s = &self.running[i];
            for p in s.num_computed..s.num_computed + chunk {
                tokens.push(s.tokens[p]);
                rows.push(BatchRow { seq: b, pos: p });
                if s.wants_prompt_logprob(p) {
                    logit_rows.push(rows.len() - 1);
                    logit_is_prompt.push(true);
                    prompt_rows.push((i, p));
                }
            }
            if s.num_computed + chunk == s.tokens.len() {
                // The last prompt row both scores nothing (no next prompt token) and samples.
                logit_rows.push(rows.len() - 1);
                logit_is_prompt.push(false);
                sampled_seqs.push(i);
            }
            tables.push(s.blocks.clone());
            slots.push(s.slot);
        }
        self.stats.steps_total += 1;
        let logits = {
            let copies = self.pool.take_pending_copies();
            let slot_ops = self.pool.recurrent.take_pending();
            let mut kv = PagedKv { pool: &mut self.pool, tables, slots, copies, slot_ops };
            self.model.model.try_forward(&tokens, &rows, &mut kv, &logit_rows)
        };
        let logits = match logits {
            Ok(l) => l,
            Err(e) => {
                // A device failure fails this batch's requests, not the server: later requests
                // get their own try (a broken device keeps failing them, each with the reason).
                tracing::error!(error = %e, rows = plan.len(), tokens = tokens.len(), "forward pass failed; failing the batch's requests");
                self.stats.forward_errors_total += 1;
                // A request's sequences (n > 1) need not be adjacent in the plan.
                let mut ids: Vec<RequestId> = plan.iter().map(|&(i, _)| self.running[i].request).collect();
                ids.sort_unstable();
                ids.dedup();
                for id in ids {
                    self.fail_request(id, &format!("the model's forward pass failed: {e}"));
                }
                return;
            }
        };
        for &(i, chunk) in plan {
            let s = &mut self.running[i];
            self.stats.prompt_tokens_total += chunk.min(s.prompt_len.saturating_sub(s.num_computed)) as u64;
            s.num_computed += chunk;
            if self.cfg.enable_prefix_caching {
                s.register_full_blocks(&mut self.pool);
            }
        }
        let vocab = self.model.config().vocab_size;
        let (prompt_logits, sample_logits): (Vec<usize>, Vec<usize>) =
            (0..logit_rows.len()).partition(|&k| logit_is_prompt[k]);
        self.score_prompt_rows(
            &prompt_rows,
            prompt_logits.iter().map(|&k| &logits[k * vocab..(k + 1) * vocab]),
            &sampled_seqs,
        );
        let mut finished: Vec<usize> = Vec::new();
        let mut forks: Vec<(usize, Vec<f32>)> = Vec::new();
        for (&k, &i) in sample_logits.iter().zip(&sampled_seqs) {
            let row = logits[k * vocab..(k + 1) * vocab].to_vec();
            let id = self.running[i].request;
            if self.requests.get(&id).is_some_and(|r| !r.forked) {
                forks.push((i, row.clone()));
            }
            if self.sample_and_emit(i, row) {
                finished.push(i);
            }
        }
        for (i, row) in forks {
            self.fork(i, row, &mut finished);
        }
        finished.sort_unstable();
        finished.dedup();
        for &i in finished.iter().rev() {
            let mut s = self.running.remove(i);
            s.release_blocks(&mut self.pool);
        }
        // Sequences whose client went away were aborted while emitting.
        let live: Vec<RequestId> = self.requests.keys().copied().collect();
        let pool = &mut self.pool;
        self.running.retain_mut(|s| {
            let keep = live.contains(&s.request);
            if !keep {
                s.release_blocks(pool);
            }
            keep
        });
    }

    /// Records the logprob of the prompt token each of `rows` scores (`logits` in the same
    /// order), and sends a sequence's prompt logprobs once they are all in, before its first
    /// token.
    fn score_prompt_rows<'a>(
        &mut self,
        rows: &[(usize, usize)],
        logits: impl Iterator<Item = &'a [f32]>,
        sampled: &[usize],
    ) {
        for (&(i, pos), l) in rows.iter().zip(logits) {
            let s = &mut self.running[i];
            let k = s.prompt_logprobs.unwrap_or(0);
            let token = s.tokens[pos + 1];
            s.prompt_lp.push(TokenLogprob::score(l, token, k));
        }
        // A one-token prompt has no rows to score and is complete when it samples.
        for i in rows.iter().map(|r| r.0).chain(sampled.iter().copied()) {
            let s = &mut self.running[i];
            if s.prompt_logprobs.is_none() || s.prompt_lp_sent || s.prompt_lp.len() + 1 < s.prompt_len {
                continue;
            }
            s.prompt_lp_sent = true;
            let lp = std::mem::take(&mut s.prompt_lp);
            if let Some(state) = self.requests.get(&s.request) {
                let _ = state.tx.send(EngineEvent::PromptLogprobs(lp));
            }
        }
    }

    /// Creates choices 1..n of a request from choice 0 once its prompt is computed. They share
    /// every prompt block (copy-on-write for the partial last one) and sample their first token
    /// from the same logits with their own RNG stream.
    fn fork(&mut self, parent: usize, logits: Vec<f32>, finished: &mut Vec<usize>) {
        let id = self.running[parent].request;
        let Some(state) = self.requests.get_mut(&id) else { return };
        state.forked = true;
        let req = state.req.clone();
        for index in 1..req.n {
            let mut sampling = req.sampling.clone();
            // Mixed, not offset: choice i of seed s must not replay choice 0 of seed s + i.
            sampling.seed = req.sampling.seed.map(|s| splitmix64(s ^ splitmix64(index as u64)));
            let mut child = self.new_sequence(id, index, &req, req.prompt_ids.clone(), sampling);
            child.arrival = self.running[parent].arrival;
            child.admitted_once = true;
            child.cached_tokens = self.running[parent].cached_tokens;
            child.num_computed = req.prompt_ids.len();
            child.blocks = self.running[parent].blocks[..req.prompt_ids.len().div_ceil(self.cfg.block_size)].to_vec();
            child.hashes =
                self.running[parent].hashes.iter().take(req.prompt_ids.len() / self.cfg.block_size).copied().collect();
            if let Some(from) = self.running[parent].slot {
                match self.pool.recurrent.fork(from) {
                    Some(slot) => child.slot = Some(slot),
                    None => {
                        // No state slot free: this choice recomputes its prompt once admitted
                        // (and samples its first token then, from its own RNG stream).
                        child.num_computed = 0;
                        child.blocks.clear();
                        child.hashes.clear();
                        self.waiting.push(child);
                        continue;
                    }
                }
            }
            for &b in &child.blocks {
                self.pool.retain(b);
            }
            self.running.push(child);
            let i = self.running.len() - 1;
            if self.sample_and_emit(i, logits.clone()) {
                finished.push(i);
            }
        }
    }

    /// Samples the next token of running sequence `i`, streams it, and reports whether it ended.
    fn sample_and_emit(&mut self, i: usize, mut logits: Vec<f32>) -> bool {
        let s = &mut self.running[i];
        let Some(state) = self.requests.get_mut(&s.request) else { return true };
        let tok = &self.model.tokenizer;
        // Logprobs are of the raw distribution, before the masks and penalties below.
        let raw_for_logprobs = state.req.logprobs.map(|k| (k, logits.clone()));
        // `min_tokens`: the ending tokens are masked after the logprobs are taken (vLLM reports
        // logprobs of the raw distribution too).
        let before_min = s.generated() < state.req.min_tokens;
        if before_min {
            let eos = if state.req.ignore_eos { &[][..] } else { &tok.eos_token_ids[..] };
            for &t in eos.iter().chain(&state.req.stop_token_ids) {
                if let Some(l) = logits.get_mut(t as usize) {
                    *l = f32::NEG_INFINITY;
                }
            }
        }
        let next = match &s.constraint {
            None => s.sampler.sample(&mut logits).token,
            Some(js) => {
                let bytes = self.token_bytes.get_or_insert_with(|| tok.token_bytes());
                let eos = tok.eos_token_ids.first().copied();
                if js.is_complete() {
                    // The constrained output is complete: nothing but EOS may follow.
                    eos.unwrap_or(0)
                } else {
                    let allowed =
                        |t: u32| bytes.get(t as usize).and_then(|b| b.as_deref()).is_some_and(|b| js.accepts(b));
                    match s.sampler.sample_allowed(&mut logits, allowed) {
                        Some(x) => x.token,
                        None => eos.unwrap_or(0),
                    }
                }
            }
        };
        if let (Some(js), Some(Some(b))) =
            (&mut s.constraint, self.token_bytes.as_ref().map(|t| t.get(next as usize).cloned().flatten()))
        {
            js.feed(&b);
        }
        s.sampler.observe(next);
        s.tokens.push(next);
        if s.generated() == 1 && s.index == 0 {
            let queued = s.admitted_at.map_or(0.0, |a| a.duration_since(s.submitted).as_secs_f64() * 1e3);
            tracing::debug!(tenant = %s.tenant, queued_ms = queued, ttft_ms = s.submitted.elapsed().as_secs_f64() * 1e3, "first token");
        }
        self.stats.generation_tokens_total += 1;
        let logprob = raw_for_logprobs.map(|(k, raw)| TokenLogprob::score(&raw, next, k));
        let is_eos = (!state.req.ignore_eos && tok.is_eos(next)) || state.req.stop_token_ids.contains(&next);
        let mut reason = None;
        let mut text = String::new();
        if is_eos {
            reason = Some(FinishReason::Stop);
        } else {
            let delta = s.decoder.push(tok, next);
            if before_min {
                text = s.stops.push_unchecked(&delta);
            } else {
                match s.stops.push(&delta) {
                    StopOutcome::Continue(t) => text = t,
                    StopOutcome::Stopped(t) => {
                        text = t;
                        reason = Some(FinishReason::Stop);
                    }
                }
            }
        }
        if reason.is_none() && s.generated() >= s.max_tokens {
            reason = Some(FinishReason::Length);
        }
        let mut ok = state.tx.send(EngineEvent::Token { index: s.index, token: next, text, logprob }).is_ok();
        if let Some(reason) = reason {
            // Unless a stop string ended the choice, release what was held back (an incomplete
            // character, or text that might have started a stop string).
            let mut tail = String::new();
            if is_eos || reason == FinishReason::Length {
                let rest = s.decoder.flush(tok);
                match s.stops.push(&rest) {
                    StopOutcome::Continue(t) => {
                        tail.push_str(&t);
                        tail.push_str(&s.stops.flush());
                    }
                    StopOutcome::Stopped(t) => tail.push_str(&t),
                }
            }
            ok &= state
                .tx
                .send(EngineEvent::Finished {
                    index: s.index,
                    reason,
                    text: tail,
                    prompt_tokens: s.prompt_len,
                    completion_tokens: s.generated(),
                    cached_tokens: s.cached_tokens,
                })
                .is_ok();
            state.live -= 1;
            if state.live == 0 {
                let id = s.request;
                self.requests.remove(&id);
            }
        }
        if !ok {
            // The client hung up: drop the whole request (run_batch frees its blocks).
            let id = s.request;
            self.requests.remove(&id);
            self.waiting.retain(|w| w.request != id);
            return true;
        }
        reason.is_some()
    }

    pub fn pool(&self) -> &BlockPool {
        &self.pool
    }
}

/// The recurrent-state slots for `model` (none when it keeps no recurrent state), logged: host
/// states, or, for a model keeping K/V and states on a device, slot ids over the state pool the
/// model allocates (`DeviceKv::allocate_recurrent`).
/// A prompt chunk's cap at `position` tokens into its prompt. Attention costs a row about its
/// position, so past [`LONG_CONTEXT_REF`] positions the chunk shrinks in proportion (down to 16
/// rows): a step's attention work stays near what `cap` rows cost at that reference instead of
/// growing with a long prompt, so a request arriving mid-step waits a bounded time for it.
fn long_context_chunk(cap: usize, position: usize) -> usize {
    if position <= LONG_CONTEXT_REF {
        return cap;
    }
    (cap.saturating_mul(LONG_CONTEXT_REF) / position).max(16).min(cap)
}

/// Positions up to which a prompt chunk keeps its full size (see [`long_context_chunk`]).
const LONG_CONTEXT_REF: usize = 1024;

fn recurrent_slots(model: &LoadedModel, cfg: &EngineConfig, bytes_per_seq: usize) -> Result<RecurrentSlots, String> {
    let count = RecurrentSlots::count_for(bytes_per_seq, cfg.max_num_seqs, cfg.kv_cache_bytes);
    if count == 0 {
        return Ok(RecurrentSlots::none());
    }
    if let Some(dev) = model.model.device_kv() {
        dev.allocate_recurrent(count)
            .map_err(|e| format!("cannot allocate {count} recurrent state slots on the device: {e}"))?;
        tracing::info!(
            slots = count,
            bytes_per_seq,
            total_bytes = count * bytes_per_seq,
            "recurrent state slots allocated on the device"
        );
        return Ok(RecurrentSlots::external(count, bytes_per_seq));
    }
    Ok(match model.model.new_recurrent_state() {
        Some(fresh) => {
            tracing::info!(
                slots = count,
                bytes_per_seq,
                total_bytes = count * bytes_per_seq,
                "recurrent state slots allocated"
            );
            RecurrentSlots::new(fresh, count, bytes_per_seq)
        }
        None => RecurrentSlots::none(),
    })
}

fn splitmix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

#[cfg(test)]
mod long_prefill_tests {
    use super::long_context_chunk;

    #[test]
    fn prompt_chunks_shrink_with_the_prompts_position() {
        assert_eq!(long_context_chunk(256, 0), 256);
        assert_eq!(long_context_chunk(256, 1024), 256);
        assert_eq!(long_context_chunk(256, 2048), 128);
        assert_eq!(long_context_chunk(128, 5000), 26);
        assert_eq!(long_context_chunk(128, 100_000), 16);
        assert_eq!(long_context_chunk(8, 100_000), 8, "never above the cap");
    }
}
