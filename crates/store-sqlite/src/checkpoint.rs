//! The checkpointer thread: copies committed WAL pages into the database file beside the
//! writer, not inside it.
//!
//! Left to itself, SQLite checkpoints on the committing connection: once the WAL passes 1,000
//! pages, the commit that crossed the line also copies every page back into the database file
//! and fsyncs it, while the group commit's callers wait (10 % of the gateway's time at full
//! load, all of it on the one writer thread). Here the writer wakes this thread after each
//! commit and it runs a `PASSIVE` checkpoint on a connection of its own, which never blocks the
//! writer or readers.
//!
//! How often: each checkpoint ends in an fsync of the database file, and the kernel's work for
//! an fsync grows with how often it is asked, not only with the pages written (checkpointing
//! after every commit at low load took a fifth of the gateway's CPU in writeback). So after a
//! pass the thread rests [`CHECKPOINT_PAUSE`], unless commits come in so fast that a rest would
//! leave most of the copying to the writer's own threshold ([`Pace`]): then it goes again as
//! soon as the next commit lands. Under full load the passes then run back to back on the
//! other core (a quarter of it), and the writer's own catch-up finds a few commits' worth of
//! pages left instead of a whole WAL: ingest alone at c=64 +3–5 % with the writer at 50 % of
//! a core instead of 58 %, and the open-loop p99 at 9,000 req/s a median of 6.9 ms over five
//! runs against 9.6 ms (same minutes; both builds had outliers, 64 and 38 ms). Resting after
//! every pass, as before, left nearly every copy to the writer.
//! At 500 req/s the thread rests as before and the fsync count is unchanged.
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

use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use hooklatch_core::StoreError;
use rusqlite::Connection;

/// WAL pages after which the writer checkpoints itself (SQLite's default).
pub(crate) const WRITER_AUTOCHECKPOINT: u32 = 1_000;
/// Rest after a pass, unless commits come in fast (see [`busy`]).
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
    let wal: Option<PathBuf> = conn.path().map(|p| PathBuf::from(format!("{p}-wal")));
    let mut pace = Pace::new(Instant::now());
    loop {
        let closed = {
            let mut f = lock.lock().unwrap_or_else(|e| e.into_inner());
            while !f.dirty && !f.closed {
                f = wake.wait(f).unwrap_or_else(|e| e.into_inner());
            }
            f.dirty = false;
            f.closed
        };
        let pass = checkpoint(conn, wal.as_deref());
        if closed {
            return;
        }
        if pace.go_on(Instant::now(), pass) {
            continue;
        }
        let f = lock.lock().unwrap_or_else(|e| e.into_inner());
        if !f.closed {
            drop(wake.wait_timeout_while(f, CHECKPOINT_PAUSE, |f| !f.closed));
        }
    }
}

/// Decides after each pass whether the next one follows without a rest.
///
/// Busy — no rests — for the next [`CHECKPOINT_PAUSE`] when in the last one commits added at
/// least twice the writer's own threshold ([`WRITER_AUTOCHECKPOINT`]) to the WAL, about 32 MB/s
/// at 4 KiB pages: resting, the thread would leave most of the copying to the writer. Below
/// that (a few hundred single-request commits a second) the writer's own checkpoints are few
/// and small, and passes after every commit would double the fsyncs for little. A pass that
/// could not run (the writer's own checkpoint held the lock) or found the WAL started over and
/// empty says nothing of the pace: the next pass follows the next commit.
#[derive(Debug)]
struct Pace {
    window_start: Instant,
    appended: i64,
    busy: bool,
    last: Option<Pass>,
}

impl Pace {
    fn new(now: Instant) -> Pace {
        Pace {
            window_start: now,
            appended: 0,
            busy: false,
            last: None,
        }
    }

    fn go_on(&mut self, now: Instant, pass: Option<Pass>) -> bool {
        let Some(pass) = pass.filter(|p| p.log > 0) else {
            return true;
        };
        self.appended += pass.appended_since(self.last);
        self.last = Some(pass);
        if now.duration_since(self.window_start) >= CHECKPOINT_PAUSE {
            self.busy = self.appended >= 2 * i64::from(WRITER_AUTOCHECKPOINT);
            self.window_start = now;
            self.appended = 0;
        }
        self.busy
    }
}

/// What a pass saw: the pages in the WAL (as the `PASSIVE` checkpoint reported them), and how
/// many times the WAL had started over (its header's checkpoint sequence number).
#[derive(Debug, Clone, Copy, PartialEq)]
struct Pass {
    log: i64,
    restarts: Option<u32>,
}

impl Pass {
    /// Pages committed to the WAL since the pass before.
    ///
    /// The WAL starts over at the first commit after every page in it was copied: after the
    /// writer's own checkpoint at its threshold, or after a pass of this thread that caught
    /// up. Of `k` restarts since the last pass, the first may be this thread's (little was
    /// committed before it), the others the writer's (its threshold each).
    fn appended_since(self, last: Option<Pass>) -> i64 {
        let Some(last) = last else {
            return self.log;
        };
        match (self.restarts, last.restarts) {
            (Some(now), Some(then)) if now == then => (self.log - last.log).max(0),
            (Some(now), Some(then)) => {
                let writers = i64::from(now.wrapping_sub(then)) - 1;
                writers * i64::from(WRITER_AUTOCHECKPOINT) + self.log
            }
            // The header could not be read: a WAL holding fewer pages than before started over.
            _ if self.log >= last.log => self.log - last.log,
            _ => self.log,
        }
    }
}

