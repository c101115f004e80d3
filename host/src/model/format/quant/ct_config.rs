//! compressed-tensors `quantization_config` (config.json): which Linear layers are quantized and
//! how. Matching follows compressed-tensors 0.20 (`utils/match.py`, `lifecycle/apply.py`):
//! a target is an exact module name, `re:<regex>` matched at the start of the name (Python
//! `re.match`), or a class name (`Linear` matches every linear layer); `ignore` uses the same
//! forms; when several targets match, exact names win over regexes over class names (ties by
//! the target string), and a target listed by two groups belongs to the later one.

use serde_json::Value;

/// Storage format of one config group's weights.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CtFormat {
    /// Integer codes in int32 words (`weight_packed`, `weight_scale`, `weight_zero_point`).
    PackQuantized,
    /// FP4 E2M1 codes two per byte with E8M0 scales per 32 (`weight_packed`, `weight_scale` u8).
    Mxfp4PackQuantized,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Strategy {
    Tensor,
    Channel,
    Group,
}

/// `weights` of a config group, reduced to what loading needs.
#[derive(Clone, Debug, PartialEq)]
pub struct WeightArgs {
    pub num_bits: u32,
    pub float: bool,
    pub symmetric: bool,
    pub strategy: Strategy,
    /// Columns per group (`Group` only).
    pub group_size: Option<usize>,
    /// `actorder: "group"` (alias `"dynamic"`): the checkpoint carries `weight_g_idx`.
    pub g_idx: bool,
}

#[derive(Clone, Debug)]
pub struct Scheme {
    pub group: String,
    pub format: CtFormat,
    pub weights: WeightArgs,
}

#[derive(Clone, Debug)]
enum Target {
    /// A module name or a class name (compressed-tensors tries both).
    Plain(String),
    Regex(fancy_regex::Regex, String),
}

impl Target {
    fn parse(s: &str) -> Result<Self, String> {
        match s.strip_prefix("re:") {
            Some(re) => {
                // Python's re.match anchors at the start only.
                let r = fancy_regex::Regex::new(&format!(r"\A(?:{re})"))
                    .map_err(|e| format!("target '{s}': invalid regex: {e}"))?;
                Ok(Target::Regex(r, s.to_string()))
            }
            None => Ok(Target::Plain(s.to_string())),
        }
    }

    fn text(&self) -> &str {
        match self {
            Target::Plain(s) | Target::Regex(_, s) => s,
        }
    }

    fn matches_name(&self, name: &str) -> bool {
        match self {
            Target::Plain(s) => s == name,
            Target::Regex(r, _) => r.is_match(name).unwrap_or(false),
        }
    }

    /// Class match for a Linear module: its class chain is just `Linear` (other class names,
    /// e.g. `Embedding` or a decoder layer's, name other modules).
    fn matches_class(&self) -> bool {
        matches!(self, Target::Plain(s) if s == "Linear")
    }

    fn matches_linear(&self, name: &str) -> bool {
        self.matches_name(name) || self.matches_class()
    }
}

#[derive(Clone, Debug)]
pub struct CtConfig {
    /// (target, index into `schemes`) in config order; later duplicates override earlier ones.
    targets: Vec<(Target, usize)>,
    schemes: Vec<Scheme>,
    ignore: Vec<Target>,
}

fn parse_format(s: &str) -> Result<CtFormat, String> {
    match s {
        "pack-quantized" => Ok(CtFormat::PackQuantized),
        "mxfp4-pack-quantized" => Ok(CtFormat::Mxfp4PackQuantized),
        other => Err(format!(
            "compressed-tensors format '{other}' is not supported (supported: pack-quantized, mxfp4-pack-quantized)"
        )),
    }
}

