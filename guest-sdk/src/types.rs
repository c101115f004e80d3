//! Plain Rust mirrors of the WIT records (see `wit/plugins.wit` for what each field means).

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PluginInfo {
    pub name: String,
    pub version: String,
    pub needs_special_tokens: bool,
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RenderOptions {
    pub add_generation_prompt: bool,
    pub reasoning_effort: Option<String>,
    /// JSON object text.
    pub extra: String,
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Rendered {
    pub prompt: String,
    pub token_ids: Option<Vec<u32>>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RequestContext {
    /// JSON array text.
    pub tools: String,
    /// JSON object text.
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

impl ReasoningDelta {
    pub fn is_empty(&self) -> bool {
        self.reasoning.is_empty() && self.content.is_empty()
    }
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

impl ToolDelta {
    pub fn is_empty(&self) -> bool {
        self.content.is_empty() && self.tool_calls.is_empty()
    }
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RequestInfo {
    pub request_id: u64,
    pub tenant: String,
    pub model: String,
    pub prompt_tokens: u32,
    /// JSON object text.
    pub params: String,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Rejection {
    pub status: u16,
    pub message: String,
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Rewrite {
    pub max_tokens_cap: Option<u32>,
    pub add_stop: Vec<String>,
    pub model: Option<String>,
    /// JSON object text of parameter overrides, or "".
    pub params: String,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Decision {
    Allow,
    Reject(Rejection),
    Rewrite(Rewrite),
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Usage {
    pub prompt_tokens: u32,
    pub completion_tokens: u32,
    pub finish_reason: String,
}
