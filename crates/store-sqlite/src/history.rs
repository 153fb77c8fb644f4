//! History queries (requests, deliveries, attempts), counts, and the purge.

use hooklatch_core::store::{
    AttemptRecord, ConflictAction, ConflictDecision, DeliveryDetail, DeliveryFilter, DeliveryState,
    Dismissal, OutboxCounts, RequestDetail, RequestFilter, RequestSummary, StoreStats, Verdict,
};
use hooklatch_core::{DeliveryId, RequestId, Timestamp};
use rusqlite::types::Value;
use rusqlite::{params, params_from_iter, Connection, OptionalExtension, Row};

use hooklatch_core::headers;

use crate::body;

/// Rows removed per purge transaction.
pub(crate) const PURGE_BATCH: u64 = 1000;

/// The columns [`summary`] reads (the decision's three by name); a query's own columns follow
/// from index 11.
const SUMMARY_COLUMNS: &str =
    "id, received_at, source, verdict, reason, status, keys, COALESCE(body_length, length(body)),
     decision, decided_at, decision_reason";

fn summary(r: &Row<'_>) -> rusqlite::Result<RequestSummary> {
    let verdict: String = r.get(3)?;
    let keys: String = r.get(6)?;
    Ok(RequestSummary {
        id: RequestId(r.get(0)?),
        received_at: Timestamp(r.get(1)?),
        source: r.get(2)?,
        verdict: Verdict::parse(&verdict).unwrap_or(Verdict::Rejected),
        reason: r.get(4)?,
        status: r.get(5)?,
        keys: serde_json::from_str(&keys).unwrap_or_default(),
        body_len: r.get::<_, i64>(7)? as u64,
        decision: ConflictDecision::from_columns(
            r.get::<_, Option<String>>("decision")?.as_deref(),
            r.get("decided_at")?,
            r.get("decision_reason")?,
        ),
    })
}

/// The sources that hold claims, one primary-key probe each (a loose index scan), so a key
/// is looked up in each source's claims without reading the rest. Ends with a `NULL` row.
const CLAIM_SOURCES: &str = "WITH RECURSIVE claim_sources(name) AS (
        SELECT min(source) FROM claims
        UNION ALL
        SELECT (SELECT min(source) FROM claims WHERE source > name)
        FROM claim_sources WHERE name IS NOT NULL)
    ";

/// Records an operator's dismissal of a conflict, unless it was decided before.
pub(crate) fn dismiss_conflict(
    conn: &Connection,
    request: RequestId,
    reason: Option<&str>,
    now: Timestamp,
) -> rusqlite::Result<Dismissal> {
    let row = conn
        .query_row(
            "SELECT verdict, decision, decided_at, decision_reason FROM requests WHERE id = ?1",
            [request.0],
            |r| {
                let verdict: String = r.get(0)?;
                let decided = ConflictDecision::from_columns(
                    r.get::<_, Option<String>>(1)?.as_deref(),
                    r.get(2)?,
                    r.get(3)?,
                );
                Ok((verdict, decided))
            },
        )
        .optional()?;
    let Some((verdict, decided)) = row else {
        return Ok(Dismissal::NotFound);
    };
    let verdict = Verdict::parse(&verdict).unwrap_or(Verdict::Rejected);
    if verdict != Verdict::Conflict {
        return Ok(Dismissal::NotAConflict(verdict));
    }
    if let Some(earlier) = decided {
        return Ok(Dismissal::Decided(earlier));
    }
    conn.execute(
        "UPDATE requests SET decision = 'dismissed', decided_at = ?2, decision_reason = ?3
         WHERE id = ?1",
        params![request.0, now.0, reason],
    )?;
    Ok(Dismissal::Dismissed(ConflictDecision {
        action: ConflictAction::Dismissed,
        at: now,
        reason: reason.map(str::to_owned),
    }))
}

/// Conflicts nobody released or dismissed, read through the index of verdicts.
pub(crate) fn undecided_conflicts(conn: &Connection) -> rusqlite::Result<u64> {
    conn.query_row(
        "SELECT count(*) FROM requests
         WHERE verdict = 'conflict' AND verdict <> 'accepted' AND decision IS NULL",
        [],
        |r| r.get::<_, i64>(0),
    )
    .map(|n| n as u64)
}

