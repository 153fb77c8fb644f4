//! Delivery retries, the dead-letter and redrive, `Retry-After`, and redirects.
//!
//! Proves that a destination failing three times then succeeding sees exactly four attempts,
//! numbered 1 to 4 and all with the same Idempotency-Key, and that the admin API shows the
//! delivery delivered with those four attempts; that a destination that always fails gets
//! exactly `max_attempts` attempts before the dead-letter, and that a retry through the admin
//! API then delivers it with the same key (a second retry is refused: it is not dead); that a
//! `Retry-After` is honoured as a floor on the next attempt; that a redirect is a failure,
//! never followed; and that an event type with a NUL reaches the first attempt and the retry
//! as the same text (on PostgreSQL too, from `postgres.rs`).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use serde_json::Value;
use tokio::io::AsyncReadExt;

use crate::support::{free_port, stripe_headers, unique, Behaviour, Gateway, Handler, Options};

/// The `status` of each attempt in a delivery's history, and their numbers.
fn history(row: &Value) -> (Vec<Option<u64>>, Vec<u64>) {
    let attempts = row["history"].as_array().expect("history");
    (
        attempts.iter().map(|a| a["status"].as_u64()).collect(),
        attempts
            .iter()
            .map(|a| a["number"].as_u64().expect("number"))
            .collect(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_destination_failing_three_times_then_succeeding_gets_four_attempts_with_one_key() {
    let handler = Handler::start(Behaviour::FailFirst(3)).await;
    let gw = Gateway::start(&handler).await;
    let key = gw.send_stripe_event("stripe", "evt_flaky").await;

    let row = gw.wait_for_delivery_state(&key, "delivered").await;
    let received = handler.received();
    assert_eq!(received.len(), 4, "{received:#?}");
    assert!(received
        .iter()
        .all(|r| r.key.as_deref() == Some(key.as_str())));
    let numbers: Vec<Option<u32>> = received.iter().map(|r| r.attempt).collect();
    assert_eq!(numbers, [Some(1), Some(2), Some(3), Some(4)]);
    assert!(received.windows(2).all(|w| w[0].body == w[1].body));

    assert_eq!(row["attempts"], 4, "{row:#}");
    let (statuses, numbers) = history(&row);
    assert_eq!(statuses, [Some(500), Some(500), Some(500), Some(200)]);
    assert_eq!(numbers, [1, 2, 3, 4]);
    assert_eq!(row["last_error"], "HTTP 500", "{row:#}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_destination_always_failing_is_dead_lettered_after_max_attempts_and_redrive_delivers_it()
{
    let handler = Handler::start(Behaviour::AlwaysFail).await;
    let options = Options {
        max_attempts: 3,
        ..Options::default()
    };
    let gw = Gateway::start_with(&handler, options).await;
    let key = gw.send_stripe_event("stripe", "evt_doomed").await;

    let dead = gw.wait_for_delivery_state(&key, "dead").await;
    assert_eq!(handler.count_for(&key), 3, "exactly max_attempts attempts");
    let listed = gw.deliveries("state=dead").await;
    assert_eq!(listed.len(), 1, "{listed:#?}");
    assert_eq!(listed[0]["id"], dead["id"]);
    assert_eq!(listed[0]["last_error"], "HTTP 500");
    assert_eq!(listed[0]["attempts"], 3);
    assert_eq!(history(&listed[0]).0, [Some(500); 3]);
    let id = dead["id"].as_str().expect("a delivery id").to_owned();

    handler.set_behaviour(Behaviour::AlwaysOk);
    let (status, json) = gw.admin_post(&format!("/v1/deliveries/{id}/retry")).await;
    assert_eq!(status, 202, "{json}");
    assert_eq!(json["state"], "pending", "{json}");

    let row = gw.wait_for_delivery_state(&key, "delivered").await;
    let received = handler.received_for(&key);
    assert_eq!(received.len(), 4, "{received:#?}");
    // A redrive starts a new round of attempts; the key is the one every attempt carried.
    assert_eq!(received[3].attempt, Some(1));
    let (statuses, numbers) = history(&row);
    assert_eq!(statuses, [Some(500), Some(500), Some(500), Some(200)]);
    assert_eq!(numbers, [1, 2, 3, 4]);

    let (status, json) = gw.admin_post(&format!("/v1/deliveries/{id}/retry")).await;
    assert_eq!(status, 409, "{json}");
    assert_eq!(json["code"], "not_dead_lettered", "{json}");
    let (status, json) = gw.admin_post("/v1/deliveries/dlv_999999/retry").await;
    assert_eq!(status, 404, "{json}");
    assert_eq!(handler.count_for(&key), 4, "a refused retry sends nothing");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retry_after_from_the_destination_is_a_floor_on_the_next_attempt() {
    let handler = Handler::start(Behaviour::TooManyRequestsOnce).await;
    // Without Retry-After the next attempt would come 100 ms later (no jitter).
    let gw = Gateway::start(&handler).await;
    let key = gw.send_stripe_event("stripe", "evt_throttled").await;

    let row = gw.wait_for_delivery_state(&key, "delivered").await;
    let received = handler.received_for(&key);
    assert_eq!(received.len(), 2, "{received:#?}");
    let gap = received[1].at.duration_since(received[0].at);
    // Retry-After: 1 (s); the store keeps times in whole milliseconds, hence the 10 ms slack.
    assert!(
        gap >= Duration::from_millis(990),
        "second attempt came {gap:?} after the first, before Retry-After allowed"
    );
    assert_eq!(history(&row).0, [Some(429), Some(200)]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redirect_from_the_destination_is_a_failure_and_is_not_followed() {
    let handler = Handler::start(Behaviour::AlwaysRedirect).await;
    let options = Options {
        max_attempts: 2,
        ..Options::default()
    };
    let gw = Gateway::start_with(&handler, options).await;
    let key = gw.send_stripe_event("stripe", "evt_redirected").await;

    let dead = gw.wait_for_delivery_state(&key, "dead").await;
    assert_eq!(history(&dead).0, [Some(302), Some(302)]);
    let error = dead["last_error"].as_str().unwrap_or("");
    assert!(error.contains("redirects are not followed"), "{dead:#}");
    let received = handler.received();
    assert_eq!(received.len(), 2, "{received:#?}");
    assert!(
        received.iter().all(|r| r.path == "/webhooks"),
        "the Location was never requested: {received:#?}"
    );
}

/// An event type with a NUL in it (a JSON `\u0000`) is kept as every store can keep it, NUL
/// replaced by U+FFFD, before anything is written: the first attempt (handed to the worker in
/// memory while it is caught up) and the retry (read back from the store) carry the same
/// `hooklatch-event-type`. On PostgreSQL the first attempt used to carry none. Returns the
/// header of each attempt, in order.
pub(crate) async fn event_type_of_each_attempt(options: Options) -> Vec<Option<String>> {
    let handler = Handler::start(Behaviour::FailFirst(1)).await;
    let gw = Gateway::start_with(&handler, options).await;
    let event_id = unique("evt_nul_type");
    let body = format!(
        r#"{{"id":"{event_id}","object":"event","type":"invoice.\u0000paid","data":{{"object":{{"id":"in_1"}}}}}}"#
    )
    .into_bytes();
    let (status, json) = gw.post("stripe", &stripe_headers(&body), body).await;
    assert_eq!(
        (status, json["status"].as_str()),
        (200, Some("accepted")),
        "{json}"
    );
    let key = format!("stripe:{event_id}");
    gw.wait_for_delivery_state(&key, "delivered").await;
    let mut attempts = handler.received_for(&key);
    attempts.sort_by_key(|r| r.attempt);
    attempts
        .iter()
        .map(|r| {
            r.headers
                .get("hooklatch-event-type")
                .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned())
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_event_type_with_a_nul_reaches_every_attempt_alike() {
    let types = event_type_of_each_attempt(Options::default()).await;
    let kept = Some("invoice.\u{fffd}paid".to_owned());
    assert_eq!(types, vec![kept.clone(), kept]);
}

/// A listener on 127.0.0.1 that takes each connection, reads the request's first bytes and
/// resets the connection (`SO_LINGER` 0) without answering; its URL and how many it took.
async fn resetting_listener() -> (String, Arc<AtomicUsize>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("binding a listener");
    let url = format!(
        "http://{}/webhooks",
        listener.local_addr().expect("its address")
    );
    let taken = Arc::new(AtomicUsize::new(0));
    let count = taken.clone();
    tokio::spawn(async move {
        while let Ok((mut stream, _)) = listener.accept().await {
            count.fetch_add(1, Ordering::SeqCst);
            let mut head = [0u8; 64];
            let _ = stream.read(&mut head).await;
            let _ = stream.set_zero_linger();
            drop(stream);
        }
    });
    (url, taken)
}

/// The attempts that get no answer at all: the destination hangs past the timeout, resets the
/// connection, or refuses it. Each is an attempt with no status, retried with the same key,
/// and dead-lettered after `max_attempts` with an error saying what happened and naming no
/// URL.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hang_a_reset_and_a_refused_connection_are_retried_then_dead_lettered_saying_what_happened(
) {
    let mut card = crate::report::Card::new("T14", "sqlite");
    card.fault("hang", 2)
        .fault("reset_peer", 2)
        .fault("refused", 2);
    let two = |timeout| Options {
        max_attempts: 2,
        timeout,
        ..Options::default()
    };
    let no_status = |row: &Value| {
        let (statuses, numbers) = history(row);
        assert_eq!(statuses, [None, None], "{row:#}");
        assert_eq!(numbers, [1, 2], "{row:#}");
    };

    // Hangs: the handler answers after 30 s, the timeout is 500 ms.
    let handler = Handler::start(Behaviour::SlowOk(30_000)).await;
    let gw = Gateway::start_with(&handler, two("500ms")).await;
    let key = gw.send_stripe_event("stripe", "evt_hang").await;
    let dead = gw.wait_for_delivery_state(&key, "dead").await;
    assert_eq!(dead["last_error"], "timed out after 500ms", "{dead:#}");
    no_status(&dead);
    let received = handler.received_for(&key);
    assert_eq!(received.len(), 2, "both attempts reached the handler");
    assert!(received.iter().all(|r| r.header("idempotency-key") == key));
    drop(gw);

    // Resets the connection without an answer.
    let (url, taken) = resetting_listener().await;
    let gw = Gateway::start_at(url, two("10s")).await;
    let key = gw.send_stripe_event("stripe", "evt_reset").await;
    let dead = gw.wait_for_delivery_state(&key, "dead").await;
    let error = dead["last_error"].as_str().expect("an error").to_owned();
    println!("figure: a reset attempt's error: {error}");
    assert!(
        error.starts_with("sending the request failed") || error.starts_with("request failed"),
        "{error}"
    );
    assert!(
        !error.contains("127.0.0.1"),
        "no address in the error: {error}"
    );
    no_status(&dead);
    assert!(taken.load(Ordering::SeqCst) >= 2, "both attempts connected");
    drop(gw);

    // Nothing listens on the port: refused.
    let url = format!("http://127.0.0.1:{}/webhooks", free_port());
    let gw = Gateway::start_at(url, two("10s")).await;
    let key = gw.send_stripe_event("stripe", "evt_refused").await;
    let dead = gw.wait_for_delivery_state(&key, "dead").await;
    let error = dead["last_error"].as_str().expect("an error").to_owned();
    println!("figure: a refused attempt's error: {error}");
    assert!(error.starts_with("connection failed"), "{error}");
    assert!(error.to_lowercase().contains("refused"), "{error}");
    assert!(
        !error.contains("127.0.0.1"),
        "no address in the error: {error}"
    );
    no_status(&dead);
    card.count("ops", 3).count("dlq", 3).count("lost", 0);
}

/// A running gateway keeps to its backoff: a destination failing every attempt, six attempts,
/// 200 ms doubling to 800 ms with 20 % jitter. Between the end of each attempt (its start plus
/// its latency, as the store recorded them) and the start of the next lies at least the
/// schedule's delay less its jitter (200, 400, 800, 800, 800 ms × 0.8), and the handler saw
/// the same spacing on its own clock; never early. How late each came (the worker's poll and
/// its scheduling) is printed, not asserted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attempts_keep_to_the_backoff_within_its_jitter() {
    const JITTER: f64 = 0.2;
    let handler = Handler::start(Behaviour::AlwaysFail).await;
    let options = Options {
        max_attempts: 6,
        initial_backoff: "200ms",
        max_backoff: "800ms",
        jitter: JITTER,
        ..Options::default()
    };
    let gw = Gateway::start_with(&handler, options).await;
    let key = gw.send_stripe_event("stripe", "evt_schedule").await;
    let dead = gw.wait_for_delivery_state(&key, "dead").await;
    let history = dead["history"].as_array().expect("the attempts");
    assert_eq!(history.len(), 6, "{dead:#}");
    let schedule_ms = [200u64, 400, 800, 800, 800];
    // `2026-12-06T10:00:00.123Z`: the millisecond of its day (the attempts span seconds; a
    // gap across midnight is put right below).
    let started = |a: &Value| -> i64 {
        let text = a["started_at"].as_str().expect("started_at");
        let clock = &text[11..23];
        let field = |r: std::ops::Range<usize>| clock[r].parse::<i64>().expect("a time field");
        ((field(0..2) * 60 + field(3..5)) * 60 + field(6..8)) * 1000 + field(9..12)
    };
    let day_ms = 86_400_000;
    let arrivals: Vec<_> = handler.received_for(&key).iter().map(|r| r.at).collect();
    assert_eq!(arrivals.len(), 6);
    let mut late_ms = Vec::new();
    for (k, delay) in schedule_ms.iter().enumerate() {
        let earliest = (*delay as f64 * (1.0 - JITTER)) as i64;
        let ended = started(&history[k]) + history[k]["latency_ms"].as_i64().unwrap_or(0);
        let mut gap = started(&history[k + 1]) - ended;
        if gap < -day_ms / 2 {
            gap += day_ms; // the next attempt started after midnight
        }
        // Times are kept to the millisecond: one of rounding on each side.
        assert!(
            gap >= earliest - 2,
            "attempt {} came {gap} ms after attempt {} ended; the schedule allows {earliest} ms at the soonest",
            k + 2,
            k + 1
        );
        let seen = arrivals[k + 1].duration_since(arrivals[k]).as_millis() as i64;
        assert!(
            seen >= earliest - 2,
            "the handler saw attempt {} {seen} ms after attempt {}",
            k + 2,
            k + 1
        );
        late_ms.push(gap - *delay as i64);
    }
    println!("backoff: each attempt's lateness against the unjittered schedule (ms): {late_ms:?}");
}

/// A slow link to the destination (the fault proxy's `slicer`: every chunk passed on 16 bytes
/// at a time, 20 ms after each, both ways, so a delivery's request takes over a second to
/// arrive). Within the destination's timeout it is only slow: delivered on its first attempt,
/// byte-exact. With a timeout shorter than the link needs, the attempt fails as "timed out"
/// and is retried; once the link is quick again the event is delivered, with the same key
/// and body on every copy that arrived (the cut attempt's bytes may still arrive whole through
/// the slow link: an extra delivery the guard catches, printed).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_link_to_the_destination_is_slow_within_the_timeout_and_retried_past_it() {
    for (timeout, whole_at_first) in [("10s", true), ("300ms", false)] {
        let handler = Handler::start(Behaviour::AlwaysOk).await;
        let (proxy, url) = crate::support::proxied(&handler.url(), 80).await;
        proxy.set_slicer(16, Duration::from_millis(20));
        let gw = Gateway::start_at(
            url,
            Options {
                timeout,
                max_attempts: 20,
                ..Options::default()
            },
        )
        .await;
        let id = unique("evt_slow_link");
        let body = crate::support::stripe_invoice_paid(&id, 5000);
        let (status, _) = gw
            .post("stripe", &stripe_headers(&body), body.clone())
            .await;
        assert_eq!(status, 200);
        let key = format!("stripe:{id}");
        if !whole_at_first {
            crate::support::eventually("the first attempt times out", async || {
                let rows = gw.deliveries("").await;
                rows.iter().any(|r| {
                    r["history"][0]["error"]
                        .as_str()
                        .is_some_and(|e| e.contains("timed out after 300ms"))
                })
            })
            .await;
            proxy.set_slicer(0, Duration::ZERO);
        }
        let row = gw.wait_for_delivery_state(&key, "delivered").await;
        let received = handler.received_for(&key);
        assert!(!received.is_empty());
        assert!(
            received.iter().all(|r| r.body == body),
            "byte-exact through the slow link"
        );
        if whole_at_first {
            assert_eq!(row["attempts"], 1, "{row:#}");
            assert_eq!(received.len(), 1);
        } else {
            let attempts = row["attempts"].as_u64().unwrap_or(0);
            assert!(attempts >= 2, "{row:#}");
            println!(
                "slow link, timeout {timeout}: delivered on attempt {attempts}; the handler saw {} copies, one key",
                received.len()
            );
        }
    }
}

/// The destination's answer torn at any byte (the fault proxy's `limit_data`, downstream):
/// the test measures one whole answer through the proxy, then cuts it at every byte, one new
/// event per cut, each connection the gateway opens closed once that many bytes of the answer
/// have passed. The handler answers 200 with no body, so its whole answer is a head: an
/// answer cut anywhere before its last byte is never counted as delivered (the attempt fails
/// and is retried), and the whole one is. Once the limit is lifted every event
/// is delivered, every copy the handler got carrying its event's key and body byte-exact.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_answer_torn_at_any_byte_is_retried_and_never_lost() {
    use hooklatch_testkit::proxy::Direction;
    let handler = Handler::start(Behaviour::AlwaysOk).await;
    let (proxy, url) = crate::support::proxied(&handler.url(), 80).await;
    let gw = Gateway::start_at(
        url,
        Options {
            max_attempts: 50,
            initial_backoff: "100ms",
            max_backoff: "1s",
            ..Options::default()
        },
    )
    .await;
    let send = async || {
        let id = unique("evt_torn");
        let body = crate::support::stripe_invoice_paid(&id, 5000);
        let (status, _) = gw
            .post("stripe", &stripe_headers(&body), body.clone())
            .await;
        assert_eq!(status, 200);
        (format!("stripe:{id}"), body)
    };
    // One whole answer, on a fresh connection.
    proxy.close_open();
    let answered = proxy.passed(Direction::Downstream);
    let (key, body) = send().await;
    gw.wait_for_delivery_state(&key, "delivered").await;
    let whole = proxy.passed(Direction::Downstream) - answered;
    assert!(
        whole > "HTTP/1.1 200 OK\r\n\r\n".len() as u64,
        "{whole} bytes"
    );

    let mut events = vec![(key, body)];
    let mut first_delivered_at = None;
    for limit in 0..=whole {
        proxy.set_limit_data(Direction::Downstream, Some(limit));
        proxy.close_open();
        let (key, body) = send().await;
        let mut first = Value::Null;
        crate::support::eventually("the first attempt recorded", async || {
            let rows = gw.deliveries_for(&key).await;
            first = rows[0]["history"][0].clone();
            !first.is_null()
        })
        .await;
        let delivered = first["error"].is_null();
        if limit < whole {
            assert!(!delivered, "cut at {limit} B of {whole}: {first:#}");
        }
        if delivered && first_delivered_at.is_none() {
            first_delivered_at = Some(limit);
        }
        events.push((key, body));
    }
    let threshold = first_delivered_at.expect("the whole answer was delivered");
    proxy.set_limit_data(Direction::Downstream, None);
    proxy.close_open();
    for (key, body) in &events {
        gw.wait_for_delivery_state(key, "delivered").await;
        let received = handler.received_for(key);
        assert!(!received.is_empty(), "{key}");
        assert!(
            received.iter().all(|r| r.body == *body),
            "{key}: byte-exact"
        );
    }
    let copies: usize = events
        .iter()
        .map(|(k, _)| handler.received_for(k).len())
        .sum();
    println!(
        "figure: an answer of {whole} B torn at {} limits: delivered on the first attempt from {threshold} B; {copies} copies of {} events reached the handler",
        whole + 1,
        events.len()
    );
}
