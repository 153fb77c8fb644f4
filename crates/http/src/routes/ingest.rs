//! `POST /in/{source}`: the product's front door.
//!
//! Order matters and is the promise: size limit, then signature, then key extraction, and only
//! then the store. A request refused at any step is recorded in history with its reason and
//! touches no claim and no outbox row. The claim and its deliveries are one store call that
//! runs off this task, so a provider hanging up (which drops this future) leaves both or
//! neither.

use std::collections::{BTreeMap, HashSet};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::extract::{ConnectInfo, Request, State};
use axum::http::request::Parts;
use axum::http::{HeaderName, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Json, Router};
use bytes::Bytes;
use hooklatch_core::crash;
use hooklatch_core::keys::{DoneKey, KeyClaim, KeyState};
use hooklatch_core::secret::sha256;
use hooklatch_core::store::{
    Claim, Ingest, IngestOutcome, KeyDecision, NewEvent, Rejected, RequestRecord, Verdict,
};
use hooklatch_core::{
    EventKey, InboundRequest, KeyStoreError, ProviderReply, Store, StoreError, Timestamp,
};
use http_body_util::{BodyExt, LengthLimitError, Limited};

use crate::extract::PathText;
use crate::{ApiError, ExternalKeys, IngestState, Source};

pub(crate) fn router(state: Arc<IngestState>) -> Router {
    // With a trailing slash too: a provider's dashboard takes the URL as typed, and a 404 for
    // `/in/stripe/` would leave its retries nowhere in history.
    let source = || post(ingest).get(check).fallback(other_method);
    Router::new()
        .route("/in/{source}", source())
        .route("/in/{source}/", source())
        .fallback(no_route)
        .with_state(state)
}

/// Any other path on the ingest listener: 404 with a JSON body, not recorded in history.
/// Webhooks arrive at `/in/{source}`; what else reaches a public port is mostly scanners,
/// and a request there names no source to file it under.
async fn no_route() -> ApiError {
    ApiError::not_found(format!(
        "{}: webhooks are received at POST /in/{{source}}",
        crate::NO_ROUTE
    ))
}

/// `/in/{source}` with a method other than POST and GET: refused with 405 (and `Allow`), and
/// recorded in history like every refusal, with its body as far as the limit.
async fn other_method(
    State(state): State<Arc<IngestState>>,
    PathText(source_name): PathText,
    req: Request,
) -> Response {
    let (parts, body) = req.into_parts();
    let mut record = request_record(&parts, &source_name);
    let metric_source = state
        .sources
        .get(&source_name)
        .map_or("unknown", |s| s.name.as_str())
        .to_owned();
    match read_body(body, &state).await {
        Ok(bytes) => record.body = bytes,
        Err(_) => record.body_truncated = true,
    }
    let err = ApiError::new(
        StatusCode::METHOD_NOT_ALLOWED,
        "method_not_allowed",
        format!(
            "{} is not accepted here: providers deliver webhooks with POST (a few with GET)",
            parts.method
        ),
    );
    let takes_get = state
        .sources
        .get(&source_name)
        .is_some_and(|s| takes_get(s.adapter.as_ref()));
    let mut res = reject(&state, record, &metric_source, err).await;
    res.headers_mut().insert(
        axum::http::header::ALLOW,
        HeaderValue::from_static(if takes_get { "GET, POST" } else { "POST" }),
    );
    res
}

/// Whether a source answers `GET` at all: events sent as GETs (Twilio's voice webhooks) or a
/// subscription check (Meta's). Asking costs nothing: `handle_get` touches no store.
fn takes_get(adapter: &dyn hooklatch_core::ProviderAdapter) -> bool {
    adapter.get_carries_events() || adapter.handle_get("").is_some()
}

async fn ingest(
    State(state): State<Arc<IngestState>>,
    PathText(source_name): PathText,
    req: Request,
) -> Response {
    let started = Instant::now();
    let read = match Read::body(&state, &source_name, req).await {
        Ok(read) => read,
        Err(refused) => return refused,
    };
    process(
        &state,
        read.source,
        &source_name,
        &read.parts,
        read.record,
        started,
    )
    .await
}

