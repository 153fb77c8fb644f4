//! Group commit: ingests, rejections, handshakes and delivery attempts, committed many to a
//! transaction.
//!
//! Callers queue a [`Work`] item on a channel and wait for its reply: delivery attempts on a
//! lane of their own, everything else on the ingest path's (see [`Writer`]). In each lane a
//! few writer tasks take turns at the channel: the one whose turn it is takes the first job,
//! waits for the batch in flight to commit (at most [`IN_FLIGHT_WAIT`], so a batch waiting on
//! a lock does not hold the next back; and only while batches take more than one job on
//! average, so a lone request is not kept waiting for nothing), takes every job waiting by
//! then (up to `max_batch`), and runs them in one `READ COMMITTED` transaction on one pooled
//! connection. The turn passes on as the batch sends `COMMIT`, so the next batch's statements
//! run during its WAL flush. Replies go out only after `COMMIT` returns, so a caller never
//! hears "done" for work that is not durable; if the commit fails, every job of the batch
//! hears the error. One commit — one WAL flush, one round trip — covers the whole batch, so
//! PostgreSQL round trips do not cap ingest throughput.
//!
//! Most batches are one statement: one-event ingests written together, or attempts recorded
//! together with their next leases. Such a batch runs without `BEGIN` and `COMMIT`, as a
//! statement PostgreSQL commits as it ends (`run_alone`): one round trip instead of three,
//! and the turn passes on when it returns. The one thing that needs a second statement, a
//! copy whose key is held where the statement cannot read it, makes that statement fail
//! before it commits anything, and the batch runs again in a transaction.
//!
//! A batch first runs without savepoints: jobs almost never fail on their own, and a savepoint
//! per job costs a round trip and a subtransaction each (ingest +8–29 % without them, same
//! minutes). If a job does fail on its own, the whole transaction is rolled back — nothing of
//! it was committed, nobody has heard anything — and the batch runs again with each job in its
//! own savepoint, so only that job fails. Without savepoints, the batch's one-event ingests
//! are written by one statement together (`ingest::insert_and_claim_many`): one round trip for
//! the batch instead of one per job (ingest +48–60 % at c=64, same minutes).
//!
//! Cancellation: the transaction lives in a writer task, never in the caller's future, which
//! only queues the job (on its first poll, when the channel has room) and waits for the reply.
//! A caller dropped before the job is queued leaves nothing; one dropped after (a provider hung
//! up) only drops the reply, and its job commits or rolls back whole, with the rest of its
//! batch.
//!
//! Failures, by scope:
//! - A job's own error (its wait for a concurrent claim passed `lock_timeout`, a full disk)
//!   reaches its caller only; its neighbours go on (after the batch runs again with savepoints,
//!   where that job rolls back to its savepoint).
//! - A deadlock or serialization failure (SQLSTATE 40P01, 40001) rolls the whole batch back and
//!   runs it again in a new transaction, after a short random pause: a deadlock is broken only
//!   when the locks taken by the batch's earlier jobs are released too. Jobs are sorted by key
//!   before they run, and each job claims its keys in key order, so batches on different
//!   instances take claim locks in the same order and seldom deadlock at all.
//! - A broken connection, a failed `COMMIT`, or a batch that takes far too long fails every job
//!   of the batch that has not heard its own error (the gateway answers 503 and the provider
//!   retries; a retry after a commit that did happen is answered as a duplicate).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use hooklatch_core::store::{
    AttemptResult, Ingest, IngestOutcome, LeasedDelivery, Rejected, RequestRecord,
};
use hooklatch_core::{Claim, DeliveryId, RequestId, StoreError, Timestamp};
use rand::Rng;
use sqlx::pool::PoolConnection;
use sqlx::{PgConnection, PgPool, Postgres};
use tokio::sync::{mpsc, oneshot, Mutex, OwnedSemaphorePermit, Semaphore};

use crate::listen::OtherListeners;
use crate::{ingest, map_err, outbox, simple, sqlstate, WORK_CHANNEL};

/// How many times a batch is run again after a deadlock or serialization failure.
const MAX_RETRIES: u32 = 8;

/// Beyond its lock waits, how long one run of a batch may take before it is abandoned (a
/// connection that stopped answering): its callers hear `Unavailable`.
const IO_TIMEOUT: Duration = Duration::from_secs(30);

/// The most lock waits one run of a batch is given time for. Each claim may wait up to
/// `lock_timeout`, but a batch whose jobs all wait that long is better failed (503, retried
/// by the providers) than kept for minutes.
const MAX_WAITS_PER_BATCH: u32 = 4;

/// How long a writer whose turn it is waits for the batch in flight to commit before it
/// starts its own beside it. Waiting, its batch gathers what arrives meanwhile: one
/// transaction instead of several small ones side by side, which costs PostgreSQL less CPU
/// per job (on 2 cores with PostgreSQL beside the gateway, ingest at c=64 +15–17 % and p99
/// 16–19 → 10–12 ms, against up to four transactions side by side; same minutes). A batch in
/// flight longer than this (a heavy one, or one waiting on another instance's uncommitted
/// claim) no longer holds the others back: the next starts beside it. At 3,000 req/s while
/// delivering, the median ack was 8.4–9.4 ms with 3 ms here against 11.1 ms with 10 ms; at
/// c=64 the two were within 2 %. Lone jobs do not wait ([`Turns::take`]): at c=1 while
/// delivering, waiting cost 15–20 % (567 against 666–684 req/s).
const IN_FLIGHT_WAIT: Duration = Duration::from_millis(3);

