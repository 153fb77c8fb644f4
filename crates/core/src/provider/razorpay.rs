//! Razorpay: `X-Razorpay-Signature` is the bare hex HMAC-SHA256 of the raw body, keyed by the
//! secret entered for that webhook. The event key is the `x-razorpay-event-id` header (the
//! body carries no event id); the event type is the body's `event` field (`payment.captured`).
//!
//! No timestamp is signed, so the tolerance is unused and deduplication is the only replay
//! defence. Rotation matters more than usual: after the secret is changed, retries of older
//! events are still signed with the *old* secret while dashboard replays use the current one,
//! so keep both configured until the old events have run out (24 h of retries).

use std::time::Duration;

use crate::provider::fields::top_level_strings;
use crate::provider::{
    event_key, header_str, malformed, signature_value, ExtractedEvent, InboundRequest,
    ProviderAdapter, Rejection, SignRequest,
};
use crate::secret::{Mac256, Secret};

const SIGNATURE_HEADER: &str = "X-Razorpay-Signature";
const EVENT_ID_HEADER: &str = "x-razorpay-event-id";

/// Razorpay's webhook scheme (`provider = "razorpay"`).
#[derive(Debug, Clone, Copy, Default)]
pub struct Razorpay;

impl ProviderAdapter for Razorpay {
    fn provider(&self) -> &'static str {
        "razorpay"
    }

    fn signature_headers(&self) -> Vec<&str> {
        vec![SIGNATURE_HEADER]
    }

    fn verify(
        &self,
        req: &InboundRequest<'_>,
        secrets: &[Secret],
        _tolerance: Duration,
    ) -> Result<(), Rejection> {
        let value = signature_value(req.headers, SIGNATURE_HEADER)?.trim();
        let received = hex::decode(value).map_err(|_| malformed(SIGNATURE_HEADER, "is not hex"))?;

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
        // Razorpay always sends JSON; a body that is not JSON is refused even though the key
        // lives in a header.
        let [event_type] = top_level_strings(req.body, ["event"])?;
        let place = format!("header {EVENT_ID_HEADER}");
        let id = header_str(req.headers, EVENT_ID_HEADER).ok_or_else(|| Rejection::MissingKey {
            detail: place.clone(),
        })?;
        Ok(vec![ExtractedEvent {
            fingerprint: None,
            key: event_key(id, &place)?,
            event_type,
        }])
    }

    fn sign(&self, req: &SignRequest<'_>) -> Vec<(String, String)> {
        let mac = Mac256::compute(req.secret.expose(), &[req.body]);
        vec![
            (SIGNATURE_HEADER.to_owned(), mac.to_hex()),
            (EVENT_ID_HEADER.to_owned(), req.event_key.to_owned()),
        ]
    }

    /// 10 days: automatic retries run for 24 hours, but the dashboard replays events up to
    /// 7 days old (with the same event id), plus a margin.
    fn default_retention(&self) -> Duration {
        Duration::from_secs(10 * 24 * 3600)
    }
}

#[cfg(test)]
mod tests {
    use http::{HeaderMap, HeaderValue};
    use proptest::prelude::*;

    use super::*;
    use crate::provider::test_support::headers;
    use crate::time::Timestamp;

    const BODY: &[u8] = br#"{"entity":"event","account_id":"acc_BFQ7uQEaa7j2z7","event":"payment.captured","contains":["payment"],"payload":{},"created_at":1700000000}"#;
    const OLD: &str = "old webhook secret";
    const NEW: &str = "new webhook secret";
    const EVENT_ID: &str = "NbvYFkVVHt5Yjd";
    /// A base64 MAC, which Razorpay never sends.
    const STANDARD_B64: &str = "sczh6vMheJFX2ilDiCycL8Rx/rM0/LCk0iVV4+4U81I=";

    fn request<'a>(headers: &'a HeaderMap, body: &'a [u8]) -> InboundRequest<'a> {
        InboundRequest {
            path_and_query: "/in/test",
            headers,
            body,
            now: Timestamp::from_secs(1_700_000_000),
        }
    }

    fn sign(secret: &str, body: &[u8]) -> Vec<(String, String)> {
        let secret = Secret::from_text(secret);
        Razorpay.sign(&SignRequest {
            url: "http://127.0.0.1:8080/in/test",
            body,
            secret: &secret,
            now: Timestamp::from_secs(1_700_000_000),
            event_key: EVENT_ID,
            event_type: Some("payment.captured"),
        })
    }

    fn signature(secret: &str, body: &[u8]) -> String {
        sign(secret, body)[0].1.clone()
    }

    fn verify(header: Option<&str>, body: &[u8], secrets: &[&str]) -> Result<(), Rejection> {
        let headers = headers(header.map(|h| (SIGNATURE_HEADER, h)).as_slice());
        let secrets: Vec<Secret> = secrets.iter().map(|s| Secret::from_text(s)).collect();
        Razorpay.verify(&request(&headers, body), &secrets, Duration::ZERO)
    }

    #[track_caller]
    fn check(header: &str, body: &[u8], secrets: &[&str], expect: Result<(), &str>) {
        let got = verify(Some(header), body, secrets);
        assert_eq!(
            got.as_ref().map_err(Rejection::code).copied(),
            expect,
            "{got:?}"
        );
    }

    fn extract(event_id: Option<&str>, body: &[u8]) -> Result<Vec<ExtractedEvent>, Rejection> {
        let headers = headers(event_id.map(|id| (EVENT_ID_HEADER, id)).as_slice());
        Razorpay.extract(&request(&headers, body))
    }

