//! `<think>…</think>` reasoning parsers: `deepseek_r1`, `qwen3`, `kimi_k2` (vLLM names).
//!
//! vLLM 0.33 has two families with different edge behaviour, both reproduced here:
//! - `deepseek_r1` (BaseThinkingReasoningParser): text after the first `<think>`; reasoning up
//!   to the first `</think>`, the rest is content verbatim; no `</think>` means all reasoning.
//! - `qwen3`, `kimi_k2` (parser engine): start in reasoning; `<think>` is dropped inside
//!   reasoning, `</think>` ends it and is dropped again in content; an implicit end marker
//!   (`<tool_call>`, `<|tool_calls_section_begin|>`) ends reasoning and stays in the content
//!   for the tool parser. Kimi strips trailing whitespace from the reasoning. Either can be
//!   switched off per request (`enable_thinking` / `thinking` false): all text is content.

use wasmserve_guest::{
    Plugin, PluginInfo, ReasoningDelta, ReasoningParser, ReasoningResult, ReasoningStream, RequestContext,
};

use crate::scan::{flush_into, scan_into, Piece, Scanner};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Flavor {
    DeepSeekR1,
    Qwen3,
    KimiK2,
}

impl Flavor {
    fn engine(self) -> bool {
        self != Flavor::DeepSeekR1
    }
    fn rstrip(self) -> bool {
        self == Flavor::KimiK2
    }
    /// Whether the request turned thinking off (then the parser is the identity).
    fn thinking(self, ctx: &RequestContext) -> bool {
        let kw = crate::kwargs(ctx);
        match self {
            Flavor::DeepSeekR1 => true,
            Flavor::Qwen3 => crate::truthy(kw.get("enable_thinking")).unwrap_or(true),
            Flavor::KimiK2 => match (crate::truthy(kw.get("thinking")), crate::truthy(kw.get("enable_thinking"))) {
                (None, None) => true,
                (a, b) => a.unwrap_or(false) || b.unwrap_or(false),
            },
        }
    }
}

const R1_MARKERS: &[&str] = &["<think>", "</think>"];
const QWEN_MARKERS: &[&str] = &["<think>", "</think>", "<tool_call>"];
const KIMI_MARKERS: &[&str] = &["<think>", "</think>", "<|tool_calls_section_begin|>"];
const END_ONLY: &[&str] = &["</think>"];
const NONE: &[&str] = &[];

#[derive(Clone, Copy, PartialEq, Eq)]
enum State {
    /// DeepSeek-R1 before any marker: a `<think>` here is dropped.
    Start,
    Reasoning,
    Content,
}

pub struct ThinkStream {
    flavor: Flavor,
    thinking: bool,
    state: State,
    scan: Scanner,
    /// Kimi: trailing whitespace of the reasoning so far, sent only if more reasoning follows.
    held_ws: String,
}

impl ThinkStream {
    pub fn new(flavor: Flavor, ctx: &RequestContext) -> Self {
        let state = if flavor == Flavor::DeepSeekR1 { State::Start } else { State::Reasoning };
        Self { flavor, thinking: flavor.thinking(ctx), state, scan: Scanner::default(), held_ws: String::new() }
    }

    fn markers(&self) -> &'static [&'static str] {
        match (self.flavor, self.state) {
            (_, State::Content) if self.flavor.engine() => END_ONLY,
            (_, State::Content) => NONE,
            (Flavor::DeepSeekR1, State::Start) => R1_MARKERS,
            (Flavor::DeepSeekR1, _) => END_ONLY,
            (Flavor::Qwen3, _) => QWEN_MARKERS,
            (Flavor::KimiK2, _) => KIMI_MARKERS,
        }
    }

    fn reasoning_text(&mut self, t: &str, out: &mut ReasoningDelta) {
        if !self.flavor.rstrip() {
            out.reasoning.push_str(t);
            return;
        }
        let trimmed = t.trim_end();
        if !trimmed.is_empty() {
            out.reasoning.push_str(&std::mem::take(&mut self.held_ws));
            out.reasoning.push_str(trimmed);
        }
        self.held_ws.push_str(&t[trimmed.len()..]);
    }

    fn piece(&mut self, p: Piece, out: &mut ReasoningDelta) {
        let markers = self.markers();
        match p {
            Piece::Text(t) => match self.state {
                State::Content => out.content.push_str(t),
                _ => self.reasoning_text(t, out),
            },
            Piece::Marker(i) => match markers[i] {
                "<think>" => self.state = State::Reasoning,
                "</think>" if self.state == State::Content => {} // engine parsers drop a stray end
                "</think>" => {
                    self.state = State::Content;
                    self.held_ws.clear();
                }
                implicit => {
                    self.state = State::Content;
                    self.held_ws.clear();
                    out.content.push_str(implicit);
                }
            },
        }
    }
}

impl ReasoningStream for ThinkStream {
    fn feed(&mut self, text: &str, _token_ids: &[u32]) -> ReasoningDelta {
        let mut out = ReasoningDelta::default();
        if !self.thinking {
            out.content.push_str(text);
            return out;
        }
        scan_into(self, |s| &mut s.scan, text, Self::markers, |s, p| s.piece(p, &mut out));
        out
    }

    fn finish(&mut self) -> ReasoningDelta {
        let mut out = ReasoningDelta::default();
        flush_into(self, |s| &mut s.scan, |s, p| s.piece(p, &mut out));
        out
    }
}

/// Whole-output parse, exactly vLLM's `extract_reasoning` for the flavor.
pub fn parse(flavor: Flavor, text: &str, ctx: &RequestContext) -> ReasoningResult {
    if !flavor.thinking(ctx) {
        return ReasoningResult { reasoning: None, content: Some(text.to_string()) };
    }
    if flavor == Flavor::DeepSeekR1 {
        let after = text.split_once("<think>").map_or(text, |(_, a)| a);
        return match after.split_once("</think>") {
            None => ReasoningResult { reasoning: Some(after.to_string()), content: None },
            Some((r, c)) => ReasoningResult {
                reasoning: Some(r.to_string()),
                content: Some(c.to_string()).filter(|c| !c.is_empty()),
            },
        };
    }
    let (r, c) = wasmserve_guest::harness::run_reasoning(ThinkStream::new(flavor, ctx), &[text]);
    ReasoningResult { reasoning: Some(r).filter(|r| !r.is_empty()), content: Some(c).filter(|c| !c.is_empty()) }
}

macro_rules! reasoning_plugin {
    ($name:ident, $flavor:expr, $vllm:literal) => {
        pub struct $name;
        impl Plugin for $name {
            fn info() -> PluginInfo {
                PluginInfo { name: $vllm.into(), version: env!("CARGO_PKG_VERSION").into(), needs_special_tokens: true }
            }
            fn configure(_config: &str) -> Result<Self, String> {
                Ok($name)
            }
        }
        impl ReasoningParser for $name {
            type Stream = ThinkStream;
            fn stream(&self, ctx: &RequestContext) -> ThinkStream {
                ThinkStream::new($flavor, ctx)
            }
            fn parse(&self, text: &str, ctx: &RequestContext) -> ReasoningResult {
                parse($flavor, text, ctx)
            }
        }
    };
}

reasoning_plugin!(DeepSeekR1, Flavor::DeepSeekR1, "deepseek_r1");
reasoning_plugin!(Qwen3, Flavor::Qwen3, "qwen3");
reasoning_plugin!(KimiK2, Flavor::KimiK2, "kimi_k2");
