//! The axum extractor for deliveries from hooklatch: [`VerifiedDelivery`].
//!
//! A destination with a `secret` gets every delivery signed in the
//! [Standard Webhooks](https://www.standardwebhooks.com/) scheme: `webhook-id` (the
//! idempotency key), `webhook-timestamp` (Unix seconds) and `webhook-signature`
//! (`v1,<base64 HMAC-SHA256 of "{id}.{timestamp}.{body}">`, space-separated when there are
//! several). The extractor checks them against the secrets in [`GuardConfig`] (any may match,
//! for rotation), in constant time, within a tolerance of 5 minutes both ways, and that the
//! `Idempotency-Key` header equals `webhook-id`. Anything else is answered
//! `401 {"code": …, "message": …}` before the handler runs. Only the `webhook-*` names are
//! read (hooklatch never sends Svix's `svix-*`).

use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::extract::rejection::BytesRejection;
use axum::extract::{FromRef, FromRequest, Request};
use axum::response::{IntoResponse, Response};
use axum::Json;
use bytes::Bytes;
use hooklatch_core::provider::standard_webhooks::{decode_secret, sign_v1};
use hooklatch_core::secret::constant_time_eq;
use hooklatch_core::Secret;
use http::{HeaderMap, StatusCode};

/// The signature tolerance [`GuardConfig::new`] uses: 5 minutes, in both directions.
pub const DEFAULT_TOLERANCE: Duration = Duration::from_secs(5 * 60);

/// The secrets the extractor verifies against; put it in the router state (or make it
/// reachable with [`FromRef`]). Cheap to clone.
#[derive(Debug, Clone)]
pub struct GuardConfig {
    inner: Arc<ConfigInner>,
}

#[derive(Debug, Clone)]
struct ConfigInner {
    /// Decoded key bytes (`whsec_…` base64-decoded), wrapped again so they never print.
    keys: Vec<Secret>,
    tolerance: Duration,
}

impl GuardConfig {
    /// Verifies against `secret`, the destination's `secret` in hooklatch's config
    /// (usually `whsec_…`), with a 5 minute tolerance.
    ///
    /// The secret is decoded the way hooklatch decodes it for signing
    /// ([`decode_secret`]): a `whsec_` secret whose rest is not base64 matches nothing (and
    /// hooklatch sends such a destination's deliveries unsigned).
    pub fn new(secret: Secret) -> GuardConfig {
        GuardConfig {
            inner: Arc::new(ConfigInner {
                keys: decode_secret(&secret)
                    .map(Secret::new)
                    .into_iter()
                    .collect(),
                tolerance: DEFAULT_TOLERANCE,
            }),
        }
    }

    /// Also accepts signatures by `secret`, for rotating the destination's secret.
    pub fn with_secret(mut self, secret: Secret) -> GuardConfig {
        let inner = Arc::make_mut(&mut self.inner);
        inner.keys.extend(decode_secret(&secret).map(Secret::new));
        self
    }

    /// Replaces the tolerance between the signed timestamp and now (either direction).
    pub fn with_tolerance(mut self, tolerance: Duration) -> GuardConfig {
        Arc::make_mut(&mut self.inner).tolerance = tolerance;
        self
    }
}

/// A delivery whose signature checked out. Extract it last (it reads the body).
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct VerifiedDelivery {
    /// The `Idempotency-Key` (`{source}:{event key}`): the same on every attempt and redrive.
    /// Pass it to [`claim`](crate::claim).
    pub idempotency_key: String,
    /// The signed `webhook-timestamp`, in Unix seconds (the attempt's, not the event's).
    pub timestamp: i64,
    /// The raw body, byte-exact as the provider sent it.
    pub body: Bytes,
}

/// Why a request is not a verified delivery. Answered `401` with `{code, message}`
/// (body errors keep axum's own status).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum GuardRejection {
    /// A Standard Webhooks header is absent.
    #[error("missing {header} header")]
    MissingHeader {
        /// The header that was expected.
        header: &'static str,
    },
    /// A header cannot be parsed.
    #[error("malformed {header} header")]
    Malformed {
        /// The header that could not be parsed.
        header: &'static str,
    },
    /// No configured secret produces any of the signatures.
    #[error("no signature matches")]
    InvalidSignature,
    /// The signed timestamp is further from now than the tolerance.
    #[error("timestamp is {skew_secs} s from now, outside the {tolerance_secs} s tolerance")]
    StaleTimestamp {
        /// Signed time minus now, in seconds.
        skew_secs: i64,
        /// The tolerance, in seconds.
        tolerance_secs: u64,
    },
    /// `Idempotency-Key` is absent.
    #[error("missing idempotency-key header")]
    MissingIdempotencyKey,
    /// `Idempotency-Key` differs from the signed `webhook-id`.
    #[error("idempotency-key does not match the signed webhook-id")]
    KeyMismatch,
    /// The body could not be read.
    #[error("reading the body")]
    Body(#[source] BytesRejection),
}

