//! The writer thread: every write, committed in groups.
//!
//! Jobs queue on a channel. The thread takes the first job, then every job already waiting (up
//! to the batch limit), and runs them in one `BEGIN IMMEDIATE … COMMIT`. Replies are sent only
//! after the commit returns, so a caller never hears "done" for work that is not durable; if
//! the commit fails, every job in the batch gets the error.
//!
//! A batch first runs without savepoints: jobs almost never fail on their own, and a savepoint
//! per job costs two statements and a copy of every page the job first touches into the
//! savepoint's sub-journal (ingest +2–8 % without them, same minutes). If a job does fail, the
//! whole transaction is rolled back — nothing of it was committed, nobody has heard anything —
//! and the batch runs again with each job in its own savepoint, so only that job fails. A job
//! may therefore run twice; its reply carries the result of its last run.
//!
//! Some errors (a full database above all) make SQLite roll back the whole transaction, not
//! just the failed statement: in the savepoint run, the jobs before it then hear the error
//! too, and the jobs after it go on in a new transaction, so no caller hears an error for work
//! that was committed.
//!
//! A std thread rather than a tokio task: SQLite calls block (the fsync above all), and one
//! owned connection needs no locking.

use std::sync::mpsc;

use hooklatch_core::StoreError;
use rusqlite::Connection;
use tokio::sync::oneshot;

use crate::checkpoint::Checkpointer;
use crate::map_err;

/// A queued write. `run` may be called twice (see the module doc); `reply` once, after the
/// commit, with the commit's outcome.
trait Job: Send {
    /// Runs the work on the connection and keeps its result for the reply.
    fn run(&mut self, conn: &Connection) -> Result<(), StoreError>;
    /// Sends the kept result to the caller, unless the commit failed.
    fn reply(self: Box<Self>, commit: Result<(), StoreError>);
}

/// A caller's work, its latest result, and where the reply goes.
struct Pending<F, R> {
    work: F,
    result: Option<Result<R, StoreError>>,
    reply: oneshot::Sender<Result<R, StoreError>>,
}

impl<F, R> Job for Pending<F, R>
where
    F: Fn(&Connection) -> rusqlite::Result<R> + Send,
    R: Send,
{
    fn run(&mut self, conn: &Connection) -> Result<(), StoreError> {
        let res = (self.work)(conn).map_err(map_err);
        let outcome = res.as_ref().map(|_| ()).map_err(StoreError::clone);
        self.result = Some(res);
        outcome
    }

    fn reply(self: Box<Self>, commit: Result<(), StoreError>) {
        let res = self.result.unwrap_or_else(|| {
            Err(StoreError::Unavailable(
                "sqlite write did not run".to_owned(),
            ))
        });
        let _ = self.reply.send(commit.and(res));
    }
}

/// A handle on the writer thread. Cheap to clone; the thread stops when the last handle drops.
#[derive(Clone)]
pub(crate) struct Writer {
    jobs: mpsc::Sender<Box<dyn Job>>,
}

impl Writer {
    pub(crate) fn start(
        conn: Connection,
        max_batch: usize,
        checkpointer: Checkpointer,
    ) -> Result<Writer, StoreError> {
        let (jobs, rx) = mpsc::channel::<Box<dyn Job>>();
        std::thread::Builder::new()
            .name("hooklatch-sqlite-writer".to_owned())
            .spawn(move || run_loop(conn, rx, max_batch, checkpointer))
            .map_err(|e| StoreError::Unavailable(format!("starting sqlite writer: {e}")))?;
        Ok(Writer { jobs })
    }

    /// Runs `f` in the next group commit and returns its result once the commit is durable.
    /// `f` may run twice, the first run undone (see the module doc).
    ///
    /// The job is queued before the first await: dropping the returned future afterwards
    /// does not stop the job, it only discards the reply.
    pub(crate) async fn run<R: Send + 'static>(
        &self,
        f: impl Fn(&Connection) -> rusqlite::Result<R> + Send + 'static,
    ) -> Result<R, StoreError> {
        let (tx, rx) = oneshot::channel();
        let job = Box::new(Pending {
            work: f,
            result: None,
            reply: tx,
        });
        self.jobs
            .send(job)
            .map_err(|_| StoreError::Unavailable("sqlite writer has stopped".to_owned()))?;
        // A dropped reply means the batch could not start; the job did not run.
        rx.await
            .map_err(|_| StoreError::Unavailable("sqlite write did not run".to_owned()))?
    }
}

/// Ends when the last handle drops; the checkpointer then runs a last checkpoint and ends too.
fn run_loop(
    conn: Connection,
    rx: mpsc::Receiver<Box<dyn Job>>,
    max_batch: usize,
    checkpointer: Checkpointer,
) {
    let mut batch: Vec<Box<dyn Job>> = Vec::with_capacity(max_batch);
    while let Ok(first) = rx.recv() {
        // Jobs that come while the writer waits for a pass join this batch.
        checkpointer.before_write();
        batch.push(first);
        while batch.len() < max_batch {
            match rx.try_recv() {
                Ok(job) => batch.push(job),
                Err(_) => break,
            }
        }
        commit_batch(&conn, &mut batch);
        checkpointer.committed();
    }
}

