//! Native test harness: drives a parser the way the host does (a `stream` per choice, one
//! `feed` per delta, then `finish`) and assembles the deltas into the whole-text result shape,
//! so tests can assert that every way of splitting a text streams to the same answer.

use crate::{ReasoningDelta, ReasoningStream, ToolCall, ToolDelta, ToolResult, ToolStream};

/// The text cut at `at` (a char boundary): two deltas, either of which may be empty.
pub fn split_at(text: &str, at: usize) -> Vec<&str> {
    vec![&text[..at], &text[at..]]
}

/// Every char boundary of `text`, 0 and `len` included.
pub fn boundaries(text: &str) -> Vec<usize> {
    text.char_indices().map(|(i, _)| i).chain([text.len()]).collect()
}

/// One delta per char, except that each of `markers` (special tokens) stays one delta, as a
/// tokenizer would emit it.
pub fn token_like_chunks<'a>(text: &'a str, markers: &[&str]) -> Vec<&'a str> {
    let mut out = Vec::new();
    let mut i = 0;
    'outer: while i < text.len() {
        for m in markers {
            if !m.is_empty() && text[i..].starts_with(m) {
                out.push(&text[i..i + m.len()]);
                i += m.len();
                continue 'outer;
            }
        }
        let c = text[i..].chars().next().unwrap();
        out.push(&text[i..i + c.len_utf8()]);
        i += c.len_utf8();
    }
    out
}

/// Feeds `chunks` then finishes; returns (reasoning, content) concatenated.
pub fn run_reasoning<S: ReasoningStream>(mut s: S, chunks: &[&str]) -> (String, String) {
    let mut all = ReasoningDelta::default();
    let mut add = |d: ReasoningDelta| {
        all.reasoning.push_str(&d.reasoning);
        all.content.push_str(&d.content);
    };
    for c in chunks {
        add(s.feed(c, &[]));
    }
    add(s.finish());
    (all.reasoning, all.content)
}

/// Assembles tool deltas, checking the streaming contract: a call's first delta carries its id
/// and name, later ones only arguments, and indices are 0, 1, 2, ... in order.
#[derive(Default, Debug)]
pub struct ToolAssembler {
    pub content: String,
    pub calls: Vec<ToolCall>,
    pub deltas: usize,
}

impl ToolAssembler {
    pub fn add(&mut self, d: ToolDelta) -> Result<(), String> {
        self.content.push_str(&d.content);
        for c in d.tool_calls {
            self.deltas += 1;
            let i = c.index as usize;
            if i == self.calls.len() {
                let (Some(id), Some(name)) = (c.id, c.name) else {
                    return Err(format!("first delta of tool call {i} lacks id or name"));
                };
                self.calls.push(ToolCall { id, name, arguments: c.arguments });
            } else if i + 1 == self.calls.len() {
                if c.id.is_some() || c.name.is_some() {
                    return Err(format!("tool call {i} got a second id/name"));
                }
                self.calls[i].arguments.push_str(&c.arguments);
            } else {
                return Err(format!("tool call index {i} out of order (have {})", self.calls.len()));
            }
        }
        Ok(())
    }
}

/// Feeds `chunks` then finishes; returns the assembled content and calls.
pub fn run_tools<S: ToolStream>(mut s: S, chunks: &[&str]) -> Result<ToolResult, String> {
    let mut a = ToolAssembler::default();
    for c in chunks {
        a.add(s.feed(c, &[]))?;
    }
    a.add(s.finish())?;
    Ok(ToolResult { content: Some(a.content).filter(|c| !c.is_empty()), tool_calls: a.calls })
}
