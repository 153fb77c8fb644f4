//! Helpers for the end-to-end tests: a real `hooklatch serve` process ([`Gateway`]), a real
//! HTTP destination that records what it receives ([`Handler`]), provider signers, and
//! [`wait_until`] / [`eventually`], which poll a condition up to a deadline instead of sleeping.
//!
//! Each [`Gateway`] owns a temp dir holding its config, its SQLite file and its log. The child
//! runs with `RUST_LOG=warn` and its output goes to `gateway.log` in that dir; when a test
//! fails, the log's tail is printed. `TEST_LOG=1` lets the child log to the terminal instead.

use std::collections::{HashMap, HashSet};
use std::fmt::Write as _;
use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, SeekFrom};
use std::net::{SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::Router;
use bytes::Bytes;
use hooklatch_core::provider::{GitHub, InboundRequest, SignRequest, Stripe};
use hooklatch_core::{ProviderAdapter, Secret, Timestamp};
use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::task::JoinHandle;

/// The admin bearer token every test gateway runs with.
pub const ADMIN_TOKEN: &str = "e2e-admin-token-0123456789abcdef";
/// The Stripe source's endpoint secret.
pub const STRIPE_SECRET: &str = "whsec_e2e_stripe_endpoint_secret_0123";
/// The GitHub source's webhook secret.
pub const GITHUB_SECRET: &str = "e2e github webhook secret";
/// How long any awaited condition may take before the test fails.
pub const DEADLINE: Duration = Duration::from_secs(30);
/// How often a condition is polled.
const POLL: Duration = Duration::from_millis(25);

// ---------------------------------------------------------------------------------------------
// Waiting

/// Polls `cond` until it holds, failing the test after `deadline`.
pub async fn wait_until_within(what: &str, deadline: Duration, mut cond: impl FnMut() -> bool) {
    let started = Instant::now();
    while !cond() {
        assert!(
            started.elapsed() < deadline,
            "timed out after {deadline:?} waiting until {what}"
        );
        tokio::time::sleep(POLL).await;
    }
}

/// Polls `cond` until it holds, failing the test after [`DEADLINE`].
pub async fn wait_until(what: &str, cond: impl FnMut() -> bool) {
    wait_until_within(what, DEADLINE, cond).await
}

/// Polls an async condition until it holds, failing the test after `deadline`.
pub async fn eventually_within(
    what: &str,
    deadline: Duration,
    mut cond: impl AsyncFnMut() -> bool,
) {
    let started = Instant::now();
    while !cond().await {
        assert!(
            started.elapsed() < deadline,
            "timed out after {deadline:?} waiting until {what}"
        );
        tokio::time::sleep(POLL).await;
    }
}

/// Polls an async condition until it holds, failing the test after [`DEADLINE`].
pub async fn eventually(what: &str, cond: impl AsyncFnMut() -> bool) {
    eventually_within(what, DEADLINE, cond).await
}

/// A port that was free a moment ago (the gateway binds it; a clash is retried by [`Gateway`]).
pub fn free_port() -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").expect("binding an ephemeral port");
    listener.local_addr().expect("local address").port()
}

// ---------------------------------------------------------------------------------------------
// Provider signing

/// A realistic Stripe `invoice.payment_succeeded` event, pretty-printed the way Stripe sends it
/// (so a gateway that re-serialized the JSON would change the bytes).
pub fn stripe_invoice_paid(event_id: &str, amount_paid: u64) -> Vec<u8> {
    stripe_invoice_paid_padded(event_id, amount_paid, 0)
}

/// [`stripe_invoice_paid`] with a metadata note of `padding` bytes, to make bodies larger.
pub fn stripe_invoice_paid_padded(event_id: &str, amount_paid: u64, padding: usize) -> Vec<u8> {
    let note = "x".repeat(padding);
    format!(
        r#"{{
  "id": "{event_id}",
  "object": "event",
  "api_version": "2024-06-20",
  "created": 1733140800,
  "data": {{
    "object": {{
      "id": "in_1QRn2bLkdIwHu7ix0Gkq5ZxY",
      "object": "invoice",
      "amount_due": {amount_paid},
      "amount_paid": {amount_paid},
      "amount_remaining": 0,
      "currency": "eur",
      "customer": "cus_R9x8fP2mLq4TzN",
      "customer_name": "Zoë Müller — Café ☕",
      "paid": true,
      "status": "paid",
      "metadata": {{ "note": "{note}" }}
    }}
  }},
  "livemode": false,
  "pending_webhooks": 1,
  "request": {{ "id": null, "idempotency_key": null }},
  "type": "invoice.payment_succeeded"
}}
"#
    )
    .into_bytes()
}

/// The headers Stripe sends with `body`, signed now (Stripe re-signs every retry).
pub fn stripe_headers(body: &[u8]) -> Vec<(String, String)> {
    stripe_headers_signed(body, STRIPE_SECRET, Timestamp::now())
}

/// The headers Stripe would send with `body`, signed with `secret` at `at`.
pub fn stripe_headers_signed(body: &[u8], secret: &str, at: Timestamp) -> Vec<(String, String)> {
    let secret = Secret::from_text(secret);
    let mut headers = vec![(
        "content-type".to_owned(),
        "application/json; charset=utf-8".to_owned(),
    )];
    headers.extend(Stripe.sign(&SignRequest {
        body,
        secret: &secret,
        now: at,
        event_key: "",
        event_type: None,
        // Stripe does not sign the URL.
        url: "",
    }));
    headers
}

/// Whether `signature` is Stripe's for `body` under the gateway's secret, at this moment with
/// the Stripe libraries' 300 s tolerance.
pub fn stripe_verifies(body: &[u8], signature: &str) -> bool {
    let mut headers = HeaderMap::new();
    let Ok(value) = axum::http::HeaderValue::from_str(signature) else {
        return false;
    };
    headers.insert("stripe-signature", value);
    let req = InboundRequest {
        path_and_query: "/webhooks",
        headers: &headers,
        body,
        now: Timestamp::now(),
    };
    Stripe
        .verify(
            &req,
            &[Secret::from_text(STRIPE_SECRET)],
            Duration::from_secs(300),
        )
        .is_ok()
}

/// The headers GitHub sends with `body` for delivery `delivery_id` of a `push` event.
pub fn github_headers(body: &[u8], delivery_id: &str) -> Vec<(String, String)> {
    let secret = Secret::from_text(GITHUB_SECRET);
    let mut headers = vec![("content-type".to_owned(), "application/json".to_owned())];
    headers.extend(GitHub.sign(&SignRequest {
        body,
        secret: &secret,
        now: Timestamp::now(),
        event_key: delivery_id,
        event_type: Some("push"),
        // GitHub does not sign the URL.
        url: "",
    }));
    headers
}

/// The value of header `name` (case-insensitive) in a list of headers.
pub fn header<'a>(headers: &'a [(String, String)], name: &str) -> &'a str {
    headers
        .iter()
        .find(|(n, _)| n.eq_ignore_ascii_case(name))
        .map(|(_, v)| v.as_str())
        .unwrap_or_else(|| panic!("no {name} header in {headers:?}"))
}

/// A process-unique suffix for event ids, so no two tests (or runs) share one.
pub fn unique(prefix: &str) -> String {
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(0);
    let n = N.fetch_add(1, Ordering::Relaxed);
    format!(
        "{prefix}_{}_{n}_{}",
        std::process::id(),
        Timestamp::now().as_millis()
    )
}

