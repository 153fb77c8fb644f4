//! Slack (Events API, interactivity, slash commands): `X-Slack-Signature: v0=<hex>` is an
//! HMAC-SHA256 over `v0:{X-Slack-Request-Timestamp}:{raw body}`, keyed by the app's signing
//! secret (UTF-8). `v0` is the only version. The timestamp must be within the source's
//! tolerance in both directions (as python-slack-sdk checks; bolt-js checks only the past).
//!
//! Three body shapes share one URL and one signature:
//!
//! - Events API: JSON. `url_verification` is a handshake answered with
//!   `{"challenge": …}` ([`Slack::handshake`]); `event_callback` is keyed by the top-level
//!   `event_id` (retries repeat it with `X-Slack-Retry-Num`), typed by `event.type`.
//! - Interactivity: form-encoded with one field, `payload`, holding JSON. Payloads carry no
//!   event id; the key is read with a JSON pointer, [`Slack::interactive_key`] (default
//!   `/trigger_id`), the type is the payload's `type` (`block_actions`, `view_submission`).
//! - Slash commands: form fields without `payload`; keyed by `trigger_id`, typed
//!   `slash_command`.
//!
//! The shape is read from the body itself (`{` first = JSON), not from `Content-Type`.
//! Interactivity and slash commands are acknowledged with an empty 200 ([`Slack::ack_reply`]):
//! Slack would show any other body to the user as a message, or fail a modal submission.
//!
//! Not handled: slash-command `ssl_check=1` posts carry no signature and are refused as a
//! missing signature.

use std::borrow::Cow;
use std::time::Duration;

use serde_json::{json, Value};

use crate::provider::{
    body_key, check_tolerance, event_key, header_str, malformed, parse_json, ExtractedEvent,
    InboundRequest, ProviderAdapter, ProviderReply, Rejection, SignRequest,
};
use crate::secret::{Mac256, Secret};

const SIGNATURE_HEADER: &str = "X-Slack-Signature";
const TIMESTAMP_HEADER: &str = "X-Slack-Request-Timestamp";
const SIGNATURE_PREFIX: &str = "v0=";
const VERSION: &[u8] = b"v0";
const EVENT_ID_FIELD: &str = "body field `event_id`";
const TRIGGER_ID_FIELD: &str = "form field `trigger_id`";
const SLASH_COMMAND_TYPE: &str = "slash_command";

/// Slack's request signing (`provider = "slack"`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Slack {
    /// A JSON pointer (RFC 6901) to the key inside an interactivity `payload`;
    /// `None` means [`Slack::DEFAULT_INTERACTIVE_KEY`].
    pub interactive_key: Option<String>,
}

/// The three kinds of body Slack posts.
enum Body<'a> {
    /// Events API JSON (`event_callback`, `url_verification`, …).
    Events(Value),
    /// Interactivity: the decoded `payload` field.
    Interactive(Value),
    /// A slash command's form fields.
    SlashCommand(Vec<(Cow<'a, str>, Cow<'a, str>)>),
}

impl Slack {
    /// Where an interactivity payload's key is found unless the source says otherwise:
    /// `trigger_id`, unique per user interaction.
    pub const DEFAULT_INTERACTIVE_KEY: &'static str = "/trigger_id";

    fn interactive_pointer(&self) -> &str {
        self.interactive_key
            .as_deref()
            .unwrap_or(Self::DEFAULT_INTERACTIVE_KEY)
    }
}

impl ProviderAdapter for Slack {
    fn provider(&self) -> &'static str {
        "slack"
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
        let raw = req
            .headers
            .get(SIGNATURE_HEADER)
            .ok_or_else(|| Rejection::MissingSignature {
                header: SIGNATURE_HEADER.to_owned(),
            })?;
        let value = raw
            .to_str()
            .map_err(|_| malformed(SIGNATURE_HEADER, "is not visible ASCII"))?
            .trim();
        let hex_digest = value
            .strip_prefix(SIGNATURE_PREFIX)
            .ok_or_else(|| malformed(SIGNATURE_HEADER, "does not start with `v0=`"))?;
        let received =
            hex::decode(hex_digest).map_err(|_| malformed(SIGNATURE_HEADER, "is not hex"))?;
        // The timestamp text as sent is part of the signed bytes.
        let timestamp_text = header_str(req.headers, TIMESTAMP_HEADER)
            .ok_or_else(|| malformed(TIMESTAMP_HEADER, "is missing or not visible ASCII"))?;
        let timestamp_secs = timestamp_text
            .parse::<i64>()
            .map_err(|_| malformed(TIMESTAMP_HEADER, "is not an integer"))?;

