//! Realistic, signed test events for each provider, as `hooklatch send` sends them.
//!
//! Bodies are data files under `crates/hooklatch/fixtures/<provider>/<event type>.json`,
//! embedded at build time, with `{{id}}`, `{{created}}` (unix seconds) and
//! `{{created_rfc3339}}` filled in. Signing uses the provider adapter's own signer, so a test
//! event is signed exactly as the provider signs it.

use hooklatch_core::provider::standard_webhooks::decode_secret;
use hooklatch_core::provider::{
    Discord, GitHub, Paddle, Razorpay, Shopify, SignRequest, Slack, StandardWebhooks, Stripe,
    Twilio, WhatsApp,
};
use hooklatch_core::{ProviderAdapter, Secret, Timestamp};

const JSON: &str = "application/json";
const FORM: &str = "application/x-www-form-urlencoded";

/// A test event's template: provider, name (what `--event` takes: the event type, or a
/// scenario such as WhatsApp's `batch`), content type and body.
struct Fixture {
    provider: &'static str,
    name: &'static str,
    content_type: &'static str,
    body: &'static str,
}

macro_rules! fixture {
    ($provider:literal, $name:literal, $file:literal, $content_type:expr) => {
        Fixture {
            provider: $provider,
            name: $name,
            content_type: $content_type,
            body: include_str!(concat!("../fixtures/", $provider, "/", $file)),
        }
    };
}

/// Every test event; each provider's first is its default.
const FIXTURES: &[Fixture] = &[
    fixture!(
        "stripe",
        "invoice.payment_succeeded",
        "invoice.payment_succeeded.json",
        JSON
    ),
    fixture!(
        "stripe",
        "checkout.session.completed",
        "checkout.session.completed.json",
        JSON
    ),
    fixture!("github", "push", "push.json", JSON),
    fixture!("github", "pull_request", "pull_request.json", JSON),
    fixture!(
        "standard-webhooks",
        "invoice.paid",
        "invoice.paid.json",
        JSON
    ),
    fixture!(
        "standard-webhooks",
        "user.created",
        "user.created.json",
        JSON
    ),
    fixture!("shopify", "orders/create", "orders__create.json", JSON),
    fixture!("shopify", "orders/paid", "orders__paid.json", JSON),
    fixture!("twilio", "message.inbound", "message.inbound.form", FORM),
    fixture!(
        "twilio",
        "message.status.delivered",
        "message.status.delivered.form",
        FORM
    ),
    fixture!("slack", "app_mention", "app_mention.json", JSON),
    fixture!("slack", "block_actions", "block_actions.form", FORM),
    fixture!("whatsapp", "batch", "batch.json", JSON),
    fixture!("whatsapp", "message.text", "message.text.json", JSON),
    // What examples/whatsapp-booking books: `send whatsapp --event message.booking`.
    fixture!("whatsapp", "message.booking", "message.booking.json", JSON),
    fixture!(
        "discord",
        "application_command.book",
        "application_command.book.json",
        JSON
    ),
    fixture!(
        "discord",
        "message_component",
        "message_component.json",
        JSON
    ),
    fixture!(
        "razorpay",
        "payment.captured",
        "payment.captured.json",
        JSON
    ),
    fixture!("razorpay", "order.paid", "order.paid.json", JSON),
    fixture!(
        "paddle",
        "transaction.completed",
        "transaction.completed.json",
        JSON
    ),
    fixture!(
        "paddle",
        "subscription.created",
        "subscription.created.json",
        JSON
    ),
];

/// A test event ready to send.
#[derive(Debug, Clone)]
pub struct TestEvent {
    /// The provider's event key (what the gateway deduplicates on).
    pub key: String,
    /// The event type.
    pub event_type: String,
    /// Headers to send, signature included.
    pub headers: Vec<(String, String)>,
    /// The body, byte-exact.
    pub body: Vec<u8>,
}

