//! hooklatch: the idempotent webhook gateway, as a library.
//!
//! [`serve`] runs the whole gateway from [`Settings`]: it opens the store, binds the public
//! and admin listeners, starts the delivery workers and the purge, and runs until its
//! cancellation token fires. The `hooklatch` binary is a thin layer over this crate, so tests
//! and embedders take the same path.
//!
//! Layout:
//! - [`config`]: layered TOML and environment configuration, resolved into [`Settings`].
//! - [`delivery`]: the workers that deliver the outbox to destinations (HTTP or RabbitMQ) with
//!   retries.
//! - [`bench`](mod@bench): the load generator behind `hooklatch bench` (ingest, the HTTP ceiling, delivery).
//! - [`listen`]: `listen` destinations on the gateway's side: the listeners connected, their
//!   stream of deliveries and their answers; [`listener`]: the `hooklatch listen` client.
//! - [`fixtures`]: realistic signed test events per provider (`hooklatch send`).
//! - [`capture`]: one request as the gateway kept it, and the export file format.
//! - [`admin`]: a client of a running gateway's admin API (captures by `req_`/`dlv_` id).
//! - [`replay`]: send a capture again, N times, K at once, re-signed; the report.
//! - [`check`]: the idempotency harness (`hooklatch check`), with [`effect`] probes that count
//!   what a handler did (SQL on SQLite or PostgreSQL, or a command).
//! - `server`: hyper connection handling with header timeouts and graceful drain.
//! - `maintenance`: the purge of expired claims and old history, and store gauges.
#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod admin;
pub mod bench;
pub mod capture;
pub mod check;
pub mod config;
pub mod contact;
pub mod delivery;
pub mod effect;
pub mod fixtures;
pub mod listen;
pub mod listener;
mod listener_tls;
mod maintenance;
mod outbound;
pub mod replay;
mod server;
#[cfg(test)]
mod simulation;
mod telemetry;
mod tls_files;
pub mod trust;

use std::collections::HashMap;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use anyhow::Context;
use hooklatch_core::Store;
use hooklatch_http::{AdminState, IngestState};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
use tokio::net::TcpListener;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

pub use config::Settings;
pub use hooklatch_core as core;
pub use hooklatch_http as http;

/// The ingest router's state for `settings`' sources and limits, over `store` (and `keys` in
/// Redis mode); `handoff` gives new deliveries to this instance's worker.
pub fn ingest_state(
    settings: &Settings,
    store: Arc<dyn Store>,
    enqueued: Arc<Notify>,
    keys: Option<hooklatch_http::ExternalKeys>,
    handoff: Option<Arc<hooklatch_http::Handoff>>,
) -> IngestState {
    IngestState {
        store,
        sources: settings
            .sources
            .iter()
            .map(|s| (s.name.to_string(), s.clone()))
            .collect(),
        body_limit: settings.body_limit,
        refused_body_limit: settings.refused_body_limit,
        body_timeout: settings.body_timeout,
        enqueued,
        keys,
        handoff,
    }
}

/// `n` and the noun for it, in the singular or the plural: "1 request", "3 requests".
pub fn counted(n: u64, one: &str, many: &str) -> String {
    format!("{n} {}", if n == 1 { one } else { many })
}

/// An open store, and the task that wakes workers when another instance queues work (for
/// stores shared between instances).
pub struct OpenStore {
    /// The store.
    pub store: Arc<dyn Store>,
    /// Wakes `enqueued` on work queued by other instances; aborted on drop.
    pub listener: Option<tokio::task::JoinHandle<()>>,
}

impl Drop for OpenStore {
    fn drop(&mut self) {
        if let Some(listener) = &self.listener {
            listener.abort();
        }
    }
}

