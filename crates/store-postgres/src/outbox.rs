//! The outbox, shared by the workers of every instance: leasing due deliveries, recording
//! attempts, releasing leases, waking a destination's deliveries, redrive and deliberate
//! redelivery.
//!
//! A lease is `(lease_owner, lease_until)` on a pending row. `lease_due` picks due rows with
//! `FOR UPDATE SKIP LOCKED`, so concurrent leasers on any instance skip the rows another is
//! taking instead of waiting for them or taking them twice; a row whose lease is still running
//! is not due. A worker (or instance) that dies holding a lease loses it when `lease_until`
//! passes, and any instance takes the row over; a worker that stops cleanly gives it back at
//! once. Each call here is one statement or one short transaction, and none waits on the claim
//! locks ingest takes; a delivery attempt (with the worker's next lease, one statement) runs
//! inside a group commit ([`crate::writer`]), several of them in one statement when they
//! share a batch; the rest runs on a pooled connection of its own.
//!
//! Statements that make rows due now (redrive, redelivery, released leases, a woken
//! destination) also `NOTIFY hooklatch_work`, delivered on commit, so idle workers everywhere
//! wake up.

use std::sync::LazyLock;
use std::time::Duration;

use bytes::Bytes;
use hooklatch_core::store::{
    redelivery_key, AttemptNext, AttemptResult, ConflictAction, ConflictDecision, DeliveryState,
    DisabledDestination, LeasedDelivery, Redelivery, Redrive, Verdict, HELD,
};
use hooklatch_core::{DeliveryId, IdempotencyKey, RequestId, Timestamp};
use sqlx::{PgConnection, PgPool, Row};

use hooklatch_core::headers;

use crate::{ingest, simple, WORK_CHANNEL};

/// A CTE `due`: the ids of up to `limit` pending rows whose time (the later of their next
/// attempt and their lease's end) has come by the time in parameter `$now`, earliest first,
/// locked, skipping rows another leaser holds; `and` narrows it further.
fn due(now: u8, limit: &str, and: &str) -> String {
    format!(
        "due AS (
            SELECT id FROM deliveries
            WHERE state = 'pending' AND GREATEST(next_attempt_at, COALESCE(lease_until, 0)) <= ${now}
              {and}
            ORDER BY GREATEST(next_attempt_at, COALESCE(lease_until, 0)), id
            LIMIT {limit}
            FOR UPDATE SKIP LOCKED)"
    )
}

/// Takes the rows of a CTE `due` (ids): leases them to the owner in parameter `$owner` until
/// the time in `$until`, and selects each with its request, as [`leased_delivery`] reads it.
fn leased(owner: u8, until: u8) -> String {
    format!(
        "leased AS (
            UPDATE deliveries d SET lease_owner = ${owner}, lease_until = ${until}
            FROM due WHERE d.id = due.id
            RETURNING d.id, d.request_id, d.source, d.event_key, d.event_type, d.destination,
                d.idempotency_key, d.attempts, d.round_started_at, d.next_attempt_at)
         SELECT l.id, l.request_id, l.source, l.event_key, l.event_type, l.destination,
            l.idempotency_key, l.attempts, l.round_started_at, r.headers, r.body, r.method,
            r.path
         FROM leased l JOIN requests r ON r.id = l.request_id
         ORDER BY l.next_attempt_at, l.id"
    )
}

pub(crate) async fn lease_due(
    conn: impl sqlx::PgExecutor<'_>,
    owner: &str,
    now: Timestamp,
    lease: Duration,
    limit: u32,
) -> Result<Vec<LeasedDelivery>, sqlx::Error> {
    let until = now.plus(lease);
    // In READ COMMITTED, a row another leaser committed after this statement's snapshot is
    // re-checked under its lock (its new lease_until fails the test) and dropped, so a row is
    // never handed to two live leases.
    static LEASE_DUE: LazyLock<String> =
        LazyLock::new(|| format!("WITH {}, {}", due(3, "$4", ""), leased(1, 2)));
    let rows = sqlx::query(&LEASE_DUE)
        .bind(owner)
        .bind(until.0)
        .bind(now.0)
        .bind(i64::from(limit))
        .fetch_all(conn)
        .await?;
    rows.iter().map(|row| leased_delivery(row, until)).collect()
}

