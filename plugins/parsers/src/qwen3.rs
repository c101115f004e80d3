//! `qwen3` tool parser: both forms Qwen3 models emit.
//! - Qwen3 (JSON): `<tool_call>{"name": …, "arguments": {…}}</tool_call>`: exactly vLLM's
//!   `hermes` (also its `qwen3_json` alias), see [`crate::hermes`].
//! - Qwen3-Coder (XML): `<tool_call>\n<function=NAME>\n<parameter=KEY>\nVALUE\n</parameter>\n</function>\n</tool_call>`:
//!   vLLM 0.33's `qwen3_coder` / `qwen3_xml` (its parser-engine grammar in `parser/qwen3.py`):
//!   values lose one wrapping newline each side and are converted with the request's tool
//!   schema (`coerce_to_schema_type`: null > integer > number > boolean > object > array >
//!   string, else JSON if it parses, else the text); undeclared tools keep strings; content
//!   next to calls is stripped.
//!
//! vLLM's `qwen3_coder` drops JSON calls and `hermes` ignores XML ones, so the form is chosen
//! per output from the first call: `{` after `<tool_call>` means JSON.
//!
//! Streaming: content streams as it comes (whitespace around it is held until it is known
//! whether a call follows); an XML call's id and name are sent when `<function=NAME>` is
//! complete, its arguments (converted, so final only then) when the call ends. Known stream
//! difference: leading whitespace of content that is followed by a call was already sent.

use serde_json::{Map, Value};
use wasmserve_guest::{
    Plugin, PluginInfo, RequestContext, ToolCall, ToolCallDelta, ToolDelta, ToolParser, ToolResult, ToolStream,
};

use crate::hermes::HermesStream;
use crate::scan::{flush_into, Piece, Scanner};

const TOOL_START: &str = "<tool_call>";
const TOOL_END: &str = "</tool_call>";
const FUNC_PREFIX: &str = "<function=";
const FUNC_END: &str = "</function>";

/// The tool schemas' `properties` by function name.
fn tool_properties(ctx: &RequestContext, name: &str) -> Option<Map<String, Value>> {
    let tools: Value = serde_json::from_str(&ctx.tools).ok()?;
    tools.as_array()?.iter().find_map(|t| {
        let f = t.get("function")?;
        (f.get("name")?.as_str()? == name)
            .then(|| f.get("parameters")?.get("properties")?.as_object().cloned())
            .flatten()
    })
}

/// vLLM `extract_types_from_schema`.
fn schema_types(schema: &Value) -> Vec<String> {
    let Some(o) = schema.as_object() else { return vec!["string".into()] };
    let mut types: Vec<String> = Vec::new();
    let mut add = |t: &str| {
        if !types.iter().any(|x| x == t) {
            types.push(t.to_string());
        }
    };
    match o.get("type") {
        Some(Value::String(t)) => add(t),
        Some(Value::Array(a)) => a.iter().filter_map(Value::as_str).for_each(&mut add),
        _ => {}
    }
    if let Some(Value::Array(e)) = o.get("enum") {
        for v in e {
            add(match v {
                Value::Null => "null",
                Value::Bool(_) => "boolean",
                Value::Number(n) if n.is_f64() => "number",
                Value::Number(_) => "integer",
                Value::String(_) => "string",
                Value::Array(_) => "array",
                Value::Object(_) => "object",
            });
        }
    }
    for k in ["anyOf", "oneOf", "allOf"] {
        if let Some(Value::Array(choices)) = o.get(k) {
            for c in choices {
                for t in schema_types(c) {
                    add(&t);
                }
            }
        }
    }
    if types.is_empty() {
        types.push("string".into());
    }
    types
}

fn alias(t: &str) -> String {
    let t = t.trim().to_lowercase();
    match t.as_str() {
        "str" | "text" | "varchar" | "char" | "enum" => "string",
        "int" | "int32" | "int64" | "uint" | "uint32" | "uint64" | "long" | "short" | "unsigned" => "integer",
        "float" | "float32" | "float64" | "double" => "number",
        "bool" => "boolean",
        "dict" => "object",
        "arr" | "list" | "sequence" => "array",
        _ => return t,
    }
    .into()
}

