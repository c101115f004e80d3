//! `hermes` tool parser (vLLM `Hermes2ProToolParser`, also vLLM's `qwen3_json`):
//! `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one JSON object per call.
//!
//! Whole output, as vLLM: every `<tool_call>` body (up to `</tool_call>` or the end) must parse
//! as an object with `name` and `arguments`, else there are no tool calls and all text is
//! content; content is the text before the first `<tool_call>`; `arguments` is re-serialised
//! the way Python's `json.dumps` writes it.
//!
//! Streaming: content streams as it comes (whitespace-only content is held until it is known
//! whether a tool call follows, when vLLM drops it); each call is sent when its `</tool_call>`
//! arrives, as one delta (id, name and the whole arguments), because `arguments` is the
//! re-serialised object and is only final once the body is complete. Ids are left empty: the
//! host assigns `chatcmpl-tool-…` ids as vLLM does (plugins have no randomness).
//!
//! Known streaming difference from the whole-output result: a malformed call after a valid one
//! cannot take the already-sent call back (vLLM's own streaming has the same limitation).

use serde_json::Value;
use wasmserve_guest::{
    Plugin, PluginInfo, RequestContext, ToolCall, ToolCallDelta, ToolDelta, ToolParser, ToolResult, ToolStream,
};

use crate::scan::{flush_into, scan_into, Piece, Scanner};

const START: &str = "<tool_call>";
const END: &str = "</tool_call>";
const START_ONLY: &[&str] = &[START];
const END_ONLY: &[&str] = &[END];

/// One call body → (name, arguments JSON), or None when vLLM's `json.loads` + key lookups fail.
pub fn call_from_body(body: &str) -> Option<(String, String)> {
    let v: Value = serde_json::from_str(body.trim()).ok()?;
    let o = v.as_object()?;
    let name = o.get("name")?.as_str()?.to_string();
    let args = o.get("arguments")?;
    Some((name, crate::pyjson::dumps(args, None)))
}

pub fn parse(text: &str) -> ToolResult {
    let all_content = || ToolResult { content: Some(text.to_string()), tool_calls: vec![] };
    let Some(first) = text.find(START) else { return all_content() };
    let mut calls = Vec::new();
    let mut rest = &text[first..];
    while let Some(p) = rest.find(START) {
        let body_start = &rest[p + START.len()..];
        let (body, next) = match body_start.find(END) {
            Some(e) => (&body_start[..e], &body_start[e + END.len()..]),
            None => (body_start, ""),
        };
        match call_from_body(body) {
            Some((name, arguments)) => calls.push(ToolCall { id: String::new(), name, arguments }),
            None => return all_content(),
        }
        rest = next;
    }
    let content = &text[..first];
    // vLLM's chat layer drops whitespace-only content next to tool calls.
    ToolResult { content: Some(content.to_string()).filter(|c| !c.trim().is_empty()), tool_calls: calls }
}

#[derive(PartialEq, Eq)]
enum State {
    Content,
    Body,
    /// After the first call: text between and after calls is not content.
    Between,
    /// A malformed call: everything from here on is content.
    Failed,
}

pub struct HermesStream {
    state: State,
    scan: Scanner,
    body: String,
    calls: u32,
    /// Whitespace-only content so far, held back (see module docs).
    held_ws: String,
    content_started: bool,
}

impl HermesStream {
    pub fn new() -> Self {
        Self {
            state: State::Content,
            scan: Scanner::default(),
            body: String::new(),
            calls: 0,
            held_ws: String::new(),
            content_started: false,
        }
    }

    /// A stream whose content so far was already handled by another parser (`qwen3`): whether
    /// non-whitespace content was sent, and the whitespace-only content held back.
    pub(crate) fn after_content(content_started: bool, held_ws: String) -> Self {
        Self { content_started, held_ws, ..Self::new() }
    }

    fn markers(&self) -> &'static [&'static str] {
        match self.state {
            State::Content | State::Between => START_ONLY,
            State::Body => END_ONLY,
            State::Failed => &[],
        }
    }

    fn content(&mut self, t: &str, out: &mut ToolDelta) {
        if self.content_started {
            out.content.push_str(t);
        } else if t.trim().is_empty() {
            self.held_ws.push_str(t);
        } else {
            self.content_started = true;
            out.content.push_str(&std::mem::take(&mut self.held_ws));
            out.content.push_str(t);
        }
    }

    fn end_call(&mut self, terminated: bool, out: &mut ToolDelta) {
        let body = std::mem::take(&mut self.body);
        match call_from_body(&body) {
            Some((name, arguments)) => {
                out.tool_calls.push(ToolCallDelta {
                    index: self.calls,
                    id: Some(String::new()),
                    name: Some(name),
                    arguments,
                });
                self.calls += 1;
                self.held_ws.clear();
                self.state = State::Between;
            }
            None => {
                self.content_started = true;
                out.content.push_str(&std::mem::take(&mut self.held_ws));
                out.content.push_str(START);
                out.content.push_str(&body);
                if terminated {
                    out.content.push_str(END);
                }
                self.state = State::Failed;
            }
        }
    }

    fn piece(&mut self, p: Piece, out: &mut ToolDelta) {
        match (p, &self.state) {
            (Piece::Text(t), State::Content | State::Failed) => self.content(t, out),
            (Piece::Text(_), State::Between) => {}
            (Piece::Text(t), State::Body) => self.body.push_str(t),
            (Piece::Marker(_), State::Content | State::Between) => self.state = State::Body,
            (Piece::Marker(_), State::Body) => self.end_call(true, out),
            (Piece::Marker(_), State::Failed) => unreachable!("no markers after a failure"),
        }
    }
}

impl Default for HermesStream {
    fn default() -> Self {
        Self::new()
    }
}

impl ToolStream for HermesStream {
    fn feed(&mut self, text: &str, _token_ids: &[u32]) -> ToolDelta {
        let mut out = ToolDelta::default();
        scan_into(self, |s| &mut s.scan, text, Self::markers, |s, p| s.piece(p, &mut out));
        out
    }

    fn finish(&mut self) -> ToolDelta {
        let mut out = ToolDelta::default();
        flush_into(self, |s| &mut s.scan, |s, p| s.piece(p, &mut out));
        if self.state == State::Body {
            self.end_call(false, &mut out);
        }
        if self.calls == 0 && !self.held_ws.is_empty() {
            out.content.push_str(&std::mem::take(&mut self.held_ws));
        }
        out
    }
}

pub struct Hermes;

impl Plugin for Hermes {
    fn info() -> PluginInfo {
        PluginInfo { name: "hermes".into(), version: env!("CARGO_PKG_VERSION").into(), needs_special_tokens: true }
    }
    fn configure(_config: &str) -> Result<Self, String> {
        Ok(Hermes)
    }
}

impl ToolParser for Hermes {
    type Stream = HermesStream;
    fn stream(&self, _ctx: &RequestContext) -> HermesStream {
        HermesStream::new()
    }
    fn parse(&self, text: &str, _ctx: &RequestContext) -> ToolResult {
        parse(text)
    }
}