/// Why a test event could not be built.
#[derive(Debug, thiserror::Error)]
pub enum FixtureError {
    /// No fixtures for this provider.
    #[error("no test events for provider {0:?}; known: {1}")]
    UnknownProvider(String, String),
    /// No such event type for the provider.
    #[error("no {provider} test event of type {event_type:?}; known: {known}")]
    UnknownEvent {
        /// The provider.
        provider: String,
        /// The type asked for.
        event_type: String,
        /// The types there are.
        known: String,
    },
    /// An `--id` no provider would send: the id goes as it is into headers (GitHub's delivery
    /// id, Standard Webhooks' `webhook-id`, signed with the body) and into the JSON body.
    #[error(
        "id {0:?} is not one a provider sends: use visible ASCII without spaces, quotes or \
         backslashes (an id goes as it is into headers and the JSON body)"
    )]
    BadId(String),
    /// A secret that cannot be the provider's ([`secret_shape`]).
    #[error("{0}")]
    BadSecret(String),
}

/// Checks that `secret` has the shape `provider`'s signing secrets have, where the scheme
/// fixes one: Discord's private key seed is 64 hex characters, and a Standard Webhooks
/// `whsec_` secret is base64 after its prefix. A secret of the wrong shape would sign
/// something no receiver verifies, and the 401 would not say why. The message never quotes
/// the secret.
pub fn secret_shape(provider: &str, secret: &Secret) -> Result<(), String> {
    match provider {
        "discord" => {
            let seed = secret
                .expose_text()
                .map(str::trim)
                .filter(|t| t.len() == 64 && t.bytes().all(|b| b.is_ascii_hexdigit()));
            match seed {
                Some(_) => Ok(()),
                None => Err(
                    "a discord secret is the application's Ed25519 private key seed: \
                     64 hex characters (the gateway's source holds the matching public_key)"
                        .to_owned(),
                ),
            }
        }
        "standard-webhooks" => {
            let whsec = secret
                .expose_text()
                .is_some_and(|t| t.starts_with("whsec_"));
            if whsec && decode_secret(secret).is_none() {
                return Err(
                    "a standard-webhooks secret that starts with whsec_ is base64 \
                     after it, and this one does not decode"
                        .to_owned(),
                );
            }
            Ok(())
        }
        _ => Ok(()),
    }
}

/// The providers and event names there are fixtures for.
pub fn catalog() -> impl Iterator<Item = (&'static str, &'static str)> {
    FIXTURES.iter().map(|f| (f.provider, f.name))
}

/// The adapter that signs a provider's test events, if there are any (every provider but
/// `generic`, whose scheme lives in a source's settings). `replay` and `check` re-sign with it.
pub fn signer(provider: &str, secret: &Secret) -> Option<Box<dyn ProviderAdapter>> {
    Some(match provider {
        "stripe" => Box::new(Stripe),
        "github" => Box::new(GitHub),
        "standard-webhooks" => Box::new(StandardWebhooks),
        "shopify" => Box::new(Shopify),
        "twilio" => Box::new(Twilio { public_url: None }),
        "slack" => Box::new(Slack::default()),
        "whatsapp" => Box::new(WhatsApp { verify_token: None }),
        "discord" => Box::new(discord_for(secret)),
        "razorpay" => Box::new(Razorpay),
        "paddle" => Box::new(Paddle),
        _ => return None,
    })
}

/// Discord signs with a key pair: the secret is the private key seed (64 hex characters),
/// and the adapter carries the matching public key.
fn discord_for(secret: &Secret) -> Discord {
    let seed: Option<[u8; 32]> = secret
        .expose_text()
        .and_then(|t| hex::decode(t.trim()).ok())
        .and_then(|b| b.try_into().ok());
    let public = seed
        .map(|s| ed25519_dalek::SigningKey::from_bytes(&s).verifying_key())
        .map(|k| hex::encode(k.as_bytes()));
    Discord::from_hex(public.as_deref().unwrap_or(RFC8032_PUBLIC_KEY))
        .expect("a public key derived from a seed, or RFC 8032's, is valid")
}

/// RFC 8032, section 7.1, test 1: a valid public key when the seed does not decode (the
/// signature then never verifies, which is what sending with a wrong secret should do).
const RFC8032_PUBLIC_KEY: &str = "d75a980182b10ab7d54bfed3c964073a0ee172f3daa62325af021a68f707511a";

