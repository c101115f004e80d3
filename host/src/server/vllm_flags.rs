//! `vllm serve` command lines, run as they are with `wasmserve serve`: the flags that mean
//! something here are mapped onto ours, those that only tune vLLM's own machinery are accepted
//! and logged, and one whose behaviour we do not have is a start-up error naming it (clap already
//! refuses flags it does not know). `VLLM_CUBIC_DYNAMIC_A8=1` is Cubic's dynamic-A8 mode:
//! `--cpu-activations int8` for the CPU forward (the device has no Cubic kernels yet).

use std::path::{Path, PathBuf};

use anyhow::{bail, Result};
use clap::Args;
use serde_json::Value;

/// The vLLM flags `serve` takes beside its own.
#[derive(Args, Debug, Clone, Default)]
pub struct VllmFlags {
    /// With --tensor-parallel-size, the routed experts are split by expert over the same devices.
    /// (Always so here for MoE models; accepted for vLLM command lines.)
    #[arg(long)]
    pub enable_expert_parallel: bool,
    /// vLLM: no CUDA graphs. Accepted (this server does not capture graphs).
    #[arg(long)]
    pub enforce_eager: bool,
    /// vLLM: run the checkpoint's Python code. Accepted; no remote code is ever run here.
    #[arg(long)]
    pub trust_remote_code: bool,
    /// vLLM: let `tool_choice: "auto"` produce tool calls. Always on here.
    #[arg(long)]
    pub enable_auto_tool_choice: bool,
    /// The checkpoint's quantization method (`cubic`, `compressed-tensors`, `mxfp4`, `gguf`):
    /// checked against the checkpoint, which is always read as it says.
    #[arg(long)]
    pub quantization: Option<String>,
    /// Fraction of the machine's memory (host memory for the CPU forward) the server may use for
    /// weights and KV cache together; the KV cache gets what the loaded weights leave.
    /// Replaces --kv-cache-memory.
    #[arg(long)]
    pub gpu_memory_utilization: Option<f64>,
    /// vLLM: how the vision encoder is split (`data` or `weights`). Accepted: image input is not
    /// served yet.
    #[arg(long, value_parser = ["data", "weights"])]
    pub mm_encoder_tp_mode: Option<String>,
    /// Longest context (prompt + completion): a number, or `auto` (the model's maximum, as the KV
    /// cache allows).
    #[arg(long)]
    pub max_model_len: Option<String>,
    /// Prefix caching on (the default).
    #[arg(long, conflicts_with = "no_enable_prefix_caching")]
    pub enable_prefix_caching: bool,
    /// Prefix caching off (vLLM's spelling of --no-prefix-caching).
    #[arg(long)]
    pub no_enable_prefix_caching: bool,
    /// vLLM: no per-request access log lines. Accepted (none are written).
    #[arg(long)]
    pub disable_uvicorn_access_log: bool,
    /// Origins browsers may call the API from (CORS): a JSON list as vLLM takes it
    /// (`["https://app.example"]`), a comma-separated list, or `*`. Off unless given.
    #[arg(long)]
    pub allowed_origins: Option<String>,
    /// With --allowed-origins: the methods allowed (JSON list or comma-separated; default any).
    #[arg(long)]
    pub allowed_methods: Option<String>,
    /// With --allowed-origins: the request headers allowed (default any).
    #[arg(long)]
    pub allowed_headers: Option<String>,
    /// With --allowed-origins (not `*`): browsers may send credentials.
    #[arg(long)]
    pub allow_credentials: bool,
}

/// A list flag: a JSON list of strings or a comma-separated list.
fn list(s: &str, flag: &str) -> Result<Vec<String>> {
    let t = s.trim();
    if t.starts_with('[') {
        return serde_json::from_str::<Vec<String>>(t).map_err(|e| anyhow::anyhow!("{flag} '{s}': {e}"));
    }
    Ok(t.split(',').map(|x| x.trim().to_string()).filter(|x| !x.is_empty()).collect())
}

