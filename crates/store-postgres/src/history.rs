//! History queries (requests, deliveries, attempts), counts, and the purge.
//!
//! Reads run as single statements on pooled connections, beside the writers. The purge works
//! in bounded batches, each its own short transaction, and skips rows another transaction has
//! locked, so it never holds locks long and never waits on an ingest.

use std::collections::HashMap;

use bytes::Bytes;
use hooklatch_core::store::{
    AttemptRecord, ConflictAction, ConflictDecision, DeliveryDetail, DeliveryFilter, DeliveryState,
    Dismissal, OutboxCounts, RequestDetail, RequestFilter, RequestSummary, StoreStats, Verdict,
};
use hooklatch_core::{DeliveryId, RequestId, Timestamp};
use sqlx::postgres::PgRow;
use sqlx::{Acquire, PgConnection, PgPool, Postgres, QueryBuilder, Row};

use crate::outbox::count;
use hooklatch_core::headers;

/// Rows removed per purge transaction.
pub(crate) const PURGE_BATCH: u64 = 1000;

/// The columns [`summary`] reads (the decision's three by name); a query's own columns follow
/// from index 11.
const SUMMARY_COLUMNS: &str = "id, received_at, source, verdict, reason, status, keys,
    octet_length(body), decision, decided_at, decision_reason";

fn summary(r: &PgRow) -> Result<RequestSummary, sqlx::Error> {
    Ok(RequestSummary {
        id: RequestId(r.try_get(0)?),
        received_at: Timestamp(r.try_get(1)?),
        source: r.try_get(2)?,
        verdict: Verdict::parse(r.try_get::<&str, _>(3)?).unwrap_or(Verdict::Rejected),
        reason: r.try_get(4)?,
        status: u16::try_from(r.try_get::<i32, _>(5)?).unwrap_or(0),
        keys: r.try_get(6)?,
        body_len: u64::try_from(r.try_get::<i32, _>(7)?).unwrap_or(0),
        decision: ConflictDecision::from_columns(
            r.try_get::<Option<&str>, _>("decision")?,
            r.try_get("decided_at")?,
            r.try_get("decision_reason")?,
        ),
    })
}

/// Records an operator's dismissal of a conflict, unless it was decided before: one update,
/// which reads the row's latest version, so a release and a dismissal never both win.
pub(crate) async fn dismiss_conflict(
    pool: &PgPool,
    request: RequestId,
    reason: Option<&str>,
    now: Timestamp,
) -> Result<Dismissal, sqlx::Error> {
    let dismissed = sqlx::query(
        "UPDATE requests SET decision = 'dismissed', decided_at = $2, decision_reason = $3
         WHERE id = $1 AND verdict = 'conflict' AND decision IS NULL
         RETURNING id",
    )
    .bind(request.0)
    .bind(now.0)
    .bind(reason)
    .fetch_optional(pool)
    .await?;
    if dismissed.is_some() {
        return Ok(Dismissal::Dismissed(ConflictDecision {
            action: ConflictAction::Dismissed,
            at: now,
            reason: reason.map(str::to_owned),
        }));
    }
    let row = sqlx::query(
        "SELECT verdict, decision, decided_at, decision_reason FROM requests WHERE id = $1",
    )
    .bind(request.0)
    .fetch_optional(pool)
    .await?;
    let Some(row) = row else {
        return Ok(Dismissal::NotFound);
    };
    let verdict = Verdict::parse(row.try_get(0)?).unwrap_or(Verdict::Rejected);
    let decided = ConflictDecision::from_columns(
        row.try_get::<Option<&str>, _>(1)?,
        row.try_get(2)?,
        row.try_get(3)?,
    );
    Ok(match decided {
        Some(d) if verdict == Verdict::Conflict => Dismissal::Decided(d),
        _ => Dismissal::NotAConflict(verdict),
    })
}

