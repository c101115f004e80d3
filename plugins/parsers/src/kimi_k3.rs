//! `kimi_k3` reasoning and tool parsers for Kimi K3's XTML output (vLLM 0.33's
//! `kimi_k3_reasoning_parser.py` / `kimi_k3_tool_parser.py`; docs/formats.md §4.2):
//!
//! `…reasoning<|close|>think<|sep|><|open|>response<|sep|>…<|close|>response<|sep|>`
//! `<|open|>tools<|sep|><|open|>call tool="NAME" index="1"<|sep|><|open|>argument key="city" type="string"<|sep|>Beijing<|close|>argument<|sep|><|close|>call<|sep|><|close|>tools<|sep|><|close|>message<|sep|>`
//!
//! `<|open|>`, `<|close|>`, `<|sep|>` are special tokens; tag names and attributes are text.
//! The generation prompt already opens the think channel, so output without an open marker is
//! reasoning from offset 0. After the think channel, the reasoning parser hands the text on raw
//! when the request offers tools (the tool parser unwraps it), else it unwraps the response
//! channel itself, as vLLM does. Markers are matched exactly as the server detokenizes them
//! (no spaces between special tokens); vLLM also tolerates `<|open|> think <|sep|>`.
//!
//! Whole-output parsing is vLLM's; streams are incremental state machines over
//! [`Scanner`](crate::scan::Scanner) whose assembled output equals it, with two documented
//! differences a stream cannot undo: a call still open when generation stops was already
//! streamed (vLLM drops it), and non-whitespace text before a late `<|open|>think<|sep|>` /
//! `<|open|>response<|sep|>` was already sent (vLLM discards it).

use serde_json::Value;
use wasmserve_guest::{
    Plugin, PluginInfo, ReasoningDelta, ReasoningParser, ReasoningResult, ReasoningStream, RequestContext, ToolCall,
    ToolCallDelta, ToolDelta, ToolParser, ToolResult, ToolStream,
};

use crate::scan::{flush_into, scan_into, Piece, Scanner};

pub const THINK_OPEN: &str = "<|open|>think<|sep|>";
pub const THINK_CLOSE: &str = "<|close|>think<|sep|>";
pub const RESPONSE_OPEN: &str = "<|open|>response<|sep|>";
pub const RESPONSE_CLOSE: &str = "<|close|>response<|sep|>";
pub const MESSAGE_CLOSE: &str = "<|close|>message<|sep|>";
pub const TOOLS_OPEN: &str = "<|open|>tools<|sep|>";
pub const TOOLS_CLOSE: &str = "<|close|>tools<|sep|>";
pub const OPEN: &str = "<|open|>";
pub const SEP: &str = "<|sep|>";
pub const CALL_CLOSE: &str = "<|close|>call<|sep|>";
pub const ARG_CLOSE: &str = "<|close|>argument<|sep|>";

/// vLLM: `thinking` kwarg, else `enable_thinking`, default on.
fn thinking(ctx: &RequestContext) -> bool {
    let kw = crate::kwargs(ctx);
    match kw.get("thinking") {
        Some(v) if !v.is_null() => crate::truthy(Some(v)).unwrap_or(true),
        _ => crate::truthy(kw.get("enable_thinking")).unwrap_or(true),
    }
}

/// Whether the tool parser will see this request's content (tools offered and not
/// `tool_choice: "none"`; the host passes an empty list otherwise).
fn tools_offered(ctx: &RequestContext) -> bool {
    matches!(serde_json::from_str::<Value>(&ctx.tools), Ok(Value::Array(a)) if !a.is_empty())
}

/// vLLM `_strip_content_wrapper`: the response channel's body (to its close or the end), or
/// the text without stray response markers; `<|close|>message<|sep|>` removed.
fn strip_content_wrapper(text: &str) -> String {
    let body = match text.find(RESPONSE_OPEN) {
        Some(o) => {
            let after = &text[o + RESPONSE_OPEN.len()..];
            after.find(RESPONSE_CLOSE).map_or(after, |c| &after[..c]).to_string()
        }
        None => text.replace(RESPONSE_OPEN, "").replace(RESPONSE_CLOSE, ""),
    };
    body.replace(MESSAGE_CLOSE, "")
}

