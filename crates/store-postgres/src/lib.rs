//! hooklatch-store-postgres: the shared backend, for several stateless gateway instances on
//! one PostgreSQL.
//!
//! The database is the only arbiter: claims, history and the outbox live there and nowhere
//! else, so any number of instances can answer for the same sources. Two copies of an event
//! meet at the claims table's primary key `(source, key)`, whichever instances they reach: the
//! second waits on the unique index for the first one's transaction, then answers as a
//! duplicate after its commit or claims the key after its rollback. The wait is bounded by
//! [`PgOptions::lock_timeout`]; past it the ingest fails with [`StoreError::Unavailable`]
//! (503, the provider retries), never with a success.
//!
//! Durability: [`PostgresStore::connect`] refuses `fsync`, `full_page_writes` or
//! `synchronous_commit` set to `off` on its own connections unless explicitly allowed (the
//! `durability` module explains the choice), and a commit returns only once PostgreSQL has
//! flushed it. Throughput: ingests and delivery attempts go through group commit (the `writer`
//! module): a few writer tasks each commit whatever jobs are waiting in one transaction (a
//! savepoint per job only when one of them failed on its own), and answer only after `COMMIT`
//! returns. That also makes ingest cancellation-safe: the transaction runs in a writer task,
//! never in the caller's future.
//!
//! Workers on every instance share the outbox through leases taken with
//! `FOR UPDATE SKIP LOCKED` (the `outbox` module); [`PostgresStore::listen_for_work`] wakes
//! idle workers on `NOTIFY` instead of polling.
//!
//! Layout: `options` parses the URL; [`schema`] holds the embedded migrations, run at
//! connect under an advisory lock; `durability` is the start-up check; `writer` is group
//! commit; `ingest`, `outbox` and `history` hold the SQL for each part of [`Store`]; `listen`
//! is the `LISTEN` task; `headers` the byte-exact header encoding.
#![forbid(unsafe_code)]

mod durability;
mod history;
mod ingest;
mod listen;
mod options;
mod outbox;
pub mod schema;
mod writer;

use std::sync::Arc;
use std::time::Duration;

use hooklatch_core::store::{
    AttemptResult, DeliveryDetail, DeliveryFilter, DisabledDestination, Dismissal, FullFlag,
    Ingest, IngestOutcome, LeasedDelivery, OutboxCounts, Purged, Redelivery, Redrive, Rejected,
    RequestDetail, RequestFilter, RequestRecord, RequestSummary, StoreStats,
};
use hooklatch_core::{DeliveryId, RequestId, Store, StoreError, Timestamp};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{Executor, PgConnection, PgPool, Row};
use tokio::sync::{watch, Notify};
use tokio::task::JoinHandle;

use crate::listen::OtherListeners;
pub use crate::options::PgOptions;
use crate::writer::{Done, Work, Writer, WriterSettings, ATTEMPTS_SETTING, ATTEMPT_WRITERS};

/// How long [`PostgresStore::connect`] waits for a server that refuses connections (still
/// starting) before giving up.
const STARTUP_TIMEOUT: Duration = Duration::from_secs(30);

/// The channel `NOTIFY`ed when deliveries become due now.
pub const WORK_CHANNEL: &str = "hooklatch_work";

/// The PostgreSQL store. Cheap to clone; its background tasks stop when the last clone drops.
#[derive(Clone)]
pub struct PostgresStore {
    inner: Arc<Inner>,
}

struct Inner {
    pool: PgPool,
    writer: Writer,
    /// For the listener's own connection.
    connect: PgConnectOptions,
    /// The `application_name` of this instance's listener.
    listener_name: String,
    /// Whether another instance listens, as last seen (for the ingests' `NOTIFY`).
    others: OtherListeners,
    /// Unsafe durability settings found at connect (only when they were allowed).
    unsafe_durability: Vec<String>,
    /// The schema version the database had at connect (0: never used by hooklatch).
    schema_found: i64,
    /// Never sent on: dropping it (with the last clone of the store) stops the listeners.
    shutdown: watch::Sender<()>,
    /// Set when a write of a new request found the database full (`53100`), cleared by the
    /// next event kept or probe for room: while set, [`Store::ping`] probes for room.
    ingest_full: FullFlag,
}

