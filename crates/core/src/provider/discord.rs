//! Discord interactions endpoint: `X-Signature-Ed25519` is a hex Ed25519 signature over
//! `{X-Signature-Timestamp}{raw body}` (no separator), checked with the application's public
//! key ([`Discord::public_key`], 32 bytes, hex in the Developer Portal) using `verify_strict`
//! (no malleable signatures, no small-order keys). The configured `secrets` are not used to
//! verify: the key is public and lives in the source's settings.
//!
//! Discord documents no timestamp window and discord-interactions enforces none; the timestamp
//! (unix seconds) is still checked against the source's tolerance in both directions, after
//! the signature, so a captured interaction cannot be replayed later.
//!
//! Discord needs a synchronous answer within 3 s:
//! - a PING (`type` 1) is a handshake: answered with PONG `{"type": 1}`, nothing stored;
//! - every stored interaction is acknowledged with [`Discord::deferred_response`] when
//!   configured, otherwise a deferred response: type 5 (`DEFERRED_CHANNEL_MESSAGE_WITH_SOURCE`)
//!   for application commands (2), modal submits (5) and unknown types, type 6
//!   (`DEFERRED_UPDATE_MESSAGE`) for message components (3). The real reply is sent later
//!   through the interaction token (valid for 15 minutes);
//! - autocomplete (4) cannot be deferred: it always gets an empty choice list
//!   (`{"type": 8, "data": {"choices": []}}`), even when `deferred_response` is configured.
//!
//! Event key: the body's `id` (the interaction snowflake). Event type:
//! `application_command.{data.name}`, `message_component`,
//! `application_command_autocomplete.{data.name}`, `modal_submit`, `ping`, or
//! `interaction.{type}` for a type this adapter does not know.
//!
//! The same source also takes Discord's Webhook Events (a separate URL in the Developer
//! Portal, signed the same way), told apart by their shape: an outer `version`,
//! `application_id` and `type` with no interaction `id` or `token`. Their PING (`type` 0) is a
//! handshake answered 204 with no body; an event (`type` 1, `event{type, timestamp, data}`)
//! carries no id, so its key is `body:` and the SHA-256 of the body (a retry sends the same
//! bytes), its type `event.type`, and it is acknowledged 204 with no body.

use std::time::Duration;

use ed25519_dalek::{Signature, Signer, SigningKey, VerifyingKey};
use serde_json::{json, Value};

use crate::provider::{
    body_key, check_tolerance, event_key, header_str, malformed, parse_json, ExtractedEvent,
    InboundRequest, ProviderAdapter, ProviderReply, Rejection, SignRequest,
};
use crate::secret::Secret;

const SIGNATURE_HEADER: &str = "X-Signature-Ed25519";
const TIMESTAMP_HEADER: &str = "X-Signature-Timestamp";
const KEY_FIELD: &str = "body field `id`";

const PING: u64 = 1;
/// A Webhook Events PING (their events are `type` 1, like an interaction PING).
const WEBHOOK_PING: u64 = 0;
const APPLICATION_COMMAND: u64 = 2;
const MESSAGE_COMPONENT: u64 = 3;
const AUTOCOMPLETE: u64 = 4;
const MODAL_SUBMIT: u64 = 5;

/// Discord's interactions endpoint (`provider = "discord"`).
#[derive(Debug, Clone)]
pub struct Discord {
    /// The application's public key.
    pub public_key: VerifyingKey,
    /// The answer to every stored interaction except autocomplete; `None`: a deferred response
    /// by interaction type (5, or 6 for components).
    pub deferred_response: Option<Value>,
}

impl Discord {
    /// An adapter for the public key as shown in the Developer Portal (64 hex characters),
    /// with the default deferred responses.
    pub fn from_hex(public_key_hex: &str) -> Result<Discord, String> {
        let bytes = hex::decode(public_key_hex.trim())
            .map_err(|_| "the Discord public key is not hex".to_owned())?;
        let bytes: [u8; 32] = bytes.try_into().map_err(|_| {
            "the Discord public key must be 32 bytes (64 hex characters)".to_owned()
        })?;
        let public_key = VerifyingKey::from_bytes(&bytes)
            .map_err(|_| "the Discord public key is not a valid Ed25519 key".to_owned())?;
        if public_key.is_weak() {
            return Err("the Discord public key is a weak (small-order) Ed25519 key".to_owned());
        }
        Ok(Discord {
            public_key,
            deferred_response: None,
        })
    }
}

