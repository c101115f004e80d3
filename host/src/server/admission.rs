//! The one path from a parsed generation request to the engine, shared by every endpoint that
//! generates (chat and text completions today). An endpoint opens a [`Gate`], builds its engine
//! requests (rendering and tokenizing are its own business) and hands them to [`Gate::submit`],
//! the only way to get a running [`Generation`]. The steps, in order:
//!
//! 1. the served model (404) and the caller's model allow-list (404);
//! 2. the endpoint's own cheap request checks (400), before any tokenizing;
//! 3. the tenancy precheck: a caller at a limit that refuses any request gets its 429 before its
//!    prompt costs any work;
//! 4. the in-flight gate (503 while the server shuts down);
//!    — the endpoint renders / tokenizes and builds its engine requests —
//! 5. engine validation (400: the client's error);
//! 6. request policies: every policy deployment serving (model, tenant) and the policy the key or
//!    tenant is bound to, in name order, each free to reject or rewrite each engine request;
//! 7. engine validation again (what a policy's rewrite made invalid is a 500 `policy_error`);
//! 8. tenancy admission: context limit, rpm/tpm/concurrency/budget reservation (429);
//! 9. submission to the engine. The policies are told the outcome when each prompt's choices
//!    end (`observe`), and the tenant's usage row is written, by the [`Generation`].

use std::time::Instant;

use super::error::{ApiError, ApiResult};
use super::generation::Generation;
use super::state::{AppState, InFlight};
use super::tenancy::{self as tenancy, CallerExt};
use crate::engine::EngineRequest;
use crate::plugins::apply::{self, Applied, PolicyError};

/// A generation request past the cheap checks (steps 1-4), holding its in-flight slot.
pub struct Gate {
    state: AppState,
    caller: CallerExt,
    endpoint: &'static str,
    started: Instant,
    in_flight: InFlight,
}

/// Engine requests that went through every step of the pipeline, ready to submit. Only
/// [`Gate::submit`] makes one, so nothing reaches the engine around the policies and limits.
pub struct Admitted {
    pub(super) reqs: Vec<EngineRequest>,
    pub(super) policies: Vec<Applied>,
    pub(super) tenancy: Option<tenancy::Admission>,
    pub(super) in_flight: InFlight,
    pub(super) started: Instant,
}

impl Gate {
    /// Steps 1-4. `request_checks` is the endpoint's own validation of the request as parsed
    /// (fields it does not support, combinations it refuses): cheap, run before the precheck;
    /// what it returns comes back beside the gate.
    pub fn open<T>(
        state: &AppState,
        caller: &CallerExt,
        endpoint: &'static str,
        model: Option<&str>,
        request_checks: impl FnOnce() -> ApiResult<T>,
    ) -> ApiResult<(Gate, T)> {
        let started = Instant::now();
        state.check_model(model)?;
        tenancy::check_model(caller, &state.served_model_name)?;
        let checked = request_checks()?;
        tenancy::precheck(state, caller)?;
        let in_flight = state.enter()?;
        Ok((Gate { state: state.clone(), caller: caller.clone(), endpoint, started, in_flight }, checked))
    }

    /// The caller's tenant id ("" without tenancy): what plugins are selected by.
    pub fn tenant(&self) -> &str {
        self.caller.as_ref().map_or("", |c| c.0.principal.tenant.id.as_str())
    }

    /// Steps 5-9 for `reqs` (one per prompt). `name_errors` rewrites an error to name the
    /// endpoint's own field (e.g. a context overflow is `prompt` on text completions and
    /// `messages` on chat).
    pub async fn submit(
        self,
        mut reqs: Vec<EngineRequest>,
        name_errors: impl Fn(ApiError) -> ApiError,
    ) -> ApiResult<Generation> {
        let state = &self.state;
        for r in &reqs {
            state.engine.validate(r).map_err(|e| name_errors(e.into()))?;
        }
        let mut policies = Vec::new();
        let bound = self.caller.as_ref().and_then(|c| c.0.principal.request_policy());
        let serving = match &state.plugins {
            Some(reg) => apply::policies_for(reg, &state.served_model_name, self.tenant(), bound)?,
            // No plugin registry: nothing is deployed, so a binding cannot be honoured.
            None => match bound {
                Some(policy) => return Err(PolicyError::BindingMissing { policy: policy.to_string() }.into()),
                None => Vec::new(),
            },
        };
        if !serving.is_empty() {
            // Guest code: on the plugin pool, never on an async worker.
            let (st, tenant) = (state.clone(), self.tenant().to_string());
            let (back, applied) = state
                .plugin_calls
                .run(move || {
                    let mut applied = Vec::new();
                    for r in &mut reqs {
                        match apply::apply(&serving, &st.served_model_name, &tenant, r) {
                            Ok(a) => applied.push(a),
                            Err(e) => return (reqs, Err(ApiError::from(e))),
                        }
                        if let Err(e) = st.engine.validate(r) {
                            let e = ApiError::internal(format!("a request policy made the request invalid: {e}"));
                            return (reqs, Err(e.with_code("policy_error")));
                        }
                    }
                    (reqs, Ok(applied))
                })
                .await?;
            reqs = back;
            policies = applied?;
        }
        let admission =
            tenancy::admit(state, &self.caller, self.endpoint, self.started, &mut reqs).map_err(&name_errors)?;
        let admitted =
            Admitted { reqs, policies, tenancy: admission, in_flight: self.in_flight, started: self.started };
        Generation::submit(&self.state, admitted).map_err(name_errors)
    }
}
