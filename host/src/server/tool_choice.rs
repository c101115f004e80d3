//! `tool_choice: "required"` and named tool choices. The engine constrains the output to
//! `{"name": ..., "arguments": {...}}` over the allowed tool names (see
//! `sampling::tool_call_constraint`), and the result is returned as `tool_calls`, independent
//! of the model's own tool-call syntax — the way vLLM serves forced tool choices.

use serde_json::{json, Value};

use super::error::{ApiError, ApiResult};
use crate::sampling::constraint::ConstraintSpec;
use crate::sampling::tool_call_constraint::parse_tool_call;

/// The constraint a request's `tool_choice` forces, if any.
pub fn forced_constraint(tool_choice: Option<&Value>, tools: Option<&[Value]>) -> ApiResult<Option<ConstraintSpec>> {
    let names: Vec<String> = tools
        .unwrap_or_default()
        .iter()
        .filter_map(|t| t.get("function").and_then(|f| f.get("name")).and_then(Value::as_str).map(str::to_string))
        .collect();
    match tool_choice {
        Some(Value::String(s)) if s == "required" => {
            if names.is_empty() {
                return Err(ApiError::invalid_param("tool_choice", "tool_choice 'required' needs at least one tool in 'tools'"));
            }
            Ok(Some(ConstraintSpec::ToolCall { names }))
        }
        Some(Value::Object(o)) => {
            let name = o.get("function").and_then(|f| f.get("name")).and_then(Value::as_str).unwrap_or_default();
            if !names.iter().any(|n| n == name) {
                return Err(ApiError::invalid_param("tool_choice", format!("tool_choice names function '{name}', which is not in 'tools'")));
            }
            Ok(Some(ConstraintSpec::ToolCall { names: vec![name.to_string()] }))
        }
        _ => Ok(None),
    }
}

/// The `tool_calls` entry for a finished constrained output, `None` if it was cut short.
pub fn tool_call_json(text: &str, index: usize) -> Option<Value> {
    let (name, arguments) = parse_tool_call(text)?;
    Some(json!({
        "index": index,
        "id": format!("call_{:024x}", rand::random::<u128>() >> 32),
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }))
}