/// The WAL's checkpoint sequence number: bytes 12..16 of its header, big-endian, one up at
/// every restart (SQLite's file format, "WAL file format").
fn wal_restarts(wal: &Path) -> Option<u32> {
    let mut header = [0u8; 16];
    let mut file = std::fs::File::open(wal).ok()?;
    file.read_exact(&mut header).ok()?;
    Some(u32::from_be_bytes([
        header[12], header[13], header[14], header[15],
    ]))
}

/// One `PASSIVE` checkpoint: copies what it can without waiting for anyone. `None` when it
/// could not run (the writer's own checkpoint holds the lock); the pages get copied next time.
fn checkpoint(conn: &Connection, wal: Option<&Path>) -> Option<Pass> {
    let res = conn.query_row("PRAGMA wal_checkpoint(PASSIVE)", [], |r| {
        Ok((
            r.get::<_, i64>(0)?,
            r.get::<_, i64>(1)?,
            r.get::<_, i64>(2)?,
        ))
    });
    match res {
        Ok((0, log, checkpointed)) if log >= 0 && checkpointed >= 0 => Some(Pass {
            log,
            restarts: wal.and_then(wal_restarts),
        }),
        Ok(_) => None,
        Err(err) => {
            tracing::debug!(%err, "sqlite: background checkpoint did not run");
            None
        }
    }
}

/// Settings for the writer's connection that go with a background checkpointer.
pub(crate) fn configure_writer(conn: &Connection) -> rusqlite::Result<()> {
    conn.pragma_update(None, "wal_autocheckpoint", WRITER_AUTOCHECKPOINT)?;
    conn.pragma_update(None, "journal_size_limit", WAL_SIZE_LIMIT)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use super::{Pace, Pass};

    fn pass(log: i64, restarts: u32) -> Option<Pass> {
        Some(Pass {
            log,
            restarts: Some(restarts),
        })
    }

    #[test]
    fn a_pass_counts_the_pages_committed_since_the_last_one() {
        let first = pass(400, 7).unwrap();
        assert_eq!(first.appended_since(None), 400);
        let grown = pass(900, 7).unwrap();
        assert_eq!(grown.appended_since(Some(first)), 500);
        // Started over once: after a pass that caught up, little came before it.
        let once = pass(300, 8).unwrap();
        assert_eq!(once.appended_since(Some(grown)), 300);
        // Three times: twice at the writer's threshold of 1,000 pages.
        let thrice = pass(300, 11).unwrap();
        assert_eq!(thrice.appended_since(Some(once)), 2_000 + 300);
        // No header: a WAL holding fewer pages than before started over.
        let blind = |log| Pass {
            log,
            restarts: None,
        };
        assert_eq!(blind(100).appended_since(Some(blind(900))), 100);
        assert_eq!(blind(950).appended_since(Some(blind(900))), 50);
    }

    #[test]
    fn the_checkpointer_rests_at_a_slow_pace_and_goes_on_at_a_fast_one() {
        let t0 = Instant::now();
        let at = |ms: u64| t0 + Duration::from_millis(ms);
        let mut pace = Pace::new(t0);
        // Single-request commits, a few hundred a second: each rest adds under 1,000 pages
        // and the pass after it catches up, so the next commit starts the WAL over.
        assert!(!pace.go_on(at(1), pass(10, 1)));
        assert!(!pace.go_on(at(260), pass(900, 2)));
        assert!(!pace.go_on(at(520), pass(800, 3)));
        // Group commits at full load: the WAL started over 5 times in the rest, 4 of them at
        // the writer's threshold.
        assert!(pace.go_on(at(780), pass(600, 8)), "4 × 1,000 + 600 pages");
        // While busy, each pass catches up and the next commit starts the WAL over.
        assert!(pace.go_on(at(790), pass(700, 9)));
        assert!(pace.go_on(at(800), pass(650, 10)));
        assert!(
            pace.go_on(at(1_031), pass(700, 11)),
            "2,050 pages in the window"
        );
        // The load falls: a window with little committed rests.
        assert!(!pace.go_on(at(1_290), pass(60, 12)));
    }

    #[test]
    fn a_pass_that_could_not_run_or_found_nothing_says_nothing_of_the_pace() {
        let t0 = Instant::now();
        let mut pace = Pace::new(t0);
        assert!(!pace.go_on(t0 + Duration::from_millis(1), pass(300, 1)));
        assert!(pace.go_on(t0 + Duration::from_millis(300), None));
        assert!(pace.go_on(t0 + Duration::from_millis(301), pass(0, 2)));
        assert!(!pace.go_on(t0 + Duration::from_millis(302), pass(310, 2)));
    }

    /// The header read is the one SQLite writes: a real WAL's sequence number moves by one
    /// when the WAL starts over.
    #[test]
    fn the_restart_count_is_read_from_a_real_wal() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("t.db");
        let conn = rusqlite::Connection::open(&path).expect("open");
        conn.pragma_update(None, "journal_mode", "wal")
            .expect("wal");
        conn.pragma_update(None, "wal_autocheckpoint", 0)
            .expect("no autocheckpoint");
        conn.execute_batch("CREATE TABLE t (v); INSERT INTO t VALUES (1);")
            .expect("writes");
        let wal = dir.path().join("t.db-wal");
        let before = super::wal_restarts(&wal).expect("a WAL header");
        conn.query_row("PRAGMA wal_checkpoint(PASSIVE)", [], |_| Ok(()))
            .expect("checkpoint");
        conn.execute("INSERT INTO t VALUES (2)", [])
            .expect("a write");
        assert_eq!(super::wal_restarts(&wal), Some(before.wrapping_add(1)));
    }
}
