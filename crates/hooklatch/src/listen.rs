//! `listen` destinations: deliveries to a developer's machine, through a connection the
//! machine opens (`hooklatch listen`), so nothing on the laptop has to be reachable.
//!
//! The listener connects to the gateway's public listener with `GET /listen/{destination}`
//! and the destination's bearer token, and reads a stream of newline-delimited JSON
//! ([`Frame`]): each delivery with its headers and its body byte-exact, pings, and the
//! reasons the stream ends. It sends each delivery on to its local URL and answers with
//! `POST /listen/{destination}/results` ([`ListenResult`]): the local status, or what went
//! wrong.
//!
//! On the gateway's side a listen destination is an outbox destination like any other: the
//! delivery workers lease its rows, and an attempt is `ListenHub::forward`: the frame goes
//! to the connected listener and the task waits for its answer (the destination's `timeout`,
//! plus [`ROUND_TRIP`]). 2xx is success; anything else is a failure retried by the
//! destination's policy, as for HTTP. With no listener connected the row is not attempted: it
//! waits ([`AttemptNext::Wait`](hooklatch_core::store::AttemptNext::Wait)) for
//! [`AWAY_RECHECK`] (on PostgreSQL a quarter of its age, up to [`AWAY_RECHECK_SHARED`])
//! without counting an attempt, so events that arrive while the laptop
//! sleeps wait in the outbox (on disk, for as long as the destination's retention allows)
//! and none nears its dead-letter. A listener connecting makes its destination's waiting
//! rows due at once ([`Store::wake_destination`]).
//!
//! One listener per destination: a new connection replaces the one before (a laptop that
//! comes back from sleep reconnects before the gateway has noticed its old connection died).
//! A listener that disconnects while deliveries wait for its answers fails them ("the
//! listener disconnected before answering"): they may or may not have reached the local
//! URL, so they are retried with the same `Idempotency-Key`.

use std::collections::HashMap;
use std::convert::Infallible;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::{Path, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use base64::Engine as _;
use hooklatch_core::secret::constant_time_eq;
use hooklatch_core::store::LeasedDelivery;
use hooklatch_core::{DeliveryId, Secret, Store, Timestamp};
use hooklatch_http::ApiError;
use serde::{Deserialize, Serialize};
use tokio::sync::{mpsc, oneshot, Notify};
use tokio_util::sync::CancellationToken;

use crate::config::{Destination, DestinationKind};
use crate::delivery::{outgoing, ProviderSigner};

/// How long a delivery waits in the outbox, uncounted, before a worker looks again whether its
/// listener came back, on a store only one gateway uses (SQLite): a listener connecting wakes
/// the rows at once, so this is only a backstop, and a long one keeps a sleeping laptop's
/// backlog from being leased over and over.
pub const AWAY_RECHECK: Duration = Duration::from_secs(300);

/// The longest wait on a store several gateways may share (PostgreSQL): an instance the
/// listener is not connected to may take its destination's rows (after a wake too), and
/// puts each back for a quarter of its age, from [`AWAY_RECHECK_SHARED_MIN`] to this, before
/// a worker, maybe the connected instance's, takes it again. A fresh event is back within a
/// second; a backlog a sleeping laptop left is looked at every 15 s.
pub const AWAY_RECHECK_SHARED: Duration = Duration::from_secs(15);

/// The shortest of those waits.
pub const AWAY_RECHECK_SHARED_MIN: Duration = Duration::from_secs(1);

/// Time allowed beyond the destination's `timeout` for a frame to reach the listener and its
/// answer to come back.
pub const ROUND_TRIP: Duration = Duration::from_secs(5);

/// How often an idle stream carries a ping: the listener's sign that the connection lives, and
/// the write through which the gateway finds a listener gone without a word.
pub const PING_EVERY: Duration = Duration::from_secs(10);

/// One line of the stream `GET /listen/{destination}` sends.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Frame {
    /// The first line: the connection is registered; waiting deliveries follow.
    Ready {
        /// The destination listened to.
        destination: String,
    },
    /// A delivery to send on to the local URL.
    Delivery(ListenDelivery),
    /// Nothing happened for [`PING_EVERY`].
    Ping,
    /// A newer listener connected for this destination; this stream ends.
    Replaced,
    /// The gateway is shutting down; this stream ends. Reconnect.
    Shutdown,
}

