//! Every provider through a real gateway: each test event (the same fixtures `hooklatch send`
//! uses) is refused with a wrong secret, a tampered body, missing signature headers and — where
//! the provider signs a timestamp — a stale one, each with its status and code and nothing
//! claimed; then accepted and delivered exactly once, however often it is sent. The handshakes
//! are answered as each provider expects, and a WhatsApp retry that batches overlapping items
//! differently processes each message and status once.

use hooklatch::core::provider::{SignRequest, WhatsApp};
use hooklatch::core::{ProviderAdapter, Secret, Timestamp};
use hooklatch::fixtures;
use serde_json::json;

use crate::support::{unique, wait_until, Behaviour, Gateway, Handler, Options};

/// A source per provider: (provider, source name, signing secret, extra TOML lines).
const SOURCES: &[(&str, &str, &str, &str)] = &[
    ("stripe", "p-stripe", "whsec_providers_stripe", ""),
    ("github", "p-github", "providers github secret", ""),
    (
        "standard-webhooks",
        "p-svix",
        "whsec_C2FVsBQIhrscChlQIMV+b5sSYspob7oD",
        "",
    ),
    ("shopify", "p-shopify", "shpss_providers", ""),
    ("twilio", "p-twilio", "twilio-auth-token", ""),
    ("slack", "p-slack", "slack-signing-secret", ""),
    (
        "whatsapp",
        "p-whatsapp",
        "meta-app-secret",
        "verify_token = \"meta-verify\"\n",
    ),
    (
        "discord",
        "p-discord",
        // RFC 8032's test key: this seed signs, the public key below verifies.
        "9d61b19deffd5a60ba844af492ec2cc44449c5697b326919703bac031cae7f60",
        "public_key = \"d75a980182b10ab7d54bfed3c964073a0ee172f3daa62325af021a68f707511a\"\n",
    ),
    ("razorpay", "p-razorpay", "razorpay-secret", ""),
    ("paddle", "p-paddle", "pdl_ntfset_providers", ""),
];

/// Providers whose signature covers a timestamp (so a stale one is refused).
const TIMESTAMPED: &[&str] = &["stripe", "standard-webhooks", "slack", "discord", "paddle"];

fn options() -> Options {
    let mut extra = String::new();
    for (provider, source, secret, more) in SOURCES {
        let secrets = if *provider == "discord" {
            String::new()
        } else {
            format!("secrets = [\"{secret}\"]\n")
        };
        extra.push_str(&format!(
            "[[sources]]\nname = \"{source}\"\nprovider = \"{provider}\"\n{secrets}{more}destinations = [\"app\"]\n\n"
        ));
    }
    Options {
        extra_config: extra,
        ..Options::default()
    }
}

fn wrong_secret(provider: &str) -> Secret {
    match provider {
        "discord" => Secret::from_text(&"11".repeat(32)),
        _ => Secret::from_text("whsec_d3Jvbmcgc2VjcmV0IGZvciB0ZXN0cw=="),
    }
}

/// Headers carrying a signature (or its timestamp), which a "missing" case leaves out.
fn is_signature_header(name: &str) -> bool {
    let name = name.to_ascii_lowercase();
    ["signature", "hmac", "-timestamp"]
        .iter()
        .any(|part| name.contains(part))
}

