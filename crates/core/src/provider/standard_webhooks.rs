//! Standard Webhooks (and Svix): `webhook-signature: v1,<base64> v1,<base64>` is a
//! space-separated list of HMAC-SHA256 signatures over `{id}.{timestamp}.{body}`. The key is
//! the `whsec_…` secret with the prefix stripped and the rest base64-decoded (unlike Stripe).
//! The event key is the `webhook-id` header, which stays the same across retries.
//!
//! Svix sends `svix-*` header names; like its libraries, they are read first when
//! `svix-signature` is present. [`decode_secret`] and [`sign_v1`] are public so hooklatch can
//! sign its own outgoing deliveries with the same scheme.

use std::time::Duration;

use base64::engine::general_purpose::{STANDARD, STANDARD_NO_PAD};
use base64::Engine;
use http::HeaderMap;

use crate::provider::{
    check_tolerance, event_key, header_str, ExtractedEvent, InboundRequest, ProviderAdapter,
    Rejection, SignRequest,
};
use crate::secret::{Mac256, Secret};

/// The Standard Webhooks scheme (`provider = "standard-webhooks"`).
#[derive(Debug, Clone, Copy, Default)]
pub struct StandardWebhooks;

/// The key bytes of a Standard Webhooks secret.
///
/// `whsec_<base64>` decodes the part after the prefix, padded or not (standardwebhooks'
/// Python library pads before decoding, so a secret issued without its `=` works there);
/// `None` if it is not standard base64, so such a secret never matches. A bare secret that
/// is valid (padded) standard base64 is decoded too; anything else is used as raw bytes.
pub fn decode_secret(secret: &Secret) -> Option<Vec<u8>> {
    let Some(text) = secret.expose_text() else {
        return Some(secret.expose().to_vec());
    };
    match text.strip_prefix("whsec_") {
        Some(encoded) => STANDARD
            .decode(encoded)
            .or_else(|_| STANDARD_NO_PAD.decode(encoded))
            .ok(),
        None => Some(
            STANDARD
                .decode(text)
                .unwrap_or_else(|_| secret.expose().to_vec()),
        ),
    }
}

/// The `v1,<base64>` signature of a message under already decoded key bytes.
pub fn sign_v1(key: &[u8], msg_id: &str, timestamp_secs: i64, body: &[u8]) -> String {
    format!("v1,{}", mac(key, msg_id, timestamp_secs, body).to_base64())
}

/// The header names one delivery uses: `svix-*` or `webhook-*`.
struct HeaderNames {
    id: &'static str,
    timestamp: &'static str,
    signature: &'static str,
}

const WEBHOOK_HEADERS: HeaderNames = HeaderNames {
    id: "webhook-id",
    timestamp: "webhook-timestamp",
    signature: "webhook-signature",
};

const SVIX_HEADERS: HeaderNames = HeaderNames {
    id: "svix-id",
    timestamp: "svix-timestamp",
    signature: "svix-signature",
};

impl HeaderNames {
    fn of(headers: &HeaderMap) -> &'static HeaderNames {
        if headers.contains_key(SVIX_HEADERS.signature) {
            &SVIX_HEADERS
        } else {
            &WEBHOOK_HEADERS
        }
    }
}

