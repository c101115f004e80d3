//! `/admin/tenants`, `/admin/keys`, `/admin/usage`: tenants, keys and usage, behind the admin key
//! (`--admin-key`; tenant keys get 403).

use std::sync::Arc;

use axum::extract::{Path, Request, State};
use axum::http::StatusCode;
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::Deserialize;
use serde_json::{json, Value};

use crate::server::error::{ApiError, ApiResult};
use crate::server::extract::{JsonBody, OpenAiJson, OpenAiQuery};
use crate::server::state::AppState;
use crate::server::tenancy::{bearer, internal, usage_json};
use crate::tenancy::db::{self, Settings, UsageQuery};
use crate::tenancy::Tenancy;

async fn require_admin(State(state): State<AppState>, req: Request, next: Next) -> Response {
    let Some(t) = state.tenancy.clone() else { return ApiError::not_found("Unknown endpoint").into_response() };
    let Some(key) = bearer(&req) else { return ApiError::unauthorized().into_response() };
    if t.is_admin(&key) {
        return next.run(req).await;
    }
    // A working tenant key is authenticated but not allowed here.
    match t.authenticate(key).await {
        Ok(Some(_)) => forbidden("The admin API needs the admin key").into_response(),
        Ok(None) if !t.has_admin() => {
            forbidden("The admin API is disabled: start the server with --admin-key").into_response()
        }
        Ok(None) => ApiError::unauthorized().into_response(),
        Err(e) => ApiError::internal(format!("authentication failed: {e:#}")).into_response(),
    }
}

fn forbidden(msg: &str) -> ApiError {
    ApiError::new(StatusCode::FORBIDDEN, "permission_error", msg).with_code("insufficient_permissions")
}

#[derive(Deserialize)]
struct CreateTenant {
    id: String,
    weight: Option<f64>,
    #[serde(flatten)]
    settings: Settings,
}

#[derive(Deserialize)]
struct CreateKey {
    tenant: String,
    name: Option<String>,
    /// Unix seconds.
    expires_at: Option<i64>,
    /// Seconds from now (instead of `expires_at`).
    expires_in: Option<i64>,
    #[serde(flatten)]
    settings: Settings,
}

macro_rules! json_body {
    ($t:ty) => {
        impl JsonBody for $t {
            fn from_json(v: Value) -> Result<Self, ApiError> {
                serde_json::from_value(v).map_err(|e| ApiError::bad_request(e.to_string()))
            }
        }
    };
}
json_body!(CreateTenant);
json_body!(CreateKey);

fn bad(e: anyhow::Error) -> ApiError {
    ApiError::bad_request(format!("{e:#}"))
}

fn tenancy(state: &AppState) -> Arc<Tenancy> {
    state.tenancy.clone().expect("admin routes exist only with a database")
}

async fn list_tenants(State(state): State<AppState>) -> ApiResult<Json<Value>> {
    let rows = tenancy(&state).with_conn(|c, _| db::list_tenants(c)).await.map_err(internal)?;
    Ok(Json(json!({"object": "list", "data": rows})))
}

async fn create_tenant(State(state): State<AppState>, OpenAiJson(b): OpenAiJson<CreateTenant>) -> ApiResult<Response> {
    let t = tenancy(&state)
        .with_conn(move |c, _| db::create_tenant(c, &b.id, b.weight.unwrap_or(1.0), &b.settings))
        .await
        .map_err(bad)?;
    Ok((StatusCode::CREATED, Json(t)).into_response())
}

async fn disable_tenant(State(state): State<AppState>, Path(id): Path<String>) -> ApiResult<Json<Value>> {
    let i = id.clone();
    let done = tenancy(&state).with_conn(move |c, _| db::disable_tenant(c, &i)).await.map_err(internal)?;
    if !done {
        return Err(ApiError::not_found(format!("no enabled tenant '{id}'")));
    }
    Ok(Json(json!({"id": id, "disabled": true})))
}

#[derive(Deserialize)]
struct KeyFilter {
    tenant: Option<String>,
}

async fn list_keys(State(state): State<AppState>, OpenAiQuery(f): OpenAiQuery<KeyFilter>) -> ApiResult<Json<Value>> {
    let rows = tenancy(&state).with_conn(move |c, _| db::list_keys(c, f.tenant.as_deref())).await.map_err(internal)?;
    Ok(Json(json!({"object": "list", "data": rows})))
}

async fn create_key(State(state): State<AppState>, OpenAiJson(b): OpenAiJson<CreateKey>) -> ApiResult<Response> {
    let expires = db::key_expiry(b.expires_at, b.expires_in).map_err(bad)?;
    let (row, key) = tenancy(&state)
        .with_conn(move |c, secret| db::create_key(c, secret, &b.tenant, b.name.as_deref(), expires, &b.settings))
        .await
        .map_err(bad)?;
    let mut v = serde_json::to_value(row).map_err(|e| ApiError::internal(e.to_string()))?;
    v["key"] = Value::String(key);
    Ok((StatusCode::CREATED, Json(v)).into_response())
}

async fn revoke_key(State(state): State<AppState>, Path(id): Path<String>) -> ApiResult<Json<Value>> {
    let i = id.clone();
    let done = tenancy(&state).with_conn(move |c, _| db::revoke_key(c, &i)).await.map_err(internal)?;
    if !done {
        return Err(ApiError::not_found(format!("no unrevoked key '{id}'")));
    }
    Ok(Json(json!({"id": id, "revoked": true})))
}

async fn any_usage(State(state): State<AppState>, OpenAiQuery(q): OpenAiQuery<UsageQuery>) -> ApiResult<Json<Value>> {
    usage_json(&tenancy(&state), q).await
}

/// `/admin/...`: tenants, keys and usage, behind the admin key.
pub fn admin_router(state: AppState) -> Router<AppState> {
    Router::new()
        .route("/admin/tenants", get(list_tenants).post(create_tenant))
        .route("/admin/tenants/{id}", axum::routing::delete(disable_tenant))
        .route("/admin/tenants/{id}/disable", post(disable_tenant))
        .route("/admin/keys", get(list_keys).post(create_key))
        .route("/admin/keys/{id}", axum::routing::delete(revoke_key))
        .route("/admin/keys/{id}/revoke", post(revoke_key))
        .route("/admin/usage", get(any_usage))
        .route_layer(middleware::from_fn_with_state(state, require_admin))
}