/// Python `int(value)` for the common forms (surrounding whitespace, sign, `_` between digits).
fn py_int(v: &str) -> Option<i64> {
    let t = v.trim();
    let (sign, digits) = match t.as_bytes().first() {
        Some(b'-') => ("-", &t[1..]),
        Some(b'+') => ("", &t[1..]),
        _ => ("", t),
    };
    if digits.is_empty()
        || digits.starts_with('_')
        || digits.ends_with('_')
        || digits.contains("__")
        || !digits.chars().all(|c| c.is_ascii_digit() || c == '_')
    {
        return None;
    }
    format!("{sign}{}", digits.replace('_', "")).parse().ok()
}

/// Python `float(value)` for finite values.
fn py_float(v: &str) -> Option<f64> {
    let t = v.trim();
    if t.is_empty() || !t.chars().all(|c| c.is_ascii_digit() || "+-.eE".contains(c)) {
        return None;
    }
    t.parse::<f64>().ok().filter(|f| f.is_finite())
}

fn json_number(f: f64) -> Value {
    if f == f.trunc() && f.abs() < 9.0e15 {
        Value::from(f as i64)
    } else {
        serde_json::Number::from_f64(f).map_or(Value::Null, Value::Number)
    }
}

/// vLLM `coerce_to_schema_type`.
fn coerce(value: &str, types: &[String]) -> Value {
    let types: Vec<String> = types.iter().map(|t| alias(t)).collect();
    let has = |t: &str| types.iter().any(|x| x == t);
    for candidate in ["null", "integer", "number", "boolean", "object", "array", "string"] {
        if !has(candidate) {
            continue;
        }
        match candidate {
            "null" if value.to_lowercase() == "null" => return Value::Null,
            "string" => return Value::String(value.to_string()),
            "integer" => {
                if let Some(i) = py_int(value) {
                    return Value::from(i);
                }
            }
            "number" => {
                if let Some(i) = py_int(value) {
                    return Value::from(i);
                }
                if let Some(f) = py_float(value) {
                    return json_number(f);
                }
            }
            "boolean" => match value.trim().to_lowercase().as_str() {
                "true" | "1" => return Value::Bool(true),
                "false" | "0" => return Value::Bool(false),
                _ => {}
            },
            "object" | "array" => {
                if let Ok(v) = serde_json::from_str::<Value>(value) {
                    return v;
                }
            }
            _ => {}
        }
    }
    serde_json::from_str(value).unwrap_or_else(|_| Value::String(value.to_string()))
}

/// vLLM `ParserEngine._coerce_value` for a string value (the XML form gives only strings at
/// the top level; nested values are already typed JSON).
fn coerce_value(v: Value, schema: &Value) -> Value {
    match v {
        Value::String(s) => coerce(&s, &schema_types(schema)),
        other => other,
    }
}

/// Strips one leading and one trailing newline (the template's markup).
fn trim_wrapping_newlines(v: &str) -> &str {
    let v = v.strip_prefix('\n').unwrap_or(v);
    v.strip_suffix('\n').unwrap_or(v)
}

/// `<\s*parameter\s*=\s*` at the start of `s`: the length matched.
fn param_open_len(s: &str) -> Option<usize> {
    let r = s.strip_prefix('<')?;
    let r2 = r.trim_start();
    let r3 = r2.strip_prefix("parameter")?.trim_start();
    let r4 = r3.strip_prefix('=')?.trim_start();
    Some(s.len() - r4.len())
}

/// `<\s*/\s*parameter\s*>` at the start of `s`: the length matched.
fn param_close_len(s: &str) -> Option<usize> {
    let r = s
        .strip_prefix('<')?
        .trim_start()
        .strip_prefix('/')?
        .trim_start()
        .strip_prefix("parameter")?
        .trim_start()
        .strip_prefix('>')?;
    Some(s.len() - r.len())
}

