//! A store that runs out of space.
//!
//! Proves that when the SQLite file reaches its size cap (`?max_page_count=N`), ingest answers
//! 503 with a `store_full` (or `store_unavailable`) code and a `Retry-After`, never 2xx: every
//! event answered 2xx is in history and is delivered, and no event answered 503 left a trace
//! in history or reached the destination.

use serde_json::Value;

use crate::support::{
    eventually, stripe_headers, stripe_invoice_paid_padded, unique, wait_until, Behaviour, Gateway,
    Handler, Options,
};

/// Events sent before giving up on ever filling the store.
const MAX_EVENTS: usize = 200;
/// Events sent after the first 503, to see that a full store keeps refusing honestly.
const AFTER_FULL: usize = 5;

/// What each event sent to a filling store was answered: (event id, status, JSON body).
type Answered = Vec<(String, u16, Value)>;

/// A gateway on a SQLite file capped at the schema's size, measured rather than assumed, plus
/// 24 pages of 4 KiB: room for a handful of 8 KiB events. Returns it and the cap.
async fn capped_gateway(handler: &Handler, options: Options) -> (Gateway, u64) {
    let mut gw = Gateway::start_with(handler, options).await;
    gw.sigterm();
    assert!(gw.wait_exit().await.success());
    let cap = gw.database_pages() + 24;
    gw.reconfigure(|o| o.max_page_count = Some(cap));
    gw.restart().await;
    (gw, cap)
}