/// A row of [`leased`]'s final `SELECT`, leased until `until`.
fn leased_delivery(
    r: &sqlx::postgres::PgRow,
    until: Timestamp,
) -> Result<LeasedDelivery, sqlx::Error> {
    Ok(LeasedDelivery {
        id: DeliveryId(r.try_get(0)?),
        request_id: RequestId(r.try_get(1)?),
        source: r.try_get(2)?,
        event_key: r.try_get(3)?,
        event_type: r.try_get(4)?,
        destination: r.try_get(5)?,
        idempotency_key: IdempotencyKey::from_stored(r.try_get(6)?),
        attempts: count(r.try_get(7)?),
        round_started_at: Timestamp(r.try_get(8)?),
        method: r.try_get(11)?,
        path: r.try_get(12)?,
        headers: headers::decode(r.try_get(9)?),
        body: Bytes::from(r.try_get::<Vec<u8>, _>(10)?),
        lease_until: Some(until),
    })
}

/// Whether an attempt may move its delivery: still pending, and under the lease the attempt
/// was made under, the attempt's owner's (`$2`) ending at `$until`. An attempt that names no
/// lease (`NULL`) compares the owner alone, and a row under no lease takes it too. Column
/// references read the row's latest version, under the row lock the update holds.
fn movable(until: u8) -> String {
    format!(
        "(state = 'pending' AND ((lease_owner = $2 AND lease_until = ${until})
            OR (${until}::bigint IS NULL AND (lease_owner IS NULL OR lease_owner = $2))))"
    )
}

/// The attempt's row update, as a CTE `moved`: counts the attempt in `total_attempts` even when
/// it may not move the row, and moves the row only when [`movable`] (`$11`, the attempt's
/// lease); and none of it when the row's last recorded attempt had this one's token, `$10` (a
/// repeat: `AttemptToken`). That test reads the row's latest version too: a repeat that
/// waited for its first's lock finds the first's token.
static MOVED: LazyLock<String> = LazyLock::new(|| {
    let m = movable(11);
    format!(
        "moved AS (
            UPDATE deliveries SET
                total_attempts = total_attempts + 1,
                attempt_token = $10,
                state = CASE WHEN {m} THEN $3 ELSE state END,
                attempts = CASE WHEN {m} THEN attempts + 1 ELSE attempts END,
                next_attempt_at = CASE WHEN {m} THEN COALESCE($4, next_attempt_at)
                    ELSE next_attempt_at END,
                lease_owner = CASE WHEN {m} THEN NULL ELSE lease_owner END,
                lease_until = CASE WHEN {m} THEN NULL ELSE lease_until END,
                last_error = CASE WHEN {m} THEN COALESCE($5, last_error) ELSE last_error END,
                updated_at = CASE WHEN {m} THEN $6 ELSE updated_at END
            WHERE id = $1 AND attempt_token IS DISTINCT FROM $10
            RETURNING id, total_attempts)"
    )
});

/// The attempt's own row, numbered by `total_attempts` (a delivery purged meanwhile updates no
/// row in `moved`, and so records nothing).
const INSERT_ATTEMPT: &str =
    "INSERT INTO attempts (delivery_id, number, started_at, status, latency_ms, error)
         SELECT id, total_attempts, $7, $8, $9, $5 FROM moved";

/// Records an attempt and, when [`movable`], moves the delivery, in one statement.
static RECORD_ATTEMPT: LazyLock<String> =
    LazyLock::new(|| format!("WITH {} {INSERT_ATTEMPT}", *MOVED));

/// Records an attempt, moves its delivery, and leases the worker's next due delivery, in one
/// statement (one round trip instead of two). The sub-statements share one snapshot, in which
/// the attempt's own delivery is still leased (so not due); it is also excluded by id, since
/// one statement must not update a row twice. `$12`: the new lease's end, `$13`: now.
static RECORD_ATTEMPT_AND_LEASE: LazyLock<String> = LazyLock::new(|| {
    format!(
        "WITH {moved}, recorded AS ({INSERT_ATTEMPT}), {due}, {leased}",
        moved = *MOVED,
        due = due(13, "1", "AND id <> $1"),
        leased = leased(2, 12)
    )
});

