//! Generic HMAC-SHA256 over the raw body, for providers without an adapter of their own
//! (Shopify, Razorpay, Meta and most in-house senders fit). [`GenericSettings`] names the
//! signature header, its encoding and prefix, and where the event key and type live: a header
//! or an RFC 6901 JSON pointer into the body.
//!
//! No timestamp is signed, so the tolerance is unused and deduplication is the only replay
//! defence. Secrets are used as raw bytes.

use std::time::Duration;

use base64::engine::general_purpose::{STANDARD, STANDARD_NO_PAD, URL_SAFE, URL_SAFE_NO_PAD};
use base64::Engine;
use http::HeaderMap;
use serde_json::Value;

use crate::id::EventKey;
use crate::provider::{
    event_key, header_str, parse_json, ExtractedEvent, InboundRequest, ProviderAdapter, Rejection,
    SignRequest,
};
use crate::secret::{Mac256, Secret};

/// How the MAC is written in the signature header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SignatureEncoding {
    /// Hex digits, either case (signed as lowercase).
    Hex,
    /// Base64: standard alphabet with or without padding, URL-safe accepted as a fallback
    /// (signed as standard with padding).
    Base64,
}

/// Where a generic source puts its signature, event key and event type.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GenericSettings {
    /// The header carrying the signature, e.g. `X-Signature`.
    pub signature_header: String,
    /// How the MAC is encoded.
    pub encoding: SignatureEncoding,
    /// A prefix the value must start with (e.g. `sha256=`), stripped before decoding.
    pub prefix: Option<String>,
    /// The header carrying the event key; tried before `key_pointer`.
    pub key_header: Option<String>,
    /// A JSON pointer (RFC 6901, e.g. `/data/id`) to the event key in the body; the value may
    /// be a string or an integer.
    pub key_pointer: Option<String>,
    /// The header carrying the event type; tried before `type_pointer`.
    pub type_header: Option<String>,
    /// A JSON pointer to the event type (a string) in the body.
    pub type_pointer: Option<String>,
}

/// HMAC-SHA256 of the raw body as [`GenericSettings`] describe it (`provider = "generic"`).
#[derive(Debug, Clone)]
pub struct Generic {
    /// The source's settings.
    pub settings: GenericSettings,
}

impl ProviderAdapter for Generic {
    fn provider(&self) -> &'static str {
        "generic"
    }

    fn signature_headers(&self) -> Vec<&str> {
        vec![self.settings.signature_header.as_str()]
    }

    fn verify(
        &self,
        req: &InboundRequest<'_>,
        secrets: &[Secret],
        _tolerance: Duration,
    ) -> Result<(), Rejection> {
        let settings = &self.settings;
        let raw = req
            .headers
            .get(settings.signature_header.as_str())
            .ok_or_else(|| Rejection::MissingSignature {
                header: settings.signature_header.clone(),
            })?;
        let value = raw
            .to_str()
            .map_err(|_| self.malformed("is not visible ASCII"))?
            .trim();
        let encoded = match settings.prefix.as_deref() {
            Some(prefix) => value
                .strip_prefix(prefix)
                .ok_or_else(|| self.malformed("does not start with the configured prefix"))?,
            None => value,
        };
        let received = match settings.encoding {
            SignatureEncoding::Hex => hex::decode(encoded).ok(),
            SignatureEncoding::Base64 => decode_base64(encoded),
        }
        .ok_or_else(|| self.malformed("cannot be decoded"))?;

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
        let settings = &self.settings;
        let body = if settings.key_pointer.is_some() || settings.type_pointer.is_some() {
            Some(parse_json(req.body)?)
        } else {
            None
        };
        let event_type = settings
            .type_header
            .as_deref()
            .and_then(|name| header_str(req.headers, name))
            .or_else(|| {
                body.as_ref()?
                    .pointer(settings.type_pointer.as_deref()?)?
                    .as_str()
            })
            .map(str::to_owned);
        Ok(vec![ExtractedEvent {
            fingerprint: None,
            key: self.find_key(req.headers, body.as_ref())?,
            event_type,
        }])
    }

    fn sign(&self, req: &SignRequest<'_>) -> Vec<(String, String)> {
        let settings = &self.settings;
        let mac = Mac256::compute(req.secret.expose(), &[req.body]);
        let encoded = match settings.encoding {
            SignatureEncoding::Hex => mac.to_hex(),
            SignatureEncoding::Base64 => mac.to_base64(),
        };
        let prefix = settings.prefix.as_deref().unwrap_or_default();
        let mut headers = vec![(
            settings.signature_header.clone(),
            format!("{prefix}{encoded}"),
        )];
        if let Some(name) = &settings.key_header {
            headers.push((name.clone(), req.event_key.to_owned()));
        }
        headers
    }
}