// ---------------------------------------------------------------------------------------------
// The destination

/// How the [`Handler`] answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Behaviour {
    /// 200 to everything.
    AlwaysOk,
    /// 500 to the first N deliveries of each Idempotency-Key, then 200.
    FailFirst(usize),
    /// 500 to everything.
    AlwaysFail,
    /// 429 with `Retry-After: 1` to the first delivery of each key, then 200.
    TooManyRequestsOnce,
    /// 302 to `/followed` on this same server (which would answer 200) for everything.
    AlwaysRedirect,
    /// 200 to everything, after this many milliseconds (deliveries stay in flight a while).
    SlowOk(u64),
    /// 410 Gone to everything: the endpoint was removed.
    Gone,
}

/// One request the handler received.
#[derive(Debug, Clone)]
pub struct Received {
    /// The request path.
    pub path: String,
    /// `Idempotency-Key`, if sent.
    pub key: Option<String>,
    /// `hooklatch-attempt`, if sent and numeric.
    pub attempt: Option<u32>,
    /// Every header as received.
    pub headers: HeaderMap,
    /// The body, byte-exact.
    pub body: Bytes,
    /// When it arrived.
    pub at: Instant,
}

impl Received {
    /// A header's value as text ("" when absent).
    pub fn header(&self, name: &str) -> &str {
        self.headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
    }
}

struct HandlerState {
    received: Mutex<Vec<Received>>,
    behaviour: Mutex<Behaviour>,
    base: String,
}

/// A real HTTP destination on 127.0.0.1 that records every request and answers as told.
pub struct Handler {
    state: Arc<HandlerState>,
    task: JoinHandle<()>,
}

impl Handler {
    /// Starts a handler on an ephemeral loopback port.
    pub async fn start(behaviour: Behaviour) -> Handler {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("binding the handler");
        let addr = listener.local_addr().expect("handler address");
        let state = Arc::new(HandlerState {
            received: Mutex::new(Vec::new()),
            behaviour: Mutex::new(behaviour),
            base: format!("http://{addr}"),
        });
        let app = Router::new().fallback(record).with_state(state.clone());
        let task = tokio::spawn(async move {
            axum::serve(listener, app).await.expect("handler server");
        });
        Handler { state, task }
    }

    /// The URL deliveries should go to.
    pub fn url(&self) -> String {
        format!("{}/webhooks", self.state.base)
    }

    /// Changes how later requests are answered.
    pub fn set_behaviour(&self, behaviour: Behaviour) {
        *self.state.behaviour.lock().expect("behaviour lock") = behaviour;
    }

    /// Everything received so far.
    pub fn received(&self) -> Vec<Received> {
        self.state.received.lock().expect("received lock").clone()
    }

    /// The deliveries that carried `Idempotency-Key: key`, in arrival order.
    pub fn received_for(&self, key: &str) -> Vec<Received> {
        self.received()
            .into_iter()
            .filter(|r| r.key.as_deref() == Some(key))
            .collect()
    }

    /// How many deliveries carried `Idempotency-Key: key`.
    pub fn count_for(&self, key: &str) -> usize {
        let received = self.state.received.lock().expect("received lock");
        received
            .iter()
            .filter(|r| r.key.as_deref() == Some(key))
            .count()
    }

    /// The distinct Idempotency-Keys seen.
    pub fn distinct_keys(&self) -> HashSet<String> {
        let received = self.state.received.lock().expect("received lock");
        received.iter().filter_map(|r| r.key.clone()).collect()
    }

    /// How many requests arrived in all.
    pub fn total(&self) -> usize {
        self.state.received.lock().expect("received lock").len()
    }
}

impl Drop for Handler {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn record(
    State(state): State<Arc<HandlerState>>,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let key = headers
        .get("idempotency-key")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    let attempt = headers
        .get("hooklatch-attempt")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse().ok());
    let behaviour = *state.behaviour.lock().expect("behaviour lock");
    let earlier = {
        let mut received = state.received.lock().expect("received lock");
        let earlier = received.iter().filter(|r| r.key == key).count();
        received.push(Received {
            path: uri.path().to_owned(),
            key,
            attempt,
            headers,
            body,
            at: Instant::now(),
        });
        earlier
    };
    if uri.path() == "/followed" {
        return StatusCode::OK.into_response();
    }
    match behaviour {
        Behaviour::AlwaysOk => StatusCode::OK.into_response(),
        Behaviour::FailFirst(n) if earlier < n => StatusCode::INTERNAL_SERVER_ERROR.into_response(),
        Behaviour::FailFirst(_) => StatusCode::OK.into_response(),
        Behaviour::AlwaysFail => StatusCode::INTERNAL_SERVER_ERROR.into_response(),
        Behaviour::Gone => StatusCode::GONE.into_response(),
        Behaviour::TooManyRequestsOnce if earlier == 0 => {
            (StatusCode::TOO_MANY_REQUESTS, [("retry-after", "1")]).into_response()
        }
        Behaviour::TooManyRequestsOnce => StatusCode::OK.into_response(),
        Behaviour::SlowOk(ms) => {
            tokio::time::sleep(Duration::from_millis(ms)).await;
            StatusCode::OK.into_response()
        }
        Behaviour::AlwaysRedirect => (
            StatusCode::FOUND,
            [("location", format!("{}/followed", state.base))],
        )
            .into_response(),
    }
}

// ---------------------------------------------------------------------------------------------
// The gateway

/// Per-test settings written into the gateway's config file.
#[derive(Debug, Clone)]
pub struct Options {
    /// `server.body_limit`, when not the default.
    pub body_limit: Option<&'static str>,
    /// `?max_page_count=N` on the store URL.
    pub max_page_count: Option<u64>,
    /// The destination's `max_attempts`.
    pub max_attempts: u32,
    /// The destination's `initial_backoff`.
    pub initial_backoff: &'static str,
    /// The destination's `max_backoff`.
    pub max_backoff: &'static str,
    /// The destination's `jitter`.
    pub jitter: f64,
    /// The destination's per-attempt `timeout`; a dead worker's leases expire after twice this
    /// plus 10 s.
    pub timeout: &'static str,
    /// `store.url` instead of a SQLite file in the temp dir (e.g. a shared PostgreSQL).
    pub store_url: Option<String>,
    /// More config appended verbatim (extra `[[sources]]` delivering to `app`).
    pub extra_config: String,
    /// More environment variables for the process (the extra sources' secrets).
    pub extra_env: Vec<(String, String)>,
    /// `server.header_timeout` and `server.body_timeout`.
    pub header_timeout: &'static str,
    /// See `header_timeout`.
    pub body_timeout: &'static str,
    /// `RUST_LOG` for the process when `TEST_LOG` is unset (its log goes to a file).
    pub log_level: &'static str,
    /// The destination's `secret` (hooklatch then signs what it delivers).
    pub destination_secret: Option<&'static str>,
    /// `delivery.enabled`: false makes an ingest-only instance.
    pub deliver: bool,
    /// `server.log_format`: `human` or `json`.
    pub log_format: &'static str,
    /// More `[store]` lines (`history_retention = "1s"`).
    pub store_config: &'static str,
    /// More `[server]` lines (`tls_cert = "…"`).
    pub server_config: String,
}

