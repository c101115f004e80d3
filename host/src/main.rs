//! `wasmserve` command line.

use std::io::Write;
use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::{Args, Parser, Subcommand};
use serde_json::{json, Value};

use wasmserve::chat_template::jinja::JinjaChatTemplate;
use wasmserve::chat_template::{ChatTemplate, ChatTemplateInput};
use wasmserve::generate::{generate, GenerateRequest};
use wasmserve::sampling::SamplingParams;

#[derive(Parser)]
#[command(name = "wasmserve", version, about = "LLM inference server with Wasm component plugins")]
struct Cli {
    /// Compute device: `cpu`, `cuda:0[,1..]` (one device per tensor-parallel rank) or `auto`
    /// (CUDA device 0 if usable, else the CPU, saying why). An unusable explicit CUDA device is an error (docs/cuda.md). `sim` runs the
    /// device forward on the CUDA-kernel simulator: for development and tests only (slow).
    #[arg(long, global = true, env = "WASMSERVE_DEVICE", default_value = "cpu", value_parser = wasmserve::backend::DeviceSpec::parse)]
    device: wasmserve::backend::DeviceSpec,
    /// How a device holds dense (unquantized) weights: `bfloat16` (bf16 GEMMs with bf16-rounded
    /// inputs, as bf16 serving engines run) or `float32` (f32 weights and GEMM inputs: the CPU
    /// forward's numbers to summation order, slower). The CPU forward always computes in f32.
    #[arg(long, global = true, env = "WASMSERVE_DTYPE", default_value = "bfloat16", value_parser = wasmserve::model::device::weights::DenseWeights::parse)]
    dtype: wasmserve::model::device::weights::DenseWeights,
    #[command(subcommand)]
    command: Command,
}

// Parsed once at start: boxing the serve arguments would save nothing that matters.
#[allow(clippy::large_enum_variant)]
#[derive(Subcommand)]
enum Command {
    /// Generate text for one prompt or chat, streamed to stdout.
    Generate(GenerateArgs),
    /// Serve the OpenAI-compatible HTTP API.
    Serve(wasmserve::server::ServeArgs),
    /// Benchmarks (progress on stderr, a result table on stdout).
    #[command(subcommand)]
    Bench(BenchCommand),
    /// Bytes per device for weights, cache per token and per sequence, and the longest context
    /// that fits, from config.json and the safetensors headers alone.
    Plan(wasmserve::plan::PlanArgs),
    /// Convert a BF16/F16/F32 checkpoint to INT (compressed-tensors) or Cubic, data-free.
    Quantize(wasmserve::quantize::QuantizeArgs),
    /// Manage tenants in the tenancy database (`serve --db`).
    #[command(subcommand)]
    Tenants(wasmserve::tenancy::cli::TenantsCommand),
    /// Manage API keys in the tenancy database (`serve --db`).
    #[command(subcommand)]
    Keys(wasmserve::tenancy::cli::KeysCommand),
}

#[derive(Subcommand)]
enum BenchCommand {
    /// Engine decode/prefill throughput and time to first token.
    Engine(BenchEngineArgs),
    /// Perplexity on a text file (fixed windows).
    Perplexity(wasmserve::perplexity::PerplexityArgs),
    /// Single-stream decode tok/s of several checkpoints side by side (e.g. dense vs INT4 vs Cubic).
    Decode(wasmserve::decode_bench::DecodeBenchArgs),
    /// MoE decode step cost vs bytes of active expert weights, against a dense layer of the same bytes.
    Moe(wasmserve::moe_bench::MoeBenchArgs),
}

#[derive(Args)]
struct BenchEngineArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Concurrent stream counts to measure.
    #[arg(long, value_delimiter = ',', default_value = "1,8,32,64")]
    concurrency: Vec<usize>,
    /// Decode steps timed per concurrency level.
    #[arg(long, default_value_t = 16)]
    steps: usize,
    #[arg(long, default_value_t = 256)]
    max_num_batched_tokens: usize,
    /// As `serve --kv-cache-dtype`: auto (bf16 for a device forward with --dtype bfloat16, else
    /// f32), f32, bf16 or fp8.
    #[arg(long, default_value = "auto", value_parser = wasmserve::engine::block_pool::KvCacheDtype::parse)]
    kv_cache_dtype: wasmserve::engine::block_pool::KvCacheDtype,
}

