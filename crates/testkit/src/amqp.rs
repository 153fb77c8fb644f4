//! A test's own RabbitMQ connection (feature `amqp`): the broker URL the tests share, and a
//! [`TestBroker`] that declares exchanges and queues, reads and counts messages, and deletes
//! what it declared when the test is done.

use std::time::{Duration, Instant};

use lapin::message::BasicGetMessage;
use lapin::options::{
    BasicAckOptions, BasicGetOptions, ExchangeDeclareOptions, ExchangeDeleteOptions,
    QueueBindOptions, QueueDeclareOptions, QueueDeleteOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{Channel, Connection, ConnectionProperties, ExchangeKind};

/// `HOOKLATCH_TEST_AMQP_URL`, or `None` (after printing `skipped: …`) when the tests should
/// skip. Under CI (`CI` set) a missing URL fails the test instead.
pub fn broker_url() -> Option<String> {
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

/// The test's own connection: declares, inspects and deletes.
pub struct TestBroker {
    connection: Connection,
    channel: Channel,
    exchanges: Vec<String>,
    queues: Vec<String>,
}

impl TestBroker {
    /// Connects to `url` and opens a channel.
    pub async fn connect(url: &str) -> TestBroker {
        TestBroker::try_connect(url)
            .await
            .expect("connecting to the test broker")
    }

    /// Connects to `url`, or `None` if the broker does not answer (yet).
    pub async fn try_connect(url: &str) -> Option<TestBroker> {
        let connection = Connection::connect(url, ConnectionProperties::default())
            .await
            .ok()?;
        let channel = connection.create_channel().await.ok()?;
        Some(TestBroker {
            connection,
            channel,
            exchanges: Vec::new(),
            queues: Vec::new(),
        })
    }

    /// A durable topic exchange, bound to nothing.
    pub async fn exchange(&mut self, name: &str) {
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
    pub async fn bound_queue(&mut self, name: &str, exchange: &str, routing_key: &str) {
        self.bound_queue_with(name, exchange, routing_key, FieldTable::default())
            .await;
    }

    /// A quorum queue bound to `exchange` with `routing_key` (its leader on the node this
    /// connection is on, RabbitMQ's default `client-local` placement).
    pub async fn bound_quorum_queue(&mut self, name: &str, exchange: &str, routing_key: &str) {
        let mut args = FieldTable::default();
        args.insert(
            "x-queue-type".into(),
            lapin::types::AMQPValue::LongString("quorum".into()),
        );
        self.bound_queue_with(name, exchange, routing_key, args)
            .await;
    }

    async fn bound_queue_with(
        &mut self,
        name: &str,
        exchange: &str,
        routing_key: &str,
        args: FieldTable,
    ) {
        self.channel
            .queue_declare(
                name,
                QueueDeclareOptions {
                    durable: true,
                    ..Default::default()
                },
                args,
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

    /// Remembers names something else declares (the gateway, a publisher), for the clean-up.
    pub fn owns(&mut self, exchange: &str, queue: &str) {
        self.exchanges.push(exchange.to_owned());
        self.queues.push(queue.to_owned());
    }

    /// The next message in `queue` (acked), waiting up to `within`.
    pub async fn get_within(&self, queue: &str, within: Duration) -> Option<BasicGetMessage> {
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

    /// The next message in `queue` (acked); fails the test after 10 s without one.
    pub async fn get(&self, queue: &str) -> BasicGetMessage {
        self.get_within(queue, Duration::from_secs(10))
            .await
            .unwrap_or_else(|| panic!("no message in {queue}"))
    }

    /// How many messages wait in `queue` (a passive declare).
    pub async fn depth(&self, queue: &str) -> u32 {
        self.channel
            .queue_declare(
                queue,
                QueueDeclareOptions {
                    passive: true,
                    ..Default::default()
                },
                FieldTable::default(),
            )
            .await
            .expect("passive queue.declare")
            .message_count()
    }

    /// Deletes every queue and exchange it declared or was told it owns, and closes.
    pub async fn clean_up(self) {
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

/// A message's `message_id` property (the gateway's `Idempotency-Key`), `None` without one.
pub fn message_id(msg: &BasicGetMessage) -> Option<String> {
    msg.delivery
        .properties
        .message_id()
        .as_ref()
        .map(|s| s.to_string())
}

/// A message's header `name`, as text (long strings and integers); fails the test otherwise.
pub fn header(msg: &BasicGetMessage, name: &str) -> String {
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