impl Default for Options {
    fn default() -> Options {
        Options {
            body_limit: None,
            max_page_count: None,
            max_attempts: 12,
            initial_backoff: "100ms",
            max_backoff: "500ms",
            jitter: 0.0,
            timeout: "10s",
            store_url: None,
            extra_config: String::new(),
            extra_env: Vec::new(),
            header_timeout: "10s",
            body_timeout: "60s",
            log_level: "warn",
            destination_secret: None,
            deliver: true,
            log_format: "human",
            store_config: "",
            server_config: String::new(),
        }
    }
}

/// Every final answer (status, `status` field) to each event's copies, by event id.
pub type Answers = HashMap<String, Vec<(u16, String)>>;

/// Sends `copies` copies of each signed Stripe event in `ids` from 64 senders (an event's
/// copies go out together, spread over `ingests`, each after 0–5 ms of jitter drawn from
/// `seed`). An answer whose status is in `retry` is retried as a provider would, after
/// `backoff`, up to `attempts` times; a copy with no final answer is recorded as status 0.
/// Returns every final answer and how many retries were made.
pub async fn storm(
    ingests: &[Ingest],
    ids: &[String],
    copies: usize,
    retry: &'static [u16],
    attempts: usize,
    backoff: Duration,
    seed: u64,
) -> (Answers, usize) {
    let answers: Arc<Mutex<Answers>> = Arc::default();
    let retried = Arc::new(AtomicUsize::new(0));
    let next = Arc::new(AtomicUsize::new(0));
    let total = ids.len() * copies;
    let mut senders = Vec::new();
    for sender in 0..64 {
        let (ids, answers, retried, next, ingests) = (
            ids.to_vec(),
            answers.clone(),
            retried.clone(),
            next.clone(),
            ingests.to_vec(),
        );
        senders.push(tokio::spawn(async move {
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= total {
                    break;
                }
                let id = &ids[i / copies];
                let ingest = &ingests[(i + sender) % ingests.len()];
                let body = stripe_invoice_paid(id, 5000);
                let jitter = crate::report::draw(seed, i as u64, 5_001);
                tokio::time::sleep(Duration::from_micros(jitter)).await;
                let mut answer = (0, "no final answer".to_owned());
                for _ in 0..attempts {
                    let headers = stripe_headers(&body);
                    match ingest.try_post("stripe", &headers, body.clone()).await {
                        Ok((status, _)) if retry.contains(&status) => {
                            retried.fetch_add(1, Ordering::Relaxed);
                            tokio::time::sleep(backoff).await;
                        }
                        Ok((status, json)) => {
                            let verdict = json["status"].as_str().unwrap_or_default();
                            answer = (status, verdict.to_owned());
                            break;
                        }
                        Err(err) => {
                            // Kept in the answer, so an assertion shows why it is missing.
                            answer.1 = format!("no final answer: {err}");
                            break;
                        }
                    }
                }
                let mut answers = answers.lock().expect("answers lock");
                answers.entry(id.clone()).or_default().push(answer);
            }
        }));
    }
    for sender in senders {
        sender.await.expect("sender task");
    }
    let answers = answers.lock().expect("answers lock").clone();
    (answers, retried.load(Ordering::Relaxed))
}

/// How a provider retries a copy in [`one_claim_per_event`]: the statuses it retries, how many
/// times, and how long apart.
pub struct Retry {
    pub statuses: &'static [u16],
    pub attempts: usize,
    pub backoff: Duration,
}

/// T1's storm and its check: `ids_n` events (ids `{prefix}_NNNN`) sent `copies` times each by
/// 64 senders spread over `ingests` ([`storm`]). Every id gets one `accepted` and `copies − 1`
/// `duplicate`s, every final answer 200; every event reaches `handler` exactly once and nothing
/// is left pending on `gateway`. Fills in `card` (ops, acked, duplicates, forwards, retried) and
/// returns the ids and how many copies were retried.
pub async fn one_claim_per_event(
    ingests: &[Ingest],
    gateway: &Gateway,
    handler: &Handler,
    card: &mut crate::report::Card,
    prefix: &str,
    copies: usize,
    retry: Retry,
) -> (Vec<String>, usize) {
    let ids_n = crate::report::scaled(1_000);
    let ids: Vec<String> = (0..ids_n).map(|i| format!("{prefix}_{i:04}")).collect();
    let seed = card.seed();
    let (answers, retried) = storm(
        ingests,
        &ids,
        copies,
        retry.statuses,
        retry.attempts,
        retry.backoff,
        seed,
    )
    .await;
    for id in &ids {
        let got = &answers[id];
        assert_eq!(got.len(), copies, "{id}");
        let accepted = got.iter().filter(|a| *a == &(200, "accepted".to_owned()));
        let duplicates = got.iter().filter(|a| *a == &(200, "duplicate".to_owned()));
        assert_eq!(
            (accepted.count(), duplicates.count()),
            (1, copies - 1),
            "{id}: {got:?}"
        );
    }
    wait_until_within("every event forwarded", Duration::from_secs(120), || {
        handler.distinct_keys().len() == ids_n
    })
    .await;
    eventually_within(
        "every outbox row delivered",
        Duration::from_secs(60),
        async || gateway.deliveries("state=pending").await.is_empty(),
    )
    .await;
    let twice: Vec<_> = ids
        .iter()
        .filter(|id| handler.count_for(&format!("stripe:{id}")) != 1)
        .collect();
    assert!(twice.is_empty(), "forwarded other than once: {twice:?}");
    card.count("ops", ids_n * copies)
        .count("acked", ids_n)
        .count("duplicates", handler.total() - ids_n)
        .figure("forwards", handler.total())
        .figure("retried", retried);
    (ids, retried)
}

/// A client for `POST /in/{source}`; cheap to clone into sender tasks.
#[derive(Clone)]
pub struct Ingest {
    client: reqwest::Client,
    base: String,
    addr: SocketAddr,
}

impl Ingest {
    /// POSTs `body` with `headers` to `/in/{source}`; panics on a transport error.
    pub async fn post(
        &self,
        source: &str,
        headers: &[(String, String)],
        body: impl Into<Vec<u8>>,
    ) -> (u16, Value) {
        self.try_post(source, headers, body)
            .await
            .unwrap_or_else(|err| panic!("POST /in/{source} failed: {err}"))
    }

    /// Sends `method` to `path` on the ingest listener with `body`; returns the status, the
    /// `Allow` header if any, and the JSON body (null when it is not JSON).
    pub async fn request(
        &self,
        method: reqwest::Method,
        path: &str,
        body: &'static str,
    ) -> (u16, Option<String>, Value) {
        let res = self
            .client
            .request(method, format!("{}{path}", self.base))
            .body(body)
            .send()
            .await
            .unwrap_or_else(|err| panic!("{path} failed: {err}"));
        let status = res.status().as_u16();
        let allow = res
            .headers()
            .get(reqwest::header::ALLOW)
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned);
        let bytes = res.bytes().await.expect("reading an ingest response");
        (
            status,
            allow,
            serde_json::from_slice(&bytes).unwrap_or(Value::Null),
        )
    }

    /// POSTs and returns the status and JSON body, or the transport error.
    pub async fn try_post(
        &self,
        source: &str,
        headers: &[(String, String)],
        body: impl Into<Vec<u8>>,
    ) -> reqwest::Result<(u16, Value)> {
        let res = self.send(source, headers, body).await?;
        let status = res.status().as_u16();
        let bytes = res.bytes().await?;
        Ok((
            status,
            serde_json::from_slice(&bytes).unwrap_or(Value::Null),
        ))
    }

    /// POSTs and returns the whole response.
    pub async fn send(
        &self,
        source: &str,
        headers: &[(String, String)],
        body: impl Into<Vec<u8>>,
    ) -> reqwest::Result<reqwest::Response> {
        let mut req = self
            .client
            .post(format!("{}/in/{source}", self.base))
            .body(body.into());
        for (name, value) in headers {
            req = req.header(name.as_str(), value.as_str());
        }
        req.send().await
    }

    /// The ingest listener's address, for raw HTTP.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }
}

