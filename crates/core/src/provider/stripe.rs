//! Stripe: `Stripe-Signature: t=…,v1=…` is a hex HMAC-SHA256 over `{t}.{body}`, keyed by the
//! endpoint secret used verbatim (`whsec_` prefix included, no base64 decoding). The event key
//! is the body's top-level `id` (`evt_…`).
//!
//! Only `v1` is read; `v0` and unknown schemes are ignored (downgrade protection). Rotation
//! works because Stripe sends one `v1` per active secret and any match is enough.

use std::time::Duration;

use crate::provider::fields::top_level_strings;
use crate::provider::{
    check_tolerance, event_key, malformed, signature_value, ExtractedEvent, InboundRequest,
    ProviderAdapter, Rejection, SignRequest,
};
use crate::secret::{Mac256, Secret};

const SIGNATURE_HEADER: &str = "Stripe-Signature";
const KEY_FIELD: &str = "body field `id`";

/// Stripe's webhook scheme (`provider = "stripe"`).
#[derive(Debug, Clone, Copy, Default)]
pub struct Stripe;

/// The parts of a `Stripe-Signature` header that matter.
struct SignatureHeader<'a> {
    /// The `t` value exactly as sent: it is part of the signed bytes.
    timestamp_text: &'a str,
    timestamp_secs: i64,
    v1: Vec<&'a str>,
}

impl ProviderAdapter for Stripe {
    fn provider(&self) -> &'static str {
        "stripe"
    }

    fn signature_headers(&self) -> Vec<&str> {
        vec![SIGNATURE_HEADER]
    }

    fn verify(
        &self,
        req: &InboundRequest<'_>,
        secrets: &[Secret],
        tolerance: Duration,
    ) -> Result<(), Rejection> {
        let value = signature_value(req.headers, SIGNATURE_HEADER)?;
        let header = parse_header(value)?;

        // A `v1` that is not hex simply matches nothing; another `v1` may still match.
        let received: Vec<Vec<u8>> = header
            .v1
            .iter()
            .filter_map(|sig| hex::decode(sig).ok())
            .collect();
        let matched = secrets.iter().any(|secret| {
            let expected = Mac256::compute(
                secret.expose(),
                &[header.timestamp_text.as_bytes(), b".", req.body],
            );
            received.iter().any(|sig| expected.matches(sig))
        });
        if !matched {
            return Err(Rejection::InvalidSignature);
        }
        check_tolerance(header.timestamp_secs, req.now, tolerance)
    }

    fn extract(&self, req: &InboundRequest<'_>) -> Result<Vec<ExtractedEvent>, Rejection> {
        let [id, event_type] = top_level_strings(req.body, ["id", "type"])?;
        let id = id.ok_or_else(|| Rejection::MissingKey {
            detail: KEY_FIELD.to_owned(),
        })?;
        Ok(vec![ExtractedEvent {
            fingerprint: None,
            key: event_key(&id, KEY_FIELD)?,
            event_type,
        }])
    }

    fn sign(&self, req: &SignRequest<'_>) -> Vec<(String, String)> {
        let timestamp = req.now.as_secs().to_string();
        let mac = Mac256::compute(req.secret.expose(), &[timestamp.as_bytes(), b".", req.body]);
        vec![(
            SIGNATURE_HEADER.to_owned(),
            format!("t={timestamp},v1={}", mac.to_hex()),
        )]
    }

    /// 35 days: the Stripe CLI resends an event for up to 30 days (the Dashboard 15, automatic
    /// retries 3), plus a margin.
    fn default_retention(&self) -> Duration {
        Duration::from_secs(35 * 24 * 3600)
    }
}

/// Splits `t=…,v1=…,v0=…` into the timestamp and the `v1` signatures. Items without `=` and
/// schemes other than `t` and `v1` are ignored.
fn parse_header(value: &str) -> Result<SignatureHeader<'_>, Rejection> {
    let mut timestamp_text = None;
    let mut v1 = Vec::new();
    for (key, val) in value
        .split(',')
        .filter_map(|item| item.trim().split_once('='))
    {
        match key {
            "t" if timestamp_text.is_some() => {
                return Err(malformed(SIGNATURE_HEADER, "has more than one `t`"))
            }
            "t" => timestamp_text = Some(val),
            "v1" => v1.push(val),
            _ => {}
        }
    }
    let timestamp_text =
        timestamp_text.ok_or_else(|| malformed(SIGNATURE_HEADER, "has no `t` timestamp"))?;
    let timestamp_secs = timestamp_text
        .parse::<i64>()
        .map_err(|_| malformed(SIGNATURE_HEADER, "has a `t` that is not an integer"))?;
    if v1.is_empty() {
        return Err(malformed(SIGNATURE_HEADER, "has no `v1` signature"));
    }
    Ok(SignatureHeader {
        timestamp_text,
        timestamp_secs,
        v1,
    })
}

#[cfg(test)]
mod tests {
    use http::{HeaderMap, HeaderValue};
    use proptest::prelude::*;

    use super::*;
    use crate::time::Timestamp;