/// A time in 2026 fixed by `key`, for the body of an event sent again under the same id.
fn created_for(key: &str) -> Timestamp {
    let digest = hooklatch_core::secret::sha256(key.as_bytes());
    let spread = u64::from_be_bytes(digest[..8].try_into().expect("8 of 32 bytes"));
    // 2026-01-01T00:00:00Z, plus up to a year.
    Timestamp::from_secs(1_767_225_600 + (spread % (365 * 86_400)) as i64)
}

/// Builds a signed test event for sending to `url`. `id` defaults to a fresh provider-shaped id.
pub fn build(
    provider: &str,
    event_type: Option<&str>,
    id: Option<&str>,
    secret: &Secret,
    url: &str,
    now: Timestamp,
) -> Result<TestEvent, FixtureError> {
    let unknown_provider = || {
        let mut known: Vec<&str> = FIXTURES.iter().map(|f| f.provider).collect();
        known.dedup();
        FixtureError::UnknownProvider(provider.to_owned(), known.join(", "))
    };
    let adapter = signer(provider, secret).ok_or_else(unknown_provider)?;
    secret_shape(provider, secret).map_err(FixtureError::BadSecret)?;
    let mut of_provider = FIXTURES.iter().filter(|f| f.provider == provider);
    let fixture = match event_type {
        None => of_provider.next(),
        Some(t) => of_provider.find(|f| f.name == t),
    }
    .ok_or_else(|| FixtureError::UnknownEvent {
        provider: provider.to_owned(),
        event_type: event_type.unwrap_or_default().to_owned(),
        known: FIXTURES
            .iter()
            .filter(|f| f.provider == provider)
            .map(|f| f.name)
            .collect::<Vec<_>>()
            .join(", "),
    })?;
    if let Some(id) = id {
        let sendable = |b: u8| b.is_ascii_graphic() && b != b'"' && b != b'\\';
        if id.is_empty() || !id.bytes().all(sendable) {
            return Err(FixtureError::BadId(id.to_owned()));
        }
    }
    let key = id.map(str::to_owned).unwrap_or_else(|| fresh_id(provider));
    // An id sent again is a provider's retry, which carries the first delivery's body: with an
    // id given, the body's own time comes from the id, so a second send is a duplicate, not a
    // conflict. The signature's timestamp is `now` either way.
    let created = id.map_or(now, created_for);
    let body = fixture
        .body
        .replace("{{id}}", &key)
        .replace("{{created_rfc3339}}", &created.to_rfc3339())
        .replace("{{created}}", &created.as_secs().to_string())
        .into_bytes();
    let mut headers = vec![("content-type".to_owned(), fixture.content_type.to_owned())];
    headers.extend(adapter.sign(&SignRequest {
        url,
        body: &body,
        secret,
        now,
        event_key: &key,
        event_type: Some(fixture.name),
    }));
    Ok(TestEvent {
        key,
        event_type: fixture.name.to_owned(),
        headers,
        body,
    })
}

/// An id shaped like the provider's.
fn fresh_id(provider: &str) -> String {
    use rand::Rng;
    let mut rng = rand::rng();
    let alnum = |n: usize, rng: &mut rand::rngs::ThreadRng| -> String {
        (0..n)
            .map(|_| rng.sample(rand::distr::Alphanumeric) as char)
            .collect()
    };
    let guid = |rng: &mut rand::rngs::ThreadRng| {
        let h = hex::encode(rng.random::<[u8; 16]>());
        format!(
            "{}-{}-{}-{}-{}",
            &h[..8],
            &h[8..12],
            &h[12..16],
            &h[16..20],
            &h[20..]
        )
    };
    match provider {
        "github" | "shopify" => guid(&mut rng),
        "standard-webhooks" => format!("msg_{}", alnum(27, &mut rng)),
        "twilio" => hex::encode(rng.random::<[u8; 16]>()),
        "slack" => format!("Ev{}", alnum(9, &mut rng).to_uppercase()),
        // A message id as the Cloud API writes one.
        "whatsapp" => format!("wamid.{}", alnum(32, &mut rng)),
        "discord" => rng.random_range(10u64.pow(17)..10u64.pow(19)).to_string(),
        "razorpay" => format!("evt_{}", alnum(14, &mut rng)),
        "paddle" => format!("evt_{}", alnum(26, &mut rng).to_lowercase()),
        _ => format!("evt_{}", alnum(24, &mut rng)),
    }
}

