//! QuantTrio's Cubic checkpoints (`quant_method: "cubic"`, `format: "cubic-pack-quantized"`), as
//! their vLLM fork reads them (QuantTrio/vllm-cubic 413ca1c `vllm/model_executor/layers/
//! quantization/cubic.py`: `CubicConfig.from_config`, `_scheme_for`, `_match_score`,
//! `_is_ignored`, `CubicLinearMethod.create_weights`; notes in docs/cubic-format.md).
//!
//! Config groups give `weights.num_bits` (1-8) and `weights.group_size` (`g` = `[1, g]`, or
//! `[group_out, group_in]`); `scale_dtype` must be float32, `param_dtype` float16, `reserved_code`
//! `binary` for 1 bit and `zero` otherwise. A module takes the group whose targets match it best:
//! its exact name (3), a `re:` regex matching the whole name (2), or a class: `Linear` for any
//! Linear, `FusedMoE` / `RoutedExperts` for a layer's routed experts (1); two groups at the best
//! score is an error. Routed experts are matched as their layer's `….experts` module, as vLLM
//! fuses them. `ignore` entries are exact names or `re:` regexes matched at the start.
//!
//! Per quantized Linear `P` of `[O, I]`: `P.weight_packed` U8 `[O, ceil(I·b/8)]`,
//! `P.weight_scale` F32 and `P.weight_a`, `P.weight_b` F16, each `[ceil(O/go), ceil(I/gi)]`.

use fancy_regex::Regex;
use safetensors::Dtype;
use serde_json::Value;

use kernels::cpu::cubic_pack::{row_bytes, CubicPackMatrix};

use crate::model::error::LoadError;
use crate::model::format::hf_source::{RawTensor, SafetensorsSource};
use crate::model::format::quant::ct_linear::floats;

/// One config group's weight scheme.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CubicScheme {
    pub bits: u32,
    pub group_out: usize,
    pub group_in: usize,
}

enum Target {
    Exact(String),
    Regex(Regex),
    Class(String),
}

struct Group {
    name: String,
    targets: Vec<Target>,
    scheme: CubicScheme,
}

enum Ignore {
    Exact(String),
    Regex(Regex),
}

pub struct CubicPackConfig {
    groups: Vec<Group>,
    ignore: Vec<Ignore>,
}

/// `re:<pattern>` compiled anchored at the start (`re.match`) or, with `whole`, at both ends
/// (`re.fullmatch`).
fn regex(pattern: &str, whole: bool) -> Result<Regex, String> {
    let anchored = if whole { format!(r"\A(?:{pattern})\z") } else { format!(r"\A(?:{pattern})") };
    Regex::new(&anchored).map_err(|e| format!("invalid regex '{pattern}': {e}"))
}

/// The module a routed expert's projection belongs to in vLLM (`….experts.{e}.w1` → `….experts`).
fn routed_experts_module(module: &str) -> Option<&str> {
    let (head, leaf) = module.rsplit_once('.')?;
    let (experts, index) = head.rsplit_once('.')?;
    let is_expert = experts.ends_with(".experts")
        && index.parse::<usize>().is_ok()
        && matches!(leaf, "w1" | "w2" | "w3" | "gate_proj" | "up_proj" | "down_proj");
    is_expert.then_some(experts)
}

