//! What the fuzz targets share: one adapter per provider (and per setting that changes how it
//! reads a request), the secrets they are configured with, and headers built from fuzz input.

pub mod admin;
pub mod ingest;
pub mod wire;

use arbitrary::Arbitrary;
use hooklatch_core::provider::{
    Discord, Generic, GenericSettings, GitHub, Paddle, ProviderAdapter, Razorpay, Shopify,
    SignRequest, SignatureEncoding, Slack, StandardWebhooks, Stripe, Twilio, WhatsApp,
};
use hooklatch_core::{EventKey, Secret, Timestamp};
use http::{HeaderMap, HeaderName, HeaderValue};

/// RFC 8032's first test key: Discord's adapter needs a public key to check against.
const DISCORD_PUBLIC_KEY: &str = "d75a980182b10ab7d54bfed3c964073a0ee172f3daa62325af021a68f707511a";

/// Header names an adapter may read besides its signature headers.
const OTHER_HEADERS: &[&str] = &[
    "X-GitHub-Event",
    "X-GitHub-Delivery",
    "X-Shopify-Webhook-Id",
    "X-Shopify-Topic",
    "X-Shopify-Triggered-At",
    "X-Slack-Request-Timestamp",
    "X-Signature-Timestamp",
    "I-Twilio-Idempotency-Token",
    "x-razorpay-event-id",
    "webhook-id",
    "webhook-timestamp",
    "X-Event-Id",
    "X-Event-Type",
    "Host",
    "X-Forwarded-Proto",
    "Content-Type",
    "Content-Length",
];

/// A header's name in fuzz input.
#[derive(Arbitrary, Debug)]
pub enum Name<'a> {
    /// One of the adapter's signature headers (by index, wrapping).
    Signature(u8),
    /// One of the other headers adapters read (by index, wrapping).
    Known(u8),
    /// Anything; skipped when it is not a valid header name.
    Other(&'a str),
}

/// The secrets every source is configured with: a `whsec_` secret whose rest is base64, as
/// Standard Webhooks requires (the other providers use the text as it is), and an older one,
/// as during a rotation.
pub fn secrets() -> Vec<Secret> {
    vec![
        Secret::from_text("whsec_ZnV6ei1zZWNyZXQtMDEyMzQ1Njc4OQ=="),
        Secret::from_text("old"),
    ]
}

/// An adapter as a source is configured with it.
pub struct Fuzzed {
    /// The adapter.
    pub adapter: Box<dyn ProviderAdapter>,
    /// Whether any body it signs ([`signed`]) verifies when sent with exactly those headers to
    /// `/in/fuzz` (the providers target) or the URL it was signed for (the ingest target).
    /// Not Discord, which signs with a private key the gateway never holds, nor Twilio without
    /// a public URL, which checks the URL rebuilt from a `Host` header the request lacks.
    pub round_trips: bool,
}

/// One adapter per provider, and per setting that changes how it reads a request.
pub fn adapters() -> Vec<Fuzzed> {
    let generic = |encoding, prefix: Option<&str>| GenericSettings {
        signature_header: "X-Signature".to_owned(),
        encoding,
        prefix: prefix.map(str::to_owned),
        key_header: Some("X-Event-Id".to_owned()),
        key_pointer: Some("/data/id".to_owned()),
        type_header: None,
        type_pointer: Some("/type".to_owned()),
    };
    let round_trips = |adapter: Box<dyn ProviderAdapter>| Fuzzed {
        adapter,
        round_trips: true,
    };
    vec![
        round_trips(Box::new(Stripe)),
        round_trips(Box::new(GitHub)),
        round_trips(Box::new(Shopify)),
        round_trips(Box::<Slack>::default()),
        round_trips(Box::new(Slack {
            interactive_key: Some("/actions/0/action_id".to_owned()),
        })),
        Fuzzed {
            adapter: Box::new(Discord::from_hex(DISCORD_PUBLIC_KEY).expect("the RFC 8032 key")),
            round_trips: false,
        },
        Fuzzed {
            adapter: Box::new(Twilio::default()),
            round_trips: false,
        },
        round_trips(Box::new(Twilio {
            public_url: Some("https://hooks.example.com/base".to_owned()),
        })),
        round_trips(Box::<WhatsApp>::default()),
        round_trips(Box::new(WhatsApp {
            verify_token: Some(Secret::from_text("verify-token")),
        })),
        round_trips(Box::new(Paddle)),
        round_trips(Box::new(Razorpay)),
        round_trips(Box::new(StandardWebhooks)),
        round_trips(Box::new(Generic {
            settings: generic(SignatureEncoding::Hex, Some("sha256=")),
        })),
        round_trips(Box::new(Generic {
            settings: generic(SignatureEncoding::Base64, None),
        })),
    ]
}

/// The headers fuzz input names for `adapter`, skipping names and values HTTP cannot carry.
pub fn headers(adapter: &dyn ProviderAdapter, input: &[(Name<'_>, &[u8])]) -> HeaderMap {
    let signature_headers = adapter.signature_headers();
    let mut headers = HeaderMap::new();
    for (name, value) in input {
        let name = match name {
            Name::Signature(i) if !signature_headers.is_empty() => {
                signature_headers[usize::from(*i) % signature_headers.len()]
            }
            Name::Signature(i) | Name::Known(i) => {
                OTHER_HEADERS[usize::from(*i) % OTHER_HEADERS.len()]
            }
            Name::Other(name) => name,
        };
        let (Ok(name), Ok(value)) = (
            HeaderName::from_bytes(name.as_bytes()),
            HeaderValue::from_bytes(value),
        ) else {
            continue;
        };
        headers.append(name, value);
    }
    headers
}

/// The headers `adapter` writes to sign `body` as its provider does, with the first of
/// [`secrets`], for an event key `EventKey::parse` accepts (as `send` and `replay` sign), and
/// for Twilio the form content type its signature assumes (as `send` sends Twilio's fixtures).
pub fn signed(
    adapter: &dyn ProviderAdapter,
    body: &[u8],
    event_key: &str,
    now: Timestamp,
    url: &str,
) -> HeaderMap {
    let event_key = EventKey::parse(event_key);
    let secret = &secrets()[0];
    let signed = adapter.sign(&SignRequest {
        body,
        secret,
        now,
        event_key: event_key.as_ref().map_or("evt_fuzz", EventKey::as_str),
        event_type: Some("fuzz.event"),
        url,
    });
    let mut headers = HeaderMap::new();
    for (name, value) in &signed {
        let name =
            HeaderName::from_bytes(name.as_bytes()).expect("a header name the adapter wrote");
        let value = HeaderValue::from_str(value).expect("a header value the adapter wrote");
        headers.append(name, value);
    }
    if adapter.provider() == "twilio" {
        headers.insert(
            http::header::CONTENT_TYPE,
            HeaderValue::from_static("application/x-www-form-urlencoded"),
        );
    }
    headers
}

/// Whether every value is visible ASCII, as a provider's are. `EventKey` allows any text
/// without control characters (keys read from bodies), and an adapter that puts such a key in
/// a header writes one no provider would send, which the adapters then cannot read.
pub fn sendable(headers: &HeaderMap) -> bool {
    headers.values().all(|v| v.to_str().is_ok())
}