/// A delivery that was not attempted ([`AttemptNext::Wait`]), as a CTE `waited`: due again
/// at `$3`, its lease released, `$4` now, when [`movable`] (`$5`, the end of its lease). No
/// attempt is counted or recorded.
static WAITED: LazyLock<String> = LazyLock::new(|| {
    format!(
        "waited AS (
            UPDATE deliveries SET next_attempt_at = $3, lease_owner = NULL, lease_until = NULL,
                updated_at = $4
            WHERE id = $1 AND {m}
            RETURNING id)",
        m = movable(5)
    )
});

static RECORD_WAIT: LazyLock<String> =
    LazyLock::new(|| format!("WITH {} SELECT count(*) FROM waited", *WAITED));

/// [`RECORD_WAIT`], then the worker's next lease, as [`RECORD_ATTEMPT_AND_LEASE`] does it
/// (the waited row, still leased in the statement's snapshot, is excluded by id too). `$6`:
/// the new lease's end, `$7`: now.
static RECORD_WAIT_AND_LEASE: LazyLock<String> = LazyLock::new(|| {
    format!(
        "WITH {waited}, {due}, {leased}",
        waited = *WAITED,
        due = due(7, "1", "AND id <> $1"),
        leased = leased(2, 6)
    )
});

/// Binds a wait's `$1`–`$5` (see [`WAITED`]).
fn bind_wait<'q>(
    query: sqlx::query::Query<'q, sqlx::Postgres, sqlx::postgres::PgArguments>,
    result: &'q AttemptResult,
    until: Timestamp,
) -> sqlx::query::Query<'q, sqlx::Postgres, sqlx::postgres::PgArguments> {
    query
        .bind(result.delivery.0)
        .bind(&result.owner)
        .bind(until.0)
        .bind(result.started_at.plus(result.latency).0)
        .bind(result.lease_until.map(|t| t.0))
}

/// The state an attempt moves its delivery to, and when it is due next (a retry, or the end
/// of a wait, which stays pending).
fn next_state(result: &AttemptResult) -> (DeliveryState, Option<i64>) {
    match result.next {
        AttemptNext::Delivered => (DeliveryState::Delivered, None),
        AttemptNext::RetryAt(at) | AttemptNext::Wait(at) => (DeliveryState::Pending, Some(at.0)),
        AttemptNext::DeadLetter => (DeliveryState::Dead, None),
    }
}

/// Binds an attempt's `$1`–`$11` (see [`MOVED`] and [`INSERT_ATTEMPT`]).
fn bind_attempt<'q>(
    query: sqlx::query::Query<'q, sqlx::Postgres, sqlx::postgres::PgArguments>,
    result: &'q AttemptResult,
) -> sqlx::query::Query<'q, sqlx::Postgres, sqlx::postgres::PgArguments> {
    let (state, next_at) = next_state(result);
    let now = result.started_at.plus(result.latency);
    query
        .bind(result.delivery.0)
        .bind(&result.owner)
        .bind(state.as_str())
        .bind(next_at)
        .bind(result.error.as_deref().map(ingest::text))
        .bind(now.0)
        .bind(result.started_at.0)
        .bind(result.status.map(i32::from))
        .bind(i64::try_from(result.latency.as_millis()).unwrap_or(i64::MAX))
        .bind(result.token.0)
        .bind(result.lease_until.map(|t| t.0))
}

pub(crate) async fn record_attempt(
    conn: impl sqlx::PgExecutor<'_>,
    result: &AttemptResult,
) -> Result<(), sqlx::Error> {
    let query = match result.next {
        AttemptNext::Wait(until) => bind_wait(sqlx::query(&RECORD_WAIT), result, until),
        _ => bind_attempt(sqlx::query(&RECORD_ATTEMPT), result),
    };
    query.execute(conn).await?;
    Ok(())
}

