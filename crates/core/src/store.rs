//! The [`Store`] trait: idempotency claims, the outbox, delivery attempts and history.
//!
//! One trait for every backend (embedded SQLite now, PostgreSQL next), spoken in domain types.
//! The central call is [`Store::ingest`]: it records a verified request and claims its event
//! keys, writing one outbox row per destination for each new event, all in one durable
//! transaction. It returns only after that commit is durable, and it must complete or roll back
//! as a whole even when the caller's future is dropped (a provider hanging up mid-request):
//! backends run the transaction off the caller's task.
//!
//! Expected outcomes are values ([`Claim`]), not errors; [`StoreError`] means the store could
//! not answer, and the gateway turns it into 503 so the provider retries.

use std::borrow::Cow;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use bytes::Bytes;

use crate::id::{DeliveryId, EventKey, IdempotencyKey, RequestId, SourceName};
use crate::time::Timestamp;

/// Text as every store keeps it: NUL replaced by U+FFFD. PostgreSQL's `TEXT` cannot hold NUL,
/// which Rust strings can (a percent-decoded path segment of a refused request, an event type
/// from a JSON body's `\u0000`); replacing it rather than failing the write keeps a request
/// the gateway has already judged from being answered 503 and retried for days.
pub fn storable_text(s: &str) -> Cow<'_, str> {
    if s.contains('\0') {
        Cow::Owned(s.replace('\0', "\u{fffd}"))
    } else {
        Cow::Borrowed(s)
    }
}

/// A header as received: name (lowercase) and raw value bytes.
pub type Header = (String, Vec<u8>);

/// The store could not do what was asked. The gateway answers 503; workers retry.
#[derive(Debug, Clone, thiserror::Error)]
pub enum StoreError {
    /// The store is full (disk full or its configured size cap).
    #[error("store is full")]
    Full,
    /// The store is unreachable, closed or failing.
    #[error("store unavailable: {0}")]
    Unavailable(String),
}

/// Whether the store's last write of a new request found it full: what a store's
/// [`Store::ping`] reads to answer "not ready" until an event fits again (a load balancer
/// should not send traffic that ingest can only refuse with 503).
#[derive(Debug, Default)]
pub struct FullFlag(AtomicBool);

impl FullFlag {
    /// Whether the last write of a new request found the store full.
    pub fn is_set(&self) -> bool {
        self.0.load(Ordering::Acquire)
    }

    /// Notes the outcome of a write that keeps an event's request, body and all, or of the
    /// store's probe for room: full on [`StoreError::Full`], not full on success, unchanged on
    /// other errors. Returns the new state when it changed, so the store logs and sets its
    /// gauge once per change, not per request.
    pub fn note<T>(&self, outcome: &Result<T, StoreError>) -> Option<bool> {
        match outcome {
            Ok(_) => self.set(false),
            Err(StoreError::Full) => self.set(true),
            Err(StoreError::Unavailable(_)) => None,
        }
    }

    /// Notes the outcome of a smaller write that needs room too (a refused request's record, a
    /// handshake, a redrive): full on [`StoreError::Full`]; its success says nothing, as it
    /// may fit where an event does not.
    pub fn note_small<T>(&self, outcome: &Result<T, StoreError>) -> Option<bool> {
        match outcome {
            Err(StoreError::Full) => self.set(true),
            _ => None,
        }
    }

    fn set(&self, full: bool) -> Option<bool> {
        // A plain read first: on ingest's path the state almost never changes.
        let changed =
            self.0.load(Ordering::Acquire) != full && self.0.swap(full, Ordering::AcqRel) != full;
        changed.then_some(full)
    }
}

/// What the gateway decided about a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Verdict {
    /// Verified, at least one new event claimed and queued.
    Accepted,
    /// Verified, every event already claimed with the same body.
    Duplicate,
    /// Verified, an event already claimed with a different body: kept, not queued.
    Conflict,
    /// Refused before the store was touched (signature, timestamp, size, format, unknown source).
    Rejected,
    /// A verified provider handshake (Slack `url_verification`, Discord PING, Meta's `GET`
    /// subscription check): answered, not an event, claims nothing.
    Handshake,
    /// Imported from an export file (another gateway's history): kept for replay and
    /// redelivery, claims nothing.
    Imported,
}

