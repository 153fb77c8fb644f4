//! Every provider adapter, fed what a stranger could send to `POST /in/{source}` (and `GET`):
//! any headers, path, query and body. Nothing may panic, and a request signed the way the
//! provider signs must verify, whatever its body.

#![no_main]

use std::time::Duration;

use arbitrary::Arbitrary;
use hooklatch_core::provider::{
    Discord, Generic, GenericSettings, GitHub, Paddle, ProviderAdapter, Razorpay, Shopify,
    SignRequest, SignatureEncoding, Slack, StandardWebhooks, Stripe, Twilio, WhatsApp,
};
use hooklatch_core::{EventKey, InboundRequest, Secret, Timestamp};
use http::{HeaderMap, HeaderName, HeaderValue};
use libfuzzer_sys::fuzz_target;

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
];

#[derive(Arbitrary, Debug)]
enum Name<'a> {
    /// One of the adapter's signature headers (by index, wrapping).
    Signature(u8),
    /// One of [`OTHER_HEADERS`] (by index, wrapping).
    Known(u8),
    /// Anything; skipped when it is not a valid header name.
    Other(&'a str),
}

#[derive(Arbitrary, Debug)]
struct Input<'a> {
    provider: u8,
    headers: Vec<(Name<'a>, &'a [u8])>,
    path_and_query: &'a str,
    body: &'a [u8],
    now: u32,
    /// Whether to also sign the body as the provider does and check that it verifies.
    sign: bool,
    event_key: &'a str,
}

fn adapters() -> Vec<Box<dyn ProviderAdapter>> {
    let generic = |encoding, prefix: Option<&str>| GenericSettings {
        signature_header: "X-Signature".to_owned(),
        encoding,
        prefix: prefix.map(str::to_owned),
        key_header: Some("X-Event-Id".to_owned()),
        key_pointer: Some("/data/id".to_owned()),
        type_header: None,
        type_pointer: Some("/type".to_owned()),
    };
    vec![
        Box::new(Stripe),
        Box::new(GitHub),
        Box::new(Shopify),
        Box::new(Slack::default()),
        Box::new(Slack {
            interactive_key: Some("/actions/0/action_id".to_owned()),
        }),
        Box::new(Discord::from_hex(DISCORD_PUBLIC_KEY).expect("the RFC 8032 key")),
        Box::new(Twilio::default()),
        Box::new(Twilio {
            public_url: Some("https://hooks.example.com/base".to_owned()),
        }),
        Box::new(WhatsApp::default()),
        Box::new(WhatsApp {
            verify_token: Some(Secret::from_text("verify-token")),
        }),
        Box::new(Paddle),
        Box::new(Razorpay),
        Box::new(StandardWebhooks),
        Box::new(Generic {
            settings: generic(SignatureEncoding::Hex, Some("sha256=")),
        }),
        Box::new(Generic {
            settings: generic(SignatureEncoding::Base64, None),
        }),
    ]
}

/// Adapters whose signature covers nothing but the headers they write and the body, so that
/// signing any body and sending exactly that must verify. (Twilio signs the URL and the form
/// fields as it parses them, Discord with a private key the gateway never holds.)
fn signs_body_alone(provider: &str) -> bool {
    !matches!(provider, "twilio" | "discord")
}

fuzz_target!(|input: Input<'_>| {
    let adapters = adapters();
    let adapter = &adapters[usize::from(input.provider) % adapters.len()];
    let signature_headers = adapter.signature_headers();
    let mut headers = HeaderMap::new();
    for (name, value) in &input.headers {
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
    // A `whsec_` secret whose rest is base64, as Standard Webhooks requires (the others use
    // the text as it is); and an older one, as during a rotation.
    let secrets = [
        Secret::from_text("whsec_ZnV6ei1zZWNyZXQtMDEyMzQ1Njc4OQ=="),
        Secret::from_text("old"),
    ];
    let now = Timestamp::from_secs(1_700_000_000 + i64::from(input.now));
    let tolerance = Duration::from_secs(300);
    let req = InboundRequest {
        path_and_query: input.path_and_query,
        headers: &headers,
        body: input.body,
        now,
    };
    let _ = adapter.handshake(&req);
    let _ = adapter.unsigned_probe(&req);
    let _ = adapter.verify(&req, &secrets, tolerance);
    let _ = adapter.extract(&req);
    let query = input.path_and_query.split_once('?').map_or("", |(_, q)| q);
    let _ = adapter.handle_get(query);
    let _ = adapter.get_carries_events();
    let _ = adapter.default_retention();

    if input.sign {
        // What `send` and `replay` sign with: a key that passed `EventKey::parse`.
        let event_key = EventKey::parse(input.event_key);
        let signed = adapter.sign(&SignRequest {
            body: input.body,
            secret: &secrets[0],
            now,
            event_key: event_key.as_ref().map_or("evt_fuzz", EventKey::as_str),
            event_type: Some("fuzz.event"),
            url: "https://hooks.example.com/base/in/fuzz",
        });
        let mut headers = HeaderMap::new();
        for (name, value) in &signed {
            let name =
                HeaderName::from_bytes(name.as_bytes()).expect("a header name the adapter wrote");
            let value = HeaderValue::from_str(value).expect("a header value the adapter wrote");
            headers.append(name, value);
        }
        let req = InboundRequest {
            path_and_query: "/in/fuzz",
            headers: &headers,
            body: input.body,
            now,
        };
        let verified = adapter.verify(&req, &secrets, tolerance);
        // Providers send header values in visible ASCII; an event key outside it (which
        // `EventKey` allows, for keys read from bodies) in a header no provider would send is
        // refused as unreadable, not checked here.
        let sendable = headers.values().all(|v| v.to_str().is_ok());
        if sendable && signs_body_alone(adapter.provider()) {
            assert!(
                verified.is_ok(),
                "{}: a request signed as the provider signs did not verify: {:?}",
                adapter.provider(),
                verified.err().map(|r| r.code())
            );
        }
        let _ = adapter.extract(&req);
    }
});
