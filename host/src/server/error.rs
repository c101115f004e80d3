//! Errors in OpenAI's JSON shape: `{"error": {"message", "type", "param", "code"}}`.
//!
//! The official clients map the HTTP status to an exception class, so the status matters as
//! much as the body; `type` follows OpenAI's names so clients that inspect it keep working.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde_json::json;

use crate::engine::SubmitError;
use crate::plugins::apply::PolicyError;
use crate::plugins::PluginError;

#[derive(Debug, Clone)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    pub kind: &'static str,
    pub param: Option<String>,
    pub code: Option<&'static str>,
    /// Extra response headers (`retry-after`, `x-ratelimit-*` on 429s).
    pub headers: Vec<(&'static str, String)>,
}

impl ApiError {
    pub fn new(status: StatusCode, kind: &'static str, message: impl Into<String>) -> Self {
        Self { status, message: message.into(), kind, param: None, code: None, headers: Vec::new() }
    }

    pub fn bad_request(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "invalid_request_error", message)
    }

    /// A 400 naming the offending request field.
    pub fn invalid_param(param: &str, message: impl Into<String>) -> Self {
        Self::bad_request(message).with_param(param)
    }

    pub fn unauthorized() -> Self {
        Self::new(
            StatusCode::UNAUTHORIZED,
            "invalid_request_error",
            "Incorrect or missing API key; send it as 'Authorization: Bearer <key>'",
        )
        .with_code("invalid_api_key")
    }

    pub fn model_not_found(model: &str) -> Self {
        Self::new(StatusCode::NOT_FOUND, "invalid_request_error", format!("The model '{model}' does not exist"))
            .with_param("model")
            .with_code("model_not_found")
    }

    pub fn not_found(message: impl Into<String>) -> Self {
        Self::new(StatusCode::NOT_FOUND, "invalid_request_error", message).with_code("not_found")
    }

    pub fn payload_too_large(limit: usize) -> Self {
        Self::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "invalid_request_error",
            format!("The request body is larger than {limit} bytes"),
        )
        .with_code("request_too_large")
    }

    pub fn overloaded(message: impl Into<String>) -> Self {
        Self::new(StatusCode::TOO_MANY_REQUESTS, "rate_limit_error", message).with_code("rate_limit_exceeded")
    }

    pub fn shutting_down() -> Self {
        Self::new(StatusCode::SERVICE_UNAVAILABLE, "service_unavailable_error", "The server is shutting down")
            .with_code("shutting_down")
    }

    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(StatusCode::INTERNAL_SERVER_ERROR, "server_error", message)
    }

    pub fn not_supported(param: &str, message: impl Into<String>) -> Self {
        Self::invalid_param(param, message).with_code("unsupported_parameter")
    }

    pub fn with_param(mut self, param: &str) -> Self {
        self.param = Some(param.to_string());
        self
    }

    pub fn with_code(mut self, code: &'static str) -> Self {
        self.code = Some(code);
        self
    }

    pub fn body(&self) -> serde_json::Value {
        json!({"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}})
    }
}

impl From<SubmitError> for ApiError {
    fn from(e: SubmitError) -> Self {
        let msg = e.to_string();
        match e {
            SubmitError::QueueFull(_) => ApiError::overloaded(msg),
            SubmitError::Invalid(_) => ApiError::bad_request(msg),
            SubmitError::InvalidParam { param, .. } => ApiError::invalid_param(param, msg),
            SubmitError::PromptTooLong { .. } => {
                ApiError::bad_request(msg).with_param("messages").with_code("context_length_exceeded")
            }
            SubmitError::ShuttingDown => ApiError::shutting_down(),
        }
    }
}

/// A plugin call that failed: its kind's status and code, the message naming the deployment.
impl From<&PluginError> for ApiError {
    fn from(e: &PluginError) -> Self {
        let status = StatusCode::from_u16(e.kind.status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        let kind = if status.is_server_error() { "server_error" } else { "invalid_request_error" };
        ApiError::new(status, kind, e.to_string()).with_code(e.kind.code())
    }
}

impl From<PluginError> for ApiError {
    fn from(e: PluginError) -> Self {
        ApiError::from(&e)
    }
}

impl From<PolicyError> for ApiError {
    fn from(e: PolicyError) -> Self {
        let message = e.to_string();
        match e {
            PolicyError::Rejected { status, .. } => {
                let status = StatusCode::from_u16(status).unwrap_or(StatusCode::FORBIDDEN);
                let kind = if status.is_server_error() { "server_error" } else { "invalid_request_error" };
                ApiError::new(status, kind, message).with_code("policy_rejected")
            }
            PolicyError::Plugin(p) => ApiError::from(&p),
            PolicyError::Misbehaved { .. } => ApiError::internal(message).with_code("policy_error"),
            // Fails closed: a bound policy is a control the operator asked for.
            PolicyError::BindingMissing { .. } => {
                ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "service_unavailable_error", message)
                    .with_code("policy_unavailable")
            }
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        if self.status.is_server_error() {
            tracing::warn!(status = self.status.as_u16(), message = %self.message, "request failed");
        } else {
            tracing::debug!(status = self.status.as_u16(), message = %self.message, "request rejected");
        }
        let mut resp = (self.status, axum::Json(self.body())).into_response();
        super::tenancy::add_headers(&mut resp, &self.headers);
        resp
    }
}

pub type ApiResult<T> = Result<T, ApiError>;
