//! Request policies applied to an engine request: each policy serving (model, tenant), and the
//! policy the caller's key or tenant is bound to (`request_policy`), sees the request in name
//! order and may reject it (its status and message) or rewrite it; after the request finishes,
//! each is told the usage (`observe`, for its own accounting). Errors are [`PolicyError`]s; the
//! server decides what HTTP answer each one is.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use serde_json::{json, Value};

use super::error::PluginError;
use super::policy::{self, Decision, RequestInfo};
use super::registry::{Deployment, Kind, Pools, Registry};
use crate::engine::EngineRequest;

/// The policies that saw a request, to be told its outcome.
pub struct Applied {
    policies: Vec<(Arc<Deployment>, RequestInfo)>,
}

/// Why the policies did not let a request through.
#[derive(Debug)]
pub enum PolicyError {
    /// A policy refused the request: its status (a 4xx or 5xx it chose) and message.
    Rejected { policy: String, status: u16, message: String },
    /// A policy call failed (trap, timeout, invalid output, ...).
    Plugin(PluginError),
    /// A policy asked for something the host cannot do (an unknown parameter, another model).
    Misbehaved { policy: String, message: String },
    /// The caller is bound to a policy that is not deployed: refused rather than let through
    /// unchecked.
    BindingMissing { policy: String },
}

impl std::fmt::Display for PolicyError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            PolicyError::Rejected { policy, message, .. } => write!(f, "{message} (policy '{policy}')"),
            PolicyError::Plugin(e) => write!(f, "{e}"),
            PolicyError::Misbehaved { policy, message } => write!(f, "policy '{policy}': {message}"),
            PolicyError::BindingMissing { policy } => {
                write!(
                    f,
                    "this key is bound to request policy '{policy}', which is not deployed as a request-policy plugin"
                )
            }
        }
    }
}

impl std::error::Error for PolicyError {}

/// Every policy deployment that applies to a request of `tenant` for `served_model`: the ones
/// whose model and tenant lists match, plus the one the caller is bound to (`bound`, the key's
/// or tenant's stored `request_policy`), whatever its lists say; in name order, each once.
pub fn policies_for(
    reg: &Registry,
    served_model: &str,
    tenant: &str,
    bound: Option<&str>,
) -> Result<Vec<Arc<Deployment>>, PolicyError> {
    let mut list = reg.policies(served_model, tenant);
    if let Some(name) = bound {
        match reg.get(name) {
            Some(d) if d.spec.kind == Kind::RequestPolicy => {
                if !list.iter().any(|x| x.spec.name == d.spec.name) {
                    list.push(d);
                    list.sort_by(|a, b| a.spec.name.cmp(&b.spec.name));
                }
            }
            _ => return Err(PolicyError::BindingMissing { policy: name.to_string() }),
        }
    }
    Ok(list)
}

static NEXT_ID: AtomicU64 = AtomicU64::new(1);

fn params(r: &EngineRequest) -> Value {
    json!({
        "max_tokens": r.max_tokens,
        "stop": r.stop,
        "n": r.n,
        "temperature": r.sampling.temperature,
        "top_p": r.sampling.top_p,
        "top_k": r.sampling.top_k,
        "seed": r.sampling.seed,
        "presence_penalty": r.sampling.presence_penalty,
        "frequency_penalty": r.sampling.frequency_penalty,
    })
}

/// Parameter overrides a policy may make (others are refused, naming the key).
fn override_param(r: &mut EngineRequest, k: &str, v: &Value) -> Result<(), String> {
    let f = || v.as_f64().map(|x| x as f32).ok_or_else(|| format!("'{k}' must be a number"));
    match k {
        "temperature" => r.sampling.temperature = f()?,
        "top_p" => r.sampling.top_p = f()?,
        "presence_penalty" => r.sampling.presence_penalty = f()?,
        "frequency_penalty" => r.sampling.frequency_penalty = f()?,
        "top_k" => r.sampling.top_k = v.as_u64().ok_or("'top_k' must be a non-negative integer")? as usize,
        other => return Err(format!("policies cannot set '{other}'")),
    }
    Ok(())
}

/// Runs `policies` (from [`policies_for`]) on `req`: each may reject it or rewrite it.
pub fn apply(
    policies: &[Arc<Deployment>],
    served_model: &str,
    tenant: &str,
    req: &mut EngineRequest,
) -> Result<Applied, PolicyError> {
    let mut applied = Applied { policies: Vec::new() };
    for d in policies {
        let Pools::Policy(pool) = &d.pools else { continue };
        let info = RequestInfo {
            request_id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
            tenant: tenant.to_string(),
            model: served_model.to_string(),
            prompt_tokens: req.prompt_ids.len().min(u32::MAX as usize) as u32,
            params: params(req).to_string(),
        };
        let name = || d.spec.name.clone();
        match policy::check(pool, &info).map_err(PolicyError::Plugin)? {
            Decision::Allow => {}
            Decision::Reject { status, message } => {
                return Err(PolicyError::Rejected { policy: name(), status, message })
            }
            Decision::Rewrite { max_tokens_cap, add_stop, model, params } => {
                if let Some(cap) = max_tokens_cap {
                    req.max_tokens = req.max_tokens.min(cap.max(1) as usize);
                }
                req.stop.extend(add_stop.into_iter().filter(|s| !s.is_empty()));
                if let Some(m) = model.filter(|m| m != served_model) {
                    // One model per server: routing elsewhere would need a model this server lacks.
                    let message = format!("routed the request to model '{m}', which this server does not serve");
                    return Err(PolicyError::Misbehaved { policy: name(), message });
                }
                for (k, v) in &params {
                    override_param(req, k, v).map_err(|message| PolicyError::Misbehaved { policy: name(), message })?;
                }
            }
        }
        applied.policies.push((d.clone(), info));
    }
    Ok(applied)
}

impl Applied {
    /// Tells every policy that saw the request how it ended. Failures are logged only: the
    /// response is already decided.
    pub fn observe(&self, prompt_tokens: usize, completion_tokens: usize, finish_reason: &str) {
        for (d, info) in &self.policies {
            let Pools::Policy(pool) = &d.pools else { continue };
            let clamp = |n: usize| n.min(u32::MAX as usize) as u32;
            if let Err(e) = policy::observe(pool, info, clamp(prompt_tokens), clamp(completion_tokens), finish_reason) {
                tracing::warn!(error = %e, "policy observe failed");
            }
        }
    }
}
