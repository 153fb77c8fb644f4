//! A store that runs out of space.
//!
//! Proves that when the SQLite file reaches its size cap (`?max_page_count=N`), ingest answers
//! 503 with a `store_full` (or `store_unavailable`) code and a `Retry-After`, never 2xx: every
//! event answered 2xx is in history and is delivered, and no event answered 503 left a trace
//! in history or reached the destination.

use serde_json::Value;

use crate::support::{
    stripe_headers, stripe_invoice_paid_padded, unique, wait_until, Behaviour, Gateway, Handler,
};

/// Events sent before giving up on ever filling the store.
const MAX_EVENTS: usize = 200;
/// Events sent after the first 503, to see that a full store keeps refusing honestly.
const AFTER_FULL: usize = 5;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_store_answers_503_and_never_2xx_for_an_event_it_did_not_keep() {
    let mut card = crate::report::Card::new("T3", "sqlite");
    let handler = Handler::start(Behaviour::AlwaysOk).await;
    // The schema's size, measured rather than assumed, then a cap of 24 more pages of 4 KiB:
    // room for a handful of 8 KiB events.
    let mut gw = Gateway::start(&handler).await;
    gw.sigterm();
    assert!(gw.wait_exit().await.success());
    let cap = gw.database_pages() + 24;
    gw.reconfigure(|o| o.max_page_count = Some(cap));
    gw.restart().await;
    let run = unique("evt_full");
    let ingest = gw.ingest();

    let mut answered: Vec<(String, u16, Value)> = Vec::new();
    let mut first_full = None;
    for i in 0..MAX_EVENTS {
        let event_id = format!("{run}_{i:03}");
        let body = stripe_invoice_paid_padded(&event_id, 5000, 8 * 1024);
        let res = ingest
            .send("stripe", &stripe_headers(&body), body)
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
