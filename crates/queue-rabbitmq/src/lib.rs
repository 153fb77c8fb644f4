//! The RabbitMQ destination of hooklatch: a [`Publisher`] that hands one webhook at a time to
//! an AMQP 0-9-1 broker and reports success only once the broker has taken responsibility.
//!
//! Every publish is:
//! - **persistent** (`delivery_mode = 2`), to a durable exchange and queue when hooklatch
//!   declares them, so a broker restart keeps it;
//! - **confirmed**: the channel is in confirm mode and [`Publisher::publish`] waits for the
//!   broker's `basic.ack`; a `basic.nack`, a timeout or a connection error is a failure;
//! - **mandatory**: a message no queue is bound to receive comes back as `basic.return` —
//!   followed by an *ack*, which is the trap: a publisher that only looks at the ack reports
//!   success for a message the broker dropped. Here a returned message is a failure
//!   ([`PublishError::Returned`]), retried then dead-lettered by the caller.
//!
//! The message carries `message_id` = the Idempotency-Key, so consumers deduplicate the
//! at-least-once stream, and `hooklatch-*` headers (source, provider, event type, delivery id,
//! attempt).
//!
//! The publisher connects lazily on the first publish and again after any connection or
//! channel error, waiting an exponential backoff between failed connection attempts.
//! Publishes are serialized on one confirm-mode channel, so each confirm and each returned
//! message belongs to exactly one publish.
#![forbid(unsafe_code)]

mod tls;
mod url;

use std::time::{Duration, Instant};

use lapin::options::{
    BasicPublishOptions, ConfirmSelectOptions, ExchangeDeclareOptions, QueueBindOptions,
    QueueDeclareOptions,
};
use lapin::publisher_confirm::Confirmation;
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties, ExchangeKind};
use tokio::sync::Mutex;

pub use hooklatch_core::tls::{ClientIdentity, TlsFiles};
pub use url::{is_tls_url, is_valid_url, redact_url};

/// Where and how a [`Publisher`] publishes.
#[derive(Clone)]
pub struct PublisherConfig {
    /// `amqp://user:password@host:port/vhost` (the vhost URL-encoded: `%2f` is `/`), or
    /// `amqps://` for TLS (port 5671 unless given). Holds a password: log [`redact_url`] of
    /// it, never the URL itself.
    pub url: String,
    /// Other nodes of the same cluster, as URLs like `url`: when the node in use cannot be
    /// reached, a (re)connection tries each in turn, from the one after it.
    pub fallback_urls: Vec<String>,
    /// What the `amqps://` URLs trust and present (the built-in roots and no client
    /// certificate by default).
    pub tls: TlsFiles,
    /// The exchange; `""` is the default exchange, which routes by queue name.
    pub exchange: String,
    /// The routing key of every message.
    pub routing_key: String,
    /// Declare the exchange (durable, `topic`) on every (re)connection. Off, the operator
    /// declares it; publishing to an exchange that does not exist fails (and is retried).
    pub declare: bool,
    /// With `declare`: a durable queue to declare and bind to the exchange with `routing_key`.
    pub queue: Option<String>,
    /// With `queue`: declare it as a quorum queue (`x-queue-type: quorum`), replicated.
    pub quorum: bool,
    /// With `queue`: at most this many messages in it (`x-max-length`). A publish past it is
    /// refused (`x-overflow: reject-publish`: a `basic.nack`, so the delivery is retried),
    /// never an older message dropped, which RabbitMQ's default (`drop-head`) would do after
    /// confirming it.
    pub max_length: Option<u32>,
    /// With `quorum`: how many times a message may be handed to consumers
    /// (`x-delivery-limit`) before it is dead-lettered, or dropped without
    /// [`PublisherConfig::dead_letter_exchange`].
    pub delivery_limit: Option<u32>,
    /// With `queue`: where messages consumers reject, or past `delivery_limit`, go
    /// (`x-dead-letter-exchange`); on a quorum queue with `x-dead-letter-strategy:
    /// at-least-once` (and `x-overflow: reject-publish`, which that needs), so none is lost on
    /// the way.
    pub dead_letter_exchange: Option<String>,
    /// Publish with the `mandatory` flag, so unroutable messages come back and fail. Always
    /// `true` in the gateway; `false` exists only to demonstrate (in tests) that the broker
    /// then confirms a message it dropped.
    pub mandatory: bool,
    /// Time allowed for one publish: connecting, publishing and the confirm.
    pub timeout: Duration,
    /// First wait after a failed connection attempt, doubled after each further failure.
    pub initial_backoff: Duration,
    /// Longest wait between connection attempts.
    pub max_backoff: Duration,
}

