//! `/v1/requests`: history of every inbound request, byte-exact.

use std::sync::Arc;

use axum::extract::State;
use axum::http::StatusCode;
use axum::Json;
use base64::Engine;
use hooklatch_core::store::{
    ConflictDecision, DeliveryDetail, DeliveryState, Dismissal, Redelivery, RequestFilter,
    RequestRecord, RequestSummary, Verdict, HELD,
};
use hooklatch_core::{RequestId, Timestamp};
use serde::Deserialize;
use serde_json::{json, Value};

use crate::extract::{invalid_body, optional_reason, ApiBytes, ApiJson, ApiQuery, PathText};
use crate::{AdminState, ApiError};

/// Page size when none is asked for, and the most one page may hold.
pub(crate) const DEFAULT_LIMIT: u32 = 50;
pub(crate) const MAX_LIMIT: u32 = 500;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct ListQuery {
    source: Option<String>,
    verdict: Option<String>,
    key: Option<String>,
    /// Milliseconds since the epoch, inclusive.
    since: Option<i64>,
    /// Milliseconds since the epoch, exclusive.
    until: Option<i64>,
    limit: Option<u32>,
    /// The `next_cursor` of the previous page.
    cursor: Option<String>,
}

pub(crate) async fn list(
    State(state): State<Arc<AdminState>>,
    ApiQuery(q): ApiQuery<ListQuery>,
) -> Result<Json<Value>, ApiError> {
    let verdict = q
        .verdict
        .as_deref()
        .map(|v| {
            Verdict::parse(v).ok_or_else(|| {
                ApiError::bad_parameter(
                    "verdict must be one of accepted, duplicate, conflict, rejected, handshake, imported",
                )
            })
        })
        .transpose()?;
    let before = q
        .cursor
        .as_deref()
        .filter(|c| !c.is_empty())
        .map(|c| RequestId::parse(c).ok_or_else(|| ApiError::bad_parameter("cursor is not valid")))
        .transpose()?;
    let limit = page_limit(q.limit)?;
    let items = state
        .store
        .list_requests(RequestFilter {
            source: q.source,
            verdict,
            key: q.key,
            since: q.since.map(Timestamp),
            until: q.until.map(Timestamp),
            before,
            limit,
        })
        .await?;
    let next_cursor = (items.len() == limit as usize)
        .then(|| items.last().map(|r| r.id.to_string()))
        .flatten();
    Ok(Json(json!({
        "items": items.iter().map(summary_json).collect::<Vec<_>>(),
        "next_cursor": next_cursor,
    })))
}