/// A delivery as a listener receives it: what an HTTP destination would be sent.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct ListenDelivery {
    /// The outbox row (`dlv_…` in the admin API); the answer names it.
    pub delivery: i64,
    /// The attempt's number in this round (1 for the first).
    pub attempt: u32,
    /// The time the listener has to send it on and answer, in milliseconds.
    pub timeout_ms: u64,
    /// The headers to send, in order; values byte-exact.
    pub headers: Vec<FrameHeader>,
    /// The body, byte-exact, base64 (standard alphabet, padded).
    pub body_base64: String,
}

/// A header of a [`ListenDelivery`]: its value as text when it is UTF-8, otherwise as base64.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct FrameHeader {
    /// The name, lowercase.
    pub name: String,
    /// The value, when it is UTF-8.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub value: Option<String>,
    /// The value's bytes, base64, when it is not UTF-8.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub value_base64: Option<String>,
}

impl FrameHeader {
    fn new(name: String, value: Vec<u8>) -> FrameHeader {
        match String::from_utf8(value) {
            Ok(text) => FrameHeader {
                name,
                value: Some(text),
                value_base64: None,
            },
            Err(err) => FrameHeader {
                name,
                value: None,
                value_base64: Some(
                    base64::engine::general_purpose::STANDARD.encode(err.as_bytes()),
                ),
            },
        }
    }

    /// The value's bytes; `None` when the frame carried neither form or bad base64.
    pub fn bytes(&self) -> Option<Vec<u8>> {
        match (&self.value, &self.value_base64) {
            (Some(text), _) => Some(text.as_bytes().to_vec()),
            (None, Some(encoded)) => base64::engine::general_purpose::STANDARD
                .decode(encoded)
                .ok(),
            (None, None) => None,
        }
    }
}

/// A listener's answer for one delivery (`POST /listen/{destination}/results`).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct ListenResult {
    /// The delivery answered.
    pub delivery: i64,
    /// The local URL's status, if it answered.
    #[serde(default)]
    pub status: Option<u16>,
    /// What went wrong when it did not (connection refused, timeout).
    #[serde(default)]
    pub error: Option<String>,
}

/// How a delivery to a listen destination went.
pub(crate) enum Forwarded {
    /// No listener is connected: the delivery waits, uncounted.
    Away,
    /// The listener answered with the local URL's status.
    Answered(u16),
    /// The attempt failed: no answer in time, the listener gone, or the local URL unreachable.
    Failed(String),
}

/// What a waiting attempt hears back.
enum Answer {
    Result(ListenResult),
    Disconnected,
}

/// The listeners connected to this gateway, and the attempts waiting for their answers.
pub struct ListenHub {
    store: Arc<dyn Store>,
    enqueued: Arc<Notify>,
    /// Each listen destination's token, by name.
    tokens: HashMap<String, Secret>,
    /// Fires when the gateway shuts down: every stream ends.
    closing: CancellationToken,
    /// How long a delivery with no listener waits: [`AWAY_RECHECK`], or at most
    /// [`AWAY_RECHECK_SHARED`] when `shared`.
    away_recheck: Duration,
    /// Whether other gateways may share the store (and hold the listener).
    shared: bool,
    state: Mutex<HubState>,
}

#[derive(Default)]
struct HubState {
    next_listener: u64,
    listeners: HashMap<String, Listener>,
    waiting: HashMap<DeliveryId, Waiting>,
}

struct Listener {
    id: u64,
    frames: mpsc::UnboundedSender<Frame>,
}

struct Waiting {
    listener: u64,
    /// The destination the delivery went to: only its token may answer.
    destination: String,
    answer: oneshot::Sender<Answer>,
}

