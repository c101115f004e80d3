//! MoE hyper-parameters read from a Hugging Face `config.json`, for the DeepSeek-V2/V3 family
//! (`n_routed_experts`, `num_experts_per_tok`, `scoring_func`, `topk_method`, …) and the Kimi
//! family (`num_experts`, `num_experts_per_token`, `moe_router_activation_func`,
//! `moe_renormalize`, `use_grouped_topk`, …, plus K3's latent MoE `routed_expert_hidden_size`).
//! Both spellings are accepted for every field (transformers' `attribute_map` aliases), so a
//! config saved by either the original remote code or transformers parses the same.

use std::path::Path;

use serde_json::Value;

use crate::model::error::LoadError;
use crate::model::layers::moe::mlp::Activation;

/// How router logits become per-expert scores, and how the top-k experts are chosen from them
/// (greedy; DeepSeek-V2's group-limited greedy; DeepSeek-V3 / Kimi noaux_tc): the routing code
/// itself lives in `kernels::cpu::moe` so the CPU router and the device kernel share one
/// reference.
pub use kernels::cpu::moe::{RouterScoring as Scoring, RouterTopk as TopkMethod};

/// Tensor names of one expert's three projections (the checkpoint's, not transformers' fused form).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExpertNaming {
    /// DeepSeek: `experts.{e}.gate_proj / up_proj / down_proj`.
    GateUpDown,
    /// Kimi (Mixtral style): `experts.{e}.w1` (gate), `w3` (up), `w2` (down).
    W1W3W2,
}

impl ExpertNaming {
    /// (gate, up, down) leaf names.
    pub fn leaves(self) -> [&'static str; 3] {
        match self {
            ExpertNaming::GateUpDown => ["gate_proj", "up_proj", "down_proj"],
            ExpertNaming::W1W3W2 => ["w1", "w3", "w2"],
        }
    }
}

/// Kimi K3 latent MoE: routed experts work on `routed_expert_down_proj(x)` of this width.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LatentConfig {
    pub hidden_size: usize,
    /// RMSNorm (`routed_expert_norm`) on the weighted expert sum before the up-projection.
    pub use_norm: bool,
}

#[derive(Clone, Debug, PartialEq)]
pub struct MoeConfig {
    pub hidden_size: usize,
    pub num_experts: usize,
    pub top_k: usize,
    pub moe_intermediate_size: usize,
    /// Shared experts are one MLP of `moe_intermediate_size × num_shared_experts`.
    pub num_shared_experts: usize,
    pub scoring: Scoring,
    pub topk_method: TopkMethod,
    pub n_group: usize,
    pub topk_group: usize,
    pub norm_topk_prob: bool,
    pub routed_scaling_factor: f32,
    pub activation: Activation,
    pub latent: Option<LatentConfig>,
    pub rms_norm_eps: f32,
    pub naming: ExpertNaming,
    /// Name of the MoE module inside a decoder layer (`mlp` or Kimi's `block_sparse_moe`).
    pub module: &'static str,
    /// Layer plan: the first `first_k_dense_replace` layers are dense, then every
    /// `moe_layer_freq`-th; an explicit `mlp_layer_types` list overrides both.
    pub first_k_dense_replace: usize,
    pub moe_layer_freq: usize,
    pub mlp_layer_types: Option<Vec<bool>>,
    /// Width of the dense layers' MLP (`intermediate_size`).
    pub dense_intermediate_size: usize,
}

fn first<'a>(v: &'a Value, keys: &[&str]) -> Option<&'a Value> {
    keys.iter().find_map(|k| v.get(*k).filter(|x| !x.is_null()))
}

impl MoeConfig {
    /// The plainest routed MoE of these sizes: softmax scores, greedy top-k without groups or
    /// renormalisation, SiLU experts, no shared or dense layers (benchmarks and unit tests start
    /// from it and override what they exercise).
    pub fn plain(hidden_size: usize, num_experts: usize, top_k: usize, moe_intermediate_size: usize) -> Self {
        MoeConfig {
            hidden_size,
            num_experts,
            top_k,
            moe_intermediate_size,
            num_shared_experts: 0,
            scoring: Scoring::Softmax,
            topk_method: TopkMethod::Greedy,
            n_group: 1,
            topk_group: 1,
            norm_topk_prob: false,
            routed_scaling_factor: 1.0,
            activation: Activation::Silu,
            latent: None,
            rms_norm_eps: 1e-6,
            naming: ExpertNaming::GateUpDown,
            module: "mlp",
            first_k_dense_replace: 0,
            moe_layer_freq: 1,
            mlp_layer_types: None,
            dense_intermediate_size: 0,
        }
    }