fn parse_weights(group: &str, w: &Value) -> Result<WeightArgs, String> {
    let err = |d: String| format!("config group '{group}' weights: {d}");
    let num_bits = w.get("num_bits").and_then(Value::as_u64).unwrap_or(8) as u32;
    if !(1..=8).contains(&num_bits) {
        return Err(err(format!("num_bits {num_bits} is not supported (1..=8)")));
    }
    let float = match w.get("type").and_then(Value::as_str).unwrap_or("int") {
        "int" => false,
        "float" => true,
        t => return Err(err(format!("type '{t}' is not supported"))),
    };
    let symmetric = w.get("symmetric").and_then(Value::as_bool).unwrap_or(true);
    let group_size = w.get("group_size").and_then(Value::as_i64);
    // compressed-tensors infers the strategy from group_size when it is absent.
    let strategy = match w.get("strategy").and_then(Value::as_str) {
        Some("tensor") => Strategy::Tensor,
        Some("channel") => Strategy::Channel,
        Some("group") => Strategy::Group,
        Some(s) => return Err(err(format!("strategy '{s}' is not supported (tensor, channel, group)"))),
        None => match group_size {
            None => Strategy::Tensor,
            Some(-1) => Strategy::Channel,
            Some(_) => Strategy::Group,
        },
    };
    let group_size = match (strategy, group_size) {
        (Strategy::Group, Some(g)) if g > 0 => Some(g as usize),
        (Strategy::Group, g) => return Err(err(format!("strategy group needs a positive group_size, got {g:?}"))),
        _ => None,
    };
    let g_idx = match w.get("actorder") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(Value::String(s)) => match s.as_str() {
            "group" | "dynamic" => true,
            "weight" | "static" => false,
            other => return Err(err(format!("actorder '{other}' is not supported"))),
        },
        Some(v) => return Err(err(format!("actorder {v} is not supported"))),
    };
    if w.get("dynamic").and_then(Value::as_bool) == Some(true) {
        return Err(err("dynamic weight quantization is not supported".into()));
    }
    if w.get("block_structure").is_some_and(|b| !b.is_null()) {
        return Err(err("block_structure is not supported".into()));
    }
    Ok(WeightArgs { num_bits, float, symmetric, strategy, group_size, g_idx })
}

impl CtConfig {
    /// Parses `quantization_config`; `Ok(None)` when it is not a compressed-tensors config.
    pub fn parse(q: &Value) -> Result<Option<Self>, String> {
        if q.get("quant_method").and_then(Value::as_str) != Some("compressed-tensors") {
            return Ok(None);
        }
        let status = q.get("quantization_status").and_then(Value::as_str).unwrap_or("compressed");
        if status != "compressed" {
            return Err(format!("quantization_status '{status}' is not supported (only 'compressed' checkpoints)"));
        }
        let global_format = q.get("format").and_then(Value::as_str).unwrap_or("dense");
        let groups = q.get("config_groups").and_then(Value::as_object).ok_or("config_groups is missing")?;
        let mut schemes = Vec::new();
        let mut targets = Vec::new();
        for (name, g) in groups {
            for key in ["input_activations", "output_activations"] {
                if g.get(key).is_some_and(|v| !v.is_null()) {
                    return Err(format!(
                        "config group '{name}': {key} quantization is not supported (weight-only schemes only)"
                    ));
                }
            }
            let Some(w) = g.get("weights").filter(|w| !w.is_null()) else { continue };
            let format = parse_format(g.get("format").and_then(Value::as_str).unwrap_or(global_format))?;
            let weights = parse_weights(name, w)?;
            match format {
                CtFormat::PackQuantized if weights.float => {
                    return Err(format!("config group '{name}': pack-quantized holds integer weights, not type float"))
                }
                CtFormat::Mxfp4PackQuantized
                    if !(weights.float && weights.num_bits == 4 && weights.group_size == Some(32)) =>
                {
                    return Err(format!(
                        "config group '{name}': mxfp4-pack-quantized needs type float, num_bits 4, group_size 32"
                    ))
                }
                _ => {}
            }
            let idx = schemes.len();
            schemes.push(Scheme { group: name.clone(), format, weights });
            for t in g
                .get("targets")
                .and_then(Value::as_array)
                .ok_or_else(|| format!("config group '{name}': targets missing"))?
            {
                let t = t.as_str().ok_or_else(|| format!("config group '{name}': target {t} is not a string"))?;
                targets.push((Target::parse(t)?, idx));
            }
        }
        let ignore = match q.get("ignore") {
            None | Some(Value::Null) => Vec::new(),
            Some(Value::Array(a)) => a
                .iter()
                .map(|v| v.as_str().ok_or_else(|| format!("ignore entry {v} is not a string")).and_then(Target::parse))
                .collect::<Result<_, _>>()?,
            Some(v) => return Err(format!("ignore must be a list, got {v}")),
        };
        Ok(Some(Self { targets, schemes, ignore }))
    }

