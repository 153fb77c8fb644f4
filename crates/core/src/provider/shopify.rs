//! Shopify: `X-Shopify-Hmac-Sha256` is the base64 HMAC-SHA256 of the raw body, keyed by the
//! app's client secret. No prefix, no list, no timestamp. The event key is
//! `X-Shopify-Webhook-Id` (one per delivery, repeated by retries); the event type is
//! `X-Shopify-Topic` (`orders/create`).
//!
//! `X-Shopify-Event-Id` is deliberately *not* the key: every delivery caused by one merchant
//! action (several topics, several subscriptions) shares it, so deduping on it would drop
//! legitimate deliveries. It stays in the stored headers as a correlation id.
//!
//! The newer "Events" format sends lowercase unprefixed headers (`shopify-hmac-sha256`,
//! `shopify-webhook-id`, `shopify-topic`); like shopify-api, a delivery carrying
//! `shopify-hmac-sha256` is read with those names, any other with the `X-Shopify-*` ones.
//!
//! No timestamp is signed, so the tolerance is unused and deduplication is the only replay
//! defence. Rotation: Shopify keeps signing with the old secret for up to an hour and never
//! sends two signatures, so any configured secret may match.

use std::time::Duration;

use base64::engine::general_purpose::{STANDARD, STANDARD_NO_PAD};
use base64::Engine;
use http::HeaderMap;

use crate::provider::{
    event_key, header_str, malformed, ExtractedEvent, InboundRequest, ProviderAdapter, Rejection,
    SignRequest,
};
use crate::secret::{Mac256, Secret};

/// Shopify's webhook scheme (`provider = "shopify"`).
#[derive(Debug, Clone, Copy, Default)]
pub struct Shopify;

/// The header names one delivery uses: classic webhooks or the newer Events format.
struct HeaderNames {
    hmac: &'static str,
    webhook_id: &'static str,
    topic: &'static str,
}

const WEBHOOK_HEADERS: HeaderNames = HeaderNames {
    hmac: "X-Shopify-Hmac-Sha256",
    webhook_id: "X-Shopify-Webhook-Id",
    topic: "X-Shopify-Topic",
};

const EVENTS_HEADERS: HeaderNames = HeaderNames {
    hmac: "shopify-hmac-sha256",
    webhook_id: "shopify-webhook-id",
    topic: "shopify-topic",
};

const TRIGGERED_AT_HEADER: &str = "X-Shopify-Triggered-At";

impl HeaderNames {
    /// The Events names when `shopify-hmac-sha256` is present (checked first, as shopify-api
    /// does), else the classic `X-Shopify-*` names.
    fn of(headers: &HeaderMap) -> &'static HeaderNames {
        if headers.contains_key(EVENTS_HEADERS.hmac) {
            &EVENTS_HEADERS
        } else {
            &WEBHOOK_HEADERS
        }
    }
}