/// Most body bytes one batched ingest statement carries: its arguments are a copy of every
/// body in it, and the buffers that carry them are kept for reuse. With 64 KB bodies at c=64
/// the gateway's peak RSS was 71–75 MiB with one statement per ingest, 129–155 MiB with one
/// per batch, 104–118 MiB with 1 MiB per statement, and 81–96 MiB with this (4 such bodies per
/// statement; a batch of 2 KB bodies at c=64 still goes whole).
const BATCHED_BYTES: usize = 256 << 10;

/// A write that goes through group commit.
pub(crate) enum Work {
    Ingest(Ingest),
    Rejection(Rejected),
    Handshake(RequestRecord, u16),
    /// A delivery attempt's outcome, then (with `next`: when and for how long) the worker's
    /// next lease. In a batch, many workers' attempts share one commit instead of one each.
    Attempt {
        result: AttemptResult,
        next: Option<(Timestamp, Duration)>,
    },
}

/// What [`ingest::insert_and_claim_many`] wrote for one ingest: its request, and the
/// deliveries of its new claim (`None`: another request holds the key).
type Inserted = (RequestId, Option<Vec<DeliveryId>>);

/// What the batch's shared statements did for one of its ingests.
enum Prepared {
    /// Recorded its request and tried its claim; what is left is to settle it.
    Inserted(Inserted),
    /// Done: its key was held by another request, read in the batched statement itself or
    /// in [`ingest::settle_held_many`].
    Settled(IngestOutcome),
    /// Done: an attempt recorded with the worker's next lease, in
    /// [`outbox::record_attempts_and_lease_many`].
    Attempted(Option<Box<LeasedDelivery>>),
}

/// What a [`Work`] item produced.
pub(crate) enum Done {
    Ingest(IngestOutcome),
    Request(RequestId),
    /// The next lease an attempt asked for, if any row was due (boxed: far larger than the
    /// other answers).
    Attempt(Option<Box<LeasedDelivery>>),
}

impl Work {
    /// The order jobs run in within a batch: keyless jobs first, then by smallest key.
    fn lock_order(&self) -> Option<(&str, &str)> {
        match self {
            Work::Ingest(ingest) => ingest::lock_order(ingest),
            Work::Rejection(_) | Work::Handshake(..) | Work::Attempt { .. } => None,
        }
    }

    /// An ingest whose deliveries are written leased to its instance's worker, which hears
    /// of them in memory: no other worker needs waking for them.
    fn handed_off(&self) -> bool {
        matches!(self, Work::Ingest(ingest) if ingest.lease.is_some())
    }

    /// How many lock waits the job may go through (one per claim).
    fn n_claims(&self) -> u32 {
        match self {
            Work::Ingest(ingest) => ingest.events.len() as u32,
            Work::Rejection(_) | Work::Handshake(..) | Work::Attempt { .. } => 0,
        }
    }

    /// The ingest [`ingest::insert_and_claim_many`] can take with others, if this is one.
    fn batchable_ingest(&self) -> Option<&Ingest> {
        match self {
            Work::Ingest(ingest) => ingest::one_event_claimed_here(ingest).map(|_| ingest),
            Work::Rejection(_) | Work::Handshake(..) | Work::Attempt { .. } => None,
        }
    }

    /// Runs the job, or what the batched statements left of it (`prepared`).
    async fn run(
        &self,
        conn: &mut PgConnection,
        prepared: Option<Prepared>,
    ) -> Result<Done, sqlx::Error> {
        match (self, prepared) {
            (Work::Ingest(_), Some(Prepared::Settled(outcome))) => {
                return Ok(Done::Ingest(outcome));
            }
            (Work::Attempt { .. }, Some(Prepared::Attempted(leased))) => {
                return Ok(Done::Attempt(leased));
            }
            (Work::Ingest(job), Some(Prepared::Inserted((request_id, deliveries)))) => {
                return Ok(Done::Ingest(
                    ingest::settle(conn, job, request_id, deliveries).await?,
                ));
            }
            _ => {}
        }
        Ok(match self {
            Work::Ingest(job) => Done::Ingest(ingest::ingest(conn, job).await?),
            Work::Rejection(job) => Done::Request(ingest::record_rejection(conn, job).await?),
            Work::Handshake(request, status) => {
                Done::Request(ingest::record_handshake(conn, request, *status).await?)
            }
            Work::Attempt { result, next } => Done::Attempt(match next {
                Some((now, lease)) => {
                    outbox::record_attempt_and_lease(&mut *conn, result, *now, *lease)
                        .await?
                        .map(Box::new)
                }
                None => {
                    outbox::record_attempt(&mut *conn, result).await?;
                    None
                }
            }),
        })
    }
}

impl Done {
    /// True when committing it gives workers something new to do.
    fn queued_deliveries(&self) -> bool {
        match self {
            Done::Ingest(outcome) => outcome.claims.iter().any(
                |(_, claim)| matches!(claim, Claim::New { deliveries } if !deliveries.is_empty()),
            ),
            Done::Request(_) | Done::Attempt(_) => false,
        }
    }
}

struct Job {
    work: Work,
    reply: oneshot::Sender<Result<Done, StoreError>>,
}

