//! Typed calls into reasoning-parser and tool-parser plugins: whole-output `parse`, and a
//! `Session` per streamed choice that holds one leased instance (and the guest's `session`
//! resource) for the choice's lifetime.

use std::sync::Arc;

use wasmtime::component::ResourceAny;

use super::bindings::{reasoning, tool};
use super::error::PluginError;
use super::pool::{Lease, Pool};
use super::{ReasoningDelta, ReasoningResult, RequestContext, ToolCall, ToolCallDelta, ToolDelta, ToolResult};

pub type ReasoningPool = Pool<reasoning::ReasoningParserPlugin>;
pub type ToolPool = Pool<tool::ToolParserPlugin>;

macro_rules! ctx {
    ($module:ident, $c:expr) => {
        $module::inference::plugins::parse_types::RequestContext {
            tools: $c.tools.clone(),
            template_kwargs: $c.template_kwargs.clone(),
            history_tool_calls: $c.history_tool_calls,
        }
    };
}

/// Refuses output larger than the deployment allows (the guest is bounded by its memory
/// limit, the host by this).
fn check_size<W: super::pool::World>(lease: &mut Lease<W>, what: &str, bytes: usize) -> Result<(), PluginError> {
    let max = lease.pool().limits.max_output_bytes;
    if bytes > max {
        return Err(lease.reject_output(what, format!("{bytes} bytes of output, more than the {max} allowed")));
    }
    Ok(())
}

pub fn reasoning_parse(
    pool: &Arc<ReasoningPool>,
    text: &str,
    ctx: &RequestContext,
) -> Result<ReasoningResult, PluginError> {
    let mut lease = pool.lease()?;
    let c = ctx!(reasoning, ctx);
    let r = lease.call("parse", |s, w| w.inference_plugins_reasoning_parser().call_parse(s, text, &c))?;
    let size = r.reasoning.as_ref().map_or(0, String::len) + r.content.as_ref().map_or(0, String::len);
    check_size(&mut lease, "parse", size)?;
    Ok(ReasoningResult { reasoning: r.reasoning, content: r.content })
}

pub fn tool_parse(pool: &Arc<ToolPool>, text: &str, ctx: &RequestContext) -> Result<ToolResult, PluginError> {
    let mut lease = pool.lease()?;
    let c = ctx!(tool, ctx);
    let r = lease.call("parse", |s, w| w.inference_plugins_tool_parser().call_parse(s, text, &c))?;
    let size = r.content.as_ref().map_or(0, String::len)
        + r.tool_calls.iter().map(|t| t.id.len() + t.name.len() + t.arguments.len()).sum::<usize>();
    check_size(&mut lease, "parse", size)?;
    Ok(ToolResult {
        content: r.content,
        tool_calls: r
            .tool_calls
            .into_iter()
            .map(|t| ToolCall { id: t.id, name: t.name, arguments: t.arguments })
            .collect(),
    })
}

/// One streamed choice's parser state inside a leased instance.
pub struct Session<W: super::pool::World> {
    lease: Lease<W>,
    resource: Option<ResourceAny>,
}

impl<W: super::pool::World> Drop for Session<W> {
    fn drop(&mut self) {
        // Free the guest's state so the instance goes back clean; failing that, discard it.
        if let Some(r) = self.resource.take() {
            if self.lease.is_healthy() && self.lease.call("session drop", |s, _| r.resource_drop(s)).is_err() {
                self.lease.discard();
            }
        }
    }
}

pub type ReasoningSession = Session<reasoning::ReasoningParserPlugin>;
pub type ToolSession = Session<tool::ToolParserPlugin>;

pub fn reasoning_session(pool: &Arc<ReasoningPool>, ctx: &RequestContext) -> Result<ReasoningSession, PluginError> {
    let mut lease = pool.lease()?;
    let c = ctx!(reasoning, ctx);
    let r = lease
        .call("session constructor", |s, w| w.inference_plugins_reasoning_parser().session().call_constructor(s, &c))?;
    Ok(Session { lease, resource: Some(r) })
}

pub fn tool_session(pool: &Arc<ToolPool>, ctx: &RequestContext) -> Result<ToolSession, PluginError> {
    let mut lease = pool.lease()?;
    let c = ctx!(tool, ctx);
    let r = lease
        .call("session constructor", |s, w| w.inference_plugins_tool_parser().session().call_constructor(s, &c))?;
    Ok(Session { lease, resource: Some(r) })
}

impl ReasoningSession {
    fn step(&mut self, what: &str, text: Option<(&str, &[u32])>) -> Result<ReasoningDelta, PluginError> {
        let r = self.resource.ok_or_else(|| self.lease.reject_output(what, "the session is gone".into()))?;
        let d = self.lease.call(what, |s, w| {
            let g = w.inference_plugins_reasoning_parser().session();
            match text {
                Some((t, ids)) => g.call_feed(s, r, t, ids),
                None => g.call_finish(s, r),
            }
        })?;
        check_size(&mut self.lease, what, d.reasoning.len() + d.content.len())?;
        Ok(ReasoningDelta { reasoning: d.reasoning, content: d.content })
    }

    pub fn feed(&mut self, text: &str, token_ids: &[u32]) -> Result<ReasoningDelta, PluginError> {
        self.step("feed", Some((text, token_ids)))
    }

    pub fn finish(&mut self) -> Result<ReasoningDelta, PluginError> {
        self.step("finish", None)
    }
}

impl ToolSession {
    fn step(&mut self, what: &str, text: Option<(&str, &[u32])>) -> Result<ToolDelta, PluginError> {
        let r = self.resource.ok_or_else(|| self.lease.reject_output(what, "the session is gone".into()))?;
        let d = self.lease.call(what, |s, w| {
            let g = w.inference_plugins_tool_parser().session();
            match text {
                Some((t, ids)) => g.call_feed(s, r, t, ids),
                None => g.call_finish(s, r),
            }
        })?;
        let size = d.content.len()
            + d.tool_calls
                .iter()
                .map(|c| {
                    c.arguments.len() + c.id.as_ref().map_or(0, String::len) + c.name.as_ref().map_or(0, String::len)
                })
                .sum::<usize>();
        check_size(&mut self.lease, what, size)?;
        Ok(ToolDelta {
            content: d.content,
            tool_calls: d
                .tool_calls
                .into_iter()
                .map(|c| ToolCallDelta { index: c.index, id: c.id, name: c.name, arguments: c.arguments })
                .collect(),
        })
    }

    pub fn feed(&mut self, text: &str, token_ids: &[u32]) -> Result<ToolDelta, PluginError> {
        self.step("feed", Some((text, token_ids)))
    }

    pub fn finish(&mut self) -> Result<ToolDelta, PluginError> {
        self.step("finish", None)
    }
}
