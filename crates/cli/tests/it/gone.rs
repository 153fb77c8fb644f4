//! A destination that answers `410 Gone` is disabled (the Standard Webhooks rule), and a
//! disabled destination's deliveries wait until an operator enables it.
//!
//! On a real `serve` process with a real handler: the 410 attempt is recorded, the destination
//! is disabled, and what comes after it waits with no attempt made or counted; the state
//! survives a kill -9; `hooklatch destinations enable` (the CLI, through the admin API) makes
//! every held delivery due, and each is delivered once with its key. Then the operator's side:
//! disable with a reason, the refusals with their codes, enable again.

use std::process::Command;

use serde_json::Value;

use crate::support::{eventually, Behaviour, Gateway, Handler, Options, ADMIN_TOKEN};

/// `hooklatch destinations ARGS…` against the gateway; its exit code, stdout and stderr.
fn cli(gw: &Gateway, args: &[&str]) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_hooklatch"))
        .arg("destinations")
        .args(args)
        .args(["--admin", &gw.admin_url()])
        .env("HOOKLATCH_ADMIN_TOKEN", ADMIN_TOKEN)
        .output()
        .expect("running hooklatch destinations");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// The destination `app` as `GET /v1/destinations` lists it.
async fn app(gw: &Gateway) -> Value {
    let (status, json) = gw.admin_get("/v1/destinations").await;
    assert_eq!(status, 200, "{json}");
    let items = json["items"].as_array().expect("items");
    assert_eq!(items.len(), 1, "{json:#}");
    assert_eq!(items[0]["name"], "app", "{json:#}");
    assert_eq!(items[0]["kind"], "http", "{json:#}");
    items[0].clone()
}

/// The one delivery of `key`.
async fn delivery(gw: &Gateway, key: &str) -> Value {
    let rows = gw.deliveries_for(key).await;
    assert_eq!(rows.len(), 1, "{rows:#?}");
    rows[0].clone()
}