impl Generic {
    /// The key from `key_header`, else from `key_pointer`.
    fn find_key(&self, headers: &HeaderMap, body: Option<&Value>) -> Result<EventKey, Rejection> {
        let settings = &self.settings;
        let header_place = settings.key_header.as_ref().map(|n| format!("header {n}"));
        let pointer_place = settings
            .key_pointer
            .as_ref()
            .map(|p| format!("body pointer {p}"));

        if let (Some(name), Some(place)) = (&settings.key_header, &header_place) {
            if let Some(value) = header_str(headers, name) {
                return event_key(value, place);
            }
        }
        if let (Some(pointer), Some(place), Some(body)) =
            (&settings.key_pointer, &pointer_place, body)
        {
            match body.pointer(pointer) {
                Some(Value::String(text)) => return event_key(text, place),
                // Integer ids are keys too; floats are not (their text form is not stable).
                Some(Value::Number(n)) if n.is_i64() || n.is_u64() => {
                    return event_key(&n.to_string(), place)
                }
                _ => {}
            }
        }

        let places: Vec<String> = header_place.into_iter().chain(pointer_place).collect();
        let detail = if places.is_empty() {
            "neither key_header nor key_pointer is configured".to_owned()
        } else {
            places.join(" or ")
        };
        Err(Rejection::MissingKey { detail })
    }

    fn malformed(&self, detail: &str) -> Rejection {
        Rejection::MalformedSignature {
            detail: format!("{} {detail}", self.settings.signature_header),
        }
    }
}

/// Decodes base64 as senders write it: standard with or without padding, else URL-safe.
fn decode_base64(text: &str) -> Option<Vec<u8>> {
    [STANDARD, STANDARD_NO_PAD, URL_SAFE, URL_SAFE_NO_PAD]
        .iter()
        .find_map(|engine| engine.decode(text).ok())
}

#[cfg(test)]
mod tests {

    use proptest::prelude::*;

    use super::*;
    use crate::provider::test_support::headers;
    use crate::time::Timestamp;

    const SECRET: &str = "generic secret";
    const OLD: &str = "old generic secret";
    const BODY: &[u8] = br#"{"id":2}"#;
    /// Standard base64 of HMAC-SHA256(`generic secret`, `{"id":2}`), computed with Python.
    const BODY_BASE64: &str = "sczh6vMheJFX2ilDiCycL8Rx/rM0/LCk0iVV4+4U81I=";

    fn hex_settings() -> GenericSettings {
        GenericSettings {
            signature_header: "X-Signature".to_owned(),
            encoding: SignatureEncoding::Hex,
            prefix: Some("sha256=".to_owned()),
            key_header: Some("X-Event-Id".to_owned()),
            key_pointer: None,
            type_header: Some("X-Event-Type".to_owned()),
            type_pointer: None,
        }
    }

    fn base64_settings() -> GenericSettings {
        GenericSettings {
            encoding: SignatureEncoding::Base64,
            prefix: None,
            ..hex_settings()
        }
    }

    fn pointer_settings() -> GenericSettings {
        GenericSettings {
            key_header: None,
            key_pointer: Some("/data/id".to_owned()),
            type_header: None,
            type_pointer: Some("/type".to_owned()),
            ..hex_settings()
        }
    }

    /// The signature header value `settings` produce for `body`.
    fn signature(settings: &GenericSettings, secret: &str, body: &[u8]) -> String {
        let secret = Secret::from_text(secret);
        let generic = Generic {
            settings: settings.clone(),
        };
        let signed = generic.sign(&SignRequest {
            url: "http://127.0.0.1:8080/in/test",
            body,
            secret: &secret,
            now: Timestamp::from_secs(0),
            event_key: "evt_1",
            event_type: None,
        });
        signed[0].1.clone()
    }

    fn verify(
        settings: &GenericSettings,
        header: Option<&str>,
        body: &[u8],
        secrets: &[&str],
    ) -> Result<(), Rejection> {
        let name = settings.signature_header.as_str();
        let headers = headers(header.map(|value| (name, value)).as_slice());
        let secrets: Vec<Secret> = secrets.iter().map(|s| Secret::from_text(s)).collect();
        let req = InboundRequest {
            path_and_query: "/in/test",
            headers: &headers,
            body,
            now: Timestamp::from_secs(0),
        };
        Generic {
            settings: settings.clone(),
        }
        .verify(&req, &secrets, Duration::ZERO)
    }

    #[track_caller]
    fn check(
        settings: &GenericSettings,
        header: &str,
        body: &[u8],
        secrets: &[&str],
        expect: Result<(), &str>,
    ) {
        let got = verify(settings, Some(header), body, secrets);
        assert_eq!(
            got.as_ref().map_err(Rejection::code).copied(),
            expect,
            "{got:?}"
        );
    }

