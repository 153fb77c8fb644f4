//! The writer thread: every write, committed in groups.
//!
//! Jobs queue on a channel. The thread takes the first job, then every job already waiting (up
//! to the batch limit), and runs them in one `BEGIN IMMEDIATE … COMMIT`, each inside its own
//! savepoint. Replies are sent only after the commit returns, so a caller never hears "done"
//! for work that is not durable; if the commit fails, every job in the batch gets the error.
//! Some errors (a full database above all) make SQLite roll back the whole transaction, not
//! just the failed statement: the jobs before it then hear the error too, and the jobs after
//! it go on in a new transaction, so no caller hears an error for work that was committed.
//!
//! A std thread rather than a tokio task: SQLite calls block (the fsync above all), and one
//! owned connection needs no locking.

use std::sync::mpsc;

use hooklatch_core::StoreError;
use rusqlite::Connection;
use tokio::sync::oneshot;

use crate::checkpoint::Checkpointer;
use crate::map_err;

type Reply = Box<dyn FnOnce(Result<(), StoreError>) + Send>;
/// A job runs on the connection and returns a copy of its own outcome (for the batch's
/// bookkeeping) and the reply that takes the commit's outcome to its caller.
type Job = Box<dyn FnOnce(&Connection) -> (Result<(), StoreError>, Reply) + Send>;

/// A handle on the writer thread. Cheap to clone; the thread stops when the last handle drops.
#[derive(Clone)]
pub(crate) struct Writer {
    jobs: mpsc::Sender<Job>,
}

impl Writer {
    pub(crate) fn start(
        conn: Connection,
        max_batch: usize,
        checkpointer: Checkpointer,
    ) -> Result<Writer, StoreError> {
        let (jobs, rx) = mpsc::channel::<Job>();
        std::thread::Builder::new()
            .name("hooklatch-sqlite-writer".to_owned())
            .spawn(move || run_loop(conn, rx, max_batch, checkpointer))
            .map_err(|e| StoreError::Unavailable(format!("starting sqlite writer: {e}")))?;
        Ok(Writer { jobs })
    }

    /// Runs `f` in the next group commit and returns its result once the commit is durable.
    ///
    /// The job is queued before the first await: dropping the returned future afterwards
    /// does not stop the job, it only discards the reply.
    pub(crate) async fn run<R: Send + 'static>(
        &self,
        f: impl FnOnce(&Connection) -> rusqlite::Result<R> + Send + 'static,
    ) -> Result<R, StoreError> {
        let (tx, rx) = oneshot::channel();
        let job: Job = Box::new(move |conn| {
            let res = f(conn).map_err(map_err);
            let outcome = res.as_ref().map(|_| ()).map_err(StoreError::clone);
            let reply: Reply = Box::new(move |commit| {
                let _ = tx.send(commit.and(res));
            });
            (outcome, reply)
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
    rx: mpsc::Receiver<Job>,
    max_batch: usize,
    checkpointer: Checkpointer,
) {
    let mut batch: Vec<Job> = Vec::with_capacity(max_batch);
    while let Ok(first) = rx.recv() {
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

fn commit_batch(conn: &Connection, batch: &mut Vec<Job>) {
    if let Err(err) = conn.execute_batch("BEGIN IMMEDIATE") {
        let err = map_err(err);
        tracing::warn!(%err, jobs = batch.len(), "sqlite: could not begin a write transaction");
        for job in batch.drain(..) {
            // Nothing ran: answer without running the job.
            drop(job);
        }
        return;
    }
    let mut replies: Vec<Reply> = Vec::with_capacity(batch.len());
    for job in batch.drain(..) {
        if let Err(err) = exec_cached(conn, "SAVEPOINT job") {
            let err = map_err(err);
            replies.push(Box::new(move |_| drop(err)));
            continue;
        }
        let (outcome, reply) = job(conn);
        if conn.is_autocommit() {
            // SQLite rolled the whole transaction back (it may on SQLITE_FULL, IOERR, NOMEM
            // or BUSY): this job and every one before it in the batch are undone. Left as is,
            // the jobs after it would run and commit outside the transaction while their
            // callers heard the final COMMIT fail.
            let err = match outcome {
                Err(err) => {
                    reply(Ok(())); // its own error reaches its caller
                    err
                }
                Ok(()) => {
                    let err =
                        StoreError::Unavailable("sqlite rolled back the transaction".to_owned());
                    reply(Err(err.clone()));
                    err
                }
            };
            tracing::warn!(%err, undone = replies.len() + 1, "sqlite: a failed write rolled back its group commit");
            for undone in replies.drain(..) {
                undone(Err(err.clone()));
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
        replies.push(reply);
    }
    let commit = conn.execute_batch("COMMIT").map_err(map_err);
    if let Err(err) = &commit {
        tracing::warn!(%err, jobs = replies.len(), "sqlite: group commit failed");
        let _ = conn.execute_batch("ROLLBACK");
    }
    for reply in replies {
        reply(commit.clone());
    }
}

/// Runs a statement from the connection's prepared-statement cache: the savepoints around each
/// job are two statements per job, too many to parse each time.
fn exec_cached(conn: &Connection, sql: &str) -> rusqlite::Result<()> {
    conn.prepare_cached(sql)?.execute([])?;
    Ok(())
}
