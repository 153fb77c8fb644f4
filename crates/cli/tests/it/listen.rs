//! `hooklatch listen`: a real gateway with a `listen` destination, a real `hooklatch listen`
//! process forwarding to a real local handler.
//!
//! Proves that events arriving while no listener is connected wait in the outbox without
//! counting an attempt (the destination allows one attempt, so a counted wait would
//! dead-letter them), then arrive on connect, once each, byte-exact, with `Idempotency-Key`,
//! the provider's signature (made again at the hand-over) and the destination's Standard Webhooks signature; that events
//! arriving while connected go straight through; that a local app's 500 is retried by the
//! gateway's policy with the attempts recorded; that after a listener is killed with SIGKILL
//! the events sent meanwhile arrive when a new one connects; and that every listen refusal
//! has its status and JSON code, and `hooklatch listen` with a wrong token exits 2 without
//! printing the token.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use hooklatch::core::provider::standard_webhooks::{decode_secret, sign_v1};
use hooklatch::core::Secret;
use serde_json::Value;

use crate::support::{
    eventually, stripe_headers, stripe_invoice_paid, stripe_verifies, unique, wait_until,
    Behaviour, Gateway, Handler, KillAfterWork, Options,
};

pub(crate) const LISTEN_TOKEN: &str = "e2e-listen-token-0123456789abcdef";
const LAPTOP_SECRET: &str = "whsec_ZTJlIGxpc3RlbiBkZXN0aW5hdGlvbiBzZWNyZXQ=";

/// A gateway whose source `dev` (Stripe) delivers to the listen destination `laptop`.
pub(crate) fn options(max_attempts: u32) -> Options {
    Options {
        extra_config: format!(
            r#"
[[sources]]
name = "dev"
provider = "stripe"
secrets = ["env:E2E_STRIPE_SECRET"]
destinations = ["laptop"]

[[destinations]]
name = "laptop"
listen_token = "env:E2E_LISTEN_TOKEN"
secret = "{LAPTOP_SECRET}"
timeout = "5s"
max_attempts = {max_attempts}
initial_backoff = "100ms"
max_backoff = "300ms"
"#
        ),
        extra_env: vec![("E2E_LISTEN_TOKEN".to_owned(), LISTEN_TOKEN.to_owned())],
        ..Options::default()
    }
}

/// A `hooklatch listen laptop` process; killed when dropped.
pub(crate) struct Listener {
    child: Child,
    out: PathBuf,
    _dir: tempfile::TempDir,
}

impl Listener {
    fn start(gw: &Gateway, token: &str, forward_to: &str) -> Listener {
        Listener::start_at(
            &format!("http://{}", gw.ingest().addr()),
            &[],
            token,
            forward_to,
        )
    }

    /// `hooklatch [global…] listen laptop --gateway {gateway} …`.
    pub(crate) fn start_at(
        gateway: &str,
        global: &[&str],
        token: &str,
        forward_to: &str,
    ) -> Listener {
        let dir = tempfile::tempdir().expect("a temp dir");
        let out = dir.path().join("listen.out");
        let file = std::fs::File::create(&out).expect("creating the output file");
        let child = Command::new(env!("CARGO_BIN_EXE_hooklatch"))
            .args(global)
            .args(["listen", "laptop", "--gateway", gateway])
            .args([
                "--forward-to",
                forward_to,
                "--token",
                "env:E2E_LISTEN_TOKEN",
            ])
            .env("E2E_LISTEN_TOKEN", token)
            .stdin(Stdio::null())
            .stdout(Stdio::from(
                file.try_clone().expect("cloning a file handle"),
            ))
            .stderr(Stdio::from(file))
            .spawn()
            .expect("spawning hooklatch listen");
        Listener {
            child,
            out,
            _dir: dir,
        }
    }

    /// Waits for the process to end by itself: its exit status and output.
    async fn exit(mut self) -> (std::process::ExitStatus, String) {
        tokio::task::spawn_blocking(move || {
            let status = self.child.wait().expect("waiting for hooklatch listen");
            (status, self.output())
        })
        .await
        .expect("waiting for hooklatch listen")
    }

    pub(crate) fn output(&self) -> String {
        std::fs::read_to_string(&self.out).unwrap_or_default()
    }

    fn kill9(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Whether the process has exited (reaping it if so).
    fn exited(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(Some(_)))
    }
}

impl Drop for Listener {
    fn drop(&mut self) {
        self.kill9();
    }
}

/// A sent event: its key and body.
struct Sent {
    key: String,
    body: Vec<u8>,
}

