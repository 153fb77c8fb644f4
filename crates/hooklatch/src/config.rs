//! Configuration: layered TOML, resolved once into typed [`Settings`].
//!
//! Layers, later wins: `config.default.toml` (embedded; it documents every key), the file given
//! with `--config`, then `HOOKLATCH_<SECTION>__<KEY>` environment variables. The merged document
//! is deserialized with unknown keys refused, then resolved: secrets read, providers built,
//! references checked. Every error names the key it is about (`sources[0].secrets[1]: …`).
//!
//! Raw structs mirror the file and stay private; the rest of the crate sees only [`Settings`].

use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use hooklatch_core::netguard::AddressPolicy;
use hooklatch_core::provider::standard_webhooks::decode_secret;
use hooklatch_core::provider::{
    Discord, Generic, GenericSettings, GitHub, Paddle, Razorpay, Shopify, SignatureEncoding, Slack,
    StandardWebhooks, Stripe, Twilio, WhatsApp, TIMESTAMP_SIGNERS,
};
use hooklatch_core::tls::{ClientIdentity, TlsFiles};
use hooklatch_core::{ProviderAdapter, RetryPolicy, Secret, SourceName};
use hooklatch_http::Source;
use serde::Deserialize;
use toml::Value;

/// The documented defaults, the base layer.
pub const DEFAULT_CONFIG: &str = include_str!("../../../config.default.toml");

/// A configuration error, naming the key at fault.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct ConfigError(String);

fn err(key: impl std::fmt::Display, msg: impl std::fmt::Display) -> ConfigError {
    ConfigError(format!("{key}: {msg}"))
}

/// Everything `serve` needs, validated.
#[derive(Debug, Clone)]
pub struct Settings {
    /// Public listener.
    pub listen: SocketAddr,
    /// Admin listener.
    pub admin_listen: SocketAddr,
    /// Admin bearer token.
    pub admin_token: Secret,
    /// Largest body accepted.
    pub body_limit: usize,
    /// The most of a refused request's body history keeps (`refused_body_limit`).
    pub refused_body_limit: usize,
    /// Time allowed for request headers.
    pub header_timeout: Duration,
    /// Time allowed for a request body.
    pub body_timeout: Duration,
    /// Grace period on shutdown.
    pub shutdown_grace: Duration,
    /// How long the listeners go on taking requests after a stop signal, while `/readyz`
    /// answers 503.
    pub shutdown_delay: Duration,
    /// Log format.
    pub log_format: LogFormat,
    /// Threads of the async runtime; `None` is `"auto"` ([`Settings::runtime_workers`]).
    pub workers: Option<usize>,
    /// TLS on the public listener (`tls_cert`, `tls_key`); `None` serves plain HTTP.
    pub tls: Option<ServerTls>,
    /// `admin_tls`: the admin listener serves TLS too, with the same certificate.
    pub admin_tls: bool,
    /// The store.
    pub store: StoreSettings,
    /// Worker settings.
    pub delivery: DeliverySettings,
    /// Sources by name, resolved.
    pub sources: Vec<Source>,
    /// Destinations, resolved.
    pub destinations: Vec<Destination>,
}

/// The public listener's certificate and key: where they are, read at start and again on
/// `SIGHUP` (after a renewal), so that a file replaced later is read then.
#[derive(Clone)]
pub struct ServerTls {
    /// `tls_cert`: the certificate chain, PEM, resolved against the configuration's
    /// directory.
    pub cert_file: std::path::PathBuf,
    /// `tls_key`: a secret reference (`file:…`, `env:…`) to the private key, PEM.
    key_reference: String,
    /// The configuration file's directory, for a relative `file:` reference.
    base_dir: Option<std::path::PathBuf>,
}

impl std::fmt::Debug for ServerTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServerTls")
            .field("cert_file", &self.cert_file)
            .finish_non_exhaustive()
    }
}

impl ServerTls {
    /// Reads the certificate chain and the key: `(certificate PEM, key)`. Errors name the file,
    /// never the key.
    pub fn read(&self, env: &HashMap<String, String>) -> Result<(String, Secret), ConfigError> {
        let cert_pem = std::fs::read_to_string(&self.cert_file).map_err(|e| {
            err(
                "server.tls_cert",
                format!("reading {}: {e}", self.cert_file.display()),
            )
        })?;
        let key = read_secret(
            "server.tls_key",
            &self.key_reference,
            env,
            self.base_dir.as_deref(),
        )?;
        Ok((cert_pem, key))
    }

    /// [`ServerTls::read`], then the chain and key as rustls serves them, checked: the
    /// certificates parse and the key is the first one's.
    pub fn certified_key(
        &self,
        env: &HashMap<String, String>,
    ) -> Result<rustls::sign::CertifiedKey, ConfigError> {
        let (cert_pem, key_pem) = self.read(env)?;
        crate::tls_files::certified_key(&ClientIdentity { cert_pem, key_pem })
            .map_err(|e| err("server.tls_cert", e))
    }
}

/// `[server] tls_cert` and `tls_key`: both or neither, read and checked once here.
fn server_tls(
    s: &RawServer,
    env: &HashMap<String, String>,
    base_dir: Option<&Path>,
) -> Result<Option<ServerTls>, ConfigError> {
    let (cert, key) = match (&s.tls_cert, &s.tls_key) {
        (None, None) => return Ok(None),
        (Some(_), None) => {
            return Err(err(
                "server.tls_key",
                "is required with server.tls_cert (the certificate's private key)",
            ))
        }
        (None, Some(_)) => {
            return Err(err(
                "server.tls_cert",
                "is required with server.tls_key (the key's certificate chain)",
            ))
        }
        (Some(cert), Some(key)) => (cert, key),
    };
    let tls = ServerTls {
        cert_file: resolve_path(cert, base_dir),
        key_reference: key.clone(),
        base_dir: base_dir.map(Path::to_path_buf),
    };
    tls.certified_key(env)?;
    Ok(Some(tls))
}

/// How logs are written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogFormat {
    /// Human-readable lines.
    Human,
    /// One JSON object per line.
    Json,
}

/// Which backend, chosen by the URL's scheme.
#[derive(Debug, Clone)]
pub enum StoreBackend {
    /// The embedded SQLite file.
    #[cfg(feature = "sqlite")]
    Sqlite(hooklatch_store_sqlite::SqliteOptions),
    /// A PostgreSQL database shared by any number of gateway instances.
    #[cfg(feature = "postgres")]
    Postgres(hooklatch_store_postgres::PgOptions),
}

/// Store settings.
#[derive(Debug, Clone)]
pub struct StoreSettings {
    /// The backend.
    pub backend: StoreBackend,
    /// How long history is kept.
    pub history_retention: Duration,
    /// How often the purge runs.
    pub purge_interval: Duration,
    /// An external key store (Redis mode); `None` keeps keys in the store.
    pub keys: Option<KeySettings>,
}

/// Redis mode: where the keys live and how long an in-flight claim is held.
#[derive(Clone)]
pub struct KeySettings {
    /// `redis://…` (may hold a password: never printed).
    pub url: String,
    /// Prefix of every key.
    pub prefix: String,
    /// The in-flight lease.
    pub lease: Duration,
    /// With a `rediss://` URL: the CA that replaces the built-in roots (`keys_ca_file`) and
    /// the client certificate (`keys_client_cert`, `keys_client_key`).
    pub tls: TlsFiles,
}

impl std::fmt::Debug for KeySettings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KeySettings")
            .field("url", &hooklatch_keys_redis::describe_url(&self.url))
            .field("prefix", &self.prefix)
            .field("lease", &self.lease)
            .field("tls", &self.tls)
            .finish()
    }
}

/// Delivery worker settings.
#[derive(Debug, Clone)]
pub struct DeliverySettings {
    /// Whether this instance delivers. Off: it ingests and queues only, and another instance
    /// on the same store delivers (or this one, once restarted with it on).
    pub enabled: bool,
    /// Deliveries in flight at once.
    pub concurrency: usize,
    /// Idle poll interval.
    pub poll_interval: Duration,
    /// New deliveries go to this instance's worker in memory while it is caught up
    /// (`hooklatch_http::handoff`).
    pub handoff: bool,
}

/// A destination, resolved.
#[derive(Debug, Clone)]
pub struct Destination {
    /// Its name.
    pub name: String,
    /// Where and how deliveries go.
    pub kind: DestinationKind,
    /// Time allowed for one attempt.
    pub timeout: Duration,
    /// Retries.
    pub retry: RetryPolicy,
    /// An HTTP destination answering `410 Gone` is disabled (`disable_on_gone`, default on):
    /// its deliveries wait, uncounted, until an operator enables it.
    pub disable_on_gone: bool,
    /// What an HTTP or `listen` destination gets of the provider's own signature
    /// (`provider_signature`).
    pub provider_signature: ProviderSignature,
}

/// What a destination gets of the provider's own signature, for providers whose signature
/// covers a timestamp that the application's library holds to a tolerance (Stripe, Slack,
/// Paddle, Standard Webhooks: 300 s, Paddle's SDK 5 s). A delivery late by more than that —
/// a retry, a redrive, a laptop that was asleep — fails the application's check unless signed
/// again.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ProviderSignature {
    /// `"fresh"` (the default): signed again at each attempt, in the provider's scheme, at the
    /// attempt's time, with the source's secret that signed the original; a request none of
    /// them signed (an imported capture without its signature) goes as received.
    #[default]
    Fresh,
    /// `"original"`: the provider's headers exactly as received.
    Original,
}

impl ProviderSignature {
    /// As written in the configuration.
    pub fn as_str(self) -> &'static str {
        match self {
            ProviderSignature::Fresh => "fresh",
            ProviderSignature::Original => "original",
        }
    }
}

/// What a destination is: an HTTP endpoint (`url`), a RabbitMQ exchange (`amqp`), or a
/// developer's machine connected with `hooklatch listen` (`listen_token`).
#[derive(Debug, Clone)]
pub enum DestinationKind {
    /// POST to an HTTP endpoint.
    Http {
        /// Where to POST.
        url: reqwest::Url,
        /// Signs deliveries (Standard Webhooks scheme) when set.
        secret: Option<Secret>,
        /// The special addresses (loopback, private, link-local, …) deliveries may reach:
        /// `allow`.
        allow: AddressPolicy,
        /// With an `https://` url: a CA trusted besides the built-in roots (`ca_file`) and a
        /// client certificate (`client_cert`, `client_key`).
        tls: TlsFiles,
    },
    /// Publish to a RabbitMQ exchange, persistent, confirmed and mandatory.
    Amqp(AmqpSettings),
    /// Hand to the `hooklatch listen` client connected for this destination, which sends it
    /// on to a local URL; while none is connected, deliveries wait in the outbox.
    Listen {
        /// The bearer token a listener presents.
        token: Secret,
        /// Signs deliveries (Standard Webhooks scheme) when set, as for HTTP.
        secret: Option<Secret>,
    },
}

impl StoreSettings {
    /// Lets the store start on settings that can lose acknowledged events (`serve
    /// --allow-unsafe-durability`): on PostgreSQL, as `allow_unsafe_durability=true` in the
    /// URL does. SQLite sets its own durability and has nothing to allow.
    pub fn allow_unsafe_durability(&mut self) {
        match &mut self.backend {
            #[cfg(feature = "sqlite")]
            StoreBackend::Sqlite(_) => {}
            #[cfg(feature = "postgres")]
            StoreBackend::Postgres(opts) => opts.allow_unsafe_durability = true,
        }
    }
}

impl DestinationKind {
    /// The kind's stable name: `http`, `amqp` or `listen`.
    pub fn name(&self) -> &'static str {
        match self {
            DestinationKind::Http { .. } => "http",
            DestinationKind::Amqp(_) => "amqp",
            DestinationKind::Listen { .. } => "listen",
        }
    }
}

/// A RabbitMQ destination's settings.
#[derive(Clone)]
pub struct AmqpSettings {
    /// `amqp://user:password@host:port/vhost`; may hold a password: log [`Self::redacted_url`].
    pub url: Secret,
    /// Other nodes of the same cluster (`amqp_fallback`), tried in turn when the one in use
    /// cannot be reached.
    pub fallback: Vec<Secret>,
    /// The exchange (`""`: the default exchange).
    pub exchange: String,
    /// The routing key.
    pub routing_key: String,
    /// Declare the exchange (durable) on connection.
    pub declare: bool,
    /// With `declare`: a durable queue to declare and bind.
    pub queue: Option<String>,
    /// With `queue`: a quorum queue.
    pub quorum: bool,
    /// With `queue`: its `x-max-length`, publishes past it refused and retried
    /// (`x-overflow: reject-publish`).
    pub max_length: Option<u32>,
    /// With `quorum`: its `x-delivery-limit`.
    pub delivery_limit: Option<u32>,
    /// With `queue`: its `x-dead-letter-exchange` (at-least-once on a quorum queue).
    pub dead_letter_exchange: Option<String>,
    /// What `amqps://` URLs trust besides the built-in roots (`ca_file`) and the client
    /// certificate they present (`client_cert`, `client_key`); read and checked at load.
    pub tls: TlsFiles,
}

impl AmqpSettings {
    /// The URL as text (it was checked to be UTF-8).
    pub fn url_text(&self) -> &str {
        self.url.expose_text().unwrap_or_default()
    }

    /// The URL with its password replaced by `***`, for logs.
    pub fn redacted_url(&self) -> String {
        hooklatch_queue_rabbitmq::redact_url(self.url_text())
    }
}

