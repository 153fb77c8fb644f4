//! End-to-end tests of the RabbitMQ destination: a real `hooklatch serve` with its Stripe
//! source delivering to a real broker at `HOOKLATCH_TEST_AMQP_URL`
//! (e.g. `amqp://guest:guest@127.0.0.1:5672/%2f`). Without it the tests print
//! `skipped: set HOOKLATCH_TEST_AMQP_URL` and pass — except under CI (`CI` set), where they
//! fail. Each test declares its own exchange and queue and deletes them afterwards.
//!
//! The gateway helpers are the end-to-end suite's own (`it/support.rs`), included as is.
//!
//! The payment → ticket tests also run the example consumer (`examples/ticket-consumer`) as a
//! real process against a PostgreSQL database of their own on the server
//! `HOOKLATCH_TEST_POSTGRES_URL` points at (e.g. `postgres://postgres@127.0.0.1:5432/postgres`,
//! a user that may create databases); they skip without it, and fail under CI. The consumer is
//! its own package, and `CARGO_BIN_EXE_*` only names this package's binaries, so
//! [`ticket_consumer_bin`] builds it once per run with
//! `cargo build -p hooklatch-example-ticket-consumer` into this run's target dir and profile.
//!
//! One test restarts the broker (`rabbitmqctl stop_app`, then `start_app`) in the middle of a
//! burst of 1,000 events. It needs `rabbitmqctl` for the node behind the URL
//! (`HOOKLATCH_TEST_RABBITMQCTL` names another command, e.g. `docker exec rabbitmq rabbitmqctl`)
//! and skips without it, failing under CI. It holds [`BROKER`] for writing; every other broker
//! test holds it for reading, so none of them sees the restart.

#[allow(dead_code)]
#[path = "it/support.rs"]
mod support;

#[path = "common/example_bin.rs"]
mod example_bin;
#[allow(dead_code)]
#[path = "it/report.rs"]
mod report;
#[path = "common/test_database.rs"]
mod test_database;

use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};
use test_database::TestDatabase as TestDb;

use hooklatch_testkit::amqp::{broker_url, header, message_id, TestBroker};
use sqlx::Connection as _;
use support::{
    eventually, stripe_headers, stripe_invoice_paid, unique, wait_until, wait_until_within,
    Behaviour, Gateway, Handler, Options, DEADLINE,
};

/// Held for reading by every test that uses the broker, for writing by the one that restarts
/// it: a restart would otherwise break the other tests of this binary running in parallel.
static BROKER: tokio::sync::RwLock<()> = tokio::sync::RwLock::const_new(());

/// Gateway options: the `stripe` source delivers to an AMQP destination `mq` (3 quick
/// attempts) with `mq_settings` (exchange, routing key, declarations).
fn options(url: &str, mq_settings: &str) -> Options {
    options_with_retries(url, QUICK_RETRIES, mq_settings)
}

/// The destination's retry settings in [`options`]: 3 attempts within half a second.
const QUICK_RETRIES: &str = "max_attempts = 3\ninitial_backoff = \"100ms\"\nmax_backoff = \"300ms\"\njitter = 0.0\ntimeout = \"10s\"";

/// [`options`] with the destination's retry settings (`max_attempts`, backoffs, `jitter`,
/// `timeout`) given.
fn options_with_retries(url: &str, retries: &str, mq_settings: &str) -> Options {
    Options {
        extra_config: format!(
            r#"
[[destinations]]
name = "mq"
amqp = "env:E2E_AMQP_URL"
{retries}
{mq_settings}
"#
        ),
        extra_env: vec![
            ("E2E_AMQP_URL".to_owned(), url.to_owned()),
            (
                "HOOKLATCH_SOURCES__STRIPE__DESTINATIONS".to_owned(),
                r#"["mq"]"#.to_owned(),
            ),
        ],
        ..Options::default()
    }
}

/// A broker that cannot be reached is said at start, naming it with its password masked,
/// and stops nothing: events are accepted and wait in the outbox.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broker_unreachable_at_start_is_said_and_events_are_still_accepted() {
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = closed.local_addr().unwrap().port();
    drop(closed);
    let handler = Handler::start(Behaviour::AlwaysOk).await;
    let gw = Gateway::start_with(
        &handler,
        options(
            &format!("amqp://guest:guest@127.0.0.1:{port}/%2f"),
            "exchange = \"\"\nrouting_key = \"nowhere\"",
        ),
    )
    .await;
    let said = format!("RabbitMQ cannot be reached now (connecting to RabbitMQ failed: amqp://guest:***@127.0.0.1:{port}/%2f:");
    wait_until("the start-up warning", || gw.log().contains(&said)).await;
    assert!(!gw.log().contains("guest:guest"));
    let key = send_accepted(&gw, "evt_broker_down").await;
    let row = gw.deliveries_for(&key).await;
    assert_eq!(row[0]["state"], "pending", "{row:#?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_payment_sent_42_times_is_one_persistent_message_keyed_by_its_event() {
    let Some(url) = broker_url() else { return };
    let _broker_up = BROKER.read().await;
    let mut broker = TestBroker::connect(&url).await;
    let exchange = format!("hooklatch-e2e-x-{}", unique("pay"));
    let queue = format!("hooklatch-e2e-q-{}", unique("pay"));
    broker.owns(&exchange, &queue);
    let handler = Handler::start(Behaviour::AlwaysOk).await;
    let gw = Gateway::start_with(
        &handler,
        options(
            &url,
            &format!(
                "exchange = \"{exchange}\"\nrouting_key = \"payment.confirmed\"\ndeclare = true\nqueue = \"{queue}\"\nquorum = true"
            ),
        ),
    )
    .await;

    let event = unique("evt");
    let body = stripe_invoice_paid(&event, 5000);
    for _ in 0..10 {
        let (status, json) = gw
            .post("stripe", &stripe_headers(&body), body.clone())
            .await;
        assert_eq!(status, 200, "{json}");
    }
    let mut senders = tokio::task::JoinSet::new();
    for _ in 0..32 {
        let ingest = gw.ingest();
        let body = body.clone();
        senders.spawn(async move { ingest.post("stripe", &stripe_headers(&body), body).await });
    }
    while let Some(sent) = senders.join_next().await {
        let (status, json) = sent.expect("a sender task");
        assert_eq!(status, 200, "{json}");
    }

    let key = format!("stripe:{event}");
    let row = gw.wait_for_delivery_state(&key, "delivered").await;
    assert_eq!(row["attempts"], 1, "{row:#}");
    let msg = broker
        .get_within(&queue, Duration::from_secs(10))
        .await
        .expect("the payment is in the queue");
    let props = &msg.delivery.properties;
    assert_eq!(msg.delivery.data, body, "the body, byte-exact");
    assert_eq!(
        props.message_id().as_ref().map(|s| s.to_string()),
        Some(key.clone())
    );
    assert_eq!(*props.delivery_mode(), Some(2), "persistent");
    assert_eq!(
        props.content_type().as_ref().map(|s| s.to_string()),
        Some("application/json; charset=utf-8".to_owned())
    );
    assert_eq!(header(&msg, "hooklatch-source"), "stripe");
    assert_eq!(header(&msg, "hooklatch-provider"), "stripe");
    assert_eq!(
        header(&msg, "hooklatch-event-type"),
        "invoice.payment_succeeded"
    );
    assert_eq!(header(&msg, "hooklatch-attempt"), "1");
    assert_eq!(
        header(&msg, "hooklatch-delivery-id"),
        row["id"].as_str().unwrap()
    );
    assert!(
        broker
            .get_within(&queue, Duration::from_secs(1))
            .await
            .is_none(),
        "a second message for one payment"
    );
    assert_eq!(handler.total(), 0, "nothing went to the HTTP destination");

    drop(gw);
    broker.clean_up().await;
}

/// T1 in Redis-keys mode with a RabbitMQ destination (the two scale-out parts together): 300
/// ids × 32 concurrent copies from 64 senders (`HOOKLATCH_SCALE` times more in the soak tier),
/// copies meeting the first in flight answered 409 and retried as a provider does. Per id one
/// `accepted` and 31 `duplicate`; the queue holds exactly one persistent message per id, keyed
/// by its event; one Redis key per id.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_keys_and_a_rabbitmq_destination_make_one_message_per_event_under_32_copies() {
    let Some(url) = broker_url() else { return };
    let Ok(redis_url) = std::env::var("HOOKLATCH_TEST_REDIS_URL") else {
        assert!(
            std::env::var_os("CI").is_none(),
            "CI is set but HOOKLATCH_TEST_REDIS_URL is not: the Redis tests must run"
        );
        println!("skipped: set HOOKLATCH_TEST_REDIS_URL to run the Redis × RabbitMQ storm");
        return;
    };
    let _broker_up = BROKER.read().await;
    let mut card = report::Card::new("T1", "redis+rabbitmq");
    let mut broker = TestBroker::connect(&url).await;
    let tag = unique("storm");
    let (exchange, queue) = (
        format!("hooklatch-e2e-x-{tag}"),
        format!("hooklatch-e2e-q-{tag}"),
    );
    broker.owns(&exchange, &queue);
    let prefix = format!("hooklatch-e2e:{tag}:");
    let mut options = options(
        &url,
        &format!(
            "exchange = \"{exchange}\"\nrouting_key = \"payment\"\ndeclare = true\nqueue = \"{queue}\""
        ),
    );
    options.extra_env.extend([
        ("HOOKLATCH_STORE__KEYS".to_owned(), redis_url.clone()),
        ("HOOKLATCH_STORE__KEY_PREFIX".to_owned(), prefix.clone()),
    ]);
    let handler = Handler::start(Behaviour::AlwaysOk).await;
    let gw = Gateway::start_with(&handler, options).await;

    let ids: Vec<String> = (0..report::scaled(300))
        .map(|i| format!("{tag}_{i:04}"))
        .collect();
    let (answers, retried) = support::storm(
        &[gw.ingest()],
        &ids,
        32,
        &[409, 503],
        200,
        Duration::from_millis(20),
        card.seed(),
    )
    .await;
    for id in &ids {
        let got = &answers[id];
        let accepted = got.iter().filter(|a| a.1 == "accepted").count();
        let duplicates = got.iter().filter(|a| a.1 == "duplicate").count();
        assert!(got.iter().all(|a| a.0 == 200), "{id}: {got:?}");
        assert_eq!((accepted, duplicates), (1, 31), "{id}: {got:?}");
    }
    eventually("every outbox row delivered", async || {
        gw.deliveries("state=pending").await.is_empty()
    })
    .await;
    let mut published = drain_message_ids(&mut broker, &queue).await;
    published.sort();
    let mut expected: Vec<String> = ids.iter().map(|id| format!("stripe:{id}")).collect();
    expected.sort();
    assert_eq!(published, expected, "one message per event, keyed by it");

    assert_eq!(
        support::delete_redis_keys(&redis_url, &prefix).await,
        ids.len(),
        "one Redis key per event"
    );
    card.count("ops", ids.len() * 32)
        .count("acked", ids.len())
        .count("duplicates", 0)
        .figure("retried", retried)
        .figure("messages", published.len());
    println!(
        "T1 redis+rabbitmq: ids={} copies=32 messages={} in_flight_or_503_retried={retried}",
        ids.len(),
        published.len()
    );
    drop(gw);
    broker.clean_up().await;
}