impl Verdict {
    /// The stable lowercase name used in history, the API and metrics.
    pub fn as_str(self) -> &'static str {
        match self {
            Verdict::Accepted => "accepted",
            Verdict::Duplicate => "duplicate",
            Verdict::Conflict => "conflict",
            Verdict::Rejected => "rejected",
            Verdict::Handshake => "handshake",
            Verdict::Imported => "imported",
        }
    }

    /// Parses [`Verdict::as_str`] back.
    pub fn parse(s: &str) -> Option<Verdict> {
        Some(match s {
            "accepted" => Verdict::Accepted,
            "duplicate" => Verdict::Duplicate,
            "conflict" => Verdict::Conflict,
            "rejected" => Verdict::Rejected,
            "handshake" => Verdict::Handshake,
            "imported" => Verdict::Imported,
            _ => return None,
        })
    }
}

/// A request as the gateway received it, for history.
#[derive(Debug, Clone)]
pub struct RequestRecord {
    /// Arrival time.
    pub received_at: Timestamp,
    /// The `{source}` path segment (kept even when it names no configured source).
    pub source: String,
    /// HTTP method.
    pub method: String,
    /// Path and query as received.
    pub path: String,
    /// The peer's socket address, if known.
    pub peer: Option<String>,
    /// Headers, byte-exact, in arrival order.
    pub headers: Vec<Header>,
    /// Body, byte-exact (possibly cut short for a rejected oversized body: see `body_truncated`).
    pub body: Bytes,
    /// True when the body was not read whole (413).
    pub body_truncated: bool,
}

/// One verified event to claim.
#[derive(Debug, Clone)]
pub struct NewEvent {
    /// The provider's stable key.
    pub key: EventKey,
    /// The provider's event type, if any.
    pub event_type: Option<String>,
    /// What tells a duplicate of this event from a conflict, when it is not the whole body's
    /// hash ([`Ingest::body_sha256`]): the provider's [`crate::ExtractedEvent::fingerprint`].
    pub content_sha256: Option<[u8; 32]>,
}

impl NewEvent {
    /// An event as every store keeps it: its type as [`storable_text`], so the copy a store
    /// writes, the copy read back for a retry and the copy handed to a worker in memory
    /// (`Ingest::leased`) are the same text on every backend.
    pub fn new(key: EventKey, event_type: Option<String>) -> NewEvent {
        let event_type = event_type.map(|t| match storable_text(&t) {
            Cow::Borrowed(_) => t,
            Cow::Owned(replaced) => replaced,
        });
        NewEvent {
            key,
            event_type,
            content_sha256: None,
        }
    }

    /// The event with its own content hash ([`NewEvent::content_sha256`]).
    pub fn with_content(mut self, content_sha256: Option<[u8; 32]>) -> NewEvent {
        self.content_sha256 = content_sha256;
        self
    }
}

/// A verified request to record and claim.
#[derive(Debug, Clone)]
pub struct Ingest {
    /// The source it arrived on.
    pub source: SourceName,
    /// The request, byte-exact.
    pub request: RequestRecord,
    /// SHA-256 of the raw body, to tell duplicates from conflicts (unless an event has a
    /// content hash of its own: [`Ingest::content_sha256`]).
    pub body_sha256: [u8; 32],
    /// The events it carries (usually one).
    pub events: Vec<NewEvent>,
    /// Destinations each new event is queued for.
    pub destinations: Vec<String>,
    /// How long the claims are kept.
    pub retention: Duration,
    /// Who decides whether each event is new: the store's claims (the default) or an external
    /// key store that already did.
    pub keys: KeyDecision,
    /// When set, the deliveries this ingest queues are written already leased to this worker
    /// (a hand-off: see [`Ingest::leased`]); otherwise they are written due at once.
    pub lease: Option<IngestLease>,
}

/// A lease taken in the ingest transaction itself, for the local delivery worker: the rows
/// are written leased, so no other leaser takes them, and the worker receives them from the
/// gateway's memory instead of a separate lease write. Should the worker never attempt them
/// (a crash, a hang-up), the lease runs out and they are due like any other row.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IngestLease {
    /// The worker the rows are leased to.
    pub owner: String,
    /// When the lease ends.
    pub until: Timestamp,
}

impl Ingest {
    /// What `event`'s claim is compared by, duplicate or conflict: its own content hash when the
    /// provider gives one (an item of a batch that a retry may regroup, an event whose
    /// notifications differ only in their own ids), else the whole body's.
    pub fn content_sha256(&self, event: &NewEvent) -> [u8; 32] {
        event.content_sha256.unwrap_or(self.body_sha256)
    }

    /// How many deliveries this ingest queues if every event is new: the most a hand-off of
    /// it may carry.
    pub fn most_deliveries(&self) -> usize {
        self.events.len() * self.destinations.len()
    }