impl std::fmt::Debug for AmqpSettings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let fallback: Vec<String> = self
            .fallback
            .iter()
            .map(|url| hooklatch_queue_rabbitmq::redact_url(url.expose_text().unwrap_or_default()))
            .collect();
        f.debug_struct("AmqpSettings")
            .field("url", &self.redacted_url())
            .field("fallback", &fallback)
            .field("exchange", &self.exchange)
            .field("routing_key", &self.routing_key)
            .field("declare", &self.declare)
            .field("queue", &self.queue)
            .field("quorum", &self.quorum)
            .field("max_length", &self.max_length)
            .field("delivery_limit", &self.delivery_limit)
            .field("dead_letter_exchange", &self.dead_letter_exchange)
            .field("tls", &self.tls)
            .finish()
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawConfig {
    server: RawServer,
    store: RawStore,
    delivery: RawDelivery,
    sources: Vec<RawSource>,
    destinations: Vec<RawDestination>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawServer {
    listen: String,
    admin_listen: String,
    admin_token: Option<String>,
    body_limit: Value,
    refused_body_limit: Value,
    header_timeout: Value,
    body_timeout: Value,
    shutdown_grace: Value,
    shutdown_delay: Value,
    log_format: String,
    workers: Value,
    tls_cert: Option<String>,
    tls_key: Option<String>,
    admin_tls: Option<bool>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawStore {
    url: String,
    history_retention: Value,
    purge_interval: Value,
    keys: String,
    keys_ca_file: Option<String>,
    keys_client_cert: Option<String>,
    keys_client_key: Option<String>,
    key_prefix: String,
    key_lease: Value,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawDelivery {
    enabled: bool,
    concurrency: i64,
    poll_interval: Value,
    handoff: bool,
    timeout: Value,
    max_attempts: i64,
    initial_backoff: Value,
    max_backoff: Value,
    jitter: f64,
    max_age: Value,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawSource {
    name: String,
    provider: String,
    #[serde(default)]
    secrets: Vec<String>,
    #[serde(default)]
    destinations: Vec<String>,
    tolerance: Option<Value>,
    retention: Option<Value>,
    signature_header: Option<String>,
    signature_encoding: Option<String>,
    signature_prefix: Option<String>,
    key_header: Option<String>,
    key_pointer: Option<String>,
    type_header: Option<String>,
    type_pointer: Option<String>,
    public_url: Option<String>,
    verify_token: Option<String>,
    public_key: Option<String>,
    deferred_response: Option<String>,
    interactive_key: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawDestination {
    name: String,
    url: Option<String>,
    secret: Option<String>,
    amqp: Option<String>,
    amqp_fallback: Option<Vec<String>>,
    ca_file: Option<String>,
    client_cert: Option<String>,
    client_key: Option<String>,
    listen_token: Option<String>,
    allow: Option<Vec<String>>,
    exchange: Option<String>,
    routing_key: Option<String>,
    declare: Option<bool>,
    queue: Option<String>,
    quorum: Option<bool>,
    max_length: Option<i64>,
    delivery_limit: Option<i64>,
    dead_letter_exchange: Option<String>,
    timeout: Option<Value>,
    max_attempts: Option<i64>,
    initial_backoff: Option<Value>,
    max_backoff: Option<Value>,
    jitter: Option<f64>,
    max_age: Option<Value>,
    disable_on_gone: Option<bool>,
    provider_signature: Option<String>,
}

/// The keys only an `amqp` destination takes, and whether `rd` sets each.
fn amqp_only_keys(rd: &RawDestination) -> [(&'static str, bool); 9] {
    [
        ("amqp_fallback", rd.amqp_fallback.is_some()),
        ("exchange", rd.exchange.is_some()),
        ("routing_key", rd.routing_key.is_some()),
        ("declare", rd.declare.is_some()),
        ("queue", rd.queue.is_some()),
        ("quorum", rd.quorum.is_some()),
        ("max_length", rd.max_length.is_some()),
        ("delivery_limit", rd.delivery_limit.is_some()),
        ("dead_letter_exchange", rd.dead_letter_exchange.is_some()),
    ]
}

/// An optional count of the declared queue's at `field`, checked: 1 to 2³¹ − 1.
fn queue_count(field: String, value: Option<i64>) -> Result<Option<u32>, ConfigError> {
    value
        .map(|n| {
            u32::try_from(n)
                .ok()
                .filter(|n| (1..=i32::MAX as u32).contains(n))
                .ok_or_else(|| err(field, format!("{n}: expected 1 to {}", i32::MAX)))
        })
        .transpose()
}

/// A destination's optional Standard Webhooks signing `secret`, checked.
fn signing_secret(
    key: &str,
    rd: &RawDestination,
    env: &HashMap<String, String>,
    base_dir: Option<&Path>,
) -> Result<Option<Secret>, ConfigError> {
    let secret = rd
        .secret
        .as_deref()
        .map(|s| read_secret(&format!("{key}.secret"), s, env, base_dir))
        .transpose()?;
    if secret.as_ref().is_some_and(|s| decode_secret(s).is_none()) {
        return Err(err(
            format!("{key}.secret"),
            "a secret starting with whsec_ must continue with base64 (Standard Webhooks format)",
        ));
    }
    Ok(secret)
}

/// A `listen_token` destination, checked: no `url` nor `amqp`, no broker keys, a token long
/// enough to be a secret.
fn listen_kind(
    key: &str,
    rd: &RawDestination,
    reference: &str,
    env: &HashMap<String, String>,
    base_dir: Option<&Path>,
) -> Result<DestinationKind, ConfigError> {
    let other = [("url", rd.url.is_some()), ("amqp", rd.amqp.is_some())];
    if let Some((field, _)) = other.iter().find(|(_, set)| *set) {
        return Err(err(
            format!("{key}.{field}"),
            "a listen destination (listen_token) has no url or amqp: its listener says where events go",
        ));
    }
    if let Some((field, _)) = amqp_only_keys(rd).iter().find(|(_, set)| *set) {
        return Err(err(
            format!("{key}.{field}"),
            "applies only to amqp destinations",
        ));
    }
    if rd.allow.is_some() {
        return Err(err(
            format!("{key}.allow"),
            "applies only to HTTP destinations (a listener chooses where its deliveries go)",
        ));
    }
    let tls = [
        ("ca_file", rd.ca_file.is_some()),
        ("client_cert", rd.client_cert.is_some()),
        ("client_key", rd.client_key.is_some()),
    ];
    if let Some((field, _)) = tls.iter().find(|(_, set)| *set) {
        return Err(err(
            format!("{key}.{field}"),
            "applies only to url and amqp destinations (the listener connects to the gateway, \
             not the gateway to it)",
        ));
    }
    let token = read_secret(&format!("{key}.listen_token"), reference, env, base_dir)?;
    if token.expose().len() < 16 {
        return Err(err(
            format!("{key}.listen_token"),
            "must be at least 16 characters (generate one with `openssl rand -hex 32`)",
        ));
    }
    let secret = signing_secret(key, rd, env, base_dir)?;
    Ok(DestinationKind::Listen { token, secret })
}

/// A destination's `url` (HTTP) or `amqp` (RabbitMQ) half, checked: exactly one of the two,
/// and only the keys of that kind.
fn destination_kind(
    key: &str,
    rd: &RawDestination,
    env: &HashMap<String, String>,
    base_dir: Option<&Path>,
) -> Result<DestinationKind, ConfigError> {
    if let Some(reference) = &rd.listen_token {
        return listen_kind(key, rd, reference, env, base_dir);
    }
    match (&rd.url, &rd.amqp) {
        (Some(_), Some(_)) => Err(err(
            format!("{key}.amqp"),
            "a destination has either url (HTTP) or amqp (RabbitMQ), not both",
        )),
        (None, None) => Err(err(
            format!("{key}.url"),
            "is required (or amqp = \"amqp://…\" for a RabbitMQ destination, or \
             listen_token = \"env:…\" for a `hooklatch listen` client)",
        )),
        (Some(raw_url), None) => {
            if let Some((field, _)) = amqp_only_keys(rd).iter().find(|(_, set)| *set) {
                return Err(err(
                    format!("{key}.{field}"),
                    "applies only to amqp destinations",
                ));
            }
            let url = reqwest::Url::parse(raw_url).map_err(|e| err(format!("{key}.url"), e))?;
            if !matches!(url.scheme(), "http" | "https") {
                return Err(err(format!("{key}.url"), "must be http:// or https://"));
            }
            let secret = signing_secret(key, rd, env, base_dir)?;
            let allow = AddressPolicy::new(
                rd.allow
                    .iter()
                    .flatten()
                    .map(|entry| {
                        AddressPolicy::parse_entry(entry)
                            .map_err(|e| err(format!("{key}.allow"), e))
                    })
                    .collect::<Result<_, _>>()?,
            );
            if let Err(blocked) = crate::outbound::check_literal(&url, &allow) {
                return Err(err(
                    format!("{key}.url"),
                    format!(
                        "{blocked}: deliveries reach such addresses only when allowed, e.g. \
                         allow = [\"{}\"]",
                        blocked.ip
                    ),
                ));
            }
            let tls = tls_files(
                &destination_tls_keys(key, rd),
                url.scheme() == "https",
                "this destination's url is http://",
                env,
                base_dir,
            )?;
            Ok(DestinationKind::Http {
                url,
                secret,
                allow,
                tls,
            })
        }
        (None, Some(reference)) => {
            if rd.allow.is_some() {
                return Err(err(
                    format!("{key}.allow"),
                    "applies only to HTTP destinations (the broker's address is the operator's choice)",
                ));
            }
            if rd.secret.is_some() {
                return Err(err(
                    format!("{key}.secret"),
                    "applies only to HTTP destinations (amqp messages carry message_id instead)",
                ));
            }
            let url = amqp_url(&format!("{key}.amqp"), reference, env, base_dir)?;
            let fallback = rd
                .amqp_fallback
                .iter()
                .flatten()
                .enumerate()
                .map(|(i, reference)| {
                    amqp_url(
                        &format!("{key}.amqp_fallback[{i}]"),
                        reference,
                        env,
                        base_dir,
                    )
                })
                .collect::<Result<Vec<_>, _>>()?;
            let exchange = rd.exchange.clone().ok_or_else(|| {
                err(
                    format!("{key}.exchange"),
                    "is required for an amqp destination (\"\" for the default exchange)",
                )
            })?;
            let routing_key = rd.routing_key.clone().ok_or_else(|| {
                err(
                    format!("{key}.routing_key"),
                    "is required for an amqp destination",
                )
            })?;
            let declare = rd.declare.unwrap_or(false);
            if rd.queue.is_some() && !declare {
                return Err(err(
                    format!("{key}.queue"),
                    "is declared only with declare = true",
                ));
            }
            if rd.queue.as_deref() == Some("") {
                return Err(err(format!("{key}.queue"), "is empty"));
            }
            if rd.quorum.is_some() && rd.queue.is_none() {
                return Err(err(format!("{key}.quorum"), "applies only with queue"));
            }
            for (name, set) in [
                ("max_length", rd.max_length.is_some()),
                ("dead_letter_exchange", rd.dead_letter_exchange.is_some()),
            ] {
                if set && rd.queue.is_none() {
                    return Err(err(format!("{key}.{name}"), "applies only with queue"));
                }
            }
            if rd.delivery_limit.is_some() && rd.quorum != Some(true) {
                return Err(err(
                    format!("{key}.delivery_limit"),
                    "applies only with quorum = true",
                ));
            }
            if rd.dead_letter_exchange.as_deref() == Some("") {
                return Err(err(format!("{key}.dead_letter_exchange"), "is empty"));
            }
            let max_length = queue_count(format!("{key}.max_length"), rd.max_length)?;
            let delivery_limit = queue_count(format!("{key}.delivery_limit"), rd.delivery_limit)?;
            let tls_urls = std::iter::once(&url)
                .chain(&fallback)
                .any(|u| hooklatch_queue_rabbitmq::is_tls_url(u.expose_text().unwrap_or_default()));
            let tls = tls_files(
                &destination_tls_keys(key, rd),
                tls_urls,
                "this destination's URLs are all amqp://",
                env,
                base_dir,
            )?;
            if declare && exchange.is_empty() && rd.queue.is_none() {
                return Err(err(
                    format!("{key}.declare"),
                    "the default exchange (\"\") cannot be declared; set queue, or declare = false",
                ));
            }
            Ok(DestinationKind::Amqp(AmqpSettings {
                url,
                fallback,
                exchange,
                routing_key,
                declare,
                queue: rd.queue.clone(),
                quorum: rd.quorum.unwrap_or(false),
                max_length,
                delivery_limit,
                dead_letter_exchange: rd.dead_letter_exchange.clone(),
                tls,
            }))
        }
    }
}

/// A destination's TLS keys: `ca_file`, `client_cert`, `client_key`, for its `url` (https://)
/// or its `amqp` URLs (amqps://).
fn destination_tls_keys<'a>(key: &str, rd: &'a RawDestination) -> TlsKeys<'a> {
    TlsKeys {
        prefix: format!("{key}."),
        ca_file: rd.ca_file.as_deref(),
        client_cert: rd.client_cert.as_deref(),
        client_key: rd.client_key.as_deref(),
    }
}

/// A connection's TLS keys as written: `{prefix}ca_file` (PEM certificates, a path),
/// `{prefix}client_cert` (a path) and `{prefix}client_key` (a secret reference).
struct TlsKeys<'a> {
    /// What comes before `ca_file` in the keys' names: `destinations[0].amqp_`, `store.keys_`.
    prefix: String,
    ca_file: Option<&'a str>,
    client_cert: Option<&'a str>,
    client_key: Option<&'a str>,
}

/// A connection's TLS files, read and checked: the CA file; the client certificate with its
/// key, both or neither; any of them only when the connection uses TLS (`tls`), so that no
/// one reads a CA file in the configuration of a connection that sends plain text (`plain`
/// says why it does). Relative paths are from the configuration file's directory.
fn tls_files(
    keys: &TlsKeys<'_>,
    tls: bool,
    plain: &str,
    env: &HashMap<String, String>,
    base_dir: Option<&Path>,
) -> Result<TlsFiles, ConfigError> {
    let p = &keys.prefix;
    let set = [
        ("ca_file", keys.ca_file.is_some()),
        ("client_cert", keys.client_cert.is_some()),
        ("client_key", keys.client_key.is_some()),
    ];
    if let Some((name, _)) = set.iter().find(|(_, set)| *set) {
        if !tls {
            return Err(err(
                format!("{p}{name}"),
                format!("applies only to TLS connections; {plain}, which sends everything in plain text"),
            ));
        }
    }
    let read = |name: &str, path: &str| -> Result<String, ConfigError> {
        let path = resolve_path(path, base_dir);
        std::fs::read_to_string(&path).map_err(|e| {
            err(
                format!("{p}{name}"),
                format!("reading {}: {e}", path.display()),
            )
        })
    };
    let ca_pem = match keys.ca_file {
        None => None,
        Some(path) => {
            let pem = read("ca_file", path)?;
            crate::tls_files::check_ca_pem(&pem)
                .map_err(|e| err(format!("{p}ca_file"), format!("{path}: {e}")))?;
            Some(pem)
        }
    };
    let client = match (keys.client_cert, keys.client_key) {
        (None, None) => None,
        (Some(_), None) => {
            return Err(err(
                format!("{p}client_key"),
                format!("is required with {p}client_cert (the certificate's private key)"),
            ))
        }
        (None, Some(_)) => {
            return Err(err(
                format!("{p}client_cert"),
                format!("is required with {p}client_key (the key's certificate)"),
            ))
        }
        (Some(cert), Some(reference)) => {
            let identity = ClientIdentity {
                cert_pem: read("client_cert", cert)?,
                key_pem: read_secret(&format!("{p}client_key"), reference, env, base_dir)?,
            };
            crate::tls_files::check_client_identity(&identity)
                .map_err(|e| err(format!("{p}client_cert"), e))?;
            Some(identity)
        }
    };
    Ok(TlsFiles { ca_pem, client })
}

/// An AMQP URL (or a reference to one) at `field`, checked: `amqp://` or `amqps://`, parseable.
/// Errors never show its password.
fn amqp_url(
    field: &str,
    reference: &str,
    env: &HashMap<String, String>,
    base_dir: Option<&Path>,
) -> Result<Secret, ConfigError> {
    let url = read_secret(field, reference, env, base_dir)?;
    let text = url
        .expose_text()
        .ok_or_else(|| err(field.to_owned(), "is not UTF-8"))?;
    // The rest of the URL (its password) is never shown.
    if !text.starts_with("amqp://") && !text.starts_with("amqps://") {
        return Err(err(
            field.to_owned(),
            "must be an amqp:// URL (or amqps:// for TLS)",
        ));
    }
    if !hooklatch_queue_rabbitmq::is_valid_url(text) {
        return Err(err(
            field.to_owned(),
            format!(
                "is not a valid AMQP URL: {}",
                hooklatch_queue_rabbitmq::redact_url(text)
            ),
        ));
    }
    Ok(url)
}

/// Default signed-timestamp tolerance (Stripe's and Standard Webhooks' libraries use 300 s).
const DEFAULT_TOLERANCE: Duration = Duration::from_secs(300);

/// Loads the layers and resolves them. `env` is the process environment (passed in for tests).
pub fn load(file: Option<&Path>, env: &HashMap<String, String>) -> Result<Settings, ConfigError> {
    read(file, env, |raw| {
        resolve(raw, env, file.and_then(Path::parent))
    })
}

/// The log format a configuration asks for, read as far as it can be when the configuration
/// does not load (`serve` then says why in that format): `HOOKLATCH_SERVER__LOG_FORMAT`, else
/// the file's `server.log_format` if the file is TOML at all; human otherwise.
pub fn log_format_hint(file: Option<&Path>, env: &HashMap<String, String>) -> LogFormat {
    let from_file = || {
        let text = std::fs::read_to_string(file?).ok()?;
        let doc: Value = toml::from_str(&text).ok()?;
        doc.get("server")?
            .get("log_format")?
            .as_str()
            .map(str::to_owned)
    };
    let asked = match env.get("HOOKLATCH_SERVER__LOG_FORMAT") {
        Some(value) => Some(value.trim().trim_matches('"').to_owned()),
        None => from_file(),
    };
    match asked.as_deref() {
        Some("json") => LogFormat::Json,
        _ => LogFormat::Human,
    }
}

/// The store's settings alone, for a verb that opens the store and nothing else (`migrate`):
/// the whole file is checked as `load` checks its shape, but no secret outside `[store]` is
/// read, so one that is not set where the verb runs (a provider's signing secret, the admin
/// token) is no error.
pub fn load_store(
    file: Option<&Path>,
    env: &HashMap<String, String>,
) -> Result<StoreSettings, ConfigError> {
    read(file, env, |raw| {
        store_settings(&raw, env, file.and_then(Path::parent))
    })
}

/// Where a gateway's admin API is, and its token unless `token` is false (the caller has one):
/// for the admin verbs, which need no other secret of the file.
pub fn load_admin(
    file: Option<&Path>,
    env: &HashMap<String, String>,
    token: bool,
) -> Result<AdminSettings, ConfigError> {
    let base_dir = file.and_then(Path::parent);
    read(file, env, |raw| {
        Ok(AdminSettings {
            admin_listen: parse_addr("server.admin_listen", &raw.server.admin_listen)?,
            admin_tls: admin_tls(&raw.server)?,
            admin_token: token
                .then(|| admin_token(&raw.server, env, base_dir))
                .transpose()?,
        })
    })
}

/// What the admin verbs need of a configuration ([`load_admin`]).
#[derive(Debug, Clone)]
pub struct AdminSettings {
    /// `server.admin_listen`.
    pub admin_listen: SocketAddr,
    /// `server.admin_tls`.
    pub admin_tls: bool,
    /// `server.admin_token`, when asked for.
    pub admin_token: Option<Secret>,
}

/// A source as an export sees it: which provider its captures came from and which headers
/// carry their signatures.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SourceOutline {
    /// The source's name (`/in/{name}`).
    pub name: String,
    /// Its provider (`stripe`, `generic`, ...).
    pub provider: String,
    /// The headers its provider signs in ([`ProviderAdapter::signature_headers`]).
    pub signature_headers: Vec<String>,
}

impl Settings {
    /// Every source's outline.
    pub fn outlines(&self) -> Vec<SourceOutline> {
        self.sources
            .iter()
            .map(|s| SourceOutline {
                name: s.name.as_str().to_owned(),
                provider: s.adapter.provider().to_owned(),
                signature_headers: s
                    .adapter
                    .signature_headers()
                    .into_iter()
                    .map(str::to_owned)
                    .collect(),
            })
            .collect()
    }
}

/// The sources' outlines alone, for `events export`, which reads no secret: a provider's
/// signing secret need not be set where history is exported.
pub fn load_outlines(
    file: Option<&Path>,
    env: &HashMap<String, String>,
) -> Result<Vec<SourceOutline>, ConfigError> {
    read(file, env, outlines)
}

fn outlines(raw: RawConfig) -> Result<Vec<SourceOutline>, ConfigError> {
    let mut outlines = Vec::with_capacity(raw.sources.len());
    for (i, rs) in raw.sources.iter().enumerate() {
        let signature_headers = match (rs.provider.as_str(), &rs.signature_header) {
            ("generic", Some(header)) => vec![header.clone()],
            ("generic", None) => {
                return Err(err(
                    format!("sources[{i}].signature_header"),
                    "is required for a generic source",
                ))
            }
            (provider, _) => crate::fixtures::signer(provider, &Secret::from_text(""))
                .ok_or_else(|| {
                    err(
                        format!("sources[{i}].provider"),
                        format!("unknown provider {provider:?}"),
                    )
                })?
                .signature_headers()
                .into_iter()
                .map(str::to_owned)
                .collect(),
        };
        outlines.push(SourceOutline {
            name: rs.name.clone(),
            provider: rs.provider.clone(),
            signature_headers,
        });
    }
    Ok(outlines)
}

impl From<&Settings> for AdminSettings {
    fn from(s: &Settings) -> AdminSettings {
        AdminSettings {
            admin_listen: s.admin_listen,
            admin_tls: s.admin_tls,
            admin_token: Some(s.admin_token.clone()),
        }
    }
}

/// The layers read ([`raw`]) and handed to `then`; a mistake `then` finds in a value an
/// environment variable set is blamed on that variable, as [`raw`] blames a value of the
/// wrong type.
fn read<T>(
    file: Option<&Path>,
    env: &HashMap<String, String>,
    then: impl FnOnce(RawConfig) -> Result<T, ConfigError>,
) -> Result<T, ConfigError> {
    let (raw, overridden) = raw(file, env)?;
    let names: Vec<(&str, Vec<String>)> = vec![
        (
            "source",
            raw.sources.iter().map(|s| s.name.clone()).collect(),
        ),
        (
            "destination",
            raw.destinations.iter().map(|d| d.name.clone()).collect(),
        ),
    ];
    then(raw).map_err(|ConfigError(msg)| {
        let msg = with_name(msg, &names);
        let var = overridden.iter().find_map(|(set, var)| {
            let rest = msg.strip_prefix(set.as_str())?;
            [":", ".", "["]
                .iter()
                .any(|next| rest.starts_with(next))
                .then_some(var)
        });
        match var {
            Some(var) => ConfigError(format!("{var}: {msg}")),
            None => ConfigError(msg),
        }
    })
}

/// `msg` about `sources[i]…` or `destinations[i]…` with that entry's name added at its end,
/// so that the fifth of nine destinations is found by the name the operator gave it.
fn with_name(msg: String, names: &[(&str, Vec<String>)]) -> String {
    for (kind, list) in names {
        let Some(rest) = msg.strip_prefix(&format!("{kind}s[")) else {
            continue;
        };
        let name = rest
            .split_once(']')
            .and_then(|(index, _)| index.parse::<usize>().ok())
            .and_then(|i| list.get(i))
            .filter(|name| !name.is_empty());
        if let Some(name) = name {
            return format!("{msg} (the {kind} named {name:?})");
        }
    }
    msg
}

/// The keys environment variables set (`store.url`, `sources[0].tolerance`), each with its
/// variable's name.
type Overridden<'e> = Vec<(String, &'e str)>;

/// The layers merged (the defaults, the file, the environment) and read into their types, with
/// the keys each environment variable set; no value resolved yet, no secret read.
fn raw<'e>(
    file: Option<&Path>,
    env: &'e HashMap<String, String>,
) -> Result<(RawConfig, Overridden<'e>), ConfigError> {
    let mut doc: Value = toml::from_str(DEFAULT_CONFIG)
        .map_err(|e| ConfigError(format!("built-in defaults: {e}")))?;
    if let Some(path) = file {
        let text = std::fs::read_to_string(path)
            .map_err(|e| ConfigError(format!("reading {}: {e}", path.display())))?;
        let overlay: Value = toml::from_str(&text)
            .map_err(|e| ConfigError(format!("{}: {}", path.display(), syntax_error(&text, &e))))?;
        merge(&mut doc, overlay);
    }
    let overridden = apply_env(&mut doc, env)?;
    let raw: RawConfig = serde_path_to_error::deserialize(doc).map_err(|e| {
        let path = e.path().to_string();
        // A value an environment variable set is that variable's fault, not the file's.
        let origin = overridden
            .iter()
            .find(|(set, _)| {
                path == *set
                    || path.starts_with(&format!("{set}."))
                    || path.starts_with(&format!("{set}["))
            })
            .map(|(_, var)| var.to_string())
            .or_else(|| file.map(|p| p.display().to_string()))
            .unwrap_or_else(|| "configuration".to_owned());
        ConfigError(format!(
            "{origin}: {path}: {}",
            readable(&without_values(e.inner().message().trim()))
        ))
    })?;
    Ok((raw, overridden))
}