/// Settings of the writer tasks.
#[derive(Debug, Clone, Copy)]
pub(crate) struct WriterSettings {
    pub(crate) max_batch: usize,
    pub(crate) writers: usize,
    pub(crate) lock_timeout: Duration,
}

/// How many writer tasks commit delivery attempts (their own lane; `writers` is the other's).
/// Their batches seldom wait on a lock (a worker's rows are leased to it), so one commits
/// at a time and a second is there only for a batch stuck behind a slow connection. The
/// lane has as many connections of its own, beside the store's pool.
pub(crate) const ATTEMPT_WRITERS: usize = 2;

/// Set on each of the attempts lane's connections as it opens. Attempts find their rows by
/// id in the deliveries table, which a new database starts empty; a connection's cached
/// plan, made while the table was a few pages, went on scanning the whole table for every
/// batch until the first `ANALYZE` made PostgreSQL plan again (at c=64 while delivering, 128
/// of 191 sampled attempt statements; 12 % of the server's CPU evaluating `id = ANY(…)` row
/// by row). Most of the lane's batches are one statement in a transaction of its own
/// ([`run_alone`]), with no `BEGIN` to carry a `SET LOCAL`; the batches that do
/// open a transaction set it there too ([`LaneKind::begin`]), for a pooler that hands each
/// transaction another server connection.
pub(crate) const ATTEMPTS_SETTING: &str = "SET enable_seqscan = off";

/// A handle on the writer tasks. Cheap to clone; the tasks stop when the last handle drops.
///
/// Two lanes, each with its own channel, writer tasks and turns: one for what arrives on the
/// ingest path (ingests, rejections, handshakes), one for delivery attempts. A batch of
/// either kind commits beside a batch of the other, so an acknowledgement never waits for
/// workers' attempts to be written, nor the other way round (on 2 cores at c=64 while
/// delivering, a single lane of both kinds committed about 9,500 jobs/s in all, shared
/// between the two). The lanes never wait on each other's locks: attempts lock rows leased
/// to their own workers, ingests their claims and the rows they insert.
#[derive(Clone)]
pub(crate) struct Writer {
    ingests: Lane,
    attempts: Lane,
}

/// One lane's channel.
#[derive(Clone)]
struct Lane {
    jobs: mpsc::Sender<Job>,
}

impl Writer {
    /// Starts the writer tasks of both lanes on the current tokio runtime: the ingest path's
    /// on `pool`, the attempts' on `attempts_pool` ([`ATTEMPTS_SETTING`]).
    pub(crate) fn start(
        pool: PgPool,
        attempts_pool: PgPool,
        others: OtherListeners,
        settings: WriterSettings,
    ) -> Writer {
        let settings = WriterSettings {
            max_batch: settings.max_batch.max(1),
            writers: settings.writers.max(1),
            ..settings
        };
        Writer {
            ingests: Lane::start(
                pool.clone(),
                others.clone(),
                settings,
                settings.writers,
                LaneKind::Ingests,
            ),
            attempts: Lane::start(
                attempts_pool,
                others,
                settings,
                ATTEMPT_WRITERS.min(settings.writers),
                LaneKind::Attempts,
            ),
        }
    }

    /// Runs `work` in the next group commit of its lane and returns its result once the
    /// commit is durable.
    ///
    /// Dropping the returned future while it waits for room on the channel leaves nothing
    /// behind; once the job is queued, dropping it does not stop the job, it only discards the
    /// reply.
    pub(crate) async fn run(&self, work: Work) -> Result<Done, StoreError> {
        let lane = match work {
            Work::Attempt { .. } => &self.attempts,
            Work::Ingest(_) | Work::Rejection(_) | Work::Handshake(..) => &self.ingests,
        };
        let (reply, rx) = oneshot::channel();
        lane.jobs
            .send(Job { work, reply })
            .await
            .map_err(|_| StoreError::Unavailable("postgres writer has stopped".to_owned()))?;
        rx.await
            .map_err(|_| StoreError::Unavailable("postgres write did not run".to_owned()))?
    }
}

impl Lane {
    /// Starts `tasks` writer tasks taking turns at a channel of their own.
    fn start(
        pool: PgPool,
        others: OtherListeners,
        settings: WriterSettings,
        tasks: usize,
        kind: LaneKind,
    ) -> Lane {
        // Room for a few batches per writer; beyond it callers wait to queue (backpressure).
        let (jobs, rx) = mpsc::channel(settings.max_batch * tasks * 8);
        let rx = Arc::new(Mutex::new(rx));
        let turns = Arc::new(Turns {
            in_flight: Arc::new(Semaphore::new(1)),
            recent_jobs: AtomicUsize::new(0),
        });
        for _ in 0..tasks {
            tokio::spawn(run_loop(
                rx.clone(),
                turns.clone(),
                pool.clone(),
                others.clone(),
                settings,
                kind,
            ));
        }
        Lane { jobs }
    }
}

/// Which of the two lanes a writer task commits for.
#[derive(Debug, Clone, Copy)]
enum LaneKind {
    Ingests,
    Attempts,
}

