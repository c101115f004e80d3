//! Native renderer for Hugging Face Jinja chat templates, with minijinja configured the way
//! transformers configures Jinja2 (`trim_blocks`, `lstrip_blocks`, loop controls, Python string
//! methods, its own `tojson`, `raise_exception`, `strftime_now`).

use minijinja::value::{Kwargs, Value as JValue};
use minijinja::{Environment, Error, ErrorKind};

use wasmserve_parsers::strftime::format_utc;

use super::{pyjson, ChatTemplate, ChatTemplateInput, RenderError};

pub struct JinjaChatTemplate {
    env: Environment<'static>,
    bos_token: String,
    eos_token: String,
}

/// transformers' `tojson`: `json.dumps(x, ensure_ascii=False, indent=None, separators=None,
/// sort_keys=False)`, each overridable by the template (Kimi K3 passes `ensure_ascii=false`).
pub(crate) fn tojson(value: JValue, kwargs: Kwargs) -> Result<String, Error> {
    let opts = tojson_opts(&kwargs)?;
    kwargs.assert_all_used()?;
    let json: serde_json::Value =
        serde_json::to_value(&value).map_err(|e| Error::new(ErrorKind::InvalidOperation, format!("tojson: {e}")))?;
    Ok(pyjson::dumps_with(&json, &opts))
}

fn tojson_opts(kwargs: &Kwargs) -> Result<pyjson::DumpOpts, Error> {
    let separators = match kwargs.get::<Option<Vec<String>>>("separators")? {
        None => None,
        Some(v) => match <[String; 2]>::try_from(v) {
            Ok([item, key]) => Some((item, key)),
            Err(_) => {
                return Err(Error::new(ErrorKind::InvalidOperation, "tojson: separators must be an (item, key) pair"))
            }
        },
    };
    Ok(pyjson::DumpOpts {
        indent: kwargs.get("indent")?,
        separators,
        sort_keys: kwargs.get::<Option<bool>>("sort_keys")?.unwrap_or(false),
        ensure_ascii: kwargs.get::<Option<bool>>("ensure_ascii")?.unwrap_or(false),
    })
}

fn raise_exception(msg: String) -> Result<String, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, msg))
}

fn strftime_now(format: String) -> String {
    // Templates use this for "today's date" in system prompts. Rendered in UTC.
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
    format_utc(now, &format)
}

impl JinjaChatTemplate {
    pub fn new(source: &str, bos_token: Option<&str>, eos_token: Option<&str>) -> Result<Self, String> {
        let mut env = Environment::new();
        let syntax = minijinja::syntax::SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()
            .map_err(|e| format!("template syntax: {e}"))?;
        env.set_syntax(syntax);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_filter("tojson", tojson);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_template_owned("chat", source.to_string())
            .map_err(|e| format!("chat template does not compile: {e:#}"))?;
        Ok(Self { env, bos_token: bos_token.unwrap_or("").into(), eos_token: eos_token.unwrap_or("").into() })
    }
}

impl ChatTemplate for JinjaChatTemplate {
    fn render(&self, input: &ChatTemplateInput) -> Result<String, RenderError> {
        let tmpl = self.env.get_template("chat").map_err(|e| RenderError::Renderer {
            status: 500,
            code: "chat_template_missing",
            message: e.to_string(),
        })?;
        let mut ctx = serde_json::Map::new();
        // Extra variables first so the standard ones cannot be overridden by a client.
        for (k, v) in &input.extra {
            ctx.insert(k.clone(), v.clone());
        }
        ctx.insert("messages".into(), serde_json::Value::Array(input.messages.clone()));
        if let Some(tools) = &input.tools {
            ctx.insert("tools".into(), serde_json::Value::Array(tools.clone()));
        }
        ctx.insert("add_generation_prompt".into(), input.add_generation_prompt.into());
        ctx.insert("bos_token".into(), self.bos_token.clone().into());
        ctx.insert("eos_token".into(), self.eos_token.clone().into());
        tmpl.render(JValue::from(minijinja::value::Serde(&ctx)))
            .map_err(|e| RenderError::Input(format!("chat template failed: {e:#}")))
    }
}

/// The transformers reference fixtures the renderer's tests, and the server's, compare with.
#[cfg(test)]
pub(crate) mod fixtures {
    use std::path::{Path, PathBuf};

