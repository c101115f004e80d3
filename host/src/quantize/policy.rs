//! Which layers `wasmserve quantize` converts and how: a default plus ordered rules (first match
//! wins), from command-line flags and an optional JSON policy file:
//!
//! ```json
//! {"format": "cubic", "bits": 3, "group_size": 512,
//!  "rules": [{"match": "re:.*mlp\\.down_proj$", "bits": 4},
//!            {"match": "lm_head", "skip": true}]}
//! ```
//! `match` is a module name or `re:<regex>` matched at the start of the name (the
//! compressed-tensors convention). Rules may set `bits`, `group_size`, `symmetric` (int only) or
//! `skip`. `lm_head` is skipped unless a rule says otherwise.

use serde_json::Value;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    /// compressed-tensors pack-quantized, round-to-nearest with min/max scales (W{b}A16).
    Int,
    /// docs/cubic-format.md.
    Cubic,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LayerPlan {
    pub format: Format,
    pub bits: u32,
    pub group_size: usize,
    pub symmetric: bool,
}

impl LayerPlan {
    pub fn kind(&self) -> String {
        match self.format {
            Format::Int => {
                format!("int{} g{}{}", self.bits, self.group_size, if self.symmetric { "" } else { " asym" })
            }
            Format::Cubic => format!("cubic b{} g{}", self.bits, self.group_size),
        }
    }
}

struct Rule {
    target: String,
    regex: Option<fancy_regex::Regex>,
    bits: Option<u32>,
    group_size: Option<usize>,
    symmetric: Option<bool>,
    skip: bool,
}

pub struct Policy {
    pub default: LayerPlan,
    rules: Vec<Rule>,
}

impl Policy {
    /// `file` (JSON text) may override the format and defaults; flags given on the command line
    /// (`Some`) override both.
    pub fn new(
        file: Option<&str>,
        format: Option<Format>,
        bits: Option<u32>,
        group_size: Option<usize>,
    ) -> Result<Self, String> {
        let v: Value = match file {
            Some(text) => serde_json::from_str(text).map_err(|e| format!("policy: invalid JSON: {e}"))?,
            None => Value::Object(Default::default()),
        };
        let file_format = match v.get("format").and_then(Value::as_str) {
            None => None,
            Some("int") => Some(Format::Int),
            Some("cubic") => Some(Format::Cubic),
            Some(f) => return Err(format!("policy: format '{f}' (int or cubic)")),
        };
        let format = format.or(file_format).unwrap_or(Format::Cubic);
        let default = LayerPlan {
            format,
            bits: bits
                .or(v.get("bits").and_then(Value::as_u64).map(|b| b as u32))
                .unwrap_or(if format == Format::Int { 4 } else { 3 }),
            group_size: group_size
                .or(v.get("group_size").and_then(Value::as_u64).map(|g| g as usize))
                .unwrap_or(if format == Format::Int { 128 } else { 512 }),
            symmetric: v.get("symmetric").and_then(Value::as_bool).unwrap_or(true),
        };
        let mut rules = Vec::new();
        for r in v.get("rules").and_then(Value::as_array).into_iter().flatten() {
            let target = r
                .get("match")
                .and_then(Value::as_str)
                .ok_or("policy: every rule needs a \"match\" string")?
                .to_string();
            let regex = match target.strip_prefix("re:") {
                Some(re) => Some(
                    fancy_regex::Regex::new(&format!(r"\A(?:{re})"))
                        .map_err(|e| format!("policy: rule '{target}': {e}"))?,
                ),
                None => None,
            };
            rules.push(Rule {
                target,
                regex,
                bits: r.get("bits").and_then(Value::as_u64).map(|b| b as u32),
                group_size: r.get("group_size").and_then(Value::as_u64).map(|g| g as usize),
                symmetric: r.get("symmetric").and_then(Value::as_bool),
                skip: r.get("skip").and_then(Value::as_bool).unwrap_or(false),
            });
        }
        let p = Self { default, rules };
        p.validate(&p.default)?;
        for r in &p.rules {
            p.validate(&LayerPlan {
                bits: r.bits.unwrap_or(p.default.bits),
                group_size: r.group_size.unwrap_or(p.default.group_size),
                ..p.default
            })
            .map_err(|e| format!("rule '{}': {e}", r.target))?;
        }
        Ok(p)
    }

    fn validate(&self, l: &LayerPlan) -> Result<(), String> {
        if !(1..=8).contains(&l.bits) {
            return Err(format!("bits {} outside 1..=8", l.bits));
        }
        if !(16..=1024).contains(&l.group_size)
            || !l.group_size.is_multiple_of(16)
            || (l.format == Format::Cubic && l.group_size < 32)
        {
            return Err(format!("group size {} must be a multiple of 16 in 32..=1024", l.group_size));
        }
        Ok(())
    }

    /// The plan for Linear module `module`, or `None` to keep it dense.
    pub fn plan_for(&self, module: &str) -> Option<LayerPlan> {
        for r in &self.rules {
            let hit = match &r.regex {
                Some(re) => re.is_match(module).unwrap_or(false),
                None => r.target == module,
            };
            if hit {
                if r.skip {
                    return None;
                }
                return Some(LayerPlan {
                    bits: r.bits.unwrap_or(self.default.bits),
                    group_size: r.group_size.unwrap_or(self.default.group_size),
                    symmetric: r.symmetric.unwrap_or(self.default.symmetric),
                    ..self.default
                });
            }
        }
        (module != "lm_head").then_some(self.default)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rules_in_order_then_default() {
        let p = Policy::new(
            Some(r#"{"format": "cubic", "bits": 3, "rules": [{"match": "re:.*down_proj$", "bits": 4}, {"match": "re:.*layers\\.0\\.", "skip": true}]}"#),
            None,
            None,
            Some(256),
        )
        .unwrap();
        assert_eq!(p.plan_for("model.layers.1.mlp.down_proj").unwrap().bits, 4);
        assert!(p.plan_for("model.layers.0.mlp.up_proj").is_none());
        let d = p.plan_for("model.layers.1.mlp.up_proj").unwrap();
        assert_eq!((d.format, d.bits, d.group_size), (Format::Cubic, 3, 256));
        assert!(p.plan_for("lm_head").is_none());
        assert!(Policy::new(Some(r#"{"bits": 9}"#), None, None, None).is_err());
        assert!(Policy::new(None, Some(Format::Int), None, Some(100)).is_err());
    }
}
