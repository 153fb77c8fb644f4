//! Tables and migrations, embedded in the binary.
//!
//! `hooklatch_schema_version` holds one row per applied migration. `migrate` runs in one
//! transaction under a transaction-scoped advisory lock, so several instances starting at once
//! take turns: the first applies what is missing, the others find it done. DDL is
//! transactional in PostgreSQL, so a failed migration leaves nothing half-applied.
//!
//! The schema mirrors the SQLite store's: times are milliseconds since the Unix epoch
//! (`BIGINT`), bodies and headers are `BYTEA` (headers in the `headers` module's encoding), and
//! the claims table's primary key `(source, key)` is the unique constraint that decides which
//! copy of an event is first — across every instance sharing the database. Tables are created
//! unqualified, in the first schema of the connection's `search_path`.

use sqlx::{Connection, PgConnection, Row};

use crate::simple;

/// Each entry moves the schema one version up. Never edit one that has shipped: add another.
const MIGRATIONS: &[&str] = &[
    r#"
CREATE TABLE requests (
    id             BIGINT  GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    received_at    BIGINT  NOT NULL,
    source         TEXT    NOT NULL,
    method         TEXT    NOT NULL,
    path           TEXT    NOT NULL,
    peer           TEXT,
    headers        BYTEA   NOT NULL,
    body           BYTEA   NOT NULL,
    body_truncated BOOLEAN NOT NULL DEFAULT false,
    verdict        TEXT    NOT NULL,
    reason         TEXT,
    status         INTEGER NOT NULL,
    keys           TEXT[]  NOT NULL DEFAULT '{}'
);
CREATE INDEX requests_source ON requests (source, id);
CREATE INDEX requests_verdict ON requests (verdict, id);
CREATE INDEX requests_received ON requests (received_at);

-- Which requests carried a key, for the history filter by key.
CREATE TABLE request_keys (
    key        TEXT   NOT NULL,
    request_id BIGINT NOT NULL,
    PRIMARY KEY (key, request_id)
);
CREATE INDEX request_keys_request ON request_keys (request_id);

CREATE TABLE claims (
    source      TEXT   NOT NULL,
    key         TEXT   NOT NULL,
    body_sha256 BYTEA  NOT NULL,
    request_id  BIGINT NOT NULL,
    claimed_at  BIGINT NOT NULL,
    expires_at  BIGINT NOT NULL,
    PRIMARY KEY (source, key)
);
CREATE INDEX claims_expiry ON claims (expires_at);
-- The purge keeps a request while a claim points at it.
CREATE INDEX claims_request ON claims (request_id);

-- The outbox. A lease is (lease_owner, lease_until), both set or both null.
CREATE TABLE deliveries (
    id               BIGINT  GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    request_id       BIGINT  NOT NULL,
    source           TEXT    NOT NULL,
    event_key        TEXT    NOT NULL,
    event_type       TEXT,
    destination      TEXT    NOT NULL,
    idempotency_key  TEXT    NOT NULL,
    state            TEXT    NOT NULL,
    attempts         INTEGER NOT NULL DEFAULT 0,
    total_attempts   INTEGER NOT NULL DEFAULT 0,
    received_at      BIGINT  NOT NULL,
    round_started_at BIGINT  NOT NULL,
    next_attempt_at  BIGINT  NOT NULL,
    lease_owner      TEXT,
    lease_until      BIGINT,
    last_error       TEXT,
    updated_at       BIGINT  NOT NULL
);
-- Leasing walks due rows in order; only pending rows are in it.
CREATE INDEX deliveries_due ON deliveries (next_attempt_at, id) WHERE state = 'pending';
-- Releasing an owner's leases, and next_due over leased rows: only rows in flight.
CREATE INDEX deliveries_leased ON deliveries (lease_owner) WHERE lease_owner IS NOT NULL;
CREATE INDEX deliveries_request ON deliveries (request_id);
CREATE INDEX deliveries_state ON deliveries (state, id);

CREATE TABLE attempts (
    delivery_id BIGINT  NOT NULL,
    number      INTEGER NOT NULL,
    started_at  BIGINT  NOT NULL,
    status      INTEGER,
    latency_ms  BIGINT  NOT NULL,
    error       TEXT,
    PRIMARY KEY (delivery_id, number)
);
"#,
    // 2: pending rows ordered by when they are next takeable — their due time, or the end of the
    // lease they are under, whichever is later — as in the SQLite store. A lease then starts at a
    // takeable row instead of stepping over (and reading) every row leased ahead of it, and the
    // earliest due time is the index's first entry.
    r#"
DROP INDEX deliveries_due;
CREATE INDEX deliveries_ready
    ON deliveries ((GREATEST(next_attempt_at, COALESCE(lease_until, 0))), id)
    WHERE state = 'pending';
"#,
    // 3: as in the SQLite store, `request_keys` no longer repeats what a claim says: a request
    // whose event it claimed is found through the claim, and only the other requests carrying a
    // key are listed. When a claim is replaced or purged, its request keeps its key here.
    r#"
CREATE FUNCTION hooklatch_claim_keeps_key() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'UPDATE' THEN
        IF OLD.request_id <> NEW.request_id THEN
            INSERT INTO request_keys (key, request_id) VALUES (OLD.key, OLD.request_id)
                ON CONFLICT DO NOTHING;
        END IF;
        RETURN NEW;
    END IF;
    INSERT INTO request_keys (key, request_id)
        SELECT OLD.key, OLD.request_id WHERE EXISTS (SELECT 1 FROM requests WHERE id = OLD.request_id)
        ON CONFLICT DO NOTHING;
    RETURN OLD;
END $$;
CREATE TRIGGER claims_replaced AFTER UPDATE OF request_id ON claims
    FOR EACH ROW EXECUTE FUNCTION hooklatch_claim_keeps_key();
CREATE TRIGGER claims_removed AFTER DELETE ON claims
    FOR EACH ROW EXECUTE FUNCTION hooklatch_claim_keeps_key();
"#,
    // 4: bodies and headers of more than about 2 KB are compressed as they are stored;
    // PostgreSQL's own method (pglz) was 5 % of the server's CPU at full load, and lz4 is
    // several times faster (ingest +3–12 %, same minutes). On a server without lz4 (built
    // without it, or before PostgreSQL 14) the columns keep the default.
    r#"
DO $$
BEGIN
    EXECUTE 'ALTER TABLE requests ALTER COLUMN body SET COMPRESSION lz4,
                                  ALTER COLUMN headers SET COMPRESSION lz4';
EXCEPTION WHEN feature_not_supported OR syntax_error THEN
    RAISE NOTICE 'lz4 is not available here: request bodies keep the default compression';
END $$;
"#,
    // 5: fewer index entries per event. A delivery row is updated at its lease and at its
    // attempt, and each update changes indexed columns, so PostgreSQL writes a new entry for it
    // into every index of the table (no heap-only update). The index of leased rows served only
    // an instance's release of its own leases at shutdown, which now reads the ready index
    // (leased rows sort after "now" in it); the index of every row by state served the history
    // filter and the outbox counts, which read pending rows through the ready index and dead
    // rows through an index of dead rows alone. Requests are filtered by verdict through an
    // index without the accepted ones, which are most of them: a filter on `accepted` walks the
    // primary key. Counted in the WAL (`pg_walinspect`, 20,000 events of 2 KB): a backlog's
    // drain wrote 8.5 index entries per event before, 6.0 after, and 19 % fewer WAL bytes;
    // ingest alone 10.5 per request before, 8.7 after.
    r#"
DROP INDEX deliveries_leased;
DROP INDEX deliveries_state;
CREATE INDEX deliveries_dead ON deliveries (id) WHERE state = 'dead';
DROP INDEX requests_verdict;
CREATE INDEX requests_verdict ON requests (verdict, id) WHERE verdict <> 'accepted';
"#,
    // 6: destinations whose deliveries are held, by a `410 Gone` from them or an operator.
    r#"
CREATE TABLE disabled_destinations (
    destination TEXT   PRIMARY KEY,
    disabled_at BIGINT NOT NULL,
    reason      TEXT   NOT NULL
);
"#,
    // 7: an operator's decision about a conflict (released or dismissed), on its request.
    r#"
ALTER TABLE requests ADD COLUMN decision TEXT,
                     ADD COLUMN decided_at BIGINT,
                     ADD COLUMN decision_reason TEXT;
"#,
    // 8: an empty table the readiness probe writes into, and rolls back, once the database
    // was found full: out of line and uncompressed, so the write needs new room on disk.
    r#"
CREATE TABLE room_probe (pad TEXT NOT NULL);
ALTER TABLE room_probe ALTER COLUMN pad SET STORAGE EXTERNAL;
"#,
    // 9: as in the SQLite store, the token of the last attempt recorded on each delivery, so
    // that recording an attempt again changes nothing (`hooklatch_core::store::AttemptToken`).
    // No default: adding the column rewrites nothing.
    r#"
ALTER TABLE deliveries ADD COLUMN attempt_token BIGINT;
"#,
];