/// Opens the configured store for serving (running its migrations). A SQLite file is taken for
/// this process alone, and the leases a gateway that died left in it are given back; a shared
/// store starts listening for work queued by other instances, waking `enqueued`.
pub async fn open_store(
    settings: &config::StoreSettings,
    enqueued: Arc<Notify>,
) -> anyhow::Result<OpenStore> {
    match &settings.backend {
        #[cfg(feature = "sqlite")]
        config::StoreBackend::Sqlite(opts) => {
            let _ = enqueued;
            let (store, released) = hooklatch_store_sqlite::SqliteStore::open_serving(opts)
                .with_context(|| format!("opening the store at {}", opts.path.display()))?;
            if released > 0 {
                tracing::info!(
                    released,
                    "released the deliveries a gateway that did not stop cleanly held leased; they are due now"
                );
            }
            Ok(OpenStore {
                store: Arc::new(store),
                listener: None,
            })
        }
        #[cfg(feature = "postgres")]
        config::StoreBackend::Postgres(opts) => {
            let store = hooklatch_store_postgres::PostgresStore::connect(opts)
                .await
                .with_context(|| format!("opening the store at {}", opts.redacted_url()))?;
            let listener = store.listen_for_work(enqueued);
            Ok(OpenStore {
                store: Arc::new(store),
                listener: Some(listener),
            })
        }
    }
}

/// Runs the store's migrations and returns (`hooklatch migrate`) a line saying which store it
/// was and what was done: created, migrated from one version to another, or up to date.
/// Opening the store migrates too; this is for deployments that migrate before rolling out new
/// instances.
pub async fn migrate(settings: &config::StoreSettings) -> anyhow::Result<String> {
    let (store, (from, to)) = match &settings.backend {
        #[cfg(feature = "sqlite")]
        config::StoreBackend::Sqlite(opts) => {
            let store = hooklatch_store_sqlite::SqliteStore::open(opts)
                .with_context(|| format!("migrating the store at {}", opts.path.display()))?;
            (
                format!("sqlite {}", opts.path.display()),
                store.schema_versions(),
            )
        }
        #[cfg(feature = "postgres")]
        config::StoreBackend::Postgres(opts) => {
            let store = hooklatch_store_postgres::PostgresStore::connect(opts)
                .await
                .with_context(|| format!("migrating the store at {}", opts.redacted_url()))?;
            store.migrate().await.context("running migrations")?;
            (
                format!("postgres {}", opts.redacted_url()),
                store.schema_versions(),
            )
        }
    };
    Ok(match from {
        0 => format!("{store}: created, schema version {to}"),
        from if from == to => format!("{store}: up to date, schema version {to}"),
        from => format!("{store}: migrated from schema version {from} to {to}"),
    })
}

/// The process-wide Prometheus recorder (installed once; later calls share it).
fn metrics_handle() -> PrometheusHandle {
    static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();
    HANDLE
        .get_or_init(|| {
            let recorder = PrometheusBuilder::new()
                .set_buckets_for_metric(
                    Matcher::Suffix("_seconds".to_owned()),
                    &[
                        0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
                        5.0, 10.0, 30.0,
                    ],
                )
                .expect("bucket list is not empty")
                .build_recorder();
            let handle = recorder.handle();
            if metrics::set_global_recorder(recorder).is_err() {
                tracing::warn!("a metrics recorder was already installed; /metrics may be empty");
            }
            handle
        })
        .clone()
}

/// Connects the external key store (Redis mode), if one is configured, and warns about every
/// server setting under which it could forget keys.
async fn open_keys(
    settings: &config::StoreSettings,
) -> anyhow::Result<Option<hooklatch_http::ExternalKeys>> {
    let Some(keys) = &settings.keys else {
        return Ok(None);
    };
    let redis =
        hooklatch_keys_redis::RedisKeys::connect_with_tls(&keys.url, &keys.prefix, &keys.tls)
            .await
            .context("opening the key store ([store] keys)")?;
    let warnings = redis.check().await;
    for warning in &warnings {
        tracing::warn!("key store: {warning}");
    }
    // How many of its settings let Redis forget keys (a forgotten key can only let a
    // duplicate through, never lose an event): 0 when all is well.
    metrics::gauge!("hooklatch_key_store_may_forget").set(warnings.len() as f64);
    tracing::info!(
        keys = %hooklatch_keys_redis::describe_url(&keys.url),
        prefix = %keys.prefix,
        lease_ms = keys.lease.as_millis() as u64,
        "idempotency keys live in Redis"
    );
    Ok(Some(hooklatch_http::ExternalKeys {
        store: Arc::new(redis),
        lease: keys.lease,
    }))
}

