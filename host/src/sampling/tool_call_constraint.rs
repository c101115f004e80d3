//! Constrained decoding for a forced tool call (`tool_choice: "required"` or a named function):
//! the output must be `{"name": "<one of the tools>", "arguments": <JSON object>}`, so the server
//! can return it as `tool_calls` whatever the model's own tool-call format is.

use super::json_constraint::JsonState;

#[derive(Clone, Debug)]
enum Phase {
    /// Fixed text still to come.
    Literal(Vec<u8>, Box<Phase>),
    /// The function name, a prefix of at least one allowed name.
    Name(Vec<u8>),
    Arguments(JsonState),
    Done,
}

#[derive(Clone, Debug)]
pub struct ToolCallConstraint {
    names: Vec<Vec<u8>>,
    phase: Phase,
}

const AFTER_NAME: &[u8] = b"\", \"arguments\": ";

impl ToolCallConstraint {
    pub fn new(names: &[String]) -> Self {
        let names = names.iter().map(|n| n.as_bytes().to_vec()).collect();
        Self { names, phase: Phase::Literal(b"{\"name\": \"".to_vec(), Box::new(Phase::Name(Vec::new()))) }
    }

    pub fn is_complete(&self) -> bool {
        matches!(self.phase, Phase::Done)
    }

    pub fn accepts(&self, bytes: &[u8]) -> bool {
        !bytes.is_empty() && self.clone().feed(bytes)
    }

    pub fn feed(&mut self, bytes: &[u8]) -> bool {
        bytes.iter().all(|&b| self.byte(b))
    }

    fn byte(&mut self, b: u8) -> bool {
        match &mut self.phase {
            Phase::Literal(rest, next) => {
                if rest.first() != Some(&b) {
                    return false;
                }
                rest.remove(0);
                if rest.is_empty() {
                    self.phase = std::mem::replace(next.as_mut(), Phase::Done);
                }
                true
            }
            Phase::Name(sofar) => {
                if b == b'"' {
                    if !self.names.iter().any(|n| n == sofar) {
                        return false;
                    }
                    self.phase =
                        Phase::Literal(AFTER_NAME[1..].to_vec(), Box::new(Phase::Arguments(JsonState::default())));
                    return true;
                }
                sofar.push(b);
                let s = sofar.as_slice();
                self.names.iter().any(|n| n.starts_with(s))
            }
            Phase::Arguments(js) => {
                if js.is_complete() {
                    if b == b'}' {
                        self.phase = Phase::Done;
                        return true;
                    }
                    return false;
                }
                js.feed(&[b])
            }
            Phase::Done => false,
        }
    }
}

/// The name and arguments of a finished constrained tool call.
pub fn parse_tool_call(text: &str) -> Option<(String, String)> {
    let v: serde_json::Value = serde_json::from_str(text).ok()?;
    let name = v.get("name")?.as_str()?.to_string();
    let args = v.get("arguments")?;
    Some((name, args.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_listed_names_and_object_arguments() {
        let names = vec!["get_weather".to_string(), "get_time".to_string()];
        let mut c = ToolCallConstraint::new(&names);
        assert!(c.accepts(b"{\"name\": \"get_"));
        assert!(!c.accepts(b"{\"name\": \"set_"));
        assert!(!c.accepts(b"{\"name\": \"get\""));
        assert!(c.feed(b"{\"name\": \"get_time\", \"arguments\": {\"tz\": \"UTC\"}"));
        assert!(!c.is_complete());
        assert!(c.feed(b"}"));
        assert!(c.is_complete());
        assert_eq!(
            parse_tool_call("{\"name\": \"get_time\", \"arguments\": {\"tz\": \"UTC\"}}"),
            Some(("get_time".into(), "{\"tz\":\"UTC\"}".into()))
        );
    }
}
