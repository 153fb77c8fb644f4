//! Extractors whose refusals are [`ApiError`]s: axum's own answer a malformed query string or
//! JSON body in plain text, and every admin API error is `{"code", "message"}`.

use axum::extract::rejection::JsonRejection;
use axum::extract::{FromRequest, FromRequestParts, MatchedPath, Path, Query, Request};
use axum::http::request::Parts;
use axum::http::{header, HeaderMap, StatusCode};
use axum::Json;
use serde::de::DeserializeOwned;

use crate::ApiError;

/// The token of an `Authorization: Bearer <token>` header, if the request has one: the scheme
/// in any case (RFC 9110 makes it case-insensitive; some clients send `bearer`), one or more
/// spaces, then the token with surrounding whitespace trimmed. `None` for another scheme, a
/// header that is not text, or no header; the caller compares the token in constant time.
pub fn bearer_token(headers: &HeaderMap) -> Option<&str> {
    let value = headers.get(header::AUTHORIZATION)?.to_str().ok()?;
    let (scheme, token) = value.split_once(' ')?;
    scheme
        .eq_ignore_ascii_case("bearer")
        .then(|| token.trim_matches(|c| c == ' ' || c == '\t'))
}

/// A route's one path parameter (`/in/{source}`, `/v1/requests/{id}`), percent-decoded.
/// axum's `Path<String>` refuses a parameter whose decoded bytes are not UTF-8 (`/in/%FF`)
/// with a plain-text 400 before the handler runs: no `{"code", "message"}` body and, on the
/// ingest listener, no history record. This keeps such bytes as U+FFFD instead, and the
/// handler refuses the name or id as the unknown one it is, in the API's own format.
pub(crate) struct PathText(pub String);

impl<S: Send + Sync> FromRequestParts<S> for PathText {
    type Rejection = std::convert::Infallible;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, Self::Rejection> {
        if let Ok(Path(text)) = Path::<String>::from_request_parts(parts, state).await {
            return Ok(PathText(text));
        }
        // The router decodes parameters as it matches and keeps none that is not UTF-8: take
        // the segment from the URI, where the route's template has its parameter.
        let raw = parts
            .extensions
            .get::<MatchedPath>()
            .and_then(|template| {
                let index = template
                    .as_str()
                    .split('/')
                    .position(|s| s.starts_with('{'))?;
                parts.uri.path().split('/').nth(index)
            })
            .unwrap_or_default();
        let bytes: Vec<u8> = percent_encoding::percent_decode_str(raw).collect();
        Ok(PathText(String::from_utf8_lossy(&bytes).into_owned()))
    }
}

/// [`Query`], refused with 400 `invalid_parameter`.
pub(crate) struct ApiQuery<T>(pub T);

impl<T: DeserializeOwned, S: Send + Sync> FromRequestParts<S> for ApiQuery<T> {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, ApiError> {
        Query::<T>::from_request_parts(parts, state)
            .await
            .map(|Query(value)| ApiQuery(value))
            .map_err(|rejection| {
                let text = rejection.body_text();
                ApiError::bad_parameter(format!("the query string: {}", reason(&text)))
            })
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

/// A body as bytes, refused as [`ApiJson`] refuses one: 413 `body_too_large` over the route's
/// limit, else 400 `invalid_body` (axum's own answers are plain text).
pub(crate) struct ApiBytes(pub bytes::Bytes);

impl<S: Send + Sync> FromRequest<S> for ApiBytes {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, ApiError> {
        bytes::Bytes::from_request(req, state)
            .await
            .map(ApiBytes)
            .map_err(|rejection| body_error(rejection.status(), &rejection.body_text()))
    }
}

/// 413 `body_too_large` when axum refused a body over the limit, else 400 `invalid_body`.
fn body_error(status: StatusCode, text: &str) -> ApiError {
    if status == StatusCode::PAYLOAD_TOO_LARGE {
        return ApiError::new(
            status,
            "body_too_large",
            "the body is larger than this route takes",
        );
    }
    invalid_body(format!("the body: {}", reason(text)))
}

fn json_error(rejection: JsonRejection) -> ApiError {
    match rejection {
        JsonRejection::MissingJsonContentType(_) => ApiError::new(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "unsupported_media_type",
            "the body must be JSON, sent with Content-Type: application/json",
        ),
        other => body_error(other.status(), &other.body_text()),
    }
}

/// What an axum rejection says after its "Failed to …: " lead (`limit: invalid digit found in
/// string`), for messages in the words the rest of the API's errors use.
fn reason(text: &str) -> &str {
    match text.split_once(": ") {
        Some((lead, rest)) if lead.starts_with("Failed to") => rest,
        _ => text,
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

#[cfg(test)]
mod tests {
    use axum::http::{HeaderMap, HeaderValue};

    use super::bearer_token;

    /// A body over a route's limit is refused as the API refuses everything: 413 with a JSON
    /// `code`, whether the route reads bytes or JSON (axum's own answer is plain text). In
    /// process, so the client never races the connection's close.
    #[tokio::test]
    async fn a_body_over_the_limit_is_a_json_413_on_every_kind_of_route() {
        use axum::extract::DefaultBodyLimit;
        use axum::routing::post;
        use tower::ServiceExt;

        use super::{ApiBytes, ApiJson};

        let app = axum::Router::new()
            .route(
                "/bytes",
                post(|ApiBytes(body): ApiBytes| async move { body.len().to_string() }),
            )
            .route(
                "/json",
                post(|ApiJson(v): ApiJson<serde_json::Value>| async move { v.to_string() }),
            )
            .layer(DefaultBodyLimit::max(64));
        for path in ["/bytes", "/json"] {
            let big = format!("{{\"reason\": \"{}\"}}", "x".repeat(1024));
            let request = axum::http::Request::post(path)
                .header("content-type", "application/json")
                .body(axum::body::Body::from(big))
                .expect("a request");
            let answer = app.clone().oneshot(request).await.expect("an answer");
            assert_eq!(answer.status(), 413, "{path}");
            let body = axum::body::to_bytes(answer.into_body(), 4096)
                .await
                .unwrap();
            let json: serde_json::Value = serde_json::from_slice(&body).expect("JSON");
            assert_eq!(json["code"], "body_too_large", "{path}: {json}");

            let small = axum::http::Request::post(path)
                .header("content-type", "application/json")
                .body(axum::body::Body::from("{}"))
                .expect("a request");
            let answer = app.clone().oneshot(small).await.expect("an answer");
            assert_eq!(answer.status(), 200, "{path}");
        }
    }

    fn token_of(value: &[u8]) -> Option<String> {
        let mut headers = HeaderMap::new();
        headers.insert(
            "authorization",
            HeaderValue::from_bytes(value).expect("a header value"),
        );
        bearer_token(&headers).map(str::to_owned)
    }

    #[test]
    fn a_bearer_token_is_read_in_any_case_of_its_scheme_and_nothing_else_is() {
        for (value, want) in [
            (&b"Bearer abc"[..], Some("abc")),
            (b"bearer abc", Some("abc")),
            (b"BEARER abc", Some("abc")),
            (b"Bearer   abc  ", Some("abc")),
            (b"Bearer ", Some("")),
            (b"Basic abc", None),
            (b"Bearerabc", None),
            (b"abc", None),
            (b"Bearer \xff\xfe", None),
        ] {
            assert_eq!(
                token_of(value).as_deref(),
                want,
                "{}",
                String::from_utf8_lossy(value)
            );
        }
        assert_eq!(bearer_token(&HeaderMap::new()), None);
    }
}