/// vLLM `_qwen3_arg_converter(raw, partial=False)` + `_fix_arg_types`: the arguments JSON.
pub fn convert_args(raw: &str, props: Option<&Map<String, Value>>) -> String {
    let mut params = Map::new();
    let mut i = 0;
    while let Some(p) = raw[i..].find('<').map(|p| i + p) {
        let Some(ol) = param_open_len(&raw[p..]) else {
            i = p + 1;
            continue;
        };
        let name_start = p + ol;
        let Some(gt) = raw[name_start..].find('>').map(|g| name_start + g) else { break };
        let name = &raw[name_start..gt];
        let val_start = gt + 1;
        // The value runs (lazily) to the first `</parameter>` or the next `<parameter=`.
        let mut end = None;
        let mut j = val_start;
        while let Some(q) = raw[j..].find('<').map(|q| j + q) {
            if let Some(cl) = param_close_len(&raw[q..]) {
                end = Some((q, q + cl));
                break;
            }
            if param_open_len(&raw[q..]).is_some() {
                end = Some((q, q));
                break;
            }
            j = q + 1;
        }
        let Some((vend, next)) = end else {
            i = p + 1;
            continue;
        };
        params.insert(name.to_string(), Value::String(trim_wrapping_newlines(&raw[val_start..vend]).to_string()));
        i = next;
    }
    if let Some(props) = props.filter(|p| !p.is_empty()) {
        for (k, v) in params.iter_mut() {
            if let Some(schema) = props.get(k).filter(|s| s.is_object()) {
                *v = coerce_value(std::mem::take(v), schema);
            }
        }
    }
    crate::pyjson::dumps(&Value::Object(params), None)
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum XState {
    Content,
    /// After `<tool_call>`, before the first non-whitespace: the form is not known yet.
    Decide,
    /// After `<tool_call>` (XML form known), before `<function=`.
    Preamble,
    Name,
    Args,
    /// After `</function>`, before `</tool_call>`.
    Between,
}

const X_CONTENT: &[&str] = &[TOOL_START, FUNC_PREFIX];
const X_DECIDE: &[&str] = &[TOOL_END, FUNC_PREFIX];
const X_PREAMBLE: &[&str] = &[TOOL_END, FUNC_PREFIX];
const X_NAME: &[&str] = &[">", FUNC_END, TOOL_END, TOOL_START, FUNC_PREFIX];
const X_ARGS: &[&str] = &[FUNC_END, FUNC_PREFIX];
const X_BETWEEN: &[&str] = &[TOOL_END, TOOL_START, FUNC_PREFIX];

pub struct Qwen3Stream {
    ctx: RequestContext,
    state: XState,
    scan: Scanner,
    /// Set once the first call is JSON: the rest of the output is Hermes'.
    hermes: Option<HermesStream>,
    decide_buf: String,
    /// XML form chosen (a later `<tool_call>` needs no decision).
    xml: bool,
    name: String,
    args: String,
    /// Stream index of the open call (None: no call open or it has no name).
    open: Option<Option<u32>>,
    calls: u32,
    content_started: bool,
    /// Whitespace not sent yet: all content so far (before any non-whitespace), or the tail of it.
    held_ws: String,
}

impl Qwen3Stream {
    pub fn new(ctx: &RequestContext) -> Self {
        Self {
            ctx: ctx.clone(),
            state: XState::Content,
            scan: Scanner::default(),
            hermes: None,
            decide_buf: String::new(),
            xml: false,
            name: String::new(),
            args: String::new(),
            open: None,
            calls: 0,
            content_started: false,
            held_ws: String::new(),
        }
    }

    fn markers(&self) -> &'static [&'static str] {
        match self.state {
            XState::Content => X_CONTENT,
            XState::Decide => X_DECIDE,
            XState::Preamble => X_PREAMBLE,
            XState::Name => X_NAME,
            XState::Args => X_ARGS,
            XState::Between => X_BETWEEN,
        }
    }

    fn content(&mut self, t: &str, out: &mut ToolDelta) {
        let trimmed = t.trim_end();
        if !trimmed.is_empty() {
            out.content.push_str(&std::mem::take(&mut self.held_ws));
            out.content.push_str(trimmed);
            self.content_started = true;
        }
        self.held_ws.push_str(&t[trimmed.len()..]);
    }

    fn begin_call(&mut self, state: XState) {
        self.name.clear();
        self.args.clear();
        self.open = Some(None);
        self.state = state;
    }

    /// `<function=NAME>` complete: the call is sent (when named).
    fn named(&mut self, out: &mut ToolDelta) {
        let name = self.name.trim().to_string();
        if !name.is_empty() {
            out.tool_calls.push(ToolCallDelta {
                index: self.calls,
                id: Some(String::new()),
                name: Some(name),
                arguments: String::new(),
            });
            self.open = Some(Some(self.calls));
            self.calls += 1;
            // Content next to calls is stripped.
            self.held_ws.clear();
        }
        self.state = XState::Args;
    }

    fn end_call(&mut self, out: &mut ToolDelta) {
        let Some(open) = self.open.take() else { return };
        let name = self.name.trim().to_string();
        let index = match open {
            Some(i) => i,
            // A call whose `>` never came: vLLM still takes a non-empty name.
            None if !name.is_empty() => {
                out.tool_calls.push(ToolCallDelta {
                    index: self.calls,
                    id: Some(String::new()),
                    name: Some(name.clone()),
                    arguments: String::new(),
                });
                self.calls += 1;
                self.held_ws.clear();
                self.calls - 1
            }
            None => return,
        };
        let arguments = if self.args.trim().is_empty() {
            "{}".to_string()
        } else {
            convert_args(&self.args, tool_properties(&self.ctx, &name).as_ref())
        };
        out.tool_calls.push(ToolCallDelta { index, id: None, name: None, arguments });
    }

    /// The first call's form is known: `{` means JSON (Hermes from here on).
    fn decided(&mut self, json: bool, out: &mut ToolDelta) {
        let buf = std::mem::take(&mut self.decide_buf);
        if json {
            let held = if self.content_started {
                out.content.push_str(&std::mem::take(&mut self.held_ws));
                String::new()
            } else {
                std::mem::take(&mut self.held_ws)
            };
            let mut h = HermesStream::after_content(self.content_started, held);
            let d = h.feed(&format!("{TOOL_START}{buf}"), &[]);
            out.content.push_str(&d.content);
            out.tool_calls.extend(d.tool_calls);
            self.hermes = Some(h);
        } else {
            self.xml = true;
            self.state = XState::Preamble;
        }
    }

    fn piece(&mut self, p: Piece, out: &mut ToolDelta) {
        let markers = self.markers();
        match p {
            Piece::Text(t) => match self.state {
                XState::Content => self.content(t, out),
                XState::Decide => {
                    self.decide_buf.push_str(t);
                    if let Some(c) = self.decide_buf.trim_start().chars().next() {
                        self.decided(c == '{', out);
                    }
                }
                XState::Preamble | XState::Between => {}
                XState::Name => self.name.push_str(t),
                XState::Args => self.args.push_str(t),
            },
            Piece::Marker(i) => {
                let m = markers[i];
                match (self.state, m) {
                    (XState::Content, TOOL_START) if !self.xml => {
                        self.decide_buf.clear();
                        self.begin_call(XState::Decide);
                    }
                    (XState::Content | XState::Between, TOOL_START) => self.begin_call(XState::Preamble),
                    (XState::Content | XState::Between, _) => self.begin_call(XState::Name), // <function=
                    (XState::Decide, _) => {
                        self.decided(false, out);
                        if self.hermes.is_none() {
                            self.piece_marker(m, out);
                        }
                    }
                    _ => self.piece_marker(m, out),
                }
            }
        }
    }

    fn piece_marker(&mut self, m: &str, out: &mut ToolDelta) {
        match (self.state, m) {
            (XState::Preamble, TOOL_END) => {
                self.end_call(out);
                self.state = XState::Content;
            }
            (XState::Preamble, _) => self.state = XState::Name, // <function=
            (XState::Name, ">") => self.named(out),
            (XState::Name, FUNC_END) | (XState::Args, FUNC_END) => {
                self.end_call(out);
                self.state = XState::Between;
            }
            (XState::Name, TOOL_END) => {
                self.end_call(out);
                self.state = XState::Content;
            }
            (XState::Name, TOOL_START) => {
                self.end_call(out);
                self.begin_call(XState::Preamble);
            }
            (XState::Name | XState::Args, _) => {
                // <function= : the open call ends, a new one starts
                self.end_call(out);
                self.begin_call(XState::Name);
            }
            (s, m) => unreachable!("marker {m} in state {s:?}"),
        }
    }
}

