//! The outbox: leasing due deliveries, recording attempts, releasing leases, waking a
//! destination's deliveries, redrive.
//!
//! A lease is `(lease_owner, lease_until)` on a pending row. A worker that dies holding one
//! loses it when `lease_until` passes; a worker that stops cleanly gives it back at once.

use std::time::Duration;

use bytes::Bytes;
use hooklatch_core::store::{
    redelivery_key, AttemptNext, AttemptResult, ConflictAction, ConflictDecision, DeliveryState,
    DisabledDestination, LeasedDelivery, Redelivery, Redrive, Verdict, HELD,
};
use hooklatch_core::{DeliveryId, IdempotencyKey, RequestId, Timestamp};
use rusqlite::{params, Connection, OptionalExtension};

use hooklatch_core::headers;

use crate::body;

/// When a pending row can next be taken: its due time, or the end of its lease if later. The
/// `deliveries_ready` index is on exactly this expression, and SQLite uses an expression index
/// only where a statement spells the expression the same way, hence one spelling.
macro_rules! ready_at {
    () => {
        "MAX(next_attempt_at, COALESCE(lease_until, 0))"
    };
}

/// Leases up to `?4` takeable rows to `?1` until `?2` (`?3` = now), earliest first.
/// `INDEXED BY`: left to itself SQLite may pick another index and sort every pending row
/// (the whole backlog) on each lease; the ready index starts at the earliest takeable row and
/// stops after `?4`, and rows under a live lease sort after `now`, so none is stepped over (a
/// test checks the plan).
const LEASE_DUE: &str = concat!(
    "UPDATE deliveries SET lease_owner = ?1, lease_until = ?2
    WHERE id IN (
       SELECT id FROM deliveries INDEXED BY deliveries_ready
       WHERE state = 'pending' AND ",
    ready_at!(),
    " <= ?3 ORDER BY ",
    ready_at!(),
    " LIMIT ?4)
    RETURNING id, request_id, source, event_key, event_type, destination, idempotency_key,
         attempts, round_started_at"
);

pub(crate) fn lease_due(
    conn: &Connection,
    owner: &str,
    now: Timestamp,
    lease: Duration,
    limit: u32,
) -> rusqlite::Result<Vec<LeasedDelivery>> {
    let until = now.plus(lease);
    let mut stmt = conn.prepare_cached(LEASE_DUE)?;
    let rows = stmt
        .query_map(params![owner, until.0, now.0, limit], |r| {
            Ok(LeasedDelivery {
                id: DeliveryId(r.get(0)?),
                request_id: RequestId(r.get(1)?),
                source: r.get(2)?,
                event_key: r.get(3)?,
                event_type: r.get(4)?,
                destination: r.get(5)?,
                idempotency_key: IdempotencyKey::from_stored(r.get(6)?),
                attempts: r.get(7)?,
                round_started_at: Timestamp(r.get(8)?),
                method: String::new(),
                path: String::new(),
                headers: Vec::new(),
                body: Bytes::new(),
                lease_until: Some(until),
            })
        })?
        .collect::<rusqlite::Result<Vec<_>>>()?;
    let mut body_stmt = conn.prepare_cached(
        "SELECT method, path, headers, body, body_codec, body_length FROM requests WHERE id = ?1",
    )?;
    let mut leased = Vec::with_capacity(rows.len());
    for mut delivery in rows {
        let hdrs: Vec<u8>;
        (delivery.method, delivery.path, hdrs, delivery.body) =
            body_stmt.query_row([delivery.request_id.0], |r| {
                Ok((
                    r.get(0)?,
                    r.get(1)?,
                    r.get(2)?,
                    body::decode(3, r.get(3)?, r.get(4)?, r.get(5)?)?,
                ))
            })?;
        delivery.headers = headers::decode(&hdrs);
        leased.push(delivery);
    }
    Ok(leased)
}

pub(crate) fn record_attempt(conn: &Connection, result: &AttemptResult) -> rusqlite::Result<()> {
    let now = result.started_at.plus(result.latency);
    let (state, next_at) = match result.next {
        AttemptNext::Delivered => (DeliveryState::Delivered, None),
        AttemptNext::RetryAt(at) => (DeliveryState::Pending, Some(at.0)),
        AttemptNext::DeadLetter => (DeliveryState::Dead, None),
        AttemptNext::Wait(until) => {
            // Not an attempt: nothing to number or record, only the row to put off.
            conn.prepare_cached(RECORD_WAIT)?.execute(params![
                result.delivery.0,
                until.0,
                now.0,
                result.owner,
                result.lease_until.map(|t| t.0)
            ])?;
            return Ok(());
        }
    };
    // One statement, one visit to the row: the attempt always counts in the numbering, and it
    // moves the delivery only while it is pending and leased to the attempt's owner (or to
    // nobody).
    let number: Option<i64> = conn
        .prepare_cached(RECORD_ATTEMPT)?
        .query_row(
            params![
                result.delivery.0,
                state.as_str(),
                next_at,
                result.error,
                now.0,
                result.owner,
                result.token.0,
                result.lease_until.map(|t| t.0)
            ],
            |r| r.get(0),
        )
        .optional()?;
    // A delivery purged meanwhile has nothing to record against, and a repeat of the attempt
    // recorded last nothing to add.
    let Some(number) = number else {
        return Ok(());
    };
    conn.prepare_cached(
        "INSERT INTO attempts (delivery_id, number, started_at, status, latency_ms, error)
         VALUES (?1, ?2, ?3, ?4, ?5, ?6)",
    )?
    .execute(params![
        result.delivery.0,
        number,
        result.started_at.0,
        result.status,
        result.latency.as_millis() as i64,
        result.error
    ])?;
    Ok(())
}

/// Whether an attempt moves its delivery: it is pending and under the lease the attempt was
/// made under, the attempt's owner's (`?6`) ending at `?8`. An attempt that names no lease
/// (`?8` `NULL`) compares the owner alone, and a row under no lease takes it too. Read from
/// the row as it was before the update, as every `SET` expression is.
macro_rules! attempt_moves {
    () => {
        "(state = 'pending' AND ((lease_owner = ?6 AND lease_until = ?8) OR (?8 IS NULL AND (lease_owner IS NULL OR lease_owner = ?6))))"
    };
}

/// [`record_attempt`]'s update: `?1` the delivery, `?2` its new state, `?3` the next attempt's
/// time (kept when `NULL`), `?4` the error (kept when `NULL`), `?5` now, `?6` the owner, `?7`
/// the attempt's token: a row whose last recorded attempt had this token already is left as it
/// is ([`hooklatch_core::store::AttemptToken`]); `?8` the end of the attempt's lease.
const RECORD_ATTEMPT: &str = concat!(
    "UPDATE deliveries SET total_attempts = total_attempts + 1, attempt_token = ?7, ",
    "state = CASE WHEN ",
    attempt_moves!(),
    " THEN ?2 ELSE state END, ",
    "attempts = CASE WHEN ",
    attempt_moves!(),
    " THEN attempts + 1 ELSE attempts END, ",
    "next_attempt_at = CASE WHEN ",
    attempt_moves!(),
    " THEN COALESCE(?3, next_attempt_at) ELSE next_attempt_at END, ",
    "lease_owner = CASE WHEN ",
    attempt_moves!(),
    " THEN NULL ELSE lease_owner END, ",
    "lease_until = CASE WHEN ",
    attempt_moves!(),
    " THEN NULL ELSE lease_until END, ",
    "last_error = CASE WHEN ",
    attempt_moves!(),
    " THEN COALESCE(?4, last_error) ELSE last_error END, ",
    "updated_at = CASE WHEN ",
    attempt_moves!(),
    " THEN ?5 ELSE updated_at END ",
    "WHERE id = ?1 AND attempt_token IS NOT ?7 RETURNING total_attempts"
);

/// A delivery that was not attempted ([`AttemptNext::Wait`]): `?1` the delivery, due again at
/// `?2`, its lease released, `?3` now, `?4` the owner, `?5` the end of its lease. It moves the
/// row under the same guard as an attempt (`attempt_moves!`), and touches no attempt count and
/// no error.
const RECORD_WAIT: &str = "UPDATE deliveries
    SET next_attempt_at = ?2, lease_owner = NULL, lease_until = NULL, updated_at = ?3
    WHERE id = ?1 AND state = 'pending'
      AND ((lease_owner = ?4 AND lease_until = ?5)
        OR (?5 IS NULL AND (lease_owner IS NULL OR lease_owner = ?4)))";

/// Makes `destination`'s pending rows that nobody holds a running lease on due at `now`,
/// where they were due later; returns how many it moved. Such a row is ready after `now`, so
/// like [`release_leases`] this reads only the rows ready later in the ready index (waiting,
/// backing off or leased), never the backlog that is due.
pub(crate) fn wake_destination(
    conn: &Connection,
    destination: &str,
    now: Timestamp,
) -> rusqlite::Result<u64> {
    let moved = conn
        .prepare_cached(WAKE_DESTINATION)?
        .execute(params![now.0, destination])?;
    Ok(moved as u64)
}

const WAKE_DESTINATION: &str = concat!(
    "UPDATE deliveries SET next_attempt_at = ?1, updated_at = ?1 WHERE id IN (
        SELECT id FROM deliveries INDEXED BY deliveries_ready
        WHERE state = 'pending' AND ",
    ready_at!(),
    " > ?1 AND destination = ?2 AND next_attempt_at > ?1
          AND (lease_owner IS NULL OR lease_until <= ?1))"
);

