//! `wasmserve plan`: what a checkpoint needs per device, from `config.json` and the safetensors
//! headers alone (no weight is read): weight bytes per device as this server places them, the
//! cache per token (K/V or MLA latent rows) and per sequence (KDA recurrent state), and the
//! longest context that fits beside the weights.
//!
//! Placement follows the loaders: routed experts split by expert over the ranks (expert parallel,
//! and the MoE layers of a tensor-parallel Kimi/DeepSeek model); with tensor parallelism the
//! attention heads split (KDA: all its projections, convolutions and gates; MLA: everything but
//! the shared latent path `q_a_proj`, `kv_a_proj_with_mqa` and their norms), Llama's attention,
//! MLP and vocabulary too; everything else is replicated on every device. Weights are counted
//! as stored (a device keeps dense weights in bf16 and quantized ones packed; the CPU widens
//! bf16 to f32, which the "CPU" line shows). Vision-tower tensors are listed apart: not served.

use std::collections::BTreeMap;
use std::io::Read;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use clap::Args;
use serde_json::Value;

use crate::model::config::{Architecture, ModelConfig};
use crate::model::layers::kda::plan::{layer_plan, MixerKind};
use crate::model::layers::kda::state::SequenceState;
use crate::model::layers::kda::KdaConfig;
use crate::model::layers::mla::MlaConfig;
use crate::model::layers::moe::expert_parallel::experts_of;
use crate::model::layers::moe::MoeConfig;

#[derive(Args, Debug)]
pub struct PlanArgs {
    /// A Hugging Face model directory (config.json + safetensors; only their headers are read).
    #[arg(long)]
    pub model: PathBuf,
    /// Tensor-parallel ranks (one device each).
    #[arg(long, default_value_t = 1)]
    pub tensor_parallel_size: usize,
    /// Expert-parallel ranks (one device each; with --tensor-parallel-size 1).
    #[arg(long, default_value_t = 1)]
    pub expert_parallel_size: usize,
    /// Memory of one device in GB (10^9 bytes); 141 is an H200.
    #[arg(long, default_value_t = 141.0)]
    pub device_memory_gb: f64,
    /// Fraction of a device's memory the server may use (vLLM's --gpu-memory-utilization).
    #[arg(long, default_value_t = 0.9)]
    pub gpu_memory_utilization: f64,
    /// Bytes per cached K/V or latent value: bfloat16 (2), fp8 (1) or float32 (4).
    #[arg(long, default_value = "bfloat16")]
    pub kv_cache_dtype: String,
    /// Context length for the "sequences that fit" line (default: the config's maximum).
    #[arg(long)]
    pub max_model_len: Option<usize>,
    /// Print the plan as JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// One tensor as a safetensors header describes it.
#[derive(Clone, Debug, PartialEq)]
pub struct HeaderTensor {
    pub name: String,
    pub dtype: String,
    pub bytes: u64,
}

/// The tensors of every shard of `dir` (`hf_source::shard_paths`: as the loader finds them),
/// reading only the headers.
pub fn read_headers(dir: &Path) -> Result<Vec<HeaderTensor>> {
    let mut out = Vec::new();
    for path in crate::model::format::hf_source::shard_paths(dir)? {
        let mut f = std::fs::File::open(&path).with_context(|| path.display().to_string())?;
        let mut len = [0u8; 8];
        f.read_exact(&mut len).with_context(|| format!("{}: no safetensors header", path.display()))?;
        let len = u64::from_le_bytes(len);
        // The format caps headers at 100 MB; a larger length is a corrupt file, not a reason to
        // allocate it.
        if len > 100_000_000 {
            bail!("{}: header length {len} is not plausible", path.display());
        }
        let mut header = vec![0u8; len as usize];
        f.read_exact(&mut header).with_context(|| format!("{}: truncated header", path.display()))?;
        let header: BTreeMap<String, Value> = serde_json::from_slice(&header)
            .with_context(|| format!("{}: header is not a JSON object", path.display()))?;
        for (name, info) in header {
            if name == "__metadata__" {
                continue;
            }
            let offsets = info.get("data_offsets").and_then(Value::as_array);
            let (start, end) =
                match offsets.map(|o| (o.first().and_then(Value::as_u64), o.get(1).and_then(Value::as_u64))) {
                    Some((Some(s), Some(e))) if e >= s => (s, e),
                    _ => bail!("{}: tensor '{name}' has no valid data_offsets", path.display()),
                };
            let dtype = info.get("dtype").and_then(Value::as_str).unwrap_or("?").to_string();
            out.push(HeaderTensor { name, dtype, bytes: end - start });
        }
    }
    Ok(out)
}

/// Where a tensor lives when the model runs on `ranks` devices.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Placement {
    /// On every device.
    Replicated,
    /// Cut evenly over the devices (tensor-parallel heads, vocabulary).
    Split,
    /// Routed expert `e`: on the device owning it.
    Expert(usize),
    /// Not loaded (the vision tower).
    NotServed,
}