/// [`record_attempt`], then the worker's next lease ([`lease_due`] of one row), in one
/// statement.
pub(crate) async fn record_attempt_and_lease(
    conn: impl sqlx::PgExecutor<'_>,
    result: &AttemptResult,
    now: Timestamp,
    lease: Duration,
) -> Result<Option<LeasedDelivery>, sqlx::Error> {
    let query = match result.next {
        AttemptNext::Wait(until) => bind_wait(sqlx::query(&RECORD_WAIT_AND_LEASE), result, until),
        _ => bind_attempt(sqlx::query(&RECORD_ATTEMPT_AND_LEASE), result),
    };
    let until = now.plus(lease);
    let row = query.bind(until.0).bind(now.0).fetch_optional(conn).await?;
    row.as_ref()
        .map(|row| leased_delivery(row, until))
        .transpose()
}

/// [`record_attempt_and_lease`] for many workers' attempts in one statement: each attempt is
/// recorded (and moves its delivery when [`movable`]), and each worker is leased one due
/// delivery, if there is one. Answers in the order given.
///
/// The deliveries attempted must be distinct (one statement updates a row once). Leases go
/// to due rows by the earliest `now` of the batch, none of them an attempted delivery (in the
/// statement's snapshot they are still leased), the earliest due to the first attempt.
pub(crate) async fn record_attempts_and_lease_many(
    conn: &mut PgConnection,
    attempts: &[(&AttemptResult, Timestamp, Duration)],
) -> Result<Vec<Option<LeasedDelivery>>, sqlx::Error> {
    let n = attempts.len();
    let mut delivery = Vec::with_capacity(n);
    let mut owner = Vec::with_capacity(n);
    let mut state = Vec::with_capacity(n);
    let mut next_at = Vec::with_capacity(n);
    let mut error = Vec::with_capacity(n);
    let mut updated_at = Vec::with_capacity(n);
    let mut started_at = Vec::with_capacity(n);
    let mut status = Vec::with_capacity(n);
    let mut latency_ms = Vec::with_capacity(n);
    let mut until = Vec::with_capacity(n);
    let mut waits = Vec::with_capacity(n);
    let mut tokens = Vec::with_capacity(n);
    let mut attempt_lease = Vec::with_capacity(n);
    for (result, now, lease) in attempts {
        let (moved_to, at) = next_state(result);
        let wait = matches!(result.next, AttemptNext::Wait(_));
        delivery.push(result.delivery.0);
        owner.push(result.owner.as_str());
        state.push(moved_to.as_str());
        next_at.push(at);
        // A wait's error is ignored: the last error stays as it was.
        error.push(
            result
                .error
                .as_deref()
                .filter(|_| !wait)
                .map(|e| ingest::text(e).into_owned()),
        );
        waits.push(wait);
        tokens.push(result.token.0);
        attempt_lease.push(result.lease_until.map(|t| t.0));
        updated_at.push(result.started_at.plus(result.latency).0);
        started_at.push(result.started_at.0);
        status.push(result.status.map(i32::from));
        latency_ms.push(i64::try_from(result.latency.as_millis()).unwrap_or(i64::MAX));
        until.push(now.plus(*lease).0);
    }
    let now = attempts.iter().map(|(_, now, _)| now.0).min().unwrap_or(0);
    let rows = sqlx::query(&RECORD_ATTEMPTS_AND_LEASE)
        .bind(&delivery)
        .bind(&owner)
        .bind(&state)
        .bind(&next_at)
        .bind(&error)
        .bind(&updated_at)
        .bind(&started_at)
        .bind(&status)
        .bind(&latency_ms)
        .bind(&until)
        .bind(now)
        .bind(n as i64)
        .bind(&waits)
        .bind(&tokens)
        .bind(&attempt_lease)
        .fetch_all(&mut *conn)
        .await?;
    let mut leased: Vec<Option<LeasedDelivery>> = (0..n).map(|_| None).collect();
    for row in &rows {
        let k: i64 = row.try_get(13)?;
        if let Some(i) = usize::try_from(k - 1).ok().filter(|i| *i < n) {
            leased[i] = Some(leased_delivery(row, Timestamp(until[i]))?);
        }
    }
    Ok(leased)
}

