//! The OpenAI-compatible HTTP server (`wasmserve serve`): axum on hyper + tokio, in front of the
//! engine thread.
//!
//! Shutdown: the first SIGTERM/SIGINT stops new generation work (503) while in-flight requests
//! and streams run to completion, then the listener closes; a second signal exits at once.

pub mod admin;
pub mod admission;
pub mod blocking;
pub mod chat;
pub mod completions;
pub mod error;
pub mod extract;
mod forced_call_stream;
pub mod generation;
mod listener;
pub mod logprobs;
mod memory;
pub mod metrics;
pub mod openai;
pub mod routes;
pub mod sse;
pub mod state;
mod structured;
pub mod tenancy;
mod token_ids;
mod tool_choice;
pub mod vllm_flags;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use clap::Args;

use crate::chat_template::jinja::JinjaChatTemplate;
use crate::chat_template::ChatTemplate;
use crate::engine::block_pool::{KvCacheDtype, KvDtype};
use crate::engine::{Engine, EngineConfig};
use state::{AppState, ServerState};

#[derive(Args, Debug, Clone)]
pub struct ServeArgs {
    /// The model, as `vllm serve MODEL` takes it (the same as --model).
    #[arg(value_name = "MODEL")]
    pub model_positional: Option<PathBuf>,
    /// A .gguf file or a Hugging Face model directory (default: the model scripts/fetch-default-model fetches).
    #[arg(long, env = "WASMSERVE_MODEL")]
    pub model: Option<PathBuf>,
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// 0 picks a free port (the bound address is logged).
    #[arg(long, default_value_t = 8000)]
    pub port: u16,
    /// When set, /v1 and tokenizer endpoints require `Authorization: Bearer <key>`.
    #[arg(long, env = "WASMSERVE_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
    /// Tenancy database (SQLite, created and migrated on start): per-tenant API keys, limits and
    /// usage accounting. Replaces --api-key.
    #[arg(long, env = "WASMSERVE_DB")]
    pub db: Option<PathBuf>,
    /// Key for the /admin API (with --db).
    #[arg(long, env = "WASMSERVE_ADMIN_KEY", hide_env_values = true)]
    pub admin_key: Option<String>,
    /// Plugin deployments to load at start (JSON: `{"plugins": [...]}`, see README).
    #[arg(long, env = "WASMSERVE_PLUGINS")]
    pub plugins: Option<PathBuf>,
    /// Reasoning parser, as vLLM's flag: `auto` (picked from the model name and chat template),
    /// `none`, or deepseek_r1 / qwen3 / kimi_k2 / kimi_k3.
    #[arg(long, env = "WASMSERVE_REASONING_PARSER", default_value = "auto", value_parser = crate::plugins::defaults::Choice::parse)]
    pub reasoning_parser: crate::plugins::defaults::Choice,
    /// Tool-call parser, as vLLM's flag: `auto`, `none`, or hermes / kimi_k2 / kimi_k3 / qwen3_coder / qwen3_xml.
    #[arg(long, env = "WASMSERVE_TOOL_CALL_PARSER", default_value = "auto", value_parser = crate::plugins::defaults::Choice::parse)]
    pub tool_call_parser: crate::plugins::defaults::Choice,
    /// Directory of the built parser components (default: target/plugins beside the binary's directory, else ./target/plugins).
    #[arg(long, env = "WASMSERVE_PLUGIN_DIR")]
    pub plugin_dir: Option<PathBuf>,
    /// Where compiled plugin code is cached across restarts.
    #[arg(long, env = "WASMSERVE_PLUGIN_CACHE_DIR")]
    pub plugin_cache_dir: Option<PathBuf>,
    /// HMAC secret for API key hashes (default: a random one stored in the database).
    #[arg(long, env = "WASMSERVE_KEY_SECRET", hide_env_values = true)]
    pub key_secret: Option<String>,
    /// The model id clients use (default: the model file stem or directory name); as vLLM, more
    /// than one name are aliases: requests may use any, responses and listings carry the first.
    #[arg(long, num_args = 1..)]
    pub served_model_name: Vec<String>,
    /// Tensor-parallel ranks the model is split over: one GPU each with `--device cuda:0,1,..`
    /// (a Llama, NCCL between them), else simulated devices (one thread each). Heads and KV heads
    /// must divide (KV heads may instead be a divisor of it, then replicated).
    #[arg(long, default_value_t = 1)]
    pub tensor_parallel_size: usize,
    /// Expert-parallel ranks the routed experts are split over (DeepSeek-V3, Kimi-Linear): one GPU
    /// each with `--device cuda:0,1,..`, else simulated devices (threads). Not with
    /// `--tensor-parallel-size` above 1.
    #[arg(long, default_value_t = 1)]
    pub expert_parallel_size: usize,
    /// How the CPU forward feeds 4- and 8-bit INT layers (GGUF Q4_0/Q4_1/Q8_0, compressed-tensors
    /// INT4/INT8): `f32` (exact to the dequantised weights) or `int8` (inputs quantised per 32
    /// values, integer dot products as llama.cpp: faster decode, slightly less accurate).
    #[arg(long, env = "WASMSERVE_CPU_ACTIVATIONS", default_value = "f32")]
    pub cpu_activations: crate::model::activations::CpuActivations,
    /// `vllm serve`'s flags (server/vllm_flags.rs).
    #[command(flatten)]
    pub vllm: vllm_flags::VllmFlags,
    #[arg(long, default_value_t = 64)]
    pub max_num_seqs: usize,
    #[arg(long, default_value_t = 256)]
    pub max_num_batched_tokens: usize,
    /// While requests wait for admission, a running prompt's chunk is capped at this many tokens
    /// (vLLM's name), so a long prompt cannot hold back a newcomer's first token for its whole
    /// prefill; 0 = half of --max-num-batched-tokens.
    #[arg(long, default_value_t = 0)]
    pub long_prefill_token_threshold: usize,
    /// KV cache size: bytes, or with a suffix (512MiB, 2GiB, 1GB, ...).
    #[arg(long, default_value = "1GiB", value_parser = parse_size)]
    pub kv_cache_memory: usize,
    /// auto (bf16 for a device forward with --dtype bfloat16, else f32: the dtype the forward
    /// computes in), f32, bf16 (half the memory, 8 mantissa bits) or fp8 (E4M3 with a scale per
    /// head and token: a quarter of f32's memory).
    #[arg(long, default_value = "auto", value_parser = KvCacheDtype::parse)]
    pub kv_cache_dtype: KvCacheDtype,
    /// Tokens per KV cache block.
    #[arg(long, default_value_t = 16)]
    pub block_size: usize,
    /// Requests waiting for admission beyond which new ones get 429.
    #[arg(long, default_value_t = 1024)]
    pub max_queue: usize,
    #[arg(long)]
    pub no_prefix_caching: bool,
    /// Largest accepted request body (bytes or with a suffix); larger ones get 413.
    #[arg(long, default_value = "8MiB", value_parser = parse_size)]
    pub max_body_bytes: usize,
    /// Seconds a stream may wait for its client to read the next event before the request is
    /// aborted (its plugin instances and concurrency slot freed); 0 waits forever.
    #[arg(long, default_value_t = state::DEFAULT_STREAM_STALL_SECS)]
    pub stream_stall_timeout: f64,
    /// Seconds to let in-flight requests finish after SIGTERM before closing anyway.
    #[arg(long, default_value_t = 60)]
    pub shutdown_timeout: u64,
    /// Seconds a connection may take to send a request's headers; also how long an idle
    /// keep-alive connection (or one that never sends anything) stays open.
    #[arg(long, default_value_t = 10.0)]
    pub header_read_timeout: f64,
    /// Seconds a request body may take to arrive in full (a 408 after that).
    #[arg(long, default_value_t = 30.0)]
    pub body_read_timeout: f64,
    /// Blocking threads Wasm plugin calls (policies, parsers) run on at once, off the HTTP
    /// server's async workers; more calls wait for one. 0: one per CPU (guest code is CPU-bound,
    /// so more threads than cores only add latency to everything else).
    #[arg(long, default_value_t = 0)]
    pub plugin_threads: usize,
    /// Prompt text (bytes, or with a suffix) being rendered or tokenized at once; larger bodies
    /// wait their turn.
    #[arg(long, default_value = "64MiB", value_parser = parse_size)]
    pub max_pending_prompt_bytes: usize,
    /// Open connections in all; more are closed at once.
    #[arg(long, default_value_t = 2048)]
    pub max_connections: usize,
    /// Open connections from one client address; more are closed at once.
    #[arg(long, default_value_t = 512)]
    pub max_connections_per_client: usize,
}