/// The CORS layer the flags ask for (`None`: CORS off, as by default).
pub fn cors_layer(f: &VllmFlags) -> Result<Option<tower_http::cors::CorsLayer>> {
    use tower_http::cors::{AllowHeaders, AllowMethods, AllowOrigin, CorsLayer};
    let Some(origins) = &f.allowed_origins else {
        if f.allowed_methods.is_some() || f.allowed_headers.is_some() || f.allow_credentials {
            bail!("--allowed-methods, --allowed-headers and --allow-credentials need --allowed-origins");
        }
        return Ok(None);
    };
    let origins = list(origins, "--allowed-origins")?;
    let any_origin = origins.iter().any(|o| o == "*");
    if any_origin && f.allow_credentials {
        bail!("--allow-credentials with --allowed-origins '*': browsers refuse credentials to any origin; list the origins");
    }
    let mut layer = CorsLayer::new();
    layer = if any_origin {
        layer.allow_origin(AllowOrigin::any())
    } else {
        let values = origins
            .iter()
            .map(|o| o.parse().map_err(|_| anyhow::anyhow!("--allowed-origins: '{o}' is not a valid origin")))
            .collect::<Result<Vec<axum::http::HeaderValue>>>()?;
        layer.allow_origin(values)
    };
    let methods = f.allowed_methods.as_deref().map(|m| list(m, "--allowed-methods")).transpose()?;
    layer = match methods.filter(|m| !m.iter().any(|x| x == "*")) {
        None => layer.allow_methods(AllowMethods::mirror_request()),
        Some(m) => layer.allow_methods(
            m.iter()
                .map(|x| x.parse().map_err(|_| anyhow::anyhow!("--allowed-methods: '{x}' is not a method")))
                .collect::<Result<Vec<axum::http::Method>>>()?,
        ),
    };
    let headers = f.allowed_headers.as_deref().map(|h| list(h, "--allowed-headers")).transpose()?;
    layer = match headers.filter(|h| !h.iter().any(|x| x == "*")) {
        None => layer.allow_headers(AllowHeaders::mirror_request()),
        Some(h) => layer.allow_headers(
            h.iter()
                .map(|x| x.parse().map_err(|_| anyhow::anyhow!("--allowed-headers: '{x}' is not a header name")))
                .collect::<Result<Vec<axum::http::HeaderName>>>()?,
        ),
    };
    Ok(Some(layer.allow_credentials(f.allow_credentials)))
}

/// `--max-model-len`: `auto` (`None`) or a token count (`1k`-style suffixes as vLLM: k = 1000,
/// K = 1024, m/M likewise).
pub fn parse_max_model_len(s: &str) -> Result<Option<usize>> {
    if s == "auto" || s == "-1" {
        return Ok(None);
    }
    let (num, mult) = match s.chars().last() {
        Some('k') => (&s[..s.len() - 1], 1_000.0),
        Some('K') => (&s[..s.len() - 1], 1_024.0),
        Some('m') => (&s[..s.len() - 1], 1_000_000.0),
        Some('M') => (&s[..s.len() - 1], 1_048_576.0),
        _ => (s, 1.0),
    };
    match num.parse::<f64>() {
        Ok(v) if v * mult >= 1.0 && (v * mult).fract() == 0.0 => Ok(Some((v * mult) as usize)),
        _ => bail!("--max-model-len '{s}': expected a token count (e.g. 32768, 128k) or auto"),
    }
}

/// The quantization method a checkpoint declares (`quantization_config.quant_method`, at the top
/// of config.json or in `text_config`), `gguf` for a GGUF file, `None` when unquantized.
pub fn checkpoint_quantization(model: &Path) -> Option<String> {
    checkpoint_quantization_config(model).map(|(method, _)| method)
}

/// The checkpoint's quantization method and its `quantization_config` (null for GGUF), read once.
fn checkpoint_quantization_config(model: &Path) -> Option<(String, Value)> {
    if model.extension().is_some_and(|e| e == "gguf") {
        return Some(("gguf".into(), Value::Null));
    }
    let text = std::fs::read_to_string(model.join("config.json")).ok()?;
    let cfg: Value = serde_json::from_str(&text).ok()?;
    let q = crate::model::format::quant::source::quantization_config(&cfg)?;
    Some((q.get("quant_method")?.as_str()?.to_string(), q.clone()))
}

