//! `max-tokens-cap` policy: caps `max_tokens` at the configured `max_tokens` (default 4096),
//! optionally per tenant: `{"max_tokens": 1024, "tenants": {"free": 256}}`.

use serde_json::Value;
use wasmserve_guest::{Decision, Plugin, PluginInfo, RequestInfo, RequestPolicy, Rewrite};

pub struct MaxTokensCap {
    default: u32,
    tenants: serde_json::Map<String, Value>,
}

impl Plugin for MaxTokensCap {
    fn info() -> PluginInfo {
        PluginInfo {
            name: "max-tokens-cap".into(),
            version: env!("CARGO_PKG_VERSION").into(),
            needs_special_tokens: false,
        }
    }
    fn configure(config: &str) -> Result<Self, String> {
        let v: Value = serde_json::from_str(config).map_err(|e| format!("config: {e}"))?;
        let default = match v.get("max_tokens") {
            None => 4096,
            Some(n) => n
                .as_u64()
                .filter(|&n| n >= 1 && n <= u32::MAX as u64)
                .ok_or("config: max_tokens must be a positive integer")? as u32,
        };
        let tenants = v.get("tenants").and_then(Value::as_object).cloned().unwrap_or_default();
        Ok(Self { default, tenants })
    }
}

impl RequestPolicy for MaxTokensCap {
    fn check(&self, req: &RequestInfo) -> Decision {
        let cap = self
            .tenants
            .get(&req.tenant)
            .and_then(Value::as_u64)
            .map_or(self.default, |n| n.min(u32::MAX as u64) as u32);
        Decision::Rewrite(Rewrite { max_tokens_cap: Some(cap), ..Default::default() })
    }
}

wasmserve_guest::export_request_policy!(MaxTokensCap);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn caps_per_tenant() {
        let p = MaxTokensCap::configure(r#"{"max_tokens": 100, "tenants": {"free": 10}}"#).unwrap();
        let cap = |t: &str| match p.check(&RequestInfo { tenant: t.into(), ..Default::default() }) {
            Decision::Rewrite(r) => r.max_tokens_cap,
            _ => None,
        };
        assert_eq!(cap("free"), Some(10));
        assert_eq!(cap("paid"), Some(100));
        assert!(MaxTokensCap::configure(r#"{"max_tokens": 0}"#).is_err());
    }
}