/// A TOML syntax error without the line it quotes: that line may hold a secret written in the
/// file (`secrets = ["whsec_…"`), and the message goes to logs. Its place and reason are enough
/// to find it.
fn syntax_error(text: &str, err: &toml::de::Error) -> String {
    let message = without_strings(err.message().trim());
    let Some(at) = err.span().map(|span| span.start.min(text.len())) else {
        return format!("not valid TOML: {message}");
    };
    // The span counts bytes; a position inside a character counts as that character's.
    let at = (0..=at)
        .rev()
        .find(|i| text.is_char_boundary(*i))
        .unwrap_or(0);
    let before = &text[..at];
    let line = before.matches('\n').count() + 1;
    let column = before.rsplit('\n').next().map_or(0, |l| l.chars().count()) + 1;
    format!("not valid TOML at line {line}, column {column}: {message}")
}

/// `message` with every value it quotes left out — serde's `string "…"`, and its `integer
/// `…``, `floating point `…``, `boolean `…`` and `character `…``: a value of the wrong type
/// may be a secret in the wrong place (a token of digits alone reads as a number).
/// serde's wording made a reader's: a mistyped key names the key it most likely meant (its
/// "expected one of" lists every key of the table), and Rust's type names are said in words.
fn readable(message: &str) -> String {
    let mut out = message.to_owned();
    for (rust, words) in [
        ("expected i64", "expected a whole number"),
        ("expected u64", "expected a whole number"),
        ("expected u32", "expected a whole number"),
        ("expected usize", "expected a whole number"),
        ("expected f64", "expected a number"),
    ] {
        out = out.replace(rust, words);
    }
    let Some(rest) = out.strip_prefix("unknown field `") else {
        return out;
    };
    let Some((field, known)) = rest.split_once("`, expected one of ") else {
        return out;
    };
    let known: Vec<&str> = known.split(", ").map(|k| k.trim_matches('`')).collect();
    let closest = known
        .iter()
        .map(|k| (edit_distance(field, k), *k))
        .min()
        .filter(|(d, _)| *d <= (field.chars().count() / 3).max(1));
    match closest {
        Some((_, k)) => format!("unknown field `{field}`: did you mean `{k}`?"),
        None => format!(
            "unknown field `{field}`; the keys here are {}",
            known.join(", ")
        ),
    }
}

/// Levenshtein distance between two short strings, by characters.
fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut diagonal = row[0];
        row[0] = i + 1;
        for (j, cb) in b.iter().enumerate() {
            let above = row[j + 1];
            row[j + 1] = (above + 1)
                .min(row[j] + 1)
                .min(diagonal + usize::from(ca != *cb));
            diagonal = above;
        }
    }
    row[b.len()]
}

fn without_values(message: &str) -> String {
    let mut out = without_strings(message);
    for kind in ["integer", "floating point", "boolean", "character"] {
        let quoted = format!("{kind} `");
        while let Some(start) = out.find(&quoted) {
            let value = start + quoted.len();
            let end = out[value..].find('`').map_or(out.len(), |i| value + i + 1);
            out.replace_range(start..end, &format!("a value of type {kind}"));
        }
    }
    out
}

/// `message` with the text of every string value it quotes (serde's `string "…"`) left out: a
/// value of the wrong type may be a secret in the wrong place.
fn without_strings(message: &str) -> String {
    const QUOTED: &str = "string \"";
    let mut out = String::with_capacity(message.len());
    let mut rest = message;
    while let Some(start) = rest.find(QUOTED) {
        out.push_str(&rest[..start]);
        out.push_str("a string");
        let value = &rest[start + QUOTED.len()..];
        // The value is `Debug`-escaped: its end is the first quote not escaped.
        let mut escaped = false;
        let end = value.char_indices().find_map(|(i, c)| match (escaped, c) {
            (false, '\\') => {
                escaped = true;
                None
            }
            (false, '"') => Some(i + 1),
            _ => {
                escaped = false;
                None
            }
        });
        rest = end.map_or("", |end| &value[end..]);
    }
    out.push_str(rest);
    out
}

/// Tables merge key by key; anything else (arrays included) is replaced.
fn merge(base: &mut Value, overlay: Value) {
    match (base, overlay) {
        (Value::Table(base), Value::Table(overlay)) => {
            for (k, v) in overlay {
                match base.get_mut(&k) {
                    Some(existing) => merge(existing, v),
                    None => {
                        base.insert(k, v);
                    }
                }
            }
        }
        (base, overlay) => *base = overlay,
    }
}

/// Settings whose value is always text: from the environment, never read as a number or a
/// boolean (a token of digits alone stays text).
const TEXT_SETTINGS: &[&str] = &[
    "admin_token",
    "secret",
    "listen_token",
    "verify_token",
    "client_key",
    "amqp",
    "url",
];

/// Settings that hold a list of text: from the environment, a value that is not a TOML list
/// is a list of one (`HOOKLATCH_SOURCES__STRIPE__SECRETS=whsec_…`).
const LIST_SETTINGS: &[&str] = &["secrets", "amqp_fallback", "allow", "destinations"];

/// Environment variables that look meant for a setting but are not read as one: a section's
/// name then a single underscore (`HOOKLATCH_STORE_URL` for `HOOKLATCH_STORE__URL`). Warned
/// about, not refused: such a name may be one a file refers to (`env:HOOKLATCH_STORE_URL`).
pub fn env_warnings(env: &HashMap<String, String>) -> Vec<String> {
    const SECTIONS: [&str; 5] = ["SERVER", "STORE", "DELIVERY", "SOURCES", "DESTINATIONS"];
    let mut names: Vec<&String> = env
        .keys()
        .filter(|k| !k.contains("__"))
        .filter(|k| {
            k.strip_prefix("HOOKLATCH_").is_some_and(|rest| {
                SECTIONS
                    .iter()
                    .any(|s| rest.strip_prefix(s).is_some_and(|r| r.starts_with('_')))
            })
        })
        .collect();
    names.sort();
    names
        .into_iter()
        .map(|name| {
            let (section, key) = name["HOOKLATCH_".len()..]
                .split_once('_')
                .expect("a section then an underscore");
            format!(
                "{name} is not read as a setting: a setting's variable separates its path with \
                 two underscores (HOOKLATCH_{section}__{key})"
            )
        })
        .collect()
}

/// Applies `HOOKLATCH_A__B__C=value`: `a.b.c`, where a segment naming an array of tables
/// selects the element whose `name` matches (case-insensitive, `-` written as `_`). A value
/// is read as TOML (`30`, `true`, `["a", "b"]`), else as text, but for [`TEXT_SETTINGS`] and
/// [`LIST_SETTINGS`]. Returns each setting set, as the path a configuration error names
/// (`sources[0].secrets`), with its variable.
fn apply_env<'e>(
    doc: &mut Value,
    env: &'e HashMap<String, String>,
) -> Result<Vec<(String, &'e str)>, ConfigError> {
    let mut overridden = Vec::new();
    let mut vars: Vec<(&String, &String)> = env
        .iter()
        .filter(|(k, _)| k.starts_with("HOOKLATCH_") && k.contains("__"))
        .collect();
    vars.sort();
    for (var, raw_value) in vars {
        let path: Vec<String> = var["HOOKLATCH_".len()..]
            .split("__")
            .map(str::to_ascii_lowercase)
            .collect();
        let parsed = toml::from_str::<toml::Table>(&format!("v = {raw_value}"))
            .ok()
            .and_then(|mut t| t.remove("v"));
        let mut node = &mut *doc;
        let mut at = String::new();
        let (last, parents) = path.split_last().expect("split yields at least one part");
        for part in parents {
            node = match node {
                Value::Table(t) => {
                    if !at.is_empty() {
                        at.push('.');
                    }
                    at.push_str(part);
                    t.entry(part.clone())
                        .or_insert_with(|| Value::Table(Default::default()))
                }
                Value::Array(items) => {
                    let (i, item) = items
                        .iter_mut()
                        .enumerate()
                        .find(|(_, item)| {
                            item.get("name")
                                .and_then(Value::as_str)
                                .is_some_and(|n| n.replace('-', "_").eq_ignore_ascii_case(part))
                        })
                        .ok_or_else(|| err(var, format!("no entry named {part:?}")))?;
                    at.push_str(&format!("[{i}]"));
                    item
                }
                _ => return Err(err(var, format!("{part:?} is not a section"))),
            };
        }
        let Value::Table(t) = node else {
            return Err(err(var, "does not name a setting"));
        };
        let text = || Value::String(raw_value.clone());
        let list = LIST_SETTINGS.contains(&last.as_str());
        let value = match parsed {
            Some(Value::String(s)) if list => Value::Array(vec![Value::String(s)]),
            Some(parsed @ (Value::String(_) | Value::Array(_) | Value::Table(_))) => parsed,
            _ if list => Value::Array(vec![text()]),
            _ if TEXT_SETTINGS.contains(&last.as_str()) => text(),
            Some(parsed) => parsed,
            None => text(),
        };
        t.insert(last.clone(), value);
        if !at.is_empty() {
            at.push('.');
        }
        at.push_str(last);
        overridden.push((at, var.as_str()));
    }
    Ok(overridden)
}