/// A full queue loses nothing: the gateway declares its quorum queue with `max_length = 3`
/// (so `x-overflow: reject-publish`, not RabbitMQ's default of dropping the oldest message
/// after confirming it), `delivery_limit = 5` and a dead-letter exchange (at-least-once, which
/// the broker accepts only with `reject-publish`: the declaration is checked by being made). Eight events: three fill the queue, the broker nacks the others'
/// publishes and the gateway retries them (recorded as "the broker nacked the message"); as
/// a consumer takes messages, the retries land. The consumer ends up with every event exactly
/// once, and the queue never held more than its limit and the one publish in flight.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_queue_refuses_publishes_which_are_retried_until_there_is_room() {
    let Some(url) = broker_url() else { return };
    let _broker_up = BROKER.read().await;
    let mut broker = TestBroker::connect(&url).await;
    let tag = unique("full");
    let (exchange, queue) = (
        format!("hooklatch-e2e-x-{tag}"),
        format!("hooklatch-e2e-q-{tag}"),
    );
    broker.owns(&exchange, &queue);
    let handler = Handler::start(Behaviour::AlwaysOk).await;
    let gw = Gateway::start_with(
        &handler,
        options_with_retries(
            &url,
            "max_attempts = 100\ninitial_backoff = \"100ms\"\nmax_backoff = \"300ms\"\njitter = 0.0\ntimeout = \"10s\"",
            &format!(
                "exchange = \"{exchange}\"\nrouting_key = \"payment\"\ndeclare = true\nqueue = \"{queue}\"\nquorum = true\nmax_length = 3\ndelivery_limit = 5\ndead_letter_exchange = \"{exchange}.dead\""
            ),
        ),
    )
    .await;
    let mut keys = Vec::new();
    for _ in 0..8 {
        keys.push(send_accepted(&gw, "evt_full_queue").await);
    }
    eventually(
        "the queue is full and publishes past it are refused",
        async || {
            let nacked = gw.deliveries("state=pending").await.iter().any(|d| {
                d["last_error"]
                    .as_str()
                    .is_some_and(|e| e.contains("nacked"))
            });
            nacked && broker.depth(&queue).await >= 3
        },
    )
    .await;

    // A consumer takes one message at a time; the retried publishes land as room is made.
    let mut taken = Vec::new();
    while taken.len() < keys.len() {
        // A quorum queue checks its limit as a publish arrives, so the one publish in flight
        // when the limit is reached still lands (the gateway publishes one at a time): 4.
        assert!(
            broker.depth(&queue).await <= 4,
            "the queue held more than its limit and the publish in flight"
        );
        let msg = broker
            .get_within(&queue, Duration::from_secs(30))
            .await
            .expect("the next message, once a retried publish lands");
        taken.push(message_id(&msg).unwrap_or_default());
    }
    taken.sort();
    keys.sort();
    assert_eq!(taken, keys, "every event exactly once");
    eventually("every outbox row delivered", async || {
        gw.deliveries("state=pending").await.is_empty()
    })
    .await;
    assert!(
        broker
            .get_within(&queue, Duration::from_secs(1))
            .await
            .is_none(),
        "no copy left in the queue"
    );
    drop(gw);
    broker.clean_up().await;
}

/// A gateway that dies after RabbitMQ confirmed a publish and before the attempt was
/// recorded (the crash point `worker_after_publish_before_record`, RELIABILITY.md T10):
/// started again, it publishes the row once more with the same `message_id`, so the event is
/// not lost and the extra copy is one a consumer that checks `message_id` drops.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_after_a_confirmed_publish_publishes_it_again_with_the_same_message_id() {
    let Some(url) = broker_url() else { return };
    let _broker_up = BROKER.read().await;
    let mut broker = TestBroker::connect(&url).await;
    let exchange = format!("hooklatch-e2e-x-{}", unique("crash"));
    let queue = format!("hooklatch-e2e-q-{}", unique("crash"));
    broker.owns(&exchange, &queue);
    let handler = Handler::start(Behaviour::AlwaysOk).await;
    let point = hooklatch_core::crash::WORKER_AFTER_PUBLISH_BEFORE_RECORD;
    let mut options = options(
        &url,
        &format!(
            "exchange = \"{exchange}\"\nrouting_key = \"payment.confirmed\"\ndeclare = true\nqueue = \"{queue}\""
        ),
    );
    options
        .extra_env
        .push(("FAILPOINTS".to_owned(), format!("{point}=return")));
    let mut gw = Gateway::start_with(&handler, options).await;

    let event = unique("evt");
    let key = format!("stripe:{event}");
    let body = stripe_invoice_paid(&event, 5000);
    let headers = stripe_headers(&body);
    // The publish follows the commit at once: the answer may or may not be written first.
    let _ = gw.ingest().try_post("stripe", &headers, body.clone()).await;
    let status = gw.wait_exit().await;
    assert!(!status.success(), "the process aborted: {status}");

    gw.reconfigure(|o| o.extra_env.retain(|(name, _)| name != "FAILPOINTS"));
    gw.restart().await;
    let (status, json) = gw.post("stripe", &headers, body.clone()).await;
    assert_eq!(
        (status, json["status"].as_str()),
        (200, Some("duplicate")),
        "{json}"
    );
    let row = gw.wait_for_delivery_state(&key, "delivered").await;
    assert_eq!(
        row["attempts"], 1,
        "the cut attempt was never recorded: {row:#}"
    );
    for copy in ["the publish the crash cut", "the publish after the restart"] {
        let msg = broker
            .get_within(&queue, Duration::from_secs(10))
            .await
            .unwrap_or_else(|| panic!("{copy} is in the queue"));
        assert_eq!(msg.delivery.data, body, "{copy}: the body, byte-exact");
        assert_eq!(message_id(&msg), Some(key.clone()), "{copy}");
    }
    assert!(
        broker
            .get_within(&queue, Duration::from_secs(1))
            .await
            .is_none(),
        "a third message"
    );
    report::Card::new("T10", "sqlite")
        .count("ops", 2)
        .count("acked", 1)
        .count("lost", 0)
        .count("duplicates", 1)
        .fault(point, 1);
    drop(gw);
    broker.clean_up().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unroutable_message_is_retried_then_dead_lettered_never_delivered_and_redrive_lands_it()
{
    let Some(url) = broker_url() else { return };
    let _broker_up = BROKER.read().await;
    let mut broker = TestBroker::connect(&url).await;
    let exchange = format!("hooklatch-e2e-unbound-{}", unique("x"));
    broker.exchange(&exchange).await;
    let handler = Handler::start(Behaviour::AlwaysOk).await;
    let gw = Gateway::start_with(
        &handler,
        options(
            &url,
            &format!("exchange = \"{exchange}\"\nrouting_key = \"payment.confirmed\""),
        ),
    )
    .await;

    let event = unique("evt");
    let body = stripe_invoice_paid(&event, 7000);
    let (status, json) = gw
        .post("stripe", &stripe_headers(&body), body.clone())
        .await;
    assert_eq!(status, 200, "{json}");
    let key = format!("stripe:{event}");
    let dead = gw.wait_for_delivery_state(&key, "dead").await;
    assert_eq!(dead["attempts"], 3, "{dead:#}");
    let listed = gw.deliveries("state=dead").await;
    let row = listed
        .iter()
        .find(|d| d["idempotency_key"] == key.as_str())
        .unwrap_or_else(|| panic!("not in the dead-letter: {listed:#?}"));
    let error = row["last_error"].as_str().unwrap_or("");
    assert!(
        error.contains("returned") && error.contains("unroutable"),
        "{row:#}"
    );
    assert!(!error.contains("guest:guest"), "{error}");
    // The broker's returns are logged in hooklatch's words only: its client library would log
    // each returned message whole, the event's body with it.
    let log = gw.log();
    assert!(log.contains("unroutable"), "{log}");
    assert!(!log.contains("BasicReturnMessage"), "{log}");
    assert!(gw.deliveries("state=delivered").await.is_empty());
    let metrics = gw.metrics().await;
    assert!(
        metrics.contains("hooklatch_amqp_returned_total{destination=\"mq\"} 3"),
        "{metrics}"
    );

    // Not lost: once a queue is bound, a redrive delivers it.
    let queue = format!("hooklatch-e2e-q-{}", unique("redrive"));
    broker
        .bound_queue(&queue, &exchange, "payment.confirmed")
        .await;
    let id = dead["id"].as_str().expect("a delivery id");
    let (status, json) = gw.admin_post(&format!("/v1/deliveries/{id}/retry")).await;
    assert_eq!(status, 202, "{json}");
    gw.wait_for_delivery_state(&key, "delivered").await;
    let msg = broker
        .get_within(&queue, Duration::from_secs(10))
        .await
        .expect("the redriven payment is in the queue");
    assert_eq!(msg.delivery.data, body);

    drop(gw);
    broker.clean_up().await;
}