fn placement(arch: Architecture, name: &str, tp: bool) -> Placement {
    if name.starts_with("vision_tower.") || name.starts_with("mm_projector.") {
        return Placement::NotServed;
    }
    let name = name.strip_prefix("language_model.").unwrap_or(name);
    if let Some((_, rest)) = name.split_once(".experts.") {
        if let Some(e) = rest.split('.').next().and_then(|e| e.parse::<usize>().ok()) {
            return Placement::Expert(e);
        }
    }
    if !tp {
        return Placement::Replicated;
    }
    let split = match arch {
        Architecture::Llama => {
            name.contains(".self_attn.")
                || name.contains(".mlp.")
                || name.starts_with("model.embed_tokens")
                || name.starts_with("lm_head")
        }
        _ => {
            const LATENT_PATH: [&str; 4] = ["q_a_proj", "q_a_layernorm", "kv_a_proj_with_mqa", "kv_a_layernorm"];
            name.contains(".self_attn.") && !LATENT_PATH.iter().any(|p| name.contains(&format!(".self_attn.{p}")))
        }
    };
    if split {
        Placement::Split
    } else {
        Placement::Replicated
    }
}

/// The plan for one checkpoint and device layout.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Plan {
    pub architecture: String,
    pub devices: usize,
    pub tensor_parallel: usize,
    pub expert_parallel: usize,
    /// Weight bytes on the fullest device.
    pub weight_bytes_per_device: u64,
    /// All served weights as stored, and the host memory the CPU forward would need (bf16 and
    /// f16 widened to f32).
    pub weight_bytes_total: u64,
    /// The lower bound of any placement: every served byte split evenly over the devices (what
    /// splitting also the replicated tensors would reach).
    pub weight_bytes_all_split: u64,
    pub fits_all_split: bool,
    pub cpu_weight_bytes: u64,
    /// Vision-tower bytes (not loaded).
    pub not_served_bytes: u64,
    pub device_budget_bytes: u64,
    /// K/V or latent bytes per token on each device, and recurrent state per sequence.
    pub cache_bytes_per_token: u64,
    pub recurrent_bytes_per_sequence: u64,
    pub fits: bool,
    /// Tokens one sequence can hold in what the weights leave (0 when they do not fit).
    pub max_context_one_sequence: u64,
    pub max_model_len: usize,
    /// Sequences of `max_model_len` tokens that fit at once.
    pub sequences_at_max_model_len: u64,
}

