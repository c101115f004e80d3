//! Single-request generation: prefill the prompt, then sample token by token with streaming text,
//! stop strings, EOS and a length limit. A CPU model uses a contiguous host cache; a model whose
//! K/V live on a device (`--device cuda:N`) gets a device pool sized for this one request, read
//! through one block table.

use std::time::{Duration, Instant};

use crate::engine::block_pool::KvDtype;
use crate::model::device::step::BlockTables;
use crate::model::kv::{BatchRow, ContiguousKvCache, KvCache};
use crate::model::tokenizer::incremental::IncrementalDecoder;
use crate::model::LoadedModel;
use crate::sampling::stop::{StopChecker, StopOutcome};
use crate::sampling::{Sampler, SamplingParams};

#[derive(Clone, Debug)]
pub struct GenerateRequest {
    pub prompt_ids: Vec<u32>,
    pub sampling: SamplingParams,
    pub max_tokens: usize,
    pub stop: Vec<String>,
    pub ignore_eos: bool,
    /// Storage of a device model's KV pool (`--kv-cache-dtype`). A CPU model's contiguous cache
    /// is always f32.
    pub kv_dtype: KvDtype,
}

pub use crate::engine::FinishReason;

#[derive(Clone, Debug)]
pub struct GenerateOutput {
    pub tokens: Vec<u32>,
    pub text: String,
    pub finish_reason: FinishReason,
    pub prefill_time: Duration,
    pub decode_time: Duration,
}

impl GenerateOutput {
    /// Decode speed, counting tokens after the first (the first comes from prefill).
    pub fn decode_tokens_per_sec(&self) -> f64 {
        let n = self.tokens.len().saturating_sub(1) as f64;
        if self.decode_time.is_zero() {
            0.0
        } else {
            n / self.decode_time.as_secs_f64()
        }
    }
}

pub fn generate(
    m: &LoadedModel,
    req: &GenerateRequest,
    mut on_text: impl FnMut(&str),
) -> Result<GenerateOutput, String> {
    let cfg = m.config();
    if req.prompt_ids.is_empty() {
        return Err("the prompt is empty".into());
    }
    if let Some(&bad) = req.prompt_ids.iter().find(|&&t| t as usize >= cfg.vocab_size) {
        return Err(format!("token id {bad} is outside the vocabulary (size {})", cfg.vocab_size));
    }
    let ctx = cfg.max_position_embeddings;
    if req.prompt_ids.len() >= ctx {
        return Err(format!("the prompt has {} tokens; this model's context is {ctx} tokens", req.prompt_ids.len()));
    }
    req.sampling.validate()?;
    let max_tokens = req.max_tokens.min(ctx - req.prompt_ids.len());

    let mut cache = Cache::for_request(m, req.prompt_ids.len() + max_tokens, req.kv_dtype)?;
    let kv = cache.as_kv();
    let mut sampler = Sampler::new(req.sampling.clone(), &req.prompt_ids);
    let mut decoder = IncrementalDecoder::with_context(&req.prompt_ids, true);
    let mut stops = StopChecker::new(req.stop.clone());
    let mut tokens = Vec::new();
    let mut text = String::new();

    let started = Instant::now();
    let rows: Vec<BatchRow> = (0..req.prompt_ids.len()).map(|pos| BatchRow { seq: 0, pos }).collect();
    let mut logits = m.model.try_forward(&req.prompt_ids, &rows, kv, &[rows.len() - 1]).map_err(|e| e.to_string())?;
    let prefill_time = started.elapsed();
    let decode_start = Instant::now();
    let mut finish_reason = FinishReason::Length;
    let mut emit = |s: &str, text: &mut String| {
        if !s.is_empty() {
            on_text(s);
            text.push_str(s);
        }
    };
    while tokens.len() < max_tokens {
        let next = sampler.sample(&mut logits).token;
        sampler.observe(next);
        tokens.push(next);
        if !req.ignore_eos && m.tokenizer.is_eos(next) {
            // Release text held back as a possible stop-string prefix.
            let rest = stops.flush();
            emit(&rest, &mut text);
            finish_reason = FinishReason::Stop;
            break;
        }
        let delta = decoder.push(&m.tokenizer, next);
        match stops.push(&delta) {
            StopOutcome::Continue(s) => emit(&s, &mut text),
            StopOutcome::Stopped(s) => {
                emit(&s, &mut text);
                finish_reason = FinishReason::Stop;
                break;
            }
        }
        if tokens.len() == max_tokens {
            break;
        }
        let pos = req.prompt_ids.len() + tokens.len() - 1;
        logits = m.model.try_forward(&[next], &[BatchRow { seq: 0, pos }], kv, &[0]).map_err(|e| e.to_string())?;
    }
    if finish_reason == FinishReason::Length {
        let tail = decoder.flush(&m.tokenizer);
        match stops.push(&tail) {
            StopOutcome::Continue(s) => {
                emit(&s, &mut text);
                let rest = stops.flush();
                emit(&rest, &mut text);
            }
            StopOutcome::Stopped(s) => {
                emit(&s, &mut text);
                finish_reason = FinishReason::Stop;
            }
        }
    }
    Ok(GenerateOutput { tokens, text, finish_reason, prefill_time, decode_time: decode_start.elapsed() })
}

/// Where one request's K/V live.
enum Cache {
    Host(ContiguousKvCache),
    /// The single sequence's block table over the whole device pool (block i holds positions
    /// 16i..16i+15), and its recurrent-state slot when the model has one.
    Device(BlockTables),
}

impl Cache {
    const BLOCK_SIZE: usize = 16;

    /// A host cache, or for a device model its pool of `dtype` allocated with blocks for
    /// `positions`.
    fn for_request(m: &LoadedModel, positions: usize, dtype: KvDtype) -> Result<Self, String> {
        let Some(dev) = m.model.device_kv() else {
            return Ok(Cache::Host(m.model.contiguous_cache(1)));
        };
        let blocks = positions.div_ceil(Self::BLOCK_SIZE).max(1);
        dev.allocate(blocks, Self::BLOCK_SIZE, dtype.device_storage())
            .map_err(|e| format!("cannot allocate the device KV pool: {e}"))?;
        tracing::info!(blocks, block_size = Self::BLOCK_SIZE, "device KV pool of {dtype:?} allocated for the request");
        let mut tables = BlockTables::new(Self::BLOCK_SIZE, vec![(0..blocks as u32).collect()], Vec::new());
        if m.model.cache_layout().recurrent_bytes_per_seq > 0 {
            // One recurrent-state slot, allocated zeroed: the empty state, so no reset is needed.
            dev.allocate_recurrent(1).map_err(|e| format!("cannot allocate the device recurrent state: {e}"))?;
            tables.slots = vec![Some(0)];
        }
        Ok(Cache::Device(tables))
    }

    fn as_kv(&mut self) -> &mut dyn KvCache {
        match self {
            Cache::Host(c) => c,
            Cache::Device(t) => t,
        }
    }
}
