//! hooklatch-store-sqlite: the embedded default backend, one SQLite file.
//!
//! Durability: WAL with `synchronous=FULL`, checked on every connection at open; a commit is
//! fsynced before [`Store::ingest`] returns. Throughput: every write goes through one writer
//! thread (`writer`) that takes whatever jobs are waiting and commits them as one transaction
//! (group commit), so one fsync covers many requests. One job's failure does not undo its
//! neighbours: the batch then runs again with each job in its own savepoint.
//!
//! Cancellation: callers hand a job to the writer thread and wait for its reply. A caller whose
//! future is dropped (a provider hung up) only drops the reply; the job still commits or rolls
//! back whole. Reads use a small pool of separate connections, which WAL lets run beside the
//! writer.
//!
//! Layout: [`schema`] creates and migrates tables; `writer` is the group-commit thread and
//! `checkpoint` the thread that copies its WAL pages into the database file;
//! `ingest`, `outbox` and `history` hold the SQL for each part of [`Store`]; `body` compresses
//! request bodies at rest.

mod body;
mod checkpoint;
mod history;
mod ingest;
mod outbox;
#[cfg(test)]
mod recorded;
pub mod schema;
pub mod serving;
mod writer;

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use hooklatch_core::store::{
    AttemptResult, DeliveryDetail, DeliveryFilter, DisabledDestination, Dismissal, FullFlag,
    Ingest, IngestOutcome, LeasedDelivery, OutboxCounts, Purged, Redelivery, Redrive, Rejected,
    RequestDetail, RequestFilter, RequestRecord, RequestSummary, StoreStats,
};
use hooklatch_core::{DeliveryId, RequestId, Store, StoreError, Timestamp};
use rusqlite::{Connection, OpenFlags};

use crate::checkpoint::Checkpointer;
use crate::writer::Writer;

/// How to open the store.
#[derive(Debug, Clone)]
pub struct SqliteOptions {
    /// The database file (created if missing).
    pub path: PathBuf,
    /// Cap on the file's size in pages (`PRAGMA max_page_count`); beyond it writes fail as
    /// "full" and the gateway answers 503. The last eighth of it (at most 256 pages) is kept for
    /// delivering what was accepted: new requests are refused there, leases and attempts are
    /// not. `None` = SQLite's default (effectively unbounded).
    pub max_page_count: Option<u64>,
    /// Most jobs committed in one group commit.
    pub max_batch: usize,
    /// Read connections.
    pub readers: usize,
}

impl SqliteOptions {
    /// Options for a file, with defaults for the rest.
    pub fn new(path: impl Into<PathBuf>) -> SqliteOptions {
        SqliteOptions {
            path: path.into(),
            max_page_count: None,
            max_batch: 512,
            readers: 4,
        }
    }

    /// Parses `sqlite://PATH[?max_page_count=N]` (also `sqlite:PATH`).
    pub fn from_url(url: &str) -> Result<SqliteOptions, String> {
        let rest = url
            .strip_prefix("sqlite://")
            .or_else(|| url.strip_prefix("sqlite:"))
            .ok_or_else(|| format!("not a sqlite URL: {url}"))?;
        let (path, query) = match rest.split_once('?') {
            Some((p, q)) => (p, Some(q)),
            None => (rest, None),
        };
        if path.is_empty() {
            return Err("sqlite URL has no file path".to_owned());
        }
        let mut opts = SqliteOptions::new(path);
        for pair in query.into_iter().flat_map(|q| q.split('&')) {
            match pair.split_once('=') {
                Some(("max_page_count", n)) => {
                    opts.max_page_count = Some(
                        n.parse()
                            .map_err(|_| format!("max_page_count is not a number: {n}"))?,
                    );
                }
                _ => return Err(format!("unknown sqlite URL option: {pair}")),
            }
        }
        Ok(opts)
    }
}

/// The embedded store. Cheap to clone.
#[derive(Clone)]
pub struct SqliteStore {
    writer: Writer,
    readers: Arc<ReaderPool>,
    cap: Option<PageCap>,
    /// Set when a write under [`Room::Ingest`] found the store full, cleared by the next event
    /// kept or probe for room that commits (a small record fitting says nothing): while set,
    /// [`Store::ping`] probes for room instead of answering ready.
    ingest_full: Arc<FullFlag>,
    /// Held by a serving gateway's store ([`SqliteStore::open_serving`]) for as long as any
    /// clone of it lives.
    _serving: Option<Arc<serving::ServingLock>>,
    /// The schema version the file had when it was opened (0: a new file).
    schema_found: i64,
}

