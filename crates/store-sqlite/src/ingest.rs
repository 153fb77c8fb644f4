//! The ingest transaction: record the request, claim each key, queue new events.
//!
//! Runs inside the writer's group commit. The claim is an insert on the `(source, key)`
//! primary key that only overwrites an expired claim; if it changed nothing, the key is held
//! and the stored body hash says duplicate or conflict.

use hooklatch_core::store::{
    Claim, Ingest, IngestOutcome, KeyDecision, NewEvent, Rejected, RequestRecord, Verdict,
};
use hooklatch_core::{DeliveryId, IdempotencyKey, RequestId, Timestamp};
use rusqlite::{params, Connection};

use hooklatch_core::headers;

use crate::body;

/// A request's row as far as it can be made before the job is queued: the body compressed,
/// the headers encoded, the keys listed. Made on the caller's task, so that the writer
/// thread, the serial part, only binds them.
pub(crate) struct Row {
    body: body::Stored,
    headers: Vec<u8>,
    keys_json: String,
}

impl Row {
    pub(crate) fn new<'a>(request: &RequestRecord, keys: impl IntoIterator<Item = &'a str>) -> Row {
        let keys: Vec<&str> = keys.into_iter().collect();
        Row {
            body: body::encode(&request.body),
            headers: headers::encode(&request.headers),
            keys_json: serde_json::to_string(&keys).expect("a list of strings serializes"),
        }
    }

    /// The row of an ingest, listing its events' keys.
    pub(crate) fn of_ingest(ingest: &Ingest) -> Row {
        Row::new(
            &ingest.request,
            ingest.events.iter().map(|e| e.key.as_str()),
        )
    }
}

/// `row` is [`Row::of_ingest`]'s, made before the job was queued.
pub(crate) fn ingest(
    conn: &Connection,
    ingest: &Ingest,
    row: &Row,
) -> rusqlite::Result<IngestOutcome> {
    let request_id = insert_request(conn, &ingest.request, row, Verdict::Accepted, None, 200)?;
    let mut claims = Vec::with_capacity(ingest.events.len());
    for (i, event) in ingest.events.iter().enumerate() {
        // A claim made here points at this request, and history finds the request through it;
        // any other request carrying the key is listed in `request_keys`.
        let (claim, claimed_here) = match &ingest.keys {
            // An external key store decided; an event it said nothing about is claimed here.
            KeyDecision::Decided(decided) if i < decided.len() => (decided[i].clone(), false),
            _ => {
                let claim = claim(conn, ingest, event, request_id)?;
                let new = matches!(claim, Claim::New { .. });
                (claim, new)
            }
        };
        if !claimed_here {
            conn.prepare_cached(
                "INSERT OR IGNORE INTO request_keys (key, request_id) VALUES (?1, ?2)",
            )?
            .execute(params![event.key.as_str(), request_id.0])?;
        }
        let claim = match claim {
            Claim::New { .. } => Claim::New {
                deliveries: queue(conn, ingest, event, request_id)?,
            },
            other => other,
        };
        claims.push((event.key.clone(), claim));
    }
    let outcome = IngestOutcome { request_id, claims };
    let verdict = outcome.verdict();
    if verdict != Verdict::Accepted {
        conn.prepare_cached("UPDATE requests SET verdict = ?1 WHERE id = ?2")?
            .execute(params![verdict.as_str(), request_id.0])?;
    }
    Ok(outcome)
}