/// Runs the gateway until `cancel` fires, then shuts down gracefully.
pub async fn serve(settings: Settings, cancel: CancellationToken) -> anyhow::Result<()> {
    log_effective_config(&settings);
    let metrics = metrics_handle();
    telemetry::register(&settings);
    let enqueued = Arc::new(Notify::new());
    let opened = open_store(&settings.store, enqueued.clone()).await?;
    let store = opened.store.clone();
    let keys = open_keys(&settings.store).await?;
    let ingest_tls = match &settings.tls {
        None => None,
        Some(tls) => {
            let tls = Arc::new(listener_tls::ListenerTls::new(tls.clone())?);
            tls.clone().reload_on_sighup()?;
            Some(tls)
        }
    };
    let ingest_listener = TcpListener::bind(settings.listen)
        .await
        .with_context(|| format!("binding server.listen {}", settings.listen))?;
    let admin_listener = TcpListener::bind(settings.admin_listen)
        .await
        .with_context(|| format!("binding server.admin_listen {}", settings.admin_listen))?;
    if !settings.admin_listen.ip().is_loopback() {
        tracing::warn!(addr = %settings.admin_listen, "the admin API listens beyond loopback; keep its token secret and the port private");
    }

    let readiness = Arc::new(hooklatch_http::Readiness::default());
    let owner = format!("{}-{}", std::process::id(), rand::random::<u32>());
    let lease = lease_for(&settings);
    let handoff = Arc::new(hooklatch_http::Handoff::new(
        owner.clone(),
        lease,
        settings.delivery.concurrency,
    ));
    let stop_serving = CancellationToken::new();
    let listen = Arc::new(listen::ListenHub::new(
        store.clone(),
        enqueued.clone(),
        &settings.destinations,
        stop_serving.clone(),
        store_is_shared(&settings.store),
    ));
    // Which destinations are held (a 410 from them, or an operator), as the store says at start.
    let disabled = Arc::new(hooklatch_http::DisabledDestinations::default());
    disabled
        .reload(store.as_ref())
        .await
        .context("reading the disabled destinations")?;
    for d in disabled.all() {
        tracing::warn!(destination = %d.destination, reason = %d.reason,
            since = %d.disabled_at.to_rfc3339(),
            "destination is disabled: its deliveries wait until it is enabled \
             (hooklatch destinations enable NAME)");
    }
    for d in &settings.destinations {
        metrics::gauge!("hooklatch_destination_disabled", "destination" => d.name.clone()).set(
            if disabled.is_disabled(&d.name) {
                1.0
            } else {
                0.0
            },
        );
    }
    let ingest = hooklatch_http::ingest_router(Arc::new(ingest_state(
        &settings,
        store.clone(),
        enqueued.clone(),
        keys.clone(),
        (settings.delivery.enabled && settings.delivery.handoff).then(|| handoff.clone()),
    )))
    .merge(listen::router(listen.clone()))
    .layer(axum::middleware::map_response(close_when_stopping(
        readiness.clone(),
    )));
    let render = metrics.clone();
    let admin_state = Arc::new(AdminState {
        store: store.clone(),
        token: settings.admin_token.clone(),
        metrics: Arc::new(move || render.render()),
        readiness: readiness.clone(),
        body_limit: settings.body_limit,
        enqueued: enqueued.clone(),
        destinations: settings
            .sources
            .iter()
            .map(|s| (s.name.to_string(), s.destinations.clone()))
            .collect(),
        destination_kinds: settings
            .destinations
            .iter()
            .map(|d| (d.name.clone(), d.kind.name()))
            .collect(),
        disabled: disabled.clone(),
        keys: keys.map(|k| k.store),
    });
    let admin = hooklatch_http::admin_router(admin_state.clone());

    let destinations: HashMap<_, _> = settings
        .destinations
        .iter()
        .map(|d| (d.name.clone(), Arc::new(d.clone())))
        .collect();
    // One publisher (one connection, one confirm-mode channel) per RabbitMQ destination,
    // shared by every delivery task; each connects on its first publish.
    let publishers: HashMap<_, _> = settings
        .destinations
        .iter()
        .filter_map(|d| match &d.kind {
            config::DestinationKind::Amqp(a) => Some((
                d.name.clone(),
                Arc::new(hooklatch_queue_rabbitmq::Publisher::new(publisher_config(
                    d, a,
                ))),
            )),
            config::DestinationKind::Http { .. } | config::DestinationKind::Listen { .. } => None,
        })
        .collect();
    let worker = delivery::Worker {
        store: store.clone(),
        destinations,
        publishers: publishers.clone(),
        providers: providers_of(&settings),
        signers: signers_of(&settings),
        under_way: Default::default(),
        clients: settings
            .destinations
            .iter()
            .filter_map(|d| match &d.kind {
                config::DestinationKind::Http { allow, tls, .. } => Some(
                    outbound::client(allow.clone(), tls)
                        .map(|client| (d.name.clone(), Arc::new(client) as Arc<dyn delivery::Post>))
                        .context("building a delivery HTTP client"),
                ),
                _ => None,
            })
            .collect::<anyhow::Result<_>>()?,
        owner,
        concurrency: settings.delivery.concurrency,
        poll_interval: settings.delivery.poll_interval,
        lease,
        enqueued: enqueued.clone(),
        handoff,
        listen,
        disabled: disabled.clone(),
        retry_scheduled: Default::default(),
    };

    let grace = settings.shutdown_grace;
    let mut tasks = tokio::task::JoinSet::new();
    tasks.spawn(server::serve(
        "ingest",
        ingest_listener,
        ingest,
        settings.header_timeout,
        ingest_tls.clone(),
        stop_serving.clone(),
        grace,
    ));
    // The admin listener stops last, once requests and deliveries in flight are done, so
    // that `/readyz` says "shutting down" and `/metrics` answers for as long as that takes.
    let stop_admin = CancellationToken::new();
    let admin_task = tokio::spawn(server::serve(
        "admin",
        admin_listener,
        admin,
        settings.header_timeout,
        ingest_tls.clone().filter(|_| settings.admin_tls),
        stop_admin.clone(),
        grace,
    ));
    if store_is_shared(&settings.store) {
        // Another instance may disable or enable a destination.
        tasks.spawn(delivery::follow_disabled(
            disabled.clone(),
            store.clone(),
            delivery::DISABLED_RELOAD,
            stop_serving.clone(),
        ));
    }
    // Held deliveries whose destination was enabled while nobody could wake them.
    tasks.spawn(delivery::sweep_held(
        store.clone(),
        enqueued.clone(),
        delivery::HELD_SWEEP,
        stop_serving.clone(),
    ));
    if settings.delivery.enabled {
        // Each broker connected at once, not at the first event: one that cannot be reached,
        // or a queue that exists with other arguments, is said at start. Nothing waits on it:
        // deliveries to a broker that is down wait in the outbox and are retried.
        for (name, publisher) in &publishers {
            let (name, publisher) = (name.clone(), publisher.clone());
            tokio::spawn(async move {
                match publisher.connect_now().await {
                    Ok(()) => tracing::info!(destination = %name, "connected to RabbitMQ"),
                    Err(err) => tracing::warn!(
                        destination = %name,
                        "RabbitMQ cannot be reached now ({err}): deliveries to it wait in the \
                         outbox and are retried"
                    ),
                }
            });
        }
        tasks.spawn(worker.run(stop_serving.clone(), grace));
    } else {
        tracing::warn!(
            "delivery is off in this instance ([delivery] enabled = false): events are queued, \
             and delivered only by an instance on the same store with delivery on"
        );
    }
    tasks.spawn(maintenance::run(
        store.clone(),
        settings.store.clone(),
        metrics,
        admin_state,
        stop_serving.clone(),
    ));

    readiness.set_ready();
    metrics::gauge!("hooklatch_ready").set(1.0);
    tracing::info!(listen = %settings.listen, admin = %settings.admin_listen, "hooklatch is ready");
    tracing::info!(
        "web inspector: {}://{}/ui/ (with the admin token)",
        if settings.admin_tls { "https" } else { "http" },
        settings.admin_listen
    );
    cancel.cancelled().await;
    readiness.set_stopping();
    metrics::gauge!("hooklatch_ready").set(0.0);
    if !settings.shutdown_delay.is_zero() {
        // A load balancer that polls `/readyz` stops sending here; what it sends until it
        // notices is still taken.
        tracing::info!(
            delay_s = settings.shutdown_delay.as_secs_f64(),
            "shutting down: /readyz answers 503; still taking requests for server.shutdown_delay"
        );
        tokio::time::sleep(settings.shutdown_delay).await;
    }
    tracing::info!("shutting down: no new requests; finishing those in flight");
    stop_serving.cancel();
    while let Some(res) = tasks.join_next().await {
        if let Err(err) = res {
            tracing::error!(%err, "a gateway task panicked");
        }
    }
    stop_admin.cancel();
    if let Err(err) = admin_task.await {
        tracing::error!(%err, "the admin listener panicked");
    }
    for publisher in publishers.values() {
        publisher.disconnect().await;
    }
    drop(opened);
    tracing::info!("stopped");
    Ok(())
}