/// The file's size cap, and the lower one new requests stop at: the pages between them are
/// kept for the leases and attempts that deliver what was already accepted (a full store that
/// could not record a lease would hold accepted events undelivered until space came back).
#[derive(Clone, Copy, Debug)]
struct PageCap {
    all: u64,
    ingest: u64,
}

impl PageCap {
    fn new(all: u64) -> PageCap {
        PageCap {
            all,
            ingest: all - (all / 8).min(256),
        }
    }
}

/// The room a full store's readiness probe asks for: a webhook of a usual size with its
/// history row.
const ROOM_PROBE_BYTES: i64 = 16 * 1024;

/// Which of the cap's two limits a write runs under.
#[derive(Clone, Copy)]
enum Room {
    /// New requests, new deliveries: stop short of the reserve.
    Ingest,
    /// Delivering what is there, or removing: the whole file.
    All,
}

/// Sets the writer's page limit for the job that follows (inside its transaction). SQLite
/// keeps a limit below the file's current size at that size.
fn set_room(conn: &Connection, cap: Option<PageCap>, room: Room) -> rusqlite::Result<()> {
    if let Some(cap) = cap {
        let pages = match room {
            Room::Ingest => cap.ingest,
            Room::All => cap.all,
        };
        conn.pragma_update(None, "max_page_count", pages)?;
    }
    Ok(())
}

struct ReaderPool {
    path: PathBuf,
    idle: Mutex<Vec<Connection>>,
}

impl SqliteStore {
    /// Opens (creating and migrating if needed) the database, checks its durability settings,
    /// and starts the writer thread.
    pub fn open(opts: &SqliteOptions) -> Result<SqliteStore, StoreError> {
        SqliteStore::open_with(opts, false).map(|(store, _)| store)
    }

    /// Opens the store for a serving gateway (`hooklatch serve`): takes the file for this
    /// process alone ([`serving::ServingLock`]; another serving process makes this fail), then
    /// gives back every delivery lease still running in it, which can only be a dead
    /// process's, so those deliveries are due at once. Returns the store and the number of
    /// deliveries released.
    pub fn open_serving(opts: &SqliteOptions) -> Result<(SqliteStore, usize), StoreError> {
        SqliteStore::open_with(opts, true)
    }

    fn open_with(opts: &SqliteOptions, serving: bool) -> Result<(SqliteStore, usize), StoreError> {
        if let Some(dir) = opts.path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(|e| {
                StoreError::Unavailable(format!("creating directory {}: {e}", dir.display()))
            })?;
        }
        let lock = serving
            .then(|| serving::ServingLock::take(&opts.path))
            .transpose()?;
        let conn = open_connection(&opts.path, false)?;
        let cap = opts.max_page_count.map(PageCap::new);
        set_room(&conn, cap, Room::All).map_err(map_err)?;
        let schema_found = schema::migrate(&conn).map_err(map_err)?;
        checkpoint::configure_writer(&conn).map_err(map_err)?;
        let released = match lock {
            Some(_) => outbox::release_every_lease(&conn, Timestamp::now()).map_err(map_err)?,
            None => 0,
        };
        let checkpointer = Checkpointer::start(open_connection(&opts.path, false)?)?;
        let writer = Writer::start(conn, opts.max_batch.max(1), checkpointer)?;
        let readers = Arc::new(ReaderPool {
            path: opts.path.clone(),
            idle: Mutex::new(Vec::new()),
        });
        for _ in 0..opts.readers.max(1) {
            let conn = open_connection(&opts.path, true)?;
            readers.idle.lock().expect("reader pool lock").push(conn);
        }
        let store = SqliteStore {
            writer,
            readers,
            cap,
            ingest_full: Arc::new(FullFlag::default()),
            _serving: lock.map(Arc::new),
            schema_found,
        };
        Ok((store, released))
    }

    /// The schema version the file had when this store opened it (0: a new file), and the one
    /// it has now, this build's.
    pub fn schema_versions(&self) -> (i64, i64) {
        (self.schema_found, schema::VERSION)
    }

    /// Runs `f` in the writer's next group commit, under the page limit of `room`.
    async fn write<R: Send + 'static>(
        &self,
        room: Room,
        f: impl Fn(&Connection) -> rusqlite::Result<R> + Send + 'static,
    ) -> Result<R, StoreError> {
        let cap = self.cap;
        let res = self
            .writer
            .run(move |tx| {
                set_room(tx, cap, room)?;
                f(tx)
            })
            .await;
        if let Room::Ingest = room {
            report_room(self.ingest_full.note_small(&res));
        }
        res
    }

    /// A write that keeps an event's request, or the probe for room: its success clears the
    /// "store full" flag (see [`Store::ping`]).
    async fn write_event<R: Send + 'static>(
        &self,
        f: impl Fn(&Connection) -> rusqlite::Result<R> + Send + 'static,
    ) -> Result<R, StoreError> {
        let res = self.write(Room::Ingest, f).await;
        report_room(self.ingest_full.note(&res));
        res
    }

    /// Runs `f` on a read connection, off the async runtime.
    async fn read<R: Send + 'static>(
        &self,
        f: impl FnOnce(&Connection) -> rusqlite::Result<R> + Send + 'static,
    ) -> Result<R, StoreError> {
        let pool = self.readers.clone();
        tokio::task::spawn_blocking(move || {
            let conn = pool.idle.lock().expect("reader pool lock").pop();
            let conn = match conn {
                Some(c) => c,
                None => open_connection(&pool.path, true)?,
            };
            let res = f(&conn).map_err(map_err);
            pool.idle.lock().expect("reader pool lock").push(conn);
            res
        })
        .await
        .map_err(|e| StoreError::Unavailable(format!("read task failed: {e}")))?
    }
}