/// A running `hooklatch serve` with its own temp dir, SQLite file and ports.
pub struct Gateway {
    dir: tempfile::TempDir,
    options: Options,
    destination_url: String,
    ingest_port: u16,
    admin_port: u16,
    /// Shared with any [`KillSwitch`], so a sender task can kill at an exact moment.
    child: Arc<Mutex<Option<Child>>>,
    ingest: Ingest,
    admin: reqwest::Client,
}

impl Gateway {
    /// Starts a gateway delivering to `handler` with default [`Options`].
    pub async fn start(handler: &Handler) -> Gateway {
        Gateway::start_with(handler, Options::default()).await
    }

    /// Starts a gateway delivering to `handler`, waiting until `/readyz` says 200.
    pub async fn start_with(handler: &Handler, options: Options) -> Gateway {
        Gateway::start_at(handler.url(), options).await
    }

    /// Starts a gateway whose destination `app` is `url` (on 127.0.0.1), waiting until
    /// `/readyz` says 200.
    pub async fn start_at(url: String, options: Options) -> Gateway {
        let dir = tempfile::Builder::new()
            .prefix("hooklatch-e2e-")
            .tempdir()
            .expect("creating a temp dir");
        let mut gateway = Gateway {
            dir,
            options,
            destination_url: url,
            ingest_port: 0,
            admin_port: 0,
            child: Arc::new(Mutex::new(None)),
            ingest: Ingest {
                client: client(),
                base: String::new(),
                addr: SocketAddr::from(([127, 0, 0, 1], 0)),
            },
            admin: client(),
        };
        gateway.spawn_ready(true).await;
        gateway
    }

    fn config_path(&self) -> PathBuf {
        self.dir.path().join("hooklatch.toml")
    }

    fn log_path(&self) -> PathBuf {
        self.dir.path().join("gateway.log")
    }

    fn write_config(&self) {
        let o = &self.options;
        let db = self.dir.path().join("hooklatch.db");
        let mut store_url = o
            .store_url
            .clone()
            .unwrap_or_else(|| format!("sqlite://{}", db.display()));
        if let Some(pages) = o.max_page_count {
            write!(store_url, "?max_page_count={pages}").expect("writing to a string");
        }
        let body_limit = o
            .body_limit
            .map(|l| format!("body_limit = \"{l}\"\n"))
            .unwrap_or_default();
        let config = format!(
            r#"[server]
listen = "127.0.0.1:{ingest}"
admin_listen = "127.0.0.1:{admin}"
admin_token = "env:HOOKLATCH_ADMIN_TOKEN"
header_timeout = "{header_timeout}"
body_timeout = "{body_timeout}"
shutdown_grace = "5s"
log_format = "{log_format}"
{body_limit}
{server_config}
[store]
url = "{store_url}"
{store_config}

[delivery]
enabled = {deliver}
concurrency = 16
poll_interval = "100ms"

[[sources]]
name = "stripe"
provider = "stripe"
secrets = ["env:E2E_STRIPE_SECRET"]
destinations = ["app"]

[[sources]]
name = "github"
provider = "github"
secrets = ["env:E2E_GITHUB_SECRET"]
destinations = ["app"]

[[destinations]]
name = "app"
url = "{url}"
allow = ["127.0.0.1"]
timeout = "{timeout}"
max_attempts = {max_attempts}
initial_backoff = "{initial_backoff}"
max_backoff = "{max_backoff}"
jitter = {jitter:?}
{destination_secret}
{extra}
"#,
            extra = o.extra_config,
            deliver = o.deliver,
            header_timeout = o.header_timeout,
            body_timeout = o.body_timeout,
            log_format = o.log_format,
            store_config = o.store_config,
            server_config = o.server_config,
            destination_secret = o
                .destination_secret
                .map(|s| format!("secret = \"{s}\""))
                .unwrap_or_default(),
            ingest = self.ingest_port,
            admin = self.admin_port,
            url = self.destination_url,
            timeout = o.timeout,
            max_attempts = o.max_attempts,
            initial_backoff = o.initial_backoff,
            max_backoff = o.max_backoff,
            jitter = o.jitter,
        );
        std::fs::write(self.config_path(), config).expect("writing the config");
    }

    /// Spawns the process and waits for readiness; picks fresh ports and tries again if one
    /// was taken in the meantime. `new_ports` picks ports even on the first try.
    async fn spawn_ready(&mut self, mut new_ports: bool) {
        for _ in 0..5 {
            if new_ports {
                self.ingest_port = free_port();
                self.admin_port = free_port();
                while self.admin_port == self.ingest_port {
                    self.admin_port = free_port();
                }
            }
            self.write_config();
            let log_offset = std::fs::metadata(self.log_path()).map_or(0, |m| m.len());
            let child = self.spawn();
            *self.child.lock().expect("child lock") = Some(child);
            self.ingest = Ingest {
                client: client(),
                base: format!("http://127.0.0.1:{}", self.ingest_port),
                addr: SocketAddr::from(([127, 0, 0, 1], self.ingest_port)),
            };
            self.admin = client();
            match self.wait_ready().await {
                Ok(()) => return,
                Err(exit) => {
                    let log = self.log_since(log_offset);
                    if log.contains("binding server.") {
                        new_ports = true;
                        continue;
                    }
                    panic!("hooklatch serve exited before it was ready ({exit}):\n{log}");
                }
            }
        }
        panic!("hooklatch serve could not bind its ports in 5 tries");
    }

    /// `hooklatch serve --config {config}` in the gateway's dir, with its environment.
    fn serve_command(&self, config: &Path) -> Command {
        let mut cmd = self.command("serve", config);
        cmd.stdin(Stdio::null());
        cmd
    }

    /// `hooklatch VERB ARGS… --config <the gateway's config>`, run to its end with the
    /// gateway's environment (its secrets, its admin token).
    pub fn cli(&self, verb: &str, args: &[&str]) -> std::process::Output {
        let mut cmd = self.command(verb, &self.config_path());
        cmd.args(args).stdin(Stdio::null());
        cmd.output().expect("running hooklatch")
    }

    /// `hooklatch VERB --config CONFIG` in the gateway's directory, with its environment.
    fn command(&self, verb: &str, config: &Path) -> Command {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_hooklatch"));
        cmd.arg(verb)
            .arg("--config")
            .arg(config)
            .current_dir(self.dir.path());
        for (name, _) in std::env::vars_os() {
            if name.to_string_lossy().starts_with("HOOKLATCH_") {
                cmd.env_remove(name);
            }
        }
        cmd.env("HOOKLATCH_ADMIN_TOKEN", ADMIN_TOKEN)
            .env("E2E_STRIPE_SECRET", STRIPE_SECRET)
            .env("E2E_GITHUB_SECRET", GITHUB_SECRET)
            .envs(self.options.extra_env.iter().cloned());
        cmd
    }