fn content_after_reasoning(text: &str, ctx: &RequestContext) -> Option<String> {
    let c = if tools_offered(ctx) { text.to_string() } else { strip_content_wrapper(text) };
    Some(c).filter(|c| !c.is_empty())
}

/// vLLM `KimiK3ReasoningParser.extract_reasoning`.
pub fn parse_reasoning(text: &str, ctx: &RequestContext) -> ReasoningResult {
    if !thinking(ctx) {
        return ReasoningResult { reasoning: None, content: content_after_reasoning(text, ctx) };
    }
    let open = text.find(THINK_OPEN);
    let start = open.map_or(0, |o| o + THINK_OPEN.len());
    let close = text[start..].find(THINK_CLOSE).map(|c| start + c);
    if open.is_none() && close.is_none() && text.contains(RESPONSE_OPEN) {
        return ReasoningResult { reasoning: None, content: content_after_reasoning(text, ctx) };
    }
    match close {
        Some(c) => ReasoningResult {
            reasoning: Some(text[start..c].to_string()).filter(|r| !r.is_empty()),
            content: content_after_reasoning(&text[c + THINK_CLOSE.len()..], ctx),
        },
        None => ReasoningResult { reasoning: Some(text[start..].to_string()).filter(|r| !r.is_empty()), content: None },
    }
}

/// Unwraps the response channel from streamed content the way [`strip_content_wrapper`] does
/// for the whole text (used by both parsers: the reasoning parser when no tools are offered,
/// the tool parser before the tools section).
#[derive(Default)]
struct Unwrap {
    state: UnwrapState,
    /// Whitespace before a response-open marker, dropped if one follows.
    held_ws: String,
}

#[derive(Default, Clone, Copy, PartialEq, Eq)]
enum UnwrapState {
    /// No response-open yet: text is content, stray response markers are dropped.
    #[default]
    Before,
    Body,
    /// After the body's close: the rest is not content.
    After,
}

const UNWRAP_BEFORE: &[&str] = &[RESPONSE_OPEN, RESPONSE_CLOSE, MESSAGE_CLOSE];
const UNWRAP_BODY: &[&str] = &[RESPONSE_CLOSE, MESSAGE_CLOSE];