impl ProviderAdapter for StandardWebhooks {
    fn provider(&self) -> &'static str {
        "standard-webhooks"
    }

    fn signature_headers(&self) -> Vec<&str> {
        vec![WEBHOOK_HEADERS.signature, SVIX_HEADERS.signature]
    }

    fn verify(
        &self,
        req: &InboundRequest<'_>,
        secrets: &[Secret],
        tolerance: Duration,
    ) -> Result<(), Rejection> {
        let names = HeaderNames::of(req.headers);
        let raw = req
            .headers
            .get(names.signature)
            .ok_or_else(|| Rejection::MissingSignature {
                header: WEBHOOK_HEADERS.signature.to_owned(),
            })?;
        let signatures = raw
            .to_str()
            .map_err(|_| malformed(format!("{} is not visible ASCII", names.signature)))?;
        let msg_id = header_str(req.headers, names.id)
            .ok_or_else(|| malformed(format!("missing or unreadable {}", names.id)))?;
        let timestamp_secs = header_str(req.headers, names.timestamp)
            .ok_or_else(|| malformed(format!("missing or unreadable {}", names.timestamp)))?
            .parse::<i64>()
            .map_err(|_| malformed(format!("{} is not an integer", names.timestamp)))?;

        let entries: Vec<(&str, &str)> = signatures
            .split_whitespace()
            .filter_map(|entry| entry.split_once(','))
            .collect();
        if entries.is_empty() {
            return Err(malformed(format!(
                "{} has no `version,signature` entry",
                names.signature
            )));
        }
        // Other versions (`v1a` is Ed25519) and undecodable entries are skipped.
        let received: Vec<Vec<u8>> = entries
            .iter()
            .filter(|(version, _)| *version == "v1")
            .filter_map(|(_, encoded)| STANDARD.decode(encoded).ok())
            .collect();

        let matched = secrets.iter().filter_map(decode_secret).any(|key| {
            let expected = mac(&key, msg_id, timestamp_secs, req.body);
            received.iter().any(|sig| expected.matches(sig))
        });
        if !matched {
            return Err(Rejection::InvalidSignature);
        }
        check_tolerance(timestamp_secs, req.now, tolerance)
    }

    fn extract(&self, req: &InboundRequest<'_>) -> Result<Vec<ExtractedEvent>, Rejection> {
        let id_header = HeaderNames::of(req.headers).id;
        let place = format!("header {id_header}");
        let id = header_str(req.headers, id_header).ok_or_else(|| Rejection::MissingKey {
            detail: place.clone(),
        })?;
        // The spec does not require JSON bodies; the type is read only when there is one.
        let event_type = serde_json::from_slice::<serde_json::Value>(req.body)
            .ok()
            .and_then(|body| body.get("type")?.as_str().map(str::to_owned));
        Ok(vec![ExtractedEvent {
            fingerprint: None,
            key: event_key(id, &place)?,
            event_type,
        }])
    }

    fn sign(&self, req: &SignRequest<'_>) -> Vec<(String, String)> {
        let timestamp_secs = req.now.as_secs();
        // An undecodable `whsec_` secret can never verify; signing with its raw bytes keeps
        // that true (the test event is refused as an invalid signature).
        let key = decode_secret(req.secret).unwrap_or_else(|| req.secret.expose().to_vec());
        vec![
            (WEBHOOK_HEADERS.id.to_owned(), req.event_key.to_owned()),
            (
                WEBHOOK_HEADERS.timestamp.to_owned(),
                timestamp_secs.to_string(),
            ),
            (
                WEBHOOK_HEADERS.signature.to_owned(),
                sign_v1(&key, req.event_key, timestamp_secs, req.body),
            ),
        ]
    }
}

fn mac(key: &[u8], msg_id: &str, timestamp_secs: i64, body: &[u8]) -> Mac256 {
    let timestamp = timestamp_secs.to_string();
    Mac256::compute(
        key,
        &[msg_id.as_bytes(), b".", timestamp.as_bytes(), b".", body],
    )
}

fn malformed(detail: String) -> Rejection {
    Rejection::MalformedSignature { detail }
}

#[cfg(test)]
mod tests {
    use http::{HeaderName, HeaderValue};
    use proptest::prelude::*;

    use super::*;
    use crate::time::Timestamp;

    const NOW: i64 = 1_649_367_553;
    const TOLERANCE: Duration = Duration::from_secs(300);
    const MSG_ID: &str = "msg_27UH4WbU6Z5A5EzD8u03UvzRbpk";
    const BODY: &[u8] = br#"{"email":"test@example.com","username":"test_user"}"#;
    const VECTOR_SECRET: &str = "whsec_C2FVsBQIhrscChlQIMV+b5sSYspob7oD";
    const VECTOR_SIGNATURE: &str = "v1,tZ1I4/hDygAJgO5TYxiSd6Sd0kDW6hPenDe+bTa3Kkw=";
    const OLD: &str = "whsec_b2xkIHNlY3JldCBieXRlcyE=";
    const NEW: &str = "whsec_bmV3IHNlY3JldCBieXRlcyE=";