    /// The deliveries `outcome` queued, as [`Store::lease_due`] would hand them out: for an
    /// ingest written with a [`lease`](Ingest::lease), what its worker attempts without
    /// reading them back. The body is shared with the request, not copied.
    pub fn leased(&self, outcome: &IngestOutcome) -> Vec<LeasedDelivery> {
        let mut leased = Vec::new();
        for (event, (_, claim)) in self.events.iter().zip(&outcome.claims) {
            let Claim::New { deliveries } = claim else {
                continue;
            };
            let idempotency_key = IdempotencyKey::new(&self.source, &event.key);
            for (id, destination) in deliveries.iter().zip(&self.destinations) {
                leased.push(LeasedDelivery {
                    id: *id,
                    request_id: outcome.request_id,
                    source: self.source.as_str().to_owned(),
                    event_key: event.key.as_str().to_owned(),
                    event_type: event.event_type.clone(),
                    destination: destination.clone(),
                    idempotency_key: idempotency_key.clone(),
                    attempts: 0,
                    round_started_at: self.request.received_at,
                    method: self.request.method.clone(),
                    path: self.request.path.clone(),
                    headers: self.request.headers.clone(),
                    body: self.request.body.clone(),
                    lease_until: self.lease.as_ref().map(|lease| lease.until),
                });
            }
        }
        leased
    }
}

/// Who decides whether each event of an [`Ingest`] is new.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum KeyDecision {
    /// The store claims each key in the ingest transaction (SQL mode, the default).
    #[default]
    Store,
    /// An external key store (Redis mode) already decided, one entry per event in order. The
    /// store records the request, queues the events marked [`Claim::New`] (whose `deliveries`
    /// it fills in; what the caller put there is ignored), records the others as given, and
    /// writes no claim of its own.
    Decided(Vec<Claim>),
}

/// The outcome of claiming one key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Claim {
    /// First time: claimed, and one delivery queued per destination.
    New {
        /// The queued deliveries.
        deliveries: Vec<DeliveryId>,
    },
    /// Already claimed with the same body.
    Duplicate {
        /// The request that claimed it.
        first_request: RequestId,
        /// When it was claimed.
        first_seen: Timestamp,
    },
    /// Already claimed with a different body: this body is kept in history, not queued.
    Conflict {
        /// The request that claimed it.
        first_request: RequestId,
        /// The SHA-256 of the claimed body.
        first_body_sha256: [u8; 32],
    },
}

/// What [`Store::ingest`] did.
#[derive(Debug, Clone)]
pub struct IngestOutcome {
    /// The history record of this request.
    pub request_id: RequestId,
    /// One claim per event, in order.
    pub claims: Vec<(EventKey, Claim)>,
}

impl IngestOutcome {
    /// The request's verdict: accepted if anything new was queued, else conflict if any body
    /// differed, else duplicate.
    pub fn verdict(&self) -> Verdict {
        verdict_of(self.claims.iter().map(|(_, c)| c))
    }
}

/// The verdict of a request from its claims (see [`IngestOutcome::verdict`]).
pub fn verdict_of<'a>(claims: impl Iterator<Item = &'a Claim>) -> Verdict {
    let mut verdict = Verdict::Duplicate;
    for claim in claims {
        match claim {
            Claim::New { .. } => return Verdict::Accepted,
            Claim::Conflict { .. } => verdict = Verdict::Conflict,
            Claim::Duplicate { .. } => {}
        }
    }
    verdict
}

/// A rejected request to record in history.
#[derive(Debug, Clone)]
pub struct Rejected {
    /// The request as received.
    pub request: RequestRecord,
    /// The stable rejection code (`invalid_signature`, `body_too_large`, ...).
    pub code: String,
    /// The HTTP status answered.
    pub status: u16,
}

/// The `Idempotency-Key` of a deliberate redelivery ([`Store::redeliver`]) of event `key` from
/// request `request`: the event's own `{source}:{key}`, so the application's guard decides;
/// but a [`Verdict::Conflict`] request carries a different body under a known key, and
/// redelivering it releases that body as the new event it is, under `{source}:{key}:{req_N}`
/// (a guard would otherwise take it for the event it already processed).
pub fn redelivery_key(source: &str, key: &str, verdict: Verdict, request: RequestId) -> String {
    match verdict {
        Verdict::Conflict => format!("{source}:{key}:{request}"),
        _ => format!("{source}:{key}"),
    }
}