impl ListenHub {
    /// A hub for the listen destinations among `destinations`. A delivery with no listener
    /// waits [`AWAY_RECHECK`], or, when other gateways may `share` the store, a quarter of
    /// its age within [`AWAY_RECHECK_SHARED_MIN`]..[`AWAY_RECHECK_SHARED`].
    pub fn new(
        store: Arc<dyn Store>,
        enqueued: Arc<Notify>,
        destinations: &[Destination],
        closing: CancellationToken,
        shared: bool,
    ) -> ListenHub {
        let tokens = destinations
            .iter()
            .filter_map(|d| match &d.kind {
                DestinationKind::Listen { token, .. } => Some((d.name.clone(), token.clone())),
                _ => None,
            })
            .collect();
        ListenHub {
            store,
            enqueued,
            tokens,
            closing,
            away_recheck: if shared {
                AWAY_RECHECK_SHARED
            } else {
                AWAY_RECHECK
            },
            shared,
            state: Mutex::new(HubState::default()),
        }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, HubState> {
        // A panic while holding the lock leaves maps that are still consistent.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether other gateways may share the store.
    pub(crate) fn shared(&self) -> bool {
        self.shared
    }

    /// When a delivery found with no listener at `now` is looked at again.
    pub(crate) fn wait_until(&self, delivery: &LeasedDelivery, now: Timestamp) -> Timestamp {
        let wait = if self.shared {
            (now.since(delivery.round_started_at) / 4)
                .clamp(AWAY_RECHECK_SHARED_MIN, self.away_recheck)
        } else {
            self.away_recheck
        };
        now.plus(wait)
    }

    /// One attempt of `delivery` to the listener of `dest`.
    pub(crate) async fn forward(
        &self,
        dest: &Destination,
        secret: Option<&Secret>,
        signer: Option<&ProviderSigner>,
        delivery: &LeasedDelivery,
        attempt: u32,
        now: Timestamp,
    ) -> Forwarded {
        let (body, headers) = outgoing(delivery, attempt, secret, signer, now);
        let frame = Frame::Delivery(ListenDelivery {
            delivery: delivery.id.0,
            attempt,
            timeout_ms: dest.timeout.as_millis() as u64,
            headers: headers
                .into_iter()
                .map(|(name, value)| FrameHeader::new(name, value))
                .collect(),
            body_base64: base64::engine::general_purpose::STANDARD.encode(&body),
        });
        let (answer, heard) = oneshot::channel();
        let listener = {
            let mut state = self.state();
            let Some(listener) = state.listeners.get(&dest.name) else {
                return Forwarded::Away;
            };
            let id = listener.id;
            if listener.frames.send(frame).is_err() {
                // Its stream ended without unregistering (it always does; this is a guard).
                state.listeners.remove(&dest.name);
                return Forwarded::Away;
            }
            state.waiting.insert(
                delivery.id,
                Waiting {
                    listener: id,
                    destination: dest.name.clone(),
                    answer,
                },
            );
            id
        };
        // An attempt dropped while it waits (shutdown) takes its waiting entry with it.
        let _forget = ForgetWaiting {
            hub: self,
            delivery: delivery.id,
            listener,
        };
        let limit = dest.timeout + ROUND_TRIP;
        match tokio::time::timeout(limit, heard).await {
            Ok(Ok(Answer::Result(result))) => match (result.status, result.error) {
                (Some(status), _) => Forwarded::Answered(status),
                (None, Some(error)) => Forwarded::Failed(format!("listener: {}", bounded(&error))),
                (None, None) => Forwarded::Failed("listener: no status and no error".to_owned()),
            },
            Ok(Ok(Answer::Disconnected)) | Ok(Err(_)) => {
                Forwarded::Failed("the listener disconnected before answering".to_owned())
            }
            Err(_) => Forwarded::Failed(format!(
                "the listener did not answer within {} s",
                limit.as_secs()
            )),
        }
    }

    /// Registers a new listener for `destination`, replacing any other; returns its id.
    fn register(&self, destination: &str, frames: mpsc::UnboundedSender<Frame>) -> u64 {
        let mut state = self.state();
        state.next_listener += 1;
        let id = state.next_listener;
        if let Some(old) = state
            .listeners
            .insert(destination.to_owned(), Listener { id, frames })
        {
            let _ = old.frames.send(Frame::Replaced);
        }
        metrics::gauge!("hooklatch_listeners", "destination" => destination.to_owned()).set(1.0);
        id
    }

    /// Forgets listener `id` of `destination` (its stream ended) and fails every attempt
    /// still waiting for its answer.
    fn unregister(&self, destination: &str, id: u64) {
        let mut state = self.state();
        if state.listeners.get(destination).is_some_and(|l| l.id == id) {
            state.listeners.remove(destination);
            metrics::gauge!("hooklatch_listeners", "destination" => destination.to_owned())
                .set(0.0);
        }
        let gone: Vec<DeliveryId> = state
            .waiting
            .iter()
            .filter(|(_, w)| w.listener == id)
            .map(|(d, _)| *d)
            .collect();
        for delivery in gone {
            if let Some(waiting) = state.waiting.remove(&delivery) {
                let _ = waiting.answer.send(Answer::Disconnected);
            }
        }
    }

    /// Hands a listener's answer to the attempt waiting for it; false if none waits (it timed
    /// out, or the delivery is unknown).
    ///
    /// Only an attempt of `destination` is answered: a listener's token speaks for its own
    /// destination's deliveries, never for another's.
    fn answer(&self, destination: &str, result: ListenResult) -> bool {
        let waiting = {
            let mut state = self.state();
            let id = DeliveryId(result.delivery);
            if state
                .waiting
                .get(&id)
                .is_none_or(|w| w.destination != destination)
            {
                return false;
            }
            state.waiting.remove(&id)
        };
        match waiting {
            Some(waiting) => waiting.answer.send(Answer::Result(result)).is_ok(),
            None => false,
        }
    }

    /// Checks the bearer token for `destination`, in constant time.
    fn authorize(&self, destination: &str, headers: &HeaderMap) -> Result<(), ApiError> {
        let Some(token) = self.tokens.get(destination) else {
            return Err(ApiError::new(
                StatusCode::NOT_FOUND,
                "unknown_destination",
                format!("no listen destination is named {destination:?}"),
            ));
        };
        match hooklatch_http::bearer_token(headers) {
            Some(given) if constant_time_eq(given.as_bytes(), token.expose()) => Ok(()),
            _ => Err(ApiError::new(
                StatusCode::UNAUTHORIZED,
                "unauthorized",
                "missing or wrong bearer token for this listen destination",
            )),
        }
    }
}

/// The longest error text a listener's answer puts in the attempt's history.
const ERROR_CHARS: usize = 300;

/// A listener's error text as history keeps it: at most [`ERROR_CHARS`] characters, control
/// characters replaced (the text comes from outside the gateway).
fn bounded(error: &str) -> String {
    let mut text: String = error
        .chars()
        .take(ERROR_CHARS)
        .map(|c| if c.is_control() { ' ' } else { c })
        .collect();
    if error.chars().nth(ERROR_CHARS).is_some() {
        text.push('…');
    }
    text
}

/// Removes an attempt's waiting entry when the attempt ends, however it ends.
struct ForgetWaiting<'a> {
    hub: &'a ListenHub,
    delivery: DeliveryId,
    listener: u64,
}

impl Drop for ForgetWaiting<'_> {
    fn drop(&mut self) {
        let mut state = self.hub.state();
        if state
            .waiting
            .get(&self.delivery)
            .is_some_and(|w| w.listener == self.listener)
        {
            state.waiting.remove(&self.delivery);
        }
    }
}

