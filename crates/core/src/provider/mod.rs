//! Provider adapters: verify a delivery's signature, extract the provider's stable event
//! key(s), and sign test events the way the provider does.
//!
//! Every adapter works on the raw body bytes as received; nothing here re-serializes JSON.
//! The gateway calls [`ProviderAdapter::verify`] before it touches the store, and
//! [`ProviderAdapter::extract`] only after verification passed.
//!
//! Facts per provider (schemes, keys, quirks, test vectors) come from `providers.md`.

mod discord;
mod fields;
mod generic;
mod github;
mod paddle;
mod razorpay;
mod shopify;
mod slack;
pub mod standard_webhooks;
mod stripe;
mod twilio;
mod whatsapp;

use std::time::Duration;

use http::HeaderMap;

pub use discord::Discord;
pub use generic::{Generic, GenericSettings, SignatureEncoding};
pub use github::GitHub;
pub use paddle::Paddle;
pub use razorpay::Razorpay;
pub use shopify::Shopify;
pub use slack::Slack;
pub use standard_webhooks::StandardWebhooks;
pub use stripe::Stripe;
pub use twilio::Twilio;
pub use whatsapp::WhatsApp;

use crate::id::EventKey;
use crate::secret::Secret;
use crate::time::Timestamp;

/// What an adapter sees of an inbound request.
#[derive(Debug, Clone, Copy)]
pub struct InboundRequest<'a> {
    /// The request target as received: path and query (`/in/twilio?x=1`). Providers that sign
    /// the URL (Twilio) rebuild it from the source's public base URL and this.
    pub path_and_query: &'a str,
    /// Request headers (names are case-insensitive).
    pub headers: &'a HeaderMap,
    /// The raw body, byte-exact.
    pub body: &'a [u8],
    /// When the request arrived, for timestamp tolerance.
    pub now: Timestamp,
}

/// One event found in a verified delivery.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExtractedEvent {
    /// The provider's stable key for the event (the dedup key within its source).
    pub key: EventKey,
    /// The provider's event type (`invoice.payment_succeeded`, `push`), when it says one.
    pub event_type: Option<String>,
    /// A hash of what the event is, when the whole body's is the wrong measure: the same event
    /// arriving again with other bytes around it is a duplicate, not a conflict (an item of a
    /// batch a retry regroups; a notification that differs only in its own id). `None`: the
    /// body's hash.
    pub fingerprint: Option<[u8; 32]>,
}

/// What a test-event signer needs.
#[derive(Debug, Clone, Copy)]
pub struct SignRequest<'a> {
    /// The body to sign, byte-exact.
    pub body: &'a [u8],
    /// The signing secret as configured on the source.
    pub secret: &'a Secret,
    /// The signing time (for schemes that sign a timestamp).
    pub now: Timestamp,
    /// The event key, for providers that carry it in a header (GitHub, Standard Webhooks).
    pub event_key: &'a str,
    /// The event type, for providers that carry it in a header (GitHub's `X-GitHub-Event`).
    pub event_type: Option<&'a str>,
    /// The full URL the event is sent to (Twilio signs it).
    pub url: &'a str,
}

/// An answer a provider needs in its own format instead of hooklatch's JSON: a handshake
/// (Slack's `url_verification` challenge, Discord's PONG, Meta's `hub.challenge`) or the
/// acknowledgement of a stored event (Twilio's empty TwiML, Discord's deferred response).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProviderReply {
    /// HTTP status.
    pub status: u16,
    /// `Content-Type` of the body.
    pub content_type: &'static str,
    /// The body.
    pub body: Vec<u8>,
}

impl ProviderReply {
    /// A 200 with a JSON body.
    pub fn json(value: &serde_json::Value) -> ProviderReply {
        ProviderReply {
            status: 200,
            content_type: "application/json",
            body: serde_json::to_vec(value).expect("a JSON value serializes"),
        }
    }
}