impl ProviderAdapter for Shopify {
    fn provider(&self) -> &'static str {
        "shopify"
    }

    fn signature_headers(&self) -> Vec<&str> {
        vec![WEBHOOK_HEADERS.hmac, EVENTS_HEADERS.hmac]
    }

    fn verify(
        &self,
        req: &InboundRequest<'_>,
        secrets: &[Secret],
        _tolerance: Duration,
    ) -> Result<(), Rejection> {
        let names = HeaderNames::of(req.headers);
        let raw = req
            .headers
            .get(names.hmac)
            .ok_or_else(|| Rejection::MissingSignature {
                header: WEBHOOK_HEADERS.hmac.to_owned(),
            })?;
        let value = raw
            .to_str()
            .map_err(|_| malformed(names.hmac, "is not visible ASCII"))?
            .trim();
        let received = STANDARD
            .decode(value)
            .or_else(|_| STANDARD_NO_PAD.decode(value))
            .map_err(|_| malformed(names.hmac, "is not base64"))?;

        let matched = secrets
            .iter()
            .any(|secret| Mac256::compute(secret.expose(), &[req.body]).matches(&received));
        if matched {
            Ok(())
        } else {
            Err(Rejection::InvalidSignature)
        }
    }

    fn extract(&self, req: &InboundRequest<'_>) -> Result<Vec<ExtractedEvent>, Rejection> {
        let names = HeaderNames::of(req.headers);
        let place = format!("header {}", names.webhook_id);
        let id =
            header_str(req.headers, names.webhook_id).ok_or_else(|| Rejection::MissingKey {
                detail: place.clone(),
            })?;
        Ok(vec![ExtractedEvent {
            fingerprint: None,
            key: event_key(id, &place)?,
            event_type: header_str(req.headers, names.topic).map(str::to_owned),
        }])
    }

    fn sign(&self, req: &SignRequest<'_>) -> Vec<(String, String)> {
        let mac = Mac256::compute(req.secret.expose(), &[req.body]);
        let mut headers = vec![
            (WEBHOOK_HEADERS.hmac.to_owned(), mac.to_base64()),
            (
                WEBHOOK_HEADERS.webhook_id.to_owned(),
                req.event_key.to_owned(),
            ),
        ];
        if let Some(topic) = req.event_type {
            headers.push((WEBHOOK_HEADERS.topic.to_owned(), topic.to_owned()));
        }
        headers.push((TRIGGERED_AT_HEADER.to_owned(), req.now.to_rfc3339()));
        headers
    }

    /// 7 days: Shopify retries 8 times over 4 hours and offers no manual redelivery, so the
    /// minimum retention already covers it with a wide margin.
    fn default_retention(&self) -> Duration {
        Duration::from_secs(7 * 24 * 3600)
    }
}

#[cfg(test)]
mod tests {
    use http::HeaderValue;
    use proptest::prelude::*;

    use super::*;
    use crate::provider::test_support::headers;
    use crate::time::Timestamp;

    const BODY: &[u8] = br#"{"id":820982911946154508,"email":"jon@example.com"}"#;
    const OLD: &str = "shpss_old";
    const NEW: &str = "shpss_new";
    /// From shopify-api's `validate.test.ts` (secret from its `test-config.ts`).
    const VECTOR_SECRET: &str = "test_secret_key";
    const VECTOR_BODY: &[u8] = br#"{"foo": "bar"}"#;
    const VECTOR_HMAC: &str = "B23tXN681gZ0qIWNRrgtzBE9XSDo5yaUu6wfmhu3a7g=";

    fn request<'a>(headers: &'a HeaderMap, body: &'a [u8]) -> InboundRequest<'a> {
        InboundRequest {
            path_and_query: "/in/test",
            headers,
            body,
            now: Timestamp::from_secs(1_700_000_000),
        }
    }

    fn sign(secret: &str, body: &[u8], event_type: Option<&str>) -> Vec<(String, String)> {
        let secret = Secret::from_text(secret);
        Shopify.sign(&SignRequest {
            url: "http://127.0.0.1:8080/in/test",
            body,
            secret: &secret,
            now: Timestamp::from_secs(1_700_000_000),
            event_key: "b54557e4-bdd9-4b37-8a5f-bf7d70bcd043",
            event_type,
        })
    }

    fn hmac(secret: &str, body: &[u8]) -> String {
        sign(secret, body, None)[0].1.clone()
    }

    fn verify_with(
        name: &str,
        header: Option<&str>,
        body: &[u8],
        secrets: &[&str],
    ) -> Result<(), Rejection> {
        let headers = headers(header.map(|h| (name, h)).as_slice());
        let secrets: Vec<Secret> = secrets.iter().map(|s| Secret::from_text(s)).collect();
        Shopify.verify(&request(&headers, body), &secrets, Duration::ZERO)
    }

    #[track_caller]
    fn check(header: &str, body: &[u8], secrets: &[&str], expect: Result<(), &str>) {
        let got = verify_with(WEBHOOK_HEADERS.hmac, Some(header), body, secrets);
        assert_eq!(
            got.as_ref().map_err(Rejection::code).copied(),
            expect,
            "{got:?}"
        );
    }

