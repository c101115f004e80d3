//! Host bindings for the four plugin worlds (`wit/plugins.wit`), one module each. Each world
//! imports only `logging`; its host side lives in `runtime::HostState`.

macro_rules! world {
    ($module:ident, $world:literal) => {
        pub mod $module {
            wasmtime::component::bindgen!({
                path: "../wit",
                world: $world,
            });
        }
    };
}

world!(chat_template, "chat-template-plugin");
world!(reasoning, "reasoning-parser-plugin");
world!(tool, "tool-parser-plugin");
world!(policy, "request-policy-plugin");