/// A gateway whose `stripe` source publishes to the broker through a fault proxy, into an
/// exchange and queue of its own (dropped by `broker.clean_up()`).
struct Proxied {
    broker: TestBroker,
    queue: String,
    proxy: hooklatch_testkit::proxy::FaultProxy,
    gw: Gateway,
    handler: Handler,
}

impl Proxied {
    /// `tag` names the exchange and queue; `max_attempts` (a config line) and the attempt's
    /// `timeout` set the destination's retries (100 to 300 ms apart).
    async fn start(url: &str, tag: &str, max_attempts: &str, timeout: &str) -> Proxied {
        let mut broker = TestBroker::connect(url).await;
        let exchange = format!("hooklatch-e2e-x-{}", unique(tag));
        let queue = format!("hooklatch-e2e-q-{}", unique(tag));
        broker.owns(&exchange, &queue);
        let (proxy, through) = support::proxied(url, 5672).await;
        let handler = Handler::start(Behaviour::AlwaysOk).await;
        let gw = Gateway::start_with(
            &handler,
            options_with_retries(
                &through,
                &format!("{max_attempts}\ninitial_backoff = \"100ms\"\nmax_backoff = \"300ms\"\njitter = 0.0\ntimeout = \"{timeout}\""),
                &format!(
                    "exchange = \"{exchange}\"\nrouting_key = \"payment.confirmed\"\ndeclare = true\nqueue = \"{queue}\""
                ),
            ),
        )
        .await;
        Proxied {
            broker,
            queue,
            proxy,
            gw,
            handler,
        }
    }
}

/// Sends a new signed Stripe event, asserts it was accepted, and returns its key.
async fn send_accepted(gw: &Gateway, prefix: &str) -> String {
    let event = unique(prefix);
    let body = stripe_invoice_paid(&event, 5000);
    let (status, json) = gw.post("stripe", &stripe_headers(&body), body).await;
    assert_eq!(
        (status, json["status"].as_str()),
        (200, Some("accepted")),
        "{json}"
    );
    format!("stripe:{event}")
}

/// Takes every message from `queue` (until none comes for 2 s); their `message_id`s in order.
async fn drain_message_ids(broker: &mut TestBroker, queue: &str) -> Vec<String> {
    let mut ids = Vec::new();
    while let Some(msg) = broker.get_within(queue, Duration::from_secs(2)).await {
        ids.push(message_id(&msg).unwrap_or_default());
    }
    ids
}

