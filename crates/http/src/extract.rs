//! Extractors whose refusals are [`ApiError`]s: axum's own answer a malformed query string or
//! JSON body in plain text, and every admin API error is `{"code", "message"}`.

use axum::extract::rejection::JsonRejection;
use axum::extract::{FromRequest, FromRequestParts, Query, Request};
use axum::http::request::Parts;
use axum::http::StatusCode;
use axum::Json;
use serde::de::DeserializeOwned;

use crate::ApiError;

/// [`Query`], refused with 400 `invalid_parameter`.
pub(crate) struct ApiQuery<T>(pub T);

impl<T: DeserializeOwned, S: Send + Sync> FromRequestParts<S> for ApiQuery<T> {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, ApiError> {
        Query::<T>::from_request_parts(parts, state)
            .await
            .map(|Query(value)| ApiQuery(value))
            .map_err(|rejection| ApiError::bad_parameter(rejection.body_text()))
    }
}

/// [`Json`], refused with 415 `unsupported_media_type` (not `application/json`) or 400
/// `invalid_body` (not JSON, or not the shape asked for).
pub(crate) struct ApiJson<T>(pub T);

impl<T: DeserializeOwned, S: Send + Sync> FromRequest<S> for ApiJson<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, ApiError> {
        Json::<T>::from_request(req, state)
            .await
            .map(|Json(value)| ApiJson(value))
            .map_err(json_error)
    }
}

fn json_error(rejection: JsonRejection) -> ApiError {
    match rejection {
        JsonRejection::MissingJsonContentType(_) => ApiError::new(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "unsupported_media_type",
            "the body must be JSON, sent with Content-Type: application/json",
        ),
        other => invalid_body(other.body_text()),
    }
}

/// 400 `invalid_body`.
pub(crate) fn invalid_body(message: impl Into<String>) -> ApiError {
    ApiError::new(StatusCode::BAD_REQUEST, "invalid_body", message)
}