pub(crate) fn list_requests(
    conn: &Connection,
    filter: &RequestFilter,
) -> rusqlite::Result<Vec<RequestSummary>> {
    let (sql, args) = requests_query(filter);
    let mut stmt = conn.prepare(&sql)?;
    let rows = stmt.query_map(params_from_iter(args), summary)?;
    rows.collect()
}

/// The statement behind [`list_requests`] and its arguments.
fn requests_query(filter: &RequestFilter) -> (String, Vec<Value>) {
    let mut sql = String::new();
    if filter.key.is_some() {
        sql.push_str(CLAIM_SOURCES);
    }
    sql.push_str(&format!(
        "SELECT {SUMMARY_COLUMNS} FROM requests WHERE 1 = 1"
    ));
    let mut args: Vec<Value> = Vec::new();
    if let Some(source) = &filter.source {
        sql.push_str(" AND source = ?");
        args.push(Value::Text(source.clone()));
    }
    if let Some(verdict) = filter.verdict {
        // A literal (the enum's fixed name), not a parameter. The index of verdicts leaves out
        // `accepted` (schema 5), and SQLite uses a partial index only where the query repeats
        // its `WHERE` term word for word.
        sql.push_str(&format!(" AND verdict = '{}'", verdict.as_str()));
        if verdict != Verdict::Accepted {
            sql.push_str(" AND verdict <> 'accepted'");
        }
    }
    if let Some(key) = &filter.key {
        // The request each source's claim of the key points at, and the others that carry it.
        sql.push_str(
            " AND id IN (SELECT request_id FROM request_keys WHERE key = ?
                UNION ALL
                SELECT c.request_id FROM claim_sources s
                JOIN claims c ON c.source = s.name AND c.key = ?)",
        );
        args.push(Value::Text(key.clone()));
        args.push(Value::Text(key.clone()));
    }
    if let Some(since) = filter.since {
        sql.push_str(" AND received_at >= ?");
        args.push(Value::Integer(since.0));
    }
    if let Some(until) = filter.until {
        sql.push_str(" AND received_at < ?");
        args.push(Value::Integer(until.0));
    }
    if let Some(before) = filter.before {
        sql.push_str(" AND id < ?");
        args.push(Value::Integer(before.0));
    }
    sql.push_str(" ORDER BY id DESC LIMIT ?");
    args.push(Value::Integer(i64::from(filter.limit)));
    (sql, args)
}

pub(crate) fn get_request(
    conn: &Connection,
    id: RequestId,
) -> rusqlite::Result<Option<RequestDetail>> {
    let detail = conn
        .query_row(
            &format!(
                "SELECT {SUMMARY_COLUMNS}, method, path, peer, headers, body, body_truncated,
                    body_codec, body_length
                 FROM requests WHERE id = ?1"
            ),
            [id.0],
            |r| {
                Ok(RequestDetail {
                    summary: summary(r)?,
                    method: r.get(11)?,
                    path: r.get(12)?,
                    peer: r.get(13)?,
                    headers: headers::decode(&r.get::<_, Vec<u8>>(14)?),
                    body: body::decode(15, r.get(15)?, r.get(17)?, r.get(18)?)?,
                    body_truncated: r.get(16)?,
                    deliveries: Vec::new(),
                })
            },
        )
        .optional()?;
    let Some(mut detail) = detail else {
        return Ok(None);
    };
    let mut stmt = conn.prepare(&format!(
        "SELECT {DELIVERY_COLUMNS} FROM deliveries WHERE request_id = ?1 ORDER BY id"
    ))?;
    let deliveries = stmt
        .query_map([id.0], delivery)?
        .collect::<rusqlite::Result<Vec<_>>>()?;
    detail.deliveries = with_attempts(conn, deliveries)?;
    Ok(Some(detail))
}