/// A forged request: what was forged, its headers and its body.
type Forgery = (&'static str, Vec<(String, String)>, Vec<u8>);

/// The forgeries of the test event `name` of `provider` with the id `id`, signed for `url` at
/// `now` with `secret`: (what, headers, body) — signed with a wrong secret, its body tampered
/// with, its signature headers left out and, where the provider signs a timestamp, signed 400 s
/// ago.
fn forgeries(
    provider: &str,
    name: &str,
    id: &str,
    secret: &Secret,
    url: &str,
    now: Timestamp,
) -> Vec<Forgery> {
    let build = |secret: &Secret, at: Timestamp| {
        fixtures::build(provider, Some(name), Some(id), secret, url, at)
            .unwrap_or_else(|e| panic!("{provider}/{name}: {e}"))
    };
    let event = build(secret, now);
    let forged = build(&wrong_secret(provider), now);
    let mut tampered = event.body.clone();
    tampered.push(b' ');
    let unsigned: Vec<_> = event
        .headers
        .iter()
        .filter(|(n, _)| !is_signature_header(n))
        .cloned()
        .collect();
    let mut all = vec![
        ("wrong secret", forged.headers, forged.body),
        ("tampered", event.headers.clone(), tampered),
        ("unsigned", unsigned, event.body.clone()),
    ];
    if TIMESTAMPED.contains(&provider) {
        let stale = build(secret, now.minus(std::time::Duration::from_secs(400)));
        all.push(("stale", stale.headers, stale.body));
    }
    all
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_provider_refuses_forgeries_and_delivers_each_event_once() {
    let mut card = crate::report::Card::new("T16", "sqlite");
    let handler = Handler::start(Behaviour::AlwaysOk).await;
    let gateway = Gateway::start_with(&handler, options()).await;
    let ingest = gateway.ingest();
    let base = format!("http://{}", ingest.addr());
    let mut expected_keys = 0;
    for (provider, source, secret, _) in SOURCES {
        let secret = Secret::from_text(secret);
        let url = format!("{base}/in/{source}");
        for (_, name) in fixtures::catalog().filter(|(p, _)| p == provider) {
            let what = format!("{provider}/{name}");
            let id = unique("pid");
            let now = Timestamp::now();
            let event = fixtures::build(provider, Some(name), Some(&id), &secret, &url, now)
                .unwrap_or_else(|e| panic!("{what}: {e}"));

            for (kind, headers, body) in forgeries(provider, name, &id, &secret, &url, now) {
                let (status, answer) = ingest.post(source, &headers, body).await;
                assert_eq!(status, 401, "{what} {kind}: {answer}");
                let code = answer["code"].as_str();
                match kind {
                    "wrong secret" => assert!(
                        matches!(code, Some("invalid_signature" | "malformed_signature")),
                        "{what} wrong secret: {answer}"
                    ),
                    "stale" => assert_eq!(code, Some("stale_timestamp"), "{what} stale"),
                    _ => {}
                }
            }

            // Nothing above claimed the id: the genuine event is new, then a duplicate.
            for round in 0..2 {
                let (status, body) = ingest
                    .post(source, &event.headers, event.body.clone())
                    .await;
                assert_eq!(status, 200, "{what} genuine #{round}: {body}");
                if body.is_object() && body.get("status").is_some() {
                    let want = if round == 0 { "accepted" } else { "duplicate" };
                    assert_eq!(body["status"].as_str(), Some(want), "{what} #{round}");
                }
            }
            expected_keys += if name == "batch" { 5 } else { 1 };
        }
    }

    wait_until("every genuine event delivered", || {
        handler.distinct_keys().len() == expected_keys
    })
    .await;
    let mut per_key = std::collections::HashMap::<String, usize>::new();
    for received in handler.received() {
        *per_key.entry(received.key.unwrap_or_default()).or_default() += 1;
    }
    assert!(
        per_key.values().all(|n| *n == 1),
        "each event exactly once: {per_key:?}"
    );
    let rejected = gateway.requests("verdict=rejected").await;
    assert!(rejected.len() >= 3 * 20, "every refusal is in history");
    card.count("acked", per_key.len())
        .count("duplicates", 0)
        .figure("refusals_recorded", rejected.len());
    println!(
        "providers: {} events delivered once each, {} refusals recorded",
        per_key.len(),
        rejected.len()
    );
}

/// The documented limit (README, "What hooklatch does not promise"): where a provider signs no
/// timestamp and carries its event id in a header its signature does not cover, a captured
/// request re-sent with a fresh id in that header is a new event. Every provider's test event
/// is sent, then sent again with each header that holds its id given a new one, signature and
/// body untouched: the providers that take it as new are exactly the ones the README names, and
/// every other provider refuses it (its signature covers the id) or finds the same event (the
/// id it keys on is in the signed body).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_capture_under_a_fresh_unsigned_id_header_is_new_only_where_the_readme_says() {
    let handler = Handler::start(Behaviour::AlwaysOk).await;
    let gateway = Gateway::start_with(&handler, options()).await;
    let ingest = gateway.ingest();
    let base = format!("http://{}", ingest.addr());
    let mut taken_as_new = std::collections::BTreeSet::new();
    for (provider, source, secret, _) in SOURCES {
        let secret = Secret::from_text(secret);
        let url = format!("{base}/in/{source}");
        let (_, name) = fixtures::catalog()
            .find(|(p, _)| p == provider)
            .expect("a test event per provider");
        let id = unique("lim");
        let event = fixtures::build(
            provider,
            Some(name),
            Some(&id),
            &secret,
            &url,
            Timestamp::now(),
        )
        .unwrap_or_else(|e| panic!("{provider}: {e}"));
        let (status, answer) = ingest
            .post(source, &event.headers, event.body.clone())
            .await;
        assert_eq!(status, 200, "{provider}: {answer}");

        let fresh = unique("lim");
        let renamed: Vec<(String, String)> = event
            .headers
            .iter()
            .map(|(n, v)| (n.clone(), v.replace(&id, &fresh)))
            .collect();
        if renamed == event.headers {
            continue; // the id travels in the signed body alone
        }
        let (status, answer) = ingest.post(source, &renamed, event.body.clone()).await;
        if status == 401 {
            assert_eq!(answer["code"], "invalid_signature", "{provider}: {answer}");
            continue; // the signature covers the id header
        }
        assert_eq!(status, 200, "{provider}: {answer}");
        // The verdict from history (Twilio answers in TwiML, not JSON).
        let verdict = |key: String| {
            let gateway = &gateway;
            async move {
                let found = gateway.requests(&format!("key={key}")).await;
                found
                    .iter()
                    .filter_map(|r| r["verdict"].as_str().map(str::to_owned))
                    .collect::<Vec<_>>()
            }
        };
        if verdict(event.key.replace(&id, &fresh)).await == ["accepted"] {
            taken_as_new.insert(*provider);
        } else {
            let verdicts = verdict(event.key.clone()).await;
            assert!(
                verdicts.contains(&"duplicate".to_owned()),
                "{provider}: the renamed request is neither new nor a duplicate: {verdicts:?}"
            );
        }
    }
    assert_eq!(
        taken_as_new.into_iter().collect::<Vec<_>>(),
        ["github", "razorpay", "shopify", "twilio"],
        "the providers README.md names under \"What hooklatch does not promise\""
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn handshakes_are_answered_as_each_provider_expects_and_claim_nothing() {
    let handler = Handler::start(Behaviour::AlwaysOk).await;
    let gateway = Gateway::start_with(&handler, options()).await;
    let ingest = gateway.ingest();
    let now = Timestamp::now();

    // Slack url_verification: the challenge, as JSON.
    let slack = fixtures::signer("slack", &Secret::from_text("slack-signing-secret")).unwrap();
    let body = br#"{"token":"t","challenge":"3eZbrw1aBm2rZgRNFdxV2595E9CY3gmdALWMmHkvFXO7tYXAYM8P","type":"url_verification"}"#;
    let headers = sign(slack.as_ref(), "slack-signing-secret", body, now);
    let res = ingest
        .send("p-slack", &headers, body.to_vec())
        .await
        .unwrap();
    assert_eq!(res.status(), 200);
    let answer: serde_json::Value = res.json().await.unwrap();
    assert_eq!(
        answer,
        json!({"challenge": "3eZbrw1aBm2rZgRNFdxV2595E9CY3gmdALWMmHkvFXO7tYXAYM8P"})
    );

    // Meta's GET subscription check: the challenge as text, only with the right token.
    let client = reqwest::Client::new();
    let base = format!("http://{}/in/p-whatsapp", ingest.addr());
    let res = client
        .get(format!(
            "{base}?hub.mode=subscribe&hub.verify_token=meta-verify&hub.challenge=1158201444"
        ))
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), 200);
    assert_eq!(res.text().await.unwrap(), "1158201444");
    let res = client
        .get(format!(
            "{base}?hub.mode=subscribe&hub.verify_token=nope&hub.challenge=1158201444"
        ))
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), 403);

    // Discord PING: PONG.
    let seed = "9d61b19deffd5a60ba844af492ec2cc44449c5697b326919703bac031cae7f60";
    let discord = fixtures::signer("discord", &Secret::from_text(seed)).unwrap();
    let body = br#"{"id":"1234567890","application_id":"42","type":1,"version":1}"#;
    let headers = sign(discord.as_ref(), seed, body, now);
    let res = ingest
        .send("p-discord", &headers, body.to_vec())
        .await
        .unwrap();
    assert_eq!(res.status(), 200);
    let answer: serde_json::Value = res.json().await.unwrap();
    assert_eq!(answer, json!({"type": 1}));
    // Discord's Webhook Events PING (their own URL, the same source): 204, no body.
    let body = br#"{"version":1,"application_id":"42","type":0}"#;
    let headers = sign(discord.as_ref(), seed, body, now);
    let res = ingest
        .send("p-discord", &headers, body.to_vec())
        .await
        .unwrap();
    assert_eq!(res.status(), 204);
    assert!(res.bytes().await.unwrap().is_empty());

    // Slack's slash-command certificate check: unsigned by design, an empty 200. Any other
    // unsigned form post is refused as before.
    let form = [(
        "content-type".to_owned(),
        "application/x-www-form-urlencoded".to_owned(),
    )];
    for (body, status) in [
        (&b"ssl_check=1&token=XXYYZZ"[..], 200),
        (&b"command=%2Fpay&text=100"[..], 401),
    ] {
        let res = ingest.send("p-slack", &form, body.to_vec()).await.unwrap();
        assert_eq!(res.status(), status, "{}", String::from_utf8_lossy(body));
        if status == 200 {
            assert!(res.bytes().await.unwrap().is_empty());
        }
    }

    let handshakes = gateway.requests("verdict=handshake").await;
    assert_eq!(handshakes.len(), 5, "{handshakes:?}");
    // The verify token is the source's secret: history keeps the check without it, and the
    // refused guess too.
    let checks: Vec<&serde_json::Value> = handshakes
        .iter()
        .filter(|r| r["source"] == "p-whatsapp")
        .collect();
    assert_eq!(checks.len(), 1, "{handshakes:?}");
    let mut checked = 0;
    for request in gateway.requests("source=p-whatsapp").await {
        let id = request["id"].as_str().unwrap();
        let (_, detail) = gateway.admin_get(&format!("/v1/requests/{id}")).await;
        let path = detail["path"].as_str().unwrap_or_default().to_owned();
        if path.contains("hub.mode") {
            assert!(path.contains("hub.verify_token=***&"), "{path}");
            assert!(
                !path.contains("meta-verify") && !path.contains("nope"),
                "{path}"
            );
            checked += 1;
        }
    }
    assert_eq!(checked, 2, "the check and the refused guess");
    assert!(
        gateway.deliveries("").await.is_empty(),
        "handshakes queue nothing"
    );
    assert_eq!(handler.total(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_whatsapp_retry_that_batches_items_differently_processes_each_once() {
    let handler = Handler::start(Behaviour::AlwaysOk).await;
    let gateway = Gateway::start_with(&handler, options()).await;
    let ingest = gateway.ingest();
    let wamid = |n: u32| format!("wamid.{}.{n}", unique("w"));
    let (m1, m2, m3, s1) = (wamid(1), wamid(2), wamid(3), wamid(4));
    let message = |id: &str| json!({"from": "16505551234", "id": id, "timestamp": "1700000000", "type": "text", "text": {"body": "hi"}});
    let status = |id: &str, s: &str| json!({"id": id, "status": s, "timestamp": "1700000000", "recipient_id": "16505551234"});
    let delivery = |messages: Vec<serde_json::Value>, statuses: Vec<serde_json::Value>| {
        serde_json::to_vec(&json!({
            "object": "whatsapp_business_account",
            "entry": [{"id": "102290129340398", "changes": [{"field": "messages", "value": {
                "messaging_product": "whatsapp", "messages": messages, "statuses": statuses
            }}]}]
        }))
        .unwrap()
    };
    // The first delivery; then a retry that re-batches: one message again, one new, the same
    // status again and a newer status of the same message.
    let first = delivery(vec![message(&m1), message(&m2)], vec![status(&s1, "sent")]);
    let retry = delivery(
        vec![message(&m2), message(&m3)],
        vec![status(&s1, "sent"), status(&s1, "delivered")],
    );
    let adapter = WhatsApp { verify_token: None };
    let mut answers = Vec::new();
    for body in [&first, &retry, &first] {
        let headers = sign(&adapter, "meta-app-secret", body, Timestamp::now());
        let (code, answer) = ingest.post("p-whatsapp", &headers, body.clone()).await;
        assert_eq!(code, 200, "{answer}");
        answers.push(answer);
    }
    // Each item is judged by itself: what came before is a duplicate in any batch, never a
    // conflict with the batch it first came in.
    let claims = |answer: &serde_json::Value| -> Vec<(String, String)> {
        answer["events"]
            .as_array()
            .unwrap()
            .iter()
            .map(|e| {
                (
                    e["key"].as_str().unwrap().to_owned(),
                    e["claim"].as_str().unwrap().to_owned(),
                )
            })
            .collect()
    };
    let pair = |k: &str, c: &str| (k.to_owned(), c.to_owned());
    assert_eq!(
        claims(&answers[1]),
        [
            pair(&m2, "duplicate"),
            pair(&m3, "new"),
            pair(&format!("{s1}:sent"), "duplicate"),
            pair(&format!("{s1}:delivered"), "new"),
        ],
        "{}",
        answers[1]
    );
    assert!(
        claims(&answers[2]).iter().all(|(_, c)| c == "duplicate"),
        "{}",
        answers[2]
    );
    assert!(gateway.requests("verdict=conflict").await.is_empty());
    let keys: Vec<String> = [
        m1.clone(),
        m2.clone(),
        m3.clone(),
        format!("{s1}:sent"),
        format!("{s1}:delivered"),
    ]
    .iter()
    .map(|k| format!("p-whatsapp:{k}"))
    .collect();
    wait_until("every item delivered", || {
        keys.iter().all(|k| handler.count_for(k) >= 1)
    })
    .await;
    // Let anything extra arrive, then count: each item exactly once.
    let (_, _) = gateway.admin_get("/v1/deliveries?state=pending").await;
    gateway.wait_for_delivery_state(&keys[4], "delivered").await;
    for key in &keys {
        assert_eq!(handler.count_for(key), 1, "{key}");
    }
    assert_eq!(handler.total(), 5);
}

/// The provider's signature headers for `body`, as its adapter signs them.
fn sign(
    adapter: &dyn ProviderAdapter,
    secret: &str,
    body: &[u8],
    now: Timestamp,
) -> Vec<(String, String)> {
    let secret = Secret::from_text(secret);
    let mut headers = vec![("content-type".to_owned(), "application/json".to_owned())];
    headers.extend(adapter.sign(&SignRequest {
        body,
        secret: &secret,
        now,
        event_key: "unused",
        event_type: None,
        url: "http://127.0.0.1/in/x",
    }));
    headers
}

/// Twilio sends voice webhooks as a GET when a number is configured so: the parameters in the
/// query, the signature over the URL alone. Verified, claimed once, answered with TwiML, and
/// delivered as the form POST Twilio would otherwise have sent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_twilio_voice_webhook_sent_as_get_is_verified_queued_once_and_delivered_as_a_form() {
    let handler = Handler::start(Behaviour::AlwaysOk).await;
    let gateway = Gateway::start_with(&handler, options()).await;
    let ingest = gateway.ingest();
    let sid = unique("CA");
    let query = format!("CallSid={sid}&CallStatus=ringing&From=%2B14158675309&To=%2B18005551212");
    let url = format!("http://{}/in/p-twilio?{query}", ingest.addr());
    let twilio = fixtures::signer("twilio", &Secret::from_text("twilio-auth-token")).unwrap();
    let signed = twilio.sign(&SignRequest {
        url: &url,
        body: b"",
        secret: &Secret::from_text("twilio-auth-token"),
        now: Timestamp::now(),
        event_key: "unused",
        event_type: None,
    });
    // Keyed from the query, as when Twilio sends no idempotency token.
    let (name, signature) = signed
        .into_iter()
        .find(|(name, _)| name.eq_ignore_ascii_case("x-twilio-signature"))
        .expect("a signature header");
    let client = reqwest::Client::new();
    let get = |url: String| client.get(url).header(&name, &signature).send();

    for (round, verdict) in ["accepted", "duplicate"].into_iter().enumerate() {
        let res = get(url.clone()).await.unwrap();
        assert_eq!(res.status(), 200, "GET #{round}");
        assert_eq!(res.headers()["content-type"], "text/xml", "GET #{round}");
        // TwiML for Twilio; the gateway's verdict and request id in headers.
        assert_eq!(res.headers()["hooklatch-verdict"], verdict);
        assert!(res.headers()["hooklatch-request-id"]
            .to_str()
            .unwrap()
            .starts_with("req_"));
        let twiml = res.text().await.unwrap();
        assert!(twiml.contains("<Response"), "GET #{round}: {twiml}");
    }
    let tampered = url.replace("ringing", "completed");
    let res = get(tampered).await.unwrap();
    assert_eq!(res.status(), 401);
    let answer: serde_json::Value = res.json().await.unwrap();
    assert_eq!(answer["code"], "invalid_signature");

    let key = format!("p-twilio:{sid}:ringing");
    gateway.wait_for_delivery_state(&key, "delivered").await;
    let received: Vec<_> = handler
        .received()
        .into_iter()
        .filter(|r| r.key.as_deref() == Some(key.as_str()))
        .collect();
    assert_eq!(received.len(), 1, "delivered once");
    assert_eq!(
        received[0].body,
        query.as_bytes(),
        "the query, as a form body"
    );
    assert_eq!(
        received[0].headers["content-type"],
        "application/x-www-form-urlencoded"
    );
    assert_eq!(received[0].headers["hooklatch-event-type"], "call.ringing");

    let accepted = gateway.requests("verdict=accepted&source=p-twilio").await;
    assert_eq!(accepted.len(), 1, "{accepted:?}");
    let (status, detail) = gateway
        .admin_get(&format!(
            "/v1/requests/{}",
            accepted[0]["id"].as_str().unwrap()
        ))
        .await;
    assert_eq!(status, 200);
    assert_eq!(detail["method"], "GET", "kept as received: {detail}");
    assert_eq!(
        gateway
            .requests("verdict=duplicate&source=p-twilio")
            .await
            .len(),
        1
    );
    assert_eq!(
        gateway
            .requests("verdict=rejected&source=p-twilio")
            .await
            .len(),
        1
    );
}

/// `hooklatch send` against a source answered in the provider's own format (TwiML): the
/// gateway's verdict and request id, from its headers, on the status line.
#[tokio::test(flavor = "multi_thread")]
async fn send_shows_the_verdict_of_an_answer_in_twiml() {
    let handler = Handler::start(Behaviour::AlwaysOk).await;
    let gateway = Gateway::start_with(&handler, options()).await;
    let url = format!("http://{}/in/p-twilio", gateway.ingest().addr());
    let id = unique("SM");
    let send = || {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_hooklatch"))
            .args([
                "send",
                "twilio",
                "--id",
                &id,
                "--secret",
                "twilio-auth-token",
            ])
            .args(["--to", &url])
            .output()
            .expect("running hooklatch send");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).expect("utf-8")
    };
    // A wrong secret: the refusal is printed, exit status 1 (the request went, the answer was
    // not 2xx; 2 is for nothing sent).
    let refused = std::process::Command::new(env!("CARGO_BIN_EXE_hooklatch"))
        .args([
            "send",
            "twilio",
            "--secret",
            "not-the-auth-token",
            "--to",
            &url,
        ])
        .output()
        .expect("running hooklatch send");
    let stdout = String::from_utf8_lossy(&refused.stdout);
    assert_eq!(refused.status.code(), Some(1), "{stdout}");
    assert!(stdout.contains("401"), "{stdout}");
    for verdict in ["accepted", "duplicate"] {
        let stdout = send();
        let status = stdout.lines().nth(1).unwrap_or_default();
        assert!(
            status.starts_with(&format!("200 OK ({verdict}, req_")),
            "{stdout}"
        );
        assert!(stdout.contains("<Response"), "{stdout}");
    }
}