/// The statement of [`record_attempts_and_lease_many`]: [`MOVED`] and [`INSERT_ATTEMPT`] over
/// arrays (`$1`–`$9` as there, one element per attempt; `$10` each lease's end; `$13` whether
/// it is a [`AttemptNext::Wait`], which moves its row as [`WAITED`] does and is neither
/// counted nor recorded; `$14` each attempt's token, whose repeat changes nothing; `$15` the
/// end of the lease each attempt was made under, as [`movable`]'s), then up
/// to `$12` due rows (by `$11`, now) numbered and leased to the attempts' owners in order.
///
/// `d.id = ANY($1)` beside the join with the arrays lets the planner walk the primary key:
/// without it, the join was planned as a scan of the whole table once the table grew, and a
/// sequence of loads on one database slowed down cell after cell (1 KB at c=64: 3,426–4,279
/// req/s against 5,247–5,381 without the batched statement, and 6,864–6,884 with this).
static RECORD_ATTEMPTS_AND_LEASE: LazyLock<String> = LazyLock::new(|| {
    let m =
        "(d.state = 'pending' AND ((d.lease_owner = u.owner AND d.lease_until = u.attempt_lease)
        OR (u.attempt_lease IS NULL AND (d.lease_owner IS NULL OR d.lease_owner = u.owner))))";
    format!(
        "WITH u AS (
            SELECT * FROM unnest($1::bigint[], $2::text[], $3::text[], $4::bigint[],
                $5::text[], $6::bigint[], $7::bigint[], $8::int[], $9::bigint[], $10::bigint[],
                $13::bool[], $14::bigint[], $15::bigint[])
                WITH ORDINALITY AS u (delivery, owner, state, next_at, error, updated_at,
                    started_at, status, latency_ms, until, wait, token, attempt_lease, k)),
         moved AS (
            UPDATE deliveries d SET
                total_attempts = CASE WHEN u.wait THEN d.total_attempts
                    ELSE d.total_attempts + 1 END,
                attempt_token = CASE WHEN u.wait THEN d.attempt_token ELSE u.token END,
                state = CASE WHEN {m} THEN u.state ELSE d.state END,
                attempts = CASE WHEN {m} AND NOT u.wait THEN d.attempts + 1 ELSE d.attempts END,
                next_attempt_at = CASE WHEN {m} THEN COALESCE(u.next_at, d.next_attempt_at)
                    ELSE d.next_attempt_at END,
                lease_owner = CASE WHEN {m} THEN NULL ELSE d.lease_owner END,
                lease_until = CASE WHEN {m} THEN NULL ELSE d.lease_until END,
                last_error = CASE WHEN {m} THEN COALESCE(u.error, d.last_error)
                    ELSE d.last_error END,
                updated_at = CASE WHEN {m} THEN u.updated_at ELSE d.updated_at END
            FROM u WHERE d.id = u.delivery AND d.id = ANY($1)
              AND (u.wait OR d.attempt_token IS DISTINCT FROM u.token)
            RETURNING d.id, d.total_attempts, u.k),
         recorded AS (
            INSERT INTO attempts (delivery_id, number, started_at, status, latency_ms, error)
            SELECT m.id, m.total_attempts, u.started_at, u.status, u.latency_ms, u.error
            FROM moved m JOIN u ON u.k = m.k WHERE NOT u.wait),
         {due},
         numbered AS (
            SELECT id, row_number() OVER (ORDER BY ready, id) AS k FROM due),
         leased AS (
            UPDATE deliveries d SET lease_owner = u.owner, lease_until = u.until
            FROM numbered nb JOIN u ON u.k = nb.k WHERE d.id = nb.id
            RETURNING d.id, d.request_id, d.source, d.event_key, d.event_type, d.destination,
                d.idempotency_key, d.attempts, d.round_started_at, d.next_attempt_at, nb.k)
         SELECT l.id, l.request_id, l.source, l.event_key, l.event_type, l.destination,
            l.idempotency_key, l.attempts, l.round_started_at, r.headers, r.body, r.method,
            r.path, l.k
         FROM leased l JOIN requests r ON r.id = l.request_id",
        due = "due AS (
            SELECT id, GREATEST(next_attempt_at, COALESCE(lease_until, 0)) AS ready
            FROM deliveries
            WHERE state = 'pending' AND GREATEST(next_attempt_at, COALESCE(lease_until, 0)) <= $11
              AND id <> ALL($1)
            ORDER BY GREATEST(next_attempt_at, COALESCE(lease_until, 0)), id
            LIMIT $12
            FOR UPDATE SKIP LOCKED)"
    )
});