/// Plans `dir` for the layout in `args`.
pub fn plan(args: &PlanArgs) -> Result<Plan> {
    let (tp, ep) = (args.tensor_parallel_size, args.expert_parallel_size);
    if tp == 0 || ep == 0 {
        bail!("parallel sizes must be at least 1");
    }
    if tp > 1 && ep > 1 {
        bail!("tensor parallelism with expert parallelism together is not implemented");
    }
    let kv_value_bytes: u64 = match args.kv_cache_dtype.as_str() {
        "bfloat16" | "bf16" | "auto" => 2,
        "fp8" | "fp8_e4m3" => 1,
        "float32" | "f32" => 4,
        other => bail!("--kv-cache-dtype '{other}': expected bfloat16, fp8 or float32"),
    };
    if !(args.device_memory_gb > 0.0) || !(0.0..=1.0).contains(&args.gpu_memory_utilization) {
        bail!("--device-memory-gb must be positive and --gpu-memory-utilization within 0..1");
    }
    let cfg_path = args.model.join("config.json");
    let raw: Value =
        serde_json::from_str(&std::fs::read_to_string(&cfg_path).with_context(|| cfg_path.display().to_string())?)
            .with_context(|| format!("{}: invalid JSON", cfg_path.display()))?;
    let cfg = ModelConfig::from_hf_config(&cfg_path, &raw)?;
    let text = cfg.hf_config.clone().context("a Hugging Face config")?;
    let devices = tp.max(ep);
    let moe = MoeConfig::from_hf_config(&cfg_path, &text)?;
    let experts = moe.as_ref().map_or(0, |m| m.num_experts);
    if devices > 1 && experts > 0 && devices > experts {
        bail!("{devices} ranks for {experts} routed experts");
    }

    // Weights.
    let mut per_device = vec![0u64; devices];
    let (mut total, mut cpu, mut not_served) = (0u64, 0u64, 0u64);
    for t in read_headers(&args.model)? {
        let widened = if matches!(t.dtype.as_str(), "BF16" | "F16") { t.bytes * 2 } else { t.bytes };
        match placement(cfg.architecture, &t.name, tp > 1) {
            Placement::NotServed => {
                not_served += t.bytes;
                continue;
            }
            Placement::Replicated => per_device.iter_mut().for_each(|d| *d += t.bytes),
            Placement::Split => {
                per_device.iter_mut().for_each(|d| *d += t.bytes.div_ceil(devices as u64));
            }
            Placement::Expert(e) => {
                let owner = (0..devices).find(|&r| experts_of(experts.max(e + 1), devices, r).contains(&e));
                per_device[owner.unwrap_or(0)] += t.bytes;
            }
        }
        total += t.bytes;
        cpu += widened;
    }
    let weight_bytes_per_device = per_device.iter().copied().max().unwrap_or(0);

    // Cache: what `cache_layout` would declare, per device.
    let (per_token, per_seq) = match cfg.architecture {
        Architecture::Llama => {
            let kv_heads =
                if tp > 1 && cfg.num_kv_heads.is_multiple_of(tp) { cfg.num_kv_heads / tp } else { cfg.num_kv_heads };
            ((cfg.num_layers() * 2 * kv_heads * cfg.head_dim) as u64 * kv_value_bytes, 0)
        }
        Architecture::DeepseekV3 => {
            let mla = MlaConfig::from_hf_config(&cfg_path, &text)?;
            ((cfg.num_layers() * (mla.kv_lora_rank + mla.qk_rope_head_dim)) as u64 * kv_value_bytes, 0)
        }
        Architecture::KimiLinear | Architecture::KimiK3 => {
            let kinds = layer_plan(&cfg_path, &text, cfg.num_layers())?;
            let mla_layers = kinds.iter().filter(|k| **k == MixerKind::FullAttention).count();
            let kda_layers = kinds.len() - mla_layers;
            let latent = if mla_layers > 0 {
                let mla = MlaConfig::from_hf_config(&cfg_path, &text)?;
                (mla_layers * (mla.kv_lora_rank + mla.qk_rope_head_dim)) as u64 * kv_value_bytes
            } else {
                0
            };
            let mut kda = KdaConfig::from_hf_config(&cfg_path, &text)?;
            if tp > 1 && kda.num_heads.is_multiple_of(tp) {
                kda.num_heads /= tp;
            }
            (latent, SequenceState::bytes(&vec![kda; kda_layers]) as u64)
        }
    };

    let budget = (args.device_memory_gb * 1e9 * args.gpu_memory_utilization) as u64;
    let free = budget.saturating_sub(weight_bytes_per_device);
    let fits = weight_bytes_per_device < budget;
    let max_context_one_sequence = match (fits, per_token) {
        (false, _) => 0,
        (true, 0) => u64::MAX,
        (true, t) => free.saturating_sub(per_seq) / t,
    };
    let max_model_len = args.max_model_len.unwrap_or(cfg.max_position_embeddings);
    let per_sequence = per_seq + per_token * max_model_len as u64;
    let sequences_at_max_model_len = if fits && per_sequence > 0 { free / per_sequence } else { 0 };
    Ok(Plan {
        architecture: format!("{:?}", cfg.architecture),
        devices,
        tensor_parallel: tp,
        expert_parallel: ep,
        weight_bytes_per_device,
        weight_bytes_total: total,
        weight_bytes_all_split: total.div_ceil(devices as u64),
        fits_all_split: total.div_ceil(devices as u64) < budget,
        cpu_weight_bytes: cpu,
        not_served_bytes: not_served,
        device_budget_bytes: budget,
        cache_bytes_per_token: per_token,
        recurrent_bytes_per_sequence: per_seq,
        fits,
        max_context_one_sequence,
        max_model_len,
        sequences_at_max_model_len,
    })
}

fn gb(b: u64) -> String {
    match b {
        0..1_000_000 => format!("{:.1} kB", b as f64 / 1e3),
        1_000_000..1_000_000_000 => format!("{:.1} MB", b as f64 / 1e6),
        _ => format!("{:.2} GB", b as f64 / 1e9),
    }
}