impl PostgresStore {
    /// Connects, checks the durability settings on the store's own connection (refusing
    /// unsafe ones unless [`PgOptions::allow_unsafe_durability`]), runs the migrations under
    /// an advisory lock (safe when several instances start at once), and starts the writer
    /// tasks on the current tokio runtime.
    ///
    /// Every later connection of the pool is checked again as it is opened (a setting changed
    /// on the role or database while the gateway runs) and refused the same way: the calls
    /// that needed it fail as unavailable, and the pool logs the setting at `error` level.
    pub async fn connect(opts: &PgOptions) -> Result<PostgresStore, StoreError> {
        let connect = opts.connect_options().map_err(StoreError::Unavailable)?;
        // The first connection on its own, so a refusal comes back as itself (the pool would
        // retry a refused connection until its acquire timeout). A one-connection pool rather
        // than a bare connection: it waits, with backoff, for a server that is still starting.
        let first_pool = PgPoolOptions::new()
            .max_connections(1)
            .acquire_timeout(STARTUP_TIMEOUT)
            .connect_lazy_with(connect.clone());
        // A server still starting is waited for; a wait longer than a moment is said.
        let shown = opts.redacted_url();
        let waiting = tokio::spawn(async move {
            tokio::time::sleep(Duration::from_secs(2)).await;
            tracing::warn!(
                store = %shown,
                "no connection to postgres yet: waiting up to {} s for it",
                STARTUP_TIMEOUT.as_secs()
            );
        });
        let acquired = first_pool.acquire().await;
        waiting.abort();
        let mut first = match acquired {
            Ok(first) => first,
            // The pool kept retrying and says only that it timed out: one more try on its own
            // gives the reason (refused, unknown host, authentication, TLS).
            Err(sqlx::Error::PoolTimedOut) => {
                let reason = match sqlx::ConnectOptions::connect(&connect).await {
                    Ok(_) => "it answers now; start again".to_owned(),
                    Err(err) => err.to_string(),
                };
                return Err(StoreError::Unavailable(format!(
                    "postgres: no connection within {} s: {reason}",
                    STARTUP_TIMEOUT.as_secs()
                )));
            }
            Err(err) => return Err(map_err(err)),
        };
        let found = durability::check(&mut first).await.map_err(map_err)?;
        if found.is_empty() {
            metrics::gauge!("hooklatch_unsafe_durability").set(0.0);
        } else if opts.allow_unsafe_durability {
            metrics::gauge!("hooklatch_unsafe_durability").set(1.0);
            tracing::warn!(
                settings = %found.join(", "),
                "postgres: UNSAFE durability settings, allowed explicitly: events acknowledged \
                 just before a crash can be lost"
            );
        } else {
            return Err(StoreError::Unavailable(durability::refusal(&found)));
        }
        let schema_found = schema::migrate(&mut first).await.map_err(map_migrate_err)?;
        drop(first);
        first_pool.close().await;

        let pool = checked_pool(opts, opts.pool_size.max(2), &connect, None);
        // The attempts lane's own connections, planned without sequential scans
        // (`writer::ATTEMPTS_SETTING`): its batches run as single statements, with no
        // transaction of their own to hold a `SET LOCAL`.
        let attempts_pool = checked_pool(
            opts,
            ATTEMPT_WRITERS as u32,
            &connect,
            Some(ATTEMPTS_SETTING),
        );
        let others = OtherListeners::new();
        let writer = Writer::start(
            pool.clone(),
            attempts_pool,
            others.clone(),
            WriterSettings {
                max_batch: opts.max_batch,
                // Leave connections for reads and leases, whatever the options say.
                writers: opts.writers.clamp(1, opts.pool_size.max(2) as usize - 1),
                lock_timeout: opts.lock_timeout,
            },
        );
        let (shutdown, _) = watch::channel(());
        let listener_name = listen::listener_name();
        tokio::spawn(listen::watch_others(
            pool.clone(),
            listener_name.clone(),
            others.clone(),
            shutdown.subscribe(),
        ));
        Ok(PostgresStore {
            inner: Arc::new(Inner {
                pool,
                writer,
                connect,
                listener_name,
                others,
                unsafe_durability: found,
                schema_found,
                shutdown,
                ingest_full: FullFlag::default(),
            }),
        })
    }