/// Logs a change of the "store full" flag and sets `hooklatch_store_full` to match.
fn report_room(changed: Option<bool>) {
    match changed {
        Some(true) => {
            tracing::warn!("sqlite: the store is full; new events are refused until there is room")
        }
        Some(false) => tracing::info!("sqlite: the store has room again"),
        None => return,
    }
    metrics::gauge!("hooklatch_store_full").set(if changed == Some(true) { 1.0 } else { 0.0 });
}

/// Opens a connection with the durability settings every connection must have, and checks them.
fn open_connection(path: &Path, read_only: bool) -> Result<Connection, StoreError> {
    let flags = OpenFlags::SQLITE_OPEN_READ_WRITE
        | OpenFlags::SQLITE_OPEN_CREATE
        | OpenFlags::SQLITE_OPEN_NO_MUTEX;
    let conn = Connection::open_with_flags(path, flags).map_err(|e| {
        StoreError::Unavailable(format!("opening sqlite database {}: {e}", path.display()))
    })?;
    conn.busy_timeout(Duration::from_secs(5)).map_err(map_err)?;
    let mode: String = conn
        .pragma_update_and_check(None, "journal_mode", "wal", |r| r.get(0))
        .map_err(map_err)?;
    conn.pragma_update(None, "synchronous", "FULL")
        .map_err(map_err)?;
    conn.pragma_update(None, "foreign_keys", "ON")
        .map_err(map_err)?;
    // Each job in a group commit runs in a savepoint, and SQLite keeps the pages a savepoint
    // may have to roll back in a sub-journal: a temp file by default, i.e. a write system call
    // per page per job (15 % of the gateway's time at full load). In memory it is a copy. The
    // commit itself still goes to the WAL and is fsynced; nothing durable lives in temp.
    conn.pragma_update(None, "temp_store", "MEMORY")
        .map_err(map_err)?;
    // The hot statements (ingest, lease, attempt, the savepoints) all stay prepared.
    conn.set_prepared_statement_cache_capacity(64);
    let sync: i64 = conn
        .pragma_query_value(None, "synchronous", |r| r.get(0))
        .map_err(map_err)?;
    if !mode.eq_ignore_ascii_case("wal") {
        return Err(StoreError::Unavailable(format!(
            "sqlite journal_mode is {mode}, expected wal (is the file on a file system without shared memory?)"
        )));
    }
    // 2 = FULL, 3 = EXTRA: both fsync the WAL at every commit.
    if sync < 2 {
        return Err(StoreError::Unavailable(format!(
            "sqlite synchronous is {sync}, expected FULL (2) or EXTRA (3)"
        )));
    }
    if read_only {
        conn.pragma_update(None, "query_only", "ON")
            .map_err(map_err)?;
    }
    Ok(conn)
}