fn resolve(
    raw: RawConfig,
    env: &HashMap<String, String>,
    base_dir: Option<&Path>,
) -> Result<Settings, ConfigError> {
    let s = &raw.server;
    let listen = parse_addr("server.listen", &s.listen)?;
    let admin_listen = parse_addr("server.admin_listen", &s.admin_listen)?;
    // One port cannot be both (serve would fail to bind the second); an address on every
    // interface overlaps any other of its port.
    let overlap = listen.ip() == admin_listen.ip()
        || listen.ip().is_unspecified()
        || admin_listen.ip().is_unspecified();
    if listen.port() == admin_listen.port() && listen.port() != 0 && overlap {
        return Err(err(
            "server.admin_listen",
            format!(
                "{admin_listen} is server.listen's port ({listen}): the admin API needs a port \
                 of its own (the default is 127.0.0.1:8081)"
            ),
        ));
    }
    let admin_token = admin_token(s, env, base_dir)?;
    let log_format = match s.log_format.as_str() {
        "human" => LogFormat::Human,
        "json" => LogFormat::Json,
        other => {
            return Err(err(
                "server.log_format",
                format!("{other:?}: expected \"human\" or \"json\""),
            ))
        }
    };

    let store = store_settings(&raw, env, base_dir)?;

    let d = &raw.delivery;
    let concurrency = usize::try_from(d.concurrency)
        .ok()
        .filter(|n| (1..=4096).contains(n))
        .ok_or_else(|| err("delivery.concurrency", "must be between 1 and 4096"))?;
    let default_retry = RetryPolicy {
        initial_backoff: positive("delivery.initial_backoff", &d.initial_backoff)?,
        max_backoff: positive("delivery.max_backoff", &d.max_backoff)?,
        max_attempts: attempts("delivery.max_attempts", d.max_attempts)?,
        max_age: positive("delivery.max_age", &d.max_age)?,
        jitter: jitter("delivery.jitter", d.jitter)?,
    };
    let default_timeout = positive("delivery.timeout", &d.timeout)?;
    backoff_in_order("delivery", &default_retry)?;

    let mut destinations = Vec::with_capacity(raw.destinations.len());
    let mut seen = HashSet::new();
    for (i, rd) in raw.destinations.iter().enumerate() {
        let key = format!("destinations[{i}]");
        if rd.name.is_empty() || !seen.insert(rd.name.clone()) {
            return Err(err(
                format!("{key}.name"),
                format!("{:?} is empty or used twice", rd.name),
            ));
        }
        let opt = |field: &str, v: &Option<Value>, default: Duration| match v {
            Some(v) => positive(&format!("{key}.{field}"), v),
            None => Ok(default),
        };
        let retry = RetryPolicy {
            initial_backoff: opt(
                "initial_backoff",
                &rd.initial_backoff,
                default_retry.initial_backoff,
            )?,
            max_backoff: opt("max_backoff", &rd.max_backoff, default_retry.max_backoff)?,
            max_attempts: rd
                .max_attempts
                .map(|n| attempts(&format!("{key}.max_attempts"), n))
                .transpose()?
                .unwrap_or(default_retry.max_attempts),
            max_age: opt("max_age", &rd.max_age, default_retry.max_age)?,
            jitter: rd
                .jitter
                .map(|j| jitter(&format!("{key}.jitter"), j))
                .transpose()?
                .unwrap_or(default_retry.jitter),
        };
        backoff_in_order(&key, &retry)?;
        let kind = destination_kind(&key, rd, env, base_dir)?;
        if rd.disable_on_gone.is_some() && !matches!(kind, DestinationKind::Http { .. }) {
            return Err(err(
                format!("{key}.disable_on_gone"),
                "applies only to HTTP destinations (url)",
            ));
        }
        let provider_signature = match rd.provider_signature.as_deref() {
            _ if rd.provider_signature.is_some() && matches!(kind, DestinationKind::Amqp(_)) => {
                return Err(err(
                    format!("{key}.provider_signature"),
                    "applies only to HTTP and listen destinations (a message carries no \
                     provider headers)",
                ))
            }
            None | Some("fresh") => ProviderSignature::Fresh,
            Some("original") => ProviderSignature::Original,
            Some(other) => {
                return Err(err(
                    format!("{key}.provider_signature"),
                    format!("{other:?}: expected \"fresh\" or \"original\""),
                ))
            }
        };
        destinations.push(Destination {
            name: rd.name.clone(),
            kind,
            timeout: opt("timeout", &rd.timeout, default_timeout)?,
            retry,
            disable_on_gone: rd.disable_on_gone.unwrap_or(true),
            provider_signature,
        });
    }

    let mut sources = Vec::with_capacity(raw.sources.len());
    let mut seen = HashSet::new();
    for (i, rs) in raw.sources.iter().enumerate() {
        let key = format!("sources[{i}]");
        let name = SourceName::parse(&rs.name).map_err(|e| err(format!("{key}.name"), e))?;
        if !seen.insert(rs.name.clone()) {
            return Err(err(
                format!("{key}.name"),
                format!("{:?} is used twice", rs.name),
            ));
        }
        let adapter = build_adapter(&key, rs, env, base_dir)?;
        // Discord signs with a key pair: its public key is `public_key`, not a secret.
        if rs.secrets.is_empty() && rs.provider != "discord" {
            return Err(err(
                format!("{key}.secrets"),
                "at least one signing secret is required",
            ));
        }
        let secrets = rs
            .secrets
            .iter()
            .enumerate()
            .map(|(j, s)| read_secret(&format!("{key}.secrets[{j}]"), s, env, base_dir))
            .collect::<Result<Vec<_>, _>>()?;
        // A `whsec_` secret that does not decode would verify nothing, silently. (A Discord
        // source verifies with its public key; its secrets are not read.)
        for (j, secret) in secrets.iter().enumerate() {
            if adapter.provider() == "standard-webhooks" {
                crate::fixtures::secret_shape(adapter.provider(), secret)
                    .map_err(|why| err(format!("{key}.secrets[{j}]"), why))?;
            }
        }
        for (j, dest) in rs.destinations.iter().enumerate() {
            if !destinations.iter().any(|d| &d.name == dest) {
                return Err(err(
                    format!("{key}.destinations[{j}]"),
                    format!("no destination named {dest:?}"),
                ));
            }
            // Each entry is a delivery of every event: a name listed twice would deliver
            // each event twice, under two ids.
            if rs.destinations[..j].contains(dest) {
                return Err(err(
                    format!("{key}.destinations[{j}]"),
                    format!("{dest:?} is listed twice: each event would be delivered to it twice"),
                ));
            }
        }
        if rs.tolerance.is_some() && !TIMESTAMP_SIGNERS.contains(&adapter.provider()) {
            return Err(err(
                format!("{key}.tolerance"),
                format!(
                    "applies only to providers that sign a timestamp ({}); {}'s signature \
                     covers none, so a resent request is known by its event id alone",
                    TIMESTAMP_SIGNERS.join(", "),
                    adapter.provider()
                ),
            ));
        }
        let tolerance = rs
            .tolerance
            .as_ref()
            .map(|v| positive(&format!("{key}.tolerance"), v))
            .transpose()?
            .unwrap_or(DEFAULT_TOLERANCE);
        let retention = rs
            .retention
            .as_ref()
            .map(|v| positive(&format!("{key}.retention"), v))
            .transpose()?
            .unwrap_or_else(|| adapter.default_retention());
        sources.push(Source {
            name,
            adapter,
            secrets,
            tolerance,
            retention,
            destinations: rs.destinations.clone(),
        });
    }

    Ok(Settings {
        listen,
        admin_listen,
        admin_token,
        body_limit: size("server.body_limit", &s.body_limit)?,
        refused_body_limit: size("server.refused_body_limit", &s.refused_body_limit)?,
        header_timeout: positive("server.header_timeout", &s.header_timeout)?,
        body_timeout: positive("server.body_timeout", &s.body_timeout)?,
        shutdown_grace: duration("server.shutdown_grace", &s.shutdown_grace)?,
        shutdown_delay: duration("server.shutdown_delay", &s.shutdown_delay)?,
        log_format,
        workers: workers("server.workers", &s.workers)?,
        tls: server_tls(s, env, base_dir)?,
        admin_tls: admin_tls(s)?,
        store,
        delivery: DeliverySettings {
            enabled: d.enabled,
            concurrency,
            poll_interval: positive("delivery.poll_interval", &d.poll_interval)?,
            handoff: d.handoff,
        },
        sources,
        destinations,
    })
}

/// A retry policy whose first pause is no longer than its longest (`{key}.initial_backoff`
/// over `max_backoff` would cap every pause below the first one asked for).
fn backoff_in_order(key: &str, retry: &RetryPolicy) -> Result<(), ConfigError> {
    if retry.initial_backoff > retry.max_backoff {
        return Err(err(
            format!("{key}.initial_backoff"),
            format!(
                "{}s is longer than max_backoff ({}s): the first pause would be cut to the longest",
                retry.initial_backoff.as_secs(),
                retry.max_backoff.as_secs()
            ),
        ));
    }
    Ok(())
}

/// `server.admin_token`, read and checked.
fn admin_token(
    s: &RawServer,
    env: &HashMap<String, String>,
    base_dir: Option<&Path>,
) -> Result<Secret, ConfigError> {
    let token_ref = s
        .admin_token
        .as_deref()
        .ok_or_else(|| err("server.admin_token", "is required"))?;
    let admin_token = read_secret("server.admin_token", token_ref, env, base_dir)?;
    if admin_token.expose().len() < 16 {
        return Err(err(
            "server.admin_token",
            "must be at least 16 characters (generate one with `openssl rand -hex 32`)",
        ));
    }
    Ok(admin_token)
}

/// `server.admin_tls`, which needs the listener's certificate.
fn admin_tls(s: &RawServer) -> Result<bool, ConfigError> {
    match s.admin_tls {
        Some(true) if s.tls_cert.is_none() => Err(err(
            "server.admin_tls",
            "needs server.tls_cert and server.tls_key (the admin listener serves the same certificate)",
        )),
        on => Ok(on.unwrap_or(false)),
    }
}

/// `[store]`, resolved.
fn store_settings(
    raw: &RawConfig,
    env: &HashMap<String, String>,
    base_dir: Option<&Path>,
) -> Result<StoreSettings, ConfigError> {
    Ok(StoreSettings {
        backend: parse_store_url("store.url", &raw.store.url)?,
        history_retention: duration("store.history_retention", &raw.store.history_retention)?,
        purge_interval: positive("store.purge_interval", &raw.store.purge_interval)?,
        keys: key_settings(&raw.store, env, base_dir)?,
    })
}

/// `"auto"` (`None`) or a number of threads, at least 1.
fn workers(key: &str, v: &Value) -> Result<Option<usize>, ConfigError> {
    match v {
        Value::String(s) if s == "auto" => Ok(None),
        Value::Integer(n) if (1..=1024).contains(n) => Ok(Some(*n as usize)),
        _ => Err(err(
            key,
            format!("expected \"auto\" or a number of threads from 1 to 1024, got {v}"),
        )),
    }
}

impl Settings {
    /// Threads for the async runtime. `"auto"`: one per CPU (`cpus`), less one with the SQLite
    /// store: its writer thread is busy whenever ingest is, and on 2 CPUs a second runtime
    /// thread only takes turns with it (BENCHMARKS.md: c=64 on SQLite +3 to +20 % with one
    /// thread; PostgreSQL, its server on the same CPUs, −8 to −17 %).
    pub fn runtime_workers(&self, cpus: usize) -> usize {
        if let Some(n) = self.workers {
            return n;
        }
        let cpus = cpus.max(1);
        match &self.store.backend {
            #[cfg(feature = "sqlite")]
            StoreBackend::Sqlite(_) => (cpus - 1).max(1),
            #[cfg(feature = "postgres")]
            StoreBackend::Postgres(_) => cpus,
        }
    }

    /// What loads but will not work as it was most likely meant: `serve` logs each at start,
    /// and `check-config` prints them.
    pub fn warnings(&self) -> Vec<String> {
        let mut warnings = Vec::new();
        if self.sources.is_empty() {
            warnings.push(
                "no [[sources]] configured: every request to /in/... will get 404".to_owned(),
            );
        }
        for s in self.sources.iter().filter(|s| s.destinations.is_empty()) {
            warnings.push(format!(
                "source {:?} has no destinations: its events are verified, claimed and kept in \
                 history, and delivered nowhere; a provider's retries of them are duplicates, \
                 also after a destination is added (redeliver them from history)",
                s.name.as_str()
            ));
        }
        // `localhost` is loopback (RFC 6761): without loopback allowed, the name resolves
        // only to blocked addresses and every attempt fails. (A name is checked when it is
        // resolved, at delivery; this one's answer is known now.)
        let loopback = [
            std::net::IpAddr::from([127, 0, 0, 1]),
            std::net::IpAddr::from(std::net::Ipv6Addr::LOCALHOST),
        ];
        for d in &self.destinations {
            let DestinationKind::Http { url, allow, .. } = &d.kind else {
                continue;
            };
            let local = url.host_str().is_some_and(|h| {
                let h = h.trim_end_matches('.').to_ascii_lowercase();
                h == "localhost" || h.ends_with(".localhost")
            });
            if local && loopback.iter().all(|ip| allow.check(*ip).is_err()) {
                warnings.push(format!(
                    "destination {:?} is on localhost, which is loopback, and its allow list \
                     holds no loopback address: every attempt will fail; add \
                     allow = [\"127.0.0.1\", \"::1\"]",
                    d.name
                ));
            }
        }
        warnings
    }
}

/// Settings that belong to one provider only, and which one.
const PROVIDER_SETTINGS: &[(&str, &str)] = &[
    ("signature_header", "generic"),
    ("signature_encoding", "generic"),
    ("signature_prefix", "generic"),
    ("key_header", "generic"),
    ("key_pointer", "generic"),
    ("type_header", "generic"),
    ("type_pointer", "generic"),
    ("public_url", "twilio"),
    ("verify_token", "whatsapp"),
    ("public_key", "discord"),
    ("deferred_response", "discord"),
    ("interactive_key", "slack"),
];

/// The providers hooklatch knows, as written in config.
pub const PROVIDERS: &[&str] = &[
    "stripe",
    "github",
    "standard-webhooks",
    "generic",
    "shopify",
    "twilio",
    "slack",
    "whatsapp",
    "discord",
    "razorpay",
    "paddle",
];

/// Checks a Twilio source's `public_url` (also `hooklatch send twilio --public-url`): an
/// `http(s)` URL without a query, fragment or user. A base (no path) loses its trailing `/`;
/// a URL with a path is kept as written, since Twilio signs it byte for byte.
pub fn twilio_public_url(url: &str) -> Result<String, String> {
    let parsed = reqwest::Url::parse(url).map_err(|e| {
        // Quoted unless it may hold a password.
        if url.contains('@') {
            format!("{e}")
        } else {
            format!("{e}: {url:?}")
        }
    })?;
    if !matches!(parsed.scheme(), "http" | "https") {
        return Err("must be an http:// or https:// URL, like https://hooks.example.com".into());
    }
    if parsed.query().is_some()
        || parsed.fragment().is_some()
        || !parsed.username().is_empty()
        || parsed.password().is_some()
    {
        return Err(
            "must be the URL Twilio calls without a query, fragment or user: \
             https://hooks.example.com, or https://example.com/hooks/twilio when a proxy \
             maps that path to this source"
                .into(),
        );
    }
    Ok(if parsed.path() == "/" {
        url.trim_end_matches('/').to_owned()
    } else {
        url.to_owned()
    })
}