    /// Connects once and reads what [`PostgresStore::connect`] would check, changing nothing
    /// (`hooklatch check-config --connect`): the unsafe durability settings, and the schema's
    /// version against this build's.
    pub async fn probe(opts: &PgOptions) -> Result<Probe, StoreError> {
        let connect = opts.connect_options().map_err(StoreError::Unavailable)?;
        let mut conn = tokio::time::timeout(PROBE_TIMEOUT, sqlx::ConnectOptions::connect(&connect))
            .await
            .map_err(|_| {
                StoreError::Unavailable(format!(
                    "postgres: no connection within {} s",
                    PROBE_TIMEOUT.as_secs()
                ))
            })?
            .map_err(map_err)?;
        let unsafe_durability = durability::check(&mut conn).await.map_err(map_err)?;
        let schema = schema::current(&mut conn).await.map_err(map_err)?;
        Ok(Probe {
            unsafe_durability,
            schema,
            this_build: schema::VERSION,
        })
    }

    /// Runs the migrations (what `hooklatch migrate` does). [`PostgresStore::connect`] already
    /// ran them; running them again finds nothing to do.
    pub async fn migrate(&self) -> Result<(), StoreError> {
        let mut conn = self.inner.pool.acquire().await.map_err(map_err)?;
        schema::migrate(&mut conn)
            .await
            .map(drop)
            .map_err(map_migrate_err)
    }

    /// The schema version the database had when this store connected (0: never used by
    /// hooklatch), and the one it has now, this build's.
    pub fn schema_versions(&self) -> (i64, i64) {
        (self.inner.schema_found, schema::VERSION)
    }

    /// The unsafe durability settings found at connect (`name=value`), which
    /// [`PgOptions::allow_unsafe_durability`] let through; empty when the settings are safe.
    pub fn unsafe_durability(&self) -> &[String] {
        &self.inner.unsafe_durability
    }

    /// Spawns a task that listens on [`WORK_CHANNEL`] on its own connection and calls
    /// `notify.notify_one()` for each notification — another instance's (or this one's)
    /// ingest, redrive, redelivery or released leases — and once after every (re)connection,
    /// since notifications sent meanwhile are lost. It reconnects with backoff on failure, and
    /// stops when the store is dropped or the handle aborted.
    ///
    /// Its connection's `application_name` is `hooklatch listener <token>`, whatever the URL
    /// says: that is how the other instances see that this one listens
    /// ([`PostgresStore::notifies_others`]).
    pub fn listen_for_work(&self, notify: Arc<Notify>) -> JoinHandle<()> {
        tokio::spawn(listen::run(
            self.inner
                .connect
                .clone()
                .application_name(&self.inner.listener_name),
            notify,
            self.inner.shutdown.subscribe(),
        ))
    }

    /// Whether this instance's ingests `NOTIFY` the workers: true while another instance's
    /// listener ([`PostgresStore::listen_for_work`]) was connected to the database when this
    /// one last looked (once a second), and until the first look. An instance wakes its own
    /// worker in memory, so its own listener does not count.
    pub fn notifies_others(&self) -> bool {
        self.inner.others.any()
    }