impl LaneKind {
    /// What opens a batch's transaction (and its first job's savepoint, with `savepoints`).
    ///
    /// Attempts are planned without sequential scans ([`ATTEMPTS_SETTING`]); `SET LOCAL`
    /// ends with the transaction.
    fn begin(self, savepoints: bool) -> &'static str {
        match (self, savepoints) {
            (LaneKind::Ingests, false) => "BEGIN ISOLATION LEVEL READ COMMITTED",
            (LaneKind::Ingests, true) => "BEGIN ISOLATION LEVEL READ COMMITTED; SAVEPOINT job",
            (LaneKind::Attempts, false) => {
                "BEGIN ISOLATION LEVEL READ COMMITTED; SET LOCAL enable_seqscan = off"
            }
            (LaneKind::Attempts, true) => {
                "BEGIN ISOLATION LEVEL READ COMMITTED; SET LOCAL enable_seqscan = off; \
                 SAVEPOINT job"
            }
        }
    }
}

/// What the writer tasks share to take turns.
struct Turns {
    /// Held by the batch committing in turn.
    in_flight: Arc<Semaphore>,
    /// How many jobs the batches took of late, in sixteenths: a moving average over about
    /// the last eight batches.
    recent_jobs: AtomicUsize,
}

impl Turns {
    /// The turn of a writer about to take a batch: it waits for the batch in flight (at most
    /// [`IN_FLIGHT_WAIT`]) only while batches take more than one job on average. Lone jobs
    /// (one provider at a time, a worker's attempt) gather nobody by waiting and would only
    /// be answered later: they start at once, beside the batch in flight if there is one.
    async fn take(&self) -> Option<OwnedSemaphorePermit> {
        let in_flight = self.in_flight.clone();
        if self.busy() {
            tokio::time::timeout(IN_FLIGHT_WAIT, in_flight.acquire_owned())
                .await
                .ok()
                .and_then(Result::ok)
        } else {
            in_flight.try_acquire_owned().ok()
        }
    }

    /// Whether batches took more than one job and a half on average of late.
    fn busy(&self) -> bool {
        self.recent_jobs.load(Ordering::Relaxed) > 24
    }

    /// Counts a batch of `jobs` into the moving average (called by the writer at the
    /// channel, one at a time).
    fn took(&self, jobs: usize) {
        let old = self.recent_jobs.load(Ordering::Relaxed);
        let new = (old * 7 + jobs.min(1 << 16) * 16) / 8;
        self.recent_jobs.store(new, Ordering::Relaxed);
    }
}

async fn run_loop(
    rx: Arc<Mutex<mpsc::Receiver<Job>>>,
    turns: Arc<Turns>,
    pool: PgPool,
    others: OtherListeners,
    settings: WriterSettings,
    kind: LaneKind,
) {
    loop {
        let mut batch = Vec::new();
        let turn = {
            // One writer at a time waits at the channel; the others are committing.
            let mut rx = rx.lock().await;
            match rx.recv().await {
                Some(job) => batch.push(job),
                None => return,
            }
            // The batch in flight, if any, commits first unless it takes long: meanwhile
            // the jobs arriving queue up for this batch.
            let turn = turns.take().await;
            while batch.len() < settings.max_batch {
                match rx.try_recv() {
                    Ok(job) => batch.push(job),
                    Err(_) => break,
                }
            }
            turns.took(batch.len());
            turn
        };
        commit_batch(&pool, &others, settings, kind, batch, turn).await;
    }
}

/// How one run of a batch ended.
enum Ended {
    /// Committed: each job's own result, to send now, and whether any job queued deliveries.
    Committed(Vec<Result<Done, StoreError>>, bool),
    /// Run as one statement without a transaction ([`run_alone`]), it failed on purpose
    /// before committing anything: run it again in a transaction.
    InTransaction,
    /// Rolled back cleanly after a deadlock or serialization failure: run it again.
    Retry(sqlx::Error),
    /// Run without savepoints, a job failed on its own; rolled back cleanly: run it again with
    /// a savepoint per job.
    JobFailed(sqlx::Error),
    /// Failed: each job's own error where it had one, else `err`. `clean` says whether the
    /// connection is still fit for the pool (rolled back, not mid-protocol).
    Failed {
        results: Vec<Option<StoreError>>,
        err: StoreError,
        clean: bool,
    },
}