impl Unwrap {
    fn markers(&self) -> &'static [&'static str] {
        match self.state {
            UnwrapState::Before => UNWRAP_BEFORE,
            UnwrapState::Body => UNWRAP_BODY,
            UnwrapState::After => &[],
        }
    }

    fn text(&mut self, t: &str, out: &mut String) {
        match self.state {
            UnwrapState::Before if t.trim().is_empty() => self.held_ws.push_str(t),
            UnwrapState::Before => {
                out.push_str(&std::mem::take(&mut self.held_ws));
                out.push_str(t);
            }
            UnwrapState::Body => out.push_str(t),
            UnwrapState::After => {}
        }
    }

    fn marker(&mut self, m: &str) {
        match (self.state, m) {
            (UnwrapState::Before, RESPONSE_OPEN) => {
                self.held_ws.clear();
                self.state = UnwrapState::Body;
            }
            (UnwrapState::Body, RESPONSE_CLOSE) => self.state = UnwrapState::After,
            _ => {} // stray markers are removed
        }
    }

    fn finish(&mut self, out: &mut String) {
        out.push_str(&std::mem::take(&mut self.held_ws));
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum RState {
    /// Nothing seen yet: an open marker may still come (and is dropped), or a response-open
    /// that says there is no think channel at all.
    Start,
    Reasoning,
    Content,
}

const R_START: &[&str] = &[THINK_OPEN, THINK_CLOSE, RESPONSE_OPEN];
const R_REASONING: &[&str] = &[THINK_CLOSE];

pub struct K3ReasoningStream {
    raw_content: bool,
    state: RState,
    scan: Scanner,
    unwrap: Unwrap,
    /// Nothing was emitted yet (a response-open here means "no think channel").
    fresh: bool,
}

impl K3ReasoningStream {
    pub fn new(ctx: &RequestContext) -> Self {
        let thinking = thinking(ctx);
        Self {
            raw_content: tools_offered(ctx),
            state: if thinking { RState::Start } else { RState::Content },
            scan: Scanner::default(),
            unwrap: Unwrap::default(),
            fresh: true,
        }
    }

    fn markers(&self) -> &'static [&'static str] {
        match self.state {
            RState::Start => R_START,
            RState::Reasoning => R_REASONING,
            RState::Content if self.raw_content => &[],
            RState::Content => self.unwrap.markers(),
        }
    }

    fn content_text(&mut self, t: &str, out: &mut ReasoningDelta) {
        if self.raw_content {
            out.content.push_str(t);
        } else {
            self.unwrap.text(t, &mut out.content);
        }
    }

    fn piece(&mut self, p: Piece, out: &mut ReasoningDelta) {
        let markers = self.markers();
        match p {
            Piece::Text(t) => match self.state {
                RState::Start | RState::Reasoning => {
                    self.fresh = false;
                    out.reasoning.push_str(t);
                }
                RState::Content => self.content_text(t, out),
            },
            Piece::Marker(i) => match (self.state, markers[i]) {
                (RState::Start, THINK_OPEN) => self.state = RState::Reasoning,
                (RState::Start | RState::Reasoning, THINK_CLOSE) => self.state = RState::Content,
                (RState::Start, _) if self.fresh => {
                    // Response channel first: no think channel, all of it is content.
                    self.state = RState::Content;
                    self.content_marker(RESPONSE_OPEN, out);
                }
                // A response-open after reasoning text: still reasoning (vLLM waits for the close).
                (RState::Start, m) => out.reasoning.push_str(m),
                (_, m) => self.content_marker(m, out),
            },
        }
    }

    fn content_marker(&mut self, m: &str, out: &mut ReasoningDelta) {
        if self.raw_content {
            out.content.push_str(m);
        } else {
            self.unwrap.marker(m);
        }
    }
}

impl ReasoningStream for K3ReasoningStream {
    fn feed(&mut self, text: &str, _token_ids: &[u32]) -> ReasoningDelta {
        let mut out = ReasoningDelta::default();
        scan_into(self, |s| &mut s.scan, text, Self::markers, |s, p| s.piece(p, &mut out));
        out
    }

    fn finish(&mut self) -> ReasoningDelta {
        let mut out = ReasoningDelta::default();
        flush_into(self, |s| &mut s.scan, |s, p| s.piece(p, &mut out));
        if self.state == RState::Content && !self.raw_content {
            self.unwrap.finish(&mut out.content);
        }
        out
    }
}

pub struct KimiK3Reasoning;

impl Plugin for KimiK3Reasoning {
    fn info() -> PluginInfo {
        PluginInfo { name: "kimi_k3".into(), version: env!("CARGO_PKG_VERSION").into(), needs_special_tokens: true }
    }
    fn configure(_config: &str) -> Result<Self, String> {
        Ok(KimiK3Reasoning)
    }
}

impl ReasoningParser for KimiK3Reasoning {
    type Stream = K3ReasoningStream;
    fn stream(&self, ctx: &RequestContext) -> K3ReasoningStream {
        K3ReasoningStream::new(ctx)
    }
    fn parse(&self, text: &str, ctx: &RequestContext) -> ReasoningResult {
        parse_reasoning(text, ctx)
    }
}

// ---------------------------------------------------------------------------------------------
// Tool calls

/// vLLM `_attrs`: every `key="value"` (`\w+` keys), values un-escaped (`&quot;` then `&amp;`).
pub fn attrs(s: &str) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut from = 0;
    while let Some(p) = s[from..].find("=\"").map(|p| from + p) {
        let key_start = s[from..p]
            .char_indices()
            .rev()
            .take_while(|(_, c)| c.is_alphanumeric() || *c == '_')
            .last()
            .map(|(i, _)| from + i);
        let vstart = p + 2;
        let Some(vlen) = s[vstart..].find('"') else { break };
        match key_start {
            Some(k) => {
                let v = s[vstart..vstart + vlen].replace("&quot;", "\"").replace("&amp;", "&");
                out.push((s[k..p].to_string(), v));
                from = vstart + vlen + 1;
            }
            // `="` without a key before it: the regex moves on one char past the `=`.
            None => from = p + 1,
        }
    }
    out
}