/// Makes the held rows ([`HELD`]) of every destination not disabled due at `now`, but a row
/// under a running lease; returns how many it moved. Held rows sort last in the ready index, so
/// this reads them alone: a long backlog that is due, or one waiting out its retries, is not
/// read.
pub(crate) fn wake_held(conn: &Connection, now: Timestamp) -> rusqlite::Result<u64> {
    let moved = conn
        .prepare_cached(WAKE_HELD)?
        .execute(params![now.0, HELD.0])?;
    Ok(moved as u64)
}

const WAKE_HELD: &str = concat!(
    "UPDATE deliveries SET next_attempt_at = ?1, updated_at = ?1 WHERE id IN (
        SELECT id FROM deliveries INDEXED BY deliveries_ready
        WHERE state = 'pending' AND ",
    ready_at!(),
    " >= ?2 AND next_attempt_at >= ?2
          AND (lease_owner IS NULL OR lease_until <= ?1)
          AND destination NOT IN (SELECT destination FROM disabled_destinations))"
);

/// Disables a destination; `false` when it was disabled already (its first reason is kept).
pub(crate) fn disable_destination(
    conn: &Connection,
    disabled: &DisabledDestination,
) -> rusqlite::Result<bool> {
    let added = conn
        .prepare_cached(
            "INSERT INTO disabled_destinations (destination, disabled_at, reason)
             VALUES (?1, ?2, ?3) ON CONFLICT (destination) DO NOTHING",
        )?
        .execute(params![
            disabled.destination,
            disabled.disabled_at.0,
            disabled.reason
        ])?;
    Ok(added > 0)
}

