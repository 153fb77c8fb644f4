//! Paddle Billing: `Paddle-Signature: ts=<unix>;h1=<hex>[;h1=<hex>…]` is a semicolon list; each
//! `h1` is a hex HMAC-SHA256 over `{ts}:{raw body}`, keyed by the notification destination's
//! secret. The event key is the body's `event_id` (`evt_…`), the event type its `event_type`.
//!
//! Every `h1` is checked (paddle-node-sdk keeps only the last one it parses, which breaks
//! rotation); other schemes (`h2`, …) are ignored. The timestamp must be within the source's
//! tolerance in both directions. Paddle's SDK allows only 5 seconds; that is not hard-coded
//! here, the source's tolerance (300 s by default) applies.
//!
//! `notification_id` (`ntf_…`) is per destination; `event_id` is the same for every
//! destination and every retry, so it is the dedup key within one source.

use std::time::Duration;

use crate::provider::fields::top_level_strings;
use crate::provider::{
    check_tolerance, event_key, malformed, signature_value, ExtractedEvent, InboundRequest,
    ProviderAdapter, Rejection, SignRequest,
};
use crate::secret::{Mac256, Secret};

const SIGNATURE_HEADER: &str = "Paddle-Signature";
const KEY_FIELD: &str = "body field `event_id`";

/// Paddle Billing's webhook scheme (`provider = "paddle"`).
#[derive(Debug, Clone, Copy, Default)]
pub struct Paddle;

/// The parts of a `Paddle-Signature` header that matter.
struct SignatureHeader<'a> {
    /// The `ts` value exactly as sent: it is part of the signed bytes.
    timestamp_text: &'a str,
    timestamp_secs: i64,
    h1: Vec<&'a str>,
}

impl ProviderAdapter for Paddle {
    fn provider(&self) -> &'static str {
        "paddle"
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

        // An `h1` that is not hex matches nothing; another `h1` may still match.
        let received: Vec<Vec<u8>> = header
            .h1
            .iter()
            .filter_map(|sig| hex::decode(sig).ok())
            .collect();
        let matched = secrets.iter().any(|secret| {
            let expected = Mac256::compute(
                secret.expose(),
                &[header.timestamp_text.as_bytes(), b":", req.body],
            );
            received.iter().any(|sig| expected.matches(sig))
        });
        if !matched {
            return Err(Rejection::InvalidSignature);
        }
        check_tolerance(header.timestamp_secs, req.now, tolerance)
    }

    fn extract(&self, req: &InboundRequest<'_>) -> Result<Vec<ExtractedEvent>, Rejection> {
        let [id, event_type] = top_level_strings(req.body, ["event_id", "event_type"])?;
        let id = id.ok_or_else(|| Rejection::MissingKey {
            detail: KEY_FIELD.to_owned(),
        })?;
        Ok(vec![ExtractedEvent {
            fingerprint: fingerprint(req.body),
            key: event_key(&id, KEY_FIELD)?,
            event_type,
        }])
    }

    fn sign(&self, req: &SignRequest<'_>) -> Vec<(String, String)> {
        let timestamp = req.now.as_secs().to_string();
        let mac = Mac256::compute(req.secret.expose(), &[timestamp.as_bytes(), b":", req.body]);
        vec![(
            SIGNATURE_HEADER.to_owned(),
            format!("ts={timestamp};h1={}", mac.to_hex()),
        )]
    }

    /// 7 days: live retries run for 3 days (60 attempts) and replays go through the API, so
    /// the minimum retention covers them with a margin.
    fn default_retention(&self) -> Duration {
        Duration::from_secs(7 * 24 * 3600)
    }
}

