//! WhatsApp Cloud API (Meta): `X-Hub-Signature-256: sha256=<hex>` is an HMAC-SHA256 of the raw
//! body keyed by the Meta App Secret. No timestamp is signed (the tolerance is unused):
//! deduplication is the only replay defence. Meta's own Node SDK compares with `==`; here the
//! comparison is constant-time like everywhere else.
//!
//! Subscription check: Meta sends `GET ?hub.mode=subscribe&hub.verify_token=…&hub.challenge=…`
//! when the callback URL is saved; [`WhatsApp::handle_get`] answers the challenge as plain text
//! when the token matches [`WhatsApp::verify_token`] (compared in constant time).
//!
//! Events: one POST batches many items (`entry[].changes[].value.messages[]` and
//! `.statuses[]`), so each item is its own event: a message keyed by its `id` (`wamid.…`, type
//! `message.{type}`), a status keyed by `{id}:{status}` (type `status.{status}`), because the
//! same outbound `wamid` comes back once per status (`sent`, `delivered`, `read`, …). Items are
//! taken across all entries and changes, in order (within a change: messages, then statuses),
//! and an item seen twice in one POST yields one event. Keys do not depend on how Meta batches
//! them, so a retry that regroups the items still deduplicates.
//!
//! A change with no messages or statuses (another webhook field: `account_update`,
//! `message_template_status_update`, …) has no item id. Such changes are kept, not dropped: the
//! delivery gets one more event keyed `body:{hex SHA-256 of the raw body}`, typed with the
//! first such change's `field`. An exact retry of the same bytes still deduplicates; a retry
//! that regroups those changes differently would be seen as new (at-least-once, never lost).
//! The same key is used for a JSON body without any `entry[].changes[]`.
//!
//! A message without a string `id`, or a status without a string `id` and `status`, is refused
//! as a missing key (400) naming the item, rather than silently skipped.

use std::collections::HashSet;
use std::time::Duration;

use serde_json::Value;

use crate::provider::{
    body_key, event_key, malformed, parse_json, signature_value, ExtractedEvent, InboundRequest,
    ProviderAdapter, ProviderReply, Rejection, SignRequest,
};
use crate::secret::{constant_time_eq, sha256, Mac256, Secret};

const SIGNATURE_HEADER: &str = "X-Hub-Signature-256";
const SIGNATURE_PREFIX: &str = "sha256=";

/// The WhatsApp Cloud API webhook scheme (`provider = "whatsapp"`).
#[derive(Debug, Clone, Default)]
pub struct WhatsApp {
    /// The Verify Token entered in the App Dashboard, for the `GET` subscription check.
    /// `None` (or empty): every subscription check is refused.
    pub verify_token: Option<Secret>,
}

impl ProviderAdapter for WhatsApp {
    fn provider(&self) -> &'static str {
        "whatsapp"
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
        let value = signature_value(req.headers, SIGNATURE_HEADER)?;
        let hex_digest = value
            .trim()
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
        let body = parse_json(req.body)?;
        let mut events = Vec::new();
        let mut seen = HashSet::new();
        // `Some(field)` once a change without items was found.
        let mut itemless_field: Option<Option<String>> = None;

        for (e, entry) in items(body.get("entry")).iter().enumerate() {
            for (c, change) in items(entry.get("changes")).iter().enumerate() {
                let value = change.get("value");
                let messages = items(value.and_then(|v| v.get("messages")));
                let statuses = items(value.and_then(|v| v.get("statuses")));
                if messages.is_empty() && statuses.is_empty() {
                    itemless_field.get_or_insert_with(|| {
                        change
                            .get("field")
                            .and_then(Value::as_str)
                            .map(str::to_owned)
                    });
                    continue;
                }
                let at = format!("entry[{e}].changes[{c}].value");
                for (m, message) in messages.iter().enumerate() {
                    let place = format!("{at}.messages[{m}].id");
                    let id = text(message, "id", &place)?;
                    let event_type = match message.get("type").and_then(Value::as_str) {
                        Some(kind) => format!("message.{kind}"),
                        None => "message".to_owned(),
                    };
                    push_unique(
                        &mut events,
                        &mut seen,
                        (id.to_owned(), event_type),
                        message,
                        &place,
                    )?;
                }
                for (s, status) in statuses.iter().enumerate() {
                    let place = format!("{at}.statuses[{s}]");
                    let id = text(status, "id", &format!("{place}.id"))?;
                    let state = text(status, "status", &format!("{place}.status"))?;
                    push_unique(
                        &mut events,
                        &mut seen,
                        (format!("{id}:{state}"), format!("status.{state}")),
                        status,
                        &place,
                    )?;
                }
            }
        }

