//! The seed scenario: one Stripe `invoice.payment_succeeded` event, validly signed.
//!
//! Proves that ten deliveries in a row are all answered 2xx and forwarded once, byte-exact,
//! with `Idempotency-Key: stripe:<event id>` and the provider's own headers; that 32 concurrent
//! copies yield exactly one claim and one forward; and that the old payload replayed after the
//! event was fully delivered is answered 2xx as a duplicate and forwarded no more.

use std::sync::Arc;

use serde_json::Value;
use tokio::sync::Barrier;
use tokio::task::JoinSet;

use hooklatch_core::Timestamp;

use crate::support::{
    header, stripe_headers, stripe_headers_signed, stripe_invoice_paid, stripe_verifies, unique,
    wait_until, Behaviour, Gateway, Handler, Options, STRIPE_SECRET,
};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_deliveries_in_a_row_of_one_event_get_ten_2xx_and_exactly_one_forward() {
    let handler = Handler::start(Behaviour::AlwaysOk).await;
    let gw = Gateway::start(&handler).await;
    let event_id = unique("evt_seed");
    let key = format!("stripe:{event_id}");
    let body = stripe_invoice_paid(&event_id, 5000);

    let mut replies = Vec::new();
    for _ in 0..10 {
        // Stripe signs every retry afresh.
        let headers = stripe_headers(&body);
        let (status, json) = gw.post("stripe", &headers, body.clone()).await;
        replies.push((headers, status, json));
    }

    for (i, (_, status, json)) in replies.iter().enumerate() {
        assert_eq!(*status, 200, "delivery {i}: {json}");
    }
    let verdicts: Vec<&str> = replies
        .iter()
        .map(|(_, _, json)| json["status"].as_str().unwrap_or("?"))
        .collect();
    assert_eq!(verdicts[0], "accepted", "{verdicts:?}");
    assert!(
        verdicts[1..].iter().all(|v| *v == "duplicate"),
        "{verdicts:?}"
    );
    let first = &replies[0].2;
    assert_eq!(first["events"][0]["key"], event_id.as_str());
    assert_eq!(first["events"][0]["claim"], "new");
    for (_, _, json) in &replies[1..] {
        assert_eq!(json["events"][0]["claim"], "duplicate", "{json}");
        assert_eq!(json["events"][0]["first_request"], first["request_id"]);
    }

    wait_until("the event is forwarded", || handler.count_for(&key) >= 1).await;
    let row = gw.wait_for_delivery_state(&key, "delivered").await;
    assert_eq!(row["attempts"], 1, "{row:#}");
    assert_eq!(gw.deliveries("").await.len(), 1, "one outbox row in all");
    assert_eq!(handler.count_for(&key), 1, "forwarded exactly once");
    assert_eq!(handler.total(), 1);

    let forwarded = &handler.received_for(&key)[0];
    assert_eq!(forwarded.body, body, "the body is forwarded byte-exact");
    // Signed again at the attempt's time with the source's secret: it verifies as Stripe's.
    assert!(
        stripe_verifies(&forwarded.body, forwarded.header("stripe-signature")),
        "{}",
        forwarded.header("stripe-signature")
    );
    assert_eq!(
        forwarded.header("content-type"),
        "application/json; charset=utf-8"
    );
    assert_eq!(forwarded.attempt, Some(1));
    assert_eq!(forwarded.header("hooklatch-source"), "stripe");
    assert_eq!(
        forwarded.header("hooklatch-event-type"),
        "invoice.payment_succeeded"
    );

    // History kept all ten requests under the event's key.
    let history = gw.requests(&format!("key={event_id}")).await;
    let mut verdicts: Vec<&str> = history
        .iter()
        .map(|r| r["verdict"].as_str().unwrap_or("?"))
        .collect();
    verdicts.sort_unstable();
    assert_eq!(
        verdicts,
        [["accepted"].as_slice(), &["duplicate"; 9]].concat()
    );
}