    fn extract(
        settings: GenericSettings,
        pairs: &[(&str, &str)],
        body: &[u8],
    ) -> Result<ExtractedEvent, Rejection> {
        let headers = headers(pairs);
        let req = InboundRequest {
            path_and_query: "/in/test",
            headers: &headers,
            body,
            now: Timestamp::from_secs(0),
        };
        let mut events = Generic { settings }.extract(&req)?;
        assert_eq!(events.len(), 1);
        Ok(events.remove(0))
    }

    #[track_caller]
    fn check_key(
        settings: GenericSettings,
        pairs: &[(&str, &str)],
        body: &[u8],
        expect: Result<(&str, Option<&str>), Rejection>,
    ) {
        let got = extract(settings, pairs, body);
        let got = got
            .as_ref()
            .map(|event| (event.key.as_str(), event.event_type.as_deref()));
        assert_eq!(got, expect.as_ref().map(|(key, ty)| (*key, *ty)));
    }

    fn missing_key(detail: &str) -> Result<(&'static str, Option<&'static str>), Rejection> {
        Err(Rejection::MissingKey {
            detail: detail.to_owned(),
        })
    }

    #[test]
    fn the_github_docs_vector_verifies_as_prefixed_hex() {
        let expected = "sha256=757107ea0eb2509fc211221cce984b8a37570b6d7586c22c46f4379c8b043e17";
        let secret = "It's a Secret to Everybody";
        assert_eq!(
            signature(&hex_settings(), secret, b"Hello, World!"),
            expected
        );
        check(
            &hex_settings(),
            expected,
            b"Hello, World!",
            &[secret],
            Ok(()),
        );
    }

    #[test]
    fn base64_signs_as_padded_standard_and_accepts_common_variants() {
        let settings = base64_settings();
        assert_eq!(signature(&settings, SECRET, BODY), BODY_BASE64);
        let unpadded = BODY_BASE64.trim_end_matches('=');
        let url_safe = unpadded.replace('+', "-").replace('/', "_");
        for header in [BODY_BASE64, unpadded, &url_safe, &format!("{url_safe}=")] {
            check(&settings, header, BODY, &[SECRET], Ok(()));
        }
    }

    #[test]
    fn hex_is_compared_case_insensitively() {
        let settings = hex_settings();
        let upper = signature(&settings, SECRET, BODY)
            .to_uppercase()
            .replace("SHA256=", "sha256=");
        check(&settings, &upper, BODY, &[SECRET], Ok(()));
    }

    #[test]
    fn a_wrong_secret_or_tampered_body_is_an_invalid_signature() {
        for settings in [hex_settings(), base64_settings()] {
            let good = signature(&settings, SECRET, BODY);
            check(&settings, &good, BODY, &[SECRET], Ok(()));
            check(&settings, &good, BODY, &[OLD], Err("invalid_signature"));
            check(
                &settings,
                &good,
                br#"{"id":3}"#,
                &[SECRET],
                Err("invalid_signature"),
            );
        }
    }

    #[test]
    fn a_missing_header_is_a_missing_signature() {
        for settings in [
            hex_settings(),
            GenericSettings {
                signature_header: "not a header name".to_owned(),
                ..hex_settings()
            },
        ] {
            assert_eq!(
                verify(&settings, None, BODY, &[SECRET]).map_err(|r| r.code()),
                Err("missing_signature")
            );
        }
    }

    #[test]
    fn a_missing_prefix_or_undecodable_value_is_malformed() {
        let good = signature(&hex_settings(), SECRET, BODY);
        let bare = good.trim_start_matches("sha256=");
        for header in [bare, "sha1=00", "sha256=xyz", "sha256=abc"] {
            check(
                &hex_settings(),
                header,
                BODY,
                &[SECRET],
                Err("malformed_signature"),
            );
        }
        for header in ["not base64!", "a", "$$$$"] {
            check(
                &base64_settings(),
                header,
                BODY,
                &[SECRET],
                Err("malformed_signature"),
            );
        }
    }

    #[test]
    fn rotation_accepts_either_configured_secret() {
        let settings = hex_settings();
        check(
            &settings,
            &signature(&settings, OLD, BODY),
            BODY,
            &[OLD, SECRET],
            Ok(()),
        );
        check(
            &settings,
            &signature(&settings, SECRET, BODY),
            BODY,
            &[OLD, SECRET],
            Ok(()),
        );
        check(
            &settings,
            &signature(&settings, OLD, BODY),
            BODY,
            &[SECRET],
            Err("invalid_signature"),
        );
    }

