//! The JSON body and query-string extractors: OpenAI-shaped 400s (naming the bad field) and 413s,
//! where axum's own `Json` and `Query` rejections would answer plain text.

use axum::extract::{FromRequest, FromRequestParts, Query, Request};
use axum::http::request::Parts;
use http_body_util::{BodyExt, LengthLimitError, Limited};
use serde::de::DeserializeOwned;
use serde_json::Value;

use super::error::ApiError;
use super::state::AppState;

pub struct OpenAiJson<T>(pub T);

impl<T: JsonBody> FromRequest<AppState> for OpenAiJson<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &AppState) -> Result<Self, ApiError> {
        let limit = state.max_body_bytes;
        // Content-Length lets us refuse at once, before reading anything.
        let declared = declared_length(req.headers());
        if declared.is_some_and(|n| n > limit as u64) {
            return Err(ApiError::payload_too_large(limit));
        }
        let body = Limited::new(req.into_body(), limit).collect();
        let Ok(read) = tokio::time::timeout(state.body_read_timeout, body).await else {
            state.metrics.body_timeouts.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            return Err(ApiError::new(
                axum::http::StatusCode::REQUEST_TIMEOUT,
                "invalid_request_error",
                format!("the request body did not arrive within {:?}", state.body_read_timeout),
            )
            .with_code("request_timeout"));
        };
        let bytes = match read {
            Ok(c) => c.to_bytes(),
            Err(e) if e.downcast_ref::<LengthLimitError>().is_some() => return Err(ApiError::payload_too_large(limit)),
            Err(e) => return Err(ApiError::bad_request(format!("could not read the request body: {e}"))),
        };
        T::from_json(parse_object(&bytes)?).map(OpenAiJson)
    }
}

/// The body length a request declares (`Content-Length`), if it declares a valid one.
pub fn declared_length(headers: &axum::http::HeaderMap) -> Option<u64> {
    headers.get(axum::http::header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()).and_then(|v| v.parse::<u64>().ok())
}

/// A query string parsed into `T` (axum's `Query`), refused with an OpenAI-shaped 400.
pub struct OpenAiQuery<T>(pub T);

impl<T: DeserializeOwned, S: Send + Sync> FromRequestParts<S> for OpenAiQuery<T> {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, ApiError> {
        Query::<T>::from_request_parts(parts, state)
            .await
            .map(|Query(q)| OpenAiQuery(q))
            .map_err(|e| ApiError::bad_request(format!("invalid query string: {}", e.body_text())))
    }
}

/// Request bodies: built from the parsed JSON value, so a type can read the same object twice
/// (serde's `flatten` would lose the path of a bad field).
pub trait JsonBody: Sized {
    fn from_json(v: Value) -> Result<Self, ApiError>;
}

/// Parses `bytes` as a JSON object (syntax errors are 400s).
pub fn parse_object(bytes: &[u8]) -> Result<Value, ApiError> {
    if bytes.iter().all(u8::is_ascii_whitespace) {
        return Err(ApiError::bad_request("The request body is empty; expected a JSON object"));
    }
    let v: Value = serde_json::from_slice(bytes)
        .map_err(|e| ApiError::bad_request(format!("The request body is not valid JSON: {e}")))?;
    if !v.is_object() {
        return Err(ApiError::bad_request("The request body must be a JSON object"));
    }
    Ok(v)
}

/// Deserializes `v`, naming the offending field in the 400.
pub fn from_value<T: DeserializeOwned>(v: &Value) -> Result<T, ApiError> {
    serde_path_to_error::deserialize(v).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner();
        if path == "." || path.is_empty() {
            ApiError::bad_request(format!("Invalid request: {inner}"))
        } else {
            ApiError::invalid_param(&path, format!("Invalid value for '{path}': {}", in_api_terms(&inner.to_string())))
        }
    })
}

/// serde's Rust type names in a deserialization error, said in the API's terms ("expected u64"
/// means nothing to a client).
fn in_api_terms(msg: &str) -> String {
    const TERMS: [(&str, &str); 8] = [
        ("expected u64", "expected a non-negative integer"),
        ("expected u32", "expected a non-negative integer"),
        ("expected usize", "expected a non-negative integer"),
        ("expected i64", "expected an integer"),
        ("expected i32", "expected an integer"),
        ("expected f32", "expected a number"),
        ("expected f64", "expected a number"),
        ("expected a string", "expected a string"),
    ];
    TERMS.iter().fold(msg.to_string(), |m, (rust, api)| m.replace(rust, api))
}