    async fn write(&self, work: Work) -> Result<Done, StoreError> {
        self.inner.writer.run(work).await
    }

    /// A write of a new request (an ingest, a rejection, a handshake), its room noted: an
    /// event kept clears the "store full" flag, a smaller record only ever sets it (it may fit
    /// where an event does not).
    async fn write_request(&self, work: Work) -> Result<Done, StoreError> {
        let event = matches!(work, Work::Ingest(_));
        let outcome = self.write(work).await;
        let flag = &self.inner.ingest_full;
        report_room(if event {
            flag.note(&outcome)
        } else {
            flag.note_small(&outcome)
        });
        outcome
    }

    /// Records an attempt (and takes the next lease, with `next`) in the next group commit.
    async fn attempt(
        &self,
        result: AttemptResult,
        next: Option<(Timestamp, Duration)>,
    ) -> Result<Option<LeasedDelivery>, StoreError> {
        match self.write(Work::Attempt { result, next }).await? {
            Done::Attempt(leased) => Ok(leased.map(|leased| *leased)),
            _ => unreachable!("an attempt job answers with its next lease"),
        }
    }

    fn pool(&self) -> &PgPool {
        &self.inner.pool
    }
}

impl std::fmt::Debug for PostgresStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PostgresStore")
            .field("unsafe_durability", &self.inner.unsafe_durability)
            .finish_non_exhaustive()
    }
}

/// A pool of at most `max` connections, each checked for unsafe durability settings as it
/// opens (a setting changed on the role or database since start-up: the connection is
/// refused, and the pool logs the reason and keeps trying), then given `setting` if any.
fn checked_pool(
    opts: &PgOptions,
    max: u32,
    connect: &PgConnectOptions,
    setting: Option<&'static str>,
) -> PgPool {
    let allow_unsafe = opts.allow_unsafe_durability;
    PgPoolOptions::new()
        .max_connections(max)
        .acquire_timeout(opts.lock_timeout + Duration::from_secs(5))
        .after_connect(move |conn, _meta| {
            Box::pin(async move {
                if !allow_unsafe {
                    let found = durability::check(conn).await?;
                    if !found.is_empty() {
                        return Err(sqlx::Error::Configuration(
                            durability::refusal(&found).into(),
                        ));
                    }
                }
                if let Some(setting) = setting {
                    simple(conn, setting).await?;
                }
                Ok(())
            })
        })
        .connect_lazy_with(connect.clone())
}

/// Logs a change of the "store full" flag and sets `hooklatch_store_full` to match.
fn report_room(changed: Option<bool>) {
    match changed {
        Some(true) => tracing::warn!(
            "postgres: the database is full; new events are refused until there is room"
        ),
        Some(false) => tracing::info!("postgres: the database has room again"),
        None => return,
    }
    metrics::gauge!("hooklatch_store_full").set(if changed == Some(true) { 1.0 } else { 0.0 });
}

/// What the readiness probe writes while the database is full: about what an event of a few
/// KB needs, with its history and outbox rows (SQLite's probe writes as much).
const ROOM_PROBE_BYTES: i32 = 16 * 1024;

