//! T18, a signing secret rotated under load (RELIABILITY.md): the source configured with the
//! old and the new secret while the sender moves from the old to both (Stripe signs with both
//! during a rotation: two `v1` entries) to the new, 10,000 events at a steady 1,000 a second
//! (an open loop: each event has its due time, whatever the answers before it took); no
//! verification fails. Then the old secret
//! is removed from the config and the gateway restarted: what only the old one signs is
//! refused 401 `invalid_signature`, and the new one still verifies.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use hooklatch_core::Timestamp;
use tokio::task::JoinSet;

use crate::report::{scaled, Card};
use crate::support::{
    stripe_headers_signed, stripe_invoice_paid, unique, Behaviour, Gateway, Handler, Options,
    STRIPE_SECRET,
};

const NEW_SECRET: &str = "whsec_e2e_rotated_endpoint_secret_4567";
const EVENTS: usize = 10_000;
/// Events sent a second, as a provider's steady traffic: event `i` is due `i` ms after the start.
const RATE: u64 = 1_000;
/// Requests in flight at most; a sender whose event is late sends it at once, so that a
/// gateway slowed for a moment (a debug build beside the other tests in CI) catches up.
const SENDERS: usize = 64;

/// The source's `secrets` as an environment override.
fn secrets(list: &[&str]) -> (String, String) {
    let quoted: Vec<String> = list.iter().map(|s| format!("\"{s}\"")).collect();
    (
        "HOOKLATCH_SOURCES__STRIPE__SECRETS".to_owned(),
        format!("[{}]", quoted.join(",")),
    )
}

/// Which secrets sign event `i` of `n`: the old for the first third, both for the second, the
/// new for the rest.
fn signers(i: usize, n: usize) -> &'static [&'static str] {
    match i * 3 / n {
        0 => &[STRIPE_SECRET],
        1 => &[STRIPE_SECRET, NEW_SECRET],
        _ => &[NEW_SECRET],
    }
}

/// Stripe's headers for `body` signed by every secret in `by`, at one timestamp.
fn signed_by(body: &[u8], by: &[&str]) -> Vec<(String, String)> {
    let at = Timestamp::now();
    let mut headers = stripe_headers_signed(body, by[0], at);
    for secret in &by[1..] {
        let more = stripe_headers_signed(body, secret, at);
        let v1 = more
            .iter()
            .find(|(name, _)| name.eq_ignore_ascii_case("stripe-signature"))
            .and_then(|(_, value)| value.split(',').find(|part| part.starts_with("v1=")))
            .expect("a v1 signature")
            .to_owned();
        for (name, value) in &mut headers {
            if name.eq_ignore_ascii_case("stripe-signature") {
                value.push(',');
                value.push_str(&v1);
            }
        }
    }
    headers
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_secret_rotated_under_load_fails_no_event_and_the_old_one_stops_once_removed() {
    let mut card = Card::new("T18", "sqlite");
    let handler = Handler::start(Behaviour::AlwaysOk).await;
    let mut gw = Gateway::start_with(
        &handler,
        Options {
            extra_env: vec![secrets(&["env:E2E_STRIPE_SECRET", NEW_SECRET])],
            ..Options::default()
        },
    )
    .await;

    let events = scaled(EVENTS);
    let run = unique("evt_rotate");
    let next = Arc::new(AtomicUsize::new(0));
    let refused = Arc::new(AtomicUsize::new(0));
    let start = tokio::time::Instant::now();
    let mut senders = JoinSet::new();
    for _ in 0..SENDERS {
        let (ingest, next, refused, run) =
            (gw.ingest(), next.clone(), refused.clone(), run.clone());
        senders.spawn(async move {
            loop {
                let i = next.fetch_add(1, Ordering::SeqCst);
                if i >= events {
                    return;
                }
                let due = start + Duration::from_micros(i as u64 * 1_000_000 / RATE);
                tokio::time::sleep_until(due).await;
                let body = stripe_invoice_paid(&format!("{run}_{i:05}"), 5000);
                let headers = signed_by(&body, signers(i, events));
                let (status, json) = ingest.post("stripe", &headers, body).await;
                if (status, json["status"].as_str()) != (200, Some("accepted")) {
                    eprintln!(
                        "event {i} signed by {:?}: {status} {json}",
                        signers(i, events).len()
                    );
                    refused.fetch_add(1, Ordering::SeqCst);
                }
            }
        });
    }
    senders.join_all().await;
    let sending = start.elapsed();
    let refused = refused.load(Ordering::SeqCst);
    assert_eq!(refused, 0, "verifications failed during the rotation");

    // The rotation is over: the old secret leaves the config.
    gw.reconfigure(|o| o.extra_env = vec![secrets(&[NEW_SECRET])]);
    gw.restart().await;
    let body = stripe_invoice_paid(&unique("evt_old_only"), 5000);
    let (status, json) = gw
        .post("stripe", &signed_by(&body, &[STRIPE_SECRET]), body)
        .await;
    assert_eq!(
        (status, json["code"].as_str()),
        (401, Some("invalid_signature")),
        "{json}"
    );
    let body = stripe_invoice_paid(&unique("evt_new_only"), 5000);
    let (status, json) = gw
        .post("stripe", &signed_by(&body, &[NEW_SECRET]), body)
        .await;
    assert_eq!(
        (status, json["status"].as_str()),
        (200, Some("accepted")),
        "{json}"
    );
    card.count("ops", events + 2)
        .count("acked", events + 1)
        .count("lost", 0)
        .fault("rotation", 1)
        .figure("failed_verifications", refused as u64)
        .figure("rate_per_s", RATE)
        .figure(
            "sent_per_s",
            (events as f64 / sending.as_secs_f64()).round() as u64,
        );
}