        let matched = secrets.iter().any(|secret| {
            Mac256::compute(
                secret.expose(),
                &[VERSION, b":", timestamp_text.as_bytes(), b":", req.body],
            )
            .matches(&received)
        });
        if !matched {
            return Err(Rejection::InvalidSignature);
        }
        check_tolerance(timestamp_secs, req.now, tolerance)
    }

    fn extract(&self, req: &InboundRequest<'_>) -> Result<Vec<ExtractedEvent>, Rejection> {
        let event = match classify(req.body)? {
            // A body Slack sends with no event at all (`app_rate_limited`) has no `event_id`:
            // keyed by the body, so it is taken, not refused. An event callback must have one.
            Body::Events(body) => {
                let kind = body.get("type").and_then(Value::as_str);
                let eventless = body.get("event_id").is_none()
                    && kind.is_some_and(|k| k != "event_callback" && k != "url_verification");
                if eventless {
                    ExtractedEvent {
                        fingerprint: None,
                        key: body_key(req.body)?,
                        event_type: kind.map(str::to_owned),
                    }
                } else {
                    let id = body
                        .get("event_id")
                        .and_then(Value::as_str)
                        .ok_or_else(|| Rejection::MissingKey {
                            detail: EVENT_ID_FIELD.to_owned(),
                        })?;
                    ExtractedEvent {
                        fingerprint: None,
                        key: event_key(id, EVENT_ID_FIELD)?,
                        event_type: body
                            .pointer("/event/type")
                            .and_then(Value::as_str)
                            .map(str::to_owned),
                    }
                }
            }
            Body::Interactive(payload) => {
                let pointer = self.interactive_pointer();
                let place = format!("payload pointer {pointer}");
                let key = match payload.pointer(pointer) {
                    Some(Value::String(text)) => event_key(text, &place)?,
                    // Integer ids are keys too; floats are not (their text form is not stable).
                    Some(Value::Number(n)) if n.is_i64() || n.is_u64() => {
                        event_key(&n.to_string(), &place)?
                    }
                    // Some payloads carry no `trigger_id` by design (`view_closed`,
                    // `block_suggestion`): keyed by the body rather than refused, which Slack
                    // counts as a failure. A pointer the operator chose must find its key.
                    None if self.interactive_key.is_none() => body_key(req.body)?,
                    _ => return Err(Rejection::MissingKey { detail: place }),
                };
                ExtractedEvent {
                    fingerprint: None,
                    key,
                    event_type: payload
                        .get("type")
                        .and_then(Value::as_str)
                        .map(str::to_owned),
                }
            }
            Body::SlashCommand(fields) => {
                let trigger_id = fields
                    .iter()
                    .find(|(name, _)| name == "trigger_id")
                    .map(|(_, value)| value.as_ref())
                    .ok_or_else(|| Rejection::MissingKey {
                        detail: TRIGGER_ID_FIELD.to_owned(),
                    })?;
                ExtractedEvent {
                    fingerprint: None,
                    key: event_key(trigger_id, TRIGGER_ID_FIELD)?,
                    event_type: Some(SLASH_COMMAND_TYPE.to_owned()),
                }
            }
        };
        Ok(vec![event])
    }

    fn sign(&self, req: &SignRequest<'_>) -> Vec<(String, String)> {
        let timestamp = req.now.as_secs().to_string();
        let mac = Mac256::compute(
            req.secret.expose(),
            &[VERSION, b":", timestamp.as_bytes(), b":", req.body],
        );
        vec![
            (TIMESTAMP_HEADER.to_owned(), timestamp),
            (
                SIGNATURE_HEADER.to_owned(),
                format!("{SIGNATURE_PREFIX}{}", mac.to_hex()),
            ),
        ]
    }

    /// 7 days: Slack retries 3 times within about 5 minutes and offers no redelivery, so the
    /// minimum retention covers it with a wide margin.
    fn default_retention(&self) -> Duration {
        Duration::from_secs(7 * 24 * 3600)
    }

    /// `url_verification` (sent when the Request URL is saved) is answered with
    /// `{"challenge": …}` and stores nothing.
    fn handshake(&self, req: &InboundRequest<'_>) -> Option<ProviderReply> {
        let Ok(Body::Events(body)) = classify(req.body) else {
            return None;
        };
        if body.get("type").and_then(Value::as_str) != Some("url_verification") {
            return None;
        }
        let challenge = body.get("challenge")?.as_str()?;
        Some(ProviderReply::json(&json!({ "challenge": challenge })))
    }

    /// Slack checks a slash command's certificate with an unsigned form post carrying
    /// `ssl_check=1`; it only wants a 200. Nothing else in such a request is looked at.
    fn unsigned_probe(&self, req: &InboundRequest<'_>) -> Option<ProviderReply> {
        if is_json(req.body) {
            return None;
        }
        let ssl_check = form_urlencoded::parse(req.body).any(|(k, v)| k == "ssl_check" && v == "1");
        ssl_check.then(empty_ok)
    }

    /// Interactivity and slash commands get an empty 200: Slack would post any other body to
    /// the user as a message (slash commands) or refuse it (modal submissions). Events API
    /// deliveries get hooklatch's JSON, which Slack ignores.
    fn ack_reply(&self, req: &InboundRequest<'_>) -> Option<ProviderReply> {
        if is_json(req.body) {
            return None;
        }
        Some(empty_ok())
    }
}

