//! MLA hyper-parameters from a Hugging Face `config.json`: the DeepSeek-V2/V3 fields
//! (`q_lora_rank`, `kv_lora_rank`, `qk_nope_head_dim`, `qk_rope_head_dim`, `v_head_dim`), RoPE
//! with optional YaRN scaling (transformers 5 `rope_parameters` or the older top-level
//! `rope_theta` + `rope_scaling`), Kimi's NoPE variant (`mla_use_nope`) and the optional output
//! gate (`mla_use_output_gate`, Kimi K3). Kimi K3 nests the text model under `text_config`.

use std::path::Path;

use serde_json::Value;

use crate::model::error::LoadError;

/// YaRN context extension (transformers `_compute_yarn_parameters`).
#[derive(Clone, Debug, PartialEq)]
pub struct Yarn {
    pub factor: f32,
    pub original_max_position_embeddings: usize,
    pub beta_fast: f32,
    pub beta_slow: f32,
    pub mscale: Option<f32>,
    pub mscale_all_dim: Option<f32>,
    /// Explicit `attention_factor` (the cos/sin multiplier); derived from the mscales if absent.
    pub attention_factor: Option<f32>,
    /// Round the correction range outward to whole dimensions (transformers' default).
    pub truncate: bool,
}

#[derive(Clone, Debug, PartialEq)]
pub struct MlaRope {
    pub theta: f32,
    /// DeepSeek checkpoints store each rotary pair as adjacent dims `(x0,x1),(x2,x3),…`
    /// (`rope_interleave: true`, transformers' default for DeepSeek-V3).
    pub interleave: bool,
    pub yarn: Option<Yarn>,
}

#[derive(Clone, Debug, PartialEq)]
pub struct MlaConfig {
    pub hidden_size: usize,
    pub num_heads: usize,
    /// `None`: queries come from a plain `q_proj` (DeepSeek-V2-Lite, Kimi-Linear).
    pub q_lora_rank: Option<usize>,
    pub kv_lora_rank: usize,
    pub qk_nope_head_dim: usize,
    pub qk_rope_head_dim: usize,
    pub v_head_dim: usize,
    /// `None`: NoPE (Kimi) — the "rope" slices exist but are not rotated.
    pub rope: Option<MlaRope>,
    /// `o = o · sigmoid(g_proj(x))` per head before `o_proj` (gated MLA).
    pub output_gate: bool,
    /// transformers builds `q_a_layernorm`/`kv_a_layernorm` with its RMSNorm default eps 1e-6,
    /// not `rms_norm_eps`.
    pub lora_norm_eps: f32,
    /// Max positions, for validating requests (`max_position_embeddings`).
    pub max_position_embeddings: usize,
}

fn first<'a>(v: &'a Value, keys: &[&str]) -> Option<&'a Value> {
    keys.iter().find_map(|k| v.get(*k).filter(|x| !x.is_null()))
}

impl MlaConfig {
    pub fn qk_head_dim(&self) -> usize {
        self.qk_nope_head_dim + self.qk_rope_head_dim
    }

    /// The query width per token (`heads × (nope + rope)`).
    pub fn q_width(&self) -> usize {
        self.num_heads * self.qk_head_dim()
    }

    /// Softmax scale: `qk_head_dim^-0.5`, times `mscale(factor, mscale_all_dim)²` under YaRN, as
    /// transformers' deepseek_v3 does (`yarn_apply_mscale`); Kimi's NoPE MLA keeps the plain scale.
    pub fn softmax_scale(&self) -> f32 {
        let base = (self.qk_head_dim() as f64).powf(-0.5);
        let corr = match self.rope.as_ref().and_then(|r| r.yarn.as_ref()) {
            Some(y) => match y.mscale_all_dim {
                Some(m) if m != 0.0 => {
                    let s = yarn_get_mscale(y.factor as f64, m as f64);
                    s * s
                }
                _ => 1.0,
            },
            None => 1.0,
        };
        (base * corr) as f32
    }