impl ProviderAdapter for Discord {
    fn provider(&self) -> &'static str {
        "discord"
    }

    fn signature_headers(&self) -> Vec<&str> {
        vec![SIGNATURE_HEADER]
    }

    fn verify(
        &self,
        req: &InboundRequest<'_>,
        _secrets: &[Secret],
        tolerance: Duration,
    ) -> Result<(), Rejection> {
        let signature = required_header(req, SIGNATURE_HEADER)?;
        let timestamp = required_header(req, TIMESTAMP_HEADER)?;
        let signature: [u8; 64] = hex::decode(signature.trim())
            .ok()
            .and_then(|bytes| bytes.try_into().ok())
            .ok_or_else(|| malformed(SIGNATURE_HEADER, "is not 64 bytes of hex"))?;
        let timestamp_secs = timestamp
            .parse::<i64>()
            .map_err(|_| malformed(TIMESTAMP_HEADER, "is not an integer"))?;

        if !signature_matches(&self.public_key, timestamp.as_bytes(), req.body, &signature) {
            return Err(Rejection::InvalidSignature);
        }
        check_tolerance(timestamp_secs, req.now, tolerance)
    }

    fn extract(&self, req: &InboundRequest<'_>) -> Result<Vec<ExtractedEvent>, Rejection> {
        let body = parse_json(req.body)?;
        if is_webhook_event(&body) {
            let event_type = body
                .pointer("/event/type")
                .and_then(Value::as_str)
                .map_or_else(|| "webhook_event".to_owned(), str::to_owned);
            return Ok(vec![ExtractedEvent {
                fingerprint: None,
                key: body_key(req.body)?,
                event_type: Some(event_type),
            }]);
        }
        let id = body
            .get("id")
            .and_then(Value::as_str)
            .ok_or_else(|| Rejection::MissingKey {
                detail: KEY_FIELD.to_owned(),
            })?;
        let name = body
            .get("data")
            .and_then(|data| data.get("name"))
            .and_then(Value::as_str);
        let event_type = match (interaction_type(&body), name) {
            (Some(APPLICATION_COMMAND), Some(name)) => format!("application_command.{name}"),
            (Some(APPLICATION_COMMAND), None) => "application_command".to_owned(),
            (Some(MESSAGE_COMPONENT), _) => "message_component".to_owned(),
            (Some(AUTOCOMPLETE), Some(name)) => format!("application_command_autocomplete.{name}"),
            (Some(AUTOCOMPLETE), None) => "application_command_autocomplete".to_owned(),
            (Some(MODAL_SUBMIT), _) => "modal_submit".to_owned(),
            (Some(PING), _) => "ping".to_owned(),
            (Some(other), _) => format!("interaction.{other}"),
            (None, _) => "interaction".to_owned(),
        };
        Ok(vec![ExtractedEvent {
            fingerprint: None,
            key: event_key(id, KEY_FIELD)?,
            event_type: Some(event_type),
        }])
    }

    /// The secret is the Ed25519 private key seed, 64 hex characters. A secret that is not
    /// such a seed cannot sign; since signing cannot fail, the signature is then 64 zero bytes,
    /// which `verify_strict` refuses under every key (its `R` is a small-order point), so the
    /// test event is rejected as an invalid signature rather than silently accepted.
    fn sign(&self, req: &SignRequest<'_>) -> Vec<(String, String)> {
        let timestamp = req.now.as_secs().to_string();
        let signature = match seed(req.secret) {
            Some(seed) => {
                let mut message = timestamp.as_bytes().to_vec();
                message.extend_from_slice(req.body);
                SigningKey::from_bytes(&seed).sign(&message).to_bytes()
            }
            None => [0; 64],
        };
        vec![
            (SIGNATURE_HEADER.to_owned(), hex::encode(signature)),
            (TIMESTAMP_HEADER.to_owned(), timestamp),
        ]
    }

    /// 7 days: Discord does not retry interactions.
    fn default_retention(&self) -> Duration {
        Duration::from_secs(7 * 24 * 3600)
    }

    fn handshake(&self, req: &InboundRequest<'_>) -> Option<ProviderReply> {
        let body = serde_json::from_slice::<Value>(req.body).ok()?;
        if is_webhook_event(&body) {
            return (interaction_type(&body) == Some(WEBHOOK_PING)).then(no_content);
        }
        (interaction_type(&body) == Some(PING)).then(pong)
    }

    fn ack_reply(&self, req: &InboundRequest<'_>) -> Option<ProviderReply> {
        let body = serde_json::from_slice::<Value>(req.body).ok();
        if body.as_ref().is_some_and(is_webhook_event) {
            return Some(no_content());
        }
        let kind = body.and_then(|body| interaction_type(&body));
        let reply = match (kind, &self.deferred_response) {
            (Some(PING), _) => return Some(pong()),
            (Some(AUTOCOMPLETE), _) => json!({"type": 8, "data": {"choices": []}}),
            (_, Some(configured)) => configured.clone(),
            (Some(MESSAGE_COMPONENT), None) => json!({"type": 6}),
            (_, None) => json!({"type": 5}),
        };
        Some(ProviderReply::json(&reply))
    }
}