/// `1024`, `512KiB`, `512MiB`, `2GiB`, `1GB`, `1.5GiB` (case-insensitive; `K`/`M`/`G` are binary).
pub fn parse_size(s: &str) -> Result<usize, String> {
    let t = s.trim();
    let split = t.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let num: f64 = num.parse().map_err(|_| format!("'{s}' is not a size (e.g. 1073741824, 512MiB, 2GiB)"))?;
    let mult: f64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "k" | "kib" => 1024.0,
        "m" | "mib" => 1024.0 * 1024.0,
        "g" | "gib" => 1024.0 * 1024.0 * 1024.0,
        "kb" => 1e3,
        "mb" => 1e6,
        "gb" => 1e9,
        u => return Err(format!("unknown size unit '{u}' in '{s}' (use KiB, MiB, GiB, KB, MB, GB)")),
    };
    let v = num * mult;
    if !v.is_finite() || v < 1.0 || v > usize::MAX as f64 {
        return Err(format!("size '{s}' is out of range"));
    }
    Ok(v as usize)
}

impl ServeArgs {
    /// The model to serve: the positional path, --model, or the default model.
    pub fn model_path(&self) -> Result<PathBuf> {
        let flag = self.model.clone().unwrap_or_else(|| PathBuf::from(crate::DEFAULT_MODEL_PATH));
        vllm_flags::model_path(self.model_positional.as_ref(), &flag, self.model.is_some())
    }