/// A request to `/in/{source}` with its body read: its head, its history record (the body in
/// it), and its source, if one of that name is configured.
struct Read<'a> {
    parts: Parts,
    record: RequestRecord,
    source: Option<&'a Source>,
    /// The `source` label of its metrics: the source's name, or `unknown`.
    metric_source: String,
}

impl<'a> Read<'a> {
    /// Reads `req`'s body as far as the limit; a body declared over it is refused before a
    /// byte of it is read (413), and one that goes over it, stalls past the body timeout or
    /// breaks off is refused with its own error, recorded as cut short.
    async fn body(
        state: &'a IngestState,
        source_name: &str,
        req: Request,
    ) -> Result<Read<'a>, Response> {
        let (parts, body) = req.into_parts();
        let mut record = request_record(&parts, source_name);
        let source = state.sources.get(source_name);
        let metric_source = source.map_or("unknown", |s| s.name.as_str()).to_owned();
        if let Err(err) = read_into(&mut record, &parts, body, state).await {
            return Err(reject(state, record, &metric_source, err).await);
        }
        Ok(Read {
            parts,
            record,
            source,
            metric_source,
        })
    }
}

/// [`Read::body`]'s reading, into `record`.
async fn read_into(
    record: &mut RequestRecord,
    parts: &Parts,
    body: Body,
    state: &IngestState,
) -> Result<(), ApiError> {
    let declared = parts
        .headers
        .get(axum::http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > state.body_limit as u64) {
        record.body_truncated = true;
        return Err(too_large(state.body_limit));
    }
    match read_body(body, state).await {
        Ok(bytes) => {
            record.body = bytes;
            Ok(())
        }
        Err(err) => {
            record.body_truncated = true;
            Err(err)
        }
    }
}

/// Verifies, extracts and accepts (or rejects) a request whose body is read: a POST, or a GET
/// of a provider that sends events that way.
async fn process(
    state: &IngestState,
    source: Option<&Source>,
    source_name: &str,
    parts: &Parts,
    record: RequestRecord,
    started: Instant,
) -> Response {
    let metric_source = source.map_or("unknown", |s| s.name.as_str()).to_owned();
    let Some(source) = source else {
        let err = ApiError::new(
            StatusCode::NOT_FOUND,
            "unknown_source",
            format!("no source named {source_name:?} is configured"),
        );
        return reject(state, record, &metric_source, err).await;
    };

    let inbound = InboundRequest {
        path_and_query: &record.path,
        headers: &parts.headers,
        body: &record.body,
        now: record.received_at,
    };
    if let Some(reply) = source.adapter.unsigned_probe(&inbound) {
        return handshake(state, record, &metric_source, reply).await;
    }
    if let Err(rejection) = source
        .adapter
        .verify(&inbound, &source.secrets, source.tolerance)
    {
        return reject(state, record, &metric_source, rejection_error(&rejection)).await;
    }
    if let Some(reply) = source.adapter.handshake(&inbound) {
        return handshake(state, record, &metric_source, reply).await;
    }
    let ack = source.adapter.ack_reply(&inbound);
    let checked = source.adapter.extract(&inbound);
    let events = match checked {
        Ok(events) if !events.is_empty() => events,
        Ok(_) => {
            let err = ApiError::new(
                StatusCode::BAD_REQUEST,
                "missing_event_key",
                "the delivery carries no event",
            );
            return reject(state, record, &metric_source, err).await;
        }
        Err(rejection) => {
            return reject(state, record, &metric_source, rejection_error(&rejection)).await;
        }
    };

    accept(state, source, record, events, started, ack).await
}