/// Sends a fresh Stripe event to `/in/dev`.
async fn send(gw: &Gateway, prefix: &str) -> Sent {
    let event_id = unique(prefix);
    let body = stripe_invoice_paid(&event_id, 5000);
    let headers = stripe_headers(&body);
    let (status, json) = gw.post("dev", &headers, body.clone()).await;
    assert_eq!(
        (status, json["status"].as_str()),
        (200, Some("accepted")),
        "{json}"
    );
    Sent {
        key: format!("dev:{event_id}"),
        body,
    }
}

/// How many times this gateway found no listener for `laptop` and put a delivery back.
async fn waits(gw: &Gateway) -> u64 {
    let metrics = gw.metrics().await;
    metrics
        .lines()
        .find_map(|l| l.strip_prefix("hooklatch_delivery_waits_total{destination=\"laptop\"} "))
        .and_then(|n| n.trim().parse().ok())
        .unwrap_or(0)
}

async fn laptop_rows(gw: &Gateway) -> Vec<Value> {
    gw.deliveries("destination=laptop").await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn events_wait_uncounted_for_a_listener_then_arrive_once_byte_exact() {
    let app = Handler::start(Behaviour::AlwaysOk).await;
    let laptop = Handler::start(Behaviour::AlwaysOk).await;
    // One attempt allowed: a wait that counted as an attempt would dead-letter the event.
    // Debug logs, to check below that neither the token nor the signing secret reaches them.
    let gw = Gateway::start_with(
        &app,
        Options {
            log_level: "debug",
            ..options(1)
        },
    )
    .await;
    let mut sent = Vec::new();
    for _ in 0..5 {
        sent.push(send(&gw, "evt_listen_wait").await);
    }
    // Every row is taken by the workers and put back to wait, uncounted.
    eventually("every event taken and put back to wait", async || {
        waits(&gw).await >= 5
    })
    .await;
    let rows = laptop_rows(&gw).await;
    assert_eq!(rows.len(), 5, "{rows:?}");
    for row in &rows {
        assert_eq!(row["state"], "pending", "{row}");
        assert_eq!(row["attempts"], 0, "{row}");
        assert_eq!(row["history"].as_array().map(Vec::len), Some(0), "{row}");
    }

    let listener = Listener::start(&gw, LISTEN_TOKEN, &laptop.url());
    wait_until("the five waiting events reach the laptop", || {
        laptop.distinct_keys().len() == 5
    })
    .await;
    let secret = decode_secret(&Secret::from_text(LAPTOP_SECRET)).expect("a whsec_ secret");
    for Sent { key, body } in &sent {
        let got = laptop.received_for(key);
        assert_eq!(got.len(), 1, "{key} arrived once");
        let got = &got[0];
        assert_eq!(
            got.body.as_ref(),
            body.as_slice(),
            "{key}: the body byte-exact"
        );
        assert_eq!(got.header("idempotency-key"), key);
        assert_eq!(got.header("hooklatch-attempt"), "1");
        // Signed again as Stripe signs, at the hand-over: the local app's Stripe check takes
        // it however long it waited.
        let fresh = got.header("stripe-signature");
        assert!(
            stripe_verifies(body, fresh),
            "{key}: the provider's header {fresh}"
        );
        let ts: i64 = got
            .header("webhook-timestamp")
            .parse()
            .expect("a timestamp");
        assert_eq!(
            got.header("webhook-signature"),
            sign_v1(&secret, key, ts, body),
            "{key}: signed with the destination's secret"
        );
    }
    eventually("the five deliveries recorded delivered", async || {
        let rows = laptop_rows(&gw).await;
        rows.iter()
            .all(|r| r["state"] == "delivered" && r["attempts"] == 1)
    })
    .await;

    // Connected: a new event goes straight through.
    let key = send(&gw, "evt_listen_live").await.key;
    wait_until("the live event reaches the laptop", || {
        laptop.count_for(&key) == 1
    })
    .await;
    eventually("the listener printed the live event", async || {
        listener.output().contains(&key)
    })
    .await;
    assert_eq!(app.total(), 0, "the app destination got nothing");
    let printed = listener.output();
    assert!(printed.contains("connected"), "{printed}");
    assert!(
        !printed.contains(LISTEN_TOKEN),
        "the token is never printed"
    );
    let log = gw.log();
    assert!(log.contains("listener connected"), "debug logs were kept");
    for secret in [LISTEN_TOKEN, LAPTOP_SECRET] {
        assert!(!log.contains(secret), "the gateway's log shows a secret");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_local_app_is_retried_and_a_killed_listener_catches_up() {
    let app = Handler::start(Behaviour::AlwaysOk).await;
    let laptop = Handler::start(Behaviour::FailFirst(2)).await;
    let gw = Gateway::start_with(&app, options(6)).await;
    let mut listener = Listener::start(&gw, LISTEN_TOKEN, &laptop.url());
    eventually("the listener connects", async || {
        listener.output().contains("connected")
    })
    .await;

    // 500, 500, then 200: three attempts, recorded with their statuses.
    let key = send(&gw, "evt_listen_retry").await.key;
    let row = gw.wait_for_delivery_state(&key, "delivered").await;
    let statuses: Vec<_> = row["history"]
        .as_array()
        .expect("history")
        .iter()
        .map(|a| a["status"].as_u64())
        .collect();
    assert_eq!(statuses, [Some(500), Some(500), Some(200)], "{row}");
    assert_eq!(laptop.count_for(&key), 3);
    let printed = listener.output();
    assert!(printed.contains("500"), "{printed}");

    // Killed without a word: the gateway finds it gone; events sent meanwhile wait.
    listener.kill9();
    laptop.set_behaviour(Behaviour::AlwaysOk);
    let mut later = Vec::new();
    for _ in 0..3 {
        later.push(send(&gw, "evt_listen_away").await.key);
    }
    let restarted = Listener::start(&gw, LISTEN_TOKEN, &laptop.url());
    for key in &later {
        let row = gw.wait_for_delivery_state(key, "delivered").await;
        assert_eq!(row["state"], "delivered", "{row}");
    }
    for key in &later {
        assert!(laptop.count_for(key) >= 1, "{key} reached the laptop");
    }
    drop(restarted);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn listen_refusals_have_a_status_and_a_code() {
    let app = Handler::start(Behaviour::AlwaysOk).await;
    let gw = Gateway::start_with(&app, options(3)).await;
    let base = format!("http://{}", gw.ingest().addr());
    let client = reqwest::Client::new();
    let code = |res: reqwest::Response| async move {
        let status = res.status().as_u16();
        let body: Value = res.json().await.expect("a JSON body");
        (status, body["code"].as_str().unwrap_or_default().to_owned())
    };
    let stream = format!("{base}/listen/laptop");
    let results = format!("{base}/listen/laptop/results");

    let res = client.get(&stream).send().await.unwrap();
    assert_eq!(code(res).await, (401, "unauthorized".to_owned()));
    let res = client
        .get(&stream)
        .bearer_auth("wrong-token-0123456789")
        .send()
        .await
        .unwrap();
    assert_eq!(code(res).await, (401, "unauthorized".to_owned()));
    let res = client
        .get(format!("{base}/listen/app"))
        .bearer_auth(LISTEN_TOKEN)
        .send()
        .await
        .unwrap();
    assert_eq!(code(res).await, (404, "unknown_destination".to_owned()));
    let res = client.delete(&stream).send().await.unwrap();
    assert_eq!(code(res).await, (405, "method_not_allowed".to_owned()));
    let res = client
        .post(&results)
        .bearer_auth(LISTEN_TOKEN)
        .body("not json")
        .send()
        .await
        .unwrap();
    assert_eq!(code(res).await, (400, "invalid_body".to_owned()));
    let res = client
        .post(&results)
        .bearer_auth(LISTEN_TOKEN)
        .json(&serde_json::json!({"delivery": 424242, "status": 200}))
        .send()
        .await
        .unwrap();
    assert_eq!(code(res).await, (404, "not_waiting".to_owned()));
    assert!(
        gw.metrics()
            .await
            .contains("hooklatch_listen_refused_total{code=\"unauthorized\"} 2"),
        "refusals are counted"
    );

    // The CLI with a wrong token stops at once with status 2, the token unprinted.
    let wrong = "wrong-listen-token-0123456789";
    let status = Listener::start(&gw, wrong, "http://127.0.0.1:9/unused")
        .exit()
        .await;
    assert_eq!(status.0.code(), Some(2), "{}", status.1);
    assert!(status.1.contains("401"), "{}", status.1);
    assert!(!status.1.contains(wrong), "{}", status.1);

    // Pointed at the admin API, it says which listener to point at.
    let status = Listener::start_at(&gw.admin_url(), &[], LISTEN_TOKEN, "http://127.0.0.1:9/")
        .exit()
        .await;
    assert_eq!(status.0.code(), Some(2), "{}", status.1);
    assert!(
        status
            .1
            .contains("is --gateway the gateway's ingest listener"),
        "{}",
        status.1
    );
}

/// Two gateways on one PostgreSQL database, the listener connected to one of them: events
/// sent to either while no listener is connected wait uncounted; once it connects they all
/// arrive, once each — those the other instance takes are put back for 15 s and then taken
/// by either again, until the connected one delivers them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_postgres_two_instances_deliver_to_the_one_listener() {
    let Some(db) = crate::postgres::Database::create(&unique("hooklatch_e2e")).await else {
        return;
    };
    let app = Handler::start(Behaviour::AlwaysOk).await;
    let laptop = Handler::start(Behaviour::AlwaysOk).await;
    let shared = Options {
        store_url: Some(db.url()),
        ..options(1)
    };
    let a = Gateway::start_with(&app, shared.clone()).await;
    let b = Gateway::start_with(&app, shared).await;
    let mut keys = Vec::new();
    for i in 0..6 {
        let gw = if i % 2 == 0 { &a } else { &b };
        keys.push(send(gw, "evt_listen_pg").await.key);
    }
    eventually("every event taken and put back to wait", async || {
        waits(&a).await + waits(&b).await >= 6
    })
    .await;
    let rows = laptop_rows(&a).await;
    assert_eq!(rows.len(), 6, "{rows:?}");
    assert!(
        rows.iter()
            .all(|r| r["state"] == "pending" && r["attempts"] == 0),
        "{rows:?}"
    );

    let listener = Listener::start(&a, LISTEN_TOKEN, &laptop.url());
    // Connected: more events, through the instance the listener is not connected to.
    for _ in 0..4 {
        keys.push(send(&b, "evt_listen_pg_live").await.key);
    }
    crate::support::wait_until_within(
        "every event reaches the laptop",
        Duration::from_secs(60),
        || keys.iter().all(|k| laptop.count_for(k) >= 1),
    )
    .await;
    for key in &keys {
        assert_eq!(laptop.count_for(key), 1, "{key} arrived once");
    }
    eventually(
        "every delivery recorded delivered, one attempt each",
        async || {
            let rows = laptop_rows(&b).await;
            rows.len() == 10
                && rows
                    .iter()
                    .all(|r| r["state"] == "delivered" && r["attempts"] == 1)
        },
    )
    .await;
    drop(listener);
    drop((a, b));
    db.drop_now().await;
}

/// How many times the T15 test kills the listener after the local app did the work.
const LISTENERS_KILLED_AFTER_WORK: usize = 5;

/// T15 for `listen`: the listener dies after the local app did the work and before it
/// reported the answer (the app kills it with SIGKILL while the listener waits for the
/// answer). The gateway counts that attempt failed, and the next listener gets the delivery
/// again, once, with the same `Idempotency-Key`: a key-guarded effect happens once per event.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_listener_killed_after_the_local_app_did_the_work_gets_it_again_once_with_the_same_key() {
    let kills = crate::report::scaled(LISTENERS_KILLED_AFTER_WORK);
    let mut card = crate::report::Card::new("T15", "listen");
    let local = KillAfterWork::start().await;
    let kill_pid = |pid: u32| -> crate::support::Kill {
        Box::new(move || {
            let _ = Command::new("kill").args(["-9", &pid.to_string()]).status();
        })
    };
    let app = Handler::start(Behaviour::AlwaysOk).await;
    let gw = Gateway::start_with(&app, options(5)).await;

    let mut keys = Vec::new();
    let mut listener = Listener::start(&gw, LISTEN_TOKEN, &local.url());
    for _ in 0..kills {
        local.set_kill(Some(kill_pid(listener.pid())));
        eventually("the listener connects", async || {
            listener.output().contains("connected")
        })
        .await;
        let key = send(&gw, "evt_listen_after_work").await.key;
        local.acked();
        wait_until("the local app kills the listener", || listener.exited()).await;
        // The next listener gets the event again (and is the one killed next time).
        listener = Listener::start(&gw, LISTEN_TOKEN, &local.url());
        local.set_kill(Some(kill_pid(listener.pid())));
        let row = gw.wait_for_delivery_state(&key, "delivered").await;
        assert_eq!(
            row["attempts"], 2,
            "the killed attempt failed, the next one delivered: {row:#}"
        );
        keys.push(key);
    }
    local.set_kill(None);
    drop(listener);

    let seen = local.seen();
    assert_eq!(seen.len(), kills, "{seen:#?}");
    for key in &keys {
        assert_eq!(
            seen[key],
            ["1", "2"],
            "{key}: exactly one extra delivery, the same key"
        );
    }
    let naive_effects: usize = seen.values().map(Vec::len).sum();
    card.count("ops", kills)
        .count("acked", kills)
        .count("lost", 0)
        .count("duplicates", naive_effects - seen.len())
        .fault("kill9", kills)
        .figure("double_effects", 0)
        .figure("naive_double_effects", naive_effects - seen.len());
}
