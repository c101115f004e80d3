//! `wasmserve bench engine`: engine throughput and latency on a real model, driven through the
//! same `EngineCore` the server uses (no HTTP in the way).

use std::sync::Arc;
use std::time::Instant;

use tokio::sync::mpsc::unbounded_channel;

use crate::engine::{EngineConfig, EngineCore, EngineEvent, EngineRequest};
use crate::model::LoadedModel;
use crate::sampling::SamplingParams;

pub struct EngineBenchReport {
    pub single_stream_decode_tps: f64,
    /// (concurrency, aggregate decode tokens/s)
    pub aggregate_decode_tps: Vec<(usize, f64)>,
    pub prefill_tps: f64,
    pub ttft_cold_ms: f64,
    pub ttft_cached_ms: f64,
    /// Length of the TTFT prompt (384 tokens, fewer for models with a shorter context).
    pub ttft_prompt_tokens: usize,
}

fn prompt_tokens(m: &LoadedModel, seed: usize, approx_tokens: usize) -> Vec<u32> {
    // Distinct prompts per stream so the prefix cache does not hide prefill work.
    let words = ["river", "mountain", "garden", "library", "engine", "harbor", "forest", "market", "planet", "castle"];
    let mut text = format!("Story {seed}: ");
    let mut i = seed;
    let mut ids = m.tokenizer.encode(&text, false).unwrap();
    while ids.len() < approx_tokens {
        text.push_str(words[i % words.len()]);
        text.push(' ');
        i = i.wrapping_mul(7).wrapping_add(3);
        ids = m.tokenizer.encode(&text, false).unwrap();
    }
    ids.truncate(approx_tokens);
    ids
}

fn request(prompt: Vec<u32>, max_tokens: usize, salt: &str) -> EngineRequest {
    EngineRequest {
        prompt_ids: prompt,
        sampling: SamplingParams::greedy(),
        max_tokens,
        ignore_eos: true,
        cache_salt: salt.into(),
        ..Default::default()
    }
}

/// Aggregate decode tokens/s with `streams` concurrent sequences: prefill everything first, then
/// time `steps` pure decode steps.
fn decode_throughput(core: &mut EngineCore, m: &LoadedModel, streams: usize, steps: usize, round: usize) -> f64 {
    let mut rxs = Vec::new();
    for s in 0..streams {
        let (tx, rx) = unbounded_channel();
        core.add_request(
            (round * 1000 + s) as u64,
            request(prompt_tokens(m, round * 1000 + s, 32), steps + 8, &format!("bench-{round}")),
            tx,
        )
        .unwrap();
        rxs.push(rx);
    }
    // Until every stream has produced its first token, steps contain prefill work.
    let mut started = vec![false; streams];
    while started.iter().any(|s| !s) {
        core.step();
        for (i, rx) in rxs.iter_mut().enumerate() {
            while let Ok(ev) = rx.try_recv() {
                if matches!(ev, EngineEvent::Token { .. }) {
                    started[i] = true;
                }
            }
        }
    }
    let before = core.stats().generation_tokens_total;
    let t = Instant::now();
    for _ in 0..steps {
        core.step();
    }
    let secs = t.elapsed().as_secs_f64();
    let tokens = core.stats().generation_tokens_total - before;
    while core.step() {}
    tokens as f64 / secs
}

fn time_to_first_token(core: &mut EngineCore, prompt: Vec<u32>, salt: &str, id: u64) -> f64 {
    let (tx, mut rx) = unbounded_channel();
    let t = Instant::now();
    core.add_request(id, request(prompt, 1, salt), tx).unwrap();
    loop {
        core.step();
        if let Ok(EngineEvent::Token { .. }) = rx.try_recv() {
            let ms = t.elapsed().as_secs_f64() * 1e3;
            while core.step() {}
            return ms;
        }
    }
}

/// Fails (rather than panicking) when the engine cannot be built, e.g. a device model whose KV
/// pool does not fit in device memory.
pub fn run_engine_bench(
    model: Arc<LoadedModel>,
    cfg: EngineConfig,
    concurrency: &[usize],
    decode_steps: usize,
) -> Result<EngineBenchReport, String> {
    let mut core = EngineCore::try_new(model.clone(), cfg.clone())?;
    eprintln!("bench: warm-up");
    decode_throughput(&mut core, &model, 2, 4, 0);

    let mut aggregate = Vec::new();
    for (round, &c) in concurrency.iter().enumerate() {
        eprint!("bench: decode with {c} concurrent streams ... ");
        let tps = decode_throughput(&mut core, &model, c, decode_steps, round + 1);
        eprintln!("{tps:.1} tok/s");
        aggregate.push((c, tps));
    }
    let single = aggregate
        .iter()
        .find(|(c, _)| *c == 1)
        .map(|x| x.1)
        .unwrap_or_else(|| decode_throughput(&mut core, &model, 1, decode_steps, 99));

    // Prompts must leave room for a generated token within the model's context.
    let room = model.config().max_position_embeddings.saturating_sub(2).max(1);
    eprint!("bench: prefill ... ");
    let prompt = prompt_tokens(&model, 4242, 512.min(room));
    let n = prompt.len();
    let ms = time_to_first_token(&mut core, prompt, "prefill", 50_000);
    let prefill_tps = n as f64 / (ms / 1e3);
    eprintln!("{prefill_tps:.1} tok/s ({n} tokens)");

    eprint!("bench: time to first token, cold vs prefix-cache hit ... ");
    let prompt = prompt_tokens(&model, 777, 384.min(room));
    let ttft_prompt_tokens = prompt.len();
    let cold = time_to_first_token(&mut core, prompt.clone(), "ttft", 60_000);
    let cached = time_to_first_token(&mut core, prompt, "ttft", 60_001);
    eprintln!("{cold:.1} ms vs {cached:.1} ms");
    Ok(EngineBenchReport {
        single_stream_decode_tps: single,
        aggregate_decode_tps: aggregate,
        prefill_tps,
        ttft_cold_ms: cold,
        ttft_cached_ms: cached,
        ttft_prompt_tokens,
    })
}

impl EngineBenchReport {
    pub fn print(&self) {
        println!("| metric | value |");
        println!("|---|---|");
        println!("| single-stream decode | {:.1} tok/s |", self.single_stream_decode_tps);
        for (c, tps) in &self.aggregate_decode_tps {
            println!(
                "| aggregate decode, {c} streams | {tps:.1} tok/s ({:.1}x single) |",
                tps / self.single_stream_decode_tps
            );
        }
        println!("| prefill | {:.1} tok/s |", self.prefill_tps);
        let n = self.ttft_prompt_tokens;
        println!("| TTFT {n}-token prompt, cold | {:.1} ms |", self.ttft_cold_ms);
        println!("| TTFT {n}-token prompt, prefix-cache hit | {:.1} ms |", self.ttft_cached_ms);
    }
}
