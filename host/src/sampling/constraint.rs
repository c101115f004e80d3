//! Output constraints the sampler can enforce token by token.

use super::choice_constraint::ChoiceConstraint;
use std::sync::Arc;

use super::json_constraint::JsonState;
use super::json_schema::Schema;
use super::schema_constraint::SchemaState;
use super::tool_call_constraint::ToolCallConstraint;

/// What a request asks its output to be.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ConstraintSpec {
    /// One JSON object (`response_format: json_object`).
    JsonObject,
    /// JSON text a schema accepts (`response_format: json_schema`, `structured_outputs.json`).
    JsonSchema { schema: Arc<Schema> },
    /// `{"name": <one of these>, "arguments": {...}}` (forced tool choice).
    ToolCall { names: Vec<String> },
    /// Exactly one of these strings (`structured_outputs: {"choice": [...]}`).
    Choice { choices: Vec<String> },
}

#[derive(Clone, Debug)]
pub enum Constraint {
    Json(JsonState),
    Schema(SchemaState),
    ToolCall(ToolCallConstraint),
    Choice(ChoiceConstraint),
}

impl Constraint {
    pub fn new(spec: &ConstraintSpec) -> Self {
        match spec {
            ConstraintSpec::JsonObject => Constraint::Json(JsonState::default()),
            ConstraintSpec::JsonSchema { schema } => Constraint::Schema(SchemaState::new(schema.clone())),
            ConstraintSpec::ToolCall { names } => Constraint::ToolCall(ToolCallConstraint::new(names)),
            ConstraintSpec::Choice { choices } => Constraint::Choice(ChoiceConstraint::new(choices)),
        }
    }

    pub fn accepts(&self, bytes: &[u8]) -> bool {
        match self {
            Constraint::Json(j) => j.accepts(bytes),
            Constraint::Schema(s) => s.accepts(bytes),
            Constraint::ToolCall(t) => t.accepts(bytes),
            Constraint::Choice(c) => c.accepts(bytes),
        }
    }

    pub fn feed(&mut self, bytes: &[u8]) -> bool {
        match self {
            Constraint::Json(j) => j.feed(bytes),
            Constraint::Schema(s) => s.feed(bytes),
            Constraint::ToolCall(t) => t.feed(bytes),
            Constraint::Choice(c) => c.feed(bytes),
        }
    }

    pub fn is_complete(&self) -> bool {
        match self {
            Constraint::Json(j) => j.is_complete(),
            Constraint::Schema(s) => s.is_complete(),
            Constraint::ToolCall(t) => t.is_complete(),
            Constraint::Choice(c) => c.is_complete(),
        }
    }
}