fn pong() -> ProviderReply {
    ProviderReply::json(&json!({"type": 1}))
}

/// What Discord's Webhook Events want back, for their PING and for every event.
fn no_content() -> ProviderReply {
    ProviderReply {
        status: 204,
        content_type: "text/plain; charset=utf-8",
        body: Vec::new(),
    }
}

/// Whether `body` is a Webhook Events payload rather than an interaction: no interaction
/// `id` or `token`, and a PING (`type` 0) or an `event`.
fn is_webhook_event(body: &Value) -> bool {
    body.get("id").is_none()
        && body.get("token").is_none()
        && (interaction_type(body) == Some(WEBHOOK_PING) || body.get("event").is_some())
}

fn interaction_type(body: &Value) -> Option<u64> {
    body.get("type").and_then(Value::as_u64)
}

/// Whether `signature` is a valid strict Ed25519 signature of `{timestamp}{body}`.
fn signature_matches(
    key: &VerifyingKey,
    timestamp: &[u8],
    body: &[u8],
    signature: &[u8; 64],
) -> bool {
    let mut message = Vec::with_capacity(timestamp.len() + body.len());
    message.extend_from_slice(timestamp);
    message.extend_from_slice(body);
    key.verify_strict(&message, &Signature::from_bytes(signature))
        .is_ok()
}

/// The 32-byte seed in a signing secret written as 64 hex characters.
fn seed(secret: &Secret) -> Option<[u8; 32]> {
    let text = secret.expose_text()?.trim();
    hex::decode(text).ok()?.try_into().ok()
}

fn required_header<'a>(req: &InboundRequest<'a>, name: &str) -> Result<&'a str, Rejection> {
    if !req.headers.contains_key(name) {
        return Err(Rejection::MissingSignature {
            header: name.to_owned(),
        });
    }
    header_str(req.headers, name).ok_or_else(|| malformed(name, "is not visible ASCII"))
}

#[cfg(test)]
mod tests {
    use http::HeaderMap;
    use proptest::prelude::*;

    use super::*;
    use crate::provider::test_support::headers;
    use crate::time::Timestamp;

    const NOW: i64 = 1_700_000_000;
    const TOLERANCE: Duration = Duration::from_secs(300);
    const SEED: [u8; 32] = [7; 32];
    const OTHER_SEED: [u8; 32] = [9; 32];