impl CubicPackConfig {
    /// Parses `quantization_config`; `Ok(None)` when it is not QuantTrio's Cubic format.
    pub fn parse(q: &Value) -> Result<Option<Self>, String> {
        if q.get("quant_method").and_then(Value::as_str) != Some("cubic") || q.get("format").is_none() {
            return Ok(None);
        }
        match q.get("format").and_then(Value::as_str) {
            Some("cubic-pack-quantized") => {}
            other => return Err(format!("cubic format {other:?} is not supported (cubic-pack-quantized)")),
        }
        let groups_json = q
            .get("config_groups")
            .and_then(Value::as_object)
            .filter(|g| !g.is_empty())
            .ok_or("cubic: config_groups must be a non-empty object")?;
        let mut groups = Vec::new();
        for (name, g) in groups_json {
            let bad = |detail: String| format!("cubic config group '{name}': {detail}");
            let w = g.get("weights").filter(|w| w.is_object()).ok_or_else(|| bad("no weights".into()))?;
            let bits = w.get("num_bits").and_then(Value::as_u64).filter(|b| (1..=8).contains(b));
            let bits = bits.ok_or_else(|| bad(format!("num_bits {:?} outside 1..=8", w.get("num_bits"))))? as u32;
            let (group_out, group_in) = match w.get("group_size") {
                Some(Value::Number(n)) => (1, n.as_u64().unwrap_or(0) as usize),
                Some(Value::Array(a)) if a.len() == 2 => {
                    (a[0].as_u64().unwrap_or(0) as usize, a[1].as_u64().unwrap_or(0) as usize)
                }
                other => {
                    return Err(bad(format!("group_size {other:?} is neither an integer nor [group_out, group_in]")))
                }
            };
            if group_out == 0 || group_in == 0 {
                return Err(bad("group dimensions must be positive".into()));
            }
            let text = |key: &str, default: &str| w.get(key).and_then(Value::as_str).unwrap_or(default).to_string();
            let scale_dtype = text("scale_dtype", "float32");
            if !matches!(scale_dtype.as_str(), "float32" | "torch.float32") {
                return Err(bad(format!("scale_dtype '{scale_dtype}' (Cubic scales are float32)")));
            }
            let param_dtype = text("param_dtype", "float16");
            if !matches!(param_dtype.as_str(), "float16" | "torch.float16") {
                return Err(bad(format!("param_dtype '{param_dtype}' (Cubic a/b are float16)")));
            }
            let expected = if bits == 1 { "binary" } else { "zero" };
            let reserved = text("reserved_code", expected);
            if reserved != expected {
                return Err(bad(format!("{bits}-bit weights need reserved_code '{expected}', got '{reserved}'")));
            }
            if g.get("input_activations").is_some_and(|a| !a.is_null()) {
                return Err(bad("input_activations must be null (activations are never stored quantized)".into()));
            }
            let targets = g
                .get("targets")
                .and_then(Value::as_array)
                .filter(|t| !t.is_empty())
                .ok_or_else(|| bad("targets must be a non-empty list".into()))?
                .iter()
                .map(|t| {
                    let t = t.as_str().ok_or_else(|| bad(format!("target {t} is not a string")))?;
                    Ok(match t.strip_prefix("re:") {
                        Some(p) => Target::Regex(regex(p, true).map_err(bad)?),
                        None if matches!(t, "Linear" | "FusedMoE" | "RoutedExperts") => Target::Class(t.to_string()),
                        None => Target::Exact(t.to_string()),
                    })
                })
                .collect::<Result<Vec<_>, String>>()?;
            groups.push(Group { name: name.clone(), targets, scheme: CubicScheme { bits, group_out, group_in } });
        }
        let ignore = match q.get("ignore") {
            None | Some(Value::Null) => Vec::new(),
            Some(Value::Array(items)) => items
                .iter()
                .map(|i| {
                    let i = i.as_str().ok_or_else(|| format!("cubic: ignore entry {i} is not a string"))?;
                    Ok(match i.strip_prefix("re:") {
                        Some(p) => Ignore::Regex(regex(p, false)?),
                        None => Ignore::Exact(i.to_string()),
                    })
                })
                .collect::<Result<Vec<_>, String>>()?,
            Some(other) => return Err(format!("cubic: ignore must be a list, got {other}")),
        };
        Ok(Some(Self { groups, ignore }))
    }

    /// The scheme of the Linear `module` (a checkpoint name), `Ok(None)` when unquantized.
    pub fn scheme_for(&self, module: &str) -> Result<Option<CubicScheme>, String> {
        let experts = routed_experts_module(module);
        let prefix = experts.unwrap_or(module);
        let ignored = self.ignore.iter().any(|i| match i {
            Ignore::Exact(e) => e == prefix,
            Ignore::Regex(r) => r.is_match(prefix).unwrap_or(false),
        });
        if ignored {
            return Ok(None);
        }
        let score = |g: &Group| {
            g.targets
                .iter()
                .map(|t| match t {
                    Target::Exact(e) if e == prefix => 3,
                    Target::Regex(r) if r.is_match(prefix).unwrap_or(false) => 2,
                    Target::Class(c) if c == "Linear" && experts.is_none() => 1,
                    Target::Class(c) if c != "Linear" && experts.is_some() => 1,
                    _ => 0,
                })
                .max()
                .unwrap_or(0)
        };
        let scored: Vec<(u8, &Group)> = self.groups.iter().map(|g| (score(g), g)).filter(|(s, _)| *s > 0).collect();
        let Some(best) = scored.iter().map(|(s, _)| *s).max() else { return Ok(None) };
        let top: Vec<&Group> = scored.iter().filter(|(s, _)| *s == best).map(|(_, g)| *g).collect();
        if top.len() > 1 {
            let names: Vec<&str> = top.iter().map(|g| g.name.as_str()).collect();
            return Err(format!("'{prefix}' matches several Cubic config groups equally: {}", names.join(", ")));
        }
        Ok(Some(top[0].scheme))
    }
}

fn bad(t: &RawTensor, name: &str, detail: String) -> LoadError {
    LoadError::BadTensor { file: t.file.to_path_buf(), tensor: name.to_string(), detail }
}