    /// The engine's configuration, the KV cache's `auto` dtype resolved to `kv_dtype`.
    pub fn engine_config(&self, kv_dtype: KvDtype) -> EngineConfig {
        EngineConfig {
            block_size: self.block_size,
            kv_cache_bytes: self.kv_cache_memory,
            kv_dtype,
            max_num_seqs: self.max_num_seqs,
            max_num_batched_tokens: self.max_num_batched_tokens,
            long_prefill_token_threshold: self.long_prefill_token_threshold,
            max_waiting: self.max_queue,
            enable_prefix_caching: !self.no_prefix_caching && !self.vllm.no_enable_prefix_caching,
            // With tenants, one eighth of the batch slots (at least one) stays out of reach of
            // any single tenant, so a newcomer never waits behind a flood for a slot.
            tenant_slot_reserve: if self.db.is_some() { (self.max_num_seqs / 8).max(1) } else { 0 },
            ..EngineConfig::default()
        }
    }
}

/// Loads the model, starts the engine and serves until a shutdown signal (forward on the CPU).
pub fn run(args: ServeArgs) -> Result<()> {
    run_on(args, &crate::backend::DeviceSpec::Cpu, crate::model::device::weights::DenseWeights::Bf16)
}

/// [`run`] with the model's forward placed by `--device` (`backend::place_model`: a Llama on a
/// CUDA device runs the device forward with its K/V in device memory).
pub fn run_on(
    args: ServeArgs,
    device: &crate::backend::DeviceSpec,
    dense: crate::model::device::weights::DenseWeights,
) -> Result<()> {
    memory::configure_allocator();
    if args.block_size == 0 || args.max_num_seqs == 0 || args.max_num_batched_tokens == 0 {
        bail!("--block-size, --max-num-seqs and --max-num-batched-tokens must be at least 1");
    }
    let model_path = args.model_path()?;
    if !model_path.exists() {
        bail!(
            "model {} not found (run scripts/fetch-default-model for the default model, or pass --model)",
            model_path.display()
        );
    }
    args.vllm.check(&model_path)?;
    // Built before the model loads, so a bad CORS flag fails at once.
    let cors = vllm_flags::cors_layer(&args.vllm)?;
    let max_model_len = match &args.vllm.max_model_len {
        Some(s) => vllm_flags::parse_max_model_len(s)?,
        None => None,
    };
    if args.db.is_some() && args.api_key.is_some() {
        bail!("--api-key and --db exclude each other: with --db, keys are created with `wasmserve keys create`");
    }
    let tenancy = match &args.db {
        Some(path) => Some(crate::tenancy::Tenancy::open(path, args.admin_key.as_deref(), args.key_secret.as_deref())?),
        None => None,
    };
    let mut cpu_activations = args.cpu_activations;
    if vllm_flags::cubic_dynamic_a8() {
        tracing::info!("VLLM_CUBIC_DYNAMIC_A8: Cubic layers multiply in dynamic-A8 mode (int8 activations)");
        cpu_activations = crate::model::activations::CpuActivations::Int8;
    }
    let opts = crate::model::LoadOptions {
        tensor_parallel: args.tensor_parallel_size,
        expert_parallel: args.expert_parallel_size,
        cpu_activations,
    };
    let model = crate::model::load_with_options(&model_path, &opts)
        .with_context(|| format!("loading {}", model_path.display()))?;
    if let Some(want) = max_model_len {
        let most = model.config().max_position_embeddings;
        if want > most {
            bail!("--max-model-len {want} exceeds the model's maximum of {most} positions");
        }
    }
    let model = Arc::new(crate::backend::place_model(model, device, dense).map_err(anyhow::Error::msg)?);
    let template: Option<Arc<dyn ChatTemplate>> = match model.tokenizer.chat_template.as_deref() {
        None => {
            tracing::warn!("the model has no chat template: /v1/chat/completions will answer 400");
            None
        }
        Some(src) => match JinjaChatTemplate::new(
            src,
            model.tokenizer.bos_token.as_deref(),
            model.tokenizer.eos_token.as_deref(),
        ) {
            Ok(t) => Some(Arc::new(t)),
            Err(e) => {
                tracing::warn!(error = %e, "the model's chat template does not compile: /v1/chat/completions will answer 400");
                None
            }
        },
    };
    let name = args.served_model_name.first().cloned().unwrap_or_else(|| model.name.clone());
    let aliases: Vec<String> = args.served_model_name.iter().skip(1).cloned().collect();
    let kv_dtype = args.kv_cache_dtype.resolve(model.model.device_kv().is_some(), dense);
    tracing::info!(kv_cache_dtype = ?kv_dtype, "KV cache dtype ({:?} asked)", args.kv_cache_dtype);
    let mut cfg = args.engine_config(kv_dtype);
    cfg.max_model_len = max_model_len;
    if let Some(u) = args.vllm.gpu_memory_utilization {
        if model.model.device_kv().is_some() {
            bail!("--gpu-memory-utilization with a device forward is not implemented yet: size the KV cache with --kv-cache-memory");
        }
        cfg.kv_cache_bytes = vllm_flags::host_kv_bytes(u)?;
        tracing::info!(
            gpu_memory_utilization = u,
            kv_cache_bytes = cfg.kv_cache_bytes,
            "KV cache sized from host memory"
        );
    }
    let engine = Engine::try_start(model, cfg).map_err(anyhow::Error::msg)?;
    let mut state = ServerState::new(engine.clone(), template, name, args.api_key.clone(), args.max_body_bytes);
    state.tenancy = tenancy;
    state.model_aliases = aliases;
    state.stream_stall_timeout = stall_timeout(args.stream_stall_timeout)?;
    state.body_read_timeout = positive_secs("--body-read-timeout", args.body_read_timeout)?;
    let plugin_threads = match args.plugin_threads {
        0 => std::thread::available_parallelism().map_or(2, |n| n.get()),
        n => n,
    };
    state.plugin_calls = blocking::PluginCalls::new(plugin_threads);
    state.prompt_work = blocking::PromptWork::new(args.max_pending_prompt_bytes);
    let plugins = crate::plugins::registry::Registry::new(crate::plugins::Runtime::new(args.plugin_cache_dir.clone())?);
    plugins.set_admin_key(args.admin_key.clone());
    if let Some(src) = state.model.tokenizer.chat_template.as_deref() {
        plugins.set_model_template(
            src,
            state.model.tokenizer.bos_token.as_deref(),
            state.model.tokenizer.eos_token.as_deref(),
        );
    }
    if let Some(path) = &args.plugins {
        let n = plugins.load_config(path).map_err(anyhow::Error::msg)?;
        tracing::info!(plugins = n, config = %path.display(), "plugins deployed");
    }
    // Both names: --served-model-name may hide the family the file name tells.
    let names = format!("{} {}", state.served_model_name, state.model.name);
    deploy_default_parsers(&plugins, &args, &names, state.model.tokenizer.chat_template.as_deref())?;
    let plugins = Arc::new(plugins);
    // A chat-template plugin for this model replaces the native renderer.
    if let Some(name) = plugins.template_for(&state.served_model_name) {
        tracing::info!(plugin = %name, "chat template rendered by a Wasm plugin");
        state.template = Some(Arc::new(crate::plugins::template::WasmChatTemplate { registry: plugins.clone(), name }));
    }
    state.plugins = Some(plugins);
    let state = Arc::new(state);
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().thread_name("http").build()?;
    let result = rt.block_on(serve(state, &args, cors));
    engine.stop();
    result
}