/// Writes [`ROOM_PROBE_BYTES`] into a `room_probe` emptied in the same transaction, then
/// rolls back. `room_probe.pad` is stored out of line and uncompressed, so the write needs that
/// much new room in the database's files; an error with SQLSTATE `53100` says there is none
/// ([`StoreError::Full`]).
///
/// While another session holds the table (another instance probing the same full database at
/// the same moment), the probe does not queue behind it, up to `lock_timeout`, to answer
/// "unavailable" at the end: it answers [`StoreError::Full`] at once, what this instance
/// knows, and the next readiness check probes again.
async fn room_probe(pool: &PgPool) -> Result<(), StoreError> {
    let mut tx = pool.begin().await.map_err(map_err)?;
    let emptied = simple(
        &mut tx,
        "LOCK TABLE room_probe IN ACCESS EXCLUSIVE MODE NOWAIT; TRUNCATE room_probe",
    )
    .await;
    match emptied {
        Err(err) if sqlstate(&err).as_deref() == Some(LOCK_NOT_AVAILABLE) => {
            return Err(StoreError::Full)
        }
        other => other.map_err(map_err)?,
    }
    sqlx::query("INSERT INTO room_probe (pad) VALUES (repeat('x', $1))")
        .bind(ROOM_PROBE_BYTES)
        .execute(&mut *tx)
        .await
        .map_err(map_err)?;
    tx.rollback().await.map_err(map_err)
}

/// SQLSTATE `55P03`: a lock wait passed `lock_timeout`, or a `NOWAIT` lock was held.
const LOCK_NOT_AVAILABLE: &str = "55P03";

/// Runs `sql` (one or more statements, no parameters) with the simple query protocol: one
/// round trip for all of them.
///
/// Through `Executor::execute` rather than `RawSql::execute`: the latter is an `async fn`
/// generic over the executor, and futures holding it fail the `Send` check of a spawned task
/// (rust-lang/rust#102211, "implementation of `Executor` is not general enough").
pub(crate) async fn simple(conn: &mut PgConnection, sql: &str) -> Result<(), sqlx::Error> {
    conn.execute(sqlx::raw_sql(sql)).await.map(|_| ())
}

/// The SQLSTATE of a database error.
pub(crate) fn sqlstate(err: &sqlx::Error) -> Option<String> {
    err.as_database_error()
        .and_then(|e| e.code())
        .map(|code| code.into_owned())
}

/// Maps a driver error to the store's error: a full disk is its own case. Messages come from
/// the driver and the server, which never repeat the connection URL or its password.
/// What [`PostgresStore::probe`] found.
#[derive(Debug, Clone)]
pub struct Probe {
    /// The durability settings that make `serve` refuse to start (unless allowed), as
    /// `name=value`; empty when all are safe.
    pub unsafe_durability: Vec<String>,
    /// The schema's version in the database (0: none yet).
    pub schema: i64,
    /// The version this build migrates to.
    pub this_build: i64,
}

/// How long [`PostgresStore::probe`] waits for its connection.
const PROBE_TIMEOUT: Duration = Duration::from_secs(10);

pub(crate) fn map_err(err: sqlx::Error) -> StoreError {
    match sqlstate(&err).as_deref() {
        Some("53100") => return StoreError::Full,
        Some(LOCK_NOT_AVAILABLE) => {
            return StoreError::Unavailable(
                "postgres: a lock wait passed the wait limit (lock_timeout), most likely a \
                 concurrent uncommitted claim of the same key"
                    .to_owned(),
            )
        }
        _ => {}
    }
    StoreError::Unavailable(format!("postgres: {err}"))
}

fn map_migrate_err(err: schema::MigrateError) -> StoreError {
    match err {
        schema::MigrateError::Sql(err) => map_err(err),
        newer @ schema::MigrateError::Newer { .. } => StoreError::Unavailable(newer.to_string()),
    }
}

#[async_trait::async_trait]
impl Store for PostgresStore {
    async fn ingest(&self, ingest: Ingest) -> Result<IngestOutcome, StoreError> {
        match self.write_request(Work::Ingest(ingest)).await? {
            Done::Ingest(outcome) => Ok(outcome),
            _ => unreachable!("an ingest job answers with its outcome"),
        }
    }

    async fn record_rejection(&self, rejected: Rejected) -> Result<RequestId, StoreError> {
        match self.write_request(Work::Rejection(rejected)).await? {
            Done::Request(id) => Ok(id),
            _ => unreachable!("a rejection job answers with its request id"),
        }
    }