    fn spawn(&self) -> Child {
        let test_log = std::env::var_os("TEST_LOG").is_some();
        let mut cmd = self.serve_command(&self.config_path());
        if test_log {
            cmd.env(
                "RUST_LOG",
                std::env::var("RUST_LOG").unwrap_or_else(|_| "info".to_owned()),
            );
        } else {
            let log = OpenOptions::new()
                .create(true)
                .append(true)
                .open(self.log_path())
                .expect("opening the gateway log");
            let log_err = log.try_clone().expect("cloning the log handle");
            cmd.env("RUST_LOG", self.options.log_level)
                .stdout(Stdio::from(log))
                .stderr(Stdio::from(log_err));
        }
        cmd.spawn().expect("spawning hooklatch serve")
    }

    /// Waits until `/readyz` answers 200; `Err` with the exit status if the process exits.
    async fn wait_ready(&mut self) -> Result<(), String> {
        let started = Instant::now();
        let url = format!("http://127.0.0.1:{}/readyz", self.admin_port);
        loop {
            if let Some(status) = self.try_wait() {
                return Err(status.to_string());
            }
            if let Ok(res) = self.admin.get(&url).send().await {
                if res.status() == StatusCode::OK {
                    return Ok(());
                }
            }
            assert!(
                started.elapsed() < DEADLINE,
                "hooklatch serve was not ready after {DEADLINE:?}:\n{}",
                self.log_tail(60)
            );
            tokio::time::sleep(POLL).await;
        }
    }

    /// A client handle for `/in/{source}`, valid until the next restart.
    pub fn ingest(&self) -> Ingest {
        self.ingest.clone()
    }

    /// POSTs to `/in/{source}`; returns the status and JSON body.
    pub async fn post(
        &self,
        source: &str,
        headers: &[(String, String)],
        body: impl Into<Vec<u8>>,
    ) -> (u16, Value) {
        self.ingest.post(source, headers, body).await
    }

    /// GETs an admin path with the bearer token.
    pub async fn admin_get(&self, path: &str) -> (u16, Value) {
        self.admin_request(reqwest::Method::GET, path, Some(ADMIN_TOKEN))
            .await
    }

    /// POSTs to an admin path with the bearer token.
    pub async fn admin_post(&self, path: &str) -> (u16, Value) {
        self.admin_request(reqwest::Method::POST, path, Some(ADMIN_TOKEN))
            .await
    }

    /// An admin request with the given bearer token (or none).
    pub async fn admin_request(
        &self,
        method: reqwest::Method,
        path: &str,
        token: Option<&str>,
    ) -> (u16, Value) {
        let res = self.admin_response(method, path, token).await;
        let status = res.status().as_u16();
        let bytes = res.bytes().await.expect("reading an admin response");
        (
            status,
            serde_json::from_slice(&bytes).unwrap_or(Value::Null),
        )
    }

    /// The ingest listener's base URL (`http://127.0.0.1:PORT`).
    pub fn ingest_url(&self) -> String {
        format!("http://127.0.0.1:{}", self.ingest_port)
    }

    /// The admin API's base URL (`http://127.0.0.1:PORT`), for the CLI's `--admin`.
    pub fn admin_url(&self) -> String {
        format!("http://127.0.0.1:{}", self.admin_port)
    }

    /// The raw response to an admin request.
    pub async fn admin_response(
        &self,
        method: reqwest::Method,
        path: &str,
        token: Option<&str>,
    ) -> reqwest::Response {
        let mut req = self.admin.request(
            method,
            format!("http://127.0.0.1:{}{path}", self.admin_port),
        );
        if let Some(token) = token {
            req = req.bearer_auth(token);
        }
        req.send()
            .await
            .unwrap_or_else(|err| panic!("admin request {path} failed: {err}"))
    }

    /// The value of one `/metrics` sample, `name{labels}` as Prometheus prints it (0 when absent).
    pub async fn metric(&self, sample: &str) -> f64 {
        let text = self.metrics().await;
        text.lines()
            .find_map(|line| {
                line.strip_prefix(sample)
                    .and_then(|rest| rest.strip_prefix(' '))
                    .and_then(|v| v.trim().parse().ok())
            })
            .unwrap_or(0.0)
    }

    /// Sends a fresh Stripe event to `source` (a Stripe source with the test secret) and
    /// checks it is accepted; returns its Idempotency-Key.
    pub async fn send_stripe_event(&self, source: &str, prefix: &str) -> String {
        let event_id = unique(prefix);
        let body = stripe_invoice_paid(&event_id, 5000);
        let (status, json) = self.post(source, &stripe_headers(&body), body).await;
        assert_eq!(
            (status, json["status"].as_str()),
            (200, Some("accepted")),
            "{json}"
        );
        format!("{source}:{event_id}")
    }

    /// `GET /metrics` with the token, as text.
    pub async fn metrics(&self) -> String {
        let res = self
            .admin_response(reqwest::Method::GET, "/metrics", Some(ADMIN_TOKEN))
            .await;
        assert_eq!(res.status(), StatusCode::OK, "GET /metrics");
        res.text().await.expect("reading /metrics")
    }

    /// `GET /v1/requests?{query}` items (one page of up to 500).
    pub async fn requests(&self, query: &str) -> Vec<Value> {
        let (status, body) = self
            .admin_get(&format!("/v1/requests?limit=500&{query}"))
            .await;
        assert_eq!(status, 200, "GET /v1/requests?{query}: {body}");
        body["items"].as_array().expect("items").clone()
    }

    /// Every row of `GET /v1/deliveries?{query}`, following the cursor.
    pub async fn deliveries(&self, query: &str) -> Vec<Value> {
        let mut all = Vec::new();
        let mut cursor = String::new();
        loop {
            let (status, body) = self
                .admin_get(&format!("/v1/deliveries?limit=500&{query}{cursor}"))
                .await;
            assert_eq!(status, 200, "GET /v1/deliveries?{query}: {body}");
            all.extend(body["items"].as_array().expect("items").iter().cloned());
            match body["next_cursor"].as_str() {
                Some(next) => cursor = format!("&cursor={next}"),
                None => return all,
            }
        }
    }

    /// The outbox rows carrying `idempotency_key`.
    pub async fn deliveries_for(&self, idempotency_key: &str) -> Vec<Value> {
        self.deliveries("")
            .await
            .into_iter()
            .filter(|d| d["idempotency_key"] == idempotency_key)
            .collect()
    }

    /// Waits until the one outbox row for `idempotency_key` is in `state`, and returns it.
    pub async fn wait_for_delivery_state(&self, idempotency_key: &str, state: &str) -> Value {
        let mut row = Value::Null;
        eventually(
            &format!("the delivery of {idempotency_key} is {state}"),
            async || {
                let rows = self.deliveries_for(idempotency_key).await;
                assert!(rows.len() <= 1, "more than one outbox row: {rows:#?}");
                match rows.into_iter().next() {
                    Some(r) if r["state"] == state => {
                        row = r;
                        true
                    }
                    _ => false,
                }
            },
        )
        .await;
        row
    }