impl GuardRejection {
    /// The stable machine-readable code sent in the response.
    pub fn code(&self) -> &'static str {
        match self {
            GuardRejection::MissingHeader { .. } => "missing_signature",
            GuardRejection::Malformed { .. } => "malformed_signature",
            GuardRejection::InvalidSignature => "invalid_signature",
            GuardRejection::StaleTimestamp { .. } => "stale_timestamp",
            GuardRejection::MissingIdempotencyKey => "missing_idempotency_key",
            GuardRejection::KeyMismatch => "idempotency_key_mismatch",
            GuardRejection::Body(_) => "unreadable_body",
        }
    }
}

impl IntoResponse for GuardRejection {
    fn into_response(self) -> Response {
        let status = match &self {
            GuardRejection::Body(rejection) => rejection.status(),
            _ => StatusCode::UNAUTHORIZED,
        };
        let body = serde_json::json!({ "code": self.code(), "message": self.to_string() });
        (status, Json(body)).into_response()
    }
}

impl<S> FromRequest<S> for VerifiedDelivery
where
    S: Send + Sync,
    GuardConfig: FromRef<S>,
{
    type Rejection = GuardRejection;

    async fn from_request(req: Request, state: &S) -> Result<VerifiedDelivery, GuardRejection> {
        let config = GuardConfig::from_ref(state);
        let headers = req.headers().clone();
        let body = Bytes::from_request(req, state)
            .await
            .map_err(GuardRejection::Body)?;
        verify(&config, &headers, body, unix_now())
    }
}

/// Checks a delivery's headers and body against `config` at `now_secs` (Unix seconds).
///
/// The extractor calls this; use it directly outside axum.
pub fn verify(
    config: &GuardConfig,
    headers: &HeaderMap,
    body: Bytes,
    now_secs: i64,
) -> Result<VerifiedDelivery, GuardRejection> {
    let msg_id = required(headers, "webhook-id")?;
    let timestamp_text = required(headers, "webhook-timestamp")?;
    let signatures = required(headers, "webhook-signature")?;
    let timestamp: i64 = timestamp_text
        .parse()
        .map_err(|_| GuardRejection::Malformed {
            header: "webhook-timestamp",
        })?;

    let received: Vec<&str> = signatures
        .split_whitespace()
        .filter(|entry| entry.starts_with("v1,"))
        .collect();
    let matched = config.inner.keys.iter().any(|key| {
        let expected = sign_v1(key.expose(), msg_id, timestamp, &body);
        // Every entry is compared, so timing says nothing about which one matched.
        received.iter().fold(false, |found, entry| {
            constant_time_eq(expected.as_bytes(), entry.as_bytes()) | found
        })
    });
    if !matched {
        return Err(GuardRejection::InvalidSignature);
    }

    let skew_secs = timestamp.saturating_sub(now_secs);
    let tolerance_secs = config.inner.tolerance.as_secs();
    if skew_secs.unsigned_abs() > tolerance_secs {
        return Err(GuardRejection::StaleTimestamp {
            skew_secs,
            tolerance_secs,
        });
    }

    let idempotency_key = headers
        .get("idempotency-key")
        .ok_or(GuardRejection::MissingIdempotencyKey)?;
    if idempotency_key.as_bytes() != msg_id.as_bytes() {
        return Err(GuardRejection::KeyMismatch);
    }
    Ok(VerifiedDelivery {
        idempotency_key: msg_id.to_owned(),
        timestamp,
        body,
    })
}

/// A header's value as text: absent → missing, not visible ASCII → malformed.
fn required<'h>(headers: &'h HeaderMap, header: &'static str) -> Result<&'h str, GuardRejection> {
    headers
        .get(header)
        .ok_or(GuardRejection::MissingHeader { header })?
        .to_str()
        .map_err(|_| GuardRejection::Malformed { header })
}

fn unix_now() -> i64 {
    let since_epoch = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default();
    i64::try_from(since_epoch.as_secs()).unwrap_or(i64::MAX)
}