/// Conflicts nobody released or dismissed, read through the index of verdicts.
pub(crate) async fn undecided_conflicts(pool: &PgPool) -> Result<u64, sqlx::Error> {
    let n: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM requests
         WHERE verdict = 'conflict' AND verdict <> 'accepted' AND decision IS NULL",
    )
    .fetch_one(pool)
    .await?;
    Ok(u64::try_from(n).unwrap_or(0))
}

pub(crate) async fn list_requests(
    pool: &PgPool,
    filter: &RequestFilter,
) -> Result<Vec<RequestSummary>, sqlx::Error> {
    let mut sql = QueryBuilder::<Postgres>::new("");
    if filter.key.is_some() {
        // The sources that hold claims, one primary-key probe each (a loose index scan).
        sql.push(
            "WITH RECURSIVE claim_sources(name) AS (
                (SELECT source FROM claims ORDER BY source LIMIT 1)
                UNION ALL
                SELECT (SELECT c.source FROM claims c WHERE c.source > s.name
                        ORDER BY c.source LIMIT 1)
                FROM claim_sources s WHERE s.name IS NOT NULL) ",
        );
    }
    sql.push(format!("SELECT {SUMMARY_COLUMNS} FROM requests WHERE true"));
    if let Some(source) = &filter.source {
        sql.push(" AND source = ").push_bind(source);
    }
    if let Some(verdict) = filter.verdict {
        // A literal, as for deliveries' states: the index of verdicts leaves out `accepted`
        // (schema 5), which the planner can see only of a literal.
        sql.push(format!(" AND verdict = '{}'", verdict.as_str()));
    }
    if let Some(key) = &filter.key {
        // The request each source's claim of the key points at, and the others that carry it.
        sql.push(" AND id IN (SELECT request_id FROM request_keys WHERE key = ")
            .push_bind(key)
            .push(" UNION ALL SELECT c.request_id FROM claim_sources s")
            .push(" JOIN claims c ON c.source = s.name AND c.key = ")
            .push_bind(key)
            .push(")");
    }
    if let Some(since) = filter.since {
        sql.push(" AND received_at >= ").push_bind(since.0);
    }
    if let Some(until) = filter.until {
        sql.push(" AND received_at < ").push_bind(until.0);
    }
    if let Some(before) = filter.before {
        sql.push(" AND id < ").push_bind(before.0);
    }
    sql.push(" ORDER BY id DESC LIMIT ")
        .push_bind(i64::from(filter.limit));
    let rows = sql.build().fetch_all(pool).await?;
    rows.iter().map(summary).collect()
}

pub(crate) async fn get_request(
    pool: &PgPool,
    id: RequestId,
) -> Result<Option<RequestDetail>, sqlx::Error> {
    let row = sqlx::query(&format!(
        "SELECT {SUMMARY_COLUMNS}, method, path, peer, headers, body, body_truncated
         FROM requests WHERE id = $1"
    ))
    .bind(id.0)
    .fetch_optional(pool)
    .await?;
    let Some(row) = row else {
        return Ok(None);
    };
    let deliveries = sqlx::query(&format!(
        "SELECT {DELIVERY_COLUMNS} FROM deliveries WHERE request_id = $1 ORDER BY id"
    ))
    .bind(id.0)
    .fetch_all(pool)
    .await?
    .iter()
    .map(delivery)
    .collect::<Result<Vec<_>, _>>()?;
    Ok(Some(RequestDetail {
        summary: summary(&row)?,
        method: row.try_get(11)?,
        path: row.try_get(12)?,
        peer: row.try_get(13)?,
        headers: headers::decode(row.try_get::<&[u8], _>(14)?),
        body: Bytes::from(row.try_get::<Vec<u8>, _>(15)?),
        body_truncated: row.try_get(16)?,
        deliveries: with_attempts(pool, deliveries).await?,
    }))
}

const DELIVERY_COLUMNS: &str = "id, request_id, destination, idempotency_key, state, attempts,
    next_attempt_at, last_error";

