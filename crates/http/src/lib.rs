//! hooklatch-http: the gateway's two routers and the errors they answer with.
//!
//! - [`ingest_router`] serves `POST /in/{source}` on the public listener: size limit, verify,
//!   extract keys, claim and enqueue through the [`Store`], answer.
//! - [`admin_router`] serves the JSON admin API (`/v1/…`), `/metrics`, `/healthz` and
//!   `/readyz` on the admin listener, behind a bearer token (the health probes excepted).
//!
//! The routers know nothing about configuration files or backends: they get an
//! `Arc<dyn Store>` and resolved [`Source`]s from the `hooklatch` crate.
//!
//! Layout: [`error`] holds [`ApiError`]; `routes/ingest.rs` serves `/in`, `routes/requests.rs`
//! serves `/v1/requests`, `routes/deliveries.rs` serves `/v1/deliveries`, `routes/health.rs`
//! serves the probes and metrics. [`wire`] serves one HTTP/1.1 connection to a router, as
//! every listener does.
#![forbid(unsafe_code)]

pub mod disabled;
pub mod error;
mod extract;
pub mod handoff;
mod routes;
pub mod wire;

use std::collections::HashMap;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use hooklatch_core::{KeyStore, ProviderAdapter, Secret, SourceName, Store};
use tokio::sync::Notify;
use tower_http::classify::{ServerErrorsAsFailures, SharedClassifier};
use tower_http::trace::{DefaultOnFailure, DefaultOnRequest, DefaultOnResponse, TraceLayer};
use tracing::Level;

pub use disabled::{DisabledDestinations, Reloaded};
pub use error::ApiError;
pub use extract::bearer_token;
pub use handoff::Handoff;

/// On an ingest answer in a provider's own format (Twilio's TwiML, Discord's deferred
/// response): the gateway's verdict (`accepted`, `duplicate`, `conflict`), which its JSON
/// answer carries as `status`.
pub const VERDICT_HEADER: &str = "hooklatch-verdict";
/// On the same answers: the request's id in history (`req_7`).
pub const REQUEST_ID_HEADER: &str = "hooklatch-request-id";

/// How the message of a 404 for a path no route takes begins, on both listeners (its `code` is
/// `not_found`, as for an unknown id): the admin client tells "nothing there" from "not the
/// admin API" by it.
pub const NO_ROUTE: &str = "no such route";

/// The refusal codes a request gets only after its signature passed: another copy of its
/// event in flight (409) and the key store down (503). Such a request is kept in history as
/// `rejected` like any other refusal, but its body is genuine, so `hooklatch replay` re-signs
/// it without `--resign-rejected`.
pub const VERIFIED_REFUSALS: &[&str] = &[IN_FLIGHT, KEY_STORE_UNAVAILABLE];

/// The refusal code of a copy that arrived while another held its event's key (409).
pub const IN_FLIGHT: &str = "in_flight";

/// The refusal code of a verified request the external key store could not claim (503).
pub const KEY_STORE_UNAVAILABLE: &str = "key_store_unavailable";

/// A configured source, resolved: what ingest needs to verify and claim its deliveries.
#[derive(Debug, Clone)]
pub struct Source {
    /// The name in `/in/{name}`.
    pub name: SourceName,
    /// The provider's scheme.
    pub adapter: Arc<dyn ProviderAdapter>,
    /// Signing secrets; any may match (rotation).
    pub secrets: Vec<Secret>,
    /// Allowed distance between a signed timestamp and now.
    pub tolerance: Duration,
    /// How long a claimed key is kept.
    pub retention: Duration,
    /// Destination names each new event is queued for.
    pub destinations: Vec<String>,
}

/// Shared state of the ingest router.
pub struct IngestState {
    /// The store.
    pub store: Arc<dyn Store>,
    /// Sources by name.
    pub sources: HashMap<String, Source>,
    /// Largest body accepted, in bytes.
    pub body_limit: usize,
    /// The most of a refused request's body history keeps, in bytes (`refused_body_limit`):
    /// what anyone can send unsigned costs the store no more. A request refused after its
    /// signature passed ([`VERIFIED_REFUSALS`]) is kept whole.
    pub refused_body_limit: usize,
    /// How long reading a body may take.
    pub body_timeout: Duration,
    /// Woken after new deliveries are queued, so idle workers start at once.
    pub enqueued: Arc<Notify>,
    /// An external key store (Redis mode); `None` claims keys in the store (SQL mode).
    pub keys: Option<ExternalKeys>,
    /// New deliveries go to this instance's delivery worker in memory (`None`: delivery is off
    /// here, and every delivery is written due).
    pub handoff: Option<Arc<handoff::Handoff>>,
}

/// An external key store and the in-flight lease its claims hold.
#[derive(Clone)]
pub struct ExternalKeys {
    /// Where the keys live.
    pub store: Arc<dyn KeyStore>,
    /// How long a claim is held while its request is being queued; a copy arriving meanwhile
    /// gets 409 with `Retry-After`.
    pub lease: Duration,
}

