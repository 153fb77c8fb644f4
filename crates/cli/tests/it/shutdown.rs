//! Graceful shutdown on SIGTERM, and SIGHUP stopping nothing.
//!
//! Proves that an idle gateway exits with status 0 soon after SIGTERM, and that what it had
//! claimed lives on disk, not in its memory: after a restart on the same file, a replay of an
//! event delivered before the shutdown is answered as a duplicate and not forwarded again.
//! With `server.shutdown_delay`, `/readyz` says "shutting down" at once while events are still
//! taken until the delay ends.

use crate::support::{
    stripe_headers, stripe_invoice_paid, unique, wait_until, Behaviour, Gateway, Handler, Options,
};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_while_idle_makes_the_gateway_exit_with_status_0() {
    let handler = Handler::start(Behaviour::AlwaysOk).await;
    let mut gw = Gateway::start(&handler).await;

    gw.sigterm();
    let status = gw.wait_exit().await;
    assert!(status.success(), "exit status {status}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_event_claimed_before_sigterm_is_still_a_duplicate_after_restart() {
    let handler = Handler::start(Behaviour::AlwaysOk).await;
    let mut gw = Gateway::start(&handler).await;
    let event_id = unique("evt_restart");
    let key = format!("stripe:{event_id}");
    let body = stripe_invoice_paid(&event_id, 5000);
    let (status, json) = gw
        .post("stripe", &stripe_headers(&body), body.clone())
        .await;
    assert_eq!((status, json["status"].as_str()), (200, Some("accepted")));
    gw.wait_for_delivery_state(&key, "delivered").await;

    gw.sigterm();
    let status = gw.wait_exit().await;
    assert!(status.success(), "exit status {status}");
    gw.restart().await;

    let (status, json) = gw.post("stripe", &stripe_headers(&body), body).await;
    assert_eq!(status, 200, "{json}");
    assert_eq!(json["status"], "duplicate", "{json}");
    assert_eq!(gw.deliveries_for(&key).await.len(), 1);
    assert_eq!(handler.count_for(&key), 1);
}

/// A load balancer polling `/readyz` learns of the shutdown at once, and what it sends until
/// it stops is still taken: with `shutdown_delay`, the listeners answer for that long.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn during_the_shutdown_delay_readyz_says_shutting_down_and_events_are_still_taken() {
    let handler = Handler::start(Behaviour::AlwaysOk).await;
    let mut gw = Gateway::start_with(
        &handler,
        Options {
            server_config: "shutdown_delay = \"8s\"".to_owned(),
            log_level: "info",
            ..Options::default()
        },
    )
    .await;
    gw.sigterm();
    let mut readyz = (0, serde_json::Value::Null);
    for _ in 0..100 {
        readyz = gw.admin_get("/readyz").await;
        if readyz.0 == 503 {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    assert_eq!(readyz.0, 503, "{}", readyz.1);
    assert_eq!(readyz.1["reason"], "shutting down", "{}", readyz.1);

    let event_id = unique("evt_in_the_delay");
    let key = format!("stripe:{event_id}");
    let body = stripe_invoice_paid(&event_id, 5000);
    let res = gw
        .ingest()
        .send("stripe", &stripe_headers(&body), body)
        .await
        .expect("an answer during the delay");
    // Told to open its next connection elsewhere.
    let close = res.headers().get("connection").cloned();
    let status = res.status().as_u16();
    let json: serde_json::Value = res.json().await.expect("a JSON answer");
    assert_eq!(
        (status, json["status"].as_str()),
        (200, Some("accepted")),
        "{json}"
    );
    assert_eq!(close.as_ref().and_then(|v| v.to_str().ok()), Some("close"));
    gw.wait_for_delivery_state(&key, "delivered").await;
    assert!(
        gw.try_wait().is_none(),
        "the gateway stopped before its delay ended"
    );

    let status = gw.wait_exit().await;
    assert!(status.success(), "exit status {status}");
    let log = gw.log();
    assert!(
        log.contains("still taking requests for server.shutdown_delay"),
        "{}",
        gw.log_tail(20)
    );
    // A probe's 503 is the state it reports, not an error to log at every poll.
    assert!(!log.contains("ERROR"), "{}", gw.log_tail(30));
}

/// An attempt still waiting for its answer when the shutdown grace runs out is recorded as
/// abandoned — the destination may have acted on it — and is due again at once: after a
/// restart the event comes again as attempt 2, and its history says why it came twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_attempt_cut_off_by_the_shutdown_grace_is_recorded_and_comes_again_as_the_next() {
    let handler = Handler::start(Behaviour::SlowOk(30_000)).await;
    let mut gw = Gateway::start_with(
        &handler,
        Options {
            timeout: "60s",
            extra_env: vec![(
                "HOOKLATCH_SERVER__SHUTDOWN_GRACE".to_owned(),
                "1s".to_owned(),
            )],
            ..Options::default()
        },
    )
    .await;
    let key = gw.send_stripe_event("stripe", "evt_abandoned").await;
    wait_until("the attempt reached the handler", || {
        handler.count_for(&key) == 1
    })
    .await;
    gw.sigterm();
    let status = gw.wait_exit().await;
    assert!(status.success(), "exit status {status}");

    handler.set_behaviour(Behaviour::AlwaysOk);
    gw.restart().await;
    let row = gw.wait_for_delivery_state(&key, "delivered").await;
    assert_eq!(row["attempts"], 2, "{row:#}");
    let first = &row["history"][0];
    assert!(
        first["error"]
            .as_str()
            .is_some_and(|e| e.starts_with("abandoned: the gateway stopped")),
        "{row:#}"
    );
    let attempts: Vec<Option<u32>> = handler
        .received_for(&key)
        .iter()
        .map(|r| r.attempt)
        .collect();
    assert_eq!(attempts, [Some(1), Some(2)]);
}

/// A second SIGTERM while the gateway stops (here, in its shutdown delay) ends it at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_sigterm_stops_at_once() {
    let handler = Handler::start(Behaviour::AlwaysOk).await;
    let mut gw = Gateway::start_with(
        &handler,
        Options {
            server_config: "shutdown_delay = \"60s\"".to_owned(),
            log_level: "info",
            ..Options::default()
        },
    )
    .await;
    gw.sigterm();
    wait_until("the gateway is in its shutdown delay", || {
        gw.log().contains("still taking requests")
    })
    .await;
    gw.sigterm();
    let status = gw.wait_exit().await;
    assert_eq!(status.code(), Some(130), "{}", gw.log_tail(20));
    assert!(
        gw.log().contains("a second stop signal: stopping now"),
        "{}",
        gw.log_tail(20)
    );
}

