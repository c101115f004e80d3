//! Reasoning and tool-call plugins applied to chat completions, in the order vLLM applies its
//! parsers: the reasoning parser splits the model text into reasoning and content, then the
//! tool parser (only when the request offers tools and does not say `tool_choice: "none"`)
//! takes tool calls out of the content.

use std::sync::Arc;

use serde_json::{json, Value};

use super::error::PluginError;
use super::parsers::{self, ReasoningSession, ToolSession};
use super::registry::{Deployment, Kind, Pools, Registry};
use super::{random_tool_call_id, RequestContext};

/// The parser deployments serving one request, pinned for its lifetime (a hot swap does not
/// change parsers under a running request).
#[derive(Clone)]
pub struct ChatParsers {
    reasoning: Option<Arc<Deployment>>,
    tool: Option<Arc<Deployment>>,
    ctx: RequestContext,
}

impl ChatParsers {
    /// `tools` is the request's tool list when tool parsing applies (present, non-empty, and
    /// `tool_choice` not "none").
    pub fn select(
        reg: &Registry,
        model: &str,
        tenant: &str,
        tools: Option<&[Value]>,
        kwargs: Option<&serde_json::Map<String, Value>>,
    ) -> Option<Self> {
        let reasoning = reg.select(Kind::ReasoningParser, model, tenant);
        let tool = tools.and_then(|_| reg.select(Kind::ToolParser, model, tenant));
        if reasoning.is_none() && tool.is_none() {
            return None;
        }
        let ctx = RequestContext {
            tools: Value::Array(tools.map(<[Value]>::to_vec).unwrap_or_default()).to_string(),
            template_kwargs: kwargs.map_or("{}".into(), |k| Value::Object(k.clone()).to_string()),
            history_tool_calls: 0,
        };
        Some(Self { reasoning, tool, ctx })
    }

    /// Parsers that match special tokens need them kept in the text (vLLM sets
    /// `skip_special_tokens = false` for these parsers too).
    pub fn needs_special_tokens(&self) -> bool {
        self.reasoning.iter().chain(&self.tool).any(|d| d.info().needs_special_tokens)
    }

    /// The assistant message for a finished choice, and whether it holds tool calls.
    pub fn message(&self, text: &str) -> Result<(Value, bool), PluginError> {
        let (reasoning, content) = match self.reasoning.as_deref().map(|d| &d.pools) {
            Some(Pools::Reasoning(p)) => {
                let r = parsers::reasoning_parse(p, text, &self.ctx)?;
                (r.reasoning, r.content)
            }
            _ => (None, Some(text.to_string())),
        };
        // Both names: current vLLM clients read `reasoning`, older ones `reasoning_content`.
        let mut msg =
            json!({"role": "assistant", "content": content, "reasoning": reasoning, "reasoning_content": reasoning});
        if let Some(Pools::Tool(p)) = self.tool.as_deref().map(|d| &d.pools) {
            let r = parsers::tool_parse(p, content.as_deref().unwrap_or(""), &self.ctx)?;
            if !r.tool_calls.is_empty() {
                let calls: Vec<Value> = r
                    .tool_calls
                    .into_iter()
                    .map(|c| {
                        let id = if c.id.is_empty() { random_tool_call_id() } else { c.id };
                        json!({"id": id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}})
                    })
                    .collect();
                msg["content"] = json!(r.content.filter(|c| !c.trim().is_empty()));
                msg["tool_calls"] = Value::Array(calls);
                return Ok((msg, true));
            }
            // No calls: the tool parser's content (vLLM uses it too; Kimi K3's parser unwraps
            // the response channel here, the others return the text unchanged).
            msg["content"] = json!(r.content.filter(|c| !c.is_empty()));
        }
        Ok((msg, false))
    }

    pub fn stream(&self) -> Result<StreamParsers, PluginError> {
        let reasoning = match self.reasoning.as_deref().map(|d| &d.pools) {
            Some(Pools::Reasoning(p)) => Some(parsers::reasoning_session(p, &self.ctx)?),
            _ => None,
        };
        let tool = match self.tool.as_deref().map(|d| &d.pools) {
            Some(Pools::Tool(p)) => Some(parsers::tool_session(p, &self.ctx)?),
            _ => None,
        };
        Ok(StreamParsers { reasoning, tool, tool_calls: 0, _pinned: self.clone() })
    }
}

/// Per streamed choice: the leased sessions, fed each text delta once.
pub struct StreamParsers {
    reasoning: Option<ReasoningSession>,
    tool: Option<ToolSession>,
    tool_calls: u32,
    _pinned: ChatParsers,
}

impl StreamParsers {
    /// The OpenAI `delta` for one text delta (or the end, `last`), or None when there is
    /// nothing to send yet.
    pub fn delta(&mut self, text: &str, token_ids: &[u32], last: bool) -> Result<Option<Value>, PluginError> {
        let (mut reasoning, mut content) = (String::new(), String::new());
        match self.reasoning.as_mut() {
            Some(s) => {
                let d = s.feed(text, token_ids)?;
                reasoning.push_str(&d.reasoning);
                content.push_str(&d.content);
                if last {
                    let d = s.finish()?;
                    reasoning.push_str(&d.reasoning);
                    content.push_str(&d.content);
                }
            }
            None => content.push_str(text),
        }
        let mut calls = Vec::new();
        if let Some(s) = self.tool.as_mut() {
            let mut d = s.feed(&content, &[])?;
            if last {
                let e = s.finish()?;
                d.content.push_str(&e.content);
                d.tool_calls.extend(e.tool_calls);
            }
            content = d.content;
            for c in d.tool_calls {
                let mut v = json!({"index": c.index, "function": {"arguments": c.arguments}});
                if let Some(name) = c.name {
                    let id = c.id.filter(|i| !i.is_empty()).unwrap_or_else(random_tool_call_id);
                    v["id"] = json!(id);
                    v["type"] = json!("function");
                    v["function"]["name"] = json!(name);
                    self.tool_calls = self.tool_calls.max(c.index.saturating_add(1));
                }
                calls.push(v);
            }
        }
        let mut delta = serde_json::Map::new();
        if !reasoning.is_empty() {
            delta.insert("reasoning".into(), reasoning.clone().into());
            delta.insert("reasoning_content".into(), reasoning.into());
        }
        if !content.is_empty() {
            delta.insert("content".into(), content.into());
        }
        if !calls.is_empty() {
            delta.insert("tool_calls".into(), calls.into());
        }
        Ok((!delta.is_empty()).then_some(Value::Object(delta)))
    }

    pub fn called_tools(&self) -> bool {
        self.tool_calls > 0
    }
}
