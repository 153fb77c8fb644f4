//! Tables and migrations. `PRAGMA user_version` holds the schema version; migrations run in
//! order inside one transaction at open.
//!
//! Times are milliseconds since the Unix epoch. The claim table's primary key
//! `(source, key)` is the unique constraint that decides which copy of an event is first.

use rusqlite::Connection;

/// Each entry moves the schema one version up.
pub(crate) const MIGRATIONS: &[&str] = &[
    r#"
CREATE TABLE requests (
    id             INTEGER PRIMARY KEY AUTOINCREMENT,
    received_at    INTEGER NOT NULL,
    source         TEXT    NOT NULL,
    method         TEXT    NOT NULL,
    path           TEXT    NOT NULL,
    peer           TEXT,
    headers        BLOB    NOT NULL,
    body           BLOB    NOT NULL,
    body_truncated INTEGER NOT NULL DEFAULT 0,
    verdict        TEXT    NOT NULL,
    reason         TEXT,
    status         INTEGER NOT NULL,
    keys           TEXT    NOT NULL DEFAULT '[]'
);
CREATE INDEX requests_source ON requests (source, id);
CREATE INDEX requests_verdict ON requests (verdict, id);
CREATE INDEX requests_received ON requests (received_at);

CREATE TABLE request_keys (
    key        TEXT    NOT NULL,
    request_id INTEGER NOT NULL,
    PRIMARY KEY (key, request_id)
) WITHOUT ROWID;

CREATE TABLE claims (
    source      TEXT    NOT NULL,
    key         TEXT    NOT NULL,
    body_sha256 BLOB    NOT NULL,
    request_id  INTEGER NOT NULL,
    claimed_at  INTEGER NOT NULL,
    expires_at  INTEGER NOT NULL,
    PRIMARY KEY (source, key)
) WITHOUT ROWID;
CREATE INDEX claims_expiry ON claims (expires_at);

CREATE TABLE deliveries (
    id              INTEGER PRIMARY KEY AUTOINCREMENT,
    request_id      INTEGER NOT NULL,
    source          TEXT    NOT NULL,
    event_key       TEXT    NOT NULL,
    event_type      TEXT,
    destination     TEXT    NOT NULL,
    idempotency_key TEXT    NOT NULL,
    state           TEXT    NOT NULL,
    attempts        INTEGER NOT NULL DEFAULT 0,
    total_attempts  INTEGER NOT NULL DEFAULT 0,
    received_at     INTEGER NOT NULL,
    round_started_at INTEGER NOT NULL,
    next_attempt_at INTEGER NOT NULL,
    lease_owner     TEXT,
    lease_until     INTEGER,
    last_error      TEXT,
    updated_at      INTEGER NOT NULL
);
CREATE INDEX deliveries_due ON deliveries (next_attempt_at) WHERE state = 'pending';
CREATE INDEX deliveries_request ON deliveries (request_id);
CREATE INDEX deliveries_state ON deliveries (state, id);

CREATE TABLE attempts (
    delivery_id INTEGER NOT NULL,
    number      INTEGER NOT NULL,
    started_at  INTEGER NOT NULL,
    status      INTEGER,
    latency_ms  INTEGER NOT NULL,
    error       TEXT,
    PRIMARY KEY (delivery_id, number)
) WITHOUT ROWID;
"#,
    // 2: pending rows ordered by when they are next takeable — their due time, or the end of the
    // lease they are under, whichever is later. A lease then walks straight to a takeable row
    // instead of stepping over every row leased ahead of it (a table read each; 12 % of the
    // writer's time at full load), and `next_due` is one index probe instead of a scan.
    r#"
DROP INDEX deliveries_due;
CREATE INDEX deliveries_ready ON deliveries (MAX(next_attempt_at, COALESCE(lease_until, 0)))
    WHERE state = 'pending';
"#,
    // 3: the history purge finds claims and request keys by request. Without these indexes it
    // scanned both tables once per candidate request (8.7 s for 100 requests beside a million
    // claims), inside the writer, so ingest stopped while it ran.
    //
    // And `request_keys` no longer repeats what a claim says: a request whose event it claimed
    // is found through the claim, so only the other requests that carry a key (duplicates,
    // conflicts, keys decided by an external key store, imports) are written there, and a
    // request keeps its key when its claim is replaced or purged (the triggers). One random
    // index insert fewer per new event.
    r#"
CREATE INDEX claims_request ON claims (request_id);
CREATE INDEX request_keys_request ON request_keys (request_id);
CREATE TRIGGER claims_replaced AFTER UPDATE OF request_id ON claims
    WHEN old.request_id <> new.request_id
BEGIN
    INSERT OR IGNORE INTO request_keys (key, request_id) VALUES (old.key, old.request_id);
END;
CREATE TRIGGER claims_removed AFTER DELETE ON claims
BEGIN
    INSERT OR IGNORE INTO request_keys (key, request_id)
        SELECT old.key, old.request_id WHERE EXISTS (SELECT 1 FROM requests WHERE id = old.request_id);
END;
"#,
    // 4: bodies compressed at rest (see `body`). Rows written before keep their bodies as they
    // came: codec 0, and no stored length (it is `length(body)`).
    r#"
ALTER TABLE requests ADD COLUMN body_codec INTEGER NOT NULL DEFAULT 0;
ALTER TABLE requests ADD COLUMN body_length INTEGER;
"#,
    // 5: fewer index entries per event. Every new event wrote an entry into the index of
    // deliveries by state, and every attempt that settled a delivery moved it there; every
    // accepted request wrote one into the index of verdicts. Pending rows are counted and
    // listed through the ready index, dead rows through an index of dead rows alone, and only
    // requests that were not accepted are in the verdict index (a filter on `accepted` reads
    // the table newest first, where nearly every row is accepted). The history's filters spell
    // the state and the verdict as literals, which is how SQLite sees that a partial index
    // serves them.
    r#"
DROP INDEX deliveries_state;
CREATE INDEX deliveries_dead ON deliveries (id) WHERE state = 'dead';
DROP INDEX requests_verdict;
CREATE INDEX requests_verdict ON requests (verdict, id) WHERE verdict <> 'accepted';
"#,
    // 6: destinations whose deliveries are held, by a `410 Gone` from them or an operator.
    r#"
CREATE TABLE disabled_destinations (
    destination TEXT    PRIMARY KEY,
    disabled_at INTEGER NOT NULL,
    reason      TEXT    NOT NULL
) WITHOUT ROWID;
"#,
    // 7: an operator's decision about a conflict (released or dismissed), on its request.
    r#"
ALTER TABLE requests ADD COLUMN decision TEXT;
ALTER TABLE requests ADD COLUMN decided_at INTEGER;
ALTER TABLE requests ADD COLUMN decision_reason TEXT;
"#,
    // 8: where a full store's readiness check writes (and removes) a row the size of an
    // event, to see whether new events fit again. Always empty between commits.
    r#"
CREATE TABLE room_probe (pad BLOB NOT NULL);
"#,
    // 9: the token of the last attempt recorded on each delivery, so that recording an attempt
    // again (a worker that did not hear whether its record committed) changes nothing
    // (`hooklatch_core::store::AttemptToken`). Rows written before have none.
    r#"
ALTER TABLE deliveries ADD COLUMN attempt_token INTEGER;
"#,
];