/// Sends 8 KiB events until the store answers 503, and [`AFTER_FULL`] more: every answer is a
/// 200 or a 503 with a `Retry-After`. Returns the answers and the index of the first 503.
async fn fill(gw: &Gateway, source: &str, run: &str) -> (Answered, usize) {
    let ingest = gw.ingest();
    let mut answered = Vec::new();
    let mut first_full = None;
    for i in 0..MAX_EVENTS {
        let event_id = format!("{run}_{i:03}");
        let body = stripe_invoice_paid_padded(&event_id, 5000, 8 * 1024);
        let res = ingest
            .send(source, &stripe_headers(&body), body)
            .await
            .expect("the gateway answers");
        let status = res.status().as_u16();
        let retry_after = res.headers().get("retry-after").cloned();
        let json: Value = res.json().await.unwrap_or(Value::Null);
        assert!(
            status == 200 || status == 503,
            "{event_id}: {status} {json}"
        );
        if status == 503 {
            assert!(retry_after.is_some(), "a 503 says when to retry");
            first_full.get_or_insert(i);
        }
        answered.push((event_id, status, json));
        if first_full.is_some_and(|f| i >= f + AFTER_FULL) {
            break;
        }
    }
    let first_full =
        first_full.unwrap_or_else(|| panic!("no 503 after {MAX_EVENTS} events of 8 KiB"));
    assert!(first_full > 0, "the store had room for at least one event");
    (answered, first_full)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_store_answers_503_and_never_2xx_for_an_event_it_did_not_keep() {
    let mut card = crate::report::Card::new("T3", "sqlite");
    let handler = Handler::start(Behaviour::AlwaysOk).await;
    let (gw, cap) = capped_gateway(&handler, Options::default()).await;
    let run = unique("evt_full");
    let (answered, first_full) = fill(&gw, "stripe", &run).await;

    let mut accepted = Vec::new();
    for (event_id, status, json) in &answered {
        let history = gw.requests(&format!("key={event_id}")).await;
        if *status == 200 {
            assert_eq!(json["status"], "accepted", "{json}");
            assert_eq!(history.len(), 1, "{event_id} answered 2xx: {history:#?}");
            assert_eq!(history[0]["verdict"], "accepted");
            accepted.push(format!("stripe:{event_id}"));
        } else {
            let code = json["code"].as_str().unwrap_or("");
            assert!(
                code == "store_full" || code == "store_unavailable",
                "{event_id}: {json}"
            );
            assert!(history.is_empty(), "{event_id} answered 503: {history:#?}");
        }
    }

    wait_until("every event answered 2xx is delivered", || {
        let seen = handler.distinct_keys();
        accepted.iter().all(|k| seen.contains(k))
    })
    .await;
    let seen = handler.distinct_keys();
    for (event_id, status, _) in &answered {
        if *status == 503 {
            assert!(!seen.contains(&format!("stripe:{event_id}")), "{event_id}");
        }
    }
    card.count("ops", answered.len())
        .count("acked", accepted.len())
        .count("lost", 0)
        .fault("disk_full", 1)
        .figure("cap_pages", cap)
        .figure("first_503_at_event", first_full);
    println!(
        "store full: cap {cap} pages, {} events accepted, first 503 at event {first_full}",
        accepted.len()
    );
}

/// A Stripe source whose keys are kept for a second, so the purge can make room.
const SHORT: &str = "stripe-short";

/// `/readyz` while the store is full, and after: 503 "store full" (and `hooklatch_store_full`
/// 1) from the first event the store could not keep, for as long as nothing makes room; ready
/// again, without a restart, once the purge removed expired keys and the delivered events'
/// history, and the next event is accepted. The destination is disabled while the store
/// fills, so every accepted event's delivery is held and nothing can be purged until it is
/// enabled: the not-ready state is watched with nothing racing it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_store_is_not_ready_until_room_is_made_and_then_takes_events_again() {
    let handler = Handler::start(Behaviour::AlwaysOk).await;
    let (gw, _) = capped_gateway(
        &handler,
        Options {
            store_config: "history_retention = \"1s\"\npurge_interval = \"1s\"",
            extra_config: format!(
                "[[sources]]\nname = \"{SHORT}\"\nprovider = \"stripe\"\nsecrets = [\"env:E2E_STRIPE_SECRET\"]\nretention = \"1s\"\ndestinations = [\"app\"]\n"
            ),
            ..Options::default()
        },
    )
    .await;
    let (status, _) = gw.admin_post("/v1/destinations/app/disable").await;
    assert_eq!(status, 200);
    let (status, ready) = gw.admin_get("/readyz").await;
    assert_eq!(status, 200, "{ready}");

    let run = unique("evt_room");
    let (answered, _) = fill(&gw, SHORT, &run).await;
    for _ in 0..3 {
        let (status, ready) = gw.admin_get("/readyz").await;
        assert_eq!(
            (status, ready["reason"].as_str()),
            (503, Some("store full")),
            "{ready}"
        );
    }
    assert!(
        gw.metrics().await.contains("hooklatch_store_full 1"),
        "the gauge says full"
    );

    let (status, _) = gw.admin_post("/v1/destinations/app/enable").await;
    assert_eq!(status, 200);
    let accepted: Vec<String> = answered
        .iter()
        .filter(|(_, status, _)| *status == 200)
        .map(|(id, _, _)| format!("{SHORT}:{id}"))
        .collect();
    wait_until("every accepted event is delivered", || {
        let seen = handler.distinct_keys();
        accepted.iter().all(|k| seen.contains(k))
    })
    .await;
    eventually("the purge made room and the gateway is ready", async || {
        gw.admin_get("/readyz").await.0 == 200
    })
    .await;
    let event_id = format!("{run}_after");
    let body = stripe_invoice_paid_padded(&event_id, 5000, 8 * 1024);
    let (status, answer) = gw.post(SHORT, &stripe_headers(&body), body).await;
    assert_eq!((status, answer["status"].as_str()), (200, Some("accepted")));
    assert!(
        gw.metrics().await.contains("hooklatch_store_full 0"),
        "the gauge says there is room"
    );
    wait_until("the event after the purge is delivered", || {
        handler
            .distinct_keys()
            .contains(&format!("{SHORT}:{event_id}"))
    })
    .await;
}