/// Unregisters a listener when its stream is dropped: the listener hung up, or the stream
/// ended.
struct Registration {
    hub: Arc<ListenHub>,
    destination: String,
    id: u64,
}

impl Drop for Registration {
    fn drop(&mut self) {
        tracing::info!(destination = %self.destination, "listener disconnected");
        self.hub.unregister(&self.destination, self.id);
    }
}

/// The listen routes, merged into the public router: `GET /listen/{destination}` and
/// `POST /listen/{destination}/results`.
pub fn router(hub: Arc<ListenHub>) -> Router {
    Router::new()
        .route("/listen/{destination}", get(connect).fallback(other_method))
        .route(
            "/listen/{destination}/results",
            post(results).fallback(other_method),
        )
        .with_state(hub)
}

/// Any other method on a listen route: 405 with a JSON body.
async fn other_method() -> ApiError {
    ApiError::new(
        StatusCode::METHOD_NOT_ALLOWED,
        "method_not_allowed",
        "a listener connects with GET /listen/{destination} and answers with POST /listen/{destination}/results",
    )
}

/// Counts and logs a refused listen request. Listen requests are not webhooks: they are kept
/// in no history, as admin requests are not.
fn refused(destination: &str, err: ApiError) -> Response {
    tracing::info!(%destination, code = err.code, "listen request refused");
    metrics::counter!("hooklatch_listen_refused_total", "code" => err.code).increment(1);
    err.into_response()
}