        if itemless_field.is_some() || events.is_empty() {
            events.push(ExtractedEvent {
                fingerprint: None,
                key: body_key(req.body)?,
                event_type: itemless_field.flatten(),
            });
        }
        Ok(events)
    }

    fn sign(&self, req: &SignRequest<'_>) -> Vec<(String, String)> {
        let mac = Mac256::compute(req.secret.expose(), &[req.body]);
        vec![(
            SIGNATURE_HEADER.to_owned(),
            format!("{SIGNATURE_PREFIX}{}", mac.to_hex()),
        )]
    }

    /// 10 days: Meta reportedly retries for up to 7 days, plus a margin.
    fn default_retention(&self) -> Duration {
        Duration::from_secs(10 * 24 * 3600)
    }

    fn handle_get(&self, query: &str) -> Option<Result<ProviderReply, Rejection>> {
        Some(self.subscription_check(query))
    }
}

impl WhatsApp {
    /// `hub.mode=subscribe` and the right `hub.verify_token`: 200 with `hub.challenge` as plain
    /// text. Anything else (wrong or missing token, another mode, no challenge, no token
    /// configured) is refused.
    fn subscription_check(&self, query: &str) -> Result<ProviderReply, Rejection> {
        let query = query.strip_prefix('?').unwrap_or(query);
        let (mut mode, mut token, mut challenge) = (None, None, None);
        for (name, value) in form_urlencoded::parse(query.as_bytes()) {
            let slot = match &*name {
                "hub.mode" => &mut mode,
                "hub.verify_token" => &mut token,
                "hub.challenge" => &mut challenge,
                _ => continue,
            };
            slot.get_or_insert(value);
        }
        let expected = self
            .verify_token
            .as_ref()
            .filter(|expected| !expected.expose().is_empty())
            .ok_or(Rejection::InvalidVerifyToken)?;
        let token = token.ok_or(Rejection::InvalidVerifyToken)?;
        // Hashing first keeps the comparison independent of the tokens' lengths.
        let token_matches = constant_time_eq(&sha256(token.as_bytes()), &sha256(expected.expose()));
        if !token_matches || mode.as_deref() != Some("subscribe") {
            return Err(Rejection::InvalidVerifyToken);
        }
        let challenge = challenge.ok_or(Rejection::InvalidVerifyToken)?;
        Ok(ProviderReply {
            status: 200,
            content_type: "text/plain",
            body: challenge.into_owned().into_bytes(),
        })
    }
}

/// The elements of a JSON array, or none.
fn items(value: Option<&Value>) -> &[Value] {
    value.and_then(Value::as_array).map_or(&[], Vec::as_slice)
}

/// A string field of an item, or a missing key naming where it was looked for.
fn text<'a>(item: &'a Value, field: &str, place: &str) -> Result<&'a str, Rejection> {
    item.get(field)
        .and_then(Value::as_str)
        .ok_or_else(|| Rejection::MissingKey {
            detail: place.to_owned(),
        })
}

