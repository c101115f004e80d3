//! JSON text as Python's `json.dumps(obj, ensure_ascii=False)` writes it (what vLLM puts in
//! tool-call `arguments`). Same rules as the host's `chat::pyjson`, duplicated because plugins
//! cannot depend on the host crate.

use serde_json::Value;

pub fn dumps(v: &Value, indent: Option<usize>) -> String {
    let mut out = String::new();
    write(v, indent, 0, &mut out);
    out
}

fn write_str(s: &str, out: &mut String) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{08}' => out.push_str("\\b"),
            '\u{0c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
}

fn write_number(n: &serde_json::Number, out: &mut String) {
    if let Some(f) = n.as_f64().filter(|_| n.is_f64()) {
        // Python prints floats with repr(): always a '.' or exponent, `1e-05` style exponents.
        if f.is_finite() && f == f.trunc() && f.abs() < 1e16 {
            out.push_str(&format!("{f:.1}"));
        } else {
            let s = format!("{f:?}");
            out.push_str(&s);
        }
    } else {
        out.push_str(&n.to_string());
    }
}

fn newline(indent: Option<usize>, level: usize, out: &mut String) {
    if let Some(i) = indent {
        out.push('\n');
        out.push_str(&" ".repeat(i * level));
    }
}

fn write(v: &Value, indent: Option<usize>, level: usize, out: &mut String) {
    let item_sep = if indent.is_some() { "," } else { ", " };
    match v {
        Value::Null => out.push_str("null"),
        Value::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
        Value::Number(n) => write_number(n, out),
        Value::String(s) => write_str(s, out),
        Value::Array(a) => {
            if a.is_empty() {
                out.push_str("[]");
                return;
            }
            out.push('[');
            for (i, x) in a.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                newline(indent, level + 1, out);
                write(x, indent, level + 1, out);
            }
            newline(indent, level, out);
            out.push(']');
        }
        Value::Object(o) => {
            if o.is_empty() {
                out.push_str("{}");
                return;
            }
            out.push('{');
            for (i, (k, x)) in o.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                newline(indent, level + 1, out);
                write_str(k, out);
                out.push_str(": ");
                write(x, indent, level + 1, out);
            }
            newline(indent, level, out);
            out.push('}');
        }
    }
}