/// The command: prints the plan.
pub fn run(args: PlanArgs) -> Result<()> {
    let p = plan(&args)?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&p)?);
        return Ok(());
    }
    let layout = match (p.tensor_parallel, p.expert_parallel) {
        (1, 1) => "1 device".to_string(),
        (tp, 1) => format!("{tp} devices, tensor parallel (MoE layers expert-parallel over them)"),
        (_, ep) => format!("{ep} devices, expert parallel"),
    };
    println!("model            {} ({})", args.model.display(), p.architecture);
    println!("layout           {layout}, {} usable per device", gb(p.device_budget_bytes));
    println!(
        "weights          {} per device (fullest), {} in all as stored",
        gb(p.weight_bytes_per_device),
        gb(p.weight_bytes_total)
    );
    println!("CPU forward      {} of host memory (bf16/f16 widened to f32)", gb(p.cpu_weight_bytes));
    if p.not_served_bytes > 0 {
        println!("not served       {} (vision tower)", gb(p.not_served_bytes));
    }
    println!(
        "cache            {} bytes per token per device ({} K/V or latent rows)",
        p.cache_bytes_per_token, args.kv_cache_dtype
    );
    println!("recurrent state  {} per sequence per device (KDA, f32)", gb(p.recurrent_bytes_per_sequence));
    if p.devices > 1 {
        let verdict = if p.fits_all_split { "would fit" } else { "would not fit either" };
        println!(
            "all split        {} per device if every tensor were split over the devices ({verdict})",
            gb(p.weight_bytes_all_split)
        );
    }
    if !p.fits {
        println!("fits             NO: the weights alone exceed a device's usable memory");
        return Ok(());
    }
    let longest = if p.max_context_one_sequence == u64::MAX {
        "unbounded by the cache".into()
    } else {
        format!("{} tokens", p.max_context_one_sequence)
    };
    println!("fits             yes; longest context of one sequence: {longest}");
    println!("sequences        {} at once of {} tokens each", p.sequences_at_max_model_len, p.max_model_len);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(model: PathBuf) -> PlanArgs {
        PlanArgs {
            model,
            tensor_parallel_size: 1,
            expert_parallel_size: 1,
            device_memory_gb: 1.0,
            gpu_memory_utilization: 0.9,
            kv_cache_dtype: "bfloat16".into(),
            max_model_len: Some(1000),
            json: false,
        }
    }

    fn k3(layout: &str) -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/reference/kimi_k3").join(layout)
    }

    #[test]
    fn tiny_k3_weights_cache_and_state_add_up() {
        let p = plan(&args(k3("int4"))).unwrap();
        let file = std::fs::metadata(k3("int4").join("model.safetensors")).unwrap().len();
        // Every byte of the one shard is a served tensor, the vision tower, or the header.
        assert!(
            p.weight_bytes_total + p.not_served_bytes < file
                && file - p.weight_bytes_total - p.not_served_bytes < 64 * 1024
        );
        assert!(p.not_served_bytes > 0);
        // Two MLA layers of 64 + 32 bf16 values per token; three KDA layers of 2 heads × 64².
        assert_eq!(p.cache_bytes_per_token, 2 * 96 * 2);
        assert_eq!(p.recurrent_bytes_per_sequence, 3 * 4 * (3 * 128 * 3 + 2 * 64 * 64));
        assert_eq!(p.weight_bytes_per_device, p.weight_bytes_total);
        let free = p.device_budget_bytes - p.weight_bytes_per_device;
        assert_eq!(p.max_context_one_sequence, (free - p.recurrent_bytes_per_sequence) / p.cache_bytes_per_token);
    }

    #[test]
    fn expert_parallel_splits_only_the_experts_and_tensor_parallel_the_heads() {
        let one = plan(&args(k3("mxfp4"))).unwrap();
        let ep = plan(&PlanArgs { expert_parallel_size: 2, ..args(k3("mxfp4")) }).unwrap();
        let tp = plan(&PlanArgs { tensor_parallel_size: 2, ..args(k3("mxfp4")) }).unwrap();
        assert!(ep.weight_bytes_per_device < one.weight_bytes_per_device);
        assert!(tp.weight_bytes_per_device < ep.weight_bytes_per_device, "heads split too");
        assert_eq!(tp.recurrent_bytes_per_sequence * 2, one.recurrent_bytes_per_sequence);
        assert_eq!(ep.cache_bytes_per_token, one.cache_bytes_per_token);
        let err = plan(&PlanArgs { expert_parallel_size: 5, ..args(k3("mxfp4")) }).unwrap_err().to_string();
        assert!(err.contains("5 ranks for 4 routed experts"), "{err}");
        let err = plan(&PlanArgs { device_memory_gb: 0.001, ..args(k3("mxfp4")) }).unwrap();
        assert!(!err.fits && err.max_context_one_sequence == 0);
    }
}