/// Twilio behind a proxy that maps its own path to the source's: the source's `public_url`
/// is that whole URL, and `send --public-url` signs for it while sending to the gateway.
#[tokio::test(flavor = "multi_thread")]
async fn send_signs_for_a_twilio_public_url_with_a_path() {
    const PUBLIC: &str = "https://example.com/hooks/twilio-calls";
    let handler = Handler::start(Behaviour::AlwaysOk).await;
    let mut options = options();
    options.log_level = "info";
    options.extra_config.push_str(&format!(
        "[[sources]]\nname = \"proxied\"\nprovider = \"twilio\"\n\
         secrets = [\"twilio-auth-token\"]\npublic_url = \"{PUBLIC}\"\ndestinations = [\"app\"]\n"
    ));
    let gateway = Gateway::start_with(&handler, options).await;
    // The start-up log shows which URL the source checks signatures against.
    let log = gateway.log();
    let logged = log.lines().find(|l| l.contains("source=proxied"));
    assert!(
        logged.is_some_and(|l| l.contains(&format!("public_url=\"{PUBLIC}\""))),
        "{log}"
    );
    let url = format!("http://{}/in/proxied?tenant=7", gateway.ingest().addr());
    let send = |provider: &str, public_url: Option<&str>| {
        let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_hooklatch"));
        cmd.args([
            "send",
            provider,
            "--secret",
            "twilio-auth-token",
            "--to",
            &url,
        ]);
        if let Some(public_url) = public_url {
            cmd.args(["--public-url", public_url]);
        }
        cmd.output().expect("running hooklatch send")
    };
    let signed_for_the_gateway = send("twilio", None);
    let stdout = String::from_utf8_lossy(&signed_for_the_gateway.stdout);
    assert_eq!(signed_for_the_gateway.status.code(), Some(1), "{stdout}");
    assert!(stdout.contains("401"), "{stdout}");

    let signed_for_the_proxy = send("twilio", Some(PUBLIC));
    let stdout = String::from_utf8_lossy(&signed_for_the_proxy.stdout);
    assert!(signed_for_the_proxy.status.success(), "{stdout}");
    assert!(stdout.contains("200 OK (accepted, req_"), "{stdout}");

    let not_twilio = send("stripe", Some(PUBLIC));
    let stderr = String::from_utf8_lossy(&not_twilio.stderr);
    assert_eq!(not_twilio.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("only Twilio signs the URL"), "{stderr}");
}