    /// RFC 8032 section 7.1, TEST 1.
    const RFC_SECRET: &str = "9d61b19deffd5a60ba844af492ec2cc44449c5697b326919703bac031cae7f60";
    const RFC_PUBLIC: &str = "d75a980182b10ab7d54bfed3c964073a0ee172f3daa62325af021a68f707511a";
    const RFC_SIGNATURE: &str = "e5564300c360ac729086e2cc806e828a84877f1eb8e5d974d873e065224901555fb8821590a33bacc61e39701cf9b46bd25bf5f0595bbe24655141438e7a100b";

    const COMMAND: &[u8] = br#"{"id":"1234567890123456789","application_id":"111","type":2,"data":{"id":"222","name":"book","type":1},"token":"tok","version":1}"#;
    const COMPONENT: &[u8] = br#"{"id":"1234567890123456790","application_id":"111","type":3,"data":{"custom_id":"confirm","component_type":2},"token":"tok","version":1}"#;
    const PING_BODY: &[u8] = br#"{"id":"1234567890123456791","application_id":"111","type":1,"token":"tok","version":1}"#;

    /// Discord's Webhook Events (a URL of their own): a PING answered 204 with no body, and
    /// an event, which carries no id, keyed by its body and acknowledged 204; neither is taken
    /// for an interaction.
    #[test]
    fn webhook_events_are_told_from_interactions() {
        let adapter = discord(SEED);
        let empty = HeaderMap::new();
        let ping = br#"{"version":1,"application_id":"111","type":0}"#;
        let reply = adapter
            .handshake(&request(&empty, ping))
            .expect("a handshake");
        assert_eq!((reply.status, reply.body.len()), (204, 0));

        let event = br#"{"version":1,"application_id":"111","type":1,"event":{"type":"APPLICATION_AUTHORIZED","timestamp":"2026-12-07T06:00:00.000000+00:00","data":{"user":{"id":"42"}}}}"#;
        let req = request(&empty, event);
        assert_eq!(adapter.handshake(&req), None, "an event, not a PING");
        let events = adapter.extract(&req).expect("an event");
        assert_eq!(events.len(), 1);
        assert_eq!(
            events[0].key.as_str(),
            format!("body:{}", hex::encode(crate::secret::sha256(event)))
        );
        assert_eq!(
            events[0].event_type.as_deref(),
            Some("APPLICATION_AUTHORIZED")
        );
        let ack = adapter.ack_reply(&req).expect("an answer");
        assert_eq!((ack.status, ack.body.len()), (204, 0));

        // An interaction PING is still one.
        let reply = adapter
            .handshake(&request(&empty, PING_BODY))
            .expect("a PONG");
        assert_eq!((reply.status, reply.body), (200, br#"{"type":1}"#.to_vec()));
    }

    fn discord(seed: [u8; 32]) -> Discord {
        Discord {
            public_key: SigningKey::from_bytes(&seed).verifying_key(),
            deferred_response: None,
        }
    }

    fn seed_secret(seed: [u8; 32]) -> Secret {
        Secret::from_text(&hex::encode(seed))
    }

    /// `(X-Signature-Ed25519, X-Signature-Timestamp)` as Discord would send them.
    fn signed(seed: [u8; 32], at: i64, body: &[u8]) -> (String, String) {
        let secret = seed_secret(seed);
        let headers = discord(seed).sign(&SignRequest {
            url: "http://127.0.0.1:8080/in/discord",
            body,
            secret: &secret,
            now: Timestamp::from_secs(at),
            event_key: "1",
            event_type: None,
        });
        assert_eq!(headers[0].0, SIGNATURE_HEADER);
        assert_eq!(headers[1].0, TIMESTAMP_HEADER);
        (headers[0].1.clone(), headers[1].1.clone())
    }

    fn request<'a>(headers: &'a HeaderMap, body: &'a [u8]) -> InboundRequest<'a> {
        InboundRequest {
            path_and_query: "/in/discord",
            headers,
            body,
            now: Timestamp::from_secs(NOW),
        }
    }

    fn verify(
        adapter: &Discord,
        signature: Option<&str>,
        timestamp: Option<&str>,
        body: &[u8],
    ) -> Result<(), Rejection> {
        let mut pairs = Vec::new();
        pairs.extend(signature.map(|s| (SIGNATURE_HEADER, s)));
        pairs.extend(timestamp.map(|t| (TIMESTAMP_HEADER, t)));
        let headers = headers(&pairs);
        // Secrets play no part: an unrelated one is passed to show it.
        adapter.verify(
            &request(&headers, body),
            &[Secret::from_text("unused")],
            TOLERANCE,
        )
    }

    #[track_caller]
    fn check(signature: &str, timestamp: &str, body: &[u8], expect: Result<(), &str>) {
        let got = verify(&discord(SEED), Some(signature), Some(timestamp), body);
        assert_eq!(
            got.as_ref().map_err(Rejection::code).copied(),
            expect,
            "{got:?}"
        );
    }

    fn reply_of(adapter: &Discord, body: &[u8]) -> Value {
        let headers = HeaderMap::new();
        let reply = adapter.ack_reply(&request(&headers, body)).unwrap();
        assert_eq!(reply.status, 200);
        assert_eq!(reply.content_type, "application/json");
        serde_json::from_slice(&reply.body).unwrap()
    }

    #[test]
    fn the_rfc_8032_test_1_vector_verifies() {
        let adapter = Discord::from_hex(RFC_PUBLIC).unwrap();
        let signature: [u8; 64] = hex::decode(RFC_SIGNATURE).unwrap().try_into().unwrap();
        assert!(signature_matches(&adapter.public_key, b"", b"", &signature));
        assert!(!signature_matches(
            &adapter.public_key,
            b"0",
            b"",
            &signature
        ));
        // The RFC's secret key derives its public key and reproduces its signature.
        let seed: [u8; 32] = hex::decode(RFC_SECRET).unwrap().try_into().unwrap();
        let signing = SigningKey::from_bytes(&seed);
        assert_eq!(hex::encode(signing.verifying_key().to_bytes()), RFC_PUBLIC);
        assert_eq!(hex::encode(signing.sign(b"").to_bytes()), RFC_SIGNATURE);
    }

    #[test]
    fn from_hex_refuses_keys_that_are_not_32_bytes_of_a_valid_point() {
        assert!(Discord::from_hex(&format!(" {RFC_PUBLIC}\n")).is_ok());
        for bad in [
            "",
            "zz",
            &RFC_PUBLIC[..62],
            &format!("{RFC_PUBLIC}00"),
            // y = 0 is a point of order 4: weak.
            "0000000000000000000000000000000000000000000000000000000000000000",
        ] {
            let err = Discord::from_hex(bad).unwrap_err();
            assert!(err.contains("Discord public key"), "{err}");
        }
    }

    #[test]
    fn a_signed_interaction_verifies_without_any_secret() {
        let (sig, ts) = signed(SEED, NOW, COMMAND);
        check(&sig, &ts, COMMAND, Ok(()));
        let headers = headers(&[(SIGNATURE_HEADER, &sig), (TIMESTAMP_HEADER, &ts)]);
        assert_eq!(
            discord(SEED).verify(&request(&headers, COMMAND), &[], TOLERANCE),
            Ok(())
        );
    }

    #[test]
    fn a_wrong_key_a_tampered_body_or_timestamp_is_an_invalid_signature() {
        let (sig, ts) = signed(OTHER_SEED, NOW, COMMAND);
        check(&sig, &ts, COMMAND, Err("invalid_signature"));
        let (sig, ts) = signed(SEED, NOW, COMMAND);
        check(&sig, &ts, COMPONENT, Err("invalid_signature"));
        check(
            &sig,
            &(NOW + 1).to_string(),
            COMMAND,
            Err("invalid_signature"),
        );
    }

    #[test]
    fn missing_headers_are_missing_signatures() {
        let (sig, ts) = signed(SEED, NOW, COMMAND);
        let adapter = discord(SEED);
        assert_eq!(
            verify(&adapter, None, Some(&ts), COMMAND),
            Err(Rejection::MissingSignature {
                header: "X-Signature-Ed25519".to_owned()
            })
        );
        assert_eq!(
            verify(&adapter, Some(&sig), None, COMMAND),
            Err(Rejection::MissingSignature {
                header: "X-Signature-Timestamp".to_owned()
            })
        );
    }

    #[test]
    fn bad_hex_a_wrong_length_or_a_non_integer_timestamp_is_malformed() {
        let (sig, ts) = signed(SEED, NOW, COMMAND);
        for (signature, timestamp) in [
            ("zz".repeat(64), ts.clone()),
            (sig[..126].to_owned(), ts.clone()),
            (format!("{sig}00"), ts.clone()),
            (String::new(), ts.clone()),
            (sig.clone(), "yesterday".to_owned()),
            (sig.clone(), String::new()),
            (sig.clone(), format!("{NOW}.5")),
        ] {
            let got = verify(&discord(SEED), Some(&signature), Some(&timestamp), COMMAND);
            let Err(Rejection::MalformedSignature { detail }) = got else {
                panic!("{signature} {timestamp}: {got:?}");
            };
            assert!(
                signature.is_empty() || !detail.contains(&signature),
                "{detail}"
            );
        }
    }

    #[test]
    fn timestamps_within_the_tolerance_pass_in_both_directions() {
        for skew in [-299, 299] {
            let (sig, ts) = signed(SEED, NOW + skew, COMMAND);
            check(&sig, &ts, COMMAND, Ok(()));
        }
        for skew_secs in [-301, 301] {
            let (sig, ts) = signed(SEED, NOW + skew_secs, COMMAND);
            assert_eq!(
                verify(&discord(SEED), Some(&sig), Some(&ts), COMMAND),
                Err(Rejection::StaleTimestamp {
                    skew_secs,
                    tolerance_secs: 300
                })
            );
        }
        // The signature is checked first.
        let (sig, ts) = signed(OTHER_SEED, NOW - 1000, COMMAND);
        check(&sig, &ts, COMMAND, Err("invalid_signature"));
    }

    #[test]
    fn a_ping_is_answered_with_pong_and_is_not_an_event() {
        let headers = HeaderMap::new();
        let adapter = discord(SEED);
        let reply = adapter.handshake(&request(&headers, PING_BODY)).unwrap();
        assert_eq!(reply, ProviderReply::json(&json!({"type": 1})));
        assert_eq!(reply.content_type, "application/json");
        assert_eq!(adapter.handshake(&request(&headers, COMMAND)), None);
        assert_eq!(adapter.handshake(&request(&headers, b"not json")), None);
    }

    #[test]
    fn an_application_command_is_keyed_by_id_and_deferred_with_type_5() {
        let headers = HeaderMap::new();
        let adapter = discord(SEED);
        let events = adapter.extract(&request(&headers, COMMAND)).unwrap();
        assert_eq!(events.len(), 1);
        assert_eq!(events[0].key.as_str(), "1234567890123456789");
        assert_eq!(
            events[0].event_type.as_deref(),
            Some("application_command.book")
        );
        assert_eq!(reply_of(&adapter, COMMAND), json!({"type": 5}));
    }

    #[test]
    fn a_component_is_deferred_with_type_6() {
        let headers = HeaderMap::new();
        let adapter = discord(SEED);
        let events = adapter.extract(&request(&headers, COMPONENT)).unwrap();
        assert_eq!(events[0].key.as_str(), "1234567890123456790");
        assert_eq!(events[0].event_type.as_deref(), Some("message_component"));
        assert_eq!(reply_of(&adapter, COMPONENT), json!({"type": 6}));
    }

    #[test]
    fn modal_submits_autocomplete_and_unknown_types_get_their_own_answers() {
        let adapter = discord(SEED);
        let modal = br#"{"id":"5","type":5,"data":{"custom_id":"m"}}"#;
        let autocomplete = br#"{"id":"6","type":4,"data":{"name":"book"}}"#;
        let unknown = br#"{"id":"7","type":42}"#;
        assert_eq!(reply_of(&adapter, modal), json!({"type": 5}));
        assert_eq!(
            reply_of(&adapter, autocomplete),
            json!({"type": 8, "data": {"choices": []}})
        );
        assert_eq!(reply_of(&adapter, unknown), json!({"type": 5}));
        assert_eq!(reply_of(&adapter, PING_BODY), json!({"type": 1}));

        let headers = HeaderMap::new();
        let types: Vec<Option<String>> = [modal.as_slice(), autocomplete, unknown]
            .iter()
            .map(|body| {
                adapter.extract(&request(&headers, body)).unwrap()[0]
                    .event_type
                    .clone()
            })
            .collect();
        assert_eq!(
            types,
            [
                Some("modal_submit".to_owned()),
                Some("application_command_autocomplete.book".to_owned()),
                Some("interaction.42".to_owned()),
            ]
        );
    }

    #[test]
    fn a_configured_deferred_response_is_used_except_for_autocomplete() {
        let configured = json!({"type": 4, "data": {"content": "On it…", "flags": 64}});
        let adapter = Discord {
            deferred_response: Some(configured.clone()),
            ..discord(SEED)
        };
        assert_eq!(reply_of(&adapter, COMMAND), configured);
        assert_eq!(reply_of(&adapter, COMPONENT), configured);
        assert_eq!(
            reply_of(&adapter, br#"{"id":"6","type":4}"#),
            json!({"type": 8, "data": {"choices": []}})
        );
    }

    #[test]
    fn a_missing_id_is_a_missing_key_and_bad_json_is_invalid_json() {
        let headers = HeaderMap::new();
        let adapter = discord(SEED);
        for body in [&br#"{"type":2}"#[..], br#"{"id":123,"type":2}"#, b"[]"] {
            assert_eq!(
                adapter.extract(&request(&headers, body)),
                Err(Rejection::MissingKey {
                    detail: "body field `id`".to_owned()
                })
            );
        }
        assert_eq!(
            adapter
                .extract(&request(&headers, b"type=2"))
                .map_err(|r| r.code()),
            Err("invalid_json")
        );
    }

    #[test]
    fn a_secret_that_is_not_a_seed_signs_with_zeros_that_never_verify() {
        for secret in ["not hex", "00", "whsec_abc"] {
            let secret = Secret::from_text(secret);
            let headers = discord(SEED).sign(&SignRequest {
                url: "http://127.0.0.1:8080/in/discord",
                body: COMMAND,
                secret: &secret,
                now: Timestamp::from_secs(NOW),
                event_key: "1",
                event_type: None,
            });
            assert_eq!(headers[0].1, "0".repeat(128));
            check(
                &headers[0].1,
                &headers[1].1,
                COMMAND,
                Err("invalid_signature"),
            );
        }
        // Not even under a weak key.
        let weak = VerifyingKey::from_bytes(&[0; 32]).unwrap();
        assert!(!signature_matches(&weak, b"1", b"", &[0; 64]));
    }

    #[test]
    fn retention_is_seven_days() {
        assert_eq!(
            discord(SEED).default_retention(),
            Duration::from_secs(7 * 86_400)
        );
    }

    proptest! {
        #[test]
        fn arbitrary_headers_and_bodies_never_panic(
            signature in prop_oneof!["[ -~]{0,140}", "[0-9a-f]{128}"],
            timestamp in prop_oneof!["[ -~]{0,24}", "-?[0-9]{1,20}"],
            body in proptest::collection::vec(any::<u8>(), 0..64),
        ) {
            let adapter = discord(SEED);
            let _ = verify(&adapter, Some(&signature), Some(&timestamp), &body);
            let headers = HeaderMap::new();
            let req = request(&headers, &body);
            let _ = adapter.extract(&req);
            let _ = adapter.handshake(&req);
            let _ = adapter.ack_reply(&req);
        }

        #[test]
        fn arbitrary_signatures_never_verify(
            sig in proptest::collection::vec(any::<u8>(), 64),
        ) {
            let got = verify(&discord(SEED), Some(&hex::encode(&sig)), Some(&NOW.to_string()), COMMAND);
            prop_assert_eq!(got, Err(Rejection::InvalidSignature));
        }
    }
}