impl ToolStream for Qwen3Stream {
    fn feed(&mut self, text: &str, token_ids: &[u32]) -> ToolDelta {
        if let Some(h) = self.hermes.as_mut() {
            return h.feed(text, token_ids);
        }
        let mut out = ToolDelta::default();
        let mut scan = std::mem::take(&mut self.scan);
        let mut rest = String::new();
        scan.feed(text, self.markers(), |p| {
            if self.hermes.is_some() {
                // The form was decided inside this delta: the rest goes to Hermes.
                match p {
                    Piece::Text(t) => rest.push_str(t),
                    Piece::Marker(i) => rest.push_str(X_DECIDE[i]),
                }
                return &[];
            }
            self.piece(p, &mut out);
            if self.hermes.is_some() {
                &[]
            } else {
                self.markers()
            }
        });
        self.scan = scan;
        if let Some(h) = self.hermes.as_mut() {
            rest.push_str(&self.scan.flush());
            let d = h.feed(&rest, token_ids);
            out.content.push_str(&d.content);
            out.tool_calls.extend(d.tool_calls);
        }
        out
    }

    fn finish(&mut self) -> ToolDelta {
        if let Some(h) = self.hermes.as_mut() {
            return h.finish();
        }
        let mut out = ToolDelta::default();
        flush_into(self, |s| &mut s.scan, |s, p| s.piece(p, &mut out));
        if let Some(h) = self.hermes.as_mut() {
            let d = h.finish();
            out.content.push_str(&d.content);
            out.tool_calls.extend(d.tool_calls);
            return out;
        }
        if self.state == XState::Decide {
            self.decided(false, &mut out);
        }
        self.end_call(&mut out);
        if self.calls == 0 {
            out.content.push_str(&std::mem::take(&mut self.held_ws));
        }
        out
    }
}