/// Adds the event `(key, type)` of `item` unless its key is there already. Its fingerprint is
/// the item's own JSON: a retry may regroup a batch's items (or send one alone), and an item
/// that comes again unchanged is a duplicate whatever came with it.
fn push_unique(
    events: &mut Vec<ExtractedEvent>,
    seen: &mut HashSet<String>,
    (key, event_type): (String, String),
    item: &Value,
    place: &str,
) -> Result<(), Rejection> {
    let key = event_key(&key, place)?;
    if seen.insert(key.as_str().to_owned()) {
        let item_json = serde_json::to_vec(item).expect("a JSON value serializes");
        events.push(ExtractedEvent {
            fingerprint: Some(sha256(&item_json)),
            key,
            event_type: Some(event_type),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use http::{HeaderMap, HeaderValue};
    use proptest::prelude::*;
    use serde_json::json;

    use super::*;
    use crate::time::Timestamp;

    const OLD: &str = "old app secret";
    const NEW: &str = "new app secret";
    const VERIFY_TOKEN: &str = "meatyhamhock";

    fn message(id: &str, kind: &str) -> Value {
        json!({"from": "16315551181", "id": id, "timestamp": "1700000000", "type": kind,
               "text": {"body": "hi"}})
    }

    fn status(id: &str, status: &str) -> Value {
        json!({"id": id, "status": status, "timestamp": "1700000001",
               "recipient_id": "16315551181"})
    }

    fn change(messages: &[Value], statuses: &[Value]) -> Value {
        let mut value = json!({
            "messaging_product": "whatsapp",
            "metadata": {"display_phone_number": "15550783881", "phone_number_id": "106540352242922"},
        });
        if !messages.is_empty() {
            value["messages"] = json!(messages);
        }
        if !statuses.is_empty() {
            value["statuses"] = json!(statuses);
        }
        json!({"field": "messages", "value": value})
    }

    fn delivery(entries: &[Vec<Value>]) -> Vec<u8> {
        let entries: Vec<Value> = entries
            .iter()
            .map(|changes| json!({"id": "102290129340398", "changes": changes}))
            .collect();
        serde_json::to_vec(&json!({"object": "whatsapp_business_account", "entry": entries}))
            .unwrap()
    }

    /// A retry may regroup a batch's items: each item's fingerprint is its own JSON, so the
    /// same item in another batch (or alone) is a duplicate of itself, and two items differ.
    #[test]
    fn an_items_fingerprint_is_its_own_whatever_it_comes_with() {
        let empty = HeaderMap::new();
        let events = |body: &[u8]| WhatsApp::default().extract(&request(&empty, body)).unwrap();
        let (a, b) = (message("wamid.A", "text"), message("wamid.B", "text"));
        let batch = delivery(&[vec![change(&[a, b.clone()], &[])]]);
        let alone = delivery(&[vec![change(&[b], &[status("wamid.Z", "sent")])]]);
        let (first, second) = (events(&batch), events(&alone));
        assert_eq!(first[1].key.as_str(), "wamid.B");
        assert_eq!(second[0].key.as_str(), "wamid.B");
        assert!(first[1].fingerprint.is_some());
        assert_eq!(first[1].fingerprint, second[0].fingerprint);
        assert_ne!(first[0].fingerprint, first[1].fingerprint);
        assert_ne!(second[0].fingerprint, second[1].fingerprint);
    }

    fn request<'a>(headers: &'a HeaderMap, body: &'a [u8]) -> InboundRequest<'a> {
        InboundRequest {
            path_and_query: "/in/whatsapp",
            headers,
            body,
            now: Timestamp::from_secs(1_700_000_000),
        }
    }

    fn signature(secret: &str, body: &[u8]) -> String {
        let secret = Secret::from_text(secret);
        let signed = WhatsApp::default().sign(&SignRequest {
            url: "http://127.0.0.1:8080/in/whatsapp",
            body,
            secret: &secret,
            now: Timestamp::from_secs(0),
            event_key: "wamid.1",
            event_type: None,
        });
        assert_eq!(signed.len(), 1);
        assert_eq!(signed[0].0, SIGNATURE_HEADER);
        signed[0].1.clone()
    }

    fn verify(header: Option<&str>, body: &[u8], secrets: &[&str]) -> Result<(), Rejection> {
        let mut headers = HeaderMap::new();
        if let Some(value) = header {
            headers.insert(SIGNATURE_HEADER, HeaderValue::from_str(value).unwrap());
        }
        let secrets: Vec<Secret> = secrets.iter().map(|s| Secret::from_text(s)).collect();
        WhatsApp::default().verify(&request(&headers, body), &secrets, Duration::ZERO)
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
        WhatsApp::default().extract(&request(&headers, body))
    }

    fn keys(body: &[u8]) -> Vec<String> {
        extract(body)
            .unwrap()
            .into_iter()
            .map(|event| event.key.as_str().to_owned())
            .collect()
    }

    fn sorted(mut keys: Vec<String>) -> Vec<String> {
        keys.sort();
        keys
    }

    fn get(verify_token: Option<&str>, query: &str) -> Result<ProviderReply, Rejection> {
        let adapter = WhatsApp {
            verify_token: verify_token.map(Secret::from_text),
        };
        adapter.handle_get(query).expect("WhatsApp answers GET")
    }

    fn batch() -> Vec<u8> {
        delivery(&[vec![
            change(
                &[message("wamid.A", "text"), message("wamid.B", "image")],
                &[],
            ),
            change(
                &[],
                &[
                    status("wamid.OUT", "sent"),
                    status("wamid.OUT", "delivered"),
                    status("wamid.OUT", "read"),
                ],
            ),
        ]])
    }

    #[test]
    fn a_signed_delivery_verifies_and_any_change_breaks_it() {
        let body = batch();
        let good = signature(NEW, &body);
        check(&good, &body, &[NEW], Ok(()));
        check(&good, &body, &[OLD], Err("invalid_signature"));
        let mut tampered = body.clone();
        tampered[10] ^= 1;
        check(&good, &tampered, &[NEW], Err("invalid_signature"));
        check(&good, &body, &[], Err("invalid_signature"));
    }

    #[test]
    fn the_signature_is_over_the_raw_bytes_with_escapes_kept() {
        // Meta escapes non-ASCII as \uXXXX; the same text unescaped is other bytes.
        let escaped = br#"{"entry":[],"text":"caf\u00e9"}"#;
        let unescaped = "{\"entry\":[],\"text\":\"caf\u{e9}\"}".as_bytes();
        check(&signature(NEW, escaped), escaped, &[NEW], Ok(()));
        check(
            &signature(NEW, escaped),
            unescaped,
            &[NEW],
            Err("invalid_signature"),
        );
        // Computed independently (Python hmac).
        assert_eq!(
            signature("mysecret", br#"{"foo":"bar"}"#),
            "sha256=4864d2759938a15468b5df9ade20bf161da9b4f737ea61794142f3484236bda3"
        );
    }

    #[test]
    fn rotation_accepts_either_configured_secret() {
        let body = batch();
        check(&signature(OLD, &body), &body, &[OLD, NEW], Ok(()));
        check(&signature(NEW, &body), &body, &[OLD, NEW], Ok(()));
        check(
            &signature(OLD, &body),
            &body,
            &[NEW],
            Err("invalid_signature"),
        );
    }

    #[test]
    fn a_missing_header_is_a_missing_signature() {
        assert_eq!(
            verify(None, &batch(), &[NEW]),
            Err(Rejection::MissingSignature {
                header: "X-Hub-Signature-256".to_owned()
            })
        );
    }

    #[test]
    fn a_value_without_the_prefix_or_with_bad_hex_is_malformed_and_never_echoed() {
        let body = batch();
        let good = signature(NEW, &body);
        let bare = good.trim_start_matches("sha256=").to_owned();
        for header in [bare.as_str(), "sha1=00", "sha256=xyz", "sha256=abc", ""] {
            check(header, &body, &[NEW], Err("malformed_signature"));
            let Err(Rejection::MalformedSignature { detail }) = verify(Some(header), &body, &[NEW])
            else {
                unreachable!()
            };
            assert!(header.is_empty() || !detail.contains(header), "{detail}");
        }
    }

    #[test]
    fn the_subscription_check_echoes_the_challenge_for_the_right_token() {
        let reply = get(
            Some(VERIFY_TOKEN),
            "hub.mode=subscribe&hub.challenge=1158201444&hub.verify_token=meatyhamhock",
        )
        .unwrap();
        assert_eq!(
            reply,
            ProviderReply {
                status: 200,
                content_type: "text/plain",
                body: b"1158201444".to_vec(),
            }
        );
        // A leading `?` and percent-encoding are fine.
        let reply = get(
            Some("a b&c"),
            "?hub.verify_token=a%20b%26c&hub.mode=subscribe&hub.challenge=x%3Dy",
        )
        .unwrap();
        assert_eq!(reply.body, b"x=y");
    }

    #[test]
    fn the_subscription_check_refuses_a_wrong_missing_or_unconfigured_token() {
        let refused = Err(Rejection::InvalidVerifyToken);
        for (configured, query) in [
            (
                Some(VERIFY_TOKEN),
                "hub.mode=subscribe&hub.challenge=1&hub.verify_token=meatyhamhocK",
            ),
            (
                Some(VERIFY_TOKEN),
                "hub.mode=subscribe&hub.challenge=1&hub.verify_token=meatyhamhock2",
            ),
            (Some(VERIFY_TOKEN), "hub.mode=subscribe&hub.challenge=1"),
            (
                Some(VERIFY_TOKEN),
                "hub.mode=unsubscribe&hub.challenge=1&hub.verify_token=meatyhamhock",
            ),
            (
                Some(VERIFY_TOKEN),
                "hub.mode=subscribe&hub.verify_token=meatyhamhock",
            ),
            (Some(VERIFY_TOKEN), ""),
            (
                None,
                "hub.mode=subscribe&hub.challenge=1&hub.verify_token=meatyhamhock",
            ),
            (
                Some(""),
                "hub.mode=subscribe&hub.challenge=1&hub.verify_token=",
            ),
        ] {
            assert_eq!(get(configured, query), refused, "{configured:?} {query}");
        }
        assert_eq!(Rejection::InvalidVerifyToken.status(), 403);
    }

    #[test]
    fn a_batch_of_two_messages_and_three_statuses_is_five_events() {
        let events = extract(&batch()).unwrap();
        let got: Vec<(&str, Option<&str>)> = events
            .iter()
            .map(|e| (e.key.as_str(), e.event_type.as_deref()))
            .collect();
        assert_eq!(
            got,
            [
                ("wamid.A", Some("message.text")),
                ("wamid.B", Some("message.image")),
                ("wamid.OUT:sent", Some("status.sent")),
                ("wamid.OUT:delivered", Some("status.delivered")),
                ("wamid.OUT:read", Some("status.read")),
            ]
        );
    }

    #[test]
    fn the_same_items_batched_differently_have_the_same_keys() {
        let expected = sorted(keys(&batch()));
        // Split in two POSTs.
        let first = delivery(&[vec![change(
            &[message("wamid.A", "text")],
            &[status("wamid.OUT", "sent")],
        )]]);
        let second = delivery(&[
            vec![change(&[message("wamid.B", "image")], &[])],
            vec![change(
                &[],
                &[
                    status("wamid.OUT", "delivered"),
                    status("wamid.OUT", "read"),
                ],
            )],
        ]);
        assert_eq!(sorted([keys(&first), keys(&second)].concat()), expected);
        // Reordered in one POST.
        let reordered = delivery(&[
            vec![change(
                &[],
                &[status("wamid.OUT", "read"), status("wamid.OUT", "sent")],
            )],
            vec![change(
                &[message("wamid.B", "image"), message("wamid.A", "text")],
                &[status("wamid.OUT", "delivered")],
            )],
        ]);
        assert_eq!(sorted(keys(&reordered)), expected);
    }

    #[test]
    fn an_item_repeated_in_one_post_is_one_event() {
        let body = delivery(&[
            vec![change(
                &[message("wamid.A", "text"), message("wamid.A", "text")],
                &[status("wamid.OUT", "sent")],
            )],
            vec![change(&[], &[status("wamid.OUT", "sent")])],
        ]);
        assert_eq!(keys(&body), ["wamid.A", "wamid.OUT:sent"]);
    }

    #[test]
    fn a_delivery_without_items_is_keyed_by_its_body_hash() {
        let body = br#"{"object":"whatsapp_business_account","entry":[{"id":"1","changes":[{"field":"account_update","value":{"event":"VERIFIED_ACCOUNT"}}]}]}"#;
        let events = extract(body).unwrap();
        assert_eq!(events.len(), 1);
        assert_eq!(
            events[0].key.as_str(),
            format!("body:{}", hex::encode(sha256(body)))
        );
        assert_eq!(events[0].event_type.as_deref(), Some("account_update"));
        // An exact retry has the same key; another body another one.
        assert_eq!(extract(body).unwrap(), events);
        let other = br#"{"object":"whatsapp_business_account","entry":[]}"#;
        let events = extract(other).unwrap();
        assert_ne!(keys(other), keys(body));
        assert_eq!(events[0].event_type, None);
        assert_eq!(keys(b"[]").len(), 1);
    }

    #[test]
    fn a_change_without_items_next_to_messages_is_not_dropped() {
        let body = delivery(&[vec![
            change(&[message("wamid.A", "text")], &[]),
            json!({"field": "message_template_status_update", "value": {"event": "APPROVED"}}),
        ]]);
        let events = extract(&body).unwrap();
        assert_eq!(events.len(), 2);
        assert_eq!(events[0].key.as_str(), "wamid.A");
        assert!(events[1].key.as_str().starts_with("body:"));
        assert_eq!(
            events[1].event_type.as_deref(),
            Some("message_template_status_update")
        );
    }

    #[test]
    fn an_item_without_its_id_or_status_is_a_missing_key() {
        let no_id = delivery(&[vec![change(&[json!({"type": "text"})], &[])]]);
        assert_eq!(
            extract(&no_id),
            Err(Rejection::MissingKey {
                detail: "entry[0].changes[0].value.messages[0].id".to_owned()
            })
        );
        let no_status = delivery(&[vec![change(&[], &[json!({"id": "wamid.X"})])]]);
        assert_eq!(
            extract(&no_status),
            Err(Rejection::MissingKey {
                detail: "entry[0].changes[0].value.statuses[0].status".to_owned()
            })
        );
        let numeric = delivery(&[vec![change(&[json!({"id": 7})], &[])]]);
        assert_eq!(
            extract(&numeric).map_err(|r| r.code()),
            Err("missing_event_key")
        );
    }

    #[test]
    fn a_body_that_is_not_json_is_invalid_json() {
        assert_eq!(
            extract(b"entry=1").map_err(|r| r.code()),
            Err("invalid_json")
        );
    }

    #[test]
    fn retention_is_ten_days() {
        assert_eq!(
            WhatsApp::default().default_retention(),
            Duration::from_secs(10 * 86_400)
        );
    }

    proptest! {
        #[test]
        fn arbitrary_headers_bodies_and_queries_never_panic(
            header in prop_oneof!["[ -~]{0,80}", "sha256=[0-9a-fA-F]{0,70}"],
            body in proptest::collection::vec(any::<u8>(), 0..64),
            query in "[ -~]{0,80}",
        ) {
            let _ = verify(Some(&header), &body, &[NEW, OLD]);
            let _ = extract(&body);
            prop_assert_ne!(get(Some(VERIFY_TOKEN), &query).map(|r| r.status), Ok(200));
        }

        #[test]
        fn arbitrary_signature_bytes_never_verify(
            sig in proptest::collection::vec(any::<u8>(), 0..40),
        ) {
            let header = format!("sha256={}", hex::encode(&sig));
            prop_assert_eq!(verify(Some(&header), &batch(), &[NEW]), Err(Rejection::InvalidSignature));
        }

        #[test]
        fn arbitrary_json_item_shapes_never_panic(
            id in proptest::option::of("[ -~]{0,300}"),
            state in proptest::option::of("[a-z]{0,10}"),
            kind in proptest::option::of("[a-z]{0,10}"),
        ) {
            let body = delivery(&[vec![change(
                &[json!({"id": id, "type": kind})],
                &[json!({"id": id, "status": state})],
            )]]);
            let _ = extract(&body);
        }
    }
}