/// Enables a destination and wakes its waiting rows ([`wake_destination`]); `None` when it was
/// not disabled.
pub(crate) fn enable_destination(
    conn: &Connection,
    destination: &str,
    now: Timestamp,
) -> rusqlite::Result<Option<u64>> {
    let removed = conn
        .prepare_cached("DELETE FROM disabled_destinations WHERE destination = ?1")?
        .execute(params![destination])?;
    if removed == 0 {
        return Ok(None);
    }
    wake_destination(conn, destination, now).map(Some)
}

/// Every disabled destination, by name.
pub(crate) fn disabled_destinations(
    conn: &Connection,
) -> rusqlite::Result<Vec<DisabledDestination>> {
    let mut stmt = conn.prepare_cached(
        "SELECT destination, disabled_at, reason FROM disabled_destinations ORDER BY destination",
    )?;
    let rows = stmt.query_map([], |r| {
        Ok(DisabledDestination {
            destination: r.get(0)?,
            disabled_at: Timestamp(r.get(1)?),
            reason: r.get(2)?,
        })
    })?;
    rows.collect()
}

/// Gives back `owner`'s leases still running at `now` (a graceful shutdown). Like
/// [`release_every_lease`], it reads only the rows ready after `now` in the ready index, never
/// the backlog that is due; a lease that has ended needs no release.
pub(crate) fn release_leases(
    conn: &Connection,
    owner: &str,
    now: Timestamp,
) -> rusqlite::Result<()> {
    conn.execute(RELEASE_LEASES, rusqlite::params![now.0, owner])?;
    Ok(())
}