#[cfg(test)]
mod tests {
    use hooklatch_core::provider::Rejection;
    use hooklatch_core::InboundRequest;
    use http::HeaderMap;

    use super::*;

    const URL: &str = "http://127.0.0.1:8080/in/test";

    #[test]
    fn an_id_no_provider_would_send_is_refused_naming_it() {
        let now = Timestamp::from_secs(1_700_000_000);
        let secret = Secret::from_text("whsec_C2FVsBQIhrscChlQIMV+b5sSYspob7oD");
        for bad in ["", "évt_1", "evt 1", "evt\"1", "evt\\1", "evt\n1"] {
            let err = build("standard-webhooks", None, Some(bad), &secret, URL, now)
                .err()
                .unwrap_or_else(|| panic!("{bad:?} was accepted"));
            assert!(
                matches!(&err, FixtureError::BadId(id) if id == bad),
                "{err}"
            );
            assert!(err.to_string().contains("visible ASCII"), "{err}");
        }
        for good in [
            "evt_1NG8Du2eZvKYlo2C",
            "msg_2KWPBgLlAfxdpx2AI54pPJ85f4W",
            "1234567890",
        ] {
            let event = build("github", None, Some(good), &secret, URL, now).unwrap();
            assert_eq!(event.key, good);
        }
    }

    #[test]
    fn every_fixture_verifies_with_its_adapter_and_yields_its_key() {
        let now = Timestamp::from_secs(1_700_000_000);
        for (provider, name) in catalog() {
            // Discord signs with a private key seed; the rest with a shared secret.
            let secret = match provider {
                "discord" => Secret::from_text(
                    "9d61b19deffd5a60ba844af492ec2cc44449c5697b326919703bac031cae7f60",
                ),
                _ => Secret::from_text("whsec_C2FVsBQIhrscChlQIMV+b5sSYspob7oD"),
            };
            let event = build(provider, Some(name), None, &secret, URL, now).unwrap();
            let mut headers = HeaderMap::new();
            for (k, v) in &event.headers {
                headers.insert(
                    http::HeaderName::from_bytes(k.as_bytes()).unwrap(),
                    v.parse().unwrap(),
                );
            }
            headers.insert("host", "127.0.0.1:8080".parse().unwrap());
            let adapter = signer(provider, &secret).unwrap();
            let req = InboundRequest {
                path_and_query: "/in/test",
                headers: &headers,
                body: &event.body,
                now,
            };
            adapter
                .verify(
                    &req,
                    std::slice::from_ref(&secret),
                    std::time::Duration::from_secs(300),
                )
                .unwrap_or_else(|e| panic!("{provider}/{name}: {e:?}"));
            assert_eq!(adapter.handshake(&req), None, "{provider}/{name}");
            // An hour later the same request fails the tolerance exactly where a timestamp is
            // signed: the list config and replay go by says what the adapters do.
            let later = adapter.verify(
                &InboundRequest {
                    now: Timestamp::from_secs(now.as_secs() + 3_600),
                    ..req
                },
                std::slice::from_ref(&secret),
                std::time::Duration::from_secs(300),
            );
            assert_eq!(
                matches!(later, Err(Rejection::StaleTimestamp { .. })),
                hooklatch_core::provider::TIMESTAMP_SIGNERS.contains(&provider),
                "{provider}/{name}: {later:?}"
            );
            // An export leaves the signature out: what the adapter names is all it reads one
            // from, and every name is one an export recognises without the config.
            let mut unsigned = headers.clone();
            for header in adapter.signature_headers() {
                assert!(
                    crate::capture::is_signature_header(header),
                    "{provider}: {header}"
                );
                unsigned.remove(header);
            }
            let refused = adapter.verify(
                &InboundRequest {
                    headers: &unsigned,
                    ..req
                },
                std::slice::from_ref(&secret),
                std::time::Duration::from_secs(300),
            );
            assert!(
                matches!(refused, Err(Rejection::MissingSignature { .. })),
                "{provider}/{name}: {refused:?}"
            );
            let extracted = adapter
                .extract(&req)
                .unwrap_or_else(|e| panic!("{provider}/{name}: {e:?}"));
            assert!(
                extracted
                    .iter()
                    .any(|e| e.key.as_str().contains(&event.key)),
                "{provider}/{name}: no event keyed by {}",
                event.key
            );
        }
    }