/// An empty 200, the answer Slack wants to everything but Events API deliveries.
fn empty_ok() -> ProviderReply {
    ProviderReply {
        status: 200,
        content_type: "text/plain; charset=utf-8",
        body: Vec::new(),
    }
}

/// Whether a body is Events API JSON: its first non-whitespace byte is `{`. Slack's form
/// bodies start with a field name, never with `{`.
fn is_json(body: &[u8]) -> bool {
    body.iter().find(|b| !b.is_ascii_whitespace()) == Some(&b'{')
}

/// Reads a body as one of Slack's three shapes.
fn classify(body: &[u8]) -> Result<Body<'_>, Rejection> {
    if is_json(body) {
        return parse_json(body).map(Body::Events);
    }
    let fields: Vec<(Cow<'_, str>, Cow<'_, str>)> = form_urlencoded::parse(body).collect();
    match fields.iter().find(|(name, _)| name == "payload") {
        Some((_, payload)) => parse_json(payload.as_bytes()).map(Body::Interactive),
        None => Ok(Body::SlashCommand(fields)),
    }
}

#[cfg(test)]
mod tests {
    use http::{HeaderMap, HeaderValue};
    use proptest::prelude::*;

    use super::*;
    use crate::provider::test_support::headers;
    use crate::time::Timestamp;

    const NOW: i64 = 1_700_000_000;
    const TOLERANCE: Duration = Duration::from_secs(300);
    const OLD: &str = "0ld51gn1ngs3cr3t0ld51gn1ngs3cr3t";
    const NEW: &str = "n3w51gn1ngs3cr3tn3w51gn1ngs3cr3t";
    const EVENT_BODY: &[u8] = br#"{"token":"XXYYZZ","team_id":"T0001","api_app_id":"A0001","event":{"type":"app_mention","user":"U0001","text":"<@U0LAN0Z89> is it everything a river should be?","ts":"1515449522.000016","channel":"C0001","event_ts":"1515449522000016"},"type":"event_callback","event_id":"Ev0LAN670R","event_time":1515449522000016,"authed_users":["U0LAN0Z89"]}"#;
    const CHALLENGE_BODY: &[u8] = br#"{"token":"Jhj5dZrVaK7ZwHHjRyZWjbDl","challenge":"3eZbrw1aBm2rZgRNFdxV2595E9CY3gmdALWMmHkvFXO7tYXAYM8P","type":"url_verification"}"#;

