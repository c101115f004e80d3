//! Constrained decoding to a JSON Schema ([`super::json_schema`]): a byte-level matcher that says
//! which tokens keep the output a prefix of some JSON text the schema accepts, and when that
//! text is complete (only then may EOS end it).
//!
//! The matcher is a nondeterministic pushdown automaton: a *path* is a stack of tasks still to
//! match (top last), and the state is the set of live paths. Unions (`anyOf`, `enum`, optional
//! properties, the `,` before one of several optional keys) fork paths; a byte no path accepts
//! is refused. Paths are deduplicated after every byte and capped, so the work per token stays
//! bounded whatever the schema.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, OnceLock};

use super::constraint::JsonWhitespace;
use super::json_number::NumState;
use super::json_schema::{Node, NodeId, Schema, ANY};

/// Deepest stack of pending tasks (nesting depth, roughly twice the JSON depth).
const MAX_STACK: usize = 192;
/// Live paths kept at most; beyond this the matcher keeps the first ones (it may then refuse
/// a continuation another path would have allowed, but never allows a wrong one).
const MAX_PATHS: usize = 64;
/// Unions expanded inside one step at most (a `$ref` cycle of unions would never consume).
const MAX_EXPANSION: u32 = 32;

/// Where a literal's bytes come from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum LitSrc {
    Static(&'static [u8]),
    /// A `Node::Lit`.
    Node(NodeId),
    /// The key (with its quotes) of property `prop` of object node `obj`.
    Key {
        obj: NodeId,
        prop: u16,
    },
}

/// What remains to be matched, one step of it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Task {
    /// A value of this node (leading whitespace allowed).
    Value(NodeId),
    /// Literal bytes from `pos` on (whitespace allowed before the first).
    Lit {
        src: LitSrc,
        pos: u16,
    },
    /// An opening `"`, then a string body.
    StrStart {
        min: u32,
        max: u32,
    },
    /// Inside a string: `count` characters so far; `esc` 0 = none, 1 = after `\`, 2..=5 = that
    /// many minus one hex digits of `\u` left.
    Str {
        min: u32,
        max: u32,
        count: u32,
        esc: u8,
    },
    Num {
        state: NumState,
        integer: bool,
    },
    /// After `{` of object node `obj` (or after a property): the next property may be `next`
    /// or any later one past optional ones; `first` means no property was written yet.
    Obj {
        obj: NodeId,
        next: u16,
        first: bool,
    },
    /// After `{` of a map (or after an entry) whose values are `values`.
    Map {
        values: NodeId,
        first: bool,
    },
    /// After `[` (or after an item): `count` items written.
    Arr {
        arr: NodeId,
        count: u32,
    },
}