const DELIVERY_COLUMNS: &str = "id, request_id, destination, idempotency_key, state, attempts,
    next_attempt_at, last_error";

fn delivery(r: &Row<'_>) -> rusqlite::Result<DeliveryDetail> {
    let state: String = r.get(4)?;
    let state = DeliveryState::parse(&state).unwrap_or(DeliveryState::Pending);
    Ok(DeliveryDetail {
        id: DeliveryId(r.get(0)?),
        request_id: RequestId(r.get(1)?),
        destination: r.get(2)?,
        idempotency_key: r.get(3)?,
        state,
        attempts: r.get(5)?,
        next_attempt_at: (state == DeliveryState::Pending)
            .then(|| Timestamp(r.get(6).unwrap_or(0))),
        last_error: r.get(7)?,
        history: Vec::new(),
    })
}

fn with_attempts(
    conn: &Connection,
    mut deliveries: Vec<DeliveryDetail>,
) -> rusqlite::Result<Vec<DeliveryDetail>> {
    let mut stmt = conn.prepare_cached(
        "SELECT number, started_at, status, latency_ms, error FROM attempts
         WHERE delivery_id = ?1 ORDER BY number",
    )?;
    for delivery in &mut deliveries {
        delivery.history = stmt
            .query_map([delivery.id.0], |r| {
                Ok(AttemptRecord {
                    number: r.get(0)?,
                    started_at: Timestamp(r.get(1)?),
                    status: r.get(2)?,
                    latency_ms: r.get::<_, i64>(3)? as u64,
                    error: r.get(4)?,
                })
            })?
            .collect::<rusqlite::Result<Vec<_>>>()?;
    }
    Ok(deliveries)
}

/// How many of the newest deliveries (below the listing's cursor) a listing of pending ones
/// looks through first ([`newest_pending_query`]).
const PENDING_WINDOW: i64 = 2_000;

pub(crate) fn list_deliveries(
    conn: &Connection,
    filter: &DeliveryFilter,
) -> rusqlite::Result<Vec<DeliveryDetail>> {
    if filter.state == Some(DeliveryState::Pending) {
        let found = deliveries_where(conn, newest_pending_query(filter))?;
        if found.len() >= filter.limit as usize {
            return with_attempts(conn, found);
        }
    }
    let found = deliveries_where(conn, deliveries_query(filter))?;
    with_attempts(conn, found)
}

/// The deliveries a statement and its arguments select.
fn deliveries_where(
    conn: &Connection,
    (sql, args): (String, Vec<Value>),
) -> rusqlite::Result<Vec<DeliveryDetail>> {
    let mut stmt = conn.prepare(&sql)?;
    let found = stmt
        .query_map(params_from_iter(args), delivery)?
        .collect::<rusqlite::Result<Vec<_>>>()?;
    Ok(found)
}

/// A page of pending deliveries found among the [`PENDING_WINDOW`] newest rows below the
/// cursor, walked by id. When that finds a whole page, it is the page: every pending row
/// newer than its last one was in the window. Otherwise the listing reads the ready index
/// ([`deliveries_query`]), which holds every pending row but in the order they are due, so
/// a page sorts all of them: 200 ms for a page among 600,000 pending rows, against 2 ms
/// here. During an outage, when the newest rows are pending, the window finds the page; in
/// calm times, when few rows are pending, the index is small.
fn newest_pending_query(filter: &DeliveryFilter) -> (String, Vec<Value>) {
    let mut args: Vec<Value> = Vec::new();
    let mut newest = format!("SELECT {DELIVERY_COLUMNS} FROM deliveries");
    if let Some(before) = filter.before {
        newest.push_str(" WHERE id < ?");
        args.push(Value::Integer(before.0));
    }
    newest.push_str(&format!(" ORDER BY id DESC LIMIT {PENDING_WINDOW}"));
    let mut sql = format!("SELECT {DELIVERY_COLUMNS} FROM ({newest}) WHERE state = 'pending'");
    if let Some(destination) = &filter.destination {
        sql.push_str(" AND destination = ?");
        args.push(Value::Text(destination.clone()));
    }
    sql.push_str(" ORDER BY id DESC LIMIT ?");
    args.push(Value::Integer(i64::from(filter.limit)));
    (sql, args)
}