    /// From the Slack docs, reproduced in python-slack-sdk's signature verifier tests.
    const VECTOR_SECRET: &str = "8f742231b10e8888abcd99yyyzzz85a5";
    const VECTOR_TIMESTAMP: &str = "1531420618";
    const VECTOR_BODY: &[u8] = b"token=xyzz0WbapA4vBCDEFasx0q6G&team_id=T1DC2JH3J&team_domain=testteamnow&channel_id=G8PSS9T3V&channel_name=foobar&user_id=U2CERLKJA&user_name=roadrunner&command=%2Fwebhook-collect&text=&response_url=https%3A%2F%2Fhooks.slack.com%2Fcommands%2FT1DC2JH3J%2F397700885554%2F96rGlfmibIGlgcZRskXaIFfN&trigger_id=398738663015.47445629121.803a0bc887a14d10d2c447fce8b6703c";
    const VECTOR_SIGNATURE: &str =
        "v0=a2114d57b48eac39b9ad189dd8316235a7b4a8d21a10bd27519666489c69b503";

    fn request_at<'a>(now: i64, headers: &'a HeaderMap, body: &'a [u8]) -> InboundRequest<'a> {
        InboundRequest {
            path_and_query: "/in/test",
            headers,
            body,
            now: Timestamp::from_secs(now),
        }
    }

    /// The headers Slack would send for `body`, signed at `signed_at`.
    fn sign(secret: &str, signed_at: i64, body: &[u8]) -> Vec<(String, String)> {
        let secret = Secret::from_text(secret);
        Slack::default().sign(&SignRequest {
            url: "http://127.0.0.1:8080/in/test",
            body,
            secret: &secret,
            now: Timestamp::from_secs(signed_at),
            event_key: "Ev0LAN670R",
            event_type: Some("app_mention"),
        })
    }

    /// `(timestamp, signature)` as signed at `signed_at`.
    fn signed(secret: &str, signed_at: i64, body: &[u8]) -> (String, String) {
        let headers = sign(secret, signed_at, body);
        assert_eq!(headers[0].0, TIMESTAMP_HEADER);
        assert_eq!(headers[1].0, SIGNATURE_HEADER);
        (headers[0].1.clone(), headers[1].1.clone())
    }

    fn verify_at(
        now: i64,
        timestamp: Option<&str>,
        signature: Option<&str>,
        body: &[u8],
        secrets: &[&str],
    ) -> Result<(), Rejection> {
        let mut pairs = Vec::new();
        if let Some(ts) = timestamp {
            pairs.push((TIMESTAMP_HEADER, ts));
        }
        if let Some(sig) = signature {
            pairs.push((SIGNATURE_HEADER, sig));
        }
        let headers = headers(&pairs);
        let secrets: Vec<Secret> = secrets.iter().map(|s| Secret::from_text(s)).collect();
        Slack::default().verify(&request_at(now, &headers, body), &secrets, TOLERANCE)
    }

    #[track_caller]
    fn check(
        (timestamp, signature): (&str, &str),
        body: &[u8],
        secrets: &[&str],
        expect: Result<(), &str>,
    ) {
        let got = verify_at(NOW, Some(timestamp), Some(signature), body, secrets);
        assert_eq!(
            got.as_ref().map_err(Rejection::code).copied(),
            expect,
            "{got:?}"
        );
    }

    #[track_caller]
    fn check_signed(
        secret: &str,
        signed_at: i64,
        body: &[u8],
        secrets: &[&str],
        expect: Result<(), &str>,
    ) {
        let (ts, sig) = signed(secret, signed_at, body);
        check((&ts, &sig), body, secrets, expect);
    }

    fn extract_with(slack: &Slack, body: &[u8]) -> Result<Vec<ExtractedEvent>, Rejection> {
        let headers = HeaderMap::new();
        slack.extract(&request_at(NOW, &headers, body))
    }