/// SIGHUP stops nothing: certbot's deploy hook (`pkill -HUP -x hooklatch`, README) reaches every
/// gateway on the host, and a closed terminal sends it too. A gateway without a TLS
/// certificate, which has nothing to reload, says so and goes on serving.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sighup_without_a_tls_certificate_stops_nothing() {
    let handler = Handler::start(Behaviour::AlwaysOk).await;
    let mut gw = Gateway::start_with(
        &handler,
        Options {
            log_level: "info",
            ..Options::default()
        },
    )
    .await;
    gw.signal("HUP");
    wait_until("the gateway logs the SIGHUP", || {
        gw.log().contains("SIGHUP received: nothing to reload")
    })
    .await;
    assert!(gw.try_wait().is_none(), "the gateway stopped on SIGHUP");

    let event_id = unique("evt_after_hup");
    let key = format!("stripe:{event_id}");
    let body = stripe_invoice_paid(&event_id, 5000);
    let (status, json) = gw.post("stripe", &stripe_headers(&body), body).await;
    assert_eq!((status, json["status"].as_str()), (200, Some("accepted")));
    gw.wait_for_delivery_state(&key, "delivered").await;

    gw.sigterm();
    let status = gw.wait_exit().await;
    assert!(status.success(), "exit status {status}");
}