/// Where the gateway is in its life, as `/readyz` reports it: a load balancer sends traffic
/// only while it is [`Readiness::set_ready`], and stops as soon as it is
/// [`Readiness::set_stopping`], while the listeners still answer.
#[derive(Debug, Default)]
pub struct Readiness(AtomicU8);

const STARTING: u8 = 0;
const READY: u8 = 1;
const STOPPING: u8 = 2;

impl Readiness {
    /// Started: `/readyz` answers 200 while the stores answer. Once stopping, it stays so.
    pub fn set_ready(&self) {
        let _ = self
            .0
            .compare_exchange(STARTING, READY, Ordering::AcqRel, Ordering::Acquire);
    }

    /// Shutting down: `/readyz` answers 503 `shutting down` from now on.
    pub fn set_stopping(&self) {
        self.0.store(STOPPING, Ordering::Release);
    }

    /// Whether the gateway is shutting down.
    pub fn is_stopping(&self) -> bool {
        self.0.load(Ordering::Acquire) == STOPPING
    }

    /// Why the gateway is not ready, if it is not: `starting` or `shutting down`.
    pub fn not_ready_because(&self) -> Option<&'static str> {
        match self.0.load(Ordering::Acquire) {
            READY => None,
            STARTING => Some("starting"),
            _ => Some("shutting down"),
        }
    }
}

/// Renders the Prometheus text exposition.
pub type MetricsRender = Arc<dyn Fn() -> String + Send + Sync>;

/// Shared state of the admin router.
pub struct AdminState {
    /// The store.
    pub store: Arc<dyn Store>,
    /// The bearer token every `/v1` route and `/metrics` requires.
    pub token: Secret,
    /// Renders `/metrics`.
    pub metrics: MetricsRender,
    /// Starting, ready, or shutting down; `/readyz` reports it.
    pub readiness: Arc<Readiness>,
    /// Woken after a redrive or redelivery queues a delivery.
    pub enqueued: Arc<Notify>,
    /// Each source's destinations, for redelivery.
    pub destinations: HashMap<String, Vec<String>>,
    /// Every configured destination's name and kind (`http`, `amqp`, `listen`), in config order.
    pub destination_kinds: Vec<(String, &'static str)>,
    /// The disabled destinations, as this instance knows them.
    pub disabled: Arc<DisabledDestinations>,
    /// The external key store, if any: `/readyz` checks it too.
    pub keys: Option<Arc<dyn KeyStore>>,
    /// The largest body ingest takes; an imported capture's body may not be larger.
    pub body_limit: usize,
}

/// The public router: `POST /in/{source}`.
pub fn ingest_router(state: Arc<IngestState>) -> Router {
    routes::ingest::router(state).layer(trace_layer())
}

/// Why the gateway cannot take traffic now, as `/readyz` says it (`None`: ready).
pub async fn not_ready_because(state: &AdminState) -> Option<&'static str> {
    routes::health::not_ready_because(state).await
}

/// The admin router: `/v1/…`, `/metrics`, `/healthz`, `/readyz`.
pub fn admin_router(state: Arc<AdminState>) -> Router {
    routes::admin_router(state).layer(trace_layer())
}

/// One span per request, at debug level, naming method and path only: no headers (they carry
/// signatures and tokens) and no query string (Meta's subscription check carries the verify
/// token there, a Twilio voice webhook its caller's details).
/// A 5xx answer (a `/readyz` 503 on every probe while not ready, ingest's 503s while the store
/// is full) is logged by the code that decided it, once, in its words: the layer says it at
/// debug level only, as every other response.
fn trace_layer() -> TraceLayer<SharedClassifier<ServerErrorsAsFailures>, SpanOf> {
    TraceLayer::new_for_http()
        .make_span_with(span_of as SpanOf)
        .on_request(DefaultOnRequest::new().level(Level::DEBUG))
        .on_response(DefaultOnResponse::new().level(Level::DEBUG))
        .on_failure(DefaultOnFailure::new().level(Level::DEBUG))
}

/// How a request's span is made ([`trace_layer`]).
type SpanOf = fn(&axum::http::Request<axum::body::Body>) -> tracing::Span;

fn span_of(request: &axum::http::Request<axum::body::Body>) -> tracing::Span {
    tracing::debug_span!(
        "request",
        method = %request.method(),
        path = %request.uri().path(),
        version = ?request.version()
    )
}

#[cfg(test)]
mod readiness_tests {
    use super::Readiness;

    /// Not ready until started, ready while serving, and "shutting down" for good once
    /// stopping: a stop is never undone by a late `set_ready`.
    #[test]
    fn readiness_goes_from_starting_to_ready_to_shutting_down() {
        let readiness = Readiness::default();
        assert_eq!(readiness.not_ready_because(), Some("starting"));
        readiness.set_ready();
        assert_eq!(readiness.not_ready_because(), None);
        readiness.set_stopping();
        assert_eq!(readiness.not_ready_because(), Some("shutting down"));
        readiness.set_ready();
        assert_eq!(readiness.not_ready_because(), Some("shutting down"));
    }
}
