//! kill -9 of the gateway in the middle of a burst of 1,000 distinct Stripe events.
//!
//! Proves that a 2xx means the event is durable: after a restart on the same SQLite file every
//! event that got a 2xx before the kill is forwarded (none lost), each with
//! `Idempotency-Key: stripe:<event id>`; and that the events a provider would re-send (those
//! that got no 2xx) are answered 2xx — as duplicates when they had committed before the kill —
//! and delivered too, with exactly one outbox row per event. The deliveries the dead process
//! held leased are given back when the new one starts, not when their lease runs out.
//!
//! Also: a second `hooklatch serve` on a SQLite file already served is refused.

use std::collections::HashSet;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::Notify;
use tokio::task::JoinSet;

use crate::support::{
    eventually_within, stripe_headers, stripe_invoice_paid, unique, Behaviour, Gateway, Handler,
    KillAfterWork, Options, DEADLINE,
};

const EVENTS: usize = 1000;
/// The burst with several stops: RELIABILITY.md's CI size for T4.
const BURST_EVENTS: usize = 20_000;
/// Its stops, kill -9 and SIGTERM in turn.
const BURST_STOPS: usize = 10;
const SENDERS: usize = 16;
/// The kill comes after this many acknowledgements, drawn from the card's seed.
const KILL_AFTER_ACKS: std::ops::Range<usize> = 100..700;
/// How long every acknowledged event has to reach the handler after the restart: well under
/// the killed process's leases (2 × timeout + 10 s = 130 s), so the test fails if the restarted
/// gateway waits for them to run out instead of giving them back.
const AFTER_RESTART: Duration = Duration::from_secs(90);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_event_acknowledged_before_a_kill_9_is_forwarded_after_restart() {
    let mut card = crate::report::Card::new("T4", "sqlite");
    let seed = card.seed();
    let events = crate::report::scaled(EVENTS);
    let (from, to) = (
        crate::report::scaled(KILL_AFTER_ACKS.start),
        crate::report::scaled(KILL_AFTER_ACKS.end),
    );
    let kill_after_acks = from + crate::report::draw(seed, 0, (to - from) as u64) as usize;
    card.fault("kill9", 1)
        .figure("kill_after_acks", kill_after_acks as u64);
    let handler = Handler::start(Behaviour::AlwaysOk).await;
    let options = Options {
        // Leases of 2 × 60 s + 10 s: longer than the test waits after the restart.
        timeout: "60s",
        ..Options::default()
    };
    let mut gw = Gateway::start_with(&handler, options).await;
    let run = unique("evt_crash");
    let ids: Arc<Vec<String>> = Arc::new((0..events).map(|i| format!("{run}_{i:04}")).collect());

    // 16 senders share the 1,000 events; the one that sees the `kill_after_acks`th 2xx (100 to
    // 699, from the seed) kills the gateway at once, so acknowledgements still on their way out
    // are caught in the act.
    let next = Arc::new(AtomicUsize::new(0));
    let n_acked = Arc::new(AtomicUsize::new(0));
    let acked = Arc::new(Mutex::new(vec![false; events]));
    let killed = Arc::new(Notify::new());
    let kill_switch = gw.kill_switch();
    let mut senders = JoinSet::new();
    for _ in 0..SENDERS {
        let (ingest, ids, next, n_acked, acked, killed, kill_switch) = (
            gw.ingest(),
            ids.clone(),
            next.clone(),
            n_acked.clone(),
            acked.clone(),
            killed.clone(),
            kill_switch.clone(),
        );
        senders.spawn(async move {
            loop {
                let i = next.fetch_add(1, Ordering::SeqCst);
                if i >= events {
                    return;
                }
                let body = stripe_invoice_paid(&ids[i], 1000 + i as u64);
                let headers = stripe_headers(&body);
                // A transport error (the gateway died) is simply not an acknowledgement.
                if let Ok((status, json)) = ingest.try_post("stripe", &headers, body).await {
                    if (200..300).contains(&status) {
                        assert_eq!(json["status"], "accepted", "first send of {}", ids[i]);
                        acked.lock().expect("acked lock")[i] = true;
                        if n_acked.fetch_add(1, Ordering::SeqCst) + 1 == kill_after_acks {
                            kill_switch.fire();
                            killed.notify_one();
                        }
                    }
                }
            }
        });
    }
    tokio::time::timeout(DEADLINE, killed.notified())
        .await
        .expect("the chosen number of events acknowledged before the deadline");
    gw.kill9();
    senders.join_all().await;

    let acked: Vec<bool> = acked.lock().expect("acked lock").clone();
    let acked_keys: HashSet<String> = ids
        .iter()
        .zip(&acked)
        .filter(|(_, a)| **a)
        .map(|(id, _)| format!("stripe:{id}"))
        .collect();
    let n_acked = acked_keys.len();
    assert!(
        (kill_after_acks..events).contains(&n_acked),
        "the kill landed mid-burst: {n_acked} of {events} acknowledged"
    );

    gw.restart().await;

    // 0 lost: every acknowledged event reaches the handler.
    let started = Instant::now();
    let missing = loop {
        let seen = handler.distinct_keys();
        let missing: Vec<&String> = acked_keys.iter().filter(|k| !seen.contains(*k)).collect();
        if missing.is_empty() || started.elapsed() > AFTER_RESTART {
            break missing.len();
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(
        missing, 0,
        "acknowledged events lost after kill -9 and restart"
    );
    let redelivered_in = started.elapsed();

    // The provider re-sends what got no 2xx; those that had committed are duplicates.
    let ingest = gw.ingest();
    let mut committed_unacked = 0;
    for (i, id) in ids.iter().enumerate().filter(|(i, _)| !acked[*i]) {
        let body = stripe_invoice_paid(id, 1000 + i as u64);
        let (status, json) = ingest.post("stripe", &stripe_headers(&body), body).await;
        assert_eq!(status, 200, "re-send of {id}: {json}");
        match json["status"].as_str() {
            Some("accepted") => {}
            Some("duplicate") => committed_unacked += 1,
            other => panic!("re-send of {id} answered {other:?}: {json}"),
        }
    }

    let (received, duplicates) = forwarded_once_each(&gw, &handler, &ids).await;
    card.count("ops", events)
        .count("acked", n_acked)
        .count("lost", 0)
        .count("recovered", committed_unacked)
        .count("duplicates", duplicates)
        .figure("forwards", received.len())
        .figure(
            "restart_to_delivered_ms",
            (redelivered_in.as_secs_f64() * 10_000.0).round() / 10.0,
        );
    println!(
        "kill -9 mid-burst: {events} events, {n_acked} acknowledged before the kill, \
         0 of them lost (all delivered {redelivered_in:.1?} after the restart, with leases of \
         130 s); {committed_unacked} committed but unacknowledged (re-sent, answered \
         duplicate); {} forwards in all, {duplicates} of them repeated deliveries",
        received.len()
    );
}

/// Waits (within [`AFTER_RESTART`]) until every event of `ids` reached `handler` and no outbox
/// row is pending; checks one delivered outbox row per event and that every forward carries
/// the key of the event in its body. Returns every forward and how many were repeats.
async fn forwarded_once_each(
    gw: &Gateway,
    handler: &Handler,
    ids: &[String],
) -> (Vec<crate::support::Received>, usize) {
    let all_keys: HashSet<String> = ids.iter().map(|id| format!("stripe:{id}")).collect();
    eventually_within(
        "every event is forwarded and its outbox row delivered",
        AFTER_RESTART,
        async || {
            handler.distinct_keys() == all_keys && gw.deliveries("state=pending").await.is_empty()
        },
    )
    .await;
    let rows = gw.deliveries("").await;
    assert_eq!(rows.len(), ids.len(), "exactly one outbox row per event");
    assert!(
        rows.iter().all(|r| r["state"] == "delivered"),
        "{:#?}",
        rows.iter()
            .filter(|r| r["state"] != "delivered")
            .collect::<Vec<_>>()
    );
    let received = handler.received();
    for r in &received {
        let body: serde_json::Value = serde_json::from_slice(&r.body).expect("a JSON body");
        let id = body["id"].as_str().expect("an event id");
        assert_eq!(r.key.as_deref(), Some(format!("stripe:{id}").as_str()));
    }
    let duplicates = received.len() - all_keys.len();
    (received, duplicates)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_serve_on_a_sqlite_file_already_served_is_refused() {
    let handler = Handler::start(Behaviour::AlwaysOk).await;
    let gw = Gateway::start(&handler).await;
    let (status, output) = gw.serve_beside().await;
    let status = status.expect("the second gateway exits by itself");
    assert!(!status.success(), "exit status {status}: {output}");
    assert!(
        output.contains(&format!("another process (pid {}) is serving", gw.pid())),
        "names the gateway that holds the file: {output}"
    );
    assert!(
        output.contains("one `hooklatch serve` per SQLite file"),
        "{output}"
    );
    // The first gateway goes on serving.
    let body = stripe_invoice_paid(&unique("evt_beside"), 1200);
    let (status, json) = gw
        .ingest()
        .post("stripe", &stripe_headers(&body), body)
        .await;
    assert_eq!(status, 200, "{json}");
}

/// With JSON logs, the reason a gateway cannot start is a JSON line too, at level ERROR, for
/// the collector that reads them; exit status 2 as ever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_json_logs_a_gateway_that_cannot_start_says_why_in_json() {
    let handler = Handler::start(Behaviour::AlwaysOk).await;
    let gw = Gateway::start_with(
        &handler,
        crate::support::Options {
            log_format: "json",
            ..crate::support::Options::default()
        },
    )
    .await;
    let (status, output) = gw.serve_beside().await;
    let status = status.expect("the second gateway exits by itself");
    assert_eq!(status.code(), Some(2), "{output}");
    let lines: Vec<serde_json::Value> = output
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}")))
        .collect();
    let error = lines
        .iter()
        .find(|l| l["level"] == "ERROR")
        .unwrap_or_else(|| panic!("no ERROR line: {output}"));
    assert_eq!(
        error["fields"]["message"], "hooklatch cannot go on",
        "{error}"
    );
    let why = error["fields"]["error"].as_str().unwrap_or_default();
    assert!(
        why.contains("one `hooklatch serve` per SQLite file"),
        "{error}"
    );
}

/// A configuration that does not load is said in JSON too when it asks for JSON logs (in the
/// file, or through `HOOKLATCH_SERVER__LOG_FORMAT` when the file is not even TOML), and as text
/// otherwise; exit status 2 either way, and the mistake named.
#[test]
fn with_json_logs_a_configuration_that_does_not_load_is_said_in_json() {
    let dir = tempfile::tempdir().expect("a temp dir");
    let serve = |config: &str, env: &[(&str, &str)]| {
        let path = dir.path().join("hooklatch.toml");
        std::fs::write(&path, config).expect("writing the config");
        let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_hooklatch"));
        for (name, _) in std::env::vars_os() {
            if name.to_string_lossy().starts_with("HOOKLATCH_") {
                cmd.env_remove(name);
            }
        }
        let out = cmd
            .args(["serve", "--config"])
            .arg(&path)
            .env("HOOKLATCH_ADMIN_TOKEN", "a-token-for-this-test-0123456789")
            .envs(env.iter().copied())
            .output()
            .expect("running hooklatch serve");
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let wrong = "[[sources]]\nname = \"shop\"\nprovider = \"shopifx\"\nsecrets = [\"s\"]\n";
    let json_error = |stderr: &str| -> String {
        let line: serde_json::Value = serde_json::from_str(stderr.trim())
            .unwrap_or_else(|e| panic!("not one JSON line ({e}): {stderr}"));
        assert_eq!(line["level"], "ERROR", "{line}");
        assert_eq!(
            line["fields"]["message"], "hooklatch cannot start",
            "{line}"
        );
        line["fields"]["error"]
            .as_str()
            .unwrap_or_default()
            .to_owned()
    };

    let (code, stderr) = serve(&format!("[server]\nlog_format = \"json\"\n\n{wrong}"), &[]);
    assert_eq!(code, Some(2), "{stderr}");
    assert!(json_error(&stderr).contains("shopifx"), "{stderr}");

    let not_toml = "[server\nlog_format = json";
    let (code, stderr) = serve(not_toml, &[("HOOKLATCH_SERVER__LOG_FORMAT", "json")]);
    assert_eq!(code, Some(2), "{stderr}");
    assert!(json_error(&stderr).contains("hooklatch.toml"), "{stderr}");

    let (code, stderr) = serve(wrong, &[]);
    assert_eq!(code, Some(2), "{stderr}");
    assert!(stderr.starts_with("hooklatch: error: "), "{stderr}");
    assert!(stderr.contains("shopifx"), "{stderr}");
}

/// How many times the T15 test kills the gateway after its handler did the work.
const CRASHES_AFTER_WORK: usize = 10;

/// T15: the gateway dies after the application did the work and before the attempt was
/// recorded (the handler kills it with SIGKILL while the attempt waits for its answer). After
/// each restart the delivery comes again, once, with the same `Idempotency-Key`: a handler that
/// keys its effect on it makes one effect per event, a naive one two.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gateway_killed_after_the_handler_did_the_work_delivers_again_once_with_the_same_key() {
    let crashes = crate::report::scaled(CRASHES_AFTER_WORK);
    let mut card = crate::report::Card::new("T15", "sqlite");
    let app = KillAfterWork::start().await;
    let mut gw = Gateway::start_at(app.url(), Options::default()).await;
    let kill = gw.kill_switch();
    app.set_kill(Some(Box::new(move || kill.fire())));

    let mut keys = Vec::new();
    for _ in 0..crashes {
        let key = gw.send_stripe_event("stripe", "evt_after_work").await;
        app.acked();
        let status = gw.wait_exit().await;
        assert!(!status.success(), "killed by the handler: {status}");
        gw.restart().await;
        let row = gw.wait_for_delivery_state(&key, "delivered").await;
        // The killed attempt was never recorded: the one that counts is the second.
        assert_eq!(row["attempts"], 1, "{row:#}");
        keys.push(key);
    }
    app.set_kill(None);

    let seen = app.seen();
    assert_eq!(seen.len(), crashes, "{seen:#?}");
    for key in &keys {
        assert_eq!(
            seen[key],
            ["1", "1"],
            "{key}: exactly one extra delivery, the same key, attempt 1 again"
        );
    }
    let naive_effects: usize = seen.values().map(Vec::len).sum();
    let keyed_effects = seen.len();
    assert_eq!(naive_effects, 2 * crashes);
    card.count("ops", crashes)
        .count("acked", crashes)
        .count("lost", 0)
        .count("duplicates", naive_effects - keyed_effects)
        .fault("kill9", crashes)
        .figure("double_effects", 0)
        .figure("naive_double_effects", naive_effects - keyed_effects)
        .figure("extra_deliveries_per_crash", 1);
}

/// T4 with several stops in one run: 20,000 events from 16 senders that retry as a provider
/// does (an answer a stop cut off, or a refused connection while the gateway is down, is sent
/// again 20 ms later), and every tenth event sent once more after its acknowledgement, as a
/// provider does that missed it. The gateway is stopped and restarted on the same file ten
/// times (`HOOKLATCH_SCALE` times more in the soak tier), at points of the acknowledgement count
/// drawn from the card's seed: kill -9 and SIGTERM in turn. Every event ends
/// acknowledged — `accepted`, or `duplicate` when a stop cut the answer to a committed request
/// — every second send is a `duplicate`, and every event is forwarded, with one outbox row
/// each: lost = 0; repeated deliveries are counted, and only a kill -9 may cause them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_event_survives_kills_and_sigterms_in_one_burst() {
    let mut card = crate::report::Card::new("T4", "sqlite");
    let seed = card.seed();
    let events = crate::report::scaled(BURST_EVENTS);
    let stops = crate::report::scaled(BURST_STOPS);
    let kills = stops.div_ceil(2);
    // Stop `i` comes after about (i + 1) / (stops + 1) of the events are acknowledged, a little
    // earlier by a draw from the seed; even stops are kill -9, odd ones SIGTERM.
    let segment = events / (stops + 1);
    let kill_points: Vec<usize> = (0..stops)
        .map(|i| {
            (i + 1) * segment - crate::report::draw(seed, i as u64, segment as u64 / 2) as usize
        })
        .collect();
    card.fault("kill9", kills).fault("sigterm", stops - kills);
    let handler = Handler::start(Behaviour::AlwaysOk).await;
    let mut gw = Gateway::start_with(
        &handler,
        Options {
            timeout: "60s",
            ..Options::default()
        },
    )
    .await;
    let run = unique("evt_kills");
    let ids: Arc<Vec<String>> = Arc::new((0..events).map(|i| format!("{run}_{i:05}")).collect());
    let next = Arc::new(AtomicUsize::new(0));
    let n_acked = Arc::new(AtomicUsize::new(0));
    let recovered = Arc::new(AtomicUsize::new(0));
    let resent = Arc::new(AtomicUsize::new(0));
    let mut senders = JoinSet::new();
    for _ in 0..SENDERS {
        let (ingest, ids, next, n_acked, recovered, resent) = (
            gw.ingest(),
            ids.clone(),
            next.clone(),
            n_acked.clone(),
            recovered.clone(),
            resent.clone(),
        );
        senders.spawn(async move {
            loop {
                let i = next.fetch_add(1, Ordering::SeqCst);
                let Some(id) = ids.get(i) else { return };
                let body = stripe_invoice_paid(id, 1000 + i as u64);
                // Sent until acknowledged, as a provider does; every tenth event then once
                // more, as a provider does that missed the acknowledgement: a duplicate.
                for send in 0..if i % 10 == 0 { 2 } else { 1 } {
                    let said = acknowledged(&ingest, id, &body).await;
                    match (send, said.as_str()) {
                        (0, "accepted") => {}
                        (0, _) => {
                            recovered.fetch_add(1, Ordering::SeqCst);
                        }
                        (_, "duplicate") => {
                            resent.fetch_add(1, Ordering::SeqCst);
                        }
                        (_, other) => panic!("{id} sent again answered {other}"),
                    }
                }
                n_acked.fetch_add(1, Ordering::SeqCst);
            }
        });
    }
    for (i, point) in kill_points.iter().enumerate() {
        crate::support::wait_until_within(
            "the acknowledgements before the next stop",
            AFTER_RESTART,
            || n_acked.load(Ordering::SeqCst) >= *point,
        )
        .await;
        if i % 2 == 0 {
            gw.kill9();
        } else {
            gw.sigterm();
            let status = gw.wait_exit().await;
            assert!(status.success(), "SIGTERM ends serve cleanly: {status}");
        }
        gw.restart().await;
    }
    senders.join_all().await;
    assert_eq!(
        n_acked.load(Ordering::SeqCst),
        events,
        "every event acknowledged"
    );

    let (received, duplicates) = forwarded_once_each(&gw, &handler, &ids).await;
    // A kill repeats only the attempts it cut: at most two leases per delivery task (16).
    assert!(
        duplicates <= kills * 2 * 16,
        "{duplicates} repeated deliveries for {kills} kills"
    );
    let recovered = recovered.load(Ordering::SeqCst);
    let resent = resent.load(Ordering::SeqCst);
    assert_eq!(
        resent,
        events.div_ceil(10),
        "every second send is a duplicate"
    );
    card.count("ops", events + resent)
        .count("acked", events)
        .count("lost", 0)
        .count("recovered", recovered)
        .count("duplicates", duplicates)
        .figure("stop_points", kill_points.clone())
        .figure("sent_twice", resent)
        .figure("forwards", received.len());
    println!(
        "{kills} kills and {} SIGTERMs in one burst of {events} events (after {kill_points:?} \
         acknowledgements): 0 lost; {recovered} answers cut by a stop after the commit \
         (re-sent, duplicate); {resent} events sent twice, each a duplicate; {duplicates} \
         repeated deliveries",
        stops - kills
    );
}

/// Sends a signed event until it is acknowledged, as a provider retries: an answer cut off,
/// a refused connection or a 503 (the gateway down, dying or starting) is sent again 20 ms
/// later. Returns the `status` of the 200.
async fn acknowledged(ingest: &crate::support::Ingest, id: &str, body: &[u8]) -> String {
    let started = Instant::now();
    loop {
        let headers = stripe_headers(body);
        match ingest.try_post("stripe", &headers, body.to_vec()).await {
            Ok((200, json)) => match json["status"].as_str() {
                Some(said @ ("accepted" | "duplicate")) => return said.to_owned(),
                other => panic!("{id} answered {other:?}: {json}"),
            },
            Ok((status, json)) => assert_eq!(status, 503, "{id}: {json}"),
            Err(_) => {}
        }
        assert!(started.elapsed() < AFTER_RESTART, "{id} never acknowledged");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