    async fn record_import(
        &self,
        request: RequestRecord,
        keys: Vec<String>,
    ) -> Result<RequestId, StoreError> {
        // Not on the hot path: one short transaction of its own, outside group commit.
        let mut conn = self.pool().acquire().await.map_err(map_err)?;
        let outcome = ingest::record_import(&mut conn, &request, &keys)
            .await
            .map_err(map_err);
        report_room(self.inner.ingest_full.note_small(&outcome));
        outcome
    }

    async fn record_handshake(
        &self,
        request: RequestRecord,
        status: u16,
    ) -> Result<RequestId, StoreError> {
        match self.write_request(Work::Handshake(request, status)).await? {
            Done::Request(id) => Ok(id),
            _ => unreachable!("a handshake job answers with its request id"),
        }
    }

    async fn lease_due(
        &self,
        owner: &str,
        now: Timestamp,
        lease: Duration,
        limit: u32,
    ) -> Result<Vec<LeasedDelivery>, StoreError> {
        outbox::lease_due(self.pool(), owner, now, lease, limit)
            .await
            .map_err(map_err)
    }

    /// Through group commit, with the ingests and other workers' attempts of the moment.
    async fn record_attempt(&self, result: AttemptResult) -> Result<(), StoreError> {
        self.attempt(result, None).await.map(|_| ())
    }

    /// Through group commit: the attempt and the next lease in one job, its commit shared with
    /// the ingests and other workers' attempts of the moment.
    async fn record_attempt_and_lease(
        &self,
        result: AttemptResult,
        now: Timestamp,
        lease: Duration,
    ) -> Result<Option<LeasedDelivery>, StoreError> {
        self.attempt(result, Some((now, lease))).await
    }

    async fn release_leases(&self, owner: &str, now: Timestamp) -> Result<(), StoreError> {
        outbox::release_leases(self.pool(), owner, now)
            .await
            .map_err(map_err)
    }

    async fn wake_destination(&self, destination: &str, now: Timestamp) -> Result<u64, StoreError> {
        outbox::wake_destination(self.pool(), destination, now)
            .await
            .map_err(map_err)
    }

    async fn disable_destination(&self, disabled: DisabledDestination) -> Result<bool, StoreError> {
        outbox::disable_destination(self.pool(), &disabled)
            .await
            .map_err(map_err)
    }

    async fn enable_destination(
        &self,
        destination: &str,
        now: Timestamp,
    ) -> Result<Option<u64>, StoreError> {
        outbox::enable_destination(self.pool(), destination, now)
            .await
            .map_err(map_err)
    }

    async fn wake_held(&self, now: Timestamp) -> Result<u64, StoreError> {
        outbox::wake_held(self.pool(), now).await.map_err(map_err)
    }

    async fn disabled_destinations(&self) -> Result<Vec<DisabledDestination>, StoreError> {
        outbox::disabled_destinations(self.pool())
            .await
            .map_err(map_err)
    }

    async fn dismiss_conflict(
        &self,
        request: RequestId,
        reason: Option<String>,
        now: Timestamp,
    ) -> Result<Dismissal, StoreError> {
        history::dismiss_conflict(self.pool(), request, reason.as_deref(), now)
            .await
            .map_err(map_err)
    }

    async fn undecided_conflicts(&self) -> Result<u64, StoreError> {
        history::undecided_conflicts(self.pool())
            .await
            .map_err(map_err)
    }

    async fn next_due(&self) -> Result<Option<Timestamp>, StoreError> {
        outbox::next_due(self.pool()).await.map_err(map_err)
    }

    async fn list_requests(
        &self,
        filter: RequestFilter,
    ) -> Result<Vec<RequestSummary>, StoreError> {
        history::list_requests(self.pool(), &filter)
            .await
            .map_err(map_err)
    }

    async fn get_request(&self, id: RequestId) -> Result<Option<RequestDetail>, StoreError> {
        history::get_request(self.pool(), id).await.map_err(map_err)
    }