/// `GET /in/{source}`: a provider's subscription check (Meta's `hub.challenge`), answered or
/// refused, kept in history and claiming nothing; or, for a provider that sends events as a
/// GET (Twilio voice), an event like a POST with an empty body. Other providers get 405.
/// Providers send a GET without a body; one that carries a body anyway is read and kept
/// like a POST's, so that history holds the request as it came (found by the `wire` fuzz
/// target: the body was dropped unread and the record said it was empty).
async fn check(
    State(state): State<Arc<IngestState>>,
    PathText(source_name): PathText,
    req: Request,
) -> Response {
    let started = Instant::now();
    let Read {
        parts,
        record,
        source,
        metric_source,
    } = match Read::body(&state, &source_name, req).await {
        Ok(read) => read,
        Err(refused) => return refused,
    };
    let Some(source) = source else {
        let err = ApiError::new(
            StatusCode::NOT_FOUND,
            "unknown_source",
            format!("no source named {source_name:?} is configured"),
        );
        return reject(&state, record, &metric_source, err).await;
    };
    match source
        .adapter
        .handle_get(parts.uri.query().unwrap_or_default())
    {
        None if source.adapter.get_carries_events() => {
            process(&state, Some(source), &source_name, &parts, record, started).await
        }
        None => {
            let err = ApiError::new(
                StatusCode::METHOD_NOT_ALLOWED,
                "method_not_allowed",
                format!("{} sources take POST only", source.adapter.provider()),
            );
            let mut res = reject(&state, record, &metric_source, err).await;
            res.headers_mut()
                .insert(axum::http::header::ALLOW, HeaderValue::from_static("POST"));
            res
        }
        Some(Err(rejection)) => {
            reject(&state, record, &metric_source, rejection_error(&rejection)).await
        }
        Some(Ok(reply)) => handshake(&state, record, &metric_source, reply).await,
    }
}

/// `path_and_query` with the value of every `hub.verify_token` parameter replaced by `***`:
/// Meta's subscription check sends the source's configured `verify_token` in the query, and
/// history, exports and the admin API keep no secret. Anything else stays byte-exact.
fn without_verify_token(path_and_query: &str) -> String {
    let Some((path, query)) = path_and_query.split_once('?') else {
        return path_and_query.to_owned();
    };
    let query: Vec<String> = query
        .split('&')
        .map(|pair| match pair.split_once('=') {
            Some((name, _)) if is_verify_token(name) => format!("{name}=***"),
            _ => pair.to_owned(),
        })
        .collect();
    format!("{path}?{}", query.join("&"))
}

/// `hub.verify_token`, as written or with its dot percent-encoded (`hub%2Everify_token`).
fn is_verify_token(name: &str) -> bool {
    name.eq_ignore_ascii_case("hub.verify_token") || name.eq_ignore_ascii_case("hub%2Everify_token")
}

/// The history record of a request as received (the body is filled in once read).
fn request_record(parts: &Parts, source_name: &str) -> RequestRecord {
    RequestRecord {
        received_at: Timestamp::now(),
        source: source_name.to_owned(),
        method: parts.method.to_string(),
        path: parts
            .uri
            .path_and_query()
            .map(|p| without_verify_token(p.as_str()))
            .unwrap_or_default(),
        peer: parts
            .extensions
            .get::<ConnectInfo<SocketAddr>>()
            .map(|c| c.0.to_string()),
        headers: parts
            .headers
            .iter()
            .map(|(n, v)| (n.as_str().to_owned(), v.as_bytes().to_vec()))
            .collect(),
        body: Bytes::new(),
        body_truncated: false,
    }
}

fn rejection_error(rejection: &hooklatch_core::Rejection) -> ApiError {
    let status = StatusCode::from_u16(rejection.status()).unwrap_or(StatusCode::BAD_REQUEST);
    ApiError::new(status, rejection.code(), rejection.message())
}

/// Records a verified handshake and answers it in the provider's format.
async fn handshake(
    state: &IngestState,
    request: RequestRecord,
    metric_source: &str,
    reply: ProviderReply,
) -> Response {
    metrics::counter!("hooklatch_requests_total",
        "source" => metric_source.to_owned(), "verdict" => "handshake")
    .increment(1);
    if let Err(err) = state.store.record_handshake(request, reply.status).await {
        tracing::warn!(%err, "could not record a handshake");
    }
    provider_response(reply)
}

/// [`crate::VERDICT_HEADER`] and [`crate::REQUEST_ID_HEADER`], as header names.
const VERDICT_HEADER: HeaderName = HeaderName::from_static(crate::VERDICT_HEADER);
const REQUEST_ID_HEADER: HeaderName = HeaderName::from_static(crate::REQUEST_ID_HEADER);

fn provider_response(reply: ProviderReply) -> Response {
    let status = StatusCode::from_u16(reply.status).unwrap_or(StatusCode::OK);
    (
        status,
        [(axum::http::header::CONTENT_TYPE, reply.content_type)],
        reply.body,
    )
        .into_response()
}