    fn headers(pairs: &[(&str, String)]) -> HeaderMap {
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

    /// The `webhook-*` headers for `MSG_ID` signed at `signed_at`.
    fn signed(secret: &str, signed_at: i64, body: &[u8]) -> Vec<(&'static str, String)> {
        let key = decode_secret(&Secret::from_text(secret)).expect("test secrets decode");
        vec![
            ("webhook-id", MSG_ID.to_owned()),
            ("webhook-timestamp", signed_at.to_string()),
            ("webhook-signature", sign_v1(&key, MSG_ID, signed_at, body)),
        ]
    }

    /// `pairs` with the value of `name` replaced (or removed when `value` is `None`).
    fn with(
        mut pairs: Vec<(&'static str, String)>,
        name: &'static str,
        value: Option<&str>,
    ) -> Vec<(&'static str, String)> {
        pairs.retain(|(n, _)| *n != name);
        pairs.extend(value.map(|v| (name, v.to_owned())));
        pairs
    }

    fn signature_of(pairs: &[(&str, String)]) -> String {
        pairs
            .iter()
            .find(|(n, _)| *n == "webhook-signature")
            .unwrap()
            .1
            .clone()
    }

    fn verify(pairs: &[(&str, String)], body: &[u8], secrets: &[&str]) -> Result<(), Rejection> {
        let headers = headers(pairs);
        let secrets: Vec<Secret> = secrets.iter().map(|s| Secret::from_text(s)).collect();
        let req = InboundRequest {
            path_and_query: "/in/test",
            headers: &headers,
            body,
            now: Timestamp::from_secs(NOW),
        };
        StandardWebhooks.verify(&req, &secrets, TOLERANCE)
    }

    #[track_caller]
    fn check(pairs: &[(&str, String)], body: &[u8], secrets: &[&str], expect: Result<(), &str>) {
        let got = verify(pairs, body, secrets);
        assert_eq!(
            got.as_ref().map_err(Rejection::code).copied(),
            expect,
            "{got:?}"
        );
    }

    fn extract(pairs: &[(&str, String)], body: &[u8]) -> Result<Vec<ExtractedEvent>, Rejection> {
        let headers = headers(pairs);
        StandardWebhooks.extract(&InboundRequest {
            path_and_query: "/in/test",
            headers: &headers,
            body,
            now: Timestamp::from_secs(NOW),
        })
    }

    #[test]
    fn the_reference_vector_signs_and_verifies() {
        let key = decode_secret(&Secret::from_text(VECTOR_SECRET)).unwrap();
        assert_eq!(sign_v1(&key, MSG_ID, NOW, BODY), VECTOR_SIGNATURE);
        let pairs = with(
            signed(VECTOR_SECRET, NOW, BODY),
            "webhook-signature",
            Some(VECTOR_SIGNATURE),
        );
        check(&pairs, BODY, &[VECTOR_SECRET], Ok(()));

        let secret = Secret::from_text(VECTOR_SECRET);
        let sign = StandardWebhooks.sign(&SignRequest {
            url: "http://127.0.0.1:8080/in/test",
            body: BODY,
            secret: &secret,
            now: Timestamp::from_secs(NOW),
            event_key: MSG_ID,
            event_type: None,
        });
        let expected = [
            ("webhook-id", MSG_ID),
            ("webhook-timestamp", "1649367553"),
            ("webhook-signature", VECTOR_SIGNATURE),
        ];
        let sign: Vec<(&str, &str)> = sign.iter().map(|(n, v)| (n.as_str(), v.as_str())).collect();
        assert_eq!(sign, expected);
    }

    #[test]
    fn svix_headers_verify_and_take_precedence() {
        let svix = |pairs: Vec<(&'static str, String)>| -> Vec<(&'static str, String)> {
            let rename = |name| match name {
                "webhook-id" => "svix-id",
                "webhook-timestamp" => "svix-timestamp",
                _ => "svix-signature",
            };
            pairs.into_iter().map(|(n, v)| (rename(n), v)).collect()
        };
        check(&svix(signed(NEW, NOW, BODY)), BODY, &[NEW], Ok(()));
        // With `svix-signature` present, a bad svix signature is not rescued by webhook-*.
        let mut mixed = svix(signed(OLD, NOW, BODY));
        mixed.extend(signed(NEW, NOW, BODY));
        check(&mixed, BODY, &[NEW], Err("invalid_signature"));
        check(&mixed, BODY, &[OLD], Ok(()));
    }

    #[test]
    fn a_wrong_secret_or_tampered_body_is_an_invalid_signature() {
        check(
            &signed(NEW, NOW, BODY),
            BODY,
            &[OLD],
            Err("invalid_signature"),
        );
        check(
            &signed(NEW, NOW, BODY),
            b"{}",
            &[NEW],
            Err("invalid_signature"),
        );
        let other_id = with(signed(NEW, NOW, BODY), "webhook-id", Some("msg_other"));
        check(&other_id, BODY, &[NEW], Err("invalid_signature"));
    }

    #[test]
    fn a_missing_signature_header_is_a_missing_signature() {
        let pairs = with(signed(NEW, NOW, BODY), "webhook-signature", None);
        assert_eq!(
            verify(&pairs, BODY, &[NEW]),
            Err(Rejection::MissingSignature {
                header: "webhook-signature".to_owned()
            })
        );
    }

    #[test]
    fn a_missing_id_or_bad_timestamp_is_malformed() {
        let good = signed(NEW, NOW, BODY);
        for pairs in [
            with(good.clone(), "webhook-id", None),
            with(good.clone(), "webhook-timestamp", None),
            with(good.clone(), "webhook-timestamp", Some("soon")),
            with(good.clone(), "webhook-timestamp", Some("1649367553.5")),
        ] {
            check(&pairs, BODY, &[NEW], Err("malformed_signature"));
        }
    }

    #[test]
    fn signature_lists_are_parsed_entry_by_entry() {
        let good = signature_of(&signed(NEW, NOW, BODY));
        let b64 = good.trim_start_matches("v1,");
        for (list, expect) in [
            (format!("garbage {good}"), Ok(())),
            (format!("v1a,{b64} v1,!!! {good}"), Ok(())),
            (format!("v2,{b64}"), Err("invalid_signature")),
            (format!("v1a,{b64}"), Err("invalid_signature")),
            ("v1,not-base64".to_owned(), Err("invalid_signature")),
            (b64.to_owned(), Err("malformed_signature")),
            (
                "garbage more-garbage".to_owned(),
                Err("malformed_signature"),
            ),
            (String::new(), Err("malformed_signature")),
        ] {
            let pairs = with(signed(NEW, NOW, BODY), "webhook-signature", Some(&list));
            check(&pairs, BODY, &[NEW], expect);
        }
    }

    #[test]
    fn rotation_accepts_any_secret_and_any_listed_signature() {
        check(&signed(OLD, NOW, BODY), BODY, &[OLD, NEW], Ok(()));
        check(&signed(NEW, NOW, BODY), BODY, &[OLD, NEW], Ok(()));

        let both = format!(
            "{} {}",
            signature_of(&signed(OLD, NOW, BODY)),
            signature_of(&signed(NEW, NOW, BODY))
        );
        let pairs = with(signed(NEW, NOW, BODY), "webhook-signature", Some(&both));
        check(&pairs, BODY, &[NEW], Ok(()));
        check(&pairs, BODY, &[OLD], Ok(()));

        check(
            &signed(OLD, NOW, BODY),
            BODY,
            &[NEW],
            Err("invalid_signature"),
        );
    }

    #[test]
    fn timestamps_within_the_tolerance_pass_in_both_directions() {
        check(&signed(NEW, NOW - 299, BODY), BODY, &[NEW], Ok(()));
        check(&signed(NEW, NOW + 299, BODY), BODY, &[NEW], Ok(()));
        for skew_secs in [-301, 301] {
            assert_eq!(
                verify(&signed(NEW, NOW + skew_secs, BODY), BODY, &[NEW]),
                Err(Rejection::StaleTimestamp {
                    skew_secs,
                    tolerance_secs: 300
                })
            );
        }
        check(
            &signed(OLD, NOW - 1000, BODY),
            BODY,
            &[NEW],
            Err("invalid_signature"),
        );
    }

    #[track_caller]
    fn check_secret(secret: &[u8], expect: Option<&[u8]>) {
        assert_eq!(
            decode_secret(&Secret::new(secret.to_vec())).as_deref(),
            expect
        );
    }

    #[test]
    fn secrets_decode_like_the_reference_libraries() {
        check_secret(b"whsec_aGVsbG8=", Some(b"hello"));
        check_secret(b"whsec_not base64!", None);
        check_secret(b"aGVsbG8=", Some(b"hello"));
        check_secret(b"plain secret", Some(b"plain secret"));
        check_secret(&[0xff, 0xfe], Some(&[0xff, 0xfe]));
    }

    /// standardwebhooks' Python library (`base64.b64decode(secret + "==")`) accepts a
    /// `whsec_` secret written without base64 padding; so must the gateway, or every delivery
    /// signed with such a secret is refused (found by interop/check.py).
    #[test]
    fn a_whsec_secret_without_padding_decodes_and_verifies() {
        // 32 key bytes: 44 base64 characters with one `=`, 43 without.
        let key = [7u8; 32];
        let padded = format!("whsec_{}", STANDARD.encode(key));
        let unpadded = padded.trim_end_matches('=').to_owned();
        assert_ne!(padded, unpadded);
        check_secret(unpadded.as_bytes(), Some(&key));
        check_secret(b"whsec_aGVsbG8", Some(b"hello"));
        // Signed with the key bytes (as the Python library does), verified under either spelling.
        let pairs = vec![
            ("webhook-id", MSG_ID.to_owned()),
            ("webhook-timestamp", NOW.to_string()),
            ("webhook-signature", sign_v1(&key, MSG_ID, NOW, BODY)),
        ];
        check(&pairs, BODY, &[&unpadded], Ok(()));
        check(&pairs, BODY, &[&padded], Ok(()));
        // A bare secret keeps its meaning: only padded base64 is decoded, the rest is raw.
        check_secret(b"aGVsbG8", Some(b"aGVsbG8"));
    }

    #[test]
    fn an_undecodable_whsec_secret_never_verifies() {
        let broken = "whsec_not base64!";
        let secret = Secret::from_text(broken);
        let sign = StandardWebhooks.sign(&SignRequest {
            url: "http://127.0.0.1:8080/in/test",
            body: BODY,
            secret: &secret,
            now: Timestamp::from_secs(NOW),
            event_key: MSG_ID,
            event_type: None,
        });
        let pairs: Vec<(&str, String)> =
            sign.iter().map(|(n, v)| (n.as_str(), v.clone())).collect();
        check(&pairs, BODY, &[broken], Err("invalid_signature"));
    }

    #[test]
    fn the_key_is_the_id_header_and_the_type_comes_from_a_json_body() {
        let events = extract(&signed(NEW, NOW, BODY), br#"{"type":"user.created"}"#).unwrap();
        assert_eq!(events.len(), 1);
        assert_eq!(events[0].key.as_str(), MSG_ID);
        assert_eq!(events[0].event_type.as_deref(), Some("user.created"));

        let form = extract(&signed(NEW, NOW, BODY), b"type=user.created").unwrap();
        assert_eq!(form[0].event_type, None);

        let svix = extract(
            &[
                ("svix-id", "msg_svix".to_owned()),
                ("svix-signature", "v1,x".to_owned()),
            ],
            BODY,
        )
        .unwrap();
        assert_eq!(svix[0].key.as_str(), "msg_svix");
    }

    #[test]
    fn a_missing_id_is_a_missing_key() {
        let pairs = with(signed(NEW, NOW, BODY), "webhook-id", None);
        assert_eq!(
            extract(&pairs, BODY),
            Err(Rejection::MissingKey {
                detail: "header webhook-id".to_owned()
            })
        );
    }

    proptest! {
        #[test]
        fn arbitrary_headers_and_bodies_never_panic(
            signature in prop_oneof![
                "[ -~]{0,120}",
                "((v1|v1a|v2|[a-z0-9]{0,3}),[A-Za-z0-9+/=!]{0,48} ?){0,4}",
            ],
            id in "[ -~]{0,20}",
            timestamp in prop_oneof!["[ -~]{0,12}", "-?[0-9]{1,19}"],
            body in proptest::collection::vec(any::<u8>(), 0..64),
        ) {
            let pairs = [("webhook-id", id), ("webhook-timestamp", timestamp), ("webhook-signature", signature)];
            let _ = verify(&pairs, &body, &[NEW, "raw secret", "whsec_!!"]);
            let _ = extract(&pairs, &body);
        }

        #[test]
        fn arbitrary_signature_bytes_never_verify(
            sig in proptest::collection::vec(any::<u8>(), 0..64),
        ) {
            let list = format!("v1,{}", STANDARD.encode(&sig));
            let pairs = with(signed(NEW, NOW, BODY), "webhook-signature", Some(&list));
            prop_assert_eq!(verify(&pairs, BODY, &[NEW]), Err(Rejection::InvalidSignature));
        }
    }
}
