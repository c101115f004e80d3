//! `prompt-length-limit` policy: rejects prompts longer than `max_prompt_tokens` (400, as
//! OpenAI answers an over-long context).

use serde_json::Value;
use wasmserve_guest::{Decision, Plugin, PluginInfo, Rejection, RequestInfo, RequestPolicy};

pub struct PromptLengthLimit {
    max: u32,
}

impl Plugin for PromptLengthLimit {
    fn info() -> PluginInfo {
        PluginInfo {
            name: "prompt-length-limit".into(),
            version: env!("CARGO_PKG_VERSION").into(),
            needs_special_tokens: false,
        }
    }
    fn configure(config: &str) -> Result<Self, String> {
        let v: Value = serde_json::from_str(config).map_err(|e| format!("config: {e}"))?;
        let max = v
            .get("max_prompt_tokens")
            .and_then(Value::as_u64)
            .ok_or("config: max_prompt_tokens (a positive integer) is required")?;
        Ok(Self { max: max.min(u32::MAX as u64) as u32 })
    }
}

impl RequestPolicy for PromptLengthLimit {
    fn check(&self, req: &RequestInfo) -> Decision {
        if req.prompt_tokens > self.max {
            return Decision::Reject(Rejection {
                status: 400,
                message: format!(
                    "the prompt has {} tokens; this deployment allows at most {}",
                    req.prompt_tokens, self.max
                ),
            });
        }
        Decision::Allow
    }
}

wasmserve_guest::export_request_policy!(PromptLengthLimit);