/// Stripe's signature covers a timestamp its libraries hold to 300 s: an event accepted late
/// in that window, then delivered, is delivered with the signature made again at the
/// attempt's time (`provider_signature = "fresh"`, the default), which the application's
/// Stripe check takes however late the attempt; a destination with `provider_signature =
/// "original"` gets the header exactly as Stripe sent it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delivery_carries_stripes_signature_made_at_its_own_time_unless_original_is_asked() {
    let handler = Handler::start(Behaviour::AlwaysOk).await;
    let options = Options {
        extra_config: format!(
            "[[sources]]\nname = \"stripe-as-sent\"\nprovider = \"stripe\"\n\
             secrets = [\"{STRIPE_SECRET}\"]\ndestinations = [\"as-sent\"]\n\n\
             [[destinations]]\nname = \"as-sent\"\nurl = \"{}\"\nallow = [\"127.0.0.1\"]\n\
             provider_signature = \"original\"\n",
            handler.url()
        ),
        ..Options::default()
    };
    let gw = Gateway::start_with(&handler, options).await;
    let signed_at = Timestamp::from_secs(Timestamp::now().as_secs() - 250);
    let mut sent = Vec::new();
    for source in ["stripe", "stripe-as-sent"] {
        let event_id = unique("evt_signed_late");
        let body = stripe_invoice_paid(&event_id, 5000);
        let headers = stripe_headers_signed(&body, STRIPE_SECRET, signed_at);
        let (status, json) = gw.post(source, &headers, body.clone()).await;
        assert_eq!(
            (status, json["status"].as_str()),
            (200, Some("accepted")),
            "{json}"
        );
        let key = format!("{source}:{event_id}");
        gw.wait_for_delivery_state(&key, "delivered").await;
        sent.push((key, body, header(&headers, "stripe-signature").to_owned()));
    }

    let (key, body, as_sent) = &sent[0];
    let got = &handler.received_for(key)[0];
    let fresh = got.header("stripe-signature");
    assert_ne!(fresh, as_sent);
    let t: i64 = fresh
        .strip_prefix("t=")
        .and_then(|rest| rest.split(',').next())
        .and_then(|t| t.parse().ok())
        .unwrap_or_else(|| panic!("a Stripe signature: {fresh}"));
    assert!(
        t >= signed_at.as_secs() + 250,
        "signed at the attempt: {fresh}"
    );
    assert!(stripe_verifies(body, fresh), "{fresh}");
    assert_eq!(got.body, *body);

    let (key, _, as_sent) = &sent[1];
    let got = &handler.received_for(key)[0];
    assert_eq!(got.header("stripe-signature"), as_sent, "as Stripe sent it");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn thirty_two_concurrent_copies_of_one_event_yield_one_claim_and_one_forward() {
    let handler = Handler::start(Behaviour::AlwaysOk).await;
    let gw = Gateway::start(&handler).await;
    let event_id = unique("evt_storm");
    let key = format!("stripe:{event_id}");
    let body = stripe_invoice_paid(&event_id, 5000);

    let copies = 32;
    let start = Arc::new(Barrier::new(copies));
    let mut senders = JoinSet::new();
    for _ in 0..copies {
        let ingest = gw.ingest();
        let body = body.clone();
        let start = start.clone();
        senders.spawn(async move {
            let headers = stripe_headers(&body);
            start.wait().await;
            ingest.post("stripe", &headers, body).await
        });
    }
    let replies: Vec<(u16, Value)> = senders.join_all().await;

    for (status, json) in &replies {
        assert_eq!(*status, 200, "{json}");
    }
    let count = |verdict: &str| {
        replies
            .iter()
            .filter(|(_, j)| j["status"] == verdict)
            .count()
    };
    assert_eq!(count("accepted"), 1, "{replies:#?}");
    assert_eq!(count("duplicate"), copies - 1, "{replies:#?}");

    wait_until("the event is forwarded", || handler.count_for(&key) >= 1).await;
    gw.wait_for_delivery_state(&key, "delivered").await;
    assert_eq!(gw.deliveries("").await.len(), 1, "one outbox row in all");
    assert_eq!(handler.count_for(&key), 1, "forwarded exactly once");
    assert_eq!(handler.received_for(&key)[0].body, body);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_old_payload_replayed_after_delivery_gets_2xx_and_is_not_forwarded() {
    let handler = Handler::start(Behaviour::AlwaysOk).await;
    let gw = Gateway::start(&handler).await;
    let event_id = unique("evt_replay");
    let key = format!("stripe:{event_id}");
    let body = stripe_invoice_paid(&event_id, 5000);
    let original_headers = stripe_headers(&body);

    let (status, first) = gw.post("stripe", &original_headers, body.clone()).await;
    assert_eq!((status, first["status"].as_str()), (200, Some("accepted")));
    gw.wait_for_delivery_state(&key, "delivered").await;
    assert_eq!(handler.count_for(&key), 1);

    // The request exactly as first sent, then the payload re-signed with a fresh timestamp.
    for headers in [original_headers.clone(), stripe_headers(&body)] {
        let (status, json) = gw.post("stripe", &headers, body.clone()).await;
        assert_eq!(status, 200, "{json}");
        assert_eq!(json["status"], "duplicate", "{json}");
        assert_eq!(json["events"][0]["first_request"], first["request_id"]);
    }

    // No new outbox row: nothing can ever forward the replay.
    let rows = gw.deliveries_for(&key).await;
    assert_eq!(rows.len(), 1, "{rows:#?}");
    assert_eq!(rows[0]["state"], "delivered");
    // And a later event overtakes nothing: once it is delivered, the replay still is not.
    let later_id = unique("evt_later");
    let later = stripe_invoice_paid(&later_id, 700);
    let (status, _) = gw.post("stripe", &stripe_headers(&later), later).await;
    assert_eq!(status, 200);
    gw.wait_for_delivery_state(&format!("stripe:{later_id}"), "delivered")
        .await;
    assert_eq!(handler.count_for(&key), 1, "the replay was not forwarded");
    assert_eq!(handler.total(), 2);
}

/// T1 on SQLite at full size: 1,000 events (`HOOKLATCH_SCALE` times more in the soak tier),
/// each sent 32 times by 64 senders with 0–5 ms of jitter per copy (the card's seed): one
/// `accepted` and 31 `duplicate`s per event, every answer 200, each event forwarded once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thousand_events_sent_32_times_each_make_one_claim_and_one_forward_each() {
    let mut card = crate::report::Card::new("T1", "sqlite");
    let handler = Handler::start(Behaviour::AlwaysOk).await;
    let gw = Gateway::start(&handler).await;
    // SQLite answers every copy itself (no lock waits): nothing to retry.
    let retry = crate::support::Retry {
        statuses: &[],
        attempts: 1,
        backoff: std::time::Duration::ZERO,
    };
    let (ids, _) = crate::support::one_claim_per_event(
        &[gw.ingest()],
        &gw,
        &handler,
        &mut card,
        &unique("evt_sqlite_storm"),
        32,
        retry,
    )
    .await;
    println!(
        "T1 sqlite: ids={} copies=32 forwards={}",
        ids.len(),
        handler.total()
    );
}