async fn commit_batch(
    pool: &PgPool,
    others: &OtherListeners,
    settings: WriterSettings,
    kind: LaneKind,
    mut batch: Vec<Job>,
    mut turn: Option<OwnedSemaphorePermit>,
) {
    batch.sort_by(|a, b| a.work.lock_order().cmp(&b.work.lock_order()));
    let n_claims: u32 = batch.iter().map(|j| j.work.n_claims()).sum();
    let deadline = IO_TIMEOUT + settings.lock_timeout * (n_claims + 1).min(MAX_WAITS_PER_BATCH);
    let mut retries = 0;
    let mut savepoints = false;
    let mut alone = true;
    loop {
        let mut conn = match pool.acquire().await {
            Ok(conn) => conn,
            Err(err) => {
                let err = map_err(err);
                tracing::warn!(%err, jobs = batch.len(), "postgres: no connection for a group commit");
                return fail(batch, Vec::new(), err);
            }
        };
        let ended = tokio::time::timeout(
            deadline,
            run_batch(&mut conn, &batch, kind, savepoints, alone, &mut turn),
        )
        .await;
        let ended = ended.unwrap_or_else(|_| Ended::Failed {
            results: Vec::new(),
            err: StoreError::Unavailable("postgres did not answer in time".to_owned()),
            clean: false,
        });
        match ended {
            Ended::Committed(results, queued_work) => {
                metrics::histogram!("hooklatch_store_group_commit_jobs")
                    .record(results.len() as f64);
                for (job, res) in batch.into_iter().zip(results) {
                    let _ = job.reply.send(res);
                }
                if queued_work && others.any() {
                    wake_workers(&mut conn).await;
                }
                return;
            }
            Ended::InTransaction => alone = false,
            Ended::JobFailed(err) => {
                tracing::debug!(%err, jobs = batch.len(), "postgres: a job failed; the batch runs again with savepoints");
                savepoints = true;
            }
            Ended::Retry(err) if retries < MAX_RETRIES => {
                retries += 1;
                metrics::counter!("hooklatch_store_serialization_retries_total").increment(1);
                tracing::debug!(%err, retries, jobs = batch.len(), "postgres: group commit retried");
                drop(conn);
                let pause = rand::rng().random_range(1..=5u64 << retries.min(6));
                tokio::time::sleep(Duration::from_millis(pause)).await;
            }
            Ended::Retry(err) => {
                let err = map_err(err);
                tracing::warn!(%err, jobs = batch.len(), "postgres: group commit gave up after retries");
                return fail(batch, Vec::new(), err);
            }
            Ended::Failed {
                results,
                err,
                clean,
            } => {
                if !clean {
                    // Mid-transaction or mid-protocol: never hand it back to the pool.
                    close(conn);
                }
                tracing::warn!(%err, jobs = batch.len(), "postgres: group commit failed");
                return fail(batch, results, err);
            }
        }
    }
}

/// `NOTIFY`s the workers of every instance that a batch queued deliveries, after its commit
/// (not for deliveries written leased to their own instance's worker: nobody else may take
/// them before their lease ends, and that worker hears of them in memory). Only while
/// another instance listens ([`OtherListeners`]): this instance's own worker is woken in
/// memory by the ingest that queued the deliveries, so with nobody else listening the
/// `NOTIFY` was a round trip and a transaction per batch for nothing (at 2,000 requests/s,
/// more than half of PostgreSQL's commits).
///
/// Not inside the batch's transaction: a transaction that notifies holds a database-wide lock
/// from its commit until its end, its WAL flush included, so batches that notified committed
/// one after the other, each waiting for the last one's flush, on every instance sharing the
/// database. Alone, the `NOTIFY` writes no WAL and waits for no flush. A failure here loses
/// no work: the rows are committed, and idle workers find them at their next poll.
async fn wake_workers(conn: &mut PgConnection) {
    if let Err(err) = simple(conn, &format!("NOTIFY {WORK_CHANNEL}")).await {
        tracing::warn!(%err, "postgres: could not notify the workers; they find the deliveries at their next poll");
    }
}

/// Tells every job of a failed batch: its own error if it had one, else `err`.
fn fail(batch: Vec<Job>, results: Vec<Option<StoreError>>, err: StoreError) {
    let mut results = results.into_iter();
    for job in batch {
        let res = results.next().flatten().unwrap_or_else(|| err.clone());
        let _ = job.reply.send(Err(res));
    }
}

fn close(mut conn: PoolConnection<Postgres>) {
    conn.close_on_drop();
    drop(conn);
}

/// Runs the batch once: as one statement when it is one and `alone` ([`run_alone`]), else its
/// lane's `BEGIN` (and the first job's savepoint when `savepoints`), each job (in a savepoint
/// of its own when `savepoints`), `COMMIT`.
async fn run_batch(
    conn: &mut PgConnection,
    batch: &[Job],
    kind: LaneKind,
    savepoints: bool,
    alone: bool,
    turn: &mut Option<OwnedSemaphorePermit>,
) -> Ended {
    if alone && !savepoints {
        if let Some(ended) = run_alone(conn, batch, kind, turn).await {
            return ended;
        }
    }
    if let Err(err) = simple(conn, kind.begin(savepoints)).await {
        return broken(Vec::new(), err, conn).await;
    }
    // Without savepoints, the batch's attempts and one-event ingests run in statements they
    // share; run alone, a job that fails in them fails alone.
    let mut prepared = Vec::new();
    if !savepoints {
        match prepare_batched(conn, batch).await {
            Ok(done) => prepared = done,
            Err(err) if is_retryable(&err) => return run_again(conn, err, Ended::Retry).await,
            Err(err) if is_connection_error(&err) => {
                return broken(Vec::new(), err, conn).await;
            }
            Err(err) => return run_again(conn, err, Ended::JobFailed).await,
        }
    }
    let mut prepared = prepared.into_iter();
    let mut results: Vec<Result<Done, StoreError>> = Vec::with_capacity(batch.len());
    let mut queued_work = false;
    for job in batch {
        match job.work.run(conn, prepared.next().flatten()).await {
            Ok(done) => {
                queued_work |= done.queued_deliveries() && !job.work.handed_off();
                results.push(Ok(done));
                // Keep the job's work, and open the next job's savepoint, in one round trip.
                if savepoints {
                    if let Err(err) = simple(conn, "RELEASE SAVEPOINT job; SAVEPOINT job").await {
                        return broken(own_errors(&results), err, conn).await;
                    }
                }
            }
            Err(err) if is_retryable(&err) => return run_again(conn, err, Ended::Retry).await,
            Err(err) if is_connection_error(&err) => {
                return broken(own_errors(&results), err, conn).await;
            }
            Err(err) if !savepoints => {
                // The transaction is aborted with every job's work in it: undo it all and let
                // the batch run again, this time able to undo this job alone.
                return run_again(conn, err, Ended::JobFailed).await;
            }
            Err(err) => {
                // Undo this job only; the savepoint stays for the next job.
                if let Err(rollback_err) = simple(conn, "ROLLBACK TO SAVEPOINT job").await {
                    return broken(own_errors(&results), rollback_err, conn).await;
                }
                results.push(Err(map_err(err)));
            }
        }
    }
    // The next batch's statements run while this one's commit waits for its WAL flush.
    drop(turn.take());
    match simple(conn, "COMMIT").await {
        Ok(_) => Ended::Committed(results, queued_work),
        Err(err) if is_retryable(&err) => match rollback(conn).await {
            // A serialization failure at commit (deferred checks): nothing was committed.
            Ok(()) => Ended::Retry(err),
            Err(_) => Ended::Failed {
                results: own_errors(&results),
                err: map_err(err),
                clean: false,
            },
        },
        // The commit may or may not have happened: every job hears the error (a provider's
        // retry of a job that did commit is answered as a duplicate).
        Err(err) => broken(own_errors(&results), err, conn).await,
    }
}