/// A delivery taken by a worker, with everything needed to send it.
#[derive(Debug, Clone)]
pub struct LeasedDelivery {
    /// The outbox row.
    pub id: DeliveryId,
    /// The request whose body is delivered.
    pub request_id: RequestId,
    /// The source it came from.
    pub source: String,
    /// The event's key.
    pub event_key: String,
    /// The provider's event type, if any.
    pub event_type: Option<String>,
    /// The destination's name.
    pub destination: String,
    /// Sent as `Idempotency-Key` on every attempt.
    pub idempotency_key: IdempotencyKey,
    /// Attempts made so far in this round (0 for a fresh delivery).
    pub attempts: u32,
    /// When this round of attempts began: when the event was received, or when an operator
    /// redrove it from the dead-letter. The retry policy's `max_age` counts from here.
    pub round_started_at: Timestamp,
    /// The original request's method.
    pub method: String,
    /// The original request's path and query.
    pub path: String,
    /// The original headers.
    pub headers: Vec<Header>,
    /// The original body, byte-exact.
    pub body: Bytes,
    /// When the lease it was handed out under ends, as the store wrote it (`None` only for
    /// one built by hand). An attempt carries it on ([`AttemptResult::lease_until`]).
    pub lease_until: Option<Timestamp>,
}

/// The content type of a body made from a query string.
pub const FORM_CONTENT_TYPE: &str = "application/x-www-form-urlencoded";

impl LeasedDelivery {
    /// What a destination receives: the body as received, byte-exact. A `GET` without a body
    /// carried its event in the query string (a provider that sends events that way, see
    /// [`crate::ProviderAdapter::get_carries_events`]): that query then becomes a form-encoded
    /// body, the shape the provider sends as a POST, with `Some` content type to set.
    pub fn payload(&self) -> (Bytes, Option<&'static str>) {
        if self.method.eq_ignore_ascii_case("GET") && self.body.is_empty() {
            let query = self.path.split_once('?').map_or("", |(_, query)| query);
            let query = query.split('#').next().unwrap_or_default();
            return (
                Bytes::copy_from_slice(query.as_bytes()),
                Some(FORM_CONTENT_TYPE),
            );
        }
        (self.body.clone(), None)
    }
}

/// How one attempt ended.
#[derive(Debug, Clone)]
pub struct AttemptResult {
    /// The delivery attempted.
    pub delivery: DeliveryId,
    /// The worker that leased it. If another lease holds the row now (this one's ran out and
    /// another worker, or this one, took the row again: see [`AttemptResult::lease_until`]) or
    /// the delivery is no longer pending, the attempt is kept in history but does not move
    /// the delivery: a late worker never undoes a newer outcome.
    pub owner: String,
    /// When the attempt started.
    pub started_at: Timestamp,
    /// How long it took.
    pub latency: Duration,
    /// The response status, if a response came.
    pub status: Option<u16>,
    /// What went wrong, if anything (safe to show).
    pub error: Option<String>,
    /// What happens next.
    pub next: AttemptNext,
    /// The end of the lease the attempt was made under ([`LeasedDelivery::lease_until`]).
    /// With `Some`, the attempt moves its delivery only while the row is under that very
    /// lease: once it ran out and the row was leased again — by another worker or by this
    /// one, whose name is the same — the newer lease's attempt decides (and may leave the row
    /// under no lease), and this one is only counted. `None` compares the owner alone, and a
    /// row under no lease takes it.
    pub lease_until: Option<Timestamp>,
    /// This attempt's own token ([`AttemptToken::random`], drawn once per attempt): recording
    /// the attempt again with the same token changes nothing, so a worker that did not hear
    /// whether its record committed may send it again.
    pub token: AttemptToken,
}

/// What makes an attempt's record idempotent. The store keeps the token of the last attempt
/// recorded on each delivery, beside the row it moves: a record whose token is the row's
/// already is a repeat (its first commit's answer was lost, or came too late) and is neither
/// counted, numbered nor kept again. The check sits on the delivery's row, under the lock the
/// update takes, so a repeat racing its first (a statement still running on a connection the
/// worker gave up on) is caught too. It compares with the last token only: a repeat arriving
/// after another worker's attempt on the same delivery was recorded (two workers on one
/// delivery at once, a lease that ran out mid-attempt) is counted again.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct AttemptToken(pub i64);

impl AttemptToken {
    /// A fresh random token.
    pub fn random() -> AttemptToken {
        AttemptToken(rand::random())
    }
}

/// The delivery's state after an attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AttemptNext {
    /// Delivered: done.
    Delivered,
    /// Failed: try again at this time.
    RetryAt(Timestamp),
    /// Failed for good: move to the dead-letter.
    DeadLetter,
    /// Not attempted: nothing could take it now (a `listen` destination with no listener
    /// connected). Due again at this time, the lease released; no attempt is recorded or
    /// counted, so a delivery may wait like this for as long as its destination is away
    /// without nearing its dead-letter. The result's status and error are ignored.
    Wait(Timestamp),
}

