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
//! leave most of the copying to the writer's own threshold ([`Pace`]): then the next pass
//! follows closely ([`rest_after`]). Under full load the passes run on the other core, and the
//! writer's own catch-up finds a few commits' worth of pages left instead of a whole WAL:
//! ingest alone at c=64 +3–5 % with the writer at 50 % of a core instead of 58 %, and the
//! open-loop p99 at 9,000 req/s a median of 6.9 ms over five runs against 9.6 ms (same
//! minutes; both builds had outliers, 64 and 38 ms). Resting the full pause after every pass,
//! as before that, left nearly every copy to the writer. At 500 req/s the thread rests the
//! full pause and the fsync count is unchanged.
//!
//! How closely depends on the commits' size. Every commit rewrites the last pages of the
//! in-order indexes and the file's first page. After group commits of many requests (about 90
//! WAL pages each at c=64) the next pass follows the next commit. After small ones (a single
//! request's commit is about 14 pages, most of them those) passes back to back copied the same
//! pages once per commit: at one request at a time the checkpointer took as much CPU as the
//! writer, 220 µs a commit. There the thread rests [`BUSY_PAUSE`] (5 ms) first, and a pass
//! copies them once for every commit since the last. Same minutes, against passes back to back
//! after every commit (BENCHMARKS.md): at c=1 while delivering +18 to +55 % (3 pairs; a rest
//! after every pass, whatever the commit's size, +14 to +83 %); at half load the gateway's CPU
//! per request −2 to −17 %; at c=64 alike (+9, +5, −7 %), where resting after big commits too
//! had cost a median of 8 % over 8 pairs.
//!
//! Starting the WAL over. A WAL only starts over from its beginning when a write begins with
//! every frame already copied, and under sustained load this thread is always a commit or two
//! behind the writer. SQLite's own answer is a checkpoint on the writer at 1,000 pages: the
//! commit that crossed the line copied what this thread had not yet, and fsynced the database
//! file, before its callers heard back (373 times in 12 s at 6,200 requests/s, each fsync
//! 1.2 ms at the median, 7 ms at worst). Now, once a pass saw the WAL past [`RESTART_PAGES`],
//! the writer, after answering its last batch, waits for a pass that saw that batch
//! ([`Checkpointer::before_write`]), and its next write starts the WAL over; the copy and the
//! fsync happen here, on the other core. SQLite's checkpoint on the writer stays as a
//! backstop at 4× ([`WRITER_AUTOCHECKPOINT`]), for a pass that cannot catch up (a reader on an
//! old snapshot) or a wait that runs out ([`RESTART_WAIT`]). `journal_size_limit` trims the
//! file. A much higher threshold alone was tried earlier: the writer's catch-up checkpoints
//! grew with it and so did the latency tail (ingest alone at 3,500 req/s: p99 29–60 ms at
//! 10,000 pages against 11–15 ms at 1,000). Durability does not change: a commit is durable
//! once its WAL frames are fsynced, before anyone hears "done".

use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use hooklatch_core::StoreError;
use rusqlite::Connection;

/// WAL pages from which the writer waits for a pass before its next write, so that the write
/// starts the WAL over ([`Checkpointer::before_write`]).
pub(crate) const RESTART_PAGES: i64 = 1_000;
/// WAL pages after which the writer checkpoints itself, as SQLite does by default at 1,000: a
/// backstop for when the passes cannot keep up or a reader keeps the WAL from starting over.
pub(crate) const WRITER_AUTOCHECKPOINT: u32 = 4_000;
/// The longest the writer waits for a pass before it writes on without starting the WAL over.
const RESTART_WAIT: Duration = Duration::from_millis(20);
/// Rest after a pass, unless commits come in fast (see [`Pace`]).
const CHECKPOINT_PAUSE: Duration = Duration::from_millis(250);
/// Rest after a pass while small commits come in fast ([`rest_after`]): short enough that the
/// WAL stays well under the writer's threshold between passes, long enough that a page every
/// commit rewrites (the last pages of the in-order indexes, the file's first page) is copied
/// once per pass rather than once per commit.
const BUSY_PAUSE: Duration = Duration::from_millis(5);
/// WAL pages per commit under which a commit counts as small: one request's commit writes
/// about 14, most of them pages the next commit rewrites; a group commit of 25 ingests, about
/// 90.
const SMALL_COMMIT_PAGES: i64 = 32;
/// Bytes the WAL file is trimmed to when it starts over (`journal_size_limit`).
pub(crate) const WAL_SIZE_LIMIT: i64 = 64 * 1024 * 1024;