fn delivery(r: &PgRow) -> Result<DeliveryDetail, sqlx::Error> {
    let state = DeliveryState::parse(r.try_get::<&str, _>(4)?).unwrap_or(DeliveryState::Pending);
    Ok(DeliveryDetail {
        id: DeliveryId(r.try_get(0)?),
        request_id: RequestId(r.try_get(1)?),
        destination: r.try_get(2)?,
        idempotency_key: r.try_get(3)?,
        state,
        attempts: count(r.try_get(5)?),
        next_attempt_at: (state == DeliveryState::Pending)
            .then(|| r.try_get(6).map(Timestamp))
            .transpose()?,
        last_error: r.try_get(7)?,
        history: Vec::new(),
    })
}

/// Fills in every delivery's attempts, in one query.
async fn with_attempts(
    pool: &PgPool,
    mut deliveries: Vec<DeliveryDetail>,
) -> Result<Vec<DeliveryDetail>, sqlx::Error> {
    if deliveries.is_empty() {
        return Ok(deliveries);
    }
    let ids: Vec<i64> = deliveries.iter().map(|d| d.id.0).collect();
    let rows = sqlx::query(
        "SELECT delivery_id, number, started_at, status, latency_ms, error FROM attempts
         WHERE delivery_id = ANY($1) ORDER BY delivery_id, number",
    )
    .bind(&ids)
    .fetch_all(pool)
    .await?;
    let mut by_delivery: HashMap<i64, Vec<AttemptRecord>> = HashMap::new();
    for r in &rows {
        by_delivery
            .entry(r.try_get(0)?)
            .or_default()
            .push(AttemptRecord {
                number: count(r.try_get(1)?),
                started_at: Timestamp(r.try_get(2)?),
                status: r
                    .try_get::<Option<i32>, _>(3)?
                    .and_then(|s| u16::try_from(s).ok()),
                latency_ms: u64::try_from(r.try_get::<i64, _>(4)?).unwrap_or(0),
                error: r.try_get(5)?,
            });
    }
    for delivery in &mut deliveries {
        delivery.history = by_delivery.remove(&delivery.id.0).unwrap_or_default();
    }
    Ok(deliveries)
}

pub(crate) async fn list_deliveries(
    pool: &PgPool,
    filter: &DeliveryFilter,
) -> Result<Vec<DeliveryDetail>, sqlx::Error> {
    let mut sql = QueryBuilder::<Postgres>::new(format!(
        "SELECT {DELIVERY_COLUMNS} FROM deliveries WHERE true"
    ));
    if let Some(state) = filter.state {
        // A literal, not a parameter: the planner then sees that a filter on dead rows
        // matches the index of dead rows alone, and one on pending rows the ready index
        // (schema 5). The names are the enum's own, fixed.
        sql.push(format!(" AND state = '{}'", state.as_str()));
    }
    if let Some(destination) = &filter.destination {
        sql.push(" AND destination = ").push_bind(destination);
    }
    if let Some(before) = filter.before {
        sql.push(" AND id < ").push_bind(before.0);
    }
    sql.push(" ORDER BY id DESC LIMIT ")
        .push_bind(i64::from(filter.limit));
    let deliveries = sql
        .build()
        .fetch_all(pool)
        .await?
        .iter()
        .map(delivery)
        .collect::<Result<Vec<_>, _>>()?;
    with_attempts(pool, deliveries).await
}

/// Removes up to `limit` claims expired at or before `now`, in one statement (its own
/// transaction). Claims locked by an ingest replacing them are skipped, not waited for.
pub(crate) async fn purge_claims(
    pool: &PgPool,
    now: Timestamp,
    limit: u64,
) -> Result<u64, sqlx::Error> {
    let res = sqlx::query(
        "WITH expired AS (
            SELECT source, key FROM claims WHERE expires_at <= $1
            LIMIT $2 FOR UPDATE SKIP LOCKED)
         DELETE FROM claims c USING expired e WHERE c.source = e.source AND c.key = e.key",
    )
    .bind(now.0)
    .bind(limit as i64)
    .execute(pool)
    .await?;
    Ok(res.rows_affected())
}

