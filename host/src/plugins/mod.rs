//! Wasm component plugins: chat templates, reasoning parsers, tool parsers and
//! request policies, run in wasmtime under per-call limits.
//!
//! - `runtime`: the engine, the epoch deadline ticker, the compiled-component cache, store limits.
//! - `pool`: warm, exclusively leased instances; a failed instance is discarded.
//! - `parsers`, `policy`, `template`: typed calls for each world, with output checks.
//! - `registry`: named deployments, swapped atomically (in-flight requests keep the old one).
//! - `defaults`: the parsers a model gets without a config (`--reasoning-parser` / `--tool-call-parser`).
//! - `output_parsers`: reasoning and tool parsers applied to a chat's output; `apply`: request
//!   policies applied to an engine request.
//!
//! Nothing here knows HTTP: calls fail with [`PluginError`] / `apply::PolicyError`, which the
//! server maps to its responses; the admin endpoints live in `server::admin`.
//!
//! The plugins only get what the WIT world passes them: no WASI, so no filesystem, network,
//! clock or randomness (the host assigns random tool-call ids when a parser leaves them empty).

pub mod apply;
pub mod bindings;
pub mod defaults;
pub mod error;
pub mod metrics;
pub mod output_parsers;
pub mod parsers;
pub mod policy;
pub mod pool;
pub mod registry;
pub mod runtime;
pub mod template;
pub mod worlds;

pub use error::{FailureKind, PluginError};
pub use runtime::{PluginLimits, Runtime};

#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct PluginInfo {
    pub name: String,
    pub version: String,
    pub needs_special_tokens: bool,
}

/// What a parser is told about the request (see `wit/plugins.wit`, `request-context`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RequestContext {
    pub tools: String,
    pub template_kwargs: String,
    pub history_tool_calls: u32,
}

impl Default for RequestContext {
    fn default() -> Self {
        Self { tools: "[]".into(), template_kwargs: "{}".into(), history_tool_calls: 0 }
    }
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ReasoningDelta {
    pub reasoning: String,
    pub content: String,
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ReasoningResult {
    pub reasoning: Option<String>,
    pub content: Option<String>,
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ToolCall {
    pub id: String,
    pub name: String,
    pub arguments: String,
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ToolResult {
    pub content: Option<String>,
    pub tool_calls: Vec<ToolCall>,
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ToolCallDelta {
    pub index: u32,
    pub id: Option<String>,
    pub name: Option<String>,
    pub arguments: String,
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ToolDelta {
    pub content: String,
    pub tool_calls: Vec<ToolCallDelta>,
}

/// vLLM's id for a tool call whose parser gave none: `chatcmpl-tool-` + 16 hex digits.
pub fn random_tool_call_id() -> String {
    format!("chatcmpl-tool-{:016x}", rand::random::<u64>())
}