/// Splits `ts=…;h1=…;h1=…;h2=…` into the timestamp and the `h1` signatures. Items without `=`
/// and schemes other than `ts` and `h1` are ignored.
fn parse_header(value: &str) -> Result<SignatureHeader<'_>, Rejection> {
    // Stripe's syntax, easy to carry over when writing a sender by hand.
    if value.contains(',') && !value.contains(';') {
        return Err(malformed(
            SIGNATURE_HEADER,
            "separates its items with `,`: Paddle's are separated by `;` (ts=…;h1=…)",
        ));
    }
    let mut timestamp_text = None;
    let mut h1 = Vec::new();
    for (key, val) in value
        .split(';')
        .filter_map(|item| item.trim().split_once('='))
    {
        match key {
            "ts" if timestamp_text.is_some() => {
                return Err(malformed(SIGNATURE_HEADER, "has more than one `ts`"))
            }
            "ts" => timestamp_text = Some(val),
            "h1" => h1.push(val),
            _ => {}
        }
    }
    let timestamp_text =
        timestamp_text.ok_or_else(|| malformed(SIGNATURE_HEADER, "has no `ts` timestamp"))?;
    let timestamp_secs = timestamp_text
        .parse::<i64>()
        .map_err(|_| malformed(SIGNATURE_HEADER, "has a `ts` that is not an integer"))?;
    if h1.is_empty() {
        return Err(malformed(SIGNATURE_HEADER, "has no `h1` signature"));
    }
    Ok(SignatureHeader {
        timestamp_text,
        timestamp_secs,
        h1,
    })
}

/// The event without its notification: one `event_id` is notified once per destination (and
/// again by a replay), each time with its own `notification_id`, so those copies are
/// duplicates of one event, not conflicts. `None` (the body's hash) for a body that is not a
/// JSON object.
fn fingerprint(body: &[u8]) -> Option<[u8; 32]> {
    let mut event = serde_json::from_slice::<serde_json::Value>(body).ok()?;
    event.as_object_mut()?.remove("notification_id");
    let canonical = serde_json::to_vec(&event).expect("a JSON value serializes");
    Some(crate::secret::sha256(&canonical))
}

#[cfg(test)]
mod tests {
    use http::{HeaderMap, HeaderValue};
    use proptest::prelude::*;

    use super::*;
    use crate::time::Timestamp;

    const NOW: i64 = 1_700_000_000;
    const TOLERANCE: Duration = Duration::from_secs(300);
    const BODY: &[u8] = br#"{"event_id":"evt_01hv8wptq8987qeep44cyrewp9","event_type":"transaction.completed","occurred_at":"2023-11-14T22:13:20.000000Z","notification_id":"ntf_01hv8wpts6hdzsn7dn8ezdpyr0","data":{}}"#;
    const OLD: &str = "pdl_ntfset_old_secret";
    const NEW: &str = "pdl_ntfset_new_secret";