/// Runs a batch that is one statement, with no `BEGIN` or `COMMIT`: PostgreSQL commits a
/// lone statement as it ends, in a transaction of its own, so the batch is one round trip
/// instead of three. That is a batch of attempts that all ask for their worker's next lease,
/// on distinct deliveries ([`record_batched_attempts`]), or of one-event ingests within one
/// statement's bodies ([`ingest::insert_and_claim_many`], run `alone`). `None` for any other
/// batch, left to run in a transaction.
///
/// Same minutes, the transaction against this, 3 pairs each on PostgreSQL: ingest alone at
/// c=64 +22 to +30 % (9,324 / 9,751 / 8,826 → 12,035 / 12,693 / 10,756 requests/s, the
/// gateway's and PostgreSQL's CPU per request −15 to −22 %); at 2,900 requests/s while
/// delivering, ack p50 −10 to −19 %; attempts alone, at c=64 while delivering, delivery +5
/// to +7 %.
///
/// A statement that fails committed nothing. An ingest whose key another request holds
/// where the statement cannot see it needs a second statement to read it
/// ([`ingest::settle_held_many`]), so it must not commit alone: the statement fails on
/// purpose ([`ingest::HELD_ELSEWHERE`]) and the batch runs again in a transaction. A deadlock
/// runs it again too, a job's own error runs it again with savepoints, and a broken
/// connection fails it (an attempt's lease runs out and the delivery is attempted again,
/// with the same key; a provider retries an ingest). The turn passes on once the statement
/// has returned, its commit included: meanwhile the next batch gathers.
async fn run_alone(
    conn: &mut PgConnection,
    batch: &[Job],
    kind: LaneKind,
    turn: &mut Option<OwnedSemaphorePermit>,
) -> Option<Ended> {
    let ran = match kind {
        LaneKind::Attempts => attempts_alone(conn, batch).await?,
        LaneKind::Ingests => ingests_alone(conn, batch).await?,
    };
    let ended = match ran {
        Ok(results) => {
            let queued_work = batch
                .iter()
                .zip(&results)
                .any(|(job, done)| matches!(done, Ok(done) if done.queued_deliveries() && !job.work.handed_off()));
            Ended::Committed(results, queued_work)
        }
        Err(err) if sqlstate(&err).as_deref() == Some(ingest::HELD_ELSEWHERE) => {
            tracing::debug!(
                jobs = batch.len(),
                "postgres: a key was held elsewhere; the batch runs again in a transaction"
            );
            Ended::InTransaction
        }
        Err(err) if is_retryable(&err) => Ended::Retry(err),
        Err(err) if is_connection_error(&err) => Ended::Failed {
            results: Vec::new(),
            err: map_err(err),
            clean: false,
        },
        Err(err) => Ended::JobFailed(err),
    };
    drop(turn.take());
    Some(ended)
}

/// A batch's results, by position.
type Results = Vec<Result<Done, StoreError>>;

/// [`run_alone`] for a batch of attempts, if it is one statement.
async fn attempts_alone(
    conn: &mut PgConnection,
    batch: &[Job],
) -> Option<Result<Results, sqlx::Error>> {
    if !batch
        .iter()
        .all(|job| matches!(job.work, Work::Attempt { next: Some(_), .. }))
    {
        return None;
    }
    Some(match record_batched_attempts(conn, batch).await {
        // Two attempts on one delivery: not one statement.
        Ok(done) if done.is_empty() => return None,
        Ok(done) => Ok(done
            .into_iter()
            .map(|leased| Ok(Done::Attempt(leased.flatten())))
            .collect()),
        Err(err) => Err(err),
    })
}

