//! Typed calls into request-policy plugins, with the host's checks on what they return.

use std::sync::Arc;

use serde_json::{Map, Value};

use super::bindings::policy as p;
use super::error::PluginError;
use super::pool::Pool;

pub type PolicyPool = Pool<p::RequestPolicyPlugin>;

#[derive(Clone, Debug, Default)]
pub struct RequestInfo {
    pub request_id: u64,
    pub tenant: String,
    pub model: String,
    pub prompt_tokens: u32,
    /// JSON object text of the request parameters.
    pub params: String,
}

#[derive(Clone, Debug, PartialEq)]
pub enum Decision {
    Allow,
    Reject { status: u16, message: String },
    Rewrite { max_tokens_cap: Option<u32>, add_stop: Vec<String>, model: Option<String>, params: Map<String, Value> },
}

fn info(r: &RequestInfo) -> p::exports::inference::plugins::request_policy::RequestInfo {
    p::exports::inference::plugins::request_policy::RequestInfo {
        request_id: r.request_id,
        tenant: r.tenant.clone(),
        model: r.model.clone(),
        prompt_tokens: r.prompt_tokens,
        params: r.params.clone(),
    }
}

/// Largest rejection message / rewrite the host passes on.
const MAX_MESSAGE: usize = 4096;

pub fn check(pool: &Arc<PolicyPool>, req: &RequestInfo) -> Result<Decision, PluginError> {
    use p::exports::inference::plugins::request_policy::Decision as D;
    let mut lease = pool.lease()?;
    let i = info(req);
    let d = lease.call("check", |s, w| w.inference_plugins_request_policy().call_check(s, &i))?;
    Ok(match d {
        D::Allow => Decision::Allow,
        D::Reject(r) => {
            if r.message.len() > MAX_MESSAGE {
                return Err(lease.reject_output("check", format!("a {} byte rejection message", r.message.len())));
            }
            // A policy may only answer with an error status.
            let status = if (400..=599).contains(&r.status) { r.status } else { 403 };
            Decision::Reject { status, message: r.message }
        }
        D::Rewrite(w) => {
            let size = w.params.len()
                + w.add_stop.iter().map(String::len).sum::<usize>()
                + w.model.as_ref().map_or(0, String::len);
            if size > MAX_MESSAGE || w.add_stop.len() > 16 {
                return Err(lease
                    .reject_output("check", format!("a rewrite of {size} bytes / {} stop strings", w.add_stop.len())));
            }
            let params = if w.params.trim().is_empty() {
                Map::new()
            } else {
                match serde_json::from_str::<Value>(&w.params) {
                    Ok(Value::Object(m)) => m,
                    Ok(_) => return Err(lease.reject_output("check", "rewrite params is not a JSON object".into())),
                    Err(e) => {
                        return Err(lease.reject_output("check", format!("rewrite params is not valid JSON ({e})")))
                    }
                }
            };
            Decision::Rewrite { max_tokens_cap: w.max_tokens_cap, add_stop: w.add_stop, model: w.model, params }
        }
    })
}

pub fn observe(
    pool: &Arc<PolicyPool>,
    req: &RequestInfo,
    prompt_tokens: u32,
    completion_tokens: u32,
    finish_reason: &str,
) -> Result<(), PluginError> {
    let mut lease = pool.lease()?;
    let i = info(req);
    let u = p::exports::inference::plugins::request_policy::Usage {
        prompt_tokens,
        completion_tokens,
        finish_reason: finish_reason.to_string(),
    };
    lease.call("observe", |s, w| w.inference_plugins_request_policy().call_observe(s, &i, &u))
}