/// A timeout flag that must be a positive number of seconds.
fn positive_secs(flag: &str, secs: f64) -> Result<Duration> {
    if !secs.is_finite() || secs <= 0.0 || secs > 1e9 {
        bail!("{flag} must be a positive number of seconds (got {secs})");
    }
    Ok(Duration::from_secs_f64(secs))
}

fn stall_timeout(secs: f64) -> Result<Option<Duration>> {
    if !secs.is_finite() || secs < 0.0 {
        bail!("--stream-stall-timeout must be a number of seconds, 0 or more (got {secs})");
    }
    Ok((secs > 0.0).then(|| Duration::from_secs_f64(secs)))
}

/// `--reasoning-parser` / `--tool-call-parser` (default `auto`: the model's usual parsers).
fn deploy_default_parsers(
    reg: &crate::plugins::registry::Registry,
    args: &ServeArgs,
    model: &str,
    template: Option<&str>,
) -> Result<()> {
    use crate::plugins::defaults;
    let detected = defaults::detect(model, template);
    let configured = |k| reg.list().iter().any(|d| d.spec.kind == k);
    let planned = defaults::plan(&args.reasoning_parser, &args.tool_call_parser, detected, configured)
        .map_err(anyhow::Error::msg)?;
    defaults::deploy(reg, &planned, &defaults::plugin_dir(args.plugin_dir.as_deref())).map_err(anyhow::Error::msg)
}