    fn extract(body: &[u8]) -> Result<Vec<ExtractedEvent>, Rejection> {
        extract_with(&Slack::default(), body)
    }

    #[track_caller]
    fn check_key(body: &[u8], key: &str, event_type: Option<&str>) {
        let events = extract(body).unwrap();
        assert_eq!(events.len(), 1);
        assert_eq!(events[0].key.as_str(), key);
        assert_eq!(events[0].event_type.as_deref(), event_type);
    }

    /// An interactivity body: `payload=<url-encoded JSON>`.
    fn interactive(payload: &str) -> Vec<u8> {
        form_urlencoded::Serializer::new(String::new())
            .append_pair("payload", payload)
            .finish()
            .into_bytes()
    }

    #[test]
    fn the_slack_docs_vector_signs_and_verifies_at_its_timestamp() {
        let now: i64 = VECTOR_TIMESTAMP.parse().unwrap();
        assert_eq!(
            signed(VECTOR_SECRET, now, VECTOR_BODY),
            (VECTOR_TIMESTAMP.to_owned(), VECTOR_SIGNATURE.to_owned())
        );
        assert_eq!(
            verify_at(
                now,
                Some(VECTOR_TIMESTAMP),
                Some(VECTOR_SIGNATURE),
                VECTOR_BODY,
                &[VECTOR_SECRET]
            ),
            Ok(())
        );
    }

    #[test]
    fn a_signed_event_verifies() {
        check_signed(NEW, NOW, EVENT_BODY, &[NEW], Ok(()));
        let (ts, sig) = signed(NEW, NOW, EVENT_BODY);
        check(
            (&ts, &sig.to_uppercase().replace("V0=", "v0=")),
            EVENT_BODY,
            &[NEW],
            Ok(()),
        );
    }

    #[test]
    fn a_wrong_secret_tampered_body_or_replayed_timestamp_is_an_invalid_signature() {
        check_signed(NEW, NOW, EVENT_BODY, &[OLD], Err("invalid_signature"));
        check_signed(NEW, NOW, EVENT_BODY, &[], Err("invalid_signature"));
        let (ts, sig) = signed(NEW, NOW, EVENT_BODY);
        let tampered = String::from_utf8_lossy(EVENT_BODY).replace("Ev0LAN670R", "Ev0LAN670S");
        check(
            (&ts, &sig),
            tampered.as_bytes(),
            &[NEW],
            Err("invalid_signature"),
        );
        // The signature covers the timestamp: a replay with a fresh one does not verify.
        let (_, old_sig) = signed(NEW, NOW - 1000, EVENT_BODY);
        check(
            (&NOW.to_string(), &old_sig),
            EVENT_BODY,
            &[NEW],
            Err("invalid_signature"),
        );
    }

    #[test]
    fn a_missing_signature_header_is_a_missing_signature() {
        assert_eq!(
            verify_at(NOW, Some(&NOW.to_string()), None, EVENT_BODY, &[NEW]),
            Err(Rejection::MissingSignature {
                header: "X-Slack-Signature".to_owned()
            })
        );
        // An unsigned `ssl_check` is no exception.
        assert_eq!(
            verify_at(NOW, None, None, b"ssl_check=1&token=x", &[NEW]).map_err(|r| r.code()),
            Err("missing_signature")
        );
    }

    #[test]
    fn a_missing_or_bad_timestamp_or_a_bad_signature_is_malformed() {
        let (ts, sig) = signed(NEW, NOW, EVENT_BODY);
        assert_eq!(
            verify_at(NOW, None, Some(&sig), EVENT_BODY, &[NEW]).map_err(|r| r.code()),
            Err("malformed_signature")
        );
        let bare = sig.trim_start_matches("v0=").to_owned();
        for (timestamp, signature) in [
            ("yesterday", sig.as_str()),
            ("", sig.as_str()),
            ("1.5e9", sig.as_str()),
            (ts.as_str(), bare.as_str()),
            (ts.as_str(), "v1=00"),
            (ts.as_str(), "sha256=00"),
            (ts.as_str(), "v0=xyz"),
            (ts.as_str(), "v0=abc"),
        ] {
            check(
                (timestamp, signature),
                EVENT_BODY,
                &[NEW],
                Err("malformed_signature"),
            );
        }
        check((&ts, "v0="), EVENT_BODY, &[NEW], Err("invalid_signature"));
    }