/// T16 with the store counted. Every provider's test events and their forgeries (wrong secret,
/// tampered body, signature left out, stale timestamp) go through the ingest router built
/// in-process over a counting store — and, in Redis mode, a counting key store: a forgery's
/// only store call is its history record (`record_rejection`), with no claim, key or outbox
/// read or write, and the key store is never called; each genuine event after them is one
/// `ingest` (in Redis mode, one claim and one `complete`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forgery_reads_and_writes_no_key_and_no_outbox_row() {
    use hooklatch::http::ExternalKeys;
    use hooklatch_testkit::{Counting, MemoryKeys, MemoryStore};
    use tower::ServiceExt;

    let dir = tempfile::tempdir().expect("a temp dir");
    let config = dir.path().join("hooklatch.toml");
    let text = format!(
        "[store]\nurl = \"sqlite://{}/unused.db\"\n\n[[destinations]]\nname = \"app\"\n\
         url = \"http://127.0.0.1:9/sink\"\nallow = [\"127.0.0.1\"]\n\n{}",
        dir.path().display(),
        options().extra_config
    );
    std::fs::write(&config, text).expect("writing the config");
    let env = std::collections::HashMap::from([(
        "HOOKLATCH_ADMIN_TOKEN".to_owned(),
        crate::support::ADMIN_TOKEN.to_owned(),
    )]);
    let settings = hooklatch::config::load(Some(&config), &env).expect("the config loads");

    for redis_mode in [false, true] {
        let store = std::sync::Arc::new(Counting::new(MemoryStore::default()));
        let keys = std::sync::Arc::new(Counting::new(MemoryKeys::default()));
        let router = hooklatch::http::ingest_router(std::sync::Arc::new(hooklatch::ingest_state(
            &settings,
            store.clone(),
            Default::default(),
            redis_mode.then(|| ExternalKeys {
                store: keys.clone(),
                lease: std::time::Duration::from_secs(30),
            }),
            None,
        )));
        let post = |source: &str, headers: &[(String, String)], body: Vec<u8>| {
            let mut request = http::Request::post(format!("/in/{source}")).header("host", HOST);
            for (name, value) in headers {
                request = request.header(name.as_str(), value.as_str());
            }
            let request = request
                .body(axum::body::Body::from(body))
                .expect("a request");
            let router = router.clone();
            async move {
                let answer = router.oneshot(request).await.expect("an answer");
                answer.status().as_u16()
            }
        };
        const HOST: &str = "127.0.0.1:9";

        let mut genuine = Vec::new();
        let mut forged = 0;
        for (provider, source, secret, _) in SOURCES {
            let secret = Secret::from_text(secret);
            let url = format!("http://{HOST}/in/{source}");
            for (_, name) in fixtures::catalog().filter(|(p, _)| p == provider) {
                let id = unique("pid");
                let now = Timestamp::now();
                for (kind, headers, body) in forgeries(provider, name, &id, &secret, &url, now) {
                    let status = post(source, &headers, body).await;
                    assert_eq!(
                        status, 401,
                        "{provider}/{name} {kind} (redis: {redis_mode})"
                    );
                    forged += 1;
                }
                let event = fixtures::build(provider, Some(name), Some(&id), &secret, &url, now)
                    .expect("a test event");
                genuine.push((*source, event));
            }
        }
        let mode = if redis_mode { "redis mode" } else { "sql mode" };
        assert_eq!(
            store.calls(),
            std::collections::BTreeMap::from([("record_rejection", forged)]),
            "{mode}: {forged} forgeries, each one history record and nothing else"
        );
        assert!(keys.calls().is_empty(), "{mode}: {:?}", keys.calls());

        for (source, event) in &genuine {
            let status = post(source, &event.headers, event.body.clone()).await;
            assert_eq!(status, 200, "{source} genuine ({mode})");
        }
        let n = genuine.len() as u64;
        assert_eq!(store.count("ingest"), n, "{mode}");
        if redis_mode {
            // One claim per request; its keys marked done once per content hash (a batch's
            // items each have their own).
            assert_eq!(keys.count("claim"), n);
            assert!(keys.count("complete") >= n, "{:?}", keys.calls());
        }
        println!(
            "{mode}: {forged} forgeries, store calls {:?}",
            store.calls()
        );

        // T17: each claimed event replayed after the window (signed 400 s ago, byte-exact
        // body): 401 `stale_timestamp`, with the history record its only store call, and no
        // key read to find it was claimed.
        store.reset();
        keys.reset();
        let mut stale = 0;
        for (provider, source, secret, _) in SOURCES {
            if !TIMESTAMPED.contains(provider) {
                continue;
            }
            let secret = Secret::from_text(secret);
            let url = format!("http://{HOST}/in/{source}");
            for (claimed_source, event) in &genuine {
                if claimed_source != source {
                    continue;
                }
                let name = event.event_type.as_str();
                let old = Timestamp::now().minus(std::time::Duration::from_secs(400));
                let replay =
                    fixtures::build(provider, Some(name), Some(&event.key), &secret, &url, old)
                        .expect("a replay");
                assert!(
                    replay.body == event.body,
                    "{provider}/{name}: the same body"
                );
                let status = post(source, &replay.headers, replay.body).await;
                assert_eq!(status, 401, "{provider}/{name} replayed late ({mode})");
                stale += 1;
            }
        }
        assert!(stale >= 5, "{stale} late replays");
        assert_eq!(
            store.calls(),
            std::collections::BTreeMap::from([("record_rejection", stale)]),
            "{mode}: late replays of claimed events"
        );
        assert!(keys.calls().is_empty(), "{mode}: {:?}", keys.calls());
        println!("{mode}: {stale} late replays of claimed events, each one history record");
    }
}