fn attr<'a>(a: &'a [(String, String)], k: &str) -> Option<&'a str> {
    // A dict built from the matches: the last value of a repeated key wins.
    a.iter().rev().find(|(key, _)| key == k).map(|(_, v)| v.as_str())
}

/// `<|open|>` tag header `NAME attrs` (the text before `<|sep|>`): the attrs when NAME matches
/// (`\s*NAME\s+attrs`, vLLM's call/argument regexes).
fn header_attrs<'a>(header: &'a str, name: &str) -> Option<&'a str> {
    let rest = header.trim_start().strip_prefix(name)?;
    let attrs = rest.trim_start();
    (attrs.len() < rest.len()).then_some(attrs)
}

/// One argument's value as vLLM types it: strings raw, other types JSON-decoded (raw text when
/// that fails).
fn arg_value(ty: &str, raw: &str) -> Value {
    if ty == "string" {
        return Value::String(raw.to_string());
    }
    serde_json::from_str(raw).unwrap_or_else(|_| Value::String(raw.to_string()))
}

/// vLLM `_decode_call`: (name, arguments JSON), None without a tool name.
fn decode_call(call_attrs: &str, body: &str) -> Option<(String, String)> {
    let a = attrs(call_attrs);
    let name = attr(&a, "tool").unwrap_or("").to_string();
    let mut args = serde_json::Map::new();
    let mut rest = body;
    // finditer over `<|open|>\s*argument\s+ATTRS<|sep|>VAL<|close|>argument<|sep|>`.
    while let Some(o) = rest.find(OPEN) {
        let after = &rest[o + OPEN.len()..];
        let parsed = after.find(SEP).and_then(|s| {
            let arg_attrs = header_attrs(&after[..s], "argument")?;
            let val_start = &after[s + SEP.len()..];
            let e = val_start.find(ARG_CLOSE)?;
            Some((arg_attrs, &val_start[..e], &val_start[e + ARG_CLOSE.len()..]))
        });
        match parsed {
            Some((arg_attrs, val, next)) => {
                let aa = attrs(arg_attrs);
                let key = attr(&aa, "key").unwrap_or("").to_string();
                let ty = attr(&aa, "type").unwrap_or("string");
                args.insert(key, arg_value(ty, val));
                rest = next;
            }
            None => rest = after,
        }
    }
    if name.is_empty() {
        return None;
    }
    Some((name, crate::pyjson::dumps(&Value::Object(args), None)))
}

/// The calls in a tools section (vLLM's call regex, finditer).
fn section_calls(section: &str) -> Vec<(String, String)> {
    let mut calls = Vec::new();
    let mut rest = section;
    while let Some(o) = rest.find(OPEN) {
        let after = &rest[o + OPEN.len()..];
        let parsed = after.find(SEP).and_then(|s| {
            let call_attrs = header_attrs(&after[..s], "call")?;
            let body_start = &after[s + SEP.len()..];
            let e = body_start.find(CALL_CLOSE)?;
            Some((call_attrs, &body_start[..e], &body_start[e + CALL_CLOSE.len()..]))
        });
        match parsed {
            Some((call_attrs, body, next)) => {
                calls.extend(decode_call(call_attrs, body));
                rest = next;
            }
            None => rest = after,
        }
    }
    calls
}

/// vLLM `_strip_response_content`.
fn strip_response_content(text: &str) -> Option<String> {
    let t = match text.find(RESPONSE_OPEN) {
        Some(o) => {
            let after = &text[o + RESPONSE_OPEN.len()..];
            after.find(RESPONSE_CLOSE).map_or(after, |c| &after[..c]).to_string()
        }
        None => text.replace(RESPONSE_CLOSE, ""),
    };
    Some(t.replace(MESSAGE_CLOSE, "")).filter(|t| !t.is_empty())
}