    /// One event notified to two destinations (or replayed) differs only in its
    /// `notification_id`: the same fingerprint, so the second is a duplicate, not a conflict.
    /// Any other difference is another fingerprint.
    #[test]
    fn notifications_of_one_event_share_a_fingerprint() {
        let of = |body: &[u8]| {
            let headers = HeaderMap::new();
            let req = InboundRequest {
                path_and_query: "/in/paddle",
                headers: &headers,
                body,
                now: Timestamp::from_secs(NOW),
            };
            Paddle.extract(&req).expect("an event")[0].fingerprint
        };
        let other_notification = String::from_utf8(BODY.to_vec()).unwrap().replace(
            "ntf_01hv8wpts6hdzsn7dn8ezdpyr0",
            "ntf_01hv8wpts6hdzsn7dn8ezdpyr1",
        );
        let first = of(BODY);
        assert!(first.is_some());
        assert_eq!(of(other_notification.as_bytes()), first);
        let other_data = String::from_utf8(BODY.to_vec())
            .unwrap()
            .replace(r#""data":{}"#, r#""data":{"amount":1}"#);
        assert_ne!(of(other_data.as_bytes()), first);
    }

    /// The `Paddle-Signature` value Paddle would send for `body`, signed at `signed_at`.
    fn signature(secret: &str, signed_at: i64, body: &[u8]) -> String {
        let secret = Secret::from_text(secret);
        let headers = Paddle.sign(&SignRequest {
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

    /// The `h1` hex of a signature value.
    fn h1_of(signature: &str) -> &str {
        signature
            .split_once(";h1=")
            .expect("signed by Paddle::sign")
            .1
    }

    fn verify_at(
        now: i64,
        header: Option<&str>,
        body: &[u8],
        secrets: &[&str],
    ) -> Result<(), Rejection> {
        let mut headers = HeaderMap::new();
        if let Some(value) = header {
            headers.insert(SIGNATURE_HEADER, HeaderValue::from_str(value).unwrap());
        }
        let secrets: Vec<Secret> = secrets.iter().map(|s| Secret::from_text(s)).collect();
        let req = InboundRequest {
            path_and_query: "/in/test",
            headers: &headers,
            body,
            now: Timestamp::from_secs(now),
        };
        Paddle.verify(&req, &secrets, TOLERANCE)
    }

    fn verify(header: Option<&str>, body: &[u8], secrets: &[&str]) -> Result<(), Rejection> {
        verify_at(NOW, header, body, secrets)
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
        Paddle.extract(&InboundRequest {
            path_and_query: "/in/test",
            headers: &headers,
            body,
            now: Timestamp::from_secs(NOW),
        })
    }

    #[test]
    fn the_paddle_node_sdk_vector_signs_and_verifies_at_its_timestamp() {
        let body = br#"{"data": ["1", "2"]}"#;
        let header =
            "ts=1698796800;h1=a300428748dce5c70e4da19bffd60769591ea969c99dea3105d0ec9612cf43f9";
        assert_eq!(signature("VALID_SECRET", 1_698_796_800, body), header);
        assert_eq!(
            verify_at(1_698_796_800, Some(header), body, &["VALID_SECRET"]),
            Ok(())
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
        let tampered = String::from_utf8_lossy(BODY).replace("completed", "canceled");
        check(
            &signature(NEW, NOW, BODY),
            tampered.as_bytes(),
            &[NEW],
            Err("invalid_signature"),
        );
        // The signature covers `ts`: a replay with a fresh `ts` does not verify.
        let replayed = format!("ts={NOW};h1={}", h1_of(&signature(NEW, NOW - 1000, BODY)));
        check(&replayed, BODY, &[NEW], Err("invalid_signature"));
        check(
            &signature(NEW, NOW, BODY),
            BODY,
            &[],
            Err("invalid_signature"),
        );
    }

    #[test]
    fn a_missing_header_is_a_missing_signature() {
        assert_eq!(
            verify(None, BODY, &[NEW]),
            Err(Rejection::MissingSignature {
                header: "Paddle-Signature".to_owned()
            })
        );
    }

    #[test]
    fn headers_without_one_integer_ts_or_any_h1_are_malformed() {
        let h1 = h1_of(&signature(NEW, NOW, BODY)).to_owned();
        for header in [
            String::new(),
            "garbage".to_owned(),
            format!("h1={h1}"),
            format!("ts=;h1={h1}"),
            format!("ts=yesterday;h1={h1}"),
            format!("ts={NOW};ts={NOW};h1={h1}"),
            format!("ts={NOW}"),
            format!("ts={NOW};h2={h1}"),
            // Stripe's comma syntax is not Paddle's.
            format!("ts={NOW},h1={h1}"),
        ] {
            check(&header, BODY, &[NEW], Err("malformed_signature"));
        }
    }

    /// Stripe's comma syntax gets a message that says so, not "a `ts` that is not an integer".
    #[test]
    fn a_header_in_stripes_syntax_is_told_the_separator() {
        let h1 = h1_of(&signature(NEW, NOW, BODY)).to_owned();
        let got = verify(Some(&format!("ts={NOW},h1={h1}")), BODY, &[NEW]);
        let message = got.expect_err("malformed").message();
        assert!(message.contains("separated by `;`"), "{message}");
        assert!(!message.contains(&h1), "{message}");
    }

    #[test]
    fn a_malformed_detail_never_echoes_the_signature() {
        let header = format!("ts=soon;h1={}", h1_of(&signature(NEW, NOW, BODY)));
        let Err(Rejection::MalformedSignature { detail }) = verify(Some(&header), BODY, &[NEW])
        else {
            panic!("expected a malformed signature");
        };
        assert!(
            !detail.contains("soon") && !detail.contains(h1_of(&header)),
            "{detail}"
        );
    }

    #[test]
    fn every_h1_is_checked_not_only_the_last() {
        let old = signature(OLD, NOW, BODY);
        let new_h1 = h1_of(&signature(NEW, NOW, BODY)).to_owned();
        let both = format!("{old};h1={new_h1}");
        // The matching `h1` first, then one that does not match (the SDK would keep the last).
        check(&both, BODY, &[OLD], Ok(()));
        check(&both, BODY, &[NEW], Ok(()));
        // An `h2` and a non-hex `h1` are skipped without hiding a good one.
        check(&format!("{both};h2=00;h1=zz"), BODY, &[OLD], Ok(()));
        check(
            &format!("ts={NOW};h1=zz"),
            BODY,
            &[NEW],
            Err("invalid_signature"),
        );
    }

    #[test]
    fn uppercase_hex_and_spaces_between_items_are_accepted() {
        let h1 = h1_of(&signature(NEW, NOW, BODY)).to_uppercase();
        check(&format!("ts={NOW}; h1={h1}"), BODY, &[NEW], Ok(()));
        check(&format!("h1={h1};ts={NOW}"), BODY, &[NEW], Ok(()));
    }

    #[test]
    fn rotation_accepts_any_configured_secret() {
        check(&signature(OLD, NOW, BODY), BODY, &[OLD, NEW], Ok(()));
        check(&signature(NEW, NOW, BODY), BODY, &[OLD, NEW], Ok(()));
        check(
            &signature(OLD, NOW, BODY),
            BODY,
            &[NEW],
            Err("invalid_signature"),
        );
    }

    #[test]
    fn timestamps_within_the_source_tolerance_pass_in_both_directions() {
        // Far beyond the SDK's 5 s: the source's tolerance applies.
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
    fn the_key_is_the_body_event_id_and_the_type_the_event_type() {
        let events = extract(BODY).unwrap();
        assert_eq!(events.len(), 1);
        assert_eq!(events[0].key.as_str(), "evt_01hv8wptq8987qeep44cyrewp9");
        assert_eq!(
            events[0].event_type.as_deref(),
            Some("transaction.completed")
        );

        let untyped = extract(br#"{"event_id":"evt_2"}"#).unwrap();
        assert_eq!(untyped[0].event_type, None);
    }

    #[test]
    fn a_missing_or_unusable_event_id_is_a_missing_key() {
        let missing = Err(Rejection::MissingKey {
            detail: "body field `event_id`".to_owned(),
        });
        // `notification_id` is per destination and never stands in for the event id.
        assert_eq!(
            extract(br#"{"notification_id":"ntf_1","event_type":"transaction.completed"}"#),
            missing
        );
        assert_eq!(extract(br#"{"event_id":42}"#), missing);
        assert_eq!(extract(b"[]"), missing);
        assert_eq!(
            extract(br#"{"event_id":""}"#).map_err(|r| r.code()),
            Err("missing_event_key")
        );
    }

    #[test]
    fn a_body_that_is_not_json_is_invalid_json() {
        assert_eq!(
            extract(b"event_id=evt_1").map_err(|r| r.code()),
            Err("invalid_json")
        );
    }

    proptest! {
        #[test]
        fn arbitrary_headers_and_bodies_never_panic(
            header in prop_oneof![
                "[ -~]{0,120}",
                "(ts=-?[0-9]{0,20}|h1=[0-9a-fA-F]{0,66}|h2=[0-9a-f]{0,4}|[a-z0-9=]{0,8})(;(ts=[0-9]{0,12}|h1=[0-9a-f]{0,66}|[ -~]{0,6})){0,5}",
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
            let got = Paddle.verify(&req, &[Secret::from_text(NEW)], TOLERANCE);
            prop_assert_eq!(got.map_err(|r| r.code()), Err("malformed_signature"));
        }

        #[test]
        fn arbitrary_signature_bytes_never_verify(
            sigs in proptest::collection::vec(proptest::collection::vec(any::<u8>(), 0..64), 1..4),
        ) {
            let h1s: Vec<String> = sigs.iter().map(|sig| format!("h1={}", hex::encode(sig))).collect();
            let header = format!("ts={NOW};{}", h1s.join(";"));
            prop_assert_eq!(verify(Some(&header), BODY, &[NEW, OLD]), Err(Rejection::InvalidSignature));
        }
    }
}