/// When a delivery held for a disabled destination is due: never, until the destination is
/// enabled ([`Store::enable_destination`] and [`Store::wake_held`] make it due). A worker
/// that leases such a delivery puts it back until then ([`AttemptNext::Wait`]`(HELD)`), once:
/// a held backlog costs nothing while it waits, however long it is. The last millisecond of
/// the year 9999, later than any retry schedule, so held rows sort last in every store's
/// ready index.
pub const HELD: Timestamp = Timestamp(253_402_300_799_999);

/// A delivery's state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeliveryState {
    /// Waiting for its next attempt.
    Pending,
    /// Delivered.
    Delivered,
    /// In the dead-letter.
    Dead,
}

impl DeliveryState {
    /// The stable lowercase name.
    pub fn as_str(self) -> &'static str {
        match self {
            DeliveryState::Pending => "pending",
            DeliveryState::Delivered => "delivered",
            DeliveryState::Dead => "dead",
        }
    }

    /// Parses [`DeliveryState::as_str`] back.
    pub fn parse(s: &str) -> Option<DeliveryState> {
        Some(match s {
            "pending" => DeliveryState::Pending,
            "delivered" => DeliveryState::Delivered,
            "dead" => DeliveryState::Dead,
            _ => return None,
        })
    }
}

/// A filter on history.
#[derive(Debug, Clone, Default)]
pub struct RequestFilter {
    /// Only this source.
    pub source: Option<String>,
    /// Only this verdict.
    pub verdict: Option<Verdict>,
    /// Only requests carrying this event key.
    pub key: Option<String>,
    /// Received at or after.
    pub since: Option<Timestamp>,
    /// Received before.
    pub until: Option<Timestamp>,
    /// Only ids below this (the previous page's cursor); newest first.
    pub before: Option<RequestId>,
    /// Page size.
    pub limit: u32,
}

/// One line of history.
#[derive(Debug, Clone)]
pub struct RequestSummary {
    /// Its id.
    pub id: RequestId,
    /// Arrival time.
    pub received_at: Timestamp,
    /// Source segment.
    pub source: String,
    /// Verdict.
    pub verdict: Verdict,
    /// Rejection code, when rejected.
    pub reason: Option<String>,
    /// Status answered.
    pub status: u16,
    /// The event key(s), when verified.
    pub keys: Vec<String>,
    /// Body length in bytes.
    pub body_len: u64,
    /// What an operator decided about a conflict, once decided (always `None` for other
    /// verdicts).
    pub decision: Option<ConflictDecision>,
}

/// What an operator did with a conflict: a body that differed from the first one under the
/// same key, held and never processed automatically.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ConflictAction {
    /// Released as a new event by a redelivery ([`redelivery_key`]); later releases queue
    /// again under the same key.
    Released,
    /// Dismissed: it will not be processed; a release is refused from then on.
    Dismissed,
}

impl ConflictAction {
    /// The stable lowercase name.
    pub fn as_str(self) -> &'static str {
        match self {
            ConflictAction::Released => "released",
            ConflictAction::Dismissed => "dismissed",
        }
    }

    /// Parses [`ConflictAction::as_str`] back.
    pub fn parse(s: &str) -> Option<ConflictAction> {
        match s {
            "released" => Some(ConflictAction::Released),
            "dismissed" => Some(ConflictAction::Dismissed),
            _ => None,
        }
    }
}

/// An operator's decision about a conflict: the first one stands.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConflictDecision {
    /// Released or dismissed.
    pub action: ConflictAction,
    /// When.
    pub at: Timestamp,
    /// Why, as the operator gave it (dismissals).
    pub reason: Option<String>,
}

impl ConflictDecision {
    /// A decision as a store keeps it: three nullable columns (action, time in ms, reason).
    /// `None` unless the action and the time are both there and the action is known.
    pub fn from_columns(
        action: Option<&str>,
        at: Option<i64>,
        reason: Option<String>,
    ) -> Option<ConflictDecision> {
        Some(ConflictDecision {
            action: ConflictAction::parse(action?)?,
            at: Timestamp(at?),
            reason,
        })
    }
}

/// What [`Store::dismiss_conflict`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Dismissal {
    /// Recorded: the conflict is dismissed.
    Dismissed(ConflictDecision),
    /// No such request.
    NotFound,
    /// The request is not a conflict.
    NotAConflict(Verdict),
    /// Decided before (released or dismissed); nothing changed.
    Decided(ConflictDecision),
}