    #[test]
    fn the_shopify_api_vector_signs_and_verifies() {
        assert_eq!(hmac(VECTOR_SECRET, VECTOR_BODY), VECTOR_HMAC);
        check(VECTOR_HMAC, VECTOR_BODY, &[VECTOR_SECRET], Ok(()));
    }

    #[test]
    fn the_events_format_lowercase_header_verifies_too() {
        let got = verify_with(
            "shopify-hmac-sha256",
            Some(VECTOR_HMAC),
            VECTOR_BODY,
            &[VECTOR_SECRET],
        );
        assert_eq!(got, Ok(()));
    }

    #[test]
    fn a_signed_event_verifies_and_any_change_breaks_it() {
        let good = hmac(NEW, BODY);
        check(&good, BODY, &[NEW], Ok(()));
        // Unpadded base64 and surrounding spaces are tolerated.
        check(good.trim_end_matches('='), BODY, &[NEW], Ok(()));
        check(&format!(" {good} "), BODY, &[NEW], Ok(()));
        check(&good, BODY, &[OLD], Err("invalid_signature"));
        check(
            &good,
            br#"{"id":820982911946154509,"email":"jon@example.com"}"#,
            &[NEW],
            Err("invalid_signature"),
        );
        check(&good, BODY, &[], Err("invalid_signature"));
    }

    #[test]
    fn a_missing_header_is_a_missing_signature() {
        assert_eq!(
            verify_with("X-Shopify-Topic", Some("orders/create"), BODY, &[NEW]),
            Err(Rejection::MissingSignature {
                header: "X-Shopify-Hmac-Sha256".to_owned()
            })
        );
    }

    #[test]
    fn a_value_that_is_not_base64_is_malformed_without_echoing_it() {
        for header in ["not base64!", "sha256=abc", "@@@@", "YQ=a"] {
            check(header, BODY, &[NEW], Err("malformed_signature"));
        }
        let Err(Rejection::MalformedSignature { detail }) =
            verify_with(WEBHOOK_HEADERS.hmac, Some("c2VjcmV0!"), BODY, &[NEW])
        else {
            panic!("expected a malformed signature");
        };
        assert!(!detail.contains("c2VjcmV0"), "{detail}");
    }

    #[test]
    fn a_hex_digest_of_the_right_mac_is_not_accepted() {
        // 64 hex digits happen to be valid base64, but decode to 48 bytes: no match.
        let hex = Mac256::compute(NEW.as_bytes(), &[BODY]).to_hex();
        check(&hex, BODY, &[NEW], Err("invalid_signature"));
    }

    #[test]
    fn rotation_accepts_either_configured_secret() {
        check(&hmac(OLD, BODY), BODY, &[OLD, NEW], Ok(()));
        check(&hmac(NEW, BODY), BODY, &[OLD, NEW], Ok(()));
        check(&hmac(OLD, BODY), BODY, &[NEW], Err("invalid_signature"));
    }

    #[test]
    fn the_key_is_the_webhook_id_not_the_event_id() {
        let delivered = headers(&[
            ("X-Shopify-Hmac-Sha256", VECTOR_HMAC),
            (
                "X-Shopify-Webhook-Id",
                "b54557e4-bdd9-4b37-8a5f-bf7d70bcd043",
            ),
            ("X-Shopify-Event-Id", "98880550-7158-44d4-b7cd-2c97c8a091b5"),
            ("X-Shopify-Topic", "orders/create"),
        ]);
        let events = Shopify.extract(&request(&delivered, BODY)).unwrap();
        assert_eq!(events.len(), 1);
        assert_eq!(
            events[0].key.as_str(),
            "b54557e4-bdd9-4b37-8a5f-bf7d70bcd043"
        );
        assert_eq!(events[0].event_type.as_deref(), Some("orders/create"));
    }