const RELEASE_LEASES: &str = concat!(
    "UPDATE deliveries SET lease_owner = NULL, lease_until = NULL WHERE id IN (
        SELECT id FROM deliveries INDEXED BY deliveries_ready
        WHERE state = 'pending' AND lease_owner = ?2 AND ",
    ready_at!(),
    " > ?1)"
);

/// Gives back every lease still running at `now`, whoever holds it: for a gateway that has just
/// taken the file for itself ([`crate::serving`]), every such lease belongs to a process that
/// is gone. Leased rows sort after `now` in the ready index, so this reads only them and the
/// retries scheduled later, never the backlog that is due. Returns the rows released.
pub(crate) fn release_every_lease(conn: &Connection, now: Timestamp) -> rusqlite::Result<usize> {
    conn.execute(RELEASE_EVERY_LEASE, [now.0])
}

const RELEASE_EVERY_LEASE: &str = concat!(
    "UPDATE deliveries SET lease_owner = NULL, lease_until = NULL WHERE id IN (
        SELECT id FROM deliveries INDEXED BY deliveries_ready
        WHERE state = 'pending' AND lease_owner IS NOT NULL AND ",
    ready_at!(),
    " > ?1)"
);

/// The earliest time a pending row can be taken: one probe of the ready index.
pub(crate) fn next_due(conn: &Connection) -> rusqlite::Result<Option<Timestamp>> {
    conn.prepare_cached(NEXT_DUE)?
        .query_row([], |r| r.get::<_, i64>(0))
        .optional()
        .map(|v| v.map(Timestamp))
}

const NEXT_DUE: &str = concat!(
    "SELECT ",
    ready_at!(),
    " FROM deliveries INDEXED BY deliveries_ready WHERE state = 'pending' ORDER BY ",
    ready_at!(),
    " LIMIT 1"
);

pub(crate) fn redrive(
    conn: &Connection,
    id: DeliveryId,
    now: Timestamp,
) -> rusqlite::Result<Redrive> {
    let state: Option<String> = conn
        .query_row("SELECT state FROM deliveries WHERE id = ?1", [id.0], |r| {
            r.get(0)
        })
        .optional()?;
    let Some(state) = state else {
        return Ok(Redrive::NotFound);
    };
    let state = DeliveryState::parse(&state).unwrap_or(DeliveryState::Pending);
    if state != DeliveryState::Dead {
        return Ok(Redrive::NotDead(state));
    }
    conn.execute(
        "UPDATE deliveries SET state = 'pending', attempts = 0, next_attempt_at = ?2, round_started_at = ?2,
            lease_owner = NULL, lease_until = NULL, updated_at = ?2
         WHERE id = ?1",
        params![id.0, now.0],
    )?;
    Ok(Redrive::Queued)
}