async fn accept(
    state: &IngestState,
    source: &Source,
    record: RequestRecord,
    events: Vec<hooklatch_core::ExtractedEvent>,
    started: Instant,
    ack: Option<ProviderReply>,
) -> Response {
    let mut ingest = Ingest {
        source: source.name.clone(),
        body_sha256: sha256(&record.body),
        request: record,
        events: events
            .into_iter()
            .map(|e| NewEvent::new(e.key, e.event_type).with_content(e.fingerprint))
            .collect(),
        destinations: source.destinations.clone(),
        retention: source.retention,
        keys: KeyDecision::Store,
        lease: None,
    };
    // While the local worker is caught up, the new deliveries are written leased to it and
    // handed over in memory (see `crate::handoff`).
    let reservation = state
        .handoff
        .as_ref()
        .and_then(|handoff| handoff.reserve(ingest.most_deliveries(), ingest.request.received_at));
    ingest.lease = reservation.as_ref().map(|r| r.lease.clone());
    let handed_off = reservation.is_some();
    // Test builds only: a failure injected here is answered as the store being away.
    let injected = injected_at(crash::INGEST_BEFORE_COMMIT)
        .await
        .map_err(|injected| Refused::Store(StoreError::Unavailable(injected)));
    let result = match (injected, &state.keys, reservation) {
        (Err(refused), _, _) => Err(refused),
        (Ok(()), None, None) => state.store.ingest(ingest).await.map_err(Refused::Store),
        // Claim, queue, mark done and hand off run in a task of their own: a provider hanging
        // up must not stop them between the store's commit and marking the keys done, nor
        // strand a delivery written leased to the worker until its lease runs out.
        (Ok(()), keys, reservation) => {
            let (store, keys) = (state.store.clone(), keys.clone());
            tokio::spawn(async move {
                let handed = reservation.map(|r| (r, ingest.clone()));
                let result = match keys {
                    None => store.ingest(ingest).await.map_err(Refused::Store),
                    Some(keys) => ingest_with_keys(store, keys, ingest).await,
                };
                if let (Some((reservation, ingest)), Ok(outcome)) = (handed, &result) {
                    reservation.fulfil(&ingest, outcome);
                }
                result
            })
            .await
            .unwrap_or_else(|err| {
                Err(Refused::Store(StoreError::Unavailable(format!(
                    "ingest task failed: {err}"
                ))))
            })
        }
    };
    let result = match result {
        Ok(outcome) => injected_at(crash::INGEST_AFTER_COMMIT_BEFORE_ANSWER)
            .await
            .map(|()| outcome)
            .map_err(|injected| Refused::Store(StoreError::Unavailable(injected))),
        Err(refused) => Err(refused),
    };
    let outcome = match result {
        Ok(outcome) => outcome,
        Err(Refused::Store(err)) => {
            let err = ApiError::from(err);
            metrics::counter!("hooklatch_requests_total",
                "source" => source.name.to_string(), "verdict" => "error", "reason" => err.code)
            .increment(1);
            return err.into_response();
        }
        Err(Refused::InFlight(lease_left, record)) => {
            // A claim is usually finished within milliseconds: ask for a retry in a second.
            // Should its holder have died, the claim lapses when its lease runs out.
            let lapses = lease_left.as_secs_f64().ceil().max(1.0) as u64;
            let err = ApiError::new(
                StatusCode::CONFLICT,
                crate::IN_FLIGHT,
                format!(
                    "another copy of this event is being queued right now; retry shortly \
                     (an abandoned claim lapses within {lapses} s)"
                ),
            );
            let mut res = reject(state, *record, source.name.as_str(), err).await;
            res.headers_mut().insert(
                axum::http::header::RETRY_AFTER,
                axum::http::HeaderValue::from_static("1"),
            );
            return res;
        }
        Err(Refused::KeyStore(err, record)) => {
            tracing::error!(%err, "key store failed");
            let err = ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                crate::KEY_STORE_UNAVAILABLE,
                "the key store is unavailable; retry later",
            );
            return reject(state, *record, source.name.as_str(), err).await;
        }
    };
    let verdict = outcome.verdict();
    // A hand-off woke the worker itself.
    if verdict == Verdict::Accepted && !handed_off {
        state.enqueued.notify_one();
    }
    let n_conflicts = outcome
        .claims
        .iter()
        .filter(|(_, c)| matches!(c, Claim::Conflict { .. }))
        .count();
    if n_conflicts > 0 {
        metrics::counter!("hooklatch_conflicts_total", "source" => source.name.to_string())
            .increment(n_conflicts as u64);
    }
    metrics::counter!("hooklatch_requests_total",
        "source" => source.name.to_string(), "verdict" => verdict.as_str())
    .increment(1);
    metrics::histogram!("hooklatch_ack_seconds", "verdict" => verdict.as_str())
        .record(started.elapsed().as_secs_f64());
    tracing::debug!(source = %source.name, request = %outcome.request_id, verdict = verdict.as_str(), "ingested");
    if let Some(reply) = ack {
        // The provider needs its own format (TwiML, a Discord interaction response), the same
        // for new events, duplicates and conflicts; the verdict and request id ride in headers
        // (for replay and for people reading a capture), which providers ignore.
        let mut res = provider_response(reply);
        let headers = res.headers_mut();
        headers.insert(VERDICT_HEADER, HeaderValue::from_static(verdict.as_str()));
        if let Ok(id) = HeaderValue::from_str(&outcome.request_id.to_string()) {
            headers.insert(REQUEST_ID_HEADER, id);
        }
        return res;
    }

    let answer = Answer {
        events: outcome
            .claims
            .iter()
            .map(|(key, claim)| match claim {
                Claim::New { deliveries } => EventAnswer::New {
                    deliveries: deliveries.iter().map(|d| d.to_string()).collect(),
                    key: key.as_str(),
                },
                Claim::Duplicate {
                    first_request,
                    first_seen,
                } => EventAnswer::Duplicate {
                    first_request: first_request.to_string(),
                    first_seen_ms: first_seen.as_millis(),
                    key: key.as_str(),
                },
                Claim::Conflict { first_request, .. } => EventAnswer::Conflict {
                    first_request: first_request.to_string(),
                    key: key.as_str(),
                },
            })
            .collect(),
        request_id: outcome.request_id.to_string(),
        status: verdict.as_str(),
    };
    (StatusCode::OK, Json(answer)).into_response()
}