/// vLLM `_content`: the first complete response channel anywhere, else the text before the tools.
fn content(text: &str, before: &str) -> Option<String> {
    if let Some(o) = text.find(RESPONSE_OPEN) {
        let after = &text[o + RESPONSE_OPEN.len()..];
        if let Some(c) = after.find(RESPONSE_CLOSE) {
            return Some(after[..c].to_string()).filter(|c| !c.is_empty());
        }
    }
    strip_response_content(before)
}

/// `functions.NAME:IDX`, IDX the call's 0-based position in this message (the alias vLLM's K3
/// renderer resolves tool results by; the model's 1-based `index` attribute is position + 1).
fn call_id(name: &str, position: u32) -> String {
    format!("functions.{name}:{position}")
}

/// vLLM `KimiK3ToolParser.extract_tool_calls` (and `KimiK3Parser`: no calls ⇒ the parser's content).
pub fn parse_tools(text: &str) -> ToolResult {
    let Some(o) = text.find(TOOLS_OPEN) else { return ToolResult { content: content(text, text), tool_calls: vec![] } };
    let before = &text[..o];
    let start = o + TOOLS_OPEN.len();
    let section = text[start..].find(TOOLS_CLOSE).map_or(&text[start..], |c| &text[start..start + c]);
    let tool_calls = section_calls(section)
        .into_iter()
        .enumerate()
        .map(|(i, (name, arguments))| ToolCall { id: call_id(&name, i as u32), name, arguments })
        .collect();
    ToolResult { content: content(text, before), tool_calls }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum TState {
    /// Before the tools section (response channel unwrapped).
    Content,
    /// Inside the tools section, between calls.
    Section,
    /// After `<|open|>` in the section: the tag header up to `<|sep|>`.
    CallHeader,
    /// Inside a call, between arguments.
    Call,
    /// After `<|open|>` in a call: the tag header up to `<|sep|>`.
    ArgHeader,
    ArgValue,
    /// After the tools section: nothing more is content or calls.
    Done,
}

const T_SECTION: &[&str] = &[OPEN, TOOLS_CLOSE];
const T_HEADER: &[&str] = &[SEP, TOOLS_CLOSE];
const T_CALL: &[&str] = &[OPEN, CALL_CLOSE, TOOLS_CLOSE];
const T_ARG_HEADER: &[&str] = &[SEP, CALL_CLOSE, TOOLS_CLOSE];
const T_ARG_VALUE: &[&str] = &[ARG_CLOSE, CALL_CLOSE, TOOLS_CLOSE];

/// The call being streamed.
struct OpenCall {
    /// Stream index, when the call has a name (nameless calls are parsed but never sent).
    index: Option<u32>,
    /// Arguments JSON sent so far (`{` + complete arguments).
    args_open: bool,
    /// The argument being read: its type and, for non-strings, the raw value so far.
    arg_type: String,
    raw: String,
    /// Argument prefix (`{"key": ` or `, "key": `) not sent yet (an unclosed argument is
    /// dropped, so a non-string one is only sent when it closes).
    pending_prefix: String,
    /// What to send if this argument turns out unclosed: nothing can be taken back, so
    /// string values are streamed and closed with `"` at the end.
    string_open: bool,
}

pub struct K3ToolStream {
    state: TState,
    scan: Scanner,
    unwrap: Unwrap,
    header: String,
    call: Option<OpenCall>,
    /// Calls with a name sent so far.
    sent: u32,
}

impl Default for K3ToolStream {
    fn default() -> Self {
        Self {
            state: TState::Content,
            scan: Scanner::default(),
            unwrap: Unwrap::default(),
            header: String::new(),
            call: None,
            sent: 0,
        }
    }
}

const T_CONTENT_BEFORE: &[&str] = &[TOOLS_OPEN, RESPONSE_OPEN, RESPONSE_CLOSE, MESSAGE_CLOSE];
const T_CONTENT_BODY: &[&str] = &[TOOLS_OPEN, RESPONSE_CLOSE, MESSAGE_CLOSE];
const T_CONTENT_AFTER: &[&str] = &[TOOLS_OPEN];

impl K3ToolStream {
    fn markers(&self) -> &'static [&'static str] {
        match self.state {
            TState::Content => match self.unwrap.state {
                UnwrapState::Before => T_CONTENT_BEFORE,
                UnwrapState::Body => T_CONTENT_BODY,
                UnwrapState::After => T_CONTENT_AFTER,
            },
            TState::Section => T_SECTION,
            TState::CallHeader => T_HEADER,
            TState::Call => T_CALL,
            TState::ArgHeader => T_ARG_HEADER,
            TState::ArgValue => T_ARG_VALUE,
            TState::Done => &[],
        }
    }

    fn send_args(&self, index: Option<u32>, s: String, out: &mut ToolDelta) {
        if let (Some(index), false) = (index, s.is_empty()) {
            out.tool_calls.push(ToolCallDelta { index, id: None, name: None, arguments: s });
        }
    }

    fn start_call(&mut self, header: &str, out: &mut ToolDelta) {
        let Some(call_attrs) = header_attrs(header, "call") else {
            self.state = TState::Section;
            return;
        };
        let a = attrs(call_attrs);
        let name = attr(&a, "tool").unwrap_or("");
        let index = (!name.is_empty()).then(|| {
            let i = self.sent;
            out.tool_calls.push(ToolCallDelta {
                index: i,
                id: Some(call_id(name, i)),
                name: Some(name.to_string()),
                arguments: String::new(),
            });
            self.sent += 1;
            i
        });
        self.call = Some(OpenCall {
            index,
            args_open: false,
            arg_type: String::new(),
            raw: String::new(),
            pending_prefix: String::new(),
            string_open: false,
        });
        self.state = TState::Call;
    }

    fn start_arg(&mut self, header: &str) {
        let Some(arg_attrs) = header_attrs(header, "argument") else {
            self.state = TState::Call;
            return;
        };
        let a = attrs(arg_attrs);
        let key = attr(&a, "key").unwrap_or("").to_string();
        let ty = attr(&a, "type").unwrap_or("string").to_string();
        let c = self.call.as_mut().expect("an argument is inside a call");
        let mut prefix = String::from(if c.args_open { ", " } else { "{" });
        prefix.push_str(&crate::pyjson::dumps(&Value::String(key), None));
        prefix.push_str(": ");
        c.arg_type = ty;
        c.raw.clear();
        c.pending_prefix = prefix;
        c.string_open = false;
        self.state = TState::ArgValue;
    }

    fn arg_text(&mut self, t: &str, out: &mut ToolDelta) {
        let c = self.call.as_mut().expect("an argument is inside a call");
        if c.arg_type != "string" {
            c.raw.push_str(t);
            return;
        }
        // A string value streams as it comes: JSON-escaped, without its closing quote.
        let mut s = std::mem::take(&mut c.pending_prefix);
        if !c.string_open {
            s.push('"');
            c.string_open = true;
            c.args_open = true;
        }
        let quoted = crate::pyjson::dumps(&Value::String(t.to_string()), None);
        s.push_str(&quoted[1..quoted.len() - 1]);
        let index = c.index;
        self.send_args(index, s, out);
    }

    fn end_arg(&mut self, out: &mut ToolDelta) {
        let c = self.call.as_mut().expect("an argument is inside a call");
        let mut s = std::mem::take(&mut c.pending_prefix);
        if c.arg_type == "string" {
            if !c.string_open {
                s.push('"'); // empty string value
            }
            s.push('"');
        } else {
            s.push_str(&crate::pyjson::dumps(&arg_value(&c.arg_type, &c.raw), None));
        }
        c.args_open = true;
        c.string_open = false;
        let index = c.index;
        self.send_args(index, s, out);
        self.state = TState::Call;
    }

    /// Ends the open call: `}` (or `{}`); an argument still open is closed so the arguments
    /// stay valid JSON (a string already streamed cannot be taken back).
    fn end_call(&mut self, out: &mut ToolDelta) {
        let Some(c) = self.call.take() else { return };
        let mut s = String::new();
        if c.string_open {
            s.push('"');
        }
        s.push_str(if c.args_open { "}" } else { "{}" });
        self.send_args(c.index, s, out);
    }

    fn piece(&mut self, p: Piece, out: &mut ToolDelta) {
        let markers = self.markers();
        match p {
            Piece::Text(t) => match self.state {
                TState::Content => self.unwrap.text(t, &mut out.content),
                TState::CallHeader | TState::ArgHeader => self.header.push_str(t),
                TState::ArgValue => self.arg_text(t, out),
                TState::Section | TState::Call | TState::Done => {}
            },
            Piece::Marker(i) => match (self.state, markers[i]) {
                (TState::Content, TOOLS_OPEN) => self.state = TState::Section,
                (TState::Content, m) => self.unwrap.marker(m),
                (_, TOOLS_CLOSE) => {
                    // The section ends here; a call not closed before it is not a call.
                    if self.call.is_some() {
                        if self.state == TState::ArgValue {
                            self.call.as_mut().unwrap().pending_prefix.clear();
                        }
                        self.end_call(out);
                    }
                    self.state = TState::Done;
                }
                (TState::Section, _) => {
                    self.header.clear();
                    self.state = TState::CallHeader;
                }
                (TState::CallHeader, _) => {
                    let h = std::mem::take(&mut self.header);
                    self.start_call(&h, out);
                }
                (TState::Call, OPEN) => {
                    self.header.clear();
                    self.state = TState::ArgHeader;
                }
                (TState::ArgHeader, SEP) => {
                    let h = std::mem::take(&mut self.header);
                    self.start_arg(&h);
                }
                (TState::ArgValue, ARG_CLOSE) => self.end_arg(out),
                (TState::Call | TState::ArgHeader | TState::ArgValue, _) => {
                    // CALL_CLOSE: an argument left open is not an argument.
                    if let Some(c) = self.call.as_mut() {
                        c.pending_prefix.clear();
                    }
                    self.end_call(out);
                    self.state = TState::Section;
                }
                (TState::Done, _) => {}
            },
        }
    }
}

