//! Chat templating: turning messages (+ tools and options) into the prompt text.
//!
//! `ChatTemplate` is the interface the Wasm `chat-template` plugin world implements; the native
//! minijinja renderer here is the built-in implementation of it.

pub mod jinja;
/// One Python-exact JSON writer for the native renderer and the Wasm template plugin.
pub use wasmserve_parsers::pyjson;

use serde::{Deserialize, Serialize};
use serde_json::Value;

/// Everything a chat template sees.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct ChatTemplateInput {
    /// OpenAI-style messages, passed to the template as they are.
    pub messages: Vec<Value>,
    #[serde(default)]
    pub tools: Option<Vec<Value>>,
    #[serde(default)]
    pub add_generation_prompt: bool,
    /// Extra template variables (`reasoning_effort`, `enable_thinking`, `chat_template_kwargs`).
    #[serde(default)]
    pub extra: serde_json::Map<String, Value>,
}

pub trait ChatTemplate: Send + Sync {
    fn render(&self, input: &ChatTemplateInput) -> Result<String, RenderError>;
}

/// Why a chat template did not render: the request's fault or the renderer's.
#[derive(Clone, Debug, PartialEq)]
pub enum RenderError {
    /// The template refused the messages or options (`raise_exception`, a missing field): a 400.
    Input(String),
    /// The renderer failed (a template plugin that trapped, timed out, found every instance busy
    /// or answered garbage): the server's error, with the HTTP status and error code to report.
    Renderer { status: u16, code: &'static str, message: String },
}

impl std::fmt::Display for RenderError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RenderError::Input(m) | RenderError::Renderer { message: m, .. } => f.write_str(m),
        }
    }
}

impl std::error::Error for RenderError {}
