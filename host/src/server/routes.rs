//! The router: OpenAI endpoints behind the API key, plus health, metrics and tokenizer helpers.

use axum::extract::{MatchedPath, Path, Request, State};
use axum::http::{header, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::{json, Value};

use super::chat::{normalize_messages, prompt_options, render_chat_off_runtime, template_extra, validate_tools};
use super::error::{ApiError, ApiResult};
use super::extract::OpenAiJson;
use super::logprobs::piece;
use super::openai::{DetokenizeRequest, TokenizeRequest};
use super::state::AppState;
use super::tenancy::{admitted_call, check_model as check_tenant_model, model_visible, CallerExt};
use super::{chat, completions};
use crate::chat_template::ChatTemplateInput;

pub fn router(state: AppState) -> Router {
    let api = Router::new()
        .route("/v1/chat/completions", post(chat::handler))
        .route("/v1/completions", post(completions::handler))
        .route("/v1/models", get(list_models))
        .route("/v1/models/{*model}", get(get_model))
        .route("/tokenize", post(tokenize))
        .route("/detokenize", post(detokenize))
        .route("/v1/usage", get(super::tenancy::own_usage))
        .route_layer(middleware::from_fn_with_state(state.clone(), require_api_key));
    let mut app = Router::new().merge(api);
    if state.tenancy.is_some() {
        app = app.merge(super::admin::tenants::admin_router(state.clone()));
    }
    if state.plugins.is_some() {
        app = app.merge(super::admin::plugins::admin_router(state.clone()));
    }
    app.route("/health", get(health))
        // vLLM's liveness (`/ping`, GET or POST), version and load endpoints.
        .route("/ping", get(health).post(health))
        .route("/version", get(version))
        .route("/load", get(load))
        .route("/metrics", get(metrics))
        .fallback(|| async { ApiError::not_found("Unknown endpoint") })
        .method_not_allowed_fallback(|| async {
            ApiError::new(
                StatusCode::METHOD_NOT_ALLOWED,
                "invalid_request_error",
                "Method not allowed for this endpoint",
            )
        })
        .layer(middleware::from_fn_with_state(state.clone(), count_requests))
        .layer(middleware::from_fn(super::memory::return_memory_after_large_bodies))
        .with_state(state)
}

/// Compares without an early exit, so response time does not reveal how much of a guess matched.
pub(super) fn same_secret(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

async fn require_api_key(State(state): State<AppState>, req: Request, next: Next) -> Response {
    if let Some(t) = state.tenancy.clone() {
        return super::tenancy::require_key(t, req, next).await;
    }
    if let Some(key) = &state.api_key {
        if !super::tenancy::bearer(&req).is_some_and(|g| same_secret(g.as_bytes(), key.as_bytes())) {
            return ApiError::unauthorized().into_response();
        }
    }
    next.run(req).await
}

async fn count_requests(State(state): State<AppState>, req: Request, next: Next) -> Response {
    // The route pattern, not the raw path, so clients cannot blow up the label set.
    let route = req.extensions().get::<MatchedPath>().map_or("unmatched", |p| p.as_str()).to_string();
    let resp = next.run(req).await;
    state.metrics.count_http(&route, resp.status().as_u16());
    resp
}

fn model_card(state: &AppState) -> Value {
    json!({
        "id": state.served_model_name,
        "object": "model",
        "created": state.started_at,
        "owned_by": "wasmserve",
        // The model's name, never its path on this host.
        "root": state.model.name,
        "max_model_len": state.engine.max_model_len(),
    })
}

async fn list_models(State(state): State<AppState>, caller: CallerExt) -> Json<Value> {
    let data: Vec<Value> =
        if model_visible(&caller, &state.served_model_name) { vec![model_card(&state)] } else { vec![] };
    Json(json!({"object": "list", "data": data}))
}

async fn get_model(
    State(state): State<AppState>,
    caller: CallerExt,
    Path(model): Path<String>,
) -> ApiResult<Json<Value>> {
    if !state.serves(&model) || !model_visible(&caller, &state.served_model_name) {
        return Err(ApiError::model_not_found(&model));
    }
    Ok(Json(model_card(&state)))
}

async fn health(State(state): State<AppState>) -> Response {
    if state.is_shutting_down() {
        return ApiError::shutting_down().into_response();
    }
    Json(json!({"status": "ok"})).into_response()
}

async fn version() -> Json<Value> {
    Json(json!({"version": env!("CARGO_PKG_VERSION")}))
}

/// vLLM's `/load`: requests being served right now.
async fn load(State(state): State<AppState>) -> Json<Value> {
    Json(json!({"server_load": state.in_flight()}))
}

async fn metrics(State(state): State<AppState>) -> Response {
    let mut body = state.metrics.render(&state.engine.stats(), state.in_flight());
    if let Some(p) = &state.plugins {
        body.push_str(&p.prometheus());
    }
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")], body).into_response()
}

async fn tokenize(
    State(state): State<AppState>,
    caller: CallerExt,
    OpenAiJson(req): OpenAiJson<TokenizeRequest>,
) -> Response {
    admitted_call(&state, &caller, tokenize_call(&state, &caller, req)).await
}

async fn detokenize(
    State(state): State<AppState>,
    caller: CallerExt,
    OpenAiJson(req): OpenAiJson<DetokenizeRequest>,
) -> Response {
    admitted_call(&state, &caller, detokenize_call(&state, &caller, req)).await
}

/// vLLM's `/tokenize`: a raw `prompt`, or `messages` rendered exactly as chat completions does.
async fn tokenize_call(state: &AppState, caller: &CallerExt, req: TokenizeRequest) -> ApiResult<Json<Value>> {
    state.check_model(req.model.as_deref())?;
    check_tenant_model(caller, &state.served_model_name)?;
    let tok = &state.model.tokenizer;
    let ids = match (req.prompt, req.messages) {
        (Some(p), None) => {
            let (st, add_special) = (state.clone(), req.add_special_tokens.unwrap_or(true));
            let bytes = p.len();
            state
                .prompt_work
                .run(bytes, move || st.model.tokenizer.encode(&p, add_special))
                .await?
                .map_err(ApiError::internal)?
        }
        (None, Some(messages)) => {
            if let Some(t) = &req.tools {
                validate_tools(t)?;
            }
            let opts = prompt_options(req.continue_final_message, req.add_generation_prompt, req.add_special_tokens)?;
            let input = ChatTemplateInput {
                messages: normalize_messages(messages)?,
                tools: req.tools.filter(|t| !t.is_empty()),
                add_generation_prompt: opts.add_generation_prompt,
                extra: template_extra(None, req.chat_template_kwargs.as_ref()),
            };
            render_chat_off_runtime(state, input, opts).await?.1
        }
        _ => return Err(ApiError::bad_request("give exactly one of 'prompt' or 'messages'")),
    };
    let mut out = json!({"count": ids.len(), "max_model_len": state.engine.max_model_len(), "tokens": ids});
    if req.return_token_strs.unwrap_or(false) {
        out["token_strs"] = ids.iter().map(|&i| Value::String(piece(tok, i))).collect();
    }
    Ok(Json(out))
}

async fn detokenize_call(state: &AppState, caller: &CallerExt, req: DetokenizeRequest) -> ApiResult<Json<Value>> {
    state.check_model(req.model.as_deref())?;
    check_tenant_model(caller, &state.served_model_name)?;
    let vocab = state.model.config().vocab_size;
    if let Some(t) = req.tokens.iter().find(|&&t| t as usize >= vocab) {
        return Err(ApiError::invalid_param(
            "tokens",
            format!("token id {t} is outside the vocabulary (size {vocab})"),
        ));
    }
    Ok(Json(json!({"prompt": state.model.tokenizer.decode(&req.tokens, false)})))
}
