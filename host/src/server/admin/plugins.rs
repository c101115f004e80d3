//! `/admin/plugins`: list, inspect, deploy (upload) and remove plugin deployments, behind the
//! admin key (`--admin-key`). An upload is the component's bytes as the request body, with the
//! deployment (everything but the bytes: name, kind, models, tenants, config, limits) as JSON
//! in the `x-plugin-spec` header. It is validated against its WIT world and configured before
//! it replaces the deployment of the same name; a failing upload changes nothing.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, Path, Request, State};
use axum::http::{HeaderMap, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use serde_json::{json, Value};

use crate::plugins::registry::{DeploymentSpec, Registry};
use crate::server::error::ApiError;
use crate::server::routes::same_secret;
use crate::server::state::AppState;
use crate::server::tenancy::bearer;

/// Largest component accepted by upload.
const MAX_COMPONENT_BYTES: usize = 32 << 20;

fn registry(state: &AppState) -> &Arc<Registry> {
    state.plugins.as_ref().expect("plugin admin routes exist only with a registry")
}

async fn require_admin(State(state): State<AppState>, req: Request, next: Next) -> Response {
    let Some(key) = registry(&state).admin_key() else {
        return ApiError::new(
            StatusCode::FORBIDDEN,
            "permission_error",
            "The plugin admin API is disabled: start the server with --admin-key",
        )
        .into_response();
    };
    if !bearer(&req).is_some_and(|g| same_secret(g.as_bytes(), key.as_bytes())) {
        return ApiError::new(StatusCode::FORBIDDEN, "permission_error", "The plugin admin API needs the admin key")
            .into_response();
    }
    next.run(req).await
}

async fn list(State(state): State<AppState>) -> Json<Value> {
    let data: Vec<Value> = registry(&state).list().iter().map(|d| d.to_json()).collect();
    Json(json!({"object": "list", "data": data}))
}

async fn get_one(State(state): State<AppState>, Path(name): Path<String>) -> Result<Json<Value>, ApiError> {
    registry(&state)
        .get(&name)
        .map(|d| Json(d.to_json()))
        .ok_or_else(|| ApiError::not_found(format!("No plugin deployment '{name}'")))
}

async fn remove(State(state): State<AppState>, Path(name): Path<String>) -> Result<Json<Value>, ApiError> {
    if registry(&state).remove(&name) {
        Ok(Json(json!({"name": name, "deleted": true})))
    } else {
        Err(ApiError::not_found(format!("No plugin deployment '{name}'")))
    }
}

async fn deploy(State(state): State<AppState>, headers: HeaderMap, body: Bytes) -> Result<Response, ApiError> {
    let spec = headers.get("x-plugin-spec").ok_or_else(|| {
        ApiError::bad_request("Send the deployment as JSON in the 'x-plugin-spec' header and the component as the body")
    })?;
    let spec: DeploymentSpec =
        serde_json::from_slice(spec.as_bytes()).map_err(|e| ApiError::bad_request(format!("x-plugin-spec: {e}")))?;
    if spec.component.is_some() {
        return Err(ApiError::bad_request(
            "x-plugin-spec: 'component' is for config files; upload the bytes as the body",
        ));
    }
    let reg = registry(&state).clone();
    // Compiling takes a CPU for a while: off the async workers.
    let d = tokio::task::spawn_blocking(move || reg.deploy(spec, &body))
        .await
        .map_err(|e| ApiError::internal(format!("deploy task failed: {e}")))?
        .map_err(|e| ApiError::bad_request(format!("The plugin was not deployed: {e}")).with_code("invalid_plugin"))?;
    tracing::info!(name = %d.spec.name, version = d.version, plugin = %d.info().name, "plugin deployed");
    Ok((StatusCode::CREATED, Json(d.to_json())).into_response())
}

pub fn admin_router(state: AppState) -> Router<AppState> {
    Router::new()
        .route("/admin/plugins", get(list).post(deploy))
        .route("/admin/plugins/{name}", get(get_one).delete(remove))
        .layer(DefaultBodyLimit::max(MAX_COMPONENT_BYTES))
        .route_layer(middleware::from_fn_with_state(state, require_admin))
}
