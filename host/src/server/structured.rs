//! vLLM's `structured_outputs` request field (and its older spelling `guided_choice`). Only
//! `choice` is served: the output is exactly one of the given strings (see
//! `sampling::choice_constraint`). Other structured-output kinds are refused by name rather than
//! ignored, so a client never gets unconstrained text it believes was constrained.

use serde_json::Value;

use super::error::{ApiError, ApiResult};
use crate::sampling::constraint::ConstraintSpec;

pub fn choice_constraint(structured_outputs: Option<&Value>, guided_choice: Option<&Value>) -> ApiResult<Option<ConstraintSpec>> {
    let (param, choices) = match (structured_outputs, guided_choice) {
        (None | Some(Value::Null), None | Some(Value::Null)) => return Ok(None),
        (Some(_), Some(_)) => return Err(ApiError::bad_request("give either 'structured_outputs' or 'guided_choice', not both")),
        (Some(Value::Object(o)), None) => {
            if let Some(other) = o.keys().find(|k| *k != "choice") {
                return Err(ApiError::invalid_param("structured_outputs", format!("structured_outputs.{other} is not supported (only 'choice')")));
            }
            ("structured_outputs.choice", o.get("choice"))
        }
        (Some(_), None) => return Err(ApiError::invalid_param("structured_outputs", "'structured_outputs' must be an object")),
        (None, Some(v)) => ("guided_choice", Some(v)),
    };
    let choices: Option<Vec<String>> = choices.and_then(Value::as_array).and_then(|a| a.iter().map(|c| c.as_str().map(str::to_string)).collect());
    match choices {
        Some(c) if !c.is_empty() && c.iter().all(|s| !s.is_empty()) => Ok(Some(ConstraintSpec::Choice { choices: c })),
        _ => Err(ApiError::invalid_param(param, format!("'{param}' must be a non-empty list of non-empty strings"))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn choices_are_read_and_bad_ones_refused() {
        let spec = choice_constraint(Some(&json!({"choice": ["yes", "no"]})), None).unwrap();
        assert_eq!(spec, Some(ConstraintSpec::Choice { choices: vec!["yes".into(), "no".into()] }));
        assert!(choice_constraint(None, Some(&json!(["a"]))).unwrap().is_some());
        assert!(choice_constraint(None, None).unwrap().is_none());
        for bad in [json!({"choice": []}), json!({"choice": [1]}), json!({"regex": "a+"}), json!("x"), json!({"choice": [""]})] {
            assert!(choice_constraint(Some(&bad), None).is_err(), "{bad}");
        }
    }
}