pub(crate) async fn show(
    State(state): State<Arc<AdminState>>,
    PathText(id): PathText,
) -> Result<Json<Value>, ApiError> {
    let id = RequestId::parse(&id).ok_or_else(|| ApiError::not_found("no such request"))?;
    let detail = state
        .store
        .get_request(id)
        .await?
        .ok_or_else(|| ApiError::not_found("no such request"))?;
    let b64 = base64::engine::general_purpose::STANDARD;
    let mut res = summary_json(&detail.summary);
    let headers: Vec<Value> = detail
        .headers
        .iter()
        .map(|(name, value)| match std::str::from_utf8(value) {
            Ok(text) => json!({ "name": name, "value": text }),
            Err(_) => json!({ "name": name, "value_base64": b64.encode(value) }),
        })
        .collect();
    let obj = res.as_object_mut().expect("summary_json builds an object");
    obj.insert("method".into(), json!(detail.method));
    obj.insert("path".into(), json!(detail.path));
    obj.insert("peer".into(), json!(detail.peer));
    obj.insert("headers".into(), json!(headers));
    obj.insert("body_base64".into(), json!(b64.encode(&detail.body)));
    obj.insert("body".into(), json!(std::str::from_utf8(&detail.body).ok()));
    obj.insert("body_truncated".into(), json!(detail.body_truncated));
    obj.insert(
        "deliveries".into(),
        json!(detail
            .deliveries
            .iter()
            .map(delivery_json)
            .collect::<Vec<_>>()),
    );
    Ok(Json(res))
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RedeliverBody {
    /// Only this destination (default: every destination of the request's source).
    destination: Option<String>,
}

/// Deliberately delivers a request's events again, bypassing dedup: new deliveries with
/// their own ids and the events' original `Idempotency-Key`s, so the handler's guard decides.
pub(crate) async fn redeliver(
    State(state): State<Arc<AdminState>>,
    PathText(id): PathText,
    ApiBytes(body): ApiBytes,
) -> Result<(StatusCode, Json<Value>), ApiError> {
    // The body is optional: none, or `{"destination": "…"}` (its content type not required).
    let body: RedeliverBody = if body.iter().all(u8::is_ascii_whitespace) {
        RedeliverBody::default()
    } else {
        serde_json::from_slice(&body).map_err(|err| {
            invalid_body(format!("the body is not {{\"destination\": \"…\"}}: {err}"))
        })?
    };
    let id = RequestId::parse(&id).ok_or_else(|| ApiError::not_found("no such request"))?;
    let request = state
        .store
        .get_request(id)
        .await?
        .ok_or_else(|| ApiError::not_found("no such request"))?;
    // What carries no verified event has nothing to deliver, whatever its source (one that
    // names no configured source has no destination either).
    let verdict = request.summary.verdict;
    if matches!(verdict, Verdict::Rejected | Verdict::Handshake) {
        return Err(nothing_to_redeliver(verdict));
    }
    let configured = state
        .destinations
        .get(&request.summary.source)
        .cloned()
        .unwrap_or_default();
    let destinations = match body.destination {
        Some(d) if configured.contains(&d) => vec![d],
        Some(d) => {
            return Err(ApiError::bad_parameter(format!(
                "source {:?} has no destination {d:?}",
                request.summary.source
            )))
        }
        None => configured,
    };
    if destinations.is_empty() {
        return Err(ApiError::new(
            StatusCode::CONFLICT,
            "no_destination",
            format!(
                "source {:?} has no configured destination",
                request.summary.source
            ),
        ));
    }
    match state
        .store
        .redeliver(id, destinations, Timestamp::now())
        .await?
    {
        Redelivery::Queued(ids) => {
            state.enqueued.notify_one();
            tracing::info!(request = %id, n = ids.len(), "redelivery queued");
            Ok((
                StatusCode::ACCEPTED,
                Json(json!({
                    "request_id": id.to_string(),
                    "deliveries": ids.iter().map(|d| d.to_string()).collect::<Vec<_>>(),
                })),
            ))
        }
        Redelivery::NotFound => Err(ApiError::not_found("no such request")),
        Redelivery::Dismissed(d) => Err(ApiError::new(
            StatusCode::CONFLICT,
            "conflict_dismissed",
            format!(
                "this conflict was dismissed at {}: it is not released",
                d.at.to_rfc3339()
            ),
        )),
        Redelivery::NothingToRedeliver(verdict) => Err(nothing_to_redeliver(verdict)),
    }
}

/// 409 `nothing_to_redeliver`: a request with this verdict carries no verified event.
fn nothing_to_redeliver(verdict: Verdict) -> ApiError {
    ApiError::new(
        StatusCode::CONFLICT,
        "nothing_to_redeliver",
        format!(
            "the request's verdict is {}: it carries no verified event",
            verdict.as_str()
        ),
    )
}

/// Dismisses a conflict: an operator's record that this body will not be processed (optional
/// body `{"reason": "…"}`). The first decision stands: a released or dismissed conflict is
/// not decided again, and a dismissed one is not released.
pub(crate) async fn dismiss(
    State(state): State<Arc<AdminState>>,
    PathText(id): PathText,
    ApiBytes(body): ApiBytes,
) -> Result<Json<Value>, ApiError> {
    let reason = optional_reason(&body)?;
    let id = RequestId::parse(&id).ok_or_else(|| ApiError::not_found("no such request"))?;
    match state
        .store
        .dismiss_conflict(id, reason, Timestamp::now())
        .await?
    {
        Dismissal::Dismissed(d) => {
            tracing::info!(request = %id, "conflict dismissed");
            Ok(Json(json!({
                "id": id.to_string(),
                "decision": decision_json(&d),
            })))
        }
        Dismissal::NotFound => Err(ApiError::not_found("no such request")),
        Dismissal::NotAConflict(verdict) => Err(ApiError::new(
            StatusCode::CONFLICT,
            "not_a_conflict",
            format!(
                "the request's verdict is {}: only a conflict is dismissed",
                verdict.as_str()
            ),
        )),
        Dismissal::Decided(d) => Err(ApiError::new(
            StatusCode::CONFLICT,
            "conflict_decided",
            format!(
                "this conflict was {} at {}; the first decision stands",
                d.action.as_str(),
                d.at.to_rfc3339()
            ),
        )),
    }
}

fn decision_json(d: &ConflictDecision) -> Value {
    json!({
        "action": d.action.as_str(),
        "at": d.at.to_rfc3339(),
        "reason": d.reason,
    })
}

/// An export file (`hooklatch events export`), as far as import reads it.
#[derive(Debug, Deserialize)]
pub(crate) struct ImportDoc {
    hooklatch_export: u32,
    captures: Vec<ImportCapture>,
}

#[derive(Debug, Deserialize)]
struct ImportCapture {
    request_id: Option<String>,
    source: String,
    method: Option<String>,
    path: Option<String>,
    #[serde(default)]
    keys: Vec<String>,
    #[serde(default)]
    headers: Vec<ImportHeader>,
    body_base64: String,
}

#[derive(Debug, Deserialize)]
struct ImportHeader {
    name: String,
    value: Option<String>,
    value_base64: Option<String>,
}

/// The largest export file import takes.
pub(crate) const IMPORT_LIMIT: usize = 64 << 20;

/// Imports captures from an export file into history (verdict `imported`), so they can be
/// replayed or redelivered here. Nothing is claimed or queued; each capture is checked whole
/// before any is stored. A capture imported before (the same source, keys and body bytes,
/// verdict `imported`) is not stored again: its first import's id is answered, marked
/// `already_imported`, so importing a file twice leaves history as once.
pub(crate) async fn import(
    State(state): State<Arc<AdminState>>,
    ApiJson(doc): ApiJson<ImportDoc>,
) -> Result<(StatusCode, Json<Value>), ApiError> {
    if doc.hooklatch_export != 1 {
        return Err(ApiError::bad_parameter(format!(
            "hooklatch_export {} is not a version this gateway reads (1)",
            doc.hooklatch_export
        )));
    }
    let b64 = base64::engine::general_purpose::STANDARD;
    let now = Timestamp::now();
    let mut records = Vec::with_capacity(doc.captures.len());
    for (i, capture) in doc.captures.into_iter().enumerate() {
        let bad = |what: String| ApiError::bad_parameter(format!("captures[{i}]: {what}"));
        if !state.destinations.contains_key(&capture.source) {
            return Err(bad(format!(
                "no source named {:?} is configured on this gateway",
                capture.source
            )));
        }
        if capture.keys.is_empty() {
            return Err(bad("has no event keys".to_owned()));
        }
        for key in &capture.keys {
            hooklatch_core::EventKey::parse(key).map_err(|e| bad(format!("key {key:?} {e}")))?;
        }
        let body = b64
            .decode(&capture.body_base64)
            .map_err(|_| bad("body_base64 is not base64".to_owned()))?;
        if body.len() > state.body_limit {
            return Err(bad(format!(
                "its body is {} bytes, over this gateway's body_limit of {} bytes: ingest \
                 would have refused it",
                body.len(),
                state.body_limit
            )));
        }
        let mut headers = Vec::with_capacity(capture.headers.len());
        for h in capture.headers {
            let value = match (h.value, h.value_base64) {
                (Some(text), _) => text.into_bytes(),
                (None, Some(encoded)) => b64
                    .decode(encoded)
                    .map_err(|_| bad(format!("header {}: value_base64 is not base64", h.name)))?,
                (None, None) => Vec::new(),
            };
            // What a delivery could not send would fail every attempt until the dead-letter.
            if axum::http::HeaderName::from_bytes(h.name.as_bytes()).is_err() {
                return Err(bad(format!(
                    "header {:?} is not an HTTP header name",
                    h.name
                )));
            }
            if axum::http::HeaderValue::from_bytes(&value).is_err() {
                return Err(bad(format!(
                    "header {}: its value is not one an HTTP request can carry (a line break or \
                     another control character)",
                    h.name
                )));
            }
            headers.push((h.name.to_ascii_lowercase(), value));
        }
        let record = RequestRecord {
            received_at: now,
            path: capture
                .path
                .unwrap_or_else(|| format!("/in/{}", capture.source)),
            source: capture.source,
            method: capture.method.unwrap_or_else(|| "POST".to_owned()),
            peer: None,
            headers,
            body: body.into(),
            body_truncated: false,
        };
        records.push((capture.request_id, record, capture.keys));
    }
    let mut imported = Vec::with_capacity(records.len());
    let mut again = 0;
    for (original, record, keys) in records {
        let (id, already) = match imported_before(state.store.as_ref(), &record, &keys).await? {
            Some(id) => (id, true),
            None => (
                state.store.record_import(record, keys.clone()).await?,
                false,
            ),
        };
        again += usize::from(already);
        imported.push(json!({
            "request_id": id.to_string(),
            "original_request_id": original,
            "keys": keys,
            "already_imported": already,
        }));
    }
    tracing::info!(
        n = imported.len() - again,
        already_imported = again,
        "captures imported"
    );
    Ok((StatusCode::CREATED, Json(json!({ "imported": imported }))))
}

/// The request an earlier import stored for this capture, if any: verdict `imported`, the same
/// source, the same keys and the same body, byte for byte.
async fn imported_before(
    store: &dyn hooklatch_core::Store,
    record: &RequestRecord,
    keys: &[String],
) -> Result<Option<RequestId>, ApiError> {
    let candidates = store
        .list_requests(RequestFilter {
            source: Some(record.source.clone()),
            verdict: Some(Verdict::Imported),
            key: keys.first().cloned(),
            since: None,
            until: None,
            before: None,
            limit: MAX_LIMIT,
        })
        .await?;
    for candidate in candidates.iter().filter(|c| c.keys == keys) {
        if let Some(detail) = store.get_request(candidate.id).await? {
            if detail.body == record.body {
                return Ok(Some(candidate.id));
            }
        }
    }
    Ok(None)
}

pub(crate) fn page_limit(limit: Option<u32>) -> Result<u32, ApiError> {
    match limit.unwrap_or(DEFAULT_LIMIT) {
        0 => Err(ApiError::bad_parameter("limit must be at least 1")),
        n if n > MAX_LIMIT => Err(ApiError::bad_parameter(format!(
            "limit must be at most {MAX_LIMIT}"
        ))),
        n => Ok(n),
    }
}

fn summary_json(r: &RequestSummary) -> Value {
    json!({
        "id": r.id.to_string(),
        "received_at": r.received_at.to_rfc3339(),
        "received_at_ms": r.received_at.as_millis(),
        "source": r.source,
        "verdict": r.verdict.as_str(),
        "reason": r.reason,
        "status": r.status,
        "keys": r.keys,
        "body_len": r.body_len,
        "decision": r.decision.as_ref().map(decision_json),
    })
}

pub(crate) fn delivery_json(d: &DeliveryDetail) -> Value {
    // Held for a disabled destination: no time, until it is enabled.
    let held = d.state == DeliveryState::Pending && d.next_attempt_at == Some(HELD);
    json!({
        "id": d.id.to_string(),
        "request_id": d.request_id.to_string(),
        "destination": d.destination,
        "idempotency_key": d.idempotency_key,
        "state": d.state.as_str(),
        "attempts": d.attempts,
        "next_attempt_at": d.next_attempt_at.filter(|_| !held).map(Timestamp::to_rfc3339),
        "held": held,
        "last_error": d.last_error,
        "history": d.history.iter().map(|a| json!({
            "number": a.number,
            "started_at": a.started_at.to_rfc3339(),
            "status": a.status,
            "latency_ms": a.latency_ms,
            "error": a.error,
        })).collect::<Vec<_>>(),
    })
}