/// Gives back the owner's leases still running at `now`. A running lease sorts after `now`
/// in the ready index, so this reads only leased rows and the retries scheduled later, never
/// the backlog that is due (there is no index of leased rows: every lease would write an
/// entry into it). A lease already ended needs no release: its row is takeable.
pub(crate) async fn release_leases(
    pool: &PgPool,
    owner: &str,
    now: Timestamp,
) -> Result<(), sqlx::Error> {
    sqlx::query(&format!(
        "WITH released AS (
            UPDATE deliveries SET lease_owner = NULL, lease_until = NULL
            WHERE state = 'pending' AND GREATEST(next_attempt_at, COALESCE(lease_until, 0)) > $2
              AND lease_owner = $1
            RETURNING 1)
         SELECT pg_notify('{WORK_CHANNEL}', '')::text FROM (SELECT 1 FROM released LIMIT 1) AS any_released"
    ))
    .bind(owner)
    .bind(now.0)
    .execute(pool)
    .await?;
    Ok(())
}

/// Makes `destination`'s pending rows that nobody holds a running lease on due at `now`,
/// where they were due later, and `NOTIFY`s the workers when it moved any; returns how many.
/// Such a row is ready after `now`, so like [`release_leases`] this reads only the rows ready
/// later in the ready index, never the backlog that is due.
pub(crate) async fn wake_destination(
    pool: &PgPool,
    destination: &str,
    now: Timestamp,
) -> Result<u64, sqlx::Error> {
    let row = sqlx::query(&format!(
        "WITH woken AS (
            UPDATE deliveries SET next_attempt_at = $2, updated_at = $2
            WHERE state = 'pending' AND GREATEST(next_attempt_at, COALESCE(lease_until, 0)) > $2
              AND destination = $1 AND next_attempt_at > $2
              AND (lease_owner IS NULL OR lease_until <= $2)
            RETURNING 1)
         SELECT count(*), CASE WHEN count(*) > 0 THEN pg_notify('{WORK_CHANNEL}', '')::text END
         FROM woken"
    ))
    .bind(destination)
    .bind(now.0)
    .fetch_one(pool)
    .await?;
    Ok(u64::try_from(row.try_get::<i64, _>(0)?).unwrap_or(0))
}

/// Makes the held rows ([`HELD`]) of every destination not disabled due at `now`, but a row
/// under a running lease, and `NOTIFY`s the workers when it moved any; returns how many. Held
/// rows sort last in the ready index, so this reads them alone.
pub(crate) async fn wake_held(pool: &PgPool, now: Timestamp) -> Result<u64, sqlx::Error> {
    let row = sqlx::query(&format!(
        "WITH woken AS (
            UPDATE deliveries SET next_attempt_at = $1, updated_at = $1
            WHERE state = 'pending' AND GREATEST(next_attempt_at, COALESCE(lease_until, 0)) >= $2
              AND next_attempt_at >= $2
              AND (lease_owner IS NULL OR lease_until <= $1)
              AND destination NOT IN (SELECT destination FROM disabled_destinations)
            RETURNING 1)
         SELECT count(*), CASE WHEN count(*) > 0 THEN pg_notify('{WORK_CHANNEL}', '')::text END
         FROM woken"
    ))
    .bind(now.0)
    .bind(HELD.0)
    .fetch_one(pool)
    .await?;
    Ok(u64::try_from(row.try_get::<i64, _>(0)?).unwrap_or(0))
}