/// Claims one key: an insert on the `(source, key)` primary key that only overwrites an
/// expired claim. `Claim::New` comes back with no deliveries yet (the caller queues them).
fn claim(
    conn: &Connection,
    ingest: &Ingest,
    event: &NewEvent,
    request_id: RequestId,
) -> rusqlite::Result<Claim> {
    let now = ingest.request.received_at;
    let source = ingest.source.as_str();
    let content = ingest.content_sha256(event);
    let inserted = conn
        .prepare_cached(
            "INSERT INTO claims (source, key, body_sha256, request_id, claimed_at, expires_at)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6)
             ON CONFLICT (source, key) DO UPDATE SET
                body_sha256 = excluded.body_sha256, request_id = excluded.request_id,
                claimed_at = excluded.claimed_at, expires_at = excluded.expires_at
             WHERE claims.expires_at <= excluded.claimed_at",
        )?
        .execute(params![
            source,
            event.key.as_str(),
            &content[..],
            request_id.0,
            now.0,
            now.plus(ingest.retention).0
        ])?;
    if inserted == 1 {
        return Ok(Claim::New {
            deliveries: Vec::new(),
        });
    }
    let (sha, first_request, first_seen): (Vec<u8>, i64, i64) = conn
        .prepare_cached(
            "SELECT body_sha256, request_id, claimed_at FROM claims WHERE source = ?1 AND key = ?2",
        )?
        .query_row(params![source, event.key.as_str()], |r| {
            Ok((r.get(0)?, r.get(1)?, r.get(2)?))
        })?;
    Ok(if sha.as_slice() == content.as_slice() {
        Claim::Duplicate {
            first_request: RequestId(first_request),
            first_seen: Timestamp(first_seen),
        }
    } else {
        let mut first_body_sha256 = [0u8; 32];
        if sha.len() == 32 {
            first_body_sha256.copy_from_slice(&sha);
        }
        Claim::Conflict {
            first_request: RequestId(first_request),
            first_body_sha256,
        }
    })
}

/// Queues one new event: a pending outbox row per destination, due at once, or leased to the
/// ingest's [`lease`](Ingest::lease) when it has one.
fn queue(
    conn: &Connection,
    ingest: &Ingest,
    event: &NewEvent,
    request_id: RequestId,
) -> rusqlite::Result<Vec<DeliveryId>> {
    let now = ingest.request.received_at;
    let idempotency_key = IdempotencyKey::new(&ingest.source, &event.key);
    let mut insert = conn.prepare_cached(
        "INSERT INTO deliveries (request_id, source, event_key, event_type, destination,
            idempotency_key, state, received_at, round_started_at, next_attempt_at, updated_at,
            lease_owner, lease_until)
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, 'pending', ?7, ?7, ?7, ?7, ?8, ?9)",
    )?;
    let (owner, until) = match &ingest.lease {
        Some(lease) => (Some(lease.owner.as_str()), Some(lease.until.0)),
        None => (None, None),
    };
    let mut deliveries = Vec::with_capacity(ingest.destinations.len());
    for destination in &ingest.destinations {
        insert.execute(params![
            request_id.0,
            ingest.source.as_str(),
            event.key.as_str(),
            event.event_type,
            destination,
            idempotency_key.as_str(),
            now.0,
            owner,
            until
        ])?;
        deliveries.push(DeliveryId(conn.last_insert_rowid()));
    }
    Ok(deliveries)
}

/// `row` lists no keys.
pub(crate) fn record_rejection(
    conn: &Connection,
    rejected: &Rejected,
    row: &Row,
) -> rusqlite::Result<RequestId> {
    insert_request(
        conn,
        &rejected.request,
        row,
        Verdict::Rejected,
        Some(&rejected.code),
        rejected.status,
    )
}

/// `row` lists `keys`.
pub(crate) fn record_import(
    conn: &Connection,
    request: &RequestRecord,
    row: &Row,
    keys: &[String],
) -> rusqlite::Result<RequestId> {
    let id = insert_request(conn, request, row, Verdict::Imported, None, 202)?;
    for key in keys {
        conn.execute(
            "INSERT OR IGNORE INTO request_keys (key, request_id) VALUES (?1, ?2)",
            params![key, id.0],
        )?;
    }
    Ok(id)
}

/// `row` lists no keys.
pub(crate) fn record_handshake(
    conn: &Connection,
    request: &RequestRecord,
    row: &Row,
    status: u16,
) -> rusqlite::Result<RequestId> {
    insert_request(conn, request, row, Verdict::Handshake, None, status)
}

fn insert_request(
    conn: &Connection,
    request: &RequestRecord,
    row: &Row,
    verdict: Verdict,
    reason: Option<&str>,
    status: u16,
) -> rusqlite::Result<RequestId> {
    let body = &row.body;
    conn.prepare_cached(
        "INSERT INTO requests (received_at, source, method, path, peer, headers, body,
            body_codec, body_length, body_truncated, verdict, reason, status, keys)
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14)",
    )?
    .execute(params![
        request.received_at.0,
        request.source,
        request.method,
        request.path,
        request.peer,
        &row.headers[..],
        &body.bytes[..],
        body.codec,
        body.length,
        request.body_truncated,
        verdict.as_str(),
        reason,
        status,
        row.keys_json
    ])?;
    Ok(RequestId(conn.last_insert_rowid()))
}
