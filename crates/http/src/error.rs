//! [`ApiError`]: every error answer, as `{"code": "...", "message": "..."}`.
//!
//! Errors the client caused carry a stable `code` and a message safe to show. Store failures
//! become 503 so a provider retries; anything unexpected is a 500 with a generic message, its
//! detail logged once here and never sent.

use axum::http::{HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use hooklatch_core::StoreError;
use serde::Serialize;

/// An error answer.
#[derive(Debug, Clone)]
pub struct ApiError {
    /// The HTTP status.
    pub status: StatusCode,
    /// The stable machine-readable code.
    pub code: &'static str,
    /// A message safe to show the caller.
    pub message: String,
}

#[derive(Serialize)]
struct Body<'a> {
    code: &'a str,
    message: &'a str,
}

impl ApiError {
    /// An error with a status, code and message.
    pub fn new(status: StatusCode, code: &'static str, message: impl Into<String>) -> ApiError {
        ApiError {
            status,
            code,
            message: message.into(),
        }
    }

    /// 404 `not_found`.
    pub fn not_found(what: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::NOT_FOUND, "not_found", what)
    }

    /// 400 `invalid_parameter`.
    pub fn bad_parameter(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::BAD_REQUEST, "invalid_parameter", message)
    }

    /// The JSON body every error answer carries, as bytes.
    pub fn body_bytes(&self) -> Vec<u8> {
        serde_json::to_vec(&Body {
            code: self.code,
            message: &self.message,
        })
        .unwrap_or_default()
    }
}

impl From<StoreError> for ApiError {
    fn from(err: StoreError) -> ApiError {
        tracing::error!(%err, "store failed");
        match err {
            StoreError::Full => ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "store_full",
                "the store is full; retry later",
            ),
            StoreError::Unavailable(_) => ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "store_unavailable",
                "the store is unavailable; retry later",
            ),
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut res = (
            self.status,
            Json(Body {
                code: self.code,
                message: &self.message,
            }),
        )
            .into_response();
        if self.status == StatusCode::SERVICE_UNAVAILABLE {
            res.headers_mut()
                .insert("retry-after", HeaderValue::from_static("5"));
        }
        if self.status == StatusCode::UNAUTHORIZED && self.code == "unauthorized" {
            res.headers_mut()
                .insert("www-authenticate", HeaderValue::from_static("Bearer"));
        }
        res
    }
}