/// `GET /listen/{destination}`: registers the caller as the destination's listener and streams
/// [`Frame`]s to it until it hangs up, another listener replaces it, or the gateway stops.
async fn connect(
    State(hub): State<Arc<ListenHub>>,
    Path(destination): Path<String>,
    headers: HeaderMap,
) -> Response {
    if let Err(err) = hub.authorize(&destination, &headers) {
        return refused(&destination, err);
    }
    let (frames, incoming) = mpsc::unbounded_channel();
    let _ = frames.send(Frame::Ready {
        destination: destination.clone(),
    });
    let id = hub.register(&destination, frames);
    tracing::info!(%destination, "listener connected");
    // What waited for this listener is due now. Off this request's task: the stream starts at
    // once, and a hang-up does not cut the store write short.
    let waker = hub.clone();
    let woken = destination.clone();
    tokio::spawn(async move {
        match waker.store.wake_destination(&woken, Timestamp::now()).await {
            Ok(n) => tracing::debug!(destination = %woken, n, "waiting deliveries due now"),
            Err(err) => {
                tracing::warn!(%err, destination = %woken, "could not wake waiting deliveries")
            }
        }
        waker.enqueued.notify_one();
    });
    let registration = Registration {
        hub: hub.clone(),
        destination,
        id,
    };
    let body = Body::from_stream(frame_stream(incoming, hub.closing.clone(), registration));
    let mut res = (StatusCode::OK, body).into_response();
    res.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/x-ndjson"),
    );
    res.headers_mut()
        .insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    res
}

/// A stream's state: see [`frame_stream`].
struct Streaming {
    incoming: mpsc::UnboundedReceiver<Frame>,
    closing: CancellationToken,
    _registration: Registration,
    done: bool,
}

/// The stream's lines: each frame as it comes, a ping after [`PING_EVERY`] of silence, and the
/// end after [`Frame::Replaced`] or [`Frame::Shutdown`]. It owns the listener's registration,
/// so the listener is forgotten when hyper drops the body (the listener hung up, found by the
/// next write at the latest).
fn frame_stream(
    incoming: mpsc::UnboundedReceiver<Frame>,
    closing: CancellationToken,
    registration: Registration,
) -> impl futures::Stream<Item = Result<Bytes, Infallible>> + Send {
    let start = Streaming {
        incoming,
        closing,
        _registration: registration,
        done: false,
    };
    futures::stream::unfold(start, |mut s| async move {
        if s.done {
            return None;
        }
        let frame = tokio::select! {
            biased;
            _ = s.closing.cancelled() => Frame::Shutdown,
            frame = s.incoming.recv() => frame?,
            _ = tokio::time::sleep(PING_EVERY) => Frame::Ping,
        };
        s.done = matches!(frame, Frame::Replaced | Frame::Shutdown);
        let mut line = serde_json::to_vec(&frame).unwrap_or_default();
        line.push(b'\n');
        Some((Ok(Bytes::from(line)), s))
    })
}