/// Maps a SQLite error to the store's error: a full database is its own case.
pub(crate) fn map_err(err: rusqlite::Error) -> StoreError {
    if let rusqlite::Error::SqliteFailure(e, _) = &err {
        if e.code == rusqlite::ErrorCode::DiskFull {
            return StoreError::Full;
        }
    }
    StoreError::Unavailable(err.to_string())
}

#[async_trait::async_trait]
impl Store for SqliteStore {
    async fn ingest(&self, ingest: Ingest) -> Result<IngestOutcome, StoreError> {
        // The row is prepared here, on the caller's task: the writer thread is the serial part.
        let row = ingest::Row::of_ingest(&ingest);
        self.write_event(move |tx| ingest::ingest(tx, &ingest, &row))
            .await
    }

    async fn record_rejection(&self, rejected: Rejected) -> Result<RequestId, StoreError> {
        let row = ingest::Row::new(&rejected.request, []);
        self.write(Room::Ingest, move |tx| {
            ingest::record_rejection(tx, &rejected, &row)
        })
        .await
    }

    async fn record_import(
        &self,
        request: RequestRecord,
        keys: Vec<String>,
    ) -> Result<RequestId, StoreError> {
        let row = ingest::Row::new(&request, keys.iter().map(String::as_str));
        self.write(Room::Ingest, move |tx| {
            ingest::record_import(tx, &request, &row, &keys)
        })
        .await
    }

    async fn record_handshake(
        &self,
        request: RequestRecord,
        status: u16,
    ) -> Result<RequestId, StoreError> {
        let row = ingest::Row::new(&request, []);
        self.write(Room::Ingest, move |tx| {
            ingest::record_handshake(tx, &request, &row, status)
        })
        .await
    }

    async fn lease_due(
        &self,
        owner: &str,
        now: Timestamp,
        lease: Duration,
        limit: u32,
    ) -> Result<Vec<LeasedDelivery>, StoreError> {
        let owner = owner.to_owned();
        self.write(Room::All, move |tx| {
            outbox::lease_due(tx, &owner, now, lease, limit)
        })
        .await
    }

    async fn record_attempt(&self, result: AttemptResult) -> Result<(), StoreError> {
        self.write(Room::All, move |tx| outbox::record_attempt(tx, &result))
            .await
    }

    async fn record_attempt_and_lease(
        &self,
        result: AttemptResult,
        now: Timestamp,
        lease: Duration,
    ) -> Result<Option<LeasedDelivery>, StoreError> {
        self.write(Room::All, move |tx| {
            outbox::record_attempt(tx, &result)?;
            Ok(outbox::lease_due(tx, &result.owner, now, lease, 1)?.pop())
        })
        .await
    }

    async fn release_leases(&self, owner: &str, now: Timestamp) -> Result<(), StoreError> {
        let owner = owner.to_owned();
        self.write(Room::All, move |tx| outbox::release_leases(tx, &owner, now))
            .await
    }

    async fn wake_destination(&self, destination: &str, now: Timestamp) -> Result<u64, StoreError> {
        let destination = destination.to_owned();
        self.write(Room::All, move |tx| {
            outbox::wake_destination(tx, &destination, now)
        })
        .await
    }

    async fn wake_held(&self, now: Timestamp) -> Result<u64, StoreError> {
        self.write(Room::All, move |tx| outbox::wake_held(tx, now))
            .await
    }

    async fn disable_destination(&self, disabled: DisabledDestination) -> Result<bool, StoreError> {
        self.write(Room::All, move |tx| {
            outbox::disable_destination(tx, &disabled)
        })
        .await
    }

    async fn enable_destination(
        &self,
        destination: &str,
        now: Timestamp,
    ) -> Result<Option<u64>, StoreError> {
        let destination = destination.to_owned();
        self.write(Room::All, move |tx| {
            outbox::enable_destination(tx, &destination, now)
        })
        .await
    }

    async fn disabled_destinations(&self) -> Result<Vec<DisabledDestination>, StoreError> {
        self.read(outbox::disabled_destinations).await
    }

