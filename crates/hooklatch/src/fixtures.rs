//! Realistic, signed test events for each provider, as `hooklatch send` sends them.
//!
//! Bodies are data files under `crates/hooklatch/fixtures/<provider>/<event type>.json`,
//! embedded at build time, with `{{id}}`, `{{created}}` (unix seconds) and
//! `{{created_rfc3339}}` filled in. Signing uses the provider adapter's own signer, so a test
//! event is signed exactly as the provider signs it.

use hooklatch_core::provider::{GitHub, SignRequest, StandardWebhooks, Stripe};
use hooklatch_core::{ProviderAdapter, Secret, Timestamp};

/// `(provider, event type, body template)`, the first event of each provider its default.
const FIXTURES: &[(&str, &str, &str)] = &[
    (
        "stripe",
        "invoice.payment_succeeded",
        include_str!("../fixtures/stripe/invoice.payment_succeeded.json"),
    ),
    (
        "stripe",
        "checkout.session.completed",
        include_str!("../fixtures/stripe/checkout.session.completed.json"),
    ),
    (
        "github",
        "push",
        include_str!("../fixtures/github/push.json"),
    ),
    (
        "github",
        "pull_request",
        include_str!("../fixtures/github/pull_request.json"),
    ),
    (
        "standard-webhooks",
        "invoice.paid",
        include_str!("../fixtures/standard-webhooks/invoice.paid.json"),
    ),
    (
        "standard-webhooks",
        "user.created",
        include_str!("../fixtures/standard-webhooks/user.created.json"),
    ),
];

/// A test event ready to send.
#[derive(Debug, Clone)]
pub struct TestEvent {
    /// The provider's event key (what the gateway deduplicates on).
    pub key: String,
    /// The event type.
    pub event_type: String,
    /// Headers to send, signature included.
    pub headers: Vec<(String, String)>,
    /// The body, byte-exact.
    pub body: Vec<u8>,
}

/// Why a test event could not be built.
#[derive(Debug, thiserror::Error)]
pub enum FixtureError {
    /// No fixtures for this provider.
    #[error("no test events for provider {0:?}; known: {1}")]
    UnknownProvider(String, String),
    /// No such event type for the provider.
    #[error("no {provider} test event of type {event_type:?}; known: {known}")]
    UnknownEvent {
        /// The provider.
        provider: String,
        /// The type asked for.
        event_type: String,
        /// The types there are.
        known: String,
    },
}

/// The providers and event types there are fixtures for.
pub fn catalog() -> impl Iterator<Item = (&'static str, &'static str)> {
    FIXTURES.iter().map(|(p, e, _)| (*p, *e))
}

/// Builds a signed test event for sending to `url`. `id` defaults to a fresh provider-shaped id.
pub fn build(
    provider: &str,
    event_type: Option<&str>,
    id: Option<&str>,
    secret: &Secret,
    url: &str,
    now: Timestamp,
) -> Result<TestEvent, FixtureError> {
    let adapter: &dyn ProviderAdapter = match provider {
        "stripe" => &Stripe,
        "github" => &GitHub,
        "standard-webhooks" => &StandardWebhooks,
        other => {
            let mut known: Vec<&str> = FIXTURES.iter().map(|f| f.0).collect();
            known.dedup();
            return Err(FixtureError::UnknownProvider(
                other.to_owned(),
                known.join(", "),
            ));
        }
    };
    let mut of_provider = FIXTURES.iter().filter(|f| f.0 == provider);
    let fixture = match event_type {
        None => of_provider.next(),
        Some(t) => of_provider.find(|f| f.1 == t),
    }
    .ok_or_else(|| FixtureError::UnknownEvent {
        provider: provider.to_owned(),
        event_type: event_type.unwrap_or_default().to_owned(),
        known: FIXTURES
            .iter()
            .filter(|f| f.0 == provider)
            .map(|f| f.1)
            .collect::<Vec<_>>()
            .join(", "),
    })?;
    let key = id.map(str::to_owned).unwrap_or_else(|| fresh_id(provider));
    let body = fixture
        .2
        .replace("{{id}}", &key)
        .replace("{{created_rfc3339}}", &now.to_rfc3339())
        .replace("{{created}}", &now.as_secs().to_string())
        .into_bytes();
    let mut headers = vec![("content-type".to_owned(), "application/json".to_owned())];
    headers.extend(adapter.sign(&SignRequest {
        url,
        body: &body,
        secret,
        now,
        event_key: &key,
        event_type: Some(fixture.1),
    }));
    Ok(TestEvent {
        key,
        event_type: fixture.1.to_owned(),
        headers,
        body,
    })
}

