//! One serving gateway per file, and the leases a gateway that died left behind.
//!
//! A SQLite file has one writer at a time, so one `hooklatch serve` per file is the supported
//! shape (several instances share PostgreSQL). [`ServingLock`] makes it a rule: `serve` takes
//! an exclusive advisory lock (`flock`) on a file beside the database, `{database}-serving`,
//! and a second `serve` on the same database refuses to start, naming the process that holds
//! it. The kernel drops the lock when its process ends, however it ends, so a gateway killed
//! with `kill -9` never leaves a stale lock behind.
//!
//! Holding the lock, the gateway knows every lease still running in the file is a dead
//! process's: a delivery it leased or was handed (the hand-off) and had not finished. Without
//! the lock those rows would wait for their lease to run out (twice the longest destination
//! timeout plus 10 s) before any worker could take them; [`crate::SqliteStore::open_serving`]
//! gives them back at once, so they are delivered as soon as the new gateway starts. The
//! attempt in flight when the process died may have reached the destination: delivering it
//! again is the at-least-once delivery every destination already sees on a retry, with the
//! same `Idempotency-Key`.
//!
//! The lock file lives beside the database rather than being the database itself: SQLite takes
//! its own POSIX locks on the database file, and on some network file systems `flock` is
//! emulated with those.

use std::fs::{File, OpenOptions, TryLockError};
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

use hooklatch_core::StoreError;

/// An exclusive lock on a database for one serving process, held until dropped.
#[derive(Debug)]
pub struct ServingLock {
    /// Open for as long as the lock is held; closing it releases the lock.
    _file: File,
}

/// The lock file of the database at `db`.
pub fn lock_path(db: &Path) -> PathBuf {
    let mut name = db.as_os_str().to_owned();
    name.push("-serving");
    PathBuf::from(name)
}

impl ServingLock {
    /// Who serves the database at `db` now, if anyone: `Some` with the holder's process id
    /// (empty if it wrote none). Changes nothing: the lock file is opened read-only, never
    /// created, and a lock it gets is let go at once.
    pub fn holder(db: &Path) -> Option<String> {
        let mut file = File::open(lock_path(db)).ok()?;
        match file.try_lock() {
            Ok(()) => {
                let _ = file.unlock();
                None
            }
            Err(TryLockError::WouldBlock) => {
                let mut holder = String::new();
                let _ = file.read_to_string(&mut holder);
                Some(holder.trim().to_owned())
            }
            Err(TryLockError::Error(_)) => None,
        }
    }

    /// Takes the lock for the database at `db` without waiting, and writes this process's id
    /// into the lock file. Fails with a message naming the holder's process id when another
    /// process holds it.
    pub fn take(db: &Path) -> Result<ServingLock, StoreError> {
        let path = lock_path(db);
        let mut file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)
            .map_err(|e| {
                StoreError::Unavailable(format!("opening the lock file {}: {e}", path.display()))
            })?;
        match file.try_lock() {
            Ok(()) => {}
            Err(TryLockError::WouldBlock) => {
                let mut holder = String::new();
                let _ = file.read_to_string(&mut holder);
                let holder = holder.trim();
                let who = if holder.is_empty() {
                    "another process".to_owned()
                } else {
                    format!("another process (pid {holder})")
                };
                return Err(StoreError::Unavailable(format!(
                    "{who} is serving the SQLite store {}: one `hooklatch serve` per SQLite \
                     file (it holds {}); run several instances on PostgreSQL",
                    db.display(),
                    path.display()
                )));
            }
            Err(TryLockError::Error(e)) => {
                return Err(StoreError::Unavailable(format!(
                    "locking {}: {e}",
                    path.display()
                )));
            }
        }
        // Only informative (the error above reads it): a failure to write it is not fatal.
        let _ = file
            .set_len(0)
            .and_then(|()| file.seek(SeekFrom::Start(0)))
            .and_then(|_| writeln!(file, "{}", std::process::id()))
            .and_then(|()| file.flush());
        Ok(ServingLock { _file: file })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_lock_file_sits_beside_the_database() {
        assert_eq!(
            lock_path(Path::new("/var/lib/hooklatch/hooklatch.db")),
            Path::new("/var/lib/hooklatch/hooklatch.db-serving")
        );
    }

    #[test]
    fn the_holder_is_named_while_the_lock_is_held_and_nothing_is_made() {
        let dir = tempfile::tempdir().unwrap();
        let db = dir.path().join("h.db");
        assert_eq!(ServingLock::holder(&db), None);
        assert!(!lock_path(&db).exists(), "asking made the lock file");
        let lock = ServingLock::take(&db).unwrap();
        assert_eq!(
            ServingLock::holder(&db),
            Some(std::process::id().to_string())
        );
        drop(lock);
        assert_eq!(ServingLock::holder(&db), None);
    }

    #[test]
    fn a_second_lock_on_the_same_database_is_refused_until_the_first_is_dropped() {
        let dir = tempfile::tempdir().unwrap();
        let db = dir.path().join("hooklatch.db");
        let first = ServingLock::take(&db).unwrap();
        // flock locks belong to an open file description: a second open in this very process
        // conflicts with the first as another process's would.
        let err = ServingLock::take(&db).unwrap_err().to_string();
        assert!(
            err.contains(&format!("pid {}", std::process::id())),
            "names the holder: {err}"
        );
        assert!(
            err.contains("one `hooklatch serve` per SQLite file"),
            "{err}"
        );
        drop(first);
        ServingLock::take(&db).expect("free again once the holder is gone");
    }
}