/// Removes up to `limit` requests received before `before` with no pending delivery and no
/// claim pointing at them, with their deliveries, attempts and keys, in one short
/// transaction. Returns how many requests were examined (locked) and how many removed.
///
/// Two statements: the first picks and locks candidates (skipping rows locked elsewhere); the
/// second re-checks them with a fresh snapshot before deleting. A redrive or redelivery of one
/// of their deliveries share-locks the request, so it either committed before that snapshot
/// (and the re-check keeps the request) or waits for this transaction (and then finds the
/// request gone).
pub(crate) async fn purge_requests(
    conn: &mut PgConnection,
    before: Timestamp,
    limit: u64,
) -> Result<(u64, u64), sqlx::Error> {
    let mut tx = conn.begin().await?;
    let ids: Vec<i64> = sqlx::query(
        "SELECT r.id FROM requests r
         WHERE r.received_at < $1
           AND NOT EXISTS (SELECT 1 FROM deliveries d WHERE d.request_id = r.id AND d.state IN ('pending', 'dead'))
           AND NOT EXISTS (SELECT 1 FROM claims c WHERE c.request_id = r.id)
         ORDER BY r.received_at LIMIT $2
         FOR UPDATE OF r SKIP LOCKED",
    )
    .bind(before.0)
    .bind(limit as i64)
    .fetch_all(&mut *tx)
    .await?
    .iter()
    .map(|r| r.try_get(0))
    .collect::<Result<_, _>>()?;
    if ids.is_empty() {
        tx.commit().await?;
        return Ok((0, 0));
    }
    let removed: i64 = sqlx::query(
        "WITH victims AS (
            SELECT r.id FROM requests r
            WHERE r.id = ANY($1)
              AND NOT EXISTS (SELECT 1 FROM deliveries d WHERE d.request_id = r.id AND d.state IN ('pending', 'dead'))
              AND NOT EXISTS (SELECT 1 FROM claims c WHERE c.request_id = r.id)),
         gone_attempts AS (
            DELETE FROM attempts a USING deliveries d, victims v
            WHERE a.delivery_id = d.id AND d.request_id = v.id),
         gone_deliveries AS (
            DELETE FROM deliveries d USING victims v WHERE d.request_id = v.id),
         gone_keys AS (
            DELETE FROM request_keys k USING victims v WHERE k.request_id = v.id),
         gone AS (
            DELETE FROM requests r USING victims v WHERE r.id = v.id RETURNING 1)
         SELECT count(*) FROM gone",
    )
    .bind(&ids)
    .fetch_one(&mut *tx)
    .await?
    .try_get(0)?;
    tx.commit().await?;
    Ok((ids.len() as u64, removed as u64))
}

pub(crate) async fn outbox_counts(pool: &PgPool) -> Result<OutboxCounts, sqlx::Error> {
    let row = sqlx::query(
        "SELECT (SELECT count(*) FROM deliveries WHERE state = 'pending'),
                (SELECT count(*) FROM deliveries WHERE state = 'dead')",
    )
    .fetch_one(pool)
    .await?;
    let n = |i: usize| -> Result<u64, sqlx::Error> {
        Ok(u64::try_from(row.try_get::<i64, _>(i)?).unwrap_or(0))
    };
    Ok(OutboxCounts {
        pending: n(0)?,
        dead: n(1)?,
    })
}

pub(crate) async fn stats(pool: &PgPool) -> Result<StoreStats, sqlx::Error> {
    let outbox = outbox_counts(pool).await?;
    let claims: i64 = sqlx::query_scalar("SELECT count(*) FROM claims")
        .fetch_one(pool)
        .await?;
    Ok(StoreStats {
        pending: outbox.pending,
        dead: outbox.dead,
        claims: u64::try_from(claims).unwrap_or(0),
    })
}