impl Task {
    /// Whether whitespace may come before this task's next byte.
    fn takes_whitespace(&self) -> bool {
        match self {
            Task::Value(_) | Task::StrStart { .. } | Task::Obj { .. } | Task::Map { .. } | Task::Arr { .. } => true,
            Task::Lit { pos, .. } => *pos == 0,
            Task::Str { .. } | Task::Num { .. } => false,
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct Path {
    stack: Vec<Task>,
    whitespace_run: u8,
}

impl Path {
    /// Complete: nothing left, or only a number that may end here.
    fn is_complete(&self) -> bool {
        match self.stack.as_slice() {
            [] => true,
            [Task::Num { state, .. }] => state.can_end(),
            _ => false,
        }
    }
}

#[derive(Debug)]
pub struct SchemaState {
    schema: Arc<Schema>,
    paths: Vec<Path>,
    max_whitespace_run: u8,
    /// Which bytes may come next, worked out once `accepts` has been asked [`TABLE_AFTER`] times
    /// since the last change: a pass over the vocabulary then refuses most tokens by their first
    /// byte without copying the paths, while a step whose first draw is allowed never pays the
    /// 256 probes the table costs.
    next_bytes: OnceLock<[u64; 4]>,
    probes: AtomicU32,
}

/// `accepts` calls on one state before it builds its byte table.
const TABLE_AFTER: u32 = 8;

/// A copy without the byte table: the copy is made to be fed (which resets the table), and
/// `OnceLock`'s own clone would initialise a new cell every time (its slow path).
impl Clone for SchemaState {
    fn clone(&self) -> Self {
        Self {
            schema: self.schema.clone(),
            paths: self.paths.clone(),
            max_whitespace_run: self.max_whitespace_run,
            next_bytes: OnceLock::new(),
            probes: AtomicU32::new(0),
        }
    }
}

impl SchemaState {
    pub fn new(schema: Arc<Schema>) -> Self {
        Self::with_whitespace(schema, JsonWhitespace::Flexible)
    }

    pub fn with_whitespace(schema: Arc<Schema>, whitespace: JsonWhitespace) -> Self {
        let root = schema.root;
        Self {
            schema,
            paths: vec![Path { stack: vec![Task::Value(root)], whitespace_run: 0 }],
            max_whitespace_run: whitespace.max_run(),
            next_bytes: OnceLock::new(),
            probes: AtomicU32::new(0),
        }
    }

    pub fn is_complete(&self) -> bool {
        self.paths.iter().any(Path::is_complete)
    }

    /// Whether appending `bytes` keeps the output a valid prefix.
    pub fn accepts(&self, bytes: &[u8]) -> bool {
        let Some(&first) = bytes.first() else { return true };
        match self.first_byte(first) {
            Some(false) => false,
            Some(true) if bytes.len() == 1 => true,
            _ => self.clone().feed(bytes),
        }
    }

    /// Whether `b` may come next, from the byte table; `None` while the table is not built.
    fn first_byte(&self, b: u8) -> Option<bool> {
        let table = match self.next_bytes.get() {
            Some(table) => table,
            None if self.probes.fetch_add(1, Ordering::Relaxed) < TABLE_AFTER => return None,
            None => self.next_bytes.get_or_init(|| {
                let mut table = [0u64; 4];
                for c in 0..=255u8 {
                    if self.clone().feed(&[c]) {
                        table[c as usize / 64] |= 1 << (c % 64);
                    }
                }
                table
            }),
        };
        Some(table[b as usize / 64] >> (b % 64) & 1 == 1)
    }

    /// Appends `bytes`; false (and the state is then dead) when no path accepts them.
    pub fn feed(&mut self, bytes: &[u8]) -> bool {
        // Called for every candidate token (the whole vocabulary when a step masks it), so the
        // two path buffers are reused across bytes rather than allocated per byte.
        if !bytes.is_empty() {
            self.next_bytes = OnceLock::new();
            self.probes = AtomicU32::new(0);
        }
        let m = Matcher { schema: &self.schema, max_whitespace_run: self.max_whitespace_run };
        let mut next = Vec::with_capacity(self.paths.len());
        for &b in bytes {
            for p in self.paths.drain(..) {
                m.step(p, b, &mut next, 0);
            }
            dedup(&mut next);
            if next.is_empty() {
                return false;
            }
            next.truncate(MAX_PATHS);
            std::mem::swap(&mut self.paths, &mut next);
        }
        true
    }
}

/// Drops repeated paths, keeping each one's first occurrence (the order `truncate` keeps).
fn dedup(paths: &mut Vec<Path>) {
    match paths.len() {
        // Usually one path, or a few after a union: comparing beats hashing (and cloning) them.
        0..=1 => {}
        2..=16 => {
            let mut i = 1;
            while i < paths.len() {
                if paths[..i].contains(&paths[i]) {
                    paths.remove(i);
                } else {
                    i += 1;
                }
            }
        }
        _ => {
            let mut seen = std::collections::HashSet::new();
            let first: Vec<bool> = paths.iter().map(|p| seen.insert(p)).collect();
            let mut keep = first.into_iter();
            paths.retain(|_| keep.next().unwrap_or(false));
        }
    }
}

fn lit_bytes(schema: &Schema, src: LitSrc) -> &[u8] {
    match src {
        LitSrc::Static(s) => s,
        LitSrc::Node(n) => match schema.node(n) {
            Node::Lit(b) => b,
            _ => b"",
        },
        LitSrc::Key { obj, prop } => match schema.node(obj) {
            Node::Object { props } => &props[prop as usize].key,
            _ => b"",
        },
    }
}

/// The schema and the generation settings one byte is matched under.
struct Matcher<'a> {
    schema: &'a Schema,
    max_whitespace_run: u8,
}

impl Matcher<'_> {
    /// `path` with `b` matched, pushed onto `out` (none when `b` cannot come next, several when
    /// the path forks).
    fn step(&self, mut path: Path, b: u8, out: &mut Vec<Path>, expansions: u32) {
        let schema = self.schema;
        if path.stack.len() > MAX_STACK || expansions > MAX_EXPANSION {
            return;
        }
        let Some(&top) = path.stack.last() else { return };
        if matches!(b, b' ' | b'\n' | b'\t' | b'\r') && top.takes_whitespace() {
            if path.whitespace_run < self.max_whitespace_run {
                path.whitespace_run += 1;
                out.push(path);
            }
            return;
        }
        if !matches!(b, b' ' | b'\n' | b'\t' | b'\r') {
            path.whitespace_run = 0;
        }
        path.stack.pop();
        // Pushes `tasks` (the last one on top) and matches `b` against the new top.
        let then = |mut p: Path, tasks: &[Task], out: &mut Vec<Path>| {
            p.stack.extend_from_slice(tasks);
            self.step(p, b, out, expansions + 1);
        };
        // Pushes `tasks` with `b` already consumed.
        let done = |mut p: Path, tasks: &[Task], out: &mut Vec<Path>| {
            p.stack.extend_from_slice(tasks);
            out.push(p);
        };
        match top {
            Task::Value(n) => match schema.node(n) {
                Node::Union(branches) => {
                    for &br in branches {
                        then(path.clone(), &[Task::Value(br)], out);
                    }
                }
                Node::Any => match b {
                    b'{' => done(path, &[Task::Map { values: ANY, first: true }], out),
                    b'[' => done(path, &[Task::Arr { arr: ANY, count: 0 }], out),
                    b'"' => done(path, &[Task::Str { min: 0, max: u32::MAX, count: 0, esc: 0 }], out),
                    b't' => done(path, &[Task::Lit { src: LitSrc::Static(b"true"), pos: 1 }], out),
                    b'f' => done(path, &[Task::Lit { src: LitSrc::Static(b"false"), pos: 1 }], out),
                    b'n' => done(path, &[Task::Lit { src: LitSrc::Static(b"null"), pos: 1 }], out),
                    _ => {
                        if let Some(state) = NumState::start(b) {
                            done(path, &[Task::Num { state, integer: false }], out);
                        }
                    }
                },
                &Node::Str { min, max } => {
                    if b == b'"' {
                        done(path, &[Task::Str { min, max, count: 0, esc: 0 }], out);
                    }
                }
                &Node::Num { integer } => {
                    if let Some(state) = NumState::start(b) {
                        done(path, &[Task::Num { state, integer }], out);
                    }
                }
                Node::Lit(_) => then(path, &[Task::Lit { src: LitSrc::Node(n), pos: 0 }], out),
                Node::Array { .. } => {
                    if b == b'[' {
                        done(path, &[Task::Arr { arr: n, count: 0 }], out);
                    }
                }
                Node::Object { .. } => {
                    if b == b'{' {
                        done(path, &[Task::Obj { obj: n, next: 0, first: true }], out);
                    }
                }
                &Node::Map { values } => {
                    if b == b'{' {
                        done(path, &[Task::Map { values, first: true }], out);
                    }
                }
                Node::Pending => {}
            },
            Task::Lit { src, pos } => {
                let bytes = lit_bytes(schema, src);
                if bytes.get(pos as usize) == Some(&b) {
                    if (pos as usize) + 1 < bytes.len() {
                        done(path, &[Task::Lit { src, pos: pos + 1 }], out);
                    } else {
                        out.push(path);
                    }
                }
            }
            Task::StrStart { min, max } => {
                if b == b'"' {
                    done(path, &[Task::Str { min, max, count: 0, esc: 0 }], out);
                }
            }
            Task::Str { min, max, count, esc } => string_byte(path, b, min, max, count, esc, out),
            Task::Num { state, integer } => match state.next(b, integer) {
                Some(s) => done(path, &[Task::Num { state: s, integer }], out),
                // The number ended: `b` belongs to what follows it.
                None if state.can_end() => self.step(path, b, out, expansions + 1),
                None => {}
            },
            Task::Obj { obj, next, first } => {
                let Node::Object { props } = schema.node(obj) else { return };
                if b == b'}' && props[next as usize..].iter().all(|p| !p.required) {
                    out.push(path.clone());
                }
                if first || b == b',' {
                    // Any property from `next` on, skipping only optional ones.
                    for (j, prop) in props.iter().enumerate().skip(next as usize) {
                        let tasks = [
                            Task::Obj { obj, next: j as u16 + 1, first: false },
                            Task::Value(prop.node),
                            Task::Lit { src: LitSrc::Static(b":"), pos: 0 },
                            Task::Lit { src: LitSrc::Key { obj, prop: j as u16 }, pos: 0 },
                        ];
                        if first {
                            then(path.clone(), &tasks, out);
                        } else {
                            done(path.clone(), &tasks, out);
                        }
                        if prop.required {
                            break;
                        }
                    }
                }
            }
            Task::Map { values, first } => {
                let key = Task::Str { min: 0, max: u32::MAX, count: 0, esc: 0 };
                let colon = Task::Lit { src: LitSrc::Static(b":"), pos: 0 };
                match (b, first) {
                    (b'}', _) => out.push(path),
                    (b'"', true) => {
                        done(path, &[Task::Map { values, first: false }, Task::Value(values), colon, key], out)
                    }
                    (b',', false) => done(
                        path,
                        &[
                            Task::Map { values, first: false },
                            Task::Value(values),
                            colon,
                            Task::StrStart { min: 0, max: u32::MAX },
                        ],
                        out,
                    ),
                    _ => {}
                }
            }
            Task::Arr { arr, count } => {
                let (items, min, max) = match schema.node(arr) {
                    &Node::Array { items, min, max } => (items, min, max),
                    _ => (ANY, 0, u32::MAX),
                };
                if b == b']' && count >= min {
                    out.push(path.clone());
                }
                if count == 0 && max > 0 {
                    then(path, &[Task::Arr { arr, count: 1 }, Task::Value(items)], out);
                } else if count > 0 && b == b',' && count < max {
                    done(path, &[Task::Arr { arr, count: count + 1 }, Task::Value(items)], out);
                }
            }
        }
    }
}

/// One byte inside a string body: `path` (the string's task popped) moves on, or is dropped when
/// `b` cannot come next. Moved, not cloned: this runs for every byte of every string.
#[allow(clippy::too_many_arguments)]
fn string_byte(mut path: Path, b: u8, min: u32, max: u32, count: u32, esc: u8, out: &mut Vec<Path>) {
    enum Next {
        Stay { count: u32, esc: u8 },
        Close,
        Refuse,
    }
    let next = match esc {
        0 => match b {
            b'"' if count >= min => Next::Close,
            b'"' => Next::Refuse,
            b'\\' if count < max => Next::Stay { count: count + 1, esc: 1 },
            0x00..=0x1f => Next::Refuse,
            // A UTF-8 continuation byte adds no character.
            0x80..=0xbf => Next::Stay { count, esc: 0 },
            _ if count < max => Next::Stay { count: count + 1, esc: 0 },
            _ => Next::Refuse,
        },
        1 => match b {
            b'"' | b'\\' | b'/' | b'b' | b'f' | b'n' | b'r' | b't' => Next::Stay { count, esc: 0 },
            b'u' => Next::Stay { count, esc: 5 },
            _ => Next::Refuse,
        },
        _ if b.is_ascii_hexdigit() => Next::Stay { count, esc: if esc == 2 { 0 } else { esc - 1 } },
        _ => Next::Refuse,
    };
    match next {
        Next::Stay { count, esc } => {
            path.stack.push(Task::Str { min, max, count, esc });
            out.push(path);
        }
        Next::Close => out.push(path),
        Next::Refuse => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn state(schema: serde_json::Value) -> SchemaState {
        SchemaState::new(Arc::new(Schema::compile(&schema).unwrap()))
    }

    /// Whether `text` is accepted whole, and complete at its end.
    fn check(s: &SchemaState, text: &str) -> (bool, bool) {
        let mut s = s.clone();
        let ok = s.feed(text.as_bytes());
        (ok, ok && s.is_complete())
    }

    #[test]
    fn objects_follow_their_properties() {
        let s = state(json!({"type": "object", "properties": {
            "name": {"type": "string", "maxLength": 5},
            "age": {"type": "integer"},
            "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
            "ok": {"type": "boolean"}
        }, "required": ["name", "age"]}));
        for good in [
            r#"{"name": "Ann", "age": 30}"#,
            r#"{"name":"Ann","age":-3,"tags":["a","b"],"ok":true}"#,
            "{\n  \"name\": \"\\u00e9\",\n  \"age\": 0,\n  \"ok\": false\n}",
            r#"{"name": "", "age": 7, "tags": []}"#,
        ] {
            assert_eq!(check(&s, good), (true, true), "{good}");
        }
        for bad in [
            r#"{"age": 30"#,                                     // a required property skipped
            r#"{"name": "Ann"}"#,                                // closed before a required one
            r#"{"name": "Annabel""#,                             // longer than maxLength
            r#"{"name": "A", "age": 1.5"#,                       // not an integer
            r#"{"name": "A", "age": 1, "tags": ["c""#,           // not in the enum
            r#"{"name": "A", "age": 1, "tags": ["a", "b", "a""#, // over maxItems
            r#"{"name": "A", "age": 1, "extra": 1"#,             // undeclared
            r#"{"name": "A", "ok": true, "age": 1"#,             // out of the declared order
            r#"["#,
        ] {
            assert!(!check(&s, bad).0, "{bad}");
        }
        assert_eq!(check(&s, r#"{"name": "A", "age": 12"#), (true, false), "a number in an object is not the end");
    }

    #[test]
    fn unions_refs_and_free_values() {
        let s = state(json!({
            "$defs": {"tree": {"type": "object", "properties": {"v": {"type": ["integer", "null"]}, "kids": {"type": "array", "items": {"$ref": "#/$defs/tree"}}}, "required": ["v"]}},
            "type": "object",
            "properties": {"root": {"$ref": "#/$defs/tree"}, "meta": {}, "pick": {"anyOf": [{"const": "x"}, {"type": "number"}]}},
            "required": ["root", "meta", "pick"]
        }));
        let good = r#"{"root": {"v": 1, "kids": [{"v": null}, {"v": 2, "kids": []}]}, "meta": {"a": [1, "s", true, null, {"b": -1.5e3}]}, "pick": 2.5}"#;
        assert_eq!(check(&s, good), (true, true));
        assert_eq!(check(&s, r#"{"root": {"v": 1}, "meta": null, "pick": "x"}"#), (true, true));
        assert!(!check(&s, r#"{"root": {"v": "1""#).0);
        assert!(!check(&s, r#"{"root": {"v": 1}, "meta": 1, "pick": "y""#).0);
        // A schema-less root is any object.
        let any = state(json!({}));
        assert_eq!(check(&any, r#"{"k": [1, {"z": false}]}"#), (true, true));
        assert!(!check(&any, "1").0);
    }

    #[test]
    fn whitespace_runs_and_control_bytes_are_bounded() {
        let s = state(json!({"type": "object", "properties": {"a": {"type": "string"}}}));
        assert!(check(&s, &format!("{{{}\"a\": \"x\"}}", " ".repeat(16))).0);
        assert!(!check(&s, &format!("{{{}", " ".repeat(17))).0);
        assert!(!check(&s, "{\"a\": \"x\ny\"}").0, "a raw newline inside a string");
        assert!(!check(&s, "{\"a\": \"\\q\"}").0, "an unknown escape");
    }

    #[test]
    fn disabled_whitespace_takes_compact_text_only() {
        let schema = Arc::new(Schema::compile(&json!({"type": "object", "properties": {"a": {"type": "array", "items": {"type": "string"}}, "b": {"type": "integer"}}, "required": ["a"]})).unwrap());
        let compact = SchemaState::with_whitespace(schema.clone(), JsonWhitespace::Disabled);
        assert_eq!(check(&compact, r#"{"a":["x y","z"],"b":-3}"#), (true, true));
        for spaced in [
            r#" {"a":[]}"#,
            r#"{ "a":[]}"#,
            r#"{"a" :[]}"#,
            r#"{"a": []}"#,
            r#"{"a":[ "x"]}"#,
            r#"{"a":["x"] ,"b":1}"#,
            "{\"a\":[]\n}",
        ] {
            assert!(!check(&compact, spaced).0, "{spaced}");
            assert_eq!(check(&SchemaState::new(schema.clone()), spaced), (true, true), "{spaced}");
        }
    }

    /// `accepts` answers from its byte table and a probe copy; it must agree with feeding a copy
    /// (the definition) for every byte and for longer texts, also after the state moved on (the
    /// table of the previous state must not survive a `feed`).
    #[test]
    fn accepts_agrees_with_feeding_a_copy() {
        let s = state(
            json!({"type": "object", "properties": {"a": {"type": "array", "items": {"type": "number"}}, "b": {"enum": ["x y", null]}}}),
        );
        let texts: Vec<Vec<u8>> = (0..=255u8)
            .map(|b| vec![b])
            .chain(
                [r#""a": ["#, r#" "b""#, "1.5e3,", r#"null}"#, r#""x y"}"#, "\n\t ", r#""a"#]
                    .map(|t| t.as_bytes().to_vec()),
            )
            .collect();
        let mut st = s.clone();
        for step in [&br#"{"#[..], br#" "a""#, b": [", b"1", b".25", b", -3]", br#", "b": "#, b"\"x", b" y\"", b"}"] {
            for t in &texts {
                let mut copy = st.clone();
                assert_eq!(
                    st.accepts(t),
                    copy.feed(t),
                    "after {:?}: {:?}",
                    String::from_utf8_lossy(step),
                    String::from_utf8_lossy(t)
                );
            }
            assert!(st.feed(step), "{:?}", String::from_utf8_lossy(step));
        }
        assert!(st.is_complete());
        assert!(!st.accepts(b" ") && !st.accepts(b"}"));
    }

    #[test]
    fn the_path_set_stays_bounded() {
        // 30 optional properties: after a comma any of them may come next.
        let props: serde_json::Map<String, serde_json::Value> =
            (0..30).map(|i| (format!("p{i}"), json!({"type": "integer"}))).collect();
        let s = state(json!({"type": "object", "properties": props}));
        let mut st = s.clone();
        assert!(st.feed(br#"{"p0": 1,"#));
        assert!(st.paths.len() <= MAX_PATHS);
        assert!(st.feed(br#" "p29": 2}"#) && st.is_complete());
    }
}