/// Why a delivery was refused. Each maps to a status and a stable `code` at the HTTP edge.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Rejection {
    /// The signature header is absent.
    MissingSignature {
        /// The header that was expected.
        header: String,
    },
    /// The signature header (or the timestamp header it needs) cannot be parsed.
    MalformedSignature {
        /// What was wrong, without echoing secrets or the signature itself.
        detail: String,
    },
    /// Well-formed, but no configured secret produces it.
    InvalidSignature,
    /// The signed timestamp is outside the tolerance window (either direction).
    StaleTimestamp {
        /// Signed time minus now, in seconds (negative = in the past).
        skew_secs: i64,
        /// The source's tolerance in seconds.
        tolerance_secs: u64,
    },
    /// The provider always sends JSON and this body is not JSON.
    InvalidJson {
        /// The parser's message.
        detail: String,
    },
    /// A subscription check (Meta's `GET` with `hub.verify_token`) with the wrong token.
    InvalidVerifyToken,
    /// The event key the provider always sends is missing or unusable.
    MissingKey {
        /// Where the key was looked for.
        detail: String,
    },
}

impl Rejection {
    /// The stable machine-readable code.
    pub fn code(&self) -> &'static str {
        match self {
            Rejection::MissingSignature { .. } => "missing_signature",
            Rejection::MalformedSignature { .. } => "malformed_signature",
            Rejection::InvalidSignature => "invalid_signature",
            Rejection::StaleTimestamp { .. } => "stale_timestamp",
            Rejection::InvalidJson { .. } => "invalid_json",
            Rejection::InvalidVerifyToken => "invalid_verify_token",
            Rejection::MissingKey { .. } => "missing_event_key",
        }
    }

    /// The HTTP status: 401 for anything about authenticity, 400 for a malformed event.
    pub fn status(&self) -> u16 {
        match self {
            Rejection::MissingSignature { .. }
            | Rejection::MalformedSignature { .. }
            | Rejection::InvalidSignature
            | Rejection::StaleTimestamp { .. } => 401,
            Rejection::InvalidJson { .. } | Rejection::MissingKey { .. } => 400,
            Rejection::InvalidVerifyToken => 403,
        }
    }

    /// A message safe to show the sender.
    pub fn message(&self) -> String {
        match self {
            Rejection::MissingSignature { header } => format!("missing signature header {header}"),
            Rejection::MalformedSignature { detail } => format!("malformed signature: {detail}"),
            Rejection::InvalidSignature => {
                "signature does not match any configured secret".to_owned()
            }
            Rejection::StaleTimestamp {
                skew_secs,
                tolerance_secs,
            } => format!(
                "timestamp is {}s {} now, outside the {tolerance_secs}s tolerance",
                skew_secs.unsigned_abs(),
                if *skew_secs < 0 { "before" } else { "after" }
            ),
            Rejection::InvalidJson { detail } => format!("body is not valid JSON: {detail}"),
            Rejection::InvalidVerifyToken => "the subscription check failed: hub.verify_token does not match, or hub.mode is not subscribe, or hub.challenge is missing".to_owned(),
            Rejection::MissingKey { detail } => format!("no event key: {detail}"),
        }
    }
}

/// One provider's webhook scheme.
///
/// Implementations are pure: no clock (time comes in [`InboundRequest::now`]), no I/O.
pub trait ProviderAdapter: Send + Sync + std::fmt::Debug {
    /// The provider's name as written in config (`stripe`, `github`, ...).
    fn provider(&self) -> &'static str;

    /// Every header the adapter reads a signature from. An export leaves them out unless asked
    /// to keep them: a capture's signature re-sent to a gateway whose key for it has expired,
    /// or to a handler keeping no keys, is taken as new where no signed timestamp expires it.
    fn signature_headers(&self) -> Vec<&str>;

    /// Checks the signature (and signed timestamp, within `tolerance`) against every secret;
    /// any one matching is enough (rotation). Must compare in constant time.
    fn verify(
        &self,
        req: &InboundRequest<'_>,
        secrets: &[Secret],
        tolerance: Duration,
    ) -> Result<(), Rejection>;