    pub fn from_hf_config(file: &Path, raw: &Value) -> Result<Self, LoadError> {
        let raw = raw.get("text_config").filter(|t| t.is_object()).unwrap_or(raw);
        let bad = |detail: String| LoadError::Config { file: file.to_path_buf(), detail };
        let usize_of = |key: &str| -> Result<Option<usize>, LoadError> {
            match first(raw, &[key]) {
                None => Ok(None),
                Some(v) => v
                    .as_u64()
                    .map(|x| Some(x as usize))
                    .ok_or_else(|| bad(format!("{key} must be a non-negative integer, got {v}"))),
            }
        };
        let need = |key: &str| -> Result<usize, LoadError> {
            usize_of(key)?.ok_or_else(|| bad(format!("MLA config without {key}")))
        };
        let bool_of = |key: &str, default: bool| -> Result<bool, LoadError> {
            match first(raw, &[key]) {
                None => Ok(default),
                Some(v) => v.as_bool().ok_or_else(|| bad(format!("{key} must be true or false, got {v}"))),
            }
        };
        if bool_of("attention_bias", false)? {
            return Err(bad("MLA with attention_bias: true is not supported".into()));
        }
        let nope = bool_of("mla_use_nope", false)?;
        let max_position_embeddings = usize_of("max_position_embeddings")?.unwrap_or(4096);
        let rope = if nope { None } else { Some(parse_rope(raw, max_position_embeddings).map_err(bad)?) };
        let cfg = MlaConfig {
            hidden_size: need("hidden_size")?,
            num_heads: need("num_attention_heads")?,
            q_lora_rank: usize_of("q_lora_rank")?,
            kv_lora_rank: need("kv_lora_rank")?,
            qk_nope_head_dim: need("qk_nope_head_dim")?,
            qk_rope_head_dim: need("qk_rope_head_dim")?,
            v_head_dim: need("v_head_dim")?,
            rope,
            output_gate: bool_of("mla_use_output_gate", false)?,
            lora_norm_eps: 1e-6,
            max_position_embeddings,
        };
        cfg.validate().map_err(bad)?;
        Ok(cfg)
    }

    pub fn validate(&self) -> Result<(), String> {
        if self.hidden_size == 0
            || self.num_heads == 0
            || self.kv_lora_rank == 0
            || self.v_head_dim == 0
            || self.qk_head_dim() == 0
        {
            return Err(format!("zero-sized MLA dimension in {self:?}"));
        }
        if self.q_lora_rank == Some(0) {
            return Err("q_lora_rank is 0 (use null for a plain q_proj)".into());
        }
        if !self.qk_rope_head_dim.is_multiple_of(2) && self.rope.is_some() {
            return Err(format!("qk_rope_head_dim {} is odd; RoPE needs an even size", self.qk_rope_head_dim));
        }
        if let Some(y) = self.rope.as_ref().and_then(|r| r.yarn.as_ref()) {
            if !(y.factor > 0.0) || y.original_max_position_embeddings == 0 {
                return Err(format!("invalid YaRN parameters {y:?}"));
            }
        }
        Ok(())
    }
}

/// `0.1·m·ln(scale) + 1` for `scale > 1`, else 1 (DeepSeek's `yarn_get_mscale`).
pub fn yarn_get_mscale(scale: f64, mscale: f64) -> f64 {
    if scale <= 1.0 {
        1.0
    } else {
        0.1 * mscale * scale.ln() + 1.0
    }
}