impl std::fmt::Debug for PublisherConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PublisherConfig")
            .field("url", &redact_url(&self.url))
            .field(
                "fallback_urls",
                &self
                    .fallback_urls
                    .iter()
                    .map(|u| redact_url(u))
                    .collect::<Vec<_>>(),
            )
            .field("tls", &self.tls)
            .field("exchange", &self.exchange)
            .field("routing_key", &self.routing_key)
            .field("declare", &self.declare)
            .field("queue", &self.queue)
            .field("quorum", &self.quorum)
            .field("max_length", &self.max_length)
            .field("delivery_limit", &self.delivery_limit)
            .field("dead_letter_exchange", &self.dead_letter_exchange)
            .field("mandatory", &self.mandatory)
            .field("timeout", &self.timeout)
            .finish_non_exhaustive()
    }
}

impl PublisherConfig {
    /// A configuration with the gateway's defaults: no declarations, `mandatory`, 30 s per
    /// publish, reconnection backoff from 100 ms up to 5 s.
    pub fn new(
        url: impl Into<String>,
        exchange: impl Into<String>,
        routing_key: impl Into<String>,
    ) -> Self {
        PublisherConfig {
            url: url.into(),
            fallback_urls: Vec::new(),
            tls: TlsFiles::default(),
            exchange: exchange.into(),
            routing_key: routing_key.into(),
            declare: false,
            queue: None,
            quorum: false,
            max_length: None,
            delivery_limit: None,
            dead_letter_exchange: None,
            mandatory: true,
            timeout: Duration::from_secs(30),
            initial_backoff: Duration::from_millis(100),
            max_backoff: Duration::from_secs(5),
        }
    }
}

/// One message to publish: a webhook as the gateway received it.
#[derive(Debug, Clone, Copy)]
pub struct Message<'a> {
    /// The body, byte-exact.
    pub body: &'a [u8],
    /// The Idempotency-Key; sent as `message_id`.
    pub idempotency_key: &'a str,
    /// The original request's `Content-Type`, if any.
    pub content_type: Option<&'a str>,
    /// The source's name (`hooklatch-source`).
    pub source: &'a str,
    /// The source's provider, if known (`hooklatch-provider`).
    pub provider: Option<&'a str>,
    /// The event type, if known (`hooklatch-event-type`).
    pub event_type: Option<&'a str>,
    /// The delivery's id (`hooklatch-delivery-id`).
    pub delivery_id: &'a str,
    /// The attempt number, from 1 (`hooklatch-attempt`).
    pub attempt: u32,
    /// The AMQP `timestamp` property, in seconds since the Unix epoch.
    pub timestamp: u64,
}

/// Why a publish did not succeed. Every variant means "not delivered": retry it.
#[derive(Debug, thiserror::Error)]
pub enum PublishError {
    /// No connection to the broker could be made (the URL is not part of the message).
    #[error("connecting to RabbitMQ failed: {0}")]
    Connect(String),
    /// The broker returned the message: no queue is bound to receive it.
    #[error("message returned by the broker as unroutable ({code} {text}): no queue is bound to exchange {exchange:?} with routing key {routing_key:?}")]
    Returned {
        /// The AMQP reply code (312 NO_ROUTE).
        code: u16,
        /// The broker's reply text.
        text: String,
        /// The exchange published to.
        exchange: String,
        /// The routing key published with.
        routing_key: String,
    },
    /// The broker refused responsibility for the message (`basic.nack`).
    #[error("the broker nacked the message")]
    Nacked,
    /// The channel or connection failed while publishing (the next publish reconnects).
    #[error("RabbitMQ channel error: {0}")]
    Channel(String),
    /// No confirm within the publish timeout (the next publish reconnects).
    #[error("no publisher confirm within {}ms", .0.as_millis())]
    Timeout(Duration),
}

struct Link {
    connection: Connection,
    channel: Channel,
}

#[derive(Default)]
struct State {
    link: Option<Link>,
    failures: u32,
    retry_at: Option<Instant>,
    in_doubt: bool,
}