impl VllmFlags {
    /// Checks the flags against the checkpoint at `model` and logs the accepted no-ops.
    pub fn check(&self, model: &Path) -> Result<()> {
        if let Some(want) = &self.quantization {
            let have = checkpoint_quantization_config(model);
            let matches = match (want.as_str(), &have) {
                (w, Some((h, _))) if w == h => true,
                // compressed-tensors' MXFP4 format is what vLLM calls `mxfp4` checkpoints too.
                ("mxfp4", Some((h, q))) if h == "compressed-tensors" => q.to_string().contains("mxfp4-pack-quantized"),
                _ => false,
            };
            if !matches {
                bail!(
                    "--quantization {want}: the checkpoint is {} (the checkpoint's own quantization_config decides how it is read)",
                    have.map_or("unquantized".to_string(), |(h, _)| format!("'{h}'"))
                );
            }
        }
        if let Some(u) = self.gpu_memory_utilization {
            if !(u > 0.0 && u <= 1.0) {
                bail!("--gpu-memory-utilization {u}: expected a fraction in (0, 1]");
            }
        }
        let accepted: [(bool, &str); 6] = [
            (self.enable_expert_parallel, "--enable-expert-parallel: MoE layers split their routed experts by expert over the tensor-parallel devices (always so here)"),
            (self.enforce_eager, "--enforce-eager: accepted (no CUDA graphs are captured)"),
            (self.trust_remote_code, "--trust-remote-code: accepted; no code from the checkpoint is ever run"),
            (self.enable_auto_tool_choice, "--enable-auto-tool-choice: accepted (tool_choice auto is always served)"),
            (self.mm_encoder_tp_mode.is_some(), "--mm-encoder-tp-mode: accepted; image input is not served yet"),
            (self.disable_uvicorn_access_log, "--disable-uvicorn-access-log: accepted (no access log is written)"),
        ];
        for (_, line) in accepted.iter().filter(|(on, _)| *on) {
            tracing::info!("{line}");
        }
        Ok(())
    }
}

/// Whether `VLLM_CUBIC_DYNAMIC_A8` asks for Cubic's dynamic-A8 mode (`1`; `0` or empty: A16).
pub fn cubic_dynamic_a8() -> bool {
    std::env::var("VLLM_CUBIC_DYNAMIC_A8").is_ok_and(|v| v != "0" && !v.is_empty())
}

/// Bytes of KV cache `--gpu-memory-utilization u` leaves on the host: `u` of the machine's memory
/// minus what the process already holds (the loaded weights).
pub fn host_kv_bytes(utilization: f64) -> Result<usize> {
    let meminfo = std::fs::read_to_string("/proc/meminfo")?;
    let kib = |key: &str| -> Option<u64> {
        meminfo.lines().find(|l| l.starts_with(key))?.split_whitespace().nth(1)?.parse().ok()
    };
    let total = kib("MemTotal:").ok_or_else(|| anyhow::anyhow!("/proc/meminfo has no MemTotal"))? * 1024;
    let statm = std::fs::read_to_string("/proc/self/statm")?;
    let resident_pages: u64 = statm.split_whitespace().nth(1).and_then(|p| p.parse().ok()).unwrap_or(0);
    let resident = resident_pages * 4096;
    let budget = (total as f64 * utilization) as u64;
    if budget <= resident {
        bail!(
            "--gpu-memory-utilization {utilization}: {:.1} GiB of {:.1} GiB is less than the {:.1} GiB the loaded model holds",
            budget as f64 / (1u64 << 30) as f64,
            total as f64 / (1u64 << 30) as f64,
            resident as f64 / (1u64 << 30) as f64
        );
    }
    Ok((budget - resident) as usize)
}

/// The model path: the positional argument (vLLM's form) or --model; both only if they agree.
pub fn model_path(positional: Option<&PathBuf>, flag: &Path, flag_given: bool) -> Result<PathBuf> {
    match positional {
        Some(p) if flag_given && p != flag => {
            bail!("the model is given twice ({} and --model {})", p.display(), flag.display())
        }
        Some(p) => Ok(p.clone()),
        None => Ok(flag.to_path_buf()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn max_model_len_forms() {
        assert_eq!(parse_max_model_len("auto").unwrap(), None);
        assert_eq!(parse_max_model_len("32768").unwrap(), Some(32768));
        assert_eq!(parse_max_model_len("128k").unwrap(), Some(128_000));
        assert_eq!(parse_max_model_len("1K").unwrap(), Some(1024));
        assert!(parse_max_model_len("0").is_err() && parse_max_model_len("lots").is_err());
    }

    #[test]
    fn quantization_is_checked_against_the_checkpoint() {
        let k3 = |l: &str| Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/reference/kimi_k3").join(l);
        let flags = |q: &str| VllmFlags { quantization: Some(q.into()), ..Default::default() };
        assert_eq!(checkpoint_quantization(&k3("cubic")).as_deref(), Some("cubic"));
        flags("cubic").check(&k3("cubic")).unwrap();
        flags("compressed-tensors").check(&k3("int4")).unwrap();
        flags("mxfp4").check(&k3("mxfp4")).unwrap();
        let err = flags("cubic").check(&k3("int4")).unwrap_err().to_string();
        assert!(err.contains("--quantization cubic") && err.contains("compressed-tensors"), "{err}");
        assert!(flags("mxfp4").check(&k3("int4")).is_err());
    }
}