fn build_adapter(
    key: &str,
    rs: &RawSource,
    env: &HashMap<String, String>,
    base_dir: Option<&Path>,
) -> Result<Arc<dyn ProviderAdapter>, ConfigError> {
    let set = |field: &str| match field {
        "signature_header" => rs.signature_header.is_some(),
        "signature_encoding" => rs.signature_encoding.is_some(),
        "signature_prefix" => rs.signature_prefix.is_some(),
        "key_header" => rs.key_header.is_some(),
        "key_pointer" => rs.key_pointer.is_some(),
        "type_header" => rs.type_header.is_some(),
        "type_pointer" => rs.type_pointer.is_some(),
        "public_url" => rs.public_url.is_some(),
        "verify_token" => rs.verify_token.is_some(),
        "public_key" => rs.public_key.is_some(),
        "deferred_response" => rs.deferred_response.is_some(),
        "interactive_key" => rs.interactive_key.is_some(),
        _ => false,
    };
    if let Some((field, owner)) = PROVIDER_SETTINGS
        .iter()
        .find(|(field, owner)| set(field) && *owner != rs.provider)
    {
        return Err(err(
            format!("{key}.{field}"),
            format!("only applies to provider = \"{owner}\""),
        ));
    }
    let pointer = |field: &str, value: &Option<String>| -> Result<(), ConfigError> {
        match value {
            Some(p) if !p.starts_with('/') => Err(err(
                format!("{key}.{field}"),
                "a JSON pointer starts with '/', e.g. \"/id\"",
            )),
            _ => Ok(()),
        }
    };
    Ok(match rs.provider.as_str() {
        "stripe" => Arc::new(Stripe),
        "github" => Arc::new(GitHub),
        "standard-webhooks" => Arc::new(StandardWebhooks),
        "shopify" => Arc::new(Shopify),
        "razorpay" => Arc::new(Razorpay),
        "paddle" => Arc::new(Paddle),
        "twilio" => {
            let public_url = rs
                .public_url
                .as_deref()
                .map(twilio_public_url)
                .transpose()
                .map_err(|e| err(format!("{key}.public_url"), e))?;
            Arc::new(Twilio { public_url })
        }
        "slack" => {
            pointer("interactive_key", &rs.interactive_key)?;
            Arc::new(Slack {
                interactive_key: rs.interactive_key.clone(),
            })
        }
        "whatsapp" => {
            let verify_token = rs
                .verify_token
                .as_deref()
                .map(|t| read_secret(&format!("{key}.verify_token"), t, env, base_dir))
                .transpose()?;
            if verify_token.is_none() {
                tracing::warn!(source = %rs.name, "no verify_token: Meta's subscription check (GET) will be refused");
            }
            Arc::new(WhatsApp { verify_token })
        }
        "discord" => {
            let hex_key = rs.public_key.as_deref().ok_or_else(|| {
                err(
                    format!("{key}.public_key"),
                    "is required for a discord source (the application's public key, hex)",
                )
            })?;
            let mut discord =
                Discord::from_hex(hex_key).map_err(|e| err(format!("{key}.public_key"), e))?;
            if let Some(reply) = &rs.deferred_response {
                let value: serde_json::Value = serde_json::from_str(reply).map_err(|e| {
                    err(
                        format!("{key}.deferred_response"),
                        format!("is not JSON: {e}"),
                    )
                })?;
                if !value.get("type").is_some_and(serde_json::Value::is_u64) {
                    return Err(err(
                        format!("{key}.deferred_response"),
                        "must be an interaction response with a numeric \"type\", e.g. {\"type\":5}",
                    ));
                }
                discord.deferred_response = Some(value);
            }
            Arc::new(discord)
        }
        "generic" => {
            let signature_header = rs.signature_header.clone().ok_or_else(|| {
                err(
                    format!("{key}.signature_header"),
                    "is required for a generic source",
                )
            })?;
            http::HeaderName::from_bytes(signature_header.as_bytes()).map_err(|_| {
                err(
                    format!("{key}.signature_header"),
                    "is not a valid header name",
                )
            })?;
            let encoding = match rs.signature_encoding.as_deref().unwrap_or("hex") {
                "hex" => SignatureEncoding::Hex,
                "base64" => SignatureEncoding::Base64,
                other => {
                    return Err(err(
                        format!("{key}.signature_encoding"),
                        format!("{other:?}: expected \"hex\" or \"base64\""),
                    ))
                }
            };
            if rs.key_header.is_none() && rs.key_pointer.is_none() {
                return Err(err(
                    format!("{key}.key_header"),
                    "a generic source needs key_header or key_pointer",
                ));
            }
            pointer("key_pointer", &rs.key_pointer)?;
            pointer("type_pointer", &rs.type_pointer)?;
            Arc::new(Generic {
                settings: GenericSettings {
                    signature_header,
                    encoding,
                    prefix: rs.signature_prefix.clone(),
                    key_header: rs.key_header.clone(),
                    key_pointer: rs.key_pointer.clone(),
                    type_header: rs.type_header.clone(),
                    type_pointer: rs.type_pointer.clone(),
                },
            })
        }
        other => {
            return Err(err(
                format!("{key}.provider"),
                format!(
                    "unknown provider {other:?}; expected one of {}",
                    PROVIDERS.join(", ")
                ),
            ))
        }
    })
}

fn parse_addr(key: &str, s: &str) -> Result<SocketAddr, ConfigError> {
    s.parse()
        .map_err(|_| err(key, format!("{s:?} is not an address like 127.0.0.1:8080")))
}

/// `[store] keys`: empty for SQL mode, else a redis:// or rediss:// URL with its TLS files
/// (checked here, connected at start).
fn key_settings(
    raw: &RawStore,
    env: &HashMap<String, String>,
    base_dir: Option<&Path>,
) -> Result<Option<KeySettings>, ConfigError> {
    let url = raw.keys.trim();
    let tls_keys = TlsKeys {
        prefix: "store.keys_".to_owned(),
        ca_file: raw.keys_ca_file.as_deref(),
        client_cert: raw.keys_client_cert.as_deref(),
        client_key: raw.keys_client_key.as_deref(),
    };
    if url.is_empty() {
        tls_files(
            &tls_keys,
            false,
            "keys are in the store (store.keys = \"\"), not in Redis",
            env,
            base_dir,
        )?;
        return Ok(None);
    }
    let shown = hooklatch_keys_redis::describe_url(url);
    let secure = url.starts_with("rediss://");
    if !secure && !url.starts_with("redis://") {
        return Err(err(
            "store.keys",
            format!("{shown}: expected \"\" (keys in the store) or a redis:// or rediss:// URL"),
        ));
    }
    hooklatch_keys_redis::check_database(url)
        .map_err(|why| err("store.keys", format!("{shown}: {why}")))?;
    if secure && url.contains('#') {
        return Err(err(
            "store.keys",
            format!(
                "{shown}: a rediss:// URL takes no #fragment (#insecure would turn the \
                 certificate checks off, which hooklatch does not do; give the server's CA \
                 in store.keys_ca_file instead)"
            ),
        ));
    }
    let tls = tls_files(
        &tls_keys,
        secure,
        "store.keys is a redis:// URL",
        env,
        base_dir,
    )?;
    if raw.key_prefix.is_empty() {
        return Err(err(
            "store.key_prefix",
            "must not be empty: hooklatch's keys need a namespace of their own",
        ));
    }
    let lease = positive("store.key_lease", &raw.key_lease)?;
    // Shorter, and a claim lapses while its request is still being queued: a copy arriving
    // then is claimed again, and the event is queued twice.
    if lease < MIN_KEY_LEASE {
        return Err(err(
            "store.key_lease",
            "must be at least 1s: a claim must outlive the store's slowest commit (default 30s)",
        ));
    }
    Ok(Some(KeySettings {
        url: url.to_owned(),
        prefix: raw.key_prefix.clone(),
        lease,
        tls,
    }))
}

fn parse_store_url(key: &str, url: &str) -> Result<StoreBackend, ConfigError> {
    #[cfg(feature = "sqlite")]
    if url.starts_with("sqlite:") {
        return hooklatch_store_sqlite::SqliteOptions::from_url(url)
            .map(StoreBackend::Sqlite)
            .map_err(|e| err(key, e));
    }
    #[cfg(feature = "postgres")]
    if url.starts_with("postgres://") || url.starts_with("postgresql://") {
        return hooklatch_store_postgres::PgOptions::from_url(url)
            .map(StoreBackend::Postgres)
            .map_err(|e| err(key, e));
    }
    // The URL may hold a password: name only its scheme.
    let scheme = url.split_once(':').map_or("", |(s, _)| s);
    Err(err(
        key,
        format!(
            "unsupported store URL scheme {scheme:?}; use sqlite://PATH or postgres://USER@HOST/DB"
        ),
    ))
}

/// `path` as written in the configuration: a relative one is from the configuration file's
/// directory (`base_dir`), when there is one.
fn resolve_path(path: &str, base_dir: Option<&Path>) -> std::path::PathBuf {
    let path = Path::new(path);
    match base_dir {
        Some(dir) if path.is_relative() => dir.join(path),
        _ => path.to_path_buf(),
    }
}

/// Reads a secret reference: `env:NAME`, `file:PATH` (relative to `base_dir` when given) or a
/// literal. `key` names the setting in errors; the error never shows the secret.
pub fn read_secret(
    key: &str,
    reference: &str,
    env: &HashMap<String, String>,
    base_dir: Option<&Path>,
) -> Result<Secret, ConfigError> {
    let value = if let Some(name) = reference.strip_prefix("env:") {
        env.get(name)
            .cloned()
            .ok_or_else(|| err(key, format!("environment variable {name} is not set")))?
    } else if let Some(path) = reference.strip_prefix("file:") {
        let path = resolve_path(path, base_dir);
        std::fs::read_to_string(&path)
            .map_err(|e| err(key, format!("reading {}: {e}", path.display())))?
            .trim()
            .to_owned()
    } else {
        reference.to_owned()
    };
    if value.is_empty() {
        return Err(err(key, "is empty"));
    }
    Ok(Secret::from_text(&value))
}

fn attempts(key: &str, n: i64) -> Result<u32, ConfigError> {
    u32::try_from(n)
        .ok()
        .filter(|n| (1..=1000).contains(n))
        .ok_or_else(|| err(key, "must be between 1 and 1000"))
}

fn jitter(key: &str, j: f64) -> Result<f64, ConfigError> {
    if (0.0..=1.0).contains(&j) {
        Ok(j)
    } else {
        Err(err(key, "must be between 0.0 and 1.0"))
    }
}

/// The shortest `store.key_lease` taken.
const MIN_KEY_LEASE: Duration = Duration::from_secs(1);

fn positive(key: &str, v: &Value) -> Result<Duration, ConfigError> {
    let d = duration(key, v)?;
    if d.is_zero() {
        return Err(err(key, "must be greater than zero"));
    }
    Ok(d)
}

fn duration(key: &str, v: &Value) -> Result<Duration, ConfigError> {
    match v {
        Value::Integer(n) if *n >= 0 => Ok(Duration::from_secs(*n as u64)),
        Value::String(s) => parse_duration(s).ok_or_else(|| {
            err(
                key,
                format!("{s:?} is not a duration like \"250ms\", \"30s\", \"10m\", \"2h\", \"7d\""),
            )
        }),
        _ => Err(err(key, "expected a duration like \"30s\"")),
    }
}

fn size(key: &str, v: &Value) -> Result<usize, ConfigError> {
    let n = match v {
        Value::Integer(n) if *n > 0 => Some(*n as u64),
        Value::String(s) => parse_size(s),
        _ => None,
    };
    n.filter(|n| *n > 0)
        .and_then(|n| usize::try_from(n).ok())
        .ok_or_else(|| {
            err(
                key,
                "expected a size above zero like \"1MiB\" or a number of bytes",
            )
        })
}

/// Parses `250ms`, `30s`, `10m`, `2h`, `7d`.
pub fn parse_duration(s: &str) -> Option<Duration> {
    let s = s.trim();
    let split = s.find(|c: char| !c.is_ascii_digit())?;
    let (digits, unit) = s.split_at(split);
    let n: u64 = digits.parse().ok()?;
    let millis = match unit.trim() {
        "ms" => 1,
        "s" => 1000,
        "m" => 60_000,
        "h" => 3_600_000,
        "d" => 86_400_000,
        _ => return None,
    };
    n.checked_mul(millis).map(Duration::from_millis)
}