/// The schema version this build writes.
pub const VERSION: i64 = MIGRATIONS.len() as i64;

/// Brings the database up to [`VERSION`]; refuses a database written by a newer build.
/// Returns the version found (0 for a new file).
pub fn migrate(conn: &Connection) -> rusqlite::Result<i64> {
    let current: i64 = conn.pragma_query_value(None, "user_version", |r| r.get(0))?;
    if current > VERSION {
        return Err(rusqlite::Error::InvalidParameterName(format!(
            "database schema version {current} is newer than this hooklatch ({VERSION}); upgrade hooklatch"
        )));
    }
    if current == VERSION {
        return Ok(current);
    }
    conn.execute_batch("BEGIN IMMEDIATE")?;
    let res = (|| {
        for (i, sql) in MIGRATIONS.iter().enumerate().skip(current as usize) {
            conn.execute_batch(sql)?;
            conn.pragma_update(None, "user_version", (i + 1) as i64)?;
        }
        Ok(())
    })();
    match res {
        Ok(()) => conn.execute_batch("COMMIT").map(|()| current),
        Err(e) => {
            let _ = conn.execute_batch("ROLLBACK");
            Err(e)
        }
    }
}

#[cfg(test)]
mod tests {
    use rusqlite::Connection;

    use super::{migrate, MIGRATIONS, VERSION};

    fn indexes(conn: &Connection) -> Vec<String> {
        let mut stmt = conn
            .prepare("SELECT name FROM sqlite_master WHERE type = 'index' AND tbl_name = 'deliveries' ORDER BY name")
            .expect("listing indexes");
        stmt.query_map([], |r| r.get(0))
            .expect("index rows")
            .collect::<rusqlite::Result<_>>()
            .expect("index names")
    }

    /// An in-memory database as a build of schema `version` left it.
    fn at_version(version: usize) -> Connection {
        let conn = Connection::open_in_memory().expect("an in-memory database");
        for sql in &MIGRATIONS[..version] {
            conn.execute_batch(sql).expect("the older versions");
        }
        conn.pragma_update(None, "user_version", version as i64)
            .expect("user_version");
        conn
    }

