//! GitHub: `X-Hub-Signature-256: sha256=<hex>` is an HMAC-SHA256 of the raw body keyed by the
//! webhook secret's UTF-8 bytes. The event key is the `X-GitHub-Delivery` header (a GUID that
//! redeliveries repeat), the event type is `X-GitHub-Event`.
//!
//! GitHub signs no timestamp, so deduplication is the only replay defence and the tolerance
//! is unused. The legacy SHA-1 `X-Hub-Signature` is never read. Bodies may be form-encoded,
//! so nothing here requires JSON.

use std::time::Duration;

use crate::provider::{
    event_key, header_str, malformed, signature_value, ExtractedEvent, InboundRequest,
    ProviderAdapter, Rejection, SignRequest,
};
use crate::secret::{Mac256, Secret};

const SIGNATURE_HEADER: &str = "X-Hub-Signature-256";
const DELIVERY_HEADER: &str = "X-GitHub-Delivery";
const EVENT_HEADER: &str = "X-GitHub-Event";
const SIGNATURE_PREFIX: &str = "sha256=";

/// GitHub's webhook scheme (`provider = "github"`).
#[derive(Debug, Clone, Copy, Default)]
pub struct GitHub;

impl ProviderAdapter for GitHub {
    fn provider(&self) -> &'static str {
        "github"
    }

    fn signature_headers(&self) -> Vec<&str> {
        vec![SIGNATURE_HEADER, "X-Hub-Signature"]
    }

    fn verify(
        &self,
        req: &InboundRequest<'_>,
        secrets: &[Secret],
        _tolerance: Duration,
    ) -> Result<(), Rejection> {
        let value = signature_value(req.headers, SIGNATURE_HEADER)?;
        let hex_digest = value
            .strip_prefix(SIGNATURE_PREFIX)
            .ok_or_else(|| malformed(SIGNATURE_HEADER, "does not start with `sha256=`"))?;
        let received =
            hex::decode(hex_digest).map_err(|_| malformed(SIGNATURE_HEADER, "is not hex"))?;

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
        let place = format!("header {DELIVERY_HEADER}");
        let delivery =
            header_str(req.headers, DELIVERY_HEADER).ok_or_else(|| Rejection::MissingKey {
                detail: place.clone(),
            })?;
        Ok(vec![ExtractedEvent {
            fingerprint: None,
            key: event_key(delivery, &place)?,
            event_type: header_str(req.headers, EVENT_HEADER).map(str::to_owned),
        }])
    }

    fn sign(&self, req: &SignRequest<'_>) -> Vec<(String, String)> {
        let mac = Mac256::compute(req.secret.expose(), &[req.body]);
        vec![
            (
                SIGNATURE_HEADER.to_owned(),
                format!("{SIGNATURE_PREFIX}{}", mac.to_hex()),
            ),
            (DELIVERY_HEADER.to_owned(), req.event_key.to_owned()),
            (
                EVENT_HEADER.to_owned(),
                req.event_type.unwrap_or("ping").to_owned(),
            ),
        ]
    }

    /// 10 days: redelivery is possible for 3 days on github.com and 7 on GitHub Enterprise
    /// Server, plus a margin.
    fn default_retention(&self) -> Duration {
        Duration::from_secs(10 * 24 * 3600)
    }
}

#[cfg(test)]
mod tests {
    use http::HeaderMap;

    use super::*;
    use crate::provider::test_support::headers;
    use crate::time::Timestamp;

    const BODY: &[u8] = br#"{"zen":"Keep it logically awesome."}"#;
    const OLD: &str = "old secret";
    const NEW: &str = "new secret";

    fn request<'a>(headers: &'a HeaderMap, body: &'a [u8]) -> InboundRequest<'a> {
        InboundRequest {
            path_and_query: "/in/test",
            headers,
            body,
            now: Timestamp::from_secs(1_700_000_000),
        }
    }

    fn signature(secret: &str, body: &[u8]) -> String {
        let secret = Secret::from_text(secret);
        let signed = GitHub.sign(&SignRequest {
            url: "http://127.0.0.1:8080/in/test",
            body,
            secret: &secret,
            now: Timestamp::from_secs(0),
            event_key: "d1",
            event_type: None,
        });
        signed[0].1.clone()
    }