const WAITS: &str = "hooklatch_delivery_waits_total{destination=\"app\"}";
const DISABLED: &str = "hooklatch_destination_disabled{destination=\"app\"}";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_410_disables_the_destination_and_its_deliveries_wait_until_it_is_enabled() {
    let mut card = crate::report::Card::new("T14", "sqlite");
    card.fault("gone_410", 1).fault("kill9", 1);
    let handler = Handler::start(Behaviour::Gone).await;
    // One attempt allowed: the 410 must not use it up into the dead-letter.
    let options = Options {
        max_attempts: 1,
        ..Options::default()
    };
    let mut gw = Gateway::start_with(&handler, options).await;
    assert_eq!(app(&gw).await["enabled"], true);

    let first = gw.send_stripe_event("stripe", "evt_gone").await;
    eventually("the destination disabled by its 410", async || {
        app(&gw).await["enabled"] == false
    })
    .await;
    let listed = app(&gw).await;
    assert_eq!(
        listed["disabled_reason"], "HTTP 410 Gone from the destination",
        "{listed:#}"
    );
    assert!(listed["disabled_at"].is_string(), "{listed:#}");
    assert_eq!(gw.metric(DISABLED).await, 1.0);
    // Counted as what it was: neither a delivery nor a retry.
    let gone = r#"hooklatch_delivery_attempts_total{destination="app",outcome="gone"}"#;
    let retry = r#"hooklatch_delivery_attempts_total{destination="app",outcome="retry"}"#;
    assert_eq!((gw.metric(gone).await, gw.metric(retry).await), (1.0, 0.0));

    // The 410 was an attempt, recorded, and its event waits for the destination instead of
    // going to the dead-letter with its one attempt used; two later events wait, uncounted.
    let later = [
        gw.send_stripe_event("stripe", "evt_held").await,
        gw.send_stripe_event("stripe", "evt_held").await,
    ];
    eventually("two later deliveries held", async || {
        gw.metric(WAITS).await >= 2.0
    })
    .await;
    let row = delivery(&gw, &first).await;
    assert_eq!(row["state"], "pending", "{row:#}");
    assert_eq!(row["attempts"], 1, "{row:#}");
    assert_eq!(row["history"][0]["status"], 410, "{row:#}");
    let error = row["last_error"].as_str().expect("last_error");
    assert!(
        error.starts_with("HTTP 410: the destination is gone"),
        "{error}"
    );
    assert_eq!(
        (&row["held"], &row["next_attempt_at"]),
        (&Value::Bool(true), &Value::Null),
        "held until the enable: {row:#}"
    );
    for key in &later {
        let row = delivery(&gw, key).await;
        assert_eq!(
            (&row["state"], &row["attempts"]),
            (&Value::from("pending"), &Value::from(0)),
            "{row:#}"
        );
        assert_eq!(row["history"].as_array().map(Vec::len), Some(0), "{row:#}");
    }
    assert_eq!(handler.total(), 1, "nothing sent after the 410");

    // Kept in the store: a gateway killed and started again still holds them.
    gw.restart().await;
    assert_eq!(app(&gw).await["enabled"], false);
    assert_eq!(gw.metric(DISABLED).await, 1.0);
    let (code, out, err) = cli(&gw, &["list"]);
    assert_eq!(code, 0, "{err}");
    assert!(
        out.starts_with("app") && out.contains("http") && out.contains("disabled since"),
        "{out}"
    );
    assert!(out.contains("HTTP 410 Gone from the destination"), "{out}");
    assert_eq!(handler.total(), 1, "nothing sent after the restart");

    // The endpoint is back; the operator enables it.
    handler.set_behaviour(Behaviour::AlwaysOk);
    let (code, out, err) = cli(&gw, &["enable", "app"]);
    assert_eq!(code, 0, "{out}{err}");
    // Held rows are never leased, so all three are woken by the enable itself.
    assert_eq!(
        out.trim(),
        "app: enabled; 3 held deliveries due now",
        "{out}"
    );
    for key in [&first, &later[0], &later[1]] {
        let row = gw.wait_for_delivery_state(key, "delivered").await;
        assert_eq!(handler.count_for(key), if key == &first { 2 } else { 1 });
        let want = if key == &first { 2 } else { 1 };
        assert_eq!(row["attempts"], want, "{row:#}");
    }
    let received = handler.received_for(&first);
    assert_eq!(received[1].attempt, Some(2), "the retry is attempt 2");
    assert_eq!(received[0].body, received[1].body);
    assert_eq!(app(&gw).await["enabled"], true);
    assert_eq!(gw.metric(DISABLED).await, 0.0);
    card.count("acked", 3)
        .count("lost", 0)
        .count("duplicates", 0);

    // Enabling what is not disabled: exit 1, the API's 409.
    let (code, _, err) = cli(&gw, &["enable", "app"]);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("is not disabled"), "{err}");
    let (status, json) = gw.admin_post("/v1/destinations/app/enable").await;
    assert_eq!((status, &json["code"]), (409, &Value::from("not_disabled")));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operator_disables_and_enables_a_destination_and_mistakes_are_refused() {
    let handler = Handler::start(Behaviour::AlwaysOk).await;
    let gw = Gateway::start(&handler).await;

    let (code, out, err) = cli(&gw, &["disable", "app", "--reason", "moving the endpoint"]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("disabled since"), "{out}");
    let listed = app(&gw).await;
    assert_eq!(listed["enabled"], false);
    assert_eq!(listed["disabled_reason"], "moving the endpoint");
    // A second disable keeps the first reason.
    let (status, json) = gw.admin_post("/v1/destinations/app/disable").await;
    assert_eq!(status, 200, "{json}");
    assert_eq!(json["disabled_reason"], "moving the endpoint", "{json}");

    let key = gw.send_stripe_event("stripe", "evt_paused").await;
    eventually("the delivery held", async || gw.metric(WAITS).await >= 1.0).await;
    assert_eq!(handler.total(), 0);
    assert_eq!(delivery(&gw, &key).await["attempts"], 0);

    // Refusals, each with its status and code; none changes anything.
    let client = reqwest::Client::new();
    let post = |path: &str, body: &'static str| {
        client
            .post(format!("{}{path}", gw.admin_url()))
            .bearer_auth(ADMIN_TOKEN)
            .header("content-type", "application/json")
            .body(body)
            .send()
    };
    for (path, body, status, code) in [
        (
            "/v1/destinations/nope/disable",
            "",
            404,
            "unknown_destination",
        ),
        (
            "/v1/destinations/nope/enable",
            "",
            404,
            "unknown_destination",
        ),
        (
            "/v1/destinations/app/disable",
            "{\"why\":1}",
            400,
            "invalid_body",
        ),
        ("/v1/destinations/app/disable", "[", 400, "invalid_body"),
    ] {
        let res = post(path, body).await.expect("admin request");
        assert_eq!(res.status().as_u16(), status, "{path} {body}");
        let json: Value = res.json().await.expect("a JSON error");
        assert_eq!(json["code"], code, "{path} {body}: {json}");
        assert!(json["message"].is_string(), "{json}");
    }
    let long = format!("{{\"reason\":\"{}\"}}", "x".repeat(201));
    let res = client
        .post(format!("{}/v1/destinations/app/disable", gw.admin_url()))
        .bearer_auth(ADMIN_TOKEN)
        .body(long)
        .send()
        .await
        .expect("admin request");
    assert_eq!(res.status().as_u16(), 400);
    let json: Value = res.json().await.expect("a JSON error");
    assert_eq!(json["code"], "invalid_parameter", "{json}");
    let (status, _) = gw
        .admin_request(reqwest::Method::POST, "/v1/destinations/app/enable", None)
        .await;
    assert_eq!(status, 401, "the token is required");
    assert_eq!(app(&gw).await["disabled_reason"], "moving the endpoint");
    let (code, _, err) = cli(&gw, &["enable", "nope"]);
    assert_eq!(code, 1, "an unknown destination is the gateway's no: {err}");

    let (status, json) = gw.admin_post("/v1/destinations/app/enable").await;
    assert_eq!(status, 200, "{json}");
    assert_eq!(json["enabled"], true, "{json}");
    // 1 once the put-back is committed; 0 if the enable came between the worker's decision and
    // its commit, when the worker wakes the row itself (`hooklatch_http::disabled`).
    assert!(json["woken"].as_u64().is_some_and(|n| n <= 1), "{json}");
    gw.wait_for_delivery_state(&key, "delivered").await;
    assert_eq!(handler.count_for(&key), 1);
}