/// One request with everything kept about it.
#[derive(Debug, Clone)]
pub struct RequestDetail {
    /// The summary fields.
    pub summary: RequestSummary,
    /// Method.
    pub method: String,
    /// Path and query.
    pub path: String,
    /// Peer address.
    pub peer: Option<String>,
    /// Headers, byte-exact.
    pub headers: Vec<Header>,
    /// Body, byte-exact.
    pub body: Bytes,
    /// True when the body was not read whole.
    pub body_truncated: bool,
    /// Deliveries queued by this request.
    pub deliveries: Vec<DeliveryDetail>,
}

/// One delivery with its attempts.
#[derive(Debug, Clone)]
pub struct DeliveryDetail {
    /// Its id.
    pub id: DeliveryId,
    /// The request it delivers.
    pub request_id: RequestId,
    /// Destination name.
    pub destination: String,
    /// `Idempotency-Key` sent.
    pub idempotency_key: String,
    /// State.
    pub state: DeliveryState,
    /// Attempts in the current round.
    pub attempts: u32,
    /// Next attempt time, when pending.
    pub next_attempt_at: Option<Timestamp>,
    /// The last error, if any.
    pub last_error: Option<String>,
    /// Every attempt, oldest first.
    pub history: Vec<AttemptRecord>,
}

/// One recorded attempt.
#[derive(Debug, Clone)]
pub struct AttemptRecord {
    /// Attempt number over the delivery's life (1-based).
    pub number: u32,
    /// Start time.
    pub started_at: Timestamp,
    /// Response status, if any.
    pub status: Option<u16>,
    /// Duration in milliseconds.
    pub latency_ms: u64,
    /// Error, if any.
    pub error: Option<String>,
}

/// A filter on deliveries.
#[derive(Debug, Clone, Default)]
pub struct DeliveryFilter {
    /// Only this state.
    pub state: Option<DeliveryState>,
    /// Only this destination.
    pub destination: Option<String>,
    /// Only ids below this; newest first.
    pub before: Option<DeliveryId>,
    /// Page size.
    pub limit: u32,
}

/// What a redrive of a dead-lettered delivery did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Redrive {
    /// Queued again, due now, with the same `Idempotency-Key`.
    Queued,
    /// No such delivery.
    NotFound,
    /// The delivery is not in the dead-letter (its state is given).
    NotDead(DeliveryState),
}

/// What a deliberate redelivery of a request did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Redelivery {
    /// New deliveries queued, due now, one per event and destination, each with its own id and
    /// the event's original `Idempotency-Key`.
    Queued(Vec<DeliveryId>),
    /// No such request.
    NotFound,
    /// The request carries no verified event (it was rejected, or was a handshake).
    NothingToRedeliver(Verdict),
    /// The request is a conflict an operator dismissed: it is not released.
    Dismissed(ConflictDecision),
}

/// Counts for metrics and readiness.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StoreStats {
    /// Deliveries waiting.
    pub pending: u64,
    /// Deliveries in the dead-letter.
    pub dead: u64,
    /// Claims held.
    pub claims: u64,
}

/// The outbox's counts alone, without the claims: see [`Store::outbox_counts`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct OutboxCounts {
    /// Deliveries waiting.
    pub pending: u64,
    /// Deliveries in the dead-letter.
    pub dead: u64,
}

/// A destination whose deliveries are held: it answered `410 Gone` (the Standard Webhooks
/// rule: the endpoint is gone, stop sending), or an operator disabled it. Its deliveries stay
/// pending and are not attempted until it is enabled again.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DisabledDestination {
    /// The destination's name.
    pub destination: String,
    /// When it was disabled.
    pub disabled_at: Timestamp,
    /// Why (safe to show: a status, or the operator's words).
    pub reason: String,
}

/// What a purge removed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Purged {
    /// Expired claims removed.
    pub claims: u64,
    /// History requests removed (with their finished deliveries and attempts).
    pub requests: u64,
}