    fn verify(header: Option<&str>, body: &[u8], secrets: &[&str]) -> Result<(), Rejection> {
        let headers = headers(header.map(|h| (SIGNATURE_HEADER, h)).as_slice());
        let secrets: Vec<Secret> = secrets.iter().map(|s| Secret::from_text(s)).collect();
        GitHub.verify(&request(&headers, body), &secrets, Duration::ZERO)
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

    #[track_caller]
    fn check_vector(secret: &str, body: &[u8], expected: &str) {
        assert_eq!(signature(secret, body), expected);
        check(expected, body, &[secret], Ok(()));
    }

    #[test]
    fn the_github_docs_vector_signs_and_verifies() {
        check_vector(
            "It's a Secret to Everybody",
            b"Hello, World!",
            "sha256=757107ea0eb2509fc211221cce984b8a37570b6d7586c22c46f4379c8b043e17",
        );
    }

    #[test]
    fn the_octokit_vector_signs_and_verifies() {
        check_vector(
            "mysecret",
            br#"{"foo":"bar"}"#,
            "sha256=4864d2759938a15468b5df9ade20bf161da9b4f737ea61794142f3484236bda3",
        );
    }

    #[test]
    fn a_signed_event_verifies_and_any_change_breaks_it() {
        let good = signature(NEW, BODY);
        check(&good, BODY, &[NEW], Ok(()));
        check(
            &good.to_uppercase().replace("SHA256=", "sha256="),
            BODY,
            &[NEW],
            Ok(()),
        );
        check(&good, BODY, &[OLD], Err("invalid_signature"));
        check(
            &good,
            br#"{"zen":"Keep it logically awesome!"}"#,
            &[NEW],
            Err("invalid_signature"),
        );
        check(&good, BODY, &[], Err("invalid_signature"));
    }

    #[test]
    fn a_missing_header_is_a_missing_signature_even_with_the_legacy_sha1_header() {
        let missing = Err(Rejection::MissingSignature {
            header: "X-Hub-Signature-256".to_owned(),
        });
        assert_eq!(verify(None, BODY, &[NEW]), missing);
        let legacy = headers(&[(
            "X-Hub-Signature",
            "sha1=0123456789abcdef0123456789abcdef01234567",
        )]);
        let secrets = [Secret::from_text(NEW)];
        assert_eq!(
            GitHub.verify(&request(&legacy, BODY), &secrets, Duration::ZERO),
            missing
        );
    }

    #[test]
    fn a_value_without_the_prefix_or_with_bad_hex_is_malformed() {
        let good = signature(NEW, BODY);
        let bare = good.trim_start_matches("sha256=");
        for header in [bare, "sha1=00", "SHA256=00", "sha256=xyz", "sha256=abc", ""] {
            check(header, BODY, &[NEW], Err("malformed_signature"));
        }
        check("sha256=", BODY, &[NEW], Err("invalid_signature"));
    }

    #[test]
    fn rotation_accepts_either_configured_secret() {
        check(&signature(OLD, BODY), BODY, &[OLD, NEW], Ok(()));
        check(&signature(NEW, BODY), BODY, &[OLD, NEW], Ok(()));
        check(
            &signature(OLD, BODY),
            BODY,
            &[NEW],
            Err("invalid_signature"),
        );
    }

    #[test]
    fn the_key_is_the_delivery_header_and_the_type_the_event_header() {
        let signed = headers(&[
            (DELIVERY_HEADER, "72d3162e-cc78-11e3-81ab-4c9367dc0958"),
            (EVENT_HEADER, "issues"),
        ]);
        // GitHub may send form-encoded bodies; they are not required to be JSON.
        let events = GitHub
            .extract(&request(&signed, b"payload=%7B%7D"))
            .unwrap();
        assert_eq!(events.len(), 1);
        assert_eq!(
            events[0].key.as_str(),
            "72d3162e-cc78-11e3-81ab-4c9367dc0958"
        );
        assert_eq!(events[0].event_type.as_deref(), Some("issues"));
    }

    #[test]
    fn a_missing_delivery_header_is_a_missing_key() {
        let unkeyed = headers(&[(EVENT_HEADER, "push")]);
        assert_eq!(
            GitHub.extract(&request(&unkeyed, BODY)),
            Err(Rejection::MissingKey {
                detail: "header X-GitHub-Delivery".to_owned()
            })
        );
    }

    #[test]
    fn signing_sets_the_delivery_and_event_headers() {
        let secret = Secret::from_text(NEW);
        let mut sign = SignRequest {
            url: "http://127.0.0.1:8080/in/test",
            body: BODY,
            secret: &secret,
            now: Timestamp::from_secs(0),
            event_key: "d-42",
            event_type: Some("push"),
        };
        let signed = GitHub.sign(&sign);
        let names: Vec<&str> = signed.iter().map(|(name, _)| name.as_str()).collect();
        assert_eq!(names, [SIGNATURE_HEADER, DELIVERY_HEADER, EVENT_HEADER]);
        assert_eq!(signed[1].1, "d-42");
        assert_eq!(signed[2].1, "push");

        sign.event_type = None;
        assert_eq!(GitHub.sign(&sign)[2].1, "ping");

        let pairs: Vec<(&str, &str)> = signed
            .iter()
            .map(|(n, v)| (n.as_str(), v.as_str()))
            .collect();
        let headers = headers(&pairs);
        let req = request(&headers, BODY);
        assert_eq!(
            GitHub.verify(&req, std::slice::from_ref(&secret), Duration::ZERO),
            Ok(())
        );
        assert_eq!(GitHub.extract(&req).unwrap()[0].key.as_str(), "d-42");
    }
}