/// [`run_alone`] for a batch of one-event ingests, if it is one statement.
async fn ingests_alone(
    conn: &mut PgConnection,
    batch: &[Job],
) -> Option<Result<Results, sqlx::Error>> {
    let ingests: Vec<&Ingest> = batch
        .iter()
        .map(|job| job.work.batchable_ingest())
        .collect::<Option<_>>()?;
    let bytes: usize = ingests.iter().map(|i| i.request.body.len()).sum();
    if ingests.len() > 1 && bytes > BATCHED_BYTES {
        return None;
    }
    Some(
        ingest::insert_and_claim_many(conn, &ingests, true)
            .await
            .map(|done| {
                done.into_iter()
                    .zip(&ingests)
                    .map(|(done, ingest)| match done {
                        ingest::Batched::Claimed(request_id, deliveries) => Ok(Done::Ingest(
                            ingest::claimed(ingest, request_id, deliveries),
                        )),
                        ingest::Batched::Settled(outcome) => Ok(Done::Ingest(outcome)),
                        // The statement fails rather than commit one (HELD_ELSEWHERE).
                        ingest::Batched::Held(request_id) => {
                            tracing::error!(%request_id, "postgres: a held key was committed without its verdict");
                            Err(StoreError::Unavailable(
                                "postgres: a held key was committed without its verdict"
                                    .to_owned(),
                            ))
                        }
                    })
                    .collect()
            }),
    )
}

/// Records the requests and tries the claims of a batch's one-event ingests in one statement,
/// when the batch holds at least two and no other ingest (whose claims, in key order among
/// theirs, would then come after them). Answers by position in the batch; empty when there
/// was nothing to batch.
async fn insert_batched_ingests(
    conn: &mut PgConnection,
    batch: &[Job],
) -> Result<Vec<Option<ingest::Batched>>, sqlx::Error> {
    let mut ingests = Vec::new();
    for job in batch {
        match (&job.work, job.work.batchable_ingest()) {
            (_, Some(ingest)) => ingests.push(ingest),
            (Work::Ingest(_), None) => return Ok(Vec::new()),
            _ => {}
        }
    }
    if ingests.len() < 2 {
        return Ok(Vec::new());
    }
    // In statements of at most BATCHED_BYTES of bodies each (at least one ingest each), in
    // order, so claims are still taken in key order.
    let mut done = Vec::with_capacity(ingests.len());
    let mut rest = ingests.as_slice();
    while !rest.is_empty() {
        let mut bytes = 0;
        let take = rest
            .iter()
            .take_while(|ingest| {
                bytes += ingest.request.body.len();
                bytes <= BATCHED_BYTES
            })
            .count()
            .max(1);
        let (chunk, more) = rest.split_at(take);
        done.extend(ingest::insert_and_claim_many(conn, chunk, false).await?);
        rest = more;
    }
    let mut done = done.into_iter();
    Ok(batch
        .iter()
        .map(|job| job.work.batchable_ingest().and_then(|_| done.next()))
        .collect())
}

/// The statements a batch's jobs share: its delivery attempts with their next leases
/// ([`record_batched_attempts`]), its one-event ingests ([`insert_batched_ingests`]), then the
/// copies whose keys were held read those claims together ([`ingest::settle_held_many`]: two
/// statements for all the batch's duplicates instead of three each).
async fn prepare_batched(
    conn: &mut PgConnection,
    batch: &[Job],
) -> Result<Vec<Option<Prepared>>, sqlx::Error> {
    let mut attempted = record_batched_attempts(conn, batch).await?;
    attempted.resize_with(batch.len(), || None);
    // The attempts the batched statement did not take (no next lease, or two on one delivery)
    // run now too, before the claims: every batch locks delivery rows before claims.
    for (job, done) in batch.iter().zip(attempted.iter_mut()) {
        if done.is_none() && matches!(job.work, Work::Attempt { .. }) {
            if let Done::Attempt(leased) = job.work.run(conn, None).await? {
                *done = Some(leased);
            }
        }
    }
    let inserted = insert_batched_ingests(conn, batch).await?;
    let held: Vec<(&Ingest, RequestId)> = batch
        .iter()
        .zip(&inserted)
        .filter_map(|(job, done)| match (&job.work, done) {
            (Work::Ingest(ingest), Some(ingest::Batched::Held(request_id))) => {
                Some((ingest, *request_id))
            }
            _ => None,
        })
        .collect();
    let mut settled = if held.is_empty() {
        Vec::new()
    } else {
        ingest::settle_held_many(conn, &held).await?
    }
    .into_iter();
    let mut attempted = attempted.into_iter();
    let mut inserted = inserted.into_iter();
    Ok(batch
        .iter()
        .map(|_| {
            // Both answer by position (or not at all): advance both at every job.
            let (attempt, insert) = (attempted.next().flatten(), inserted.next().flatten());
            if let Some(leased) = attempt {
                return Some(Prepared::Attempted(leased));
            }
            Some(match insert? {
                ingest::Batched::Claimed(request_id, deliveries) => {
                    Prepared::Inserted((request_id, Some(deliveries)))
                }
                ingest::Batched::Settled(outcome) => Prepared::Settled(outcome),
                ingest::Batched::Held(request_id) => match settled.next().flatten() {
                    Some(outcome) => Prepared::Settled(outcome),
                    None => Prepared::Inserted((request_id, None)),
                },
            })
        })
        .collect())
}

