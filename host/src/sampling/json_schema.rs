//! JSON Schema → the node graph [`super::schema_constraint`] matches output against, for
//! `response_format: {"type": "json_schema"}` and vLLM's `structured_outputs: {"json": ...}`.
//!
//! The subset is what structured-output schemas use in practice (OpenAI's strict mode, Pydantic
//! models): `type` (one or a list), `properties` / `required`, `additionalProperties` (a
//! schema-valued one only for objects without `properties`), `items`, `minItems` / `maxItems`,
//! `minLength` / `maxLength`, `enum`, `const`, `anyOf` / `oneOf`, single-schema `allOf`, and
//! `$ref` into the document (`#`, `#/$defs/...`, `#/definitions/...`, recursion included).
//! Annotations (`title`, `description`, `default`, `examples`, `format`, ...) are ignored, as the
//! JSON Schema spec lets a validator do. A validation keyword the matcher cannot enforce
//! (`pattern`, `minimum`, `uniqueItems`, ...) is an error naming it, never silently dropped.
//!
//! Generation is narrower than validation, never wider: properties come in their declared
//! order (optional ones may be skipped), an object with `properties` gets no others, strings and
//! constants use one serialisation, and `oneOf` is matched as `anyOf` (every output still
//! satisfies one branch; one that satisfies two is not excluded).

use std::collections::HashMap;

use serde_json::{Map, Value};

pub type NodeId = u32;

/// Node 0 of every schema: any JSON value.
pub const ANY: NodeId = 0;