pub(crate) async fn disable_destination(
    pool: &PgPool,
    disabled: &DisabledDestination,
) -> Result<bool, sqlx::Error> {
    let added = sqlx::query(
        "INSERT INTO disabled_destinations (destination, disabled_at, reason)
         VALUES ($1, $2, $3) ON CONFLICT (destination) DO NOTHING",
    )
    .bind(&disabled.destination)
    .bind(disabled.disabled_at.0)
    .bind(&disabled.reason)
    .execute(pool)
    .await?;
    Ok(added.rows_affected() > 0)
}

/// Enables a destination and wakes its waiting rows as [`wake_destination`] does, in one
/// statement: every instance that reads the table after it sees both or neither.
pub(crate) async fn enable_destination(
    pool: &PgPool,
    destination: &str,
    now: Timestamp,
) -> Result<Option<u64>, sqlx::Error> {
    let row = sqlx::query(&format!(
        "WITH enabled AS (
            DELETE FROM disabled_destinations WHERE destination = $1 RETURNING 1),
         woken AS (
            UPDATE deliveries SET next_attempt_at = $2, updated_at = $2
            WHERE EXISTS (SELECT 1 FROM enabled)
              AND state = 'pending' AND GREATEST(next_attempt_at, COALESCE(lease_until, 0)) > $2
              AND destination = $1 AND next_attempt_at > $2
              AND (lease_owner IS NULL OR lease_until <= $2)
            RETURNING 1)
         SELECT (SELECT count(*) FROM enabled), count(*),
                CASE WHEN count(*) > 0 THEN pg_notify('{WORK_CHANNEL}', '')::text END
         FROM woken"
    ))
    .bind(destination)
    .bind(now.0)
    .fetch_one(pool)
    .await?;
    if row.try_get::<i64, _>(0)? == 0 {
        return Ok(None);
    }
    Ok(Some(u64::try_from(row.try_get::<i64, _>(1)?).unwrap_or(0)))
}

pub(crate) async fn disabled_destinations(
    pool: &PgPool,
) -> Result<Vec<DisabledDestination>, sqlx::Error> {
    let rows = sqlx::query(
        "SELECT destination, disabled_at, reason FROM disabled_destinations ORDER BY destination",
    )
    .fetch_all(pool)
    .await?;
    rows.iter()
        .map(|r| {
            Ok(DisabledDestination {
                destination: r.try_get(0)?,
                disabled_at: Timestamp(r.try_get(1)?),
                reason: r.try_get(2)?,
            })
        })
        .collect()
}

pub(crate) async fn next_due(pool: &PgPool) -> Result<Option<Timestamp>, sqlx::Error> {
    // The first entry of the ready index: leased rows count from the end of their lease.
    let row = sqlx::query(
        "SELECT GREATEST(next_attempt_at, COALESCE(lease_until, 0)) FROM deliveries
         WHERE state = 'pending'
         ORDER BY GREATEST(next_attempt_at, COALESCE(lease_until, 0)), id
         LIMIT 1",
    )
    .fetch_optional(pool)
    .await?;
    row.map(|r| r.try_get::<i64, _>(0).map(Timestamp))
        .transpose()
}