    /// The process id of the running gateway.
    pub fn pid(&self) -> u32 {
        let child = self.child.lock().expect("child lock");
        child.as_ref().expect("the gateway is running").id()
    }

    /// kill -9: the process dies at once, holding whatever it held.
    pub fn kill9(&mut self) {
        let child = self.child.lock().expect("child lock").take();
        if let Some(mut child) = child {
            // std's Child::kill is SIGKILL on unix (and Ok if a kill switch got there first).
            child.kill().expect("sending SIGKILL");
            child.wait().expect("reaping the gateway");
        }
    }

    /// A handle that can kill -9 this gateway from any task, the moment it is fired.
    pub fn kill_switch(&self) -> KillSwitch {
        KillSwitch(self.child.clone())
    }

    /// The exit status, if the process has exited (it is then forgotten).
    pub fn try_wait(&self) -> Option<ExitStatus> {
        let mut child = self.child.lock().expect("child lock");
        let status = child
            .as_mut()
            .expect("the gateway is running")
            .try_wait()
            .expect("polling the child")?;
        *child = None;
        Some(status)
    }

    /// Sends SIGTERM (the process is left running until it exits by itself).
    pub fn sigterm(&self) {
        self.signal("TERM");
    }

    /// Sends the signal named `name` (`TERM`, `HUP`) with `kill`.
    pub fn signal(&self, name: &str) {
        let status = Command::new("kill")
            .arg(format!("-{name}"))
            .arg(self.pid().to_string())
            .status()
            .expect("running kill");
        assert!(status.success(), "kill -{name} failed: {status}");
    }

    /// Waits (bounded) for the process to exit and returns its status.
    pub async fn wait_exit(&mut self) -> ExitStatus {
        let started = Instant::now();
        loop {
            if let Some(status) = self.try_wait() {
                return status;
            }
            assert!(
                started.elapsed() < DEADLINE,
                "hooklatch serve did not exit within {DEADLINE:?}"
            );
            tokio::time::sleep(POLL).await;
        }
    }

    /// Starts a second `hooklatch serve` with this gateway's config (as [`Gateway::reconfigure`]
    /// left its options) and store, on ports of its own, and waits (bounded) for it to exit:
    /// its exit status (`None`: still running at the deadline, then killed) and its output.
    pub async fn serve_beside(&self) -> (Option<ExitStatus>, String) {
        self.write_config();
        let config = std::fs::read_to_string(self.config_path()).expect("reading the config");
        let config = config
            .replace(
                &format!("127.0.0.1:{}\"", self.ingest_port),
                &format!("127.0.0.1:{}\"", free_port()),
            )
            .replace(
                &format!("127.0.0.1:{}\"", self.admin_port),
                &format!("127.0.0.1:{}\"", free_port()),
            );
        let path = self.dir.path().join("beside.toml");
        std::fs::write(&path, config).expect("writing the second config");
        let log = self.dir.path().join("beside.log");
        let out = File::create(&log).expect("creating the second log");
        let err = out.try_clone().expect("cloning the log handle");
        let mut child = self
            .serve_command(&path)
            .env("RUST_LOG", "warn")
            .stdout(Stdio::from(out))
            .stderr(Stdio::from(err))
            .spawn()
            .expect("spawning a second hooklatch serve");
        let started = Instant::now();
        let status = loop {
            if let Some(status) = child.try_wait().expect("polling the child") {
                break Some(status);
            }
            if started.elapsed() > DEADLINE {
                child.kill().expect("sending SIGKILL");
                child.wait().expect("reaping the second gateway");
                break None;
            }
            tokio::time::sleep(POLL).await;
        };
        let output = std::fs::read_to_string(&log).unwrap_or_default();
        (status, output)
    }

    /// Changes the options the next [`Gateway::restart`] writes into the config.
    pub fn reconfigure(&mut self, change: impl FnOnce(&mut Options)) {
        change(&mut self.options);
    }

    /// The SQLite file (when the gateway runs on SQLite).
    pub fn database_path(&self) -> PathBuf {
        self.dir.path().join("hooklatch.db")
    }

    /// The database's size in pages of 4 KiB, counting the WAL (a slight overestimate).
    pub fn database_pages(&self) -> u64 {
        let len = |name: &str| std::fs::metadata(self.dir.path().join(name)).map_or(0, |m| m.len());
        (len("hooklatch.db") + len("hooklatch.db-wal")).div_ceil(4096)
    }

    /// Starts the gateway again with the same config and database file (kill -9 first if it
    /// is still running).
    pub async fn restart(&mut self) {
        self.kill9();
        self.spawn_ready(false).await;
    }

    fn log_since(&self, offset: u64) -> String {
        let mut text = String::new();
        if let Ok(mut file) = File::open(self.log_path()) {
            let _ = file.seek(SeekFrom::Start(offset));
            let _ = file.read_to_string(&mut text);
        }
        text
    }

    /// The whole log so far (with `TEST_LOG` unset).
    pub fn log(&self) -> String {
        self.log_since(0)
    }

    /// The last `n` lines of the gateway's log.
    pub fn log_tail(&self, n: usize) -> String {
        let text = self.log_since(0);
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(n)..].join("\n")
    }
}

impl Gateway {
    /// The secrets this gateway's configuration holds (T21's canaries): the admin token, the
    /// sources' signing secrets, the destination's secret, and every extra environment
    /// variable named like a secret or token.
    fn canaries(&self) -> Vec<(String, String)> {
        let mut canaries = vec![
            ("admin token".to_owned(), ADMIN_TOKEN.to_owned()),
            ("Stripe signing secret".to_owned(), STRIPE_SECRET.to_owned()),
            ("GitHub signing secret".to_owned(), GITHUB_SECRET.to_owned()),
        ];
        if let Some(secret) = self.options.destination_secret {
            canaries.push(("destination secret".to_owned(), secret.to_owned()));
        }
        for (name, value) in &self.options.extra_env {
            if (name.contains("SECRET") || name.contains("TOKEN")) && value.len() >= 8 {
                canaries.push((name.clone(), value.clone()));
            }
        }
        canaries
    }
}

impl Gateway {
    /// `GET /metrics` with the token over a plain blocking connection (for `Drop`, which
    /// cannot await); `None` when the gateway does not answer within a few seconds.
    fn metrics_now(&self) -> Option<String> {
        use std::io::Write;
        let addr = SocketAddr::from(([127, 0, 0, 1], self.admin_port));
        let mut conn = std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(2)).ok()?;
        conn.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
        write!(
            conn,
            "GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {ADMIN_TOKEN}\r\nConnection: close\r\n\r\n"
        )
        .ok()?;
        let mut answer = String::new();
        conn.read_to_string(&mut answer).ok()?;
        answer.starts_with("HTTP/1.1 200").then_some(answer)
    }
}

