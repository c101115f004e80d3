//! Structured outputs: vLLM's `structured_outputs` request field (`choice`, `json` or
//! `json_object`, and `disable_any_whitespace` for compact JSON) and its
//! older spellings `guided_choice` / `guided_json`, and OpenAI's `response_format` of type
//! `json_schema`. A choice makes the output exactly one of the given strings
//! (`sampling::choice_constraint`); a schema makes it JSON the schema accepts
//! (`sampling::json_schema`, `sampling::schema_constraint`). Other kinds (`regex`, `grammar`)
//! and schema keywords that cannot be enforced are refused by name rather than ignored, so a
//! client never gets unconstrained text it believes was constrained.

use std::sync::Arc;

use serde_json::Value;

use super::error::{ApiError, ApiResult};
use crate::sampling::constraint::{ConstraintSpec, JsonWhitespace};
use crate::sampling::json_schema::Schema;

/// The constraint a chat or text completion request asks for in its vLLM fields.
pub fn from_sampling_fields(f: &super::openai::SamplingFields) -> ApiResult<Option<ConstraintSpec>> {
    structured_constraint(f.structured_outputs.as_ref(), f.guided_choice.as_ref(), f.guided_json.as_ref())
}

/// The constraint of `structured_outputs`, `guided_choice` or `guided_json` (at most one).
pub fn structured_constraint(
    structured_outputs: Option<&Value>,
    guided_choice: Option<&Value>,
    guided_json: Option<&Value>,
) -> ApiResult<Option<ConstraintSpec>> {
    let given = |v: Option<&Value>| v.is_some_and(|v| !v.is_null());
    let (so, gc, gj) = (given(structured_outputs), given(guided_choice), given(guided_json));
    if [so, gc, gj].iter().filter(|x| **x).count() > 1 {
        return Err(ApiError::bad_request(
            "give one of 'structured_outputs', 'guided_choice' or 'guided_json', not several",
        ));
    }
    if gc {
        return choices("guided_choice", guided_choice).map(Some);
    }
    if gj {
        return schema_constraint("guided_json", guided_json.expect("given"), JsonWhitespace::Flexible).map(Some);
    }
    if !so {
        return Ok(None);
    }
    let Some(Value::Object(o)) = structured_outputs else {
        return Err(ApiError::invalid_param("structured_outputs", "'structured_outputs' must be an object"));
    };
    if let Some(other) = o.keys().find(|k| !STRUCTURED_OUTPUTS_KEYS.contains(&k.as_str())) {
        return Err(ApiError::invalid_param(
            "structured_outputs",
            format!("structured_outputs.{other} is not supported (only {})", STRUCTURED_OUTPUTS_KEYS.join(", ")),
        ));
    }
    let whitespace = json_whitespace(structured_outputs)?;
    let json_object = match o.get("json_object") {
        None | Some(Value::Null) | Some(Value::Bool(false)) => false,
        Some(Value::Bool(true)) => true,
        Some(_) => {
            return Err(ApiError::invalid_param(
                "structured_outputs.json_object",
                "'structured_outputs.json_object' must be a boolean",
            ))
        }
    };
    let choice = o.get("choice").filter(|v| !v.is_null());
    let json = o.get("json").filter(|v| !v.is_null());
    if [choice.is_some(), json.is_some(), json_object].iter().filter(|x| **x).count() > 1 {
        return Err(ApiError::invalid_param(
            "structured_outputs",
            "give one of 'choice', 'json' or 'json_object', not several",
        ));
    }
    if let Some(schema) = json {
        return schema_constraint("structured_outputs.json", schema, whitespace).map(Some);
    }
    if json_object {
        return Ok(Some(ConstraintSpec::JsonObject { whitespace }));
    }
    // Options alone (`disable_any_whitespace`) shape a `response_format` constraint, as in vLLM.
    choice.map(|c| choices("structured_outputs.choice", Some(c))).transpose()
}

/// The `structured_outputs` fields read: vLLM's constraint kinds this server enforces and the
/// options that apply to them (`disable_fallback` is accepted because nothing here falls back:
/// an unenforceable constraint is a 400).
const STRUCTURED_OUTPUTS_KEYS: &[&str] =
    &["choice", "json", "json_object", "disable_any_whitespace", "disable_fallback"];

/// vLLM's `structured_outputs.disable_any_whitespace`: JSON constraints (this request's
/// `response_format` too) then allow no insignificant whitespace.
pub fn json_whitespace(structured_outputs: Option<&Value>) -> ApiResult<JsonWhitespace> {
    match structured_outputs.and_then(|o| o.get("disable_any_whitespace")) {
        None | Some(Value::Null) | Some(Value::Bool(false)) => Ok(JsonWhitespace::Flexible),
        Some(Value::Bool(true)) => Ok(JsonWhitespace::Disabled),
        Some(_) => Err(ApiError::invalid_param(
            "structured_outputs.disable_any_whitespace",
            "'structured_outputs.disable_any_whitespace' must be a boolean",
        )),
    }
}