fn commit_batch(conn: &Connection, batch: &mut Vec<Box<dyn Job>>) {
    if !begin(conn, batch) {
        return;
    }
    let clean = batch
        .iter_mut()
        .all(|job| job.run(conn).is_ok() && !conn.is_autocommit());
    if clean {
        commit(conn, batch);
        return;
    }
    // A job failed: roll everything back (SQLite may have done so already) and run the batch
    // again, each job in its own savepoint.
    if !conn.is_autocommit() {
        if let Err(err) = conn.execute_batch("ROLLBACK") {
            tracing::warn!(err = %map_err(err), "sqlite: rolling back a failed group commit");
        }
    }
    tracing::debug!(
        jobs = batch.len(),
        "sqlite: a job failed; its group commit runs again with savepoints"
    );
    if begin(conn, batch) {
        commit_with_savepoints(conn, batch);
    }
}

/// `BEGIN IMMEDIATE`; when it fails, the batch is dropped unrun and its callers hear so.
fn begin(conn: &Connection, batch: &mut Vec<Box<dyn Job>>) -> bool {
    match conn.execute_batch("BEGIN IMMEDIATE") {
        Ok(()) => true,
        Err(err) => {
            let err = map_err(err);
            tracing::warn!(%err, jobs = batch.len(), "sqlite: could not begin a write transaction");
            batch.clear();
            false
        }
    }
}

/// Commits the open transaction, then answers every job that ran in it.
fn commit(conn: &Connection, ran: &mut Vec<Box<dyn Job>>) {
    let started = std::time::Instant::now();
    let commit = conn.execute_batch("COMMIT").map_err(map_err);
    match &commit {
        Ok(()) => {
            // The WAL frames' writes and their fsync: what every caller in the batch waited
            // for after its own work ran.
            metrics::histogram!("hooklatch_store_commit_seconds")
                .record(started.elapsed().as_secs_f64());
            metrics::histogram!("hooklatch_store_group_commit_jobs").record(ran.len() as f64);
        }
        Err(err) => {
            tracing::warn!(%err, jobs = ran.len(), "sqlite: group commit failed");
            let _ = conn.execute_batch("ROLLBACK");
        }
    }
    for job in ran.drain(..) {
        job.reply(commit.clone());
    }
}

/// Runs each job of the batch in its own savepoint inside the open transaction, then commits.
fn commit_with_savepoints(conn: &Connection, batch: &mut Vec<Box<dyn Job>>) {
    let mut ran: Vec<Box<dyn Job>> = Vec::with_capacity(batch.len());
    for mut job in batch.drain(..) {
        if let Err(err) = exec_cached(conn, "SAVEPOINT job") {
            // Dropped unrun: its caller hears that the write did not run.
            tracing::warn!(err = %map_err(err), "sqlite: opening a savepoint failed");
            continue;
        }
        let outcome = job.run(conn);
        if conn.is_autocommit() {
            // SQLite rolled the whole transaction back (it may on SQLITE_FULL, IOERR, NOMEM
            // or BUSY): this job and every one before it in the batch are undone. Left as is,
            // the jobs after it would run and commit outside the transaction while their
            // callers heard the final COMMIT fail.
            let err = match outcome {
                Err(err) => {
                    job.reply(Ok(())); // its own error reaches its caller
                    err
                }
                Ok(()) => {
                    let err =
                        StoreError::Unavailable("sqlite rolled back the transaction".to_owned());
                    job.reply(Err(err.clone()));
                    err
                }
            };
            tracing::warn!(%err, undone = ran.len() + 1, "sqlite: a failed write rolled back its group commit");
            for undone in ran.drain(..) {
                undone.reply(Err(err.clone()));
            }
            if let Err(err) = conn.execute_batch("BEGIN IMMEDIATE") {
                let err = map_err(err);
                tracing::warn!(%err, "sqlite: could not begin a write transaction");
                // The jobs not run yet are dropped with the drain: their callers hear that
                // the write did not run.
                return;
            }
            continue;
        }
        let end = if outcome.is_ok() {
            exec_cached(conn, "RELEASE job")
        } else {
            exec_cached(conn, "ROLLBACK TO job").and_then(|()| exec_cached(conn, "RELEASE job"))
        };
        if let Err(err) = end {
            tracing::warn!(err = %map_err(err), "sqlite: closing a savepoint failed");
        }
        ran.push(job);
    }
    commit(conn, &mut ran);
}

