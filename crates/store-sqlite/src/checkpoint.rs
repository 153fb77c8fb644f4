//! The checkpointer thread: copies committed WAL pages into the database file beside the
//! writer, not inside it.
//!
//! Left to itself, SQLite checkpoints on the committing connection: once the WAL passes 1,000
//! pages, the commit that crossed the line also copies every page back into the database file
//! and fsyncs it, while the group commit's callers wait (10 % of the gateway's time at full
//! load, all of it on the one writer thread). Here the writer wakes this thread after each
//! commit and it runs a `PASSIVE` checkpoint on a connection of its own, which never blocks the
//! writer or readers, at most once per [`CHECKPOINT_PAUSE`]: each checkpoint ends in an fsync
//! of the database file, and fewer, larger ones cost the kernel much less (checkpointing after
//! every commit took a fifth of the gateway's CPU in writeback).
//!
//! The writer keeps SQLite's automatic checkpoint at its default threshold
//! ([`WRITER_AUTOCHECKPOINT`]). A WAL only starts over from its beginning when a write finds
//! every frame already copied, and under sustained load this thread is always a few commits
//! behind; when the WAL reaches the threshold, the writer's own checkpoint copies the pages
//! left since this thread's last pass and the next write starts the WAL over.
//! `journal_size_limit` then trims the file. A higher threshold was tried: the writer's
//! catch-up checkpoints grew with it and so did the latency tail (ingest alone at 3,500
//! req/s: p99 29–60 ms at 10,000 pages against 11–15 ms at 1,000). Durability does not
//! change: a commit is durable once its WAL frames are fsynced, before anyone hears "done".

use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use hooklatch_core::StoreError;
use rusqlite::Connection;

/// WAL pages after which the writer checkpoints itself (SQLite's default).
pub(crate) const WRITER_AUTOCHECKPOINT: u32 = 1_000;
/// Least time between two background checkpoints.
const CHECKPOINT_PAUSE: Duration = Duration::from_millis(250);
/// Bytes the WAL file is trimmed to when it starts over (`journal_size_limit`).
pub(crate) const WAL_SIZE_LIMIT: i64 = 64 * 1024 * 1024;

#[derive(Default)]
struct Flags {
    /// A commit happened since the last checkpoint started.
    dirty: bool,
    /// The writer has stopped; the thread runs a last checkpoint and ends.
    closed: bool,
}

/// The writer's handle on the checkpointer thread.
pub(crate) struct Checkpointer {
    flags: Arc<(Mutex<Flags>, Condvar)>,
}

impl Checkpointer {
    /// Starts the thread with its own read-write connection on the database.
    pub(crate) fn start(conn: Connection) -> Result<Checkpointer, StoreError> {
        let flags = Arc::new((Mutex::new(Flags::default()), Condvar::new()));
        let shared = flags.clone();
        std::thread::Builder::new()
            .name("sqlite-checkpoint".to_owned())
            .spawn(move || run(&conn, &shared))
            .map_err(|e| StoreError::Unavailable(format!("starting sqlite checkpointer: {e}")))?;
        Ok(Checkpointer { flags })
    }

    /// Called by the writer after each commit: cheap, never waits on a checkpoint.
    pub(crate) fn committed(&self) {
        let (lock, wake) = &*self.flags;
        let mut flags = lock.lock().unwrap_or_else(|e| e.into_inner());
        if !flags.dirty {
            flags.dirty = true;
            wake.notify_one();
        }
    }
}

impl Drop for Checkpointer {
    fn drop(&mut self) {
        let (lock, wake) = &*self.flags;
        lock.lock().unwrap_or_else(|e| e.into_inner()).closed = true;
        wake.notify_one();
    }
}

fn run(conn: &Connection, flags: &(Mutex<Flags>, Condvar)) {
    let (lock, wake) = flags;
    loop {
        let closed = {
            let mut f = lock.lock().unwrap_or_else(|e| e.into_inner());
            while !f.dirty && !f.closed {
                f = wake.wait(f).unwrap_or_else(|e| e.into_inner());
            }
            f.dirty = false;
            f.closed
        };
        // PASSIVE copies what it can without waiting for anyone. A busy answer (the writer's
        // own checkpoint holds the lock) just means the pages get copied next time.
        if let Err(err) = conn.query_row("PRAGMA wal_checkpoint(PASSIVE)", [], |_| Ok(())) {
            tracing::debug!(%err, "sqlite: background checkpoint did not run");
        }
        if closed {
            return;
        }
        // Each checkpoint ends in an fsync of the database file, and the kernel's work for an
        // fsync grows with how often it is asked, not only with the pages written: run at most
        // a few per second, each copying what the WAL gathered meanwhile.
        let f = lock.lock().unwrap_or_else(|e| e.into_inner());
        if !f.closed {
            drop(wake.wait_timeout_while(f, CHECKPOINT_PAUSE, |f| !f.closed));
        }
    }
}

/// Settings for the writer's connection that go with a background checkpointer.
pub(crate) fn configure_writer(conn: &Connection) -> rusqlite::Result<()> {
    conn.pragma_update(None, "wal_autocheckpoint", WRITER_AUTOCHECKPOINT)?;
    conn.pragma_update(None, "journal_size_limit", WAL_SIZE_LIMIT)?;
    Ok(())
}