struct Flags {
    /// Commits since the last pass started (any: the thread has work).
    commits: u64,
    /// The writer has stopped; the thread runs a last checkpoint and ends.
    closed: bool,
    /// The writer's commits so far.
    committed: u64,
    /// `committed` when the last finished pass started: that pass saw every commit up to it.
    passed: u64,
    /// The last finished pass copied every page in the WAL.
    caught_up: bool,
    /// WAL pages the last finished pass saw.
    wal_pages: i64,
    /// WAL pages from which the writer waits for a pass (see [`Checkpointer::before_write`]).
    restart_at: i64,
    /// The writer waits for a pass: the thread does not rest.
    wanted: bool,
}

impl Default for Flags {
    fn default() -> Flags {
        Flags {
            commits: 0,
            closed: false,
            committed: 0,
            passed: 0,
            caught_up: false,
            wal_pages: 0,
            restart_at: RESTART_PAGES,
            wanted: false,
        }
    }
}

struct Shared {
    flags: Mutex<Flags>,
    /// Wakes the thread: a commit, the writer waiting, the end.
    work: Condvar,
    /// Wakes the writer: a pass finished.
    passed: Condvar,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Flags> {
        self.flags.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// The writer's handle on the checkpointer thread.
pub(crate) struct Checkpointer {
    shared: Arc<Shared>,
}

impl Checkpointer {
    /// Starts the thread with its own read-write connection on the database.
    pub(crate) fn start(conn: Connection) -> Result<Checkpointer, StoreError> {
        let shared = Arc::new(Shared {
            flags: Mutex::new(Flags::default()),
            work: Condvar::new(),
            passed: Condvar::new(),
        });
        let thread = shared.clone();
        std::thread::Builder::new()
            .name("sqlite-checkpoint".to_owned())
            .spawn(move || run(&conn, &thread))
            .map_err(|e| StoreError::Unavailable(format!("starting sqlite checkpointer: {e}")))?;
        Ok(Checkpointer { shared })
    }

    /// Called by the writer after each commit: cheap, never waits on a checkpoint.
    pub(crate) fn committed(&self) {
        let mut flags = self.shared.lock();
        flags.commits += 1;
        flags.committed += 1;
        if flags.commits == 1 {
            self.shared.work.notify_one();
        }
    }

    /// Called by the writer before it begins a write: once the WAL holds [`RESTART_PAGES`],
    /// waits (at most [`RESTART_WAIT`]) for a pass that saw the writer's last commit. When that
    /// pass copied every page, the write begins on a WAL with nothing left to copy, and SQLite
    /// starts the WAL over from its beginning, without the writer copying or fsyncing anything.
    /// After a wait, the next one comes [`RESTART_PAGES`] later unless the WAL started over.
    /// Returns whether the WAL was due to start over (whether or not the writer had to wait).
    pub(crate) fn before_write(&self) -> bool {
        let mut flags = self.shared.lock();
        if !flags.caught_up || flags.wal_pages < flags.restart_at {
            return false;
        }
        let last_commit = flags.committed;
        if flags.passed < last_commit {
            let started = Instant::now();
            flags.wanted = true;
            self.shared.work.notify_one();
            flags = self
                .shared
                .passed
                .wait_timeout_while(flags, RESTART_WAIT, |f| f.passed < last_commit && !f.closed)
                .unwrap_or_else(|e| e.into_inner())
                .0;
            flags.wanted = false;
            metrics::histogram!("hooklatch_store_wal_restart_wait_seconds")
                .record(started.elapsed().as_secs_f64());
        }
        flags.restart_at = flags.wal_pages + RESTART_PAGES;
        true
    }
}

impl Drop for Checkpointer {
    fn drop(&mut self) {
        self.shared.lock().closed = true;
        self.shared.work.notify_one();
    }
}

fn run(conn: &Connection, shared: &Shared) {
    let wal: Option<PathBuf> = conn.path().map(|p| PathBuf::from(format!("{p}-wal")));
    let mut pace = Pace::new(Instant::now());
    loop {
        let (closed, commits, seen) = {
            let mut f = shared.lock();
            while f.commits == 0 && !f.closed {
                f = shared.work.wait(f).unwrap_or_else(|e| e.into_inner());
            }
            (f.closed, std::mem::take(&mut f.commits), f.committed)
        };
        let pass = checkpoint(conn, wal.as_deref());
        shared.lock().finished(seen, pass);
        shared.passed.notify_all();
        if closed {
            return;
        }
        let rest = pace.rest(Instant::now(), pass, commits);
        if rest.is_zero() {
            continue;
        }
        let f = shared.lock();
        if !f.closed && !f.wanted {
            drop(
                shared
                    .work
                    .wait_timeout_while(f, rest, |f| !f.closed && !f.wanted),
            );
        }
    }
}

impl Flags {
    /// Records a pass that started when the writer had made `seen` commits.
    fn finished(&mut self, seen: u64, pass: Option<Pass>) {
        self.passed = seen;
        match pass {
            Some(pass) => {
                if pass.log < self.wal_pages {
                    // The WAL started over since the last pass.
                    self.restart_at = RESTART_PAGES;
                }
                self.wal_pages = pass.log;
                self.caught_up = pass.checkpointed == pass.log;
            }
            None => self.caught_up = false,
        }
    }
}

/// How long the thread rests after a pass: the full [`CHECKPOINT_PAUSE`] unless [`Pace`] says
/// commits come in fast; then, if the pass found small commits (under [`SMALL_COMMIT_PAGES`]
/// WAL pages each on average), [`BUSY_PAUSE`], so that the pages every commit rewrites are
/// copied once for several commits; and none after big commits (group commits of many
/// requests), where the next pass follows the next commit and the writer's own catch-up stays
/// small. A pass that could not run or found the WAL started over (`appended` unknown) is
/// followed by the next commit.
fn rest_after(busy: bool, appended: Option<i64>, commits: u64) -> Duration {
    if !busy {
        return CHECKPOINT_PAUSE;
    }
    match appended {
        Some(pages) if commits > 0 && pages < SMALL_COMMIT_PAGES.saturating_mul(commits as i64) => {
            BUSY_PAUSE
        }
        _ => Duration::ZERO,
    }
}

/// Decides after each pass whether commits come in fast.
///
/// Busy for the next [`CHECKPOINT_PAUSE`] when in the last one commits added at least twice
/// the writer's own threshold ([`WRITER_AUTOCHECKPOINT`]) to the WAL, about 32 MB/s at 4 KiB
/// pages: resting the full pause, the thread would leave most of the copying to the writer.
/// Below that (a few hundred single-request commits a second) the writer's own checkpoints are
/// few and small, and frequent passes would double the fsyncs for little. A pass that could not
/// run (the writer's own checkpoint held the lock) or found the WAL started over and empty says
/// nothing of the pace.
#[derive(Debug)]
struct Pace {
    window_start: Instant,
    appended: i64,
    busy: bool,
    last: Option<Pass>,
    /// Pages the last pass found appended since the one before (`None`: it could not tell).
    last_appended: Option<i64>,
}

impl Pace {
    fn new(now: Instant) -> Pace {
        Pace {
            window_start: now,
            appended: 0,
            busy: false,
            last: None,
            last_appended: None,
        }
    }

    /// After a pass that covered `commits` commits: how long to rest ([`rest_after`]).
    fn rest(&mut self, now: Instant, pass: Option<Pass>, commits: u64) -> Duration {
        let busy = self.go_on(now, pass);
        rest_after(busy, self.last_appended, commits)
    }

    fn go_on(&mut self, now: Instant, pass: Option<Pass>) -> bool {
        self.last_appended = None;
        let Some(pass) = pass.filter(|p| p.log > 0) else {
            return true;
        };
        let appended = pass.appended_since(self.last);
        self.last_appended = Some(appended);
        self.appended += appended;
        self.last = Some(pass);
        if now.duration_since(self.window_start) >= CHECKPOINT_PAUSE {
            self.busy = self.appended >= 2 * RESTART_PAGES;
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
    /// Of them, copied into the database file.
    checkpointed: i64,
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
                writers * RESTART_PAGES + self.log
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
            checkpointed,
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
    use crate::recorded::Histograms;

    fn pass(log: i64, restarts: u32) -> Option<Pass> {
        Some(Pass {
            log,
            checkpointed: log,
            restarts: Some(restarts),
        })
    }

    #[test]
    fn small_commits_coming_fast_are_copied_together_and_big_ones_as_they_come() {
        use super::{rest_after, BUSY_PAUSE, CHECKPOINT_PAUSE};
        // One request a commit: ~14 pages each, most of them rewritten by the next commit.
        assert_eq!(rest_after(true, Some(14), 1), BUSY_PAUSE);
        assert_eq!(rest_after(true, Some(140), 10), BUSY_PAUSE);
        // Group commits of many requests: the next pass follows the next commit.
        assert_eq!(rest_after(true, Some(90), 1), Duration::ZERO);
        assert_eq!(rest_after(true, Some(400), 4), Duration::ZERO);
        // A pass that could not run, or found the WAL started over: no rest either.
        assert_eq!(rest_after(true, None, 3), Duration::ZERO);
        assert_eq!(rest_after(true, Some(20), 0), Duration::ZERO);
        // Slow commits: the full pause, whatever their size.
        assert_eq!(rest_after(false, Some(14), 1), CHECKPOINT_PAUSE);
        assert_eq!(rest_after(false, Some(900), 1), CHECKPOINT_PAUSE);
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
            checkpointed: log,
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
    fn the_rest_follows_the_pages_each_pass_found_per_commit() {
        use super::{BUSY_PAUSE, CHECKPOINT_PAUSE};
        let t0 = Instant::now();
        let at = |ms: u64| t0 + Duration::from_millis(ms);
        let mut pace = Pace::new(t0);
        assert_eq!(pace.rest(at(1), pass(10, 1), 1), CHECKPOINT_PAUSE);
        // A fast window: 4 restarts at the writer's threshold and 600 more, 4,600 pages from
        // 200 commits.
        assert_eq!(
            pace.rest(at(260), pass(600, 6), 200),
            BUSY_PAUSE,
            "small commits"
        );
        // 700 − 600 = 100 pages from one commit: a group commit; then 300 from 20 commits.
        assert_eq!(pace.rest(at(270), pass(700, 6), 1), Duration::ZERO);
        assert_eq!(pace.rest(at(280), pass(1_000, 6), 20), BUSY_PAUSE);
        // A pass that could not run: nothing known of the commits' size.
        assert_eq!(pace.rest(at(290), None, 5), Duration::ZERO);
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

    /// A database in WAL mode with a writer set up as the store's, its checkpointer, and a
    /// way to commit `rows` pages' worth of rows as the writer thread does.
    struct Wal {
        dir: tempfile::TempDir,
        writer: rusqlite::Connection,
        checkpointer: super::Checkpointer,
    }

    impl Wal {
        fn new() -> Wal {
            let dir = tempfile::tempdir().expect("tempdir");
            let writer = Wal::open(&dir);
            super::configure_writer(&writer).expect("writer settings");
            writer
                .execute_batch("CREATE TABLE t (v BLOB)")
                .expect("table");
            let checkpointer = super::Checkpointer::start(Wal::open(&dir)).expect("checkpointer");
            checkpointer.committed();
            Wal {
                dir,
                writer,
                checkpointer,
            }
        }

        fn open(dir: &tempfile::TempDir) -> rusqlite::Connection {
            let conn = rusqlite::Connection::open(dir.path().join("t.db")).expect("open");
            conn.pragma_update(None, "journal_mode", "wal")
                .expect("wal");
            conn.pragma_update(None, "synchronous", "FULL")
                .expect("full");
            conn
        }

        /// `before_write`, then a commit of `rows` rows of about a page each; whether the WAL
        /// was due to start over.
        fn commit(&self, rows: u32) -> bool {
            let due = self.checkpointer.before_write();
            self.writer
                .execute_batch(&format!(
                    "BEGIN; INSERT INTO t SELECT zeroblob(3000) FROM \
                     (WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < {rows}) \
                     SELECT i FROM n); COMMIT;"
                ))
                .expect("a commit");
            self.checkpointer.committed();
            due
        }

        /// A one-row commit that the checkpointer hears of, without `before_write` first.
        fn commit_one(&self) {
            self.writer
                .execute("INSERT INTO t VALUES (x'00')", [])
                .expect("a commit");
            self.checkpointer.committed();
        }

        /// A new database with 1,200 pages in its WAL from twelve commits (well under the
        /// writer's own threshold of 4,000), once a pass saw them all and copied them.
        fn past_restart_pages() -> Wal {
            let wal = Wal::new();
            for _ in 0..12 {
                wal.commit(100);
            }
            wal.until_a_pass_caught_up();
            wal
        }

        /// Waits until a pass saw the WAL at [`super::RESTART_PAGES`] or more and copied it all.
        fn until_a_pass_caught_up(&self) {
            let seen = |f: &super::Flags| f.wal_pages >= super::RESTART_PAGES && f.caught_up;
            let until = Instant::now() + Duration::from_secs(10);
            while !seen(&self.checkpointer.shared.lock()) {
                assert!(Instant::now() < until, "no pass caught up past 1,000 pages");
                std::thread::sleep(Duration::from_millis(5));
            }
        }

        fn restarts(&self) -> u32 {
            super::wal_restarts(&self.dir.path().join("t.db-wal")).expect("a WAL header")
        }
    }

    /// The writer's wait: once a pass saw the WAL past [`super::RESTART_PAGES`], the write
    /// after the next commit waits for a pass that copied that commit too, and so starts the
    /// WAL over, long before SQLite's own checkpoint on the writer would (its threshold is 4×).
    #[test]
    fn the_write_after_a_caught_up_pass_starts_the_wal_over_without_the_writer_checkpointing() {
        let wal = Wal::past_restart_pages();
        // One more commit, which no pass has copied yet; the write after it waits for one.
        wal.commit_one();
        let before = wal.restarts();
        let waits = Histograms::default();
        assert!(
            metrics::with_local_recorder(&waits, || wal.checkpointer.before_write()),
            "the WAL is due to start over"
        );
        // The wait is in the metric operators read.
        let recorded = waits.of("hooklatch_store_wal_restart_wait_seconds");
        assert!(
            recorded.len() == 1 && recorded[0] > 0.0,
            "one wait recorded: {recorded:?}"
        );
        // The wait is bounded (RESTART_WAIT); on a loaded machine the pass may finish after
        // it, and the write would then start the WAL over one write later. Wait for the pass
        // here, so the write below is the one after a pass that copied everything.
        let until = Instant::now() + Duration::from_secs(10);
        loop {
            let flags = wal.checkpointer.shared.lock();
            if flags.passed >= flags.committed {
                break;
            }
            drop(flags);
            assert!(Instant::now() < until, "no pass copied the last commit");
            std::thread::sleep(Duration::from_millis(5));
        }
        wal.writer
            .execute("INSERT INTO t VALUES (x'00')", [])
            .expect("a write");
        assert_eq!(
            wal.restarts(),
            before.wrapping_add(1),
            "the write started the WAL over"
        );
        let pages: i64 = wal
            .writer
            .query_row("PRAGMA wal_checkpoint(PASSIVE)", [], |r| r.get(1))
            .expect("pages in the WAL");
        assert!(pages < 10, "{pages} pages in the WAL after it started over");
    }

    /// A reader on an old snapshot keeps the passes from catching up: the writer does not wait
    /// before every write meanwhile, and the WAL starts over once the reader is done.
    #[test]
    fn a_reader_holding_a_snapshot_does_not_make_every_write_wait() {
        let wal = Wal::past_restart_pages();
        // A read that begins right after a commit no pass has copied yet: its snapshot ends
        // there, and no later page can be copied while it lasts.
        let reader = Wal::open(&wal.dir);
        wal.commit_one();
        reader
            .execute_batch("BEGIN; SELECT count(*) FROM t;")
            .expect("a read transaction");
        // 3,000 pages over about half a second, long enough for passes to see the WAL grow.
        let due = (0..30)
            .filter(|_| {
                let due = wal.commit(100);
                std::thread::sleep(Duration::from_millis(15));
                due
            })
            .count();
        assert!(due <= 4, "due to start over at {due} of 30 writes");
        reader.execute_batch("COMMIT").expect("the read ends");
        let before = wal.restarts();
        let until = Instant::now() + Duration::from_secs(10);
        while wal.restarts() == before {
            assert!(Instant::now() < until, "the WAL never started over");
            wal.commit(1);
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}