/// While shutting down (the shutdown delay above all), each ingest answer carries
/// `Connection: close`: a client on a kept-alive connection (a load balancer, a provider)
/// opens its next one elsewhere instead of finding this one closed when the listener stops.
fn close_when_stopping(
    readiness: Arc<hooklatch_http::Readiness>,
) -> impl Fn(axum::response::Response) -> std::future::Ready<axum::response::Response> + Clone {
    move |mut res: axum::response::Response| {
        if readiness.is_stopping() {
            res.headers_mut().insert(
                axum::http::header::CONNECTION,
                axum::http::HeaderValue::from_static("close"),
            );
        }
        std::future::ready(res)
    }
}

/// The publisher of RabbitMQ destination `d` (whose settings are `a`).
fn publisher_config(
    d: &config::Destination,
    a: &config::AmqpSettings,
) -> hooklatch_queue_rabbitmq::PublisherConfig {
    let mut cfg = hooklatch_queue_rabbitmq::PublisherConfig::new(
        a.url_text(),
        a.exchange.clone(),
        a.routing_key.clone(),
    );
    cfg.fallback_urls = a
        .fallback
        .iter()
        .map(|url| url.expose_text().unwrap_or_default().to_owned())
        .collect();
    cfg.declare = a.declare;
    cfg.queue = a.queue.clone();
    cfg.quorum = a.quorum;
    cfg.max_length = a.max_length;
    cfg.delivery_limit = a.delivery_limit;
    cfg.dead_letter_exchange = a.dead_letter_exchange.clone();
    cfg.tls = a.tls.clone();
    cfg.timeout = d.timeout;
    cfg
}