    #[test]
    fn keys_and_types_come_from_headers() {
        let pairs = [("X-Event-Id", "evt_h"), ("X-Event-Type", "order.paid")];
        // Without pointers the body is never parsed, so it need not be JSON.
        check_key(
            hex_settings(),
            &pairs,
            b"not json",
            Ok(("evt_h", Some("order.paid"))),
        );
        check_key(
            hex_settings(),
            &pairs[..1],
            b"not json",
            Ok(("evt_h", None)),
        );
        check_key(
            hex_settings(),
            &pairs[1..],
            b"not json",
            missing_key("header X-Event-Id"),
        );
    }

    #[test]
    fn keys_and_types_come_from_json_pointers() {
        check_key(
            pointer_settings(),
            &[],
            br#"{"data":{"id":"evt_p"},"type":"a.b"}"#,
            Ok(("evt_p", Some("a.b"))),
        );
        check_key(
            pointer_settings(),
            &[],
            br#"{"data":{"id":42}}"#,
            Ok(("42", None)),
        );
        check_key(
            pointer_settings(),
            &[],
            br#"{"data":{"id":-7},"type":3}"#,
            Ok(("-7", None)),
        );
        check_key(
            pointer_settings(),
            &[],
            br#"{"data":{"id":4.5}}"#,
            missing_key("body pointer /data/id"),
        );
        check_key(
            pointer_settings(),
            &[],
            br#"{"data":{}}"#,
            missing_key("body pointer /data/id"),
        );
        check_key(
            pointer_settings(),
            &[],
            br#"[1,2]"#,
            missing_key("body pointer /data/id"),
        );
        let escaped = GenericSettings {
            key_pointer: Some("/a~1b/~0c".to_owned()),
            ..pointer_settings()
        };
        check_key(
            escaped,
            &[],
            br#"{"a/b":{"~c":"evt_e"}}"#,
            Ok(("evt_e", None)),
        );
        assert_eq!(
            extract(pointer_settings(), &[], b"id=1").map_err(|r| r.code()),
            Err("invalid_json")
        );
    }

    #[test]
    fn a_key_header_is_preferred_to_a_key_pointer() {
        let both = GenericSettings {
            key_header: Some("X-Event-Id".to_owned()),
            ..pointer_settings()
        };
        let body = br#"{"data":{"id":"evt_body"}}"#;
        check_key(
            both.clone(),
            &[("X-Event-Id", "evt_header")],
            body,
            Ok(("evt_header", None)),
        );
        check_key(both.clone(), &[], body, Ok(("evt_body", None)));
        check_key(
            both,
            &[],
            b"{}",
            missing_key("header X-Event-Id or body pointer /data/id"),
        );
    }

    #[test]
    fn no_configured_key_source_is_a_missing_key() {
        let unkeyed = GenericSettings {
            key_header: None,
            ..hex_settings()
        };
        check_key(
            unkeyed,
            &[],
            BODY,
            missing_key("neither key_header nor key_pointer is configured"),
        );
    }

    #[test]
    fn signing_adds_the_key_header_when_configured() {
        let secret = Secret::from_text(SECRET);
        let sign = SignRequest {
            url: "http://127.0.0.1:8080/in/test",
            body: BODY,
            secret: &secret,
            now: Timestamp::from_secs(0),
            event_key: "evt_9",
            event_type: None,
        };
        let keyed = Generic {
            settings: hex_settings(),
        }
        .sign(&sign);
        assert_eq!(keyed[1], ("X-Event-Id".to_owned(), "evt_9".to_owned()));
        let unkeyed = Generic {
            settings: pointer_settings(),
        }
        .sign(&sign);
        assert_eq!(unkeyed.len(), 1);
    }

    proptest! {
        #[test]
        fn arbitrary_headers_and_bodies_never_panic(
            header in prop_oneof!["[ -~]{0,100}", "(sha256=)?[0-9a-fA-F]{0,66}", "[A-Za-z0-9+/_=-]{0,50}"],
            body in proptest::collection::vec(any::<u8>(), 0..64),
        ) {
            for settings in [hex_settings(), base64_settings(), pointer_settings()] {
                let _ = verify(&settings, Some(&header), &body, &[SECRET]);
                let _ = extract(settings, &[("X-Event-Id", &header)], &body);
            }
        }

        #[test]
        fn arbitrary_signature_bytes_never_verify(
            sig in proptest::collection::vec(any::<u8>(), 0..64),
        ) {
            let hex_header = format!("sha256={}", hex::encode(&sig));
            prop_assert_eq!(verify(&hex_settings(), Some(&hex_header), BODY, &[SECRET]), Err(Rejection::InvalidSignature));
            let base64_header = STANDARD.encode(&sig);
            prop_assert_eq!(verify(&base64_settings(), Some(&base64_header), BODY, &[SECRET]), Err(Rejection::InvalidSignature));
        }
    }
}