    async fn dismiss_conflict(
        &self,
        request: RequestId,
        reason: Option<String>,
        now: Timestamp,
    ) -> Result<Dismissal, StoreError> {
        self.write(Room::All, move |tx| {
            history::dismiss_conflict(tx, request, reason.as_deref(), now)
        })
        .await
    }

    async fn undecided_conflicts(&self) -> Result<u64, StoreError> {
        self.read(history::undecided_conflicts).await
    }

    async fn next_due(&self) -> Result<Option<Timestamp>, StoreError> {
        self.read(outbox::next_due).await
    }

    async fn list_requests(
        &self,
        filter: RequestFilter,
    ) -> Result<Vec<RequestSummary>, StoreError> {
        self.read(move |c| history::list_requests(c, &filter)).await
    }

    async fn get_request(&self, id: RequestId) -> Result<Option<RequestDetail>, StoreError> {
        self.read(move |c| history::get_request(c, id)).await
    }

    async fn list_deliveries(
        &self,
        filter: DeliveryFilter,
    ) -> Result<Vec<DeliveryDetail>, StoreError> {
        self.read(move |c| history::list_deliveries(c, &filter))
            .await
    }

    async fn redrive(&self, id: DeliveryId, now: Timestamp) -> Result<Redrive, StoreError> {
        self.write(Room::Ingest, move |tx| outbox::redrive(tx, id, now))
            .await
    }

    async fn redeliver(
        &self,
        request: RequestId,
        destinations: Vec<String>,
        now: Timestamp,
    ) -> Result<Redelivery, StoreError> {
        self.write(Room::Ingest, move |tx| {
            outbox::redeliver(tx, request, &destinations, now)
        })
        .await
    }

    async fn purge(&self, now: Timestamp, history_before: Timestamp) -> Result<Purged, StoreError> {
        // Bounded batches, each its own short transaction, so ingest never waits long.
        let mut total = Purged::default();
        loop {
            let n = self
                .write(Room::All, move |tx| {
                    history::purge_claims(tx, now, history::PURGE_BATCH)
                })
                .await?;
            total.claims += n;
            if n < history::PURGE_BATCH {
                break;
            }
        }
        loop {
            let n = self
                .write(Room::All, move |tx| {
                    history::purge_requests(tx, history_before, history::PURGE_BATCH)
                })
                .await?;
            total.requests += n;
            if n < history::PURGE_BATCH {
                break;
            }
        }
        Ok(total)
    }

    async fn stats(&self) -> Result<StoreStats, StoreError> {
        self.read(history::stats).await
    }

    async fn outbox_counts(&self) -> Result<OutboxCounts, StoreError> {
        self.read(history::outbox_counts).await
    }

    /// `SELECT 1` through the writer; once an ingest found the store full, a write that needs
    /// room instead (16 KiB into `room_probe`, removed in the same commit), so
    /// the store reads as ready again only when an event of that size fits: after the
    /// operator freed space, before any provider retries.
    async fn ping(&self) -> Result<(), StoreError> {
        if !self.ingest_full.is_set() {
            return self
                .writer
                .run(|tx| tx.query_row("SELECT 1", [], |_| Ok(())))
                .await;
        }
        self.write_event(|tx| {
            tx.execute(
                "INSERT INTO room_probe (pad) VALUES (zeroblob(?1))",
                [ROOM_PROBE_BYTES],
            )?;
            tx.execute("DELETE FROM room_probe", [])?;
            Ok(())
        })
        .await
    }
}

#[cfg(test)]
mod durability_tests {
    use super::*;

    #[test]
    fn a_connection_without_a_wal_is_refused() {
        // An in-memory database keeps its journal in memory: no WAL, nothing durable.
        let err = open_connection(Path::new(":memory:"), false).expect_err("refused");
        assert!(
            err.to_string()
                .contains("sqlite journal_mode is memory, expected wal"),
            "{err}"
        );
    }

    #[test]
    fn a_file_is_opened_in_wal_with_a_synced_commit() {
        let dir = tempfile::tempdir().expect("a temp dir");
        let conn = open_connection(&dir.path().join("t.db"), false).expect("opened");
        let mode: String = conn
            .pragma_query_value(None, "journal_mode", |r| r.get(0))
            .unwrap();
        let sync: i64 = conn
            .pragma_query_value(None, "synchronous", |r| r.get(0))
            .unwrap();
        assert_eq!((mode.as_str(), sync), ("wal", 2));
    }
}
