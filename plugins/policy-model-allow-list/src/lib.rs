//! `model-allow-list` policy: `{"models": ["a", "b"], "tenants": {"t1": ["a"]}}`. A tenant with
//! its own list may use only those models; everyone else the global list. Others get 403.

use serde_json::Value;
use wasmserve_guest::{Decision, Plugin, PluginInfo, Rejection, RequestInfo, RequestPolicy};

pub struct ModelAllowList {
    models: Vec<String>,
    tenants: serde_json::Map<String, Value>,
}

fn strings(v: Option<&Value>) -> Result<Vec<String>, String> {
    match v {
        None => Ok(vec![]),
        Some(Value::Array(a)) => a
            .iter()
            .map(|x| x.as_str().map(str::to_string).ok_or_else(|| "config: model names must be strings".to_string()))
            .collect(),
        Some(_) => Err("config: a model list must be an array".into()),
    }
}

impl Plugin for ModelAllowList {
    fn info() -> PluginInfo {
        PluginInfo {
            name: "model-allow-list".into(),
            version: env!("CARGO_PKG_VERSION").into(),
            needs_special_tokens: false,
        }
    }
    fn configure(config: &str) -> Result<Self, String> {
        let v: Value = serde_json::from_str(config).map_err(|e| format!("config: {e}"))?;
        let tenants = v.get("tenants").and_then(Value::as_object).cloned().unwrap_or_default();
        for t in tenants.values() {
            strings(Some(t))?;
        }
        Ok(Self { models: strings(v.get("models"))?, tenants })
    }
}

impl RequestPolicy for ModelAllowList {
    fn check(&self, req: &RequestInfo) -> Decision {
        let allowed = match self.tenants.get(&req.tenant) {
            Some(list) => strings(Some(list)).unwrap_or_default(),
            None => self.models.clone(),
        };
        if allowed.iter().any(|m| m == &req.model) {
            Decision::Allow
        } else {
            Decision::Reject(Rejection {
                status: 403,
                message: format!("model '{}' is not allowed for this tenant", req.model),
            })
        }
    }
}

wasmserve_guest::export_request_policy!(ModelAllowList);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tenant_lists_override_the_global_one() {
        let p = ModelAllowList::configure(r#"{"models": ["a"], "tenants": {"t": ["b"]}}"#).unwrap();
        let ok = |t: &str, m: &str| {
            p.check(&RequestInfo { tenant: t.into(), model: m.into(), ..Default::default() }) == Decision::Allow
        };
        assert!(ok("x", "a") && !ok("x", "b") && ok("t", "b") && !ok("t", "a"));
    }
}