#[derive(Args)]
struct ModelArgs {
    /// A .gguf file or a Hugging Face model directory.
    #[arg(long, env = "WASMSERVE_MODEL", default_value = wasmserve::DEFAULT_MODEL_PATH)]
    model: PathBuf,
    /// Tensor-parallel ranks to split the model over (Llama, DeepSeek-V3, Kimi-Linear): one GPU
    /// each with `--device cuda:0,1,..` (NCCL between them), else simulated devices (threads).
    #[arg(long, default_value_t = 1)]
    tensor_parallel_size: usize,
    /// Expert-parallel ranks to split the routed experts over (DeepSeek-V3, Kimi-Linear): one GPU
    /// each with `--device cuda:0,1,..`, else simulated devices (threads).
    #[arg(long, default_value_t = 1)]
    expert_parallel_size: usize,
    /// How the CPU forward feeds 4- and 8-bit INT layers (GGUF Q4_0/Q4_1/Q8_0, compressed-tensors
    /// INT4/INT8): `f32` (exact to the dequantised weights) or `int8` (inputs quantised per 32
    /// values, integer dot products as llama.cpp: faster decode, slightly less accurate).
    #[arg(long, env = "WASMSERVE_CPU_ACTIVATIONS", default_value = "f32")]
    cpu_activations: wasmserve::model::activations::CpuActivations,
}

impl ModelArgs {
    /// Loads the model with the requested sharding (TP and EP together are not implemented yet).
    fn load(&self) -> Result<wasmserve::model::LoadedModel> {
        let opts = wasmserve::model::LoadOptions {
            tensor_parallel: self.tensor_parallel_size,
            expert_parallel: self.expert_parallel_size,
            cpu_activations: self.cpu_activations,
        };
        Ok(wasmserve::model::load_with_options(&self.model, &opts)?)
    }
}

#[derive(Args)]
struct GenerateArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Raw prompt text (no chat template).
    #[arg(long, conflicts_with_all = ["chat", "messages"])]
    prompt: Option<String>,
    /// A user message, rendered with the model's chat template.
    #[arg(long, conflicts_with = "messages")]
    chat: Option<String>,
    /// A JSON file with OpenAI-style messages, rendered with the model's chat template.
    #[arg(long)]
    messages: Option<PathBuf>,
    /// A system message to put before --chat.
    #[arg(long, requires = "chat")]
    system: Option<String>,
    #[arg(long, default_value_t = 128)]
    max_tokens: usize,
    /// 0 is greedy.
    #[arg(long, default_value_t = 0.0)]
    temperature: f32,
    #[arg(long, default_value_t = 0)]
    top_k: usize,
    #[arg(long, default_value_t = 1.0)]
    top_p: f32,
    #[arg(long, default_value_t = 0.0)]
    min_p: f32,
    #[arg(long, default_value_t = 1.0)]
    repetition_penalty: f32,
    #[arg(long, default_value_t = 0.0)]
    presence_penalty: f32,
    #[arg(long, default_value_t = 0.0)]
    frequency_penalty: f32,
    #[arg(long)]
    seed: Option<u64>,
    /// Stop string (repeatable).
    #[arg(long)]
    stop: Vec<String>,
    #[arg(long)]
    ignore_eos: bool,
    /// As `serve --kv-cache-dtype`: auto (bf16 for a device forward with --dtype bfloat16, else
    /// f32), f32, bf16 or fp8. Applies to a device model; the CPU's single-request cache is f32.
    #[arg(long, default_value = "auto", value_parser = wasmserve::engine::block_pool::KvCacheDtype::parse)]
    kv_cache_dtype: wasmserve::engine::block_pool::KvCacheDtype,
}

fn main() -> Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()))
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    let selected = wasmserve::backend::select(&cli.device).map_err(anyhow::Error::msg)?;
    tracing::info!(device = %cli.device, backends = %selected.describe(), "compute device");
    let on_device = cli.device != wasmserve::backend::DeviceSpec::Cpu && selected.fallback_reason.is_none();
    if on_device
        && !matches!(cli.command, Command::Serve(_) | Command::Generate(_) | Command::Bench(BenchCommand::Engine(_)))
    {
        // `bench decode` and `bench perplexity` measure the CPU forward with a contiguous host
        // cache, so say so rather than imply GPU work.
        tracing::warn!("this command's forward runs on the CPU; `serve`, `generate` and `bench engine` run a model's forward on the device");
    }
    match cli.command {
        Command::Generate(args) => run_generate(args, &cli.device, cli.dtype),
        Command::Serve(args) => wasmserve::server::run_on(args, &cli.device, cli.dtype),
        Command::Bench(BenchCommand::Engine(args)) => run_bench_engine(args, &cli.device, cli.dtype),
        Command::Bench(BenchCommand::Perplexity(args)) => wasmserve::perplexity::run(args),
        Command::Bench(BenchCommand::Decode(args)) => wasmserve::decode_bench::run(args),
        Command::Bench(BenchCommand::Moe(args)) => wasmserve::moe_bench::run(args),
        Command::Quantize(args) => wasmserve::quantize::run(args),
        Command::Plan(args) => wasmserve::plan::run(args),
        Command::Tenants(cmd) => wasmserve::tenancy::cli::tenants(cmd),
        Command::Keys(cmd) => wasmserve::tenancy::cli::keys(cmd),
    }
}

