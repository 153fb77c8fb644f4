//! Builders for what the conformance cases feed a store: requests, ingests, rejections and
//! attempt results, all at explicit times counted from [`T0`].
//!
//! Every request carries a header value that is not UTF-8, so any case that reads headers
//! back checks that they are kept byte-exact.

use std::time::Duration;

use bytes::Bytes;
use hooklatch_core::store::{
    AttemptNext, AttemptResult, AttemptToken, DeliveryDetail, DeliveryFilter, Header, Ingest,
    IngestOutcome, NewEvent, Rejected, RequestFilter, RequestRecord, RequestSummary,
};
use hooklatch_core::{Claim, DeliveryId, EventKey, KeyDecision, SourceName, Store, Timestamp};
use sha2::{Digest, Sha256};

/// The time every case counts from (2023-11-14T22:13:20Z).
pub const T0: Timestamp = Timestamp(1_700_000_000_000);

/// The destinations every [`ingest`] queues for: one delivery each per new event.
pub const DESTINATIONS: [&str; 2] = ["app", "audit"];

/// The claim retention [`ingest`] asks for, unless a case sets its own.
pub const RETENTION: Duration = Duration::from_secs(7 * 24 * 3600);

/// The event type [`ingest`] gives every event.
pub const EVENT_TYPE: &str = "invoice.paid";

/// Enough rows to see everything a case wrote.
pub const ALL: u32 = 10_000;

/// `T0` plus `secs` seconds (minus, when negative).
pub fn at(secs: i64) -> Timestamp {
    Timestamp(T0.as_millis() + secs * 1000)
}

/// The SHA-256 of a body, as the gateway computes it before ingest.
pub fn sha256(body: &[u8]) -> [u8; 32] {
    Sha256::digest(body).into()
}

/// The headers every test request carries, in order; `x-raw` is not UTF-8.
pub fn headers() -> Vec<Header> {
    vec![
        ("content-type".to_owned(), b"application/json".to_vec()),
        ("x-raw".to_owned(), vec![0xff, 0x00, 0xfe, b'z', 0x80]),
        ("x-empty".to_owned(), Vec::new()),
    ]
}

/// A `POST /in/{source}` request received at `received_at`.
pub fn request(source: &str, body: &[u8], received_at: Timestamp) -> RequestRecord {
    RequestRecord {
        received_at,
        source: source.to_owned(),
        method: "POST".to_owned(),
        path: format!("/in/{source}?attempt=1"),
        peer: Some("192.0.2.7:54321".to_owned()),
        headers: headers(),
        body: Bytes::copy_from_slice(body),
        body_truncated: false,
    }
}

/// A verified request on `source` carrying one event per key, received (and so claimed) at
/// `received_at`, queued for [`DESTINATIONS`] and retained for [`RETENTION`].
pub fn ingest(source: &str, keys: &[&str], body: &[u8], received_at: Timestamp) -> Ingest {
    Ingest {
        source: SourceName::parse(source).expect("test sources are valid names"),
        request: request(source, body, received_at),
        body_sha256: sha256(body),
        events: keys
            .iter()
            .map(|key| NewEvent {
                key: EventKey::parse(key).expect("test keys are valid"),
                event_type: Some(EVENT_TYPE.to_owned()),
                content_sha256: None,
            })
            .collect(),
        destinations: DESTINATIONS.iter().map(|d| (*d).to_owned()).collect(),
        retention: RETENTION,
        keys: KeyDecision::Store,
        lease: None,
    }
}

/// A request refused with `code` and answered with `status`.
pub fn rejection(
    source: &str,
    body: &[u8],
    received_at: Timestamp,
    code: &str,
    status: u16,
) -> Rejected {
    Rejected {
        request: request(source, body, received_at),
        code: code.to_owned(),
        status,
    }
}

/// The worker name [`attempt`] records attempts as.
pub const WORKER: &str = "worker-a";

/// An attempt by [`WORKER`] on `delivery` that started at `started_at` and took 25 ms.
pub fn attempt(
    delivery: DeliveryId,
    started_at: Timestamp,
    status: Option<u16>,
    error: Option<&str>,
    next: AttemptNext,
) -> AttemptResult {
    AttemptResult {
        delivery,
        owner: WORKER.to_owned(),
        started_at,
        latency: Duration::from_millis(25),
        status,
        error: error.map(str::to_owned),
        next,
        lease_until: None,
        token: AttemptToken::random(),
    }
}

/// The `Idempotency-Key` a delivery of `key` on `source` carries.
pub fn idempotency_key(source: &str, key: &str) -> String {
    format!("{source}:{key}")
}

/// The deliveries a [`Claim::New`] queued, across every event of the outcome.
pub fn new_deliveries(outcome: &IngestOutcome) -> Vec<DeliveryId> {
    outcome
        .claims
        .iter()
        .flat_map(|(_, claim)| match claim {
            Claim::New { deliveries } => deliveries.clone(),
            _ => Vec::new(),
        })
        .collect()
}

/// Ingests, panicking if the store could not answer.
pub async fn ingest_ok<S: Store>(store: &S, ingest: Ingest) -> IngestOutcome {
    store.ingest(ingest).await.expect("ingest")
}

/// Every delivery, newest first.
pub async fn all_deliveries<S: Store>(store: &S) -> Vec<DeliveryDetail> {
    store
        .list_deliveries(DeliveryFilter {
            limit: ALL,
            ..DeliveryFilter::default()
        })
        .await
        .expect("list_deliveries")
}

/// The deliveries carrying one `Idempotency-Key`, newest first.
pub async fn deliveries_with_key<S: Store>(
    store: &S,
    idempotency_key: &str,
) -> Vec<DeliveryDetail> {
    let mut res = all_deliveries(store).await;
    res.retain(|d| d.idempotency_key == idempotency_key);
    res
}

/// One delivery by id, panicking when it is missing.
pub async fn delivery<S: Store>(store: &S, id: DeliveryId) -> DeliveryDetail {
    all_deliveries(store)
        .await
        .into_iter()
        .find(|d| d.id == id)
        .unwrap_or_else(|| panic!("{id} is missing from list_deliveries"))
}

/// Every request in history, newest first.
pub async fn all_requests<S: Store>(store: &S) -> Vec<RequestSummary> {
    store
        .list_requests(RequestFilter {
            limit: ALL,
            ..RequestFilter::default()
        })
        .await
        .expect("list_requests")
}

/// Every request in history that carried `key`, newest first.
pub async fn requests_with_key<S: Store>(store: &S, key: &str) -> Vec<RequestSummary> {
    store
        .list_requests(RequestFilter {
            key: Some(key.to_owned()),
            limit: ALL,
            ..RequestFilter::default()
        })
        .await
        .expect("list_requests")
}