/// The schema version this build writes.
pub const VERSION: i64 = MIGRATIONS.len() as i64;

/// The advisory lock key migrations hold ("hooklatc" in ASCII), one per database.
const MIGRATION_LOCK: i64 = 0x686f_6f6b_6c61_7463;

/// Why [`migrate`] failed.
#[derive(Debug, thiserror::Error)]
pub(crate) enum MigrateError {
    /// The database was migrated by a newer hooklatch.
    #[error(
        "database schema version {found} is newer than this hooklatch ({VERSION}); upgrade hooklatch"
    )]
    Newer {
        /// The version found.
        found: i64,
    },
    /// PostgreSQL failed.
    #[error(transparent)]
    Sql(#[from] sqlx::Error),
}

/// Brings the database up to [`VERSION`]; refuses a database written by a newer build. Safe to
/// run from several instances at once: they queue on the advisory lock.
/// Returns the version found (0 for a database hooklatch never used).
/// The schema's version in the database, 0 when it has none yet; reads, changes nothing.
pub(crate) async fn current(conn: &mut PgConnection) -> Result<i64, sqlx::Error> {
    let exists: bool = sqlx::query("SELECT to_regclass('hooklatch_schema_version') IS NOT NULL")
        .fetch_one(&mut *conn)
        .await?
        .try_get(0)?;
    if !exists {
        return Ok(0);
    }
    sqlx::query("SELECT COALESCE(max(version), 0) FROM hooklatch_schema_version")
        .fetch_one(&mut *conn)
        .await?
        .try_get(0)
}

