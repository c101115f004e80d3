//! Which layers of a hybrid Kimi-Linear model are KDA and which are full (MLA) attention.
//!
//! Moonshot's checkpoints list them in `linear_attn_config.kda_layers` / `full_attn_layers`,
//! **1-based**; transformers-written configs may instead carry `layer_types`
//! (`"linear_attention"` / `"full_attention"`, 0-based by position). A config with neither follows
//! transformers' default: every 4th layer (i % 4 == 0, i > 0) full attention, the rest KDA.

use std::path::Path;

use serde_json::Value;

use crate::model::error::LoadError;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MixerKind {
    Kda,
    FullAttention,
}

pub fn layer_plan(file: &Path, raw: &Value, num_layers: usize) -> Result<Vec<MixerKind>, LoadError> {
    let err = |detail: String| LoadError::Config { file: file.to_path_buf(), detail };
    let lac = raw.get("linear_attn_config").filter(|v| !v.is_null());
    let list = |key: &str| -> Result<Option<Vec<usize>>, LoadError> {
        let Some(v) = lac.and_then(|l| l.get(key)).filter(|v| !v.is_null()) else { return Ok(None) };
        let arr =
            v.as_array().ok_or_else(|| err(format!("linear_attn_config.{key} must be a list of layer numbers")))?;
        arr.iter()
            .map(|x| {
                let n = x.as_u64().ok_or_else(|| err(format!("linear_attn_config.{key}: {x} is not a layer number")))?
                    as usize;
                if n == 0 || n > num_layers {
                    return Err(err(format!(
                        "linear_attn_config.{key}: layer {n} is outside 1..={num_layers} (the lists are 1-based)"
                    )));
                }
                Ok(n - 1)
            })
            .collect::<Result<Vec<_>, _>>()
            .map(Some)
    };
    if let Some(kda) = list("kda_layers")? {
        let full = list("full_attn_layers")?.unwrap_or_default();
        let mut plan = vec![MixerKind::FullAttention; num_layers];
        for &i in &kda {
            if full.contains(&i) {
                return Err(err(format!("layer {} is listed as both a KDA and a full-attention layer", i + 1)));
            }
            plan[i] = MixerKind::Kda;
        }
        return Ok(plan);
    }
    if let Some(types) = raw.get("layer_types").filter(|v| !v.is_null()) {
        let arr = types.as_array().ok_or_else(|| err("layer_types must be a list".into()))?;
        if arr.len() != num_layers {
            return Err(err(format!("layer_types has {} entries for {num_layers} layers", arr.len())));
        }
        return arr
            .iter()
            .map(|t| match t.as_str() {
                Some("linear_attention") => Ok(MixerKind::Kda),
                Some("full_attention") => Ok(MixerKind::FullAttention),
                _ => Err(err(format!(
                    "layer_types: unknown layer type {t} (expected linear_attention or full_attention)"
                ))),
            })
            .collect();
    }
    Ok((0..num_layers).map(|i| if i > 0 && i % 4 == 0 { MixerKind::FullAttention } else { MixerKind::Kda }).collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn plan(v: Value, n: usize) -> Result<Vec<MixerKind>, LoadError> {
        layer_plan(Path::new("config.json"), &v, n)
    }

    #[test]
    fn one_based_lists() {
        use MixerKind::*;
        let p = plan(json!({"linear_attn_config": {"kda_layers": [1, 2, 4], "full_attn_layers": [3]}}), 4).unwrap();
        assert_eq!(p, vec![Kda, Kda, FullAttention, Kda]);
    }

    #[test]
    fn layer_types_and_default() {
        use MixerKind::*;
        let p = plan(json!({"layer_types": ["full_attention", "linear_attention"]}), 2).unwrap();
        assert_eq!(p, vec![FullAttention, Kda]);
        assert_eq!(plan(json!({}), 6).unwrap(), vec![Kda, Kda, Kda, Kda, FullAttention, Kda]);
    }

    #[test]
    fn bad_lists_are_named_errors() {
        let e = plan(json!({"linear_attn_config": {"kda_layers": [0, 1]}}), 4).unwrap_err().to_string();
        assert!(e.contains("1-based"), "{e}");
        let e = plan(json!({"linear_attn_config": {"kda_layers": [5]}}), 4).unwrap_err().to_string();
        assert!(e.contains("outside 1..=4"), "{e}");
        let e = plan(json!({"linear_attn_config": {"kda_layers": [2], "full_attn_layers": [2]}}), 4)
            .unwrap_err()
            .to_string();
        assert!(e.contains("both"), "{e}");
        let e = plan(json!({"layer_types": ["linear_attention", "sliding"]}), 2).unwrap_err().to_string();
        assert!(e.contains("unknown layer type"), "{e}");
    }
}