fn parse_rope(raw: &Value, max_pos: usize) -> Result<MlaRope, String> {
    // transformers >= 5 writes `rope_parameters` (theta inside); older configs `rope_theta` +
    // `rope_scaling` (`type` or `rope_type`).
    let params = first(raw, &["rope_parameters"]).filter(|v| v.is_object());
    let scaling = params.or_else(|| first(raw, &["rope_scaling"]).filter(|v| v.is_object()));
    let num = |v: Option<&Value>, key: &str| -> Result<Option<f64>, String> {
        match v.and_then(|s| s.get(key)).filter(|x| !x.is_null()) {
            None => Ok(None),
            Some(x) => x.as_f64().map(Some).ok_or_else(|| format!("rope parameter {key} must be a number, got {x}")),
        }
    };
    let theta = num(params, "rope_theta")?.or(num(Some(raw), "rope_theta")?).unwrap_or(10000.0) as f32;
    let interleave = match first(raw, &["rope_interleave"]) {
        None => true,
        Some(v) => v.as_bool().ok_or_else(|| format!("rope_interleave must be true or false, got {v}"))?,
    };
    let kind =
        scaling.and_then(|s| s.get("rope_type").or_else(|| s.get("type"))).and_then(Value::as_str).unwrap_or("default");
    let yarn = match kind {
        "default" => None,
        "yarn" => {
            let original = match num(scaling, "original_max_position_embeddings")? {
                Some(v) => v as usize,
                None => max_pos,
            };
            // As transformers: a missing factor is max_position_embeddings / original.
            let factor = num(scaling, "factor")?.unwrap_or(max_pos as f64 / original.max(1) as f64) as f32;
            // `beta_fast or 32`: a 0 also falls back, like Python's `or`.
            let or = |v: Option<f64>, d: f64| v.filter(|x| *x != 0.0).unwrap_or(d) as f32;
            Some(Yarn {
                factor,
                original_max_position_embeddings: original,
                beta_fast: or(num(scaling, "beta_fast")?, 32.0),
                beta_slow: or(num(scaling, "beta_slow")?, 1.0),
                mscale: num(scaling, "mscale")?.map(|v| v as f32),
                mscale_all_dim: num(scaling, "mscale_all_dim")?.map(|v| v as f32),
                attention_factor: num(scaling, "attention_factor")?.map(|v| v as f32),
                truncate: scaling.and_then(|s| s.get("truncate")).and_then(Value::as_bool).unwrap_or(true),
            })
        }
        other => return Err(format!("rope scaling type '{other}' is not supported for MLA (default, yarn)")),
    };
    Ok(MlaRope { theta, interleave, yarn })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn parse(v: Value) -> Result<MlaConfig, LoadError> {
        MlaConfig::from_hf_config(Path::new("config.json"), &v)
    }

    fn base() -> Value {
        json!({"hidden_size": 64, "num_attention_heads": 4, "q_lora_rank": 32, "kv_lora_rank": 16,
               "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 12, "max_position_embeddings": 512})
    }

    #[test]
    fn deepseek_v3_yarn_in_old_and_new_spelling() {
        let mut old = base();
        old["rope_theta"] = json!(5000.0);
        old["rope_scaling"] = json!({"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128,
            "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.8});
        let mut new = base();
        new["rope_parameters"] = json!({"rope_type": "yarn", "rope_theta": 5000.0, "factor": 4.0,
            "original_max_position_embeddings": 128, "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.8});
        let (a, b) = (parse(old).unwrap(), parse(new).unwrap());
        assert_eq!(a, b);
        let r = a.rope.as_ref().unwrap();
        assert_eq!((r.theta, r.interleave), (5000.0, true));
        let m = 0.1 * 0.8 * 4f64.ln() + 1.0;
        assert!((a.softmax_scale() as f64 - m * m / 24f64.sqrt()).abs() < 1e-7);
        assert_eq!(a.q_lora_rank, Some(32));
    }

    #[test]
    fn kimi_nope_plain_q_and_gate() {
        let mut v = base();
        v["q_lora_rank"] = Value::Null;
        v["mla_use_nope"] = json!(true);
        v["mla_use_output_gate"] = json!(true);
        let c = parse(json!({"text_config": v})).unwrap();
        assert_eq!((c.q_lora_rank, c.rope.is_none(), c.output_gate), (None, true, true));
        assert!((c.softmax_scale() - 24f32.powf(-0.5)).abs() < 1e-7);
    }

    #[test]
    fn bad_configs_are_named() {
        for (key, val, needle) in [
            ("kv_lora_rank", Value::Null, "kv_lora_rank"),
            ("v_head_dim", json!("x"), "v_head_dim"),
            ("qk_rope_head_dim", json!(7), "odd"),
            ("attention_bias", json!(true), "attention_bias"),
            ("rope_scaling", json!({"type": "longrope", "factor": 2.0}), "longrope"),
        ] {
            let mut v = base();
            v[key] = val;
            let err = parse(v).unwrap_err().to_string();
            assert!(err.contains(needle), "{key}: {err}");
        }
    }
}