    /// A secret no receiver could verify is refused before anything is sent, without being
    /// quoted; one of the right shape but the wrong value is sent (the receiver's 401 is the
    /// point of trying one).
    #[test]
    fn a_secret_of_the_wrong_shape_is_refused_before_sending() {
        let now = Timestamp::from_secs(1_700_000_000);
        for (provider, secret) in [
            ("discord", "not-a-hex-seed"),
            (
                "discord",
                "9d61b19deffd5a60ba844af492ec2cc44449c5697b326919703bac031cae7f",
            ),
            ("standard-webhooks", "whsec_not base64!"),
        ] {
            let err = build(provider, None, None, &Secret::from_text(secret), URL, now)
                .err()
                .unwrap_or_else(|| panic!("{provider} {secret}"));
            assert!(matches!(err, FixtureError::BadSecret(_)), "{err:?}");
            assert!(!err.to_string().contains(secret), "{err}");
        }
        for (provider, secret) in [
            (
                "discord",
                "0000000000000000000000000000000000000000000000000000000000000000",
            ),
            (
                "standard-webhooks",
                "whsec_C2FVsBQIhrscChlQIMV+b5sSYspob7oD",
            ),
            ("standard-webhooks", "a plain secret"),
            ("stripe", "anything"),
        ] {
            build(provider, None, None, &Secret::from_text(secret), URL, now)
                .unwrap_or_else(|e| panic!("{provider}: {e}"));
        }
    }

    #[test]
    fn a_whatsapp_batch_is_five_events() {
        let secret = Secret::from_text("app-secret");
        let event = build(
            "whatsapp",
            Some("batch"),
            Some("abc"),
            &secret,
            URL,
            Timestamp(0),
        )
        .unwrap();
        let mut headers = HeaderMap::new();
        for (k, v) in &event.headers {
            headers.insert(
                http::HeaderName::from_bytes(k.as_bytes()).unwrap(),
                v.parse().unwrap(),
            );
        }
        let req = InboundRequest {
            path_and_query: "/in/test",
            headers: &headers,
            body: &event.body,
            now: Timestamp(0),
        };
        assert_eq!(
            WhatsApp { verify_token: None }.extract(&req).unwrap().len(),
            5
        );
    }

    #[test]
    fn unknown_provider_and_event_are_named() {
        let secret = Secret::from_text("s");
        let now = Timestamp(0);
        let err = build("paypal", None, None, &secret, URL, now)
            .unwrap_err()
            .to_string();
        assert!(err.contains("paypal") && err.contains("stripe"), "{err}");
        let err = build("stripe", Some("x"), None, &secret, URL, now)
            .unwrap_err()
            .to_string();
        assert!(err.contains("invoice.payment_succeeded"), "{err}");
    }

    #[test]
    fn a_given_id_is_used() {
        let secret = Secret::from_text("s");
        let event = build(
            "stripe",
            None,
            Some("evt_fixed"),
            &secret,
            URL,
            Timestamp(0),
        )
        .unwrap();
        assert_eq!(event.key, "evt_fixed");
        assert!(String::from_utf8(event.body)
            .unwrap()
            .contains("\"id\": \"evt_fixed\""));
    }

    /// `send --id X` twice is a retry: the same body, whatever the clock says, for every test
    /// event; without an id, each send is a new event.
    #[test]
    fn the_same_id_sent_later_has_the_same_body() {
        let at = |secs| Timestamp::from_secs(secs);
        for (provider, name) in catalog() {
            // Discord's secret is a key seed; any text does for the others.
            let secret = match provider {
                "discord" => Secret::from_text(&"ab".repeat(32)),
                _ => Secret::from_text("s"),
            };
            let send = |id, now| build(provider, Some(name), id, &secret, URL, now).unwrap();
            let first = send(Some("evt_again"), at(1_800_000_000));
            let again = send(Some("evt_again"), at(1_800_000_090));
            assert_eq!(first.body, again.body, "{provider} {name}");
            let other = send(Some("evt_other"), at(1_800_000_000));
            assert_ne!(first.body, other.body, "{provider} {name}");
        }
    }
}