/// Bounds on what a request may ask the matcher to track per token.
const MAX_NODES: usize = 2048;
const MAX_PROPERTIES: usize = 256;

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Node {
    Any,
    /// A string of `min..=max` characters.
    Str {
        min: u32,
        max: u32,
    },
    Num {
        integer: bool,
    },
    /// Exactly these bytes (a `const`, an `enum` value, `true`, `null`).
    Lit(Box<[u8]>),
    /// One of these.
    Union(Vec<NodeId>),
    Array {
        items: NodeId,
        min: u32,
        max: u32,
    },
    /// Declared properties in order: each key as its JSON string literal (quotes included).
    Object {
        props: Vec<Prop>,
    },
    /// Any string keys, values of one schema.
    Map {
        values: NodeId,
    },
    /// A `$ref` not yet resolved (only while compiling).
    Pending,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Prop {
    pub key: Box<[u8]>,
    pub node: NodeId,
    pub required: bool,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Schema {
    pub nodes: Vec<Node>,
    pub root: NodeId,
}

impl Schema {
    pub fn node(&self, id: NodeId) -> &Node {
        &self.nodes[id as usize]
    }

    /// Compiles `doc`. The root must be something whose text ends unambiguously (an object, an
    /// array, a string, a constant): a bare number could always take one more digit, so the
    /// output would never be known complete. A root with no type is taken as any object.
    pub fn compile(doc: &Value) -> Result<Self, String> {
        let mut c = Compiler { doc, nodes: vec![Node::Any], refs: HashMap::new(), depth: 0 };
        let mut root = c.node(doc)?;
        if root == ANY {
            root = c.push(Node::Map { values: ANY })?;
        }
        if c.nodes[root as usize] == (Node::Num { integer: true })
            || c.nodes[root as usize] == (Node::Num { integer: false })
        {
            return Err("the schema's root is a number, whose end cannot be told: wrap it in an object".into());
        }
        let schema = Self { nodes: c.nodes, root };
        if !schema.finite_values()[root as usize] {
            return Err("the schema admits no finite JSON value (its references only lead back to themselves)".into());
        }
        Ok(schema)
    }

    /// Per node, whether some finite JSON text matches it (a least fixpoint: `{"$ref": "#"}`
    /// or an object requiring itself has none, and decoding to it could only emit whitespace).
    fn finite_values(&self) -> Vec<bool> {
        let mut ok = vec![false; self.nodes.len()];
        loop {
            let mut changed = false;
            for (i, n) in self.nodes.iter().enumerate() {
                if ok[i] {
                    continue;
                }
                let now = match n {
                    Node::Union(branches) => branches.iter().any(|&b| ok[b as usize]),
                    Node::Array { items, min, .. } => *min == 0 || ok[*items as usize],
                    Node::Object { props } => props.iter().all(|p| !p.required || ok[p.node as usize]),
                    Node::Pending => false,
                    Node::Any | Node::Str { .. } | Node::Num { .. } | Node::Lit(_) | Node::Map { .. } => true,
                };
                if now {
                    ok[i] = true;
                    changed = true;
                }
            }
            if !changed {
                return ok;
            }
        }
    }
}

struct Compiler<'a> {
    doc: &'a Value,
    nodes: Vec<Node>,
    /// `$ref` target → its node (set before the target compiles, so recursion terminates).
    refs: HashMap<String, NodeId>,
    depth: usize,
}

/// Validation keywords the matcher cannot enforce.
const UNSUPPORTED: &[&str] = &[
    "pattern",
    "patternProperties",
    "minimum",
    "maximum",
    "exclusiveMinimum",
    "exclusiveMaximum",
    "multipleOf",
    "not",
    "if",
    "then",
    "else",
    "dependentRequired",
    "dependentSchemas",
    "dependencies",
    "propertyNames",
    "unevaluatedProperties",
    "unevaluatedItems",
    "contains",
    "minContains",
    "maxContains",
    "uniqueItems",
    "prefixItems",
    "minProperties",
    "maxProperties",
];

impl Compiler<'_> {
    fn push(&mut self, n: Node) -> Result<NodeId, String> {
        if self.nodes.len() >= MAX_NODES {
            return Err(format!("the schema is too large (over {MAX_NODES} nodes)"));
        }
        self.nodes.push(n);
        Ok((self.nodes.len() - 1) as NodeId)
    }

    fn node(&mut self, v: &Value) -> Result<NodeId, String> {
        self.depth += 1;
        if self.depth > 64 {
            return Err("the schema nests too deeply (over 64 levels)".into());
        }
        let r = self.node_inner(v);
        self.depth -= 1;
        r
    }

    fn node_inner(&mut self, v: &Value) -> Result<NodeId, String> {
        let o = match v {
            Value::Bool(true) => return Ok(ANY),
            Value::Bool(false) => return Err("the schema 'false' matches nothing".into()),
            Value::Object(o) => o,
            other => return Err(format!("a schema must be an object or a boolean, got {other}")),
        };
        if let Some(k) = UNSUPPORTED.iter().find(|k| o.contains_key(**k)) {
            return Err(format!("the JSON Schema keyword '{k}' is not supported in constrained decoding"));
        }
        if let Some(r) = o.get("$ref") {
            return self.reference(r);
        }
        if let Some(c) = o.get("const") {
            return self.literal(c);
        }
        if let Some(e) = o.get("enum") {
            let values = e.as_array().filter(|a| !a.is_empty()).ok_or("'enum' must be a non-empty array")?;
            let ids = values.iter().map(|x| self.literal(x)).collect::<Result<Vec<_>, _>>()?;
            return self.push(Node::Union(ids));
        }
        for key in ["anyOf", "oneOf"] {
            if let Some(list) = o.get(key) {
                let branches = list
                    .as_array()
                    .filter(|a| !a.is_empty())
                    .ok_or_else(|| format!("'{key}' must be a non-empty array"))?;
                let ids = branches.iter().map(|b| self.node(b)).collect::<Result<Vec<_>, _>>()?;
                return self.push(Node::Union(ids));
            }
        }
        if let Some(all) = o.get("allOf") {
            return match all.as_array().map(Vec::as_slice) {
                Some([one]) => self.node(one),
                _ => Err("'allOf' is supported with exactly one schema".into()),
            };
        }
        match o.get("type") {
            None if o.contains_key("properties")
                || o.contains_key("additionalProperties")
                || o.contains_key("required") =>
            {
                self.typed("object", o)
            }
            None if o.contains_key("items") => self.typed("array", o),
            None => Ok(ANY),
            Some(Value::String(t)) => self.typed(t, o),
            Some(Value::Array(types)) if !types.is_empty() => {
                let ids = types
                    .iter()
                    .map(|t| {
                        t.as_str()
                            .ok_or_else(|| "'type' entries must be strings".to_string())
                            .and_then(|t| self.typed(t, o))
                    })
                    .collect::<Result<Vec<_>, _>>()?;
                self.push(Node::Union(ids))
            }
            Some(other) => Err(format!("'type' must be a string or a list of strings, got {other}")),
        }
    }

    fn typed(&mut self, t: &str, o: &Map<String, Value>) -> Result<NodeId, String> {
        match t {
            "object" => self.object(o),
            "array" => {
                let items = match o.get("items") {
                    None => ANY,
                    Some(i) => self.node(i)?,
                };
                let (min, max) = (bound(o, "minItems", 0)?, bound(o, "maxItems", u32::MAX)?);
                if min > max {
                    return Err(format!("minItems {min} is above maxItems {max}"));
                }
                self.push(Node::Array { items, min, max })
            }
            "string" => {
                let (min, max) = (bound(o, "minLength", 0)?, bound(o, "maxLength", u32::MAX)?);
                if min > max {
                    return Err(format!("minLength {min} is above maxLength {max}"));
                }
                self.push(Node::Str { min, max })
            }
            "integer" => self.push(Node::Num { integer: true }),
            "number" => self.push(Node::Num { integer: false }),
            "boolean" => {
                let (t, f) =
                    (self.push(Node::Lit(b"true".to_vec().into()))?, self.push(Node::Lit(b"false".to_vec().into()))?);
                self.push(Node::Union(vec![t, f]))
            }
            "null" => self.push(Node::Lit(b"null".to_vec().into())),
            other => Err(format!("unknown JSON Schema type '{other}'")),
        }
    }

    fn object(&mut self, o: &Map<String, Value>) -> Result<NodeId, String> {
        let empty = Map::new();
        let props = match o.get("properties") {
            None => &empty,
            Some(Value::Object(p)) => p,
            Some(_) => return Err("'properties' must be an object".into()),
        };
        if props.len() > MAX_PROPERTIES {
            return Err(format!("an object schema may declare at most {MAX_PROPERTIES} properties"));
        }
        let required: Vec<&str> = match o.get("required") {
            None => vec![],
            Some(Value::Array(r)) => {
                r.iter().map(|k| k.as_str().ok_or("'required' entries must be strings")).collect::<Result<_, _>>()?
            }
            Some(_) => return Err("'required' must be an array of strings".into()),
        };
        if let Some(k) = required.iter().find(|k| !props.contains_key(**k)) {
            return Err(format!("required property '{k}' is not in 'properties'"));
        }
        if props.is_empty() {
            // No declared properties: a map whose values follow additionalProperties (false:
            // only the empty object).
            return match o.get("additionalProperties") {
                Some(Value::Bool(false)) => self.push(Node::Lit(b"{}".to_vec().into())),
                None | Some(Value::Bool(true)) => self.push(Node::Map { values: ANY }),
                Some(s) => {
                    let values = self.node(s)?;
                    self.push(Node::Map { values })
                }
            };
        }
        let mut list = Vec::with_capacity(props.len());
        for (k, s) in props {
            let node = self.node(s)?;
            let key = serde_json::to_string(k).expect("a string serialises").into_bytes().into_boxed_slice();
            list.push(Prop { key, node, required: required.contains(&k.as_str()) });
        }
        self.push(Node::Object { props: list })
    }

    fn literal(&mut self, v: &Value) -> Result<NodeId, String> {
        let text = serde_json::to_string(v).map_err(|e| e.to_string())?;
        self.push(Node::Lit(text.into_bytes().into()))
    }

    fn reference(&mut self, r: &Value) -> Result<NodeId, String> {
        let r = r.as_str().ok_or("'$ref' must be a string")?;
        if let Some(&id) = self.refs.get(r) {
            return Ok(id);
        }
        let pointer = r
            .strip_prefix('#')
            .ok_or_else(|| format!("only references into the schema itself ('#...') are supported, not '{r}'"))?;
        let target = self.doc.pointer(pointer).ok_or_else(|| format!("'$ref' {r} points at nothing"))?;
        // A placeholder first: a recursive reference resolves to it, and it becomes a union of
        // the one compiled target (the matcher expands unions).
        let slot = self.push(Node::Pending)?;
        self.refs.insert(r.to_string(), slot);
        let id = self.node(target)?;
        self.nodes[slot as usize] = Node::Union(vec![id]);
        Ok(slot)
    }
}

