//! `kimi_k2` tool parser (vLLM's `kimi_k2` parser engine config):
//!
//! `<|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>{json}<|tool_call_end|>…<|tool_calls_section_end|>`
//!
//! The header is the OpenAI tool-call id as the model wrote it (`functions.get_weather:0`);
//! the name is the part before `:` without `functions.`. Arguments are the raw text between
//! the markers, trimmed (`{}` when empty). Content is the text before the section; text inside
//! the section outside calls, and after it, is dropped. Whitespace-only content next to tool
//! calls is dropped.
//!
//! Streaming sends a call's id and name as soon as its header is complete and then its
//! arguments as they arrive (leading whitespace skipped, trailing whitespace held until more
//! text follows), so the assembled stream equals the whole-output result.

use wasmserve_guest::{
    Plugin, PluginInfo, RequestContext, ToolCall, ToolCallDelta, ToolDelta, ToolParser, ToolResult, ToolStream,
};

use crate::scan::{flush_into, scan_into, Piece, Scanner};

pub const SECTION_BEGIN: &str = "<|tool_calls_section_begin|>";
pub const SECTION_END: &str = "<|tool_calls_section_end|>";
pub const CALL_BEGIN: &str = "<|tool_call_begin|>";
pub const ARG_BEGIN: &str = "<|tool_call_argument_begin|>";
pub const CALL_END: &str = "<|tool_call_end|>";

const IN_CONTENT: &[&str] = &[SECTION_BEGIN];
const IN_SECTION: &[&str] = &[CALL_BEGIN, SECTION_END];
const IN_HEADER: &[&str] = &[ARG_BEGIN, CALL_END, SECTION_END];
const IN_ARGS: &[&str] = &[CALL_END, SECTION_END];

