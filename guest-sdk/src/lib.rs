//! SDK for wasmserve plugins (the `inference:plugins@0.1.0` WIT package in `wit/`).
//!
//! A plugin implements one of the traits below on a type and exports it with the matching macro:
//!
//! ```ignore
//! struct Hermes;
//! impl wasmserve_guest::Plugin for Hermes { ... }
//! impl wasmserve_guest::ToolParser for Hermes { ... }
//! wasmserve_guest::export_tool_parser!(Hermes);
//! ```
//!
//! The traits use plain Rust types (this crate's [`types`]), not wit-bindgen's, so the same code
//! runs natively: [`harness`] feeds a parser the way the host does, which is how plugin logic is
//! unit-tested with `cargo test` on the build machine. On wasm32 the export macro generates the
//! component glue (wit-bindgen) for the enabled world.

pub mod harness;
pub mod log;
pub mod types;

#[cfg(target_arch = "wasm32")]
#[doc(hidden)]
pub mod glue;

pub use types::*;

/// What every plugin provides. `configure` runs once per instance, before any other call, and
/// its result is the value the other calls see (`&self`).
pub trait Plugin: Sized + 'static {
    fn info() -> PluginInfo;
    /// `config` is the deployment's JSON config text (`{}` when none).
    fn configure(config: &str) -> Result<Self, String>;
}

pub trait ChatTemplate: Plugin {
    /// `messages` and `tools` are JSON text (arrays), passed through from the request.
    fn render(&self, messages: &str, tools: Option<&str>, options: &RenderOptions) -> Result<Rendered, String>;
}

/// An incremental reasoning parser for one streamed choice.
pub trait ReasoningStream: 'static {
    /// Must cost O(delta): the host calls it once per generated token.
    fn feed(&mut self, text: &str, token_ids: &[u32]) -> ReasoningDelta;
    fn finish(&mut self) -> ReasoningDelta;
}

pub trait ReasoningParser: Plugin {
    type Stream: ReasoningStream;
    fn stream(&self, ctx: &RequestContext) -> Self::Stream;
    fn parse(&self, text: &str, ctx: &RequestContext) -> ReasoningResult;
}

pub trait ToolStream: 'static {
    fn feed(&mut self, text: &str, token_ids: &[u32]) -> ToolDelta;
    fn finish(&mut self) -> ToolDelta;
}

pub trait ToolParser: Plugin {
    type Stream: ToolStream;
    fn stream(&self, ctx: &RequestContext) -> Self::Stream;
    fn parse(&self, text: &str, ctx: &RequestContext) -> ToolResult;
}

pub trait RequestPolicy: Plugin {
    fn check(&self, req: &RequestInfo) -> Decision;
    fn observe(&self, _req: &RequestInfo, _usage: &Usage) {}
}

/// Exports `$t` (a [`ChatTemplate`]) as the `chat-template-plugin` world.
#[macro_export]
macro_rules! export_chat_template {
    ($t:ty) => {
        #[cfg(target_arch = "wasm32")]
        type __WasmserveChatTemplate = $crate::glue::chat_template::Glue<$t>;
        #[cfg(target_arch = "wasm32")]
        $crate::glue::chat_template::__export!(__WasmserveChatTemplate with_types_in $crate::glue::chat_template);
    };
}

/// Exports `$t` (a [`ReasoningParser`]) as the `reasoning-parser-plugin` world.
#[macro_export]
macro_rules! export_reasoning_parser {
    ($t:ty) => {
        #[cfg(target_arch = "wasm32")]
        type __WasmserveReasoningParser = $crate::glue::reasoning_parser::Glue<$t>;
        #[cfg(target_arch = "wasm32")]
        $crate::glue::reasoning_parser::__export!(__WasmserveReasoningParser with_types_in $crate::glue::reasoning_parser);
    };
}

/// Exports `$t` (a [`ToolParser`]) as the `tool-parser-plugin` world.
#[macro_export]
macro_rules! export_tool_parser {
    ($t:ty) => {
        #[cfg(target_arch = "wasm32")]
        type __WasmserveToolParser = $crate::glue::tool_parser::Glue<$t>;
        #[cfg(target_arch = "wasm32")]
        $crate::glue::tool_parser::__export!(__WasmserveToolParser with_types_in $crate::glue::tool_parser);
    };
}

/// Exports `$t` (a [`RequestPolicy`]) as the `request-policy-plugin` world.
#[macro_export]
macro_rules! export_request_policy {
    ($t:ty) => {
        #[cfg(target_arch = "wasm32")]
        type __WasmserveRequestPolicy = $crate::glue::request_policy::Glue<$t>;
        #[cfg(target_arch = "wasm32")]
        $crate::glue::request_policy::__export!(__WasmserveRequestPolicy with_types_in $crate::glue::request_policy);
    };
}