async fn serve(state: AppState, args: &ServeArgs, cors: Option<tower_http::cors::CorsLayer>) -> Result<()> {
    let addr: SocketAddr = tokio::net::lookup_host((args.host.as_str(), args.port))
        .await
        .with_context(|| format!("resolving --host {}", args.host))?
        .next()
        .with_context(|| format!("--host {} resolves to no address", args.host))?;
    let listener = tokio::net::TcpListener::bind(addr).await.with_context(|| format!("binding {addr}"))?;
    let bound = listener.local_addr()?;
    tracing::info!(model = %state.served_model_name, max_model_len = state.engine.max_model_len(), "listening on http://{bound}");
    if args.max_connections == 0 || args.max_connections_per_client == 0 {
        bail!("--max-connections and --max-connections-per-client must be at least 1");
    }
    let limits = listener::ConnectionLimits {
        max_total: args.max_connections,
        max_per_client: args.max_connections_per_client,
        header_read_timeout: positive_secs("--header-read-timeout", args.header_read_timeout)?,
    };
    let mut app = routes::router(state.clone());
    if let Some(cors) = cors {
        tracing::info!(origins = args.vllm.allowed_origins.as_deref().unwrap_or(""), "CORS on");
        app = app.layer(cors);
    }
    let counted = state.clone();
    let refused = move || {
        counted.metrics.refused_connections.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    };
    let drain = drain_on_signal(state, Duration::from_secs(args.shutdown_timeout));
    listener::serve(listener, app, limits, refused, drain).await;
    tracing::info!("server stopped");
    Ok(())
}

/// Resolves when the listener should close: after a signal, once in-flight work has drained.
async fn drain_on_signal(state: AppState, timeout: Duration) {
    wait_for_signal().await;
    tracing::info!(in_flight = state.in_flight(), "shutdown signal: refusing new requests, draining in-flight ones");
    state.begin_shutdown();
    tokio::spawn(async {
        wait_for_signal().await;
        tracing::warn!("second shutdown signal: exiting now");
        std::process::exit(130);
    });
    if tokio::time::timeout(timeout, state.wait_drained()).await.is_err() {
        tracing::warn!(in_flight = state.in_flight(), "shutdown timeout: closing with requests still in flight");
    }
}

async fn wait_for_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        let mut term = signal(SignalKind::terminate()).expect("installing the SIGTERM handler");
        let mut int = signal(SignalKind::interrupt()).expect("installing the SIGINT handler");
        tokio::select! {
            _ = term.recv() => {}
            _ = int.recv() => {}
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}

#[cfg(test)]
mod tests {
    use super::parse_size;

    #[test]
    fn sizes_parse_with_and_without_suffixes() {
        assert_eq!(parse_size("1024"), Ok(1024));
        assert_eq!(parse_size("512MiB"), Ok(512 << 20));
        assert_eq!(parse_size("2GiB"), Ok(2 << 30));
        assert_eq!(parse_size("2g"), Ok(2 << 30));
        assert_eq!(parse_size("1GB"), Ok(1_000_000_000));
        assert_eq!(parse_size("1.5KiB"), Ok(1536));
        assert!(parse_size("abc").is_err());
        assert!(parse_size("12XB").is_err());
    }
}