/// How long a worker's lease on a delivery lasts: longer than any attempt, the longest
/// destination timeout twice over plus a margin.
fn lease_for(settings: &Settings) -> Duration {
    let longest_timeout = settings
        .destinations
        .iter()
        .map(|d| d.timeout)
        .max()
        .unwrap_or(Duration::from_secs(30));
    longest_timeout * 2 + Duration::from_secs(10)
}

/// Each source's provider, by source name (the worker's `hooklatch-provider` AMQP header).
fn providers_of(settings: &Settings) -> HashMap<String, &'static str> {
    settings
        .sources
        .iter()
        .map(|s| (s.name.to_string(), s.adapter.provider()))
        .collect()
}

/// The sources whose provider's signature deliveries sign again ([`delivery::ProviderSigner`]).
fn signers_of(settings: &Settings) -> HashMap<String, delivery::ProviderSigner> {
    settings
        .sources
        .iter()
        .filter_map(|s| Some((s.name.to_string(), delivery::ProviderSigner::of(s)?)))
        .collect()
}

/// `url` as logs may show it: without its user, password and query (`?token=…` is as secret
/// as a password).
fn loggable(url: &url::Url) -> url::Url {
    let mut url = url.clone();
    let _ = url.set_password(None);
    let _ = url.set_username("");
    if url.query().is_some() {
        url.set_query(Some("redacted"));
    }
    url
}