pub(crate) fn redeliver(
    conn: &Connection,
    request: RequestId,
    destinations: &[String],
    now: Timestamp,
) -> rusqlite::Result<Redelivery> {
    let row: Option<(String, String, String)> = conn
        .query_row(
            "SELECT source, verdict, keys FROM requests WHERE id = ?1",
            [request.0],
            |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)),
        )
        .optional()?;
    let Some((source, verdict, keys)) = row else {
        return Ok(Redelivery::NotFound);
    };
    let verdict = Verdict::parse(&verdict).unwrap_or(Verdict::Rejected);
    let keys: Vec<String> = serde_json::from_str(&keys).unwrap_or_default();
    if keys.is_empty() || matches!(verdict, Verdict::Rejected | Verdict::Handshake) {
        return Ok(Redelivery::NothingToRedeliver(verdict));
    }
    if verdict == Verdict::Conflict {
        let decided: (Option<String>, Option<i64>, Option<String>) = conn.query_row(
            "SELECT decision, decided_at, decision_reason FROM requests WHERE id = ?1",
            [request.0],
            |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)),
        )?;
        match ConflictDecision::from_columns(decided.0.as_deref(), decided.1, decided.2) {
            Some(d) if d.action == ConflictAction::Dismissed => {
                return Ok(Redelivery::Dismissed(d))
            }
            Some(_) => {}
            None => {
                conn.execute(
                    "UPDATE requests SET decision = 'released', decided_at = ?2 WHERE id = ?1",
                    params![request.0, now.0],
                )?;
            }
        }
    }
    let mut queued = Vec::with_capacity(keys.len() * destinations.len());
    for key in &keys {
        // The event type as the first delivery of this event recorded it.
        let event_type: Option<String> = conn
            .query_row(
                "SELECT event_type FROM deliveries WHERE source = ?1 AND event_key = ?2
                 ORDER BY id LIMIT 1",
                params![source, key],
                |r| r.get(0),
            )
            .optional()?
            .flatten();
        let idempotency_key = redelivery_key(&source, key, verdict, request);
        for destination in destinations {
            conn.execute(
                "INSERT INTO deliveries (request_id, source, event_key, event_type, destination,
                    idempotency_key, state, received_at, round_started_at, next_attempt_at, updated_at)
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6, 'pending', ?7, ?7, ?7, ?7)",
                params![
                    request.0,
                    source,
                    key,
                    event_type,
                    destination,
                    idempotency_key,
                    now.0
                ],
            )?;
            queued.push(DeliveryId(conn.last_insert_rowid()));
        }
    }
    Ok(Redelivery::Queued(queued))
}

#[cfg(test)]
mod tests {
    use rusqlite::Connection;

    use super::{
        LEASE_DUE, NEXT_DUE, RECORD_WAIT, RELEASE_EVERY_LEASE, RELEASE_LEASES, WAKE_DESTINATION,
    };

    fn plan(sql: &str, params: impl rusqlite::Params) -> String {
        let conn = Connection::open_in_memory().expect("an in-memory database");
        crate::schema::migrate(&conn).expect("the schema");
        let mut plan = conn
            .prepare(&format!("EXPLAIN QUERY PLAN {sql}"))
            .expect("the statement prepares");
        let steps: Vec<String> = plan
            .query_map(params, |r| r.get(3))
            .expect("a plan")
            .collect::<rusqlite::Result<_>>()
            .expect("plan rows");
        steps.join("\n")
    }

    #[test]
    fn leasing_walks_the_ready_index_and_sorts_nothing() {
        let plan = plan(LEASE_DUE, rusqlite::params!["w", 2, 1, 8]);
        assert!(plan.contains("USING INDEX deliveries_ready"), "{plan}");
        assert!(
            !plan.contains("TEMP B-TREE"),
            "a lease must not sort the backlog: {plan}"
        );
    }

    #[test]
    fn the_next_due_time_is_one_index_probe() {
        let plan = plan(NEXT_DUE, []);
        assert!(plan.contains("USING INDEX deliveries_ready"), "{plan}");
        assert!(!plan.contains("TEMP B-TREE"), "{plan}");
    }

    #[test]
    fn releasing_leases_reads_only_rows_ready_later() {
        for plan in [
            plan(RELEASE_EVERY_LEASE, rusqlite::params![1]),
            plan(RELEASE_LEASES, rusqlite::params![1, "w"]),
        ] {
            assert!(plan.contains("USING INDEX deliveries_ready"), "{plan}");
            assert!(!plan.contains("SCAN deliveries"), "{plan}");
        }
    }

    #[test]
    fn waking_a_destination_reads_only_rows_ready_later() {
        let plan = plan(WAKE_DESTINATION, rusqlite::params![1, "app"]);
        assert!(plan.contains("USING INDEX deliveries_ready"), "{plan}");
        assert!(!plan.contains("SCAN deliveries"), "{plan}");
    }

    #[test]
    fn a_wait_finds_its_row_by_id() {
        let plan = plan(RECORD_WAIT, rusqlite::params![1, 2, 3, "w", 4]);
        assert!(plan.contains("INTEGER PRIMARY KEY"), "{plan}");
    }

    #[test]
    fn the_index_is_on_the_expression_the_statements_use() {
        let schema = crate::schema::MIGRATIONS.concat();
        assert!(schema.contains(concat!("deliveries (", ready_at!(), ")")));
    }
}