fn run_generate(
    a: GenerateArgs,
    device: &wasmserve::backend::DeviceSpec,
    dense: wasmserve::model::device::weights::DenseWeights,
) -> Result<()> {
    let m = wasmserve::backend::place_model(a.model.load()?, device, dense).map_err(anyhow::Error::msg)?;
    let on_device = m.model.device_kv().is_some();
    let kv_dtype = a.kv_cache_dtype.resolve(on_device, dense);
    if !on_device && kv_dtype != wasmserve::engine::block_pool::KvDtype::F32 {
        tracing::warn!("`generate` keeps a CPU model's K/V in an f32 cache; --kv-cache-dtype {kv_dtype:?} applies to `serve` and device models");
    }
    let prompt = if let Some(p) = &a.prompt {
        p.clone()
    } else {
        let messages: Vec<Value> = if let Some(path) = &a.messages {
            let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
            serde_json::from_str(&text)
                .with_context(|| format!("{}: expected a JSON array of messages", path.display()))?
        } else if let Some(user) = &a.chat {
            let mut v = Vec::new();
            if let Some(s) = &a.system {
                v.push(json!({"role": "system", "content": s}));
            }
            v.push(json!({"role": "user", "content": user}));
            v
        } else {
            bail!("give --prompt, --chat or --messages");
        };
        let source = m.tokenizer.chat_template.as_deref().context("the model has no chat template; use --prompt")?;
        let tmpl = JinjaChatTemplate::new(source, m.tokenizer.bos_token.as_deref(), m.tokenizer.eos_token.as_deref())
            .map_err(anyhow::Error::msg)?;
        tmpl.render(&ChatTemplateInput { messages, add_generation_prompt: true, ..Default::default() })
            .map_err(anyhow::Error::msg)?
    };
    let prompt_ids = m.tokenizer.encode(&prompt, true).map_err(anyhow::Error::msg)?;
    let req = GenerateRequest {
        prompt_ids,
        sampling: SamplingParams {
            temperature: a.temperature,
            top_k: a.top_k,
            top_p: a.top_p,
            min_p: a.min_p,
            repetition_penalty: a.repetition_penalty,
            presence_penalty: a.presence_penalty,
            frequency_penalty: a.frequency_penalty,
            seed: a.seed,
            ..Default::default()
        },
        max_tokens: a.max_tokens,
        stop: a.stop,
        ignore_eos: a.ignore_eos,
        kv_dtype,
    };
    let mut stdout = std::io::stdout();
    let out = generate(&m, &req, |t| {
        let _ = stdout.write_all(t.as_bytes());
        let _ = stdout.flush();
    })
    .map_err(anyhow::Error::msg)?;
    println!();
    eprintln!(
        "[{} prompt tokens, {} generated, finish={}, prefill {:.1} tok/s, decode {:.1} tok/s]",
        req.prompt_ids.len(),
        out.tokens.len(),
        out.finish_reason.as_str(),
        req.prompt_ids.len() as f64 / out.prefill_time.as_secs_f64().max(1e-9),
        out.decode_tokens_per_sec()
    );
    Ok(())
}

fn run_bench_engine(
    a: BenchEngineArgs,
    device: &wasmserve::backend::DeviceSpec,
    dense: wasmserve::model::device::weights::DenseWeights,
) -> Result<()> {
    let model = std::sync::Arc::new(
        wasmserve::backend::place_model(a.model.load()?, device, dense).map_err(anyhow::Error::msg)?,
    );
    let max_streams = a.concurrency.iter().copied().max().unwrap_or(1);
    let kv_dtype = a.kv_cache_dtype.resolve(model.model.device_kv().is_some(), dense);
    let cfg = wasmserve::engine::EngineConfig {
        max_num_seqs: max_streams.max(64),
        max_num_batched_tokens: a.max_num_batched_tokens.max(max_streams),
        kv_dtype,
        ..Default::default()
    };
    eprintln!(
        "bench: dot kernel {}, {} threads, KV cache {kv_dtype:?}",
        kernels::cpu::dot::dot_impl_name(),
        rayon::current_num_threads()
    );
    let report = wasmserve::bench::run_engine_bench(model, cfg, &a.concurrency, a.steps).map_err(anyhow::Error::msg)?;
    report.print();
    Ok(())
}
