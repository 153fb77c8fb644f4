//! The writer thread: every write, committed in groups.
//!
//! Jobs queue on a channel. The thread takes the first job, then every job already waiting (up
//! to the batch limit), and runs them in one `BEGIN IMMEDIATE … COMMIT`, each inside its own
//! savepoint. Replies are sent only after the commit returns, so a caller never hears "done"
//! for work that is not durable; if the commit fails, every job in the batch gets the error.
//!
//! A std thread rather than a tokio task: SQLite calls block (the fsync above all), and one
//! owned connection needs no locking.

use std::sync::mpsc;

use hooklatch_core::StoreError;
use rusqlite::Connection;
use tokio::sync::oneshot;

use crate::map_err;

type Reply = Box<dyn FnOnce(Result<(), StoreError>) + Send>;
type Job = Box<dyn FnOnce(&Connection) -> (bool, Reply) + Send>;

/// A handle on the writer thread. Cheap to clone; the thread stops when the last handle drops.
#[derive(Clone)]
pub(crate) struct Writer {
    jobs: mpsc::Sender<Job>,
}

impl Writer {
    pub(crate) fn start(conn: Connection, max_batch: usize) -> Result<Writer, StoreError> {
        let (jobs, rx) = mpsc::channel::<Job>();
        std::thread::Builder::new()
            .name("hooklatch-sqlite-writer".to_owned())
            .spawn(move || run_loop(conn, rx, max_batch))
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
            let ok = res.is_ok();
            let reply: Reply = Box::new(move |commit| {
                let _ = tx.send(commit.and(res));
            });
            (ok, reply)
        });
        self.jobs
            .send(job)
            .map_err(|_| StoreError::Unavailable("sqlite writer has stopped".to_owned()))?;
        // A dropped reply means the batch could not start; the job did not run.
        rx.await
            .map_err(|_| StoreError::Unavailable("sqlite write did not run".to_owned()))?
    }
}

fn run_loop(conn: Connection, rx: mpsc::Receiver<Job>, max_batch: usize) {
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
        if let Err(err) = conn.execute_batch("SAVEPOINT job") {
            let err = map_err(err);
            replies.push(Box::new(move |_| drop(err)));
            continue;
        }
        let (ok, reply) = job(conn);
        let end = if ok {
            "RELEASE job"
        } else {
            "ROLLBACK TO job; RELEASE job"
        };
        if let Err(err) = conn.execute_batch(end) {
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
        let res = match &commit {
            Ok(()) => Ok(()),
            Err(StoreError::Full) => Err(StoreError::Full),
            Err(StoreError::Unavailable(m)) => Err(StoreError::Unavailable(m.clone())),
        };
        reply(res);
    }
}