/// The statement behind [`list_deliveries`] and its arguments.
fn deliveries_query(filter: &DeliveryFilter) -> (String, Vec<Value>) {
    // Pending rows are read through the ready index and sorted: left to itself SQLite walks
    // the table newest first, through every delivered row above an old pending one.
    let index = match filter.state {
        Some(DeliveryState::Pending) => " INDEXED BY deliveries_ready",
        _ => "",
    };
    let mut sql = format!("SELECT {DELIVERY_COLUMNS} FROM deliveries{index} WHERE 1 = 1");
    let mut args: Vec<Value> = Vec::new();
    if let Some(state) = filter.state {
        // A literal, as for verdicts: dead rows are then read through the index of dead rows
        // alone, and the ready index's `WHERE` is seen to hold (schema 5).
        sql.push_str(&format!(" AND state = '{}'", state.as_str()));
    }
    if let Some(destination) = &filter.destination {
        sql.push_str(" AND destination = ?");
        args.push(Value::Text(destination.clone()));
    }
    if let Some(before) = filter.before {
        sql.push_str(" AND id < ?");
        args.push(Value::Integer(before.0));
    }
    sql.push_str(" ORDER BY id DESC LIMIT ?");
    args.push(Value::Integer(i64::from(filter.limit)));
    (sql, args)
}

pub(crate) fn purge_claims(conn: &Connection, now: Timestamp, limit: u64) -> rusqlite::Result<u64> {
    let n = conn.execute(
        "DELETE FROM claims WHERE (source, key) IN (
            SELECT source, key FROM claims WHERE expires_at <= ?1 LIMIT ?2)",
        params![now.0, limit as i64],
    )?;
    Ok(n as u64)
}

/// Removes old requests whose deliveries are all delivered, with those deliveries' attempts.
/// A request whose event is still claimed is kept: a claim points at its request.
pub(crate) fn purge_requests(
    conn: &Connection,
    before: Timestamp,
    limit: u64,
) -> rusqlite::Result<u64> {
    conn.execute(
        "CREATE TEMP TABLE IF NOT EXISTS purge_ids (id INTEGER PRIMARY KEY)",
        [],
    )?;
    conn.execute("DELETE FROM temp.purge_ids", [])?;
    let n = conn.execute(PURGE_CANDIDATES, params![before.0, limit as i64])?;
    for sql in PURGE_DELETES {
        conn.execute(sql, [])?;
    }
    Ok(n as u64)
}

/// The requests a purge batch removes: old, nothing pending or dead-lettered (a dead delivery
/// stays until an operator retries it), not pointed at by a claim. Oldest
/// first by `received_at`, so that only old requests are read (in id order, a purge with
/// nothing old to remove read every request there is).
const PURGE_CANDIDATES: &str = "INSERT INTO temp.purge_ids (id)
    SELECT r.id FROM requests r
    WHERE r.received_at < ?1
      AND NOT EXISTS (SELECT 1 FROM deliveries d WHERE d.request_id = r.id AND d.state IN ('pending', 'dead'))
      AND NOT EXISTS (SELECT 1 FROM claims c WHERE c.request_id = r.id)
    ORDER BY r.received_at LIMIT ?2";

/// What goes with them, each found by request through an index.
const PURGE_DELETES: [&str; 5] = [
    "DELETE FROM attempts WHERE delivery_id IN
        (SELECT id FROM deliveries WHERE request_id IN (SELECT id FROM temp.purge_ids))",
    "DELETE FROM deliveries WHERE request_id IN (SELECT id FROM temp.purge_ids)",
    "DELETE FROM request_keys WHERE request_id IN (SELECT id FROM temp.purge_ids)",
    "DELETE FROM requests WHERE id IN (SELECT id FROM temp.purge_ids)",
    "DELETE FROM temp.purge_ids",
];

