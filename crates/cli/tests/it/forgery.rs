//! Forged and stale deliveries carrying the id of a genuine event that comes later.
//!
//! Proves that the signature (and its timestamp) is checked before the store is touched: a
//! forgery with the wrong secret, a missing signature, a tampered body and a stale timestamp
//! are each answered 401 with a code naming the reason and recorded in history as rejected,
//! none of them claims the event id, so the genuine event that follows is accepted and
//! delivered once.

use std::time::Duration;

use crate::support::{
    stripe_headers, stripe_headers_signed, stripe_invoice_paid, unique, wait_until, Behaviour,
    Gateway, Handler, STRIPE_SECRET,
};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forgeries_of_an_event_are_refused_and_the_genuine_event_is_still_processed() {
    let handler = Handler::start(Behaviour::AlwaysOk).await;
    let gw = Gateway::start(&handler).await;
    let event_id = unique("evt_forged");
    let key = format!("stripe:{event_id}");
    let genuine = stripe_invoice_paid(&event_id, 5000);
    // The forger's payload: the genuine id, a different amount.
    let forged = stripe_invoice_paid(&event_id, 999_999);

    let wrong_secret = stripe_headers_signed(
        &forged,
        "whsec_not_the_endpoint_secret",
        hooklatch_core::Timestamp::now(),
    );
    let unsigned = vec![("content-type".to_owned(), "application/json".to_owned())];
    // Signed over the genuine body, sent with the forged one.
    let tampered = stripe_headers(&genuine);
    let stale = stripe_headers_signed(
        &genuine,
        STRIPE_SECRET,
        hooklatch_core::Timestamp::now().minus(Duration::from_secs(400)),
    );
    let attempts = [
        (
            "wrong secret",
            wrong_secret,
            forged.clone(),
            "invalid_signature",
        ),
        (
            "no signature",
            unsigned,
            forged.clone(),
            "missing_signature",
        ),
        (
            "tampered body",
            tampered,
            forged.clone(),
            "invalid_signature",
        ),
        ("stale timestamp", stale, genuine.clone(), "stale_timestamp"),
    ];
    for (what, headers, body, code) in &attempts {
        let (status, json) = gw.post("stripe", headers, body.clone()).await;
        assert_eq!(status, 401, "{what}: {json}");
        assert_eq!(json["code"], *code, "{what}: {json}");
        assert!(json["message"].is_string(), "{what}: {json}");
    }

    // History lists each refusal with its reason, newest first, and no key claimed.
    let rejected = gw.requests("verdict=rejected").await;
    let reasons: Vec<&str> = rejected
        .iter()
        .map(|r| r["reason"].as_str().unwrap_or("?"))
        .collect();
    let expected: Vec<&str> = attempts.iter().rev().map(|a| a.3).collect();
    assert_eq!(reasons, expected, "{rejected:#?}");
    for r in &rejected {
        assert_eq!(r["status"], 401, "{r}");
        assert_eq!(r["source"], "stripe", "{r}");
        assert_eq!(r["keys"], serde_json::json!([]), "{r}");
    }
    // The forgery is kept byte-exact for inspection.
    let first_id = rejected.last().expect("four rejections")["id"]
        .as_str()
        .expect("an id")
        .to_owned();
    let (status, detail) = gw.admin_get(&format!("/v1/requests/{first_id}")).await;
    assert_eq!(status, 200, "{detail}");
    assert_eq!(detail["verdict"], "rejected");
    assert_eq!(
        detail["body"].as_str(),
        Some(std::str::from_utf8(&forged).expect("UTF-8")),
        "the forged body is stored byte-exact"
    );
    assert!(gw.deliveries("").await.is_empty(), "nothing was queued");
    assert!(gw.requests(&format!("key={event_id}")).await.is_empty());

    // The genuine event, arriving later, is new and delivered once.
    let (status, json) = gw
        .post("stripe", &stripe_headers(&genuine), genuine.clone())
        .await;
    assert_eq!(status, 200, "{json}");
    assert_eq!(json["status"], "accepted", "{json}");
    assert_eq!(json["events"][0]["claim"], "new", "{json}");
    wait_until("the genuine event is forwarded", || {
        handler.count_for(&key) >= 1
    })
    .await;
    gw.wait_for_delivery_state(&key, "delivered").await;
    assert_eq!(handler.count_for(&key), 1);
    assert_eq!(handler.total(), 1, "no forgery was forwarded");
    assert_eq!(handler.received_for(&key)[0].body, genuine);
}