impl Drop for Gateway {
    fn drop(&mut self) {
        // T21 across the whole run: the metrics a running gateway serves hold none of the
        // secrets its configuration carried either (read before it is stopped; a gateway a
        // test left dead or stalled is skipped).
        let metrics = if std::thread::panicking() {
            None
        } else {
            self.metrics_now()
        };
        self.kill9();
        if let Some(metrics) = &metrics {
            for (what, secret) in self.canaries() {
                assert!(
                    !metrics.contains(&secret),
                    "the gateway's /metrics shows the {what}"
                );
            }
        }
        if std::thread::panicking() {
            eprintln!(
                "---- hooklatch serve log ({}), last lines ----\n{}\n---- end of log ----",
                self.log_path().display(),
                self.log_tail(80)
            );
            return;
        }
        // T21 across the whole run: whatever the test did to it, the gateway's log holds none
        // of the secrets its configuration carried.
        let log = self.log();
        for (what, secret) in self.canaries() {
            assert!(
                !log.contains(&secret),
                "the gateway's log ({}) shows the {what}",
                self.log_path().display()
            );
        }
    }
}

/// Kills a [`Gateway`]'s process with SIGKILL from wherever it is fired; the gateway reaps it
/// on its next [`Gateway::kill9`] or [`Gateway::restart`].
#[derive(Clone)]
pub struct KillSwitch(Arc<Mutex<Option<Child>>>);

impl KillSwitch {
    /// kill -9, now.
    pub fn fire(&self) {
        if let Some(child) = self.0.lock().expect("child lock").as_mut() {
            child.kill().expect("sending SIGKILL");
        }
    }
}

fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .no_proxy()
        .timeout(DEADLINE)
        // The gateway closes a keep-alive connection that sends no request within its header
        // timeout (10 s here, slow-header defence). A pooled connection reused just as the
        // gateway closes it fails before any byte is read, and a test would count an answer
        // missing; dropping idle connections well before that keeps the race out of the tests.
        .pool_idle_timeout(Duration::from_secs(4))
        .build()
        .expect("building a reqwest client")
}

// ---------------------------------------------------------------------------------------------
// Raw HTTP, for bodies a normal client would send whole

/// Writes `head` (request line and headers, without the blank line) and then `body_parts`
/// to the ingest listener, without finishing the body unless the parts do, and reads the
/// answer. Returns the status and JSON body.
pub async fn raw_post(addr: SocketAddr, head: &str, body_parts: &[&[u8]]) -> (u16, Value) {
    let exchange = async {
        let mut stream = tokio::net::TcpStream::connect(addr)
            .await
            .expect("connecting to the gateway");
        stream
            .write_all(format!("{head}\r\n\r\n").as_bytes())
            .await
            .expect("writing the request head");
        for part in body_parts {
            // The gateway may answer and close before it reads everything: that is the point.
            if stream.write_all(part).await.is_err() {
                break;
            }
        }
        let _ = stream.flush().await;
        read_response(&mut stream).await
    };
    tokio::time::timeout(DEADLINE, exchange)
        .await
        .expect("the gateway answered before the body was complete")
}

async fn read_response(stream: &mut tokio::net::TcpStream) -> (u16, Value) {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    let header_end = loop {
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break i + 4;
        }
        let n = stream.read(&mut chunk).await.expect("reading the response");
        assert!(n > 0, "connection closed before a response: {buf:?}");
        buf.extend_from_slice(&chunk[..n]);
    };
    let head = String::from_utf8_lossy(&buf[..header_end]).to_string();
    let status: u16 = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no status in {head:?}"));
    let content_length: usize = head
        .lines()
        .find_map(|l| {
            let (name, value) = l.split_once(':')?;
            name.trim()
                .eq_ignore_ascii_case("content-length")
                .then(|| value.trim().parse().ok())?
        })
        .unwrap_or(0);
    while buf.len() < header_end + content_length {
        let n = stream.read(&mut chunk).await.expect("reading the body");
        if n == 0 {
            break;
        }
        buf.extend_from_slice(&chunk[..n]);
    }
    let body = &buf[header_end..(header_end + content_length).min(buf.len())];
    (status, serde_json::from_slice(body).unwrap_or(Value::Null))
}

// ---------------------------------------------------------------------------------------------
// An application that is killed after its work (T15)

/// A kill as [`KillAfterWork`] fires it: the gateway's [`KillSwitch`], or a `listen` client's.
pub type Kill = Box<dyn Fn() + Send + Sync>;

#[derive(Default)]
struct AfterWork {
    /// What to kill on an event's first delivery, once the work is counted.
    kill: Mutex<Option<Kill>>,
    /// Deliveries by `Idempotency-Key`, with the `hooklatch-attempt` each carried.
    seen: Mutex<HashMap<String, Vec<String>>>,
    /// The test heard the event's 2xx: a kill now cannot cut the ingest's answer.
    acked: tokio::sync::Notify,
}

/// An application on 127.0.0.1 that does the work of each event's first delivery (counts it),
/// then, once the test says the event's 2xx was heard ([`KillAfterWork::acked`]), fires its
/// kill before answering: what delivered it dies after the work and before it could record the
/// answer. Later deliveries of a key are answered 200 at once.
pub struct KillAfterWork {
    state: Arc<AfterWork>,
    url: String,
    task: tokio::task::JoinHandle<()>,
}

impl KillAfterWork {
    pub async fn start() -> KillAfterWork {
        async fn deliver(State(app): State<Arc<AfterWork>>, headers: HeaderMap) -> StatusCode {
            let header = |name: &str| {
                headers
                    .get(name)
                    .and_then(|v| v.to_str().ok())
                    .unwrap_or_default()
                    .to_owned()
            };
            let first = {
                let mut seen = app.seen.lock().expect("seen lock");
                let attempts = seen.entry(header("idempotency-key")).or_default();
                attempts.push(header("hooklatch-attempt"));
                attempts.len() == 1
            };
            if first {
                app.acked.notified().await;
                if let Some(kill) = app.kill.lock().expect("kill lock").as_ref() {
                    kill();
                }
            }
            StatusCode::OK
        }
        let state = Arc::new(AfterWork::default());
        let router = Router::new()
            .route("/webhooks", axum::routing::post(deliver))
            .with_state(state.clone());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("binding the application");
        let url = format!(
            "http://{}/webhooks",
            listener.local_addr().expect("its address")
        );
        let task = tokio::spawn(async move {
            let _ = axum::serve(listener, router).await;
        });
        KillAfterWork { state, url, task }
    }

    pub fn url(&self) -> String {
        self.url.clone()
    }

    /// What the next first delivery kills (`None`: nothing).
    pub fn set_kill(&self, kill: Option<Kill>) {
        *self.state.kill.lock().expect("kill lock") = kill;
    }

    /// The test heard an event's 2xx.
    pub fn acked(&self) {
        self.state.acked.notify_one();
    }

    /// Every delivery so far by `Idempotency-Key`, with the `hooklatch-attempt` each carried.
    pub fn seen(&self) -> HashMap<String, Vec<String>> {
        self.state.seen.lock().expect("seen lock").clone()
    }
}