pub(crate) fn stats(conn: &Connection) -> rusqlite::Result<StoreStats> {
    let outbox = outbox_counts(conn)?;
    let claims: i64 = conn.query_row("SELECT count(*) FROM claims", [], |r| r.get(0))?;
    Ok(StoreStats {
        pending: outbox.pending,
        dead: outbox.dead,
        claims: claims as u64,
    })
}

/// Two partial indexes counted: the ready index (pending rows) and the dead rows' index.
pub(crate) fn outbox_counts(conn: &Connection) -> rusqlite::Result<OutboxCounts> {
    let count = |sql: &str| {
        conn.prepare_cached(sql)?
            .query_row([], |r| r.get::<_, i64>(0))
    };
    Ok(OutboxCounts {
        pending: count(COUNT_PENDING)? as u64,
        dead: count(COUNT_DEAD)? as u64,
    })
}

const COUNT_PENDING: &str = "SELECT count(*) FROM deliveries WHERE state = 'pending'";
const COUNT_DEAD: &str = "SELECT count(*) FROM deliveries WHERE state = 'dead'";

#[cfg(test)]
mod tests {
    use hooklatch_core::store::{DeliveryFilter, DeliveryState, RequestFilter, Verdict};
    use rusqlite::types::Value;
    use rusqlite::{params_from_iter, Connection};

    use super::{
        deliveries_query, list_deliveries, requests_query, COUNT_DEAD, COUNT_PENDING,
        PENDING_WINDOW, PURGE_CANDIDATES, PURGE_DELETES,
    };

    fn migrated() -> Connection {
        let conn = Connection::open_in_memory().expect("an in-memory database");
        crate::schema::migrate(&conn).expect("the schema");
        conn.execute(
            "CREATE TEMP TABLE IF NOT EXISTS purge_ids (id INTEGER PRIMARY KEY)",
            [],
        )
        .expect("the purge's temp table");
        conn
    }

    /// The plan of `sql`, one step a line.
    fn plan(conn: &Connection, sql: &str, args: &[Value]) -> String {
        let mut plan = conn
            .prepare(&format!("EXPLAIN QUERY PLAN {sql}"))
            .expect("the statement prepares");
        let steps: Vec<String> = plan
            .query_map(params_from_iter(args), |r| r.get(3))
            .expect("a plan")
            .collect::<rusqlite::Result<_>>()
            .expect("plan rows");
        steps.join("\n")
    }

    /// Every full scan in `plan` is of one of `allowed` (a table or alias). A scan of a table
    /// that grows with traffic, once per request looked at, is what stopped the writer for
    /// minutes on a store with a million claims.
    #[track_caller]
    fn assert_scans_only(plan: &str, allowed: &[&str]) {
        for step in plan.lines().map(str::trim) {
            if let Some(scanned) = step.strip_prefix("SCAN ") {
                let name = scanned.split_whitespace().next().unwrap_or_default();
                assert!(allowed.contains(&name), "a scan of {name}:\n{plan}");
            }
        }
    }

    #[test]
    fn the_purge_finds_claims_keys_deliveries_and_attempts_by_request() {
        let conn = migrated();
        let args = [Value::Integer(1), Value::Integer(1000)];
        let candidates = plan(&conn, PURGE_CANDIDATES, &args);
        assert!(candidates.contains("claims_request"), "{candidates}");
        assert!(candidates.contains("requests_received"), "{candidates}");
        assert_scans_only(&candidates, &[]);
        for sql in PURGE_DELETES {
            assert_scans_only(&plan(&conn, sql, &[]), &["purge_ids"]);
        }
        let keys = plan(&conn, PURGE_DELETES[2], &[]);
        assert!(keys.contains("request_keys_request"), "{keys}");
    }

    #[test]
    fn the_key_filter_probes_each_source_s_claims_and_scans_no_table() {
        let conn = migrated();
        let (sql, args) = requests_query(&RequestFilter {
            key: Some("evt_1".to_owned()),
            limit: 50,
            ..RequestFilter::default()
        });
        let steps = plan(&conn, &sql, &args);
        assert!(steps.contains("claims"), "{steps}");
        assert!(
            steps.contains("SEARCH requests USING INTEGER PRIMARY KEY"),
            "{steps}"
        );
        assert_scans_only(&steps, &["claim_sources", "s"]);
    }