    #[test]
    fn the_events_format_reads_the_lowercase_key_and_topic() {
        let delivered = headers(&[
            ("shopify-hmac-sha256", VECTOR_HMAC),
            ("shopify-webhook-id", "e1a7f8d4-0000-4000-8000-000000000001"),
            ("shopify-event-id", "shared-by-many"),
            ("shopify-topic", "orders/paid"),
        ]);
        let events = Shopify.extract(&request(&delivered, BODY)).unwrap();
        assert_eq!(
            events[0].key.as_str(),
            "e1a7f8d4-0000-4000-8000-000000000001"
        );
        assert_eq!(events[0].event_type.as_deref(), Some("orders/paid"));
    }

    #[test]
    fn a_missing_webhook_id_is_a_missing_key_even_with_an_event_id() {
        let unkeyed = headers(&[
            ("X-Shopify-Hmac-Sha256", VECTOR_HMAC),
            ("X-Shopify-Event-Id", "98880550-7158-44d4-b7cd-2c97c8a091b5"),
        ]);
        assert_eq!(
            Shopify.extract(&request(&unkeyed, BODY)),
            Err(Rejection::MissingKey {
                detail: "header X-Shopify-Webhook-Id".to_owned()
            })
        );
        let events_unkeyed = headers(&[("shopify-hmac-sha256", VECTOR_HMAC)]);
        assert_eq!(
            Shopify.extract(&request(&events_unkeyed, BODY)),
            Err(Rejection::MissingKey {
                detail: "header shopify-webhook-id".to_owned()
            })
        );
    }

    #[test]
    fn signing_sets_the_webhook_id_and_topic_and_round_trips() {
        let signed = sign(NEW, BODY, Some("orders/paid"));
        let names: Vec<&str> = signed.iter().map(|(name, _)| name.as_str()).collect();
        assert_eq!(
            names,
            [
                "X-Shopify-Hmac-Sha256",
                "X-Shopify-Webhook-Id",
                "X-Shopify-Topic",
                "X-Shopify-Triggered-At"
            ]
        );
        let pairs: Vec<(&str, &str)> = signed
            .iter()
            .map(|(n, v)| (n.as_str(), v.as_str()))
            .collect();
        let headers = headers(&pairs);
        let req = request(&headers, BODY);
        assert_eq!(
            Shopify.verify(&req, &[Secret::from_text(NEW)], Duration::ZERO),
            Ok(())
        );
        let events = Shopify.extract(&req).unwrap();
        assert_eq!(
            events[0].key.as_str(),
            "b54557e4-bdd9-4b37-8a5f-bf7d70bcd043"
        );
        assert_eq!(events[0].event_type.as_deref(), Some("orders/paid"));

        assert!(sign(NEW, BODY, None)
            .iter()
            .all(|(name, _)| name != "X-Shopify-Topic"));
    }

    #[test]
    fn retention_is_seven_days() {
        assert_eq!(Shopify.default_retention(), Duration::from_secs(7 * 86_400));
    }

    proptest! {
        #[test]
        fn arbitrary_header_values_never_panic(
            header in "[ -~]{0,100}",
            body in proptest::collection::vec(any::<u8>(), 0..64),
        ) {
            let _ = verify_with(WEBHOOK_HEADERS.hmac, Some(&header), &body, &[NEW, OLD]);
            let _ = verify_with(EVENTS_HEADERS.hmac, Some(&header), &body, &[NEW]);
        }

        #[test]
        fn non_ascii_header_bytes_are_malformed(
            bytes in proptest::collection::vec(0x80u8..=0xff, 1..32),
        ) {
            let mut headers = HeaderMap::new();
            headers.insert(WEBHOOK_HEADERS.hmac, HeaderValue::from_bytes(&bytes).unwrap());
            let got = Shopify.verify(&request(&headers, BODY), &[Secret::from_text(NEW)], Duration::ZERO);
            prop_assert_eq!(got.map_err(|r| r.code()), Err("malformed_signature"));
        }

        #[test]
        fn arbitrary_signature_bytes_never_verify(
            sig in proptest::collection::vec(any::<u8>(), 0..64),
        ) {
            let header = STANDARD.encode(&sig);
            prop_assert_eq!(
                verify_with(WEBHOOK_HEADERS.hmac, Some(&header), BODY, &[NEW]),
                Err(Rejection::InvalidSignature)
            );
        }
    }
}