impl Drop for KillAfterWork {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// The rest of a T3 outage once `proxy` has cut a service off, on a gateway whose `before`
/// event was delivered before the cut: a new event is answered 503 `code` with `Retry-After`
/// (never 2xx, never a hang) and `/readyz` says 503; once the proxy is up again the gateway is
/// ready without a restart, the provider's retry is accepted, and both events are delivered
/// once. Returns how long the 503 took.
pub async fn outage_then_recovery(
    gw: &Gateway,
    handler: &Handler,
    proxy: &hooklatch_testkit::proxy::FaultProxy,
    before: &str,
    code: &str,
) -> Duration {
    let event_id = unique("evt_during_outage");
    let body = stripe_invoice_paid(&event_id, 5000);
    let headers = stripe_headers(&body);
    let started = Instant::now();
    let res = gw
        .ingest()
        .send("stripe", &headers, body.clone())
        .await
        .expect("an answer, not a hang");
    let answered_in = started.elapsed();
    assert_eq!(res.status().as_u16(), 503, "never 2xx while {code}");
    assert!(res.headers().contains_key("retry-after"));
    let json: Value = res.json().await.expect("a JSON error");
    assert_eq!(json["code"], code, "{json}");
    let (status, json) = gw.admin_get("/readyz").await;
    assert_eq!(status, 503, "{json}");

    proxy.up();
    eventually_within("ready again", Duration::from_secs(60), async || {
        gw.admin_get("/readyz").await.0 == 200
    })
    .await;
    let (status, json) = gw.post("stripe", &headers, body).await;
    assert_eq!(
        (status, json["status"].as_str()),
        (200, Some("accepted")),
        "{json}"
    );
    let during = format!("stripe:{event_id}");
    gw.wait_for_delivery_state(&during, "delivered").await;
    assert_eq!(handler.count_for(before), 1);
    assert_eq!(handler.count_for(&during), 1);
    answered_in
}

/// The address a service URL (`redis://…`, `amqp://…`) names, resolved; `default_port` when
/// the URL has none.
pub fn service_addr(url: &str, default_port: u16) -> SocketAddr {
    let url = reqwest::Url::parse(url).expect("a service URL");
    std::net::ToSocketAddrs::to_socket_addrs(&(
        url.host_str().expect("a host").to_owned(),
        url.port().unwrap_or(default_port),
    ))
    .expect("resolving the service")
    .next()
    .expect("an address")
}

/// The service at `url` behind a TLS-terminating proxy (the testkit's) whose certificate, for
/// `localhost`, comes from a new private CA; and `url` rewritten to reach it over TLS:
/// `tls_scheme` (`amqps`, `rediss`), host `localhost`, the proxy's port.
pub async fn behind_tls(
    url: &str,
    default_port: u16,
    tls_scheme: &str,
) -> (
    hooklatch_testkit::tls::TestCa,
    hooklatch_testkit::tls::TlsTerminator,
    String,
) {
    let ca = hooklatch_testkit::tls::TestCa::new("hooklatch e2e CA");
    let tls = hooklatch_testkit::tls::TlsTerminator::start(
        service_addr(url, default_port),
        &ca.server(&["localhost"]),
        None,
    )
    .await
    .expect("the TLS proxy listens");
    let mut secure = reqwest::Url::parse(url).expect("a service URL");
    secure.set_scheme(tls_scheme).expect("a TLS scheme");
    secure.set_host(Some("localhost")).expect("a host");
    secure.set_port(Some(tls.addr().port())).expect("a port");
    (ca, tls, secure.to_string())
}

/// A fault proxy in front of the service `url` names (`default_port` when it names none), and
/// `url` rewritten to go through it.
pub async fn proxied(
    url: &str,
    default_port: u16,
) -> (hooklatch_testkit::proxy::FaultProxy, String) {
    let mut through = reqwest::Url::parse(url).expect("a service URL");
    let upstream = service_addr(url, default_port);
    let proxy = hooklatch_testkit::proxy::FaultProxy::start(upstream)
        .await
        .expect("starting the fault proxy");
    through.set_host(Some("127.0.0.1")).expect("a host");
    through.set_port(Some(proxy.addr().port())).expect("a port");
    (proxy, through.to_string())
}

// Power loss

/// A lazy file system (`hooklatch_testkit::lazyfs`) over a backing directory, both in a temp
/// dir that other users may enter (servers that refuse root keep their data there); `None`
/// (the test prints why it skips) where FUSE cannot be mounted. Not asserted under CI: a
/// machine without FUSE cannot be given it by `.ci/run`; where it is there, a mount that fails
/// fails the test.
pub fn lazy_mount(
    fsync: hooklatch_testkit::lazyfs::Fsync,
) -> Option<(tempfile::TempDir, hooklatch_testkit::lazyfs::LazyFs)> {
    use std::os::unix::fs::PermissionsExt;
    if let Err(why) = hooklatch_testkit::lazyfs::available() {
        println!("skipped: the lazy file system needs /dev/fuse and root ({why})");
        return None;
    }
    let dir = tempfile::tempdir().expect("a temp dir");
    let (backing, mnt) = (dir.path().join("disk"), dir.path().join("mnt"));
    std::fs::create_dir_all(&backing).expect("the backing directory");
    std::fs::create_dir_all(&mnt).expect("the mount point");
    for open in [dir.path(), &backing] {
        std::fs::set_permissions(open, std::fs::Permissions::from_mode(0o755))
            .expect("opening the temp dir to other users");
    }
    let fs = hooklatch_testkit::lazyfs::LazyFs::mount(&backing, &mnt, fsync)
        .expect("mounting the lazy file system");
    Some((dir, fs))
}

/// The uid and gid of system user `name` (`/etc/passwd`).
pub fn system_user(name: &str) -> Option<(u32, u32)> {
    let passwd = std::fs::read_to_string("/etc/passwd").ok()?;
    passwd.lines().find_map(|line| {
        let fields: Vec<&str> = line.split(':').collect();
        if fields.first() != Some(&name) || fields.len() < 4 {
            return None;
        }
        Some((fields[2].parse().ok()?, fields[3].parse().ok()?))
    })
}

/// kill -9 of `child` and every process in its process group (it was spawned with
/// `process_group(0)`); returns once all of them are gone (at most 10 s).
pub fn kill_process_group(child: &mut Child) {
    let group = format!("-{}", child.id());
    let signal = |sig: &str| {
        Command::new("kill")
            .args([sig, "--", &group])
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    };
    signal("-KILL");
    let _ = child.wait();
    let started = Instant::now();
    // `kill -0` succeeds while any process of the group is left.
    while signal("-0") && started.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Runs `hooklatch ARGS --admin ADMIN` with the admin token; what it did, however it ended.
pub fn hooklatch_output(args: &[&str], admin: &str) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_hooklatch"))
        .args(args)
        .args(["--admin", admin])
        .env("HOOKLATCH_ADMIN_TOKEN", ADMIN_TOKEN)
        .output()
        .expect("running hooklatch")
}

/// Runs `hooklatch ARGS --admin ADMIN` with the admin token; its standard output, once it
/// succeeded.
pub fn hooklatch(args: &[&str], admin: &str) -> String {
    let out = hooklatch_output(args, admin);
    assert!(
        out.status.success(),
        "hooklatch {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Deletes every key under `prefix` on the Redis at `url` (what a test wrote there); how many
/// there were.
pub async fn delete_redis_keys(url: &str, prefix: &str) -> usize {
    let mut conn = redis::Client::open(url)
        .expect("a Redis URL")
        .get_multiplexed_async_connection()
        .await
        .expect("connecting to Redis");
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg(format!("{prefix}*"))
        .query_async(&mut conn)
        .await
        .expect("KEYS");
    if !keys.is_empty() {
        let _: () = redis::cmd("DEL")
            .arg(&keys)
            .query_async(&mut conn)
            .await
            .expect("DEL");
    }
    keys.len()
}