pub(crate) async fn redrive(
    pool: &PgPool,
    id: DeliveryId,
    now: Timestamp,
) -> Result<Redrive, sqlx::Error> {
    // The request row is share-locked: a purge removing it (and this delivery) at the same
    // moment either finishes first (then the delivery is gone) or waits for this redrive (and
    // then sees a pending delivery and keeps the request).
    let queued = sqlx::query(&format!(
        "WITH queued AS (
            UPDATE deliveries d SET state = 'pending', attempts = 0, next_attempt_at = $2,
                round_started_at = $2, lease_owner = NULL, lease_until = NULL, updated_at = $2
            WHERE d.id = $1 AND d.state = 'dead'
              AND EXISTS (SELECT 1 FROM requests r WHERE r.id = d.request_id FOR KEY SHARE)
            RETURNING d.id)
         SELECT q.id, pg_notify('{WORK_CHANNEL}', '')::text FROM queued q"
    ))
    .bind(id.0)
    .bind(now.0)
    .fetch_optional(pool)
    .await?;
    if queued.is_some() {
        return Ok(Redrive::Queued);
    }
    let state: Option<String> = sqlx::query("SELECT state FROM deliveries WHERE id = $1")
        .bind(id.0)
        .fetch_optional(pool)
        .await?
        .map(|r| r.try_get(0))
        .transpose()?;
    Ok(match state.as_deref().map(DeliveryState::parse) {
        None => Redrive::NotFound,
        // Dead, but its request is gone: it is being purged.
        Some(Some(DeliveryState::Dead)) => Redrive::NotFound,
        Some(state) => Redrive::NotDead(state.unwrap_or(DeliveryState::Pending)),
    })
}

pub(crate) async fn redeliver(
    conn: &mut PgConnection,
    request: RequestId,
    destinations: &[String],
    now: Timestamp,
) -> Result<Redelivery, sqlx::Error> {
    // Key-share lock: a concurrent purge cannot remove the request while deliveries are added.
    let row = sqlx::query("SELECT source, verdict, keys FROM requests WHERE id = $1 FOR KEY SHARE")
        .bind(request.0)
        .fetch_optional(&mut *conn)
        .await?;
    let Some(row) = row else {
        return Ok(Redelivery::NotFound);
    };
    let source: String = row.try_get(0)?;
    let verdict = Verdict::parse(row.try_get(1)?).unwrap_or(Verdict::Rejected);
    let keys: Vec<String> = row.try_get(2)?;
    if keys.is_empty() || matches!(verdict, Verdict::Rejected | Verdict::Handshake) {
        return Ok(Redelivery::NothingToRedeliver(verdict));
    }
    if verdict == Verdict::Conflict {
        // The first decision stands. An update reads the row's latest version, so a dismissal
        // committed meanwhile is seen here and the release refused.
        let row = sqlx::query(
            "UPDATE requests SET decision = COALESCE(decision, 'released'),
                                 decided_at = COALESCE(decided_at, $2)
             WHERE id = $1 RETURNING decision, decided_at, decision_reason",
        )
        .bind(request.0)
        .bind(now.0)
        .fetch_one(&mut *conn)
        .await?;
        let decided = ConflictDecision::from_columns(
            row.try_get::<Option<&str>, _>(0)?,
            row.try_get(1)?,
            row.try_get(2)?,
        );
        if let Some(d) = decided.filter(|d| d.action == ConflictAction::Dismissed) {
            return Ok(Redelivery::Dismissed(d));
        }
    }
    let mut queued = Vec::with_capacity(keys.len() * destinations.len());
    for key in &keys {
        // The event type as the event's first delivery recorded it: one of this request's own
        // deliveries, or of the request holding the key's claim (this one was a duplicate).
        let event_type: Option<String> = sqlx::query(
            "SELECT event_type FROM deliveries
             WHERE request_id IN ($3, (SELECT request_id FROM claims WHERE source = $1 AND key = $2))
               AND source = $1 AND event_key = $2
             ORDER BY id LIMIT 1",
        )
        .bind(&source)
        .bind(key)
        .bind(request.0)
        .fetch_optional(&mut *conn)
        .await?
        .map(|r| r.try_get::<Option<String>, _>(0))
        .transpose()?
        .flatten();
        let idempotency_key = redelivery_key(&source, key, verdict, request);
        queued.extend(
            ingest::insert_deliveries(
                conn,
                request,
                &source,
                key,
                event_type.as_deref(),
                &idempotency_key,
                destinations,
                now,
                None,
            )
            .await?,
        );
    }
    if !queued.is_empty() {
        simple(conn, &format!("NOTIFY {WORK_CHANNEL}")).await?;
    }
    Ok(Redelivery::Queued(queued))
}

/// An attempt count as stored (never negative).
pub(crate) fn count(n: i32) -> u32 {
    u32::try_from(n).unwrap_or(0)
}