/// The JSON answer to an ingest, written straight from these types rather than through a
/// `serde_json::Value` tree. Fields in alphabetical order, the order the answer has always
/// had.
#[derive(serde::Serialize)]
struct Answer<'a> {
    events: Vec<EventAnswer<'a>>,
    request_id: String,
    status: &'static str,
}

/// One event of an [`Answer`]: its `claim` first, then its fields.
#[derive(serde::Serialize)]
#[serde(tag = "claim", rename_all = "lowercase")]
enum EventAnswer<'a> {
    New {
        deliveries: Vec<String>,
        key: &'a str,
    },
    Duplicate {
        first_request: String,
        first_seen_ms: i64,
        key: &'a str,
    },
    Conflict {
        first_request: String,
        key: &'a str,
    },
}

/// Why a verified request was not queued.
enum Refused {
    /// The store failed (503).
    Store(StoreError),
    /// Another copy holds a key in flight (409 with `Retry-After`); the request goes to history.
    InFlight(Duration, Box<RequestRecord>),
    /// The external key store failed (503); the request goes to history.
    KeyStore(KeyStoreError, Box<RequestRecord>),
}

/// A fallible crash point (test builds only, [`crash::fallible`]): `Err` when it injects a
/// failure, after the pause it injects if any, waited out at an await, where a provider
/// hanging up drops the request as it would anywhere else.
async fn injected_at(point: &'static str) -> Result<(), String> {
    if let Some(pause) = crash::fallible(point)? {
        tokio::time::sleep(pause).await;
    }
    Ok(())
}