/// `response_format: {"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}`
/// (no `schema`: any JSON object).
pub fn response_format_schema(rf: &Value, whitespace: JsonWhitespace) -> ApiResult<ConstraintSpec> {
    let js = rf.get("json_schema").ok_or_else(|| {
        ApiError::invalid_param("response_format", "response_format 'json_schema' needs a 'json_schema' object")
    })?;
    if !js.is_object() {
        return Err(ApiError::invalid_param("response_format", "'response_format.json_schema' must be an object"));
    }
    let schema = js.get("schema").cloned().unwrap_or_else(|| Value::Object(Default::default()));
    schema_constraint("response_format", &schema, whitespace)
}

fn schema_constraint(param: &str, schema: &Value, whitespace: JsonWhitespace) -> ApiResult<ConstraintSpec> {
    // guided_json may come as the schema's text.
    let parsed;
    let schema = match schema {
        Value::String(text) => {
            parsed = serde_json::from_str::<Value>(text)
                .map_err(|e| ApiError::invalid_param(param, format!("'{param}' is not a JSON schema: {e}")))?;
            &parsed
        }
        v => v,
    };
    let schema = Schema::compile(schema)
        .map_err(|e| ApiError::invalid_param(param, format!("invalid schema in '{param}': {e}")))?;
    Ok(ConstraintSpec::JsonSchema { schema: Arc::new(schema), whitespace })
}

fn choices(param: &str, v: Option<&Value>) -> ApiResult<ConstraintSpec> {
    let choices: Option<Vec<String>> =
        v.and_then(Value::as_array).and_then(|a| a.iter().map(|c| c.as_str().map(str::to_string)).collect());
    match choices {
        Some(c) if !c.is_empty() && c.iter().all(|s| !s.is_empty()) => Ok(ConstraintSpec::Choice { choices: c }),
        _ => Err(ApiError::invalid_param(param, format!("'{param}' must be a non-empty list of non-empty strings"))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn choices_are_read_and_bad_ones_refused() {
        let spec = structured_constraint(Some(&json!({"choice": ["yes", "no"]})), None, None).unwrap();
        assert_eq!(spec, Some(ConstraintSpec::Choice { choices: vec!["yes".into(), "no".into()] }));
        assert!(structured_constraint(None, Some(&json!(["a"])), None).unwrap().is_some());
        assert!(structured_constraint(None, None, None).unwrap().is_none());
        for bad in
            [json!({"choice": []}), json!({"choice": [1]}), json!({"regex": "a+"}), json!("x"), json!({"choice": [""]})]
        {
            assert!(structured_constraint(Some(&bad), None, None).is_err(), "{bad}");
        }
    }

    #[test]
    fn schemas_come_from_every_spelling_and_bad_ones_are_400() {
        let schema = json!({"type": "object", "properties": {"a": {"type": "integer"}}});
        for spec in [
            structured_constraint(Some(&json!({"json": schema})), None, None).unwrap().unwrap(),
            structured_constraint(None, None, Some(&schema)).unwrap().unwrap(),
            structured_constraint(None, None, Some(&Value::String(schema.to_string()))).unwrap().unwrap(),
            response_format_schema(
                &json!({"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}),
                JsonWhitespace::Flexible,
            )
            .unwrap(),
        ] {
            assert!(matches!(spec, ConstraintSpec::JsonSchema { .. }));
        }
        let e = response_format_schema(
            &json!({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string", "pattern": "a"}}}),
            JsonWhitespace::Flexible,
        )
        .unwrap_err();
        assert_eq!(e.param.as_deref(), Some("response_format"));
        assert!(e.message.contains("'pattern'"), "{}", e.message);
        assert!(structured_constraint(Some(&json!({"json": schema})), Some(&json!(["a"])), None).is_err());
    }

    #[test]
    fn json_object_and_disable_any_whitespace_are_read() {
        let so = |v: Value| structured_constraint(Some(&v), None, None);
        let schema = json!({"type": "object"});
        assert_eq!(
            so(json!({"json_object": true})).unwrap(),
            Some(ConstraintSpec::JsonObject { whitespace: JsonWhitespace::Flexible })
        );
        assert_eq!(
            so(json!({"json_object": true, "disable_any_whitespace": true})).unwrap(),
            Some(ConstraintSpec::JsonObject { whitespace: JsonWhitespace::Disabled })
        );
        assert!(matches!(
            so(json!({"json": schema, "disable_any_whitespace": true, "disable_fallback": true})).unwrap(),
            Some(ConstraintSpec::JsonSchema { whitespace: JsonWhitespace::Disabled, .. })
        ));
        // Options alone constrain nothing themselves; they shape response_format's constraint.
        assert_eq!(so(json!({"disable_any_whitespace": true})).unwrap(), None);
        assert_eq!(json_whitespace(Some(&json!({"disable_any_whitespace": true}))).unwrap(), JsonWhitespace::Disabled);
        assert_eq!(json_whitespace(None).unwrap(), JsonWhitespace::Flexible);
        for (bad, param) in [
            (json!({"json_object": true, "json": schema}), "structured_outputs"),
            (json!({"json_object": true, "choice": ["a"]}), "structured_outputs"),
            (json!({"json_object": "yes"}), "structured_outputs.json_object"),
            (json!({"json": schema, "disable_any_whitespace": 1}), "structured_outputs.disable_any_whitespace"),
            (json!({"whitespace_pattern": " "}), "structured_outputs"),
        ] {
            assert_eq!(so(bad.clone()).unwrap_err().param.as_deref(), Some(param), "{bad}");
        }
    }
}