/// T16 on a real PostgreSQL, cross-checked by the server's own counters: a `serve` on a fresh
/// database takes every provider's forgeries, then its genuine events. Once
/// `pg_stat_user_tables` counts every request's history row (the server publishes a session's
/// counts some time after it goes idle: the check waits for them), the claims, deliveries and
/// request keys tables have exactly the genuine events' rows inserted, not one more: each
/// forgery wrote its history record and nothing else.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forgeries_insert_nothing_but_their_history_rows_by_postgres_own_count() {
    use sqlx::Connection;
    let Some((db, _handler, gateway)) = crate::postgres::gateway_on_fresh_database(options()).await
    else {
        return;
    };
    let ingest = gateway.ingest();
    let base = format!("http://{}", ingest.addr());
    let (mut forged, mut genuine, mut events) = (0i64, 0i64, 0i64);
    let mut sent = Vec::new();
    for (provider, source, secret, _) in SOURCES {
        let secret = Secret::from_text(secret);
        let url = format!("{base}/in/{source}");
        for (_, name) in fixtures::catalog().filter(|(p, _)| p == provider) {
            let id = unique("pgstat");
            let now = Timestamp::now();
            for (kind, headers, body) in forgeries(provider, name, &id, &secret, &url, now) {
                let (status, answer) = ingest.post(source, &headers, body).await;
                assert_eq!(status, 401, "{provider}/{name} {kind}: {answer}");
                forged += 1;
            }
            let event = fixtures::build(provider, Some(name), Some(&id), &secret, &url, now)
                .expect("a test event");
            sent.push((*source, event));
            events += if name == "batch" { 5 } else { 1 };
        }
    }
    for (source, event) in &sent {
        let (status, answer) = ingest
            .post(source, &event.headers, event.body.clone())
            .await;
        assert_eq!(status, 200, "{source}: {answer}");
        genuine += 1;
    }

    let mut conn = sqlx::PgConnection::connect(&db.url())
        .await
        .expect("a session on the test database");
    let inserted = async |conn: &mut sqlx::PgConnection, table: &str| -> i64 {
        sqlx::query_scalar(
            "SELECT COALESCE(SUM(n_tup_ins), 0)::bigint FROM pg_stat_user_tables WHERE relname = $1",
        )
        .bind(table)
        .fetch_one(conn)
        .await
        .expect("reading pg_stat_user_tables")
    };
    let started = std::time::Instant::now();
    loop {
        // A fresh snapshot of the counters each time round.
        sqlx::query("SELECT pg_stat_clear_snapshot()")
            .execute(&mut conn)
            .await
            .expect("clearing the stats snapshot");
        let requests = inserted(&mut conn, "requests").await;
        if requests == forged + genuine {
            break;
        }
        assert!(
            requests < forged + genuine,
            "{requests} history rows for {forged} forgeries and {genuine} genuine requests"
        );
        assert!(
            started.elapsed() < std::time::Duration::from_secs(60),
            "the server counted {requests} of {} history rows within 60 s",
            forged + genuine
        );
        tokio::time::sleep(std::time::Duration::from_millis(250)).await;
    }
    for table in ["claims", "deliveries"] {
        assert_eq!(
            inserted(&mut conn, table).await,
            events,
            "{table}: rows inserted for {events} genuine events and {forged} forgeries"
        );
    }
    assert_eq!(
        inserted(&mut conn, "request_keys").await,
        0,
        "no request keys for first copies (and none for forgeries)"
    );
    println!(
        "pg_stat_user_tables: {forged} forgeries and {genuine} genuine requests: requests +{}, claims +{events}, deliveries +{events}",
        forged + genuine
    );
    drop(conn);
    drop(gateway);
    db.drop_now().await;
}