/// A backend holding claims, the outbox, attempts and history.
#[async_trait::async_trait]
pub trait Store: Send + Sync + 'static {
    /// Records a verified request and claims each of its events; for each new event, queues
    /// one delivery per destination. One durable transaction; returns after the commit.
    /// A claim whose retention has passed is treated as absent (and replaced).
    async fn ingest(&self, ingest: Ingest) -> Result<IngestOutcome, StoreError>;

    /// Records a rejected request in history. Touches no claim and no outbox row.
    async fn record_rejection(&self, rejected: Rejected) -> Result<RequestId, StoreError>;

    /// Records a capture imported from an export file (verdict [`Verdict::Imported`]) with the
    /// event keys it carried, for replay and [`redeliver`](Self::redeliver). Touches no claim
    /// and no outbox row.
    async fn record_import(
        &self,
        request: RequestRecord,
        keys: Vec<String>,
    ) -> Result<RequestId, StoreError>;

    /// Records a verified handshake (verdict [`Verdict::Handshake`]) answered with `status`.
    /// Touches no claim and no outbox row.
    async fn record_handshake(
        &self,
        request: RequestRecord,
        status: u16,
    ) -> Result<RequestId, StoreError>;

    /// Leases up to `limit` pending deliveries due at `now` for `lease`, to `owner`.
    async fn lease_due(
        &self,
        owner: &str,
        now: Timestamp,
        lease: Duration,
        limit: u32,
    ) -> Result<Vec<LeasedDelivery>, StoreError>;

    /// Records an attempt and moves the delivery on (done, retry later, or dead-letter),
    /// releasing its lease — unless the delivery is leased by another worker or no longer
    /// pending, in which case only the attempt is recorded.
    async fn record_attempt(&self, result: AttemptResult) -> Result<(), StoreError>;

    /// Records an attempt as [`Store::record_attempt`] does, then leases the next due delivery
    /// (if any) to the attempt's owner for `lease`: a busy worker goes on to its next delivery
    /// without a separate round trip. Backends whose writes queue (SQLite's writer) do both in
    /// one write; the default makes the two calls.
    async fn record_attempt_and_lease(
        &self,
        result: AttemptResult,
        now: Timestamp,
        lease: Duration,
    ) -> Result<Option<LeasedDelivery>, StoreError> {
        let owner = result.owner.clone();
        self.record_attempt(result).await?;
        Ok(self.lease_due(&owner, now, lease, 1).await?.pop())
    }

    /// Gives back every lease `owner` holds that is still running at `now` (graceful
    /// shutdown), making the rows due again. A lease that has ended needs no release: its row
    /// is due already.
    async fn release_leases(&self, owner: &str, now: Timestamp) -> Result<(), StoreError>;

    /// Makes `destination`'s pending deliveries that nobody holds a running lease on due at
    /// `now`, where they were due later: a `listen` client connecting gets what waited for it
    /// ([`AttemptNext::Wait`]) and what was waiting out a retry's backoff at once. Touches no
    /// attempt count. Returns how many rows it moved.
    async fn wake_destination(&self, destination: &str, now: Timestamp) -> Result<u64, StoreError>;

    /// Disables `destination` (see [`DisabledDestination`]): durable, for every instance on
    /// the store. Returns `false`, changing nothing, when it is disabled already (the first
    /// reason is kept). Moves no delivery: workers put a disabled destination's deliveries back
    /// as they lease them ([`AttemptNext::Wait`]).
    async fn disable_destination(&self, disabled: DisabledDestination) -> Result<bool, StoreError>;

    /// Enables `destination` again and, in the same write, makes its waiting deliveries due at
    /// `now` as [`Store::wake_destination`] does. Returns the rows woken, or `None`, changing
    /// nothing, when it was not disabled.
    async fn enable_destination(
        &self,
        destination: &str,
        now: Timestamp,
    ) -> Result<Option<u64>, StoreError>;

    /// Every disabled destination, by name.
    async fn disabled_destinations(&self) -> Result<Vec<DisabledDestination>, StoreError>;

    /// Makes due at `now` every delivery held for a disabled destination ([`HELD`]) whose
    /// destination the store has enabled since, and that nobody holds a running lease on:
    /// what a worker put back just before an enable and did not wake itself (it stopped
    /// first, or heard of the enable late). Reads only held rows; touches no attempt count.
    /// Returns how many rows it moved.
    async fn wake_held(&self, now: Timestamp) -> Result<u64, StoreError>;

    /// The earliest time a pending, unleased delivery becomes due, if any.
    async fn next_due(&self) -> Result<Option<Timestamp>, StoreError>;

    /// Lists history, newest first.
    async fn list_requests(&self, filter: RequestFilter)
        -> Result<Vec<RequestSummary>, StoreError>;

    /// One request with its deliveries and attempts.
    async fn get_request(&self, id: RequestId) -> Result<Option<RequestDetail>, StoreError>;

    /// Lists deliveries, newest first.
    async fn list_deliveries(
        &self,
        filter: DeliveryFilter,
    ) -> Result<Vec<DeliveryDetail>, StoreError>;

    /// Moves a dead-lettered delivery back to pending, due at `now`, with a fresh attempt budget.
    async fn redrive(&self, id: DeliveryId, now: Timestamp) -> Result<Redrive, StoreError>;

    /// Queues a deliberate redelivery of a request's events to `destinations`, bypassing the
    /// claim on purpose: new deliveries, due at `now`, with the request's body and the events'
    /// original `Idempotency-Key`s, so the application's guard still decides — except for a
    /// conflict, which is released under a key of its own ([`redelivery_key`]), its decision
    /// recorded as [`ConflictAction::Released`] in the same write the first time, and refused
    /// once dismissed. Every call queues anew; nothing is swallowed.
    async fn redeliver(
        &self,
        request: RequestId,
        destinations: Vec<String>,
        now: Timestamp,
    ) -> Result<Redelivery, StoreError> {
        let _ = (request, destinations, now);
        Err(StoreError::Unavailable(
            "this store does not support redelivery".to_owned(),
        ))
    }

    /// Dismisses a conflict: records that an operator decided it will not be processed, with
    /// an optional reason. Only a conflict not decided before changes (the first decision
    /// stands); a dismissed conflict's redelivery is refused ([`Redelivery::Dismissed`]).
    async fn dismiss_conflict(
        &self,
        request: RequestId,
        reason: Option<String>,
        now: Timestamp,
    ) -> Result<Dismissal, StoreError>;

    /// How many conflicts no operator has released or dismissed yet.
    async fn undecided_conflicts(&self) -> Result<u64, StoreError>;

    /// Removes claims whose retention ended before `now`, and history received before
    /// `history_before` whose deliveries are all delivered: a pending delivery, or one in the
    /// dead-letter (it stays there until an operator retries it), keeps its request. Works in
    /// bounded batches.
    async fn purge(&self, now: Timestamp, history_before: Timestamp) -> Result<Purged, StoreError>;

    /// Counts for metrics. Counting the claims reads every claim held, work that grows with
    /// the store (seconds on ten million claims with a cold cache): read it rarely.
    async fn stats(&self) -> Result<StoreStats, StoreError>;

    /// The pending and dead-letter counts of [`Store::stats`] without counting the claims:
    /// ranges of the outbox's indexes, cheap enough to read every few seconds.
    async fn outbox_counts(&self) -> Result<OutboxCounts, StoreError> {
        let stats = self.stats().await?;
        Ok(OutboxCounts {
            pending: stats.pending,
            dead: stats.dead,
        })
    }

    /// Whether the store answers and accepts writes (for readiness).
    async fn ping(&self) -> Result<(), StoreError>;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_event_type_is_kept_without_nul() {
        assert!(matches!(storable_text("invoice.paid"), Cow::Borrowed(_)));
        assert_eq!(storable_text("a\0b\0"), "a\u{fffd}b\u{fffd}");
        let key = EventKey::parse("evt_1").unwrap();
        let event = NewEvent::new(key.clone(), Some("invoice.\0paid".to_owned()));
        assert_eq!(event.event_type.as_deref(), Some("invoice.\u{fffd}paid"));
        assert_eq!(NewEvent::new(key, None).event_type, None);
    }

    #[test]
    fn the_full_flag_changes_on_full_and_on_success_and_says_so_once() {
        let flag = FullFlag::default();
        let full: Result<(), StoreError> = Err(StoreError::Full);
        let down: Result<(), StoreError> = Err(StoreError::Unavailable("down".to_owned()));
        assert!(!flag.is_set());
        assert_eq!(flag.note(&Ok::<(), StoreError>(())), None);
        assert_eq!(flag.note(&full), Some(true));
        assert!(flag.is_set());
        assert_eq!(flag.note(&full), None, "already full");
        assert_eq!(flag.note(&down), None, "another error says nothing of room");
        assert!(flag.is_set());
        assert_eq!(flag.note(&Ok::<u8, StoreError>(1)), Some(false));
        assert!(!flag.is_set());
        assert_eq!(flag.note(&down), None);
        assert!(!flag.is_set());
    }

    #[test]
    fn a_small_write_sets_the_full_flag_but_never_clears_it() {
        let flag = FullFlag::default();
        let ok: Result<(), StoreError> = Ok(());
        assert_eq!(flag.note_small(&ok), None);
        assert_eq!(flag.note_small(&Err::<(), _>(StoreError::Full)), Some(true));
        assert_eq!(
            flag.note_small(&ok),
            None,
            "a small record fits where an event may not"
        );
        assert!(flag.is_set());
        assert_eq!(
            flag.note(&ok),
            Some(false),
            "an event kept says there is room"
        );
    }
}