/// A delivery held for a destination the store has enabled since, that nobody is left to wake
/// (the instance that put it back stopped between its put-back and its look at the enable, or
/// heard of the enable late and went away): the gateway's sweep of held rows, as it starts,
/// makes it due, and it is delivered once. The enable is written into the stopped gateway's
/// file by hand, as such a lost wake leaves it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_held_delivery_whose_wake_was_lost_is_delivered_after_the_next_start() {
    let handler = Handler::start(Behaviour::AlwaysOk).await;
    let mut gw = Gateway::start(&handler).await;
    let (code, _, err) = cli(&gw, &["disable", "app", "--reason", "moving the endpoint"]);
    assert_eq!(code, 0, "{err}");
    let key = gw.send_stripe_event("stripe", "evt_lost_wake").await;
    eventually("the delivery held", async || {
        delivery(&gw, &key).await["held"] == true
    })
    .await;
    let row = delivery(&gw, &key).await;
    assert_eq!(row["next_attempt_at"], Value::Null, "{row:#}");
    assert_eq!(row["attempts"], 0, "{row:#}");

    gw.kill9();
    let db = rusqlite::Connection::open(gw.database_path()).expect("opening the store");
    let enabled = db
        .execute(
            "DELETE FROM disabled_destinations WHERE destination = 'app'",
            [],
        )
        .expect("enabling by hand");
    assert_eq!(enabled, 1);
    drop(db);
    gw.restart().await;
    let row = gw.wait_for_delivery_state(&key, "delivered").await;
    assert_eq!(row["held"], false, "{row:#}");
    assert_eq!(handler.count_for(&key), 1);
    assert_eq!(handler.total(), 1);
    let log = gw.log();
    assert!(
        log.contains("deliveries held for a destination enabled since are due"),
        "{log}"
    );
}

