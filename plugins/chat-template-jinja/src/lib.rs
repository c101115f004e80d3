//! `chat-template-jinja`: the model's own Hugging Face chat template, rendered inside Wasm.
//!
//! Config: `{"template": "<jinja source>", "bos_token": "...", "eos_token": "..."}`. minijinja is
//! set up the way transformers sets up Jinja2 (`trim_blocks`, `lstrip_blocks`, loop controls,
//! Python string methods via pycompat, its `tojson` that writes `json.dumps` text,
//! `raise_exception`, `strftime_now`), the same as the host's native renderer
//! (host/src/chat_template/jinja.rs), so the output matches `apply_chat_template` byte for byte.
//!
//! Plugins have no clock: `strftime_now` formats the Unix time the host passes in the extra
//! variable `__now` (removed before rendering; 0 when absent).

use std::cell::Cell;

use minijinja::value::{Kwargs, Value as JValue};
use minijinja::{Environment, Error, ErrorKind};
use serde_json::{Map, Value};
use wasmserve_guest::{ChatTemplate, Plugin, PluginInfo, RenderOptions, Rendered};
use wasmserve_parsers::pyjson;
use wasmserve_parsers::strftime::format_utc;

pub struct JinjaTemplate {
    env: Environment<'static>,
    bos: String,
    eos: String,
}

thread_local! {
    static NOW: Cell<u64> = const { Cell::new(0) };
}

/// transformers' `tojson`: `json.dumps(x, ensure_ascii=False, indent=None, separators=None,
/// sort_keys=False)`, each overridable by the template (Kimi K3 passes `ensure_ascii=false`).
fn tojson(value: JValue, kwargs: Kwargs) -> Result<String, Error> {
    let separators = match kwargs.get::<Option<Vec<String>>>("separators")? {
        None => None,
        Some(v) => match <[String; 2]>::try_from(v) {
            Ok([item, key]) => Some((item, key)),
            Err(_) => {
                return Err(Error::new(ErrorKind::InvalidOperation, "tojson: separators must be an (item, key) pair"))
            }
        },
    };
    let opts = pyjson::DumpOpts {
        indent: kwargs.get("indent")?,
        separators,
        sort_keys: kwargs.get::<Option<bool>>("sort_keys")?.unwrap_or(false),
        ensure_ascii: kwargs.get::<Option<bool>>("ensure_ascii")?.unwrap_or(false),
    };
    kwargs.assert_all_used()?;
    let json: Value =
        serde_json::to_value(&value).map_err(|e| Error::new(ErrorKind::InvalidOperation, format!("tojson: {e}")))?;
    Ok(pyjson::dumps_with(&json, &opts))
}

fn raise_exception(msg: String) -> Result<String, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, msg))
}

fn strftime_now(format: String) -> String {
    format_utc(NOW.with(Cell::get), &format)
}

impl Plugin for JinjaTemplate {
    fn info() -> PluginInfo {
        PluginInfo {
            name: "chat-template-jinja".into(),
            version: env!("CARGO_PKG_VERSION").into(),
            needs_special_tokens: false,
        }
    }

    fn configure(config: &str) -> Result<Self, String> {
        let cfg: Value = serde_json::from_str(config).map_err(|e| format!("config: {e}"))?;
        let source =
            cfg.get("template").and_then(Value::as_str).ok_or("config: 'template' (the Jinja source) is required")?;
        let s = |k: &str| cfg.get(k).and_then(Value::as_str).unwrap_or("").to_string();
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
        Ok(Self { env, bos: s("bos_token"), eos: s("eos_token") })
    }
}

impl ChatTemplate for JinjaTemplate {
    fn render(&self, messages: &str, tools: Option<&str>, options: &RenderOptions) -> Result<Rendered, String> {
        let tmpl = self.env.get_template("chat").map_err(|e| e.to_string())?;
        let mut ctx: Map<String, Value> =
            match serde_json::from_str(if options.extra.is_empty() { "{}" } else { &options.extra }) {
                Ok(Value::Object(m)) => m,
                _ => return Err("options.extra must be a JSON object".into()),
            };
        NOW.with(|n| n.set(ctx.remove("__now").and_then(|v| v.as_u64()).unwrap_or(0)));
        if let Some(r) = &options.reasoning_effort {
            ctx.insert("reasoning_effort".into(), r.clone().into());
        }
        let messages: Value = serde_json::from_str(messages).map_err(|e| format!("messages: {e}"))?;
        ctx.insert("messages".into(), messages);
        if let Some(t) = tools {
            ctx.insert("tools".into(), serde_json::from_str(t).map_err(|e| format!("tools: {e}"))?);
        }
        ctx.insert("add_generation_prompt".into(), options.add_generation_prompt.into());
        ctx.insert("bos_token".into(), self.bos.clone().into());
        ctx.insert("eos_token".into(), self.eos.clone().into());
        let prompt = tmpl
            .render(JValue::from(minijinja::value::Serde(&ctx)))
            .map_err(|e| format!("chat template failed: {e:#}"))?;
        Ok(Rendered { prompt, token_ids: None })
    }
}

wasmserve_guest::export_chat_template!(JinjaTemplate);
