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

/// The longest operator's reason kept, in characters.
pub(crate) const REASON_LIMIT: usize = 200;

#[derive(Debug, Default, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct ReasonBody {
    reason: Option<String>,
}

/// The reason in an optional body `{"reason": "…"}` (no body, or only whitespace, or an
/// empty reason: none), trimmed and made storable; 400 `invalid_body` for another body, 400
/// `invalid_parameter` for a reason over [`REASON_LIMIT`] characters.
pub(crate) fn optional_reason(body: &[u8]) -> Result<Option<String>, ApiError> {
    let parsed: ReasonBody = if body.iter().all(u8::is_ascii_whitespace) {
        ReasonBody::default()
    } else {
        serde_json::from_slice(body)
            .map_err(|err| invalid_body(format!("the body is not {{\"reason\": \"…\"}}: {err}")))?
    };
    match parsed.reason.as_deref().map(str::trim) {
        None | Some("") => Ok(None),
        Some(r) if r.chars().count() > REASON_LIMIT => Err(ApiError::bad_parameter(format!(
            "reason is longer than {REASON_LIMIT} characters"
        ))),
        Some(r) => Ok(Some(hooklatch_core::store::storable_text(r).into_owned())),
    }
}