    /// Every step of `plan` reads an index: no step scans a table's rows.
    #[track_caller]
    fn assert_reads_indexes_only(plan: &str) {
        for step in plan.lines().map(str::trim) {
            if step.starts_with("SCAN ") {
                assert!(step.contains(" USING "), "a table scan:\n{plan}");
            }
        }
    }

    /// Schema 5 keeps only dead rows in an index by state, and only requests that were not
    /// accepted in the index of verdicts: the filters on them still read an index, not every
    /// row there is.
    #[test]
    fn the_state_and_verdict_filters_and_the_counts_read_partial_indexes() {
        let conn = migrated();
        let cases = [
            (DeliveryState::Dead, "deliveries_dead"),
            (DeliveryState::Pending, "deliveries_ready"),
        ];
        for (state, index) in cases {
            let (sql, args) = deliveries_query(&DeliveryFilter {
                state: Some(state),
                limit: 50,
                ..DeliveryFilter::default()
            });
            let steps = plan(&conn, &sql, &args);
            assert!(steps.contains(index), "{state:?}:\n{steps}");
            assert_reads_indexes_only(&steps);
        }
        for verdict in [Verdict::Duplicate, Verdict::Rejected] {
            let (sql, args) = requests_query(&RequestFilter {
                verdict: Some(verdict),
                limit: 50,
                ..RequestFilter::default()
            });
            let steps = plan(&conn, &sql, &args);
            assert!(steps.contains("requests_verdict"), "{verdict:?}:\n{steps}");
            assert_reads_indexes_only(&steps);
        }
        for (sql, index) in [
            (COUNT_PENDING, "deliveries_ready"),
            (COUNT_DEAD, "deliveries_dead"),
        ] {
            let steps = plan(&conn, sql, &[]);
            assert!(steps.contains(index), "{steps}");
        }
    }

    /// Pages of pending deliveries list the newest first, all of them once, whether they are
    /// among the newest rows (found by walking the table by id) or older than thousands of
    /// delivered ones (found through the ready index), with or without a destination.
    #[test]
    fn pages_of_pending_deliveries_list_every_one_newest_first_wherever_they_are() {
        let conn = migrated();
        // 1–10 pending, 11–2,510 delivered, 2,511–2,570 pending; destinations by parity.
        const {
            assert!(
                PENDING_WINDOW < 2500,
                "the old pending rows lie beyond the window"
            )
        };
        conn.execute_batch(
            "WITH RECURSIVE n(id) AS (SELECT 1 UNION ALL SELECT id + 1 FROM n WHERE id < 2570)
             INSERT INTO deliveries (id, request_id, source, event_key, destination,
                 idempotency_key, state, received_at, round_started_at, next_attempt_at,
                 updated_at)
             SELECT id, id, 's', 'k' || id, CASE WHEN id % 2 = 0 THEN 'a' ELSE 'b' END,
                 's:k' || id, CASE WHEN id BETWEEN 11 AND 2510 THEN 'delivered' ELSE 'pending' END,
                 1, 1, 1, 1
             FROM n",
        )
        .expect("deliveries");
        let pending = (2511..=2570).rev().chain((1..=10).rev());
        for destination in [None, Some("a")] {
            let expected: Vec<i64> = pending
                .clone()
                .filter(|id| destination.is_none() || id % 2 == 0)
                .collect();
            let mut listed = Vec::new();
            let mut before = None;
            loop {
                let page = list_deliveries(
                    &conn,
                    &DeliveryFilter {
                        state: Some(DeliveryState::Pending),
                        destination: destination.map(str::to_owned),
                        before,
                        limit: 7,
                    },
                )
                .expect("a page");
                listed.extend(page.iter().map(|d| d.id.0));
                match page.last() {
                    Some(last) if page.len() == 7 => before = Some(last.id),
                    _ => break,
                }
            }
            assert_eq!(listed, expected, "destination {destination:?}");
        }
    }
}