/// A broker that stops answering (the fault proxy stalls every byte): publishes get no confirm
/// within the destination's timeout and are retried, recorded as failures, never as delivered;
/// once the broker answers again the publisher connects anew and the event lands, once, keyed
/// by its event. With no close at all (Toxiproxy's `timeout` without a limit), or with every
/// connection closed after 2 s of silence (`timeout` with a limit: the publisher's connection
/// ends under it, and each new one it opens hears nothing and is closed in turn).
async fn broker_silent(
    fault: &str,
    closes: bool,
    silence: impl FnOnce(&hooklatch_testkit::proxy::FaultProxy),
) {
    let Some(url) = broker_url() else { return };
    let _broker_up = BROKER.read().await;
    let Proxied {
        mut broker,
        queue,
        proxy,
        gw,
        handler: _handler,
    } = Proxied::start(&url, fault, "max_attempts = 50", "1s").await;
    let send = async |prefix: &str| send_accepted(&gw, prefix).await;
    let before = send(&format!("evt_before_{fault}")).await;
    gw.wait_for_delivery_state(&before, "delivered").await;

    let connections = proxy.accepted();
    silence(&proxy);
    let during = send(&format!("evt_during_{fault}")).await;
    if closes {
        // The silent connection is closed under the publisher, which opens another into the
        // silence.
        eventually("a new connection after the close", async || {
            proxy.accepted() > connections
        })
        .await;
    }
    eventually("a failed attempt recorded while silent", async || {
        gw.deliveries_for(&during).await.first().is_some_and(|row| {
            row["attempts"].as_u64().unwrap_or(0) >= 1 && !row["last_error"].is_null()
        })
    })
    .await;
    let failed = gw.deliveries_for(&during).await[0].clone();
    assert_eq!(failed["state"], "pending", "{failed:#}");
    let error = failed["last_error"].as_str().unwrap_or_default().to_owned();
    assert!(!error.is_empty(), "{failed:#}");

    proxy.up();
    let row = gw.wait_for_delivery_state(&during, "delivered").await;
    let attempts = row["attempts"].as_u64().unwrap_or(0);
    assert!(
        attempts >= 2,
        "failed while silent, then delivered: {row:#}"
    );
    let keys = drain_message_ids(&mut broker, &queue).await;
    assert_eq!(
        keys,
        [before, during],
        "each event once, in order, keyed by its event"
    );
    println!("figure: {fault}: a silent publish's error: {error}; {attempts} attempts in all, {} connections", proxy.accepted());
    drop(gw);
    drop(proxy);
    broker.clean_up().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broker_that_stops_answering_is_retried_until_it_answers_and_the_event_lands_once() {
    broker_silent("stall", false, |proxy| proxy.stall()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broker_silent_then_cut_off_is_retried_until_it_answers_and_the_event_lands_once() {
    broker_silent("timeout", true, |proxy| {
        proxy.timeout(Duration::from_secs(2))
    })
    .await;
}

/// The broker's connection reset by the network in the middle of a burst, then the link made
/// slow (RELIABILITY.md T10, Toxiproxy's `reset_peer`, `latency` and `slicer`): every event
/// lands in the queue keyed by its event; the reset may repeat only the publishes it left
/// unconfirmed, at most one per delivery in flight, and the slow links repeat none.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reset_broker_connection_and_a_slow_link_lose_no_event() {
    let Some(url) = broker_url() else { return };
    let _broker_up = BROKER.read().await;
    let Proxied {
        mut broker,
        queue,
        proxy,
        gw,
        handler: _handler,
    } = Proxied::start(&url, "reset", "max_attempts = 100", "5s").await;
    let events = report::scaled(200);
    let send = async |prefix: &str| send_accepted(&gw, prefix).await;
    let wait_delivered = async |keys: &[String]| {
        for key in keys {
            gw.wait_for_delivery_state(key, "delivered").await;
        }
    };

    // Reset while the first half is being published; the second half comes while it is.
    let mut reset_keys = Vec::new();
    for _ in 0..events / 2 {
        reset_keys.push(send("evt_reset").await);
    }
    proxy.reset_peer();
    for _ in events / 2..events {
        reset_keys.push(send("evt_reset").await);
    }
    let retried = "hooklatch_delivery_attempts_total{destination=\"mq\",outcome=\"retry\"}";
    eventually("an attempt failed by the reset", async || {
        gw.metric(retried).await >= 1.0
    })
    .await;
    proxy.up();
    wait_delivered(&reset_keys).await;

    // A slow link: every chunk 50 ms late, each way; then every chunk in 64-byte slices with
    // 1 ms after each (a publish and its confirm arrive in pieces).
    proxy.set_latency(Duration::from_millis(50));
    let mut slow_keys = Vec::new();
    for _ in 0..report::scaled(20) {
        slow_keys.push(send("evt_slow").await);
    }
    wait_delivered(&slow_keys).await;
    proxy.set_latency(Duration::ZERO);
    proxy.set_slicer(64, Duration::from_millis(1));
    let mut sliced_keys = Vec::new();
    for _ in 0..report::scaled(20) {
        sliced_keys.push(send("evt_sliced").await);
    }
    wait_delivered(&sliced_keys).await;
    proxy.set_slicer(0, Duration::ZERO);
    slow_keys.extend(sliced_keys);

    let mut copies = std::collections::HashMap::<String, usize>::new();
    for key in drain_message_ids(&mut broker, &queue).await {
        *copies.entry(key).or_default() += 1;
    }
    let lost: Vec<&String> = reset_keys
        .iter()
        .chain(&slow_keys)
        .filter(|k| !copies.contains_key(*k))
        .collect();
    assert!(lost.is_empty(), "not in the queue: {lost:?}");
    let extra = |keys: &[String]| keys.iter().map(|k| copies[k] - 1).sum::<usize>();
    let (reset_extra, slow_extra) = (extra(&reset_keys), extra(&slow_keys));
    // `delivery.concurrency` in the test config: the most publishes one reset can cut.
    assert!(
        reset_extra <= 16,
        "{reset_extra} extra copies after one reset"
    );
    assert_eq!(slow_extra, 0, "the slow link repeated a publish");
    assert_eq!(
        copies.len(),
        reset_keys.len() + slow_keys.len(),
        "only these events"
    );
    report::Card::new("T10", "sqlite")
        .count("ops", reset_keys.len() + slow_keys.len())
        .count("acked", reset_keys.len() + slow_keys.len())
        .count("lost", 0)
        .count("duplicates", reset_extra)
        .fault("reset_peer", 1)
        .fault("latency", 1)
        .fault("slicer", 1)
        .figure("proxied_connections", proxy.accepted() as u64);
    drop(gw);
    drop(proxy);
    broker.clean_up().await;
}

/// `amqps://` end to end: a real `hooklatch serve` whose RabbitMQ destination speaks TLS (to
/// a TLS-terminating proxy in front of the real broker, its certificate from a private CA
/// given by `ca_file`) publishes an accepted event once, keyed by its event. Without the
/// CA the same gateway cannot trust the broker: every attempt fails on the certificate
/// (recorded as the delivery's error, no password in it), the event is dead-lettered, not
/// lost, and nothing — no credentials, no message — reached the broker in plain text.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_amqps_destination_publishes_over_tls_and_an_untrusted_broker_gets_nothing() {
    let Some(url) = broker_url() else { return };
    let _broker_up = BROKER.read().await;
    let mut broker = TestBroker::connect(&url).await;
    let exchange = format!("hooklatch-e2e-x-{}", unique("tls"));
    let queue = format!("hooklatch-e2e-q-{}", unique("tls"));
    broker.owns(&exchange, &queue);
    let (ca, tls, amqps) = support::behind_tls(&url, 5672, "amqps").await;
    let dir = tempfile::tempdir().expect("a temp dir");
    let ca_file = dir.path().join("rabbit-ca.pem");
    std::fs::write(&ca_file, ca.pem()).expect("writing the CA");
    let settings = format!(
        "exchange = \"{exchange}\"\nrouting_key = \"payment.confirmed\"\ndeclare = true\nqueue = \"{queue}\""
    );

    let handler = Handler::start(Behaviour::AlwaysOk).await;
    let gw = Gateway::start_with(
        &handler,
        options(
            &amqps,
            &format!("{settings}\nca_file = \"{}\"", ca_file.display()),
        ),
    )
    .await;
    let key = send_accepted(&gw, "evt_tls").await;
    gw.wait_for_delivery_state(&key, "delivered").await;
    let msg = broker
        .get_within(&queue, Duration::from_secs(10))
        .await
        .expect("the payment is in the queue");
    assert_eq!(message_id(&msg), Some(key.clone()));
    assert!(tls.handshakes() >= 1 && tls.upstream_connections() >= 1);
    drop(gw);

    let refused_before = tls.refused();
    let upstream_before = tls.upstream_connections();
    let gw = Gateway::start_with(&handler, options(&amqps, &settings)).await;
    let key = send_accepted(&gw, "evt_untrusted").await;
    let dead = gw.wait_for_delivery_state(&key, "dead").await;
    assert_eq!(dead["attempts"], 3, "{dead:#}");
    let listed = gw.deliveries("state=dead").await;
    let row = listed
        .iter()
        .find(|d| d["idempotency_key"] == key.as_str())
        .unwrap_or_else(|| panic!("not in the dead-letter: {listed:#?}"));
    let error = row["last_error"].as_str().unwrap_or("");
    assert!(error.contains("invalid peer certificate"), "{row:#}");
    assert!(!error.contains("guest:guest"), "{error}");
    // It names the broker it tried, its password masked.
    assert!(error.contains("amqps://guest:***@"), "{error}");
    assert!(
        tls.refused_at_least(refused_before + 1, Duration::from_secs(10))
            .await
            > refused_before
    );
    assert_eq!(tls.upstream_connections(), upstream_before);
    assert!(broker
        .get_within(&queue, Duration::from_millis(500))
        .await
        .is_none());

    drop(gw);
    broker.clean_up().await;
}

// ---------------------------------------------------------------------------------------------
// Payment → ticket: the gateway, RabbitMQ and the example consumer, with PostgreSQL

/// The invoice `stripe_invoice_paid` pays: the consumer's order id (`data.object.id`).
const ORDER_ID: &str = "in_1QRn2bLkdIwHu7ix0Gkq5ZxY";

/// The PostgreSQL admin URL, or `None` (after printing why) when the tests should skip.
fn postgres_url() -> Option<String> {
    match std::env::var("HOOKLATCH_TEST_POSTGRES_URL") {
        Ok(url) if !url.is_empty() => Some(url),
        _ => {
            assert!(
                std::env::var_os("CI").is_none(),
                "HOOKLATCH_TEST_POSTGRES_URL must be set under CI (a PostgreSQL server for the tests)"
            );
            eprintln!("skipped: set HOOKLATCH_TEST_POSTGRES_URL");
            None
        }
    }
}

/// The example consumer's tickets, read from the test's database.
impl TestDb {
    /// `SELECT count(*) FROM tickets`.
    async fn tickets(&self) -> i64 {
        let mut conn = sqlx::PgConnection::connect(&self.url())
            .await
            .expect("connecting to the test database");
        let n = sqlx::query_scalar("SELECT count(*) FROM tickets")
            .fetch_one(&mut conn)
            .await
            .expect("counting tickets");
        let _ = conn.close().await;
        n
    }

    /// `SELECT count(DISTINCT idempotency_key) FROM tickets` (0 before the table exists).
    async fn distinct_ticket_keys(&self) -> i64 {
        let mut conn = sqlx::PgConnection::connect(&self.url())
            .await
            .expect("connecting to the test database");
        let n = sqlx::query_scalar("SELECT count(DISTINCT idempotency_key) FROM tickets")
            .fetch_one(&mut conn)
            .await
            .unwrap_or(0);
        let _ = conn.close().await;
        n
    }

    /// The tickets' `(order_id, idempotency_key)`.
    async fn ticket_rows(&self) -> Vec<(String, String)> {
        let mut conn = sqlx::PgConnection::connect(&self.url())
            .await
            .expect("connecting to the test database");
        let rows = sqlx::query_as("SELECT order_id, idempotency_key FROM tickets")
            .fetch_all(&mut conn)
            .await
            .expect("reading tickets");
        let _ = conn.close().await;
        rows
    }
}

/// The example consumer's binary, built once per test run into this run's target dir and
/// profile (found from the `hooklatch` binary's path), like the replay tests' credit service.
fn ticket_consumer_bin() -> &'static Path {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    BIN.get_or_init(|| example_bin::build("hooklatch-example-ticket-consumer", "ticket-consumer"))
}

/// A running `ticket-consumer`; its stdout lines are collected as they come. Killed on drop.
struct Consumer {
    child: Child,
    lines: Arc<Mutex<Vec<String>>>,
    stderr: Arc<Mutex<String>>,
}