    /// The scheme quantizing the Linear layer `module` (e.g. `model.layers.0.mlp.down_proj`),
    /// or `None` when it is not targeted or ignored (it stays in the checkpoint dtype).
    pub fn scheme_for(&self, module: &str) -> Option<&Scheme> {
        if self.ignore.iter().any(|t| t.matches_linear(module)) {
            return None;
        }
        // Later groups override earlier ones for the same target string.
        let mut effective: Vec<(&Target, usize)> = Vec::new();
        for (t, i) in &self.targets {
            match effective.iter_mut().find(|(e, _)| e.text() == t.text()) {
                Some(slot) => slot.1 = *i,
                None => effective.push((t, *i)),
            }
        }
        let mut by_name: Vec<&(&Target, usize)> = effective.iter().filter(|(t, _)| t.matches_name(module)).collect();
        by_name.sort_by_key(|(t, _)| (matches!(t, Target::Regex(..)), t.text().to_string()));
        let chosen = by_name.first().copied().or_else(|| effective.iter().find(|(t, _)| t.matches_class()));
        chosen.map(|(_, i)| &self.schemes[*i])
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn cfg(v: Value) -> CtConfig {
        CtConfig::parse(&v).unwrap().unwrap()
    }

    fn w4(gs: i64) -> Value {
        json!({"num_bits": 4, "type": "int", "symmetric": true, "strategy": "group", "group_size": gs})
    }

    #[test]
    fn linear_targets_and_regex_ignores() {
        let c = cfg(
            json!({"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
            "config_groups": {"g": {"targets": ["Linear"], "weights": w4(32)}},
            "ignore": ["lm_head", "re:.*self_attn.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*"]}),
        );
        assert!(c.scheme_for("lm_head").is_none());
        assert!(c.scheme_for("model.layers.0.self_attn.q_proj").is_none());
        assert!(c.scheme_for("model.layers.3.mlp.down_proj").is_none());
        let s = c.scheme_for("model.layers.3.mlp.experts.7.down_proj").unwrap();
        assert_eq!((s.weights.num_bits, s.weights.group_size, s.weights.strategy), (4, Some(32), Strategy::Group));
    }

    #[test]
    fn regex_is_anchored_at_the_start_only() {
        let c = cfg(json!({"quant_method": "compressed-tensors", "format": "pack-quantized",
            "config_groups": {"g": {"targets": ["re:mlp"], "weights": w4(32)}}}));
        assert!(c.scheme_for("model.layers.0.mlp.up_proj").is_none());
        let c = cfg(json!({"quant_method": "compressed-tensors", "format": "pack-quantized",
            "config_groups": {"g": {"targets": ["re:.*mlp"], "weights": w4(32)}}}));
        assert!(c.scheme_for("model.layers.0.mlp.up_proj").is_some());
    }

    #[test]
    fn exact_beats_regex_beats_class() {
        let c = cfg(json!({"quant_method": "compressed-tensors", "format": "pack-quantized",
            "config_groups": {
                "a": {"targets": ["Linear"], "weights": w4(128)},
                "b": {"targets": ["re:.*down_proj"], "weights": w4(64)},
                "c": {"targets": ["model.layers.0.mlp.down_proj"], "weights": w4(32)}}}));
        assert_eq!(c.scheme_for("model.layers.0.mlp.down_proj").unwrap().group, "c");
        assert_eq!(c.scheme_for("model.layers.1.mlp.down_proj").unwrap().group, "b");
        assert_eq!(c.scheme_for("model.layers.1.mlp.up_proj").unwrap().group, "a");
    }

    #[test]
    fn strategy_inferred_and_bad_configs_rejected() {
        let c = cfg(json!({"quant_method": "compressed-tensors", "format": "pack-quantized",
            "config_groups": {"g": {"targets": ["Linear"], "weights": {"num_bits": 8, "group_size": -1, "symmetric": false}}}}));
        let w = &c.scheme_for("x.q_proj").unwrap().weights;
        assert_eq!((w.strategy, w.symmetric, w.num_bits), (Strategy::Channel, false, 8));
        for bad in [
            json!({"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"g": {"targets": ["Linear"], "weights": w4(32)}}}),
            json!({"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "frozen", "config_groups": {}}),
            json!({"quant_method": "compressed-tensors", "format": "pack-quantized",
                   "config_groups": {"g": {"targets": ["Linear"], "weights": w4(32), "input_activations": {"num_bits": 8}}}}),
        ] {
            assert!(CtConfig::parse(&bad).is_err(), "{bad}");
        }
        assert!(CtConfig::parse(&json!({"quant_method": "gptq"})).unwrap().is_none());
    }
}