/// Parses `512KiB`, `1MiB`, `10MB`, `100B`.
fn parse_size(s: &str) -> Option<u64> {
    let s = s.trim();
    let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (digits, unit) = s.split_at(split);
    let n: u64 = digits.parse().ok()?;
    let mult = match unit.trim() {
        "" | "B" => 1,
        "KB" => 1000,
        "KiB" => 1024,
        "MB" => 1_000_000,
        "MiB" => 1 << 20,
        "GB" => 1_000_000_000,
        "GiB" => 1 << 30,
        _ => return None,
    };
    n.checked_mul(mult)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(pairs: &[(&str, &str)]) -> HashMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    const TOKEN: (&str, &str) = ("HOOKLATCH_ADMIN_TOKEN", "0123456789abcdef0123");

    fn load_str(toml: &str, env: &HashMap<String, String>) -> Result<Settings, ConfigError> {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("hooklatch.toml");
        std::fs::write(&path, toml).unwrap();
        load(Some(&path), env)
    }

    #[track_caller]
    fn check_err(toml: &str, env_pairs: &[(&str, &str)], expect: &str) {
        let mut e = env(&[TOKEN]);
        e.extend(env(env_pairs));
        let msg = load_str(toml, &e).unwrap_err().to_string();
        assert!(msg.contains(expect), "{msg:?} lacks {expect:?}");
    }

    /// The error `toml` is refused with (the admin token set).
    fn config_err(toml: &str) -> String {
        load_str(toml, &env(&[TOKEN])).unwrap_err().to_string()
    }

    const EXAMPLE: &str = r#"
[store]
url = "sqlite://x.db"

[[sources]]
name = "stripe"
provider = "stripe"
secrets = ["env:STRIPE_WEBHOOK_SECRET"]
destinations = ["app"]

[[destinations]]
name = "app"
url = "http://app.internal:3000/webhooks/stripe"
"#;

    /// An error about one of many sources or destinations names it as the operator did, and
    /// an environment variable that set the value is still blamed.
    #[test]
    fn an_entry_in_error_is_named_by_its_name() {
        let more = format!(
            "{EXAMPLE}\n[[destinations]]\nname = \"billing\"\nurl = \"http://b.internal/\"\n\
             timeout = \"soon\"\n"
        );
        let secret = ("STRIPE_WEBHOOK_SECRET", "whsec_x");
        check_err(&more, &[secret], "destinations[1].timeout: ");
        check_err(&more, &[secret], "(the destination named \"billing\")");
        check_err(
            EXAMPLE,
            &[secret, ("HOOKLATCH_SOURCES__STRIPE__TOLERANCE", "soon")],
            "(the source named \"stripe\")",
        );
        check_err(
            EXAMPLE,
            &[secret, ("HOOKLATCH_SOURCES__STRIPE__TOLERANCE", "soon")],
            "HOOKLATCH_SOURCES__STRIPE__TOLERANCE: sources[0].tolerance",
        );
    }

    #[test]
    fn runtime_threads_leave_the_sqlite_writer_a_cpu_unless_set() {
        let e = env(&[TOKEN, ("STRIPE_WEBHOOK_SECRET", "whsec_x")]);
        let sqlite = load_str(EXAMPLE, &e).expect("loads");
        assert_eq!(sqlite.workers, None, "\"auto\" by default");
        assert_eq!(sqlite.runtime_workers(2), 1);
        assert_eq!(sqlite.runtime_workers(8), 7);
        assert_eq!(sqlite.runtime_workers(1), 1);
        assert_eq!(sqlite.runtime_workers(0), 1);
        let postgres = load_str(
            &EXAMPLE.replace("sqlite://x.db", "postgres://hl@127.0.0.1/hl"),
            &e,
        )
        .expect("loads");
        assert_eq!(postgres.runtime_workers(2), 2);
        let mut set = e.clone();
        set.insert("HOOKLATCH_SERVER__WORKERS".to_owned(), "3".to_owned());
        let three = load_str(EXAMPLE, &set).expect("loads");
        assert_eq!(three.runtime_workers(2), 3);
        for bad in ["0", "-1", "\"many\"", "2.5"] {
            check_err(
                &format!("[server]\nworkers = {bad}\n{EXAMPLE}"),
                &[("STRIPE_WEBHOOK_SECRET", "whsec_x")],
                "server.workers: expected \"auto\" or a number of threads",
            );
        }
    }

    #[test]
    fn the_issue_example_loads_with_defaults() {
        let e = env(&[TOKEN, ("STRIPE_WEBHOOK_SECRET", "whsec_x")]);
        let s = load_str(EXAMPLE, &e).unwrap();
        assert_eq!(s.listen.to_string(), "127.0.0.1:8080");
        assert_eq!(s.admin_listen.to_string(), "127.0.0.1:8081");
        assert_eq!(s.body_limit, 1 << 20);
        assert_eq!(s.sources[0].tolerance, Duration::from_secs(300));
        // Stripe's default covers its CLI's 30-day resend window.
        assert_eq!(s.sources[0].retention, Duration::from_secs(35 * 86_400));
        assert_eq!(s.sources[0].secrets[0].expose(), b"whsec_x");
        assert_eq!(s.destinations[0].retry.max_attempts, 12);
        assert!(s.delivery.handoff, "the hand-off is on by default");
    }

    #[test]
    fn environment_overrides_any_key_including_a_named_source() {
        let e = env(&[
            TOKEN,
            ("STRIPE_WEBHOOK_SECRET", "whsec_x"),
            ("HOOKLATCH_SERVER__LISTEN", "127.0.0.1:9999"),
            ("HOOKLATCH_SERVER__BODY_LIMIT", "2048"),
            ("HOOKLATCH_SOURCES__STRIPE__TOLERANCE", "10m"),
            ("HOOKLATCH_DESTINATIONS__APP__MAX_ATTEMPTS", "3"),
            ("HOOKLATCH_DELIVERY__HANDOFF", "false"),
        ]);
        let s = load_str(EXAMPLE, &e).unwrap();
        assert!(!s.delivery.handoff);
        assert_eq!(s.listen.port(), 9999);
        assert_eq!(s.body_limit, 2048);
        assert_eq!(s.sources[0].tolerance, Duration::from_secs(600));
        assert_eq!(s.destinations[0].retry.max_attempts, 3);
    }

    #[test]
    fn errors_name_the_key() {
        let with_secret = [("STRIPE_WEBHOOK_SECRET", "whsec_x")];
        check_err(
            EXAMPLE,
            &[],
            "sources[0].secrets[0]: environment variable STRIPE_WEBHOOK_SECRET is not set",
        );
        check_err(
            &EXAMPLE.replace("\"stripe\"\nsecrets", "\"strype\"\nsecrets"),
            &with_secret,
            "sources[0].provider: unknown provider \"strype\"",
        );
        check_err(
            &EXAMPLE.replace("[\"app\"]", "[\"ap\"]"),
            &with_secret,
            "sources[0].destinations[0]: no destination named \"ap\"",
        );
        check_err(
            &format!("{EXAMPLE}\n[delivery]\ninitial_backoff = \"2h\"\nmax_backoff = \"1m\""),
            &with_secret,
            "delivery.initial_backoff: 7200s is longer than max_backoff (60s)",
        );
        check_err(
            &format!("{EXAMPLE}max_backoff = \"1s\""),
            &with_secret,
            "destinations[0].initial_backoff: 5s is longer than max_backoff (1s)",
        );
        check_err(
            &EXAMPLE.replace("[\"app\"]", "[\"app\", \"app\"]"),
            &with_secret,
            "sources[0].destinations[1]: \"app\" is listed twice",
        );
        check_err(
            &format!("{EXAMPLE}\n[server]\nlisten = \"nope\""),
            &with_secret,
            "server.listen",
        );
        check_err(
            &format!("{EXAMPLE}\n[server]\nlistn = \"x\""),
            &with_secret,
            "server.listn: unknown field `listn`: did you mean `listen`?",
        );
        check_err(
            &EXAMPLE.replace("[[destinations]]\n", "[[destinations]]\nalow = []\n"),
            &with_secret,
            "destinations[0].alow: unknown field `alow`: did you mean `allow`?",
        );
        check_err(
            &EXAMPLE.replace("[[destinations]]\n", "[[destinations]]\nqwertyuiop = 1\n"),
            &with_secret,
            "unknown field `qwertyuiop`; the keys here are name, url,",
        );
        check_err(
            &EXAMPLE.replace(
                "[[destinations]]\n",
                "[[destinations]]\nmax_attempts = \"2\"\n",
            ),
            &with_secret,
            "destinations[0].max_attempts: invalid type: a string, expected a whole number",
        );
        check_err(
            EXAMPLE,
            &[
                ("STRIPE_WEBHOOK_SECRET", "whsec_x"),
                ("HOOKLATCH_DELIVERY__TIMEOUT", "soon"),
            ],
            "delivery.timeout",
        );
        check_err(
            &EXAMPLE.replace("sqlite://x.db", "mysql://x"),
            &with_secret,
            "store.url: unsupported store URL",
        );
        check_err(
            &EXAMPLE.replace(
                "provider = \"stripe\"",
                "provider = \"stripe\"\nkey_header = \"x\"",
            ),
            &with_secret,
            "sources[0].key_header: only applies to provider = \"generic\"",
        );
    }

    #[test]
    fn every_provider_loads_with_its_own_settings() {
        let toml = r#"
[[sources]]
name = "twilio"
provider = "twilio"
secrets = ["auth-token"]
public_url = "https://hooks.example.com/"

[[sources]]
name = "wa"
provider = "whatsapp"
secrets = ["app-secret"]
verify_token = "env:WA_VERIFY"

[[sources]]
name = "discord"
provider = "discord"
public_key = "d75a980182b10ab7d54bfed3c964073a0ee172f3daa62325af021a68f707511a"
deferred_response = '{"type":5,"data":{"flags":64}}'

[[sources]]
name = "slack"
provider = "slack"
secrets = ["signing-secret"]
interactive_key = "/actions/0/action_id"

[[sources]]
name = "shop"
provider = "shopify"
secrets = ["s"]

[[sources]]
name = "rzp"
provider = "razorpay"
secrets = ["s"]

[[sources]]
name = "paddle"
provider = "paddle"
secrets = ["s"]
tolerance = "30s"
"#;
        let s = load_str(toml, &env(&[TOKEN, ("WA_VERIFY", "meta-verify")])).unwrap();
        let names: Vec<&str> = s.sources.iter().map(|s| s.adapter.provider()).collect();
        assert_eq!(
            names,
            ["twilio", "whatsapp", "discord", "slack", "shopify", "razorpay", "paddle"]
        );
        assert!(s.sources[2].secrets.is_empty());
        assert_eq!(s.sources[6].tolerance, Duration::from_secs(30));
    }

    /// The configurations in `examples/` load as the README and their comments start them.
    #[test]
    fn every_example_config_loads() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples");
        let e = env(&[
            ("HOOKLATCH_ADMIN_TOKEN", "dev-admin-token-0123456789"),
            ("HOOKLATCH_LISTEN_TOKEN", "dev-listen-token-0123456789"),
        ]);
        let mut loaded = 0;
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.extension().is_some_and(|x| x == "toml") {
                load(Some(&path), &e).unwrap_or_else(|err| panic!("{}: {err}", path.display()));
                loaded += 1;
            }
        }
        assert!(loaded >= 3, "{loaded} example configs");
        // The quick start's Stripe events go where the example handler listens.
        let quick = load(Some(&dir.join("hooklatch.toml")), &e).unwrap();
        let app = quick.destinations.iter().find(|d| d.name == "app").unwrap();
        let DestinationKind::Http { url, .. } = &app.kind else {
            panic!("an HTTP destination");
        };
        assert_eq!(url.path(), "/webhooks/stripe");
    }

    /// What loads but cannot work as meant is said, not refused: a destination on localhost
    /// whose allow list holds no loopback address, a source delivering nowhere.
    #[test]
    fn warnings_name_what_will_not_work_as_meant() {
        let e = env(&[TOKEN, ("STRIPE_WEBHOOK_SECRET", "whsec_x")]);
        let at = |url: &str, allow: &str| {
            EXAMPLE.replace(
                "url = \"http://app.internal:3000/webhooks/stripe\"",
                &format!("url = \"{url}\"\n{allow}"),
            )
        };
        let warnings = |toml: &str| load_str(toml, &e).unwrap().warnings();
        assert_eq!(warnings(EXAMPLE), Vec::<String>::new());
        for url in [
            "http://localhost:3000/hooks",
            "http://LOCALHOST.:3000/",
            "http://app.localhost/",
        ] {
            let found = warnings(&at(url, ""));
            assert_eq!(found.len(), 1, "{url}: {found:?}");
            assert!(
                found[0].starts_with("destination \"app\" is on localhost"),
                "{found:?}"
            );
        }
        for allow in [
            "allow = [\"127.0.0.1\"]",
            "allow = [\"::1\"]",
            "allow = [\"127.0.0.0/8\"]",
        ] {
            assert_eq!(
                warnings(&at("http://localhost:3000/", allow)),
                Vec::<String>::new(),
                "{allow}"
            );
        }
        let nowhere = EXAMPLE.replace("destinations = [\"app\"]", "destinations = []");
        let found = warnings(&nowhere);
        assert!(
            found
                .iter()
                .any(|w| w.starts_with("source \"stripe\" has no destinations")),
            "{found:?}"
        );
    }

    #[test]
    fn a_variable_with_one_underscore_after_a_section_is_warned_about() {
        let e = env(&[
            ("HOOKLATCH_STORE_URL", "postgres://x"),
            ("HOOKLATCH_STORE__URL", "sqlite://y.db"),
            ("HOOKLATCH_ADMIN_TOKEN", "not a setting's name"),
            ("HOOKLATCH_SOURCES_STRIPE__SECRETS", "mixed"),
        ]);
        assert_eq!(
            env_warnings(&e),
            [
                "HOOKLATCH_STORE_URL is not read as a setting: a setting's variable separates its \
              path with two underscores (HOOKLATCH_STORE__URL)"
            ]
        );
    }

    #[test]
    fn a_standard_webhooks_secret_that_does_not_decode_is_refused() {
        let toml = "[[sources]]\nname = \"svix\"\nprovider = \"standard-webhooks\"\nsecrets = [\"whsec_local_development_only\"]\n";
        check_err(
            toml,
            &[],
            "sources[0].secrets[0]: a standard-webhooks secret that starts with whsec_ is base64",
        );
        let msg = load_str(toml, &env(&[TOKEN])).unwrap_err().to_string();
        assert!(!msg.contains("local_development_only"), "{msg}");
    }

    #[test]
    fn the_admin_api_needs_a_port_of_its_own() {
        let with_secret = [("STRIPE_WEBHOOK_SECRET", "whsec_x")];
        for admin in ["127.0.0.1:8080", "0.0.0.0:8080"] {
            check_err(
                &format!(
                    "[server]\nlisten = \"127.0.0.1:8080\"\nadmin_listen = \"{admin}\"\n{EXAMPLE}"
                ),
                &with_secret,
                &format!("server.admin_listen: {admin} is server.listen's port (127.0.0.1:8080)"),
            );
        }
        // Another address on the same port is another socket.
        let e = env(&[TOKEN, with_secret[0]]);
        let toml = format!(
            "[server]\nlisten = \"127.0.0.2:8080\"\nadmin_listen = \"127.0.0.1:8080\"\n{EXAMPLE}"
        );
        load_str(&toml, &e).expect("two sockets");
    }

    #[test]
    fn a_tolerance_is_refused_where_no_timestamp_is_signed() {
        check_err(
            "[[sources]]\nname = \"gh\"\nprovider = \"github\"\nsecrets = [\"s\"]\ntolerance = \"10m\"\n",
            &[],
            "sources[0].tolerance: applies only to providers that sign a timestamp (stripe, \
             standard-webhooks, slack, paddle, discord); github's signature covers none, so a \
             resent request is known by its event id alone",
        );
    }

    #[test]
    fn provider_settings_are_checked() {
        let base = "[[sources]]\nname = \"x\"\nsecrets = [\"s\"]\n";
        check_err(
            &format!("{base}provider = \"discord\""),
            &[],
            "sources[0].public_key: is required",
        );
        check_err(
            &format!("{base}provider = \"discord\"\npublic_key = \"zz\""),
            &[],
            "sources[0].public_key:",
        );
        check_err(
            &format!("{base}provider = \"stripe\"\nverify_token = \"t\""),
            &[],
            "sources[0].verify_token: only applies to provider = \"whatsapp\"",
        );
        check_err(
            &format!("{base}provider = \"twilio\"\npublic_url = \"https://h.example/t?a=1\""),
            &[],
            "sources[0].public_url: must be the URL Twilio calls without a query",
        );
        // A password alone is refused too, and never quoted.
        for url in [
            "https://:pw-0123@h.example/",
            "https://:pw-0123@[h.example/",
        ] {
            let text = format!("{base}provider = \"twilio\"\npublic_url = \"{url}\"");
            let msg = config_err(&text);
            assert!(msg.starts_with("sources[0].public_url: "), "{msg}");
            assert!(!msg.contains("pw-0123"), "{msg}");
        }
        check_err(
            &format!("{base}provider = \"twilio\"\npublic_url = \"ftp://h.example/\""),
            &[],
            "sources[0].public_url: must be an http:// or https:// URL",
        );
        check_err(
            &format!("{base}provider = \"slack\"\ninteractive_key = \"trigger_id\""),
            &[],
            "sources[0].interactive_key: a JSON pointer",
        );
        check_err(
            &format!("{base}provider = \"github\"\nsecrets = []"),
            &[],
            "duplicate key",
        );
        check_err(
            "[[sources]]\nname = \"x\"\nprovider = \"github\"",
            &[],
            "sources[0].secrets: at least one",
        );
    }

    #[test]
    fn a_short_admin_token_is_refused() {
        let e = env(&[
            ("HOOKLATCH_ADMIN_TOKEN", "short"),
            ("STRIPE_WEBHOOK_SECRET", "whsec_x"),
        ]);
        let msg = load_str(EXAMPLE, &e).unwrap_err().to_string();
        assert!(
            msg.starts_with("server.admin_token: must be at least 16"),
            "{msg}"
        );
        assert!(!msg.contains("short"));
    }

    #[test]
    fn durations_and_sizes() {
        assert_eq!(parse_duration("250ms"), Some(Duration::from_millis(250)));
        assert_eq!(parse_duration("7d"), Some(Duration::from_secs(604_800)));
        assert_eq!(parse_duration("7"), None);
        assert_eq!(parse_duration("x"), None);
        assert_eq!(parse_size("1MiB"), Some(1 << 20));
        assert_eq!(parse_size("10MB"), Some(10_000_000));
        assert_eq!(parse_size("12"), Some(12));
        assert_eq!(parse_size("1 parsec"), None);
    }

    #[test]
    fn a_destination_on_a_special_address_needs_it_in_allow() {
        let e = env(&[TOKEN, ("STRIPE_WEBHOOK_SECRET", "whsec_x")]);
        let at = |url: &str, allow: &str| {
            EXAMPLE.replace(
                "url = \"http://app.internal:3000/webhooks/stripe\"",
                &format!("url = \"{url}\"\n{allow}"),
            )
        };
        for url in [
            "http://127.0.0.1:3000/",
            "http://2130706433/",
            "http://[::1]/",
            "http://169.254.169.254/latest/meta-data/",
            "http://10.0.0.5/hooks",
        ] {
            let msg = load_str(&at(url, ""), &e).unwrap_err().to_string();
            assert!(msg.starts_with("destinations[0].url: "), "{msg}");
            assert!(msg.contains("allow = ["), "{msg}");
        }
        let s = load_str(
            &at("http://127.0.0.1:3000/", "allow = [\"127.0.0.0/8\"]"),
            &e,
        )
        .unwrap();
        let DestinationKind::Http { allow, .. } = &s.destinations[0].kind else {
            panic!()
        };
        assert_eq!(allow.allowed()[0].to_string(), "127.0.0.0/8");
        // A name is checked when it is resolved, at delivery.
        load_str(&at("http://localhost:3000/", ""), &e).unwrap();
        let msg = load_str(&at("http://127.0.0.1/", "allow = [\"localhost\"]"), &e)
            .unwrap_err()
            .to_string();
        assert!(
            msg.starts_with("destinations[0].allow: \"localhost\" is not"),
            "{msg}"
        );
    }

    #[test]
    fn listen_destinations_are_checked_and_never_show_their_token() {
        let listen = |rest: &str| {
            EXAMPLE.replace(
                "url = \"http://app.internal:3000/webhooks/stripe\"",
                &format!("listen_token = \"env:LISTEN_TOKEN\"\n{rest}"),
            )
        };
        let token = "listen-token-0123456789abcdef";
        let e = env(&[
            TOKEN,
            ("STRIPE_WEBHOOK_SECRET", "whsec_x"),
            ("LISTEN_TOKEN", token),
        ]);
        let s = load_str(&listen("max_attempts = 4"), &e).unwrap();
        let d = &s.destinations[0];
        assert_eq!(d.retry.max_attempts, 4);
        let DestinationKind::Listen { token: t, secret } = &d.kind else {
            panic!("{d:?}")
        };
        assert_eq!(t.expose(), token.as_bytes());
        assert!(secret.is_none());
        assert!(!format!("{d:?}").contains(token));

        let check = |toml: &str, env: &HashMap<String, String>, expect: &str| {
            let msg = load_str(toml, env).unwrap_err().to_string();
            assert!(msg.contains(expect), "{msg:?} lacks {expect:?}");
            assert!(!msg.contains(token), "{msg}");
        };
        check(
            &listen("url = \"http://h/\""),
            &e,
            "destinations[0].url: a listen destination (listen_token) has no url or amqp",
        );
        check(
            &listen("exchange = \"x\""),
            &e,
            "destinations[0].exchange: applies only to amqp destinations",
        );
        check(
            &listen("allow = [\"127.0.0.1\"]"),
            &e,
            "destinations[0].allow: applies only to HTTP destinations",
        );
        check(
            &listen("disable_on_gone = false"),
            &e,
            "destinations[0].disable_on_gone: applies only to HTTP destinations",
        );
        check(
            &listen("provider_signature = \"stale\""),
            &e,
            "destinations[0].provider_signature: \"stale\": expected \"fresh\" or \"original\"",
        );
        let original = load_str(&listen("provider_signature = \"original\""), &e).unwrap();
        assert_eq!(
            original.destinations[0].provider_signature,
            ProviderSignature::Original
        );
        let fresh = load_str(&listen(""), &e).unwrap();
        assert_eq!(
            fresh.destinations[0].provider_signature,
            ProviderSignature::Fresh
        );
        check(
            &listen("secret = \"whsec_!!\""),
            &e,
            "destinations[0].secret: a secret starting with whsec_ must continue with base64",
        );
        let short = env(&[
            TOKEN,
            ("STRIPE_WEBHOOK_SECRET", "whsec_x"),
            ("LISTEN_TOKEN", "short"),
        ]);
        check(
            &listen(""),
            &short,
            "destinations[0].listen_token: must be at least 16 characters",
        );
    }

    #[test]
    fn amqp_destinations_are_checked_and_never_show_their_password() {
        let amqp = |rest: &str| {
            EXAMPLE.replace(
                "url = \"http://app.internal:3000/webhooks/stripe\"",
                &format!("amqp = \"env:MQ_URL\"\n{rest}"),
            )
        };
        let e = env(&[
            TOKEN,
            ("STRIPE_WEBHOOK_SECRET", "whsec_x"),
            ("MQ_URL", "amqp://guest:pa55word@127.0.0.1:5672/%2f"),
        ]);
        let s = load_str(
            &amqp("exchange = \"payments\"\nrouting_key = \"payment.confirmed\"\ndeclare = true\nqueue = \"q\"\nquorum = true\nmax_attempts = 3\nmax_length = 100000\ndelivery_limit = 5\ndead_letter_exchange = \"payments.dead\""),
            &e,
        )
        .unwrap();
        let d = &s.destinations[0];
        assert_eq!(d.retry.max_attempts, 3);
        let DestinationKind::Amqp(a) = &d.kind else {
            panic!("{d:?}")
        };
        assert_eq!(
            (a.exchange.as_str(), a.routing_key.as_str()),
            ("payments", "payment.confirmed")
        );
        assert!(a.declare && a.quorum);
        assert_eq!(a.queue.as_deref(), Some("q"));
        assert_eq!(
            (
                a.max_length,
                a.delivery_limit,
                a.dead_letter_exchange.as_deref()
            ),
            (Some(100_000), Some(5), Some("payments.dead"))
        );
        assert_eq!(a.redacted_url(), "amqp://guest:***@127.0.0.1:5672/%2f");
        assert!(!format!("{d:?}").contains("pa55word"));
        // The default exchange is allowed.
        load_str(&amqp("exchange = \"\"\nrouting_key = \"q\""), &e).unwrap();

        let check = |toml: &str, expect: &str| {
            let msg = load_str(toml, &e).unwrap_err().to_string();
            assert!(msg.contains(expect), "{msg:?} lacks {expect:?}");
            assert!(!msg.contains("pa55word"), "{msg}");
        };
        check(
            &amqp("routing_key = \"k\""),
            "destinations[0].exchange: is required",
        );
        check(
            &amqp("exchange = \"x\"\nrouting_key = \"k\"\nprovider_signature = \"original\""),
            "destinations[0].provider_signature: applies only to HTTP and listen destinations",
        );
        check(
            &amqp("exchange = \"x\""),
            "destinations[0].routing_key: is required",
        );
        check(
            &amqp("exchange = \"x\"\nrouting_key = \"k\"\nurl = \"http://h/\""),
            "destinations[0].amqp: a destination has either url (HTTP) or amqp (RabbitMQ), not both",
        );
        check(
            &amqp("exchange = \"x\"\nrouting_key = \"k\"\nqueue = \"q\""),
            "destinations[0].queue: is declared only with declare = true",
        );
        check(
            &amqp("exchange = \"x\"\nrouting_key = \"k\"\nquorum = true"),
            "destinations[0].quorum: applies only with queue",
        );
        check(
            &amqp("exchange = \"x\"\nrouting_key = \"k\"\nmax_length = 5"),
            "destinations[0].max_length: applies only with queue",
        );
        check(
            &amqp("exchange = \"x\"\nrouting_key = \"k\"\ndead_letter_exchange = \"dlx\""),
            "destinations[0].dead_letter_exchange: applies only with queue",
        );
        let queue = "exchange = \"x\"\nrouting_key = \"k\"\ndeclare = true\nqueue = \"q\"";
        check(
            &amqp(&format!("{queue}\ndelivery_limit = 3")),
            "destinations[0].delivery_limit: applies only with quorum = true",
        );
        check(
            &amqp(&format!("{queue}\nmax_length = 0")),
            "destinations[0].max_length: 0: expected 1 to 2147483647",
        );
        check(
            &amqp(&format!("{queue}\nquorum = true\ndelivery_limit = -1")),
            "destinations[0].delivery_limit: -1: expected 1 to 2147483647",
        );
        check(
            &amqp(&format!("{queue}\ndead_letter_exchange = \"\"")),
            "destinations[0].dead_letter_exchange: is empty",
        );
        check(
            &EXAMPLE.replace("/webhooks/stripe\"", "/webhooks/stripe\"\nmax_length = 5"),
            "destinations[0].max_length: applies only to amqp destinations",
        );
        check(
            &amqp("exchange = \"x\"\nrouting_key = \"k\"\nsecret = \"s\""),
            "destinations[0].secret: applies only to HTTP destinations",
        );
        check(
            &EXAMPLE.replace("/webhooks/stripe\"", "/webhooks/stripe\"\nexchange = \"x\""),
            "destinations[0].exchange: applies only to amqp destinations",
        );
        check(
            &EXAMPLE.replace("url = \"http://app.internal:3000/webhooks/stripe\"", ""),
            "destinations[0].url: is required",
        );
        let mut bad = e.clone();
        bad.insert("MQ_URL".into(), "https://guest:pa55word@h/".into());
        let msg = load_str(&amqp("exchange = \"x\"\nrouting_key = \"k\""), &bad)
            .unwrap_err()
            .to_string();
        assert!(
            msg.contains("destinations[0].amqp: must be an amqp:// URL"),
            "{msg}"
        );
        assert!(!msg.contains("pa55word"), "{msg}");
    }

    /// `amqp_fallback`: the cluster's other nodes, each checked as `amqp` is, named by its
    /// place in the list when refused, never shown with its password; only on amqp destinations.
    #[test]
    fn amqp_fallback_nodes_are_checked_as_the_first_is() {
        let amqp = |rest: &str| {
            EXAMPLE.replace(
                "url = \"http://app.internal:3000/webhooks/stripe\"",
                &format!("amqp = \"env:MQ_URL\"\nexchange = \"x\"\nrouting_key = \"k\"\n{rest}"),
            )
        };
        let e = env(&[
            TOKEN,
            ("STRIPE_WEBHOOK_SECRET", "whsec_x"),
            ("MQ_URL", "amqp://guest:pa55word@10.0.0.1:5672/%2f"),
            ("MQ_URL_2", "amqp://guest:pa55word@10.0.0.2:5672/%2f"),
            ("MQ_URL_BAD", "rabbitmq://guest:pa55word@10.0.0.3:5671/%2f"),
        ]);
        let s = load_str(
            &amqp("amqp_fallback = [\"env:MQ_URL_2\", \"amqp://10.0.0.3:5672/%2f\"]"),
            &e,
        )
        .unwrap();
        let DestinationKind::Amqp(a) = &s.destinations[0].kind else {
            panic!("an amqp destination")
        };
        let fallback: Vec<_> = a
            .fallback
            .iter()
            .map(|u| u.expose_text().unwrap())
            .collect();
        assert_eq!(
            fallback,
            [
                "amqp://guest:pa55word@10.0.0.2:5672/%2f",
                "amqp://10.0.0.3:5672/%2f"
            ]
        );
        assert!(!format!("{a:?}").contains("pa55word"), "{a:?}");

        let msg = load_str(
            &amqp("amqp_fallback = [\"env:MQ_URL_2\", \"env:MQ_URL_BAD\"]"),
            &e,
        )
        .unwrap_err()
        .to_string();
        assert!(msg.contains("destinations[0].amqp_fallback[1]: "), "{msg}");
        assert!(!msg.contains("pa55word"), "{msg}");
        let msg = load_str(
            &EXAMPLE.replace(
                "/webhooks/stripe\"",
                "/webhooks/stripe\"\namqp_fallback = [\"amqp://h/%2f\"]",
            ),
            &e,
        )
        .unwrap_err()
        .to_string();
        assert!(
            msg.contains("destinations[0].amqp_fallback: applies only to amqp destinations"),
            "{msg}"
        );
    }

    #[test]
    fn a_config_error_never_quotes_a_string_value() {
        assert_eq!(
            without_strings(r#"invalid type: string "whsec_\"x\\", expected a sequence"#),
            "invalid type: a string, expected a sequence"
        );
        assert_eq!(
            without_strings(r#"string "a" and string "b"#),
            "a string and a string"
        );
        assert_eq!(
            without_strings("unknown field `secret`"),
            "unknown field `secret`"
        );

        // A secret of the wrong type, in the file and from the environment.
        let in_file = EXAMPLE.replace(
            "[\"env:STRIPE_WEBHOOK_SECRET\"]",
            &format!("\"{FILE_SECRET}\""),
        );
        let msg = load_str(&in_file, &env(&[TOKEN])).unwrap_err().to_string();
        assert!(
            msg.ends_with("sources[0].secrets: invalid type: a string, expected a sequence"),
            "{msg}"
        );
        let value = format!("{{ s = \"{FILE_SECRET}\" }}");
        let from_env = env(&[TOKEN, ("HOOKLATCH_SOURCES__STRIPE__SECRETS", &value)]);
        let msg = load_str(EXAMPLE, &from_env).unwrap_err().to_string();
        assert!(!msg.contains(FILE_SECRET), "{msg}");
        assert!(
            msg.starts_with("HOOKLATCH_SOURCES__STRIPE__SECRETS: sources[0].secrets: "),
            "the variable is named: {msg}"
        );
        // One secret where a list goes is a list of one; a secret of digits alone is text.
        for secret in [FILE_SECRET, "8675309123"] {
            let from_env = env(&[TOKEN, ("HOOKLATCH_SOURCES__STRIPE__SECRETS", secret)]);
            let loaded = load_str(EXAMPLE, &from_env).expect("loads");
            assert_eq!(loaded.sources[0].secrets[0].expose(), secret.as_bytes());
        }
        let digits = env(&[
            ("HOOKLATCH_SERVER__ADMIN_TOKEN", "1234567890123456"),
            ("STRIPE_WEBHOOK_SECRET", "whsec_x"),
        ]);
        let loaded = load_str(EXAMPLE, &digits).expect("loads");
        assert_eq!(loaded.admin_token.expose(), b"1234567890123456");
        // Values of other types are left out of messages too, and a variable's mistake is
        // blamed on the variable.
        let msg = load_str(
            EXAMPLE,
            &env(&[
                TOKEN,
                ("STRIPE_WEBHOOK_SECRET", "whsec_x"),
                ("HOOKLATCH_SOURCES__STRIPE__PROVIDER", "8675309123"),
            ]),
        )
        .unwrap_err()
        .to_string();
        assert_eq!(
            msg,
            "HOOKLATCH_SOURCES__STRIPE__PROVIDER: sources[0].provider: invalid type: a value of \
             type integer, expected a string"
        );
        // A value of the right type that does not do is the variable's fault too.
        for (var, value, expect) in [
            (
                "HOOKLATCH_SERVER__BODY_LIMIT",
                "abc",
                "HOOKLATCH_SERVER__BODY_LIMIT: server.body_limit: ",
            ),
            (
                "HOOKLATCH_SOURCES__STRIPE__TOLERANCE",
                "soon",
                "HOOKLATCH_SOURCES__STRIPE__TOLERANCE: sources[0].tolerance: ",
            ),
            (
                "HOOKLATCH_SOURCES__STRIPE__DESTINATIONS",
                "[\"nowhere\"]",
                "HOOKLATCH_SOURCES__STRIPE__DESTINATIONS: sources[0].destinations[0]: ",
            ),
        ] {
            let msg = load_str(
                EXAMPLE,
                &env(&[TOKEN, ("STRIPE_WEBHOOK_SECRET", "whsec_x"), (var, value)]),
            )
            .unwrap_err()
            .to_string();
            assert!(msg.starts_with(expect), "{msg}");
        }
        // A mistake the file made is not blamed on a variable that set something else.
        let msg = load_str(
            &EXAMPLE.replace("[\"app\"]", "[\"ap\"]"),
            &env(&[
                TOKEN,
                ("STRIPE_WEBHOOK_SECRET", "whsec_x"),
                ("HOOKLATCH_SOURCES__STRIPE__TOLERANCE", "1m"),
            ]),
        )
        .unwrap_err()
        .to_string();
        assert!(msg.starts_with("sources[0].destinations[0]: "), "{msg}");
        let msg = load_str(
            EXAMPLE,
            &env(&[TOKEN, ("HOOKLATCH_DELIVERY__MAX_ATTEMPS", "3")]),
        )
        .unwrap_err()
        .to_string();
        assert!(
            msg.starts_with("HOOKLATCH_DELIVERY__MAX_ATTEMPS: delivery.max_attemps: unknown field"),
            "{msg}"
        );
    }

    /// A secret written in the file, to find in error messages.
    const FILE_SECRET: &str = "whsec_Zm9vYmFyYmF6cXV4";

    /// How a test edits a config file: a line's index and what to do with it. Only
    /// `BreakSecrets` writes the secret, and only where a secret goes: the file may be broken
    /// around it, but a secret moved into another field (`provider = "whsec_…"`) is that
    /// field's value to the gateway, and may be quoted back like any other.
    #[derive(Debug, Clone)]
    enum Edit {
        Delete(usize),
        /// The `secrets` line's value replaced by this, which holds the secret.
        BreakSecrets(String),
        /// The line up to its `=`, then this instead of its value.
        Revalue(usize, String),
        Insert(usize, String),
        /// This many characters cut from the line's end.
        Truncate(usize, usize),
    }

    fn any_edit() -> impl proptest::strategy::Strategy<Value = Edit> {
        use proptest::prelude::*;
        // Values and lines made of TOML's own punctuation, words the config knows, and the
        // secret, so that many edits get past the parser into the typed layers.
        let piece = |secret: bool| {
            let secrets = if secret {
                vec![
                    format!("\"{FILE_SECRET}\""),
                    format!("[\"{FILE_SECRET}\"]"),
                    format!("\"{FILE_SECRET}"),
                    FILE_SECRET.to_owned(),
                ]
            } else {
                vec!["\"x\"".to_owned()]
            };
            let punctuation = proptest::sample::select(vec![
                "[",
                "]",
                "\"",
                ",",
                "=",
                " ",
                "{",
                "}",
                "5",
                "true",
                "secrets",
                "[[sources]]",
            ]);
            prop_oneof![
                1 => proptest::sample::select(secrets),
                3 => punctuation.prop_map(str::to_owned),
                1 => "\\PC{0,6}",
            ]
        };
        let text =
            |secret: bool| proptest::collection::vec(piece(secret), 1..6).prop_map(|p| p.concat());
        let (text, with_secret) = (text(false), text(true));
        prop_oneof![
            with_secret
                .prop_filter("holds the secret", |t| t.contains(FILE_SECRET))
                .prop_map(Edit::BreakSecrets),
            any::<usize>().prop_map(Edit::Delete),
            (any::<usize>(), text.clone()).prop_map(|(i, t)| Edit::Revalue(i, t)),
            (any::<usize>(), text).prop_map(|(i, t)| Edit::Insert(i, t)),
            (any::<usize>(), 1usize..12).prop_map(|(i, n)| Edit::Truncate(i, n)),
        ]
    }

    /// `EXAMPLE` with its secret written in the file, edited.
    fn edited(edits: &[Edit]) -> String {
        let base = EXAMPLE.replace("env:STRIPE_WEBHOOK_SECRET", FILE_SECRET);
        let mut lines: Vec<String> = base.lines().map(str::to_owned).collect();
        for edit in edits {
            let n = lines.len().max(1);
            match edit {
                Edit::Delete(i) if !lines.is_empty() => {
                    lines.remove(i % n);
                }
                Edit::Delete(_) => {}
                Edit::BreakSecrets(value) => {
                    if let Some(line) = lines.iter_mut().find(|l| l.starts_with("secrets")) {
                        *line = format!("secrets = {value}");
                    }
                }
                Edit::Revalue(i, value) => {
                    if let Some(line) = lines.get_mut(i % n) {
                        let key = line.split('=').next().unwrap_or_default().to_owned();
                        *line = format!("{key}= {value}");
                    }
                }
                Edit::Insert(i, text) => lines.insert(i % (lines.len() + 1), text.clone()),
                Edit::Truncate(i, cut) => {
                    if let Some(line) = lines.get_mut(i % n) {
                        let keep = line.chars().count().saturating_sub(*cut);
                        *line = line.chars().take(keep).collect();
                    }
                }
            }
        }
        lines.join("\n")
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(1024))]

        /// Whatever a config file holds, loading it returns settings or an error, never a
        /// panic, and the error never quotes the secret written in the file, wherever the
        /// edits moved it (secrets never leave, not even in a refusal).
        #[test]
        fn an_edited_config_loads_or_is_refused_without_quoting_its_secret(
            edits in proptest::collection::vec(any_edit(), 1..5),
        ) {
            let toml = edited(&edits);
            if let Err(err) = load_str(&toml, &env(&[TOKEN])) {
                let msg = err.to_string();
                proptest::prop_assert!(!msg.is_empty());
                proptest::prop_assert!(
                    !msg.contains(FILE_SECRET),
                    "{} quoted in {:?} from\n{}", FILE_SECRET, msg, toml
                );
            }
        }
    }

    #[test]
    fn redis_keys_are_off_by_default_and_checked_when_on() {
        let with_secret = [("STRIPE_WEBHOOK_SECRET", "whsec_x")];
        let e = env(&[TOKEN, with_secret[0]]);
        assert!(load_str(EXAMPLE, &e).unwrap().store.keys.is_none());

        let mut on = e.clone();
        on.extend(env(&[
            (
                "HOOKLATCH_STORE__KEYS",
                "redis://:pa55word@127.0.0.1:6379/3",
            ),
            ("HOOKLATCH_STORE__KEY_LEASE", "5s"),
        ]));
        let keys = load_str(EXAMPLE, &on).unwrap().store.keys.unwrap();
        assert_eq!(keys.prefix, "hooklatch:");
        assert_eq!(keys.lease, Duration::from_secs(5));
        // A lease shorter than a commit would let a second copy claim the event again.
        let mut short = on.clone();
        short.insert("HOOKLATCH_STORE__KEY_LEASE".to_owned(), "1ms".to_owned());
        let msg = load_str(EXAMPLE, &short).unwrap_err().to_string();
        assert!(
            msg.contains("store.key_lease: must be at least 1s"),
            "{msg}"
        );
        let shown = format!("{keys:?}");
        assert!(
            shown.contains("redis://127.0.0.1:6379") && !shown.contains("pa55word"),
            "{shown}"
        );

        for (url, expect) in [
            (
                "rediss://:pa55word@cache:6380/#insecure",
                "a rediss:// URL takes no #fragment",
            ),
            (
                "memcached://:pa55word@cache",
                "expected \"\" (keys in the store) or a redis:// or rediss:// URL",
            ),
            (
                "redis://:pa55word@cache:6379/keys",
                "redis://cache:6379: the URL's path is the database's number",
            ),
        ] {
            let toml = EXAMPLE.replace("[store]\n", &format!("[store]\nkeys = \"{url}\"\n"));
            check_err(&toml, &with_secret, expect);
            let mut e = env(&[TOKEN]);
            e.extend(env(&with_secret));
            let msg = load_str(&toml, &e).unwrap_err().to_string();
            assert!(msg.starts_with("store.keys"), "{msg}");
            assert!(!msg.contains("pa55word"), "{msg}");
        }
        let toml = EXAMPLE.replace(
            "[store]\n",
            "[store]\nkeys = \"redis://127.0.0.1\"\nkey_prefix = \"\"\n",
        );
        check_err(&toml, &with_secret, "store.key_prefix: must not be empty");
    }

    /// `[server] tls_cert` and `tls_key`: both or neither; read and checked at load (the key
    /// must be the certificate's), and readable again later from the same places.
    #[test]
    fn the_public_listeners_tls_files_are_checked_at_load() {
        use hooklatch_testkit::tls::TestCa;
        let dir = tempfile::tempdir().unwrap();
        let ca = TestCa::new("listener CA");
        let (server, other) = (ca.server(&["hooks.example.com"]), ca.server(&["other"]));
        for (name, text) in [
            ("fullchain.pem", server.cert_pem()),
            ("privkey.pem", server.key_pem()),
            ("other.pem", other.key_pem()),
        ] {
            std::fs::write(dir.path().join(name), text).unwrap();
        }
        let e = env(&[TOKEN, ("STRIPE_WEBHOOK_SECRET", "whsec_x")]);
        let load_in_dir = |server_lines: &str| {
            let toml = format!("[server]\n{server_lines}\n{EXAMPLE}");
            let path = dir.path().join("hooklatch.toml");
            std::fs::write(&path, toml).unwrap();
            load(Some(&path), &e)
        };
        let plain = load_in_dir("").unwrap();
        assert!(plain.tls.is_none() && !plain.admin_tls);
        let both = load_in_dir(
            "tls_cert = \"fullchain.pem\"\ntls_key = \"file:privkey.pem\"\nadmin_tls = true",
        )
        .unwrap();
        assert!(both.tls.is_some() && both.admin_tls);
        let tls = load_in_dir("tls_cert = \"fullchain.pem\"\ntls_key = \"file:privkey.pem\"")
            .unwrap()
            .tls
            .expect("TLS on the public listener");
        assert_eq!(tls.cert_file, dir.path().join("fullchain.pem"));
        let (cert, key) = tls.read(&e).expect("read again");
        assert_eq!(cert, server.cert_pem());
        assert_eq!(key.expose_text(), Some(server.key_pem().trim()));
        assert!(!format!("{tls:?}").contains("privkey"));

        for (lines, expect) in [
            (
                "tls_cert = \"fullchain.pem\"",
                "server.tls_key: is required with server.tls_cert",
            ),
            (
                "tls_key = \"file:privkey.pem\"",
                "server.tls_cert: is required with server.tls_key",
            ),
            (
                "tls_cert = \"fullchain.pem\"\ntls_key = \"file:other.pem\"",
                "server.tls_cert: the key cannot be used with the certificate",
            ),
            (
                "tls_cert = \"missing.pem\"\ntls_key = \"file:privkey.pem\"",
                "server.tls_cert: reading ",
            ),
            (
                "admin_tls = true",
                "server.admin_tls: needs server.tls_cert and server.tls_key",
            ),
        ] {
            let msg = load_in_dir(lines).unwrap_err().to_string();
            assert!(msg.contains(expect), "{msg:?} lacks {expect:?}");
            assert!(!msg.contains("PRIVATE KEY"), "{msg}");
        }
    }

    /// `rediss://` (TLS) keys: the built-in roots alone, or a CA and a client certificate read
    /// and checked at load; TLS files without a `rediss://` URL are refused, saying why.
    #[test]
    fn rediss_keys_load_with_their_tls_files_checked_and_no_secret_shown() {
        use hooklatch_testkit::tls::TestCa;
        let dir = tempfile::tempdir().unwrap();
        let ca = TestCa::new("redis CA");
        let (client, other) = (ca.client("hooklatch"), ca.client("other"));
        for (name, text) in [
            ("ca.pem", ca.pem()),
            ("client.pem", client.cert_pem()),
            ("client.key", client.key_pem()),
            ("other.key", other.key_pem()),
        ] {
            std::fs::write(dir.path().join(name), text).unwrap();
        }
        let e = env(&[
            TOKEN,
            ("STRIPE_WEBHOOK_SECRET", "whsec_x"),
            ("REDIS_KEY", client.key_pem()),
        ]);
        let load_in_dir = |store: &str| {
            let toml = EXAMPLE.replace("[store]\n", &format!("[store]\n{store}\n"));
            let path = dir.path().join("hooklatch.toml");
            std::fs::write(&path, toml).unwrap();
            load(Some(&path), &e)
        };
        let keys = load_in_dir("keys = \"rediss://:pa55word@cache:6380/2\"")
            .unwrap()
            .store
            .keys
            .expect("Redis keys");
        assert!(!keys.tls.is_set());
        let keys = load_in_dir(
            "keys = \"rediss://:pa55word@cache:6380/2\"\nkeys_ca_file = \"ca.pem\"\n\
             keys_client_cert = \"client.pem\"\nkeys_client_key = \"env:REDIS_KEY\"",
        )
        .unwrap()
        .store
        .keys
        .expect("Redis keys");
        assert_eq!(keys.tls.ca_pem.as_deref(), Some(ca.pem()));
        assert!(keys.tls.client.is_some());
        let shown = format!("{keys:?}");
        assert!(
            !shown.contains("pa55word") && !shown.contains("PRIVATE"),
            "{shown}"
        );

        let check = |store: &str, expect: &str| {
            let msg = load_in_dir(store).unwrap_err().to_string();
            assert!(msg.contains(expect), "{msg:?} lacks {expect:?}");
            assert!(
                !msg.contains("pa55word") && !msg.contains("PRIVATE"),
                "{msg}"
            );
        };
        check(
            "keys_ca_file = \"ca.pem\"",
            "store.keys_ca_file: applies only to TLS connections; keys are in the store",
        );
        check(
            "keys = \"redis://:pa55word@cache:6379\"\nkeys_client_cert = \"client.pem\"\nkeys_client_key = \"file:client.key\"",
            "store.keys_client_cert: applies only to TLS connections; store.keys is a redis:// URL",
        );
        check(
            "keys = \"rediss://:pa55word@cache:6380\"\nkeys_client_cert = \"client.pem\"\nkeys_client_key = \"file:other.key\"",
            "store.keys_client_cert: the key cannot be used with the certificate",
        );
        check(
            "keys = \"rediss://:pa55word@cache:6380\"\nkeys_ca_file = \"client.key\"",
            "store.keys_ca_file: client.key: holds no PEM certificate",
        );
    }

    /// A destination's TLS files (`ca_file`, `client_cert`, `client_key`), for `amqps://` and
    /// `https://`: the built-in roots alone, or a private CA and a client certificate whose
    /// files are read and checked at load (relative to the configuration's directory); every
    /// mistake is named, and neither the URL's password nor the client key shows in an error
    /// or in `Debug`.
    #[test]
    fn destination_tls_files_are_checked_at_load_and_no_secret_shown() {
        use hooklatch_testkit::tls::TestCa;
        let dir = tempfile::tempdir().unwrap();
        let ca = TestCa::new("rabbit CA");
        let (client, other) = (ca.client("hooklatch"), ca.client("other"));
        let files = [
            ("ca.pem", ca.pem()),
            ("client.pem", client.cert_pem()),
            ("client.key", client.key_pem()),
            ("other.key", other.key_pem()),
            ("not-a-ca.pem", client.key_pem()),
        ];
        for (name, text) in files {
            std::fs::write(dir.path().join(name), text).unwrap();
        }
        let e = env(&[
            TOKEN,
            ("STRIPE_WEBHOOK_SECRET", "whsec_x"),
            ("MQ_TLS", "amqps://guest:pa55word@mq.internal:5671/%2f"),
            ("MQ_PLAIN", "amqp://guest:pa55word@mq.internal:5672/%2f"),
        ]);
        let load_in_dir = |rest: &str| {
            let toml = EXAMPLE.replace(
                "url = \"http://app.internal:3000/webhooks/stripe\"",
                &format!("exchange = \"payments\"\nrouting_key = \"payment.confirmed\"\n{rest}"),
            );
            let path = dir.path().join("hooklatch.toml");
            std::fs::write(&path, toml).unwrap();
            load(Some(&path), &e)
        };
        let amqp = |s: &Settings| match &s.destinations[0].kind {
            DestinationKind::Amqp(a) => a.clone(),
            other => panic!("{other:?}"),
        };

        let roots_only = load_in_dir("amqp = \"env:MQ_TLS\"").unwrap();
        let a = amqp(&roots_only);
        assert!(a.tls.ca_pem.is_none() && a.tls.client.is_none());
        assert_eq!(a.redacted_url(), "amqps://guest:***@mq.internal:5671/%2f");

        let full = load_in_dir(
            "amqp = \"env:MQ_TLS\"\nca_file = \"ca.pem\"\n\
             client_cert = \"client.pem\"\nclient_key = \"file:client.key\"",
        )
        .unwrap();
        let a = amqp(&full);
        assert_eq!(a.tls.ca_pem.as_deref(), Some(ca.pem()));
        let identity = a.tls.client.as_ref().expect("a client identity");
        assert_eq!(
            identity.key_pem.expose_text(),
            Some(client.key_pem().trim())
        );
        assert_eq!(identity.cert_pem, client.cert_pem());
        let shown = format!("{full:?}");
        assert!(!shown.contains("pa55word"), "{shown}");
        assert!(!shown.contains("PRIVATE KEY"), "{shown}");

        // A plain primary with an amqps:// fallback node: the TLS files are for that node.
        load_in_dir(
            "amqp = \"env:MQ_PLAIN\"\namqp_fallback = [\"env:MQ_TLS\"]\nca_file = \"ca.pem\"",
        )
        .unwrap();

        let check = |rest: &str, expect: &str| {
            let msg = load_in_dir(rest).unwrap_err().to_string();
            assert!(msg.contains(expect), "{msg:?} lacks {expect:?}");
            assert!(!msg.contains("pa55word"), "{msg}");
            assert!(!msg.contains("PRIVATE KEY"), "{msg}");
            for key in [client.key_pem(), other.key_pem()] {
                let body = key.lines().nth(1).unwrap();
                assert!(!msg.contains(body), "{msg}");
            }
        };
        check(
            "amqp = \"env:MQ_PLAIN\"\nca_file = \"ca.pem\"",
            "destinations[0].ca_file: applies only to TLS connections; this destination's URLs are all amqp://",
        );
        check(
            "amqp = \"env:MQ_TLS\"\nca_file = \"missing.pem\"",
            "destinations[0].ca_file: reading ",
        );
        check(
            "amqp = \"env:MQ_TLS\"\nca_file = \"not-a-ca.pem\"",
            "destinations[0].ca_file: not-a-ca.pem: holds no PEM certificate",
        );
        check(
            "amqp = \"env:MQ_TLS\"\nclient_cert = \"client.pem\"",
            "destinations[0].client_key: is required with destinations[0].client_cert",
        );
        check(
            "amqp = \"env:MQ_TLS\"\nclient_key = \"file:client.key\"",
            "destinations[0].client_cert: is required with destinations[0].client_key",
        );
        check(
            "amqp = \"env:MQ_TLS\"\nclient_cert = \"client.pem\"\nclient_key = \"file:other.key\"",
            "destinations[0].client_cert: the key cannot be used with the certificate",
        );
        check(
            "amqp = \"env:MQ_TLS\"\nclient_cert = \"client.pem\"\nclient_key = \"file:client.pem\"",
            "destinations[0].client_cert: the key holds no PEM private key",
        );
        check(
            "amqp = \"http://mq.internal/\"",
            "destinations[0].amqp: must be an amqp:// URL (or amqps:// for TLS)",
        );

        // The same keys on an HTTP destination: for an https:// url only; never on a listen
        // destination.
        let load_destination = |lines: &str| {
            let toml = EXAMPLE.replace("url = \"http://app.internal:3000/webhooks/stripe\"", lines);
            let path = dir.path().join("hooklatch.toml");
            std::fs::write(&path, toml).unwrap();
            load(Some(&path), &e)
        };
        let https = load_destination(
            "url = \"https://app.internal/webhooks/stripe\"\nca_file = \"ca.pem\"\n\
             client_cert = \"client.pem\"\nclient_key = \"file:client.key\"",
        )
        .unwrap();
        let DestinationKind::Http { tls, .. } = &https.destinations[0].kind else {
            panic!("an HTTP destination");
        };
        assert_eq!(tls.ca_pem.as_deref(), Some(ca.pem()));
        assert!(tls.client.is_some());
        assert!(!format!("{https:?}").contains("PRIVATE KEY"));
        for (lines, expect) in [
            (
                "url = \"http://app.internal/webhooks/stripe\"\nca_file = \"ca.pem\"",
                "destinations[0].ca_file: applies only to TLS connections; this destination's url is http://",
            ),
            (
                "url = \"https://app.internal/webhooks/stripe\"\nclient_key = \"file:other.key\"\nclient_cert = \"client.pem\"",
                "destinations[0].client_cert: the key cannot be used with the certificate",
            ),
            (
                "listen_token = \"0123456789abcdef0123\"\nca_file = \"ca.pem\"",
                "destinations[0].ca_file: applies only to url and amqp destinations",
            ),
        ] {
            let msg = load_destination(lines).unwrap_err().to_string();
            assert!(msg.contains(expect), "{msg:?} lacks {expect:?}");
            assert!(!msg.contains("PRIVATE KEY"), "{msg}");
        }
    }
}
