//! wit-bindgen glue, wasm32 only: one module per world, compiled in by the plugin's feature.
//! `Glue<T>` implements the generated `Guest` traits by delegating to the SDK trait on `T`.

use std::any::Any;
use std::cell::RefCell;

use crate::log::Level;

thread_local! {
    // The configured plugin value (`Plugin::configure`). A component instance is single-threaded
    // and `configure` runs once before anything else, so a thread-local is the whole story.
    static INSTANCE: RefCell<Option<Box<dyn Any>>> = const { RefCell::new(None) };
}

fn set_instance<T: 'static>(value: T) {
    INSTANCE.with(|i| *i.borrow_mut() = Some(Box::new(value)));
}

/// Runs `f` on the configured plugin value. Panics (a trap, failing only this call's request)
/// when the host did not configure the instance first.
fn with_instance<T: 'static, R>(f: impl FnOnce(&T) -> R) -> R {
    INSTANCE.with(|i| {
        let guard = i.borrow();
        let v = guard.as_ref().and_then(|b| b.downcast_ref::<T>()).expect("plugin called before configure");
        f(v)
    })
}

macro_rules! plugin_glue {
    ($world:ident, $bound:path) => {
        impl<T: $bound> exports::inference::plugins::plugin::Guest for Glue<T> {
            fn info() -> exports::inference::plugins::plugin::PluginInfo {
                let i = T::info();
                exports::inference::plugins::plugin::PluginInfo {
                    name: i.name,
                    version: i.version,
                    needs_special_tokens: i.needs_special_tokens,
                }
            }
            fn configure(config: String) -> Result<(), String> {
                let v = T::configure(&config)?;
                super::set_instance(v);
                Ok(())
            }
        }

        pub(crate) fn log(level: crate::log::Level, message: &str) {
            use inference::plugins::logging::{log, Level as L};
            let l = match level {
                crate::log::Level::Trace => L::Trace,
                crate::log::Level::Debug => L::Debug,
                crate::log::Level::Info => L::Info,
                crate::log::Level::Warn => L::Warn,
                crate::log::Level::Error => L::Error,
            };
            log(l, message);
        }
    };
}

#[allow(unused_macros)]
macro_rules! ctx_from {
    ($c:expr) => {
        crate::RequestContext {
            tools: $c.tools,
            template_kwargs: $c.template_kwargs,
            history_tool_calls: $c.history_tool_calls,
        }
    };
}

#[cfg(feature = "chat-template")]
pub mod chat_template {
    wit_bindgen::generate!({
        path: "../wit",
        world: "chat-template-plugin",
        pub_export_macro: true,
        export_macro_name: "__export",
        default_bindings_module: "wasmserve_guest::glue::chat_template",
    });
    use exports::inference::plugins::chat_template as ct;

    pub struct Glue<T>(core::marker::PhantomData<T>);
    plugin_glue!(chat_template, crate::ChatTemplate);

    impl<T: crate::ChatTemplate> ct::Guest for Glue<T> {
        fn render(messages: String, tools: Option<String>, options: ct::RenderOptions) -> Result<ct::Rendered, String> {
            let opts = crate::RenderOptions {
                add_generation_prompt: options.add_generation_prompt,
                reasoning_effort: options.reasoning_effort,
                extra: options.extra,
            };
            let r = super::with_instance(|t: &T| t.render(&messages, tools.as_deref(), &opts))?;
            Ok(ct::Rendered { prompt: r.prompt, token_ids: r.token_ids })
        }
    }
}

#[cfg(feature = "reasoning-parser")]
pub mod reasoning_parser {
    wit_bindgen::generate!({
        path: "../wit",
        world: "reasoning-parser-plugin",
        pub_export_macro: true,
        export_macro_name: "__export",
        default_bindings_module: "wasmserve_guest::glue::reasoning_parser",
    });
    use crate::ReasoningStream as _;
    use exports::inference::plugins::reasoning_parser as rp;

    pub struct Glue<T>(core::marker::PhantomData<T>);
    plugin_glue!(reasoning_parser, crate::ReasoningParser);

    pub struct Session<T: crate::ReasoningParser>(core::cell::RefCell<T::Stream>);

    fn delta(d: crate::ReasoningDelta) -> rp::ReasoningDelta {
        rp::ReasoningDelta { reasoning: d.reasoning, content: d.content }
    }

    impl<T: crate::ReasoningParser> rp::GuestSession for Session<T> {
        fn new(ctx: rp::RequestContext) -> Self {
            let ctx = ctx_from!(ctx);
            Session(core::cell::RefCell::new(super::with_instance(|t: &T| t.stream(&ctx))))
        }
        fn feed(&self, text: String, token_ids: Vec<u32>) -> rp::ReasoningDelta {
            delta(self.0.borrow_mut().feed(&text, &token_ids))
        }
        fn finish(&self) -> rp::ReasoningDelta {
            delta(self.0.borrow_mut().finish())
        }
    }

