//! The parsers behind the shipped parser plugins, as plain Rust on the guest SDK's traits (the
//! plugin crates only export them). Output follows vLLM 0.33's parsers of the same name: the
//! fixtures in tests/reference/parsers/vllm_expected.json were produced by running vLLM itself.
//!
//! Every stream is a small state machine over a [`scan::Scanner`]: a delta is scanned once,
//! and only a possible partial marker at its end is held back, so streaming costs O(delta).

pub mod hermes;
pub mod kimi_k2;
pub mod kimi_k3;
pub mod pyjson;
pub mod qwen3;
pub mod scan;
pub mod strftime;
pub mod think;

/// `chat_template_kwargs` as a JSON object (`{}` when absent or malformed).
pub(crate) fn kwargs(ctx: &wasmserve_guest::RequestContext) -> serde_json::Map<String, serde_json::Value> {
    match serde_json::from_str(&ctx.template_kwargs) {
        Ok(serde_json::Value::Object(m)) => m,
        _ => Default::default(),
    }
}

/// Python truthiness of an optional kwarg (None stays None).
pub(crate) fn truthy(v: Option<&serde_json::Value>) -> Option<bool> {
    use serde_json::Value;
    v.map(|v| match v {
        Value::Null => false,
        Value::Bool(b) => *b,
        Value::Number(n) => n.as_f64() != Some(0.0),
        Value::String(s) => !s.is_empty(),
        Value::Array(a) => !a.is_empty(),
        Value::Object(o) => !o.is_empty(),
    })
}
