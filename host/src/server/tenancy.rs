//! The server side of tenancy: the key check on `/v1`, admission against the limits before a
//! request reaches the engine, settlement and the usage row when it ends, and `GET /v1/usage`.
//! The admin API under `/admin` is `server::admin::tenants`.

use std::sync::Arc;
use std::time::Instant;

use axum::extract::{Request, State};
use axum::http::{header, HeaderName, HeaderValue};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use serde_json::{json, Value};

use super::error::{ApiError, ApiResult};
use super::extract::OpenAiQuery;
use super::generation::Usage;
use super::state::AppState;
use crate::engine::EngineRequest;
use crate::tenancy::db::{self, UsageQuery, UsageRow};
use crate::tenancy::limits::{Refusal, Scope};
use crate::tenancy::{Caller, Tenancy};

pub type CallerExt = Option<Extension<Arc<Caller>>>;

pub(super) fn bearer(req: &Request) -> Option<String> {
    req.headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(|v| v.trim().to_string())
}

/// The `/v1` key check in database mode: resolves the key to its tenant (401 otherwise).
pub async fn require_key(t: Arc<Tenancy>, mut req: Request, next: Next) -> Response {
    let Some(key) = bearer(&req) else { return ApiError::unauthorized().into_response() };
    match t.authenticate(key).await {
        Ok(Some(c)) => {
            req.extensions_mut().insert(Arc::new(c));
            next.run(req).await
        }
        Ok(None) => ApiError::unauthorized().into_response(),
        Err(e) => ApiError::internal(format!("authentication failed: {e:#}")).into_response(),
    }
}

fn caller_of(c: &CallerExt) -> Option<&Caller> {
    c.as_ref().map(|e| e.0.as_ref())
}

/// 404 (as OpenAI answers for a model you cannot access) when the caller's allow-list lacks
/// the served model. `model` is the served model's name (the request already matched it).
pub fn check_model(caller: &CallerExt, model: &str) -> ApiResult<()> {
    match caller_of(caller) {
        Some(c) if !c.principal.allows_model(model) => Err(ApiError::model_not_found(model)),
        _ => Ok(()),
    }
}

/// Whether the caller may see `model` in `/v1/models`.
pub fn model_visible(caller: &CallerExt, model: &str) -> bool {
    check_model(caller, model).is_ok()
}

/// An admitted request: its reservation and the usage row to write when it ends.
pub struct Admission {
    tenancy: Arc<Tenancy>,
    reservation: Option<crate::tenancy::limits::Reservation>,
    row: UsageRow,
    started: Instant,
    headers: Vec<(&'static str, String)>,
}

/// Applies the caller to the engine requests (tenant, weight, cache salt, max context) and
/// admits the request against every limit of its tenant and key, or answers 429.
pub fn admit(
    state: &AppState,
    caller: &CallerExt,
    endpoint: &str,
    started: Instant,
    reqs: &mut [EngineRequest],
) -> ApiResult<Option<Admission>> {
    let (Some(t), Some(c)) = (state.tenancy.clone(), caller_of(caller)) else { return Ok(None) };
    let p = &c.principal;
    let max_model_len = state.engine.max_model_len();
    let max_context =
        [p.tenant.settings.limits.max_context, p.key.settings.limits.max_context].into_iter().flatten().min();
    let mut tokens: u64 = 0;
    for r in reqs.iter_mut() {
        r.tenant = p.tenant.id.clone();
        r.tenant_weight = p.tenant.weight;
        r.cache_salt = p.tenant.id.clone();
        let prompt = r.prompt_ids.len();
        if let Some(mc) = max_context {
            if prompt as u64 >= mc {
                return Err(ApiError::bad_request(format!(
                    "the prompt has {prompt} tokens, at or over this key's context limit of {mc} tokens"
                ))
                .with_code("context_length_exceeded"));
            }
            r.max_tokens = r.max_tokens.min((mc as usize) - prompt);
        }
        // A request the engine would refuse is the client's error (400), not a use of its limits.
        state.engine.validate(r)?;
        let completion = r.max_tokens.min(max_model_len.saturating_sub(prompt));
        tokens = tokens.saturating_add((prompt as u64).saturating_add((r.n as u64).saturating_mul(completion as u64)));
    }
    let now_unix = db::unix_now().max(0) as u64;
    match t.limiter.admit(&scopes_of(c), tokens, Instant::now(), now_unix) {
        Err(r) => Err(rate_limited(r)),
        Ok(res) => {
            let headers = res.status.headers();
            Ok(Some(Admission {
                row: UsageRow {
                    ts: now_unix as i64,
                    request_id: String::new(),
                    tenant_id: p.tenant.id.clone(),
                    key_id: p.key.id.clone(),
                    model: state.served_model_name.clone(),
                    endpoint: endpoint.to_string(),
                    prompt_tokens: 0,
                    completion_tokens: 0,
                    cached_tokens: 0,
                    latency_ms: 0,
                    status: String::new(),
                },
                tenancy: t,
                reservation: Some(res),
                started,
                headers,
            }))
        }
    }
}

/// 429 now, before any tokenizing or rendering, for a caller that `admit` would refuse
/// whatever the request's size (see `Limiter::precheck`).
pub fn precheck(state: &AppState, caller: &CallerExt) -> ApiResult<()> {
    let (Some(t), Some(c)) = (state.tenancy.as_ref(), caller_of(caller)) else { return Ok(()) };
    t.limiter.precheck(&scopes_of(c), Instant::now(), db::unix_now().max(0) as u64).map_err(rate_limited)
}

/// The limit scopes a caller's request counts against: its tenant and its key.
fn scopes_of(c: &Caller) -> [Scope<'_>; 2] {
    let p = &c.principal;
    [
        Scope {
            id: format!("tenant:{}", p.tenant.id),
            limits: &p.tenant.settings.limits,
            budget_used: c.budget_used.0,
        },
        Scope { id: format!("key:{}", p.key.id), limits: &p.key.settings.limits, budget_used: c.budget_used.1 },
    ]
}

/// An admitted call to an endpoint that generates nothing; holds a concurrency slot until
/// finished.
pub struct CallAdmission {
    reservation: crate::tenancy::limits::Reservation,
}

impl CallAdmission {
    /// The `x-ratelimit-*` headers for the response.
    pub fn headers(&self) -> Vec<(&'static str, String)> {
        self.reservation.status.headers()
    }

