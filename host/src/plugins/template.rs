//! Chat-template plugins: a typed `render` call, and `WasmChatTemplate`, which stands in for the
//! native minijinja renderer behind the server's `ChatTemplate` trait. It looks its deployment
//! up on every render, so a hot-swapped template applies to the next request.

use std::sync::Arc;

use serde_json::Value;

use super::bindings::chat_template as ct;
use super::error::{FailureKind, PluginError};
use super::pool::Pool;
use super::registry::{Pools, Registry};
use crate::chat_template::{ChatTemplate, ChatTemplateInput, RenderError};

pub type TemplatePool = Pool<ct::ChatTemplatePlugin>;

pub struct Rendered {
    pub prompt: String,
    pub token_ids: Option<Vec<u32>>,
}

pub fn render(
    pool: &Arc<TemplatePool>,
    messages: &str,
    tools: Option<&str>,
    add_generation_prompt: bool,
    reasoning_effort: Option<&str>,
    extra: &str,
) -> Result<Rendered, PluginError> {
    let mut lease = pool.lease()?;
    let opts = ct::exports::inference::plugins::chat_template::RenderOptions {
        add_generation_prompt,
        reasoning_effort: reasoning_effort.map(str::to_string),
        extra: extra.to_string(),
    };
    let r = lease.call("render", |s, w| w.inference_plugins_chat_template().call_render(s, messages, tools, &opts))?;
    match r {
        Ok(r) => {
            let size = r.prompt.len() + r.token_ids.as_ref().map_or(0, |t| t.len() * 4);
            let max = pool.limits.max_output_bytes;
            if size > max {
                return Err(
                    lease.reject_output("render", format!("{size} bytes of output, more than the {max} allowed"))
                );
            }
            Ok(Rendered { prompt: r.prompt, token_ids: r.token_ids })
        }
        // The template's own refusal (raise_exception, a bad message): the instance is fine.
        Err(msg) => Err(PluginError { plugin: pool.name.to_string(), kind: FailureKind::PluginError, message: msg }),
    }
}

/// The served model's chat template, rendered by the deployment named `name`.
pub struct WasmChatTemplate {
    pub registry: Arc<Registry>,
    pub name: String,
}

impl ChatTemplate for WasmChatTemplate {
    fn render(&self, input: &ChatTemplateInput) -> Result<String, RenderError> {
        let misconfigured =
            |message: String| RenderError::Renderer { status: 500, code: "chat_template_missing", message };
        let d = self
            .registry
            .get(&self.name)
            .ok_or_else(|| misconfigured(format!("chat template plugin '{}' is not deployed", self.name)))?;
        let Pools::Template(pool) = &d.pools else {
            return Err(misconfigured(format!("plugin '{}' is not a chat template", self.name)));
        };
        let mut extra = input.extra.clone();
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
        extra.insert("__now".into(), now.into());
        let reasoning_effort = extra.remove("reasoning_effort").and_then(|v| v.as_str().map(str::to_string));
        let messages = Value::Array(input.messages.clone()).to_string();
        let tools = input.tools.as_ref().map(|t| Value::Array(t.clone()).to_string());
        render(
            pool,
            &messages,
            tools.as_deref(),
            input.add_generation_prompt,
            reasoning_effort.as_deref(),
            &Value::Object(extra).to_string(),
        )
        .map(|r| r.prompt)
        .map_err(|e| match e.kind {
            // The template's own error result (it raised): the request's fault.
            FailureKind::PluginError => RenderError::Input(e.to_string()),
            kind => RenderError::Renderer { status: kind.status(), code: kind.code(), message: e.to_string() },
        })
    }
}