/// The arguments a declared queue gets from `c` (`x-queue-type`, its limits, where its dead
/// letters go).
fn queue_arguments(c: &PublisherConfig) -> FieldTable {
    let text = |v: &str| AMQPValue::LongString(LongString::from(v));
    let mut args = FieldTable::default();
    if c.quorum {
        args.insert(ShortString::from("x-queue-type"), text("quorum"));
    }
    if let Some(n) = c.max_length {
        args.insert(
            ShortString::from("x-max-length"),
            AMQPValue::LongLongInt(n.into()),
        );
    }
    if let Some(n) = c.delivery_limit {
        args.insert(
            ShortString::from("x-delivery-limit"),
            AMQPValue::LongLongInt(n.into()),
        );
    }
    if let Some(exchange) = &c.dead_letter_exchange {
        args.insert(ShortString::from("x-dead-letter-exchange"), text(exchange));
        if c.quorum {
            args.insert(
                ShortString::from("x-dead-letter-strategy"),
                text("at-least-once"),
            );
        }
    }
    let at_least_once = c.quorum && c.dead_letter_exchange.is_some();
    if c.max_length.is_some() || at_least_once {
        args.insert(ShortString::from("x-overflow"), text("reject-publish"));
    }
    args
}

/// Publishes to one exchange over one connection and one confirm-mode channel, reconnecting
/// as needed. Share it (in an `Arc`) between the tasks that publish to the same destination.
pub struct Publisher {
    config: PublisherConfig,
    state: Mutex<State>,
    /// Which URL the next connection tries first: the last one that connected (`url` is 0,
    /// `fallback_urls[i]` is `i + 1`).
    node: std::sync::atomic::AtomicUsize,
}

impl std::fmt::Debug for Publisher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Publisher")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

impl Publisher {
    /// A publisher that connects on its first publish.
    pub fn new(config: PublisherConfig) -> Publisher {
        Publisher {
            config,
            state: Mutex::new(State::default()),
            node: std::sync::atomic::AtomicUsize::new(0),
        }
    }

    /// Its configuration.
    pub fn config(&self) -> &PublisherConfig {
        &self.config
    }

    /// Publishes `msg` and waits for the broker's confirm: `Ok` only when the broker acked a
    /// message it routed to at least one queue (with `mandatory`).
    pub async fn publish(&self, msg: &Message<'_>) -> Result<(), PublishError> {
        let timeout = self.config.timeout;
        let attempt = async {
            // Waiting for the other publishes counts against this one's timeout.
            let mut state = self.state.lock().await;
            let result = self.publish_locked(&mut state, msg).await;
            if matches!(result, Err(PublishError::Channel(_))) {
                // The channel may be half-broken: start afresh on the next publish.
                if let Some(link) = state.link.take() {
                    close_quietly(link).await;
                }
            }
            result
        };
        tokio::time::timeout(timeout, attempt)
            .await
            .unwrap_or(Err(PublishError::Timeout(timeout)))
    }

    /// Connects now rather than at the first publish, so that a broker that cannot be reached
    /// (or a queue declared before with other arguments) is known at start. A failure counts
    /// as a failed connection: the next publish waits out the same backoff.
    pub async fn connect_now(&self) -> Result<(), PublishError> {
        let timeout = self.config.timeout;
        let attempt = async {
            let mut state = self.state.lock().await;
            self.ensure_link(&mut state).await
        };
        tokio::time::timeout(timeout, attempt)
            .await
            .unwrap_or(Err(PublishError::Timeout(timeout)))
    }

    /// A usable connection and channel in `state`, connecting (after any backoff) if there is
    /// none.
    async fn ensure_link(&self, state: &mut State) -> Result<(), PublishError> {
        // A publish abandoned before its confirm (timed out) leaves the channel in doubt: a
        // late confirm or return must not be taken for the next message's.
        let usable = !state.in_doubt
            && state.link.as_ref().is_some_and(|l| {
                l.connection.status().connected() && l.channel.status().connected()
            });
        if !usable {
            if let Some(link) = state.link.take() {
                close_quietly(link).await;
            }
            if let Some(at) = state.retry_at {
                tokio::time::sleep_until(at.into()).await;
            }
            match self.connect().await {
                Ok(link) => {
                    state.link = Some(link);
                    state.in_doubt = false;
                    state.failures = 0;
                    state.retry_at = None;
                }
                Err(err) => {
                    state.failures = state.failures.saturating_add(1);
                    let backoff = self
                        .config
                        .initial_backoff
                        .saturating_mul(1 << state.failures.min(16).saturating_sub(1))
                        .min(self.config.max_backoff);
                    state.retry_at = Some(Instant::now() + backoff);
                    return Err(err);
                }
            }
        }
        Ok(())
    }

