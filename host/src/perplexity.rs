//! Perplexity of a model on a text: non-overlapping windows of `ctx` tokens, each token after
//! the first of a window predicted from the window's earlier tokens (the usual fixed-window
//! evaluation; windows do not see each other, so results do not depend on batching).

use crate::model::kv::{BatchRow, ContiguousKvCache};
use crate::model::LoadedModel;

pub struct Perplexity {
    pub nll: f64,
    pub predicted: usize,
    pub windows: usize,
}

impl Perplexity {
    pub fn value(&self) -> f64 {
        (self.nll / self.predicted.max(1) as f64).exp()
    }
}

/// Mean next-token negative log-likelihood over up to `max_windows` windows of `tokens`.
pub fn perplexity(
    m: &LoadedModel,
    tokens: &[u32],
    ctx: usize,
    max_windows: usize,
    mut progress: impl FnMut(usize, f64),
) -> Perplexity {
    let cfg = m.config();
    let vocab = cfg.vocab_size;
    let mut r = Perplexity { nll: 0.0, predicted: 0, windows: 0 };
    for window in tokens.chunks_exact(ctx).take(max_windows) {
        let rows: Vec<BatchRow> = (0..ctx).map(|pos| BatchRow { seq: 0, pos }).collect();
        let logit_rows: Vec<usize> = (0..ctx - 1).collect();
        let mut kv = ContiguousKvCache::for_layout(&m.model.cache_layout(), 1);
        let logits = m.model.forward(window, &rows, &mut kv, &logit_rows);
        for (p, row) in logits.chunks_exact(vocab).enumerate() {
            let max = row.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b)) as f64;
            let lse = max + row.iter().map(|&v| (v as f64 - max).exp()).sum::<f64>().ln();
            r.nll += lse - row[window[p + 1] as usize] as f64;
            r.predicted += 1;
        }
        r.windows += 1;
        progress(r.windows, r.value());
    }
    r
}

#[derive(clap::Args)]
pub struct PerplexityArgs {
    /// A .gguf file or a Hugging Face model directory.
    #[arg(long)]
    pub model: std::path::PathBuf,
    /// UTF-8 text file to evaluate on.
    #[arg(long)]
    pub text: std::path::PathBuf,
    /// Tokens per window.
    #[arg(long, default_value_t = 512)]
    pub ctx: usize,
    /// Windows evaluated (from the start of the text).
    #[arg(long, default_value_t = 32)]
    pub windows: usize,
    /// As `serve --cpu-activations`: `f32` or `int8`.
    #[arg(long, default_value = "f32")]
    pub cpu_activations: crate::model::activations::CpuActivations,
}

/// `wasmserve bench perplexity`: prints `model  tokens  ppl` on stdout.
pub fn run(a: PerplexityArgs) -> anyhow::Result<()> {
    let m = crate::model::load_with_options(
        &a.model,
        &crate::model::LoadOptions { cpu_activations: a.cpu_activations, ..Default::default() },
    )?;
    let text = std::fs::read_to_string(&a.text)?;
    let tokens = m.tokenizer.encode(&text, false).map_err(anyhow::Error::msg)?;
    anyhow::ensure!(tokens.len() >= a.ctx, "{} has only {} tokens", a.text.display(), tokens.len());
    let started = std::time::Instant::now();
    let r = perplexity(&m, &tokens, a.ctx, a.windows, |w, p| eprint!("\rwindow {w}/{}: ppl {p:.3}   ", a.windows));
    eprintln!();
    println!(
        "{} ({})\t{} tokens\tppl {:.4}\t({:.0} tok/s)",
        a.model.display(),
        a.cpu_activations,
        r.predicted,
        r.value(),
        (r.windows * a.ctx) as f64 / started.elapsed().as_secs_f64()
    );
    Ok(())
}