/// Two gateways on one PostgreSQL database, `a` delivering and `b` ingesting only: `a`
/// disables the destination on its 410 and `b` learns it (within `DISABLED_RELOAD`); enabled
/// through `b`, the deliveries `a` takes before it hears are put back, and woken again when it
/// hears: every event arrives once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_postgres_an_enable_on_another_instance_wakes_what_this_one_held() {
    let mut card = crate::report::Card::new("T14", "postgres");
    let Some(db) =
        crate::postgres::Database::create(&crate::support::unique("hooklatch_e2e")).await
    else {
        return;
    };
    let handler = Handler::start(Behaviour::Gone).await;
    let shared = Options {
        store_url: Some(db.url()),
        ..Options::default()
    };
    let a = Gateway::start_with(&handler, shared.clone()).await;
    let b = Gateway::start_with(
        &handler,
        Options {
            deliver: false,
            ..shared
        },
    )
    .await;

    let first = b.send_stripe_event("stripe", "evt_gone_pg").await;
    eventually("the destination disabled by its 410", async || {
        app(&b).await["enabled"] == false
    })
    .await;
    eventually("the other instance hears of it", async || {
        b.metric(DISABLED).await == 1.0
    })
    .await;
    let mut keys = vec![first];
    for _ in 0..6 {
        keys.push(b.send_stripe_event("stripe", "evt_held_pg").await);
    }
    eventually("the new deliveries held", async || {
        a.metric(WAITS).await >= 6.0
    })
    .await;
    assert_eq!(handler.total(), 1, "nothing sent after the 410");
    for key in &keys[1..] {
        assert_eq!(delivery(&a, key).await["attempts"], 0, "{key}");
    }

    // Enabled through the instance that does not deliver: the one that does takes the woken
    // rows while it still believes the destination disabled, and puts them back.
    handler.set_behaviour(Behaviour::AlwaysOk);
    let held = a.metric(WAITS).await;
    let (status, json) = b.admin_post("/v1/destinations/app/enable").await;
    assert_eq!(status, 200, "{json}");
    assert_eq!(json["woken"], 7, "{json}");
    crate::support::wait_until_within(
        "every event delivered",
        std::time::Duration::from_secs(60),
        || {
            keys.iter()
                .all(|k| handler.count_for(k) > usize::from(k == &keys[0]))
        },
    )
    .await;
    for key in &keys {
        let row = a.wait_for_delivery_state(key, "delivered").await;
        let last = row["history"].as_array().and_then(|h| h.last()).cloned();
        assert_eq!(
            last.map(|a| a["status"].clone()),
            Some(Value::from(200)),
            "{row:#}"
        );
    }
    assert_eq!(
        handler.total(),
        1 + keys.len(),
        "each event delivered once after the enable"
    );
    let put_back = a.metric(WAITS).await - held;
    card.count("acked", keys.len())
        .count("lost", 0)
        .fault("gone_410", 1)
        .figure("put_back_before_hearing", put_back as u64);
    eventually("the delivering instance knows it is enabled", async || {
        a.metric(DISABLED).await == 0.0
    })
    .await;
    drop((a, b));
    db.drop_now().await;
}