    #[test]
    fn a_version_1_database_moves_to_the_ready_index_and_keeps_its_rows() {
        let conn = at_version(1);
        conn.execute(
            "INSERT INTO deliveries (request_id, source, event_key, destination, idempotency_key,
                state, received_at, round_started_at, next_attempt_at, updated_at)
             VALUES (1, 's', 'k', 'd', 's:k', 'pending', 5, 5, 5, 5)",
            [],
        )
        .expect("a pending row written by version 1");
        assert!(indexes(&conn).contains(&"deliveries_due".to_owned()));

        migrate(&conn).expect("migrating");
        let version: i64 = conn
            .pragma_query_value(None, "user_version", |r| r.get(0))
            .expect("user_version");
        assert_eq!(version, VERSION);
        let names = indexes(&conn);
        assert!(names.contains(&"deliveries_ready".to_owned()), "{names:?}");
        assert!(!names.contains(&"deliveries_due".to_owned()), "{names:?}");
        let due: i64 = conn
            .query_row(
                "SELECT MAX(next_attempt_at, COALESCE(lease_until, 0)) FROM deliveries
                 INDEXED BY deliveries_ready WHERE state = 'pending'",
                [],
                |r| r.get(0),
            )
            .expect("the row through the new index");
        assert_eq!(due, 5);
    }

    /// Rows written before bodies were compressed keep their bodies as they came, and their
    /// lengths read as `length(body)`.
    #[test]
    fn a_version_3_request_keeps_its_body_as_it_came() {
        let conn = at_version(3);
        conn.execute(
            "INSERT INTO requests (received_at, source, method, path, headers, body, verdict, status)
             VALUES (5, 's', 'POST', '/in/s', x'', x'7b7d', 'accepted', 200)",
            [],
        )
        .expect("a request written by version 3");

        migrate(&conn).expect("migrating");
        let detail = crate::history::get_request(&conn, hooklatch_core::RequestId(1))
            .expect("reading the request")
            .expect("the request");
        assert_eq!(&detail.body[..], b"{}");
        assert_eq!(detail.summary.body_len, 2);
    }

    /// Schema 5 swaps the indexes by state and by verdict for partial ones; a version 4
    /// database keeps its rows, and the history's filters find them through the new indexes.
    #[test]
    fn a_version_4_database_keeps_its_dead_rows_and_verdicts_findable() {
        use hooklatch_core::store::{DeliveryFilter, DeliveryState, RequestFilter, Verdict};

        let conn = at_version(4);
        conn.execute_batch(
            "INSERT INTO requests (received_at, source, method, path, headers, body, verdict, status)
             VALUES (5, 's', 'POST', '/in/s', x'', x'', 'accepted', 200),
                    (6, 's', 'POST', '/in/s', x'', x'', 'rejected', 401);
             INSERT INTO deliveries (request_id, source, event_key, destination, idempotency_key,
                state, received_at, round_started_at, next_attempt_at, updated_at)
             VALUES (1, 's', 'a', 'd', 's:a', 'dead', 5, 5, 5, 5),
                    (1, 's', 'b', 'd', 's:b', 'pending', 5, 5, 5, 5),
                    (1, 's', 'c', 'd', 's:c', 'delivered', 5, 5, 5, 5);",
        )
        .expect("rows written by version 4");

        migrate(&conn).expect("migrating");
        let names = indexes(&conn);
        assert!(names.contains(&"deliveries_dead".to_owned()), "{names:?}");
        assert!(!names.contains(&"deliveries_state".to_owned()), "{names:?}");
        for (state, id) in [
            (DeliveryState::Dead, 1),
            (DeliveryState::Pending, 2),
            (DeliveryState::Delivered, 3),
        ] {
            let found = crate::history::list_deliveries(
                &conn,
                &DeliveryFilter {
                    state: Some(state),
                    limit: 10,
                    ..DeliveryFilter::default()
                },
            )
            .expect("listing deliveries");
            let ids: Vec<i64> = found.iter().map(|d| d.id.0).collect();
            assert_eq!(ids, [id], "{state:?}");
        }
        for (verdict, id) in [(Verdict::Rejected, 2), (Verdict::Accepted, 1)] {
            let found = crate::history::list_requests(
                &conn,
                &RequestFilter {
                    verdict: Some(verdict),
                    limit: 10,
                    ..RequestFilter::default()
                },
            )
            .expect("listing requests");
            let ids: Vec<i64> = found.iter().map(|r| r.id.0).collect();
            assert_eq!(ids, [id], "{verdict:?}");
        }
        let counts = crate::history::outbox_counts(&conn).expect("counting");
        assert_eq!((counts.pending, counts.dead), (1, 1));
    }
}