    async fn list_deliveries(
        &self,
        filter: DeliveryFilter,
    ) -> Result<Vec<DeliveryDetail>, StoreError> {
        history::list_deliveries(self.pool(), &filter)
            .await
            .map_err(map_err)
    }

    async fn redrive(&self, id: DeliveryId, now: Timestamp) -> Result<Redrive, StoreError> {
        outbox::redrive(self.pool(), id, now).await.map_err(map_err)
    }

    async fn redeliver(
        &self,
        request: RequestId,
        destinations: Vec<String>,
        now: Timestamp,
    ) -> Result<Redelivery, StoreError> {
        // One transaction: dropped half-way (the future cancelled), sqlx rolls it back.
        let mut tx = self.pool().begin().await.map_err(map_err)?;
        let res = outbox::redeliver(&mut tx, request, &destinations, now)
            .await
            .map_err(map_err)?;
        tx.commit().await.map_err(map_err)?;
        Ok(res)
    }

    async fn purge(&self, now: Timestamp, history_before: Timestamp) -> Result<Purged, StoreError> {
        // Bounded batches, each its own short transaction, so nothing waits long on a purge.
        let mut total = Purged::default();
        loop {
            let n = history::purge_claims(self.pool(), now, history::PURGE_BATCH)
                .await
                .map_err(map_err)?;
            total.claims += n;
            if n < history::PURGE_BATCH {
                break;
            }
        }
        let mut conn = self.pool().acquire().await.map_err(map_err)?;
        loop {
            let (examined, removed) =
                history::purge_requests(&mut conn, history_before, history::PURGE_BATCH)
                    .await
                    .map_err(map_err)?;
            total.requests += removed;
            if examined < history::PURGE_BATCH {
                break;
            }
        }
        Ok(total)
    }

    async fn stats(&self) -> Result<StoreStats, StoreError> {
        history::stats(self.pool()).await.map_err(map_err)
    }

    async fn outbox_counts(&self) -> Result<OutboxCounts, StoreError> {
        history::outbox_counts(self.pool()).await.map_err(map_err)
    }

    /// Answers whether the database takes writes (a standby does not); once a new request
    /// found it full, whether a write that needs new room in the database's files succeeds:
    /// 16 KiB into an emptied `room_probe`, rolled back. Emptying it in the
    /// same transaction gives the table new, empty files, so space freed by earlier probes
    /// cannot answer for the disk; rolling back removes them again. The database reads as
    /// ready once that fits, before any provider retries. Another instance probing at the
    /// same moment makes this one answer full without waiting.
    async fn ping(&self) -> Result<(), StoreError> {
        let standby: bool = sqlx::query("SELECT pg_is_in_recovery()")
            .fetch_one(self.pool())
            .await
            .and_then(|r| r.try_get(0))
            .map_err(map_err)?;
        if standby {
            return Err(StoreError::Unavailable(
                "postgres is a read-only standby".to_owned(),
            ));
        }
        if self.inner.ingest_full.is_set() {
            let probed = room_probe(self.pool()).await;
            report_room(self.inner.ingest_full.note(&probed));
            probed?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod startup_tests {
    use super::*;

    /// A server that never answers: after the start-up wait the error says why (the pool alone
    /// said only "pool timed out while waiting for an open connection"). The wait passes on
    /// tokio's paused clock.
    #[tokio::test(start_paused = true)]
    async fn a_server_that_cannot_be_reached_is_named_with_its_reason() {
        let opts = PgOptions::from_url("postgres://hooklatch@127.0.0.1:1/none").unwrap();
        let Err(StoreError::Unavailable(message)) = PostgresStore::connect(&opts).await else {
            panic!("connected to nothing");
        };
        assert!(
            message.starts_with("postgres: no connection within 30 s: ")
                && message.contains("Connection refused"),
            "{message}"
        );
    }
}