    fn dir() -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/reference")
    }

    /// A JSON file under tests/reference/.
    pub fn reference(file: &str) -> serde_json::Value {
        let path = dir().join(file);
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display())))
            .unwrap()
    }

    /// The source of a template named in templates/expected.json: SmolLM2's from its fixtures,
    /// the others from templates/<name>.jinja.
    pub fn template_source(name: &str) -> String {
        match name {
            "SmolLM2-135M-Instruct" => {
                reference("smollm2/fixtures.json")["chat_template"].as_str().unwrap().to_string()
            }
            _ => std::fs::read_to_string(dir().join(format!("templates/{name}.jinja"))).unwrap(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::fixtures::{reference, template_source};
    use super::*;
    use serde_json::json;

    #[test]
    fn chatml_renders_with_generation_prompt() {
        let t = JinjaChatTemplate::new(
            "{% for m in messages %}{{'<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}",
            None,
            None,
        )
        .unwrap();
        let out = t
            .render(&ChatTemplateInput {
                messages: vec![json!({"role": "user", "content": "hi"})],
                add_generation_prompt: true,
                ..Default::default()
            })
            .unwrap();
        assert_eq!(out, "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n");
    }

    #[test]
    fn raise_exception_is_an_error_and_strftime_formats() {
        let t = JinjaChatTemplate::new("{{ raise_exception('no system') }}", None, None).unwrap();
        assert!(t.render(&ChatTemplateInput::default()).unwrap_err().to_string().contains("no system"));
    }

    /// `tojson` with ensure_ascii / indent / separators / sort_keys writes what Python's
    /// json.dumps writes (tests/reference/templates/tojson_expected.json, made by transformers).
    #[test]
    fn tojson_matches_python_json_dumps() {
        let data = reference("templates/tojson_expected.json");
        let mut failures = Vec::new();
        let cases = data["cases"].as_array().unwrap();
        for case in cases {
            let t = JinjaChatTemplate::new(case["template"].as_str().unwrap(), None, None).unwrap();
            let mut extra = serde_json::Map::new();
            extra.insert("value".into(), case["value"].clone());
            let got = t.render(&ChatTemplateInput { extra, ..Default::default() });
            if got.as_deref() != Ok(case["expected"].as_str().unwrap()) {
                failures.push(format!(
                    "{} {}: got {got:?}, want {}",
                    case["value_name"], case["template"], case["expected"]
                ));
            }
        }
        assert!(failures.is_empty(), "{} of {} differ:\n{}", failures.len(), cases.len(), failures.join("\n"));
        assert!(cases.len() >= 60);
    }

    /// The native renderer gives transformers' prompts byte for byte for the real templates
    /// (tests/reference/templates/expected.json, with tools, multi-turn tool results and the
    /// templates' thinking options), and refuses what transformers refuses.
    #[test]
    fn real_templates_match_transformers() {
        let data = reference("templates/expected.json");
        let mut templates = std::collections::HashMap::new();
        let (mut same, mut refused, mut failures) = (0, 0, Vec::new());
        for case in data["cases"].as_array().unwrap() {
            let name = case["template"].as_str().unwrap();
            let t = templates.entry(name.to_string()).or_insert_with(|| {
                JinjaChatTemplate::new(&template_source(name), case["bos_token"].as_str(), case["eos_token"].as_str())
                    .unwrap()
            });
            let input = ChatTemplateInput {
                messages: case["messages"].as_array().unwrap().clone(),
                tools: case["tools"].as_array().cloned(),
                add_generation_prompt: case["add_generation_prompt"].as_bool().unwrap(),
                extra: case["kwargs"].as_object().cloned().unwrap_or_default(),
            };
            let label =
                format!("{name}/{}/gen={}/{}", case["conversation"], case["add_generation_prompt"], case["kwargs"]);
            match (t.render(&input), case["prompt"].as_str()) {
                (Ok(got), Some(want)) if got == want => same += 1,
                (Err(_), None) => refused += 1,
                (got, want) => failures.push(format!("{label}:\n--- got\n{got:?}\n--- want\n{want:?}")),
            }
        }
        assert!(failures.is_empty(), "{} differ:\n{}", failures.len(), failures.join("\n"));
        assert!(same >= 280 && refused >= 20, "{same} same, {refused} refused");
    }
}
