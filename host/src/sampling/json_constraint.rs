//! Constrained decoding for `response_format: {"type": "json_object"}`: a byte-level JSON
//! recogniser decides, token by token, which candidates keep the output a valid prefix of one
//! JSON object, and whether the object is complete (only then may EOS end it).
//!
//! Checking is lazy: candidates are tried best first (greedy) or by sampling with rejection, so a
//! step usually checks a handful of tokens rather than the whole vocabulary.
//!
//! The schema matcher could enforce this too (`{"type": "object"}`), but this fixed-size state is
//! 2-5x cheaper per pass over the vocabulary (`examples/bench_constraints.rs`,
//! docs/engine-benchmarks.md), and `json_object` is the constraint most requests ask for.

use super::constraint::JsonWhitespace;
use super::json_number::NumState;

/// Deepest nesting accepted.
const MAX_DEPTH: usize = 64;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Frame {
    Object,
    Array,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Expect {
    /// Before the top-level object.
    Start,
    /// A value (after `:` or `[` or `,` in an array).
    Value,
    /// A value or `]` (just after `[`).
    ValueOrEnd,
    /// A key string or `}` (just after `{`).
    KeyOrEnd,
    /// A key string (after `,` in an object).
    Key,
    /// `:` after a key.
    Colon,
    /// `,` or the closing bracket of the current container.
    CommaOrEnd,
    /// Inside a string; `key` says whether it is an object key.
    Str { key: bool, escape: bool, unicode_left: u8 },
    /// Inside a number; `state` tracks which parts were seen.
    Number(NumState),
    /// Inside `true` / `false` / `null`: the remaining bytes.
    Literal(&'static [u8]),
    /// The top-level object is closed.
    Done,
}

#[derive(Clone, Debug)]
pub struct JsonState {
    stack: Vec<Frame>,
    expect: Expect,
    whitespace_run: u8,
    max_whitespace_run: u8,
}

impl Default for JsonState {
    fn default() -> Self {
        Self::with_whitespace(JsonWhitespace::Flexible)
    }
}

impl JsonState {
    pub fn with_whitespace(whitespace: JsonWhitespace) -> Self {
        Self { stack: Vec::new(), expect: Expect::Start, whitespace_run: 0, max_whitespace_run: whitespace.max_run() }
    }

    pub fn is_complete(&self) -> bool {
        self.expect == Expect::Done
    }

    /// Feeds bytes; false (state unspecified) if they cannot continue a JSON object.
    pub fn feed(&mut self, bytes: &[u8]) -> bool {
        bytes.iter().all(|&b| self.byte(b))
    }

    /// Whether `bytes` would be accepted, without changing the state.
    pub fn accepts(&self, bytes: &[u8]) -> bool {
        !bytes.is_empty() && self.clone().feed(bytes)
    }

    fn after_value(&mut self) {
        self.expect = if self.stack.is_empty() { Expect::Done } else { Expect::CommaOrEnd };
    }

    fn open(&mut self, f: Frame) -> bool {
        if self.stack.len() >= MAX_DEPTH {
            return false;
        }
        self.stack.push(f);
        self.expect = if f == Frame::Object { Expect::KeyOrEnd } else { Expect::ValueOrEnd };
        true
    }

    fn close(&mut self, f: Frame) -> bool {
        if self.stack.pop() != Some(f) {
            return false;
        }
        self.after_value();
        true
    }

    fn start_value(&mut self, b: u8) -> bool {
        match b {
            b'{' => self.open(Frame::Object),
            b'[' => self.open(Frame::Array),
            b'"' => {
                self.expect = Expect::Str { key: false, escape: false, unicode_left: 0 };
                true
            }
            b't' => {
                self.expect = Expect::Literal(b"rue");
                true
            }
            b'f' => {
                self.expect = Expect::Literal(b"alse");
                true
            }
            b'n' => {
                self.expect = Expect::Literal(b"ull");
                true
            }
            _ => match NumState::start(b) {
                Some(n) => {
                    self.expect = Expect::Number(n);
                    true
                }
                None => false,
            },
        }
    }

    fn byte(&mut self, b: u8) -> bool {
        let ws = matches!(b, b' ' | b'\n' | b'\t' | b'\r');
        let in_token = matches!(self.expect, Expect::Str { .. } | Expect::Literal(_));
        if ws && !in_token {
            if let Expect::Number(n) = self.expect {
                if !n.can_end() {
                    return false;
                }
                self.after_value();
            }
            if self.expect == Expect::Done {
                return false; // nothing may follow the object but EOS
            }
            if self.whitespace_run >= self.max_whitespace_run {
                return false;
            }
            self.whitespace_run += 1;
            return true;
        }
        if !in_token {
            self.whitespace_run = 0;
        }
        match self.expect {
            Expect::Start => b == b'{' && self.open(Frame::Object),
            Expect::Done => false,
            Expect::Value => self.start_value(b),
            Expect::ValueOrEnd => {
                if b == b']' {
                    self.close(Frame::Array)
                } else {
                    self.start_value(b)
                }
            }
            Expect::KeyOrEnd | Expect::Key => {
                if b == b'}' && self.expect == Expect::KeyOrEnd {
                    self.close(Frame::Object)
                } else if b == b'"' {
                    self.expect = Expect::Str { key: true, escape: false, unicode_left: 0 };
                    true
                } else {
                    false
                }
            }
            Expect::Colon => {
                if b == b':' {
                    self.expect = Expect::Value;
                    true
                } else {
                    false
                }
            }
            Expect::CommaOrEnd => match (b, self.stack.last()) {
                (b',', Some(Frame::Object)) => {
                    self.expect = Expect::Key;
                    true
                }
                (b',', Some(Frame::Array)) => {
                    self.expect = Expect::Value;
                    true
                }
                (b'}', _) => self.close(Frame::Object),
                (b']', _) => self.close(Frame::Array),
                _ => false,
            },
            Expect::Str { key, escape, unicode_left } => {
                if unicode_left > 0 {
                    if !b.is_ascii_hexdigit() {
                        return false;
                    }
                    self.expect = Expect::Str { key, escape: false, unicode_left: unicode_left - 1 };
                    return true;
                }
                if escape {
                    return match b {
                        b'"' | b'\\' | b'/' | b'b' | b'f' | b'n' | b'r' | b't' => {
                            self.expect = Expect::Str { key, escape: false, unicode_left: 0 };
                            true
                        }
                        b'u' => {
                            self.expect = Expect::Str { key, escape: false, unicode_left: 4 };
                            true
                        }
                        _ => false,
                    };
                }
                match b {
                    b'"' => {
                        if key {
                            self.expect = Expect::Colon;
                        } else {
                            self.after_value();
                        }
                        true
                    }
                    b'\\' => {
                        self.expect = Expect::Str { key, escape: true, unicode_left: 0 };
                        true
                    }
                    0x00..=0x1F => false,
                    _ => true, // UTF-8 bytes are checked when the text is decoded
                }
            }
            Expect::Number(n) => match n.next(b, false) {
                Some(s) => {
                    self.expect = Expect::Number(s);
                    true
                }
                None if n.can_end() => {
                    self.after_value();
                    self.byte(b)
                }
                None => false,
            },
            Expect::Literal(rest) => {
                if rest.first() != Some(&b) {
                    return false;
                }
                if rest.len() == 1 {
                    self.after_value();
                } else {
                    self.expect = Expect::Literal(&rest[1..]);
                }
                true
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ok(s: &str) -> bool {
        JsonState::default().feed(s.as_bytes())
    }

    #[test]
    fn accepts_prefixes_of_objects_only() {
        assert!(ok("{"));
        assert!(ok("{\"a\": [1, 2.5e-3, true, null, {\"b\": \"x\\\"y\\u00e9\"}], \"c\": -0"));
        assert!(!ok("[1]"));
        assert!(!ok("{\"a\" 1}"));
        assert!(!ok("{\"a\": 01}"));
        assert!(!ok("{\"a\": tru3}"));
        assert!(!ok("{,}"));
        let mut s = JsonState::default();
        assert!(s.feed(b"{\"k\": 12}"));
        assert!(s.is_complete());
        assert!(!s.accepts(b" "));
        assert!(!s.accepts(b"x"));
    }

    #[test]
    fn whitespace_runs_are_bounded() {
        let mut s = JsonState::default();
        assert!(s.feed(b"{"));
        assert!(!s.accepts(&[b' '; 40]));
        assert!(s.accepts(b"   \"a\""));
    }

    #[test]
    fn disabled_whitespace_takes_compact_json_only() {
        let mut s = JsonState::with_whitespace(JsonWhitespace::Disabled);
        assert!(!s.accepts(b" {"));
        assert!(s.feed(b"{\"a b\":[1,{\"c\":\" \"}],\"d\":true"));
        for ws in [&b" "[..], b"\n", b"\t", b"\r"] {
            assert!(!s.accepts(ws), "{ws:?}");
        }
        assert!(s.feed(b"}"));
        assert!(s.is_complete());
        // Flexible takes the same text spaced out.
        assert!(JsonState::default().feed(b"{ \"a b\" : [ 1 ,\n {\"c\": \" \"} ] }"));
        assert!(!JsonState::with_whitespace(JsonWhitespace::Disabled).feed(b"{\"a\": 1}"));
    }
}