    const NOW: i64 = 1_700_000_000;
    const TOLERANCE: Duration = Duration::from_secs(300);
    const BODY: &[u8] = br#"{"id":"evt_1","type":"invoice.paid"}"#;
    const OLD: &str = "whsec_old";
    const NEW: &str = "whsec_new";

    /// The `Stripe-Signature` value Stripe would send for `body`, signed at `signed_at`.
    fn signature(secret: &str, signed_at: i64, body: &[u8]) -> String {
        let secret = Secret::from_text(secret);
        let headers = Stripe.sign(&SignRequest {
            url: "http://127.0.0.1:8080/in/test",
            body,
            secret: &secret,
            now: Timestamp::from_secs(signed_at),
            event_key: "evt_1",
            event_type: None,
        });
        assert_eq!(headers.len(), 1);
        assert_eq!(headers[0].0, SIGNATURE_HEADER);
        headers[0].1.clone()
    }

    /// The `v1` hex of a signature value.
    fn v1_of(signature: &str) -> &str {
        signature
            .split_once(",v1=")
            .expect("signed by Stripe::sign")
            .1
    }

    fn verify(header: Option<&str>, body: &[u8], secrets: &[&str]) -> Result<(), Rejection> {
        let mut headers = HeaderMap::new();
        if let Some(value) = header {
            headers.insert(SIGNATURE_HEADER, HeaderValue::from_str(value).unwrap());
        }
        let secrets: Vec<Secret> = secrets.iter().map(|s| Secret::from_text(s)).collect();
        let req = InboundRequest {
            path_and_query: "/in/test",
            headers: &headers,
            body,
            now: Timestamp::from_secs(NOW),
        };
        Stripe.verify(&req, &secrets, TOLERANCE)
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

    fn extract(body: &[u8]) -> Result<Vec<ExtractedEvent>, Rejection> {
        let headers = HeaderMap::new();
        Stripe.extract(&InboundRequest {
            path_and_query: "/in/test",
            headers: &headers,
            body,
            now: Timestamp::from_secs(NOW),
        })
    }

    #[test]
    fn signing_uses_the_whole_secret_as_utf8() {
        // Computed independently (Python hmac) with the `whsec_` prefix kept as key bytes.
        let body = br#"{"id":"evt_test","type":"charge.succeeded"}"#;
        assert_eq!(
            signature("whsec_test_secret", 1_492_774_577, body),
            "t=1492774577,v1=a20c03e4b5610ebe700b6165721191b3c53ed14fde1ad65a5371f189eae89927"
        );
    }

    #[test]
    fn a_signed_event_verifies() {
        check(&signature(NEW, NOW, BODY), BODY, &[NEW], Ok(()));
    }

    #[test]
    fn a_wrong_secret_or_tampered_body_is_an_invalid_signature() {
        check(
            &signature(NEW, NOW, BODY),
            BODY,
            &[OLD],
            Err("invalid_signature"),
        );
        let tampered = br#"{"id":"evt_2","type":"invoice.paid"}"#;
        check(
            &signature(NEW, NOW, BODY),
            tampered,
            &[NEW],
            Err("invalid_signature"),
        );
        // The signature covers `t`: a replay with a fresh `t` does not verify.
        let replayed =
            signature(NEW, NOW - 1000, BODY).replace(&(NOW - 1000).to_string(), &NOW.to_string());
        check(&replayed, BODY, &[NEW], Err("invalid_signature"));
    }

    #[test]
    fn a_missing_header_is_a_missing_signature() {
        assert_eq!(
            verify(None, BODY, &[NEW]),
            Err(Rejection::MissingSignature {
                header: "Stripe-Signature".to_owned()
            })
        );
    }

    #[test]
    fn headers_without_one_integer_t_or_any_v1_are_malformed() {
        let v1 = v1_of(&signature(NEW, NOW, BODY)).to_owned();
        for header in [
            String::new(),
            "garbage".to_owned(),
            format!("v1={v1}"),
            format!("t=,v1={v1}"),
            format!("t=yesterday,v1={v1}"),
            format!("t={NOW},t={NOW},v1={v1}"),
            format!("t={NOW}"),
            format!("t={NOW},v2={v1}"),
        ] {
            check(&header, BODY, &[NEW], Err("malformed_signature"));
        }
    }

    #[test]
    fn a_malformed_detail_never_echoes_the_signature() {
        let header = format!("t=soon,v1={}", v1_of(&signature(NEW, NOW, BODY)));
        let Err(Rejection::MalformedSignature { detail }) = verify(Some(&header), BODY, &[NEW])
        else {
            panic!("expected a malformed signature");
        };
        assert!(
            !detail.contains("soon") && !detail.contains(v1_of(&header)),
            "{detail}"
        );
    }

    #[test]
    fn a_v0_only_header_is_not_accepted() {
        let v0 = v1_of(&signature(NEW, NOW, BODY)).to_owned();
        check(
            &format!("t={NOW},v0={v0}"),
            BODY,
            &[NEW],
            Err("malformed_signature"),
        );
    }

    #[test]
    fn a_v1_that_is_not_hex_does_not_hide_a_good_one() {
        let good = signature(NEW, NOW, BODY);
        check(&format!("{good},v1=zz"), BODY, &[NEW], Ok(()));
        check(
            &format!("t={NOW},v1=zz"),
            BODY,
            &[NEW],
            Err("invalid_signature"),
        );
    }

    #[test]
    fn uppercase_hex_and_spaces_between_items_are_accepted() {
        let good = signature(NEW, NOW, BODY);
        let v1 = v1_of(&good).to_uppercase();
        check(&format!("t={NOW}, v0=00, v1={v1}"), BODY, &[NEW], Ok(()));
    }

    #[test]
    fn rotation_accepts_any_configured_secret_and_any_v1() {
        let old = signature(OLD, NOW, BODY);
        let new = signature(NEW, NOW, BODY);
        check(&old, BODY, &[OLD, NEW], Ok(()));
        check(&new, BODY, &[OLD, NEW], Ok(()));

        let both = format!("{old},v1={}", v1_of(&new));
        check(&both, BODY, &[NEW], Ok(()));
        check(&both, BODY, &[OLD], Ok(()));

        // Once the old secret is removed, a signature made only with it fails.
        check(&old, BODY, &[NEW], Err("invalid_signature"));
    }

    #[test]
    fn timestamps_within_the_tolerance_pass_in_both_directions() {
        check(&signature(NEW, NOW - 299, BODY), BODY, &[NEW], Ok(()));
        check(&signature(NEW, NOW + 299, BODY), BODY, &[NEW], Ok(()));
        for skew_secs in [-301, 301] {
            assert_eq!(
                verify(Some(&signature(NEW, NOW + skew_secs, BODY)), BODY, &[NEW]),
                Err(Rejection::StaleTimestamp {
                    skew_secs,
                    tolerance_secs: 300
                })
            );
        }
    }

    #[test]
    fn the_signature_is_checked_before_the_timestamp() {
        check(
            &signature(OLD, NOW - 1000, BODY),
            BODY,
            &[NEW],
            Err("invalid_signature"),
        );
    }

    #[test]
    fn the_key_is_the_body_id_and_the_type_is_the_body_type() {
        let events = extract(BODY).unwrap();
        assert_eq!(events.len(), 1);
        assert_eq!(events[0].key.as_str(), "evt_1");
        assert_eq!(events[0].event_type.as_deref(), Some("invoice.paid"));

        let untyped = extract(br#"{"id":"evt_2"}"#).unwrap();
        assert_eq!(untyped[0].event_type, None);
    }

    #[test]
    fn a_missing_or_unusable_id_is_a_missing_key() {
        let missing = Err(Rejection::MissingKey {
            detail: "body field `id`".to_owned(),
        });
        assert_eq!(extract(br#"{"type":"invoice.paid"}"#), missing);
        assert_eq!(extract(br#"{"id":42}"#), missing);
        assert_eq!(extract(b"[]"), missing);
        assert_eq!(
            extract(br#"{"id":"  "}"#).map_err(|r| r.code()),
            Err("missing_event_key")
        );
    }

    #[test]
    fn a_body_that_is_not_json_is_invalid_json() {
        assert_eq!(
            extract(b"id=evt_1").map_err(|r| r.code()),
            Err("invalid_json")
        );
    }

    proptest! {
        #[test]
        fn arbitrary_headers_and_bodies_never_panic(
            header in prop_oneof![
                "[ -~]{0,120}",
                "(t=-?[0-9]{0,20}|v1=[0-9a-fA-F]{0,66}|v0=[0-9a-f]{0,4}|[a-z0-9=]{0,8})(,(t=[0-9]{0,12}|v1=[0-9a-f]{0,66}|[ -~]{0,6})){0,5}",
            ],
            body in proptest::collection::vec(any::<u8>(), 0..64),
        ) {
            let _ = verify(Some(&header), &body, &[NEW, OLD]);
            let _ = extract(&body);
        }

        #[test]
        fn non_ascii_header_bytes_are_malformed(
            bytes in proptest::collection::vec(0x80u8..=0xff, 1..32),
        ) {
            let mut headers = HeaderMap::new();
            headers.insert(SIGNATURE_HEADER, HeaderValue::from_bytes(&bytes).unwrap());
            let req = InboundRequest { path_and_query: "/in/test", headers: &headers, body: BODY, now: Timestamp::from_secs(NOW) };
            let got = Stripe.verify(&req, &[Secret::from_text(NEW)], TOLERANCE);
            prop_assert_eq!(got.map_err(|r| r.code()), Err("malformed_signature"));
        }

        #[test]
        fn arbitrary_signature_bytes_never_verify(
            sig in proptest::collection::vec(any::<u8>(), 0..64),
        ) {
            let header = format!("t={NOW},v1={}", hex::encode(&sig));
            prop_assert_eq!(verify(Some(&header), BODY, &[NEW]), Err(Rejection::InvalidSignature));
        }
    }
}