    #[test]
    fn a_malformed_detail_never_echoes_the_signature_or_timestamp() {
        let (_, sig) = signed(NEW, NOW, EVENT_BODY);
        let Err(Rejection::MalformedSignature { detail }) =
            verify_at(NOW, Some("soon"), Some(&sig), EVENT_BODY, &[NEW])
        else {
            panic!("expected a malformed signature");
        };
        assert!(
            !detail.contains("soon") && !detail.contains(&sig[3..]),
            "{detail}"
        );
    }

    #[test]
    fn rotation_accepts_any_configured_secret() {
        check_signed(OLD, NOW, EVENT_BODY, &[OLD, NEW], Ok(()));
        check_signed(NEW, NOW, EVENT_BODY, &[OLD, NEW], Ok(()));
        check_signed(OLD, NOW, EVENT_BODY, &[NEW], Err("invalid_signature"));
    }

    #[test]
    fn timestamps_within_the_tolerance_pass_in_both_directions() {
        check_signed(NEW, NOW - 299, EVENT_BODY, &[NEW], Ok(()));
        check_signed(NEW, NOW + 299, EVENT_BODY, &[NEW], Ok(()));
        for skew_secs in [-301, 301] {
            let (ts, sig) = signed(NEW, NOW + skew_secs, EVENT_BODY);
            assert_eq!(
                verify_at(NOW, Some(&ts), Some(&sig), EVENT_BODY, &[NEW]),
                Err(Rejection::StaleTimestamp {
                    skew_secs,
                    tolerance_secs: 300
                })
            );
        }
    }

    #[test]
    fn the_signature_is_checked_before_the_timestamp() {
        check_signed(
            OLD,
            NOW - 1000,
            EVENT_BODY,
            &[NEW],
            Err("invalid_signature"),
        );
    }

    #[test]
    fn url_verification_is_answered_with_the_challenge() {
        let headers = HeaderMap::new();
        let reply = Slack::default()
            .handshake(&request_at(NOW, &headers, CHALLENGE_BODY))
            .expect("a handshake");
        assert_eq!(reply.status, 200);
        assert_eq!(reply.content_type, "application/json");
        let body: Value = serde_json::from_slice(&reply.body).unwrap();
        assert_eq!(
            body,
            json!({"challenge": "3eZbrw1aBm2rZgRNFdxV2595E9CY3gmdALWMmHkvFXO7tYXAYM8P"})
        );
    }

