//! `World` for each generated binding: how to link, pre-instantiate, instantiate, describe and
//! configure a component of that world.

use wasmtime::component::{HasSelf, InstancePre, Linker};
use wasmtime::Store;

use super::bindings::{chat_template, policy, reasoning, tool};
use super::pool::World;
use super::runtime::HostState;
use super::PluginInfo;

macro_rules! world_impl {
    ($module:ident, $ty:ident, $pre:ident, $name:literal) => {
        impl World for $module::$ty {
            const WORLD: &'static str = $name;
            type Pre = $module::$pre<HostState>;
            fn link(linker: &mut Linker<HostState>) -> wasmtime::Result<()> {
                $module::$ty::add_to_linker::<HostState, HasSelf<HostState>>(linker, |s| s)
            }
            fn pre(ip: InstancePre<HostState>) -> wasmtime::Result<Self::Pre> {
                $module::$pre::new(ip)
            }
            fn instantiate(pre: &Self::Pre, store: &mut Store<HostState>) -> wasmtime::Result<Self> {
                pre.instantiate(store)
            }
            fn info(&self, store: &mut Store<HostState>) -> wasmtime::Result<PluginInfo> {
                let i = self.inference_plugins_plugin().call_info(store)?;
                Ok(PluginInfo { name: i.name, version: i.version, needs_special_tokens: i.needs_special_tokens })
            }
            fn configure(&self, store: &mut Store<HostState>, config: &str) -> wasmtime::Result<Result<(), String>> {
                self.inference_plugins_plugin().call_configure(store, config)
            }
        }
    };
}

world_impl!(chat_template, ChatTemplatePlugin, ChatTemplatePluginPre, "chat-template-plugin");
world_impl!(reasoning, ReasoningParserPlugin, ReasoningParserPluginPre, "reasoning-parser-plugin");
world_impl!(tool, ToolParserPlugin, ToolParserPluginPre, "tool-parser-plugin");
world_impl!(policy, RequestPolicyPlugin, RequestPolicyPluginPre, "request-policy-plugin");