/// Whole output: JSON form as vLLM's `hermes`, XML form as its `qwen3_coder`.
pub fn parse(text: &str, ctx: &RequestContext) -> ToolResult {
    let json = text.find(TOOL_START).is_some_and(|p| text[p + TOOL_START.len()..].trim_start().starts_with('{'));
    if json {
        return crate::hermes::parse(text);
    }
    let mut a = wasmserve_guest::harness::ToolAssembler::default();
    let mut s = Qwen3Stream::new(ctx);
    a.add(s.feed(text, &[])).expect("the qwen3 stream keeps the delta contract");
    a.add(s.finish()).expect("the qwen3 stream keeps the delta contract");
    // The stream's content is the content-state text; vLLM strips it when there are calls.
    let content = if a.calls.is_empty() { a.content } else { a.content.trim().to_string() };
    ToolResult {
        content: Some(content).filter(|c| !c.is_empty()),
        tool_calls: a.calls.into_iter().map(|c| ToolCall { id: c.id, name: c.name, arguments: c.arguments }).collect(),
    }
}

pub struct Qwen3;

impl Plugin for Qwen3 {
    fn info() -> PluginInfo {
        PluginInfo { name: "qwen3".into(), version: env!("CARGO_PKG_VERSION").into(), needs_special_tokens: true }
    }
    fn configure(_config: &str) -> Result<Self, String> {
        Ok(Qwen3)
    }
}

impl ToolParser for Qwen3 {
    type Stream = Qwen3Stream;
    fn stream(&self, ctx: &RequestContext) -> Qwen3Stream {
        Qwen3Stream::new(ctx)
    }
    fn parse(&self, text: &str, ctx: &RequestContext) -> ToolResult {
        parse(text, ctx)
    }
}