    #[test]
    fn the_razorpay_node_vector_signs_and_verifies() {
        let body = br#"{"a":1,"b":2,"c":{"d":3}}"#;
        let expected = "2fe04e22977002e6c7cb553adab8b460cb9e2a4970d5953cb27a8472752e3bbc";
        assert_eq!(signature("123456", body), expected);
        check(expected, body, &["123456"], Ok(()));
    }

    #[test]
    fn a_signed_event_verifies_and_any_change_breaks_it() {
        let good = signature(NEW, BODY);
        check(&good, BODY, &[NEW], Ok(()));
        check(&good.to_uppercase(), BODY, &[NEW], Ok(()));
        check(&good, BODY, &[OLD], Err("invalid_signature"));
        let tampered = String::from_utf8_lossy(BODY).replace("captured", "failed");
        check(&good, tampered.as_bytes(), &[NEW], Err("invalid_signature"));
        check(&good, BODY, &[], Err("invalid_signature"));
    }

    #[test]
    fn a_missing_header_is_a_missing_signature() {
        assert_eq!(
            verify(None, BODY, &[NEW]),
            Err(Rejection::MissingSignature {
                header: "X-Razorpay-Signature".to_owned()
            })
        );
    }

    #[test]
    fn a_value_that_is_not_bare_hex_is_malformed() {
        let good = signature(NEW, BODY);
        for header in [
            format!("sha256={good}"),
            "xyz".to_owned(),
            good[..63].to_owned(),
            STANDARD_B64.to_owned(),
        ] {
            check(&header, BODY, &[NEW], Err("malformed_signature"));
        }
        check("", BODY, &[NEW], Err("invalid_signature"));
    }

    #[test]
    fn rotation_accepts_the_old_secret_for_retries_and_the_new_for_replays() {
        check(&signature(OLD, BODY), BODY, &[OLD, NEW], Ok(()));
        check(&signature(NEW, BODY), BODY, &[OLD, NEW], Ok(()));
        check(&signature(NEW, BODY), BODY, &[NEW, OLD], Ok(()));
        check(
            &signature(OLD, BODY),
            BODY,
            &[NEW],
            Err("invalid_signature"),
        );
    }

    #[test]
    fn the_key_is_the_event_id_header_and_the_type_the_body_event() {
        let events = extract(Some(EVENT_ID), BODY).unwrap();
        assert_eq!(events.len(), 1);
        assert_eq!(events[0].key.as_str(), EVENT_ID);
        assert_eq!(events[0].event_type.as_deref(), Some("payment.captured"));

        let untyped = extract(Some(EVENT_ID), br#"{"entity":"event"}"#).unwrap();
        assert_eq!(untyped[0].event_type, None);
    }

    #[test]
    fn a_missing_or_blank_event_id_is_a_missing_key() {
        assert_eq!(
            extract(None, BODY),
            Err(Rejection::MissingKey {
                detail: "header x-razorpay-event-id".to_owned()
            })
        );
        assert_eq!(
            extract(Some(" "), BODY).map_err(|r| r.code()),
            Err("missing_event_key")
        );
    }

    #[test]
    fn a_body_that_is_not_json_is_invalid_json() {
        assert_eq!(
            extract(Some(EVENT_ID), b"event=payment.captured").map_err(|r| r.code()),
            Err("invalid_json")
        );
    }

    #[test]
    fn signing_sets_the_event_id_and_round_trips() {
        let signed = sign(NEW, BODY);
        let names: Vec<&str> = signed.iter().map(|(name, _)| name.as_str()).collect();
        assert_eq!(names, [SIGNATURE_HEADER, EVENT_ID_HEADER]);
        let pairs: Vec<(&str, &str)> = signed
            .iter()
            .map(|(n, v)| (n.as_str(), v.as_str()))
            .collect();
        let headers = headers(&pairs);
        let req = request(&headers, BODY);
        assert_eq!(
            Razorpay.verify(&req, &[Secret::from_text(NEW)], Duration::ZERO),
            Ok(())
        );
        assert_eq!(Razorpay.extract(&req).unwrap()[0].key.as_str(), EVENT_ID);
    }

    #[test]
    fn retention_outlives_the_seven_day_dashboard_replay() {
        assert!(Razorpay.default_retention() > Duration::from_secs(7 * 86_400));
    }

    proptest! {
        #[test]
        fn arbitrary_headers_and_bodies_never_panic(
            header in "[ -~]{0,100}",
            body in proptest::collection::vec(any::<u8>(), 0..64),
            event_id in proptest::option::of("[ -~]{0,40}"),
        ) {
            let _ = verify(Some(&header), &body, &[NEW, OLD]);
            let _ = extract(event_id.as_deref(), &body);
        }

        #[test]
        fn non_ascii_header_bytes_are_malformed(
            bytes in proptest::collection::vec(0x80u8..=0xff, 1..32),
        ) {
            let mut headers = HeaderMap::new();
            headers.insert(SIGNATURE_HEADER, HeaderValue::from_bytes(&bytes).unwrap());
            let got = Razorpay.verify(&request(&headers, BODY), &[Secret::from_text(NEW)], Duration::ZERO);
            prop_assert_eq!(got.map_err(|r| r.code()), Err("malformed_signature"));
        }

        #[test]
        fn arbitrary_signature_bytes_never_verify(
            sig in proptest::collection::vec(any::<u8>(), 0..64),
        ) {
            prop_assert_eq!(
                verify(Some(&hex::encode(&sig)), BODY, &[NEW, OLD]),
                Err(Rejection::InvalidSignature)
            );
        }
    }
}
