//! JSON text exactly as Python's `json.dumps` writes it: what vLLM puts in tool-call
//! `arguments` (`ensure_ascii=False`) and what transformers' `tojson` template filter writes
//! (with the template's `ensure_ascii` / `indent` / `separators` / `sort_keys`).
//!
//! The host's native template renderer uses this module too (`wasmserve::chat::pyjson`); both
//! paths are checked against tests/reference/templates/tojson_expected.json (made by Python).

use serde_json::Value;

/// `json.dumps` keyword arguments. `Default` is transformers' `tojson` default
/// (`ensure_ascii=False`, no indent, Python's default separators, insertion order).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DumpOpts {
    pub indent: Option<usize>,
    /// `(item_separator, key_separator)`; None: `(", ", ": ")`, or `(",", ": ")` with an indent.
    pub separators: Option<(String, String)>,
    pub sort_keys: bool,
    pub ensure_ascii: bool,
}

/// `json.dumps(v, ensure_ascii=False, indent=indent)`.
pub fn dumps(v: &Value, indent: Option<usize>) -> String {
    dumps_with(v, &DumpOpts { indent, ..Default::default() })
}

pub fn dumps_with(v: &Value, o: &DumpOpts) -> String {
    let (item, key) = match &o.separators {
        Some((i, k)) => (i.as_str(), k.as_str()),
        None if o.indent.is_some() => (",", ": "),
        None => (", ", ": "),
    };
    let mut out = String::new();
    write(v, &Ctx { o, item, key }, 0, &mut out);
    out
}

struct Ctx<'a> {
    o: &'a DumpOpts,
    item: &'a str,
    key: &'a str,
}

fn write_str(s: &str, ascii: bool, out: &mut String) {
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
            // ensure_ascii escapes everything outside ' '..='~' (DEL too), as UTF-16 units.
            c if ascii && !(' '..='~').contains(&c) => {
                let mut buf = [0u16; 2];
                for u in c.encode_utf16(&mut buf) {
                    out.push_str(&format!("\\u{u:04x}"));
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

/// Python's `repr(float)`: the shortest round-trip digits, positional when the decimal
/// exponent is in -4..16 (with a trailing `.0` for whole numbers), else `1.5e+16` / `1e-05`.
fn write_float(f: f64, out: &mut String) {
    if !f.is_finite() {
        // json.dumps writes these (allow_nan=True); serde_json cannot hold them, but be exact.
        out.push_str(if f.is_nan() {
            "NaN"
        } else if f > 0.0 {
            "Infinity"
        } else {
            "-Infinity"
        });
        return;
    }
    let sci = format!("{:e}", f.abs()); // shortest digits: "1.2345e-5", "1e16", "0e0"
    let (mantissa, exp) = sci.split_once('e').unwrap_or((&sci, "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    let digits: String = mantissa.chars().filter(char::is_ascii_digit).collect();
    if f.is_sign_negative() {
        out.push('-');
    }
    if (-4..16).contains(&exp) {
        if exp >= 0 {
            let int_len = exp as usize + 1;
            if digits.len() <= int_len {
                out.push_str(&digits);
                out.push_str(&"0".repeat(int_len - digits.len()));
                out.push_str(".0");
            } else {
                out.push_str(&digits[..int_len]);
                out.push('.');
                out.push_str(&digits[int_len..]);
            }
        } else {
            out.push_str("0.");
            out.push_str(&"0".repeat((-exp - 1) as usize));
            out.push_str(&digits);
        }
    } else {
        out.push_str(&digits[..1]);
        if digits.len() > 1 {
            out.push('.');
            out.push_str(&digits[1..]);
        }
        out.push_str(&format!("e{}{:02}", if exp < 0 { '-' } else { '+' }, exp.abs()));
    }
}

fn write_number(n: &serde_json::Number, out: &mut String) {
    match n.as_f64().filter(|_| n.is_f64()) {
        Some(f) => write_float(f, out),
        None => out.push_str(&n.to_string()),
    }
}

fn newline(c: &Ctx, level: usize, out: &mut String) {
    if let Some(i) = c.o.indent {
        out.push('\n');
        out.push_str(&" ".repeat(i * level));
    }
}

fn write(v: &Value, c: &Ctx, level: usize, out: &mut String) {
    match v {
        Value::Null => out.push_str("null"),
        Value::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
        Value::Number(n) => write_number(n, out),
        Value::String(s) => write_str(s, c.o.ensure_ascii, out),
        Value::Array(a) if a.is_empty() => out.push_str("[]"),
        Value::Object(o) if o.is_empty() => out.push_str("{}"),
        Value::Array(a) => {
            out.push('[');
            for (i, x) in a.iter().enumerate() {
                if i > 0 {
                    out.push_str(c.item);
                }
                newline(c, level + 1, out);
                write(x, c, level + 1, out);
            }
            newline(c, level, out);
            out.push(']');
        }
        Value::Object(o) => {
            let mut entries: Vec<(&String, &Value)> = o.iter().collect();
            if c.o.sort_keys {
                // Python sorts str keys by code point, which is UTF-8 byte order.
                entries.sort_by(|a, b| a.0.cmp(b.0));
            }
            out.push('{');
            for (i, (k, x)) in entries.into_iter().enumerate() {
                if i > 0 {
                    out.push_str(c.item);
                }
                newline(c, level + 1, out);
                write_str(k, c.o.ensure_ascii, out);
                out.push_str(c.key);
                write(x, c, level + 1, out);
            }
            newline(c, level, out);
            out.push('}');
        }
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    #[test]
    fn matches_python_json_dumps() {
        let v = json!({"name": "get_weather", "parameters": {"city": "Zürich <b>", "n": [1, 2.5, 3.0]}, "e": {}});
        assert_eq!(
            super::dumps(&v, None),
            r#"{"name": "get_weather", "parameters": {"city": "Zürich <b>", "n": [1, 2.5, 3.0]}, "e": {}}"#
        );
        assert_eq!(super::dumps(&json!({"a": [1]}), Some(2)), "{\n  \"a\": [\n    1\n  ]\n}");
    }
}