/// `(id, name)` from a call header: vLLM matches `(?P<id>.+:\d+)` at the start of the trimmed
/// header (greedy, so the last `:digits` that leaves a non-empty prefix ends the id).
pub fn id_and_name(header: &str) -> Option<(String, String)> {
    let h = header.trim();
    let b = h.as_bytes();
    // Longest prefix ending in ":" + digits, with at least one char before the colon.
    let mut best = None;
    for (i, &c) in b.iter().enumerate() {
        if c == b':' && i >= 1 {
            let digits = b[i + 1..].iter().take_while(|d| d.is_ascii_digit()).count();
            if digits > 0 && !h[..i].contains('\n') {
                best = Some(i + 1 + digits);
            }
        }
    }
    let id = &h[..best?];
    let name = id.split(':').next().unwrap_or("");
    let name = name.strip_prefix("functions.").unwrap_or(name);
    (!name.is_empty()).then(|| (id.to_string(), name.to_string()))
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum State {
    Content,
    Section,
    Header,
    Args,
}

pub struct KimiStream {
    state: State,
    scan: Scanner,
    header: String,
    /// Index of the call being streamed, when its header was valid.
    current: Option<u32>,
    calls: u32,
    args_sent: bool,
    held_args_ws: String,
    content_started: bool,
    held_ws: String,
}

impl Default for KimiStream {
    fn default() -> Self {
        Self {
            state: State::Content,
            scan: Scanner::default(),
            header: String::new(),
            current: None,
            calls: 0,
            args_sent: false,
            held_args_ws: String::new(),
            content_started: false,
            held_ws: String::new(),
        }
    }
}

impl KimiStream {
    fn markers(&self) -> &'static [&'static str] {
        match self.state {
            State::Content => IN_CONTENT,
            State::Section => IN_SECTION,
            State::Header => IN_HEADER,
            State::Args => IN_ARGS,
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

    fn args(&mut self, t: &str, out: &mut ToolDelta) {
        let Some(index) = self.current else { return };
        let t = if self.args_sent { t } else { t.trim_start() };
        let trimmed = t.trim_end();
        if !trimmed.is_empty() {
            let mut a = std::mem::take(&mut self.held_args_ws);
            a.push_str(trimmed);
            out.tool_calls.push(ToolCallDelta { index, id: None, name: None, arguments: a });
            self.args_sent = true;
        }
        self.held_args_ws.push_str(&t[trimmed.len()..]);
    }

    fn start_args(&mut self, out: &mut ToolDelta) {
        self.current = None;
        if let Some((id, name)) = id_and_name(&std::mem::take(&mut self.header)) {
            out.tool_calls.push(ToolCallDelta {
                index: self.calls,
                id: Some(id),
                name: Some(name),
                arguments: String::new(),
            });
            self.current = Some(self.calls);
            self.calls += 1;
            self.held_ws.clear();
        }
        self.args_sent = false;
        self.held_args_ws.clear();
    }

    fn end_call(&mut self, out: &mut ToolDelta) {
        if let Some(index) = self.current.take() {
            if !self.args_sent {
                out.tool_calls.push(ToolCallDelta { index, id: None, name: None, arguments: "{}".into() });
            }
        }
    }

    fn piece(&mut self, p: Piece, out: &mut ToolDelta) {
        let markers = self.markers();
        match p {
            Piece::Text(t) => match self.state {
                State::Content => self.content(t, out),
                State::Section => {}
                State::Header => self.header.push_str(t),
                State::Args => self.args(t, out),
            },
            Piece::Marker(i) => match (self.state, markers[i]) {
                (State::Content, _) => self.state = State::Section,
                (State::Section, CALL_BEGIN) => self.state = State::Header,
                (State::Section, _) => {}
                (State::Header, ARG_BEGIN) => {
                    self.start_args(out);
                    self.state = State::Args;
                }
                // A call without arguments marker is dropped (vLLM never names it).
                (State::Header, _) => {
                    self.header.clear();
                    self.state = State::Section;
                }
                (State::Args, _) => {
                    self.end_call(out);
                    self.state = State::Section;
                }
            },
        }
    }
}

impl ToolStream for KimiStream {
    fn feed(&mut self, text: &str, _token_ids: &[u32]) -> ToolDelta {
        let mut out = ToolDelta::default();
        scan_into(self, |s| &mut s.scan, text, Self::markers, |s, p| s.piece(p, &mut out));
        out
    }

    fn finish(&mut self) -> ToolDelta {
        let mut out = ToolDelta::default();
        flush_into(self, |s| &mut s.scan, |s, p| s.piece(p, &mut out));
        if self.state == State::Args {
            self.end_call(&mut out);
        }
        if self.calls == 0 && !self.held_ws.is_empty() {
            out.content.push_str(&std::mem::take(&mut self.held_ws));
        }
        out
    }
}

/// Whole output: the stream run over the text in one delta, assembled.
pub fn parse(text: &str) -> ToolResult {
    let r = wasmserve_guest::harness::run_tools(KimiStream::default(), &[text])
        .expect("the kimi stream keeps the delta contract");
    let content = if r.tool_calls.is_empty() { Some(text.to_string()).filter(|t| !t.is_empty()) } else { r.content };
    ToolResult {
        content,
        tool_calls: r
            .tool_calls
            .into_iter()
            .map(|c| ToolCall { id: c.id, name: c.name, arguments: c.arguments })
            .collect(),
    }
}

pub struct KimiK2;

impl Plugin for KimiK2 {
    fn info() -> PluginInfo {
        PluginInfo { name: "kimi_k2".into(), version: env!("CARGO_PKG_VERSION").into(), needs_special_tokens: true }
    }
    fn configure(_config: &str) -> Result<Self, String> {
        Ok(KimiK2)
    }
}

impl ToolParser for KimiK2 {
    type Stream = KimiStream;
    fn stream(&self, _ctx: &RequestContext) -> KimiStream {
        KimiStream::default()
    }
    fn parse(&self, text: &str, _ctx: &RequestContext) -> ToolResult {
        parse(text)
    }
}