    /// Parses the MoE part of `raw` (K3's nested `text_config` is looked into); `Ok(None)` when
    /// the config has no routed experts.
    pub fn from_hf_config(file: &Path, raw: &Value) -> Result<Option<Self>, LoadError> {
        let raw = raw.get("text_config").filter(|t| t.is_object()).unwrap_or(raw);
        let bad = |detail: String| LoadError::Config { file: file.to_path_buf(), detail };
        let usize_of = |keys: &[&str]| -> Result<Option<usize>, LoadError> {
            match first(raw, keys) {
                None => Ok(None),
                Some(v) => v
                    .as_u64()
                    .map(|x| Some(x as usize))
                    .ok_or_else(|| bad(format!("{} must be a non-negative integer, got {v}", keys[0]))),
            }
        };
        let need = |keys: &[&str]| -> Result<usize, LoadError> {
            usize_of(keys)?.ok_or_else(|| bad(format!("MoE config without {}", keys[0])))
        };
        let f32_of = |keys: &[&str], default: f32| -> Result<f32, LoadError> {
            match first(raw, keys) {
                None => Ok(default),
                Some(v) => {
                    v.as_f64().map(|x| x as f32).ok_or_else(|| bad(format!("{} must be a number, got {v}", keys[0])))
                }
            }
        };
        let bool_of = |keys: &[&str], default: bool| -> Result<bool, LoadError> {
            match first(raw, keys) {
                None => Ok(default),
                Some(v) => v.as_bool().ok_or_else(|| bad(format!("{} must be true or false, got {v}", keys[0]))),
            }
        };
        let str_of = |keys: &[&str]| first(raw, keys).and_then(Value::as_str);

        let Some(num_experts) = usize_of(&["n_routed_experts", "num_experts", "num_local_experts"])? else {
            return Ok(None);
        };
        if num_experts == 0 {
            return Ok(None);
        }
        let model_type = str_of(&["model_type"]).unwrap_or("");
        let kimi = model_type.starts_with("kimi");
        let deepseek_v2 = model_type == "deepseek_v2";

        let scoring = match str_of(&["scoring_func", "moe_router_activation_func"]) {
            Some("softmax") => Scoring::Softmax,
            Some("sigmoid") => Scoring::Sigmoid,
            Some(other) => {
                return Err(bad(format!("router scoring function '{other}' is not supported (softmax, sigmoid)")))
            }
            // DeepSeek-V2 scores with softmax; V3 and Kimi with sigmoid.
            None if deepseek_v2 => Scoring::Softmax,
            None => Scoring::Sigmoid,
        };
        let n_group = usize_of(&["n_group", "num_expert_group"])?.unwrap_or(1).max(1);
        let topk_group = usize_of(&["topk_group"])?.unwrap_or(n_group).max(1);
        let topk_method = match str_of(&["topk_method"]) {
            Some("greedy") => TopkMethod::Greedy,
            Some("group_limited_greedy") => TopkMethod::GroupLimitedGreedy,
            Some("noaux_tc") => TopkMethod::NoauxTc,
            Some(other) => {
                return Err(bad(format!(
                    "topk_method '{other}' is not supported (greedy, group_limited_greedy, noaux_tc)"
                )))
            }
            // Kimi routers always carry `e_score_correction_bias` (grouped or not: one group is plain
            // top-k); DeepSeek-V2 defaults to greedy, V3 to noaux_tc.
            None if deepseek_v2 => TopkMethod::Greedy,
            None => TopkMethod::NoauxTc,
        };
        // Kimi's `use_grouped_topk: false` means no group restriction.
        let (n_group, topk_group) = if bool_of(&["use_grouped_topk"], true)? { (n_group, topk_group) } else { (1, 1) };

        let activation = Activation::from_hf_config(raw).map_err(bad)?;
        let latent = match usize_of(&["routed_expert_hidden_size"])? {
            None | Some(0) => None,
            Some(h) => Some(LatentConfig { hidden_size: h, use_norm: bool_of(&["latent_moe_use_norm"], true)? }),
        };
        let mlp_layer_types = match first(raw, &["mlp_layer_types"]) {
            None => None,
            Some(Value::Array(items)) => Some(
                items
                    .iter()
                    .map(|t| match t.as_str() {
                        Some("sparse") => Ok(true),
                        Some("dense") => Ok(false),
                        _ => Err(bad(format!("mlp_layer_types entry {t} is neither \"dense\" nor \"sparse\""))),
                    })
                    .collect::<Result<Vec<_>, _>>()?,
            ),
            Some(v) => return Err(bad(format!("mlp_layer_types must be a list, got {v}"))),
        };
        let hidden_size = need(&["hidden_size"])?;
        let moe_intermediate_size = need(&["moe_intermediate_size"])?;
        let cfg = MoeConfig {
            hidden_size,
            num_experts,
            top_k: need(&["num_experts_per_tok", "num_experts_per_token"])?,
            moe_intermediate_size,
            num_shared_experts: usize_of(&["n_shared_experts", "num_shared_experts"])?.unwrap_or(0),
            scoring,
            topk_method,
            n_group,
            topk_group,
            norm_topk_prob: bool_of(&["norm_topk_prob", "moe_renormalize"], !deepseek_v2)?,
            routed_scaling_factor: f32_of(&["routed_scaling_factor"], 1.0)?,
            activation,
            latent,
            rms_norm_eps: f32_of(&["rms_norm_eps"], 1e-6)?,
            naming: if kimi { ExpertNaming::W1W3W2 } else { ExpertNaming::GateUpDown },
            module: if kimi { "block_sparse_moe" } else { "mlp" },
            first_k_dense_replace: usize_of(&["first_k_dense_replace"])?.unwrap_or(0),
            moe_layer_freq: usize_of(&["moe_layer_freq"])?.unwrap_or(1).max(1),
            mlp_layer_types,
            dense_intermediate_size: usize_of(&["intermediate_size"])?.unwrap_or(0),
        };
        cfg.validate().map_err(bad)?;
        Ok(Some(cfg))
    }

