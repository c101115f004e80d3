//! `tool_choice: "required"` and named tool choices. The engine constrains the output to
//! `{"name": ..., "arguments": {...}}` over the allowed tools, the arguments following each
//! tool's `parameters` schema (`sampling::json_schema`; a tool whose schema uses keywords that
//! cannot be enforced gets any JSON object, as `sampling::tool_call_constraint` does for all
//! tools when the schemas together are too large), and the result is returned as `tool_calls`,
//! independent of the model's own tool-call syntax — the way vLLM serves forced tool choices.

use std::sync::Arc;

use serde_json::{json, Value};

use super::error::{ApiError, ApiResult};
use crate::sampling::constraint::{ConstraintSpec, JsonWhitespace};
use crate::sampling::json_schema::Schema;
use crate::sampling::tool_call_constraint::parse_tool_call;

/// The constraint a request's `tool_choice` forces, if any.
///
/// `whitespace` (`structured_outputs.disable_any_whitespace`) applies to the call's JSON; the
/// fallback for schemas too large to enforce writes its own fixed spacing.
pub fn forced_constraint(
    tool_choice: Option<&Value>,
    tools: Option<&[Value]>,
    whitespace: JsonWhitespace,
) -> ApiResult<Option<ConstraintSpec>> {
    let names: Vec<String> = tools
        .unwrap_or_default()
        .iter()
        .filter_map(|t| t.get("function").and_then(|f| f.get("name")).and_then(Value::as_str).map(str::to_string))
        .collect();
    match tool_choice {
        Some(Value::String(s)) if s == "required" => {
            if names.is_empty() {
                return Err(ApiError::invalid_param(
                    "tool_choice",
                    "tool_choice 'required' needs at least one tool in 'tools'",
                ));
            }
            Ok(Some(tool_call_spec(tools.unwrap_or_default(), names, whitespace)))
        }
        Some(Value::Object(o)) => {
            let name = o.get("function").and_then(|f| f.get("name")).and_then(Value::as_str).unwrap_or_default();
            if !names.iter().any(|n| n == name) {
                return Err(ApiError::invalid_param(
                    "tool_choice",
                    format!("tool_choice names function '{name}', which is not in 'tools'"),
                ));
            }
            Ok(Some(tool_call_spec(tools.unwrap_or_default(), vec![name.to_string()], whitespace)))
        }
        _ => Ok(None),
    }
}

/// The constraint for a call of one of `names`: one schema branch per tool, its arguments
/// following the tool's `parameters`.
fn tool_call_spec(tools: &[Value], names: Vec<String>, whitespace: JsonWhitespace) -> ConstraintSpec {
    let mut branches = Vec::new();
    for t in tools {
        let f = t.get("function");
        let Some(name) = f.and_then(|f| f.get("name")).and_then(Value::as_str).filter(|n| names.iter().any(|x| x == n))
        else {
            continue;
        };
        let mut params = f
            .and_then(|f| f.get("parameters"))
            .filter(|p| p.is_object())
            .cloned()
            .unwrap_or_else(|| json!({"type": "object"}));
        if let Err(e) = Schema::compile(&params) {
            tracing::debug!(tool = name, error = %e, "the tool's parameters cannot be enforced: its arguments are constrained to any JSON object");
            params = json!({"type": "object"});
        }
        // The parameters become a sub-schema of the combined one: their own references move with them.
        rebase_refs(&mut params, &format!("#/anyOf/{}/properties/arguments", branches.len()));
        branches.push(json!({"type": "object", "properties": {"name": {"const": name}, "arguments": params}, "required": ["name", "arguments"]}));
    }
    match Schema::compile(&json!({"anyOf": branches})) {
        Ok(schema) => ConstraintSpec::JsonSchema { schema: Arc::new(schema), whitespace },
        Err(e) => {
            tracing::debug!(error = %e, "the tools' schemas together cannot be enforced: arguments constrained to any JSON object");
            ConstraintSpec::ToolCall { names }
        }
    }
}

/// Rewrites every local `$ref` (`#...`) in `v` to point under `base`.
fn rebase_refs(v: &mut Value, base: &str) {
    match v {
        Value::Object(o) => {
            for (k, x) in o.iter_mut() {
                match x {
                    Value::String(r) if k == "$ref" && r.starts_with('#') => *r = format!("{base}{}", &r[1..]),
                    _ => rebase_refs(x, base),
                }
            }
        }
        Value::Array(a) => a.iter_mut().for_each(|x| rebase_refs(x, base)),
        _ => {}
    }
}

/// A fresh id for a forced tool call (streamed or not).
pub fn forced_call_id() -> String {
    format!("call_{:024x}", rand::random::<u128>() >> 32)
}

/// The `tool_calls` entry for a finished constrained output, `None` if it was cut short.
pub fn tool_call_json(text: &str, index: usize) -> Option<Value> {
    let (name, arguments) = parse_tool_call(text)?;
    Some(json!({
        "index": index,
        "id": forced_call_id(),
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sampling::constraint::Constraint;

    fn accepts(spec: &ConstraintSpec, text: &str) -> bool {
        Constraint::new(spec).feed(text.as_bytes())
    }

    #[test]
    fn forced_calls_follow_each_tools_parameters() {
        let tools = vec![
            json!({"type": "function", "function": {"name": "get_weather", "parameters": {
                "$defs": {"unit": {"enum": ["c", "f"]}},
                "type": "object", "properties": {"city": {"type": "string"}, "unit": {"$ref": "#/$defs/unit"}}, "required": ["city"]}}}),
            json!({"type": "function", "function": {"name": "lookup", "parameters": {"type": "object", "properties": {"id": {"type": "string", "pattern": "^[a-z]+$"}}}}}),
            json!({"type": "function", "function": {"name": "now"}}),
        ];
        let spec =
            forced_constraint(Some(&json!("required")), Some(&tools), JsonWhitespace::Flexible).unwrap().unwrap();
        assert!(matches!(spec, ConstraintSpec::JsonSchema { .. }));
        let full = |t: &str| {
            let mut c = Constraint::new(&spec);
            c.feed(t.as_bytes()) && c.is_complete()
        };
        assert!(full(r#"{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}"#));
        assert!(full(r#"{"name": "now", "arguments": {}}"#));
        // `pattern` cannot be enforced: that tool takes any object.
        assert!(full(r#"{"name": "lookup", "arguments": {"id": 5, "x": [1]}}"#));
        assert!(!accepts(&spec, r#"{"name": "get_weather", "arguments": {"town""#));
        assert!(!accepts(&spec, r#"{"name": "get_weather", "arguments": {"city": "P", "unit": "k""#));
        assert!(!accepts(&spec, r#"{"name": "other""#));
        let named = forced_constraint(
            Some(&json!({"type": "function", "function": {"name": "now"}})),
            Some(&tools),
            JsonWhitespace::Flexible,
        )
        .unwrap()
        .unwrap();
        assert!(!accepts(&named, r#"{"name": "get_weather""#));
        assert!(accepts(&named, r#"{"name": "now", "arguments": {"#));
        let compact =
            forced_constraint(Some(&json!("required")), Some(&tools), JsonWhitespace::Disabled).unwrap().unwrap();
        assert!(accepts(&compact, r#"{"name":"get_weather","arguments":{"city":"Paris"}}"#));
        assert!(!accepts(&compact, r#"{"name": "#));
    }
}