/// Runs a statement from the connection's prepared-statement cache: the savepoints around each
/// job are two statements per job, too many to parse each time.
fn exec_cached(conn: &Connection, sql: &str) -> rusqlite::Result<()> {
    conn.prepare_cached(sql)?.execute([])?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;

    use rusqlite::Connection;
    use tokio::sync::oneshot;

    use super::{commit_batch, Job, Pending};
    use crate::recorded::Histograms;
    use hooklatch_core::StoreError;

    type Answer = oneshot::Receiver<Result<i64, StoreError>>;

    fn job(
        work: impl Fn(&Connection) -> rusqlite::Result<i64> + Send + 'static,
    ) -> (Box<dyn Job>, Answer) {
        let (reply, answer) = oneshot::channel();
        let job = Box::new(Pending {
            work,
            result: None,
            reply,
        });
        (job, answer)
    }

    fn insert(conn: &Connection, v: &str) -> rusqlite::Result<i64> {
        conn.execute("INSERT INTO t (v) VALUES (?1)", [v])?;
        Ok(conn.last_insert_rowid())
    }

    fn rows(conn: &Connection) -> Vec<(i64, String)> {
        let mut stmt = conn
            .prepare("SELECT id, v FROM t ORDER BY id")
            .expect("select");
        stmt.query_map([], |r| Ok((r.get(0)?, r.get(1)?)))
            .expect("rows")
            .collect::<rusqlite::Result<_>>()
            .expect("rows")
    }

    fn table() -> Connection {
        let conn = Connection::open_in_memory().expect("an in-memory database");
        conn.execute_batch("CREATE TABLE t (id INTEGER PRIMARY KEY, v TEXT NOT NULL)")
            .expect("table");
        conn
    }

    #[test]
    fn a_clean_batch_commits_every_job_in_one_run() {
        let conn = table();
        let runs = Arc::new(AtomicUsize::new(0));
        let (mut batch, mut answers) = (Vec::new(), Vec::new());
        for v in ["a", "b", "c"] {
            let runs = runs.clone();
            let (j, a) = job(move |c| {
                runs.fetch_add(1, Ordering::Relaxed);
                insert(c, v)
            });
            batch.push(j);
            answers.push(a);
        }
        commit_batch(&conn, &mut batch);
        let ids: Vec<i64> = answers
            .into_iter()
            .map(|a| a.blocking_recv().expect("a reply").expect("committed"))
            .collect();
        assert_eq!(ids, vec![1, 2, 3]);
        assert_eq!(runs.load(Ordering::Relaxed), 3, "each job ran once");
        assert_eq!(rows(&conn).len(), 3);
        assert!(conn.is_autocommit(), "the transaction is closed");
    }

    /// Each group commit shows in the two metrics operators read: how long its `COMMIT` (the
    /// WAL's writes and fsync) took, and how many jobs it answered.
    #[test]
    fn a_group_commit_records_its_commit_time_and_its_jobs() {
        let dir = tempfile::tempdir().expect("a temporary directory");
        // The store's own durability settings (WAL, `synchronous=FULL`), so the commit fsyncs.
        let conn =
            crate::open_connection(&dir.path().join("t.db"), false).expect("a database file");
        conn.execute_batch("CREATE TABLE t (id INTEGER PRIMARY KEY, v TEXT NOT NULL)")
            .expect("table");
        let (mut batch, mut answers) = (Vec::new(), Vec::new());
        for v in ["a", "b"] {
            let (j, a) = job(move |c| insert(c, v));
            batch.push(j);
            answers.push(a);
        }
        let recorded = Histograms::default();
        metrics::with_local_recorder(&recorded, || commit_batch(&conn, &mut batch));
        for answer in answers {
            answer.blocking_recv().expect("a reply").expect("committed");
        }
        let commits = recorded.of("hooklatch_store_commit_seconds");
        assert!(
            commits.len() == 1 && commits[0] > 0.0 && commits[0] < 60.0,
            "one commit's time, in seconds: {commits:?}"
        );
        assert_eq!(recorded.of("hooklatch_store_group_commit_jobs"), vec![2.0]);
    }

    /// One job fails after writing: its write is undone, its caller hears its error, and its
    /// neighbours — before and after it — commit, with results from the run that committed.
    #[test]
    fn a_failing_job_fails_alone_and_its_neighbours_answer_from_the_run_that_committed() {
        let conn = table();
        let (first, a1) = job(|c| insert(c, "first"));
        let (failing, a2) = job(|c| {
            insert(c, "failing")?;
            c.execute("INSERT INTO missing (v) VALUES (1)", [])?;
            Ok(0)
        });
        let (last, a3) = job(|c| insert(c, "last"));
        let mut batch = vec![first, failing, last];
        commit_batch(&conn, &mut batch);

        assert_eq!(a1.blocking_recv().expect("a reply").expect("committed"), 1);
        let err = a2
            .blocking_recv()
            .expect("a reply")
            .expect_err("its own error");
        assert!(err.to_string().contains("missing"), "{err}");
        // Row 2 was the failing job's, rolled back: the last job's id is the one in the file.
        let last_id = a3.blocking_recv().expect("a reply").expect("committed");
        assert_eq!(
            rows(&conn),
            vec![(1, "first".to_owned()), (last_id, "last".to_owned())]
        );
        assert!(conn.is_autocommit(), "the transaction is closed");
    }
}