/// Records the batch's delivery attempts that ask for the worker's next lease, with those
/// leases, in one statement, when they attempted distinct deliveries (one attempt alone too).
/// [`prepare_batched`] runs the attempts this leaves right after it, still before the batch's
/// claims: an attempt run after the batched ingests took its row lock after the batch's
/// claims while another batch took them in the other order (a deadlock, found by PostgreSQL
/// only after its `deadlock_timeout`, 1 s, of both batches waiting). Answers by position in
/// the batch (`Some` for an attempt done here); empty when there was nothing to batch.
async fn record_batched_attempts(
    conn: &mut PgConnection,
    batch: &[Job],
) -> Result<Vec<Option<Option<Box<LeasedDelivery>>>>, sqlx::Error> {
    let attempts: Vec<_> = batch
        .iter()
        .filter_map(|job| match &job.work {
            Work::Attempt {
                result,
                next: Some((now, lease)),
            } => Some((result, *now, *lease)),
            _ => None,
        })
        .collect();
    let mut ids: Vec<i64> = attempts.iter().map(|(r, ..)| r.delivery.0).collect();
    ids.sort_unstable();
    ids.dedup();
    if attempts.is_empty() || ids.len() < attempts.len() {
        return Ok(Vec::new());
    }
    let mut leased = outbox::record_attempts_and_lease_many(conn, &attempts)
        .await?
        .into_iter();
    Ok(batch
        .iter()
        .map(|job| match &job.work {
            Work::Attempt { next: Some(_), .. } => leased.next().map(|l| l.map(Box::new)),
            _ => None,
        })
        .collect())
}

/// Rolls the whole batch back after `err`, to run it again as `again` says; if even the
/// rollback fails, the batch fails and its connection is not reused.
async fn run_again(
    conn: &mut PgConnection,
    err: sqlx::Error,
    again: fn(sqlx::Error) -> Ended,
) -> Ended {
    match rollback(conn).await {
        Ok(()) => again(err),
        Err(_) => Ended::Failed {
            results: Vec::new(),
            err: map_err(err),
            clean: false,
        },
    }
}

/// The jobs' own errors so far, by position (`None` for jobs that succeeded).
fn own_errors(results: &[Result<Done, StoreError>]) -> Vec<Option<StoreError>> {
    results.iter().map(|r| r.as_ref().err().cloned()).collect()
}

/// Ends a batch that failed as a whole: tries to roll back, so the connection can be reused.
async fn broken(
    results: Vec<Option<StoreError>>,
    err: sqlx::Error,
    conn: &mut PgConnection,
) -> Ended {
    let clean = !is_connection_error(&err) && rollback(conn).await.is_ok();
    Ended::Failed {
        results,
        err: map_err(err),
        clean,
    }
}

async fn rollback(conn: &mut PgConnection) -> Result<(), sqlx::Error> {
    simple(conn, "ROLLBACK").await
}

/// Deadlock detected (40P01) or serialization failure (40001): the batch can run again.
fn is_retryable(err: &sqlx::Error) -> bool {
    matches!(sqlstate(err).as_deref(), Some("40P01" | "40001"))
}

/// The connection itself failed: nothing more can be sent on it.
fn is_connection_error(err: &sqlx::Error) -> bool {
    matches!(
        err,
        sqlx::Error::Io(_) | sqlx::Error::Tls(_) | sqlx::Error::Protocol(_)
    ) || sqlstate(err).is_some_and(|code| code.starts_with("08") || code.starts_with("57P"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn turns() -> Arc<Turns> {
        Arc::new(Turns {
            in_flight: Arc::new(Semaphore::new(1)),
            recent_jobs: AtomicUsize::new(0),
        })
    }

    /// Under load, a writer waits for the batch in flight and gets the turn when it commits;
    /// a batch that does not commit in time (a lock wait) does not hold it back. Time is
    /// paused: the wait ends by the clock, not by the machine's speed.
    #[tokio::test(start_paused = true)]
    async fn under_load_a_turn_waits_for_the_batch_in_flight_but_not_for_long() {
        let turns = turns();
        for _ in 0..8 {
            turns.took(40);
        }
        assert!(turns.busy());
        let in_flight = turns.take().await.expect("a free turn");
        let next = tokio::spawn({
            let turns = turns.clone();
            async move { turns.take().await }
        });
        tokio::task::yield_now().await;
        assert!(!next.is_finished(), "waits for the batch in flight");
        drop(in_flight);
        let next = next.await.unwrap();
        assert!(next.is_some(), "the turn of the batch that committed");

        let started = tokio::time::Instant::now();
        let beside = turns.take().await;
        assert!(
            beside.is_none(),
            "starts beside a batch that does not commit"
        );
        assert_eq!(started.elapsed(), IN_FLIGHT_WAIT);
    }

    #[tokio::test(start_paused = true)]
    async fn lone_jobs_take_the_free_turn_or_go_beside_at_once() {
        let turns = turns();
        for _ in 0..8 {
            turns.took(1);
        }
        assert!(!turns.busy());
        let first = turns.take().await;
        assert!(first.is_some(), "the free turn");
        let started = tokio::time::Instant::now();
        assert!(turns.take().await.is_none());
        assert_eq!(started.elapsed(), Duration::ZERO, "no wait");
    }

    #[test]
    fn the_average_follows_the_recent_batches() {
        let turns = turns();
        assert!(!turns.busy(), "idle at start");
        for _ in 0..8 {
            turns.took(64);
        }
        assert!(turns.busy());
        for _ in 0..32 {
            turns.took(1);
        }
        assert!(!turns.busy());
        turns.took(usize::MAX);
        assert!(turns.busy(), "no overflow");
    }
}