/// `POST /listen/{destination}/results`: a listener's answer for one delivery.
async fn results(
    State(hub): State<Arc<ListenHub>>,
    Path(destination): Path<String>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    if let Err(err) = hub.authorize(&destination, &headers) {
        return refused(&destination, err);
    }
    let result: ListenResult = match serde_json::from_slice(&body) {
        Ok(result) => result,
        Err(err) => {
            return refused(&destination, ApiError::new(
                StatusCode::BAD_REQUEST,
                "invalid_body",
                format!("a result is {{\"delivery\": id, \"status\": code}} or {{\"delivery\": id, \"error\": text}}: {err}"),
            ))
        }
    };
    let delivery = result.delivery;
    if hub.answer(&destination, result) {
        StatusCode::NO_CONTENT.into_response()
    } else {
        refused(
            &destination,
            ApiError::new(
                StatusCode::NOT_FOUND,
                "not_waiting",
                format!("no attempt of delivery {delivery} waits for an answer (it timed out, or was answered already)"),
            ),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_header_value_that_is_not_utf8_travels_as_base64_byte_exact() {
        let raw = vec![b'a', 0xff, b'b'];
        let header = FrameHeader::new("x-odd".to_owned(), raw.clone());
        assert_eq!(header.value, None);
        let line = serde_json::to_string(&header).unwrap();
        assert_eq!(line, r#"{"name":"x-odd","value_base64":"Yf9i"}"#);
        let back: FrameHeader = serde_json::from_str(&line).unwrap();
        assert_eq!(back.bytes(), Some(raw));
        let text = FrameHeader::new("x-ok".to_owned(), b"plain".to_vec());
        assert_eq!(text.bytes(), Some(b"plain".to_vec()));
    }

    /// A delivery of `stripe:evt_1` to `laptop`, received at `received`.
    fn leased(id: i64, received: Timestamp) -> LeasedDelivery {
        LeasedDelivery {
            id: DeliveryId(id),
            request_id: hooklatch_core::RequestId(1),
            source: "stripe".to_owned(),
            event_key: "evt_1".to_owned(),
            event_type: None,
            destination: "laptop".to_owned(),
            idempotency_key: hooklatch_core::IdempotencyKey::from_stored("stripe:evt_1".to_owned()),
            attempts: 0,
            round_started_at: received,
            method: "POST".to_owned(),
            path: "/in/stripe".to_owned(),
            headers: Vec::new(),
            body: Bytes::from_static(b"{}"),
            lease_until: None,
        }
    }

    #[test]
    fn a_delivery_with_no_listener_waits_by_its_age_on_a_shared_store() {
        let hub = |shared| {
            ListenHub::new(
                Arc::new(hooklatch_testkit::MemoryStore::default()),
                Arc::new(Notify::new()),
                &[],
                CancellationToken::new(),
                shared,
            )
        };
        let received = Timestamp::from_secs(1_000_000);
        let delivery = leased(7, received);
        let wait = |hub: &ListenHub, age_s: u64| {
            let now = received.plus(Duration::from_secs(age_s));
            hub.wait_until(&delivery, now).since(now)
        };
        let shared = hub(true);
        assert_eq!(wait(&shared, 0), AWAY_RECHECK_SHARED_MIN);
        assert_eq!(wait(&shared, 20), Duration::from_secs(5));
        assert_eq!(wait(&shared, 3_600), AWAY_RECHECK_SHARED);
        let alone = hub(false);
        assert_eq!(wait(&alone, 0), AWAY_RECHECK);
        assert_eq!(wait(&alone, 3_600), AWAY_RECHECK);
    }

    #[test]
    fn a_listeners_error_is_kept_short_and_printable() {
        assert_eq!(bounded("connection refused"), "connection refused");
        assert_eq!(bounded("a\nb\u{0}c"), "a b c");
        let long = "x".repeat(10_000);
        let kept = bounded(&long);
        assert_eq!(kept.chars().count(), ERROR_CHARS + 1);
        assert!(kept.ends_with('…'));
    }

    /// A listener's token answers only its own destination's deliveries.
    #[tokio::test]
    async fn an_answer_for_another_destinations_delivery_is_refused() {
        use hooklatch_core::RetryPolicy;
        let destination = |name: &str| Destination {
            name: name.to_owned(),
            kind: DestinationKind::Listen {
                token: Secret::from_text("listen-token-0123456789"),
                secret: None,
            },
            timeout: Duration::from_secs(5),
            retry: RetryPolicy::default(),
            disable_on_gone: true,
            provider_signature: Default::default(),
        };
        let (laptop, other) = (destination("laptop"), destination("other"));
        let hub = Arc::new(ListenHub::new(
            Arc::new(hooklatch_testkit::MemoryStore::default()),
            Arc::new(Notify::new()),
            &[laptop.clone(), other],
            CancellationToken::new(),
            false,
        ));
        let (frames, mut incoming) = mpsc::unbounded_channel();
        hub.register("laptop", frames);
        let delivery = leased(7, Timestamp::from_secs(1));
        let attempt = {
            let hub = hub.clone();
            tokio::spawn(async move {
                hub.forward(&laptop, None, None, &delivery, 1, Timestamp::from_secs(2))
                    .await
            })
        };
        // The frame reached the listener: the attempt waits for its answer.
        assert!(matches!(incoming.recv().await, Some(Frame::Delivery(_))));
        let ok = ListenResult {
            delivery: 7,
            status: Some(200),
            error: None,
        };
        assert!(
            !hub.answer("other", ok.clone()),
            "another destination's token"
        );
        assert!(
            hub.answer("laptop", ok.clone()),
            "its own destination's token"
        );
        assert!(matches!(attempt.await.unwrap(), Forwarded::Answered(200)));
        assert!(!hub.answer("laptop", ok), "answered once");
    }

    #[test]
    fn frames_are_one_json_object_tagged_by_type() {
        let ping = serde_json::to_string(&Frame::Ping).unwrap();
        assert_eq!(ping, r#"{"type":"ping"}"#);
        let ready: Frame =
            serde_json::from_str(r#"{"type":"ready","destination":"laptop"}"#).unwrap();
        assert_eq!(
            ready,
            Frame::Ready {
                destination: "laptop".to_owned()
            }
        );
        let result: ListenResult = serde_json::from_str(r#"{"delivery":7,"status":200}"#).unwrap();
        assert_eq!((result.status, result.error), (Some(200), None));
    }
}
