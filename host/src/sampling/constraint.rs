//! Output constraints the sampler can enforce token by token.

use super::choice_constraint::ChoiceConstraint;
use std::sync::Arc;

use super::json_constraint::JsonState;
use super::json_schema::Schema;
use super::schema_constraint::SchemaState;
use super::tool_call_constraint::ToolCallConstraint;

/// Insignificant whitespace JSON output may hold between its tokens.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum JsonWhitespace {
    /// Runs of up to [`JsonWhitespace::FLEXIBLE_RUN`] bytes anywhere JSON allows them.
    #[default]
    Flexible,
    /// None (vLLM's `disable_any_whitespace`): compact JSON, which small models otherwise pad
    /// with newlines and indentation that cost tokens and say nothing.
    Disabled,
}

impl JsonWhitespace {
    /// Longest run allowed when flexible: stops a model from padding forever.
    pub const FLEXIBLE_RUN: u8 = 16;

    pub fn max_run(self) -> u8 {
        match self {
            JsonWhitespace::Flexible => Self::FLEXIBLE_RUN,
            JsonWhitespace::Disabled => 0,
        }
    }
}

/// What a request asks its output to be.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ConstraintSpec {
    /// One JSON object (`response_format: json_object`, `structured_outputs.json_object`).
    JsonObject { whitespace: JsonWhitespace },
    /// JSON text a schema accepts (`response_format: json_schema`, `structured_outputs.json`).
    JsonSchema { schema: Arc<Schema>, whitespace: JsonWhitespace },
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
            ConstraintSpec::JsonObject { whitespace } => Constraint::Json(JsonState::with_whitespace(*whitespace)),
            ConstraintSpec::JsonSchema { schema, whitespace } => {
                Constraint::Schema(SchemaState::with_whitespace(schema.clone(), *whitespace))
            }
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