/// Redis mode: claims the keys in the key store, writes the request and the new events'
/// deliveries to the store as the key store decided, then marks the claimed keys done for the
/// source's retention (or gives them back if the store failed).
async fn ingest_with_keys(
    store: Arc<dyn Store>,
    keys: ExternalKeys,
    mut ingest: Ingest,
) -> Result<IngestOutcome, Refused> {
    // One claim per key, even if a request names an event twice.
    let mut seen = HashSet::new();
    ingest.events.retain(|e| seen.insert(e.key.clone()));
    let event_keys: Vec<EventKey> = ingest.events.iter().map(|e| e.key.clone()).collect();
    let (token, states) = match keys
        .store
        .claim(&ingest.source, &event_keys, keys.lease)
        .await
    {
        Ok(KeyClaim::Decided { token, keys }) => (token, keys),
        Ok(KeyClaim::InFlight { retry_after }) => {
            return Err(Refused::InFlight(retry_after, Box::new(ingest.request)))
        }
        Err(err) => return Err(Refused::KeyStore(err, Box::new(ingest.request))),
    };
    // Each key's content hash: its event's own, or the body's.
    let hashes: Vec<[u8; 32]> = ingest
        .events
        .iter()
        .map(|e| ingest.content_sha256(e))
        .collect();
    let mut claimed = Vec::new();
    let mut claimed_hashes: BTreeMap<[u8; 32], Vec<EventKey>> = BTreeMap::new();
    let mut decided = Vec::with_capacity(states.len());
    for ((key, state), hash) in event_keys.into_iter().zip(states).zip(hashes) {
        decided.push(match state {
            KeyState::Claimed => {
                claimed_hashes.entry(hash).or_default().push(key.clone());
                claimed.push(key);
                Claim::New {
                    deliveries: Vec::new(),
                }
            }
            KeyState::Done(done) if done.body_sha256 == hash => Claim::Duplicate {
                first_request: done.first_request,
                first_seen: done.first_seen,
            },
            KeyState::Done(done) => Claim::Conflict {
                first_request: done.first_request,
                first_body_sha256: done.body_sha256,
            },
        });
    }
    ingest.keys = KeyDecision::Decided(decided);
    if let Some(pause) = crash::paused(crash::KEYS_AFTER_CLAIM_BEFORE_STORE) {
        tokio::time::sleep(pause).await;
    }
    let source = ingest.source.clone();
    let retention = ingest.retention;
    let first_seen = ingest.request.received_at;
    let outcome = match store.ingest(ingest).await {
        Ok(outcome) => outcome,
        Err(err) => {
            if !claimed.is_empty() {
                if let Err(release_err) = keys.store.release(&source, &claimed, &token).await {
                    // The lease runs out by itself; until then copies get 409.
                    tracing::warn!(err = %release_err, "could not give back claimed keys");
                }
            }
            return Err(Refused::Store(err));
        }
    };
    if let Some(pause) = crash::paused(crash::KEYS_AFTER_STORE_BEFORE_DONE) {
        tokio::time::sleep(pause).await;
    }
    if !claimed.is_empty() {
        // One call per content hash: each key is kept done with its own event's.
        let mut completed = Ok(0);
        for (body_sha256, group) in &claimed_hashes {
            let done = DoneKey {
                first_request: outcome.request_id,
                first_seen,
                body_sha256: *body_sha256,
            };
            let result = keys
                .store
                .complete(&source, group, &token, done, retention)
                .await;
            completed = match (completed, result) {
                (Ok(total), Ok(kept)) => Ok(total + kept),
                (Err(err), _) | (_, Err(err)) => Err(err),
            };
        }
        match completed {
            Ok(kept) if kept == claimed.len() => {}
            Ok(kept) => {
                metrics::counter!("hooklatch_key_leases_lost_total", "source" => source.to_string())
                    .increment((claimed.len() - kept) as u64);
                tracing::warn!(
                    request = %outcome.request_id,
                    lost = claimed.len() - kept,
                    "a key's in-flight lease ran out before its request was queued; \
                     a copy that arrived meanwhile may have been queued too (raise key_lease)"
                );
            }
            Err(err) => {
                metrics::counter!("hooklatch_key_leases_lost_total", "source" => source.to_string())
                    .increment(claimed.len() as u64);
                tracing::warn!(
                    request = %outcome.request_id,
                    %err,
                    "queued, but the keys could not be marked done; a copy arriving after the \
                     lease runs out would be queued again"
                );
            }
        }
    }
    Ok(outcome)
}