    /// The call is over, whatever its answer: it stays counted against the request rate.
    pub fn finish(self) {
        self.reservation.settle(0);
    }
}

/// Admission for `/tokenize`, `/detokenize` and `/v1/usage`: they generate nothing, but
/// rendering a chat runs the template (perhaps a tenant's Wasm plugin) and a usage report reads
/// the database, so they count against the caller's request rate and concurrency like any
/// request; they reserve no tokens and write no usage row. Without this, a key switched off
/// with `rpm 0` could still keep the server busy.
pub fn admit_call(state: &AppState, caller: &CallerExt) -> ApiResult<Option<CallAdmission>> {
    let (Some(t), Some(c)) = (state.tenancy.as_ref(), caller_of(caller)) else { return Ok(None) };
    let now_unix = db::unix_now().max(0) as u64;
    match t.limiter.admit(&scopes_of(c), 0, Instant::now(), now_unix) {
        Ok(reservation) => Ok(Some(CallAdmission { reservation })),
        Err(r) => Err(rate_limited(r)),
    }
}

fn rate_limited(r: Refusal) -> ApiError {
    if r.is_permanent() {
        // No wait admits it: a 400 naming the limit, which clients do not retry.
        let mut e = ApiError::bad_request(r.message).with_code("request_too_large");
        e.headers = r.status.headers();
        return e;
    }
    let secs = r.retry_after.as_secs_f64().ceil().max(1.0) as u64;
    let mut e = ApiError::overloaded(r.message);
    e.headers = r.status.headers();
    e.headers.push(("retry-after", secs.to_string()));
    e
}

impl Admission {
    pub fn headers(&self) -> &[(&'static str, String)] {
        &self.headers
    }

    pub fn set_request_id(&mut self, id: &str) {
        self.row.request_id = id.to_string();
    }

    fn settle(&mut self, usage: &Usage, status: &str) -> UsageRow {
        if let Some(r) = self.reservation.take() {
            r.settle((usage.prompt_tokens + usage.completion_tokens) as u64);
        }
        let mut row = self.row.clone();
        row.prompt_tokens = usage.prompt_tokens as u64;
        row.completion_tokens = usage.completion_tokens as u64;
        row.cached_tokens = usage.cached_tokens as u64;
        row.latency_ms = self.started.elapsed().as_millis() as u64;
        row.status = status.to_string();
        row
    }

    /// Settles the reservation and writes the usage row, resolving once it is committed.
    pub async fn finish(mut self, usage: &Usage, status: &str) -> Result<(), String> {
        let row = self.settle(usage, status);
        self.tenancy.usage.record(row).await
    }

    /// The same without waiting (a request whose client went away).
    pub fn finish_nowait(mut self, usage: &Usage, status: &str) {
        let row = self.settle(usage, status);
        self.tenancy.usage.record_nowait(row);
    }
}

/// Adds rate-limit headers to a response.
pub fn add_headers(resp: &mut Response, headers: &[(&'static str, String)]) {
    for (k, v) in headers {
        if let Ok(v) = HeaderValue::from_str(v) {
            resp.headers_mut().insert(HeaderName::from_static(k), v);
        }
    }
}

pub(super) fn internal(e: anyhow::Error) -> ApiError {
    ApiError::internal(format!("{e:#}"))
}

/// `GET /v1/usage`: the caller's tenant's rows. A report reads the database, so it counts
/// against the caller's request rate and concurrency like `/tokenize` (see `admit_call`): a
/// tenant cannot query it in a loop without limit.
pub async fn own_usage(
    State(state): State<AppState>,
    caller: CallerExt,
    OpenAiQuery(mut q): OpenAiQuery<UsageQuery>,
) -> Response {
    let (Some(t), Some(c)) = (state.tenancy.clone(), caller_of(&caller)) else {
        return ApiError::not_found("Usage accounting needs the server to run with --db").into_response();
    };
    q.tenant = Some(c.principal.tenant.id.clone());
    admitted_call(&state, &caller, usage_json(&t, q)).await
}

/// Runs a call that generates nothing inside its tenant admission (rate and concurrency, see
/// `admit_call`), adding the rate-limit headers to whatever it answers.
pub async fn admitted_call<Fut>(state: &AppState, caller: &CallerExt, call: Fut) -> Response
where
    Fut: std::future::Future<Output = ApiResult<Json<Value>>>,
{
    let admission = match admit_call(state, caller) {
        Ok(a) => a,
        Err(e) => return e.into_response(),
    };
    let mut resp = call.await.into_response();
    if let Some(a) = admission {
        add_headers(&mut resp, &a.headers());
        a.finish();
    }
    resp
}

pub(super) async fn usage_json(t: &Arc<Tenancy>, q: UsageQuery) -> ApiResult<Json<Value>> {
    let (rows, totals) = t.with_reports_conn(move |conn| db::query_usage(conn, &q)).await.map_err(internal)?;
    Ok(Json(json!({"object": "list", "data": rows, "totals": totals})))
}