impl ToolStream for K3ToolStream {
    fn feed(&mut self, text: &str, _token_ids: &[u32]) -> ToolDelta {
        let mut out = ToolDelta::default();
        scan_into(self, |s| &mut s.scan, text, Self::markers, |s, p| s.piece(p, &mut out));
        out
    }

    fn finish(&mut self) -> ToolDelta {
        let mut out = ToolDelta::default();
        flush_into(self, |s| &mut s.scan, |s, p| s.piece(p, &mut out));
        if self.state == TState::ArgValue {
            if let Some(c) = self.call.as_mut() {
                c.pending_prefix.clear();
            }
        }
        self.end_call(&mut out);
        // Whitespace-only content goes with no calls only (vLLM drops it next to calls).
        if self.sent == 0 {
            self.unwrap.finish(&mut out.content);
        }
        out
    }
}

pub struct KimiK3Tools;

impl Plugin for KimiK3Tools {
    fn info() -> PluginInfo {
        PluginInfo { name: "kimi_k3".into(), version: env!("CARGO_PKG_VERSION").into(), needs_special_tokens: true }
    }
    fn configure(_config: &str) -> Result<Self, String> {
        Ok(KimiK3Tools)
    }
}

impl ToolParser for KimiK3Tools {
    type Stream = K3ToolStream;
    fn stream(&self, _ctx: &RequestContext) -> K3ToolStream {
        K3ToolStream::default()
    }
    fn parse(&self, text: &str, _ctx: &RequestContext) -> ToolResult {
        parse_tools(text)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn attributes_are_unescaped_like_vllm() {
        assert_eq!(
            attrs(r#"tool="a&amp;b" index="1""#),
            vec![("tool".into(), "a&b".into()), ("index".into(), "1".into())]
        );
        assert_eq!(attrs(r#"key="q&quot;k" type="array""#)[0].1, "q\"k");
        // `&amp;quot;` is `&quot;` written escaped: un-escaping `&quot;` first keeps it.
        assert_eq!(attrs(r#"key="&amp;quot;""#)[0].1, "&quot;");
        assert_eq!(attrs(r#" ="x" k="v""#), vec![("k".into(), "v".into())]);
    }
}