    /// Checks the numbers fit together, so routing can never index out of range.
    pub fn validate(&self) -> Result<(), String> {
        let (e, k, g, tg) = (self.num_experts, self.top_k, self.n_group, self.topk_group);
        if self.hidden_size == 0 || self.moe_intermediate_size == 0 {
            return Err(format!(
                "zero-sized MoE dimension (hidden {}, moe_intermediate {})",
                self.hidden_size, self.moe_intermediate_size
            ));
        }
        if k == 0 || k > e {
            return Err(format!("num_experts_per_tok {k} must be in 1..={e} (the number of routed experts)"));
        }
        if e % g != 0 {
            return Err(format!("{e} routed experts do not split into {g} groups"));
        }
        if tg > g {
            return Err(format!("topk_group {tg} exceeds the {g} expert groups"));
        }
        if g > 1 && self.topk_method != TopkMethod::Greedy && k > tg * (e / g) {
            return Err(format!("top-{k} cannot be chosen from {tg} groups of {} experts", e / g));
        }
        if self.topk_method == TopkMethod::NoauxTc && g > 1 && e / g < 2 {
            return Err("noaux_tc ranks groups by their two best experts: groups need at least 2".into());
        }
        if let Some(l) = self.latent {
            if l.hidden_size == 0 {
                return Err("routed_expert_hidden_size is 0".into());
            }
        }
        Ok(())
    }

    /// Whether decoder layer `layer` (0-based) has this MoE block rather than a dense MLP.
    pub fn is_moe_layer(&self, layer: usize) -> bool {
        match &self.mlp_layer_types {
            Some(types) => types.get(layer).copied().unwrap_or(false),
            None => layer >= self.first_k_dense_replace && layer.is_multiple_of(self.moe_layer_freq),
        }
    }

    /// Width the routed experts act on: the latent width for latent MoE, else the hidden size.
    pub fn expert_hidden_size(&self) -> usize {
        self.latent.map_or(self.hidden_size, |l| l.hidden_size)
    }

    /// `model.layers.{layer}.mlp` or `model.layers.{layer}.block_sparse_moe`.
    pub fn prefix(&self, layer: usize) -> String {
        format!("model.layers.{layer}.{}", self.module)
    }