    /// Finds the event key(s) of a verified delivery.
    fn extract(&self, req: &InboundRequest<'_>) -> Result<Vec<ExtractedEvent>, Rejection>;

    /// The headers a provider would send with `req.body` (signature, timestamp and key headers).
    fn sign(&self, req: &SignRequest<'_>) -> Vec<(String, String)>;

    /// How long a claimed key is kept unless the source says otherwise: at least 7 days, and
    /// at least the provider's longest redelivery path plus a margin.
    fn default_retention(&self) -> Duration {
        MIN_RETENTION
    }

    /// Answers a `GET` to the ingest URL (Meta's subscription check: `hub.mode`,
    /// `hub.verify_token`, `hub.challenge` in `query`). `None`: not a check; the gateway then
    /// takes the GET as an event if [`get_carries_events`](Self::get_carries_events) says so,
    /// and answers 405 otherwise. Touches no store.
    fn handle_get(&self, query: &str) -> Option<Result<ProviderReply, Rejection>> {
        let _ = query;
        None
    }

    /// Whether the provider may send its events as a `GET` with the parameters in the query
    /// string (Twilio's voice webhooks, when configured so). Such a request goes through
    /// [`verify`](Self::verify) and [`extract`](Self::extract) like a POST with an empty body;
    /// its event is delivered as a form-encoded POST of the query (see
    /// [`crate::store::LeasedDelivery::payload`]).
    fn get_carries_events(&self) -> bool {
        false
    }

    /// Called before [`verify`](Self::verify): an unsigned probe the provider sends by design
    /// (Slack's slash-command `ssl_check=1`) is answered with this reply and recorded as a
    /// handshake — nothing else: no claim, no delivery, none of its fields used. `None`: verify
    /// as usual.
    fn unsigned_probe(&self, req: &InboundRequest<'_>) -> Option<ProviderReply> {
        let _ = req;
        None
    }

    /// Called after [`verify`](Self::verify) succeeded and before anything is stored: a
    /// verified request that is a handshake, not an event (Slack `url_verification`, Discord
    /// PING), is answered with this reply and claims nothing. `None`: an event.
    fn handshake(&self, req: &InboundRequest<'_>) -> Option<ProviderReply> {
        let _ = req;
        None
    }

    /// The answer once the events are stored, when the provider needs its own format (Twilio's
    /// empty TwiML, Discord's deferred interaction response). `None`: hooklatch's JSON. Given
    /// for new events, duplicates and conflicts alike: the provider must see the same answer.
    fn ack_reply(&self, req: &InboundRequest<'_>) -> Option<ProviderReply> {
        let _ = req;
        None
    }

    /// The public URL the provider signs, when the source sets one (Twilio's `public_url`),
    /// for the start-up log. `None`: none set, or the provider signs no URL.
    fn public_url(&self) -> Option<&str> {
        None
    }
}

/// Providers whose signature covers a timestamp, which [`ProviderAdapter::verify`] checks
/// against its tolerance: a source of any other provider has no `tolerance` to set, and a
/// capture of theirs stays valid however old it is.
pub const TIMESTAMP_SIGNERS: &[&str] =
    &["stripe", "standard-webhooks", "slack", "paddle", "discord"];

/// The shortest default retention of any provider: 7 days.
pub const MIN_RETENTION: Duration = Duration::from_secs(7 * 24 * 3600);

/// Whether `signed` (unix seconds) is within `tolerance` of `now`, in both directions.
pub(crate) fn check_tolerance(
    signed_secs: i64,
    now: Timestamp,
    tolerance: Duration,
) -> Result<(), Rejection> {
    let skew_secs = signed_secs.saturating_sub(now.as_secs());
    let tolerance_secs = tolerance.as_secs();
    if skew_secs.unsigned_abs() > tolerance_secs {
        return Err(Rejection::StaleTimestamp {
            skew_secs,
            tolerance_secs,
        });
    }
    Ok(())
}

/// A required signature header's value as text: absent → [`Rejection::MissingSignature`],
/// not visible ASCII → [`Rejection::MalformedSignature`], both naming the header.
pub(crate) fn signature_value<'a>(
    headers: &'a HeaderMap,
    name: &str,
) -> Result<&'a str, Rejection> {
    let raw = headers
        .get(name)
        .ok_or_else(|| Rejection::MissingSignature {
            header: name.to_owned(),
        })?;
    raw.to_str()
        .map_err(|_| malformed(name, "is not visible ASCII"))
}