/// Loads Linear `module` (`[rows, cols]`) stored under `scheme`.
pub fn load_cubic_pack(
    src: &SafetensorsSource,
    module: &str,
    rows: usize,
    cols: usize,
    scheme: CubicScheme,
) -> Result<CubicPackMatrix, LoadError> {
    let CubicScheme { bits, group_out, group_in } = scheme;
    let packed_name = format!("{module}.weight_packed");
    let packed = src.raw(&packed_name)?;
    let want = [rows, row_bytes(cols, bits)];
    if packed.dtype != Dtype::U8 || packed.shape != want {
        return Err(bad(
            &packed,
            &packed_name,
            format!(
                "{:?} {:?}, expected U8 {want:?} ({bits}-bit codes of [{rows}, {cols}])",
                packed.dtype, packed.shape
            ),
        ));
    }
    let groups = [rows.div_ceil(group_out), cols.div_ceil(group_in)];
    let meta = |leaf: &str, dtype: Dtype| -> Result<Vec<f32>, LoadError> {
        let name = format!("{module}.{leaf}");
        let t = src.raw(&name)?;
        // A single-row weight may keep 1-D metadata `[groups]` (cubic.py).
        let shape_ok = t.shape == groups || (groups[0] == 1 && t.shape == [groups[1]]);
        if t.dtype != dtype || !shape_ok {
            return Err(bad(&t, &name, format!("{:?} {:?}, expected {dtype:?} {groups:?}", t.dtype, t.shape)));
        }
        floats(&t, &name)
    };
    let (scale, a, b) =
        (meta("weight_scale", Dtype::F32)?, meta("weight_a", Dtype::F16)?, meta("weight_b", Dtype::F16)?);
    Ok(CubicPackMatrix::new(bits, rows, cols, group_out, group_in, packed.bytes.to_vec(), scale, a, b))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn k3_like() -> CubicPackConfig {
        CubicPackConfig::parse(&json!({
            "quant_method": "cubic", "format": "cubic-pack-quantized",
            "config_groups": {
                "moe_layers_1_3": {"targets": [r"re:.*\.layers\.(?:1|2|3)\.block_sparse_moe\.experts"],
                                   "weights": {"num_bits": 3, "group_size": 256}},
                "linear_layer_2_5bit": {"targets": ["language_model.model.layers.2.mlp_res_proj"],
                                        "weights": {"num_bits": 5, "group_size": [1, 128]}},
                "fallback": {"targets": ["Linear", "FusedMoE"], "weights": {"num_bits": 4, "group_size": 512}}
            },
            "ignore": ["re:.*self_attn.*", "re:.*shared_experts.*"]
        }))
        .unwrap()
        .unwrap()
    }

    #[test]
    fn schemes_resolve_by_exact_name_then_regex_then_class() {
        let c = k3_like();
        let s = |m: &str| c.scheme_for(m).unwrap().map(|s| (s.bits, s.group_out, s.group_in));
        assert_eq!(s("language_model.model.layers.2.block_sparse_moe.experts.7.w1"), Some((3, 1, 256)));
        assert_eq!(s("language_model.model.layers.5.block_sparse_moe.experts.0.w2"), Some((4, 1, 512)));
        assert_eq!(s("language_model.model.layers.2.mlp_res_proj"), Some((5, 1, 128)));
        assert_eq!(s("language_model.model.layers.2.block_sparse_moe.routed_expert_down_proj"), Some((4, 1, 512)));
        assert_eq!(s("language_model.model.layers.2.self_attn.q_proj"), None);
        assert_eq!(s("language_model.model.layers.2.block_sparse_moe.shared_experts.up_proj"), None);
    }

    #[test]
    fn bad_configs_are_named() {
        let parse = |v: Value| CubicPackConfig::parse(&v).err().unwrap_or_default();
        let base = |w: Value| {
            json!({"quant_method": "cubic", "format": "cubic-pack-quantized",
                                     "config_groups": {"g": {"targets": ["Linear"], "weights": w}}})
        };
        assert!(parse(base(json!({"num_bits": 9, "group_size": 64}))).contains("num_bits"));
        assert!(parse(base(json!({"num_bits": 3, "group_size": 64, "scale_dtype": "float16"}))).contains("scale_dtype"));
        assert!(parse(base(json!({"num_bits": 1, "group_size": 64, "reserved_code": "zero"}))).contains("binary"));
        assert!(parse(base(json!({"num_bits": 3, "group_size": [0, 64]}))).contains("positive"));
        let two = json!({"quant_method": "cubic", "format": "cubic-pack-quantized", "config_groups": {
            "a": {"targets": ["Linear"], "weights": {"num_bits": 3, "group_size": 64}},
            "b": {"targets": ["Linear"], "weights": {"num_bits": 4, "group_size": 64}}}});
        let c = CubicPackConfig::parse(&two).unwrap().unwrap();
        assert!(c.scheme_for("model.layers.0.mlp.up_proj").unwrap_err().contains("several"));
    }
}