impl Consumer {
    async fn start(amqp: &str, queue: &str, db: &str, exit_after_commit: bool) -> Consumer {
        let bin = tokio::task::spawn_blocking(ticket_consumer_bin)
            .await
            .expect("the build thread");
        let mut command = Command::new(bin);
        command
            .args(["--amqp", amqp, "--queue", queue, "--db", db])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        if exit_after_commit {
            command.arg("--exit-after-commit");
        }
        let mut child = command.spawn().expect("starting ticket-consumer");
        let lines = Arc::new(Mutex::new(Vec::new()));
        let stdout = child.stdout.take().expect("piped stdout");
        let sink = Arc::clone(&lines);
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                sink.lock().unwrap().push(line);
            }
        });
        let stderr = Arc::new(Mutex::new(String::new()));
        let mut err_pipe = child.stderr.take().expect("piped stderr");
        let err_sink = Arc::clone(&stderr);
        std::thread::spawn(move || {
            let mut buf = [0u8; 4096];
            while let Ok(n @ 1..) = err_pipe.read(&mut buf) {
                err_sink
                    .lock()
                    .unwrap()
                    .push_str(&String::from_utf8_lossy(&buf[..n]));
            }
        });
        Consumer {
            child,
            lines,
            stderr,
        }
    }

    fn lines(&self) -> Vec<String> {
        self.lines.lock().unwrap().clone()
    }

    /// How many times `needle` occurs in stderr so far.
    fn stderr_count(&self, needle: &str) -> usize {
        self.stderr.lock().unwrap().matches(needle).count()
    }

    /// Stdout and stderr so far, for assertion messages.
    fn output(&self) -> String {
        format!(
            "stdout:\n{}\nstderr:\n{}",
            self.lines().join("\n"),
            self.stderr.lock().unwrap()
        )
    }

    /// Waits until stdout has a line `pred` accepts; fails early if the process exits.
    async fn wait_for_line(&mut self, what: &str, pred: impl Fn(&str) -> bool) {
        let started = Instant::now();
        while !self.lines().iter().any(|l| pred(l)) {
            if let Some(status) = self.child.try_wait().expect("polling the consumer") {
                // The reader thread may still be draining stdout.
                if !self.lines().iter().any(|l| pred(l)) {
                    panic!(
                        "ticket-consumer exited ({status}) before {what}\n{}",
                        self.output()
                    );
                }
                break;
            }
            assert!(
                started.elapsed() < DEADLINE,
                "timed out waiting for {what}\n{}",
                self.output()
            );
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
    }

    /// Waits for the process to exit on its own.
    async fn wait_exit(&mut self) -> ExitStatus {
        let started = Instant::now();
        loop {
            if let Some(status) = self.child.try_wait().expect("polling the consumer") {
                return status;
            }
            assert!(
                started.elapsed() < DEADLINE,
                "ticket-consumer did not exit\n{}",
                self.output()
            );
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
    }

    fn stop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Consumer {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Starts a gateway whose AMQP destination declares `exchange` and a durable `queue` bound to
/// it with `payment.confirmed`.
/// The payment → ticket flow of one test: its own database, exchange and queue, and a gateway
/// publishing Stripe payments to them.
struct TicketFlow {
    url: String,
    db: TestDb,
    broker: TestBroker,
    queue: String,
    _handler: Handler,
    gw: Gateway,
}

impl TicketFlow {
    async fn start(url: &str, pg: &str, name: &str) -> TicketFlow {
        let db = TestDb::create_on(pg, &unique("hooklatch_tickets")).await;
        let mut broker = TestBroker::connect(url).await;
        let exchange = format!("hooklatch-e2e-x-{}", unique(name));
        let queue = format!("hooklatch-e2e-q-{}", unique(name));
        broker.owns(&exchange, &queue);
        let handler = Handler::start(Behaviour::AlwaysOk).await;
        let gw = Gateway::start_with(
            &handler,
            options(
                url,
                &format!(
                    "exchange = \"{exchange}\"\nrouting_key = \"payment.confirmed\"\ndeclare = true\nqueue = \"{queue}\""
                ),
            ),
        )
        .await;
        TicketFlow {
            url: url.to_owned(),
            db,
            broker,
            queue,
            _handler: handler,
            gw,
        }
    }

    async fn consumer(&self, exit_after_commit: bool) -> Consumer {
        Consumer::start(&self.url, &self.queue, &self.db.url(), exit_after_commit).await
    }

    /// Exactly one ticket, for `key`, and nothing left unacked in the queue; then cleans up.
    async fn finish_with_one_ticket(self, key: &str) {
        assert_eq!(self.db.tickets().await, 1, "exactly one ticket");
        assert_eq!(
            self.db.ticket_rows().await,
            vec![(ORDER_ID.to_owned(), key.to_owned())]
        );
        // A stopped consumer's unacked message would be back in the queue.
        assert!(
            self.broker
                .get_within(&self.queue, Duration::from_secs(1))
                .await
                .is_none(),
            "a message left in the queue after the consumer acked"
        );
        drop(self.gw);
        self.broker.clean_up().await;
        self.db.drop_now().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_payment_sent_42_times_issues_one_ticket_through_rabbitmq_and_the_guard() {
    let Some(url) = broker_url() else { return };
    let _broker_up = BROKER.read().await;
    let Some(pg) = postgres_url() else { return };
    let flow = TicketFlow::start(&url, &pg, "ticket").await;
    let gw = &flow.gw;

    // 10 sequential + 32 concurrent copies of one payment.
    let event = unique("evt");
    let body = stripe_invoice_paid(&event, 4200);
    for _ in 0..10 {
        let (status, json) = gw
            .post("stripe", &stripe_headers(&body), body.clone())
            .await;
        assert_eq!(status, 200, "{json}");
    }
    let mut senders = tokio::task::JoinSet::new();
    for _ in 0..32 {
        let ingest = gw.ingest();
        let body = body.clone();
        senders.spawn(async move { ingest.post("stripe", &stripe_headers(&body), body).await });
    }
    while let Some(sent) = senders.join_next().await {
        let (status, json) = sent.expect("a sender task");
        assert_eq!(status, 200, "{json}");
    }
    let key = format!("stripe:{event}");
    gw.wait_for_delivery_state(&key, "delivered").await;

    let mut consumer = flow.consumer(false).await;
    consumer
        .wait_for_line("the payment consumed", |l| l.starts_with("new "))
        .await;
    consumer.stop();
    assert_eq!(
        consumer.lines(),
        vec![format!("new {key}")],
        "exactly one message, consumed as new\n{}",
        consumer.output()
    );
    drop(consumer);
    flow.finish_with_one_ticket(&key).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumer_killed_between_the_ticket_and_the_ack_gets_a_redelivery_and_issues_no_second_ticket(
) {
    let Some(url) = broker_url() else { return };
    let _broker_up = BROKER.read().await;
    let Some(pg) = postgres_url() else { return };
    let flow = TicketFlow::start(&url, &pg, "crash").await;
    let gw = &flow.gw;

    let event = unique("evt");
    let body = stripe_invoice_paid(&event, 4200);
    let (status, json) = gw
        .post("stripe", &stripe_headers(&body), body.clone())
        .await;
    assert_eq!(status, 200, "{json}");
    let key = format!("stripe:{event}");
    gw.wait_for_delivery_state(&key, "delivered").await;

    // The work commits, then the process exits before the ack.
    let mut crashing = flow.consumer(true).await;
    let status = crashing.wait_exit().await;
    assert_eq!(status.code(), Some(3), "{}", crashing.output());
    wait_until("the crashed consumer's stdout is read", || {
        !crashing.lines().is_empty()
    })
    .await;
    assert_eq!(
        crashing.lines(),
        vec![format!("new {key}")],
        "{}",
        crashing.output()
    );
    assert_eq!(
        flow.db.tickets().await,
        1,
        "the ticket committed before the crash"
    );

    // The broker redelivers the unacked message; the guard finds the key: acked, no ticket.
    let mut consumer = flow.consumer(false).await;
    consumer
        .wait_for_line("the redelivered message handled", |_| true)
        .await;
    consumer.stop();
    assert_eq!(
        consumer.lines(),
        vec![format!("duplicate {key} redelivered")],
        "{}",
        consumer.output()
    );
    drop(consumer);
    flow.finish_with_one_ticket(&key).await;
}

// ---------------------------------------------------------------------------------------------
// A broker restart in the middle of a burst

/// `rabbitmqctl`, controlling the node behind `HOOKLATCH_TEST_AMQP_URL`; the command is
/// `HOOKLATCH_TEST_RABBITMQCTL` when set (e.g. `docker exec rabbitmq rabbitmqctl`).
#[derive(Clone)]
struct Rabbitmqctl(Vec<String>);

impl Rabbitmqctl {
    /// The command, or `None` (after printing why) when the test should skip: it is missing or
    /// cannot reach the node.
    fn find() -> Option<Rabbitmqctl> {
        let command = std::env::var("HOOKLATCH_TEST_RABBITMQCTL")
            .ok()
            .filter(|c| !c.trim().is_empty())
            .unwrap_or_else(|| "rabbitmqctl".to_owned());
        let ctl = Rabbitmqctl(command.split_whitespace().map(str::to_owned).collect());
        match ctl.run(&["status"]) {
            Ok(_) => Some(ctl),
            Err(why) => {
                assert!(
                    std::env::var_os("CI").is_none(),
                    "rabbitmqctl is needed under CI (set HOOKLATCH_TEST_RABBITMQCTL): {why}"
                );
                eprintln!("skipped: rabbitmqctl is not usable: {why}");
                None
            }
        }
    }

    /// Runs `rabbitmqctl args…`; its stdout, or why it failed.
    fn run(&self, args: &[&str]) -> Result<String, String> {
        let (program, pre) = self.0.split_first().expect("a command");
        let out = Command::new(program)
            .args(pre)
            .args(args)
            .stdin(Stdio::null())
            .output()
            .map_err(|e| format!("running {program}: {e}"))?;
        if out.status.success() {
            Ok(String::from_utf8_lossy(&out.stdout).into_owned())
        } else {
            Err(format!(
                "{program} {}: {}\n{}{}",
                args.join(" "),
                out.status,
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            ))
        }
    }

    /// [`Self::run`] on a blocking thread.
    async fn run_async(&self, args: &'static [&'static str]) -> Result<String, String> {
        let ctl = self.clone();
        tokio::task::spawn_blocking(move || ctl.run(args))
            .await
            .expect("the rabbitmqctl thread")
    }

    /// The messages in `queue`, ready and unacked.
    async fn messages_in(&self, queue: &str) -> u64 {
        let out = self
            .run_async(&[
                "list_queues",
                "--quiet",
                "--no-table-headers",
                "name",
                "messages",
            ])
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        out.lines()
            .filter_map(|line| {
                let mut cols = line.split_whitespace();
                (cols.next() == Some(queue)).then(|| cols.next()?.parse().ok())?
            })
            .next()
            .unwrap_or_else(|| panic!("queue {queue} not listed:\n{out}"))
    }
}

/// Starts the broker's application again when dropped unless [`Self::started`]: a test that
/// fails between `stop_app` and `start_app` must not leave the machine without a broker.
struct StoppedBroker {
    ctl: Rabbitmqctl,
    stopped: bool,
}

impl StoppedBroker {
    /// `rabbitmqctl stop_app`: the node stays up, its AMQP listener and every connection close.
    async fn stop(ctl: &Rabbitmqctl) -> StoppedBroker {
        // Armed before the command: a stop that half happened is undone as well.
        let guard = StoppedBroker {
            ctl: ctl.clone(),
            stopped: true,
        };
        ctl.run_async(&["stop_app"])
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        guard
    }

    /// `rabbitmqctl start_app`, then waits until the broker has booted.
    async fn start(mut self) {
        self.ctl
            .run_async(&["start_app"])
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        self.ctl
            .run_async(&["await_startup"])
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        self.stopped = false;
    }
}

impl Drop for StoppedBroker {
    fn drop(&mut self) {
        if self.stopped {
            if let Err(e) = self.ctl.run(&["start_app"]) {
                eprintln!("could not start the broker again: {e}");
            }
        }
    }
}

/// Where the burst is relative to the restart.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Phase {
    Up,
    Stopped,
    Restarted,
}

/// Sends one event as a provider would: again (freshly signed) after any non-2xx answer or
/// transport error, until accepted. Returns how many sends were refused.
async fn send_until_accepted(ingest: &support::Ingest, body: &[u8]) -> u32 {
    let started = Instant::now();
    let mut refused = 0;
    loop {
        match ingest
            .try_post("stripe", &stripe_headers(body), body.to_vec())
            .await
        {
            Ok((status, _)) if (200..300).contains(&status) => return refused,
            Ok((status, json)) => eprintln!("refused ({status}), sending again: {json}"),
            Err(err) => eprintln!("not sent ({err}), sending again"),
        }
        refused += 1;
        assert!(
            started.elapsed() < Duration::from_secs(120),
            "an event was never accepted"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broker_restarted_during_a_burst_of_1000_events_loses_none_and_the_guard_keeps_each_effect_once(
) {
    let Some(url) = broker_url() else { return };
    let Some(pg) = postgres_url() else { return };
    let Some(ctl) = Rabbitmqctl::find() else {
        return;
    };
    // Alone on the broker: the other tests of this binary wait, and do not see the restart.
    let _restarting = BROKER.write().await;
    let db = TestDb::create_on(&pg, &unique("hooklatch_tickets")).await;
    let exchange = format!("hooklatch-e2e-x-{}", unique("restart"));
    let queue = format!("hooklatch-e2e-q-{}", unique("restart"));
    // A failure is caught, so that the clean-up runs then too.
    let outcome = CatchUnwind(Box::pin(restart_during_burst(
        &url, &ctl, &db, &exchange, &queue,
    )))
    .await;
    let mut broker = TestBroker::connect(&url).await;
    broker.owns(&exchange, &queue);
    broker.clean_up().await;
    db.drop_now().await;
    if let Err(panic) = outcome {
        std::panic::resume_unwind(panic);
    }
}

/// A future's panic as an `Err`, for a clean-up that must run after a failed test.
struct CatchUnwind<F>(std::pin::Pin<Box<F>>);

impl<F: std::future::Future> std::future::Future for CatchUnwind<F> {
    type Output = std::thread::Result<F::Output>;

    fn poll(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Self::Output> {
        let inner = self.0.as_mut();
        match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| inner.poll(cx))) {
            Ok(std::task::Poll::Pending) => std::task::Poll::Pending,
            Ok(std::task::Poll::Ready(out)) => std::task::Poll::Ready(Ok(out)),
            Err(panic) => std::task::Poll::Ready(Err(panic)),
        }
    }
}

/// The burst, the restart, the wait and the checks of
/// [`a_broker_restarted_during_a_burst_of_1000_events_loses_none_and_the_guard_keeps_each_effect_once`].
async fn restart_during_burst(
    url: &str,
    ctl: &Rabbitmqctl,
    db: &TestDb,
    exchange: &str,
    queue: &str,
) {
    const EVENTS: usize = 1000;
    const SENDERS: usize = 16;
    // Retried for as long as the restart takes: nothing may be dead-lettered by it.
    let retries = "max_attempts = 1000\ninitial_backoff = \"100ms\"\nmax_backoff = \"1s\"\njitter = 0.0\ntimeout = \"5s\"";
    let handler = Handler::start(Behaviour::AlwaysOk).await;
    let gw = Gateway::start_with(
        &handler,
        options_with_retries(
            url,
            retries,
            &format!(
                "exchange = \"{exchange}\"\nrouting_key = \"payment.confirmed\"\ndeclare = true\nqueue = \"{queue}\"\nquorum = true"
            ),
        ),
    )
    .await;
    // The gateway declares the quorum queue on its first publish; one event before the burst.
    let bodies: Vec<Vec<u8>> = (0..EVENTS)
        .map(|i| {
            let body = stripe_invoice_paid(&unique(&format!("evt_burst{i:04}")), 1000 + i as u64);
            String::from_utf8(body)
                .expect("a UTF-8 event")
                .replace(ORDER_ID, &format!("in_burst_{i:04}"))
                .into_bytes()
        })
        .collect();
    let mut refused = send_until_accepted(&gw.ingest(), &bodies[0]).await;
    let first_key = format!(
        "stripe:{}",
        serde_json::from_slice::<serde_json::Value>(&bodies[0]).unwrap()["id"]
            .as_str()
            .unwrap()
    );
    gw.wait_for_delivery_state(&first_key, "delivered").await;
    let mut consumer = Consumer::start(url, queue, &db.url(), false).await;

    // The rest of the burst from 16 senders: up to #500 while the broker is up (it stops once
    // 300 are accepted), #500–#799 while it is stopped, the rest after it is back.
    let (phase_tx, phase_rx) = tokio::sync::watch::channel(Phase::Up);
    let next = Arc::new(std::sync::atomic::AtomicUsize::new(1));
    let accepted = Arc::new(std::sync::atomic::AtomicUsize::new(1));
    let bodies = Arc::new(bodies);
    let mut senders = tokio::task::JoinSet::new();
    for _ in 0..SENDERS {
        let (ingest, next, accepted, bodies) = (
            gw.ingest(),
            Arc::clone(&next),
            Arc::clone(&accepted),
            Arc::clone(&bodies),
        );
        let mut phase = phase_rx.clone();
        senders.spawn(async move {
            let mut refused = 0;
            loop {
                let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                if i >= EVENTS {
                    return refused;
                }
                let due = match i {
                    0..500 => Phase::Up,
                    500..800 => Phase::Stopped,
                    _ => Phase::Restarted,
                };
                phase
                    .wait_for(|p| *p >= due)
                    .await
                    .expect("the restart is running");
                refused += send_until_accepted(&ingest, &bodies[i]).await;
                accepted.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            }
        });
    }
    let restart = async {
        wait_until_within("300 events are accepted", Duration::from_secs(120), || {
            accepted.load(std::sync::atomic::Ordering::Relaxed) >= 300
        })
        .await;
        let before = accepted.load(std::sync::atomic::Ordering::Relaxed);
        let stopped = StoppedBroker::stop(ctl).await;
        phase_tx.send_replace(Phase::Stopped);
        let at_stop = accepted.load(std::sync::atomic::Ordering::Relaxed);
        // The outage: the gateway keeps accepting, its publishes fail and are retried.
        tokio::time::sleep(Duration::from_secs(3)).await;
        stopped.start().await;
        phase_tx.send_replace(Phase::Restarted);
        (before, at_stop, Instant::now())
    };
    let send_all = async {
        let mut refused = 0;
        while let Some(sent) = senders.join_next().await {
            refused += sent.expect("a sender task");
        }
        refused
    };
    let ((before_stop, at_stop, restarted_at), sender_refusals) = tokio::join!(restart, send_all);
    refused += sender_refusals;
    let acked: std::collections::HashSet<String> = bodies
        .iter()
        .map(|b| {
            let event: serde_json::Value = serde_json::from_slice(b).unwrap();
            format!("stripe:{}", event["id"].as_str().unwrap())
        })
        .collect();
    assert_eq!(acked.len(), EVENTS, "distinct events");

    // Bounded wait: every row delivered (confirmed), the queue empty (every message consumed
    // and acked, so every ticket committed) and the consumer's output settled.
    let started = Instant::now();
    let mut last_lines = usize::MAX;
    loop {
        let delivered = gw.deliveries("state=delivered").await.len();
        let tickets = db.distinct_ticket_keys().await;
        let left = ctl.messages_in(queue).await;
        let lines = consumer.lines().len();
        if delivered == EVENTS && left == 0 && lines == last_lines {
            break;
        }
        last_lines = lines;
        assert!(
            started.elapsed() < Duration::from_secs(180),
            "timed out: {delivered}/{EVENTS} delivered, {tickets} tickets, {left} messages in \
             the queue\ndead: {:#?}\nconsumer:\n{}\ngateway log:\n{}",
            gw.deliveries("state=dead").await,
            consumer.output(),
            gw.log_tail(40)
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let drained_after = restarted_at.elapsed();
    consumer.stop();

    // Each effect once: one ticket per event, for its own order, and nothing else.
    let rows = db.ticket_rows().await;
    let mut per_key: std::collections::HashMap<&str, usize> = std::collections::HashMap::new();
    for (_, key) in &rows {
        *per_key.entry(key.as_str()).or_default() += 1;
    }
    let doubled: Vec<_> = per_key.iter().filter(|(_, n)| **n > 1).collect();
    assert!(doubled.is_empty(), "effects applied twice: {doubled:?}");
    let stray: Vec<_> = per_key.keys().filter(|k| !acked.contains(**k)).collect();
    assert!(stray.is_empty(), "tickets for unknown events: {stray:?}");
    let missing: Vec<_> = acked
        .iter()
        .filter(|k| !per_key.contains_key(k.as_str()))
        .collect();
    assert!(missing.is_empty(), "acked, never published: {missing:?}");
    let orders: std::collections::HashSet<&str> = rows.iter().map(|(o, _)| o.as_str()).collect();
    assert_eq!(orders.len(), EVENTS, "one ticket per order");
    assert!(gw.deliveries("state=dead").await.is_empty());

    // What the consumer saw: every message it handled has a line; an ack lost with the
    // connection leaves no line, and its redelivery is a duplicate.
    let lines = consumer.lines();
    let consumed_keys: std::collections::HashSet<&str> = lines
        .iter()
        .filter_map(|l| l.split_whitespace().nth(1))
        .collect();
    assert!(
        consumed_keys.iter().all(|k| acked.contains(*k)),
        "{}",
        consumer.output()
    );
    let new = lines.iter().filter(|l| l.starts_with("new ")).count();
    let duplicates = lines.iter().filter(|l| l.starts_with("duplicate ")).count();
    let redelivered = lines.iter().filter(|l| l.ends_with(" redelivered")).count();
    let lost_acks = consumer.stderr_count("acknowledging the message");
    let reconnects = consumer.stderr_count("reconnecting in");
    let rows = gw.deliveries("").await;
    let attempts: u64 = rows
        .iter()
        .map(|r| r["attempts"].as_u64().unwrap_or(0))
        .sum();
    let retried = rows
        .iter()
        .filter(|r| r["attempts"].as_u64().unwrap_or(0) > 1)
        .count();
    println!(
        "broker restart during a burst: {EVENTS} events acked ({refused} sends refused and \
         sent again), {before_stop} accepted when stop_app began and {at_stop} when it \
         returned; gateway: {} rows delivered in {attempts} publish attempts ({retried} rows \
         retried); consumer: {} messages ({new} new, {duplicates} duplicates absorbed by the \
         guard, {redelivered} flagged redelivered, {lost_acks} acks lost with the connection, \
         {reconnects} reconnections); effects: {} tickets for {} distinct events; all \
         consumed {:.1}s after start_app returned",
        rows.len(),
        lines.len(),
        per_key.values().sum::<usize>(),
        per_key.len(),
        drained_after.as_secs_f64(),
    );
    assert!(
        reconnects >= 1,
        "the consumer never lost its connection: {}",
        consumer.output()
    );

    drop(consumer);
    drop(gw);
}

/// A RabbitMQ node of the test's own, its data directory (`RABBITMQ_MNESIA_BASE`) on the lazy
/// file system, run as the `rabbitmq` user in a process group of its own (kill -9 takes the
/// Erlang VM with the script that started it), on ports of its own beside the shared broker.
struct PrivateBroker {
    dir: PathBuf,
    mnesia: PathBuf,
    node: String,
    port: u16,
    dist_port: u16,
    uid: u32,
    gid: u32,
    child: Option<Child>,
    /// It has taken connections once: its ports are in the gateway's config.
    booted: bool,
}

impl PrivateBroker {
    /// `None` (after printing why) without `rabbitmq-server` or its user. Its data goes in
    /// `mnt`, its log and output in `dir`; its node name starts `hooklatch-{test}-`.
    fn new(dir: &Path, mnt: &Path, test: &str) -> Option<PrivateBroker> {
        let Some((uid, gid)) = support::system_user("rabbitmq") else {
            println!("skipped: no rabbitmq user to run a private RabbitMQ as");
            return None;
        };
        let on_path = std::env::var_os("PATH").is_some_and(|paths| {
            std::env::split_paths(&paths).any(|dir| dir.join("rabbitmq-server").is_file())
        });
        if !on_path {
            println!("skipped: no rabbitmq-server");
            return None;
        }
        let own = |path: &Path| {
            std::os::unix::fs::chown(path, Some(uid), Some(gid)).expect("giving it to rabbitmq")
        };
        let mnesia = mnt.join("mnesia");
        std::fs::create_dir(&mnesia).expect("the data directory");
        own(&mnesia);
        std::fs::create_dir(dir.join("log")).expect("the log directory");
        own(&dir.join("log"));
        std::fs::write(dir.join("enabled_plugins"), "[].\n").expect("no plugins");
        Some(PrivateBroker {
            dir: dir.to_owned(),
            mnesia,
            node: format!(
                "hooklatch-{test}-{}@localhost",
                unique("n").replace('_', "-")
            ),
            port: support::free_port(),
            dist_port: support::free_port(),
            uid,
            gid,
            child: None,
            booted: false,
        })
    }

    fn url(&self) -> String {
        format!("amqp://guest:guest@127.0.0.1:{}/%2f", self.port)
    }

    /// Starts the node (recovering what its disk kept) and waits until it takes connections.
    async fn start(&mut self) {
        // A node that exits while booting gets two more tries: on its first boot with fresh
        // ports (another test may have taken one between picking it and the node binding it),
        // after a power cut on the same ones (the gateway is configured with them).
        for _ in 0..3 {
            self.spawn();
            if self.wait_taking_connections().await {
                self.booted = true;
                return;
            }
            println!(
                "the private RabbitMQ exited while booting; trying again:\n{}",
                self.output()
            );
            self.kill9();
            if !self.booted {
                self.port = support::free_port();
                self.dist_port = support::free_port();
            }
        }
        panic!("the private RabbitMQ exited three times while booting");
    }

    fn spawn(&mut self) {
        use std::os::unix::process::CommandExt;
        let out = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.join("server.out"))
            .expect("the server's output");
        let child = Command::new("rabbitmq-server")
            .env("HOME", "/var/lib/rabbitmq")
            .env("RABBITMQ_NODENAME", &self.node)
            .env("RABBITMQ_NODE_PORT", self.port.to_string())
            .env("RABBITMQ_DIST_PORT", self.dist_port.to_string())
            .env("RABBITMQ_MNESIA_BASE", &self.mnesia)
            .env("RABBITMQ_LOG_BASE", self.dir.join("log"))
            .env(
                "RABBITMQ_ENABLED_PLUGINS_FILE",
                self.dir.join("enabled_plugins"),
            )
            .env("RABBITMQ_CONFIG_FILE", self.dir.join("none"))
            .current_dir(&self.dir)
            .uid(self.uid)
            .gid(self.gid)
            .process_group(0)
            .stdout(out.try_clone().expect("the output"))
            .stderr(out)
            .spawn()
            .expect("starting rabbitmq-server");
        self.child = Some(child);
    }

    /// Waits until the node takes connections (`true`) or exits (`false`); panics with its
    /// output after 120 s of neither.
    async fn wait_taking_connections(&mut self) -> bool {
        let url = self.url();
        let started = std::time::Instant::now();
        while TestBroker::try_connect(&url).await.is_none() {
            let exited = self
                .child
                .as_mut()
                .and_then(|child| child.try_wait().ok().flatten());
            if exited.is_some() {
                return false;
            }
            if started.elapsed() > Duration::from_secs(120) {
                panic!(
                    "the private RabbitMQ took no connection within 120 s:\n{}",
                    self.output()
                );
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        true
    }

    /// The tail of what the node printed and logged, for a failure's message.
    fn output(&self) -> String {
        let mut text = String::new();
        let mut files = vec![self.dir.join("server.out")];
        if let Ok(logs) = std::fs::read_dir(self.dir.join("log")) {
            files.extend(logs.filter_map(Result::ok).map(|e| e.path()));
        }
        for file in files {
            let content = std::fs::read_to_string(&file).unwrap_or_default();
            let lines: Vec<&str> = content.lines().collect();
            let tail = lines[lines.len().saturating_sub(40)..].join("\n");
            text.push_str(&format!("--- {}\n{tail}\n", file.display()));
        }
        text
    }

    fn kill9(&mut self) {
        if let Some(mut child) = self.child.take() {
            support::kill_process_group(&mut child);
        }
    }

    /// `rabbitmqctl ARGS…` against this node, as the `rabbitmq` user (its Erlang cookie);
    /// panics with its output when it fails. Returns its standard output.
    fn ctl(&self, args: &[&str]) -> String {
        use std::os::unix::process::CommandExt;
        let out = Command::new("rabbitmqctl")
            .env("HOME", "/var/lib/rabbitmq")
            .args(["-q", "-n", &self.node])
            .args(args)
            .uid(self.uid)
            .gid(self.gid)
            .output()
            .expect("running rabbitmqctl");
        assert!(
            out.status.success(),
            "rabbitmqctl {args:?} on {}: {}{}",
            self.node,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// `queue`'s line in `rabbitmqctl list_queues name leader`: its name and its leader node.
    fn queue_leader(&self, queue: &str) -> String {
        let leaders = self.ctl(&["list_queues", "name", "leader", "--no-table-headers"]);
        leaders
            .lines()
            .find(|l| l.starts_with(queue))
            .unwrap_or_else(|| panic!("{queue} in {leaders}"))
            .to_owned()
    }

    /// Makes this node a member of `other`'s cluster.
    fn join(&self, other: &PrivateBroker) {
        self.ctl(&["stop_app"]);
        self.ctl(&["join_cluster", &other.node]);
        self.ctl(&["start_app"]);
    }
}

impl Drop for PrivateBroker {
    fn drop(&mut self) {
        self.kill9();
    }
}

/// What one broker power cut left: how many events were confirmed (recorded delivered)
/// before it, those of them not in the queue after it, and the messages in the queue then.
struct BrokerCut {
    confirmed: usize,
    lost: Vec<String>,
    messages: usize,
}

/// T5 for the RabbitMQ destination: events published through the gateway to a durable
/// (classic) queue on a private node whose data directory is on the lazy file system. Once the node has
/// booted and the gateway's first event is in (its declarations made), what it wrote is
/// written back as the kernel would have long before a cut, and fsyncs then do as `fsync`
/// says. 200 more events; once half are confirmed the node is killed -9 and its power cut,
/// then started again; the gateway, on its own disk, publishes the rest when it is back.
async fn broker_power_cut(fsync: hooklatch_testkit::lazyfs::Fsync) -> Option<BrokerCut> {
    use hooklatch_testkit::lazyfs::Fsync;
    let (dir, mut fs) = support::lazy_mount(Fsync::Honoured)?;
    let mut node = PrivateBroker::new(dir.path(), fs.path(), "t5")?;
    node.start().await;
    let exchange = format!("hooklatch-e2e-x-{}", unique("power"));
    let queue = format!("hooklatch-e2e-q-{}", unique("power"));
    let handler = Handler::start(Behaviour::AlwaysOk).await;
    let gw = Gateway::start_with(
        &handler,
        options_with_retries(
            &node.url(),
            "max_attempts = 200\ninitial_backoff = \"100ms\"\nmax_backoff = \"500ms\"\njitter = 0.0\ntimeout = \"5s\"",
            &format!(
                "exchange = \"{exchange}\"\nrouting_key = \"payment.confirmed\"\ndeclare = true\nqueue = \"{queue}\"\nquorum = false"
            ),
        ),
    )
    .await;
    let first = send_accepted(&gw, "evt_power_first").await;
    gw.wait_for_delivery_state(&first, "delivered").await;
    fs.write_back().expect("writing the boot's files back");
    fs.set_fsync(fsync);

    let events = report::scaled(200);
    let mut keys = Vec::new();
    for _ in 0..events {
        keys.push(send_accepted(&gw, "evt_power").await);
    }
    let delivered = "hooklatch_delivery_attempts_total{destination=\"mq\",outcome=\"delivered\"}";
    eventually("half of the events confirmed", async || {
        gw.metric(delivered).await >= (1 + events / 2) as f64
    })
    .await;
    // Killed first: whatever is recorded delivered after this was confirmed before the cut.
    node.kill9();
    fs.power_cut();
    let mut confirmed = Vec::new();
    for key in &keys {
        let rows = gw.deliveries_for(key).await;
        if rows.first().is_some_and(|row| row["state"] == "delivered") {
            confirmed.push(key.clone());
        }
    }
    fs.mount_again().expect("serving the disk again");
    node.start().await;
    for key in &keys {
        gw.wait_for_delivery_state(key, "delivered").await;
    }
    let mut reader = TestBroker::connect(&node.url()).await;
    reader.owns(&exchange, &queue);
    let ids = drain_message_ids(&mut reader, &queue).await;
    let lost = confirmed
        .iter()
        .filter(|key| !ids.contains(key))
        .cloned()
        .collect();
    drop(gw);
    drop(node);
    drop(fs);
    Some(BrokerCut {
        confirmed: confirmed.len(),
        lost,
        messages: ids.len(),
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_power_cut_of_the_broker_loses_no_confirmed_publish() {
    let mut card = report::Card::new("T5", "rabbitmq");
    let Some(cut) = broker_power_cut(hooklatch_testkit::lazyfs::Fsync::Honoured).await else {
        return;
    };
    card.count("acked", cut.confirmed)
        .count("lost", cut.lost.len())
        .fault("power_cut", 1)
        .figure("messages_after", cut.messages as u64);
    assert!(
        cut.lost.is_empty(),
        "{} of {} confirmed publishes gone after the broker's power cut: {:?}",
        cut.lost.len(),
        cut.confirmed,
        &cut.lost[..cut.lost.len().min(10)]
    );
}

/// The control: the node's fsyncs ignored once it has booted; its power cut must lose
/// confirmed publishes, or the test above could not see a loss.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_the_brokers_fsyncs_ignored_its_power_cut_loses_confirmed_publishes() {
    let mut card = report::Card::new("T5", "rabbitmq-fsync-ignored");
    let Some(cut) = broker_power_cut(hooklatch_testkit::lazyfs::Fsync::Ignored).await else {
        return;
    };
    card.count("acked", cut.confirmed)
        .count("lost", cut.lost.len())
        .fault("power_cut", 1)
        .figure("control", true);
    assert!(
        !cut.lost.is_empty(),
        "with the broker's fsyncs ignored, its power cut lost none of {} confirmed publishes: \
         the test is blind",
        cut.confirmed
    );
}

/// Which node of the T12 cluster is killed.
#[derive(Clone, Copy, PartialEq, Eq)]
enum ClusterKill {
    /// `b`, the quorum queue's leader.
    Leader,
    /// `a`, the node the gateway publishes through.
    GatewaysNode,
}

/// T12: a cluster of three private nodes (own names and ports, data in temp directories, run
/// as `rabbitmq`) and a quorum queue declared through node `b`, which puts its leader there.
/// The gateway publishes through node `a`, with `b` and `c` as its `amqp_fallback`, while a
/// provider sends 200 events, one every 20 ms; once a quarter are confirmed, `kill` is killed
/// -9. Every event ends recorded delivered, and every one is in the queue read through node
/// `c`: lost = 0, copies only from publishes the kill left unconfirmed.
async fn cluster_node_killed(kill: ClusterKill) {
    use std::os::unix::fs::PermissionsExt;
    let mut card = report::Card::new("T12", "rabbitmq");
    let mut dirs = Vec::new();
    let mut nodes = Vec::new();
    for _ in 0..3 {
        let dir = tempfile::tempdir().expect("a temp dir");
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755))
            .expect("opening the temp dir to the rabbitmq user");
        let Some(node) = PrivateBroker::new(dir.path(), dir.path(), "t12") else {
            return;
        };
        dirs.push(dir);
        nodes.push(node);
    }
    for node in &mut nodes {
        node.start().await;
    }
    nodes[1].join(&nodes[0]);
    nodes[2].join(&nodes[0]);
    let members = nodes[0].ctl(&["cluster_status", "--formatter", "json"]);
    for node in &nodes {
        assert!(members.contains(&node.node), "{} in {members}", node.node);
    }

    let exchange = format!("hooklatch-e2e-x-{}", unique("t12"));
    let queue = format!("hooklatch-e2e-q-{}", unique("t12"));
    let mut declarer = TestBroker::connect(&nodes[1].url()).await;
    declarer.exchange(&exchange).await;
    declarer
        .bound_quorum_queue(&queue, &exchange, "payment.confirmed")
        .await;
    let leader_line = nodes[0].queue_leader(&queue);
    assert!(
        leader_line.contains(&nodes[1].node),
        "the leader is on the declaring node: {leader_line}"
    );
    drop(declarer);

    let handler = Handler::start(Behaviour::AlwaysOk).await;
    let gw = Gateway::start_with(
        &handler,
        options_with_retries(
            &nodes[0].url(),
            "max_attempts = 200\ninitial_backoff = \"100ms\"\nmax_backoff = \"500ms\"\njitter = 0.0\ntimeout = \"5s\"",
            &format!(
                "exchange = \"{exchange}\"\nrouting_key = \"payment.confirmed\"\n\
                 amqp_fallback = [\"{}\", \"{}\"]",
                nodes[1].url(),
                nodes[2].url()
            ),
        ),
    )
    .await;
    // The provider sends while the leader dies, an event every 20 ms (pacing, so the burst
    // outlasts the election): a quarter confirmed, then the kill, the rest published through
    // the election and after it.
    let events = report::scaled(200);
    let ingest = gw.ingest();
    let sending = tokio::spawn(async move {
        let mut keys = Vec::new();
        for _ in 0..events {
            let event = unique("evt_t12");
            let body = stripe_invoice_paid(&event, 5000);
            let (status, json) = ingest.post("stripe", &stripe_headers(&body), body).await;
            assert_eq!((status, json["status"].as_str()), (200, Some("accepted")));
            keys.push(format!("stripe:{event}"));
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        keys
    });
    let delivered = "hooklatch_delivery_attempts_total{destination=\"mq\",outcome=\"delivered\"}";
    eventually("a quarter of the events confirmed", async || {
        gw.metric(delivered).await >= (events / 4) as f64
    })
    .await;
    let confirmed_before = gw.metric(delivered).await as usize;
    let killed = match kill {
        ClusterKill::Leader => 1,
        ClusterKill::GatewaysNode => 0,
    };
    nodes[killed].kill9();
    let keys = sending.await.expect("the provider's sends");
    for key in &keys {
        gw.wait_for_delivery_state(key, "delivered").await;
    }
    let leader_line = nodes[2].queue_leader(&queue);
    if kill == ClusterKill::Leader {
        assert!(
            !leader_line.contains(&nodes[1].node),
            "another node leads the queue after the kill: {leader_line}"
        );
    }
    let retried = gw
        .metric("hooklatch_delivery_attempts_total{destination=\"mq\",outcome=\"retry\"}")
        .await as usize;
    let mut reader = TestBroker::connect(&nodes[2].url()).await;
    let ids = drain_message_ids(&mut reader, &queue).await;
    let lost: Vec<&String> = keys.iter().filter(|key| !ids.contains(key)).collect();
    let copies = ids.len() - (keys.len() - lost.len());
    card.count("ops", events)
        .count("acked", events)
        .count("lost", lost.len())
        .count("duplicates", copies)
        .fault(
            match kill {
                ClusterKill::Leader => "kill9_leader",
                ClusterKill::GatewaysNode => "kill9_gateways_node",
            },
            1,
        )
        .figure("confirmed_before_the_kill", confirmed_before)
        .figure("attempts_retried", retried)
        .figure("messages_after", ids.len());
    println!(
        "T12 ({}): {events} events, {confirmed_before} confirmed before the kill, \
         {retried} attempts retried, {} in the queue after, {} lost, {copies} extra copies",
        match kill {
            ClusterKill::Leader => "the leader killed",
            ClusterKill::GatewaysNode => "the gateway's node killed",
        },
        ids.len(),
        lost.len()
    );
    assert!(lost.is_empty(), "confirmed publishes missing: {lost:?}");
    drop(gw);
    drop(nodes);
}

/// T12: the quorum queue's leader killed mid-burst ([`cluster_node_killed`]). Another node
/// leads the queue after it (checked).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killing_the_quorum_queues_leader_loses_no_confirmed_publish() {
    cluster_node_killed(ClusterKill::Leader).await;
}

/// T12: the node the gateway publishes through killed mid-burst ([`cluster_node_killed`]): the
/// gateway connects to the next node of its `amqp_fallback` and retries there what the kill
/// left unconfirmed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killing_the_gateways_node_moves_it_to_another_and_loses_no_confirmed_publish() {
    cluster_node_killed(ClusterKill::GatewaysNode).await;
}
