//! Streams a forced tool call (`tool_choice: "required"` or a named function) as it is
//! generated, the way vLLM streams one: the constrained output is
//! `{"name": "<tool>", "arguments": {...}}` (`server::tool_choice`), so once the name and the
//! start of the arguments are out, the first `tool_calls` delta carries the call's id and name,
//! and each later one the arguments' next text. The outer object's closing brace and any
//! whitespace around the arguments are not part of them.
//!
//! A small scanner over the output (strings, escapes, nesting) finds those spans; the
//! constraint guarantees the shape, so it never has to recover from anything else.

use serde_json::{json, Value};

use super::tool_choice::forced_call_id;

/// One choice's forced call, fed the output's text deltas in order.
#[derive(Debug, Default)]
pub struct ForcedCallStream {
    text: String,
    scanned: usize,
    depth: u32,
    in_string: bool,
    escape: bool,
    /// Where the string being read starts (its opening quote), and whether it is a key of the
    /// outer object.
    string_start: usize,
    string_is_key: bool,
    /// In the outer object: a key comes next (after `{` or `,`), not a value.
    expect_key: bool,
    key: Option<String>,
    name: Option<String>,
    args_start: Option<usize>,
    args_end: Option<usize>,
    /// Bytes of the arguments already sent (from `args_start`), once the head was.
    sent_to: Option<usize>,
}

impl ForcedCallStream {
    /// Appends `delta`; the `tool_calls` entry to send for it, if any.
    pub fn push(&mut self, delta: &str) -> Option<Value> {
        self.text.push_str(delta);
        self.scan();
        let (start, name) = (self.args_start?, self.name.as_ref()?);
        let end = self.args_end.unwrap_or(self.text.len());
        match self.sent_to {
            None => {
                self.sent_to = Some(end);
                Some(json!({
                    "index": 0,
                    "id": forced_call_id(),
                    "type": "function",
                    "function": {"name": name, "arguments": &self.text[start..end]},
                }))
            }
            Some(sent) if end > sent => {
                self.sent_to = Some(end);
                Some(json!({"index": 0, "function": {"arguments": &self.text[sent..end]}}))
            }
            Some(_) => None,
        }
    }

    /// Whether the call's head went out (then the choice is a tool call, complete or not).
    pub fn started(&self) -> bool {
        self.sent_to.is_some()
    }

    /// Whether the arguments are complete.
    pub fn complete(&self) -> bool {
        self.args_end.is_some()
    }

    /// Everything generated, for a choice cut off before its call began.
    pub fn into_text(self) -> String {
        self.text
    }

    fn scan(&mut self) {
        let bytes = self.text.as_bytes();
        for (i, &b) in bytes.iter().enumerate().skip(self.scanned) {
            if self.in_string {
                if self.escape {
                    self.escape = false;
                } else if b == b'\\' {
                    self.escape = true;
                } else if b == b'"' {
                    self.in_string = false;
                    if self.depth == 1 {
                        let s: Option<String> = serde_json::from_str(&self.text[self.string_start..=i]).ok();
                        if self.string_is_key {
                            self.key = s;
                        } else if self.key.as_deref() == Some("name") {
                            self.name = s;
                        }
                    }
                }
                continue;
            }
            match b {
                b'"' => {
                    self.in_string = true;
                    self.string_start = i;
                    self.string_is_key = self.depth == 1 && self.expect_key;
                }
                b'{' | b'[' => {
                    self.depth += 1;
                    if self.depth == 1 {
                        self.expect_key = true;
                    } else if self.depth == 2 && self.key.as_deref() == Some("arguments") && self.args_start.is_none() {
                        self.args_start = Some(i);
                    }
                }
                b'}' | b']' => {
                    self.depth = self.depth.saturating_sub(1);
                    if self.depth == 1 && self.args_start.is_some() && self.args_end.is_none() {
                        self.args_end = Some(i + 1);
                    }
                }
                b':' if self.depth == 1 => self.expect_key = false,
                b',' if self.depth == 1 => self.expect_key = true,
                _ => {}
            }
        }
        self.scanned = bytes.len();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Feeds `text` in pieces of `step` bytes; (the deltas sent, the arguments they add up to).
    fn stream(text: &str, step: usize) -> (Vec<Value>, String) {
        let mut s = ForcedCallStream::default();
        let mut deltas = Vec::new();
        let mut rest = text;
        while !rest.is_empty() {
            let mut cut = step.min(rest.len());
            while !rest.is_char_boundary(cut) {
                cut += 1;
            }
            deltas.extend(s.push(&rest[..cut]));
            rest = &rest[cut..];
        }
        let args = deltas.iter().map(|d| d["function"]["arguments"].as_str().unwrap()).collect();
        (deltas, args)
    }

    #[test]
    fn the_head_then_the_arguments_text_in_any_pieces() {
        let text = "{ \"name\" : \"get_weather\",\n \"arguments\": {\"city\": \"P{a}r\\\"is, \u{e9}\", \"n\": [1, {\"x\": []}]}\n}";
        let args = "{\"city\": \"P{a}r\\\"is, \u{e9}\", \"n\": [1, {\"x\": []}]}";
        for step in [1, 2, 3, 7, 200] {
            let (deltas, got) = stream(text, step);
            assert_eq!(got, args, "step {step}");
            assert_eq!(deltas[0]["function"]["name"], "get_weather");
            assert!(deltas[0]["id"].as_str().unwrap().starts_with("call_"));
            assert!(deltas[1..].iter().all(|d| d.get("id").is_none() && d["function"].get("name").is_none()));
        }
        let mut s = ForcedCallStream::default();
        s.push(text);
        assert!(s.started() && s.complete());
    }

    #[test]
    fn a_name_that_looks_like_a_key_and_a_cut_off_call() {
        let (deltas, args) = stream(r#"{"name":"arguments","arguments":{"a":"}"}}"#, 1);
        assert_eq!((deltas[0]["function"]["name"].as_str(), args.as_str()), (Some("arguments"), r#"{"a":"}"}"#));
        let mut s = ForcedCallStream::default();
        assert!(s.push(r#"{"name": "get_wea"#).is_none());
        assert!(!s.started());
        assert_eq!(s.into_text(), r#"{"name": "get_wea"#);
        let mut s = ForcedCallStream::default();
        assert!(s.push(r#"{"name": "f", "arguments": {"a": "#).is_some());
        assert!(s.started() && !s.complete());
    }
}