/// Records a refused request in history (never a claim or a delivery) and answers. Counted
/// `verdict="rejected"`, or `"error"` when the gateway failed rather than the request (a 5xx:
/// the key store down), so that an outage is not read as forgeries.
async fn reject(
    state: &IngestState,
    mut request: RequestRecord,
    metric_source: &str,
    err: ApiError,
) -> Response {
    let verdict = if err.status.is_server_error() {
        "error"
    } else {
        "rejected"
    };
    metrics::counter!("hooklatch_requests_total",
        "source" => metric_source.to_owned(), "verdict" => verdict, "reason" => err.code)
    .increment(1);
    tracing::debug!(source = %request.source, code = err.code, "rejected");
    if request.body.len() > state.refused_body_limit
        && !crate::VERIFIED_REFUSALS.contains(&err.code)
    {
        request.body = request.body.slice(..state.refused_body_limit);
        request.body_truncated = true;
    }
    let rejected = Rejected {
        request,
        code: err.code.to_owned(),
        status: err.status.as_u16(),
    };
    if let Err(store_err) = state.store.record_rejection(rejected).await {
        tracing::warn!(err = %store_err, code = err.code, "could not record a rejected request");
    }
    err.into_response()
}

fn too_large(limit: usize) -> ApiError {
    ApiError::new(
        StatusCode::PAYLOAD_TOO_LARGE,
        "body_too_large",
        format!("body is larger than the {limit}-byte limit"),
    )
}

/// Reads the body whole, refusing it once it passes the limit and when it is too slow.
async fn read_body(body: Body, state: &IngestState) -> Result<Bytes, ApiError> {
    let limited = Limited::new(body, state.body_limit);
    match tokio::time::timeout(state.body_timeout, limited.collect()).await {
        Ok(Ok(collected)) => Ok(collected.to_bytes()),
        Ok(Err(err)) if err.downcast_ref::<LengthLimitError>().is_some() => {
            Err(too_large(state.body_limit))
        }
        Ok(Err(_)) => Err(ApiError::new(
            StatusCode::BAD_REQUEST,
            "body_read_failed",
            "the request body could not be read",
        )),
        Err(_) => Err(ApiError::new(
            StatusCode::REQUEST_TIMEOUT,
            "body_timeout",
            "the request body did not arrive in time",
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::{Answer, EventAnswer};

    /// `Allow` names GET only for the sources that answer one: Twilio (events as GETs) and
    /// WhatsApp (Meta's subscription check); a Stripe or GitHub source takes POST alone.
    #[test]
    fn a_source_takes_get_only_when_its_provider_sends_one() {
        use hooklatch_core::provider::{GitHub, Stripe, Twilio, WhatsApp};
        assert!(super::takes_get(&Twilio { public_url: None }));
        assert!(super::takes_get(&WhatsApp { verify_token: None }));
        assert!(!super::takes_get(&Stripe));
        assert!(!super::takes_get(&GitHub));
    }

    /// Clients read the answer as JSON, but people and scripts compare captures: its bytes stay
    /// what they were when it was built as a `serde_json::Value` (keys in alphabetical order).
    #[test]
    fn the_answer_keeps_its_fields_in_alphabetical_order() {
        let answer = Answer {
            events: vec![
                EventAnswer::New {
                    deliveries: vec!["7".to_owned(), "8".to_owned()],
                    key: "evt_new",
                },
                EventAnswer::Duplicate {
                    first_request: "3".to_owned(),
                    first_seen_ms: 1_700_000_000_000,
                    key: "evt_dup",
                },
                EventAnswer::Conflict {
                    first_request: "4".to_owned(),
                    key: "evt_conflict",
                },
            ],
            request_id: "9".to_owned(),
            status: "accepted",
        };
        assert_eq!(
            serde_json::to_string(&answer).expect("serializes"),
            concat!(
                r#"{"events":[{"claim":"new","deliveries":["7","8"],"key":"evt_new"},"#,
                r#"{"claim":"duplicate","first_request":"3","first_seen_ms":1700000000000,"key":"evt_dup"},"#,
                r#"{"claim":"conflict","first_request":"4","key":"evt_conflict"}],"#,
                r#""request_id":"9","status":"accepted"}"#
            )
        );
    }
}