    #[test]
    fn events_interactivity_and_slash_commands_are_not_handshakes() {
        let headers = HeaderMap::new();
        for body in [
            EVENT_BODY.to_vec(),
            VECTOR_BODY.to_vec(),
            interactive(r#"{"type":"url_verification","challenge":"x"}"#),
            br#"{"type":"url_verification"}"#.to_vec(),
            b"{not json".to_vec(),
            Vec::new(),
        ] {
            assert_eq!(
                Slack::default().handshake(&request_at(NOW, &headers, &body)),
                None,
                "{}",
                String::from_utf8_lossy(&body)
            );
        }
    }

    #[test]
    fn an_event_callback_is_keyed_by_event_id_and_typed_by_the_inner_event() {
        check_key(EVENT_BODY, "Ev0LAN670R", Some("app_mention"));
        check_key(
            br#" {"event_id":"Ev2","type":"event_callback"}"#,
            "Ev2",
            None,
        );
    }

    #[test]
    fn an_events_body_without_event_id_is_a_missing_key() {
        let missing = Err(Rejection::MissingKey {
            detail: "body field `event_id`".to_owned(),
        });
        assert_eq!(extract(CHALLENGE_BODY), missing);
        assert_eq!(
            extract(br#"{"type":"event_callback","event_id":7}"#),
            missing
        );
        assert_eq!(
            extract(br#"{"event_id":""}"#).map_err(|r| r.code()),
            Err("missing_event_key")
        );
    }

    #[test]
    fn a_json_body_that_does_not_parse_is_invalid_json() {
        assert_eq!(
            extract(b"{\"event_id\":").map_err(|r| r.code()),
            Err("invalid_json")
        );
    }

    #[test]
    fn an_interactivity_payload_is_keyed_by_its_trigger_id() {
        let body = interactive(
            r#"{"type":"block_actions","trigger_id":"12466734323.1395872398.7b83e4d1f7a3b5c0d9e2f1a0b9c8d7e6","user":{"id":"U0001"},"actions":[{"action_id":"approve","action_ts":"1700000000.000100"}]}"#,
        );
        check_key(
            &body,
            "12466734323.1395872398.7b83e4d1f7a3b5c0d9e2f1a0b9c8d7e6",
            Some("block_actions"),
        );
    }

    #[test]
    fn the_interactivity_key_pointer_is_configurable() {
        let slack = Slack {
            interactive_key: Some("/actions/0/action_ts".to_owned()),
        };
        let body = interactive(
            r#"{"type":"block_actions","trigger_id":"t1","actions":[{"action_ts":"1700000000.000100"}]}"#,
        );
        let events = extract_with(&slack, &body).unwrap();
        assert_eq!(events[0].key.as_str(), "1700000000.000100");

        let numeric = Slack {
            interactive_key: Some("/n".to_owned()),
        };
        let events = extract_with(&numeric, &interactive(r#"{"type":"x","n":42}"#)).unwrap();
        assert_eq!(events[0].key.as_str(), "42");
    }

    #[test]
    fn an_interactivity_payload_without_the_key_is_a_missing_key() {
        let missing = Err(Rejection::MissingKey {
            detail: "payload pointer /trigger_id".to_owned(),
        });
        // No trigger_id by design (view_closed, block_suggestion): keyed by the body.
        let closed = interactive(r#"{"type":"view_closed"}"#);
        check_key(
            &closed,
            &format!("body:{}", hex::encode(crate::secret::sha256(&closed))),
            Some("view_closed"),
        );
        // An Events API body without an event (app_rate_limited): keyed by the body too.
        let limited = br#"{"token":"t","type":"app_rate_limited","team_id":"T1","minute_rate_limited":1518467820,"api_app_id":"A1"}"#;
        check_key(
            limited,
            &format!("body:{}", hex::encode(crate::secret::sha256(limited))),
            Some("app_rate_limited"),
        );
        assert_eq!(
            extract(&interactive(r#"{"type":"x","trigger_id":1.5}"#)),
            missing
        );
        let bad_pointer = Slack {
            interactive_key: Some("trigger_id".to_owned()),
        };
        assert_eq!(
            extract_with(&bad_pointer, &interactive(r#"{"trigger_id":"t"}"#)).map_err(|r| r.code()),
            Err("missing_event_key")
        );
    }

    #[test]
    fn an_interactivity_payload_that_is_not_json_is_invalid_json() {
        assert_eq!(
            extract(b"payload=not%20json").map_err(|r| r.code()),
            Err("invalid_json")
        );
    }

    #[test]
    fn a_slash_command_is_keyed_by_its_trigger_id() {
        check_key(
            VECTOR_BODY,
            "398738663015.47445629121.803a0bc887a14d10d2c447fce8b6703c",
            Some("slash_command"),
        );
    }

    #[test]
    fn a_form_without_payload_or_trigger_id_is_a_missing_key() {
        for body in [&b"command=%2Fdeploy&text=now"[..], b"", b"ssl_check=1"] {
            assert_eq!(
                extract(body),
                Err(Rejection::MissingKey {
                    detail: "form field `trigger_id`".to_owned()
                })
            );
        }
    }

    #[test]
    fn forms_are_acknowledged_with_an_empty_200_and_events_with_hooklatch_json() {
        let headers = HeaderMap::new();
        let slack = Slack::default();
        let form_reply = slack
            .ack_reply(&request_at(NOW, &headers, VECTOR_BODY))
            .expect("an empty ack");
        assert_eq!((form_reply.status, form_reply.body.len()), (200, 0));
        assert!(slack
            .ack_reply(&request_at(NOW, &headers, &interactive("{}")))
            .is_some());
        assert_eq!(
            slack.ack_reply(&request_at(NOW, &headers, EVENT_BODY)),
            None
        );
    }

    #[test]
    fn signing_round_trips_through_verify_and_extract() {
        let signed = sign(NEW, NOW, EVENT_BODY);
        let pairs: Vec<(&str, &str)> = signed
            .iter()
            .map(|(n, v)| (n.as_str(), v.as_str()))
            .collect();
        let headers = headers(&pairs);
        let req = request_at(NOW, &headers, EVENT_BODY);
        let slack = Slack::default();
        assert_eq!(
            slack.verify(&req, &[Secret::from_text(NEW)], TOLERANCE),
            Ok(())
        );
        assert_eq!(slack.extract(&req).unwrap()[0].key.as_str(), "Ev0LAN670R");
    }

    proptest! {
        #[test]
        fn arbitrary_headers_and_bodies_never_panic(
            timestamp in prop_oneof!["[ -~]{0,24}", "-?[0-9]{1,20}"],
            signature in prop_oneof!["[ -~]{0,100}", "v0=[0-9a-fA-F]{0,66}"],
            body in proptest::collection::vec(any::<u8>(), 0..64),
        ) {
            let _ = verify_at(NOW, Some(&timestamp), Some(&signature), &body, &[NEW, OLD]);
            let _ = extract(&body);
            let headers = HeaderMap::new();
            let _ = Slack::default().handshake(&request_at(NOW, &headers, &body));
        }

        #[test]
        fn arbitrary_form_bodies_never_panic(
            fields in proptest::collection::vec(
                (prop_oneof!["payload", "trigger_id", "[a-z_]{0,8}"], "\\PC{0,24}"),
                0..4,
            ),
            pointer in "\\PC{0,12}",
        ) {
            let mut form = form_urlencoded::Serializer::new(String::new());
            for (name, value) in &fields {
                form.append_pair(name, value);
            }
            let body = form.finish();
            let slack = Slack { interactive_key: Some(pointer) };
            let _ = extract_with(&slack, body.as_bytes());
        }

        #[test]
        fn non_ascii_signature_bytes_are_malformed(
            bytes in proptest::collection::vec(0x80u8..=0xff, 1..32),
        ) {
            let mut headers = HeaderMap::new();
            headers.insert(TIMESTAMP_HEADER, HeaderValue::from_str(&NOW.to_string()).unwrap());
            headers.insert(SIGNATURE_HEADER, HeaderValue::from_bytes(&bytes).unwrap());
            let got = Slack::default().verify(&request_at(NOW, &headers, EVENT_BODY), &[Secret::from_text(NEW)], TOLERANCE);
            prop_assert_eq!(got.map_err(|r| r.code()), Err("malformed_signature"));
        }

        #[test]
        fn arbitrary_signature_bytes_never_verify(
            sig in proptest::collection::vec(any::<u8>(), 0..64),
        ) {
            let signature = format!("v0={}", hex::encode(&sig));
            prop_assert_eq!(
                verify_at(NOW, Some(&NOW.to_string()), Some(&signature), EVENT_BODY, &[NEW, OLD]),
                Err(Rejection::InvalidSignature)
            );
        }
    }

    #[test]
    fn an_unsigned_ssl_check_is_a_probe_and_nothing_else_is() {
        let none = HeaderMap::new();
        let probe =
            |body: &'static [u8]| Slack::default().unsigned_probe(&request_at(NOW, &none, body));
        let reply = probe(b"ssl_check=1&token=XXYYZZ").expect("ssl_check=1 is a probe");
        assert_eq!((reply.status, reply.body.as_slice()), (200, &b""[..]));
        assert!(probe(b"ssl_check=0&token=XXYYZZ").is_none());
        assert!(probe(VECTOR_BODY).is_none(), "a slash command is verified");
        assert!(
            probe(br#"{"ssl_check":"1"}"#).is_none(),
            "JSON is never a probe"
        );
    }
}