    async fn publish_locked(
        &self,
        state: &mut State,
        msg: &Message<'_>,
    ) -> Result<(), PublishError> {
        self.ensure_link(state).await?;
        state.in_doubt = true;
        let link = state.link.as_ref().expect("connected above");
        let c = &self.config;
        let confirm = link
            .channel
            .basic_publish(
                &c.exchange,
                &c.routing_key,
                BasicPublishOptions {
                    mandatory: c.mandatory,
                    immediate: false,
                },
                msg.body,
                properties(msg),
            )
            .await
            .map_err(|e| PublishError::Channel(e.to_string()))?;
        let confirmation = confirm
            .await
            .map_err(|e| PublishError::Channel(e.to_string()))?;
        state.in_doubt = false;
        match confirmation {
            Confirmation::Ack(None) => Ok(()),
            Confirmation::Ack(Some(returned)) | Confirmation::Nack(Some(returned)) => {
                Err(PublishError::Returned {
                    code: returned.reply_code,
                    text: returned.reply_text.to_string(),
                    exchange: c.exchange.clone(),
                    routing_key: c.routing_key.clone(),
                })
            }
            Confirmation::Nack(None) => Err(PublishError::Nacked),
            Confirmation::NotRequested => Err(PublishError::Channel(
                "the channel is not in confirm mode".to_owned(),
            )),
        }
    }

    /// Opens a connection and a confirm-mode channel, and makes the declarations: on the node
    /// that connected last, else on each of the others in turn.
    async fn connect(&self) -> Result<Link, PublishError> {
        use std::sync::atomic::Ordering;
        let c = &self.config;
        let urls: Vec<&str> = std::iter::once(c.url.as_str())
            .chain(c.fallback_urls.iter().map(String::as_str))
            .collect();
        let first = self.node.load(Ordering::Relaxed) % urls.len();
        let mut failed = None;
        for i in 0..urls.len() {
            let node = (first + i) % urls.len();
            match self.connect_to(urls[node]).await {
                Ok(link) => {
                    if node != first {
                        tracing::info!(url = %redact_url(urls[node]), "connected to another RabbitMQ node");
                    }
                    self.node.store(node, Ordering::Relaxed);
                    return Ok(link);
                }
                Err(err) => failed = Some(err),
            }
        }
        Err(failed.expect("at least one URL"))
    }

    /// [`Publisher::connect`] to one node.
    async fn connect_to(&self, url: &str) -> Result<Link, PublishError> {
        let c = &self.config;
        let shown = redact_url(url);
        let connect_err = |e: lapin::Error| PublishError::Connect(format!("{shown}: {e}"));
        let props = ConnectionProperties::default().with_connection_name(LongString::from(
            format!("hooklatch-{}", std::process::id()),
        ));
        let connection = Connection::connect_with_config(url, props, tls::to_lapin(&c.tls))
            .await
            .map_err(connect_err)?;
        let setup = async {
            let channel = connection.create_channel().await?;
            channel
                .confirm_select(ConfirmSelectOptions::default())
                .await?;
            if c.declare {
                if !c.exchange.is_empty() {
                    channel
                        .exchange_declare(
                            &c.exchange,
                            ExchangeKind::Topic,
                            ExchangeDeclareOptions {
                                durable: true,
                                ..ExchangeDeclareOptions::default()
                            },
                            FieldTable::default(),
                        )
                        .await?;
                }
                if let Some(queue) = &c.queue {
                    let args = queue_arguments(c);
                    channel
                        .queue_declare(
                            queue,
                            QueueDeclareOptions {
                                durable: true,
                                ..QueueDeclareOptions::default()
                            },
                            args,
                        )
                        .await?;
                    if !c.exchange.is_empty() {
                        channel
                            .queue_bind(
                                queue,
                                &c.exchange,
                                &c.routing_key,
                                QueueBindOptions::default(),
                                FieldTable::default(),
                            )
                            .await?;
                    }
                }
            }
            Ok::<_, lapin::Error>(channel)
        };
        match setup.await {
            Ok(channel) => {
                tracing::debug!(url = %redact_url(url), exchange = %c.exchange, "connected to RabbitMQ");
                Ok(Link {
                    connection,
                    channel,
                })
            }
            Err(e) => {
                let _ = connection.close(200, "setup failed").await;
                // Connected: what failed is the channel, or declaring the exchange and queue
                // (a queue declared before with other arguments, say).
                Err(PublishError::Connect(format!(
                    "{shown}: connected, then setting up the confirm channel{} failed: {e}",
                    if c.declare {
                        ", exchange and queue"
                    } else {
                        ""
                    }
                )))
            }
        }
    }

