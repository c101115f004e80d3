//! Request policies applied to an engine request: each policy serving (model, tenant) sees the
//! request in name order and may reject it (its status and message) or rewrite it; after the
//! request finishes, each is told the usage (`observe`, for its own accounting).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use axum::http::StatusCode;
use serde_json::{json, Value};

use super::chat::api_error;
use super::policy::{self, Decision, RequestInfo};
use super::registry::{Deployment, Pools, Registry};
use crate::engine::EngineRequest;
use crate::server::error::ApiError;

/// The policies that saw a request, to be told its outcome.
pub struct Applied {
    policies: Vec<(Arc<Deployment>, RequestInfo)>,
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

pub fn apply(reg: &Registry, served_model: &str, tenant: &str, req: &mut EngineRequest) -> Result<Applied, ApiError> {
    let mut applied = Applied { policies: Vec::new() };
    for d in reg.policies(served_model, tenant) {
        let Pools::Policy(pool) = &d.pools else { continue };
        let info = RequestInfo {
            request_id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
            tenant: tenant.to_string(),
            model: served_model.to_string(),
            prompt_tokens: req.prompt_ids.len().min(u32::MAX as usize) as u32,
            params: params(req).to_string(),
        };
        match policy::check(pool, &info).map_err(|e| api_error(&e))? {
            Decision::Allow => {}
            Decision::Reject { status, message } => {
                let status = StatusCode::from_u16(status).unwrap_or(StatusCode::FORBIDDEN);
                let kind = if status.is_server_error() { "server_error" } else { "invalid_request_error" };
                return Err(ApiError::new(status, kind, format!("{message} (policy '{}')", d.spec.name)).with_code("policy_rejected"));
            }
            Decision::Rewrite { max_tokens_cap, add_stop, model, params } => {
                if let Some(cap) = max_tokens_cap {
                    req.max_tokens = req.max_tokens.min(cap.max(1) as usize);
                }
                req.stop.extend(add_stop.into_iter().filter(|s| !s.is_empty()));
                if let Some(m) = model.filter(|m| m != served_model) {
                    // One model per server: routing elsewhere would need a model this server lacks.
                    return Err(ApiError::internal(format!("policy '{}' routed the request to model '{m}', which this server does not serve", d.spec.name))
                        .with_code("policy_error"));
                }
                for (k, v) in &params {
                    override_param(req, k, v).map_err(|e| ApiError::internal(format!("policy '{}': {e}", d.spec.name)).with_code("policy_error"))?;
                }
            }
        }
        applied.policies.push((d, info));
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