fn bound(o: &Map<String, Value>, key: &str, default: u32) -> Result<u32, String> {
    match o.get(key) {
        None => Ok(default),
        Some(v) => v
            .as_u64()
            .map(|n| n.min(u32::MAX as u64) as u32)
            .ok_or_else(|| format!("'{key}' must be a non-negative integer")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn unsupported_keywords_and_bad_schemas_are_named() {
        for (schema, want) in [
            (json!({"type": "string", "pattern": "a+"}), "'pattern'"),
            (json!({"type": "integer", "minimum": 0}), "'minimum'"),
            (json!({"type": "object", "properties": {"a": {}}, "required": ["b"]}), "'b'"),
            (json!({"$ref": "http://example.com/x"}), "only references"),
            (json!({"$ref": "#/$defs/missing"}), "points at nothing"),
            (json!({"type": "integer"}), "root is a number"),
            (json!({"type": "wat"}), "unknown JSON Schema type"),
            (json!(false), "matches nothing"),
            (json!({"type": "string", "minLength": 3, "maxLength": 2}), "minLength"),
            (json!({"$ref": "#"}), "no finite JSON value"),
            (
                json!({"type": "object", "properties": {"me": {"$ref": "#"}}, "required": ["me"]}),
                "no finite JSON value",
            ),
        ] {
            let e = Schema::compile(&schema).unwrap_err();
            assert!(e.contains(want), "{schema}: {e}");
        }
    }

    #[test]
    fn properties_keep_their_order_and_refs_may_recurse() {
        let s = Schema::compile(&json!({
            "$defs": {"node": {"type": "object", "properties": {"v": {"type": "integer"}, "next": {"anyOf": [{"$ref": "#/$defs/node"}, {"type": "null"}]}}, "required": ["v"]}},
            "$ref": "#/$defs/node"
        }))
        .unwrap();
        let Node::Union(u) = s.node(s.root) else { panic!("a reference compiles to a union") };
        let Node::Object { props } = s.node(u[0]) else { panic!("an object") };
        assert_eq!(
            props.iter().map(|p| (String::from_utf8_lossy(&p.key).into_owned(), p.required)).collect::<Vec<_>>(),
            [("\"v\"".into(), true), ("\"next\"".into(), false)]
        );
    }
}