    impl<T: crate::ReasoningParser> rp::Guest for Glue<T> {
        type Session = Session<T>;
        fn parse(text: String, ctx: rp::RequestContext) -> rp::ReasoningResult {
            let ctx = ctx_from!(ctx);
            let r = super::with_instance(|t: &T| t.parse(&text, &ctx));
            rp::ReasoningResult { reasoning: r.reasoning, content: r.content }
        }
    }
}

#[cfg(feature = "tool-parser")]
pub mod tool_parser {
    wit_bindgen::generate!({
        path: "../wit",
        world: "tool-parser-plugin",
        pub_export_macro: true,
        export_macro_name: "__export",
        default_bindings_module: "wasmserve_guest::glue::tool_parser",
    });
    use crate::ToolStream as _;
    use exports::inference::plugins::tool_parser as tp;

    pub struct Glue<T>(core::marker::PhantomData<T>);
    plugin_glue!(tool_parser, crate::ToolParser);

    pub struct Session<T: crate::ToolParser>(core::cell::RefCell<T::Stream>);

    fn delta(d: crate::ToolDelta) -> tp::ToolDelta {
        tp::ToolDelta {
            content: d.content,
            tool_calls: d
                .tool_calls
                .into_iter()
                .map(|c| tp::ToolCallDelta { index: c.index, id: c.id, name: c.name, arguments: c.arguments })
                .collect(),
        }
    }

    impl<T: crate::ToolParser> tp::GuestSession for Session<T> {
        fn new(ctx: tp::RequestContext) -> Self {
            let ctx = ctx_from!(ctx);
            Session(core::cell::RefCell::new(super::with_instance(|t: &T| t.stream(&ctx))))
        }
        fn feed(&self, text: String, token_ids: Vec<u32>) -> tp::ToolDelta {
            delta(self.0.borrow_mut().feed(&text, &token_ids))
        }
        fn finish(&self) -> tp::ToolDelta {
            delta(self.0.borrow_mut().finish())
        }
    }

    impl<T: crate::ToolParser> tp::Guest for Glue<T> {
        type Session = Session<T>;
        fn parse(text: String, ctx: tp::RequestContext) -> tp::ToolResult {
            let ctx = ctx_from!(ctx);
            let r = super::with_instance(|t: &T| t.parse(&text, &ctx));
            tp::ToolResult {
                content: r.content,
                tool_calls: r
                    .tool_calls
                    .into_iter()
                    .map(|c| tp::ToolCall { id: c.id, name: c.name, arguments: c.arguments })
                    .collect(),
            }
        }
    }
}

#[cfg(feature = "request-policy")]
pub mod request_policy {
    wit_bindgen::generate!({
        path: "../wit",
        world: "request-policy-plugin",
        pub_export_macro: true,
        export_macro_name: "__export",
        default_bindings_module: "wasmserve_guest::glue::request_policy",
    });
    use exports::inference::plugins::request_policy as rp;

    pub struct Glue<T>(core::marker::PhantomData<T>);
    plugin_glue!(request_policy, crate::RequestPolicy);

    fn info(r: rp::RequestInfo) -> crate::RequestInfo {
        crate::RequestInfo {
            request_id: r.request_id,
            tenant: r.tenant,
            model: r.model,
            prompt_tokens: r.prompt_tokens,
            params: r.params,
        }
    }

    impl<T: crate::RequestPolicy> rp::Guest for Glue<T> {
        fn check(req: rp::RequestInfo) -> rp::Decision {
            let req = info(req);
            match super::with_instance(|t: &T| t.check(&req)) {
                crate::Decision::Allow => rp::Decision::Allow,
                crate::Decision::Reject(r) => {
                    rp::Decision::Reject(rp::Rejection { status: r.status, message: r.message })
                }
                crate::Decision::Rewrite(w) => rp::Decision::Rewrite(rp::Rewrite {
                    max_tokens_cap: w.max_tokens_cap,
                    add_stop: w.add_stop,
                    model: w.model,
                    params: w.params,
                }),
            }
        }
        fn observe(req: rp::RequestInfo, usage: rp::Usage) {
            let req = info(req);
            let u = crate::Usage {
                prompt_tokens: usage.prompt_tokens,
                completion_tokens: usage.completion_tokens,
                finish_reason: usage.finish_reason,
            };
            super::with_instance(|t: &T| t.observe(&req, &u))
        }
    }
}

/// Sends a log line through whichever world this plugin was built for.
#[allow(unreachable_code, unused_variables)]
pub fn log(level: Level, message: &str) {
    #[cfg(feature = "chat-template")]
    return chat_template::log(level, message);
    #[cfg(feature = "reasoning-parser")]
    return reasoning_parser::log(level, message);
    #[cfg(feature = "tool-parser")]
    return tool_parser::log(level, message);
    #[cfg(feature = "request-policy")]
    return request_policy::log(level, message);
}