    /// Closes the connection, if open; the next publish connects again. For shutdown, and
    /// for tests that exercise reconnection.
    pub async fn disconnect(&self) {
        let mut state = self.state.lock().await;
        if let Some(link) = state.link.take() {
            close_quietly(link).await;
        }
    }

    /// Closes the connection under the publisher's feet without telling it, as a broker or
    /// network failure would: the next publish must notice and reconnect. For tests.
    pub async fn break_connection(&self) {
        let state = self.state.lock().await;
        if let Some(link) = &state.link {
            let _ = link.connection.close(320, "closed by a test").await;
        }
    }
}

async fn close_quietly(link: Link) {
    let _ = tokio::time::timeout(
        Duration::from_secs(1),
        link.connection.close(200, "reconnecting"),
    )
    .await;
}

/// The AMQP properties of `msg`: persistent, `message_id`, content type, timestamp, headers.
fn properties(msg: &Message<'_>) -> BasicProperties {
    let mut headers = FieldTable::default();
    let mut text = |name: &str, value: &str| {
        headers.insert(
            ShortString::from(name),
            AMQPValue::LongString(LongString::from(value)),
        );
    };
    text("hooklatch-source", msg.source);
    text("hooklatch-delivery-id", msg.delivery_id);
    text("idempotency-key", msg.idempotency_key);
    if let Some(provider) = msg.provider {
        text("hooklatch-provider", provider);
    }
    if let Some(event_type) = msg.event_type {
        text("hooklatch-event-type", event_type);
    }
    headers.insert(
        ShortString::from("hooklatch-attempt"),
        AMQPValue::LongLongInt(i64::from(msg.attempt)),
    );
    let mut props = BasicProperties::default().with_delivery_mode(2);
    // `message_id` is a short string (255 bytes at most); the header carries any key whole.
    if msg.idempotency_key.len() <= 255 {
        props = props.with_message_id(ShortString::from(msg.idempotency_key));
    }
    let mut props = props
        .with_timestamp(msg.timestamp)
        .with_app_id(ShortString::from("hooklatch"))
        .with_headers(headers);
    if let Some(content_type) = msg.content_type {
        props = props.with_content_type(ShortString::from(content_type));
    }
    props
}

#[cfg(test)]
mod tests {
    use super::*;

    fn arguments(c: &PublisherConfig) -> Vec<(String, String)> {
        let mut args: Vec<(String, String)> = queue_arguments(c)
            .inner()
            .iter()
            .map(|(k, v)| {
                let v = match v {
                    AMQPValue::LongString(text) => {
                        String::from_utf8_lossy(text.as_bytes()).into_owned()
                    }
                    AMQPValue::LongLongInt(n) => n.to_string(),
                    other => format!("{other:?}"),
                };
                (k.to_string(), v)
            })
            .collect();
        args.sort();
        args
    }

    #[test]
    fn a_limited_queue_refuses_publishes_and_a_quorum_dead_letter_is_at_least_once() {
        let mut c = PublisherConfig::new("amqp://h", "x", "k");
        c.queue = Some("q".to_owned());
        assert!(arguments(&c).is_empty(), "a plain classic queue");
        c.max_length = Some(3);
        let names: Vec<String> = arguments(&c).into_iter().map(|(k, _)| k).collect();
        assert_eq!(names, ["x-max-length", "x-overflow"]);
        assert!(format!("{:?}", arguments(&c)).contains("reject-publish"));

        c.max_length = None;
        c.quorum = true;
        c.delivery_limit = Some(5);
        c.dead_letter_exchange = Some("dead".to_owned());
        let args = format!("{:?}", arguments(&c));
        for expected in [
            "x-delivery-limit",
            "x-dead-letter-exchange",
            "at-least-once",
            "reject-publish",
            "quorum",
        ] {
            assert!(args.contains(expected), "{expected} in {args}");
        }
        // A classic queue has no dead-letter strategy, and needs no overflow for one.
        c.quorum = false;
        c.delivery_limit = None;
        let args = format!("{:?}", arguments(&c));
        assert!(
            !args.contains("at-least-once") && !args.contains("x-overflow"),
            "{args}"
        );
    }
}
