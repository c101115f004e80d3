//! `wasmserve bench decode`: single-stream greedy decode speed (and the prompt's prefill speed) of
//! several checkpoints of the same model (e.g. bf16 → dense f32, INT4, Cubic), measured side by
//! side in one run. Rounds go over the models in turn and each model's fastest round is kept, so
//! every model sees the same machine load (the machine may be shared); ratios are against the
//! first model. `bench/cpu-vs-llama-cpp.sh` runs it beside llama.cpp's `llama-bench`.

use std::time::Instant;

use crate::model::activations::CpuActivations;
use crate::model::kv::BatchRow;
use crate::model::LoadedModel;

#[derive(clap::Args)]
pub struct DecodeBenchArgs {
    /// Checkpoints (.gguf or Hugging Face directories); the first is the baseline of the ratios.
    #[arg(long = "model", required = true)]
    pub models: Vec<std::path::PathBuf>,
    /// Prompt tokens prefilled before decoding.
    #[arg(long, default_value_t = 32)]
    pub prompt_tokens: usize,
    /// Tokens decoded (and timed) per round.
    #[arg(long, default_value_t = 32)]
    pub steps: usize,
    #[arg(long, default_value_t = 3)]
    pub rounds: usize,
    /// CPU activation precisions to run each checkpoint with (`f32`, `int8`, or both:
    /// `f32,int8`); each checkpoint × precision is one row of the table.
    #[arg(long, value_delimiter = ',', default_value = "f32")]
    pub cpu_activations: Vec<CpuActivations>,
}

/// Seconds spent on one run's prompt (one forward over all its tokens) and on its decode steps.
pub struct Timings {
    pub prefill: f64,
    pub decode: f64,
}

/// Prefills `prompt` and decodes `steps` greedy tokens after it; returns both times and the
/// tokens, so the caller can check every model ran a real continuation.
pub fn timed_decode(m: &LoadedModel, prompt: &[u32], steps: usize) -> (Timings, Vec<u32>) {
    let mut kv = m.model.contiguous_cache(1);
    let rows: Vec<BatchRow> = (0..prompt.len()).map(|pos| BatchRow { seq: 0, pos }).collect();
    let started = Instant::now();
    let mut logits = m.model.forward(prompt, &rows, &mut kv, &[prompt.len() - 1]);
    let prefill = started.elapsed().as_secs_f64();
    let mut out = Vec::with_capacity(steps);
    let started = Instant::now();
    for i in 0..steps {
        let next = argmax(&logits);
        out.push(next);
        logits = m.model.forward(&[next], &[BatchRow { seq: 0, pos: prompt.len() + i }], &mut kv, &[0]);
    }
    (Timings { prefill, decode: started.elapsed().as_secs_f64() }, out)
}

fn argmax(v: &[f32]) -> u32 {
    v.iter().enumerate().fold((0, f32::NEG_INFINITY), |b, (i, &x)| if x > b.1 { (i, x) } else { b }).0 as u32
}

pub fn run(a: DecodeBenchArgs) -> anyhow::Result<()> {
    anyhow::ensure!(
        a.prompt_tokens > 0 && a.steps > 0 && a.rounds > 0,
        "--prompt-tokens, --steps and --rounds must be positive"
    );
    anyhow::ensure!(!a.cpu_activations.is_empty(), "--cpu-activations needs at least one precision");
    let mut labels = Vec::new();
    let mut models = Vec::new();
    for p in &a.models {
        for &act in &a.cpu_activations {
            let opts = crate::model::LoadOptions { cpu_activations: act, ..Default::default() };
            models.push(crate::model::load_with_options(p, &opts)?);
            labels.push(if a.cpu_activations.len() > 1 {
                format!("{} ({act})", p.display())
            } else {
                p.display().to_string()
            });
        }
    }
    let text = "To be, or not to be, that is the question: Whether 'tis nobler in the mind to suffer \
                The slings and arrows of outrageous fortune, Or to take arms against a sea of troubles";
    let (mut best_decode, mut best_prefill) = (vec![f64::MAX; models.len()], vec![f64::MAX; models.len()]);
    for round in 0..a.rounds {
        for (i, m) in models.iter().enumerate() {
            let mut prompt = m.tokenizer.encode(text, false).map_err(anyhow::Error::msg)?;
            prompt.resize(a.prompt_tokens, prompt[prompt.len() - 1]);
            let (t, _) = timed_decode(m, &prompt, a.steps);
            best_decode[i] = best_decode[i].min(t.decode);
            best_prefill[i] = best_prefill[i].min(t.prefill);
            eprintln!(
                "round {}/{}: {} prefill {:.1} tok/s, decode {:.1} tok/s",
                round + 1,
                a.rounds,
                labels[i],
                a.prompt_tokens as f64 / t.prefill,
                a.steps as f64 / t.decode
            );
        }
    }
    println!("{:<48} {:>12} {:>9} {:>13} {:>9}", "model", "decode tok/s", "vs first", "prefill tok/s", "vs first");
    for (i, label) in labels.iter().enumerate() {
        println!(
            "{:<48} {:>12.1} {:>8.2}x {:>13.1} {:>8.2}x",
            label,
            a.steps as f64 / best_decode[i],
            best_decode[0] / best_decode[i],
            a.prompt_tokens as f64 / best_prefill[i],
            best_prefill[0] / best_prefill[i]
        );
    }
    Ok(())
}