/// An id shaped like the provider's: `evt_…` (Stripe), a GUID (GitHub), `msg_…` (Standard
/// Webhooks).
fn fresh_id(provider: &str) -> String {
    use rand::Rng;
    let mut rng = rand::rng();
    let alnum = |n: usize, rng: &mut rand::rngs::ThreadRng| -> String {
        (0..n)
            .map(|_| rng.sample(rand::distr::Alphanumeric) as char)
            .collect()
    };
    match provider {
        "github" => {
            let b: [u8; 16] = rng.random();
            let h = hex::encode(b);
            format!(
                "{}-{}-{}-{}-{}",
                &h[..8],
                &h[8..12],
                &h[12..16],
                &h[16..20],
                &h[20..]
            )
        }
        "standard-webhooks" => format!("msg_{}", alnum(27, &mut rng)),
        _ => format!("evt_{}", alnum(24, &mut rng)),
    }
}

#[cfg(test)]
mod tests {
    use hooklatch_core::InboundRequest;
    use http::HeaderMap;

    use super::*;

    const URL: &str = "http://127.0.0.1:8080/in/test";

    #[test]
    fn every_fixture_is_json_and_verifies_with_its_adapter() {
        let secret = Secret::from_text("whsec_C2FVsBQIhrscChlQIMV+b5sSYspob7oD");
        let now = Timestamp::from_secs(1_700_000_000);
        for (provider, event_type) in catalog() {
            let event = build(provider, Some(event_type), None, &secret, URL, now).unwrap();
            serde_json::from_slice::<serde_json::Value>(&event.body)
                .unwrap_or_else(|e| panic!("{provider}/{event_type}: {e}"));
            let mut headers = HeaderMap::new();
            for (k, v) in &event.headers {
                headers.insert(
                    http::HeaderName::from_bytes(k.as_bytes()).unwrap(),
                    v.parse().unwrap(),
                );
            }
            let adapter: &dyn ProviderAdapter = match provider {
                "stripe" => &Stripe,
                "github" => &GitHub,
                _ => &StandardWebhooks,
            };
            let req = InboundRequest {
                path_and_query: "/in/test",
                headers: &headers,
                body: &event.body,
                now,
            };
            adapter
                .verify(
                    &req,
                    std::slice::from_ref(&secret),
                    std::time::Duration::from_secs(300),
                )
                .unwrap_or_else(|e| panic!("{provider}/{event_type}: {e:?}"));
            let extracted = adapter.extract(&req).unwrap();
            assert_eq!(extracted[0].key.as_str(), event.key);
            assert_eq!(extracted[0].event_type.as_deref(), Some(event_type));
        }
    }

    #[test]
    fn unknown_provider_and_event_are_named() {
        let secret = Secret::from_text("s");
        let now = Timestamp(0);
        let err = build("paypal", None, None, &secret, URL, now)
            .unwrap_err()
            .to_string();
        assert!(err.contains("paypal") && err.contains("stripe"), "{err}");
        let err = build("stripe", Some("x"), None, &secret, URL, now)
            .unwrap_err()
            .to_string();
        assert!(err.contains("invoice.payment_succeeded"), "{err}");
    }

    #[test]
    fn a_given_id_is_used() {
        let secret = Secret::from_text("s");
        let event = build(
            "stripe",
            None,
            Some("evt_fixed"),
            &secret,
            URL,
            Timestamp(0),
        )
        .unwrap();
        assert_eq!(event.key, "evt_fixed");
        assert!(String::from_utf8(event.body)
            .unwrap()
            .contains("\"id\": \"evt_fixed\""));
    }
}