/// Whether other gateways may share the store (and so hold a `listen` destination's listener):
/// PostgreSQL; one `serve` holds a SQLite file.
fn store_is_shared(store: &config::StoreSettings) -> bool {
    match &store.backend {
        #[cfg(feature = "sqlite")]
        config::StoreBackend::Sqlite(_) => false,
        #[cfg(feature = "postgres")]
        config::StoreBackend::Postgres(_) => true,
    }
}

fn log_effective_config(settings: &Settings) {
    let store = match &settings.store.backend {
        #[cfg(feature = "sqlite")]
        config::StoreBackend::Sqlite(o) => format!("sqlite {}", o.path.display()),
        #[cfg(feature = "postgres")]
        config::StoreBackend::Postgres(o) => format!("postgres {}", o.redacted_url()),
    };
    tracing::info!(
        listen = %settings.listen,
        tls_cert = settings.tls.as_ref().map(|t| t.cert_file.display().to_string()),
        admin_listen = %settings.admin_listen,
        admin_tls = settings.admin_tls,
        %store,
        body_limit = settings.body_limit,
        "configuration"
    );
    for s in &settings.sources {
        // A tolerance is only logged where it is used: a provider's signature that covers no
        // timestamp has none.
        let tolerance_s = hooklatch_core::provider::TIMESTAMP_SIGNERS
            .contains(&s.adapter.provider())
            .then_some(s.tolerance.as_secs());
        tracing::info!(
            source = %s.name,
            provider = s.adapter.provider(),
            secrets = s.secrets.len(),
            destinations = s.destinations.join(", "),
            tolerance_s,
            retention_s = s.retention.as_secs(),
            public_url = s.adapter.public_url(),
            "source"
        );
    }
    for d in &settings.destinations {
        match &d.kind {
            config::DestinationKind::Http {
                url,
                secret,
                allow,
                tls,
            } => {
                let url = loggable(url);
                tracing::info!(
                    destination = %d.name,
                    url = %url,
                    signed = secret.is_some(),
                    allow = allow
                        .allowed()
                        .iter()
                        .map(ToString::to_string)
                        .collect::<Vec<_>>()
                        .join(", "),
                    ca_file = tls.ca_pem.is_some(),
                    client_certificate = tls.client.is_some(),
                    provider_signature = d.provider_signature.as_str(),
                    max_attempts = d.retry.max_attempts,
                    "destination"
                );
            }
            config::DestinationKind::Amqp(a) => tracing::info!(
                destination = %d.name,
                amqp = %a.redacted_url(),
                exchange = %a.exchange,
                routing_key = %a.routing_key,
                declare = a.declare,
                queue = a.queue.as_deref().unwrap_or(""),
                quorum = a.quorum,
                ca_file = a.tls.ca_pem.is_some(),
                client_certificate = a.tls.client.is_some(),
                max_attempts = d.retry.max_attempts,
                "destination"
            ),
            config::DestinationKind::Listen { secret, .. } => tracing::info!(
                destination = %d.name,
                listen = %format!("/listen/{}", d.name),
                signed = secret.is_some(),
                provider_signature = d.provider_signature.as_str(),
                max_attempts = d.retry.max_attempts,
                "destination"
            ),
        }
    }
    for warning in settings.warnings() {
        tracing::warn!("{warning}");
    }
}

#[cfg(test)]
mod loggable_tests {
    #[test]
    fn a_logged_url_has_no_credentials_and_no_query() {
        let url = "https://user:s3cret@app.example:8443/hooks?token=qs3cret&x=1#part"
            .parse()
            .unwrap();
        let shown = super::loggable(&url).to_string();
        assert_eq!(shown, "https://app.example:8443/hooks?redacted#part");
        let plain = "http://127.0.0.1:3000/webhooks".parse().unwrap();
        assert_eq!(
            super::loggable(&plain).as_str(),
            "http://127.0.0.1:3000/webhooks"
        );
    }
}

#[cfg(test)]
mod counted_tests {
    #[test]
    fn one_is_singular_and_every_other_count_plural() {
        assert_eq!(super::counted(0, "request", "requests"), "0 requests");
        assert_eq!(super::counted(1, "request", "requests"), "1 request");
        assert_eq!(
            super::counted(2, "held delivery", "held deliveries"),
            "2 held deliveries"
        );
    }
}