    /// Whether the router needs `e_score_correction_bias`.
    pub fn uses_bias(&self) -> bool {
        self.topk_method == TopkMethod::NoauxTc
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn parse(v: Value) -> Result<Option<MoeConfig>, LoadError> {
        MoeConfig::from_hf_config(Path::new("config.json"), &v)
    }

    #[test]
    fn deepseek_v3_names() {
        let c = parse(json!({"model_type": "deepseek_v3", "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32,
            "n_routed_experts": 16, "num_experts_per_tok": 4, "n_group": 4, "topk_group": 2, "topk_method": "noaux_tc",
            "scoring_func": "sigmoid", "norm_topk_prob": true, "routed_scaling_factor": 2.5, "n_shared_experts": 2,
            "first_k_dense_replace": 3, "moe_layer_freq": 1}))
        .unwrap()
        .unwrap();
        assert_eq!((c.num_experts, c.top_k, c.n_group, c.topk_group, c.num_shared_experts), (16, 4, 4, 2, 2));
        assert_eq!(
            (c.scoring, c.topk_method, c.naming, c.module),
            (Scoring::Sigmoid, TopkMethod::NoauxTc, ExpertNaming::GateUpDown, "mlp")
        );
        assert_eq!(c.routed_scaling_factor, 2.5);
        assert_eq!((0..5).map(|i| c.is_moe_layer(i)).collect::<Vec<_>>(), [false, false, false, true, true]);
    }

    #[test]
    fn kimi_names_and_layer_types() {
        let text = std::fs::read_to_string(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../tests/reference/kimi_linear/model/config.json"
        ))
        .unwrap();
        let c = parse(serde_json::from_str(&text).unwrap()).unwrap().unwrap();
        assert_eq!((c.num_experts, c.top_k, c.num_shared_experts, c.moe_intermediate_size), (4, 2, 1, 32));
        assert_eq!(
            (c.scoring, c.topk_method, c.naming, c.module),
            (Scoring::Sigmoid, TopkMethod::NoauxTc, ExpertNaming::W1W3W2, "block_sparse_moe")
        );
        assert!(c.norm_topk_prob);
        assert_eq!(c.routed_scaling_factor, 1.7);
        assert_eq!((0..4).map(|i| c.is_moe_layer(i)).collect::<Vec<_>>(), [false, true, true, true]);
        let typed =
            parse(json!({"model_type": "kimi_linear", "hidden_size": 8, "moe_intermediate_size": 4, "num_experts": 4,
            "num_experts_per_token": 2, "mlp_layer_types": ["dense", "sparse", "dense"]}))
            .unwrap()
            .unwrap();
        assert_eq!((0..4).map(|i| typed.is_moe_layer(i)).collect::<Vec<_>>(), [false, true, false, false]);
    }

    #[test]
    fn k3_latent_and_situ_from_text_config() {
        let c =
            parse(json!({"model_type": "kimi_k3", "text_config": {"model_type": "kimi_linear", "hidden_size": 7168,
            "moe_intermediate_size": 3072, "num_experts": 896, "num_experts_per_token": 16, "num_shared_experts": 2,
            "routed_expert_hidden_size": 3584, "latent_moe_use_norm": true, "moe_router_activation_func": "sigmoid",
            "hidden_act": "situ", "activation_situ_beta": 4.0, "activation_situ_linear_beta": 25.0,
            "use_grouped_topk": true, "num_expert_group": 1, "topk_group": 1}}))
            .unwrap()
            .unwrap();
        assert_eq!(c.latent, Some(LatentConfig { hidden_size: 3584, use_norm: true }));
        assert_eq!(c.activation, Activation::Situ { beta: 4.0, linear_beta: Some(25.0) });
        assert_eq!(c.expert_hidden_size(), 3584);
    }

    #[test]
    fn dense_and_bad_configs() {
        assert!(parse(json!({"hidden_size": 8})).unwrap().is_none());
        let base = json!({"hidden_size": 8, "moe_intermediate_size": 4, "n_routed_experts": 8, "num_experts_per_tok": 2, "n_group": 4, "topk_group": 1});
        assert!(parse(base.clone()).unwrap().is_some());
        for (key, val, needle) in [
            ("num_experts_per_tok", json!(9), "num_experts_per_tok"),
            ("n_group", json!(3), "groups"),
            ("topk_group", json!(5), "topk_group"),
            ("num_experts_per_tok", json!(3), "cannot be chosen"),
            ("scoring_func", json!("relu"), "scoring"),
            ("topk_method", json!("magic"), "topk_method"),
            ("hidden_act", json!("gelu"), "hidden_act"),
            ("num_experts_per_tok", json!("two"), "integer"),
        ] {
            let mut v = base.clone();
            v[key] = val;
            let err = parse(v).unwrap_err().to_string();
            assert!(err.contains(needle), "{key}: {err}");
        }
    }
}