pub(crate) async fn migrate(conn: &mut PgConnection) -> Result<i64, MigrateError> {
    let mut tx = conn.begin().await?;
    // Waiting for another instance's migration is expected: not bounded by the wait limit.
    simple(&mut tx, "SET LOCAL lock_timeout = 0").await?;
    sqlx::query("SELECT pg_advisory_xact_lock($1)")
        .bind(MIGRATION_LOCK)
        .execute(&mut *tx)
        .await?;
    simple(
        &mut tx,
        "CREATE TABLE IF NOT EXISTS hooklatch_schema_version (
            version    BIGINT      PRIMARY KEY,
            applied_at TIMESTAMPTZ NOT NULL DEFAULT now()
        )",
    )
    .await?;
    let current: i64 =
        sqlx::query("SELECT COALESCE(max(version), 0) FROM hooklatch_schema_version")
            .fetch_one(&mut *tx)
            .await?
            .try_get(0)?;
    if current > VERSION {
        return Err(MigrateError::Newer { found: current });
    }
    for (i, sql) in MIGRATIONS.iter().enumerate().skip(current as usize) {
        let version = i as i64 + 1;
        simple(&mut tx, sql).await?;
        sqlx::query("INSERT INTO hooklatch_schema_version (version) VALUES ($1)")
            .bind(version)
            .execute(&mut *tx)
            .await?;
        tracing::info!(version, "postgres: schema migrated");
    }
    tx.commit().await?;
    Ok(current)
}
