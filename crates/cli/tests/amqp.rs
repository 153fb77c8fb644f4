//! End-to-end tests of the RabbitMQ destination: a real `hooklatch serve` with its Stripe
//! source delivering to a real broker at `HOOKLATCH_TEST_AMQP_URL`
//! (e.g. `amqp://guest:guest@127.0.0.1:5672/%2f`). Without it the tests print
//! `skipped: set HOOKLATCH_TEST_AMQP_URL` and pass — except under CI (`CI` set), where they
//! fail. Each test declares its own exchange and queue and deletes them afterwards.
//!
//! The gateway helpers are the end-to-end suite's own (`it/support.rs`), included as is.

#[allow(dead_code)]
#[path = "it/support.rs"]
mod support;

use std::time::{Duration, Instant};

use lapin::message::BasicGetMessage;
use lapin::options::{
    BasicAckOptions, BasicGetOptions, ExchangeDeclareOptions, ExchangeDeleteOptions,
    QueueBindOptions, QueueDeclareOptions, QueueDeleteOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{Channel, Connection, ConnectionProperties, ExchangeKind};
use support::{stripe_headers, stripe_invoice_paid, unique, Behaviour, Gateway, Handler, Options};

/// The broker URL, or `None` (after printing why) when the tests should skip.
fn broker_url() -> Option<String> {
    match std::env::var("HOOKLATCH_TEST_AMQP_URL") {
        Ok(url) if !url.is_empty() => Some(url),
        _ => {
            assert!(
                std::env::var_os("CI").is_none(),
                "HOOKLATCH_TEST_AMQP_URL must be set under CI (a RabbitMQ broker for the tests)"
            );
            eprintln!("skipped: set HOOKLATCH_TEST_AMQP_URL");
            None
        }
    }
}

/// The test's own broker connection: declares, inspects and deletes.
struct Broker {
    connection: Connection,
    channel: Channel,
    exchanges: Vec<String>,
    queues: Vec<String>,
}

impl Broker {
    async fn connect(url: &str) -> Broker {
        let connection = Connection::connect(url, ConnectionProperties::default())
            .await
            .expect("connecting to the test broker");
        let channel = connection.create_channel().await.expect("a channel");
        Broker {
            connection,
            channel,
            exchanges: Vec::new(),
            queues: Vec::new(),
        }
    }

    /// A durable topic exchange, bound to nothing.
    async fn exchange(&mut self, name: &str) {
        self.channel
            .exchange_declare(
                name,
                ExchangeKind::Topic,
                ExchangeDeclareOptions {
                    durable: true,
                    ..Default::default()
                },
                FieldTable::default(),
            )
            .await
            .expect("declaring an exchange");
        self.exchanges.push(name.to_owned());
    }

    /// A durable queue bound to `exchange` with `routing_key`.
    async fn bound_queue(&mut self, name: &str, exchange: &str, routing_key: &str) {
        self.channel
            .queue_declare(
                name,
                QueueDeclareOptions {
                    durable: true,
                    ..Default::default()
                },
                FieldTable::default(),
            )
            .await
            .expect("declaring a queue");
        self.channel
            .queue_bind(
                name,
                exchange,
                routing_key,
                QueueBindOptions::default(),
                FieldTable::default(),
            )
            .await
            .expect("binding a queue");
        self.queues.push(name.to_owned());
    }

    /// Remembers names the gateway declares, for the clean-up.
    fn owns(&mut self, exchange: &str, queue: &str) {
        self.exchanges.push(exchange.to_owned());
        self.queues.push(queue.to_owned());
    }

    /// The next message in `queue` (acked), waiting up to `within`.
    async fn get_within(&self, queue: &str, within: Duration) -> Option<BasicGetMessage> {
        let started = Instant::now();
        loop {
            let got = self
                .channel
                .basic_get(queue, BasicGetOptions::default())
                .await
                .expect("basic.get");
            if let Some(msg) = got {
                msg.delivery
                    .acker
                    .ack(BasicAckOptions::default())
                    .await
                    .expect("ack");
                return Some(msg);
            }
            if started.elapsed() >= within {
                return None;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    async fn clean_up(self) {
        for queue in &self.queues {
            let _ = self
                .channel
                .queue_delete(queue, QueueDeleteOptions::default())
                .await;
        }
        for exchange in &self.exchanges {
            let _ = self
                .channel
                .exchange_delete(exchange, ExchangeDeleteOptions::default())
                .await;
        }
        let _ = self.connection.close(200, "done").await;
    }
}

/// Gateway options: the `stripe` source delivers to an AMQP destination `mq` (3 quick
/// attempts) with `mq_settings` (exchange, routing key, declarations).
fn options(url: &str, mq_settings: &str) -> Options {
    Options {
        extra_config: format!(
            r#"
[[destinations]]
name = "mq"
amqp = "env:E2E_AMQP_URL"
max_attempts = 3
initial_backoff = "100ms"
max_backoff = "300ms"
jitter = 0.0
timeout = "10s"
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

fn header(msg: &BasicGetMessage, name: &str) -> String {
    let headers = msg
        .delivery
        .properties
        .headers()
        .clone()
        .expect("the message has headers");
    match headers.inner().get(name) {
        Some(AMQPValue::LongString(s)) => s.to_string(),
        Some(AMQPValue::LongLongInt(n)) => n.to_string(),
        other => panic!("header {name}: {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_payment_sent_42_times_is_one_persistent_message_keyed_by_its_event() {
    let Some(url) = broker_url() else { return };
    let mut broker = Broker::connect(&url).await;
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unroutable_message_is_retried_then_dead_lettered_never_delivered_and_redrive_lands_it()
{
    let Some(url) = broker_url() else { return };
    let mut broker = Broker::connect(&url).await;
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