/// A malformed-signature rejection naming the header; `detail` never echoes its value.
pub(crate) fn malformed(header: &str, detail: &str) -> Rejection {
    Rejection::MalformedSignature {
        detail: format!("{header} {detail}"),
    }
}

/// A header's value as text, if present and visible ASCII.
pub(crate) fn header_str<'a>(headers: &'a HeaderMap, name: &str) -> Option<&'a str> {
    headers.get(name).and_then(|v| v.to_str().ok())
}

/// Parses the body as JSON, mapping failure to [`Rejection::InvalidJson`].
pub(crate) fn parse_json(body: &[u8]) -> Result<serde_json::Value, Rejection> {
    serde_json::from_slice(body).map_err(|err| Rejection::InvalidJson {
        detail: err.to_string(),
    })
}

/// Wraps a key, mapping an unusable one to [`Rejection::MissingKey`].
/// `body:` and the body's SHA-256: the key of a payload that carries none of its own
/// (WhatsApp's itemless changes, Slack's `app_rate_limited`, Discord's Webhook Events). A
/// provider's retry sends the same bytes, so it finds the same key.
pub(crate) fn body_key(body: &[u8]) -> Result<EventKey, Rejection> {
    let key = format!("body:{}", hex::encode(crate::secret::sha256(body)));
    event_key(&key, "the body's hash")
}

pub(crate) fn event_key(raw: &str, place: &str) -> Result<EventKey, Rejection> {
    EventKey::parse(raw).map_err(|err| Rejection::MissingKey {
        detail: format!("{place} {err}"),
    })
}

/// Helpers shared by the adapters' tests.
#[cfg(test)]
pub(crate) mod test_support {
    use http::{HeaderMap, HeaderName, HeaderValue};

    /// A header map from `(name, value)` pairs.
    pub(crate) fn headers(pairs: &[(&str, &str)]) -> HeaderMap {
        pairs
            .iter()
            .map(|(name, value)| {
                (
                    HeaderName::from_bytes(name.as_bytes()).unwrap(),
                    HeaderValue::from_str(value).unwrap(),
                )
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_default_retention_is_at_least_seven_days() {
        let settings = GenericSettings {
            signature_header: "x-signature".to_owned(),
            encoding: SignatureEncoding::Hex,
            prefix: None,
            key_header: Some("x-id".to_owned()),
            key_pointer: None,
            type_header: None,
            type_pointer: None,
        };
        let discord =
            Discord::from_hex("d75a980182b10ab7d54bfed3c964073a0ee172f3daa62325af021a68f707511a")
                .expect("RFC 8032 test key");
        let adapters: [&dyn ProviderAdapter; 11] = [
            &Stripe,
            &GitHub,
            &StandardWebhooks,
            &Generic { settings },
            &Shopify,
            &Twilio { public_url: None },
            &Slack::default(),
            &WhatsApp { verify_token: None },
            &discord,
            &Razorpay,
            &Paddle,
        ];
        for adapter in adapters {
            assert!(
                adapter.default_retention() >= MIN_RETENTION,
                "{}",
                adapter.provider()
            );
        }
        // Stripe's CLI resends for 30 days; GitHub Enterprise redelivers for 7; Razorpay's
        // dashboard replays for 7; Meta reportedly retries for 7.
        let week = Duration::from_secs(7 * 86_400);
        assert!(Stripe.default_retention() > Duration::from_secs(30 * 86_400));
        assert!(GitHub.default_retention() > week);
        assert!(Razorpay.default_retention() > week);
        assert!(WhatsApp { verify_token: None }.default_retention() > week);
    }
}
